"""Pure RL math: advantage estimators, policy losses and KL estimators, each naming its source.

What it owns: functions of their inputs with no state, tested against hand-computed values in
``tests/unit/algorithms``. What it may import: numpy, torch and the standard library; nothing
of ours (every other package may import it).

The package itself imports no torch: it exports the advantage estimators (numpy), the
mini-batch plan of a train step (:mod:`algorithms.mini_batches`) and the
:class:`PolicyObjective` the train role hands an engine. The torch math lives in its modules,
imported by name where it is used: :mod:`algorithms.losses` (policy losses, aggregation),
:mod:`algorithms.kl` (KL estimators), :mod:`algorithms.batch` (:class:`LossInputs`, the
contract between engines and losses).
"""

from tandem.algorithms.advantages import (
    ADVANTAGE_ESTIMATORS,
    AdvantageEstimator,
    RewardGroup,
    compute_advantages,
    grpo_advantages,
    reinforce_advantages,
    rloo_advantages,
)
from tandem.algorithms.mini_batches import plan_mini_batches
from tandem.algorithms.objective import PROXIMAL_SOURCES, LossMeanOver, PolicyObjective, ProximalSource, ValueObjective

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "PROXIMAL_SOURCES",
    "AdvantageEstimator",
    "LossMeanOver",
    "PolicyObjective",
    "ProximalSource",
    "RewardGroup",
    "ValueObjective",
    "compute_advantages",
    "grpo_advantages",
    "plan_mini_batches",
    "reinforce_advantages",
    "rloo_advantages",
]
