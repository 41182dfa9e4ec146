"""Device profiles: how large the shapes of one graph call may be on a given GPU, and how long engine builds take.

Why per device: TensorRT sizes an engine's activation memory for the profile's maximum shapes, so the flow frame
limit and the batch rows decide whether CosyVoice fits an 8 GB Orin Nano (the official 6800-frame flow engine alone
takes ~4.5 GB). Values can be overridden per service (environment or service config), never silently exceeded:
the runtime caps its batch rows and refuses utterances longer than `max_frames`.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, replace

from cosyedge.device.errors import InputError

PROFILE_ENV = "COSYEDGE_DEVICE_PROFILE"
DEFAULT_PROFILE = "desktop"
SERVE_LOAD_SECONDS = 300  # loading a bundle and warming it up, after the engines exist (the unit's old timeout)


@dataclass(frozen=True)
class DeviceProfile:
    """Limits for one class of GPU.

    max_frames: mel frames of one flow call (prompt + speech; 50 frames per second of audio).
    max_rows: rows of one LLM prefill / decode step.
    flow_rows: rows of one flow batch (the estimator runs 2x that: CFG); its attention grows with frames squared.
    workspace_mb: TensorRT builder workspace (`trt_max_workspace_size`, trtexec `--memPoolSize=workspace:`).
    gpu_budget_gb: memory the models may take on this device (shared CPU/GPU memory on Jetson, after the OS).
    build_minutes: documented upper estimate for building every engine of a full-size CosyVoice2 bundle once
    (first start); not measured on hardware yet (docs/jetson.md asks for reports).
    """
    name: str
    description: str
    max_frames: int
    max_rows: int
    flow_rows: int
    workspace_mb: int
    gpu_budget_gb: float
    build_minutes: int

    def __post_init__(self) -> None:
        if self.max_frames < 16 or self.max_rows < 1 or self.flow_rows < 1 or self.workspace_mb < 64:
            raise InputError(f"device profile {self.name!r}: max_frames >= 16, max_rows and flow_rows >= 1 and "
                             "workspace_mb >= 64 are required")

    @property
    def workspace_bytes(self) -> int:
        return self.workspace_mb << 20


PROFILES: dict[str, DeviceProfile] = {p.name: p for p in (
    DeviceProfile("orin-nano-8gb", "Jetson Orin Nano 8GB (Super or not): 8 GB shared, ~6 GB for models headless",
                  max_frames=1500, max_rows=2, flow_rows=1, workspace_mb=1024, gpu_budget_gb=6.0, build_minutes=40),
    DeviceProfile("orin-nx-16gb", "Jetson Orin NX 16GB: 16 GB shared", max_frames=3000, max_rows=4, flow_rows=1,
                  workspace_mb=2048, gpu_budget_gb=13.0, build_minutes=30),
    DeviceProfile("agx-orin-64gb", "Jetson AGX Orin 64GB: 64 GB shared", max_frames=6800, max_rows=16, flow_rows=2,
                  workspace_mb=4096, gpu_budget_gb=56.0, build_minutes=15),
    DeviceProfile("desktop", "discrete desktop / server GPU with >= 16 GB", max_frames=6800, max_rows=8, flow_rows=1,
                  workspace_mb=4096, gpu_budget_gb=16.0, build_minutes=8),
)}

# Environment overrides (the service config's keys without the COSYEDGE_ prefix, lower case, in TOML).
_OVERRIDES = {"COSYEDGE_MAX_FRAMES": "max_frames", "COSYEDGE_MAX_ROWS": "max_rows",
              "COSYEDGE_FLOW_ROWS": "flow_rows",
              "COSYEDGE_TRT_WORKSPACE_MB": "workspace_mb"}


def device_profile(name: str | None = None, **overrides: int) -> DeviceProfile:
    """A named profile (default: `desktop`) with optional field overrides; unknown names are an InputError."""
    name = name or DEFAULT_PROFILE
    base = PROFILES.get(name)
    if base is None:
        raise InputError(f"unknown device profile {name[:40]!r}; choose from {', '.join(PROFILES)}")
    given = {k: int(v) for k, v in overrides.items() if v is not None}
    return replace(base, **given) if given else base


def profile_from_env(environ: dict[str, str] | None = None) -> DeviceProfile:
    """`COSYEDGE_DEVICE_PROFILE`, then `COSYEDGE_MAX_FRAMES`, `COSYEDGE_MAX_ROWS`, `COSYEDGE_TRT_WORKSPACE_MB`."""
    env = os.environ if environ is None else environ
    overrides = {}
    for var, field in _OVERRIDES.items():
        raw = env.get(var, "").strip()
        if raw:
            try:
                overrides[field] = int(raw)
            except ValueError:
                raise InputError(f"{var} must be an integer, not {raw[:20]!r}") from None
    return device_profile(env.get(PROFILE_ENV, "").strip() or None, **overrides)


def max_build_minutes() -> int:
    """The longest documented first-start engine build over all profiles (the unit's start timeout covers it)."""
    return max(p.build_minutes for p in PROFILES.values())
