"""Fixtures of the build-host tests: torch on one thread (the machine is shared), the tiny official releases."""
from __future__ import annotations

import os
from pathlib import Path

import onnxruntime as ort
import pytest
import torch

from cosyedge.quantize.cosyvoice2.release import Release
from cosyedge.quantize.cosyvoice3.release import Release3, open_release


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def release(golden_dir: Path) -> Release:
    """The tiny random-weight CosyVoice2 release in the official on-disk layout."""
    return Release.open(golden_dir / "cosyvoice2-tiny")


@pytest.fixture(scope="module")
def cv3_release(cv3_tiny_dir: Path) -> Release3:
    """The tiny random-weight Fun-CosyVoice3 release, opened once per module."""
    return open_release(cv3_tiny_dir)


@pytest.fixture()
def opened(monkeypatch) -> list[Path]:
    """Every graph file an ONNX Runtime session is created from while the test runs."""
    paths: list[Path] = []

    class Recorded(ort.InferenceSession):
        def __init__(self, path_or_bytes, *args, **kwargs):
            paths.append(Path(path_or_bytes).resolve() if isinstance(path_or_bytes, (str, os.PathLike))
                         else Path("<bytes>"))
            super().__init__(path_or_bytes, *args, **kwargs)

    monkeypatch.setattr(ort, "InferenceSession", Recorded)
    return paths
