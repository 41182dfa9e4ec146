"""Configuration: defaults < TOML < environment < flags, validated once."""
from __future__ import annotations

import contextlib
import io

import pytest

from cosyedge.api.config import ConfigError, ServiceConfig, load_config


def test_defaults_bind_localhost():
    config = load_config(env={})
    assert (config.host, config.port, config.effective_port) == ("127.0.0.1", 8100, 8100)


def test_precedence_file_env_flags(tmp_path):
    path = tmp_path / "cosyedge.toml"
    path.write_text('port = 9000\nqueue_size = 5\nbatch_timeout_ms = 7\n[voice_aliases]\nalloy = "joe"\n')
    config = load_config(path, env={"COSYEDGE_PORT": "9001", "COSYEDGE_BATCH_MAX": "3"}, host="127.0.0.2")
    assert (config.port, config.queue_size, config.batch_max, config.host) == (9001, 5, 3, "127.0.0.2")
    assert config.batch_timeout == pytest.approx(0.007)
    assert dict(config.voice_aliases) == {"alloy": "joe"}
    assert load_config(path, env={}, port=9002).port == 9002


def test_instance_offsets_port_and_env_aliases():
    config = load_config(env={"COSYEDGE_INSTANCE": "3", "COSYEDGE_VOICE_ALIASES": "alloy=joe, echo=joe"})
    assert config.effective_port == 8103
    assert dict(config.voice_aliases) == {"alloy": "joe", "echo": "joe"}


@pytest.mark.parametrize("env, words", [
    ({"COSYEDGE_PORT": "70000"}, "port"),
    ({"COSYEDGE_PORT": "eighty"}, "COSYEDGE_PORT"),
    ({"COSYEDGE_QUEUE_SIZE": "0"}, "queue_size"),
    ({"COSYEDGE_PRECISION": "fp64"}, "precision"),
    ({"COSYEDGE_VOICE_ALIASES": "alloy"}, "name=voice"),
    ({"COSYEDGE_WYOMING_MAX_CONNECTIONS": "65536"}, "wyoming_max_connections must be 1-32768"),  # the units' files
    ({"COSYEDGE_WYOMING_WRITE_TIMEOUT_S": "0"}, r"wyoming_write_timeout_s must be in \(0, 3600\]"),
    ({"COSYEDGE_WYOMING_WRITE_TIMEOUT_S": "soon"}, "COSYEDGE_WYOMING_WRITE_TIMEOUT_S"),
])
def test_invalid_values_are_named(env, words):
    with pytest.raises(ConfigError, match=words):
        load_config(env=env)


def test_wyoming_connections_stay_below_the_units_open_files():
    assert load_config(env={"COSYEDGE_WYOMING_MAX_CONNECTIONS": "32768"}).wyoming_max_connections == 32768
    with pytest.raises(ConfigError, match="each is an open file"):
        ServiceConfig(wyoming_max_connections=32769)


def test_unknown_key_and_bad_toml(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("prot = 1\n")
    with pytest.raises(ConfigError, match="unknown key 'prot'"):
        load_config(path, env={})
    path.write_text("port = \n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(path, env={})


def test_config_is_frozen():
    config = ServiceConfig(voice_aliases={"alloy": "joe"})
    with pytest.raises(Exception):
        config.port = 1  # type: ignore[misc]
    with pytest.raises(TypeError):
        config.voice_aliases["x"] = "y"  # type: ignore[index]


def test_build_targets_are_given_as_target():
    """Issue 10: `serve` took no build target; now COSYEDGE_TARGET / --target do, and precision says where they go."""
    assert load_config(env={"COSYEDGE_TARGET": "gpu-fp16"}).target == "gpu-fp16"
    assert load_config(env={}, target="trt-int8").target == "trt-int8"
    # the service takes every selection the engine does (one list: the 4-bit LLM target and precision included)
    assert load_config(env={}, target="cpu-int4").target == "cpu-int4"
    assert load_config(env={"COSYEDGE_PRECISION": "int4"}).precision == "int4"
    with pytest.raises(ConfigError, match="precision 'cpu' is a build target; give it as target"):
        load_config(env={"COSYEDGE_PRECISION": "cpu"})
    with pytest.raises(ConfigError, match="not both"):
        load_config(env={"COSYEDGE_PRECISION": "fp16", "COSYEDGE_TARGET": "cpu"})
    with pytest.raises(ConfigError, match="target must be"):
        load_config(env={"COSYEDGE_TARGET": "fp16"})


def test_serve_with_a_target_as_precision_is_one_line_exit_2():
    from cosyedge.device.cli import main
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert main(["serve", "--precision", "gpu-fp16", "--port", "0"]) == 2
    assert err.getvalue().count("\n") == 1 and "build target" in err.getvalue()


def test_websocket_start_deadline_and_pending_text_bound():
    """Issue 21 items 4 and 7: the WebSocket `start` deadline and the bound on a session's unspoken text."""
    config = load_config(env={})
    assert (config.websocket_start_timeout_s, config.max_pending_chars) == (10.0, 4 * config.max_text_len)
    config = load_config(env={"COSYEDGE_WEBSOCKET_START_TIMEOUT_S": "2.5", "COSYEDGE_MAX_TEXT_LEN": "100",
                              "COSYEDGE_WEBSOCKET_MAX_PENDING_CHARS": "100"})
    assert (config.websocket_start_timeout_s, config.max_pending_chars) == (2.5, 100)
    assert load_config(env={"COSYEDGE_MAX_TEXT_LEN": "100"}).max_pending_chars == 400  # follows max_text_len
    for env, words in [({"COSYEDGE_WEBSOCKET_START_TIMEOUT_S": "0"}, "websocket_start_timeout_s must be in"),
                       ({"COSYEDGE_WEBSOCKET_START_TIMEOUT_S": "3601"}, "websocket_start_timeout_s must be in"),
                       ({"COSYEDGE_WEBSOCKET_START_TIMEOUT_S": "nan"}, "websocket_start_timeout_s must be in"),
                       ({"COSYEDGE_WEBSOCKET_MAX_PENDING_CHARS": "1999"}, "a text message of max_text_len"),
                       ({"COSYEDGE_WEBSOCKET_MAX_PENDING_CHARS": "10000001"}, "websocket_max_pending_chars must be")]:
        with pytest.raises(ConfigError, match=words):
            load_config(env=env)
