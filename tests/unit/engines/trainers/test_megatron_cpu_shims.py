"""megatron-core's CPU shims and its per-process parallel state: in force exactly inside ``model_parallel`` on CPU, then gone.

That a ``GPTModel`` really runs forward and backward under them is ``test_megatron_model.py``'s
subject; here: scope, idempotence, restoration, and what each replacement does.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

pytest.importorskip("megatron.core", reason="megatron-core is an optional extra: pip install tandem[megatron]")

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.tensor_parallel import get_cuda_rng_tracker
from megatron.core.tensor_parallel import random as megatron_random

from tandem.engines.trainers.megatron.cpu_shims import CpuMemoryBuffer, CpuRNGStatesTracker, cpu_shims, shims_active
from tandem.engines.trainers.megatron.parallel import model_parallel

CPU = torch.device("cpu")


@contextmanager
def world_of_one(tmp_path: Path, name: str = "rendezvous", seed: int = 0) -> Iterator[None]:
    with model_parallel(
        rank=0, world_size=1, init_method=f"file://{tmp_path / name}", tensor_parallel_size=1, seed=seed, device=CPU
    ):
        yield


def test_shims_are_in_force_inside_model_parallel_and_restored_after(tmp_path: Path) -> None:
    get_emb = RotaryEmbedding.get_emb
    tracker = megatron_random._CUDA_RNG_STATE_TRACKER
    with world_of_one(tmp_path):
        assert shims_active()
        assert isinstance(parallel_state.get_global_memory_buffer(), CpuMemoryBuffer)
        assert isinstance(get_cuda_rng_tracker(), CpuRNGStatesTracker)
        assert RotaryEmbedding.get_emb is not get_emb
    assert not shims_active()
    assert RotaryEmbedding.get_emb is get_emb
    assert megatron_random._CUDA_RNG_STATE_TRACKER is tracker
    assert not parallel_state.model_parallel_is_initialized()
    assert not dist.is_initialized()


def test_entering_the_shims_again_changes_nothing(tmp_path: Path) -> None:
    with world_of_one(tmp_path):
        buffer, tracker = parallel_state.get_global_memory_buffer(), get_cuda_rng_tracker()
        with cpu_shims(seed=5):
            assert parallel_state.get_global_memory_buffer() is buffer
            assert get_cuda_rng_tracker() is tracker
        assert shims_active()
        assert parallel_state.get_global_memory_buffer() is buffer
        assert get_cuda_rng_tracker() is tracker


def test_the_shims_need_megatrons_parallel_state() -> None:
    with pytest.raises(RuntimeError, match="initialize_model_parallel"), cpu_shims(seed=0):
        pass


def test_a_second_world_in_the_same_process_is_refused(tmp_path: Path) -> None:
    with world_of_one(tmp_path), pytest.raises(RuntimeError, match="already initialised"), world_of_one(tmp_path, "other"):
        pass


def test_a_process_can_set_up_again_after_tearing_down(tmp_path: Path) -> None:
    with world_of_one(tmp_path, "first"):
        pass
    with world_of_one(tmp_path, "second"):
        assert parallel_state.get_tensor_model_parallel_world_size() == 1


def test_fork_draws_from_the_named_stream_and_resumes_the_interrupted_one() -> None:
    tracker = CpuRNGStatesTracker()
    tracker.add("stream", 7)
    torch.manual_seed(0)
    outer = torch.rand(6)
    torch.manual_seed(0)
    before = torch.rand(3)
    with tracker.fork("stream"):
        first = torch.rand(2)
    after = torch.rand(3)
    with tracker.fork("stream"):
        second = torch.rand(2)
    assert torch.equal(torch.cat([before, after]), outer)
    assert torch.equal(torch.cat([first, second]), torch.rand(4, generator=torch.Generator().manual_seed(7)))


def test_dropout_in_the_tensor_parallel_stream_follows_the_seed(tmp_path: Path) -> None:
    sessions = itertools.count()

    def masks(seed: int) -> torch.Tensor:
        with world_of_one(tmp_path, f"session{next(sessions)}", seed=seed):
            torch.manual_seed(123)  # the default stream is the same every time: only the seed may differ
            with get_cuda_rng_tracker().fork():
                return torch.nn.functional.dropout(torch.ones(64), p=0.5)

    assert torch.equal(masks(3), masks(3))
    assert not torch.equal(masks(3), masks(4))


def test_memory_buffer_allocates_on_cpu_and_reuses_by_name() -> None:
    buffer = CpuMemoryBuffer()
    big = buffer.get_tensor((4, 3), torch.float32, "mpu")
    small = buffer.get_tensor((2, 2), torch.float32, "mpu")
    other = buffer.get_tensor((2, 2), torch.float32, "other")
    assert big.device.type == "cpu" and big.shape == (4, 3) and small.shape == (2, 2)
    assert small.data_ptr() == big.data_ptr()
    assert other.data_ptr() != big.data_ptr()
    assert buffer.get_tensor((5, 3), torch.float32, "mpu").shape == (5, 3)
