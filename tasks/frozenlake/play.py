"""A model plays FrozenLake episodes turn by turn with plain ``model.generate``: the evaluation.

Owns how pretraining and the tests measure a model's success: every live episode's transcript
(see :mod:`tasks.frozenlake.transcript`) is a row of one :class:`~tasks.turn_batch.TurnBatch`;
each turn the model generates one turn for all of them (at most ``TURN_TOKENS`` tokens, stopping
at ``<eot>``), each turn's text goes to its environment, and the next observation is appended.
The batch keeps its KV cache across turns, so each turn encodes only the new tokens.

Invariant: with the same model, seeds and ``sampling_seed``, the episodes are the same (on the
same machine and torch build).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerFast

from tandem.tasks.frozenlake.environment import MAX_TURNS, FrozenLakeEnvironment
from tandem.tasks.frozenlake.tokenizer import EOT
from tandem.tasks.frozenlake.transcript import TURN_TOKENS
from tandem.tasks.turn_batch import TurnBatch

__all__ = ["EpisodeOutcome", "PlayReport", "play", "summarize"]


@dataclass(slots=True, frozen=True)
class EpisodeOutcome:
    """How one episode went: the actions taken, its reward and how it ended."""

    seed: int
    actions: list[str]
    reward: float
    outcome: str  # goal, hole or turn_limit
    malformed_actions: int
    tokens: int  # length of the whole transcript


@dataclass(slots=True, frozen=True)
class PlayReport:
    """Success rate and episode shape over a set of seeds."""

    episodes: int
    success: float
    mean_turns: float
    holes: float
    turn_limits: float
    malformed_actions_per_episode: float
    max_tokens: int


@torch.no_grad()
def play(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerFast,
    seeds: Sequence[int],
    do_sample: bool = True,
    sampling_seed: int = 0,
    slippery: bool = False,
    max_turns: int = MAX_TURNS,
) -> list[EpisodeOutcome]:
    """Play one episode per seed, all in one batch, sampling at temperature 1.0 (no top-k/top-p)
    when ``do_sample``, else greedily."""
    was_training = model.training
    model.eval()
    torch.manual_seed(sampling_seed)
    sampling = {"do_sample": True, "temperature": 1.0, "top_k": 0, "top_p": 1.0} if do_sample else {"do_sample": False}
    eot_id = tokenizer.convert_tokens_to_ids(EOT)
    environments = [FrozenLakeEnvironment(slippery=slippery, max_turns=max_turns) for _ in seeds]
    transcripts = [tokenizer(env.reset(seed))["input_ids"] for env, seed in zip(environments, seeds, strict=True)]
    actions: list[list[str]] = [[] for _ in seeds]
    rewards = [0.0] * len(seeds)
    outcomes = [""] * len(seeds)
    malformed = [0] * len(seeds)
    live = list(range(len(seeds)))
    batch = TurnBatch(model, transcripts, tokenizer.pad_token_id)
    while live:
        generated = batch.generate(max_new_tokens=TURN_TOKENS, eos_token_id=eot_id, **sampling)
        still_live, rows, turn_lengths, observations = [], [], [], []
        for row, (i, tokens) in enumerate(zip(live, generated, strict=True)):
            turn = tokens[: tokens.index(eot_id) + 1] if eot_id in tokens else tokens  # what follows <eot> is padding
            action_text = tokenizer.decode(turn[:-1] if turn[-1] == eot_id else turn, skip_special_tokens=False)
            result = environments[i].step(action_text)
            actions[i].append(action_text)
            rewards[i] += result.reward
            malformed[i] += "error" in result.info
            transcripts[i] += turn
            if result.terminated or result.truncated:
                outcomes[i] = str(result.info["outcome"])
            else:
                observation = tokenizer(result.observation, add_special_tokens=False)["input_ids"]
                transcripts[i] += observation
                still_live.append(i)
                rows.append(row)
                turn_lengths.append(len(turn))
                observations.append(observation)
        if still_live:
            batch.advance(rows, turn_lengths, observations)
        live = still_live
    model.train(was_training)
    return [
        EpisodeOutcome(seed, actions[i], rewards[i], outcomes[i], malformed[i], len(transcripts[i]))
        for i, seed in enumerate(seeds)
    ]


def summarize(episodes: Sequence[EpisodeOutcome]) -> PlayReport:
    """The success rate and the shape of a set of episodes."""
    count = len(episodes)
    return PlayReport(
        episodes=count,
        success=statistics.fmean(e.reward for e in episodes),
        mean_turns=round(statistics.fmean(len(e.actions) for e in episodes), 2),
        holes=sum(e.outcome == "hole" for e in episodes) / count,
        turn_limits=sum(e.outcome == "turn_limit" for e in episodes) / count,
        malformed_actions_per_episode=sum(e.malformed_actions for e in episodes) / count,
        max_tokens=max(e.tokens for e in episodes),
    )
