"""`cosyedge bench --peer vox`: vox-tts (the `test` extra pins vox-tts 0.19.5) converts the tiny release with its own
converter and runs beside the device at concurrency 1, stream off, pinned to the same token count.

No timed assertions: the rows' shape, the pinned audio length and that the ratio is reported. vox returns exactly
N x 960 samples for N pinned speech tokens (480 samples per mel frame, 2 frames per token: measured on this release
at N = 30, 50, 250), so the only tolerance is the row's rounding of audio_s to 1 ms.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from cosyedge.device.cli import main

TOKENS = 30
SECONDS_PER_TOKEN = 2 * 480 / 24000  # token_mel_ratio * samples per mel frame / sample rate
NEEDS_VOX = "vox-tts is not installed: pip install vox-tts (the test extra pins 0.19.5)"


def _bench(bundle: Path, release: Path, out: Path, *flags: str) -> dict:
    assert main(["bench", "--bundle", str(bundle), "--reference", str(release), "--peer", "vox",
                 "--tokens", str(TOKENS), "--threads", "1", "--json", str(out), *flags]) == 0
    return json.loads(out.read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def report(cv2_tiny_bundle: Path, cv2_tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    pytest.importorskip("vox", reason=NEEDS_VOX)
    return _bench(cv2_tiny_bundle, cv2_tiny_dir, tmp_path_factory.mktemp("vox") / "bench.json",
                  "--texts", "1", "--stream", "off", "--concurrency", "1")


def test_vox_row_speaks_the_pinned_length_beside_the_device(report, cv2_tiny_dir):
    vox = [r for r in report["runs"] if r["backend"] == "vox-tts"]
    assert len(vox) == 1 and vox[0]["bundle"] == cv2_tiny_dir.name and vox[0]["preset"] == "official"
    row = vox[0]
    assert (row["concurrency"], row["stream"]) == (1, False) and row["first_chunk_s_p50"] is None
    assert row["audio_s"] == pytest.approx(TOKENS * SECONDS_PER_TOKEN, abs=1e-3)
    assert row["wall_s"] > 0 and row["rtf"] > 0 and row["peak_rss_mb"] > 0
    assert row["stage_s"]["llm_decode"] > 0 and row["stage_s"]["flow"] > 0 and row["stage_s"]["hift"] > 0
    assert row["precision"]["llm"] == "q8" and row["precision"]["flow_estimator"] == "fp32"
    assert {r["backend"] for r in report["runs"]} == {"device", "reference", "vox-tts"}


def test_report_names_the_quant_the_streaming_and_the_ratio(report):
    from cosyedge.device.bench.report import cosyvoice_table
    peer = report["peer"]
    assert peer["name"] == "vox-tts" and peer["version"] == "0.19.5" and peer["quant"] == "q8"
    assert "no token-level streaming" in peer["streaming"]
    device = next(r for r in report["runs"] if r["backend"] == "device")
    vox = next(r for r in report["runs"] if r["backend"] == "vox-tts")
    [ratio] = peer["ratios"]
    assert ratio["stream"] is False and ratio["rtf_ratio"] == pytest.approx(device["rtf"] / vox["rtf"], rel=1e-3)
    assert ratio["speedup"] == pytest.approx(vox["rtf"] / device["rtf"], rel=1e-3)
    assert f"/ vox-tts RTF, stream off: {ratio['rtf_ratio']:.3f}" in cosyvoice_table(report)


def test_each_text_is_pinned_and_vox_runs_only_at_concurrency_one_stream_off(cv2_tiny_bundle, cv2_tiny_dir, tmp_path):
    """Two texts of different token counts (vox reopens its engine, pinned anew, for each) and configurations
    vox cannot run (stream on, concurrency 2): it runs in (1, off) only, every request N tokens long."""
    pytest.importorskip("vox", reason=NEEDS_VOX)
    runs = _bench(cv2_tiny_bundle, cv2_tiny_dir, tmp_path / "bench.json", "--texts", "2", "--stream", "on,off",
                  "--concurrency", "1,2")["runs"]
    vox = [r for r in runs if r["backend"] == "vox-tts"]
    assert [(r["concurrency"], r["stream"]) for r in vox] == [(1, False)]
    assert vox[0]["audio_s"] == pytest.approx(2 * TOKENS * SECONDS_PER_TOKEN, abs=1e-3)


def test_what_vox_cannot_run_is_one_line_before_any_worker(cv2_tiny_bundle, cv2_tiny_dir, capsys):
    pytest.importorskip("vox", reason=NEEDS_VOX)
    base = ["bench", "--bundle", str(cv2_tiny_bundle), "--peer", "vox", "--tokens", "3"]
    for flags, message in (([], "--reference MODEL_DIR"),
                           (["--reference", str(cv2_tiny_dir), "--stream", "on"], "stream off")):
        assert main([*base, *flags]) == 2
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1, err
    assert main(["bench", "--peer", "vox"]) == 2  # the default voice (Piper)
    assert "CosyVoice bundles only" in capsys.readouterr().err


def test_a_release_the_converter_refuses_is_one_line_naming_why(cv2_tiny_bundle, cv2_tiny_dir, tmp_path):
    """A release vox's converter refuses (a two-level flow estimator): the worker's error is one line with the
    converter's reason and no path."""
    pytest.importorskip("vox", reason=NEEDS_VOX)
    from cosyedge.device.bench.cosyvoice import PEER_WORKER, Worker
    from cosyedge.device.errors import CosyedgeError
    release = tmp_path / "odd-release"
    release.mkdir()
    for item in cv2_tiny_dir.iterdir():
        if item.name != "cosyvoice2.yaml":
            (release / item.name).symlink_to(item)
    yaml = (cv2_tiny_dir / "cosyvoice2.yaml").read_text(encoding="utf-8")
    (release / "cosyvoice2.yaml").write_text(yaml.replace("channels: [64]", "channels: [64, 64]"), encoding="utf-8")
    worker = Worker("vox-tts", [sys.executable, "-m", PEER_WORKER, "--worker", str(release), "--bundle",
                                str(cv2_tiny_bundle), "--threads", "1"])
    try:
        with pytest.raises(CosyedgeError) as caught:
            worker.wait_ready()
    finally:
        worker.close()
    message = str(caught.value)
    assert "vox-tts cannot convert release 'odd-release'" in message and "only one level" in message
    assert len(message.splitlines()) == 1 and str(tmp_path) not in message


def test_without_vox_the_peer_is_one_line_naming_the_package(cv2_tiny_bundle, cv2_tiny_dir, blocked_imports):
    """vox-tts is optional: without it `--peer vox` is one line and exit 2, before any worker starts."""
    env = blocked_imports(("vox",), "no vox here")
    result = subprocess.run([sys.executable, "-m", "cosyedge.device.cli", "bench", "--bundle", str(cv2_tiny_bundle),
                             "--reference", str(cv2_tiny_dir), "--peer", "vox", "--tokens", "3", "--stream", "off",
                             "--concurrency", "1"], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 2, result.stderr[-2000:]
    assert "pip install vox-tts" in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr
