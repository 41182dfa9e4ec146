"""ONNX-to-ONNX precision transforms of the exported fp32 graphs: 8- / 4-bit weights, static int8 QDQ, fp16.

Policy-free on purpose: which nodes stay out of int8 (`exclude` patterns) or in fp32 (`keep_fp32`) is decided per
graph and target by the caller (precision_targets.py), so one transform serves every graph. What holds for every
graph is fixed here: only MatMul (constant weight), Conv, Gemm and ConvTranspose are ever quantized, so norms,
residual adds, softmax and every elementwise op stay in floating point, and `FP32_OPS` compute in fp32 inside
every fp16 graph. Each transform writes one self-contained file, because a bundle hashes graph files.
"""
from __future__ import annotations

import logging
import re
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterable, Sequence

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

# K values per scale of the MatMulNBits weights, by bits. 8-bit: blocks of 128 (full-size CosyVoice2 LLM, 2 threads,
# against blocks of 32: session 404 against 511 MB, decode step 25-26.5 against 29-30.5 ms, prefill 0.85x; gate KL
# 1.9e-5 against 1.4e-5: fewer scales to read and to pack). 4-bit: blocks of 128 too (full size: session +228
# against +324 MB at blocks of 32, a decode step 10.0 against 13.1 ms, prefill 338 against 438 ms; gate KL 1.82e-3
# against 1.76e-3, decisive top-1 0.95 at both; tiny preset KL 5.2e-3, decisive 0.957). Random weights cannot show
# what round-to-nearest blocks of 128 cost on trained ones: the LLM gate on the release's own prompts decides, and
# where it misses cpu-int4 tries blocks of 32 (precision_targets.RUNG_BLOCK), then keeps the int8 LLM.
NBITS_BLOCKS = {8: 128, 4: 128}
NBITS_ACCURACY_LEVEL = 4          # int8 activations inside MatMulNBits (VNNI / SDOT kernels)
FP16_MAX = float(np.finfo(np.float16).max)
# Op types that always compute in fp32 inside an fp16 graph (overflow / precision-critical).
FP32_OPS = frozenset({"LayerNormalization", "Softmax", "Exp", "Log", "Pow", "ReduceMean", "Sqrt", "Reciprocal",
                      "CumSum", "Range", "Sin", "Cos", "Erf", "ReduceL2", "Softplus",
                      "QuantizeLinear", "DequantizeLinear"})
QUANTIZED_OPS = ("MatMul", "Conv", "Gemm", "ConvTranspose")


def name_matches(name: str, patterns: Iterable[str]) -> bool:
    """Whether any of the regular expressions `patterns` is found in the node name `name`."""
    return any(re.search(p, name) for p in patterns)


def _save(model: onnx.ModelProto, dst: Path) -> Path:
    """One self-contained file (a bundle hashes graph files, not external-data side files; every derived graph is
    smaller than its fp32 export, which already fits)."""
    dst = Path(dst)
    onnx.save(model, str(dst))
    return dst


@contextmanager
def _quiet_root_logger():
    """ORT's quantizer warns on the root logger about optional pre-processing for every graph."""
    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.ERROR)
    try:
        yield
    finally:
        root.setLevel(level)


# -------------------------------------------------------------------------------- 8- / 4-bit weights (cpu LLM)

def _initializers(graph: onnx.GraphProto) -> dict[str, onnx.TensorProto]:
    return {t.name: t for t in graph.initializer}


def nbits_weights(src: Path, dst: Path, exclude: Sequence[str] = (), bits: int = 8, block: int | None = None) -> Path:
    """Every MatMul with a constant 2-D weight -> com.microsoft MatMulNBits with `bits`-bit (8 or 4) symmetric blocks.

    Per output column n and block of `block` K values: scale = max|w| / qmax, q = round(w / scale) + zero with
    qmax = 2^(bits-1) - 1 and zero = 2^(bits-1) (the kernel's default zero point, so none is stored): 127 / 128 for
    8 bits, 7 / 8 for 4 bits, two 4-bit values per byte (low nibble first). Activations stay float (quantized per
    block inside the kernel at accuracy level 4).
    """
    block = block or NBITS_BLOCKS.get(bits, 0)
    if bits not in (4, 8) or not block or block % 2:
        raise ValueError(f"MatMulNBits weights need 4 or 8 bits and an even block, not {bits} / {block}")
    qmax, zero = (1 << (bits - 1)) - 1, 1 << (bits - 1)
    model = onnx.load(str(src))
    graph = model.graph
    inits = _initializers(graph)
    users: dict[str, int] = {}
    for node in graph.node:
        for name in node.input:
            users[name] = users.get(name, 0) + 1
    nodes, dropped = [], set()
    for node in graph.node:
        weight = inits.get(node.input[1]) if node.op_type == "MatMul" and len(node.input) == 2 else None
        if weight is None or len(weight.dims) != 2 or name_matches(node.name, exclude):
            nodes.append(node)
            continue
        w = numpy_helper.to_array(weight).astype(np.float32)                 # [K, N]
        k, n = w.shape
        blocks = -(-k // block)
        padded = np.zeros((blocks * block, n), np.float32)
        padded[:k] = w
        columns = padded.T.reshape(n, blocks, block)                         # [N, blocks, block]
        scale = np.maximum(np.abs(columns).max(axis=2), 1e-12) / qmax       # [N, blocks]
        q = (np.clip(np.rint(columns / scale[:, :, None]), -qmax, qmax) + zero).astype(np.uint8)
        if bits == 4:
            q = q[:, :, 0::2] | (q[:, :, 1::2] << 4)                          # [N, blocks, block / 2]
        prefix = f"{weight.name}_nbits{bits}"
        graph.initializer.extend([numpy_helper.from_array(q, f"{prefix}_q"),
                                  numpy_helper.from_array(scale.astype(np.float32).reshape(-1), f"{prefix}_scale")])
        nodes.append(helper.make_node("MatMulNBits", [node.input[0], f"{prefix}_q", f"{prefix}_scale"],
                                      list(node.output), name=f"{node.name}_nbits{bits}", domain="com.microsoft",
                                      K=k, N=n, bits=bits, block_size=block, accuracy_level=NBITS_ACCURACY_LEVEL))
        users[weight.name] -= 1
        if users[weight.name] == 0:
            dropped.add(weight.name)
    del graph.node[:]
    graph.node.extend(nodes)
    kept = [t for t in graph.initializer if t.name not in dropped]
    del graph.initializer[:]
    graph.initializer.extend(kept)
    if not any(o.domain == "com.microsoft" for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    return _save(model, dst)


def int8_weights_dynamic(src: Path, dst: Path, exclude: Sequence[str] = ()) -> Path:
    """ORT dynamic quantization: int8 per-channel MatMul weights, activations quantized per call (MatMulInteger)."""
    from onnxruntime.quantization import QuantType, quantize_dynamic
    model = onnx.load(str(src), load_external_data=False)
    names = [n.name for n in model.graph.node if name_matches(n.name, exclude)]
    names += [f"{name}_MatMul" for name in names]  # ORT turns an excluded Gemm into `<name>_MatMul` + Add first
    with _quiet_root_logger():
        quantize_dynamic(str(src), str(dst), op_types_to_quantize=["MatMul"], per_channel=True, reduce_range=False,
                         weight_type=QuantType.QInt8, nodes_to_exclude=names,
                         extra_options={"MatMulConstBOnly": True, "WeightSymmetric": True})
    return Path(dst)


# -------------------------------------------------------------------------------------------- static int8 QDQ

class _Feeds:
    """ORT CalibrationDataReader over recorded input dicts."""

    def __init__(self, feeds: Sequence[dict[str, np.ndarray]]) -> None:
        self._it = iter(list(feeds))

    def get_next(self) -> dict[str, np.ndarray] | None:
        return next(self._it, None)


def static_int8_qdq(src: Path, dst: Path, calibration: Sequence[dict[str, np.ndarray]],
                    exclude: Sequence[str] = ()) -> Path:
    """Explicit QDQ int8 (TensorRT rules): symmetric per-channel weights, symmetric per-tensor activations from a
    min/max calibration over `calibration` (input dicts recorded from fp32 runs); biases stay float."""
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, quantize_static
    if not calibration:
        raise ValueError("static int8 quantization needs calibration inputs")
    model = onnx.load(str(src), load_external_data=False)
    names = [n.name for n in model.graph.node if name_matches(n.name, exclude)]
    with _quiet_root_logger():
        quantize_static(str(src), str(dst), _Feeds(calibration), quant_format=QuantFormat.QDQ,
                        op_types_to_quantize=list(QUANTIZED_OPS), per_channel=True, reduce_range=False,
                        activation_type=QuantType.QInt8, weight_type=QuantType.QInt8, nodes_to_exclude=names,
                        calibrate_method=CalibrationMethod.MinMax,
                        extra_options={"ActivationSymmetric": True, "WeightSymmetric": True,
                                       "MatMulConstBOnly": True, "QuantizeBias": False})
    return Path(dst)


def unsigned_activations(src: Path, dst: Path) -> Path:
    """The same QDQ graph with every symmetric int8 activation pair (QuantizeLinear with zero point 0 and its
    DequantizeLinear consumers) as uint8 with zero point 128: the same grid, so the graph computes the same values.

    Why (ONNX Runtime CPU): its kernels fuse DQ -> Conv -> Q into QLinearConv with uint8 activations. It converts
    int8 pairs itself, but not a pair whose DequantizeLinear feeds two nodes (the Snake after HiFT's dilated
    `convs1`), so half of the HiFT decoder's convolutions ran in fp32 between a dequantize and a quantize. Weights
    (DequantizeLinear of int8 initializers, no QuantizeLinear) keep int8: QLinearConv takes u8 x s8."""
    model = onnx.load(str(src))
    graph = model.graph
    inits = _initializers(graph)
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)
    unsigned: dict[str, str] = {}
    for node in graph.node:
        zero = inits.get(node.input[2]) if node.op_type == "QuantizeLinear" and len(node.input) > 2 else None
        if zero is None or zero.data_type != TensorProto.INT8 or numpy_helper.to_array(zero).any():
            continue
        pairs = consumers.get(node.output[0], [])
        if not all(c.op_type == "DequantizeLinear" and c.input[2] == node.input[2] for c in pairs):
            continue    # a quantized tensor read as int8 by anything else keeps its type
        if zero.name not in unsigned:
            unsigned[zero.name] = f"{zero.name}_u8"
            graph.initializer.append(numpy_helper.from_array(
                np.full(tuple(zero.dims), 128, np.uint8), unsigned[zero.name]))
        for quantized in (node, *pairs):
            quantized.input[2] = unsigned[zero.name]
    used = {name for node in graph.node for name in node.input}
    kept = [t for t in graph.initializer if t.name in used or t.name not in unsigned]
    del graph.initializer[:]
    graph.initializer.extend(kept)
    return _save(model, dst)


# ------------------------------------------------------------------------------------------------------- fp16

_TYPE_AGNOSTIC = frozenset({"Cast", "Shape", "Size"})        # inputs of any type: never cast in front of them
_FP32_SOURCES = frozenset({"Cast", "ConstantOfShape", "RandomNormal", "RandomNormalLike", "RandomUniform",
                           "RandomUniformLike", "EyeLike"})  # float outputs decided by an attribute: keep fp32


def _float_tensors(model: onnx.ModelProto) -> set[str]:
    """Names of every float32 tensor (inputs, initializers, node outputs) after ONNX type inference.

    Inference runs on a weightless copy (initializers turned into typed inputs): a full-size graph is not copied.
    """
    light = helper.make_model(
        helper.make_graph(model.graph.node, "types", [*model.graph.input, *(
            helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)) for t in model.graph.initializer)],
            model.graph.output), opset_imports=model.opset_import)
    light.ir_version = model.ir_version
    graph = onnx.shape_inference.infer_shapes(light).graph
    floats = {v.name for v in (*graph.input, *graph.output, *graph.value_info)
              if v.type.tensor_type.elem_type == TensorProto.FLOAT}
    floats |= {t.name for t in model.graph.initializer if t.data_type == TensorProto.FLOAT}
    for node in graph.node:
        if node.op_type == "Constant" and node.attribute and node.attribute[0].name == "value" \
                and node.attribute[0].t.data_type == TensorProto.FLOAT:
            floats.add(node.output[0])
    return floats


def to_fp16(src: Path | onnx.ModelProto, dst: Path, keep_fp32: Callable[[onnx.NodeProto], bool]) -> Path:
    """fp16 compute everywhere except nodes where `keep_fp32(node)` (and `FP32_OPS`); graph I/O stays float32.

    Float initializers and constants read by fp16 nodes get fp16 copies clamped to +-65504 (attention-bias
    constants such as -1e10 or float32 min would become -inf); Casts are inserted where precisions meet, and in front
    of an fp16 reader of an overridable initializer (an input with a default: it is read as an input).
    """
    model = onnx.load(str(src)) if not isinstance(src, onnx.ModelProto) else src
    graph = model.graph
    floats = _float_tensors(model)
    inputs = {i.name for i in graph.input}
    # An initializer that is also a graph input is an overridable default (the prompt state's): a fed value replaces
    # it, so an fp16 reader gets a Cast of the input, never an fp16 copy of the default.
    inits = {name: t for name, t in _initializers(graph).items() if name not in inputs}
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)

    def half(node: onnx.NodeProto) -> bool:
        if node.op_type in FP32_OPS or node.op_type in _FP32_SOURCES or node.op_type in _TYPE_AGNOSTIC:
            return False
        if node.op_type == "Constant":
            return node.output[0] in floats and bool(consumers.get(node.output[0])) \
                and all(half(c) for c in consumers[node.output[0]])
        return not keep_fp32(node) and any(n in floats for n in (*node.input, *node.output))

    nodes = list(graph.node)  # one wrapper per node: ids stay valid
    fp16_nodes = {id(n) for n in nodes if half(n)}
    precision: dict[str, int] = {name: TensorProto.FLOAT for name in floats}
    casts: dict[tuple[str, int], str] = {}
    half_inits: dict[str, str] = {}
    new_nodes: list[onnx.NodeProto] = []

    def cast(name: str, to: int) -> str:
        key = (name, to)
        if key not in casts:
            out = f"{name}__to_{'fp16' if to == TensorProto.FLOAT16 else 'fp32'}"
            new_nodes.append(helper.make_node("Cast", [name], [out], name=f"{out}__cast", to=to))
            casts[key] = out
        return casts[key]

    for node in nodes:
        want = TensorProto.FLOAT16 if id(node) in fp16_nodes else TensorProto.FLOAT
        if node.op_type == "Constant" and want == TensorProto.FLOAT16:
            value = numpy_helper.to_array(node.attribute[0].t)
            node.attribute[0].t.CopyFrom(numpy_helper.from_array(
                np.clip(value, -FP16_MAX, FP16_MAX).astype(np.float16), node.attribute[0].t.name))
        elif node.op_type not in _TYPE_AGNOSTIC:
            for i, name in enumerate(node.input):
                if name not in floats or precision.get(name) == want:
                    continue
                if want == TensorProto.FLOAT16 and name in inits:
                    if name not in half_inits:
                        value = np.clip(numpy_helper.to_array(inits[name]), -FP16_MAX, FP16_MAX).astype(np.float16)
                        graph.initializer.append(numpy_helper.from_array(value, f"{name}__fp16"))
                        half_inits[name] = f"{name}__fp16"
                    node.input[i] = half_inits[name]
                else:
                    node.input[i] = cast(name, want)
        if want == TensorProto.FLOAT16:
            for name in node.output:
                if name in floats:
                    precision[name] = TensorProto.FLOAT16
        new_nodes.append(node)
    for output in graph.output:
        if precision.get(output.name) == TensorProto.FLOAT16:
            inner = f"{output.name}__fp16"
            for node in new_nodes:
                node.output[:] = [inner if o == output.name else o for o in node.output]
                node.input[:] = [inner if i == output.name else i for i in node.input]
            new_nodes.append(helper.make_node("Cast", [inner], [output.name], name=f"{output.name}__cast",
                                              to=TensorProto.FLOAT))
    used = {i for n in new_nodes for i in n.input}
    kept = [t for t in graph.initializer if t.name in used]
    del graph.initializer[:]
    graph.initializer.extend(kept)
    del graph.node[:]
    graph.node.extend(new_nodes)
    del graph.value_info[:]
    return _save(model, dst)


# ------------------------------------------------------------------------------------------- int8 table rows

def symmetric_int8(values: np.ndarray, axis: int, floor: float) -> tuple[np.ndarray, np.ndarray]:
    """(q, scale): `values` as int8 with one float32 scale per slice along `axis` (kept as a size-1 axis), scale =
    max(max |slice|, floor) / 127 and q = round(values / scale), so that q * scale is the slice's nearest int8 grid
    point (the cpu LLM's weight columns, an embedding table's rows)."""
    scale = np.maximum(np.abs(values).max(axis=axis, keepdims=True), np.float32(floor)) / np.float32(127)
    return np.clip(np.rint(values / scale), -127, 127).astype(np.int8), scale.astype(np.float32)


def int8_table_rows(src: Path, dst: Path, min_rows: int = 1024) -> int:
    """Every Gather along axis 0 of a float32 table initializer of at least `min_rows` rows (the flow encoder's
    speech-token embedding, [6561, 512]: 13.4 MB at full size) reads int8 rows and a per-row scale instead:
    Gather(table) becomes Cast(Gather(q), float) * Gather(scale), q = round(table / scale), scale = max |row| / 127.
    The session holds a quarter of the table; a call gathers only its tokens' rows. Returns the tables rewritten."""
    model = onnx.load(str(src))
    graph = model.graph
    inits, inputs = _initializers(graph), {i.name for i in graph.input}
    readers: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        for name in node.input:
            readers.setdefault(name, []).append(node)
    rewritten, nodes = set(), []
    for node in graph.node:
        table = inits.get(node.input[0]) if node.op_type == "Gather" and node.input else None
        axis = next((a.i for a in node.attribute if a.name == "axis"), 0)
        if table is None or table.name in inputs or table.data_type != TensorProto.FLOAT or len(table.dims) != 2 \
                or table.dims[0] < min_rows or axis != 0 or any(r.op_type != "Gather" for r in readers[table.name]):
            nodes.append(node)
            continue
        if table.name not in rewritten:
            q, scale = symmetric_int8(numpy_helper.to_array(table), 1, np.finfo(np.float32).tiny)
            graph.initializer.extend([numpy_helper.from_array(q, f"{table.name}_q"),
                                      numpy_helper.from_array(scale, f"{table.name}_scale")])
            rewritten.add(table.name)
        out, ids = node.output[0], node.input[1]
        nodes += [helper.make_node("Gather", [f"{table.name}_q", ids], [f"{out}_q"], name=f"{node.name}_q", axis=0),
                  helper.make_node("Cast", [f"{out}_q"], [f"{out}_float"], name=f"{node.name}_cast",
                                   to=TensorProto.FLOAT),
                  helper.make_node("Gather", [f"{table.name}_scale", ids], [f"{out}_scale"],
                                   name=f"{node.name}_scale", axis=0),
                  helper.make_node("Mul", [f"{out}_float", f"{out}_scale"], [out], name=f"{node.name}_rows")]
    if rewritten:
        kept = [t for t in graph.initializer if t.name not in rewritten]
        del graph.initializer[:]
        graph.initializer.extend(kept)
        del graph.node[:]
        graph.node.extend(nodes)
    _save(model, dst)
    return len(rewritten)
