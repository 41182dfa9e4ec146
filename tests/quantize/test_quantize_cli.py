"""`cosyedge quantize` (the build host's command, registered through the `cosyedge.commands` entry point)
refuses a user folder as --out before any work: the bundle writer never deletes what it did not write."""
from __future__ import annotations

import json
import os
import subprocess
import sys

from cosyedge.device.cli import main


def test_cli_quantize_refuses_a_user_folder_before_any_work(golden_dir, tmp_path):
    tiny_release = golden_dir / "cosyvoice2-tiny"
    documents = tmp_path / "Documents"
    documents.mkdir()
    (documents / "photo.jpg").write_bytes(b"\xff\xd8 not really")
    env = {**os.environ, "COSYEDGE_HOME": str(tmp_path / "home")}
    for args in (["--model-dir", str(tiny_release)], ["--random-init", "cosyvoice2-0.5b", "--template", str(tiny_release)]):
        result = subprocess.run([sys.executable, "-m", "cosyedge.device.cli", "quantize", *args, "--out", str(documents)],
                                capture_output=True, text=True, env=env, timeout=300)
        assert result.returncode == 2, result.stderr[-2000:]
        assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr
        assert sorted(p.name for p in documents.iterdir()) == ["photo.jpg"]


def test_quantize_default_voice_adds_the_speaker_similarity_of_the_build_host(tmp_path, capsys, monkeypatch):
    """The device converts the voice torch-free; `cosyedge quantize` passes Resemblyzer in: same voice, same speaker."""
    monkeypatch.setenv("COSYEDGE_HOME", str(tmp_path / "home"))
    assert main(["quantize", "--out", str(tmp_path / "joe")]) == 0
    quality = json.loads(capsys.readouterr().out)["quality"]
    assert quality["speaker_similarity"] == "resemblyzer cosine"
    assert quality["int8"]["mean_speaker_cosine"] > 0.95 and quality["int8"]["mean_mcd_db"] < 2.0

