"""PPO's mini-batches and epochs: which of a train step's trajectories each optimizer step trains.

A train step (one version: one published set of weights) may take several optimizer steps, as
every peer does: verl's ``ppo_mini_batch_size`` and ``ppo_epochs``, AReaL's
``ppo_n_minibatches``, TRL's ``num_iterations``, slime's ``--num-steps-per-rollout``. This
module owns the plan: the step's groups are shuffled by a generator seeded from the run's seed
and the step, split into ``mini_batches`` lists of whole groups, and each list is one optimizer
step; ``epochs`` passes over the step, reshuffled each pass. The train role makes the plan and
hands it to the trainer with the step's trajectories; the trainer only follows it.

Invariants (pure: no state, the inputs are not modified):
- every pass trains every trajectory exactly once; a group's trajectories are never split
  (group baselines and sequence-mean aggregations stay whole within one optimizer step);
- the group counts of a pass's mini-batches differ by at most one;
- each mini-batch lists its indices in ascending order: the step's own order, so with one
  mini-batch and one epoch the plan is the whole step in order, exactly the step as it was
  before mini-batches existed;
- the same (``seed``, ``step``) gives the same plan, in any process and after a resume.
"""

from __future__ import annotations

import random
from collections.abc import Hashable, Sequence

__all__ = ["plan_mini_batches"]


def plan_mini_batches(
    groups: Sequence[Hashable], mini_batches: int, epochs: int, *, seed: int, step: int
) -> list[list[int]]:
    """The indices into a train step's trajectories that each of its ``mini_batches * epochs``
    optimizer steps trains, in order; ``groups[i]`` names trajectory ``i``'s group (its prompt).

    Raises ``ValueError`` naming ``train.mini_batches`` if there are fewer groups than mini-batches.
    """
    if mini_batches < 1 or epochs < 1:
        raise ValueError(f"mini_batches and epochs must be >= 1, got {mini_batches} and {epochs}")
    members: dict[Hashable, list[int]] = {}
    for index, group in enumerate(groups):
        members.setdefault(group, []).append(index)
    keys = list(members)
    if mini_batches > len(keys):
        raise ValueError(
            f"train.mini_batches={mini_batches} exceeds the step's {len(keys)} groups: a mini-batch "
            "keeps its groups whole (lower train.mini_batches or raise train.prompts_per_step)"
        )
    # A string seed is hashed the same way by every Python process (unlike hash()).
    rng = random.Random(f"mini-batches/{seed}/{step}")
    plan: list[list[int]] = []
    for _ in range(epochs):
        order = keys[:]
        rng.shuffle(order)
        size, extra = divmod(len(order), mini_batches)
        start = 0
        for part in range(mini_batches):
            end = start + size + (part < extra)
            plan.append(sorted(i for key in order[start:end] for i in members[key]))
            start = end
    return plan
