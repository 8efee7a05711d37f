"""A megatron-core GPTModel built from an HF Llama/Qwen2 computes the HF model's log-probs and gradients (fp32, CPU).

For each model: its weights load into a ``GPTModel`` and gather back bit-exact; on a right-padded
batch of rows with different prompt and response lengths, megatron's response log-probs and
entropies match HF's (max abs diff below 1e-4); and the gradient of a weighted sum of log-probs,
gathered back to HF names, matches HF's (max abs diff per tensor below 2e-5 of that tensor's
largest gradient: measured here up to 8.8e-6, on layer 0's q_proj of the 4-layer shipped model at
tensor parallel 2, float32 rounding accumulated through the backward). Tensor parallel 1 runs in
this process; tensor parallel 2 in two gloo processes forked from the fork server.

The HF reference is computed here from the full logits, not through ``engines.shared.microbatch``,
so the index arithmetic of the batch is checked too.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

pytest.importorskip("megatron.core", reason="megatron-core is an optional extra: pip install tandem[megatron]")

import torch
import torch.multiprocessing as mp
from test_megatron_convert import hf_model

from tandem.engines.trainers.megatron.convert import build_gpt_model, gather_hf_tensors, load_hf_weights
from tandem.engines.trainers.megatron.model import response_logprobs
from tandem.engines.trainers.megatron.parallel import model_parallel
from tandem.param_sync import unique_weights

CPU = torch.device("cpu")
TEMPERATURE = 0.7
# (prompt, response) lengths: different prompts and responses, so rows are padded differently.
ROW_LENGTHS = [(5, 4), (3, 6), (7, 2)]
LOGP_TOLERANCE = 1e-4
GRAD_TOLERANCE = 2e-5  # relative to each tensor's largest HF gradient


@dataclass(slots=True)
class RightPaddedBatch:
    """The ``ResponseBatch`` shape (``engines.shared.microbatch.collate``'s), built here for the test."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    logits_to_keep: int
    gather_index: torch.Tensor
    response_ids: torch.Tensor
    mask: torch.Tensor


def right_padded_batch(vocab_size: int, seed: int = 0) -> tuple[RightPaddedBatch, list[tuple[list[int], list[int]]]]:
    """Random (prompt, response) rows of ``ROW_LENGTHS``, right-padded; only the positions from the
    shortest prompt's last token on are 'kept', as ``collate`` does."""
    rng = random.Random(seed)
    rows = [
        ([rng.randrange(vocab_size) for _ in range(p)], [rng.randrange(vocab_size) for _ in range(r)]) for p, r in ROW_LENGTHS
    ]
    length = max(len(p) + len(r) for p, r in rows)
    longest = max(len(r) for _, r in rows)
    input_ids = torch.zeros(len(rows), length, dtype=torch.long)
    attention_mask = torch.zeros(len(rows), length, dtype=torch.long)
    response_ids = torch.zeros(len(rows), longest, dtype=torch.long)
    mask = torch.zeros(len(rows), longest)
    for b, (p, r) in enumerate(rows):
        input_ids[b, : len(p) + len(r)] = torch.tensor(p + r)
        attention_mask[b, : len(p) + len(r)] = 1
        response_ids[b, : len(r)] = torch.tensor(r)
        mask[b, : len(r)] = 1.0
    first = min(len(p) for p, _ in rows) - 1
    keep = length - first
    gather_index = (torch.tensor([len(p) for p, _ in rows]).unsqueeze(1) - 1 - first + torch.arange(longest)).clamp(max=keep - 1)
    return RightPaddedBatch(input_ids, attention_mask, keep, gather_index, response_ids, mask), rows


def hf_logprobs(
    model: torch.nn.Module, batch: RightPaddedBatch, rows: list[tuple[list[int], list[int]]]
) -> tuple[torch.Tensor, torch.Tensor]:
    """log_softmax(logits / T) of each response token at the position before it, and the entropy there."""
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    logp = torch.log_softmax(logits.float() / TEMPERATURE, dim=-1)
    token_logp = torch.zeros_like(batch.mask)
    entropy = torch.zeros_like(batch.mask)
    for b, (prompt, response) in enumerate(rows):
        for j, token in enumerate(response):
            position = len(prompt) - 1 + j
            token_logp[b, j] = logp[b, position, token]
            entropy[b, j] = -(logp[b, position].exp() * logp[b, position]).sum().detach()
    return token_logp, entropy


@dataclass(frozen=True, slots=True)
class Parity:
    """How one process's megatron model compares with the HF model it was converted from."""

    weights_exact: bool  # loaded and gathered back: same names, bit-identical tensors
    logp_diff: float  # max abs difference of response log-probs
    entropy_diff: float
    grad_diff: float  # max over tensors of max abs gradient difference / max abs HF gradient


def measure_parity(hf: torch.nn.Module) -> Parity:
    """Convert ``hf`` into this rank's GPTModel and compare weights, log-probs and gradients."""
    gpt, layout = build_gpt_model(hf.config, dtype=torch.float32, device=CPU)
    load_hf_weights(gpt, hf.state_dict(), layout)
    expected = unique_weights(hf)
    gathered = dict(gather_hf_tensors(dict(gpt.named_parameters()), layout))
    weights_exact = gathered.keys() == expected.keys() and all(torch.equal(gathered[k], v) for k, v in expected.items())

    batch, rows = right_padded_batch(hf.config.vocab_size)
    hf_logp, hf_entropy = hf_logprobs(hf, batch, rows)
    logp, entropy = response_logprobs(gpt, batch, TEMPERATURE)
    # A weighted sum with signs, like a policy-gradient loss: every token's gradient counts.
    weights = torch.randn(batch.mask.shape, generator=torch.Generator().manual_seed(1)) * batch.mask
    (weights * hf_logp).sum().backward()
    (weights * logp).sum().backward()
    hf_grads = {name: p.grad for name, p in hf.named_parameters()}
    grads = dict(gather_hf_tensors({name: p.grad for name, p in gpt.named_parameters()}, layout))
    grad_diff = max(float((grads[n] - hf_grads[n]).abs().max() / hf_grads[n].abs().max()) for n in expected)
    return Parity(
        weights_exact=weights_exact,
        logp_diff=float((logp - hf_logp).detach().abs().max()),
        entropy_diff=float((entropy - hf_entropy).abs().max()),
        grad_diff=grad_diff,
    )


# ---------------------------------------------------------------- tensor parallel 1, in this process


@pytest.fixture(scope="module")
def megatron_world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    rendezvous = tmp_path_factory.mktemp("megatron_tp1") / "rendezvous"
    with model_parallel(rank=0, world_size=1, init_method=f"file://{rendezvous}", tensor_parallel_size=1, seed=0, device=CPU):
        yield


@pytest.fixture(scope="module", params=["llama_tied", "qwen2", "llama3_rope", "shipped"])
def tp1_parity(request: pytest.FixtureRequest, megatron_world: None) -> Parity:
    return measure_parity(hf_model(request.param))


def test_weights_load_and_gather_back_bit_exact(tp1_parity: Parity) -> None:
    assert tp1_parity.weights_exact


def test_logprobs_and_entropy_match_hf(tp1_parity: Parity) -> None:
    assert tp1_parity.logp_diff < LOGP_TOLERANCE
    assert tp1_parity.entropy_diff < LOGP_TOLERANCE


def test_gradients_match_hf(tp1_parity: Parity) -> None:
    assert tp1_parity.grad_diff < GRAD_TOLERANCE


def test_logprobs_are_zero_past_each_response(megatron_world: None) -> None:
    hf = hf_model("qwen2")
    gpt, layout = build_gpt_model(hf.config, dtype=torch.float32, device=CPU)
    load_hf_weights(gpt, hf.state_dict(), layout)
    batch, _ = right_padded_batch(hf.config.vocab_size)
    with torch.no_grad():
        logp, entropy = response_logprobs(gpt, batch, TEMPERATURE)
    padding = batch.mask == 0
    assert padding.any()
    assert (logp[padding] == 0).all() and (entropy[padding] == 0).all()
    assert (logp[~padding] < 0).all() and (entropy[~padding] > 0).all()


# ---------------------------------------------------------------- tensor parallel 2, two gloo processes

TP2_MODELS = ["llama_tied", "qwen2", "shipped"]


def _tp2_rank(rank: int, rendezvous: str, results: mp.SimpleQueue) -> None:
    torch.set_num_threads(1)  # two ranks on a shared 2-core machine
    with model_parallel(rank=rank, world_size=2, init_method=rendezvous, tensor_parallel_size=2, seed=0, device=CPU):
        parity = {name: measure_parity(hf_model(name)) for name in TP2_MODELS}
    results.put((rank, parity))


@pytest.fixture(scope="module")
def tp2_parity(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict[str, Parity]]:
    """Each rank's parity per model; ``start_processes`` raises, with the rank's traceback, if a rank fails.

    The ranks fork from the fork server, as a trainer group's do (``engines.trainers.group``): each
    spawned rank spent 5 CPU-s importing this module (torch, megatron, transformers) before any
    work. The server imports it once, unless a trainer group started the server first (its modules
    then are torch's and transformers', which the ranks need too)."""
    rendezvous = f"file://{Path(tmp_path_factory.mktemp('megatron_tp2')) / 'rendezvous'}"
    context = mp.get_context("forkserver")
    # This module, and the architectures its models build (from_config imports them on first use).
    architectures = ["transformers.models.llama.modeling_llama", "transformers.models.qwen2.modeling_qwen2"]
    context.set_forkserver_preload([__name__, *architectures])  # no effect once the server runs
    results = context.SimpleQueue()
    mp.start_processes(_tp2_rank, args=(rendezvous, results), nprocs=2, join=True, start_method="forkserver")
    return dict(results.get() for _ in range(2))


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("name", TP2_MODELS)
def test_tp2_shards_load_and_gather_back_bit_exact(tp2_parity: dict[int, dict[str, Parity]], name: str) -> None:
    assert all(tp2_parity[rank][name].weights_exact for rank in (0, 1))


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("name", TP2_MODELS)
def test_tp2_logprobs_match_hf_on_every_rank(tp2_parity: dict[int, dict[str, Parity]], name: str) -> None:
    for rank in (0, 1):
        assert tp2_parity[rank][name].logp_diff < LOGP_TOLERANCE
        assert tp2_parity[rank][name].entropy_diff < LOGP_TOLERANCE


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("name", TP2_MODELS)
def test_tp2_gradients_match_hf(tp2_parity: dict[int, dict[str, Parity]], name: str) -> None:
    for rank in (0, 1):
        assert tp2_parity[rank][name].grad_diff < GRAD_TOLERANCE
