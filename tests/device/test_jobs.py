"""synth-batch keeps going: every failed line lands in the dead-letter file, whatever failed (issue 10, lost work),
a corrupt or foreign output is made again, and bad arguments are one line and exit 2."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

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
    """mp3 needs ffmpeg: without it on PATH every line's encoder fails; the job records each and ends cleanly."""
    ffmpeg = shutil.which("ffmpeg")
    assert ffmpeg, "ffmpeg is a test dependency (.ci/run installs it)"
    bare = tmp_path / "bin"
    bare.mkdir()  # a PATH with no ffmpeg or ffprobe
    out = tmp_path / "out"
    result = cosyedge("synth-batch", str(book), "--out-dir", str(out), "--format", "mp3", "--quiet", home=home,
                      env={"PATH": str(bare)})
    assert result.returncode == 1, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary == {**summary, "total": 3, "failed": 3, "done": 0}
    dead = [json.loads(line) for line in (out / DEAD_LETTER).read_text().splitlines()]
    assert [d["id"] for d in dead] == ["000001", "000002", "000003"] and all(d["error"] for d in dead)
    assert not list(out.glob("*.mp3")) and not list(out.glob(".*.partial"))

    # With ffmpeg back, the rerun makes exactly the failed lines.
    result = cosyedge("synth-batch", str(book), "--out-dir", str(out), "--format", "mp3", "--quiet", home=home)
    assert result.returncode == 0, result.stderr[-2000:]
    assert json.loads(result.stdout.strip().splitlines()[-1])["done"] == 3


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


@pytest.mark.parametrize("case", ["input_is_a_directory", "out_dir_is_a_file"])
def test_bad_job_arguments_are_one_line_and_exit_2(home, book, tmp_path, case):
    a_file = tmp_path / "taken"
    a_file.write_text("mine")
    args = {"input_is_a_directory": [str(tmp_path), "--out-dir", str(tmp_path / "o")],
            "out_dir_is_a_file": [str(book), "--out-dir", str(a_file)]}[case]
    result = cosyedge("synth-batch", *args, home=home)
    assert result.returncode == 2, result.stderr[-2000:]
    assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr
    assert str(tmp_path) not in result.stderr  # no absolute paths in errors
    assert a_file.read_text() == "mine"
