"""`cosyedge appliance build`: one offline artefact for a box, made on a connected build host.

The artefact is a tar with one top folder `cosyedge-<version>-<platform>/`:

    install.sh          the box's installer (systemd/install.sh): venv from the wheelhouse, units, bundles
    appliance.json      version, platform, Python, minimum glibc, the bundles and which one is the default
    SHA256SUMS          every other file with its sha256 (`sha256sum -c SHA256SUMS`; install.sh checks it first)
    wheels/             the project's wheel, every runtime and service dependency for that platform and Python
                        (binary wheels only, resolved by pip against constraints.txt), and pip itself
    bundles/<name>/     the default voice (converted here, torch-free) and each --bundle, hash-verified
    systemd/            the units and the example environment file

Build host side (it runs pip download against the registry), but importing no torch: only the device's bundle
code and the default voice's converter.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from importlib.metadata import version as installed_version
from pathlib import Path

from cosyedge.device.bundle import MANIFEST, sha256_file
from cosyedge.device.bundle_store import copy_bundle
from cosyedge.device.bundle_writer import created_now
from cosyedge.device.errors import InputError

REPO = Path(__file__).resolve().parents[1]  # a checkout: the project's wheel is built from it
PLATFORMS = {"linux-x86_64": "x86_64", "linux-aarch64": "aarch64"}
GLIBC_MIN = (2, 28)  # the newest manylinux tag accepted: onnxruntime's aarch64 wheels need 2.28 (JetPack 5: 2.31)
UNITS = ("cosyedge.service", "cosyedge@.service", "cosyedge-wyoming.service", "cosyedge.env.example")
SOURCES = ("pyproject.toml", "README.md", "device", "api", "quantize")  # what the project's wheel is built from
DEFAULT_VOICE = "default-joe"


def platform_tags(platform: str) -> list[str]:
    """pip's --platform tags of a box: every manylinux glibc level up to GLIBC_MIN (no plain linux_* wheels)."""
    arch = PLATFORMS[platform]
    return ["manylinux2014_" + arch, *(f"manylinux_2_{minor}_{arch}" for minor in range(17, GLIBC_MIN[1] + 1))]


def _pip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pip", *args], capture_output=True, text=True,
                          env={**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1", "PIP_NO_INPUT": "1"})


def download_wheels(requirements: list[str], platform: str, python: str, dest: Path,
                    constraints: Path | None = None) -> None:
    """Binary wheels of `requirements` and all their dependencies for the box into `dest`.

    A dependency with no wheel for the platform and Python is one line naming it (InputError)."""
    python_tag = python.replace(".", "")
    args = ["download", "--only-binary=:all:", "--python-version", python, "--implementation", "cp",
            "--abi", f"cp{python_tag}", "--abi", "abi3", "--abi", "none", "-d", str(dest),
            *(arg for tag in platform_tags(platform) for arg in ("--platform", tag))]
    if constraints is not None:
        args += ["-c", str(constraints)]
    result = _pip(*args, *requirements)
    if result.returncode != 0:
        missing = re.findall(r"No matching distribution found for ([^\s;]+)", result.stderr)
        if missing:
            raise InputError(f"{missing[0]} has no wheel for {platform} and Python {python} (pip download "
                             "--only-binary); pin a version that has one in constraints.txt, or drop it")
        tail = [line for line in result.stderr.splitlines() if line.startswith("ERROR")] or ["pip download failed"]
        raise InputError(f"resolving the wheelhouse for {platform}: {tail[-1]}")


def project_wheel(dest: Path) -> Path:
    """The project's own wheel, built from a copy of the checkout's sources (nothing is written into it)."""
    if not (REPO / "pyproject.toml").is_file():
        raise InputError("cosyedge appliance build runs from a checkout of cosyedge (pyproject.toml not found)")
    with tempfile.TemporaryDirectory(prefix="cosyedge-src-") as tmp:
        for name in SOURCES:
            source = REPO / name
            if source.is_dir():
                shutil.copytree(source, Path(tmp) / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
            else:
                shutil.copy2(source, Path(tmp) / name)
        result = _pip("wheel", "--no-deps", "-w", str(dest), tmp)  # its own build env: a 3.12 venv has no setuptools
    wheels = sorted(dest.glob("cosyedge-*.whl"))
    if result.returncode != 0 or not wheels:
        raise InputError(f"building the cosyedge wheel failed: {(result.stderr.strip().splitlines() or ['?'])[-1]}")
    return wheels[-1]


def default_voice(dest: Path) -> None:
    """The default voice's bundle, converted once on this host (torch-free), so the box converts nothing."""
    from cosyedge.device.vits.default_voice import default_bundle
    copy_bundle(default_bundle(), dest)


def write_manifests(top: Path, meta: dict) -> None:
    """appliance.json (what the artefact is), then SHA256SUMS over every file, appliance.json included."""
    (top / "appliance.json").write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
    files = sorted(p for p in top.rglob("*") if p.is_file() and p.name != "SHA256SUMS")
    lines = [f"{sha256_file(p)}  {p.relative_to(top).as_posix()}" for p in files]
    (top / "SHA256SUMS").write_text("\n".join(lines) + "\n", encoding="utf-8")


def build(platform: str, out: Path, bundles: list[Path] = (), python: str | None = None,
          force: bool = False) -> dict:
    """Write the artefact to `out` (a new file; an existing one only with `force`). Returns appliance.json."""
    if platform not in PLATFORMS:
        raise InputError(f"unknown --platform {platform!r}; choose {', '.join(PLATFORMS)}")
    python = python or f"{sys.version_info.major}.{sys.version_info.minor}"
    if not re.fullmatch(r"3\.\d{1,2}", python):
        raise InputError(f"--python {python!r}: give a version like 3.11")
    out = Path(out)
    if out.exists() and (out.is_dir() or not force):
        raise InputError(f"--out {out.name!r} exists; choose a new name (or --force to replace that file)")
    if not out.parent.is_dir():
        raise InputError(f"--out directory {out.parent.name!r} does not exist")
    version = installed_version("cosyedge")
    name = f"cosyedge-{version}-{platform}"
    with tempfile.TemporaryDirectory(prefix=".cosyedge-appliance-", dir=out.parent) as tmp:
        top = Path(tmp) / name
        wheels = top / "wheels"
        wheels.mkdir(parents=True)
        wheel = project_wheel(wheels)
        download_wheels([str(wheel), "pip"], platform, python, wheels, REPO / "constraints.txt")
        chosen = {DEFAULT_VOICE: None, **{Path(b).resolve().name: Path(b) for b in bundles}}
        if len(chosen) != len(bundles) + 1:
            raise InputError("two --bundle directories have the same name (or one is named default-joe)")
        names = {}
        for folder, source in chosen.items():
            dest = top / "bundles" / folder
            if source is None:
                default_voice(dest)
            else:
                copy_bundle(source, dest)
            names[folder] = json.loads((dest / MANIFEST).read_text(encoding="utf-8"))["name"]
        (top / "systemd").mkdir()
        for unit in UNITS:
            shutil.copy2(REPO / "systemd" / unit, top / "systemd" / unit)
        shutil.copy2(REPO / "systemd" / "install.sh", top / "install.sh")
        (top / "install.sh").chmod(0o755)
        meta = {"name": "cosyedge", "version": version, "platform": platform, "python": python,
                "glibc_min": ".".join(map(str, GLIBC_MIN)), "created": created_now(),
                "wheel": wheel.name, "bundles": names,
                "default_bundle": next(iter(chosen)) if not bundles else Path(bundles[0]).resolve().name}
        write_manifests(top, meta)
        partial = out.with_name(f".{out.name}.partial")
        with tarfile.open(partial, "w") as tar:
            tar.add(top, arcname=name)
        partial.replace(out)
    return meta


def register(sub: argparse._SubParsersAction) -> None:
    """Entry point `cosyedge.commands: appliance`."""
    p = sub.add_parser("appliance", help="build the offline artefact a box installs from (build host)")
    actions = p.add_subparsers(dest="appliance_command", required=True)
    b = actions.add_parser("build", help="wheelhouse + default voice + bundles + units + install.sh in one tar")
    b.add_argument("--platform", required=True, choices=tuple(PLATFORMS))
    b.add_argument("--bundle", action="append", default=[], metavar="DIR",
                   help="a bundle to ship (repeatable; the first becomes the box's current bundle, else the "
                        "default voice)")
    b.add_argument("--python", help="the box's Python, e.g. 3.12 (default: this one's)")
    b.add_argument("--out", help="the tar to write (default: cosyedge-<version>-<platform>.tar)")
    b.add_argument("--force", action="store_true", help="replace an existing --out file")
    b.set_defaults(func=cmd_build)


def cmd_build(args: argparse.Namespace) -> int:
    out = Path(args.out or f"cosyedge-{installed_version('cosyedge')}-{args.platform}.tar")
    meta = build(args.platform, out, [Path(b) for b in args.bundle], python=args.python, force=args.force)
    print(json.dumps({"artefact": str(out), "bytes": out.stat().st_size, **meta}, indent=2))
    return 0
