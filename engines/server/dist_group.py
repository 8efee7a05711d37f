"""The torch.distributed group that carries weights from the trainer (rank 0) to rollout servers.

What it owns: joining a process group of its own, beside any default group the process has
(the trainer's data-parallel group, a server's tensor-parallel group), the way sglang's
``init_custom_process_group`` does for ``/init_weights_update_group``: a TCP rendezvous hosted
by rank 0 at ``master_address:master_port``, a ``PrefixStore`` named after the group, and a
process group built by torch's own helper, so both ends agree on the keys they exchange; and
broadcasting one tensor from rank 0 in it.

Invariants: every member calls :func:`broadcast` for the same tensors in the same order (the
group has no message boundaries); gloo for CPU tensors, NCCL for CUDA ones.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world, rendezvous

__all__ = ["broadcast", "destroy_weight_group", "init_weight_group"]


def init_weight_group(
    backend: str, master_address: str, master_port: int, rank: int, world_size: int, group_name: str, timeout_s: float,
    *, connect_timeout_s: float | None = None,
) -> dist.ProcessGroup:
    """Join group ``group_name``; returns once all ``world_size`` members have joined. A member
    (rank > 0) gives the rendezvous ``connect_timeout_s`` (default ``timeout_s``) to answer;
    rank 0 hosts it and waits ``timeout_s`` for the others."""
    timeout = timedelta(seconds=timeout_s)
    connect = timedelta(seconds=connect_timeout_s if connect_timeout_s is not None and rank > 0 else timeout_s)
    store, rank, world_size = next(rendezvous(f"tcp://{master_address}:{master_port}", rank, world_size, timeout=connect))
    store.set_timeout(timeout)
    group, _ = _new_process_group_helper(
        world_size, rank, [], Backend(backend), PrefixStore(group_name, store), group_name=group_name, timeout=timeout
    )
    _world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


def broadcast(group: dist.ProcessGroup, tensor: torch.Tensor) -> None:
    """Broadcast ``tensor`` (contiguous) from rank 0 of ``group``; every member passes a tensor
    of the same dtype and shape, which holds rank 0's bytes afterwards."""
    options = dist.BroadcastOptions()
    options.rootRank = 0
    group.broadcast([tensor], options).wait()


def destroy_weight_group(group: dist.ProcessGroup) -> None:
    dist.destroy_process_group(group)
