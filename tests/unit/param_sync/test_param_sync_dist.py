"""torch.distributed (gloo) transport: rank 0 trains and broadcasts, rank 1 serves."""

from __future__ import annotations

from pathlib import Path

import torch.multiprocessing as tmp
from param_sync_models import dist_worker


def test_gloo_broadcast_survives_broken_transfers_and_ends_bit_identical(tmp_path: Path) -> None:
    # Each rank asserts its side (see dist_worker); spawn re-raises a failure of either here.
    # The rollout rank loads in pause mode (the shared-memory tests cover swap).
    tmp.spawn(dist_worker, args=(str(tmp_path / "rendezvous"), "pause"), nprocs=2, join=True)
