"""Load on the real service: 16 clients for 15 s, OpenAI and native routes, short and paragraph texts.

Every request is answered (200, or 503 with Retry-After); none times out or is dropped, and the service stays
within its memory budget, measured on its whole process tree (gunicorn arbiter + the worker that holds the engine +
its children): 600 MB for the default voice (it reached 1.2-2.1 GB when VITS ran padded batches), 1 GB for the
tiny CosyVoice2 bundle (continuous batching: 16 requests in the engine at once). The harness
guard kills the tree past twice the budget, so a regression fails the test without taking the box down. Speed is
not asserted (shared CPUs); the figures are printed. `make load` runs 64 clients for 60 s.
"""
from __future__ import annotations

import pytest

from cosyedge.api.bench.harness import ServiceProcess
from cosyedge.api.bench.load import format_report, run_load

pytestmark = pytest.mark.slow

CLIENTS = 16
SECONDS = 15.0
RSS_BUDGET_MB = 600  # the default voice's documented budget (README)
COSYVOICE_TINY_BUDGET_MB = 1024  # the tiny CosyVoice2 bundle's (api/README.md, Memory budget)


def _load(bundle, cosyedge_home, budget_mb: float, seconds: float) -> dict:
    env = {"COSYEDGE_HOME": str(cosyedge_home), "COSYEDGE_PROVIDERS": "cpu", "COSYEDGE_THREADS": "1"}
    with ServiceProcess(bundle=str(bundle), env=env, memory_budget_mb=2 * budget_mb) as service:
        report = run_load(service.url, clients=CLIENTS, seconds=seconds, pid=service.pid, timeout=180)
        print(format_report(report))
        alive = service.proc.poll() is None
    assert alive, (service.guard.exceeded, service.log_tail())
    return report


def test_every_request_is_answered_under_load(default_bundle_path, cosyedge_home):
    report = _load(default_bundle_path, cosyedge_home, RSS_BUDGET_MB, SECONDS)
    assert report["requests"] >= CLIENTS  # every client got at least one answer
    assert set(report["statuses"]) <= {"200", "503"}, report["errors"]
    assert report["statuses"].get("200", 0) > 0
    assert report["timeouts"] == 0 and report["dropped"] == 0 and report["unanswered"] == 0, report["errors"]
    assert report["empty_audio"] == 0
    assert report["clients_still_running"] == 0
    assert set(report["by_kind"]) == {"speech_short", "speech_paragraph", "tts_short", "tts_paragraph"}
    assert report["processes"] >= 2, report  # the arbiter and the worker: the engine is in the worker
    assert 0 < report["rss_mb_peak"] < RSS_BUDGET_MB, format_report(report)
    assert report["readyz_after"] == 200


def test_cosyvoice_service_stays_in_its_budget_under_concurrent_load(cv2_tiny_bundle, cosyedge_home):
    report = _load(cv2_tiny_bundle, cosyedge_home, COSYVOICE_TINY_BUDGET_MB, 10.0)
    assert report["statuses"].get("200", 0) >= CLIENTS and report["dropped"] == report["timeouts"] == 0, report
    assert report["processes"] >= 2
    assert 0 < report["rss_mb_peak"] < COSYVOICE_TINY_BUDGET_MB, format_report(report)
