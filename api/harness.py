"""A real `cosyedge serve` in a child process, for the fuzz and load harnesses and their tests.

The service is tested from the outside, as deployed: its own entry point, its own port on
127.0.0.1, its own state directory. The child's memory (VmRSS, VmHWM) is read from /proc, so
a harness can report what the service itself costs, apart from the clients driving it.
"""
from __future__ import annotations

import http.client
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Mapping
from urllib.parse import urlsplit

READY_TIMEOUT_S = 300.0  # a fresh COSYEDGE_HOME builds the default voice's bundle first


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
    """VmRSS and VmHWM (peak RSS) of a process in KiB, from /proc/PID/status; {} where unreadable."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return {}
    fields_ = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    return {key.lower(): int(fields_[key].split()[0]) for key in ("VmRSS", "VmHWM") if key in fields_}


@dataclass
class ServiceProcess:
    """`python -m cosyedge.device.cli serve` on a free loopback port; a context manager that waits for /readyz.

    `env` adds to (and overrides) the inherited environment, e.g. COSYEDGE_MAX_TEXT_LEN. The state
    directory (dead letters, registered voices) is private to this process unless `env` names one.
    """
    bundle: str | None = None
    env: Mapping[str, str] = field(default_factory=dict)
    ready_timeout_s: float = READY_TIMEOUT_S
    port: int = 0
    proc: subprocess.Popen | None = None
    launched_at: float = 0.0
    ready_after_s: float | None = None
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

    def memory(self) -> dict[str, int]:
        return memory_kib(self.pid)

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
        return self

    def wait_ready(self) -> float:
        """Seconds from launch to the first 200 on /readyz; RuntimeError (with the log) if it exits or times out."""
        assert self.proc is not None, "service not launched"
        deadline = self.launched_at + self.ready_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.stop()
                raise RuntimeError(f"cosyedge serve exited with {self.proc.returncode} before ready:\n{self.log_tail()}")
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
        """SIGKILL, as the OOM killer or a power cut would: no drain, no clean-up; returns the exit status (-9)."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
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
