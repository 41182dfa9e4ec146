"""The request declaration: every field a synthesis request may carry, declared once for every door.

A door reads its own wire format (an HTTP body, the WebSocket `start` message, a Wyoming event, command-line
flags) into a mapping of its field names and hands it to `parse`, which checks every value the same way and
returns a `Request` holding the engine's validated `SynthesisOptions`. The OpenAPI document (api/openapi.py) and
the command-line flags (`add_flags`) are generated from the same table, so a field added here reaches every
door: accepted and honoured where its `doors` list the door, refused with `unknown_field` everywhere else.

Rules every door shares: JSON types are strict (`speed: "2"`, `speed: true`, `voice: 10**30` are refused);
a missing field, `null` and, for a string field, `""` all mean the field's default; strings may not hold lone
surrogates; the same value gets the same error code on every door.
"""
from __future__ import annotations

import argparse
import math
import unicodedata
from dataclasses import dataclass, field
from dataclasses import fields as dataclass_fields
from numbers import Integral, Real
from typing import TYPE_CHECKING, Any, Mapping

from cosyedge.device.audio import FORMATS, SAMPLE_RATES, codec_rate
from cosyedge.device.errors import (InputError, SpeedOutOfRangeError, TextTooLongError, UnknownFieldError,
                                    UnknownFormatError, UnknownModelError, UnknownVoiceError,
                                    UnsupportedSampleRateError)
from cosyedge.device.options import INSTRUCT_MAX_CHARS, SEED_MAX, SPEED_RANGE, SynthesisOptions
from cosyedge.device.subtitles import FORMATS as SUBTITLE_FORMATS
from cosyedge.device.text import check_unicode

if TYPE_CHECKING:
    from cosyedge.device.engine import Engine

# The doors. HTTP: the OpenAI route, the native one and the native batch; the WebSocket `start` message;
# Wyoming's `synthesize` / `synthesize-start` events (over the `cosyedge wyoming` flags); the CLI commands.
SPEECH, TTS, BATCH, WEBSOCKET, WYOMING = "speech", "tts", "batch", "websocket", "wyoming"
SYNTH, SYNTH_BATCH, CACHE_WARM = "synth", "synth-batch", "cache-warm"
HTTP = (SPEECH, TTS, BATCH)
CLI = (SYNTH, SYNTH_BATCH, CACHE_WARM, WYOMING)  # doors whose fields are also command-line flags
DOORS = (*HTTP, WEBSOCKET, WYOMING, SYNTH, SYNTH_BATCH, CACHE_WARM)
_ALL = DOORS
_SPOKEN = (SPEECH, TTS, SYNTH)  # doors whose request carries its text (the others send it apart)
_AUDIO_OUT = (*HTTP, WEBSOCKET, SYNTH, SYNTH_BATCH, CACHE_WARM)  # doors that choose an encoding

OPENAI_MODELS = ("tts-1", "tts-1-hd", "gpt-4o-mini-tts")  # accepted as `model`, besides the bundle's own name
MODES = ("zero_shot", "sft", "cross_lingual", "instruct2")
SAMPLINGS = ("default", "greedy")
SPEAKER_ID_MAX = 999_999_999  # at most 9 ASCII digits, as a name made of digits
DETERMINISTIC_SEED = 0  # the seed of a `deterministic` request that gives none (CosyVoice's sampler needs one)


@dataclass(frozen=True)
class Field:
    """One request field: its kind, where it lands, which doors take it and under which names."""
    name: str  # the attribute of `Request` or `SynthesisOptions` it lands in (or only checked: model, stream_format)
    kind: str  # text | string | choice | number | integer | boolean | voice
    doc: str
    doors: tuple[str, ...] = _ALL
    wire: Mapping[str, str] = field(default_factory=dict)  # door -> its name there, where it differs
    default: Any = None
    defaults: Mapping[str, Any] = field(default_factory=dict)  # door -> its own default
    choices: tuple[str, ...] = ()
    bounds: tuple[float, float] | None = None
    error: type[InputError] = InputError  # raised for a value of the right type out of choices or bounds
    type_error: type[InputError] = InputError  # raised for a value of the wrong JSON type
    flag: str | None = None  # the command-line flag of the CLI doors that take the field
    max_chars: int | None = None  # a string's bound, counted after NFKC (as every text bound is)

    def wire_name(self, door: str | None) -> str:
        return self.wire.get(door, self.name) if door else self.name

    def default_for(self, door: str | None) -> Any:
        return self.defaults.get(door, self.default) if door else self.default

    def check(self, value: Any, door: str | None = None) -> Any:
        """The value as the request's own, or the default for an absent one (None, and "" for strings)."""
        if value is None or (value == "" and self.kind in ("string", "choice", "voice")):
            return self.default_for(door)
        return _CHECKS[self.kind](self, value, self.wire_name(door))


def _string(f: Field, value: Any, name: str) -> str:
    if not isinstance(value, str):
        raise f.type_error(f"{name} must be a string")
    try:
        check_unicode(value)
    except InputError:
        raise InputError(f"{name} contains invalid Unicode (lone surrogate code points U+D800-U+DFFF)") from None
    if f.max_chars is not None and (length := len(unicodedata.normalize("NFKC", value))) > f.max_chars:
        raise TextTooLongError(f"{name} has {length} characters (after NFKC); the limit is {f.max_chars}")
    return value


def _choice(f: Field, value: Any, name: str) -> str:
    if not isinstance(value, str) or value not in f.choices:
        raise f.error(f"unknown {name} {str(value)[:32]!r}; choose one of {', '.join(f.choices)}")
    return value


def _number(f: Field, value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, Real):
        raise f.type_error(f"{name} must be a number")
    low, high = f.bounds or (-math.inf, math.inf)
    if not low <= value <= high:  # compared as given: a huge int never becomes a float; NaN fails both
        raise f.error(f"{name} {str(value)[:32]} is out of range {low:g}-{high:g}")
    return float(value)


def _integer(f: Field, value: Any, name: str) -> int:
    low, high = f.bounds or (-math.inf, math.inf)
    if isinstance(value, bool) or not isinstance(value, Integral):
        raise f.type_error(f"{name} must be an integer in {low:.0f}-{high:.0f}")
    if not low <= value <= high:
        raise f.error(f"{name} must be an integer in {low:.0f}-{high:.0f}")
    return int(value)


def _boolean(f: Field, value: Any, name: str) -> bool:
    if not isinstance(value, bool):
        raise f.type_error(f"{name} must be true or false")
    return value


def _voice(f: Field, value: Any, name: str) -> str | int:
    """A voice name, or a speaker id written as ASCII digits ("²" is a name); `{"id": name}` as newer OpenAI SDKs
    send it."""
    if isinstance(value, dict) and set(value) == {"id"}:
        value = value["id"]
    if not isinstance(value, str):
        raise UnknownVoiceError(f"{name} must be a name (a speaker id goes in speaker_id, or as digits)")
    value = _string(f, value, name)
    if value.isascii() and value.isdigit():
        if len(value) > 9:
            raise UnknownVoiceError(f"unknown voice {value[:32]!r}: a speaker id is at most 9 ASCII digits")
        return int(value)
    return value


_CHECKS = {"text": _string, "string": _string, "choice": _choice, "number": _number, "integer": _integer,
           "boolean": _boolean, "voice": _voice}

# -- the declaration ---------------------------------------------------------------------------------------
FIELDS: tuple[Field, ...] = (
    Field("text", "text", "the text to speak; emoji and unpronounceable symbols are removed, not rejected",
          doors=(*_SPOKEN, WYOMING), wire={SPEECH: "input"}),
    Field("model", "string", "an OpenAI model name or the bundle's own (see /v1/models); all mean the loaded bundle",
          doors=(*HTTP, WEBSOCKET), defaults={SPEECH: "tts-1"}, error=UnknownModelError,
          type_error=UnknownModelError),
    Field("voice", "voice", "a local voice name, a numeric speaker id as text, or an alias (OpenAI voice names)",
          flag="--voice"),
    Field("speaker_id", "integer", "a numeric speaker id, instead of voice", doors=(TTS, BATCH, WEBSOCKET),
          bounds=(0, SPEAKER_ID_MAX), error=UnknownVoiceError, type_error=UnknownVoiceError),
    Field("speed", "number", "speaking rate: 2 is twice as fast", default=1.0, bounds=SPEED_RANGE,
          error=SpeedOutOfRangeError, flag="--speed"),
    Field("format", "choice", "audio encoding (pcm: 16-bit mono little-endian)", doors=_AUDIO_OUT,
          wire={SPEECH: "response_format"}, default="wav", defaults={SPEECH: "mp3", WEBSOCKET: "pcm"},
          choices=FORMATS, error=UnknownFormatError, type_error=UnknownFormatError, flag="--format"),
    Field("sample_rate", "integer", "output sample rate in Hz, resampled from the voice's own (default: the "
          "voice's; mp3, aac and opus at a rate their codec does not take: the next one up, as X-Sample-Rate says)",
          doors=(*_AUDIO_OUT, WYOMING),
          bounds=SAMPLE_RATES, error=UnsupportedSampleRateError, flag="--sample-rate"),
    Field("stream", "boolean", "send the audio as it is made (chunked)", doors=(SPEECH, TTS), default=False),
    Field("timestamps", "boolean", "word times, on the output audio's clock (families with word times). HTTP: answer "
          "JSON, the audio (base64) with its words and segments (with stream: NDJSON lines of audio and words); "
          "WebSocket: a `word` event once the audio holding the word has been sent", doors=(SPEECH, TTS, WEBSOCKET),
          default=False),
    Field("subtitles", "choice", "answer the words' times alone, as a WebVTT (vtt) or SRT (srt) file (not with "
          "stream)", doors=(SPEECH, TTS), choices=SUBTITLE_FORMATS),
    Field("stream_format", "choice", "OpenAI's stream format: only audio", doors=(SPEECH,), choices=("audio",)),
    Field("seed", "integer", "sampling seed: the same seed gives the same audio (the phrase cache keeps it)",
          bounds=(0, SEED_MAX), flag="--seed"),
    Field("deterministic", "boolean", "no sampling noise, and the sampler seeded (0 unless seed says otherwise): "
          "the same text gives the same audio (the phrase cache keeps it)", default=False, flag="--deterministic"),
    Field("sampling", "choice", "speech-token sampling (CosyVoice): the release's sampler or greedy",
          default="default", choices=SAMPLINGS, flag="--sampling"),
    Field("preset", "string", "CosyVoice2 flow quality preset: official (default) or a faster one the bundle "
          "lists (`cosyedge info`: config.presets); unknown: unknown_preset", flag="--preset"),
    Field("mode", "choice", "CosyVoice inference mode (default: the voice's own)", choices=MODES, flag="--mode"),
    Field("instruct_text", "string", "CosyVoice instruct2: how to speak ('用四川话说这句话'), in a sentence or two; "
          "a family without instruct refuses it (unsupported_option)", wire={SPEECH: "instructions"},
          flag="--instruct", max_chars=INSTRUCT_MAX_CHARS),
)
BY_NAME = {f.name: f for f in FIELDS}


@dataclass(frozen=True)
class Request:
    """One door's request, checked once: the engine's options and what the door does with the audio."""
    options: SynthesisOptions
    format: str = "wav"
    sample_rate: int | None = None  # the output rate asked for; None: the voice's own
    stream: bool = False
    text: str | None = None  # for the doors whose request carries its text
    timestamps: bool = False  # word times: a JSON / NDJSON answer (HTTP), word events (WebSocket)
    subtitles: str | None = None  # the answer is a subtitle file (vtt, srt) instead of the audio

    def rate(self, voice_rate: int) -> int:
        """The rate of the audio delivered: the one asked for (else the voice's), raised to the next one the
        format's codec takes (`codec_rate`)."""
        return codec_rate(self.format, self.sample_rate or voice_rate)


def fields(door: str) -> list[Field]:
    """The fields a door takes, in declaration order."""
    return [f for f in FIELDS if door in f.doors]


def _unknown(key: str, door: str) -> UnknownFieldError:
    here = {f.name: f.wire_name(door) for f in fields(door)}
    hint = next((f"; this door calls it {here[f.name]!r}" for f in FIELDS
                 if key in (f.name, *f.wire.values()) and f.name in here), "")
    return UnknownFieldError(f"unknown field {str(key)[:40]!r}{hint or '; the fields here: ' + ', '.join(here.values())}")


def parse(values: Mapping[str, Any], door: str, engine: "Engine", aliases: Mapping[str, str] | None = None) -> Request:
    """A door's fields (by its names) -> the validated request; typed errors (their `code`) for anything refused."""
    declared = {f.wire_name(door): f for f in fields(door)}
    for key in values:
        if key not in declared:
            raise _unknown(key, door)
    got = {f.name: f.check(values.get(wire), door) for wire, f in declared.items()}
    for name in got:
        if name not in _OPTIONS and name not in _REQUEST and name not in _CHECKED:
            raise TypeError(f"declared field {name!r} lands nowhere: add it to SynthesisOptions or Request")
    voice = got.get("voice")
    if got.get("speaker_id") is not None:
        if voice is not None:
            raise InputError("give voice or speaker_id, not both")
        voice = got["speaker_id"]
    elif isinstance(voice, str):
        voice = (aliases or {}).get(voice, voice)
    if got.get("model") is not None and got["model"] not in (*OPENAI_MODELS, engine.bundle.manifest.name):
        raise UnknownModelError(f"unknown model {got['model'][:64]!r}; see /v1/models")
    options = engine.options(**{**{k: v for k, v in got.items() if k in _OPTIONS and v is not None}, "voice": voice})
    return Request(options, **{k: v for k, v in got.items() if k in _REQUEST and v is not None})


_OPTIONS = {f.name for f in dataclass_fields(SynthesisOptions)}
_REQUEST = {f.name for f in dataclass_fields(Request)} - {"options"}
_CHECKED = {"model", "stream_format", "speaker_id"}  # checked, then part of another field or of nothing


# -- command-line doors ------------------------------------------------------------------------------------
_CLI_TYPES = {"number": float, "integer": int, "string": str, "voice": str}


def add_flags(parser: argparse.ArgumentParser, door: str) -> None:
    """The door's fields as flags (dest = the field's name); `cli_values` reads them back for `parse`."""
    for f in fields(door):
        if f.flag is None:
            continue
        if f.kind == "boolean":
            parser.add_argument(f.flag, dest=f.name, action="store_true", help=f.doc)
        elif f.kind == "choice":
            default = f.default_for(door)
            parser.add_argument(f.flag, dest=f.name, choices=f.choices,
                                help=f.doc if default is None else f"{f.doc} (default: {default})")
        else:
            parser.add_argument(f.flag, dest=f.name, type=_CLI_TYPES[f.kind], help=f.doc)


def cli_values(args: argparse.Namespace, door: str, **given: Any) -> dict[str, Any]:
    """The flags `add_flags` added, as `parse` takes them (an unset flag is absent), plus `given` (e.g. text)."""
    values = {f.name: getattr(args, f.name) for f in fields(door) if f.flag is not None}
    return {**{k: v for k, v in values.items() if v is not None and v is not False}, **given}  # 0 is a value


IN_FLIGHT_MAX = 256  # lines of a batch command in the engine at once (each holds a thread and a few sentences)


def add_in_flight(parser: argparse.ArgumentParser) -> None:
    """`--in-flight N` of the commands that render many lines (`synth-batch`, `cache warm`): not a request field,
    how many requests the command keeps in the engine at once."""
    parser.add_argument("--in-flight", type=int, metavar="N",
                        help="lines in the engine at once through its door (default: the bundle's batch bound; "
                             "1: one at a time)")


def check_in_flight(value: int) -> int:
    if not 1 <= value <= IN_FLIGHT_MAX:
        raise InputError(f"--in-flight must be in 1-{IN_FLIGHT_MAX}")
    return value
