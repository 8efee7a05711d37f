"""Policy losses against hand-computed values: the specification of algorithms.losses.

The shared micro-batch has 2 rows x 3 tokens; row 1's last token is padding and holds values
that would change every result if it leaked in. Per token (r = pi_theta / pi_anchor):

    row 0:  A = +2,  log pi_theta = [-0.5, -1.0, -2.0],  r = [1.5, 1.0, 0.5]
    row 1:  A = -1,  log pi_theta = [-0.5, -2.0, pad],   r = [1.5, 0.5, pad]

Expected numbers are worked out by hand in the comments; 5 real tokens, so token-mean
divides by 5 and each gradient entry is d(token loss)/d(log pi_theta) / 5.
"""

from __future__ import annotations

import dataclasses
import math
import typing

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.algorithms.batch import LossInputs
from tandem.algorithms.losses import (
    POLICY_LOSSES,
    LossSettings,
    aggregate_loss,
    compute_policy_loss,
    get_policy_loss,
)
from tandem.core.config import AlgorithmConfig


@dataclasses.dataclass(frozen=True)
class Settings:
    """Every attribute :class:`LossSettings` declares, with the config's defaults (both checked
    below): the losses are pure functions of any object with these attributes."""

    loss: str = "ppo"
    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.2
    dual_clip_c: float | None = None
    decoupled: bool = True
    behaviour_weight_level: str = "token"
    behaviour_weight_mode: str = "mask"
    behaviour_weight_cap: float = 5.0
    behaviour_weight_floor: float | None = None
    tis_cap: float = 1.0
    topr_positive_weight: float = 1.0
    topr_negative_weight: float = 1.0
    cispo_eps_low: float = 1.0
    cispo_eps_high: float = 0.2
    kimi15_tau: float = 0.1
    kl_estimator: str | None = None
    kl_coef: float = 0.0
    kl_importance_weight: bool = False
    aggregation: str = "token-mean"


def test_the_test_settings_are_the_protocol_with_the_config_defaults() -> None:
    fields = {f.name: f.default for f in dataclasses.fields(Settings)}
    assert set(fields) == set(typing.get_type_hints(LossSettings))
    config = AlgorithmConfig()
    shared = set(fields) & set(AlgorithmConfig.model_fields)
    assert {name: getattr(config, name) for name in shared} == {name: fields[name] for name in shared}

LOGPROBS = [[-0.5, -1.0, -2.0], [-0.5, -2.0, -3.0]]
RATIOS = [[1.5, 1.0, 0.5], [1.5, 0.5, 7.0]]
ADVANTAGES = [[2.0, 2.0, 2.0], [-1.0, -1.0, -1.0]]
MASK = [[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]]


def make_inputs(
    *,
    ratios: list[list[float]] = RATIOS,
    behaviour_weights: list[list[float]] | None = None,
    ref_logprobs: list[list[float]] | None = None,
    entropy: list[list[float]] | None = None,
) -> LossInputs:
    """Log-probs that realise ``ratios`` against the anchor.

    Without ``behaviour_weights`` the anchor is the behaviour policy and there are no prox
    log-probs; with them the anchor is pi_prox and pi_prox / pi_behav = behaviour_weights.
    """
    logprobs = torch.tensor(LOGPROBS, requires_grad=True)
    anchor = torch.tensor(LOGPROBS) - torch.log(torch.tensor(ratios))
    prox = None
    behaviour = anchor
    if behaviour_weights is not None:
        prox = anchor
        behaviour = anchor - torch.log(torch.tensor(behaviour_weights))
    return LossInputs(
        logprobs=logprobs,
        behaviour_logprobs=behaviour,
        advantages=torch.tensor(ADVANTAGES),
        mask=torch.tensor(MASK),
        prox_logprobs=prox,
        ref_logprobs=None if ref_logprobs is None else torch.tensor(ref_logprobs),
        entropy=None if entropy is None else torch.tensor(entropy),
    )


def run(inputs: LossInputs, **cfg: object) -> tuple[float, list[list[float]], dict[str, float]]:
    loss, metrics = compute_policy_loss(inputs, Settings(loss=cfg.pop("name", "ppo"), **cfg))  # type: ignore[arg-type]
    loss.backward()
    assert inputs.logprobs.grad is not None
    return loss.item(), inputs.logprobs.grad.tolist(), metrics


def assert_grad(actual: list[list[float]], expected: list[list[float]]) -> None:
    torch.testing.assert_close(torch.tensor(actual), torch.tensor(expected), atol=1e-6, rtol=1e-5)


# ----------------------------------------------------------------------------- PPO


def test_ppo_clip_hand_values() -> None:
    # eps 0.2, bounds [0.8, 1.2]; loss = -min(r A, clip(r) A), grad = -A r where unclipped.
    # row 0 (A=2):  r=1.5 clipped: -1.2*2 = -2.4, grad 0;  r=1: -2, grad -2;  r=0.5: -1, grad -1.
    # row 1 (A=-1): r=1.5: min(-1.5, -1.2) -> 1.5, grad 1.5;  r=0.5 clipped: 0.8, grad 0.
    # token-mean: (-2.4 - 2 - 1 + 1.5 + 0.8) / 5 = -0.62.
    loss, grad, metrics = run(make_inputs(), name="ppo", decoupled=False)
    assert loss == pytest.approx(-0.62)
    assert_grad(grad, [[0.0, -0.4, -0.2], [0.3, 0.0, 0.0]])
    assert metrics["clip_fraction"] == pytest.approx(0.4)  # 2 of 5 tokens
    assert metrics["ratio_mean"] == pytest.approx(1.0)  # (1.5 + 1 + 0.5 + 1.5 + 0.5) / 5
    # Tokens come from pi_behav, so k3 of KL(behav || theta) per token is r - 1 - ln r:
    # 0.5 - 0.4054651 = 0.0945349 (r=1.5), -0.5 + 0.6931472 = 0.1931472 (r=0.5), 0 (r=1);
    # (2 * 0.0945349 + 2 * 0.1931472) / 5 = 0.1150728.
    assert metrics["approx_kl_behaviour"] == pytest.approx(0.1150728, abs=1e-6)
    assert metrics["masked_fraction"] == 0.0
    assert metrics["pg_loss"] == metrics["loss"] == pytest.approx(-0.62)
    assert "importance_weight_mean" not in metrics and "kl_loss" not in metrics


@pytest.mark.parametrize(
    ("aggregation", "expected_loss", "expected_grad"),
    [
        # row means: -5.4 / 3 = -1.8 and 2.3 / 2 = 1.15; mean -0.325.
        # grads: row 0 divided by 3 * 2, row 1 by 2 * 2.
        ("seq-mean-token-mean", -0.325, [[0.0, -1 / 3, -1 / 6], [0.375, 0.0, 0.0]]),
        # row sums: -5.4 and 2.3; mean -1.55. grads divided by 2 rows.
        ("seq-mean-token-sum", -1.55, [[0.0, -1.0, -0.5], [0.75, 0.0, 0.0]]),
    ],
)
def test_ppo_sequence_aggregations(
    aggregation: str, expected_loss: float, expected_grad: list[list[float]]
) -> None:
    loss, grad, _ = run(make_inputs(), name="ppo", decoupled=False, aggregation=aggregation)
    assert loss == pytest.approx(expected_loss)
    assert_grad(grad, expected_grad)


def test_ppo_dual_clip_bounds_negative_advantages_only() -> None:
    # Ratios row 0 [4, 1, 0.5], row 1 [4, 0.5]; c = 3.
    # row 0 (A=2): r=4 is ordinary-clipped: -2.4, grad 0 (dual clip never touches A > 0).
    # row 1 (A=-1): r=4: min(-4, -1.2) = -4 < c A = -3 -> dual-clipped to -3: loss 3, grad 0.
    # token-mean: (-2.4 - 2 - 1 + 3 + 0.8) / 5 = -0.32.
    ratios = [[4.0, 1.0, 0.5], [4.0, 0.5, 7.0]]
    loss, grad, metrics = run(
        make_inputs(ratios=ratios), name="ppo", decoupled=False, dual_clip_c=3.0
    )
    assert loss == pytest.approx(-0.32)
    assert_grad(grad, [[0.0, -0.4, -0.2], [0.0, 0.0, 0.0]])
    assert metrics["dual_clip_fraction"] == pytest.approx(0.2)
    assert metrics["clip_fraction"] == pytest.approx(0.4)
    # Without it the r=4, A=-1 token costs 4 with gradient -A r = 4: (-5.4 + 4 + 0.8) / 5.
    loss, grad, metrics = run(make_inputs(ratios=ratios), name="ppo", decoupled=False)
    assert loss == pytest.approx(-0.12)
    assert_grad(grad, [[0.0, -0.4, -0.2], [0.8, 0.0, 0.0]])
    assert "dual_clip_fraction" not in metrics


# ------------------------------------------------------------------ decoupled PPO

# pi_prox / pi_behav per token; the cap is 3.
WEIGHTS = [[1.0, 2.0, 0.5], [4.0, 1.0, 9.0]]


def test_decoupled_ppo_clamps_the_behaviour_weight() -> None:
    # Same ratios against pi_prox, so the PPO token losses are [-2.4, -2, -1], [1.5, 0.8] and
    # their gradients [0, -2, -1], [1.5, 0]. Weights clamped at 3: [1, 2, 0.5], [3, 1].
    # loss (-2.4 - 4 - 0.5 + 4.5 + 0.8) / 5 = -0.32; grads [0, -4, -0.5], [4.5, 0] / 5.
    loss, grad, metrics = run(
        make_inputs(behaviour_weights=WEIGHTS),
        name="ppo",
        behaviour_weight_cap=3.0,
        behaviour_weight_mode="clamp",
    )
    assert loss == pytest.approx(-0.32)
    assert_grad(grad, [[0.0, -0.8, -0.1], [0.9, 0.0, 0.0]])
    assert metrics["importance_weight_mean"] == pytest.approx(1.5)  # (1 + 2 + 0.5 + 3 + 1) / 5
    assert metrics["masked_fraction"] == 0.0
    assert metrics["ratio_mean"] == pytest.approx(1.0)  # the ratio is against pi_prox
    assert metrics["clip_fraction"] == pytest.approx(0.4)


def test_decoupled_ppo_masks_tokens_above_the_cap() -> None:
    # The weight-4 token gets weight 0 but stays in the denominator:
    # (-2.4 - 4 - 0.5 + 0 + 0.8) / 5 = -1.22.
    loss, grad, metrics = run(
        make_inputs(behaviour_weights=WEIGHTS), name="ppo", behaviour_weight_cap=3.0
    )
    assert loss == pytest.approx(-1.22)
    assert_grad(grad, [[0.0, -0.8, -0.1], [0.0, 0.0, 0.0]])
    assert metrics["importance_weight_mean"] == pytest.approx(0.9)  # (1 + 2 + 0.5 + 0 + 1) / 5
    assert metrics["masked_fraction"] == pytest.approx(0.2)


def test_decoupling_is_on_by_default() -> None:
    assert AlgorithmConfig().decoupled is True


@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
def test_decoupled_loss_refuses_missing_prox_logprobs(name: str) -> None:
    with pytest.raises(ValueError, match="prox_logprobs"):
        compute_policy_loss(make_inputs(), Settings(loss=name))


# ----------------------------------------------------------- ROLL's pg variants


@pytest.mark.parametrize(
    ("tis_cap", "expected_loss", "expected_grad", "expected_clip"),
    [
        # cap 1: weights [1, 1, 0.5], [1, 0.5]; loss = -w A log pi:
        # row 0: 1, 2, 2;  row 1: -0.5, -1  ->  3.5 / 5 = 0.7.  grad = -w A / 5.
        (1.0, 0.7, [[-0.4, -0.4, -0.2], [0.2, 0.1, 0.0]], 0.4),
        # cap 2: nothing truncated, weights = ratios:
        # row 0: 1.5, 2, 2;  row 1: -0.75, -1  ->  3.75 / 5 = 0.75.
        (2.0, 0.75, [[-0.6, -0.4, -0.2], [0.3, 0.1, 0.0]], 0.0),
    ],
)
def test_tis_hand_values(
    tis_cap: float, expected_loss: float, expected_grad: list[list[float]], expected_clip: float
) -> None:
    loss, grad, metrics = run(make_inputs(), name="tis", decoupled=False, tis_cap=tis_cap)
    assert loss == pytest.approx(expected_loss)
    assert_grad(grad, expected_grad)
    assert metrics["clip_fraction"] == pytest.approx(expected_clip)


def test_cispo_hand_values() -> None:
    # IS weight clip(r, 0.8, 1.2): [1.2, 1, 0.8], [1.2, 0.8]; loss = -w A log pi:
    # row 0: 1.2, 2, 3.2;  row 1: -0.6, -1.6  ->  4.2 / 5 = 0.84.  grad = -w A / 5:
    # every token keeps a gradient, unlike PPO.
    loss, grad, metrics = run(
        make_inputs(), name="cispo", decoupled=False, cispo_eps_low=0.2, cispo_eps_high=0.2
    )
    assert loss == pytest.approx(0.84)
    assert_grad(grad, [[-0.48, -0.4, -0.32], [0.24, 0.16, 0.0]])
    assert metrics["clip_fraction"] == pytest.approx(0.8)  # all but the r=1 token


def test_vanilla_hand_values() -> None:
    # loss = -A log pi: row 0: 1, 2, 4;  row 1: -0.5, -2  ->  4.5 / 5 = 0.9.  grad = -A / 5.
    loss, grad, metrics = run(make_inputs(), name="vanilla", decoupled=False)
    assert loss == pytest.approx(0.9)
    assert_grad(grad, [[-0.4, -0.4, -0.4], [0.2, 0.2, 0.0]])
    assert metrics["clip_fraction"] == 0.0


@pytest.mark.parametrize(
    ("weights", "expected_loss", "expected_grad", "expected_clip"),
    [
        # row 0 (A > 0): -A log pi = 1, 2, 4 (no IS weight).
        # row 1 (A < 0): -clip(r, 0, 1) A log pi = -1 * 0.5, -0.5 * 2 = -0.5, -1.
        # (7 - 1.5) / 5 = 1.1; grads -A / 5 on row 0, -clip(r) A / 5 on row 1.
        ((1.0, 1.0), 1.1, [[-0.4, -0.4, -0.4], [0.2, 0.1, 0.0]], 0.2),
        # positive weight 0.5, negative 2: (3.5 - 3) / 5 = 0.1.
        ((0.5, 2.0), 0.1, [[-0.2, -0.2, -0.2], [0.4, 0.2, 0.0]], 0.2),
    ],
)
def test_topr_hand_values(
    weights: tuple[float, float],
    expected_loss: float,
    expected_grad: list[list[float]],
    expected_clip: float,
) -> None:
    loss, grad, metrics = run(
        make_inputs(),
        name="topr",
        decoupled=False,
        topr_positive_weight=weights[0],
        topr_negative_weight=weights[1],
    )
    assert loss == pytest.approx(expected_loss)
    assert_grad(grad, expected_grad)
    assert metrics["clip_fraction"] == pytest.approx(expected_clip)  # the r=1.5, A<0 token


def test_kimi15_hand_values() -> None:
    # loss = -A log pi + 0.05 (ln r)^2 with (ln 1.5)^2 = 0.1644020, (ln 0.5)^2 = 0.4804530:
    # 4.5 + 2 * 0.05 * 0.1644020 + 2 * 0.05 * 0.4804530 = 4.5644855; / 5 = 0.9128971.
    # grad = (-A + 0.1 ln r) / 5: row 0: (-2 + 0.0405465) / 5, -2 / 5, (-2 - 0.0693147) / 5;
    # row 1: (1 + 0.0405465) / 5, (1 - 0.0693147) / 5.
    loss, grad, _ = run(make_inputs(), name="kimi15", decoupled=False, kimi15_tau=0.1)
    assert loss == pytest.approx(0.9128971)
    assert_grad(grad, [[-0.3918907, -0.4, -0.4138629], [0.2081093, 0.1861371, 0.0]])


# ---------------------------------------------------------------------- KL penalty

# ref - log pi = d: row 0 [-0.5, +0.5, 0], row 1 [+0.5, -0.5, pad].
REF = [[-1.0, -0.5, -2.0], [0.0, -2.5, 5.0]]


def test_k3_penalty_is_added_on_top() -> None:
    # k3 = e^d - 1 - d: 0.1065307 (d=-0.5), 0.1487213 (d=0.5), 0 (d=0);
    # token-mean (2 * 0.1065307 + 2 * 0.1487213) / 5 = 0.1021008.
    # loss = vanilla 0.9 + 0.1 * 0.1021008 = 0.9102101.
    # grad = vanilla grad + 0.1 (1 - e^d) / 5: +0.0078694 (d=-0.5), -0.0129744 (d=0.5).
    loss, grad, metrics = run(
        make_inputs(ref_logprobs=REF),
        name="vanilla",
        decoupled=False,
        kl_estimator="k3",
        kl_coef=0.1,
    )
    assert loss == pytest.approx(0.9102101)
    assert metrics["kl_loss"] == pytest.approx(0.1021008, abs=1e-6)
    assert metrics["pg_loss"] == pytest.approx(0.9)
    assert_grad(grad, [[-0.3921306, -0.4129744, -0.4], [0.1870256, 0.2078694, 0.0]])


def test_k1_is_refused_as_a_loss() -> None:
    # As a loss k1's gradient is d(log pi)/d(log pi) = 1 on every token whatever pi_ref is: zero
    # in expectation on-policy, it regularises nothing (test_kl pins this); it belongs in the reward.
    cfg = Settings(loss="vanilla", decoupled=False, kl_estimator="k1", kl_coef=0.2)
    with pytest.raises(ValueError, match=r"'k1' cannot be a loss.*\['k2', 'k3'\]"):
        compute_policy_loss(make_inputs(ref_logprobs=REF), cfg)


def test_kl_penalty_refuses_missing_ref_logprobs() -> None:
    cfg = Settings(loss="vanilla", decoupled=False, kl_estimator="k3", kl_coef=0.1)
    with pytest.raises(ValueError, match="ref_logprobs"):
        compute_policy_loss(make_inputs(), cfg)


# ------------------------------------------------------------------------ padding

_ALL_CONFIGS = [
    Settings(loss=name, decoupled=decoupled, kl_estimator="k3", kl_coef=0.1, dual_clip_c=3.0)
    for name in sorted(POLICY_LOSSES)
    for decoupled in (False, True)
]


@pytest.mark.parametrize("cfg", _ALL_CONFIGS, ids=lambda c: f"{c.loss}-decoupled={c.decoupled}")
def test_padding_contributes_nothing_even_when_it_holds_nan(cfg: Settings) -> None:
    clean = make_inputs(behaviour_weights=WEIGHTS, ref_logprobs=REF, entropy=[[1.0] * 3] * 2)
    clean_loss, clean_metrics = compute_policy_loss(clean, cfg)
    clean_loss.backward()

    dirty = make_inputs(behaviour_weights=WEIGHTS, ref_logprobs=REF, entropy=[[1.0] * 3] * 2)
    with torch.no_grad():
        dirty.logprobs[1, 2] = float("nan")
    for tensor, value in (
        (dirty.behaviour_logprobs, float("-inf")),
        (dirty.prox_logprobs, float("inf")),
        (dirty.advantages, float("nan")),
        (dirty.ref_logprobs, float("nan")),
        (dirty.entropy, float("inf")),
    ):
        assert tensor is not None
        tensor[1, 2] = value
    dirty_loss, dirty_metrics = compute_policy_loss(dirty, cfg)
    dirty_loss.backward()

    assert dirty_loss.item() == pytest.approx(clean_loss.item())
    assert dirty_metrics == pytest.approx(clean_metrics)
    assert dirty.logprobs.grad is not None and clean.logprobs.grad is not None
    torch.testing.assert_close(dirty.logprobs.grad, clean.logprobs.grad)
    assert dirty.logprobs.grad[1, 2].item() == 0.0


def test_a_batch_without_real_tokens_gives_zero_loss_in_the_graph() -> None:
    inputs = make_inputs()
    inputs.mask = torch.zeros(2, 3)
    loss, grad, metrics = run(inputs, name="ppo", decoupled=False)
    assert loss == 0.0
    assert grad == [[0.0] * 3] * 2
    assert all(math.isfinite(v) for v in metrics.values())


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_empty_rows_do_not_change_any_aggregation(mode: str) -> None:
    loss_mat = torch.tensor([[1.0, 3.0], [5.0, 7.0]])
    one_row = aggregate_loss(loss_mat[:1], torch.tensor([[1.0, 1.0]]), mode)
    with_empty = aggregate_loss(loss_mat, torch.tensor([[1.0, 1.0], [0.0, 0.0]]), mode)
    assert with_empty.item() == one_row.item() == (2.0 if mode != "seq-mean-token-sum" else 4.0)


# ------------------------------------------------------------------- on-policy


def test_on_policy_decoupled_ppo_equals_ppo_and_every_gradient_equals_vanilla() -> None:
    # All log-probs equal: r = 1, behaviour weight 1, nothing clipped. Every variant's
    # gradient reduces to REINFORCE's -A / 5.
    def on_policy() -> LossInputs:
        return make_inputs(ratios=[[1.0] * 3] * 2, behaviour_weights=[[1.0] * 3] * 2)

    vanilla_loss, vanilla_grad, _ = run(on_policy(), name="vanilla", decoupled=False)
    ppo_loss, ppo_grad, ppo_metrics = run(on_policy(), name="ppo", decoupled=False)
    dec_loss, dec_grad, dec_metrics = run(on_policy(), name="ppo", decoupled=True)
    assert dec_loss == pytest.approx(ppo_loss)
    assert dec_metrics == pytest.approx(
        ppo_metrics
        | {
            "importance_weight_mean": 1.0,
            "behaviour_ratio_mean": 1.0,
            "behaviour_ratio_max": 1.0,
            "behaviour_weight_clamped_fraction": 0.0,
        }
    )
    assert_grad(ppo_grad, vanilla_grad)
    assert_grad(dec_grad, vanilla_grad)
    assert_grad(vanilla_grad, [[-0.4] * 3, [0.2, 0.2, 0.0]])
    for name in ("tis", "topr", "cispo", "kimi15"):
        _, grad, metrics = run(on_policy(), name=name)
        assert_grad(grad, vanilla_grad)
        assert metrics["clip_fraction"] == 0.0
    assert vanilla_loss == pytest.approx(0.9)


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.floats(-8, -0.01), min_size=6, max_size=6),
    st.lists(st.floats(-3, 3), min_size=2, max_size=2),
    st.sampled_from(["ppo", "tis", "cispo", "topr"]),
)
def test_ratio_one_gives_zero_clip_fraction(
    logprobs: list[float], advantages: list[float], name: str
) -> None:
    lp = torch.tensor(logprobs).reshape(2, 3)
    inputs = LossInputs(
        logprobs=lp.clone().requires_grad_(),
        behaviour_logprobs=lp.clone(),
        advantages=torch.tensor(advantages).reshape(2, 1).expand(2, 3),
        mask=torch.tensor(MASK),
        prox_logprobs=lp.clone(),
    )
    _, metrics = compute_policy_loss(inputs, Settings(loss=name, dual_clip_c=3.0))
    assert metrics["clip_fraction"] == 0.0
    assert metrics["ratio_mean"] == pytest.approx(1.0)
    assert metrics["importance_weight_mean"] == pytest.approx(1.0)


# ---------------------------------------------------------------- configuration


def test_entropy_mean_over_real_tokens() -> None:
    entropy = [[1.0, 2.0, 3.0], [4.0, 5.0, 100.0]]
    _, _, metrics = run(make_inputs(entropy=entropy), name="vanilla", decoupled=False)
    assert metrics["entropy_mean"] == pytest.approx(3.0)  # (1 + 2 + 3 + 4 + 5) / 5


def test_unknown_names_list_the_allowed_ones() -> None:
    allowed = r"\['cispo', 'kimi15', 'ppo', 'tis', 'topr', 'vanilla'\]"
    with pytest.raises(ValueError) as refused:
        AlgorithmConfig(loss="grpo")
    assert all(f"'{name}'" in str(refused.value) for name in POLICY_LOSSES)
    with pytest.raises(ValueError, match=allowed):
        get_policy_loss("grpo")
    with pytest.raises(ValueError, match="k1"):
        AlgorithmConfig(kl_estimator="k9")
    with pytest.raises(ValueError, match="token-mean"):
        AlgorithmConfig(aggregation="sum")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "bad",
    [
        {"clip_eps_low": 1.5},
        {"clip_eps_high": -0.1},
        {"dual_clip_c": 1.0},
        {"behaviour_weight_cap": 0.5},
        {"behaviour_weight_mode": "drop"},
        {"tis_cap": 0.0},
        {"topr_negative_weight": -1.0},
        {"cispo_eps_low": 2.0},
        {"kimi15_tau": -0.1},
        {"kl_coef": 0.1},  # a coefficient without an estimator would be silently ignored
        {"kl_coef": -0.1, "kl_estimator": "k3"},
    ],
)
def test_invalid_configs_are_refused(bad: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        AlgorithmConfig(**bad)  # type: ignore[arg-type]


def test_mismatched_shapes_are_refused() -> None:
    inputs = make_inputs()
    inputs.advantages = torch.tensor([2.0, -1.0])
    with pytest.raises(ValueError, match="advantages"):
        compute_policy_loss(inputs, Settings(decoupled=False))


def test_only_logprobs_receive_gradient() -> None:
    inputs = make_inputs(behaviour_weights=WEIGHTS, ref_logprobs=REF)
    for name in ("behaviour_logprobs", "advantages", "prox_logprobs", "ref_logprobs"):
        setattr(inputs, name, getattr(inputs, name).clone().requires_grad_())
    loss, _ = compute_policy_loss(inputs, Settings(kl_estimator="k3", kl_coef=0.1))
    loss.backward()
    assert inputs.logprobs.grad is not None
    assert inputs.behaviour_logprobs.grad is None and inputs.advantages.grad is None
    assert inputs.prox_logprobs is not None and inputs.prox_logprobs.grad is None
    assert inputs.ref_logprobs is not None and inputs.ref_logprobs.grad is None


# ----------------------------------------------------------- tokens never trained
# Each of these failed before: a NaN behaviour weight made the loss NaN, a k1 loss was accepted,
# a token past the +-20 log-ratio clamp added e^20 |A| to the loss, silently without gradient.


@pytest.mark.parametrize(
    ("mode", "expected_loss", "expected_grad"),
    [
        # Decoupled PPO with WEIGHTS, cap 3; token (0, 1) (r = 1, w = 2: loss -4, grad -0.8) is
        # dropped. mask: (-2.4 - 0.5 + 0 + 0.8) / 5 = -0.42 (the w = 4 token is masked as before).
        ("mask", -0.42, [[0.0, 0.0, -0.1], [0.0, 0.0, 0.0]]),
        # clamp: (-2.4 - 0.5 + 4.5 + 0.8) / 5 = 0.48.
        ("clamp", 0.48, [[0.0, 0.0, -0.1], [0.9, 0.0, 0.0]]),
    ],
)
@pytest.mark.parametrize("where", ["both", "prox", "behaviour"])
def test_a_non_finite_log_prob_masks_its_token(
    mode: str, expected_loss: float, expected_grad: list[list[float]], where: str
) -> None:
    inputs = make_inputs(behaviour_weights=WEIGHTS)
    assert inputs.prox_logprobs is not None
    if where in ("both", "prox"):
        inputs.prox_logprobs[0, 1] = float("-inf")
    if where in ("both", "behaviour"):
        inputs.behaviour_logprobs[0, 1] = float("-inf")  # both: -inf - (-inf) = NaN
    loss, grad, metrics = run(inputs, name="ppo", behaviour_weight_cap=3.0, behaviour_weight_mode=mode)
    assert loss == pytest.approx(expected_loss)
    assert_grad(grad, expected_grad)
    assert metrics["nonfinite_fraction"] == pytest.approx(0.2)
    assert all(math.isfinite(v) for v in metrics.values())


def test_a_nan_behaviour_log_prob_is_masked_in_the_coupled_loss_too() -> None:
    # vanilla, anchored on pi_behav: the token losses are 1, 2, 4, -0.5, -2; (0, 1) is dropped:
    # (1 + 4 - 0.5 - 2) / 5 = 0.5.
    inputs = make_inputs()
    inputs.behaviour_logprobs[0, 1] = float("nan")
    loss, grad, metrics = run(inputs, name="vanilla", decoupled=False)
    assert loss == pytest.approx(0.5)
    assert_grad(grad, [[-0.4, 0.0, -0.4], [0.2, 0.2, 0.0]])
    assert metrics["nonfinite_fraction"] == pytest.approx(0.2)
    assert all(math.isfinite(v) for v in metrics.values())


@pytest.mark.parametrize("log_ratio", [25.0, -25.0])
def test_a_token_past_the_log_ratio_bound_is_masked_and_counted(log_ratio: float) -> None:
    # Token (1, 0) (A = -1) gets log(pi_theta / pi_behav) = +-25. PPO over the other four:
    # (-2.4 - 2 - 1 + 0.8) / 5 = -0.92; ratio_mean over the scored (1.5 + 1 + 0.5 + 0.5) / 4.
    ratios = [[1.5, 1.0, 0.5], [math.exp(log_ratio), 0.5, 7.0]]
    loss, grad, metrics = run(make_inputs(ratios=ratios), name="ppo", decoupled=False)
    assert loss == pytest.approx(-0.92)
    assert_grad(grad, [[0.0, -0.4, -0.2], [0.0, 0.0, 0.0]])
    assert metrics["out_of_range_fraction"] == pytest.approx(0.2)
    assert metrics["ratio_mean"] == pytest.approx(0.875)
    assert metrics["clip_fraction"] == pytest.approx(0.4)


def test_the_log_ratio_bound_masks_the_token_for_every_loss() -> None:
    # vanilla ignores the ratio; the token is not trained all the same (the rule is per token).
    ratios = [[1.5, 1.0, 0.5], [math.exp(25.0), 0.5, 7.0]]
    loss, grad, metrics = run(make_inputs(ratios=ratios), name="vanilla", decoupled=False)
    assert loss == pytest.approx((1 + 2 + 4 - 2) / 5)
    assert_grad(grad, [[-0.4, -0.4, -0.4], [0.0, 0.2, 0.0]])
    assert metrics["out_of_range_fraction"] == pytest.approx(0.2)


# ------------------------------------------------------------ mismatch corrections

# PPO token losses against pi_prox (RATIOS): [-2.4, -2, -1], [1.5, 0.8]; their gradients
# [0, -2, -1], [1.5, 0]; WEIGHTS pi_prox / pi_behav: [1, 2, 0.5], [4, 1]. Loss = sum(w * l) / 5.


@pytest.mark.parametrize(
    ("settings_", "expected_loss", "expected_grad", "masked", "clamped"),
    [
        # Sequence products 1 and 4. mask at 3: row 1 dropped: (-2.4 - 2 - 1) / 5.
        ({"behaviour_weight_level": "sequence"}, -1.08, [[0.0, -0.4, -0.2], [0.0, 0.0, 0.0]], 0.4, 0.0),
        # clamp at 3: row 1 weighs 3: (-5.4 + 4.5 + 2.4) / 5 = 0.3.
        (
            {"behaviour_weight_level": "sequence", "behaviour_weight_mode": "clamp"},
            0.3,
            [[0.0, -0.4, -0.2], [0.9, 0.0, 0.0]],
            0.0,
            0.4,
        ),
        # Geometric means 1 and 2, inside the band: (-5.4 + 3 + 1.6) / 5 = -0.16.
        ({"behaviour_weight_level": "geometric"}, -0.16, [[0.0, -0.4, -0.2], [0.6, 0.0, 0.0]], 0.0, 0.0),
        # IcePop band [0.6, 3]: w = 0.5 and w = 4 masked: (-2.4 - 4 + 0.8) / 5 = -1.12.
        ({"behaviour_weight_floor": 0.6}, -1.12, [[0.0, -0.8, 0.0], [0.0, 0.0, 0.0]], 0.4, 0.0),
        # Truncation into [0.6, 3]: weights 1, 2, 0.6, 3, 1: (-2.4 - 4 - 0.6 + 4.5 + 0.8) / 5.
        (
            {"behaviour_weight_floor": 0.6, "behaviour_weight_mode": "clamp"},
            -0.34,
            [[0.0, -0.8, -0.12], [0.9, 0.0, 0.0]],
            0.0,
            0.4,
        ),
    ],
)
def test_corrections_compose_with_decoupled_ppo(
    settings_: dict[str, object], expected_loss: float, expected_grad: list[list[float]], masked: float, clamped: float
) -> None:
    loss, grad, metrics = run(make_inputs(behaviour_weights=WEIGHTS), name="ppo", behaviour_weight_cap=3.0, **settings_)
    assert loss == pytest.approx(expected_loss)
    assert_grad(grad, expected_grad)
    assert metrics["masked_fraction"] == pytest.approx(masked)
    assert metrics["behaviour_weight_clamped_fraction"] == pytest.approx(clamped)


def test_correction_metrics_describe_the_ratio_before_the_band() -> None:
    # Sequence level: ratios 1, 1, 1, 4, 4 (mean 2.2, max 4); weights after the mask 1, 1, 1, 0, 0.
    _, _, metrics = run(
        make_inputs(behaviour_weights=WEIGHTS), name="ppo", behaviour_weight_cap=3.0, behaviour_weight_level="sequence"
    )
    assert metrics["behaviour_ratio_mean"] == pytest.approx(2.2)
    assert metrics["behaviour_ratio_max"] == pytest.approx(4.0)
    assert metrics["importance_weight_mean"] == pytest.approx(0.6)


@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
def test_a_sequence_mask_removes_every_token_of_the_sequence_for_every_loss(name: str) -> None:
    # Row 1's product 4 is above the cap: none of its tokens may move, whatever the loss.
    _, grad, _ = run(
        make_inputs(behaviour_weights=WEIGHTS), name=name, behaviour_weight_cap=3.0, behaviour_weight_level="sequence"
    )
    assert grad[1] == [0.0, 0.0, 0.0]
    assert any(g != 0.0 for g in grad[0])


# ---------------------------------------------------- KL: clamp and importance weight


def test_k3_penalty_past_the_clamp_counts_and_has_no_gradient() -> None:
    # Token (0, 0): d = -12 + 0.5 = -11.5, k3 = e^-11.5 - 1 + 11.5 > 10 -> 10, no gradient.
    # Others as in test_k3_penalty_is_added_on_top: 0.1487213 (x2), 0.1065307, 0.
    # kl_loss = (10 + 2 * 0.1487213 + 0.1065307) / 5 = 2.0807947; loss 0.9 + 0.1 * 2.0807947.
    ref = [[-12.0, -0.5, -2.0], [0.0, -2.5, 5.0]]
    loss, grad, metrics = run(
        make_inputs(ref_logprobs=ref), name="vanilla", decoupled=False, kl_estimator="k3", kl_coef=0.1
    )
    assert metrics["kl_loss"] == pytest.approx(2.0807947, abs=1e-6)
    assert loss == pytest.approx(1.1080795, abs=1e-6)
    assert metrics["kl_clamped_fraction"] == pytest.approx(0.2)
    assert_grad(grad, [[-0.4, -0.4129744, -0.4], [0.1870256, 0.2078694, 0.0]])


def test_importance_weighted_k3_penalty_hand_values() -> None:
    # On-policy w.r.t. pi_prox (r = 1, as in one optimizer step per train step), behaviour
    # weights w = [1, 2, 0.5], [2, 1]; d = ref - log pi: [-0.5, 0.5, 0], [0.5, -0.5].
    # vanilla, decoupled: -w A log pi = 1, 4, 2, -1, -2 -> pg_loss 4 / 5 = 0.8; grad -w A / 5.
    # KL value w * k3: 0.1065307, 2 * 0.1487213, 0, 2 * 0.1487213, 0.1065307 -> 0.8079466 / 5.
    # KL gradient per token w * (log pi - ref) = w * -d: 0.5, -1, 0, -1, 0.5 (the reverse KL's,
    # where plain k3 would give 1 - e^d); times 0.1 / 5.
    weights = [[1.0, 2.0, 0.5], [2.0, 1.0, 1.0]]
    loss, grad, metrics = run(
        make_inputs(ratios=[[1.0] * 3] * 2, behaviour_weights=weights, ref_logprobs=REF),
        name="vanilla",
        kl_estimator="k3",
        kl_coef=0.1,
        kl_importance_weight=True,
    )
    assert metrics["pg_loss"] == pytest.approx(0.8)
    assert metrics["kl_loss"] == pytest.approx(0.1615893, abs=1e-6)
    assert loss == pytest.approx(0.8161589, abs=1e-6)
    assert_grad(grad, [[-0.39, -0.82, -0.2], [0.38, 0.21, 0.0]])


def test_importance_weighted_kl_drops_masked_tokens() -> None:
    # The w = 4 token is masked by the cap of 3: it carries neither policy loss nor KL.
    # kl_loss = (1 * 0.1065307 + 2 * 0.1487213 + 0.5 * 0 + 0 + 1 * 0.1065307) / 5 = 0.1021008.
    _, grad, metrics = run(
        make_inputs(ratios=[[1.0] * 3] * 2, behaviour_weights=WEIGHTS, ref_logprobs=REF),
        name="vanilla",
        behaviour_weight_cap=3.0,
        kl_estimator="k3",
        kl_coef=0.1,
        kl_importance_weight=True,
    )
    assert grad[1][0] == 0.0
    assert metrics["kl_loss"] == pytest.approx(0.1021008, abs=1e-6)


def test_kl_importance_weight_needs_the_decoupled_loss() -> None:
    cfg = Settings(loss="vanilla", decoupled=False, kl_estimator="k3", kl_coef=0.1, kl_importance_weight=True)
    with pytest.raises(ValueError, match="decoupled"):
        compute_policy_loss(make_inputs(ref_logprobs=REF), cfg)


def test_an_unknown_correction_level_is_refused() -> None:
    with pytest.raises(ValueError, match="episode"):
        compute_policy_loss(make_inputs(behaviour_weights=WEIGHTS), Settings(behaviour_weight_level="episode"))
