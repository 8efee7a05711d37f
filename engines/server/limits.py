"""What one rollout server accepts: sizes of requests and how much work it holds at once.

What it owns: the limits ``tandem serve`` is started with (:class:`ServerLimits`) and the
admission of generation work (:class:`Admission`): a cap on requests and on tokens (each
request's prompt plus its ``max_new_tokens``) held at once, counted from the moment a request is
admitted until its HTTP answer is done (waiting while paused, queued and running alike).

Invariants: a request that could never fit (more requests or tokens than the caps on its own)
is a 400 naming the field; one that does not fit now is a 429 with ``Retry-After`` (the router
waits and sends it again); admitted work never exceeds either cap, so a burst of requests
cannot grow the server's memory without bound.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from aiohttp import web

from tandem.engines.server.http import error_response

__all__ = ["Admission", "BusyError", "ServerLimits", "busy_response"]

# torch's store retries a connect that times out once: an address where nothing listens fails in about twice this
CONNECT_TIMEOUT_S = 5.0
RETRY_AFTER_S = 1  # whole seconds (HTTP's Retry-After); the engine frees tokens at decode speed


@dataclass(frozen=True, slots=True)
class ServerLimits:
    """``tandem serve``'s limits (``engines.server.options`` documents each)."""

    max_body_bytes: int = 64 << 20
    max_top_logprobs: int = 20
    max_running_requests: int = 4096
    max_queued_tokens: int = 1 << 23
    weight_dirs: tuple[Path, ...] = ()  # empty: the model's own folder
    group_addresses: tuple[str, ...] = ("127.0.0.1", "localhost", "::1")
    connect_timeout_s: float = CONNECT_TIMEOUT_S


class BusyError(Exception):
    """The server holds as much work as its caps allow; retry after ``retry_after_s``."""

    def __init__(self, message: str, retry_after_s: int = RETRY_AFTER_S) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class Admission:
    """Counts admitted requests and tokens against the caps (single event loop: no lock)."""

    def __init__(self, max_requests: int, max_tokens: int) -> None:
        self.max_requests = max_requests
        self.max_tokens = max_tokens
        self.requests = 0
        self.tokens = 0

    def check_fits(self, requests: int, tokens: int) -> None:
        """ValueError naming the field when work of this size could never be admitted."""
        if requests > self.max_requests:
            raise ValueError(f"sampling_params.n: {requests} requests in one call exceed the server's "
                             f"--max-running-requests {self.max_requests}")
        if tokens > self.max_tokens:
            raise ValueError(f"sampling_params.max_new_tokens: prompts plus max_new_tokens come to {tokens} tokens, over "
                             f"the server's --max-queued-tokens {self.max_tokens}")

    @contextlib.contextmanager
    def admitted(self, requests: int, tokens: int) -> Iterator[None]:
        """Hold ``requests`` and ``tokens`` for the body of the ``with``; :class:`BusyError` when
        they do not fit beside the work already held (call :meth:`check_fits` first)."""
        if self.requests + requests > self.max_requests or self.tokens + tokens > self.max_tokens:
            raise BusyError(f"server busy: {self.requests} requests and {self.tokens} tokens held, caps "
                            f"{self.max_requests} and {self.max_tokens}")
        self.requests += requests
        self.tokens += tokens
        try:
            yield
        finally:
            self.requests -= requests
            self.tokens -= tokens


def busy_response(exc: BusyError) -> web.Response:
    """429 with ``Retry-After``: the caps are full now; the same request fits later."""
    return error_response(429, str(exc), headers={"Retry-After": str(exc.retry_after_s)})
