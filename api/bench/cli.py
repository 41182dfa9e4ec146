"""`cosyedge bench-api`: the HTTP API measured from the client's side; `device.cli` registers it."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from cosyedge.api.config import TARGETS
from cosyedge.device.errors import InputError


def cmd_bench_api(args: argparse.Namespace) -> int:
    from cosyedge.api.bench.api_bench import format_report, run_api_bench
    if args.cache_wyoming:  # issue 14's figures: a real `cosyedge serve --wyoming` process, measured from outside
        from cosyedge.api.bench.latency import format_latency, run
        if args.requests < 1:
            raise InputError("--requests must be at least 1")
        report = run(args.bundle, rounds=5 * args.requests, stream_rounds=args.requests)
        print(format_latency(report))
        if args.json:
            Path(args.json).write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
        return 0
    try:
        levels = tuple(int(n) for n in args.concurrency.split(","))
    except ValueError:
        levels = ()
    if not levels or min(levels) < 1:
        raise InputError("--concurrency must be a comma-separated list of positive integers, e.g. 1,4,8")
    report = run_api_bench(url=args.url, bundle=args.bundle, target=args.target, concurrency=levels,
                           stream=args.stream == "on", arrivals=args.arrivals, requests=args.requests,
                           texts=args.text or None, stagger_s=args.stagger, voice=args.voice,
                           preset=args.preset)
    print(format_report(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    """Add `bench-api` to the `cosyedge` parser."""
    p = sub.add_parser("bench-api", help="measure the HTTP API against the engine alone: first audio, latency, "
                                         "throughput at several concurrency levels")
    p.add_argument("--url", help="a running service (default: start one in-process on a free port)")
    p.add_argument("--bundle", help="bundle for the in-process service (default: the embedded default voice)")
    p.add_argument("--target", choices=TARGETS, help="a build target of the bundle (in-process service)")
    p.add_argument("--voice", help="voice of every request (default: the bundle's first)")
    p.add_argument("--preset", help="CosyVoice flow quality preset of every request (default: the bundle's)")
    p.add_argument("--stream", choices=("on", "off"), default="on", help="streamed or whole-file requests")
    p.add_argument("--concurrency", default="1,4", help="comma-separated client counts (default 1,4)")
    p.add_argument("--arrivals", choices=("staggered", "burst"), default="staggered")
    p.add_argument("--stagger", type=float, help="seconds between client starts (default: single-client mean "
                                                 "latency / concurrency)")
    p.add_argument("--requests", type=int, default=4, help="requests per client")
    p.add_argument("--text", action="append", help="a text of the workload (repeatable; default: 5 sentences)")
    p.add_argument("--json", help="write the report to this file")
    p.add_argument("--cache-wyoming", action="store_true",
                   help="instead: phrase-cache hit latency (wav, mp3; 5 x --requests) and HTTP vs Wyoming first "
                        "audio (--requests pairs) of one `cosyedge serve --wyoming` process")
    p.set_defaults(func=cmd_bench_api)
