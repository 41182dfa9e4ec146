"""Fused attention (quantize/cosyvoice2/attention_fusion.py): each rewritten estimator graph equals the graph it
replaces within fp32 round-off, on the tiny official releases of both families, in every mask regime the runtime
feeds (full attention with every frame real: the flash branch; padded rows and chunk-causal streaming: the biased
branch); the ORT profile shows which branch ran; every attention site is rewritten.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from cosyedge.device.bundle import Bundle
from cosyedge.quantize.cosyvoice2.attention_fusion import fuse_attention
from cosyedge.quantize.cosyvoice2.precision_transforms import int8_weights_dynamic

# fp32 round-off of a 64-frame estimator call: the flash kernel sums in another order (measured <= 1.8e-6 on
# outputs of magnitude ~3); the biased kernel measured exactly equal.
TOLERANCE = 2e-5
# (rows, frames, streaming flag, padded frames of the last row): which branch each call must take
CALLS = {"full, all frames real": (2, 64, 0, 0, "flash"), "padded rows": (3, 57, 0, 11, "biased"),
         "chunk-causal streaming": (2, 70, 1, 0, "biased"), "streaming, padded": (2, 70, 1, 9, "biased")}


def _session(model: Path | onnx.ModelProto, profile: Path | None = None) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    if profile is not None:
        options.enable_profiling = True
        options.profile_file_prefix = str(profile)
    source = model.SerializeToString() if isinstance(model, onnx.ModelProto) else str(model)
    return ort.InferenceSession(source, options, providers=["CPUExecutionProvider"])


def _feeds(rows: int, frames: int, streaming: int, padded: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(frames)
    mask = np.ones((rows, 1, frames), np.float32)
    if padded:
        mask[-1, :, frames - padded:] = 0
    return {"x": rng.standard_normal((rows, 80, frames), np.float32), "mask": mask,
            "mu": rng.standard_normal((rows, 80, frames), np.float32), "t": rng.random(rows).astype(np.float32),
            "spks": rng.standard_normal((rows, 80), np.float32),
            "cond": rng.standard_normal((rows, 80, frames), np.float32),
            "streaming": np.array([streaming], np.int64)}


@pytest.fixture(scope="module", params=["cosyvoice2", "cosyvoice3"])
def estimator(request, cv2_tiny_bundle: Path, cv3_tiny_bundle: Path) -> Path:
    bundle = Bundle.load(cv2_tiny_bundle if request.param == "cosyvoice2" else cv3_tiny_bundle)
    return bundle.path(bundle.component("flow_estimator", "fp32").file)


def _blocks(model: onnx.ModelProto) -> int:
    return sum(n.op_type == "Softmax" for n in model.graph.node)


def test_every_attention_site_is_fused(estimator):
    original = onnx.load(str(estimator))
    fused, sites = fuse_attention(estimator)
    assert len(sites) == _blocks(original) > 0
    assert _blocks(fused) == 0 and not any(n.op_type == "FusedMatMul" for n in fused.graph.node)
    assert {s.head_dim for s in sites} == {16} and all(s.scale == pytest.approx(0.25) for s in sites)
    branches = [n for n in fused.graph.node if n.op_type == "If"]
    assert len(branches) == len(sites) and not any(n.op_type == "MultiHeadAttention" for n in fused.graph.node)
    for node in branches:      # every site has a mask bias: a bias-free (flash) branch and a biased one
        inputs = {a.name: list(a.g.node[0].input) for a in node.attribute}
        assert len(inputs["then_branch"]) == 3 and inputs["else_branch"][5]


@pytest.mark.parametrize("call", list(CALLS))
def test_fused_estimator_equals_the_original(estimator, call, tmp_path):
    rows, frames, streaming, padded, branch = CALLS[call]
    feeds = _feeds(rows, frames, streaming, padded)
    want = _session(estimator).run(None, feeds)[0]
    fused, _ = fuse_attention(estimator)
    session = _session(fused, tmp_path / "profile")
    got = session.run(None, feeds)[0]
    ran = {e["name"] for e in json.loads(Path(session.end_profiling()).read_text()) if e.get("cat") == "Node"}
    assert np.abs(got - want).max() <= TOLERANCE
    assert any(f"/{branch}" in name for name in ran), sorted(ran)[:10]
    assert not any(f"/{'biased' if branch == 'flash' else 'flash'}" in name for name in ran)


def _rel_l2(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def test_fused_int8_estimator_adds_no_error_to_the_int8_graph(cv2_tiny_bundle, tmp_path):
    """The cpu target's estimator is dynamic int8, then fused. Dynamic int8 quantizes activations per call, so a
    round-off difference upstream can flip a rounding step (a 1e-7 relative nudge of `x` moves the tiny int8
    graph's output by up to 0.02): measured against fp32, the fused int8 graph must be as close as the int8 graph
    (relative L2 within 10 %), and bit-equal-level close where the biased kernel runs."""
    bundle = Bundle.load(cv2_tiny_bundle)
    fp32 = bundle.path(bundle.component("flow_estimator", "fp32").file)
    int8 = int8_weights_dynamic(fp32, tmp_path / "e.onnx")
    fused, sites = fuse_attention(int8)
    assert sites and any(n.op_type == "MatMulInteger" for n in fused.graph.node)
    for rows, frames, streaming, padded, branch in CALLS.values():
        feeds = _feeds(rows, frames, streaming, padded)
        want, plain, got = (_session(m).run(None, feeds)[0] for m in (fp32, int8, fused))
        assert _rel_l2(got, want) <= 1.1 * _rel_l2(plain, want) + 1e-6
        if branch == "biased":
            assert np.abs(got - plain).max() <= TOLERANCE


def test_a_graph_without_attention_comes_back_unchanged(cv2_tiny_bundle):
    bundle = Bundle.load(cv2_tiny_bundle)
    hift = onnx.load(str(bundle.path(bundle.component("hift_decoder", "fp32").file)))
    before = hift.SerializeToString()
    fused, sites = fuse_attention(hift)
    assert sites == [] and fused.SerializeToString() == before
