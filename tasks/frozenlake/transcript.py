"""The transcript of a FrozenLake episode: the exact token sequence a model reads and writes.

Pretraining trains on it and the environment manager must reproduce it token for token, so it is
defined once, here. With ``obs_i`` the observation the model sees before its turn ``i`` (the grid
and neighbour line of :func:`tasks.frozenlake.environment.render`, 25 characters on a 4×4 lake)
and ``a_i`` its action (one letter)::

    <bos> obs_0  a_0 <eot>  obs_1  a_1 <eot>  ...  obs_{n-1}  a_{n-1} <eot>
    └─ prompt ─┘ └ model ┘ └ env ┘ └ model ┘        └─ env ─┘  └─ model ─┘

- the prompt is ``tokenizer(obs_0)``: ``<bos>`` then one token per character;
- a model turn is the action's token then ``<eot>`` (the stop token: ``generate`` with
  ``max_new_tokens=TURN_TOKENS`` ends there). The environment receives the turn's decoded text
  without the ``<eot>``, special tokens kept, so a turn that is not exactly one action letter is
  a malformed action. A turn cut off by the token budget has no ``<eot>``; it goes into the
  transcript as generated;
- the environment then appends the next observation, ``tokenizer(obs, add_special_tokens=False)``,
  directly after the turn: no separator, no role markers;
- the episode ends after the model's last turn: the observation a terminal step returns is not
  part of the transcript (no turn follows it).

The loss covers the model's tokens only (each action and its ``<eot>``); ``<bos>`` and every
observation token are masked, exactly as RL masks environment tokens. Pretraining also masks the
turns its noisy expert took at random (``trained``), which stay in the transcript as context. Because the tokenizer is
character-level, encoding the pieces one by one gives the same ids as encoding the whole text.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from transformers import PreTrainedTokenizerFast

from tandem.tasks.frozenlake.tokenizer import EOT

__all__ = ["TURN_TOKENS", "EncodedEpisode", "encode_episode", "transcript_text"]

# One action token plus <eot>: the generation budget of a model turn.
TURN_TOKENS = 2


@dataclass(slots=True, frozen=True)
class EncodedEpisode:
    """An episode's token ids and its loss mask (1 on the model's tokens, 0 elsewhere)."""

    input_ids: list[int]
    loss_mask: list[int]


def transcript_text(observations: Sequence[str], actions: Sequence[str]) -> str:
    """The transcript as text (``<eot>`` written out, ``<bos>`` left to the tokenizer)."""
    if len(observations) != len(actions):
        raise ValueError(f"one observation per action: got {len(observations)} and {len(actions)}")
    return "".join(f"{observation}{action}{EOT}" for observation, action in zip(observations, actions, strict=True))


def encode_episode(
    tokenizer: PreTrainedTokenizerFast,
    observations: Sequence[str],
    actions: Sequence[str],
    trained: Sequence[bool] | None = None,
) -> EncodedEpisode:
    """Ids and loss mask of an episode, built piece by piece as the environment manager will.

    ``trained[i]`` says whether turn ``i`` carries loss (default: every turn).
    """
    if len(observations) != len(actions):
        raise ValueError(f"one observation per action: got {len(observations)} and {len(actions)}")
    if trained is not None and len(trained) != len(actions):
        raise ValueError(f"one trained flag per action: got {len(trained)} and {len(actions)}")
    input_ids: list[int] = []
    loss_mask: list[int] = []
    eot_id = tokenizer.convert_tokens_to_ids(EOT)
    for turn, (observation, action) in enumerate(zip(observations, actions, strict=True)):
        observation_ids = tokenizer(observation, add_special_tokens=turn == 0)["input_ids"]
        action_ids = [*tokenizer(action, add_special_tokens=False)["input_ids"], eot_id]
        input_ids += observation_ids + action_ids
        loss_mask += [0] * len(observation_ids) + [int(trained is None or trained[turn])] * len(action_ids)
    return EncodedEpisode(input_ids, loss_mask)
