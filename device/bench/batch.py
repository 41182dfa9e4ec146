"""`cosyedge bench-batch`: what a batch job makes per hour on a bundle, the same lines in one run at several lines
in flight on one engine and on a local Ray cluster of several engines (issue 22 item 5).

Every engine of a thread count gets the same intra-op threads (ONNX Runtime's float sums follow the thread count,
so only then are the files of every run byte-identical, which the report checks within each thread count); several
thread counts (`--threads 2,1`) load the engine once each, so the in-flight runs of both are measured in one run.
Every run is a fresh output directory (no line skipped). Engine loads and the cluster's start are outside the
job's wall time and reported apart."""
from __future__ import annotations

import os
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Sequence

from cosyedge.device.engine import Engine
from cosyedge.device.errors import InputError
from cosyedge.device.jobs import DEAD_LETTER, Line, run_job
from cosyedge.device.request import SYNTH_BATCH, parse
from cosyedge.device.sessions import SessionConfig

VALUES = {"deterministic": True}  # every run's request is reproducible, so the files can be compared


def _row(run: str, engines: int, threads: int, in_flight: int, summary: dict, start_s: float) -> dict[str, Any]:
    wall = summary["wall_s"]
    return {"run": run, "engines": engines, "threads": threads, "in_flight": in_flight, "lines": summary["done"],
            "failed": summary["failed"], "audio_s": summary["audio_s"], "wall_s": wall, "start_s": round(start_s, 2),
            "lines_per_hour": round(summary["done"] * 3600 / wall) if wall else None,
            "audio_s_per_s": summary["audio_s_per_s"], "rtf": summary["rtf"]}


def _fresh(path: Path) -> Path:
    if path.exists() and any(path.iterdir()):
        raise InputError(f"--out-dir: {path.name!r} is not empty (a run must make every line)")
    return path


def _files(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.iterdir()) if p.is_file() and p.name != DEAD_LETTER}


def run_batch_bench(lines: list[Line], work: Path, bundle: str | None = None, precision: str = "auto",
                    target: str | None = None, in_flight: Sequence[int] = (1, 2, 4, 8), actors: int = 2,
                    threads: Sequence[int] = (), values: dict[str, Any] | None = None) -> dict[str, Any]:
    """For each of `threads` (intra-op threads; default: this machine's CPUs shared by the actors) one engine at each
    of `in_flight`, then `actors` engines of the first thread count on a throwaway local Ray cluster (0: none);
    outputs in `work/<run>/`. `values`: the request's fields as synth-batch takes them (e.g. voice, preset,
    sampling), always deterministic."""
    values = {**(values or {}), **VALUES}
    threads = list(threads) or [max(1, len(os.sched_getaffinity(0)) // max(1, actors))]
    suffix = (lambda t: f"-t{t}") if len(threads) > 1 else (lambda t: "")
    runs = [(f"in-flight-{n}{suffix(t)}", n, t) for t in threads for n in in_flight]
    if actors:
        runs.append((f"ray-{actors}-actors", max(in_flight), threads[0]))
    for name, _, _ in runs:
        _fresh(work / name)
    rows, loaded_as = [], {}
    for count in threads:
        began = time.perf_counter()
        engine = Engine.load(bundle, precision=precision, target=target,
                             sessions=replace(SessionConfig.from_env(), intra_op_threads=count))
        loaded, job = time.perf_counter() - began, parse(values, SYNTH_BATCH, engine)
        rows += [_row(name, 1, count, n, run_job(engine, lines, work / name, job, progress=False, in_flight=n), loaded)
                 for name, n, t in runs if t == count and not name.startswith("ray-")]
        loaded_as = {"bundle": engine.bundle.manifest.name, "precision": engine.precision}
        del engine  # before the next thread count's engine loads: one engine's memory at a time
    if actors:
        from cosyedge.device.ray_jobs import Actors, cluster, run_on_ray
        name, per_actor, _ = runs[-1]
        began = time.perf_counter()
        with cluster("local", cpus=actors * threads[0]) as ray:
            pool = Actors(ray, values, bundle, precision, target, count=actors, in_flight=per_actor)
            try:
                started = time.perf_counter() - began
                rows.append(_row(name, actors, pool.cpus, per_actor,
                                 run_on_ray(pool, lines, work / name, progress=False), started))
            finally:
                pool.close()
    first = {t: _files(work / next(name for name, _, c in runs if c == t)) for t in threads}
    differ = [name for name, _, t in runs if _files(work / name) != first[t]]
    return {**loaded_as, "request": values, "lines": len(lines), "threads_per_engine": threads,
            "cpus": len(os.sched_getaffinity(0)), "runs": rows, "identical": not differ, "differ": differ}


def batch_table(report: dict[str, Any]) -> str:
    """One row per run: engines x threads, lines in flight per engine, lines/hour, audio s/s, RTF, start."""
    head = f"{'run':<18}{'engines':>8}{'threads':>8}{'in-flight':>10}{'lines/h':>10}{'audio s/s':>11}{'RTF':>8}" \
           f"{'start s':>9}"
    rows = [f"{r['run']:<18}{r['engines']:>8}{r['threads']:>8}{r['in_flight']:>10}{r['lines_per_hour'] or 0:>10}"
            f"{r['audio_s_per_s'] or 0:>11.2f}{r['rtf'] or 0:>8.3f}{r['start_s']:>9.1f}" for r in report["runs"]]
    same = "byte-identical" if report["identical"] else f"DIFFER: {', '.join(report['differ'])}"
    if len(report["threads_per_engine"]) > 1:
        same = f"of a thread count {same}"
    request = ", ".join(f"{k}={v}" for k, v in report["request"].items())
    return "\n".join([head, *rows, f"{report['lines']} lines, {report['bundle']} {report['precision']} ({request}), "
                                   f"{report['cpus']} CPUs; files of every run {same}"])
