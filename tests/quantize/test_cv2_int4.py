"""The optional `cpu-int4` target (issue 12, item 6b): the cpu target with 4-bit MatMulNBits LLM weights under the
int4 LLM gate (gates.PRECISION_THRESHOLDS), flow and HiFT shared with `cpu`.

The release is `random_init`'s `cosyvoice2-tiny` preset (golden tiny sizes, default PyTorch initialisation), on
which every stage of `cpu` passes its gate without fallback (test_cv2_quantized_load.py) and 4-bit LLM weights pass
the int4 gate (KL ~0.005 nats, decisive top-1 0.957 against the gate's 0.95). The golden tiny release itself is too
sensitive for 4 bits (KL ~0.43): there cpu-int4 would fall back to the int8 LLM. The bundle is built through
`cosyedge quantize`.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from cosyedge.device.bundle import Bundle
from cosyedge.device.errors import ReleaseError
from cosyedge.quantize.cosyvoice2 import precision, precision_targets
from cosyedge.quantize.cosyvoice2.gates import PRECISION_THRESHOLDS, THRESHOLDS, GateConfig, Gates
from cosyedge.quantize.cosyvoice2.precision_targets import STAGE_GRAPHS
from cosyedge.quantize.cosyvoice2.precision_transforms import NBITS_BLOCKS
from cosyedge.quantize.cosyvoice2.random_init import write_random_release

pytestmark = pytest.mark.slow

TEXT = "收到好友从远方寄来的生日礼物。"
VOICE = "tiny_spk_zh"


@pytest.fixture(scope="module")
def bundle(golden_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Bundle:
    root = tmp_path_factory.mktemp("int4")
    release = write_random_release("cosyvoice2-tiny", golden_dir / "cosyvoice2-tiny", root / "release", seed=0)
    out = root / "bundle"
    # no --allow-fallback: a missed gate of either target fails the build
    result = subprocess.run([sys.executable, "-m", "cosyedge.device.cli", "quantize", "--model-dir", str(release),
                             "--out", str(out), "--target", "cpu,cpu-int4"], capture_output=True, text=True,
                            timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    return Bundle.load(out)


def _int4_graphs(bundle: Bundle) -> dict[str, Path]:
    return {g: bundle.path(bundle.component(g, "int4").file) for g in STAGE_GRAPHS["llm"]}


def _attr(node: onnx.NodeProto, name: str) -> int:
    return next(onnx.helper.get_attribute_value(a) for a in node.attribute if a.name == name)


def test_llm_graphs_hold_packed_4bit_matmulnbits(bundle):
    for graph, path in _int4_graphs(bundle).items():
        model = onnx.load(str(path))
        inits = {t.name: t for t in model.graph.initializer}
        nbits = [n for n in model.graph.node if n.op_type == "MatMulNBits"]
        assert nbits and not any(n.op_type == "MatMul" and "proj" in n.name for n in model.graph.node), graph
        for node in nbits:
            block = NBITS_BLOCKS[4]
            assert (_attr(node, "bits"), _attr(node, "block_size"), _attr(node, "accuracy_level")) == (4, block, 4)
            k, n = _attr(node, "K"), _attr(node, "N")
            q = numpy_helper.to_array(inits[node.input[1]])
            # two 4-bit values per byte: N x blocks x block / 2 bytes, an eighth of the fp32 weight (K padded)
            assert q.dtype == np.uint8 and q.shape == (n, -(-k // block), block // 2), node.name
            assert numpy_helper.to_array(inits[node.input[2]]).size == n * -(-k // block)
        int8 = onnx.load(str(bundle.path(bundle.component(graph, "int8").file)))
        int8_q = {n.name.removesuffix("/rows/MatMulIntegerToFloat") for n in int8.graph.node
                  if n.op_type == "MatMulIntegerToFloat" and not n.name.startswith("/llm_decoder/")}
        head = [n.op_type for n in model.graph.node if n.name.startswith("/llm_decoder/")]
        assert "MatMulIntegerToFloat" in head and not {"Gemm", "MatMul"} & set(head), graph  # the head in row int8
        # the same projections as the int8 graph, half a byte per weight (K padded to whole blocks)
        int4_q = {n.name.removesuffix("_nbits4"): numpy_helper.to_array(inits[n.input[1]]).nbytes for n in nbits}
        assert int4_q.keys() == int8_q, graph
        block = NBITS_BLOCKS[4]
        assert all(2 * int4_q[n.name.removesuffix("_nbits4")] == -(-_attr(n, "K") // block) * block * _attr(n, "N")
                   for n in nbits), graph
        # both cpu LLM graphs take the shared key/value cache (head size 16: GroupQueryAttention runs it)
        for quantized in (model, int8):
            assert [n.op_type for n in quantized.graph.node].count("GroupQueryAttention") == 2, graph


def test_manifest_has_the_int4_gate_report_and_shares_flow_and_hift_with_cpu(bundle):
    targets, quality = bundle.manifest.config["targets"], bundle.manifest.quality
    int4 = targets["cpu-int4"]
    assert int4["stages"]["llm"] == "int4" and "llm_int8" not in int4
    assert {g: int4["graphs"][g] for g in STAGE_GRAPHS["llm"]} == {
        g: {"component": g, "precision": "int4"} for g in STAGE_GRAPHS["llm"]}
    report = quality["cpu-int4"]["llm"]
    assert report["precision"] == "int4" and report["fallback_from"] is None
    (attempt,) = report["attempts"]
    assert attempt["precision"] == "int4" and attempt["passed"]
    assert attempt["thresholds"] == PRECISION_THRESHOLDS["int4"]["llm"] != THRESHOLDS["llm"]
    assert quality["cpu"]["llm"]["attempts"][0]["thresholds"] == THRESHOLDS["llm"]   # cpu keeps the int8 gate
    for graph in (*STAGE_GRAPHS["flow"], *STAGE_GRAPHS["hift"]):   # the same components, hence the same files
        assert int4["graphs"][graph] == targets["cpu"]["graphs"][graph], graph
    for stage in ("flow", "hift", "e2e"):
        assert quality["cpu-int4"][stage] == quality["cpu"][stage], stage
    files = [c.file for c in bundle.manifest.components]
    assert len(files) == len(set(files))


def test_engine_loads_the_int4_graphs_and_synthesizes(bundle, opened):
    from cosyedge.device.engine import Engine
    from cosyedge.device.sessions import SessionConfig
    engine = Engine.load(bundle.root, target="cpu-int4", warmup=False,
                         sessions=SessionConfig(providers=("cpu",), intra_op_threads=1))
    # the sessions were made from the int4 LLM file, never the int8 or fp32 one (a label alone proves nothing)
    llm_files = {p: bundle.path(bundle.component("llm", p).file).resolve() for p in ("int4", "int8", "fp32")}
    assert llm_files["int4"] in opened and not {llm_files["int8"], llm_files["fp32"]} & set(opened)
    assert any(n.op_type == "GroupQueryAttention" for n in onnx.load(str(llm_files["int4"])).graph.node)
    described = engine.pipeline.describe()["precision"]
    assert {g: described[g] for g in STAGE_GRAPHS["llm"]} == {g: "int4" for g in STAGE_GRAPHS["llm"]}
    assert described["flow_estimator"] == "int8"
    wave = engine.synthesize_waveform(TEXT, voice=VOICE, sampling="greedy", deterministic=True)
    samples_per_token = int(bundle.manifest.config["token_mel_ratio"]) * int(bundle.manifest.config["hift_upsample"])
    assert wave.size >= 10 * samples_per_token and wave.size % samples_per_token == 0
    assert np.isfinite(wave).all() and 0 < np.abs(wave).max() <= 1.0


def _swap_nibbles(src: Path, dst: Path) -> Path:
    """The defect a packing bug makes: every 4-bit pair stored in the wrong nibble order."""
    model = onnx.load(str(src))
    for t in model.graph.initializer:
        if t.name.endswith("_nbits4_q"):
            q = numpy_helper.to_array(t)
            t.CopyFrom(numpy_helper.from_array(((q & 15) << 4) | (q >> 4), t.name))
    onnx.save(model, str(dst))
    return dst


def test_a_broken_int4_graph_fails_the_gate_and_the_build(bundle, tmp_path, monkeypatch):
    fp32 = {g: bundle.path(bundle.component(g, "fp32").file)
            for g in (*STAGE_GRAPHS["llm"], *STAGE_GRAPHS["flow"], *STAGE_GRAPHS["hift"])}
    gates = Gates(GateConfig.from_bundle(bundle), fp32)
    broken = {g: _swap_nibbles(p, tmp_path / f"{g}.onnx") for g, p in _int4_graphs(bundle).items()}
    assert gates.check("llm", _int4_graphs(bundle), "int4").passed
    report = gates.check("llm", broken, "int4")
    assert not report.passed and report.failures
    transform = precision_targets.nbits_weights

    def broken_nbits(src, dst, exclude=(), bits=8, block=None):
        out = transform(src, dst, exclude, bits, block)
        return _swap_nibbles(out, out) if bits == 4 else out

    monkeypatch.setattr(precision_targets, "nbits_weights", broken_nbits)
    for name in ("strict", "loose"):
        (tmp_path / name).mkdir()
    with pytest.raises(ReleaseError, match="stage 'llm' of target 'cpu-int4' at int4 failed"):
        precision.build_targets(["cpu-int4"], fp32, tmp_path / "strict", None, gates=gates)
    built = precision.build_targets(["cpu-int4"], fp32, tmp_path / "loose", None, allow_fallback=True, gates=gates)
    llm = built.quality["cpu-int4"]["llm"]
    assert llm["precision"] == "int8" and llm["fallback_from"] == "int4"
    # both 4-bit rungs (blocks of 128, then 32) were tried and missed
    assert [(a["precision"], a["passed"]) for a in llm["attempts"]] == [("int4", False), ("int4-b32", False),
                                                                        ("int8", True)]
    assert built.targets["cpu-int4"]["llm_int8"] == precision_targets.CPU_LLM_METHOD
    assert not list((tmp_path / "loose").glob("llm.int4*"))    # the missed 4-bit graphs are not left behind


def test_blocks_of_32_keep_a_4bit_llm_where_blocks_of_128_miss(bundle, tmp_path, monkeypatch):
    """The second 4-bit rung: where blocks of 128 miss the int4 gate (here: a graph broken at 128 only), blocks of
    32 are gated next and, passing, ship as the target's int4 LLM (`int4-b32` in the report, precision int4 in the
    graphs, so `auto` still takes the target)."""
    fp32 = {g: bundle.path(bundle.component(g, "fp32").file)
            for g in (*STAGE_GRAPHS["llm"], *STAGE_GRAPHS["flow"], *STAGE_GRAPHS["hift"])}
    gates = Gates(GateConfig.from_bundle(bundle), fp32)
    transform = precision_targets.nbits_weights

    def broken_at_128(src, dst, exclude=(), bits=8, block=None):
        out = transform(src, dst, exclude, bits, block)
        return _swap_nibbles(out, out) if bits == 4 and (block or NBITS_BLOCKS[4]) == 128 else out

    monkeypatch.setattr(precision_targets, "nbits_weights", broken_at_128)
    built = precision.build_targets(["cpu-int4"], fp32, tmp_path, None, allow_fallback=True, gates=gates)
    llm = built.quality["cpu-int4"]["llm"]
    assert llm["precision"] == "int4-b32" and llm["fallback_from"] == "int4"
    assert [(a["precision"], a["passed"]) for a in llm["attempts"]] == [("int4", False), ("int4-b32", True)]
    assert llm["attempts"][1]["thresholds"] == PRECISION_THRESHOLDS["int4"]["llm"]     # the int4 gate, not int8's
    target = built.targets["cpu-int4"]
    assert target["stages"]["llm"] == "int4-b32" and "llm_int8" not in target
    assert target["graphs"]["llm"] == {"component": "llm", "precision": "int4"}
    shipped = built.files[("llm", "int4")]
    assert {_attr(n, "block_size") for n in onnx.load(str(shipped)).graph.node if n.op_type == "MatMulNBits"} == {32}
    assert sorted(p.name for p in tmp_path.glob("llm.*")) == [shipped.name]      # the block-128 graph is gone


def test_auto_takes_cpu_int4_where_its_llm_kept_int4_else_cpu(bundle, tmp_path):
    """On a CPU, `auto` loads `cpu-int4` where its own gate kept the LLM at int4 (faster and smaller than `cpu`),
    else `cpu`; a bundle without `cpu` then falls to its default precision."""
    import json
    import os

    from cosyedge.device.engine import choose_graphs
    from cosyedge.device.sessions import SessionConfig
    cpu = SessionConfig(providers=("cpu",), intra_op_threads=1)
    assert bundle.targets["cpu-int4"]["stages"]["llm"] == "int4"
    assert choose_graphs(bundle, "auto", None, cpu) == "cpu-int4"

    def edited(name: str, change) -> Bundle:
        root = tmp_path / name
        root.mkdir()
        for path in bundle.root.rglob("*"):
            target = root / path.relative_to(bundle.root)
            if path.is_dir():
                target.mkdir(exist_ok=True)
            elif path.name != "manifest.json":
                os.link(path, target)
        manifest = json.loads((bundle.root / "manifest.json").read_text())
        change(manifest)
        (root / "manifest.json").write_text(json.dumps(manifest))
        return Bundle.load(root)

    def int4_fell_back(manifest: dict) -> None:
        int4 = manifest["config"]["targets"]["cpu-int4"]
        int4["stages"]["llm"] = "int8"
        int4["graphs"]["llm"] = {"component": "llm", "precision": "int8"}

    def int4_at_blocks_of_32(manifest: dict) -> None:
        manifest["config"]["targets"]["cpu-int4"]["stages"]["llm"] = "int4-b32"

    def only_int4_fell_back(manifest: dict) -> None:
        int4_fell_back(manifest)
        del manifest["config"]["targets"]["cpu"]

    assert choose_graphs(edited("fell_back", int4_fell_back), "auto", None, cpu) == "cpu"
    assert choose_graphs(edited("b32", int4_at_blocks_of_32), "auto", None, cpu) == "cpu-int4"
    only = edited("only", only_int4_fell_back)
    assert choose_graphs(only, "auto", None, cpu) == only.manifest.default_precision
