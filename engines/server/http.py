"""HTTP helpers shared by the server's endpoints: parsing bodies into schemas, sglang's error body."""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web
from pydantic import BaseModel, ValidationError

__all__ = ["error_body", "error_response", "parse"]


def error_response(status: int, message: str) -> web.Response:
    """sglang's ``ErrorResponse`` body."""
    body = {"object": "error", "message": message, "type": "BadRequest" if status == 400 else "ServerError", "code": status}
    return web.json_response(body, status=status)


async def parse(request: web.Request, model: type[BaseModel], *, empty_ok: bool = False) -> Any:
    """The request body as ``model``; raises an HTTP 400 naming the bad fields."""
    raw = await request.read()
    try:
        data = json.loads(raw) if raw.strip() else ({} if empty_ok else None)
        return model.model_validate(data)
    except (ValidationError, ValueError) as exc:
        raise web.HTTPBadRequest(text=json.dumps(error_body(str(exc))), content_type="application/json") from None


def error_body(message: str) -> dict[str, Any]:
    return {"object": "error", "message": message, "type": "BadRequest", "code": 400}
