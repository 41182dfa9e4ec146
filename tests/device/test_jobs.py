"""synth-batch keeps going: every failed line lands in the dead-letter file, whatever failed (issue 10, lost work),
a corrupt or foreign output is made again, and bad arguments are one line and exit 2."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import soundfile as sf

from cosyedge.device.jobs import DEAD_LETTER


def cosyedge(*args: str, home: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cosyedge.device.cli", *args], capture_output=True, text=True,
                          env={**os.environ, "COSYEDGE_HOME": str(home), "COSYEDGE_THREADS": "1", **(env or {})},
                          timeout=600)


@pytest.fixture()
def home(default_bundle_path: Path) -> Path:
    return default_bundle_path.parents[1]


@pytest.fixture()
def book(tmp_path: Path) -> Path:
    source = tmp_path / "book.txt"
    source.write_text("One small line.\nTwo small lines.\nThree small lines.\n")
    return source


def test_encoder_failure_is_dead_lettered_and_the_job_finishes(home, book, tmp_path):
    """An ffmpeg that fails (here: the one on PATH exits 1) fails every line's encoder; the job records each
    and ends cleanly."""
    broken = tmp_path / "bin"
    broken.mkdir()
    (broken / "ffmpeg").write_text("#!/bin/sh\nexit 1\n")
    (broken / "ffmpeg").chmod(0o755)
    out = tmp_path / "out"
    result = cosyedge("synth-batch", str(book), "--out-dir", str(out), "--format", "mp3", "--quiet", home=home,
                      env={"PATH": f"{broken}:{os.environ['PATH']}"})
    assert result.returncode == 1, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary == {**summary, "total": 3, "failed": 3, "done": 0}
    dead = [json.loads(line) for line in (out / DEAD_LETTER).read_text().splitlines()]
    # lines in flight finish in any order; each failed line is there once
    assert sorted(d["id"] for d in dead) == ["000001", "000002", "000003"] and all(d["error"] for d in dead)
    assert not list(out.glob("*.mp3")) and not list(out.glob(".*.partial"))

    # With a working ffmpeg back, the rerun makes exactly the failed lines.
    result = cosyedge("synth-batch", str(book), "--out-dir", str(out), "--format", "mp3", "--quiet", home=home)
    assert result.returncode == 0, result.stderr[-2000:]
    assert json.loads(result.stdout.strip().splitlines()[-1])["done"] == 3


def test_compressed_jobs_encode_and_resume_without_ffmpeg_or_ffprobe_on_path(home, book, tmp_path):
    """A box with no Debian ffmpeg (issue 26): the encoder runs the imageio-ffmpeg wheel's binary, and the resume
    check decodes finished outputs with it (pydub's decoder would need ffprobe, which no wheel ships)."""
    bare = tmp_path / "bin"
    bare.mkdir()  # a PATH with no ffmpeg or ffprobe
    out = tmp_path / "out"
    for fmt in ("mp3", "opus"):
        result = cosyedge("synth-batch", str(book), "--out-dir", str(out), "--format", fmt, "--quiet", home=home,
                          env={"PATH": str(bare)})
        assert result.returncode == 0, result.stderr[-2000:]
        assert "Couldn't find ffmpeg" not in result.stderr  # pydub's import-time warning is not ours to print
        assert json.loads(result.stdout.strip().splitlines()[-1])["done"] == 3
        again = cosyedge("synth-batch", str(book), "--out-dir", str(out), "--format", fmt, "--quiet", home=home,
                         env={"PATH": str(bare)})
        assert json.loads(again.stdout.strip().splitlines()[-1])["skipped"] == 3
    for path in (out / "000001.mp3", out / "000001.opus"):
        info = sf.info(str(path))  # libsndfile, independent of ffmpeg: real mp3 and Ogg Opus
        assert info.duration > 0.5, path.name
    assert sf.info(str(out / "000001.opus")).subtype == "OPUS"


def test_ffmpeg_binary_is_the_system_one_on_path_else_the_wheels(tmp_path, monkeypatch):
    from cosyedge.device.audio import ffmpeg_binary
    monkeypatch.setenv("PATH", str(tmp_path))
    wheel = Path(ffmpeg_binary())
    assert "imageio_ffmpeg" in wheel.parts and os.access(wheel, os.X_OK)
    (tmp_path / "ffmpeg").write_text("#!/bin/sh\n")
    (tmp_path / "ffmpeg").chmod(0o755)
    assert ffmpeg_binary() == str(tmp_path / "ffmpeg")


def test_a_corrupt_compressed_output_is_made_again(home, book, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "000002.mp3").write_bytes(b"ID3 this is not an mp3 at all" * 10)
    result = cosyedge("synth-batch", str(book), "--out-dir", str(out), "--format", "mp3", "--quiet", home=home)
    assert result.returncode == 0, result.stderr[-2000:]
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["skipped"] == 0 and summary["done"] == 3
    from pydub import AudioSegment
    assert len(AudioSegment.from_file(str(out / "000002.mp3"))) > 300  # real audio now

    again = cosyedge("synth-batch", str(book), "--out-dir", str(out), "--format", "mp3", "--quiet", home=home)
    assert json.loads(again.stdout.strip().splitlines()[-1])["skipped"] == 3  # decodable outputs count as done


@pytest.mark.parametrize("case", ["input_is_a_directory", "out_dir_is_a_file", "no_line_in_flight"])
def test_bad_job_arguments_are_one_line_and_exit_2(home, book, tmp_path, case):
    a_file = tmp_path / "taken"
    a_file.write_text("mine")
    args = {"input_is_a_directory": [str(tmp_path), "--out-dir", str(tmp_path / "o")],
            "out_dir_is_a_file": [str(book), "--out-dir", str(a_file)],
            "no_line_in_flight": [str(book), "--out-dir", str(tmp_path / "o"), "--in-flight", "0"]}[case]
    result = cosyedge("synth-batch", *args, home=home)
    assert result.returncode == 2, result.stderr[-2000:]
    assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr
    assert str(tmp_path) not in result.stderr  # no absolute paths in errors
    assert a_file.read_text() == "mine"
