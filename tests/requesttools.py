"""The hostile field values every door's test sends (issue 21 item 14, issue 20 item 3): one table, so the same
value must get the same error code on HTTP, WebSocket, Wyoming and the CLI. Fields by their declared name; each
door's test sends them under its own names (`Field.wire_name`)."""
from __future__ import annotations

from typing import Any

from cosyedge.device.request import BY_NAME

# (fields, the API's error code) on the default voice (Piper: no presets, no modes, no instruct text).
HOSTILE: list[tuple[dict[str, Any], str]] = [
    ({"speed": "2"}, "invalid_parameter"),
    ({"speed": True}, "invalid_parameter"),
    ({"speed": 9}, "speed_out_of_range"),
    ({"speed": 10**30}, "speed_out_of_range"),
    ({"voice": 10**30}, "unknown_voice"),
    ({"voice": "\u00b2"}, "unknown_voice"),
    ({"seed": -1}, "invalid_parameter"),
    ({"seed": 2**32}, "invalid_parameter"),
    ({"seed": "7"}, "invalid_parameter"),
    ({"deterministic": "yes"}, "invalid_parameter"),
    ({"sampling": "hot"}, "invalid_parameter"),
    ({"preset": "turbo"}, "unknown_preset"),
    ({"mode": "sft"}, "unsupported_option"),
    ({"instruct_text": "speak slowly"}, "unsupported_option"),
    ({"instruct_text": "\ud800"}, "invalid_parameter"),
    ({"sample_rate": 100}, "unsupported_sample_rate"),
    ({"sample_rate": 16000.5}, "invalid_parameter"),
    ({"nonsense": 1}, "unknown_field"),
]
# Accepted everywhere: an empty string is the default (issue 21 item 14: `preset: ""` was refused on WebSocket).
DEFAULTS = [{"preset": ""}, {"voice": ""}, {"speed": None}, {"seed": 7}]


def wire(fields: dict[str, Any], door: str) -> dict[str, Any]:
    """`fields` under the door's names (an undeclared name is sent as it is)."""
    return {(BY_NAME[k].wire_name(door) if k in BY_NAME else k): v for k, v in fields.items()}


def case_id(case: tuple[dict[str, Any], str]) -> str:
    (key, value), = case[0].items()
    return f"{key}={str(value)[:12]!r}"
