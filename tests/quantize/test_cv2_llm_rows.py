"""The cpu LLM's int8 weight products with each activation row quantized on its own (llm_row_int8.py, the cpu
targets' `CPU_LLM_METHOD` for both families): every weight product of the tiny releases' LLM is rewritten, the
speech-token head's Gemm (CosyVoice2: transposed weight and a bias) too, the products sharing an input share its
quantization, a row's logits are exactly the same whatever rows share its
call (the reason for the method: decode steps are batched across requests), and the logits stay near fp32.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from cosyedge.device.bundle import Bundle
from cosyedge.device.cosyvoice2.kvcache import LLMCalls
from cosyedge.quantize.cosyvoice2.llm_row_int8 import int8_rows_dynamic
from cosyedge.quantize.cosyvoice2.precision_targets import CPU_LLM_METHOD

ROUND_OFF = 1e-5  # relative to the largest logit: the float graphs' own batched round-off is ~5e-7


@pytest.fixture(scope="module", params=["cosyvoice2", "cosyvoice3"])
def graphs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The fp32 LLM of the family's tiny official-layout release and its row-quantized rewrite (as the cpu target
    builds it: the head too)."""
    bundle = Bundle.load(request.getfixturevalue(f"cv{request.param[-1]}_tiny_bundle"))
    fp32 = bundle.path(bundle.component("llm", "fp32").file)
    rows = tmp_path_factory.mktemp(f"rows-{request.param}") / "llm.rows.onnx"
    int8_rows_dynamic(fp32, rows)
    return fp32, rows


def _calls(path: Path) -> LLMCalls:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    return LLMCalls(ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"]))


def _weight_products(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    weights = {t.name for t in model.graph.initializer if len(t.dims) == 2}
    return [n for n in model.graph.node if n.op_type in ("MatMul", "Gemm") and n.input[1] in weights]


def test_every_weight_product_and_the_head_is_int8_and_each_input_is_quantized_once(graphs):
    assert CPU_LLM_METHOD == "dynamic_rows"
    fp32, rows = onnx.load(str(graphs[0])), onnx.load(str(graphs[1]))
    products = _weight_products(fp32)
    assert [n for n in products if n.name.startswith("/llm_decoder/")]  # the head is among them
    ops = [n.op_type for n in rows.graph.node]
    assert ops.count("MatMulIntegerToFloat") == len(products)
    assert ops.count("QuantizeLinear") == len({n.input[0] for n in products}) < len(products)  # q/k/v, gate/up
    assert not _weight_products(rows)
    int8 = [t for t in rows.graph.initializer if t.data_type == onnx.TensorProto.INT8]
    assert len(int8) == len(products)
    assert sum(t.data_type == onnx.TensorProto.FLOAT and len(t.dims) == 2 for t in rows.graph.initializer) \
        < sum(t.data_type == onnx.TensorProto.FLOAT and len(t.dims) == 2 for t in fp32.graph.initializer)


def test_a_rows_logits_do_not_depend_on_the_rows_beside_it(graphs):
    """Row 0 alone, and batched with a 50x louder, shorter row: the same logits within float32 round-off at the
    prefill and at every decode step (one activation scale per call moves them by whole units). Round-off, not bit
    for bit: the float graphs themselves differ by up to 5e-6 (logits ~10) batched, in the golden releases'
    stacked-cache graph (a row padded beside a longer one; cosyvoice3's decode steps); the full-size shared-cache
    graph measured 0.0."""
    calls = _calls(graphs[1])
    rng = np.random.default_rng(0)
    hidden = calls._session.get_inputs()[0].shape[2]
    prompt, loud = (rng.standard_normal((1, n, hidden)).astype(np.float32) * s for n, s in ((9, 0.5), (6, 25.0)))
    alone, cache = calls.prefill([prompt])
    beside, both = calls.prefill([prompt, loud])
    assert np.abs(alone[0] - beside[0]).max() <= ROUND_OFF * np.abs(alone[0]).max()
    for _ in range(4):
        step = rng.standard_normal((2, 1, hidden)).astype(np.float32) * np.array([[[0.5]], [[25.0]]], np.float32)
        alone, cache = calls.decode(step[:1], cache)
        beside, both = calls.decode(step, both)
        assert np.abs(alone[0] - beside[0]).max() <= ROUND_OFF * np.abs(alone[0]).max()


def test_the_logits_stay_near_fp32(graphs):
    rng = np.random.default_rng(1)
    fp32, rows = _calls(graphs[0]), _calls(graphs[1])
    hidden = fp32._session.get_inputs()[0].shape[2]
    prompts = [rng.standard_normal((1, n, hidden)).astype(np.float32) for n in (7, 12)]
    want, got = fp32.prefill(prompts)[0], rows.prefill(prompts)[0]
    error = np.abs(want - got).max() / np.abs(want).max()
    assert 0 < error < 0.05, error  # measured 0.01 on both tiny releases (int8: not exact, but near)


def test_a_weight_shared_by_two_products_is_stored_once(tmp_path):
    """Tied weights: two products of one weight (on different inputs) give one int8 copy, a valid graph, and
    each product near its float value."""
    w = np.random.default_rng(2).standard_normal((16, 16)).astype(np.float32) / 4
    nodes = [onnx.helper.make_node("MatMul", ["x", "w"], ["h"], name="/first/MatMul"),
             onnx.helper.make_node("MatMul", ["h", "w"], ["y"], name="/second/MatMul")]
    graph = onnx.helper.make_graph(nodes, "tied", [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT,
                                                                                      [None, 16])],
                                   [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [None, 16])],
                                   [onnx.numpy_helper.from_array(w, "w")])
    onnx.save(onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)]), tmp_path / "f.onnx")
    assert int8_rows_dynamic(tmp_path / "f.onnx", tmp_path / "q.onnx") == 2
    model = onnx.load(str(tmp_path / "q.onnx"))
    onnx.checker.check_model(model)
    assert [t.name for t in model.graph.initializer].count("w/int8") == 1 and "w" not in \
        [t.name for t in model.graph.initializer]
    x = np.random.default_rng(3).standard_normal((3, 16)).astype(np.float32)
    got = ort.InferenceSession(str(tmp_path / "q.onnx"), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    want = x @ w @ w
    assert np.abs(got - want).max() < 0.05 * np.abs(want).max()
