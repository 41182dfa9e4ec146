"""A network namespace with nothing but loopback, for the tests that prove the box needs no network."""
from __future__ import annotations

import shutil
import subprocess

import pytest


def namespace_prefix() -> list[str]:
    """`unshare -n` (root) or `unshare -rn` (a user namespace); pytest.skip with the reason where neither works."""
    if shutil.which("unshare") is None or shutil.which("ip") is None:
        pytest.skip("unshare (util-linux) or ip (iproute2) is not installed")
    reasons = []
    for prefix in (["unshare", "-n"], ["unshare", "-rn"]):
        probe = subprocess.run([*prefix, "ip", "link", "set", "lo", "up"], capture_output=True, text=True, timeout=30)
        if probe.returncode == 0:
            return prefix
        reasons.append(f"{' '.join(prefix)}: {probe.stderr.strip() or probe.returncode}")
    pytest.skip("the kernel refuses a network namespace here: " + "; ".join(reasons))
