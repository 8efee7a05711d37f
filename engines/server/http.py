"""HTTP helpers shared by the server's endpoints: parsing bodies into schemas, sglang's error body.

Invariant: whatever bytes a client sends, :func:`parse` answers a 4xx naming what is wrong (the
body, its size, its nesting, or a field), never an exception that becomes a 500.
"""

from __future__ import annotations

import json
from http import HTTPStatus
from typing import Any

from aiohttp import web
from pydantic import BaseModel, ValidationError

__all__ = ["error_body", "error_response", "parse"]


def error_response(status: int, message: str, headers: dict[str, str] | None = None) -> web.Response:
    """sglang's ``ErrorResponse`` body."""
    return web.json_response(error_body(message, status), status=status, headers=headers)


async def parse(request: web.Request, model: type[BaseModel], *, empty_ok: bool = False,
                context: dict[str, Any] | None = None) -> Any:
    """The request body as ``model`` (validated with ``context``, e.g. the vocabulary size);
    raises an HTTP 413 for a body over the server's limit, a 400 naming the bad fields otherwise."""
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge as exc:
        body = json.dumps(error_body(f"body: {exc.text} (the server's --max-body-mb)", 413))
        raise web.HTTPRequestEntityTooLarge(0, text=body, content_type="application/json") from None
    try:
        data = json.loads(raw) if raw.strip() else ({} if empty_ok else None)
    except RecursionError:
        raise _error(web.HTTPBadRequest, "body: JSON nested deeper than this server parses") from None
    except ValueError as exc:  # not JSON, or not UTF-8
        raise _error(web.HTTPBadRequest, f"body: not JSON: {exc}") from None
    try:
        return model.model_validate(data, context=context)
    except RecursionError:
        raise _error(web.HTTPBadRequest, "body: JSON nested deeper than this server parses") from None
    except (ValidationError, ValueError) as exc:
        raise _error(web.HTTPBadRequest, str(exc)) from None


def _error(kind: type[web.HTTPException], message: str) -> web.HTTPException:
    return kind(text=json.dumps(error_body(message, kind.status_code)), content_type="application/json")


def error_body(message: str, status: int = 400) -> dict[str, Any]:
    kind = "BadRequest" if status == 400 else HTTPStatus(status).phrase.replace(" ", "")
    return {"object": "error", "message": message, "type": kind, "code": status}
