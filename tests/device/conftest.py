"""Shared fixtures of the device (runtime) tests: the golden data lives in shared/ next to the repository."""
from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def golden_dir() -> Path:
    path = Path(__file__).resolve().parents[2].parent / "shared" / "golden"
    if not path.is_dir():
        pytest.skip(f"golden data not found at {path}")
    return path


@pytest.fixture(scope="session")
def cv2_tiny_dir(golden_dir: Path) -> Path:
    return golden_dir / "cosyvoice2-tiny"
