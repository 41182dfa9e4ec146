"""Fixtures of the device (runtime) tests; `golden_dir` comes from tests/conftest.py."""
from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def cv2_tiny_dir(golden_dir: Path) -> Path:
    """The tiny random-weight CosyVoice2 release and its official golden vectors."""
    return golden_dir / "cosyvoice2-tiny"
