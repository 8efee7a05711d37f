"""HFRolloutEngine: continuous batching, sampling controls, and weight updates between decode steps."""

from __future__ import annotations

import asyncio
import warnings
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from tiny_lm import EOS_ID, decode, encode

from tandem.core.protocols import GenerationRequest, RolloutEngine, SamplingParams
from tandem.core.records import FinishReason, ResumePolicy, Trajectory
from tandem.engines.text.rollout import EngineClosedError, HFRolloutEngine
from tandem.engines.trainers.torch_train import TorchLogProbEngine
from tandem.param_sync import SyncError
from tests.unit.engines.weights_for_tests import push, push_from_inside_a_step

PROMPTS = ["1+2=", "34+5=", "6=", "78+90=", "b", "12+3=", "c+d=", "4"]


def requests(max_new: Sequence[int], *, continued: bool = False, **params: Any) -> list[GenerationRequest]:
    """One request per prompt, with various lengths so rows join and leave mid-batch."""
    return [
        GenerationRequest(
            prompt_id=i,
            index=0,
            prompt_ids=encode(PROMPTS[i % len(PROMPTS)]),
            params=SamplingParams(max_new_tokens=n, **params),
            seed=7,
            continued=continued,
        )
        for i, n in enumerate(max_new)
    ]


async def collect(stream: AsyncIterator[Trajectory]) -> list[Trajectory]:
    return sorted([s async for s in stream], key=lambda s: (s.prompt_id, s.index))


def max_gap(a: Sequence[float], b: Sequence[float]) -> float:
    assert len(a) == len(b)
    return max((abs(x - y) for x, y in zip(a, b, strict=True)), default=0.0)


@pytest.fixture
async def engine(model_dir: Path) -> AsyncIterator[HFRolloutEngine]:
    async with HFRolloutEngine(str(model_dir), max_batch_size=3) as eng:
        yield eng


@pytest.fixture
async def scorer(model_dir: Path) -> AsyncIterator[TorchLogProbEngine]:
    async with TorchLogProbEngine(str(model_dir)) as eng:
        yield eng


def test_implements_protocol(engine: HFRolloutEngine) -> None:
    assert isinstance(engine, RolloutEngine)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
async def test_logprobs_match_the_trainer_including_rows_that_joined_mid_batch(
    model_dir: Path, engine: HFRolloutEngine, temperature: float
) -> None:
    # 8 requests through 3 slots: most join a running batch after a shorter row left it.
    samples = await collect(engine.generate(requests([4, 11, 7, 16, 5, 9, 13, 6], temperature=temperature)))
    async with TorchLogProbEngine(str(model_dir), temperature=temperature) as scorer:
        recomputed = await scorer.logprobs(samples)
    for sample, logprobs in zip(samples, recomputed, strict=True):
        assert sample.versions == [0] * sample.num_actions
        assert sample.start_version == 0 and sample.resumed is None
        assert max_gap(sample.behaviour_logprobs, logprobs) < 1e-4


@pytest.mark.parametrize("params", [{}, {"top_p": 0.8}, {"top_k": 3, "temperature": 0.8}])
async def test_continuous_batching_samples_what_one_at_a_time_samples(
    model_dir: Path, engine: HFRolloutEngine, params: dict[str, Any]
) -> None:
    reqs = requests([4, 11, 7, 16, 5, 9, 13, 6], **params)
    batched = await collect(engine.generate(reqs))
    async with HFRolloutEngine(str(model_dir), max_batch_size=1) as alone:
        one_by_one = [(await collect(alone.generate([r])))[0] for r in reqs]
    assert [s.payload.response_ids for s in batched] == [s.payload.response_ids for s in one_by_one]
    for a, b in zip(batched, one_by_one, strict=True):
        assert max_gap(a.behaviour_logprobs, b.behaviour_logprobs) < 1e-4


async def test_samples_of_a_group_differ_under_one_seed(engine: HFRolloutEngine) -> None:
    group = [
        GenerationRequest(prompt_id=0, index=i, prompt_ids=encode("1+2="), params=SamplingParams(max_new_tokens=8))
        for i in range(4)
    ]
    samples = await collect(engine.generate(group))
    assert [s.index for s in samples] == [0, 1, 2, 3]
    assert len({tuple(s.payload.response_ids) for s in samples}) == 4


async def test_top_k_one_is_greedy(engine: HFRolloutEngine) -> None:
    [sample] = await collect(engine.generate(requests([10], top_k=1)))
    with torch.no_grad():  # the engine is idle: its model can be borrowed for a reference forward
        logits = engine.model(torch.tensor([sample.payload.prompt_ids + sample.payload.response_ids])).logits[0]
    prompt_len = len(sample.payload.prompt_ids)
    assert sample.payload.response_ids == logits[prompt_len - 1 : -1].argmax(-1).tolist()


@pytest.mark.parametrize("params", [{"top_k": 3}, {"top_p": 0.6}, {"top_k": 4, "top_p": 0.8}])
async def test_behaviour_log_probs_are_the_truncated_distributions(
    engine: HFRolloutEngine, scorer: TorchLogProbEngine, params: dict[str, Any]
) -> None:
    # Sampled from a truncated distribution, a token's behaviour log-prob is its full log-prob
    # minus the log of the kept mass (a true importance ratio against pi_prox), never the full one.
    [sample] = await collect(engine.generate(requests([12], **params)))
    [full] = await scorer.logprobs([sample])
    with torch.no_grad():
        logits = engine.model(torch.tensor([sample.payload.prompt_ids + sample.payload.response_ids])).logits[0]
    prompt_len = len(sample.payload.prompt_ids)
    for t, (behaviour, logprob) in enumerate(zip(sample.behaviour_logprobs, full, strict=True)):
        probs = torch.softmax(logits[prompt_len - 1 + t].float(), -1).sort(descending=True).values
        keep = torch.arange(len(probs)) < params.get("top_k", len(probs))
        keep &= probs.cumsum(0) - probs < params.get("top_p", 1.0)
        assert behaviour == pytest.approx(logprob - float(probs[keep].sum().log()), abs=1e-4)
        assert behaviour >= logprob - 1e-6  # renormalised over fewer tokens: never less likely
    assert max(b - f for b, f in zip(sample.behaviour_logprobs, full, strict=True)) > 1e-3  # the filter bit


async def test_unfiltered_behaviour_log_probs_are_the_full_distributions(
    engine: HFRolloutEngine, scorer: TorchLogProbEngine
) -> None:
    [sample] = await collect(engine.generate(requests([12])))
    [full] = await scorer.logprobs([sample])
    assert max_gap(sample.behaviour_logprobs, full) < 1e-4


async def test_max_new_tokens_and_stop_strings(engine: HFRolloutEngine) -> None:
    [free] = await collect(engine.generate(requests([1, 20])[1:]))
    assert free.finish_reason is FinishReason.LENGTH and free.num_actions == 20
    assert free.payload.text == decode(free.payload.response_ids)
    [single] = await collect(engine.generate(requests([1])))
    assert single.finish_reason is FinishReason.LENGTH and single.num_actions == 1

    # Same seed, same tokens: a stop string taken from the free-running text cuts it there,
    # at the token that completes it (the stop string stays in the text, token-aligned).
    stop = free.payload.text[5:7]
    [stopped] = await collect(engine.generate(requests([1, 20], stop=("zz", stop))[1:]))
    n = stopped.num_actions
    assert stopped.finish_reason is FinishReason.STOP and n < 20
    assert stopped.payload.response_ids == free.payload.response_ids[:n]
    assert stopped.behaviour_logprobs == free.behaviour_logprobs[:n]
    assert stopped.payload.text.endswith(stop) and stop not in decode(stopped.payload.response_ids[:-1])


async def test_decoding_passes_the_cache_by_transformers_current_name(engine: HFRolloutEngine) -> None:
    # The deprecated ``past_key_values`` warns on every forward, and stops working in transformers 5.40.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        await collect(engine.generate(requests([5, 9, 3])))
    assert [str(w.message) for w in caught if "past_key_values" in str(w.message)] == []


async def test_eos_stops_a_sequence(eos_model_dir: Path) -> None:
    async with HFRolloutEngine(str(eos_model_dir), max_batch_size=4) as eng:
        samples = await collect(eng.generate(requests([30] * 8)))
    stopped = [s for s in samples if s.finish_reason is FinishReason.STOP]
    assert stopped, "expected some of 8 x 30 draws over 20 tokens to hit eos"
    for s in samples:
        if s.finish_reason is FinishReason.STOP:
            assert s.payload.response_ids[-1] == EOS_ID and EOS_ID not in s.payload.response_ids[:-1]
        else:
            assert EOS_ID not in s.payload.response_ids and s.num_actions == 30


async def test_concurrent_generate_calls_share_the_batch(engine: HFRolloutEngine) -> None:
    reqs = requests([6, 9, 12, 5])
    first, second = await asyncio.gather(collect(engine.generate(reqs[:2])), collect(engine.generate(reqs[2:])))
    together = await collect(engine.generate(reqs))
    assert [s.payload.response_ids for s in first + second] == [s.payload.response_ids for s in together]


async def test_closing_a_stream_early_drops_its_requests(engine: HFRolloutEngine) -> None:
    stream = engine.generate(requests([2, 400, 400, 400]))
    first = await anext(stream)
    assert first.num_actions == 2
    await stream.aclose()  # the long rows leave the batch at the next step boundary
    forwards = 0

    def count(*_: object) -> None:
        nonlocal forwards
        forwards += 1

    engine.model.register_forward_hook(count)
    [after] = await collect(engine.generate(requests([3])))
    assert after.num_actions == 3
    assert forwards < 20  # not the ~400 steps the abandoned rows would have taken


async def test_close_fails_unfinished_work(model_dir: Path) -> None:
    eng = HFRolloutEngine(str(model_dir), max_batch_size=1)
    stream = eng.generate(requests([400, 400]))
    await eng.aclose()
    with pytest.raises(EngineClosedError):
        await collect(stream)
    with pytest.raises(EngineClosedError):
        eng.generate(requests([3]))


async def test_invalid_params_fail_at_submission(engine: HFRolloutEngine) -> None:
    with pytest.raises(ValueError, match="temperature"):
        engine.generate(requests([3], temperature=0.0))
    with pytest.raises(ValueError, match="top_p"):
        engine.generate(requests([3], top_p=0.0))


# ------------------------------------------------------------------------- weight updates


def update_after_forwards(engine: HFRolloutEngine, weights: dict[str, torch.Tensor], forwards: int) -> list[Any]:
    """Push ``weights`` as version 1 from inside the k-th forward pass: it lands right after that step."""
    pushes: list[Any] = []
    calls = 0

    def hook(*_: object) -> None:
        nonlocal calls
        calls += 1
        if calls == forwards:
            pushes.append(push_from_inside_a_step(engine.target, weights, version=1))

    engine.model.register_forward_hook(hook)
    return pushes


async def score_by_version(samples: list[Trajectory], v0_dir: Path, v1_dir: Path) -> list[tuple[list[float], list[float]]]:
    async with TorchLogProbEngine(str(v0_dir)) as v0, TorchLogProbEngine(str(v1_dir)) as v1:
        return list(zip(await v0.logprobs(samples), await v1.logprobs(samples), strict=True))


def split_by_version(sample: Trajectory, values: Sequence[float], version: int) -> tuple[list[float], list[float]]:
    pairs = [(b, v) for b, v, ver in zip(sample.behaviour_logprobs, values, sample.versions) if ver == version]
    return [b for b, _ in pairs], [v for _, v in pairs]


async def test_recompute_resumes_under_new_weights_with_aligned_versions(
    model_dir: Path, v1_model_dir: Path, v1_weights: dict[str, torch.Tensor]
) -> None:
    async with HFRolloutEngine(str(model_dir), max_batch_size=8) as eng:
        pushed = update_after_forwards(eng, v1_weights, forwards=5)
        [single] = await collect(eng.generate(requests([12])))
        await asyncio.to_thread(pushed[0].join)
        assert eng.version == 1
    # Forward 1 is the prefill (token 0), forwards 2-5 decode tokens 1-4; the update lands after.
    assert single.versions == [0] * 5 + [1] * 7
    assert single.start_version == 0 and single.resumed is ResumePolicy.RECOMPUTE
    [(old, new)] = await score_by_version([single], model_dir, v1_model_dir)
    assert max_gap(*split_by_version(single, old, 0)) < 1e-4
    assert max_gap(*split_by_version(single, new, 1)) < 1e-4  # the re-prefilled cache is the new policy's


async def test_recompute_with_many_rows_of_different_lengths(
    model_dir: Path, v1_model_dir: Path, v1_weights: dict[str, torch.Tensor]
) -> None:
    async with HFRolloutEngine(str(model_dir), max_batch_size=4) as eng:
        update_after_forwards(eng, v1_weights, forwards=9)
        samples = await collect(eng.generate(requests([4, 14, 9, 18, 6, 12, 15, 10])))
    versions_seen = set()
    for sample, (old, new) in zip(samples, await score_by_version(samples, model_dir, v1_model_dir), strict=True):
        versions = sample.versions
        assert versions == sorted(versions) and sample.start_version == versions[0]
        interrupted = versions[0] == 0 and versions[-1] == 1
        assert sample.resumed is (ResumePolicy.RECOMPUTE if interrupted else None)
        assert max_gap(*split_by_version(sample, old, 0)) < 1e-4
        assert max_gap(*split_by_version(sample, new, 1)) < 1e-4
        versions_seen.add((versions[0], versions[-1]))
    assert versions_seen >= {(0, 0), (0, 1), (1, 1)}  # finished before, interrupted, started after


async def test_keep_cache_resumes_on_the_old_cache_and_says_so(
    model_dir: Path, v1_model_dir: Path, v1_weights: dict[str, torch.Tensor]
) -> None:
    async with HFRolloutEngine(str(model_dir), resume_policy="keep_cache") as eng:
        update_after_forwards(eng, v1_weights, forwards=5)
        [single] = await collect(eng.generate(requests([12])))
    assert single.versions == [0] * 5 + [1] * 7
    assert single.resumed is ResumePolicy.KEEP_CACHE
    [(old, new)] = await score_by_version([single], model_dir, v1_model_dir)
    assert max_gap(*split_by_version(single, old, 0)) < 1e-4
    # New weights over a cache the old ones built: not the new policy's log-probs (the gap the
    # trainer must know about, hence Sample.resumed).
    assert max_gap(*split_by_version(single, new, 1)) > 1e-3


async def test_update_while_idle_serves_the_next_requests(
    engine: HFRolloutEngine, v1_model_dir: Path, v1_weights: dict[str, torch.Tensor]
) -> None:
    await push(engine.target, v1_weights, version=3)
    assert engine.version == 3
    [sample] = await collect(engine.generate(requests([6])))
    assert sample.versions == [3] * 6 and sample.resumed is None
    async with TorchLogProbEngine(str(v1_model_dir)) as v1:
        [logprobs] = await v1.logprobs([sample])
    assert max_gap(sample.behaviour_logprobs, logprobs) < 1e-4


@pytest.mark.parametrize(
    ("mutate", "error"),
    [
        (lambda w: w.pop("lm_head.weight"), "leaves 1 weights unset"),
        (lambda w: w.update(extra=torch.zeros(1)), "no weight 'extra'"),
        (lambda w: w.update({"lm_head.weight": torch.zeros(3, 3)}), "lm_head.weight"),
    ],
)
async def test_a_rejected_update_changes_nothing(
    engine: HFRolloutEngine, scorer: TorchLogProbEngine, v1_weights: dict[str, torch.Tensor], mutate: Any, error: str
) -> None:
    weights = dict(v1_weights)
    mutate(weights)
    with pytest.raises(SyncError, match=error):
        await push(engine.target, weights, version=1)
    await push(engine.target, v1_weights, version=2)  # a newer version loads...
    with pytest.raises(SyncError, match="older than loaded version 2"):
        await push(engine.target, dict(engine.model.state_dict()), version=1)  # ...an older one never
    assert engine.version == 2
    await push(engine.target, {n: t.clone() for n, t in scorer.model.state_dict().items()}, version=3)
    [sample] = await collect(engine.generate(requests([6])))
    [logprobs] = await scorer.logprobs([sample])
    assert max_gap(sample.behaviour_logprobs, logprobs) < 1e-4  # still the old weights, all of them


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
async def test_bf16_on_cuda_matches_the_trainer_loosely(model_dir: Path) -> None:
    async with HFRolloutEngine(str(model_dir), device="cuda", dtype=torch.bfloat16) as eng:
        samples = await collect(eng.generate(requests([8, 12, 5, 9])))
    async with TorchLogProbEngine(str(model_dir), device="cuda", dtype=torch.bfloat16) as scorer:
        recomputed = await scorer.logprobs(samples)
    for sample, logprobs in zip(samples, recomputed, strict=True):
        assert max_gap(sample.behaviour_logprobs, logprobs) < 0.1


# ------------------------------------------------------------------------- kept caches (episodes)


def next_turn(turn: Trajectory, observation: str, *, continued: bool = True) -> GenerationRequest:
    """The sequence's next request: its whole transcript (prompt, response, an observation), as an
    episode sends it, with a seed of its own."""
    prompt = list(turn.payload.prompt_ids) + list(turn.payload.response_ids) + encode(observation)
    return GenerationRequest(turn.prompt_id, turn.index, prompt, SamplingParams(max_new_tokens=4), seed=11,
                             continued=continued)


def forward_lengths(engine: HFRolloutEngine) -> list[int]:
    """The number of new tokens each forward of the engine's model encodes, recorded from now on."""
    lengths: list[int] = []
    engine.model.register_forward_pre_hook(lambda _, args, kwargs: lengths.append(kwargs["input_ids"].shape[1]),
                                           with_kwargs=True)
    return lengths


async def test_a_continued_turn_encodes_only_its_new_tokens_and_samples_as_a_full_encoding_does(model_dir: Path) -> None:
    first = requests([5, 3], continued=True)
    async with HFRolloutEngine(str(model_dir), max_batch_size=3) as kept, \
            HFRolloutEngine(str(model_dir), max_batch_size=3) as fresh:
        turns = await collect(kept.generate(first))
        plain = await collect(fresh.generate(requests([5, 3])))
        assert [(t.payload.response_ids, t.behaviour_logprobs) for t in turns] == [
            (t.payload.response_ids, t.behaviour_logprobs) for t in plain]  # the hint changes no first turn
        lengths = forward_lengths(kept)
        on_kept = await collect(kept.generate([next_turn(t, "+1=") for t in turns]))
        # Each row's new tokens are its last response token and the 3 observation tokens: one
        # forward per row (their kept lengths differ), then decode steps of one token.
        assert sorted(lengths[:2]) == [4, 4] and set(lengths[2:]) == {1}
        in_full = await collect(fresh.generate([next_turn(t, "+1=", continued=False) for t in turns]))
    for a, b in zip(on_kept, in_full, strict=True):
        assert a.payload.response_ids == b.payload.response_ids
        assert max_gap(a.behaviour_logprobs, b.behaviour_logprobs) < 1e-5


async def test_a_turn_after_an_update_or_off_its_transcript_is_encoded_whole(
    engine: HFRolloutEngine, v1_model_dir: Path, v1_weights: dict[str, torch.Tensor]
) -> None:
    [turn] = await collect(engine.generate(requests([4], continued=True)))
    other = GenerationRequest(turn.prompt_id, turn.index, encode("9+9="), SamplingParams(max_new_tokens=2), continued=True)
    lengths = forward_lengths(engine)
    await collect(engine.generate([other]))  # the same sequence's key, not its transcript
    assert lengths[0] == len(other.prompt_ids)
    [turn] = await collect(engine.generate(requests([4], continued=True)))
    await push(engine.target, v1_weights, version=1)
    lengths.clear()
    [after] = await collect(engine.generate([next_turn(turn, "+1=")]))
    assert lengths[0] == len(turn.payload.prompt_ids) + 4 + 3  # built by version 0: not used
    async with TorchLogProbEngine(str(v1_model_dir)) as v1:
        [expected] = await v1.logprobs([after])
    assert after.versions == [1] * 4 and max_gap(after.behaviour_logprobs, expected) < 1e-4


async def test_at_most_max_batch_size_caches_are_kept_the_oldest_dropped_first(engine: HFRolloutEngine) -> None:
    turns = await collect(engine.generate(requests([2, 2, 2, 2], continued=True)))
    finished_first = turns[0]  # rows 0-2 ran together and finished at once; row 3 after them
    lengths = forward_lengths(engine)
    await collect(engine.generate([next_turn(turns[3], "1")]))
    assert lengths[0] == 2  # kept: its last token and the observation's
    lengths.clear()
    await collect(engine.generate([next_turn(finished_first, "1")]))
    assert lengths[0] == len(finished_first.payload.prompt_ids) + 2 + 1  # one of the three oldest: dropped
