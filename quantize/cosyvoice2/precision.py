"""Precision targets of a `cosyvoice2` bundle: ONNX-to-ONNX transforms of the exported fp32 graphs.

Three targets (layout and manifest keys in docs/bundle_cosyvoice2.md, "Precision targets"):

* `cpu` (ONNX Runtime CPU): LLM graphs with int8 weights (`CPU_LLM_METHOD`, chosen by measurement on the full-size
  graph: weight-only `MatMulNBits` 8-bit blocks); the flow estimator as static int8 QDQ calibrated on estimator inputs
  recorded from fp32 runs; the flow encoder and the HiFT source stay fp32; the HiFT decoder becomes int8 only where
  its gate passes.
* `gpu-fp16`: every graph but the HiFT source in fp16 with fp32 islands (norms, softmax, residual stream, time
  embedding, exp / iSTFT) and fp32 graph inputs and outputs, so the runtime feeds the same arrays.
* `trt-int8`: explicit symmetric QDQ for TensorRT (int8 weights per output channel, activations per tensor, zero
  points 0) on MatMul / Conv / Gemm, fp16 elsewhere; TensorRT cannot be installed on the build host, so these graphs
  are validated with ONNX Runtime CPU.

Only MatMul (constant weight), Conv, Gemm and ConvTranspose are ever quantized, so norms, residual adds, softmax
and every elementwise op stay in floating point; `INT8_EXCLUDE` also keeps the time embedding, the f0 predictor,
the STFT / iSTFT and the speech-token head in high precision.
"""
from __future__ import annotations

import ctypes
import gc
import logging
import re
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Sequence

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from cosyedge.device.bundle import TARGETS

CPU_LLM_METHOD = "matmul_nbits"   # measured faster than "dynamic" (MatMulInteger) per decode token at full size
NBITS_BLOCK = 32                  # K values per scale of the 8-bit MatMulNBits weights
NBITS_ACCURACY_LEVEL = 4          # int8 activations inside MatMulNBits (VNNI / SDOT kernels)
FP16_MAX = float(np.finfo(np.float16).max)

# Node names (regular expressions, searched) kept out of int8 per graph: the time embedding of the estimator with
# its per-block time projections (`mlp`) and the final projection, the speech-token head of the LLM, the f0
# predictor / source of HiFT, the DFT-basis STFT / iSTFT convolutions (top-level `/Conv`, `/ConvTranspose*`) and
# the log-magnitude projection before the exp.
INT8_EXCLUDE: dict[str, tuple[str, ...]] = {
    "llm_prefill": (r"^/llm_decoder/",),
    "llm_decode": (r"^/llm_decoder/",),
    "flow_encoder": (r"^/spk_embed_affine_layer/", r"^/encoder/embed/", r"^/encoder/up_embed/"),
    "flow_estimator": (r"/time_mlp/", r"/time_embeddings", r"/mlp/", r"^/estimator/final_proj/"),
    "hift_source": (r".",),
    "hift_decoder": (r"^/Conv$", r"^/ConvTranspose", r"^/conv_post/"),
}
# Op types that always compute in fp32 inside an fp16 graph (overflow / precision-critical), and per-graph
# name patterns for the rest of the fp32 islands: RMSNorm / LayerNorm subgraphs, the LLM residual stream
# (layer-level Adds), rotary tables, the estimator time embedding, HiFT's Snake reciprocal and the iSTFT tail.
FP32_OPS = frozenset({"LayerNormalization", "Softmax", "Exp", "Log", "Pow", "ReduceMean", "Sqrt", "Reciprocal",
                      "CumSum", "Range", "Sin", "Cos", "Erf", "ReduceL2", "Softplus",
                      "QuantizeLinear", "DequantizeLinear"})
TOP_LEVEL = r"^/[A-Za-z]+(_\d+)?$"    # graph-level glue: masks, positions, rotary tables, output picks
FP32_NAMES: dict[str, tuple[str, ...]] = {
    "llm_prefill": (TOP_LEVEL, r"norm", r"^/layers\.\d+/Add(_\d+)?$", r"^/llm_decoder/"),
    "llm_decode": (TOP_LEVEL, r"norm", r"^/layers\.\d+/Add(_\d+)?$", r"^/llm_decoder/"),
    "flow_encoder": (TOP_LEVEL, r"norm", r"^/encoder/embed/", r"^/encoder/up_embed/", r"^/spk_embed_affine_layer/",
                     r"^/encoder/[A-Za-z]+(_\d+)?$"),
    "flow_estimator": (TOP_LEVEL, r"norm", r"/time_mlp/", r"/time_embeddings", r"^/estimator/[A-Za-z]+(_\d+)?$",
                       r"^/estimator/final_proj/"),
    "hift_source": (r".",),
    "hift_decoder": (TOP_LEVEL, r"^/conv_post/"),
}
QUANTIZED_OPS = ("MatMul", "Conv", "Gemm", "ConvTranspose")


def _matches(name: str, patterns: Iterable[str]) -> bool:
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


def _return_freed_memory() -> None:
    """glibc keeps the freed protobuf / numpy buffers of a 1.4 GB graph mapped (RSS grew past 8 GB over two LLM
    graphs); hand them back to the OS between graphs."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to trim
        pass


# ------------------------------------------------------------------------------------------- int8 weights (cpu LLM)

def _initializers(graph: onnx.GraphProto) -> dict[str, onnx.TensorProto]:
    return {t.name: t for t in graph.initializer}


def int8_weights_nbits(src: Path, dst: Path, exclude: Sequence[str] = (), block: int = NBITS_BLOCK) -> Path:
    """Every MatMul with a constant 2-D weight -> com.microsoft MatMulNBits with 8-bit symmetric block weights.

    Per output column n and block of `block` K values: scale = max|w| / 127, q = round(w / scale) + 128 (uint8,
    zero point 128). Activations stay float (quantized per block inside the kernel at accuracy level 4).
    """
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
        if weight is None or len(weight.dims) != 2 or _matches(node.name, exclude):
            nodes.append(node)
            continue
        w = numpy_helper.to_array(weight).astype(np.float32)                 # [K, N]
        k, n = w.shape
        blocks = -(-k // block)
        padded = np.zeros((blocks * block, n), np.float32)
        padded[:k] = w
        columns = padded.T.reshape(n, blocks, block)                         # [N, blocks, block]
        scale = np.maximum(np.abs(columns).max(axis=2), 1e-12) / 127.0      # [N, blocks]
        q = (np.clip(np.rint(columns / scale[:, :, None]), -127, 127) + 128).astype(np.uint8)
        prefix = f"{weight.name}_nbits8"
        graph.initializer.extend([numpy_helper.from_array(q, f"{prefix}_q"),
                                  numpy_helper.from_array(scale.astype(np.float32).reshape(-1), f"{prefix}_scale")])
        nodes.append(helper.make_node("MatMulNBits", [node.input[0], f"{prefix}_q", f"{prefix}_scale"],
                                      list(node.output), name=f"{node.name}_nbits8", domain="com.microsoft",
                                      K=k, N=n, bits=8, block_size=block, accuracy_level=NBITS_ACCURACY_LEVEL))
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
    names = [n.name for n in model.graph.node if _matches(n.name, exclude)]
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
    names = [n.name for n in model.graph.node if _matches(n.name, exclude)]
    with _quiet_root_logger():
        quantize_static(str(src), str(dst), _Feeds(calibration), quant_format=QuantFormat.QDQ,
                        op_types_to_quantize=list(QUANTIZED_OPS), per_channel=True, reduce_range=False,
                        activation_type=QuantType.QInt8, weight_type=QuantType.QInt8, nodes_to_exclude=names,
                        calibrate_method=CalibrationMethod.MinMax,
                        extra_options={"ActivationSymmetric": True, "WeightSymmetric": True,
                                       "MatMulConstBOnly": True, "QuantizeBias": False})
    return Path(dst)


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
    constants such as -1e10 or float32 min would become -inf); Casts are inserted where precisions meet.
    """
    model = onnx.load(str(src)) if not isinstance(src, onnx.ModelProto) else src
    graph = model.graph
    floats = _float_tensors(model)
    inits = _initializers(graph)
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


def fp32_island(graph_name: str, quantized: bool = False) -> Callable[[onnx.NodeProto], bool]:
    """keep_fp32 predicate of `graph_name`; with `quantized`, QDQ-quantized ops also stay fp32 (their DQ outputs
    are float32 in opset 17, and TensorRT fuses DQ -> op -> Q into one int8 kernel either way)."""
    patterns = FP32_NAMES.get(graph_name, ())

    def keep(node: onnx.NodeProto) -> bool:
        return _matches(node.name, patterns) or (quantized and node.op_type in QUANTIZED_OPS)

    return keep


# ----------------------------------------------------------------------------------------------- target recipes

@dataclass(frozen=True)
class Variant:
    """One graph of one target at one precision: the bundle component (name, precision) it is stored as."""
    graph: str
    component: str
    precision: str


def variant(target: str, graph: str, precision: str) -> Variant:
    """Component naming: fp32/fp16 graphs and cpu int8 graphs keep the graph name; trt-int8 QDQ graphs are
    `trt_<graph>` (they differ from the cpu int8 graphs of the same name and precision)."""
    if target == "trt-int8" and precision == "int8":
        return Variant(graph, f"trt_{graph}", precision)
    return Variant(graph, graph, precision)


def build_variant(v: Variant, fp32: Path, dst: Path, calibration: Sequence[dict[str, np.ndarray]] | None,
                  cpu_llm_method: str = CPU_LLM_METHOD) -> Path:
    """Write the graph of variant `v` from its fp32 export `fp32` into `dst`."""
    exclude = INT8_EXCLUDE.get(v.graph, ())
    if v.precision == "fp16":
        return to_fp16(fp32, dst, fp32_island(v.graph))
    if v.precision != "int8":
        raise ValueError(f"no transform to {v.precision}")
    if v.component == v.graph and v.graph.startswith("llm_"):
        method = {"matmul_nbits": int8_weights_nbits, "dynamic": int8_weights_dynamic}[cpu_llm_method]
        return method(fp32, dst, exclude)
    qdq = dst.with_name(f"{dst.stem}.qdq32.onnx") if v.component != v.graph else dst
    static_int8_qdq(fp32, qdq, calibration or (), exclude)
    if v.component == v.graph:
        return dst
    to_fp16(qdq, dst, fp32_island(v.graph, quantized=True))
    qdq.unlink()
    return dst


# Per target: the precision ladder of each stage, tried in order (the last one is the safe fallback), and the
# graphs of each stage that change precision (the others stay fp32).
STAGE_GRAPHS = {"llm": ("llm_prefill", "llm_decode"), "flow": ("flow_encoder", "flow_estimator"),
                "hift": ("hift_source", "hift_decoder")}
LADDERS: dict[str, dict[str, tuple[str, ...]]] = {
    "cpu": {"llm": ("int8", "fp32"), "flow": ("int8", "fp32"), "hift": ("int8", "fp32")},
    "gpu-fp16": {"llm": ("fp16", "fp32"), "flow": ("fp16", "fp32"), "hift": ("fp16", "fp32")},
    "trt-int8": {"llm": ("int8", "fp16", "fp32"), "flow": ("int8", "fp16", "fp32"), "hift": ("int8", "fp16", "fp32")},
}
# Graphs that stay fp32 although their stage is quantized (cost too small or precision-critical).
KEEP_FP32: dict[str, dict[str, frozenset[str]]] = {
    "cpu": {"int8": frozenset({"flow_encoder", "hift_source"})},
    "gpu-fp16": {"fp16": frozenset({"hift_source"})},
    "trt-int8": {"int8": frozenset({"hift_source"}), "fp16": frozenset({"hift_source"})},
}
# A stage of the cpu target that may silently stay fp32 when int8 misses the gate (HiFT: int8 only if it is fine).
OPTIONAL_INT8 = {"cpu": frozenset({"hift"})}
# For trt-int8 the flow encoder is fp16 (it runs once per request; its int8 gain is small).
INT8_AS_FP16 = {"trt-int8": frozenset({"flow_encoder"})}


def stage_variants(target: str, stage: str, precision: str) -> list[Variant]:
    """The graphs of `stage` for `target` at stage precision `precision`."""
    out = []
    for graph in STAGE_GRAPHS[stage]:
        p = precision
        if graph in KEEP_FP32.get(target, {}).get(precision, frozenset()):
            p = "fp32"
        elif p == "int8" and graph in INT8_AS_FP16.get(target, frozenset()):
            p = "fp16"
        out.append(variant(target, graph, p))
    return out


# --------------------------------------------------------------------------------------------- build and gate

@dataclass
class TargetBuild:
    """What `build_targets` adds to a bundle: graph files per component and the manifest entries."""
    files: dict[tuple[str, str], Path]                 # (component, precision) -> written graph (fp32 excluded)
    targets: dict[str, dict]                           # manifest.config["targets"]
    quality: dict[str, dict]                           # manifest.quality


def build_targets(targets: Sequence[str], fp32: dict[str, Path], work: Path, gate_config, allow_fallback: bool = False,
                  cpu_llm_method: str = CPU_LLM_METHOD, log: Callable[[str], None] = lambda _: None) -> TargetBuild:
    """Build every target's graphs from the fp32 exports in `fp32` (graph -> path) into `work` and gate each stage.

    A stage that misses its gate raises ReleaseError naming target and stage, unless `allow_fallback`: then the stage
    moves down its ladder (int8 -> fp16 -> fp32 for trt-int8, int8 -> fp32 for cpu, fp16 -> fp32 for gpu-fp16) and the
    manifest records `fallback_from`. The cpu HiFT decoder is int8 only when it passes (fp32 otherwise, no error).
    After the stages, the end-to-end gate (flow + HiFT from the same tokens) must pass as well; with
    `allow_fallback` the lower-precision of flow / HiFT (the flow on a tie) moves up one rung until it does.
    Graphs of rejected attempts are deleted from `work`.
    """
    from cosyedge.device.errors import ReleaseError
    from cosyedge.quantize.cosyvoice2.gates import Gates

    unknown = [t for t in targets if t not in TARGETS]
    if unknown:
        raise ReleaseError(f"unknown precision target {unknown[0]!r}; known: {', '.join(TARGETS)}")
    gates = Gates(gate_config, fp32)
    files: dict[tuple[str, str], Path] = {}
    calibration: dict[str, list] = {}

    def calibration_for(graph: str) -> list:
        if graph not in calibration:
            log(f"recording calibration inputs of {graph} from fp32 runs")
            if graph.startswith("llm_"):
                calibration.update(gates.llm_calibration())
            else:
                calibration["flow_estimator"], mels = gates.flow_calibration()
                calibration["hift_decoder"] = gates.hift_calibration(mels)
        return calibration.get(graph, [])

    def path_of(v: Variant) -> Path:
        if v.precision == "fp32":
            return fp32[v.graph]
        key = (v.component, v.precision)
        if key not in files:
            log(f"building {v.component}.{v.precision}")
            needs = v.precision == "int8" and not (v.component == v.graph and v.graph.startswith("llm_"))
            files[key] = build_variant(v, fp32[v.graph], work / f"{v.component}.{v.precision}.onnx",
                                       calibration_for(v.graph) if needs else None, cpu_llm_method)
            _return_freed_memory()
        return files[key]

    config: dict[str, dict] = {}
    quality: dict[str, dict] = {}
    used: set[tuple[str, str]] = set()
    for target in targets:
        stages: dict[str, str] = {}
        report: dict[str, dict] = {}

        def settle(stage: str, start: int, reason: str | None = None) -> None:
            """Walk the stage's ladder from rank `start` until a precision passes its stage gate (fp32 always does)."""
            ladder = LADDERS[target][stage]
            entry = report.setdefault(stage, {"precision": ladder[0], "attempts": [], "fallback_from": None})
            for rank in range(start, len(ladder)):
                precision = ladder[rank]
                if precision != "fp32":
                    graphs = {v.graph: path_of(v) for v in stage_variants(target, stage, precision)}
                    result = gates.check(stage, graphs, precision)
                    gates.forget(p for g, p in graphs.items() if p != fp32[g])   # full-size sessions are large
                    _return_freed_memory()
                    entry["attempts"].append(result.as_dict())
                    log(f"{target} {stage} {precision}: {result.metrics} "
                        f"{'pass' if result.passed else result.failures}")
                    if not result.passed:
                        if not allow_fallback and stage not in OPTIONAL_INT8.get(target, ()):
                            raise ReleaseError(
                                f"quality gate: stage {stage!r} of target {target!r} at {precision} failed "
                                f"({'; '.join(result.failures)}); pass --allow-fallback to keep it at "
                                f"{ladder[rank + 1]}")
                        reason = reason or f"{precision} missed the {stage} gate"
                        continue
                stages[stage] = entry["precision"] = precision
                if rank > 0:
                    entry["fallback_from"] = entry["fallback_from"] or ladder[0]
                    entry["fallback_reason"] = entry.get("fallback_reason") or reason
                return

        for stage in LADDERS[target]:
            settle(stage, 0)
        e2e: list[dict] = []
        while stages["flow"] != "fp32" or stages["hift"] != "fp32":
            graphs = {v.graph: path_of(v) for s in ("flow", "hift") for v in stage_variants(target, s, stages[s])}
            result = gates.check("e2e", graphs, f"flow {stages['flow']}, hift {stages['hift']}")
            e2e.append(result.as_dict())
            log(f"{target} e2e {result.precision}: {result.metrics} {'pass' if result.passed else result.failures}")
            if result.passed:
                break
            if not allow_fallback:
                raise ReleaseError(f"quality gate: stage 'e2e' of target {target!r} ({result.precision}) failed "
                                   f"({'; '.join(result.failures)}); pass --allow-fallback to raise flow / HiFT "
                                   "precision until it passes")
            # step down the lower-precision stage first (int8 before fp16); on a tie the flow, whose error the
            # vocoder inherits
            order = {"int8": 0, "fp16": 1, "fp32": 2}
            stage = min(("flow", "hift"), key=lambda s: order[stages[s]])
            settle(stage, LADDERS[target][stage].index(stages[stage]) + 1, "end-to-end gate")
        report["e2e"] = {"precision": f"flow {stages['flow']}, hift {stages['hift']}", "attempts": e2e,
                         "fallback_from": None}
        chosen = [v for s in STAGE_GRAPHS for v in stage_variants(target, s, stages[s])]
        used.update((v.component, v.precision) for v in chosen)
        config[target] = {
            "graphs": {v.graph: {"component": v.component, "precision": v.precision} for v in chosen},
            "stages": stages, "validated_with": "onnxruntime-cpu",
            **({"llm_int8": cpu_llm_method} if target == "cpu" and stages["llm"] == "int8" else {}),
        }
        quality[target] = report
    for key in [k for k in files if k not in used]:   # graphs of attempts that missed their gate
        files.pop(key).unlink()
    return TargetBuild(files, config, quality)
