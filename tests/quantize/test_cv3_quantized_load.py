"""The CosyVoice3 `cpu` target's quantized stages are in the bundle and run in the device runtime (issue 24 item 4).

On the golden tiny release (chaotic random weights) the dynamic int8 DiT moves the end-to-end MCD past its gate
(2.10 dB > 2), so that bundle's cpu flow falls back to fp32 (test_cv3_precision.py) and never makes the runtime
load it. Here the release is random_init's `cosyvoice3-tiny` preset: the golden tiny sizes but 2 query / 1 key-value
LLM heads of 16 channels (the smallest head GroupQueryAttention runs) and the modules' default initialisation, on
which the cpu LLM and flow pass the unchanged gates (no --allow-fallback for them; the v3 HiFT stays fp32 there,
as at full size). For that bundle:

* the cpu LLM is weight-only 8-bit with the shared key/value cache (GroupQueryAttention), the DiT is dynamic int8
  (integer kernels, activations quantized per call, no QuantizeLinear) with its attention fused, and both gates
  passed at int8;
* the runtime opens exactly those files and never their fp32 originals, decodes through the shared cache, and its
  flow rows of different requests never share a call (the dynamic DiT rounds a call's rows together);
* it speaks the text; 130 streamed speech codes (past the first two hops) give fp32's chunks in number and length,
  finite, not bit-equal to fp32 (quantized numerics ran) and within the HiFT gate's SNR of it.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest

from cosyedge.device.bundle import Bundle
from cosyedge.device.quality import snr_db
from cosyedge.quantize.cosyvoice2.gates import THRESHOLDS
from cosyedge.quantize.cosyvoice3.bundle import write_bundle
from cosyedge.quantize.cosyvoice3.random_init import write_random_release

pytestmark = pytest.mark.slow

TEXT = "收到好友从远方寄来的生日礼物，今天天气很好，我们去公园散步吧。"
VOICE = "zs_full"


@pytest.fixture(scope="module")
def bundle(golden_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Bundle:
    root = tmp_path_factory.mktemp("cv3gated")
    release = write_random_release("cosyvoice3-tiny", golden_dir / "cosyvoice3-tiny", root / "release", seed=0)
    # fallback allowed for the v3 HiFT only (its int8 misses the gate, as at full size); checked below
    return Bundle.load(write_bundle(release, root / "bundle", targets=("cpu",), allow_fallback=True))


def _ops(bundle: Bundle, graph: str) -> set[str]:
    ref = bundle.manifest.config["targets"]["cpu"]["graphs"][graph]
    model = onnx.load(str(bundle.path(bundle.component(ref["component"], ref["precision"]).file)))
    found = {n.op_type for n in model.graph.node}
    for node in model.graph.node:       # the fused attention sits in If branches
        found |= {n.op_type for a in node.attribute if a.type == onnx.AttributeProto.GRAPH for n in a.g.node}
    return found


def _load(bundle: Bundle, selection_name: str):
    from cosyedge.device.engine import Engine, selection
    from cosyedge.device.sessions import SessionConfig
    return Engine.load(bundle.root, sessions=SessionConfig(providers=("cpu",), intra_op_threads=1), warmup=False,
                       **selection(selection_name))


def test_cpu_llm_and_dit_are_quantized_and_passed_their_gates(bundle):
    cpu, quality = bundle.manifest.config["targets"]["cpu"], bundle.manifest.quality["cpu"]
    assert cpu["stages"] == {"llm": "int8", "flow": "int8", "hift": "fp32"}
    for stage in ("llm", "flow"):
        report = quality[stage]
        assert report["precision"] == "int8" and report["fallback_from"] is None, stage
        assert [a["passed"] for a in report["attempts"]] == [True] and \
            report["attempts"][0]["thresholds"] == THRESHOLDS[stage], stage
    assert quality["e2e"]["attempts"][-1]["passed"]
    assert cpu["graphs"]["flow_encoder"]["precision"] == "fp32"            # CV3_RULES.cpu_fp32
    assert {"MatMulIntegerToFloat", "GroupQueryAttention"} <= _ops(bundle, "llm")
    dit = _ops(bundle, "flow_estimator")
    assert {"MatMulInteger", "DynamicQuantizeLinear", "MultiHeadAttention"} <= dit and "QuantizeLinear" not in dit


def test_runtime_runs_the_quantized_llm_and_dit(bundle, opened):
    fp32 = _load(bundle, "fp32")
    request = fp32.options(voice=VOICE, sampling="greedy", deterministic=True)
    # speech codes, not the tiny LLM's (its near-uniform logits meet one of v3's 200 stop ids after ~30 tokens):
    # long enough for the stream's later hops
    tokens = np.random.default_rng(0).integers(0, 6561, 130).tolist()
    want = list(fp32.pipeline.stream_tokens(tokens, request))
    opened.clear()

    engine = _load(bundle, "cpu")
    graphs = bundle.manifest.config["targets"]["cpu"]["graphs"]
    for graph in ("llm", "flow_estimator"):
        assert bundle.path(bundle.component(graph, "int8").file).resolve() in opened, graph
        assert bundle.path(bundle.component(graph, "fp32").file).resolve() not in opened, graph
    assert engine.pipeline.describe()["precision"] == {g: ref["precision"] for g, ref in graphs.items()
                                                       if g != "llm_align"}
    assert engine.pipeline._lm._calls.shared                               # the shared key/value cache decodes
    assert engine.pipeline._flow_rows == 1                                 # dynamic DiT: rows never share a call
    request = engine.options(voice=VOICE, sampling="greedy", deterministic=True)
    assert all(engine.pipeline.speech_tokens(s, request) for s in engine.segments(TEXT))

    whole = engine.synthesize_waveform(TEXT, voice=VOICE, sampling="greedy", deterministic=True)
    assert whole.size and np.isfinite(whole).all() and np.abs(whole).max() <= 1.0
    chunks = list(engine.pipeline.stream_tokens(tokens, request))
    assert len(chunks) >= 3 and [c.shape for c in chunks] == [c.shape for c in want]   # fp32's chunking
    got, reference = np.concatenate(chunks), np.concatenate(want)
    assert np.isfinite(got).all() and not np.array_equal(got, reference)           # quantized numerics ran
    assert THRESHOLDS["hift"]["snr_db_min"] <= snr_db(reference, got) < 100, snr_db(reference, got)
