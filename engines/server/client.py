"""An async client of one rollout server speaking sglang's native HTTP API.

What it owns: the calls an RL trainer makes to a server (``engines.server.schemas`` names
them), over an ``aiohttp`` session the caller shares between all its servers (one connection
pool), each answer parsed into the pydantic model of sglang's schema. The same client drives
``tandem serve`` and a real sglang server.

Errors: :class:`ServerGoneError` when the server cannot be reached or drops the connection (the
router takes it out of service); :class:`ServerBusyError` when it is at its caps (HTTP 429: the
router waits ``Retry-After`` and sends the request again); :class:`ServerError` when it answers
with another error (the request was wrong, or the server refused it), carrying the server's message.

Every call carries the key its route needs (``engines.server.auth``): the admin key on the
weight and control routes when there is one, the API key on the others.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp

from tandem.engines.server.auth import ApiKeys, bearer
from tandem.engines.server.schemas import ConversationRecord, GenerateResponse, ModelInfo, SuccessResponse

__all__ = ["ServerBusyError", "ServerClient", "ServerError", "ServerGoneError"]

_GONE = (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, ConnectionError)


class ServerError(RuntimeError):
    """The server answered with an error status; ``status`` and the server's message."""

    def __init__(self, url: str, status: int, message: str) -> None:
        super().__init__(f"{url}: HTTP {status}: {message}")
        self.status = status


class ServerBusyError(ServerError):
    """The server is at its caps (HTTP 429); the same request may be sent after ``retry_after_s``."""

    def __init__(self, url: str, message: str, retry_after_s: float) -> None:
        super().__init__(url, 429, message)
        self.retry_after_s = retry_after_s


def _retry_after(value: str | None) -> float:
    """``Retry-After`` in seconds (an HTTP date, or none, counts as one second)."""
    try:
        return max(0.0, float(value)) if value is not None else 1.0
    except ValueError:
        return 1.0


class ServerGoneError(ConnectionError):
    """The server could not be reached, or went away during the call."""


def _message(text: str) -> str:
    try:
        body = json.loads(text)
    except ValueError:
        return text.strip()
    if isinstance(body, dict):
        return str(body.get("message") or body.get("error") or body)
    return text.strip()


class ServerClient:
    """sglang's API at ``url`` (``http://host:port``), through ``session``."""

    def __init__(self, url: str, session: aiohttp.ClientSession, *, request_timeout_s: float,
                 keys: ApiKeys | None = None) -> None:
        self.url = url.rstrip("/")
        self._session = session
        self._keys = keys or ApiKeys()
        self._timeout = aiohttp.ClientTimeout(total=request_timeout_s)

    async def _call(self, method: str, path: str, body: Any = None, *, timeout: aiohttp.ClientTimeout | None = None,
                    ok_statuses: tuple[int, ...] = (200,)) -> tuple[int, str]:
        try:
            async with self._session.request(method, self.url + path, json=body, timeout=timeout or self._timeout,
                                             headers=bearer(self._keys.for_client(path))) as resp:
                text = await resp.text()
        except _GONE as exc:
            raise ServerGoneError(f"{self.url}{path}: {type(exc).__name__}: {exc}") from exc
        except TimeoutError as exc:
            raise ServerGoneError(f"{self.url}{path}: no answer within {(timeout or self._timeout).total:g} s") from exc
        if resp.status == 429:
            raise ServerBusyError(self.url, _message(text), _retry_after(resp.headers.get("Retry-After")))
        if resp.status not in ok_statuses:
            raise ServerError(self.url, resp.status, _message(text))
        return resp.status, text

    # ----------------------------------------------------------------------- generation

    async def generate(self, body: dict[str, Any]) -> GenerateResponse:
        """One prompt's ``/generate`` (``body`` is a ``GenerateReqInput`` without ``stream``)."""
        _, text = await self._call("POST", "/generate", body)
        return GenerateResponse.model_validate_json(text)

    async def generate_stream(self, body: dict[str, Any]) -> AsyncIterator[GenerateResponse]:
        """``/generate`` with ``stream: true``: each server-sent event as it arrives, the last
        one carrying the finish reason."""
        try:
            async with self._session.post(self.url + "/generate", json={**body, "stream": True}, timeout=self._timeout,
                                          headers=bearer(self._keys.for_client("/generate"))) as resp:
                if resp.status == 429:
                    raise ServerBusyError(self.url, _message(await resp.text()), _retry_after(resp.headers.get("Retry-After")))
                if resp.status != 200:
                    raise ServerError(self.url, resp.status, _message(await resp.text()))
                async for raw in resp.content:
                    line = raw.strip()
                    if not line.startswith(b"data:"):
                        continue
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        return
                    event = json.loads(data)
                    if "error" in event:
                        raise ServerError(self.url, 200, str(event["error"].get("message", event["error"])))
                    yield GenerateResponse.model_validate(event)
        except _GONE as exc:
            raise ServerGoneError(f"{self.url}/generate: {type(exc).__name__}: {exc}") from exc

    async def abort(self, rid: str = "", *, abort_all: bool = False) -> None:
        await self._call("POST", "/abort_request", {"rid": rid, "abort_all": abort_all})

    async def pause_generation(self, mode: str = "abort") -> None:
        await self._call("POST", "/pause_generation", {"mode": mode})

    async def continue_generation(self) -> None:
        await self._call("POST", "/continue_generation", {})

    async def flush_cache(self) -> bool:
        status, _ = await self._call("POST", "/flush_cache", ok_statuses=(200, 400))
        return status == 200

    # ------------------------------------------------------------------------- health

    async def health(self, timeout_s: float) -> bool:
        """Whether ``/health`` answers 200 within ``timeout_s`` (False, not an error, otherwise)."""
        try:
            status, _ = await self._call("GET", "/health", timeout=aiohttp.ClientTimeout(total=timeout_s),
                                         ok_statuses=(200, 503))
        except (ServerGoneError, ServerError):
            return False
        return status == 200

    async def health_generate(self, timeout_s: float) -> bool:
        try:
            status, _ = await self._call("GET", "/health_generate", timeout=aiohttp.ClientTimeout(total=timeout_s),
                                         ok_statuses=(200, 503))
        except (ServerGoneError, ServerError):
            return False
        return status == 200

    async def model_info(self) -> ModelInfo:
        _, text = await self._call("GET", "/get_model_info")
        return ModelInfo.model_validate_json(text)

    async def conversation(self, conversation_id: str) -> list[ConversationRecord]:
        """tandem's extension: the records of one conversation of OpenAI calls (then forgotten)."""
        _, text = await self._call("GET", f"/tandem/conversations/{conversation_id}")
        return [ConversationRecord.model_validate(r) for r in json.loads(text)]

    # ------------------------------------------------------------------ weight updates

    async def update_weights_from_disk(self, model_path: str, weight_version: int) -> SuccessResponse:
        _, text = await self._call("POST", "/update_weights_from_disk",
                                   {"model_path": model_path, "weight_version": str(weight_version)}, ok_statuses=(200, 400))
        return SuccessResponse.model_validate_json(text)
