"""Two services starting on a fresh box build the default voice's bundle once (issue 10: both built it, and the
second swapped out the files the first was loading)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

CODE = """
import logging, sys, time
logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
start = float(sys.argv[1])
while time.time() < start:  # both processes ask at the same moment
    time.sleep(0.005)
from cosyedge.device import Engine
engine = Engine.load(warmup=False)
assert engine.synthesize("Both of us speak.", deterministic=True).duration_seconds > 0.5
print("ok")
"""


@pytest.mark.slow
def test_concurrent_first_use_builds_once(tmp_path):
    import time
    env = {**os.environ, "COSYEDGE_HOME": str(tmp_path / "fresh"), "COSYEDGE_THREADS": "1"}
    start = str(time.time() + 3)
    procs = [subprocess.Popen([sys.executable, "-c", CODE, start], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    results = [proc.communicate(timeout=600) for proc in procs]
    for proc, (out, err) in zip(procs, results):
        assert proc.returncode == 0 and out.strip() == "ok", err[-3000:]
    builds = sum(err.count("built default-joe") for _, err in results)
    assert builds == 1, [err[-1500:] for _, err in results]
