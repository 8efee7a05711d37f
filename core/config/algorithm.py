"""The algorithm's section (advantages, the policy loss, KL, corrections) and the rules it imposes on
the stage graph: what the loss reads must be produced, and what is produced must be read."""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pydantic import Field, model_validator

from tandem.core.config.section import Section

if TYPE_CHECKING:
    from tandem.core.config.schema import TandemConfig

__all__ = ["AlgorithmConfig", "check_algorithm_stages", "check_objective_inputs", "check_proximal_schedule"]


class AlgorithmConfig(Section):
    """Advantages and the policy loss (see ``algorithms/`` for the formulas and sources)."""

    advantage: Literal["grpo", "rloo", "reinforce", "gae"] = "grpo"
    """Advantage estimator over each prompt group's rewards, or ``gae``: per-action advantages by
    GAE(``gae_gamma``, ``gae_lambda``) over the values of a critic (the ``critic`` stage, a value
    model trained beside the policy on the GAE returns), whitened over the step's actions as verl does."""
    gae_gamma: float = Field(1.0, ge=0.0, le=1.0)
    """gae: discount per action."""
    gae_lambda: float = Field(1.0, ge=0.0, le=1.0)
    """gae: lambda (1: Monte-Carlo return minus value; 0: one-step TD error)."""
    value_clip_eps: float = Field(0.5, gt=0.0)
    """gae: the critic's value clipping (a value may not move more than this from the one its
    returns were computed with, PPO's ``cliprange_value``; verl's default 0.5)."""
    proximal: Literal["recompute", "loglinear", "current", "behaviour"] = "recompute"
    """Decoupled PPO: where pi_prox, the policy at the start of the train step, comes from.
    ``recompute``: a forward pass of the trainer over every sample (the logp stage; rescored at
    the train step if a newer version trains it); exact for every optimizer step of the step,
    costs one forward pass per sample. ``loglinear``: AReaL's log-linear interpolation between
    the behaviour log-probs and the optimizer step's own forward pass, by version distance
    (``algorithms.prox``; the weights after j of a step's n optimizer steps stand at version
    v + j/n); exact at a step's first optimizer step, free: no logp stage. ``current``: the
    step's own forward pass, detached: exact only while a train step is one optimizer step
    (``train.mini_batches`` and ``train.epochs`` 1: the forward then runs on pi_prox), refused
    otherwise; free. ``behaviour``: pi_prox := pi_behav, the rollout engine's log-probs: the
    behaviour weight is 1 and the loss is naive PPO anchored at pi_behav (the same as
    ``decoupled: false``); exact only at k = 0 with no numerical mismatch between the engines,
    an explicit approximation otherwise."""
    dynamic_sampling: bool = False
    """DAPO's dynamic sampling: a group whose (shaped) rewards are all equal is dropped on arrival
    at the train role and its slot refilled with a fresh prompt (grpo and rloo only: their group
    advantage is 0 there)."""
    dynamic_sampling_max_refills: int = Field(8, ge=1)
    """Dynamic sampling's bound on extra generation: groups a step may drop and refill; past it
    the step trains the equal-reward groups it gets (advantage 0: no policy gradient)."""
    overlong_buffer: int | None = Field(None, ge=1)
    """DAPO's soft over-long punishment: responses longer than ``rollout.max_new_tokens`` minus
    this many tokens get a reward penalty ramping from 0 to -1 at ``max_new_tokens``; None = off."""
    overlong_filter: bool = False
    """DAPO's over-long filtering: responses cut at ``rollout.max_new_tokens`` (finish reason
    ``length``) are kept out of the loss (they still count in their group's advantages)."""
    normalize_std: bool = True
    """GRPO: divide by the group's reward std (False: Dr. GRPO's mean-centring only)."""
    loss: Literal["ppo", "vanilla", "tis", "topr", "cispo", "kimi15"] = "ppo"
    """Policy loss, with the meanings these names have in ROLL."""
    clip_eps_low: float = Field(0.2, ge=0.0, le=1.0)
    """PPO: ratio clipped below at 1 - eps."""
    clip_eps_high: float = Field(0.2, ge=0.0)
    """PPO: ratio clipped above at 1 + eps."""
    dual_clip_c: float | None = Field(None, gt=1.0)
    """PPO dual clip (Ye et al. 2020) for negative advantages; None = off."""
    decoupled: bool = True
    """Decoupled PPO (AReaL): trust region around pi_prox recomputed by the logp role, tokens
    weighted by pi_prox / pi_behav. Needs the logp stage."""
    behaviour_weight_cap: float = Field(5.0, ge=1.0)
    """Decoupled: upper end of the band the behaviour weight pi_prox / pi_behav must stay in."""
    behaviour_weight_floor: float | None = Field(None, gt=0.0, le=1.0)
    """Decoupled: lower end of that band (IcePop: 0.5 with cap 5); None = no lower bound."""
    behaviour_weight_mode: Literal["clamp", "mask"] = "mask"
    """Decoupled: outside the band, clamp the weight to it (truncated IS) or mask the token
    (masked IS, AReaL's choice)."""
    behaviour_weight_level: Literal["token", "sequence", "geometric"] = "token"
    """Decoupled: the weight per token, per sequence (product over its trained tokens), or as the
    sequence's geometric mean (see ``algorithms.corrections``)."""
    tis_cap: float = Field(1.0, gt=0.0)
    """tis: upper truncation of the importance ratio (under decoupled PPO the token's loss is
    also multiplied by the behaviour weight pi_prox / pi_behav)."""
    topr_positive_weight: float = Field(1.0, ge=0.0)
    """topr: coefficient of the A > 0 (SFT-like) term."""
    topr_negative_weight: float = Field(1.0, ge=0.0)
    """topr: coefficient of the A <= 0 (truncated-IS) term (under decoupled PPO, times the
    behaviour weight as well)."""
    cispo_eps_low: float = Field(1.0, ge=0.0, le=1.0)
    """cispo: IS-weight floor 1 - eps; 1.0 = no floor, as in MiniMax-M1."""
    cispo_eps_high: float = Field(0.2, ge=0.0)
    """cispo: IS-weight ceiling 1 + eps."""
    kimi15_tau: float = Field(0.1, ge=0.0)
    """kimi15: weight of the squared log-ratio penalty."""
    kl_estimator: Literal["k1", "k2", "k3", "exact"] | None = None
    """KL estimator against the reference model, in the loss; None = no KL term. ``k1``'s gradient
    is zero in expectation, so it is refused in the loss (see ``algorithms.kl``). ``exact``: no
    estimate but the KL the train engine computes in closed form against the initial weights
    (the image workload: Flow-GRPO's KL between Gaussian transitions; needs no ref_logp stage)."""
    kl_coef: float = Field(0.0, ge=0.0)
    """Weight of the KL term; > 0 needs kl_estimator and, unless it is ``exact``, the ref_logp stage."""
    kl_importance_weight: bool = False
    """Decoupled: weight the KL term by pi_theta / pi_behav (DeepSeek-V3.2's unbiased KL; with it
    k3's gradient is the reverse KL's off-policy too)."""
    aggregation: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"] = "token-mean"
    """How per-token losses become one number."""

    @model_validator(mode="after")
    def _consistent(self) -> AlgorithmConfig:
        if self.kl_coef > 0 and self.kl_estimator is None:
            raise ValueError(
                f"algorithm.kl_coef={self.kl_coef} needs algorithm.kl_estimator (without one the "
                "coefficient would be silently ignored)"
            )
        if self.kl_estimator == "k1":
            raise ValueError(
                "algorithm.kl_estimator=k1 as a loss regularises nothing (its gradient is zero in "
                "expectation); use k2 (the reverse KL's gradient) or k3"
            )
        if self.kl_estimator == "exact" and self.kl_importance_weight:
            raise ValueError("algorithm.kl_importance_weight re-weights a sampled KL estimate: not with kl_estimator=exact")
        if self.behaviour_weight_floor is not None and self.behaviour_weight_floor > self.behaviour_weight_cap:
            raise ValueError("algorithm.behaviour_weight_floor must not exceed behaviour_weight_cap")
        if self.dynamic_sampling and self.advantage not in ("grpo", "rloo"):
            raise ValueError(
                f"algorithm.dynamic_sampling filters groups whose group-baselined advantage is 0 (grpo, rloo); "
                f"with advantage={self.advantage} equal rewards still carry a signal"
            )
        if not self.decoupled:
            for name, default in (("behaviour_weight_level", "token"), ("behaviour_weight_floor", None),
                                  ("kl_importance_weight", False), ("proximal", "recompute")):
                if getattr(self, name) != default:
                    raise ValueError(
                        f"algorithm.{name}={getattr(self, name)} applies to decoupled PPO only: set "
                        f"algorithm.decoupled=true, or algorithm.{name}={default} (its default) for naive PPO"
                    )
        return self




def check_algorithm_stages(config: TandemConfig) -> None:
    algo = config.algorithm
    if (algo.advantage == "gae") != ("critic" in config.flow.stages):
        raise ValueError(
            "algorithm.advantage=gae and the 'critic' stage go together: GAE reads the critic's values, "
            "and the critic trains on GAE's returns"
        )
    if algo.overlong_buffer is not None and algo.overlong_buffer > config.rollout.max_new_tokens:
        raise ValueError(
            f"algorithm.overlong_buffer={algo.overlong_buffer} is longer than rollout.max_new_tokens="
            f"{config.rollout.max_new_tokens}"
        )



def check_proximal_schedule(config: TandemConfig) -> None:
    """pi_prox is the policy at the start of the train step for every optimizer step of it: the
    step's own forward pass is that policy only at its first optimizer step."""
    algo, train = config.algorithm, config.train
    if algo.decoupled and algo.proximal == "current" and train.optimizer_steps > 1:
        raise ValueError(
            f"algorithm.proximal=current takes pi_prox from the optimizer step's own forward pass, which "
            f"is pi_prox only at a train step's first optimizer step; train.mini_batches={train.mini_batches} "
            f"and train.epochs={train.epochs} take {train.optimizer_steps}: use algorithm.proximal=recompute "
            "(with the logp stage) or loglinear"
        )


def check_objective_inputs(config: TandemConfig) -> None:
    """The torch engines' loss reads what the stages produce, and every stage's output is read."""
    if config.engines.type == "torch":
        algo, stages = config.algorithm, config.flow.stages
        recompute = algo.decoupled and algo.proximal == "recompute"
        if recompute and "logp" not in stages:
            raise ValueError(
                "algorithm.decoupled needs recomputed log-probs: add 'logp' to flow.stages, "
                "set algorithm.proximal=loglinear or current (from the train step's own forward pass) "
                "or algorithm.decoupled=false"
            )
        if "logp" in stages and not recompute:
            raise ValueError(
                "flow.stages has logp but the loss reads no recomputed log-probs (algorithm.decoupled=false or "
                f"algorithm.proximal={algo.proximal}): the forward pass would go unused"
            )
        if algo.advantage == "gae" and (config.engines.rollout != "embedded" or config.cluster.backend != "local"):
            # Every trainer takes per-action advantages (engines.trainers.loss_loop); the critic
            # itself is built only by the embedded local bundle.
            raise ValueError(
                "algorithm.advantage=gae: the critic runs beside the embedded local engines only "
                "(engines.rollout=embedded, cluster.backend=local)"
            )
        exact = algo.kl_estimator == "exact"  # the train engine holds the reference itself
        if algo.kl_coef > 0 and (algo.kl_estimator is None or ("ref_logp" not in stages and not exact)):
            raise ValueError(
                "algorithm.kl_coef > 0 needs algorithm.kl_estimator and the 'ref_logp' stage (a reference model)"
            )
        if "ref_logp" in stages and (algo.kl_coef == 0 or exact):
            raise ValueError(
                "flow.stages has ref_logp but the loss takes no KL from it (kl_coef is 0 or kl_estimator is exact): "
                "the reference would go unused"
            )
