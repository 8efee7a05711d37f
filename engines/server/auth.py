"""Who may call a rollout server: API keys on its routes, and refusing an open non-loopback bind.

What it owns: the routes that change weights or steer other callers' work (:data:`ADMIN_ROUTES`),
the aiohttp middleware that checks ``Authorization: Bearer <key>`` (sglang's and vLLM's
``--api-key`` convention), and the rule that a server reachable from other machines has a key.

- no key configured: every route is open (loopback users keep today's behaviour);
- an API key: every route but ``/health`` needs it (or the admin key);
- an admin key as well: the admin routes need the admin key itself, so an agent handed the API
  key can generate but cannot replace the weights, join a process group, pause or abort.

Invariants: keys are compared in constant time; a refused attempt is logged with the route, the
peer and why, never the key it carried; ``/health`` stays open (launchers and load balancers
probe it without credentials, and it says nothing but alive or not).
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import structlog
from aiohttp import web
from pydantic import SecretStr

from tandem.core.config import is_loopback
from tandem.engines.server.http import error_response

__all__ = ["ADMIN_ROUTES", "OPEN_ROUTES", "ApiKeys", "auth_middleware", "bearer", "check_bind"]

log = structlog.get_logger("tandem.serve")

OPEN_ROUTES = frozenset({"/health"})
ADMIN_ROUTES = frozenset({
    "/update_weights_from_disk", "/update_weights_from_tensor", "/init_weights_update_group",
    "/update_weights_from_distributed", "/tandem/update_weights_from_shm", "/load_lora_adapter", "/unload_lora_adapter",
    "/pause_generation", "/continue_generation",
    "/abort_request", "/flush_cache",
})
ALLOW_OPEN_FLAG = "--allow-unauthenticated"


@dataclass(frozen=True, slots=True)
class ApiKeys:
    """The keys a server requires (either may be None). ``SecretStr``: a repr or a log line of
    this object never shows them."""

    api_key: SecretStr | None = None
    admin_key: SecretStr | None = None

    @property
    def any(self) -> bool:
        return self.api_key is not None or self.admin_key is not None

    def for_route(self, path: str) -> list[SecretStr]:
        """The keys that open ``path``; empty: the route is open."""
        if path in OPEN_ROUTES:
            return []
        if path in ADMIN_ROUTES and self.admin_key is not None:
            return [self.admin_key]
        return [k for k in (self.api_key, self.admin_key) if k is not None] if self.api_key is not None else []

    def for_client(self, path: str) -> SecretStr | None:
        """The key a trusted client (the trainer's router and weight transports) sends on ``path``."""
        if path in ADMIN_ROUTES and self.admin_key is not None:
            return self.admin_key
        return self.api_key or self.admin_key


def bearer(key: SecretStr | None) -> dict[str, str]:
    """The header that carries ``key`` (none without a key)."""
    return {} if key is None else {"Authorization": f"Bearer {key.get_secret_value()}"}


def _presented(request: web.Request) -> str | None:
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


def auth_middleware(keys: ApiKeys) -> Callable[[web.Request, Callable[[web.Request], Awaitable[web.StreamResponse]]],
                                               Awaitable[web.StreamResponse]]:
    """Refuse (401) a request to a route whose keys (:meth:`ApiKeys.for_route`) it does not carry."""

    @web.middleware
    async def check(request: web.Request,
                    handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
        wanted = keys.for_route(request.path)
        if wanted:
            token = _presented(request)
            if token is None or not any(hmac.compare_digest(token.encode(), k.get_secret_value().encode()) for k in wanted):
                why = "no bearer key" if token is None else "wrong key"
                log.warning("unauthorized request", path=request.path, peer=request.remote, reason=why)
                kind = "the admin key" if request.path in ADMIN_ROUTES and keys.admin_key is not None else "the API key"
                response = error_response(401, f"Authorization: {request.path} needs 'Bearer <key>' with {kind} ({why})")
                response.headers["WWW-Authenticate"] = "Bearer"
                return response
        return await handler(request)

    return check


def check_bind(host: str, keys: ApiKeys, *, allow_unauthenticated: bool) -> None:
    """Refuse to serve ``host`` beyond loopback without an API key unless told so explicitly."""
    if not is_loopback(host) and keys.api_key is None and not allow_unauthenticated:
        raise ValueError(f"--host {host} makes the server reachable from other machines, and without --api-key (or "
                         f"TANDEM_API_KEY) anyone who reaches it can generate and replace its weights: give a key, bind "
                         f"127.0.0.1, or pass {ALLOW_OPEN_FLAG} to serve it open anyway")
