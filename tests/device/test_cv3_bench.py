"""`cosyedge bench --bundle <cosyvoice3>`: the CosyVoice bench on a Fun-CosyVoice3 bundle with its PyTorch reference
(quantize/cosyvoice3/reference.py) and, in the same run, a CosyVoice2 bundle (`--compare BUNDLE:PRECISION`), both at
two presets.

No timed assertions: report shape, who ran, and audio lengths (fixed by --tokens; the v3 silent filter may only
shorten them, and the reference must voice exactly what the device voices)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from cosyedge.device.bench.worker import Settings
from cosyedge.device.cli import main
from cosyedge.device.engine import Engine
from cosyedge.device.sessions import SessionConfig

TOKENS = 30  # > first hop + look-ahead (28): every streaming request yields a chunk before its final one
SECONDS_PER_TOKEN = 2 * 480 / 24000


@pytest.fixture(scope="module")
def bench(cv3_tiny_bundle: Path, cv2_tiny_bundle: Path, golden_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    out = tmp_path_factory.mktemp("bench3")
    (out / "v3").symlink_to(cv3_tiny_bundle)    # both fixtures are named "tiny": the report names bundles
    (out / "v2").symlink_to(cv2_tiny_bundle)
    code = main(["bench", "--bundle", str(out / "v3"), "--precisions", "fp32", "--concurrency", "1",
                 "--stream", "on,off", "--tokens", str(TOKENS), "--texts", "2", "--threads", "1",
                 "--presets", "official,fastest",
                 "--reference", str(golden_dir / "cosyvoice3-tiny"), "--compare", f"{out / 'v2'}:fp32",
                 "--json", str(out / "bench.json")])
    assert code == 0
    return json.loads((out / "bench.json").read_text(encoding="utf-8"))


def test_cv3_device_cv2_device_and_reference_in_one_run(bench) -> None:
    runs = bench["runs"]
    who = [(r["backend"], r["bundle"], r["preset"], r["stream"]) for r in runs]
    devices = [("device", n, p) for n in ("v3", "v2") for p in ("official", "fastest")]  # the compared one at both
    assert sorted(who) == sorted((b, n, p, s) for b, n, p in (*devices, ("reference", "cosyvoice3-tiny", "official"))
                                 for s in (True, False))
    for run in runs:
        assert run["rtf"] > 0 and run["peak_rss_mb"] > 0 and run["stage_s"]["flow"] > 0 and run["stage_s"]["hift"] > 0


def test_audio_lengths(bench) -> None:
    pinned = 2 * TOKENS * SECONDS_PER_TOKEN
    by = {(r["backend"], r["bundle"], r["stream"]): r["audio_s"] for r in bench["runs"] if r["preset"] == "official"}
    for stream in (True, False):
        v3 = by["device", "v3", stream]
        assert 0 < v3 <= pinned + 1e-3
        assert by["reference", "cosyvoice3-tiny", stream] == pytest.approx(v3, abs=1e-3)
        assert by["device", "v2", stream] == pytest.approx(pinned, abs=1e-3)   # no silent filter in v2


def test_reference_speaks_like_the_runtime(cv3_tiny_bundle: Path, golden_dir: Path) -> None:
    """The torch reference (official compute, fp32) and the ONNX runtime give the same greedy audio, whole and
    streamed: the bench compares engines doing the same work."""
    from cosyedge.quantize.cosyvoice3.reference import ReferencePipeline3
    reference = ReferencePipeline3(golden_dir / "cosyvoice3-tiny", threads=1)
    engine = Engine.load(cv3_tiny_bundle, precision="fp32", warmup=False,
                         sessions=SessionConfig(providers=("cpu",), intra_op_threads=1))
    text = "Hello, this is a tiny test of CosyVoice three."
    settings = Settings(None, "greedy")
    whole = np.concatenate(list(reference.synthesize(text, False, settings, 0)[1]))
    want = engine.synthesize_waveform(text, sampling="greedy", deterministic=True)
    assert whole.shape == want.shape and whole.size > 0
    np.testing.assert_allclose(whole, want, atol=2e-4)
    streamed = list(reference.synthesize(text, True, settings, 0)[1])
    chunks = list(engine.stream(text, sampling="greedy", deterministic=True))
    assert [c.size for c in streamed] == [c.size for c in chunks] and len(chunks) > 1
    np.testing.assert_allclose(np.concatenate(streamed), np.concatenate(chunks), atol=2e-4)


def test_compared_bundles_of_one_folder_name_are_refused(cv3_tiny_bundle: Path, cv2_tiny_bundle: Path,
                                                          tmp_path: Path, capsys) -> None:
    """The report names bundles by folder: two of one name (or one pair twice) would be reported as one, the second
    silently replacing the first. One line, exit 2, before any worker starts."""
    assert cv3_tiny_bundle.name == "tiny"
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "tiny").symlink_to(cv2_tiny_bundle)
    common = ["bench", "--bundle", str(cv3_tiny_bundle), "--precisions", "fp32", "--concurrency", "1", "--tokens", "30"]
    for compare, says in (([f"{tmp_path / 'a' / 'tiny'}:fp32"], "two bundles are named 'tiny'"),
                          ([f"{cv3_tiny_bundle}:fp32"] * 2, "is given twice")):
        assert main([*common, *[a for c in compare for a in ("--compare", c)]]) == 2
        err = capsys.readouterr().err.strip()
        assert says in err and len(err.splitlines()) == 1 and str(tmp_path) not in err, err
