"""Fixtures shared by every test package: the real default voice bundle, built once per run."""
from __future__ import annotations

import os
from pathlib import Path

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


_BLOCK_TORCH = '''
import importlib.abc, sys
class _NoTorch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "torchaudio"):
            raise ImportError("torch is forbidden in the device runtime")
        return None
sys.meta_path.insert(0, _NoTorch())
'''


@pytest.fixture()
def torch_blocked_env(tmp_path: Path) -> dict[str, str]:
    """Environment for a subprocess in which `import torch` fails (a sitecustomize meta-path blocker)."""
    site = tmp_path / "no_torch_site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(_BLOCK_TORCH)
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]),
            "COSYEDGE_THREADS": "1", "OMP_NUM_THREADS": "1"}
