"""What a Wyoming request is, apart from the connection that carries it (`wyoming.py`): a `synthesize` /
`synthesize-start` event's data as a request of the declaration's Wyoming door (`event_request`), and the records
of what was accepted: a one-shot `synthesize` (`OneShot`) and a streamed request (`StreamRequest`: its pieces each
journalled on arrival), each holding its place in flight until `settle` closes it once, delivered or
dead-lettered with why.
"""
from __future__ import annotations

import uuid
from typing import Any, Mapping

from cosyedge.api.admission import Ticket
from cosyedge.api.errors import ApiError
from cosyedge.api.journal import PieceJournal
from cosyedge.api.service import Service
from cosyedge.device import Engine, InputError, SentenceStream
from cosyedge.device import request as declaration
from cosyedge.device.errors import UnknownFieldError

ROUTE = "wyoming:synthesize"
STREAM_ROUTE = "wyoming:synthesize-chunk"
# Keys of a synthesize event's data that are the protocol's own, not request fields: `voice` (read below),
# `text_format` (only plain text is spoken) and `context` (the conversation's, nothing to do with the audio).
PROTOCOL_KEYS = ("voice", "text_format", "context")


def event_request(data: dict[str, Any], defaults: Mapping[str, Any], engine: Engine,
                  aliases: Mapping[str, str]) -> declaration.Request:
    """A synthesize / synthesize-start event's request (its data as sent) over `defaults` (the `cosyedge wyoming`
    flags), checked as every door checks it."""
    if not isinstance(data, dict):
        raise InputError("an event's data must be an object")
    voice = data.get("voice")
    if voice is not None and not isinstance(voice, dict):
        raise InputError("voice must be an object with a name")
    if (voice or {}).get("speaker") is not None:
        raise UnknownFieldError("voice.speaker: these voices have no speakers; choose a voice by its name")
    if data.get("text_format") not in (None, "text"):
        raise InputError("only text_format 'text' is spoken (no SSML)")
    fields = {key: value for key, value in data.items() if key not in PROTOCOL_KEYS}
    name = (voice or {}).get("name")  # a language alone: the bundle's default voice
    values = {**defaults, **fields, **({"voice": name} if name is not None else {})}
    return declaration.parse(values, declaration.WYOMING, engine, aliases)


class OneShot:
    """A one-shot `synthesize`, admitted and journalled on arrival; `settle` closes it once: delivered (None) or
    dead-lettered with why."""

    def __init__(self, service: Service, payload: dict[str, Any], ticket: Ticket) -> None:
        self.journal, self.payload, self.ticket = service.journal, payload, ticket
        self.request_id = uuid.uuid4().hex[:16]
        self.settled = False
        try:
            self.journal.accepted(self.request_id, ROUTE, payload)
        except OSError:
            ticket.release()
            raise journal_unavailable() from None

    def settle(self, why: str | None) -> None:
        if self.settled:
            return
        self.settled = True
        if why is None:
            self.journal.finished(self.request_id)
        else:
            self.journal.dead_letter(ROUTE, self.request_id, self.payload, why)
        self.ticket.release()


class StreamRequest:
    """One streaming request: its request fields, splitter, pieces journalled on arrival and place in flight; `settle`
    closes its pieces (delivered: None, else dead-lettered with why) and gives its place back."""

    def __init__(self, service: Service, request: declaration.Request, ticket: Ticket) -> None:
        self.request, self.ticket = request, ticket
        self.pieces = PieceJournal(service.journal, STREAM_ROUTE, uuid.uuid4().hex[:16])
        self.splitter = SentenceStream(max_chars=min(400, service.config.max_text_len))
        self.spoken = 0  # sentences spoken
        self.queued = 0  # characters of the sentences cut and not yet spoken (the splitter holds at most 400 more)
        self.settled = False

    def settle(self, why: str | None) -> None:
        if self.settled:
            return
        self.settled = True
        self.pieces.close(why)
        self.ticket.release()


class RefusedStream:
    """A streaming request refused at `synthesize-start` (queue full): its chunks and stop are dropped."""


def journal_unavailable() -> ApiError:
    return ApiError(503, "journal_unavailable", "the service cannot record requests (state directory not "
                    "writable); retry later")
