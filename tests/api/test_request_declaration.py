"""One request declaration (issue 20 item 3): every field reaches every door, accepted and honoured where the
declaration lists the door, refused with a code everywhere else; the OpenAPI document is generated from it.

The walk drives each door's own parse path in process (the HTTP bodies, the WebSocket `start` message, Wyoming's
synthesize event and `cosyedge wyoming` flags, the CLI commands' flags) on the tiny CosyVoice2 bundle, whose
presets, modes and instruct text make every field valid somewhere. The network doors' answers to hostile values
are in test_api_errors.py, test_websocket.py, test_wyoming.py and tests/device/test_cli.py.
"""
from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any, Callable

import pytest

from cosyedge.api import bodies, openapi
from cosyedge.api.config import ServiceConfig
from cosyedge.api.errors import DEVICE_ERRORS, ApiError
from cosyedge.api.routes.websocket import start_request
from cosyedge.api.wyoming_requests import event_request
from cosyedge.device import request as declaration
from cosyedge.device.cli import build_parser
from cosyedge.device.engine import Engine
from cosyedge.device.errors import CosyedgeError
from cosyedge.device.request import (BATCH, CACHE_WARM, FIELDS, SPEECH, SYNTH, SYNTH_BATCH, TTS, WEBSOCKET, WYOMING,
                                     Field)
from cosyedge.device.sessions import SessionConfig
from requesttools import HOSTILE, case_id

# field -> (a valid value, what the request then holds, a refused value, its code). The tiny CosyVoice2 bundle's
# voices: tiny_spk_zh (0, the default), tiny_spk_en (1), tiny_sft_spk (2). A field added to the declaration
# needs a row here (the first test), and then must pass on every door.
EXAMPLES: dict[str, tuple[Any, Any, Any, str]] = {
    "text": ("你好。", "你好。", 5, "invalid_parameter"),
    "model": ("tts-1-hd", None, "dall-e-3", "unknown_model"),
    "voice": ("1", "tiny_spk_en", "nobody", "unknown_voice"),
    "speaker_id": (1, "tiny_spk_en", -1, "unknown_voice"),
    "speed": (1.5, 1.5, 0.1, "speed_out_of_range"),
    "format": ("flac", "flac", "midi", "unknown_format"),
    "sample_rate": (16000, 16000, 96000, "unsupported_sample_rate"),
    "stream": (True, True, "yes", "invalid_parameter"),
    "timestamps": (True, True, "yes", "invalid_parameter"),
    "subtitles": ("vtt", "vtt", "ass", "invalid_parameter"),
    "stream_format": ("audio", None, "sse", "invalid_parameter"),
    "seed": (7, 7, -1, "invalid_parameter"),
    "deterministic": (True, True, 1, "invalid_parameter"),
    "sampling": ("greedy", "greedy", "hot", "invalid_parameter"),
    "preset": ("official", "official", "turbo", "unknown_preset"),
    "mode": ("cross_lingual", "cross_lingual", "karaoke", "invalid_parameter"),
    "instruct_text": ("Speak slowly.", "Speak slowly.", "\ud800", "invalid_parameter"),
}
def _on_a_command_line(case: tuple[dict[str, Any], str]) -> bool:
    """Whether a command line can say the hostile value: no JSON type there, so "2" is a number and True a switch."""
    (name, value), = case[0].items()
    field = declaration.BY_NAME.get(name)
    if field is not None and field.kind == "boolean" or isinstance(value, bool):
        return False  # a switch: present or not
    return not (isinstance(value, str) and name in ("speed", "seed", "sample_rate")) \
        and not (isinstance(value, int) and name == "voice")


# A command's own output option that shares a field's name: `synth --subtitles FILE.vtt` names the subtitle file
# beside -o (its suffix is the format, as HTTP's `subtitles` field chooses it); `synth-batch --subtitles vtt|srt`
# writes one beside each line's file.
CLI_OUTPUT_OPTIONS = {(SYNTH, "subtitles"), (SYNTH_BATCH, "subtitles")}
CLI_COMMANDS = {SYNTH: "synth 你好。 -o out.wav", SYNTH_BATCH: "synth-batch lines.txt --out-dir out",
                CACHE_WARM: "cache warm lines.txt", WYOMING: "wyoming"}


@pytest.fixture(scope="module")
def engine(cv2_tiny_bundle: Path) -> Engine:
    return Engine.load(cv2_tiny_bundle, precision="fp32", sessions=SessionConfig(providers=("cpu",), intra_op_threads=1),
                       warmup=False)


def _json_door(door: str, engine: Engine) -> Callable[[dict[str, Any]], declaration.Request]:
    """The door's own parse path for a JSON object of its fields (a request that needs a text gets one)."""
    def http(body: dict[str, Any]) -> Any:
        if door == SPEECH:
            return bodies.speech({"input": "你好。", **body}, engine, {})
        if door == TTS:
            return bodies.tts({"text": "你好。", **body}, engine, {})
        return bodies.batch({"texts": ["你好。"], **body}, engine, {}, 8)

    def wyoming(body: dict[str, Any]) -> Any:
        data = {"text": "你好。", **body}
        if "voice" in body:
            data["voice"] = {"name": body["voice"]}
        return event_request(data, {}, engine, {})

    if door == WEBSOCKET:
        return lambda body: start_request({"type": "start", **body}, engine, {})
    return wyoming if door == WYOMING else http


def _cli_door(door: str, engine: Engine) -> Callable[[dict[str, Any]], declaration.Request]:
    """A CLI door: its command line with the field's flag, read back as the command reads it."""
    def run(body: dict[str, Any]) -> declaration.Request:
        (name, value), = body.items()
        field = declaration.BY_NAME[name]
        flags = [field.flag] if value is True else [field.flag, str(value)]
        args = build_parser().parse_args([*shlex.split(CLI_COMMANDS[door]), *flags])
        values = declaration.cli_values(args, door)
        if door == WYOMING:  # the flags are the defaults of every event
            return event_request({"text": "你好。"}, values, engine, {})
        return declaration.parse(values, door, engine)
    return run


def _code(exc: Exception) -> str:
    """The error code a client sees: the API's, or for a device error the API's code of its device code."""
    if isinstance(exc, ApiError):
        return exc.code
    assert isinstance(exc, CosyedgeError), exc
    return DEVICE_ERRORS[exc.code][1]


def _landed(job: Any, name: str) -> Any:
    """Where a field's value ends up in a door's request (None: checked only, it selects nothing)."""
    if name in ("voice", "speaker_id"):
        return job.options.voice
    if name in declaration._OPTIONS:
        return getattr(job.options, name)
    if name in declaration._REQUEST:
        return getattr(job, name)
    return None


def test_every_declared_field_has_an_example_here():
    assert set(EXAMPLES) == {f.name for f in FIELDS}


@pytest.mark.parametrize("door", [SPEECH, TTS, BATCH, WEBSOCKET, WYOMING])
def test_every_field_is_honoured_or_refused_with_a_code_on_every_door(engine, door):
    parse = _json_door(door, engine)
    for field in FIELDS:
        good, held, bad, code = EXAMPLES[field.name]
        wire = field.wire_name(door)
        if door not in field.doors:
            with pytest.raises((ApiError, CosyedgeError)) as refused:
                parse({field.name: good})
            assert _code(refused.value) == "unknown_field", (door, field.name)
            continue
        if field.name == "text":
            continue  # the door's own text (the helper sends one); its bad values: the hostile tables
        job = parse({wire: good})
        assert _landed(job, field.name) == held, (door, field.name, job)
        with pytest.raises((ApiError, CosyedgeError)) as refused:
            parse({wire: bad})
        assert _code(refused.value) == code, (door, field.name, refused.value)


@pytest.mark.parametrize("door", list(CLI_COMMANDS))
def test_every_flag_of_a_cli_door_is_a_declared_field_and_honoured(engine, door):
    """The CLI doors: a field with a flag lands in the request the command makes (Wyoming: the defaults of every
    event); a field without one has no flag (argparse refuses it: exit 2)."""
    parse = _cli_door(door, engine)
    for field in FIELDS:
        good, held, bad, code = EXAMPLES[field.name]
        if (door, field.name) in CLI_OUTPUT_OPTIONS:
            continue
        if door not in field.doors or field.flag is None:
            with pytest.raises(SystemExit):
                build_parser().parse_args([*shlex.split(CLI_COMMANDS[door]), f"--{field.name.replace('_', '-')}", "1"])
            continue
        assert _landed(parse({field.name: good}), field.name) == held, (door, field.name)
        if field.kind == "boolean":
            continue  # a switch has no bad value
        try:
            parse({field.name: bad})
        except SystemExit as refused:  # argparse's own check (a type or a choice): one line and exit 2
            assert refused.code == 2
        except CosyedgeError as refused:
            assert _code(refused) == code, (door, field.name)
        else:
            pytest.fail(f"{door}: {field.flag} {bad!r} was accepted")


@pytest.mark.parametrize("door", list(CLI_COMMANDS))
def test_a_zero_on_a_cli_door_is_a_value_not_an_absent_flag(engine, door):
    """`--seed 0` is seed 0 (0 == False once made the flag look unset: a random seed instead)."""
    if "seed" not in declaration.BY_NAME or door not in declaration.BY_NAME["seed"].doors:
        pytest.fail(f"{door}: no --seed flag to check")
    assert _landed(_cli_door(door, engine)({"seed": 0}), "seed") == 0, door


def test_a_field_added_to_the_declaration_reaches_every_door(engine, monkeypatch):
    """A new field declared for /v1/tts only: the OpenAPI document lists it there and nowhere else, every other
    door refuses it with unknown_field, and a field that lands nowhere is a loud error, never silently dropped."""
    volume = Field("volume", "number", "loudness", doors=(TTS,), bounds=(0.0, 2.0))
    monkeypatch.setattr(declaration, "FIELDS", (*FIELDS, volume))
    document = openapi.spec(ServiceConfig())
    bodies_of = {path: document["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
                 for path in ("/v1/audio/speech", "/v1/tts", "/v1/tts/batch")}
    assert bodies_of["/v1/tts"]["properties"]["volume"] == {"description": "loudness", "type": "number",
                                                             "minimum": 0.0, "maximum": 2.0}
    assert all("volume" not in body["properties"] and body["additionalProperties"] is False
               for path, body in bodies_of.items() if path != "/v1/tts")
    for door in (SPEECH, BATCH, WEBSOCKET, WYOMING):
        with pytest.raises((ApiError, CosyedgeError)) as refused:
            _json_door(door, engine)({"volume": 1.0})
        assert _code(refused.value) == "unknown_field"
    with pytest.raises(TypeError, match="lands nowhere"):
        _json_door(TTS, engine)({"volume": 1.0})


def test_the_openapi_bodies_are_the_declaration(engine):
    """Each synthesis body's properties are exactly its door's fields under its door's names."""
    document = openapi.spec(ServiceConfig())
    for path, door, own in (("/v1/audio/speech", SPEECH, set()), ("/v1/tts", TTS, set()),
                            ("/v1/tts/batch", BATCH, {"texts"})):
        schema = document["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert set(schema["properties"]) == {f.wire_name(door) for f in declaration.fields(door)} | own


@pytest.mark.parametrize("case", [case for case in HOSTILE if _on_a_command_line(case)], ids=case_id)
def test_hostile_values_on_the_cli_doors_get_the_codes_http_gives(default_engine, case):
    """The hostile table (tests/requesttools.py) as `cosyedge synth` flags, where a command line can say it (no
    JSON types there): the same code as HTTP, or argparse's own refusal (exit 2) for a choice it checks."""
    (name, value), = case[0].items()
    field = declaration.BY_NAME.get(name)
    argv = [*shlex.split(CLI_COMMANDS[SYNTH]), field.flag if field and field.flag else f"--{name}", str(value)]
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as refused:
        assert refused.code == 2 and (field is None or field.choices or field.kind in ("integer", "number")), case
        return
    with pytest.raises(CosyedgeError) as refused:
        declaration.parse(declaration.cli_values(args, SYNTH, text="Hi."), SYNTH, default_engine)
    assert _code(refused.value) == case[1]
