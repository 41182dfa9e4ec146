"""Load on the real service: 16 clients for 15 s, OpenAI and native routes, short and paragraph texts.

Every request is answered (200, or 503 with Retry-After); none times out or is dropped, and the service stays
within its memory budget (600 MB RSS for the default voice; it reached 1.2-2.1 GB when VITS ran padded
batches). Speed is not asserted (shared CPUs); the figures are printed. `make load` runs 64 clients for 60 s.
"""
from __future__ import annotations

import pytest

from cosyedge.api.harness import ServiceProcess
from cosyedge.api.load import format_report, run_load

pytestmark = pytest.mark.slow

CLIENTS = 16
SECONDS = 15.0
RSS_BUDGET_MB = 600  # the default voice's documented budget (README)


def test_every_request_is_answered_under_load(default_bundle_path, cosyedge_home):
    env = {"COSYEDGE_HOME": str(cosyedge_home), "COSYEDGE_PROVIDERS": "cpu", "COSYEDGE_THREADS": "1"}
    with ServiceProcess(bundle=str(default_bundle_path), env=env) as service:
        report = run_load(service.url, clients=CLIENTS, seconds=SECONDS, pid=service.pid, timeout=180)
        print(format_report(report))
        alive = service.proc.poll() is None
    assert alive, service.log_tail()
    assert report["requests"] >= CLIENTS  # every client got at least one answer
    assert set(report["statuses"]) <= {"200", "503"}, report["errors"]
    assert report["statuses"].get("200", 0) > 0
    assert report["timeouts"] == 0 and report["dropped"] == 0 and report["unanswered"] == 0, report["errors"]
    assert report["empty_audio"] == 0
    assert report["clients_still_running"] == 0
    assert set(report["by_kind"]) == {"speech_short", "speech_paragraph", "tts_short", "tts_paragraph"}
    assert 0 < report["rss_mb_peak"] < RSS_BUDGET_MB, format_report(report)
    assert report["readyz_after"] == 200
