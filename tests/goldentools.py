"""Helpers of the golden-parity tests (importable from any test package: tests/ is on sys.path through its
conftest.py). numpy only, so that the torch-free device tests use them too."""
from __future__ import annotations

import numpy as np


class Measured(dict[str, float]):
    """The largest absolute error seen per name in one test module (its report test prints them)."""

    def err(self, name: str, got, want) -> float:
        """max |got - want| in float64 (shapes must agree; a torch tensor is detached first), recorded under name."""
        if hasattr(got, "detach"):
            got = got.detach().numpy()
        got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
        assert got.shape == want.shape, (name, got.shape, want.shape)
        err = float(np.abs(got - want).max()) if got.size else 0.0
        self[name] = max(err, self.get(name, 0.0))
        return err
