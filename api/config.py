"""Service configuration: defaults < TOML file < COSYEDGE_* environment < command-line flags.

Validated once into a frozen `ServiceConfig`; every later reader trusts it.
"""
from __future__ import annotations

import math
import os
import re
import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path
from types import MappingProxyType
from typing import Any, Mapping

from cosyedge.device.engine import PRECISIONS as ENGINE_PRECISIONS, TARGETS as ENGINE_TARGETS
from cosyedge.device.errors import InputError
from cosyedge.device.paths import read_text

OPENAI_VOICES = ("alloy", "ash", "ballad", "coral", "echo", "fable", "onyx", "nova", "sage", "shimmer", "verse")
PRECISIONS = ("auto", *ENGINE_PRECISIONS)  # numeric formats (the engine's list: one definition)
TARGETS = ENGINE_TARGETS  # build targets of `cosyedge quantize`
HTTP_THREADS_MAX = 1024
# Wyoming connections open at once, at most: each is an open file, and the units allow 65,536 (LimitNOFILE); the
# other half holds the HTTP worker's connections (4,160 at HTTP_THREADS_MAX), the engine's files, the journal and
# ffmpeg's pipes (tests/api/test_api_systemd.py checks the units against it).
WYOMING_CONNECTIONS_MAX = 32768
# A WebSocket session's text accepted and not yet spoken: by default 4 texts' worth (as a Wyoming stream's), at most
# 10 million characters (tens of MB held per session).
PENDING_FACTOR, PENDING_CHARS_MAX = 4, 10_000_000
API_KEY_MIN, API_KEY_MAX = 16, 512
API_KEY = re.compile(r"[\x21-\x7e]{%d,%d}" % (API_KEY_MIN, API_KEY_MAX))  # what fits in `Bearer <key>` unquoted
_HOST_NAME = re.compile(r"[a-z0-9]([a-z0-9-]{0,62})(\.[a-z0-9]([a-z0-9-]{0,62}))*")


class ConfigError(InputError):
    """The service configuration (file, environment or flags) is invalid."""


@dataclass(frozen=True)
class ServiceConfig:
    """Everything `cosyedge serve` needs; see systemd/cosyedge.env.example for the environment names."""
    host: str = "127.0.0.1"
    port: int = 8100
    instance: int | None = None          # template unit: GPU index, added to `port`
    bundle: str | None = None            # None: the embedded default voice
    precision: str = "auto"              # numeric format: auto, fp32, fp16, int8
    target: str | None = None            # build target instead: cpu, gpu-fp16, trt-int8
    http_threads: int = 32               # waitress worker threads (concurrent requests, streams included)
    queue_size: int = 64                 # requests in flight, every protocol (admission.py); beyond it: 503
    batch_max: int = 8                   # CosyVoice: rows decoded together, whole-file requests started together
    batch_timeout_ms: float = 20.0       # CosyVoice, idle engine: how long a whole-file request waits for company
    max_text_len: int = 2000             # characters per text; beyond it: 413
    max_batch_items: int = 64            # texts per /v1/tts/batch request
    request_timeout_s: float = 60.0      # deadline for work to start; beyond it: 504
    rate_limit_per_s: float = 0.0        # per-client token bucket; 0 = off
    rate_limit_burst: int = 10
    voice_aliases: Mapping[str, str] = field(default_factory=dict)  # OpenAI voice name -> local voice
    state_dir: str | None = None         # dead letters, registered voices; None: device.default_voice.state_dir()
    api_key: str | None = field(default=None, repr=False)  # Bearer key; required to listen beyond loopback
    max_streams_per_client: int = 4      # simultaneous `stream: true` responses per client; beyond it: 429
    log_request_text: bool = False       # the slow-request log line includes the request's text
    cache_max_mb: float = 256.0          # phrase cache of reproducible requests (state dir); 0 = off
    wyoming_uri: str | None = None       # also serve the Wyoming protocol here (tcp://127.0.0.1:10200); loopback only
    wyoming_max_connections: int = 64    # Wyoming connections open at once; beyond: an error event and a close
    wyoming_idle_timeout_s: float = 60.0  # a Wyoming connection with nothing received nor being spoken is closed
    wyoming_write_timeout_s: float = 30.0  # a Wyoming client that takes no audio for this long is cut
    websocket_start_timeout_s: float = 10.0  # a WebSocket session's `start` must come this soon after the handshake
    websocket_max_pending_chars: int | None = None  # text a session holds not yet spoken; None: 4 x max_text_len
    allowed_hosts: tuple[str, ...] = ()  # Host names clients use besides loopback, the bind host and this machine's

    def __post_init__(self) -> None:
        object.__setattr__(self, "voice_aliases", MappingProxyType(dict(self.voice_aliases)))
        object.__setattr__(self, "allowed_hosts", tuple(h.strip().lower().rstrip(".") for h in self.allowed_hosts))
        if self.precision in TARGETS:
            raise ConfigError(f"configuration: precision {self.precision!r} is a build target; "
                              f"give it as target (--target, COSYEDGE_TARGET)")
        checks = [
            (0 <= self.port <= 65535, "port must be 0-65535"),
            (self.instance is None or 0 <= self.instance <= 99, "instance must be 0-99"),
            (0 <= self.effective_port <= 65535, "port + instance must be <= 65535"),
            (bool(self.host), "host must not be empty"),
            (self.precision in PRECISIONS, f"precision must be one of {', '.join(PRECISIONS)}"),
            (self.target is None or self.target in TARGETS, f"target must be one of {', '.join(TARGETS)}"),
            (self.target is None or self.precision == "auto", "give a precision or a target, not both"),
            (1 <= self.http_threads <= HTTP_THREADS_MAX, f"http_threads must be 1-{HTTP_THREADS_MAX}"),
            (1 <= self.queue_size <= 100000, "queue_size must be 1-100000"),
            (1 <= self.batch_max <= 1024, "batch_max must be 1-1024"),
            (0 <= self.batch_timeout_ms <= 10000, "batch_timeout_ms must be 0-10000"),
            (1 <= self.max_text_len <= 1_000_000, "max_text_len must be 1-1000000"),
            (1 <= self.max_batch_items <= 10000, "max_batch_items must be 1-10000"),
            (0 < self.request_timeout_s <= 3600, "request_timeout_s must be in (0, 3600]"),
            (0 <= self.rate_limit_per_s and math.isfinite(self.rate_limit_per_s), "rate_limit_per_s must be >= 0"),
            (self.rate_limit_burst >= 1, "rate_limit_burst must be >= 1"),
            (1 <= self.max_streams_per_client <= 10000, "max_streams_per_client must be 1-10000"),
            (1 <= self.wyoming_max_connections <= WYOMING_CONNECTIONS_MAX,
             f"wyoming_max_connections must be 1-{WYOMING_CONNECTIONS_MAX} (each is an open file; the units allow "
             "65536)"),
            (0 < self.wyoming_idle_timeout_s <= 86400, "wyoming_idle_timeout_s must be in (0, 86400]"),
            (0 < self.wyoming_write_timeout_s <= 3600, "wyoming_write_timeout_s must be in (0, 3600]"),
            (0 < self.websocket_start_timeout_s <= 3600, "websocket_start_timeout_s must be in (0, 3600]"),
            (self.websocket_max_pending_chars is None
             or self.max_text_len <= self.websocket_max_pending_chars <= PENDING_CHARS_MAX,
             f"websocket_max_pending_chars must be max_text_len-{PENDING_CHARS_MAX} (a text message of max_text_len "
             "characters must fit)"),
            (self.wyoming_uri is None or self.wyoming_uri.startswith("tcp://"), "wyoming_uri must be tcp://HOST:PORT"),
            (0 <= self.cache_max_mb <= 1_000_000 and math.isfinite(self.cache_max_mb), "cache_max_mb must be 0-1000000"),
            (self.api_key is None or API_KEY.fullmatch(self.api_key) is not None,
             f"api_key must be {API_KEY_MIN}-{API_KEY_MAX} printable ASCII characters without spaces "
             "(e.g. `openssl rand -hex 32`)"),
        ]
        for ok, message in checks:
            if not ok:
                raise ConfigError(f"configuration: {message}")
        if not all(_HOST_NAME.fullmatch(h) for h in self.allowed_hosts):
            raise ConfigError("configuration: allowed_hosts must be host names (letters, digits, '-', '.'), "
                              "without a scheme or port")
        for alias, target in self.voice_aliases.items():
            if not isinstance(alias, str) or not isinstance(target, str) or not alias or not target:
                raise ConfigError("configuration: voice_aliases must map names to voice names")

    @property
    def effective_port(self) -> int:
        return self.port + (self.instance or 0) if self.port else 0

    @property
    def max_pending_chars(self) -> int:
        """A WebSocket session's bound on text accepted and not yet spoken."""
        if self.websocket_max_pending_chars is not None:
            return self.websocket_max_pending_chars
        return PENDING_FACTOR * self.max_text_len

    @property
    def batch_timeout(self) -> float:
        return self.batch_timeout_ms / 1000.0


_ENV = {  # environment variable -> field
    "COSYEDGE_HOST": "host", "COSYEDGE_PORT": "port", "COSYEDGE_INSTANCE": "instance",
    "COSYEDGE_BUNDLE": "bundle", "COSYEDGE_PRECISION": "precision", "COSYEDGE_TARGET": "target",
    "COSYEDGE_HTTP_THREADS": "http_threads",
    "COSYEDGE_QUEUE_SIZE": "queue_size", "COSYEDGE_BATCH_MAX": "batch_max",
    "COSYEDGE_BATCH_TIMEOUT_MS": "batch_timeout_ms", "COSYEDGE_MAX_TEXT_LEN": "max_text_len",
    "COSYEDGE_MAX_BATCH_ITEMS": "max_batch_items", "COSYEDGE_REQUEST_TIMEOUT_S": "request_timeout_s",
    "COSYEDGE_RATE_LIMIT_PER_S": "rate_limit_per_s", "COSYEDGE_RATE_LIMIT_BURST": "rate_limit_burst",
    "COSYEDGE_VOICE_ALIASES": "voice_aliases", "COSYEDGE_STATE_DIR": "state_dir",
    "COSYEDGE_API_KEY": "api_key", "COSYEDGE_MAX_STREAMS_PER_CLIENT": "max_streams_per_client",
    "COSYEDGE_LOG_REQUEST_TEXT": "log_request_text", "COSYEDGE_CACHE_MAX_MB": "cache_max_mb",
    "COSYEDGE_WYOMING_URI": "wyoming_uri", "COSYEDGE_WYOMING_MAX_CONNECTIONS": "wyoming_max_connections",
    "COSYEDGE_WYOMING_IDLE_TIMEOUT_S": "wyoming_idle_timeout_s",
    "COSYEDGE_WYOMING_WRITE_TIMEOUT_S": "wyoming_write_timeout_s", "COSYEDGE_ALLOWED_HOSTS": "allowed_hosts",
    "COSYEDGE_WEBSOCKET_START_TIMEOUT_S": "websocket_start_timeout_s",
    "COSYEDGE_WEBSOCKET_MAX_PENDING_CHARS": "websocket_max_pending_chars",
}
CONFIG_MAX_BYTES = 1 << 20  # a TOML file of the service is a few hundred bytes
API_KEY_FILE_ENV = "COSYEDGE_API_KEY_FILE"  # a file holding the key (systemd: LoadCredential=), read once at start
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off", "")
_TYPES = {f.name: f.type for f in fields(ServiceConfig)}


def _coerce(name: str, value: Any, source: str) -> Any:
    """One raw value (TOML or environment string) -> the field's type; ConfigError names the source."""
    kind = _TYPES[name]
    try:
        if name == "voice_aliases":
            if isinstance(value, str):  # "alloy=joe,echo=joe"
                pairs = [p.split("=", 1) for p in value.split(",") if p.strip()]
                if any(len(p) != 2 for p in pairs):
                    raise ValueError("expected name=voice pairs separated by commas")
                return {k.strip(): v.strip() for k, v in pairs}
            if not isinstance(value, dict):
                raise ValueError("expected a table")
            return dict(value)
        if name == "allowed_hosts":  # "kiosk.lan,box.example" or a TOML list
            names = value.split(",") if isinstance(value, str) else value
            if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
                raise ValueError("expected host names separated by commas, or a list of them")
            return tuple(n for n in (n.strip() for n in names) if n)
        if value == "" and "None" in kind:
            return None
        if kind == "bool":
            if isinstance(value, bool):
                return value
            if isinstance(value, str) and value.strip().lower() in _TRUE + _FALSE:
                return value.strip().lower() in _TRUE
            raise ValueError("expected true or false")
        if "int" in kind:
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError("expected an integer")
            return int(value)
        if "float" in kind:
            if isinstance(value, bool):
                raise ValueError("expected a number")
            return float(value)
        if not isinstance(value, str):
            raise ValueError("expected a string")
        return value
    except (TypeError, ValueError) as exc:
        if name == "api_key":  # never echo (part of) a secret
            raise ConfigError(f"configuration: {source}: api_key must be a string") from None
        raise ConfigError(f"configuration: {source}: {name}: {exc}") from None


def read_api_key_file(path: str, source: str) -> str:
    """The key in a file (one line; surrounding whitespace and the final newline are not part of it)."""
    try:
        with open(path, "rb") as handle:
            data = handle.read(API_KEY_MAX + 64)
    except OSError as exc:
        raise ConfigError(f"configuration: {source}: cannot read the API key file: "
                          f"{exc.strerror or type(exc).__name__}") from None
    try:
        key = data.decode("ascii").strip()
    except UnicodeDecodeError:
        raise ConfigError(f"configuration: {source}: the API key file is not ASCII text") from None
    if not key:
        raise ConfigError(f"configuration: {source}: the API key file is empty")
    return key


def load_config(path: Path | str | None = None, env: Mapping[str, str] | None = None,
                **overrides: Any) -> ServiceConfig:
    """Read the TOML file (if any; `COSYEDGE_CONFIG` names one too), then the environment, then `overrides`."""
    env = os.environ if env is None else env
    values: dict[str, Any] = {}
    path = path or env.get("COSYEDGE_CONFIG") or None
    if path is not None:
        path = Path(path)
        try:
            data = tomllib.loads(read_text(path, "configuration file", CONFIG_MAX_BYTES, ConfigError))
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"configuration file {path.name!r} is not valid TOML: {exc}") from None
        table = data.get("cosyedge", data)  # either top-level keys or a [cosyedge] table
        for key, value in table.items():
            if key == "cosyedge":
                continue
            if key == "api_key_file":
                if not isinstance(value, str) or not value:
                    raise ConfigError(f"configuration file {path.name!r}: api_key_file must be a path")
                values["api_key"] = read_api_key_file(value, path.name)
                continue
            if key not in _TYPES:
                raise ConfigError(f"configuration file {path.name!r}: unknown key {key!r}")
            values[key] = _coerce(key, value, path.name)
    for var, name in _ENV.items():
        if var in env:
            values[name] = _coerce(name, env[var], var)
    if env.get(API_KEY_FILE_ENV):
        if env.get("COSYEDGE_API_KEY"):
            raise ConfigError(f"configuration: give COSYEDGE_API_KEY or {API_KEY_FILE_ENV}, not both")
        values["api_key"] = read_api_key_file(env[API_KEY_FILE_ENV], API_KEY_FILE_ENV)
    for name, value in overrides.items():
        if value is not None:
            values[name] = value
    return ServiceConfig(**values)
