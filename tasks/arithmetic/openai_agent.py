"""The arithmetic task solved by an agent that sees only an OpenAI-compatible endpoint.

This is how a black-box agent is trained: it calls ``run.base_url`` with the ``openai`` client,
as it would call any hosted model, and passes ``run.extra_body`` so the server files the call
under the rollout's conversation; tandem reads back the exact tokens, log-probs and weight
versions the server recorded and trains on them (``engines/server/agent.py``). Nothing here
knows about tandem's engines, and the agent may make several calls (each prompt extending the
last call's prompt and output).

Selected by ``engines.servers.agent: tasks.arithmetic.openai_agent:solver`` with
``engines.rollout: server`` (``configs/arithmetic_openai_agent.yaml``) or ``vllm_server`` (the
run then serves the endpoint in front of vLLM's servers). Needs the ``openai`` package
(``pip install -e .[agents]``).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import openai

from tandem.core.protocols import Agent, AgentRun

__all__ = ["solver"]


@contextlib.asynccontextmanager
async def solver() -> AsyncIterator[Agent]:
    """The agent's session: one HTTP connection pool for the whole run, closed when it ends.

    Connections then stay open from one episode to the next, and the pool is ``openai``'s aiohttp
    transport: against a stand-in endpoint, the client's CPU per episode (on the trainer's core)
    was 1.2 to 1.6 ms at 64 and 128 episodes in flight (the default job's), against 2.3 to 3.9 ms
    for an httpx pool per episode (a connection each) and 2.6 to 4.6 ms for one httpx pool shared by
    the run (httpcore walks every pooled connection on each request). Each episode wraps the pool
    in an ``openai`` client (0.07 ms) for the server it was given (the router picks one per group).
    """
    async with openai.DefaultAioHttpClient() as http:

        async def solve(run: AgentRun) -> None:
            """One completion of the problem's prompt with the run's sampling settings; the reward
            scores the recorded answer, so the agent returns nothing."""
            client = openai.AsyncOpenAI(base_url=run.base_url, api_key=run.api_key, max_retries=0, http_client=http)
            sampling = run.sampling
            await client.completions.create(
                model="tandem", prompt=run.item.prompt, max_tokens=sampling.max_new_tokens,
                temperature=sampling.temperature, top_p=sampling.top_p, seed=run.seed, extra_body=run.extra_body,
            )

        yield solve
