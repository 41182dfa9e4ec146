"""Fixtures shared by every test package: the real default voice bundle, built once per run."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"


@pytest.fixture(scope="session")
def golden_dir() -> Path:
    path = SHARED / "golden"
    if not path.is_dir():
        pytest.fail(f"golden data missing: expected {path} (shared/ beside the repository)")
    return path


@pytest.fixture(scope="session")
def cv3_tiny_dir(golden_dir: Path) -> Path:
    """The tiny random-weight Fun-CosyVoice3 release in the official on-disk layout (goldens in vectors/)."""
    return golden_dir / "cosyvoice3-tiny"


@pytest.fixture(scope="session")
def cv3_vectors(cv3_tiny_dir: Path) -> Path:
    """The official goldens of the tiny CosyVoice3 release (vectors/README.md)."""
    return cv3_tiny_dir / "vectors"


@pytest.fixture(scope="session")
def cosyedge_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A private state directory, so tests never touch the user's bundles."""
    home = tmp_path_factory.mktemp("cosyedge_home")
    os.environ["COSYEDGE_HOME"] = str(home)
    return home


@pytest.fixture(scope="session")
def default_bundle_path(cosyedge_home: Path) -> Path:
    """The embedded default voice, built the way a fresh box builds it on first use."""
    from cosyedge.device.vits.default_voice import default_bundle
    return default_bundle()


@pytest.fixture(scope="session")
def default_engine(default_bundle_path: Path):
    from cosyedge.device.engine import Engine
    from cosyedge.device.sessions import SessionConfig
    return Engine.load(default_bundle_path, precision="fp32", sessions=SessionConfig(providers=("cpu",), intra_op_threads=1))


def _tiny_bundle(family: str, golden_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny official-layout release (`<family>-tiny`) as an fp32 bundle, exported with torch on one thread."""
    import importlib

    import torch
    write_bundle = importlib.import_module(f"cosyedge.quantize.{family}.bundle").write_bundle
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return write_bundle(golden_dir / f"{family}-tiny", tmp_path_factory.mktemp(family) / "tiny")
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def cv2_tiny_bundle(golden_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny official-layout CosyVoice2 release as an fp32 bundle, built once per test run."""
    return _tiny_bundle("cosyvoice2", golden_dir, tmp_path_factory)


@pytest.fixture(scope="session")
def cv3_tiny_bundle(golden_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny official-layout Fun-CosyVoice3 release as an fp32 bundle, built once per test run."""
    return _tiny_bundle("cosyvoice3", golden_dir, tmp_path_factory)


_BLOCKER = '''
import importlib.abc, sys
class _Blocked(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {names!r}:
            raise ImportError({message!r})
        return None
sys.meta_path.insert(0, _Blocked())
'''


@pytest.fixture()
def blocked_imports(tmp_path: Path) -> Callable[[tuple[str, ...], str], dict[str, str]]:
    """`env(names, message)`: the environment of a subprocess in which importing any of the top-level packages
    `names` fails with `message` (a sitecustomize meta-path blocker), e.g. an optional extra not installed."""
    def env(names: tuple[str, ...], message: str) -> dict[str, str]:
        site = tmp_path / f"blocked_{'_'.join(names)}"
        site.mkdir()
        (site / "sitecustomize.py").write_text(_BLOCKER.format(names=tuple(names), message=message))
        return {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])}
    return env


@pytest.fixture()
def torch_blocked_env(blocked_imports: Callable[[tuple[str, ...], str], dict[str, str]]) -> dict[str, str]:
    """Environment for a subprocess in which `import torch` fails (a sitecustomize meta-path blocker)."""
    return {**blocked_imports(("torch", "torchaudio"), "torch is forbidden in the device runtime"),
            "COSYEDGE_THREADS": "1", "OMP_NUM_THREADS": "1"}
