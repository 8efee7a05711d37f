"""A model solves calculator episodes turn by turn with plain ``model.generate``: the evaluation.

Owns how the calculator model's pretraining and tests measure it: each turn, every live
episode's transcript so far (the prompt, the model's turns, the tool's answers) is left-padded
into one batch, the model writes one turn (stopping at ``<eos>``), the turn's text goes to the
:class:`~tasks.calculator.environment.CalculatorEnvironment`, and the tool's answer is appended.
This is the transcript format the environment manager reproduces: first prompt with ``<bos>``,
later pieces without special tokens, the turn's ``<eos>`` kept in the transcript, the text the
environment gets without it.

Invariant: with the same model, seeds and ``sampling_seed``, the episodes are the same.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerFast

from tandem.tasks.calculator.environment import MAX_TURN_CHARS, CalculatorEnvironment

__all__ = ["CalculatorReport", "play"]


@dataclass(slots=True, frozen=True)
class CalculatorReport:
    """How a model did on a set of problems: accuracy, and how it used the tool."""

    episodes: int
    accuracy: float
    tool_calls_per_episode: float
    episodes_with_tool_calls: float
    mean_turns: float
    malformed_turns_per_episode: float
    unanswered: float  # episodes cut off by the turn limit before a final answer


@torch.no_grad()
def play(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerFast,
    seeds: Sequence[int],
    do_sample: bool = True,
    sampling_seed: int = 0,
) -> CalculatorReport:
    """One episode per environment seed, all in one batch, sampled at temperature 1.0 (or greedy)."""
    was_training = model.training
    model.eval()
    torch.manual_seed(sampling_seed)
    sampling = {"do_sample": True, "temperature": 1.0, "top_k": 0, "top_p": 1.0} if do_sample else {"do_sample": False}
    eos = tokenizer.eos_token_id
    environments = [CalculatorEnvironment() for _ in seeds]
    transcripts = [tokenizer(env.reset(seed))["input_ids"] for env, seed in zip(environments, seeds, strict=True)]
    rewards = [0.0] * len(seeds)
    turns = [0] * len(seeds)
    malformed = [0] * len(seeds)
    answered = [False] * len(seeds)
    live = list(range(len(seeds)))
    while live:
        width = max(len(transcripts[i]) for i in live)
        input_ids = torch.tensor([[tokenizer.pad_token_id] * (width - len(transcripts[i])) + transcripts[i] for i in live])
        attention_mask = torch.tensor([[0] * (width - len(transcripts[i])) + [1] * len(transcripts[i]) for i in live])
        output = model.generate(
            input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=MAX_TURN_CHARS + 1,
            eos_token_id=eos, pad_token_id=tokenizer.pad_token_id, **sampling,
        )
        still_live = []
        for i, row in zip(live, output[:, width:].tolist(), strict=True):
            turn = row[: row.index(eos) + 1] if eos in row else row  # what follows <eos> is padding
            text = tokenizer.decode(turn[:-1] if turn[-1] == eos else turn, skip_special_tokens=False)
            result = environments[i].step(text)
            turns[i] += 1
            malformed[i] += "error" in result.info
            transcripts[i] += turn
            if result.terminated or result.truncated:
                rewards[i] = result.reward
                answered[i] = result.terminated
            else:
                transcripts[i] += tokenizer(result.observation, add_special_tokens=False)["input_ids"]
                still_live.append(i)
        live = still_live
    model.train(was_training)
    tool_calls = [env.tool_calls for env in environments]
    count = len(seeds)
    return CalculatorReport(
        episodes=count,
        accuracy=statistics.fmean(rewards),
        tool_calls_per_episode=round(statistics.fmean(tool_calls), 3),
        episodes_with_tool_calls=sum(c > 0 for c in tool_calls) / count,
        mean_turns=round(statistics.fmean(turns), 2),
        malformed_turns_per_episode=sum(malformed) / count,
        unanswered=sum(not a for a in answered) / count,
    )
