"""One import namespace, proved on real installs: `pip install --no-deps` the project, non-editable and editable, into
fresh venvs, then import every module of cosyedge.device, cosyedge.api and cosyedge.quantize with the fresh venv's
own interpreter from a directory outside the repository, and show that `device`, `api` and `quantize` are not
importable names. The dependencies come from this test run's environment through a .pth file (offline; a .pth in a
site directory adds a path, and the .pth files of that path are not processed, so its editable finder stays out).
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
LAYERS = {"device": "cosyedge.device", "api": "cosyedge.api", "quantize": "cosyedge.quantize"}

IMPORT_ALL = r'''
import importlib, json, pkgutil, sys
names = []
for top in ("cosyedge.device", "cosyedge.api", "cosyedge.quantize"):
    names.append(top)
    names += [info.name for info in pkgutil.walk_packages(importlib.import_module(top).__path__, top + ".")]
for name in names:
    importlib.import_module(name)
leaks = {}
for bare in ("device", "api", "quantize"):
    try:
        leaks[bare] = getattr(importlib.import_module(bare), "__file__", None) or "namespace"
    except ModuleNotFoundError:
        pass
from importlib.metadata import entry_points
print(json.dumps({"files": {n: sys.modules[n].__file__ for n in names}, "leaks": leaks,
                  "commands": sorted(e.name for e in entry_points(group="cosyedge.commands"))}))
'''


def _expected_modules() -> set[str]:
    found = set()
    for folder, package in LAYERS.items():
        for path in (REPO / folder).rglob("*.py"):
            parts = [package, *path.relative_to(REPO / folder).with_suffix("").parts]
            found.add(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return found


def _source_copy(dest: Path) -> Path:
    """The tracked and new files of the working tree, so the build never writes into the repository."""
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=REPO, capture_output=True, text=True,
                            check=True).stdout.split()
    for rel in listed:
        if (REPO / rel).is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / rel, dest / rel)
    return dest


def _fresh_venv(root: Path) -> Path:
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True, timeout=120)
    python = root / "bin" / "python"
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    (Path(site) / "cosyedge_test_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return python


@pytest.mark.slow
@pytest.mark.parametrize("editable", [False, True], ids=["wheel", "editable"])
def test_installed_project_imports_only_under_cosyedge(tmp_path, editable):
    source = _source_copy(tmp_path / "src")
    python = _fresh_venv(tmp_path / "venv")
    install = [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index",
               "--no-build-isolation", "-q", *(["-e"] if editable else []), str(source)]
    result = subprocess.run(install, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]

    outside = tmp_path / "elsewhere"
    outside.mkdir()
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "COSYEDGE_HOME": str(tmp_path / "home")}
    run = subprocess.run([str(python), "-c", IMPORT_ALL], capture_output=True, text=True, timeout=600, cwd=outside,
                         env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(run.stdout.strip().splitlines()[-1])

    assert set(report["files"]) == _expected_modules()
    home = source if editable else tmp_path / "venv"
    strays = {name: file for name, file in report["files"].items() if not Path(file).is_relative_to(home)}
    assert not strays, f"modules not loaded from the {'source tree' if editable else 'venv'}: {strays}"
    assert report["leaks"] == {}, f"top-level names that must not be importable: {report['leaks']}"
    assert report["commands"] == ["appliance", "bench", "bench-api", "bundle", "cache", "quantize", "serve", "trt",
                                  "wyoming"]

    cli = subprocess.run([str(python.parent / "cosyedge"), "--help"], capture_output=True, text=True, timeout=300,
                         cwd=outside, env=env)
    assert cli.returncode == 0 and all(c in cli.stdout for c in ("synth", "bench", "quantize", "serve")), cli.stderr[-2000:]



def test_constraints_pin_versions_the_project_accepts_and_gunicorn_one_major_version():
    """`constraints.txt` pins what a box installs; each pin must satisfy pyproject.toml's own requirement (else pip
    refuses the pair). gunicorn is bounded to the major version `api/front.py` was written against: the front
    worker subclasses gthread's worker and reads its connection and parser internals, which a major release may
    change under it."""
    import importlib.metadata
    import tomllib

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    requirements = [Requirement(r) for r in (*project["dependencies"], *sum(project["optional-dependencies"].values(),
                                                                               []))]
    pins = {}
    for line in (REPO / "constraints.txt").read_text().splitlines():
        if line.split("#")[0].strip():
            pin = Requirement(line.split("#")[0].strip())
            pins[canonicalize_name(pin.name)] = next(iter(pin.specifier)).version
    refused = [f"{r} (pinned {pins[canonicalize_name(r.name)]})" for r in requirements
               if canonicalize_name(r.name) in pins and not r.specifier.contains(pins[canonicalize_name(r.name)])]
    assert not refused
    gunicorn = next(r.specifier for r in requirements if r.name == "gunicorn")
    assert gunicorn.contains(pins["gunicorn"]) and gunicorn.contains(importlib.metadata.version("gunicorn"))
    assert not gunicorn.contains("28.0") and not gunicorn.contains("26.9")
