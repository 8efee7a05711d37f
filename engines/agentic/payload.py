"""The payload of an episode trajectory: its tokens, plus what happened turn by turn.

An :class:`EpisodePayload` is a :class:`~core.records.TokenPayload`, so the token engines train it
as they train text: ``prompt_ids`` is the first prompt (the context the first action saw) and
``response_ids`` every token after it, the model's turns and the environment's observations
interleaved; the trajectory's ``loss_mask`` says which tokens are the model's. The rest is for
reward functions (a task of kind ``episode`` gets the payload as its ``response``, see
``pipeline.builders.RENDERERS``) and for people reading a run: what the environment received each
turn, what each step paid, and how the episode ended.

Light on purpose (no torch): reward worker processes unpickle it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tandem.core.records import TokenPayload

__all__ = ["EpisodePayload"]


@dataclass(slots=True)
class EpisodePayload(TokenPayload):
    """Tokens (``prompt_ids``, ``response_ids``, decoded ``text``) and the episode's turns.

    ``actions[i]`` is model turn ``i`` as the environment received it (decoded, special tokens
    kept, without the end-of-turn token); ``env_rewards[i]`` the reward of the step it caused.
    ``outcome`` says how the episode ended: ``terminated`` (the environment ended it),
    ``turn_limit`` (its ``max_turns``), ``context`` (the next turn would not fit the context
    budget), or ``failed`` (the environment misbehaved; see ``Trajectory.failure``). ``info`` is
    the last step's ``info`` (FrozenLake's ``outcome``, the calculator's ``tool_calls``).
    """

    actions: list[str] = field(default_factory=list)
    env_rewards: list[float] = field(default_factory=list)
    outcome: str = ""
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def env_return(self) -> float:
        """The sum of the environment's step rewards: the episode's return."""
        return float(sum(self.env_rewards))
