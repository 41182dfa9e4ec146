"""`cosyedge bench-api` on the default voice with tiny bounds: the report has the engine-only row and one row per
concurrency level, as JSON and as a table; bad flags are one line and exit 2."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from cosyedge.api.bench.api_bench import _address, _local_service, format_report, http_level, run_api_bench
from cosyedge.device.errors import InputError

TEXTS = ["Short one.", "A second, slightly longer sentence for the bench."]


def test_bench_api_reports_engine_and_http_levels(default_bundle_path: Path):
    report = run_api_bench(bundle=str(default_bundle_path), concurrency=(1, 2), stream=True, arrivals="staggered",
                           requests=2, texts=TEXTS)
    json.dumps(report)  # the --json file
    assert report["engine"]["requests"] == len(TEXTS) and report["engine"]["first_audio_s"]["p50"] > 0
    assert [level["concurrency"] for level in report["http"]] == [1, 2]
    for level in report["http"]:
        assert level["requests"] == 2 * level["concurrency"] and not level["errors"]
        assert 0 < level["first_audio_s"]["p50"] <= level["latency_s"]["p50"] and level["audio_s_per_s"] > 0
    assert report["http"][1]["stagger_s"] > 0  # staggered: client 2 starts after client 1
    table = format_report(report)
    assert "engine.stream alone" in table and "HTTP x1" in table and "HTTP x2" in table

    burst = run_api_bench(bundle=str(default_bundle_path), concurrency=(2,), stream=False, arrivals="burst",
                          requests=1, texts=TEXTS)
    assert burst["http"][0]["stagger_s"] == 0.0 and burst["http"][0]["requests"] == 2


def test_bench_api_refuses_a_bad_concurrency_list(tmp_path: Path):
    result = subprocess.run([sys.executable, "-m", "cosyedge.device.cli", "bench-api", "--concurrency", "1,x"],
                            capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 2 and "--concurrency" in result.stderr and "Traceback" not in result.stderr


def test_bench_api_cache_wyoming_measures_hits_and_both_first_audios(tmp_path: Path):
    """`--cache-wyoming`: one real `cosyedge serve --wyoming` process; the hits really are cache hits (the module
    asserts the X-Cosyedge-Cache header of every answer) and every path delivered audio."""
    out = tmp_path / "latency.json"
    result = subprocess.run([sys.executable, "-m", "cosyedge.device.cli", "bench-api", "--cache-wyoming",
                             "--requests", "1", "--json", str(out)], capture_output=True, text=True, timeout=600,
                            check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    assert set(report["cache"]) == {"wav", "mp3"}
    assert all(entry["hit"]["n"] == 5 and entry["hit"]["p50_ms"] > 0 and entry["audio_s"] > 1
               for entry in report["cache"].values())
    first = report["first_audio"]
    assert all(first[name]["n"] == 1 and first[name]["p50_ms"] > 0
               for name in ("http_first_byte", "wyoming_first_chunk", "wyoming_streaming_first_chunk"))
    assert "cache hit wav" in result.stdout and "first audio wyoming_first_chunk" in result.stdout


def test_bench_api_sends_the_preset_on_both_paths(cv2_tiny_bundle: Path):
    """`--preset` reaches the engine-only run and every HTTP body: an unknown preset fails both, a listed one runs."""
    zh = ["收到好友从远方寄来的生日礼物。"]
    report = run_api_bench(bundle=str(cv2_tiny_bundle), concurrency=(1,), requests=1, texts=zh, preset="fast")
    assert report["preset"] == "fast" and not report["http"][0]["errors"]
    assert "preset fast" in format_report(report)
    with pytest.raises(InputError, match="preset"):
        run_api_bench(bundle=str(cv2_tiny_bundle), concurrency=(1,), requests=1, texts=zh, preset="turbo")
    with _local_service(str(cv2_tiny_bundle), None) as (url, _engine):
        with pytest.raises(RuntimeError, match="unknown_preset"):
            http_level(*_address(url), zh, 1, 1, False, "burst", 0.0, {"preset": "turbo"})
