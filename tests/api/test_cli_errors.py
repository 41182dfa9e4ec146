"""Issue 21 item 15: every command-line mistake is one line and exit 2, naming no absolute path, found before
anything listens or loads; a batch line that cannot be written is dead-lettered, never the end of the job.

Each case is run as a user runs it (a subprocess of `cosyedge`), on the real default voice where one is needed.
"""
from __future__ import annotations

import json
import os
import resource
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from cosyedge.device.jobs import DEAD_LETTER, read_lines


def cosyedge(*args: str, home: Path, timeout: float = 300, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cosyedge.device.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "COSYEDGE_HOME": str(home), "COSYEDGE_THREADS": "1", **env})


def one_line(result: subprocess.CompletedProcess, *absent: str) -> str:
    """The refusal: exit 2, one line on stderr, no traceback, no absolute path (none of `absent`)."""
    lines = [line for line in result.stderr.splitlines() if line.strip() and "pkg_resources" not in line
             and not line.lstrip().startswith("import pkg_resources")]  # webrtcvad's import warning (quantize)
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert lines[0].startswith("cosyedge: error: ") and "Traceback" not in result.stderr, result.stderr
    for text in absent:
        assert text not in result.stderr, result.stderr
    return lines[0]


@pytest.fixture(scope="module")
def home(default_bundle_path: Path) -> Path:
    return default_bundle_path.parents[1]


def test_cache_warm_with_a_csv_field_over_the_csv_limit(home, tmp_path):
    """csv.Error ("field larger than field limit (131072)") was an internal error, exit 1."""
    phrases = tmp_path / "phrases.csv"
    phrases.write_text("id,text\nlong," + "a" * 131_073 + "\nshort,Hello.\n", encoding="utf-8")
    line = one_line(cosyedge("cache", "warm", str(phrases), "--state-dir", str(tmp_path / "state"), "--quiet",
                             home=home), str(tmp_path))
    assert "phrases.csv line 2" in line and "131072" in line


def test_serve_with_a_directory_as_config(home, tmp_path):
    """IsADirectoryError was an internal error, exit 1."""
    line = one_line(cosyedge("serve", "--config", str(tmp_path), "--port", "0", home=home, timeout=60), str(tmp_path))
    assert "is a directory" in line


def test_cosyedge_home_naming_a_file(home, tmp_path):
    """NotADirectoryError from building the default voice under it was an internal error, exit 1."""
    not_a_dir = tmp_path / "home"
    not_a_dir.write_text("")
    result = cosyedge("synth", "Hello.", "-o", str(tmp_path / "x.wav"), home=not_a_dir)
    assert "COSYEDGE_HOME" in one_line(result, str(tmp_path))


def _closed_port() -> int:
    with socket.socket() as sock:  # bound, never listening: a connect is refused
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.parametrize("url, words", [("http://127.0.0.1:{port}", "Connection refused"),
                                        ("http://127.0.0.1:notaport", "must look like http://")])
def test_bench_api_against_nothing(home, url, words):
    """ConnectionRefusedError (and urllib's ValueError for a bad port) were internal errors, exit 1."""
    result = cosyedge("bench-api", "--url", url.format(port=_closed_port()), "--concurrency", "1", home=home,
                      timeout=60)
    line = one_line(result)
    assert "cannot reach" in line and words in line


def test_synth_batch_dead_letters_an_id_too_long_for_a_file_name(home, tmp_path):
    """An id of 300 bytes made every file test raise ENAMETOOLONG: the whole job ended with an internal error,
    nothing rendered and nothing dead-lettered."""
    source = tmp_path / "lines.csv"
    source.write_text(f"id,text\n{'a' * 300},Too long a name.\nshort,Hello there.\n", encoding="utf-8")
    out = tmp_path / "out"
    result = cosyedge("synth-batch", str(source), "--out-dir", str(out), "--quiet", home=home)
    assert result.returncode == 1, result.stderr  # one line failed, the job went on
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["total"] == 2 and summary["done"] == 1 and summary["failed"] == 1
    assert (out / "short.wav").stat().st_size > 10_000
    dead = [json.loads(x) for x in (out / DEAD_LETTER).read_text(encoding="utf-8").splitlines()]
    assert [d["id"] for d in dead] == ["a" * 300] and "bytes" in dead[0]["error"]
    assert str(tmp_path) not in dead[0]["error"]


def test_serve_with_a_state_dir_that_cannot_be_made(home, tmp_path):
    """It was refused after the port was bound and the voice loaded, with the absolute path in the message."""
    blocker = tmp_path / "file"
    blocker.write_text("")
    result = cosyedge("serve", "--port", "0", home=home, timeout=120, COSYEDGE_STATE_DIR=str(blocker / "state"))
    line = one_line(result, str(tmp_path), "listening on")
    assert "state" in line


def test_quantize_a_piper_model_without_its_json(home, tmp_path):
    """The message carried the absolute path of the missing voice.onnx.json (FileNotFoundError's text)."""
    pytest.importorskip("torch", reason="cosyedge quantize is a build-host command")
    model = tmp_path / "voice.onnx"
    model.write_bytes(b"not a model")
    result = cosyedge("quantize", "--piper-model", str(model), "--out", str(tmp_path / "bundle"), home=home)
    assert "voice.onnx.json" in one_line(result, str(tmp_path))


def test_serve_refuses_a_remote_wyoming_address_before_listening(home):
    """It was refused only after the HTTP port was bound and the engine loaded, with exit 1."""
    result = cosyedge("serve", "--port", "0", "--wyoming", "tcp://0.0.0.0:10299", home=home, timeout=60)
    assert "loopback only" in one_line(result, "listening on", "warm-up")


def _memory_guard() -> None:  # what an unbounded read would reach instead of the box's memory
    resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))


def test_cache_warm_reads_dev_zero_within_a_bound(home, tmp_path):
    """The whole input was read before anything was checked: /dev/zero ran into the memory guard (MemoryError,
    internal error, exit 1)."""
    result = subprocess.run([sys.executable, "-m", "cosyedge.device.cli", "cache", "warm", "/dev/zero", "--state-dir",
                             str(tmp_path / "state"), "--quiet"], capture_output=True, text=True, timeout=120,
                            env={**os.environ, "COSYEDGE_HOME": str(home)}, preexec_fn=_memory_guard)
    assert "larger than" in one_line(result, str(tmp_path))


def test_a_utf8_csv_with_a_byte_order_mark_keeps_its_header_silent(tmp_path):
    """Excel's "CSV UTF-8" starts with U+FEFF: the header row was taken for a line (id "_id", text "text")."""
    source = tmp_path / "lines.csv"
    source.write_bytes("id,text\nintro,Welcome.\n".encode("utf-8-sig"))
    assert [(line.key, line.text) for line in read_lines(source)] == [("intro", "Welcome.")]
