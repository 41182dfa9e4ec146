"""`cosyedge bench --bundle <cosyvoice2>`: report schema, pinned lengths, the reference baseline, the PNG chart
(matplotlib: the `chart` extra, part of the `test` extra).

No timed assertions: only shapes of the report and quantities that do not depend on speed (audio length is fixed by
--tokens, so it is checked exactly).
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from cosyedge.device.cli import main

RUN_KEYS = {"backend", "bundle", "precision", "preset", "concurrency", "stream", "audio_s", "wall_s", "rtf", "first_chunk_s_p50",
            "first_chunk_s_p95", "stall_s_p50", "stall_s_p95", "llm_ms_per_token", "stage_s", "peak_rss_mb", "stage_rss_mb",
            "throughput_audio_s_per_s", "align_cost_pct"}
STAGES = {"frontend", "llm_prefill", "llm_decode", "flow", "hift", "align"}
GRAPHS = {"llm", "flow_encoder", "flow_estimator", "hift_source", "hift_decoder"}
TOKENS = 30  # > first hop + look-ahead (28): every streaming request yields a chunk before its final one
TEXTS = 2    # one Chinese, one English
SECONDS_PER_TOKEN = 2 * 480 / 24000  # token_mel_ratio * hift samples per frame / sample rate


@pytest.fixture(scope="module")
def bench(cv2_tiny_bundle: Path, golden_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    out = tmp_path_factory.mktemp("bench")
    code = main(["bench", "--bundle", str(cv2_tiny_bundle), "--concurrency", "1,2", "--stream", "on,off",
                 "--tokens", str(TOKENS), "--texts", str(TEXTS), "--threads", "1",
                 "--reference", str(golden_dir / "cosyvoice2-tiny"), "--json", str(out / "bench.json"),
                 "--chart", str(out / "bench.png")])
    assert code == 0
    return json.loads((out / "bench.json").read_text(encoding="utf-8")), out / "bench.png"


def test_report_schema_for_device_runs(bench):
    report, _ = bench
    assert set(report) == {"machine", "runs"}
    assert report["machine"]["tokens"] == TOKENS and report["machine"]["threads"] == 1
    device = [r for r in report["runs"] if r["backend"] == "device"]
    assert {(r["concurrency"], r["stream"]) for r in device} == {(1, True), (1, False), (2, True), (2, False)}
    for run in report["runs"]:
        assert set(run) == RUN_KEYS
        assert set(run["stage_s"]) == STAGES and all(v >= 0 for v in run["stage_s"].values())
        assert set(run["precision"]) == GRAPHS and set(run["precision"].values()) == {"fp32"}
        assert run["rtf"] > 0 and run["wall_s"] > 0 and run["throughput_audio_s_per_s"] > 0
        assert run["llm_ms_per_token"] > 0 and run["peak_rss_mb"] > 0
        if run["backend"] == "device":  # resident set after each stage's graph calls, never above the peak
            assert set(run["stage_rss_mb"]) == STAGES - {"frontend", "align"}   # no word times asked
            assert all(0 < v <= run["peak_rss_mb"] for v in run["stage_rss_mb"].values())
        assert run["stage_s"]["llm_decode"] > 0 and run["stage_s"]["flow"] > 0 and run["stage_s"]["hift"] > 0
        assert run["stage_s"]["align"] == 0 and run["align_cost_pct"] is None


def test_words_report_the_alignment_pass_as_its_own_stage(cv2_tiny_bundle: Path, tmp_path: Path, capsys) -> None:
    """`--words`: every device run synthesizes with word times; the pass's graph calls are the `align` stage and
    `align_cost_pct` its share of the rest of the synthesis (a ratio from the same run, not a timed claim)."""
    code = main(["bench", "--bundle", str(cv2_tiny_bundle), "--concurrency", "1", "--stream", "on,off",
                 "--tokens", str(TOKENS), "--texts", "1", "--threads", "1", "--words", "--json", str(tmp_path / "words.json")])
    assert code == 0
    runs = json.loads((tmp_path / "words.json").read_text(encoding="utf-8"))["runs"]
    assert {r["stream"] for r in runs} == {True, False}
    for run in runs:
        assert run["stage_s"]["align"] > 0 and run["align_cost_pct"] > 0 and "align" in run["stage_rss_mb"]
        assert run["audio_s"] == pytest.approx(TOKENS * SECONDS_PER_TOKEN, abs=1e-3)  # the same audio as without
    assert "align_%" in capsys.readouterr().out


def test_pinned_tokens_fix_the_audio_length(bench):
    report, _ = bench
    for run in report["runs"]:
        requests = max(TEXTS, run["concurrency"])  # 2 texts fill one batch of 2, or two batches of 1
        assert run["audio_s"] == pytest.approx(requests * TOKENS * SECONDS_PER_TOKEN, abs=1e-3)


def test_first_chunk_latency_and_stall_only_for_streaming_runs(bench):
    report, _ = bench
    for run in report["runs"]:
        if run["stream"]:
            assert 0 < run["first_chunk_s_p50"] <= run["first_chunk_s_p95"]
            assert 0 <= run["stall_s_p50"] <= run["stall_s_p95"]
        else:
            assert run["first_chunk_s_p50"] is None and run["first_chunk_s_p95"] is None
            assert run["stall_s_p50"] is None and run["stall_s_p95"] is None


def test_reference_runs_beside_the_device_at_concurrency_one(bench, cv2_tiny_bundle):
    report, _ = bench
    reference = [r for r in report["runs"] if r["backend"] == "reference"]
    assert {(r["concurrency"], r["stream"]) for r in reference} == {(1, True), (1, False)}
    assert {r["bundle"] for r in reference} == {"cosyvoice2-tiny"}
    assert {r["bundle"] for r in report["runs"] if r["backend"] == "device"} == {cv2_tiny_bundle.name}


def test_chart_is_a_png_drawn_by_matplotlib(bench):
    from PIL import Image
    _, chart = bench
    with Image.open(chart) as image:
        assert image.format == "PNG" and image.size[0] > 0 and image.size[1] > 0
        image.verify()


def test_missing_precisions_are_skipped_and_no_reference_without_the_option(cv2_tiny_bundle, tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert main(["bench", "--bundle", str(cv2_tiny_bundle), "--precisions", "int8,fp32", "--concurrency", "1",
                 "--stream", "off", "--tokens", "3", "--texts", "1", "--threads", "1", "--json", str(out)]) == 0
    runs = json.loads(out.read_text(encoding="utf-8"))["runs"]
    assert [(r["backend"], r["concurrency"], r["stream"]) for r in runs] == [("device", 1, False)]
    assert "rtf" in capsys.readouterr().out


def test_cosyvoice_options_are_refused_for_piper_bundles(capsys):
    assert main(["bench", "--tokens", "5"]) == 2
    assert "CosyVoice bundles only" in capsys.readouterr().err


@pytest.fixture(scope="module")
def cv2_tiny_cpu_bundle(golden_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny release with the `cpu` target (int8 LLM graphs; stages that miss their gate stay fp32)."""
    import torch

    from cosyedge.quantize.cosyvoice2.bundle import write_bundle
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return write_bundle(golden_dir / "cosyvoice2-tiny", tmp_path_factory.mktemp("cv2cpu") / "tiny-cpu",
                            targets=["cpu"], allow_fallback=True)
    finally:
        torch.set_num_threads(threads)


def test_precisions_side_by_side_report_the_precision_of_every_stage(cv2_tiny_cpu_bundle, tmp_path):
    out = tmp_path / "bench.json"
    assert main(["bench", "--bundle", str(cv2_tiny_cpu_bundle), "--precisions", "fp32,int8,cpu", "--concurrency", "1",
                 "--stream", "off", "--tokens", "3", "--texts", "1", "--threads", "1", "--json", str(out)]) == 0
    runs = json.loads(out.read_text(encoding="utf-8"))["runs"]
    assert len(runs) == 3 and all(r["backend"] == "device" for r in runs)
    fp32, int8, target = (r["precision"] for r in runs)
    assert set(fp32.values()) == {"fp32"}
    assert int8["llm"] == "int8"  # the cpu target always quantises the LLM
    targets = json.loads((cv2_tiny_cpu_bundle / "manifest.json").read_text())["config"]["targets"]["cpu"]["graphs"]
    assert target == {graph: entry["precision"] for graph, entry in targets.items() if graph in target}


def test_presets_are_measured_like_precisions(cv2_tiny_bundle, tmp_path, capsys):
    """`--presets all`: one run per preset of the bundle, each carrying `preset` beside `precision`."""
    out = tmp_path / "bench.json"
    offered = list(json.loads((cv2_tiny_bundle / "manifest.json").read_text())["config"]["presets"])
    assert main(["bench", "--bundle", str(cv2_tiny_bundle), "--presets", "all", "--concurrency", "1",
                 "--stream", "on", "--tokens", str(TOKENS), "--texts", "1", "--threads", "1", "--json", str(out)]) == 0
    runs = json.loads(out.read_text(encoding="utf-8"))["runs"]
    assert [r["preset"] for r in runs] == offered and len(offered) >= 2
    assert all(set(r["precision"].values()) == {"fp32"} and r["first_chunk_s_p50"] for r in runs)
    assert "fast" in capsys.readouterr().out
    assert main(["bench", "--bundle", str(cv2_tiny_bundle), "--presets", "official,turbo", "--tokens", "3"]) == 2
    assert "turbo" in capsys.readouterr().err
