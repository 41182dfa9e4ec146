"""Stand-in for H1's device/options.py on this branch: the names the API imports, from where they live today."""
from __future__ import annotations

from cosyedge.device.engine import BatchLimits
from cosyedge.device.pipeline import SPEED_RANGE, Segment, SynthesisOptions

SEED_MAX = 2**32 - 1  # numpy's SeedSequence takes any int >= 0; the API promises 32 bits

__all__ = ["SEED_MAX", "SPEED_RANGE", "BatchLimits", "Segment", "SynthesisOptions"]
