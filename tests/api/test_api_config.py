"""Configuration: defaults < TOML < environment < flags, validated once."""
from __future__ import annotations

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
])
def test_invalid_values_are_named(env, words):
    with pytest.raises(ConfigError, match=words):
        load_config(env=env)


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
