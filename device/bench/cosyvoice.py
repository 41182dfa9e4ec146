"""`cosyedge bench --bundle B` for CosyVoice2 bundles: RTF, first-chunk latency, throughput, stage times, peak RSS.

Every backend runs in its own worker process (one per device precision, one for the PyTorch reference), so the
peak RSS of each is its own (VmHWM, reset at the start of every configuration) and torch never enters the device
runtime. This parent (numpy only) sends the workers the same batches of requests in turn, ABBA-ordered, batch by
batch: on a noisy shared machine the backends are slowed alike and their ratios hold.

A configuration is (concurrency c, stream on/off): the text set is cut into batches of c requests (texts reused
round-robin to fill the last batch); the c requests of a batch start together on c threads. Per run:

* rtf: sum of request latencies / sum of audio seconds (c = 1: compute time / audio time);
* first_chunk_s_p50/p95: request start (text in) to its first audio chunk (streaming runs; null otherwise);
* stall_s_p50/p95: per request, the seconds a listener who starts playing at the first chunk waits for later
  chunks (worker.playback_stall; streaming runs; null otherwise): first audio sooner from smaller first chunks
  can cost a gap after them, and this shows it;
* throughput_audio_s_per_s: audio seconds / wall seconds of the batches;
* stage_s: seconds per stage summed over every request (frontend, llm_prefill, llm_decode, flow, hift); on the
  device they are the wall time of the stage's ORT graph calls, timed by the session factory the worker injects
  (the one `llm` graph by call kind: empty cache = llm_prefill, else llm_decode; clocks.py);
  llm_ms_per_token = llm_decode / decode steps;
* peak_rss_mb: the worker's peak resident set during the configuration (the models stay resident);
  stage_rss_mb: per stage, the largest resident set seen right after one of its graph calls.

`--presets official,fast|all` measures each CosyVoice2 flow quality preset of the bundle (presets.py) on every
device precision, as separate runs of the same worker (the preset is a per-request option); every run carries
`precision` and `preset` (the reference is the official recipe: `official`).

`--peer vox` adds vox-tts (an independent C++ engine) on the same release (`--reference`) as one more worker at
concurrency 1, stream off (peer_vox.py); the report's `peer` section says how it ran and holds ours / its RTF.

`--tokens N` pins every segment to exactly N speech tokens (`cosyvoice2.pipeline.pinned`, the bench's own options: no
stop id can be chosen), because random-weight bundles never stop sensibly; without it lengths follow the model.
"""
from __future__ import annotations

import json
import math
import os
import platform
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from cosyedge.device.bench.clocks import STAGES
from cosyedge.device.bench.peer_vox import PEER, check_peer
from cosyedge.device.bench.report import rtf_ratios
from cosyedge.device.bench.worker import TEXTS, Settings
from cosyedge.device.errors import CosyedgeError, InputError

DEVICE_WORKER = "cosyedge.device.bench.worker"
REFERENCE_WORKER = "cosyedge.quantize.cosyvoice2.reference"  # build host only: torch lives in that process
REFERENCE_WORKERS = {"cosyvoice2": REFERENCE_WORKER, "cosyvoice3": "cosyedge.quantize.cosyvoice3.reference"}
PEER_WORKER = "cosyedge.device.bench.peer_vox"


class Worker:
    """One backend process and the parent side of its line protocol (see `worker`)."""

    def __init__(self, name: str, argv: list[str]) -> None:
        self.name = name
        self._log = tempfile.TemporaryFile(mode="w+", encoding="utf-8")
        self._process = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log,
                                         text=True, encoding="utf-8", bufsize=1)
        self.info: dict[str, Any] = {}

    def wait_ready(self) -> dict[str, Any]:
        self.info = self._receive()
        return self.info

    def batch(self, texts: Sequence[str], stream: bool, settings: Settings, reset_peak: bool) -> dict[str, Any]:
        self._send({"cmd": "batch", "texts": list(texts), "stream": stream, "reset_peak": reset_peak,
                    "settings": {"tokens": settings.tokens, "sampling": settings.sampling, "seed": settings.seed,
                                 "preset": settings.preset, "words": settings.words}})
        return self._receive()

    def close(self) -> None:
        try:
            if self._process.poll() is None:
                self._send({"cmd": "quit"})
                self._process.wait(timeout=60)
        except (OSError, subprocess.TimeoutExpired):
            self._process.kill()
            self._process.wait()
        self._log.close()

    def _send(self, message: dict[str, Any]) -> None:
        assert self._process.stdin is not None
        self._process.stdin.write(json.dumps(message) + "\n")
        self._process.stdin.flush()

    def _receive(self) -> dict[str, Any]:
        assert self._process.stdout is not None
        line = self._process.stdout.readline()
        message = json.loads(line) if line.strip() else {"error": "the worker exited"}
        if "error" in message:
            self._log.seek(0)
            tail = self._log.read()[-1500:].strip()
            raise CosyedgeError(f"bench worker {self.name}: {message['error']}" + (f"\n{tail}" if tail else ""))
        return message


@dataclass
class _Run:
    """The batches of one backend in one configuration, summed."""
    wall_s: float = 0.0
    audio_s: float = 0.0
    latency_s: list[float] = field(default_factory=list)
    first_chunk_s: list[float] = field(default_factory=list)
    stall_s: list[float] = field(default_factory=list)
    decode_steps: int = 0
    stage_s: dict[str, float] = field(default_factory=lambda: dict.fromkeys(STAGES, 0.0))
    peak_rss_mb: float = 0.0
    stage_rss_mb: dict[str, float] = field(default_factory=dict)

    def add(self, reply: dict[str, Any]) -> None:
        self.wall_s += reply["wall_s"]
        self.audio_s += reply["audio_s"]
        self.latency_s += reply["latency_s"]
        self.first_chunk_s += reply["first_chunk_s"]
        self.stall_s += reply["stall_s"]
        self.decode_steps += reply["decode_steps"]
        for stage in STAGES:
            self.stage_s[stage] += reply["stage_s"].get(stage, 0.0)
        self.peak_rss_mb = max(self.peak_rss_mb, reply["peak_rss_mb"])
        for stage, rss in reply.get("stage_rss_mb", {}).items():
            self.stage_rss_mb[stage] = max(self.stage_rss_mb.get(stage, 0.0), rss)

    def row(self, info: dict[str, Any], preset: str, concurrency: int, stream: bool) -> dict[str, Any]:
        audio = self.audio_s or float("nan")
        first, stall = np.asarray(self.first_chunk_s, np.float64), np.asarray(self.stall_s, np.float64)
        streamed = stream and first.size > 0
        return {"backend": info["backend"], "bundle": info["bundle"], "precision": info["precision"], "preset": preset,
                "concurrency": concurrency, "stream": stream, "audio_s": round(self.audio_s, 3),
                "wall_s": round(self.wall_s, 3), "rtf": round(sum(self.latency_s) / audio, 4),
                "first_chunk_s_p50": round(float(np.percentile(first, 50)), 4) if streamed else None,
                "first_chunk_s_p95": round(float(np.percentile(first, 95)), 4) if streamed else None,
                "stall_s_p50": round(float(np.percentile(stall, 50)), 4) if streamed else None,
                "stall_s_p95": round(float(np.percentile(stall, 95)), 4) if streamed else None,
                "llm_ms_per_token": round(1000 * self.stage_s["llm_decode"] / self.decode_steps, 2)
                if self.decode_steps else None,
                "stage_s": {k: round(v, 4) for k, v in self.stage_s.items()},
                "peak_rss_mb": self.peak_rss_mb, "stage_rss_mb": dict(self.stage_rss_mb),
                # the word-timing pass against the rest of the synthesis (runs with --words; concurrency 1: compute)
                "align_cost_pct": round(100 * self.stage_s["align"] / (sum(self.latency_s) - self.stage_s["align"]), 2)
                if self.stage_s["align"] else None,
                "throughput_audio_s_per_s": round(self.audio_s / self.wall_s, 4) if self.wall_s else None}


def batches(texts: Sequence[str], concurrency: int) -> list[list[str]]:
    """The text set as batches of `concurrency` requests, texts reused round-robin to fill the last batch."""
    count = math.ceil(len(texts) / concurrency)
    return [[texts[(b * concurrency + j) % len(texts)] for j in range(concurrency)] for b in range(count)]


def machine_info(threads: int, settings: Settings, rounds: int, texts: int) -> dict[str, Any]:
    import onnxruntime
    return {"platform": platform.platform(), "processor": platform.machine(), "cpus": os.cpu_count(),
            "python": platform.python_version(), "onnxruntime": onnxruntime.__version__, "numpy": np.__version__,
            "load_average": [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None,
            "threads": threads, "tokens": settings.tokens, "sampling": settings.sampling, "rounds": rounds,
            "texts": texts}


def _manifest(bundle: Path):
    """The manifest of a CosyVoice bundle (InputError for another family)."""
    from cosyedge.device.bundle import Bundle
    manifest = Bundle.load(bundle, verify=False).manifest
    if manifest.family not in REFERENCE_WORKERS:
        raise InputError(f"bundle {Path(bundle).name!r} is a {manifest.family} bundle, not "
                         f"{' or '.join(REFERENCE_WORKERS)}")
    return manifest


def _check_compare_names(bundle: Path, compare: Sequence[tuple[Path, str]]) -> None:
    """The report names a bundle by its folder, and a run by bundle and precision: two bundles of one folder name,
    or one pair given twice, would be reported as one (the second silently replacing the first)."""
    seen: dict[str, Path] = {Path(bundle).name: Path(bundle).resolve()}
    pairs: set[tuple[Path, str]] = set()
    for other, precision in compare:
        path = Path(other).resolve()
        if (path, precision) in pairs:
            raise InputError(f"--compare {Path(other).name}:{precision} is given twice")
        pairs.add((path, precision))
        if seen.setdefault(Path(other).name, path) != path:
            raise InputError(f"--compare: two bundles are named {Path(other).name!r} and the report names bundles by "
                             "folder; give one another name (a symbolic link will do)")


def _precisions(bundle: Path, precisions: Sequence[str]) -> list[str]:
    """The requested precisions (or quantize targets) this CosyVoice bundle has, in the order asked."""
    manifest = _manifest(bundle)
    available = [*manifest.precisions, *manifest.config.get("targets", {})]
    chosen = [p for p in dict.fromkeys(precisions) if p in available]
    if not chosen:
        raise InputError(f"bundle {Path(bundle).name!r} has none of the precisions {', '.join(precisions)}; "
                         f"it has {', '.join(available)}")
    return chosen


def _presets(bundle: Path, presets: Sequence[str] | None) -> list[str]:
    """The requested flow presets in the order asked (`all`: every preset of the bundle); None: the default."""
    from cosyedge.device.bundle import Bundle
    from cosyedge.device.cosyvoice2.presets import bundle_presets
    offered, default, _ = bundle_presets(Bundle.load(bundle, verify=False).manifest.config)
    if not presets:
        return [default]
    chosen = list(offered) if list(presets) == ["all"] else list(dict.fromkeys(presets))
    unknown = [p for p in chosen if p not in offered]
    if unknown:
        raise InputError(f"--presets: bundle {Path(bundle).name!r} has no preset {unknown[0][:32]!r}; "
                         f"it has {', '.join(offered)}")
    return chosen


def run_cosyvoice_bench(bundle: Path, precisions: Sequence[str], concurrency: Sequence[int] = (1, 4, 8),
                        streams: Sequence[bool] = (True, False), tokens: int | None = None,
                        reference: Path | None = None, threads: int = 2, texts: Sequence[str] = TEXTS,
                        rounds: int = 1, sampling: str = "greedy", presets: Sequence[str] | None = None,
                        progress: Callable[[str], None] | None = None,
                        compare: Sequence[tuple[Path, str]] = (), words: bool = False,
                        peer: str | None = None) -> dict[str, Any]:
    """The report `{"machine": ..., "runs": [...]}`; the reference (PyTorch, fp32, same release) runs at
    concurrency 1 only, interleaved batch by batch with the device precisions and presets (one run per precision
    and preset; a precision's presets share its worker). `compare` adds (bundle, precision) pairs of other
    CosyVoice bundles (e.g. CosyVoice2 cpu beside CosyVoice3 cpu) at each chosen preset they offer (none: their
    default), interleaved the same way so their ratios come from one run. `words`: the device runs with word times
    (their pass is the `align` stage, `align_cost_pct` its share of the rest of the synthesis). `peer="vox"`:
    vox-tts on the release of `reference` at concurrency 1, stream off. `progress` gets a line per batch."""
    say = progress or (lambda line: None)
    chosen = _precisions(bundle, precisions)
    chosen_presets = _presets(bundle, presets)
    if tokens is not None and tokens < 1:
        raise InputError("--tokens must be at least 1")
    if not texts or any(c < 1 for c in concurrency) or rounds < 1 or sampling not in ("greedy", "default"):
        raise InputError("texts, concurrency >= 1, rounds >= 1 and sampling greedy|default are required")
    if peer is not None:
        check_peer(_manifest(bundle).family, reference, streams, concurrency)
    _check_compare_names(bundle, compare)
    settings = Settings(tokens, sampling, words=words)
    python = sys.executable
    devices = [(f"device-{p}", bundle, p) for p in chosen]
    devices += [(f"device-{Path(b).name}-{p}", Path(b), _precisions(Path(b), [p])[0]) for b, p in compare]
    workers = {name: Worker(name, [python, "-m", DEVICE_WORKER, "--worker", str(b), "--precision", p,
                                   "--threads", str(threads), *(["--words"] if words else [])])
               for name, b, p in devices}
    if reference is not None:
        workers["reference"] = Worker("reference", [python, "-m", REFERENCE_WORKERS[_manifest(bundle).family], "--worker",
                                                    str(reference), "--threads", str(threads)])
    if peer is not None:
        workers[PEER] = Worker(PEER, [python, "-m", PEER_WORKER, "--worker", str(reference), "--bundle", str(bundle),
                                      "--threads", str(threads)])
    # run name -> (worker, preset): every device precision once per preset, a compared bundle at each of those
    # presets it offers (none: its default), the reference once
    plan = {}
    for name, b, _ in devices:
        offered = chosen_presets if b == bundle else (
            [p for p in chosen_presets if p in _presets(b, ["all"])] or _presets(b, None))
        plan.update({(f"{name}/{preset}" if len(chosen_presets) > 1 else name): (name, preset) for preset in offered})
    if reference is not None:
        plan["reference"] = ("reference", "official")
    if peer is not None:
        plan[PEER] = (PEER, "official")  # vox's flow runs the official recipe only
    runs = []
    turn = 0  # ABBA over every batch of the whole bench, so single-batch configurations alternate too
    try:
        for name, worker in workers.items():
            info = worker.wait_ready()
            say(f"{name}: ready, peak RSS {info['peak_rss_mb']:.0f} MB")
        for c in concurrency:
            for stream in streams:
                names = [n for n in plan if (c == 1 or n not in ("reference", PEER)) and not (stream and n == PEER)]
                acc = {name: _Run() for name in names}
                for _ in range(rounds):
                    for index, batch in enumerate(batches(texts, c)):
                        for name in (names if turn % 2 == 0 else names[::-1]):
                            worker, preset = plan[name]
                            first = not acc[name].latency_s
                            reply = workers[worker].batch(batch, stream, replace(settings, preset=preset),
                                                          reset_peak=first)
                            acc[name].add(reply)
                            say(f"{name}: concurrency {c}, stream {'on' if stream else 'off'}, batch {index + 1}: "
                                f"{reply['audio_s']:.2f} s of audio in {reply['wall_s']:.2f} s")
                        turn += 1
                runs += [acc[name].row(workers[plan[name][0]].info, plan[name][1], c, stream) for name in names]
    finally:
        for worker in workers.values():
            worker.close()
    report = {"machine": machine_info(threads, settings, rounds, len(texts)), "runs": runs}
    if peer is not None:
        report["peer"] = {**workers[PEER].info["peer"], "ratios": rtf_ratios(runs, PEER)}
    return report
