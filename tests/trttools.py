"""Shared by the TensorRT profile tests of both CosyVoice families: record every input shape the runtime feeds
its graphs (through `SessionConfig.session_factory`, run and IO binding alike) while it runs under a device
profile's limits, and check each one against the graph's min..max profile."""
from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any, Callable

import numpy as np
import onnxruntime as ort

from cosyedge.device.bundle import TARGETS, Bundle
from cosyedge.device.engine import Engine
from cosyedge.device.sessions import SessionConfig, create_session
from cosyedge.device.trt.device_profiles import device_profile
from cosyedge.device.trt.engines import GpuIdentity
from cosyedge.device.trt.profiles import graph_profiles

STAGES = ("llm", "flow_encoder", "flow_estimator", "hift_source", "hift_decoder")
Shapes = dict[str, set[tuple[str, tuple[int, ...]]]]


class _Recording:
    """An ORT session that records the shape of every input it is fed (run and IO binding alike)."""

    def __init__(self, session: ort.InferenceSession, shapes: list[tuple[str, tuple[int, ...]]]) -> None:
        self._session = session
        self._shapes = shapes

    def run(self, outputs, feeds, *args):
        self._shapes.extend((name, tuple(np.shape(value))) for name, value in feeds.items())
        return self._session.run(outputs, feeds, *args)

    def run_with_iobinding(self, binding, *args):
        self._shapes.extend((name, tuple(value.shape())) for name, value in binding.inputs_by_name.items())
        return self._session.run_with_iobinding(binding.inner, *args)

    def io_binding(self):
        return _Binding(self._session.io_binding())

    def __getattr__(self, name: str) -> Any:
        return getattr(self._session, name)


class _Binding:
    def __init__(self, inner) -> None:
        self.inner = inner
        self.inputs_by_name: dict[str, Any] = {}

    def bind_cpu_input(self, name, array):
        self.inputs_by_name[name] = ort.OrtValue.ortvalue_from_numpy(array)
        return self.inner.bind_cpu_input(name, array)

    def bind_ortvalue_input(self, name, value):
        self.inputs_by_name[name] = value
        return self.inner.bind_ortvalue_input(name, value)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def record_shapes(bundle_path: Path, selection: str, profile_name: str, cache_dir: Path,
                  run: Callable[[Engine], None]) -> Shapes:
    """graph name -> (input, shape) pairs fed while `run(engine)` runs, the engine loaded with `selection`'s graphs
    and limited as it is under TensorRT on that device profile (rows, frames)."""
    from cosyedge.device.trt.providers import TrtSessionOptions
    recorded: dict[str, list] = defaultdict(list)
    bundle = Bundle.load(bundle_path, verify=False)
    by_file = {bundle.path(c.file): c.name for c in bundle.manifest.components}
    by_file |= {bundle.path(c.file): graph for graph, c in bundle.selected(selection).items()}  # trt_llm -> llm

    def factory(path: Path, config: SessionConfig):
        return _Recording(create_session(path, config), recorded[by_file[Path(path).resolve()]])

    trt = TrtSessionOptions(device_profile(profile_name), cache_dir, GpuIdentity("Orin", "8.7", "10.3.0", "x"))
    sessions = SessionConfig(providers=("cpu",), intra_op_threads=1, session_factory=factory, trt=trt)
    choice = {"target": selection} if selection in TARGETS else {"precision": selection}
    run(Engine.load(bundle_path, warmup=False, sessions=sessions, **choice))
    return {graph: set(shapes) for graph, shapes in recorded.items()}


def assert_profiles_cover(bundle_path: Path, selection: str, profile_name: str, fed: Shapes) -> None:
    """Every fed shape inside its input's min..max (static inputs: exactly their shape), min <= opt <= max."""
    bundle = Bundle.load(bundle_path, verify=False)
    profiles = graph_profiles(bundle, selection, device_profile(profile_name))
    assert set(profiles) == set(STAGES)  # CAM++ and the speech tokenizer run on the CPU provider
    assert set(STAGES) <= set(fed), sorted(fed)
    specs = {graph: {s.name: s for s in bundle.selected(selection)[graph].inputs} for graph in STAGES}
    for graph in STAGES:
        for name, shape in fed[graph]:
            spec = specs[graph][name]
            if all(isinstance(d, int) for d in spec.shape):
                assert shape == tuple(spec.shape), (graph, name, shape)
                continue
            entry = profiles[graph].input(name)
            assert entry is not None and entry.covers(shape), (graph, name, shape, entry)
        for entry in profiles[graph].inputs:  # min <= opt <= max everywhere
            assert all(lo <= opt <= hi for lo, opt, hi in zip(entry.min, entry.opt, entry.max)), entry


def cv3_golden_runs(vectors: Path) -> Callable[[Engine], None]:
    """The tiny Fun-CosyVoice3 release's golden runs on its bundle voices: the 9 e2e cases rendered and streamed
    (greedy, deterministic), the scripted 180-token stream and instruct2_3 streamed from the LLM."""
    import json

    from cosyedge.device.options import SynthesisOptions
    cases = [entry["case"] for entry in json.loads((vectors / "meta.json").read_text(encoding="utf-8"))["e2e"].values()]

    def run(engine: Engine) -> None:
        for case in cases:
            options = {"voice": "zs_full", "mode": case["mode"], "sampling": "greedy", "deterministic": True,
                       **({"instruct_text": case["instruct_text"]} if case.get("instruct_text") else {})}
            engine.synthesize_waveform(case["tts_text"], **options)
            list(engine.stream(case["tts_text"], **options))
        with np.load(vectors / "streaming.npz") as golden:
            tokens = golden["scripted_tokens"].tolist()
        list(engine.pipeline.stream_tokens(tokens, SynthesisOptions(voice="zs_2s", mode="zero_shot", sampling="greedy",
                                                                    deterministic=True)))
    return run
