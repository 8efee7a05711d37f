"""The public API of ``param_sync`` is what the ``__all__`` lists say: no more, no less."""

from __future__ import annotations

import tandem.param_sync
from tandem.param_sync import bucket, buffer, errors, feed, module, protocols, receiver, syncer, synthetic, transports
from tandem.param_sync.transports import dist, inprocess, messages, shm

MODULES = (bucket, buffer, errors, feed, module, protocols, receiver, synthetic, syncer, dist, inprocess, messages, shm)


def test_every_exported_name_exists_once() -> None:
    for namespace in (tandem.param_sync, transports, *MODULES):
        assert len(namespace.__all__) == len(set(namespace.__all__)), namespace.__name__
        for name in namespace.__all__:
            assert hasattr(namespace, name), f"{namespace.__name__}.{name}"


def test_every_public_definition_is_exported_by_its_module() -> None:
    for namespace in MODULES:
        for name, obj in vars(namespace).items():
            if not name.startswith("_") and getattr(obj, "__module__", None) == namespace.__name__:
                assert name in namespace.__all__, f"{namespace.__name__}.{name}"


def test_the_package_exports_the_protocols_adapters_syncer_and_transports() -> None:
    exported = set(tandem.param_sync.__all__)
    for namespace in (errors, module, protocols, receiver, syncer, transports):
        assert set(namespace.__all__) <= exported, namespace.__name__
