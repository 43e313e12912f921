"""Reading a request body without trusting its size.

``await request.body()`` holds the whole body in memory before anything can look
at its size: one 2 GiB PUT took the control plane to 4 GB. These read the body
as it arrives and refuse it (413) as soon as it passes its limit.
"""

from __future__ import annotations

import asyncio
import io
import json
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError

from nbfleet.model.errors import ContentTooLarge, InvalidInput

Model = TypeVar("Model", bound=BaseModel)

#: Bytes gathered before each hand-off to a worker thread: large enough that the
#: hop costs little per byte, small enough that memory stays bounded per request.
BATCH = 1024 * 1024


async def spool(stream: AsyncIterator[bytes], write: Callable[[bytearray], None],
                limit: int, what: str, batch: int = BATCH) -> int:
    """Feed the body to ``write`` (run in a worker thread: it does disk I/O) in
    pieces of about ``batch`` bytes; returns the body's size.

    Memory holds at most one batch, whatever the body's size. ContentTooLarge as
    soon as the body passes ``limit``, before the rest of it is read.
    """
    buffer = bytearray()
    size = 0
    async for chunk in stream:
        size += len(chunk)
        if size > limit:
            raise ContentTooLarge(f"{what} is larger than {limit} bytes", limit=limit)
        buffer += chunk
        if len(buffer) >= batch:
            full, buffer = buffer, bytearray()
            await asyncio.to_thread(write, full)
    if buffer:
        await asyncio.to_thread(write, buffer)
    return size


async def read_bounded(stream: AsyncIterator[bytes], limit: int, what: str) -> bytes:
    """The whole body as bytes, for a caller that needs them in memory; refused
    (ContentTooLarge) as soon as it passes ``limit``, so at most ``limit`` bytes are
    ever held. (``BytesIO.getvalue`` hands over its buffer: no second copy.)"""
    buffer = io.BytesIO()
    async for chunk in stream:
        if buffer.tell() + len(chunk) > limit:
            raise ContentTooLarge(f"{what} is larger than {limit} bytes", limit=limit)
        buffer.write(chunk)
    return buffer.getvalue()


async def json_object(request: Request, limit: int | None = None) -> dict[str, Any]:
    """The body as a JSON object, whatever its Content-Type says: Jupyter's servers
    accept JSON sent without one (JupyterLab sends some as ``text/plain``, Enterprise
    Gateway's client sends none). Empty is ``{}``; anything else is a 400."""
    raw = await request.body()
    if limit is not None and len(raw) > limit:
        raise InvalidInput(f"the body must be under {limit} bytes")
    if not raw.strip():
        return {}
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise InvalidInput(f"the body is not valid JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise InvalidInput("the body must be a JSON object")
    return body


async def json_model(request: Request, model: type[Model]) -> Model:
    """The body as ``model`` (see :func:`json_object`); a mismatch is a 400 that says
    which field is wrong."""
    body = await json_object(request)
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first["loc"]) or "body"
        raise InvalidInput(f"{where}: {first['msg']}") from None
