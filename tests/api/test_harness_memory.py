"""The harness measures a service's whole process tree and guards the box (issue 20 item 7).

The engine lives in gunicorn's forked worker, not in the arbiter whose pid the harness holds: reading the arbiter
alone let 700 MB of ballast in the worker go unseen. A parent that only waits, and a child that holds the memory,
stand in for the two; the guard must kill both past its budget.
"""
from __future__ import annotations

import subprocess
import sys
import time

from cosyedge.api.bench.harness import TreeMemory, memory_kib, process_tree

BALLAST_MB = 200
# the parent spawns a child that touches BALLAST_MB and then waits for stdin (closed: it exits)
PARENT = f"""
import subprocess, sys
child = subprocess.Popen([sys.executable, "-c",
    "import sys; b = bytearray({BALLAST_MB} << 20); b[::4096] = b'x' * len(b[::4096]); print('ready', flush=True); "
    "sys.stdin.read()"], stdin=sys.stdin, stdout=sys.stdout)
child.wait()
"""


def _start() -> tuple[subprocess.Popen, int]:
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert parent.stdout is not None and parent.stdout.readline().strip() == b"ready"
    tree = process_tree(parent.pid)
    assert len(tree) == 2 and tree[0] == parent.pid, tree
    return parent, tree[1]


def test_the_tree_counts_the_childs_memory_that_the_parent_alone_does_not_show():
    parent, child = _start()
    try:
        memory = TreeMemory(parent.pid).start()
        memory.sample()
        memory.stop()
        assert memory_kib(parent.pid)["vmhwm"] < BALLAST_MB * 1024 / 2  # what the old harness reported
        assert memory.processes == 2
        assert memory.peak_kib >= BALLAST_MB * 1024 and memory.peak_sum_kib >= BALLAST_MB * 1024
        assert memory.exceeded is None
    finally:
        parent.communicate(b"", timeout=30)


def test_the_guard_kills_every_process_of_the_tree_past_its_budget():
    parent, child = _start()
    memory = TreeMemory(parent.pid, budget_mb=BALLAST_MB // 2, interval=0.02).start()
    try:
        assert parent.wait(timeout=30) == -9
        deadline = time.monotonic() + 10
        while memory_kib(child) and time.monotonic() < deadline:  # a zombie until reaped by init: no status
            time.sleep(0.05)
        assert not memory_kib(child) or memory_kib(child).get("vmrss", 0) == 0
        assert memory.exceeded is not None and "over its budget" in memory.exceeded
    finally:
        memory.stop()
        if parent.poll() is None:
            parent.kill()
