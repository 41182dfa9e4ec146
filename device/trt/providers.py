"""Which execution providers really work here, and the TensorRT options the runtime's sessions get.

onnxruntime-gpu lists the CUDA and TensorRT providers even where their libraries (libcudart, libcublas, libcudnn,
libnvinfer) are missing; a session then silently runs on the CPU. So a provider counts as usable only if a tiny
session created with it keeps it, and the library its loader failed on is named.
"""
from __future__ import annotations

import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cosyedge.device.bundle import MANIFEST, Bundle
from cosyedge.device.trt.device_profiles import DeviceProfile, profile_from_env
from cosyedge.device.trt.engines import GpuIdentity, cache_root, detect_gpu, provider_options, trt_home
from cosyedge.device.trt.profiles import GraphProfile, graph_profiles

_LIBRARY = re.compile(r"(lib[\w.+-]+\.so(?:\.\d+)*)")


def _tiny_model() -> bytes:
    """A one-node float graph (Relu [1, 4]): the cheapest thing every provider can run."""
    from onnx import TensorProto, helper
    node = helper.make_node("Relu", ["x"], ["y"])
    graph = helper.make_graph([node], "probe", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8).SerializeToString()


def _with_captured_stderr(action):
    """Run `action()` with file descriptor 2 captured: ORT's provider loaders print the missing library there."""
    with tempfile.TemporaryFile(mode="w+b") as sink:
        saved = os.dup(2)
        os.dup2(sink.fileno(), 2)
        try:
            result, error = action(), None
        except Exception as exc:  # noqa: BLE001 - ORT's own untyped errors
            result, error = None, exc
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        sink.seek(0)
        return result, error, sink.read().decode(errors="replace")


@dataclass(frozen=True)
class ProviderStatus:
    name: str
    listed: bool
    usable: bool
    reason: str = ""
    missing_library: str | None = None


def probe_providers() -> list[ProviderStatus]:
    """TensorRT, CUDA and CPU: listed by this onnxruntime build? Does a tiny session really run on it?"""
    import onnxruntime as ort
    listed = set(ort.get_available_providers())
    model = _tiny_model()
    out = []
    for name in ("TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider"):
        if name not in listed:
            out.append(ProviderStatus(name, False, False, "not in this onnxruntime build"))
            continue
        options = ort.SessionOptions()
        options.log_severity_level = 3
        session, error, log = _with_captured_stderr(
            lambda: ort.InferenceSession(model, sess_options=options,
                                         providers=list(dict.fromkeys([name, "CPUExecutionProvider"]))))
        text = f"{error or ''}\n{log}"
        library = next(iter(_LIBRARY.findall(text)), None) if (error or "cannot open" in text or "load" in text) else None
        if session is not None and session.get_providers()[0] == name:
            out.append(ProviderStatus(name, True, True))
            continue
        reason = (f"its libraries do not load ({library} missing)" if library
                  else f"session creation failed ({type(error).__name__})" if error
                  else "listed, but sessions fall back to the CPU provider")
        out.append(ProviderStatus(name, True, False, reason, library))
    return out


@dataclass(frozen=True)
class TrtSessionOptions:
    """Called by `SessionConfig.resolved_providers(path)` for each graph the TensorRT provider is asked to run:
    the graph's profile and its cache folders, from the manifest beside the graph file."""
    device: DeviceProfile
    home: Path
    gpu: GpuIdentity
    fp16_for_fp32: bool = True

    @classmethod
    def from_env(cls, fp16_for_fp32: bool = True) -> "TrtSessionOptions | None":
        """None where TensorRT cannot run (the provider then falls back, as before)."""
        from cosyedge.device.errors import ProviderError
        try:
            gpu = detect_gpu()
        except ProviderError:
            return None
        return cls(profile_from_env(), trt_home(), gpu, fp16_for_fp32)

    def profile_for(self, path: Path) -> GraphProfile | None:
        """The profile of the graph stored at `path`, or None for a file outside a bundle / without a rule."""
        path = Path(path)
        if not (path.parent / MANIFEST).is_file():
            return None
        bundle = Bundle.load(path.parent, verify=False)
        for selection in (*bundle.targets, *bundle.manifest.precisions):
            for profile in graph_profiles(bundle, selection, self.device).values():
                if bundle.path(profile.component.file) == path.resolve():
                    return profile
        return None

    def __call__(self, path: Path) -> dict[str, Any]:
        profile = self.profile_for(path)
        if profile is None:
            return {}
        return provider_options(profile, cache_root(self.home, self.gpu), self.device, self.fp16_for_fp32)
