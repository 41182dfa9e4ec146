"""The cpu LLM's weight products in int8 with each activation row quantized on its own (`CPU_LLM_METHOD`
"dynamic_rows"): every constant-weight MatMul x @ W, and every Gemm x @ W (+ bias) without transA, alpha or beta
(the speech-token head), becomes

    s = max(|x|, over K) / 127              one scale per row: per position of each request
    q = QuantizeLinear(x / s, 1, 128)       uint8, zero point 128
    y = MatMulIntegerToFloat(q, Wq, 1, w_scale, 128) * s (+ bias)

with W quantized per output column (symmetric int8, `w_scale` = max |W[:, n]| / 127). The products sharing one
input (q, k and v; gate and up) share its quantization.

Why: ONNX Runtime's dynamic int8 (MatMulInteger / DynamicQuantizeMatMul) takes one activation scale per call, so one
request's loud row would change another's logits when decode steps are batched; and MatMulNBits 8-bit (weight-only,
blocks of 128) computes a 137-row prefill at less than half this graph's speed. Measured on the full-size
CosyVoice2-0.5B LLM with the shared cache, 2 threads (docs/bundle_cosyvoice2.md): prefill 141-151 against 327-351
ms, a 4-row decode step 21-23 against 28-30 ms, session 377 against 416 MB, a lone row's step 17.8-18.1 against
16.4-17.4 ms; a row's logits are the same alone or beside any other row (test_cv2_llm_rows).
"""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np
import onnx
from onnx import helper, numpy_helper

from cosyedge.quantize.cosyvoice2.graph_index import GraphIndex, finish
from cosyedge.quantize.cosyvoice2.llm_shared_kv import MS_DOMAIN
from cosyedge.quantize.cosyvoice2.precision_transforms import name_matches, symmetric_int8

ZERO_POINT = 128  # uint8 activations, symmetric around it: x / s lies in [-127, 127]


def int8_rows_dynamic(src: Path, dst: Path, exclude: Sequence[str] = ()) -> int:
    """Rewrite the constant-weight products of `src` (nodes matching `exclude` kept float) into `dst`; returns how
    many were rewritten."""
    model = onnx.load(str(src))
    graph = model.graph
    index = GraphIndex(model)
    opset = next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx"))
    if opset >= 18:  # the exports are opset 17 (onnx_export.ONNX_OPSET); ReduceMax's axes became an input at 18
        raise ValueError(f"row quantization writes opset-17 ReduceMax; the graph is opset {opset}")
    rows: dict[str, tuple[str, str]] = {}  # activation -> (its uint8 rows, their scales): shared by its products
    quantized: set[str] = set()  # weights already in int8 (a weight shared by two products is stored once)
    nodes: list[onnx.NodeProto] = []
    constants: list[onnx.TensorProto] = []
    uses = {name: len(users) for name, users in index.consumers.items()}
    count = 0
    for node in graph.node:
        product = _weight_product(node, index)
        if product is None or name_matches(node.name, exclude):
            nodes.append(node)
            continue
        weight, transposed, bias = product
        x = node.input[0]
        if x not in rows:
            rows[x] = _quantize_rows(x, f"{node.name}/quantize_rows", nodes)
        q, scale = rows[x]
        stored = f"{weight.name}/T" if transposed else weight.name  # the int8 copy is [K, N] either way
        if stored not in quantized:
            quantized.add(stored)
            w = numpy_helper.to_array(weight).astype(np.float32)
            w = np.ascontiguousarray(w.T) if transposed else w
            w_q, w_scale = symmetric_int8(w, 0, 1e-12)
            constants += [numpy_helper.from_array(w_q, f"{stored}/int8"),
                          numpy_helper.from_array(w_scale.reshape(-1), f"{stored}/scale")]
        p = f"{node.name}/rows"
        scaled = f"{p}/scaled" if bias else node.output[0]
        nodes += [helper.make_node("MatMulIntegerToFloat",
                                   [q, f"{stored}/int8", "rows_one", f"{stored}/scale", "rows_zero"],
                                   [f"{p}/unscaled"], name=f"{p}/MatMulIntegerToFloat", domain=MS_DOMAIN),
                  helper.make_node("Mul", [f"{p}/unscaled", scale], [scaled], name=f"{p}/Mul")]
        if bias:
            nodes.append(helper.make_node("Add", [scaled, bias], [node.output[0]], name=f"{p}/Add"))
        uses[weight.name] -= 1
        count += 1
    if count:
        del graph.node[:]
        graph.node.extend(nodes)
        kept = [t for t in graph.initializer if uses.get(t.name, 0) > 0]
        del graph.initializer[:]
        graph.initializer.extend(kept + constants + [
            numpy_helper.from_array(np.array(1.0, np.float32), "rows_one"),
            numpy_helper.from_array(np.array(1 / 127, np.float32), "rows_per_level"),
            numpy_helper.from_array(np.array(1e-12, np.float32), "rows_tiny"),
            numpy_helper.from_array(np.array(ZERO_POINT, np.uint8), "rows_zero")])
        if not any(o.domain == MS_DOMAIN for o in model.opset_import):
            model.opset_import.append(helper.make_opsetid(MS_DOMAIN, 1))
    finish(model, dst)
    return count


def _weight_product(node: onnx.NodeProto, index: GraphIndex) -> tuple[onnx.TensorProto, bool, str] | None:
    """(W, transposed, bias name or "") of a product x @ W (+ bias) with a constant 2-D W: a MatMul, or a Gemm
    without transA, alpha or beta (the speech-token head's export: transB with a bias); else None."""
    if node.op_type == "MatMul" and len(node.input) == 2:
        weight, transposed, bias = index.inits.get(node.input[1]), False, ""
    elif node.op_type == "Gemm":
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        if attrs.get("transA", 0) or attrs.get("alpha", 1.0) != 1.0 or attrs.get("beta", 1.0) != 1.0:
            return None
        weight, transposed = index.inits.get(node.input[1]), bool(attrs.get("transB", 0))
        bias = node.input[2] if len(node.input) > 2 else ""
    else:
        return None
    return (weight, transposed, bias) if weight is not None and len(weight.dims) == 2 else None


def _quantize_rows(x: str, p: str, nodes: list[onnx.NodeProto]) -> tuple[str, str]:
    """Append the nodes that quantize `x` row by row; returns (uint8 rows, their scales [..., 1])."""
    nodes += [helper.make_node("Abs", [x], [f"{p}/abs"], name=f"{p}/Abs"),
              helper.make_node("ReduceMax", [f"{p}/abs"], [f"{p}/max"], axes=[-1], keepdims=1, name=f"{p}/ReduceMax"),
              helper.make_node("Mul", [f"{p}/max", "rows_per_level"], [f"{p}/level"], name=f"{p}/Mul"),
              helper.make_node("Max", [f"{p}/level", "rows_tiny"], [f"{p}/scale"], name=f"{p}/Max"),  # a zero row
              helper.make_node("Div", [x, f"{p}/scale"], [f"{p}/levels"], name=f"{p}/Div"),
              helper.make_node("QuantizeLinear", [f"{p}/levels", "rows_one", "rows_zero"], [f"{p}/uint8"],
                               name=f"{p}/QuantizeLinear")]
    return f"{p}/uint8", f"{p}/scale"
