"""Request bodies, parsed and validated once into what the engine takes.

The JSON parser is bounded (nesting depth, digits per number, no NaN/Infinity) so that no body makes the
parser recurse or convert without limit. The fields' JSON types are checked here; their meaning (voice names,
speed range, seed range, modes) by `engine.options(...)` and `engine.segments(...)`, whose typed errors the
app maps to statuses. Values that the engine would have to convert (huge numbers, "²" as a speaker id) are
refused here, so they are a 400 whatever the engine does with them.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from itertools import accumulate
from typing import Any, Mapping

from flask import request

from cosyedge.api.config import OPENAI_MODELS
from cosyedge.api.errors import ApiError
from cosyedge.device.audio import FORMATS
from cosyedge.device.engine import Engine
from cosyedge.device.errors import CosyedgeError
from cosyedge.device.options import SEED_MAX, SPEED_RANGE, Segment, SynthesisOptions

MAX_JSON_DEPTH = 32          # our bodies nest 2 deep; a deeper one is an attack on the parser
MAX_NUMBER_CHARS = 40        # digits, sign, point and exponent of one JSON number
MAX_VOICE_UPLOAD = 16 << 20  # bytes: 30 s of 48 kHz stereo 16-bit WAV is 11 MB
_STRING = re.compile(r'"(?:[^"\\]++|\\.)*+"', re.DOTALL)
_BRACKET = re.compile(r"[\[\]{}]")


@dataclass(frozen=True)
class Speech:
    """One text to speak: its segments, the validated options, the audio format, whether to stream."""
    text: str
    segments: list[Segment]
    options: SynthesisOptions
    format: str
    stream: bool


@dataclass(frozen=True)
class Batch:
    """Many texts with shared options; `items` holds each text's segments, or the error that refused it."""
    texts: list[Any]
    items: list[list[Segment] | ApiError]
    options: SynthesisOptions
    format: str


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


def json_body() -> dict[str, Any]:
    """The request's JSON object, parsed with bounded depth and number size."""
    if request.mimetype != "application/json":
        raise ApiError(415, "unsupported_media_type", "send the request body as JSON with Content-Type: application/json")
    try:
        text = request.get_data(cache=False).decode("utf-8")
    except UnicodeDecodeError:
        raise ApiError(400, "invalid_utf8", "the request body is not valid UTF-8") from None
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


# -- fields ------------------------------------------------------------------------------------------
def _string(value: Any, field: str) -> str:
    if not isinstance(value, str):
        raise ApiError(400, "invalid_parameter", f"{field} must be a string")
    return value


def _optional_str(value: Any, field: str) -> str | None:
    return None if value is None else _string(value, field) or None


def _bool(value: Any, field: str) -> bool:
    if value is None:
        return False
    if not isinstance(value, bool):
        raise ApiError(400, "invalid_parameter", f"{field} must be true or false")
    return value


def _format(value: Any, default: str) -> str:
    if value is None:
        return default
    if not isinstance(value, str) or value.lower() not in FORMATS:
        raise ApiError(400, "unknown_format", f"unknown audio format {str(value)[:32]!r}; choose one of {', '.join(FORMATS)}")
    return value.lower()


def _speed(value: Any) -> float:
    if value is None:
        return 1.0
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ApiError(400, "invalid_parameter", "speed must be a number")
    if not SPEED_RANGE[0] <= value <= SPEED_RANGE[1]:  # compared as given: a huge int never becomes a float
        raise ApiError(400, "speed_out_of_range", f"speed must be between {SPEED_RANGE[0]} and {SPEED_RANGE[1]}")
    return float(value)


def _seed(value: Any) -> int | None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= SEED_MAX):
        raise ApiError(400, "invalid_parameter", f"seed must be an integer in 0-{SEED_MAX}")
    return value


def _voice_name(value: Any, aliases: Mapping[str, str]) -> str | int | None:
    """A voice name, an alias, or a speaker id written as ASCII digits (other digits, such as "²", are refused)."""
    if value is None or value == "":
        return None
    if not isinstance(value, str):
        raise ApiError(400, "unknown_voice", "voice must be a name")
    if value.isdigit():
        if not value.isascii() or len(value) > 9:
            raise ApiError(400, "unknown_voice", f"unknown voice {value[:32]!r}: a speaker id is at most 9 ASCII digits")
        return int(value)
    return aliases.get(value, value)


def _options(engine: Engine, voice: str | int | None, speed: float, **extra: Any) -> SynthesisOptions:
    try:
        return engine.options(voice=voice, speed=speed, **extra)
    except CosyedgeError as exc:
        raise ApiError.from_device(exc) from None


def _segments(engine: Engine, text: Any, field: str) -> list[Segment]:
    try:
        return engine.segments(_string(text, field))
    except CosyedgeError as exc:
        raise ApiError.from_device(exc) from None


def _native_voice(body: dict[str, Any], aliases: Mapping[str, str]) -> str | int | None:
    voice, speaker = body.get("voice"), body.get("speaker_id")
    if voice is not None and speaker is not None:
        raise ApiError(400, "invalid_parameter", "give voice or speaker_id, not both")
    if speaker is not None:
        if isinstance(speaker, bool) or not isinstance(speaker, int) or speaker < 0:
            raise ApiError(400, "unknown_voice", "speaker_id must be a non-negative integer")
        return speaker
    return _voice_name(voice, aliases)


def _native_options(engine: Engine, body: dict[str, Any], aliases: Mapping[str, str]) -> SynthesisOptions:
    """The native routes' options: voice or speaker_id, speed, seed, determinism and the CosyVoice fields
    (mode, instruct_text, sampling, preset)."""
    return _options(engine, _native_voice(body, aliases), _speed(body.get("speed")),
                    deterministic=_bool(body.get("deterministic"), "deterministic"), seed=_seed(body.get("seed")),
                    mode=_optional_str(body.get("mode"), "mode"),
                    instruct_text=_optional_str(body.get("instruct_text"), "instruct_text"),
                    sampling=_optional_str(body.get("sampling"), "sampling") or "default",
                    preset=_optional_str(body.get("preset"), "preset"))


# -- bodies ------------------------------------------------------------------------------------------
def speech(body: dict[str, Any], engine: Engine, aliases: Mapping[str, str]) -> Speech:
    """POST /v1/audio/speech (OpenAI's fields)."""
    model = body.get("model", "tts-1")
    if not isinstance(model, str) or model not in (*OPENAI_MODELS, engine.bundle.manifest.name):
        raise ApiError(400, "unknown_model", f"unknown model {str(model)[:64]!r}; see /v1/models")
    voice = body.get("voice")
    if isinstance(voice, dict):  # newer SDKs may send {"id": "..."}
        voice = voice.get("id")
    if body.get("stream_format") not in (None, "audio"):
        raise ApiError(400, "invalid_parameter", "only stream_format 'audio' is supported")
    instructions = _optional_str(body.get("instructions"), "instructions")
    text = _string(body.get("input"), "input")
    fmt = _format(body.get("response_format"), "mp3")
    # OpenAI's `instructions` ("speak cheerfully") is CosyVoice's instruct2 text; Piper voices ignore it.
    options = _options(engine, _voice_name(voice, aliases), _speed(body.get("speed")),
                       instruct_text=instructions if engine.bundle.manifest.family != "vits" else None,
                       preset=_optional_str(body.get("preset"), "preset"))
    return Speech(text, _segments(engine, text, "input"), options, fmt, _bool(body.get("stream"), "stream"))


def tts(body: dict[str, Any], engine: Engine, aliases: Mapping[str, str]) -> Speech:
    """POST /v1/tts."""
    text = _string(body.get("text"), "text")
    fmt = _format(body.get("format"), "wav")
    options = _native_options(engine, body, aliases)
    return Speech(text, _segments(engine, text, "text"), options, fmt, _bool(body.get("stream"), "stream"))


def batch(body: dict[str, Any], engine: Engine, aliases: Mapping[str, str], max_items: int) -> Batch:
    """POST /v1/tts/batch: a bad text fails its own item, a bad shared field the whole request."""
    texts = body.get("texts")
    if not isinstance(texts, list) or not texts:
        raise ApiError(400, "invalid_parameter", "texts must be a non-empty list of strings")
    if len(texts) > max_items:
        raise ApiError(413, "too_many_items", f"{len(texts)} texts; the limit is {max_items} per request")
    fmt = _format(body.get("format"), "wav")
    options = _native_options(engine, body, aliases)
    items: list[list[Segment] | ApiError] = []
    for index, text in enumerate(texts):
        try:
            items.append(_segments(engine, text, f"texts[{index}]"))
        except ApiError as exc:
            items.append(exc)
    return Batch(texts, items, options, fmt)


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

