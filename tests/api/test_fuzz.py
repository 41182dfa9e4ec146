"""Schema-driven fuzzing of the real service: its own /openapi.json, positive and negative cases, fixed seed.

The service runs as deployed (`cosyedge serve` in a child process, private state directory). A
few hundred requests: no 5xx except 503/504 with Retry-After, every response matches the schema,
nothing times out or is dropped, and the service is still ready afterwards. `make fuzz` runs the
same harness for 10,000+ requests.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from cosyedge.api.bench.fuzz import failed, format_report, run_fuzz
from cosyedge.api.bench.harness import ServiceProcess, http_status

pytestmark = pytest.mark.slow

REQUESTS = 300
CV2_REQUESTS = 150  # CosyVoice2 renders are slower; still every operation in both modes
TEXT_CAP = 40  # characters: synthesis is the slow part on a small CPU
BATCH_CAP = 3


def _fuzz(bundle: Path, home: Path, requests: int) -> dict:
    env = {"COSYEDGE_HOME": str(home), "COSYEDGE_PROVIDERS": "cpu", "COSYEDGE_THREADS": "1",
           "COSYEDGE_MAX_TEXT_LEN": str(TEXT_CAP), "COSYEDGE_MAX_BATCH_ITEMS": str(BATCH_CAP)}
    with ServiceProcess(bundle=str(bundle), env=env) as service:
        report = run_fuzz(service.url, requests=requests, seed=0, text_cap=TEXT_CAP, batch_cap=BATCH_CAP)
        print(format_report(report))
        assert service.proc.poll() is None, service.log_tail()
        assert http_status(service.url, "/readyz") == 200
    detail = json.dumps(report["findings"][:5], indent=1)
    assert requests * 0.8 <= report["requests"] <= requests  # bounded, and the budget was really spent
    assert set(report["by_mode"]) == {"positive", "negative"}
    assert report["not_generated"] == []  # every operation and mode was fuzzed (a schema yielding none fails)
    assert {"POST /v1/tts", "POST /v1/audio/speech", "POST /v1/tts/batch", "POST /v1/audio/voices",
            "DELETE /v1/audio/voices/{name}", "GET /readyz"} <= set(report["by_operation"])
    assert report["statuses"].get("200", 0) > 0  # some cases were really synthesised
    assert report["server_errors_5xx"] == 0, detail
    assert report["check_failures"] == {}, detail
    assert report["transport_errors"] == {}, detail
    assert report["readyz_after"] == 200
    assert not failed(report)
    return report


def test_fuzz_the_documented_api_finds_no_server_error(default_bundle_path, cosyedge_home):
    _fuzz(default_bundle_path, cosyedge_home, REQUESTS)


def test_fuzz_the_cosyvoice2_service(cv2_tiny_bundle, cosyedge_home):
    """The same run on the tiny CosyVoice2 bundle: its presets, modes, instruct text and voice registration."""
    _fuzz(cv2_tiny_bundle, cosyedge_home, CV2_REQUESTS)


def test_a_schema_that_yields_no_cases_fails():
    """A run that could generate nothing is a failed run, not a clean one (it used to pass)."""
    report = {"server_errors_5xx": 0, "transport_errors": {}, "readyz_after": 200, "requests": 0,
              "not_generated": ["the schema has no operations"]}
    assert failed(report)
    assert failed({**report, "not_generated": []}) and not failed({**report, "not_generated": [], "requests": 5})
