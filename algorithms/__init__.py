"""Pure RL math: advantage estimators, policy losses and KL estimators (torch, no state).

Each function names its source paper or framework in its docstring and is tested against
hand-computed values in ``tests/unit/algorithms``. The train engine sees one seam:
:func:`compute_policy_loss` over :class:`LossInputs` with a :class:`LossConfig`.
"""

from algorithms.advantages import (
    ADVANTAGE_ESTIMATORS,
    AdvantageEstimator,
    compute_advantages,
    grpo_advantages,
    reinforce_advantages,
    rloo_advantages,
)
from algorithms.batch import LossInputs
from algorithms.kl import (
    KL_ESTIMATORS,
    KLEstimator,
    compute_kl,
    get_kl_estimator,
    kl_k1,
    kl_k2,
    kl_k3,
)
from algorithms.losses import (
    AGGREGATIONS,
    BEHAVIOUR_WEIGHT_MODES,
    POLICY_LOSSES,
    LossConfig,
    PolicyLossFn,
    TokenLoss,
    aggregate_loss,
    cispo_loss,
    compute_policy_loss,
    get_policy_loss,
    kimi15_loss,
    ppo_loss,
    tis_loss,
    topr_loss,
    vanilla_loss,
)

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "AGGREGATIONS",
    "BEHAVIOUR_WEIGHT_MODES",
    "KL_ESTIMATORS",
    "POLICY_LOSSES",
    "AdvantageEstimator",
    "KLEstimator",
    "LossConfig",
    "LossInputs",
    "PolicyLossFn",
    "TokenLoss",
    "aggregate_loss",
    "cispo_loss",
    "compute_advantages",
    "compute_kl",
    "compute_policy_loss",
    "get_kl_estimator",
    "get_policy_loss",
    "grpo_advantages",
    "kimi15_loss",
    "kl_k1",
    "kl_k2",
    "kl_k3",
    "ppo_loss",
    "reinforce_advantages",
    "rloo_advantages",
    "tis_loss",
    "topr_loss",
    "vanilla_loss",
]
