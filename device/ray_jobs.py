"""synth-batch on a Ray cluster (`--ray local|ADDRESS`): the same job as `jobs.run_job`, its lines rendered by
engines on many boxes.

Each actor is one engine on a node (`Engine.load` once, its thread budget the CPUs Ray gives it) with its own door;
it renders a line with the local job's renderer into a scratch directory and hands back the files' bytes
(`jobs.render_bytes`). The driver is the job's one writer: it skips the lines already done (whichever node made
them), places each returned line under a partial name renamed into place (`jobs.place`), appends failures to the
dead-letter file and shows the same progress, all through `jobs.run_lines`. An actor lost with lines in flight
(its process killed, its node gone) is replaced and those lines go again, so nothing is lost and, the driver being
the only writer, nothing is written twice. docs/scale-out.md.

Ray is an optional extra (`cosyedge[ray]`): this is the one module that imports it, lazily.
"""
from __future__ import annotations

import importlib.util
import os
import queue
import shutil
import tempfile
import threading
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any, Iterator, Mapping

from cosyedge.device.door import Door
from cosyedge.device.engine import Engine
from cosyedge.device.errors import InputError
from cosyedge.device.jobs import (DEAD_LETTER, Line, Rendered, line_done, line_path, place, prepare, render_bytes,
                                  run_lines)
from cosyedge.device.options import BatchLimits
from cosyedge.device.request import IN_FLIGHT_MAX, SYNTH_BATCH, Request, check_in_flight, parse
from cosyedge.device.sessions import SessionConfig

ATTEMPTS = 3  # a line's tries when its actor is lost under it (then it is a failed line, dead-lettered)
START_S = 600.0  # an engine no node has started in this long: the cluster has no room for it (not a hung job)
ACTORS_MAX = IN_FLIGHT_MAX  # the driver keeps at most IN_FLIGHT_MAX lines in flight: at least one per actor
# Ray's own switch for a one-machine cluster (its macOS/Windows mode): every process on 127.0.0.1, no other node.
_ONE_BOX = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
_LOOPBACK = ("127.0.0.1", "localhost")
_MISSING = "--ray needs Ray on this machine and on every node: pip install 'cosyedge[ray]'"


def require_ray() -> None:
    """The one-line error that names the extra, before any work that would end in it (ray is not imported)."""
    if importlib.util.find_spec("ray") is None:
        raise InputError(_MISSING)


def _import_ray(one_box: bool) -> Any:
    """Ray, or the one-line error that names the extra. An appliance is offline: Ray's usage statistics are off
    unless the environment turns them on."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if one_box:
        os.environ.setdefault(_ONE_BOX, "0")  # read when ray is first imported
    try:
        import ray
    except ImportError:
        raise InputError(_MISSING) from None
    return ray


def check_actors(value: int) -> int:
    if not 1 <= value <= ACTORS_MAX:
        raise InputError(f"--actors must be in 1-{ACTORS_MAX}")
    return value


@contextmanager
def cluster(address: str, cpus: int | None = None) -> Iterator[Any]:
    """`local`: a throwaway cluster on this machine (`cpus`, default the CPUs this process may use; loopback only,
    no dashboard, a temporary directory of its own) that ends with the block; else the running cluster at
    `address`, which the block only leaves."""
    local = address == "local"
    ray = _import_ray(local or address.rpartition(":")[0] in _LOOPBACK)
    temp = tempfile.mkdtemp(prefix="cosyedge-ray-") if local else None
    try:
        if local:  # the workers' TMPDIR inside it too: the scratch files of a worker killed mid-line go with it
            (Path(temp) / "tmp").mkdir()
            ray.init(address="local", num_cpus=cpus or len(os.sched_getaffinity(0)), include_dashboard=False,
                     _temp_dir=temp, log_to_driver=False, runtime_env={"env_vars": {"TMPDIR": f"{temp}/tmp"}})
        else:
            ray.init(address=address, log_to_driver=False)
    except (ConnectionError, RuntimeError, ValueError) as exc:
        if temp:
            shutil.rmtree(temp, ignore_errors=True)
        raise InputError(f"--ray {address[:80]}: no Ray cluster there ({str(exc).splitlines()[0][:160]}; a cluster "
                         "with token authentication: RAY_AUTH_MODE=token and its token, docs/scale-out.md)") from None
    try:
        yield ray
    finally:
        ray.shutdown()
        if temp:
            shutil.rmtree(temp, ignore_errors=True)


class LineActor:
    """One engine on a node, loaded once; its door takes the lines Ray runs on the actor's threads at once."""

    def __init__(self, bundle: str | None, precision: str, target: str | None, threads: int) -> None:
        self._load = (bundle, precision, target, threads)
        self.engine: Engine | None = None
        self.door: Door | None = None

    def start(self, values: Mapping[str, Any]) -> Request:
        """Load the engine and check the job's flags against it (the driver loads none: every actor checks them,
        so a voice one node lacks stops the job before its first line)."""
        if self.engine is None:
            bundle, precision, target, threads = self._load
            self.engine = Engine.load(bundle, precision=precision, target=target,
                                      sessions=replace(SessionConfig.from_env(), intra_op_threads=threads))
            self.door = Door(self.engine)
        return parse(values, SYNTH_BATCH, self.engine)

    def render(self, line: Line, job: Request, subtitles: str | None) -> Rendered:
        return render_bytes(self.engine, self.door, line, job, subtitles)

    def pid(self) -> int:
        """The worker process (tests SIGKILL it, as a crash would)."""
        return os.getpid()


def _cpus_each(ray: Any, actors: int) -> int:
    """The most CPUs each of `actors` engines can have with all of them placed on the cluster's nodes."""
    nodes = [int(n["Resources"].get("CPU", 0)) for n in ray.nodes() if n["Alive"]]
    if sum(nodes) < actors:
        raise InputError(f"--actors {actors}: the cluster has {sum(nodes)} CPUs; each engine needs one")
    return max(c for c in range(1, max(nodes) + 1) if sum(n // c for n in nodes) >= actors)


class Actors:
    """`count` engines spread over the cluster (default: one per node), `in_flight` lines on each at once. A line
    whose actor is lost goes again on a fresh actor in its place, up to `ATTEMPTS` tries."""

    def __init__(self, ray: Any, values: Mapping[str, Any], bundle: str | Path | None = None,
                 precision: str = "auto", target: str | None = None, count: int | None = None,
                 in_flight: int | None = None) -> None:
        self._ray, self._values = ray, dict(values)
        self.count = check_actors(count or sum(1 for n in ray.nodes() if n["Alive"] and n["Resources"].get("CPU")))
        self.per_actor = check_in_flight(in_flight or BatchLimits().batch_max)
        self.in_flight = min(self.count * self.per_actor, IN_FLIGHT_MAX)  # the driver's threads, one per line
        self.cpus = _cpus_each(ray, self.count)
        bundle = str(Path(bundle).expanduser().resolve()) if bundle is not None else None  # the same path on every node
        self._make = lambda: ray.remote(LineActor).options(
            num_cpus=self.cpus, max_concurrency=self.per_actor + 1, max_restarts=0,
            scheduling_strategy="SPREAD").remote(bundle, precision, target, self.cpus)
        self.handles = [self._make() for _ in range(self.count)]
        self.lost = 0  # actors lost (and replaced) during the job
        self._lock = threading.Lock()
        try:
            self.job: Request = self._get([h.start.remote(self._values) for h in self.handles], START_S)[0]
        except BaseException:
            self.close()
            raise
        self._free: queue.Queue[int] = queue.Queue()
        for _ in range(self.per_actor):
            for slot in range(self.count):
                self._free.put(slot)

    def _get(self, refs: Any, timeout: float | None = None) -> Any:
        """Ray's answer; a line's own failure (a refusal, an encoder error) raised as the local job raises it."""
        try:
            return self._ray.get(refs, timeout=timeout)
        except self._ray.exceptions.RayTaskError as exc:
            raise exc.cause from None
        except self._ray.exceptions.GetTimeoutError:
            raise InputError(f"no node started an engine of {self.cpus} CPU(s) within {START_S:.0f} s") from None

    def render(self, line: Line, subtitles: str | None) -> Rendered:
        """The line rendered by a free actor; tried again on a fresh actor when the one it ran on is lost."""
        for _ in range(ATTEMPTS):
            slot = self._free.get()
            handle = self.handles[slot]
            try:
                return self._get(handle.render.remote(line, self.job, subtitles))
            except self._ray.exceptions.RayActorError:
                self._replace(slot, handle)
            finally:
                self._free.put(slot)
        raise InputError(f"the actor rendering this line was lost {ATTEMPTS} times")

    def _replace(self, slot: int, lost: Any) -> None:
        """A fresh actor in a lost one's place (once, whichever of its lines noticed first)."""
        with self._lock:
            if self.handles[slot] is not lost:
                return
            self.lost += 1
            self._ray.kill(lost)  # gone already, or unreachable: either way not used again
            fresh = self._make()
            try:
                self._get(fresh.start.remote(self._values), START_S)
            except BaseException:  # no engine there (no room, a node without the bundle): the line fails, not the job
                self._ray.kill(fresh)
                raise
            self.handles[slot] = fresh

    def close(self) -> None:
        for handle in self.handles:
            self._ray.kill(handle)


def run_on_ray(actors: Actors, lines: list[Line], out_dir: Path, subtitles: str | None = None,
               progress: bool = True) -> dict:
    """`jobs.run_job` with the lines rendered by `actors` and written here: the same files, dead-letter file,
    progress and summary (plus `actors` and `actors_lost`)."""
    prepare(out_dir, subtitles)
    fmt = actors.job.format
    summary = run_lines(lines, lambda line: place(line_path(out_dir, line, fmt), actors.render(line, subtitles),
                                                  subtitles),
                        lambda line: line_done(line_path(out_dir, line, fmt), subtitles),
                        out_dir / DEAD_LETTER, progress, actors.in_flight)
    return {**summary, "actors": actors.count, "actors_lost": actors.lost}


def run_ray_job(address: str, lines: list[Line], out_dir: Path, values: Mapping[str, Any],
                bundle: str | None = None, precision: str = "auto", target: str | None = None,
                actors: int | None = None, in_flight: int | None = None, subtitles: str | None = None,
                progress: bool = True) -> dict:
    """`cosyedge synth-batch --ray`: connect (or start a local cluster), start the engines, run the job, let go."""
    prepare(out_dir, subtitles)  # before the cluster: a bad --out-dir is known at once
    with cluster(address) as ray:
        pool = Actors(ray, values, bundle, precision, target, actors, in_flight)
        try:
            return run_on_ray(pool, lines, out_dir, subtitles, progress)
        finally:
            pool.close()
