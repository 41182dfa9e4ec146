"""The `bench` and `bench-graphs` commands, added to the `cosyedge` parser by `register(subparsers)`
(entry point group `cosyedge.commands`). Benchmark modules are imported only when a command runs."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Callable

from cosyedge.device.cli import add_engine_args, writable  # the CLI's own flags and output-path check (no copy)
from cosyedge.device.errors import InputError
from cosyedge.device.request import SYNTH_BATCH, add_flags, cli_values


def _bundle_family(bundle: str | None) -> str:
    if bundle is None:
        return "vits"
    from cosyedge.device.bundle import Bundle
    return Bundle.load(bundle, verify=False).manifest.family


def _parse_list(value: str, option: str, parse: Callable[[str], Any]) -> list:
    try:
        return [parse(item.strip()) for item in value.split(",") if item.strip()]
    except (KeyError, ValueError):
        raise InputError(f"{option}: cannot read {value!r}") from None


def _compare(item: str) -> tuple[Path, str]:
    """`BUNDLE:PRECISION` of --compare (the precision after the last colon)."""
    bundle, _, precision = item.rpartition(":")
    if not bundle or not precision:
        raise InputError(f"--compare: give BUNDLE:PRECISION, not {item!r}")
    return Path(bundle), precision


def cmd_bench_cosyvoice(args: argparse.Namespace) -> int:
    from cosyedge.device.bench.chart import CHART_HINT, write_chart
    from cosyedge.device.bench.cosyvoice import TEXTS, run_cosyvoice_bench
    from cosyedge.device.bench.report import cosyvoice_table, write_json
    concurrency = _parse_list(args.concurrency or "1,4,8", "--concurrency", int)
    streams = _parse_list(args.stream or "on,off", "--stream", {"on": True, "off": False}.__getitem__)
    if not concurrency or not streams:
        raise InputError("--concurrency and --stream need at least one value")
    count = len(TEXTS) if args.texts is None else args.texts
    if not 1 <= count <= len(TEXTS):
        raise InputError(f"--texts must be 1-{len(TEXTS)}")
    chart = writable(Path(args.chart)) if args.chart else None
    out = writable(Path(args.json)) if args.json else None
    report = run_cosyvoice_bench(Path(args.bundle), args.precisions.split(","), concurrency=concurrency,
                                 streams=list(dict.fromkeys(streams)), tokens=args.tokens,
                                 reference=Path(args.reference) if args.reference else None, threads=args.threads,
                                 texts=TEXTS[:count], rounds=args.rounds or 1, sampling=args.sampling,
                                 presets=args.presets.split(",") if args.presets else None,
                                 progress=lambda line: print(line, file=sys.stderr, flush=True),
                                 compare=[_compare(item) for item in args.compare or ()], words=args.words,
                                 peer=args.peer)
    print(cosyvoice_table(report))
    if out:
        write_json(report, out)
    if chart:
        if write_chart(report, chart) is None:
            print(f"chart: not written; {CHART_HINT}", file=sys.stderr)
        else:
            print(f"chart: {chart.name} (bars numbered in table order)", file=sys.stderr)
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    if _bundle_family(args.bundle) in ("cosyvoice2", "cosyvoice3"):
        return cmd_bench_cosyvoice(args)
    from cosyedge.device.bench.engine import run_bench
    from cosyedge.device.bench.report import engine_table, write_json
    given = [name for name in ("concurrency", "stream", "tokens", "reference", "chart", "texts", "presets", "peer")
             if getattr(args, name) is not None] + (["words"] if args.words else [])
    if given:
        raise InputError(f"--{given[0]} applies to CosyVoice bundles only")
    report = run_bench(args.bundle, args.precisions.split(","), rounds=args.rounds or 3, threads=args.threads,
                       peer=not args.no_peer, compare={item: _compare(item) for item in args.compare or ()})
    print(engine_table(report))
    if args.json:
        write_json(report, Path(args.json))
    else:
        print(json.dumps(report, indent=2))
    return 0


def cmd_bench_graphs(args: argparse.Namespace) -> int:
    from cosyedge.device.bench.graphs import run_graph_bench
    from cosyedge.device.bench.report import write_json
    report = run_graph_bench(Path(args.bundle), precision=args.precision, tokens=args.tokens, prompt=args.prompt,
                             threads=args.threads, repeats=args.repeats)
    if args.json:
        write_json(report, Path(args.json))
    print(json.dumps(report, indent=2))
    e, ceiling = report["estimator"], report["estimator"]["gemm_ceiling"]
    print(f"flow_estimator ({args.precision}): {e['gop_per_call']} GOP per call, {report['graph_ms']['flow_estimator_call']} "
          f"ms -> {e['achieved_gops']} GOP/s; plain {'x'.join(map(str, ceiling['shape_mkn']))} GEMM on "
          f"{args.threads} threads: fp32 {ceiling['fp32_gops']} GOP/s, dynamic int8 {ceiling['int8_dynamic_gops']} GOP/s",
          file=sys.stderr)
    top = ", ".join(f"{op} {ms}" for op, ms in list(e["ms_by_op"].items())[:8])
    print(f"flow_estimator ({args.precision}) kernel ms by op, one profiled call: {top}", file=sys.stderr)
    return 0


def cmd_bench_batch(args: argparse.Namespace) -> int:
    import tempfile

    from cosyedge.device.bench.batch import batch_table, run_batch_bench
    from cosyedge.device.bench.report import write_json
    from cosyedge.device.jobs import read_lines
    from cosyedge.device.request import check_in_flight
    in_flight = [check_in_flight(n) for n in _parse_list(args.in_flight, "--in-flight", int)]
    if not in_flight:
        raise InputError("--in-flight needs at least one value")
    if not 0 <= args.actors <= 64:
        raise InputError("--actors must be in 0-64 (0: no Ray run)")
    threads = _parse_list(args.threads, "--threads", int) if args.threads else []
    if any(not 1 <= t <= 256 for t in threads) or len(set(threads)) != len(threads):
        raise InputError("--threads must be distinct counts in 1-256")
    lines = read_lines(Path(args.input))
    out = writable(Path(args.json)) if args.json else None
    if args.actors:
        from cosyedge.device.ray_jobs import require_ray
        require_ray()
    with tempfile.TemporaryDirectory(prefix="cosyedge-bench-batch-") as scratch:
        report = run_batch_bench(lines, Path(args.out_dir or scratch), args.bundle, args.precision, args.target,
                                 in_flight, args.actors, threads, cli_values(args, SYNTH_BATCH))
    print(batch_table(report))
    if out:
        write_json(report, out)
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    """Add `bench` and `bench-graphs` to the `cosyedge` parser."""
    p = sub.add_parser("bench", help="measure real-time factor, precisions side by side")
    p.add_argument("--bundle")
    p.add_argument("--precisions", default="fp32,int8",
                   help="those the bundle has are measured (CosyVoice: also quantize targets, e.g. fp32,cpu)")
    p.add_argument("--rounds", type=int, help="passes over the text set (default: 3 Piper, 1 CosyVoice)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--no-peer", action="store_true", help="skip the piper-tts reference runner")
    p.add_argument("--json", help="write the report to this file")
    p.add_argument("--compare", action="append", metavar="BUNDLE:PRECISION",
                   help="also run another bundle of the family at a precision or target (repeatable), interleaved "
                        "(e.g. the same Piper voice converted by an older version)")
    cv = p.add_argument_group("CosyVoice bundles")
    cv.add_argument("--concurrency", help="concurrent requests, comma list (default 1,4,8)")
    cv.add_argument("--stream", help="on, off or on,off (default both)")
    cv.add_argument("--tokens", type=int, help="pin every segment to N speech tokens (random-weight bundles never stop)")
    cv.add_argument("--reference", metavar="MODEL_DIR",
                    help="also run the PyTorch reference of this release (fp32, concurrency 1), interleaved")
    cv.add_argument("--peer", choices=["vox"],
                    help="also run vox-tts (pip install vox-tts) on the release of --reference, converted by its own "
                         "converter (LLM q8), interleaved at concurrency 1, stream off; the report has our RTF / vox's")
    cv.add_argument("--chart", help="write a PNG bar chart (RTF, first-chunk p50, throughput per run); "
                                    "needs matplotlib: pip install cosyedge[chart]")
    cv.add_argument("--texts", type=int, help="use the first N texts of the fixed set (zh and en alternate)")
    cv.add_argument("--presets", help="CosyVoice2 flow quality presets, comma list or 'all' (default: the bundle's "
                                      "default preset); each is measured like a precision")
    cv.add_argument("--sampling", choices=["greedy", "default"], default="greedy",
                    help="greedy (no NSF noise) or the release's sampler")
    cv.add_argument("--words", action="store_true",
                    help="synthesize with word times: the alignment pass is the align_s column, align_%% its share "
                         "of the rest of the synthesis (Piper bundles always report their word-time cost)")
    p.set_defaults(func=cmd_bench)

    p = sub.add_parser("bench-batch", help="a batch job's lines/hour, audio s/s and RTF at several lines in flight "
                                            "and on a local Ray cluster, in one run")
    p.add_argument("input", help="the lines, as synth-batch reads them (.txt or .csv id,text)")
    add_engine_args(p)
    p.add_argument("--in-flight", default="1,2,4,8", help="lines in flight on one engine, comma list (default 1,2,4,8)")
    p.add_argument("--actors", type=int, default=2,
                   help="engines on a throwaway local Ray cluster, the largest --in-flight each (0: no Ray run; "
                        "needs cosyedge[ray])")
    p.add_argument("--threads", help="intra-op threads of the engines, comma list: each count's engine runs every "
                                     "--in-flight (default: the CPUs / --actors; Ray actors: the first)")
    p.add_argument("--out-dir", help="keep every run's files here, one folder per run (default: a temporary one)")
    add_flags(p, SYNTH_BATCH)  # the request of every line (always --deterministic: the runs' files are compared)
    p.add_argument("--json", help="also write the report to this file")
    p.set_defaults(func=cmd_bench_batch)

    p = sub.add_parser("bench-graphs", help="per-graph ONNX Runtime latency of a CosyVoice bundle (pinned lengths)")
    p.add_argument("bundle")
    p.add_argument("--precision", default="fp32")
    p.add_argument("--tokens", type=int, default=250, help="speech tokens generated (250 = 10 s of audio)")
    p.add_argument("--prompt", type=int, default=137, help="LLM prompt positions")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--json", help="also write the report to this file")
    p.set_defaults(func=cmd_bench_graphs)
