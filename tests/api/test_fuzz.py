"""Schema-driven fuzzing of the real service: its own /openapi.json, positive and negative cases, fixed seed.

The service runs as deployed (`cosyedge serve` in a child process, private state directory). A
few hundred requests: no 5xx except 503/504 with Retry-After, every response matches the schema,
nothing times out or is dropped, and the service is still ready afterwards. `make fuzz` runs the
same harness for 10,000+ requests.
"""
from __future__ import annotations

import json

import pytest

from cosyedge.api.fuzz import format_report, run_fuzz
from cosyedge.api.harness import ServiceProcess, http_status

pytestmark = pytest.mark.slow

REQUESTS = 300
TEXT_CAP = 40  # characters: synthesis is the slow part on a small CPU
BATCH_CAP = 3


def test_fuzz_the_documented_api_finds_no_server_error(default_bundle_path, cosyedge_home):
    env = {"COSYEDGE_HOME": str(cosyedge_home), "COSYEDGE_PROVIDERS": "cpu", "COSYEDGE_THREADS": "1",
           "COSYEDGE_MAX_TEXT_LEN": str(TEXT_CAP), "COSYEDGE_MAX_BATCH_ITEMS": str(BATCH_CAP)}
    with ServiceProcess(bundle=str(default_bundle_path), env=env) as service:
        report = run_fuzz(service.url, requests=REQUESTS, seed=0, text_cap=TEXT_CAP, batch_cap=BATCH_CAP)
        print(format_report(report))
        alive = service.proc.poll() is None
        assert http_status(service.url, "/readyz") == 200
    detail = json.dumps(report["findings"][:5], indent=1)
    assert alive, service.log_tail()
    assert REQUESTS * 0.8 <= report["requests"] <= REQUESTS  # bounded, and the budget was really spent
    assert set(report["by_mode"]) == {"positive", "negative"}
    assert {"POST /v1/tts", "POST /v1/audio/speech", "POST /v1/tts/batch", "POST /v1/audio/voices",
            "DELETE /v1/audio/voices/{name}", "GET /readyz"} <= set(report["by_operation"])
    assert report["statuses"].get("200", 0) > 0  # some cases were really synthesised
    assert report["server_errors_5xx"] == 0, detail
    assert report["check_failures"] == {}, detail
    assert report["transport_errors"] == {}, detail
    assert report["readyz_after"] == 200
