"""The arithmetic task solved by an agent that sees only an OpenAI-compatible endpoint.

This is how a black-box agent is trained: it calls ``run.base_url`` with the ``openai`` client,
as it would call any hosted model, and passes ``run.extra_body`` so the server files the call
under the rollout's conversation; tandem reads back the exact tokens, log-probs and weight
versions the server recorded and trains on them (``engines/server/agent.py``). Nothing here
knows about tandem's engines, and the agent may make several calls (each prompt extending the
last call's prompt and output).

Selected by ``engines.servers.agent: tasks.arithmetic.openai_agent:solve`` with
``engines.rollout: server`` (``configs/arithmetic_openai_agent.yaml``). Needs the ``openai``
package (``pip install -e .[agents]``).
"""

from __future__ import annotations

import asyncio
import weakref

import openai

from core.protocols import AgentRun

__all__ = ["solve"]

# One client per event loop and server. Building a client creates a TLS context (it loads the
# system's certificates): built per episode, that took 44 % of the trainer process's time and
# halved throughput (23 against 55 samples/s on the default job). A client belongs to the loop
# it first ran on, and goes with it.
_clients: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[str, openai.AsyncOpenAI]] = weakref.WeakKeyDictionary()


def client_for(base_url: str) -> openai.AsyncOpenAI:
    """This loop's client for the server at ``base_url``, made on first use."""
    clients = _clients.setdefault(asyncio.get_running_loop(), {})
    if base_url not in clients:
        clients[base_url] = openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0)
    return clients[base_url]


async def solve(run: AgentRun) -> None:
    """One completion of the problem's prompt with the run's sampling settings; the reward
    scores the recorded answer, so the agent returns nothing."""
    sampling = run.sampling
    await client_for(run.base_url).completions.create(
        model="tandem", prompt=run.item.prompt, max_tokens=sampling.max_new_tokens,
        temperature=sampling.temperature, top_p=sampling.top_p, seed=run.seed, extra_body=run.extra_body,
    )
