"""Request bodies, parsed and validated once into what the engine takes.

The JSON parser is bounded (nesting depth, digits per number, no NaN/Infinity) so that no body, and no
WebSocket message (`loads` is theirs too), makes the parser recurse or convert without limit. The fields
themselves are the request declaration's (`cosyedge.device.request`): their types, bounds, defaults and error
codes are checked there, the same for every door; here each route's body is handed to it under its door's names.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from itertools import accumulate
from typing import Any, Mapping

from flask import request

from cosyedge.api.errors import ApiError
from cosyedge.device import request as declaration
from cosyedge.device.audio import codec_rate
from cosyedge.device.engine import Engine
from cosyedge.device.errors import CosyedgeError, InputError
from cosyedge.device.options import Segment, SynthesisOptions

MAX_JSON_DEPTH = 32          # our bodies nest 2 deep; a deeper one is an attack on the parser
MAX_NUMBER_CHARS = 40        # digits, sign, point and exponent of one JSON number
MAX_VOICE_UPLOAD = 16 << 20  # bytes: 30 s of 48 kHz stereo 16-bit WAV is 11 MB
_STRING = re.compile(r'"(?:[^"\\]++|\\.)*+"', re.DOTALL)
_BRACKET = re.compile(r"[\[\]{}]")


@dataclass(frozen=True)
class Speech:
    """One text to speak: its segments, the validated options, the audio format and rate, whether to stream."""
    text: str
    segments: list[Segment]
    options: SynthesisOptions
    format: str
    stream: bool
    sample_rate: int | None = None  # None: the voice's own rate
    timestamps: bool = False  # answer JSON: the audio and its words' times
    subtitles: str | None = None  # answer the words' times as a subtitle file (vtt, srt)

    def rate(self, voice_rate: int) -> int:
        """The rate delivered: as `Request.rate` (the codec's rate next to the one asked for)."""
        return codec_rate(self.format, self.sample_rate or voice_rate)

    @property
    def words(self) -> bool:
        """Whether the answer needs the words' times."""
        return self.timestamps or self.subtitles is not None

    @property
    def answer(self) -> str:
        """What the answer is: the audio's format, or what wraps or replaces it (a key of the phrase cache)."""
        return f"subtitles:{self.subtitles}" if self.subtitles else f"timestamps:{self.format}" if self.timestamps \
            else self.format


@dataclass(frozen=True)
class Batch:
    """Many texts with shared options; `items` holds each text's segments, or the error that refused it."""
    texts: list[Any]
    items: list[list[Segment] | ApiError]
    options: SynthesisOptions
    format: str
    sample_rate: int | None = None

    def rate(self, voice_rate: int) -> int:
        """The rate delivered: as `Request.rate` (the codec's rate next to the one asked for)."""
        return codec_rate(self.format, self.sample_rate or voice_rate)


# -- the JSON body ---------------------------------------------------------------------------------
def _bounded_number(literal: str, convert: type) -> int | float:
    if len(literal) > MAX_NUMBER_CHARS:
        raise ApiError(400, "number_too_large", f"a number in the body has {len(literal)} characters; "
                                                f"the limit is {MAX_NUMBER_CHARS}")
    return convert(literal)


def _no_constant(name: str) -> None:
    raise ApiError(400, "invalid_json", f"{name} is not valid JSON")


def _check_depth(text: str) -> None:
    """Refuse nesting deeper than MAX_JSON_DEPTH before the (recursive) parser sees it."""
    brackets = _BRACKET.findall(_STRING.sub('""', text))
    if brackets and max(accumulate(1 if b in "[{" else -1 for b in brackets)) > MAX_JSON_DEPTH:
        raise ApiError(400, "nesting_too_deep", f"the request body nests deeper than {MAX_JSON_DEPTH} levels")


def loads(text: str) -> dict[str, Any]:
    """One JSON object (a body or a WebSocket message), parsed with bounded depth and number size."""
    _check_depth(text)
    try:
        body = json.loads(text, parse_int=lambda s: _bounded_number(s, int),
                          parse_float=lambda s: _bounded_number(s, float), parse_constant=_no_constant)
    except json.JSONDecodeError as exc:
        raise ApiError(400, "invalid_json", f"the request body is not valid JSON ({exc.msg} at line {exc.lineno} "
                                            f"column {exc.colno})") from None
    if not isinstance(body, dict):
        raise ApiError(400, "invalid_json", "the request body must be a JSON object")
    return body


def json_body() -> dict[str, Any]:
    """The request's JSON object, parsed with bounded depth and number size."""
    if request.mimetype != "application/json":
        raise ApiError(415, "unsupported_media_type", "send the request body as JSON with Content-Type: application/json")
    try:
        text = request.get_data(cache=False).decode("utf-8")
    except UnicodeDecodeError:
        raise ApiError(400, "invalid_utf8", "the request body is not valid UTF-8") from None
    return loads(text)


# -- bodies ------------------------------------------------------------------------------------------
def parse(values: Mapping[str, Any], door: str, engine: Engine, aliases: Mapping[str, str]) -> declaration.Request:
    """The declaration's `parse` for an API door; a refused field is the API's error of its code."""
    try:
        return declaration.parse(values, door, engine, aliases)
    except CosyedgeError as exc:
        raise ApiError.from_device(exc) from None


def _segments(engine: Engine, text: Any, field: str, words: bool = False) -> list[Segment]:
    try:
        if not isinstance(text, str):
            raise InputError(f"{field} must be a string")
        return engine.segments(text, words=words)
    except CosyedgeError as exc:
        raise ApiError.from_device(exc) from None


def _speech(body: dict[str, Any], door: str, engine: Engine, aliases: Mapping[str, str]) -> Speech:
    job = parse(body, door, engine, aliases)
    words = job.timestamps or job.subtitles is not None
    if job.subtitles and job.stream:
        raise ApiError(400, "invalid_parameter", "a subtitle file is a whole answer: send subtitles without stream "
                       "(timestamps with stream: NDJSON lines of audio and words)")
    segments = _segments(engine, job.text, declaration.BY_NAME["text"].wire_name(door), words)
    return Speech(job.text or "", segments, job.options, job.format, job.stream, job.sample_rate, job.timestamps,
                  job.subtitles)


def speech(body: dict[str, Any], engine: Engine, aliases: Mapping[str, str]) -> Speech:
    """POST /v1/audio/speech: OpenAI's fields, and the extension fields its SDK sends through `extra_body`."""
    return _speech(body, declaration.SPEECH, engine, aliases)


def tts(body: dict[str, Any], engine: Engine, aliases: Mapping[str, str]) -> Speech:
    """POST /v1/tts."""
    return _speech(body, declaration.TTS, engine, aliases)


def batch(body: dict[str, Any], engine: Engine, aliases: Mapping[str, str], max_items: int) -> Batch:
    """POST /v1/tts/batch: a bad text fails its own item, a bad shared field the whole request."""
    texts = body.get("texts")
    if not isinstance(texts, list) or not texts:
        raise ApiError(400, "invalid_parameter", "texts must be a non-empty list of strings")
    if len(texts) > max_items:
        raise ApiError(413, "too_many_items", f"{len(texts)} texts; the limit is {max_items} per request")
    job = parse({k: v for k, v in body.items() if k != "texts"}, declaration.BATCH, engine, aliases)
    items: list[list[Segment] | ApiError] = []
    for index, text in enumerate(texts):
        try:
            items.append(_segments(engine, text, f"texts[{index}]"))
        except ApiError as exc:
            items.append(exc)
    return Batch(texts, items, job.options, job.format, job.sample_rate)


def voice_upload(max_text_len: int) -> tuple[str, bytes, str]:
    """POST /v1/audio/voices: multipart `name`, `text` (the transcript, at most max_text_len characters), file `audio`."""
    request.max_content_length = MAX_VOICE_UPLOAD  # a 30 s prompt is larger than any JSON body
    if request.mimetype != "multipart/form-data":
        raise ApiError(415, "unsupported_media_type", "send multipart/form-data with fields name, text and file audio")
    upload = request.files.get("audio")
    if upload is None:
        raise ApiError(400, "missing_audio", "the form needs a file field 'audio' (1-30 s of the speaker)")
    transcript = request.form.get("text", "")
    if len(transcript) > max_text_len:
        raise ApiError(413, "text_too_long", f"the transcript has {len(transcript)} characters; the limit is {max_text_len}")
    return request.form.get("name", ""), upload.read(), transcript

