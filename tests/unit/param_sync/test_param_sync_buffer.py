"""The dual buffer: write the inactive half, publish it with its version, never go back."""

from __future__ import annotations

import numpy as np
import pytest

from tandem.param_sync import BufferHalf, DualBuffer, StaleVersionError
from tandem.param_sync.buffer import host_half


def test_publish_flips_halves_and_tags_the_version() -> None:
    buffer = DualBuffer((host_half(8), host_half(8)))
    assert buffer.version is None and buffer.nbytes == 8
    first = buffer.inactive(1)
    first.array[:] = 1
    buffer.publish(1)
    assert buffer.active is first and first.version == 1
    second = buffer.inactive(2)
    assert second is not first  # version 2 never overwrites the half holding version 1
    buffer.publish(2)
    assert buffer.active is second and buffer.version == 2 and first.version == 1


def test_older_versions_are_rejected_equal_ones_accepted() -> None:
    buffer = DualBuffer((host_half(4), host_half(4)))
    buffer.inactive(5)
    buffer.publish(5)
    with pytest.raises(StaleVersionError):
        buffer.inactive(4)
    with pytest.raises(StaleVersionError):
        buffer.publish(4)
    assert buffer.version == 5
    buffer.inactive(5)  # re-sending the version held is allowed (a retry)
    buffer.publish(5)


def test_a_carried_over_version_still_guards_a_new_buffer() -> None:
    buffer = DualBuffer((host_half(4), host_half(4)), version=7)
    with pytest.raises(StaleVersionError):
        buffer.inactive(6)


def test_close_drops_views_then_releases_each_half() -> None:
    released: list[int] = []
    halves = tuple(BufferHalf(np.zeros(4, np.uint8), release=lambda i=i: released.append(i)) for i in range(2))
    buffer = DualBuffer(halves)  # type: ignore[arg-type]
    buffer.close()
    assert released == [0, 1] and all(h.array.size == 0 for h in halves)


def test_halves_must_match_in_size() -> None:
    with pytest.raises(ValueError):
        DualBuffer((host_half(4), host_half(5)))
