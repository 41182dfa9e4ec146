"""One Wyoming event read from a client, bounded and checked (issue 21 items 6 and 12).

The `wyoming` package's reader trusts its peer: a header that is not an object, without a `type` or with a string
`data_length` raised out of the connection's task (a traceback, no answer), a line over the stream's limit or data
that is not JSON closed the connection without a word, and `payload_length` was read whole whatever it said (256
MiB announced: 256 MB held). Here every way an event can be wrong is an `ApiError` with a code, which the
connection answers with an `error` event before it closes normally (the byte stream cannot be trusted after it).
"""
from __future__ import annotations

import asyncio
import json
from typing import Any

from wyoming.event import Event

from cosyedge.api.errors import ApiError

MAX_PAYLOAD_BYTES = 64 * 1024  # a TTS server is sent no audio: a client's payload is read and ignored up to this


def max_event_bytes(max_text_len: int) -> int:
    """The bound on an event's header line and on its data: a chunk of `max_text_len` astral characters fits even
    as JSON escapes (12 bytes each), as the WebSocket frame bound."""
    return 12 * max_text_len + 4096


def _malformed(message: str) -> ApiError:
    return ApiError(400, "bad_request", f"malformed event: {message}")


def _too_large(what: str, size: int, limit: int) -> ApiError:
    return ApiError(413, "event_too_large", f"an event's {what} has {size} bytes; the limit is {limit}")


def _json_object(raw: bytes, what: str) -> dict[str, Any]:
    try:
        value = json.loads(raw)
    except (ValueError, RecursionError):  # not UTF-8, not JSON, nested beyond the parser
        raise _malformed(f"its {what} is not JSON") from None
    if not isinstance(value, dict):
        raise _malformed(f"its {what} is not an object")
    return value


def _length(header: dict[str, Any], key: str, limit: int) -> int:
    value = header.get(key)
    if value is None:
        return 0
    if type(value) is not int or value < 0:
        raise _malformed(f"{key} must be a whole number of bytes")
    if value > limit:
        raise _too_large(key.split("_")[0], value, limit)
    return value


async def read_event(reader: asyncio.StreamReader, limit: int) -> Event | None:
    """The next event (None: the client closed the connection), its header line and data each at most `limit`
    bytes (the reader's own limit must be `limit`), its payload at most MAX_PAYLOAD_BYTES; else `ApiError`."""
    try:
        line = await reader.readuntil(b"\n")
    except asyncio.IncompleteReadError as exc:
        if exc.partial.strip():
            raise _malformed("the connection ended inside its header") from None
        return None
    except asyncio.LimitOverrunError:
        raise ApiError(413, "event_too_large", f"an event's header line is over {limit} bytes") from None
    header = _json_object(line, "header")
    kind, data = header.get("type"), header.get("data", {})
    if not isinstance(kind, str) or not kind:
        raise _malformed("it has no type")
    if not isinstance(data, dict):
        raise _malformed("its data is not an object")
    data_length = _length(header, "data_length", limit)
    payload_length = _length(header, "payload_length", MAX_PAYLOAD_BYTES)
    try:
        if data_length:
            data = {**data, **_json_object(await reader.readexactly(data_length), "data")}
        payload = await reader.readexactly(payload_length) if payload_length else None
    except asyncio.IncompleteReadError:
        return None  # the client left inside the event
    return Event(type=kind, data=data, payload=payload)
