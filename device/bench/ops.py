"""Arithmetic of a graph call and the machine's practical GEMM ceiling, for `cosyedge bench-graphs`.

Multiply-adds are counted from the graph as ONNX Runtime runs it: one profiled call records every node's input and
output shapes, and each MatMul / Gemm / Conv-like node (fp32 or any fused / quantized form of it) contributes
batch x M x K x N (convolutions: output elements x input channels per group x kernel). Everything else (norms,
softmax, element-wise) is not counted: it is memory-bound and small next to the products. The ceiling is a plain
M x K x N MatMul through ONNX Runtime on the same threads, in fp32 and with dynamic int8 quantisation
(`quantize_dynamic`: MatMulInteger / DynamicQuantizeMatMul), the best the CPU's kernels do on dense products.
"""
from __future__ import annotations

import json
import math
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

MATMUL_OPS = {"MatMul", "MatMulInteger", "QLinearMatMul", "DynamicQuantizeMatMul", "MatMulIntegerToFloat",
              "MatMulNBits", "FusedMatMul", "QAttention"}
GEMM_OPS = {"Gemm", "QGemm", "FusedGemm"}
ATTENTION_OPS = {"MultiHeadAttention"}
CONV_OPS = {"Conv", "QLinearConv", "FusedConv", "ConvInteger", "ConvTranspose"}
GEMM_SHAPE = (600, 1024, 1024)  # M, K, N of the ceiling micro-benchmark


def _shapes(entries: list[dict[str, list[int]]]) -> list[list[int]]:
    return [next(iter(entry.values())) for entry in entries]


def node_macs(op: str, inputs: list[list[int]], outputs: list[list[int]]) -> int:
    """Multiply-adds of one profiled node from its input / output shapes (0 for ops that are not products)."""
    if not inputs or not outputs or not outputs[0]:
        return 0
    out = outputs[0]
    if op in MATMUL_OPS and len(inputs) >= 2:
        a = inputs[0]
        k = a[-1] if a else 0
        return int(math.prod(out) * k)
    if op in ATTENTION_OPS and len(inputs) >= 3:   # query [B, S, H*D], key [B, T, H*D]: Q K^T, then P V
        b, s, width = inputs[0]
        return int(b * s * inputs[1][1] * (width + out[-1]))
    if op in GEMM_OPS and len(inputs) >= 2:
        return int(math.prod(out) * inputs[0][-1])
    if op in CONV_OPS and len(inputs) >= 2:
        weight = inputs[3] if op in ("QLinearConv",) and len(inputs) > 3 else inputs[1]
        if op == "ConvTranspose":  # weight [C_in, C_out/g, k]: every input element meets C_out/g x k weights
            return int(math.prod(inputs[0]) * math.prod(weight[1:]))
        return int(math.prod(out) * math.prod(weight[1:]))
    return 0


CONTAINER_OPS = {"If", "Loop", "Scan"}   # their nested nodes are profiled on their own


def profile_call(model: Path, feeds: dict[str, np.ndarray], threads: int = 1) -> dict[str, Any]:
    """Multiply-adds and kernel milliseconds per op type of one call of `model` on `feeds`, from an ORT profile of
    that call (after one warm-up call, whose allocations and prepacking are not counted)."""
    with tempfile.TemporaryDirectory() as tmp:
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        options.enable_profiling = True
        options.profile_file_prefix = str(Path(tmp) / "profile")
        options.log_severity_level = 3
        session = ort.InferenceSession(str(model), options, providers=["CPUExecutionProvider"])
        session.run(None, feeds)
        session.run(None, feeds)
        events = json.loads(Path(session.end_profiling()).read_text(encoding="utf-8"))
    last = max(e["ts"] for e in events if e.get("name") == "model_run")
    by_op: dict[str, int] = {}
    ms: dict[str, float] = {}
    for event in events:
        args = event.get("args", {})
        if event.get("cat") != "Node" or "op_name" not in args or not event.get("name", "").endswith("_kernel_time") \
                or event["ts"] < last:
            continue
        op = args["op_name"]
        if op not in CONTAINER_OPS:
            ms[op] = ms.get(op, 0.0) + event["dur"] / 1000
        macs = node_macs(op, _shapes(args.get("input_type_shape", [])), _shapes(args.get("output_type_shape", [])))
        if macs:
            by_op[op] = by_op.get(op, 0) + macs
    return {"macs": sum(by_op.values()), "macs_by_op": by_op,
            "ms_by_op": {k: round(v, 1) for k, v in sorted(ms.items(), key=lambda kv: -kv[1])}}


def _gemm_model(path: Path, m: int, k: int, n: int) -> None:
    import onnx
    from onnx import TensorProto, helper, numpy_helper
    weight = numpy_helper.from_array(np.random.default_rng(0).standard_normal((k, n), dtype=np.float32) * 0.05, "w")
    graph = helper.make_graph([helper.make_node("MatMul", ["a", "w"], ["y"])], "gemm",
                              [helper.make_tensor_value_info("a", TensorProto.FLOAT, [m, k])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [m, n])], [weight])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))


def gemm_ceiling(threads: int, repeats: int = 5, shape: tuple[int, int, int] = GEMM_SHAPE) -> dict[str, Any]:
    """Achieved GOP/s (2 x multiply-adds per second, best of `repeats`) of an M x K x N MatMul in fp32 and int8."""
    from onnxruntime.quantization import QuantType, quantize_dynamic
    m, k, n = shape
    out: dict[str, Any] = {"shape_mkn": list(shape), "threads": threads}
    with tempfile.TemporaryDirectory() as tmp:
        fp32, int8 = Path(tmp) / "gemm.fp32.onnx", Path(tmp) / "gemm.int8.onnx"
        _gemm_model(fp32, m, k, n)
        quantize_dynamic(str(fp32), str(int8), weight_type=QuantType.QInt8)
        feeds = {"a": np.random.default_rng(1).standard_normal((m, k), dtype=np.float32)}
        for name, path in (("fp32", fp32), ("int8_dynamic", int8)):
            options = ort.SessionOptions()
            options.intra_op_num_threads = threads
            options.log_severity_level = 3
            session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
            session.run(None, feeds)
            best = math.inf
            for _ in range(repeats):
                start = time.perf_counter()
                session.run(None, feeds)
                best = min(best, time.perf_counter() - start)
            out[f"{name}_gops"] = round(2 * m * k * n / best / 1e9, 1)
    return out
