"""TensorRT provider options per graph, the engine / timing cache layout, trtexec equivalents and engine builds.

Engines and timing caches are only valid for the GPU model, compute capability, TensorRT version (and, for ONNX
Runtime's engine cache, the onnxruntime version) they were built with, so the cache directory is keyed by all of
them: a JetPack upgrade or a moved SD card gets fresh engines instead of a crash or a silent slowdown.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from cosyedge.device.bundle import Bundle
from cosyedge.device.errors import ProviderError
from cosyedge.device.trt.device_profiles import DeviceProfile
from cosyedge.device.trt.profiles import GraphProfile

TRTEXEC = "/usr/src/tensorrt/bin/trtexec"  # where JetPack installs it
_CC_MAJOR, _CC_MINOR = 75, 76  # CUdevice_attribute: compute capability


@dataclass(frozen=True)
class GpuIdentity:
    """What an engine is bound to."""
    gpu_name: str
    compute_capability: str  # "8.7"
    tensorrt_version: str  # "10.3.0"
    onnxruntime_version: str

    def cache_key(self) -> str:
        """A directory name: `nvidia-jetson-orin-nano-sm87-trt10.3.0-ort1.23.2`."""
        gpu = re.sub(r"[^a-z0-9]+", "-", self.gpu_name.lower()).strip("-") or "gpu"
        sm = self.compute_capability.replace(".", "")
        return f"{gpu}-sm{sm}-trt{self.tensorrt_version}-ort{self.onnxruntime_version}"


def _tensorrt_version() -> str | None:
    """The TensorRT library's own version (libnvinfer), else the Python module's; None when neither loads."""
    for name in ("libnvinfer.so.10", "libnvinfer.so.8", "libnvinfer.so"):
        try:
            value = int(ctypes.CDLL(name).getInferLibVersion())
        except (OSError, AttributeError):
            continue
        if value >= 100000:  # TensorRT >= 10: major * 10000 + minor * 100 + patch
            return f"{value // 10000}.{value // 100 % 100}.{value % 100}"
        return f"{value // 1000}.{value // 100 % 10}.{value % 100}"
    try:
        import tensorrt  # noqa: PLC0415 - optional; JetPack's python3-libnvinfer
        return str(tensorrt.__version__)
    except ImportError:
        return None


def _cuda_device() -> tuple[str, str] | None:
    """Name and compute capability of CUDA device 0 through the driver API (works on Jetson and desktops)."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    count, major, minor = ctypes.c_int(0), ctypes.c_int(0), ctypes.c_int(0)
    name = ctypes.create_string_buffer(256)
    if cuda.cuInit(0) != 0 or cuda.cuDeviceGetCount(ctypes.byref(count)) != 0 or count.value < 1:
        return None
    if cuda.cuDeviceGetName(name, 256, 0) != 0 or cuda.cuDeviceGetAttribute(ctypes.byref(major), _CC_MAJOR, 0) != 0 \
            or cuda.cuDeviceGetAttribute(ctypes.byref(minor), _CC_MINOR, 0) != 0:
        return None
    return name.value.decode(errors="replace"), f"{major.value}.{minor.value}"


def detect_gpu() -> GpuIdentity:
    """This machine's GPU and TensorRT; ProviderError (one line, naming what is missing) where there is none."""
    import onnxruntime as ort
    if "TensorrtExecutionProvider" not in ort.get_available_providers():
        raise ProviderError("TensorRT is not available: this onnxruntime build has no TensorRT execution provider "
                            "(install onnxruntime-gpu with TensorRT: `make gpu-runtime`, docs/jetson.md)")
    version = _tensorrt_version()
    if version is None:
        raise ProviderError("TensorRT is not available: libnvinfer.so.10 not found (on Jetson: JetPack's TensorRT, "
                            "docs/jetson.md)")
    device = _cuda_device()
    if device is None:
        raise ProviderError("TensorRT is not available: no CUDA GPU is usable here (libcuda.so.1 or a device is "
                            "missing); engines are built on the target device (--dry-run shows the plan)")
    return GpuIdentity(device[0], device[1], version, ort.__version__)


def trt_home() -> Path:
    """`COSYEDGE_TRT_CACHE`, else `<state directory>/trt`: where `serve` and `build-engines` keep engines."""
    from cosyedge.device.paths import state_dir
    cache = os.environ.get("COSYEDGE_TRT_CACHE", "").strip()
    return Path(cache) if cache else state_dir() / "trt"


def cache_root(home: Path, gpu: GpuIdentity) -> Path:
    """`<trt home>/<gpu-sm-trt-ort key>`: the shared timing cache and one folder of engines per graph."""
    return Path(home) / gpu.cache_key()


def engine_dir(root: Path, profile: GraphProfile, device: DeviceProfile) -> Path:
    """One folder per graph file content and profile: a new bundle or other limits never reuse a stale engine."""
    spec = f"{profile.shapes('min')}|{profile.shapes('opt')}|{profile.shapes('max')}|{device.workspace_mb}"
    digest = hashlib.sha256(spec.encode()).hexdigest()[:8]
    return root / f"{profile.graph}-{profile.component.sha256[:12]}-{digest}"


def provider_options(profile: GraphProfile, root: Path, device: DeviceProfile, fp16_for_fp32: bool = True
                     ) -> dict[str, Any]:
    """The TensorRT execution provider's options for one graph.

    fp16 / int8 graphs carry their precisions (Casts, Q/DQ), so they build strongly typed: onnxruntime >= 1.22
    does that when neither trt_fp16_enable nor trt_int8_enable is set, and no calibration table is given (TensorRT
    refuses one for Q/DQ graphs). fp32 graphs may let TensorRT pick fp16 kernels (`fp16_for_fp32`).
    """
    options: dict[str, Any] = {
        "trt_fp16_enable": fp16_for_fp32 and profile.component.precision == "fp32",
        "trt_int8_enable": False,
        "trt_max_workspace_size": device.workspace_bytes,
        "trt_engine_cache_enable": True,
        "trt_engine_cache_path": str(engine_dir(root, profile, device)),
        "trt_timing_cache_enable": True,
        "trt_timing_cache_path": str(root),
        "trt_builder_optimization_level": 3,
    }
    if profile.inputs:
        options |= {"trt_profile_min_shapes": profile.shapes("min"), "trt_profile_opt_shapes": profile.shapes("opt"),
                    "trt_profile_max_shapes": profile.shapes("max")}
    return options


def trtexec_command(bundle: Bundle, profile: GraphProfile, root: Path, device: DeviceProfile) -> str:
    """A native-engine build equivalent to the provider options: explicit Q/DQ, strongly typed, same shapes."""
    out = engine_dir(root, profile, device)
    parts = [TRTEXEC, f"--onnx={bundle.path(profile.component.file)}", "--stronglyTyped"]
    if profile.inputs:
        parts += [f"--minShapes={profile.shapes('min')}", f"--optShapes={profile.shapes('opt')}",
                  f"--maxShapes={profile.shapes('max')}"]
    parts += [f"--memPoolSize=workspace:{device.workspace_mb}M", f"--timingCacheFile={root / 'timing.cache'}",
              f"--saveEngine={out / (profile.graph + '.plan')}", "--skipInference"]
    return " ".join(parts)


def build_engine(bundle: Bundle, profile: GraphProfile, root: Path, device: DeviceProfile,
                 fp16_for_fp32: bool = True) -> dict[str, Any]:
    """Build (or load from the cache) one graph's engine by creating its TensorRT session: with explicit profiles
    the provider builds the engine at session creation. Returns the seconds taken and the cache folder."""
    import onnxruntime as ort
    options = provider_options(profile, root, device, fp16_for_fp32)
    folder = Path(options["trt_engine_cache_path"])
    folder.mkdir(parents=True, exist_ok=True)
    had = {p.name for p in folder.iterdir()}
    began = time.perf_counter()
    try:
        session = ort.InferenceSession(str(bundle.path(profile.component.file)),
                                       providers=[("TensorrtExecutionProvider", options), "CPUExecutionProvider"])
    except Exception as exc:  # noqa: BLE001 - ORT's own untyped errors
        raise ProviderError(f"TensorRT could not build {profile.graph}: {type(exc).__name__}: {str(exc)[:200]}") from None
    seconds = time.perf_counter() - began
    if session.get_providers()[0] != "TensorrtExecutionProvider":
        raise ProviderError(f"{profile.graph}: onnxruntime fell back to {session.get_providers()[0]}")
    built = sorted(p.name for p in folder.iterdir() if p.name not in had)
    return {"graph": profile.graph, "seconds": round(seconds, 1), "cached": not built, "engine_dir": str(folder)}


def build_all(bundle: Bundle, profiles: dict[str, GraphProfile], root: Path, device: DeviceProfile,
              progress: Callable[[str], None]) -> list[dict[str, Any]]:
    """Every engine the service needs, one after the other (the timing cache fills as it goes)."""
    root.mkdir(parents=True, exist_ok=True)
    results = []
    for index, profile in enumerate(profiles.values(), 1):
        progress(f"[{index}/{len(profiles)}] {profile.graph} ({profile.component.precision}) ...")
        result = build_engine(bundle, profile, root, device)
        progress(f"[{index}/{len(profiles)}] {profile.graph}: {'cached' if result['cached'] else 'built'} in "
                 f"{result['seconds']} s -> {result['engine_dir']}")
        results.append(result)
    return results
