"""A real `cosyedge serve` in a child process, for the fuzz and load harnesses and their tests, and the in-process
server (`make_server`) of the HTTP tests and `bench-api`.

The service is tested from the outside, as deployed: its own entry point, its own port on
127.0.0.1, its own state directory. Its memory is the memory of its whole process tree (the gunicorn
arbiter, the worker that holds the engine, the worker's children such as ffmpeg), read from /proc
by a `TreeMemory` sampler that also guards the box: past its budget it SIGKILLs every process of the
tree, so a test that could exhaust memory takes down its own service, never the shared machine.
"""
from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, Mapping
from urllib.parse import urlsplit

MAX_HEADER_BYTES = 32 << 10  # the in-process server: the request line and headers together
READY_TIMEOUT_S = 300.0  # a fresh COSYEDGE_HOME builds the default voice's bundle first


def make_server(app: Any, host: str, port: int, threads: int):
    """An in-process waitress server in a thread, for the tests and `bench-api`'s in-process service.

    gunicorn's arbiter forks and owns the process's signals, so it cannot run inside a test process; the
    HTTP routes behave the same on both. WebSocket needs `cosyedge serve` (gunicorn).
    """
    from waitress import create_server
    return create_server(app, host=host, port=port, threads=threads, channel_request_lookahead=1,
                         ident="cosyedge", asyncore_use_poll=True, connection_limit=max(100, threads * 4),
                         max_request_header_size=MAX_HEADER_BYTES)


def add_service_arguments(parser: Any) -> None:
    """The options of a long run that either starts its own service or measures a running one."""
    parser.add_argument("--url", help="a running service (default: start one on a free loopback port)")
    parser.add_argument("--pid", type=int, help="with --url: the service's process id, for its memory")
    parser.add_argument("--bundle", help="bundle of the service started here (default: the default voice)")
    parser.add_argument("--memory-budget-mb", type=float, default=DEFAULT_BUDGET_MB,
                        help="the service started here is killed past this (its whole process tree; 0: never)")
    parser.add_argument("--json", help="write the figures to this file")


def write_json(report: dict[str, Any], path: str | None) -> None:
    """A long run's figures as indented JSON in `path` (nothing when None), for the Makefile targets."""
    if path:
        with open(path, "w", encoding="utf-8") as out:
            json.dump(report, out, indent=2)
            out.write("\n")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def http_status(url: str, path: str, timeout: float = 5.0) -> int | None:
    """Status of GET `path`, or None when nothing answers."""
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname or "127.0.0.1", parts.port or 80, timeout=timeout)
    try:
        conn.request("GET", path)
        response = conn.getresponse()
        response.read()
        return response.status
    except OSError:
        return None
    finally:
        conn.close()


def memory_kib(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM (peak RSS) of one process in KiB, from /proc/PID/status; {} where unreadable."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return {}
    fields_ = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    return {key.lower(): int(fields_[key].split()[0]) for key in ("VmRSS", "VmHWM") if key in fields_}


def kill_tree(pid: int) -> None:
    """SIGKILL to `pid` and every process below it, children first (none is left to outlive its parent)."""
    for member in reversed(process_tree(pid)):
        try:
            os.kill(member, signal.SIGKILL)
        except OSError:  # gone meanwhile
            pass


def process_tree(pid: int) -> list[int]:
    """`pid` and every live process below it (children of any of its threads), from /proc."""
    tree: list[int] = []
    todo = [pid]
    while todo:
        current = todo.pop()
        if current in tree:
            continue
        try:
            tasks = os.listdir(f"/proc/{current}/task")
        except OSError:
            continue  # gone meanwhile
        tree.append(current)
        for task in tasks:
            try:
                todo += [int(child) for child in Path(f"/proc/{current}/task/{task}/children").read_text().split()]
            except OSError:
                pass
    return tree


DEFAULT_BUDGET_MB = 4096  # a test service's guard; the units cap the real service at MemoryMax=4G too
SAMPLE_INTERVAL_S = 0.05


class TreeMemory:
    """The resident memory of a process tree, sampled every `interval` seconds in a daemon thread.

    `peak_kib` is the larger of the largest sum of the tree's VmRSS seen and the largest VmHWM (a process's own
    exact peak: the worker's spike between two samples is not missed). With a budget, the first sample over it
    SIGKILLs every process of the tree (`exceeded` then holds what was seen), as a cgroup's memory cap would.
    """

    def __init__(self, pid: int, budget_mb: float | None = None, interval: float = SAMPLE_INTERVAL_S) -> None:
        self.pid, self.interval = pid, interval
        self.budget_kib = int(budget_mb * 1024) if budget_mb else None
        self.peak_kib = self.peak_sum_kib = self.peak_hwm_kib = 0
        self.processes = 0  # the most processes seen in the tree at once
        self.exceeded: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def sample(self) -> int:
        """One reading (updates the peaks); returns the tree's current VmRSS sum in KiB."""
        readings = [memory_kib(pid) for pid in process_tree(self.pid)]
        readings = [r for r in readings if r]
        current = sum(r.get("vmrss", 0) for r in readings)
        self.processes = max(self.processes, len(readings))
        self.peak_sum_kib = max(self.peak_sum_kib, current)
        self.peak_hwm_kib = max([self.peak_hwm_kib, *(r.get("vmhwm", 0) for r in readings)])
        self.peak_kib = max(self.peak_sum_kib, self.peak_hwm_kib)
        if self.budget_kib is not None and self.peak_kib > self.budget_kib and self.exceeded is None:
            self.exceeded = (f"process tree of pid {self.pid} reached {self.peak_kib >> 10} MB, over its budget of "
                             f"{self.budget_kib >> 10} MB: killed")
            self.kill_tree()
        return current

    def kill_tree(self) -> None:
        kill_tree(self.pid)

    def start(self) -> "TreeMemory":
        self.sample()
        self._thread = threading.Thread(target=self._run, name=f"tree-memory-{self.pid}", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            if not Path(f"/proc/{self.pid}").exists():
                return
            self.sample()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)

    def figures(self) -> dict[str, float | int | str | None]:
        """MB figures for a report: the tree's peak, its parts, how many processes, and the guard's verdict."""
        return {"rss_mb_peak": kib_to_mb(self.peak_kib), "rss_mb_peak_sum": kib_to_mb(self.peak_sum_kib),
                "rss_mb_peak_process": kib_to_mb(self.peak_hwm_kib), "processes": self.processes,
                "budget_mb": kib_to_mb(self.budget_kib), "exceeded": self.exceeded}


def kib_to_mb(kib: int | None) -> float | None:
    return round(kib / 1024, 1) if kib is not None else None


@dataclass
class ServiceProcess:
    """`python -m cosyedge.device.cli serve` on a free loopback port; a context manager that waits for /readyz.

    `env` adds to (and overrides) the inherited environment, e.g. COSYEDGE_MAX_TEXT_LEN. The state
    directory (dead letters, registered voices) is private to this process unless `env` names one.
    `memory_budget_mb` guards the box: the whole process tree is killed past it (None: measured, never killed).
    """
    bundle: str | None = None
    env: Mapping[str, str] = field(default_factory=dict)
    ready_timeout_s: float = READY_TIMEOUT_S
    port: int = 0
    memory_budget_mb: float | None = DEFAULT_BUDGET_MB
    proc: subprocess.Popen | None = None
    launched_at: float = 0.0
    ready_after_s: float | None = None
    guard: TreeMemory | None = None
    _tmp: tempfile.TemporaryDirectory | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        assert self.proc is not None, "service not started"
        return self.proc.pid

    @property
    def log_path(self) -> Path:
        assert self._tmp is not None, "service not started"
        return Path(self._tmp.name) / "serve.log"

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def memory(self) -> dict[str, float | int | str | None]:
        """The process tree's memory since launch (`TreeMemory.figures`), read now."""
        assert self.guard is not None, "service not started"
        self.guard.sample()
        return self.guard.figures()

    def launch(self) -> "ServiceProcess":
        """Start the child and return at once (`wait_ready` waits; a test of a refused start waits for the exit)."""
        self._tmp = tempfile.TemporaryDirectory(prefix="cosyedge-serve-")
        state = Path(self._tmp.name) / "state"
        state.mkdir()
        self.port = self.port or free_port()
        env = {**os.environ, "COSYEDGE_STATE_DIR": str(state), **self.env}
        env.pop("NOTIFY_SOCKET", None)  # the child is not a systemd unit, whatever runs the harness
        command = [sys.executable, "-m", "cosyedge.device.cli", "serve", "--host", "127.0.0.1", "--port", str(self.port)]
        if self.bundle:
            command += ["--bundle", str(self.bundle)]
        self.launched_at = time.monotonic()
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL, stdout=log,
                                         stderr=subprocess.STDOUT)
        self.guard = TreeMemory(self.proc.pid, self.memory_budget_mb).start()
        return self

    def wait_ready(self) -> float:
        """Seconds from launch to the first 200 on /readyz; RuntimeError (with the log) if it exits or times out."""
        assert self.proc is not None, "service not launched"
        deadline = self.launched_at + self.ready_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.stop()
                why = f" ({self.guard.exceeded})" if self.guard is not None and self.guard.exceeded else ""
                raise RuntimeError(f"cosyedge serve exited with {self.proc.returncode} before ready{why}:\n"
                                   f"{self.log_tail()}")
            if http_status(self.url, "/readyz", timeout=2) == 200:
                self.ready_after_s = time.monotonic() - self.launched_at
                return self.ready_after_s
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"cosyedge serve not ready within {self.ready_timeout_s:.0f} s:\n{self.log_tail()}")

    def start(self) -> "ServiceProcess":
        self.launch()
        self.wait_ready()
        return self

    def kill(self) -> int | None:
        """SIGKILL to the whole process tree (the worker and its ffmpeg first, then the arbiter), as a power cut or
        the unit's cgroup kill would: no drain, no clean-up; returns the arbiter's exit status (-9). (The arbiter
        alone left its worker running on as an orphan, finishing or abandoning its writes after the next start.)"""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            kill_tree(self.proc.pid)
        return self.proc.wait()

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM (the service drains), then SIGKILL after `timeout`; returns the exit status."""
        code = None
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.send_signal(signal.SIGTERM)
                try:
                    self.proc.wait(timeout=timeout)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait()
            code = self.proc.returncode
        return code

    def close(self) -> None:
        self.stop()
        if self.guard is not None:
            self.guard.stop()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> "ServiceProcess":
        try:
            return self.start()
        except BaseException:
            self.close()
            raise

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()
