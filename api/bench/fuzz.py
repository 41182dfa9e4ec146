"""Schema-driven fuzzing of the HTTP service: schemathesis against the service's own /openapi.json.

Every operation gets positive (schema-valid) cases and every operation with a body negative (schema-violating)
ones, from a fixed seed, one request each, until the request budget is spent. A finding is a 5xx other than
503/504 with Retry-After, a response that does not match the schema (status, content type, headers, body), or a
request that timed out or lost its connection. Findings are collected, not raised, so the figures
cover the whole run. Schema-valid requests refused (unknown voice, nothing speakable) and
schema-violating ones accepted are counted too, as figures: the schema cannot say everything.

Synthesis is the slow part, so text lengths are capped in the generated cases (the schema's
maxLength is lowered to `text_cap`, batch lists to `batch_cap` items). A service started here gets
the same limits, so over-long negative cases are refused at once; against `--url`, set the
service's max_text_len to `text_cap` as well or over-long texts count as accepted negatives.

    python -m cosyedge.api.bench.fuzz --requests 10000 [--url URL | --bundle DIR] [--seed 0] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from cosyedge.api.bench.harness import ServiceProcess, http_status, write_json

REQUEST_TIMEOUT_S = 60.0
RETRYABLE = (503, 504)  # overload and deadline: allowed, with Retry-After
MAX_FINDINGS_KEPT = 50  # details of the first ones; every finding is counted
# Checks that compare the response with the schema; "not a server error" is ours (503/504 are allowed).
CHECKS = ("status_code_conformance", "content_type_conformance", "response_headers_conformance",
          "response_schema_conformance")
# Counted, not findings: semantic refusals of valid requests, tolerance of invalid ones.
INFO_CHECKS = ("positive_data_acceptance", "negative_data_rejection")


@dataclass
class FuzzStats:
    """What a fuzz run sent and what came back; `findings` keeps the first few in full."""
    requests: int = 0
    statuses: Counter = field(default_factory=Counter)
    by_operation: Counter = field(default_factory=Counter)
    by_mode: Counter = field(default_factory=Counter)
    server_errors: int = 0          # 5xx other than 503/504 with Retry-After
    check_failures: Counter = field(default_factory=Counter)
    info: Counter = field(default_factory=Counter)
    info_examples: list[str] = field(default_factory=list)
    transport_errors: Counter = field(default_factory=Counter)
    findings: list[dict[str, Any]] = field(default_factory=list)
    finding_count: int = 0
    not_generated: list[str] = field(default_factory=list)

    def record(self, label: str, mode: str, status: int | None) -> None:
        self.requests += 1
        self.by_operation[label] += 1
        self.by_mode[mode] += 1
        self.statuses[str(status) if status is not None else "none"] += 1

    def finding(self, kind: str, label: str, mode: str, detail: str, curl: str) -> None:
        self.finding_count += 1
        if len(self.findings) < MAX_FINDINGS_KEPT:
            self.findings.append({"kind": kind, "operation": label, "mode": mode, "detail": detail[:600],
                                  "reproduce": curl[:2000]})

    def report(self) -> dict[str, Any]:
        return {"requests": self.requests, "statuses": dict(sorted(self.statuses.items())),
                "server_errors_5xx": self.server_errors,
                "5xx_total": sum(n for s, n in self.statuses.items() if s.startswith("5")),
                "by_operation": dict(sorted(self.by_operation.items())), "by_mode": dict(self.by_mode),
                "check_failures": dict(self.check_failures), "informational": dict(self.info),
                "informational_examples": self.info_examples,
                "transport_errors": dict(self.transport_errors),
                "finding_count": self.finding_count, "findings": self.findings,
                "not_generated": self.not_generated}


def cap_schema(spec: dict[str, Any], text_cap: int, batch_cap: int) -> dict[str, Any]:
    """The spec with every request string's maxLength at most `text_cap`, batch `texts` at most `batch_cap`."""
    def walk(node: Any, key: str | None = None) -> Any:
        if isinstance(node, dict):
            node = {k: walk(v, k) for k, v in node.items()}
            if node.get("type") == "string" and "maxLength" in node:
                node["maxLength"] = min(node["maxLength"], text_cap)
            if key == "texts" and node.get("type") == "array":
                node["maxItems"] = min(node.get("maxItems", batch_cap), batch_cap)
                node["items"] = {**node.get("items", {}), "maxLength": text_cap}
            return node
        if isinstance(node, list):
            return [walk(v) for v in node]
        return node
    paths = {path: {method: ({**op, "requestBody": walk(op["requestBody"])} if "requestBody" in op else op)
                    for method, op in item.items()} for path, item in spec["paths"].items()}
    return {**spec, "paths": paths}


def _fetch_spec(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(f"{url}/openapi.json", timeout=30) as response:  # noqa: S310 - loopback URL
        return json.load(response)


def _check_one(case: Any, url: str, label: str, mode: str, checks: tuple[list[Any], list[Any]],
               stats: FuzzStats) -> None:
    """Send one case, record its status, and every way the answer is wrong."""
    import requests

    try:
        response = case.call(base_url=url, timeout=REQUEST_TIMEOUT_S)
    except requests.RequestException as exc:
        kind = "timeout" if isinstance(exc, requests.Timeout) else "connection"
        stats.record(label, mode, None)
        stats.transport_errors[kind] += 1
        stats.finding(kind, label, mode, f"{type(exc).__name__}: {exc}", case.as_curl_command(base_url=url))
        return
    stats.record(label, mode, response.status_code)
    if response.status_code >= 500:
        allowed = response.status_code in RETRYABLE and response.headers.get("Retry-After", "").strip().isdigit()
        if not allowed:
            stats.server_errors += 1
            stats.finding("server_error", label, mode, f"HTTP {response.status_code}: {response.text[:300]}",
                          case.as_curl_command(base_url=url))
    for failure in _failures(case, response, checks[0]):
        stats.check_failures[getattr(failure, "title", type(failure).__name__)] += 1
        stats.finding("check", label, mode, str(failure), case.as_curl_command(base_url=url))
    for failure in _failures(case, response, checks[1]):
        title = getattr(failure, "title", type(failure).__name__)
        stats.info[title] += 1
        if stats.info[title] <= 10:  # a few examples of each kind
            stats.info_examples.append(f"{title}: HTTP {response.status_code} {case.as_curl_command(base_url=url)}"[:1000])


def _failures(case: Any, response: Any, checks: list[Any]) -> list[Any]:
    """The schemathesis check failures of one response (empty when it passes)."""
    try:
        case.validate_response(response, checks=checks)
    except BaseExceptionGroup as group:
        return list(group.exceptions)
    except AssertionError as failure:
        return [failure]
    return []


def _resolve_checks() -> tuple[list[Any], list[Any]]:
    """(asserted checks, informational checks) from schemathesis' registry."""
    from schemathesis.checks import CHECKS as REGISTRY
    from schemathesis.specs.openapi import checks as _openapi_checks  # noqa: F401 - registers the OpenAPI checks
    return REGISTRY.get_by_names(list(CHECKS)), REGISTRY.get_by_names(list(INFO_CHECKS))


def _run_stream(operation: Any, mode: Any, budget: int, seed: int, url: str, label: str, checks: tuple,
                stats: FuzzStats) -> int:
    """Up to `budget` cases of one operation in one mode; returns how many were sent."""
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as fixed_seed

    sent = 0

    @fixed_seed(seed)
    @settings(max_examples=budget, database=None, deadline=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck), derandomize=False, print_blob=False)
    @given(case=operation.as_strategy(generation_mode=mode))
    def run(case: Any) -> None:
        nonlocal sent
        if sent >= budget:
            return
        sent += 1
        _check_one(case, url, label, mode.value, checks, stats)

    run()
    return sent


def run_fuzz(url: str, requests: int = 300, seed: int = 0, text_cap: int = 40, batch_cap: int = 3,
             progress: bool = False) -> dict[str, Any]:
    """Fuzz the service at `url` with about `requests` requests; returns the figures (see FuzzStats.report)."""
    import schemathesis
    from schemathesis import GenerationMode

    schema = schemathesis.openapi.from_dict(cap_schema(_fetch_spec(url), text_cap, batch_cap))
    checks = _resolve_checks()
    streams = []
    stats = FuzzStats()
    for result in schema.get_all_operations():
        try:
            operation = result.ok()
        except Exception as exc:  # noqa: BLE001 - an operation schemathesis cannot load: a finding, not a pass
            stats.not_generated.append(f"an operation could not be loaded ({type(exc).__name__}: {str(exc)[:200]})")
            continue
        # Negative cases need an input that can be wrong: a body (path and query values here are free strings,
        # so for the other operations every request is a valid one and hypothesis finds none to make).
        modes = (GenerationMode.POSITIVE, GenerationMode.NEGATIVE) if len(operation.body) else (GenerationMode.POSITIVE,)
        for mode in modes:
            streams.append((operation, mode, f"{operation.method.upper()} {operation.path}"))
    if not streams:
        stats.not_generated.append("the schema has no operations")
    started = time.monotonic()
    rounds = 0
    while stats.requests < requests and streams:  # exhausted streams (few distinct cases) drop out
        budget = max(1, (requests - stats.requests) // len(streams))
        still = []
        for index, (operation, mode, label) in enumerate(streams):
            if stats.requests >= requests:
                break
            budget_here = min(budget, requests - stats.requests)
            try:
                sent = _run_stream(operation, mode, budget_here, seed + 1000 * rounds + index, url, label, checks,
                                   stats)
            except Exception as exc:  # noqa: BLE001 - schemathesis cannot generate this mode here
                if rounds == 0:
                    stats.not_generated.append(f"{label} {mode.value} ({type(exc).__name__})")
                continue
            if sent >= budget_here:
                still.append((operation, mode, label))
        streams = still
        rounds += 1
        if progress:
            print(f"fuzz: {stats.requests} requests, {stats.server_errors} server errors, "
                  f"{stats.finding_count} findings, {time.monotonic() - started:.0f} s", file=sys.stderr, flush=True)
    report = stats.report()
    report.update({"url": url, "seed": seed, "text_cap": text_cap, "batch_cap": batch_cap,
                   "seconds": round(time.monotonic() - started, 1), "readyz_after": http_status(url, "/readyz")})
    return report


def format_report(report: dict[str, Any]) -> str:
    lines = [f"cosyedge fuzz ({report['url']}, seed {report['seed']}, text <= {report['text_cap']} chars): "
             f"{report['requests']} requests in {report['seconds']} s",
             f"  statuses: {report['statuses']}",
             f"  5xx: {report['5xx_total']} in all, {report['server_errors_5xx']} not 503/504 with Retry-After",
             f"  schema check failures: {report['check_failures'] or 'none'}",
             f"  informational (not failures): {report['informational'] or 'none'}",
             f"  timeouts/dropped: {report['transport_errors'] or 'none'}",
             f"  /readyz afterwards: {report['readyz_after']}"]
    if report["not_generated"]:
        lines.append(f"  not generated: {report['not_generated']}")
    for item in report["findings"][:10]:
        lines.append(f"  finding [{item['kind']}] {item['operation']} ({item['mode']}): "
                     f"{item['detail'].splitlines()[0] if item['detail'] else ''}\n    {item['reproduce']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cosyedge.api.bench.fuzz", description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=10000, help="request budget (default 10000)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--text-cap", type=int, default=40, help="longest generated text (characters)")
    parser.add_argument("--batch-cap", type=int, default=3, help="most texts in a generated batch request")
    parser.add_argument("--url", help="a running service (default: start one on a free loopback port)")
    parser.add_argument("--bundle", help="bundle of the service started here (default: the default voice)")
    parser.add_argument("--json", help="write the figures to this file")
    args = parser.parse_args(argv)
    if args.requests < 1 or args.text_cap < 1 or args.batch_cap < 1:
        parser.error("--requests, --text-cap and --batch-cap must be >= 1")
    if args.url:
        report = run_fuzz(args.url.rstrip("/"), args.requests, args.seed, args.text_cap, args.batch_cap, True)
    else:
        env = {"COSYEDGE_MAX_TEXT_LEN": str(args.text_cap), "COSYEDGE_MAX_BATCH_ITEMS": str(args.batch_cap)}
        with ServiceProcess(bundle=args.bundle, env=env) as service:
            report = run_fuzz(service.url, args.requests, args.seed, args.text_cap, args.batch_cap, True)
            report["server_memory"] = service.memory()  # the process tree, MB
    print(format_report(report))
    write_json(report, args.json)
    return 1 if failed(report) else 0


def failed(report: dict[str, Any]) -> bool:
    """Whether a run found something: a 5xx, a timeout or drop, not ready afterwards, or operations (or modes)
    that could not be generated, so that part of the API went unfuzzed."""
    return bool(report["server_errors_5xx"] or report["transport_errors"] or report["readyz_after"] != 200
                or report["not_generated"] or not report["requests"])


if __name__ == "__main__":
    sys.exit(main())
