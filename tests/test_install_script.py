"""`install.sh` never touches a venv it did not make: run against a prefix whose `venv` is a user's, it refuses in
one line (exit 2) before anything is installed, removed or written there. The artefact here holds only what the
installer reads before the venv (its own copy, `appliance.json`, `SHA256SUMS`); the whole install, upgrade included,
runs in tests/quantize/test_appliance.py."""
from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture()
def artefact(tmp_path: Path) -> Path:
    top = tmp_path / "artefact"
    top.mkdir()
    shutil.copy(REPO / "systemd" / "install.sh", top / "install.sh")
    (top / "appliance.json").write_text(json.dumps({
        "version": "0.0.0", "platform": f"linux-{platform.machine()}", "python": "%d.%d" % sys.version_info[:2],
        "wheel": "cosyedge-0.0.0-py3-none-any.whl", "default_bundle": "default-joe"}, indent=2) + "\n")
    (top / "SHA256SUMS").write_text("".join(f"{hashlib.sha256((top / name).read_bytes()).hexdigest()}  {name}\n"
                                            for name in ("install.sh", "appliance.json")))
    return top


def _install(top: Path, prefix: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    return subprocess.run(["sh", str(top / "install.sh"), "--prefix", str(prefix), "--no-systemd"], env=env,
                          capture_output=True, text=True, timeout=300)


def _users_venv(prefix: Path, python: str) -> dict[str, bytes]:
    """A venv of the user's at PREFIX/venv whose python reports another version (`exit 1` to the version check)."""
    (prefix / "venv" / "bin").mkdir(parents=True)
    (prefix / "venv" / "bin" / "python").write_text(python)
    (prefix / "venv" / "bin" / "python").chmod(0o755)
    (prefix / "venv" / "my-notes.txt").write_text("mine")
    return {p.relative_to(prefix).as_posix(): p.read_bytes() for p in prefix.rglob("*") if p.is_file()}


@pytest.mark.parametrize("python", ["#!/bin/sh\nexit 1\n", f"#!/bin/sh\nexec {sys.executable} \"$@\"\n"],
                         ids=["other-python", "same-python"])
def test_a_users_venv_in_the_prefix_is_refused_and_kept(artefact, tmp_path, python):
    prefix = tmp_path / "prefix"
    before = _users_venv(prefix, python)
    result = _install(artefact, prefix)
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert "was not made by install.sh" in result.stderr
    assert {p.relative_to(prefix).as_posix(): p.read_bytes() for p in prefix.rglob("*") if p.is_file()} == before


def test_a_venv_with_the_installers_marker_is_replaced_for_another_python(artefact, tmp_path):
    prefix = tmp_path / "prefix"
    _users_venv(prefix, "#!/bin/sh\nexit 1\n")
    (prefix / "venv" / ".cosyedge-appliance").touch()  # made by an earlier install.sh
    result = _install(artefact, prefix)  # goes on to install the wheelhouse, which this artefact has not
    assert "was not made by install.sh" not in result.stderr
    assert not (prefix / "venv" / "my-notes.txt").exists()
    assert (prefix / "venv" / "pyvenv.cfg").is_file() and (prefix / "venv" / ".cosyedge-appliance").is_file()
