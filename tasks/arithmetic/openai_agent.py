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

import ssl

import openai

from core.protocols import AgentRun

__all__ = ["solve"]

# Every client builds its HTTP client, and an httpx client loads the system's certificates into
# a new TLS context (26 ms here): built per episode, that took 44 % of the trainer process's time
# and halved throughput (23 against 55 samples/s on the default job). One context made here and
# given to every episode's client leaves 0.2 ms per client. What remains is a connection per
# episode, 0.6 to 1.3 ms of CPU more than a kept-alive one (benchmarks/e2e.py --rollout agent:
# 5 to 9 % at sync, 3 to 4 % at k = 1, none at k = 2). A client kept past its episode would save
# that but needs an owner to close it: kept per event loop, it held its loop and socket alive
# after the run ended.
_TLS = ssl.create_default_context()


async def solve(run: AgentRun) -> None:
    """One completion of the problem's prompt with the run's sampling settings; the reward
    scores the recorded answer, so the agent returns nothing."""
    sampling = run.sampling
    http_client = openai.DefaultAsyncHttpxClient(verify=_TLS)
    async with openai.AsyncOpenAI(base_url=run.base_url, api_key="unused", max_retries=0, http_client=http_client) as client:
        await client.completions.create(
            model="tandem", prompt=run.item.prompt, max_tokens=sampling.max_new_tokens,
            temperature=sampling.temperature, top_p=sampling.top_p, seed=run.seed, extra_body=run.extra_body,
        )
