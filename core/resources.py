"""Resource pools: which device slots each role's engines hold, and which roles share devices.

A *slot* is one device of the cluster: a GPU where it has GPUs, else one CPU. ``cluster``
config places roles on slots either explicitly (``device_mapping``, ROLL style) or by fractions
of the cluster (``use_nodes_ratios``); :func:`plan_resources` turns that into a
:class:`ResourcePlan` once the cluster's size is known, and the Ray backend realises the plan as
one placement group with a bundle per used slot.

Invariants:
- every pooled role in the flow holds at least one slot, and every slot index is on the cluster;
- ``ref_logp`` without a pool of its own shares train's slots;
- roles that share a slot are colocated: :func:`colocated_groups` puts them under one lock, so
  they take turns (the hybrid engine, synchronous by nature); roles on disjoint slots overlap.
  In-process (``backend: local``) only ``flow.colocate`` says who shares.

Imports neither torch nor ray: the plan is pure and checked before anything starts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from tandem.core.config import ClusterConfig, ConfigError, TandemConfig

__all__ = ["ActorPlacement", "ResourcePlan", "colocated_groups", "plan_resources", "role_slots"]

DeviceKind = Literal["CPU", "GPU"]
DEFAULT_RATIOS = {"train": 0.5, "generate": 0.5}
# use_nodes_ratios hands out disjoint ranges in this order.
_RATIO_ORDER = ("train", "ref_logp", "generate")


@dataclass(slots=True, frozen=True)
class ActorPlacement:
    """One actor: its role, its name, the slot whose bundle it sits in, the share of that
    bundle it reserves, and the slots it computes with (CPU: its thread budget)."""

    role: str
    name: str
    slot: int
    share: float
    slots: tuple[int, ...]


@dataclass(slots=True, frozen=True)
class ResourcePlan:
    """Slots per pooled role on a cluster of ``total_slots`` devices of kind ``device``."""

    device: DeviceKind
    total_slots: int
    roles: dict[str, tuple[int, ...]]

    @property
    def used_slots(self) -> list[int]:
        """Every slot some role holds, ascending: one placement-group bundle each."""
        return sorted({s for slots in self.roles.values() for s in slots})

    def actors(self) -> list[ActorPlacement]:
        """generate: one actor per slot; train and ref_logp: one actor over all their slots.
        Actors sharing a slot split its bundle evenly."""
        placed: list[tuple[str, str, int, tuple[int, ...]]] = []
        for role, slots in self.roles.items():
            if role == "generate":
                placed += [(role, f"rollout-{i}", slot, (slot,)) for i, slot in enumerate(slots)]
            else:
                placed.append((role, role, slots[0], slots))
        per_slot = {s: sum(1 for _, _, slot, _ in placed if slot == s) for s in self.used_slots}
        return [ActorPlacement(role, name, slot, 1.0 / per_slot[slot], slots) for role, name, slot, slots in placed]


def role_slots(cluster: ClusterConfig, stages: list[str], total_slots: int | None) -> dict[str, tuple[int, ...]]:
    """The slots of each pooled role in ``stages``. ``total_slots`` may be None only for an
    explicit ``device_mapping`` (then the indices are checked against the cluster later)."""
    pooled = [r for r in ("generate", "train", "ref_logp") if r in stages or r == "train"]
    if cluster.device_mapping is not None:
        roles = {r: tuple(cluster.device_mapping[r]) for r in pooled if r in cluster.device_mapping}
        if total_slots is not None:
            for role, slots in roles.items():
                if max(slots) >= total_slots:
                    raise ConfigError(
                        f"cluster.device_mapping.{role} names slot {max(slots)}, but the cluster has "
                        f"{total_slots} slots (0..{total_slots - 1})"
                    )
    else:
        ratios = cluster.use_nodes_ratios or DEFAULT_RATIOS
        if total_slots is None:
            raise ValueError("use_nodes_ratios needs the cluster's slot count")
        roles, start = {}, 0
        for role in (r for r in _RATIO_ORDER if r in pooled and r in ratios):
            count = max(1, round(ratios[role] * total_slots))
            if start + count > total_slots:
                raise ConfigError(
                    f"cluster.use_nodes_ratios {dict(ratios)}: {role} would need slots {start}..{start + count - 1} "
                    f"of a {total_slots}-slot cluster"
                )
            roles[role], start = tuple(range(start, start + count)), start + count
    if "ref_logp" in pooled and "ref_logp" not in roles:
        roles["ref_logp"] = roles["train"]
    return roles


def plan_resources(config: TandemConfig, total_slots: int, device: DeviceKind) -> ResourcePlan:
    """The plan for ``config`` on a cluster with ``total_slots`` devices of kind ``device``."""
    if total_slots < 1:
        raise ConfigError(f"the Ray cluster offers no {device} to place the engines on")
    roles = role_slots(config.cluster, config.flow.stages, total_slots)
    if device == "GPU":
        wide = [r for r, slots in roles.items() if r != "generate" and len(slots) > 1]
        if wide:
            raise ConfigError(f"cluster: {wide[0]} is one actor on one GPU here; give it exactly one slot")
    return ResourcePlan(device, total_slots, roles)


def colocated_groups(config: TandemConfig) -> list[set[str]]:
    """Groups of roles that take turns under one lock: ``flow.colocate``, plus on Ray the roles
    whose slots overlap (merged transitively: sharing with a sharer is sharing)."""
    groups = [set(g) for g in config.flow.colocate]
    cluster = config.cluster
    if cluster.backend == "ray":
        if cluster.device_mapping is not None:
            slots = role_slots(cluster, config.flow.stages, None)
            names = list(slots)
            groups += [{a, b} for i, a in enumerate(names) for b in names[i + 1 :] if set(slots[a]) & set(slots[b])]
        elif "ref_logp" in config.flow.stages and "ref_logp" not in (cluster.use_nodes_ratios or {}):
            groups.append({"ref_logp", "train"})  # ratios give disjoint ranges, but for this default
    merged: list[set[str]] = []
    for group in groups:
        touching = [m for m in merged if m & group]
        for m in touching:
            merged.remove(m)
            group = group | m
        merged.append(group)
    return merged
