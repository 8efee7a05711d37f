"""What the train role does with each prompt group as it arrives: staleness at consumption, dynamic sampling.

A group is assigned its train step ``s`` at admission, so its staleness at consumption,
``s - oldest token version``, and the version span of its partial rollouts are fixed once its
last token is sampled: the train role judges it on arrival (a refill then starts as early as it
can), before holding it for its step.

Staleness at consumption (``staleness.max_consumption_staleness`` c, ``max_version_span``): a
group over either bound is *stale*, and ``staleness.on_stale`` says what happens to it:

- ``train``: it is trained as it is (valid: the admission bound k still holds); counted.
- ``drop``: dropped with the reason in the ledger; a fresh prompt refills its slot. Replaces
  slow groups by fresh prompts, so over many steps it favours prompts whose answers come fast.
- ``recompute``: the same prompt is generated again for the same step (it keeps its slot and
  its ledger entry); its trajectories are discarded. Keeps the prompt mix, costs a generation.
  The generate role serves regenerations while the prompt stream is open (a data file that ran
  out ends the run as it would without them).
- ``withhold``: it moves to step ``s + 1`` if it is still inside its admission bound there and
  that step has a free slot (else it is dropped); step ``s`` gets a fresh group in its slot
  now. Nothing is thrown away, at the price of one more version of staleness for it.

A refill or a regeneration is admitted only under the refill bound (``StalenessGate``): its
tokens are at most ``min(c, span)`` versions behind its step, so it is never judged stale
itself. Hence the cap that keeps drop-and-refill from emptying the pipeline: each group admitted
under the configured bound is judged stale at most once, so a step gives at most
``prompts_per_step`` slots to the policy.

Dynamic sampling (DAPO, ``algorithm.dynamic_sampling``): a group whose rewards (shaped as its
advantages will see them) are all equal gets a group-baselined advantage of 0; it is dropped and
its slot refilled, at most ``algorithm.dynamic_sampling_max_refills`` times per step (the bound
on extra generation); past it the step trains such groups as they are.

Invariant: every action is accounted: each arriving group ends in exactly one of held for a
step, dropped (ledger), or sent back for regeneration; the counts per step are reported with
the step (``StepRecord.consumption``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

from tandem.algorithms.shaping import has_reward_variance
from tandem.core.records import Trajectory, TrajectoryGroup
from tandem.state_machines.base import FlowServices

__all__ = ["CONSUMPTION_ACTIONS", "Consumption", "version_span"]

# What can happen to an arriving group, as counted per step (``StepRecord.consumption``).
CONSUMPTION_ACTIONS = (
    "stale", "stale_trained", "stale_dropped", "regenerated", "withheld", "filtered", "zero_variance_trained",
)


def version_span(trajectory: Trajectory) -> int:
    """Newest minus oldest version among a trajectory's actions (0 without a weight update mid-way)."""
    return max(trajectory.versions) - min(trajectory.versions) if trajectory.versions else 0


class Consumption:
    """The train role's decisions on arrival, with their counts per step (see the module docstring).

    ``shaped_rewards(group)`` gives the rewards the group's advantages will be computed from.
    """

    def __init__(self, services: FlowServices, stage: str, shaped_rewards: Callable[[TrajectoryGroup], list[float]]):
        config = services.config
        self.services = services
        self.stage = stage
        self.bound = config.staleness.max_consumption_staleness
        self.span_bound = config.staleness.max_version_span
        self.policy = config.staleness.on_stale
        self.dynamic_sampling = config.algorithm.dynamic_sampling
        self.max_refills = config.algorithm.dynamic_sampling_max_refills
        self.shaped_rewards = shaped_rewards
        self._counts: dict[int, Counter[str]] = {}  # step -> actions on its slots, until it trains

    def stale_reason(self, group: TrajectoryGroup) -> str | None:
        """Why ``group`` is stale at its step, or None if it is not."""
        staleness = group.step - group.oldest_version
        if self.bound is not None and staleness > self.bound:
            return f"stale at consumption: {staleness} versions behind step {group.step} > {self.bound}"
        span = max((version_span(t) for t in group.trajectories), default=0)
        if self.span_bound is not None and span > self.span_bound:
            return f"partial rollout spans {span} versions > {self.span_bound}"
        return None

    async def accept(self, group: TrajectoryGroup) -> int | None:
        """Judge an arriving group: the step it is to be trained in, or None if it left (dropped,
        or sent back to be generated again)."""
        step = group.step
        counts = self._counts.setdefault(step, Counter())
        reason = self.stale_reason(group)
        if reason is not None:
            counts["stale"] += 1
            step = await self._stale(group, reason, counts)
            if step is None:
                return None
            counts = self._counts.setdefault(step, Counter())  # a withheld group counts in its new step
        if self.dynamic_sampling and not self._has_variance(group):
            if counts["filtered"] < self.max_refills:
                counts["filtered"] += 1
                await self.services.ledger.drop(group.prompt_id, self.stage, "no reward variance (dynamic sampling)")
                return None
            counts["zero_variance_trained"] += 1
        return step

    async def _stale(self, group: TrajectoryGroup, reason: str, counts: Counter[str]) -> int | None:
        services = self.services
        if self.policy == "train":
            counts["stale_trained"] += 1
            return group.step
        if self.policy == "recompute":
            counts["regenerated"] += 1
            await services.gate.regenerate(group.group)
            return None
        if self.policy == "withhold":
            later = group.step + 1
            inside = later - group.oldest_version <= group.group.admitted_k
            if inside and await services.gate.move(group.step, later):
                services.ledger.reassign(group.prompt_id, later)
                group.group.step = later
                counts["withheld"] += 1
                return later
            reason += " (withhold: the next step is full or past its admission bound)"
        counts["stale_dropped"] += 1
        await services.ledger.drop(group.prompt_id, self.stage, reason)
        return None

    def _has_variance(self, group: TrajectoryGroup) -> bool:
        if any(t.reward is None for t in group.trajectories):
            return True  # unscored: the train role refuses it with the reason
        return has_reward_variance(self.shaped_rewards(group))

    def pop(self, step: int) -> dict[str, int]:
        """The counts of ``step``'s slots (it has trained: they are final)."""
        return dict(sorted(self._counts.pop(step, Counter()).items()))
