"""sglang's sampling parameters as the engine's request: the one conversion every HTTP front shares.

What it owns: :func:`engine_request`, which turns a prompt and an API request's
:class:`~engines.server.schemas.SamplingParams` into the :class:`core.protocols.GenerationRequest`
an engine or the router samples. ``tandem serve``'s ``/generate``, its OpenAI endpoints and the
agents' recording proxy in front of vLLM servers (``engines.server.agent_proxy``) all call it, so
one request means the same sampling on every path.

Invariants: the request fits the context (prompt plus ``max_new_tokens``); greedy (temperature 0)
is top-k 1 at temperature 1, so its log-probs are those of the distribution actually sampled
from; an unseeded request gets a fresh random seed (a retried request then reuses it).
"""

from __future__ import annotations

import secrets

from tandem.core.protocols import GenerationRequest
from tandem.core.protocols import SamplingParams as EngineSampling
from tandem.engines.server.schemas import SamplingParams

__all__ = ["engine_request"]


def engine_request(prompt_ids: list[int], params: SamplingParams, seed: int | None, *, context: int,
                   index: int = 0) -> GenerationRequest:
    """``params`` for ``prompt_ids`` as the engine's request (sample ``index``); ValueError naming
    the field when it cannot be served (no prompt, stop token ids, beyond ``context`` tokens)."""
    if not prompt_ids:
        raise ValueError("prompt: no tokens (an empty text or token list)")
    if params.stop_token_ids:
        raise ValueError("sampling_params.stop_token_ids: not supported by this server (it stops on the model's eos)")
    budget = context - len(prompt_ids)
    max_new = params.max_new_tokens if params.max_new_tokens is not None else budget
    if max_new < 1:
        raise ValueError(f"max_new_tokens must be >= 1 (a prompt of {len(prompt_ids)} tokens leaves {budget}), got {max_new}")
    if max_new > budget:
        raise ValueError(f"prompt ({len(prompt_ids)} tokens) + max_new_tokens ({max_new}) exceed the context {context}")
    greedy = params.temperature == 0
    stop = (params.stop,) if isinstance(params.stop, str) else tuple(params.stop or ())
    sampling = EngineSampling(
        max_new, 1.0 if greedy else params.temperature, params.top_p, 1 if greedy else max(params.top_k, 0), stop
    )
    if seed is None:
        seed = secrets.randbelow(1 << 31)
    return GenerationRequest(prompt_id=0, index=index, prompt_ids=list(prompt_ids), params=sampling, seed=seed)
