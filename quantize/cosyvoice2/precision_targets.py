"""Precision targets of a `cosyvoice2` bundle: which transform each graph of each stage gets, per target.

Four targets (layout and manifest keys in docs/bundle_cosyvoice2.md, "Precision targets"):

* `cpu` (ONNX Runtime CPU): LLM graphs with int8 weights (`CPU_LLM_METHOD`, chosen by measurement on the full-size
  graph: int8 weight products with each activation row quantized on its own, llm_row_int8.py) and the shared
  key/value cache contract where the head size allows (`GraphRules.shared_kv`, llm_shared_kv.py:
  GroupQueryAttention writes each new position into the cache in place) with fewer kernel calls per decode step:
  each residual sum fused with the norm after it (llm_skip_norm.py) and the products that read one activation
  packed into one (llm_packing.py: query-key-value, gate-up); the flow estimator with dynamic int8
  MatMuls (`CPU_FLOW_DYNAMIC`: int8 weights per channel, activations quantized per call, the CPU's integer
  dot-product kernels) and its attention fused into ONNX Runtime's MultiHeadAttention (`GraphRules.fused_attention`,
  attention_fusion.py) and its Mish activations computed through one Exp (mish_rewrite.py, on every cpu int8
  graph); the flow encoder is dynamic
  int8 too where the end-to-end gate allows (else the `int8-estimator` rung keeps it fp32); the HiFT source stays
  fp32; the HiFT decoder becomes static int8 QDQ with uint8 activations (every convolution fused by ONNX Runtime,
  `unsigned_activations`) only where its gate passes.
* `cpu-int4` (optional, ONNX Runtime CPU): the `cpu` target with 4-bit LLM weights (`MatMulNBits`, blocks of 128,
  symmetric, int8 compute) under their own LLM gate thresholds (gates.PRECISION_THRESHOLDS), falling back to blocks
  of 32 (rung `int4-b32`: a scale per 32 weights rounds closer to trained weights' outliers, at a larger and slower
  graph), then to the int8 LLM; its flow and HiFT graphs are the `cpu` target's (the same files when both targets
  are built).
* `gpu-fp16`: every graph but the HiFT source in fp16 with fp32 islands (norms, softmax, residual stream, time
  embedding, exp / iSTFT) and fp32 graph inputs and outputs, so the runtime feeds the same arrays.
* `trt-int8`: explicit symmetric QDQ for TensorRT (int8 weights per output channel, activations per tensor, zero
  points 0) on MatMul / Conv / Gemm, fp16 elsewhere; TensorRT cannot be installed on the build host, so these graphs
  are validated with ONNX Runtime CPU.

`INT8_EXCLUDE` keeps the time embedding, the f0 predictor, the STFT / iSTFT and the speech-token head out of int8
(the cpu targets quantize the head all the same: the note at `CPU_LLM_METHOD`);
`FP32_NAMES` are the fp32 islands of the fp16 graphs. The transforms themselves are in precision_transforms.py,
the ladder walk under the quality gates in precision.py.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping, Sequence

import numpy as np
import onnx

from cosyedge.quantize.cosyvoice2.attention_fusion import fuse_attention
from cosyedge.quantize.cosyvoice2.empty_inputs import drop_empty_inputs
from cosyedge.quantize.cosyvoice2.llm_row_int8 import int8_rows_dynamic
from cosyedge.quantize.cosyvoice2.llm_packing import pack_products
from cosyedge.quantize.cosyvoice2.llm_shared_kv import shared_kv_llm, supports_shared_kv
from cosyedge.quantize.cosyvoice2.llm_skip_norm import fuse_skip_norms
from cosyedge.quantize.cosyvoice2.mish_rewrite import mish_by_exp
from cosyedge.quantize.cosyvoice2.precision_transforms import (QUANTIZED_OPS, int8_table_rows,
                                                               int8_weights_dynamic, name_matches, nbits_weights,
                                                               static_int8_qdq, to_fp16, unsigned_activations)

# The cpu LLM's int8 weight products. "dynamic_rows" (llm_row_int8.py): int8 weights per column, each activation row
# quantized on its own for ONNX Runtime's integer kernel, so the rows of a decode step batched across requests stay
# exactly independent; measured at full size with the shared cache against
# "matmul_nbits" (weight-only MatMulNBits 8-bit, blocks of 128): prefill 141-151 against 327-351 ms, a 4-row step
# 21-23 against 28-30 ms, 377 against 416 MB, a lone row's step 17.8-18.1 against 16.4-17.4 ms. ORT's own dynamic int8
# (one activation scale per call) is not offered: one request's rows would change another's.
CPU_LLM_METHOD = "dynamic_rows"
# The speech-token head (`llm_decoder`, kept float by INT8_EXCLUDE on the other targets) is row int8 on the cpu
# targets too, after the 4-bit layers on cpu-int4: its float32 weight (22.4 MB at full size) was the largest float
# tensor left in the graph. Measured on the full-size CosyVoice2-0.5B cpu LLM: session 384 -> 368 MB, the gate's mean
# KL 3.9e-5 -> 5.1e-5 (threshold 0.05), decisive top-1 agreement 1.0 either way, decode time unchanged.
# Inputs only the CPU runtime feeds: the estimator's int8 prompt state (flow_export.py), empty by default. The
# TensorRT-facing graphs (fp16, trt-int8 QDQ) drop them (empty_inputs.py): their I/O stays float32 / int64.
CPU_ONLY_INPUTS = ("past_hidden_q", "past_hidden_scale")
CPU_LLM_METHODS = {"matmul_nbits": nbits_weights, "dynamic_rows": int8_rows_dynamic}
# The cpu flow estimator: ORT dynamic int8 on its constant-weight MatMuls (MatMulInteger with activations quantized
# per call, fused to DynamicQuantizeMatMul by ORT), measured 1.33x faster per 250-token call than the static QDQ
# graph at full size (whose unfused DequantizeLinear nodes eat the int8 gain); attention products and convolutions
# stay fp32 (dynamic int8 attention was slower: quantizing the T x T scores each call costs more than it saves).
CPU_FLOW_DYNAMIC = True

# Node names (regular expressions, searched) kept out of int8 per graph: the time embedding of the estimator with
# its per-block time projections (`mlp`) and the final projection, the speech-token head of the LLM, the f0
# predictor / source of HiFT, the DFT-basis STFT / iSTFT convolutions (top-level `/Conv`, `/ConvTranspose*`) and
# the log-magnitude projection before the exp.
INT8_EXCLUDE: dict[str, tuple[str, ...]] = {
    "llm": (r"^/llm_decoder/",),
    "flow_encoder": (r"^/spk_embed_affine_layer/", r"^/encoder/embed/", r"^/encoder/up_embed/"),
    "flow_estimator": (r"/time_mlp/", r"/time_embeddings", r"/mlp/", r"^/estimator/final_proj/"),
    "hift_source": (r".",),
    "hift_decoder": (r"^/Conv$", r"^/ConvTranspose", r"^/conv_post/"),
}
# Per-graph name patterns for the fp32 islands of an fp16 graph beyond precision_transforms.FP32_OPS: RMSNorm /
# LayerNorm subgraphs, the LLM residual stream (layer-level Adds), rotary tables, the estimator time embedding,
# HiFT's Snake reciprocal and the iSTFT tail.
TOP_LEVEL = r"^/[A-Za-z]+(_\d+)?$"    # graph-level glue: masks, positions, rotary tables, output picks
FP32_NAMES: dict[str, tuple[str, ...]] = {
    "llm": (TOP_LEVEL, r"norm", r"^/layers\.\d+/Add(_\d+)?$", r"^/llm_decoder/"),
    "flow_encoder": (TOP_LEVEL, r"norm", r"^/encoder/embed/", r"^/encoder/up_embed/", r"^/spk_embed_affine_layer/",
                     r"^/encoder/[A-Za-z]+(_\d+)?$"),
    "flow_estimator": (TOP_LEVEL, r"norm", r"/time_mlp/", r"/time_embeddings", r"^/estimator/[A-Za-z]+(_\d+)?$",
                       r"^/estimator/final_proj/"),
    "hift_source": (r".",),
    "hift_decoder": (TOP_LEVEL, r"^/conv_post/"),
}


@dataclass(frozen=True)
class GraphRules:
    """A model family's node-name rules per graph: the int8 exclusions and the fp32 islands of fp16 graphs (the
    graph names and ladders are shared; node names differ, e.g. CosyVoice3's DiT estimator)."""
    int8_exclude: Mapping[str, tuple[str, ...]]
    fp32_names: Mapping[str, tuple[str, ...]]
    # graphs whose cpu int8 is dynamic (weights quantized, activations per call: no calibration); the others but
    # the LLM's (weight-only) are static QDQ, calibrated
    dynamic_int8: frozenset[str] = frozenset()
    # graphs whose cpu int8 variant gets ONNX Runtime's fused attention after quantization (attention_fusion.py:
    # the CPU kernel's MultiHeadAttention, flash path when unmasked); other targets keep the exported attention
    fused_attention: frozenset[str] = frozenset()
    # LLM graphs whose cpu variants (int8 / int4) take the shared key/value cache contract (llm_shared_kv.py:
    # GroupQueryAttention writing into a preallocated cache in place) where the kernel supports the head size, their
    # residual sums fused with the norms after them (llm_skip_norm.py) and sibling products packed (llm_packing.py)
    shared_kv: frozenset[str] = frozenset()
    # graphs kept fp32 at every rung of the cpu targets (no calibration-free int8 transform in this family; the cpu
    # ladder's int8 flow rung quantizes the flow encoder only where `dynamic_int8` has it)
    cpu_fp32: frozenset[str] = frozenset()
    # the exclusions of a `dynamic_int8` graph where they differ from `int8_exclude` (activations quantized per
    # call need no calibrated range, so some products kept float for static QDQ can be int8 there)
    dynamic_int8_exclude: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    # graphs whose cpu int8 variant gathers its large embedding tables from int8 rows (precision_transforms.
    # int8_table_rows): the session holds a quarter of each table
    int8_tables: frozenset[str] = frozenset()


# The cpu estimator's time MLPs (`time_mlp` and each block's `mlp`: 19 MB of float32 weights at full size, one
# [2, 1024] row pair per call) are dynamic int8 too. Full size: the graph 111 -> 96 MB, the flow gate's mel cosine
# 0.999977 -> 0.999982 and relative L2 0.0068 -> 0.0060 (random weights).
CV2_RULES = GraphRules(INT8_EXCLUDE, FP32_NAMES, frozenset({"flow_encoder", *(("flow_estimator",) if CPU_FLOW_DYNAMIC
                                                                                else ())}),
                       fused_attention=frozenset({"flow_estimator"}), shared_kv=frozenset({"llm"}),
                       dynamic_int8_exclude={"flow_estimator": (r"/time_embeddings", r"^/estimator/final_proj/")},
                       int8_tables=frozenset({"flow_encoder"}))


def fp32_island(graph_name: str, quantized: bool = False, rules: GraphRules = CV2_RULES
                ) -> Callable[[onnx.NodeProto], bool]:
    """keep_fp32 predicate of `graph_name`; with `quantized`, QDQ-quantized ops also stay fp32 (their DQ outputs
    are float32 in opset 17, and TensorRT fuses DQ -> op -> Q into one int8 kernel either way)."""
    patterns = rules.fp32_names.get(graph_name, ())

    def keep(node: onnx.NodeProto) -> bool:
        return name_matches(node.name, patterns) or (quantized and node.op_type in QUANTIZED_OPS)

    return keep


@dataclass(frozen=True)
class Variant:
    """One graph of one target at one precision: the bundle component (name, precision) it is stored as, and for
    4-bit weights their block size where a rung sets one (0: NBITS_BLOCKS[4])."""
    graph: str
    component: str
    precision: str
    block: int = 0

    @property
    def work_name(self) -> str:
        """The file it is built as: rungs of one component and precision (4-bit blocks) do not overwrite each
        other's graph while the ladder walks."""
        return f"{self.component}.{self.precision}{f'.b{self.block}' if self.block else ''}.onnx"


def variant(target: str, graph: str, precision: str, block: int = 0) -> Variant:
    """Component naming: fp32/fp16 graphs and cpu int8 / int4 graphs keep the graph name; trt-int8 QDQ graphs are
    `trt_<graph>` (they differ from the cpu int8 graphs of the same name and precision)."""
    if target == "trt-int8" and precision == "int8":
        return Variant(graph, f"trt_{graph}", precision)
    return Variant(graph, graph, precision, block)


def uncalibrated(graph: str, rules: GraphRules = CV2_RULES) -> bool:
    """Whether the cpu int8 graph of `graph` is quantized without calibration inputs (weights-only or dynamic)."""
    return graph in STAGE_GRAPHS["llm"] or graph in rules.dynamic_int8


def _without_cpu_inputs(fp32: Path) -> onnx.ModelProto | None:
    """The graph `fp32` without CPU_ONLY_INPUTS, or None where it has none (then nothing but its inputs is read:
    the LLM's external weights never are)."""
    inputs = {i.name for i in onnx.load(str(fp32), load_external_data=False).graph.input}
    if not inputs & set(CPU_ONLY_INPUTS):
        return None
    return drop_empty_inputs(onnx.load(str(fp32)), CPU_ONLY_INPUTS)


def build_variant(v: Variant, fp32: Path, dst: Path, calibration: Sequence[dict[str, np.ndarray]] | None,
                  cpu_llm_method: str = CPU_LLM_METHOD, rules: GraphRules = CV2_RULES) -> Path:
    """Write the graph of variant `v` from its fp32 export `fp32` into `dst` (node rules of the family `rules`)."""
    exclude = rules.int8_exclude.get(v.graph, ())
    if v.precision == "fp16":
        stripped = _without_cpu_inputs(fp32)
        return to_fp16(fp32 if stripped is None else stripped, dst, fp32_island(v.graph, rules=rules))
    if v.precision not in ("int4", "int8") or (v.precision == "int4" and v.graph not in STAGE_GRAPHS["llm"]):
        raise ValueError(f"no transform of {v.graph} to {v.precision}")
    if v.component == v.graph and v.graph in STAGE_GRAPHS["llm"]:     # the cpu targets' LLM: weight-only
        source = fp32
        if v.graph in rules.shared_kv and supports_shared_kv(fp32):
            source = dst.with_name(f"{dst.stem}.kv32.onnx")
            pack_products(fuse_skip_norms(shared_kv_llm(fp32))[0], source)
        if v.precision == "int4":
            nbits_weights(source, dst, exclude, bits=4, block=v.block or None)
            int8_rows_dynamic(dst, dst)  # the speech-token head, the one float product left (CPU_LLM_METHOD note)
        else:
            CPU_LLM_METHODS[cpu_llm_method](source, dst, ())  # the head too (CPU_LLM_METHOD note)
        if source != fp32:
            source.unlink()
        return dst
    if v.component == v.graph:       # the cpu int8 graph
        if v.graph in rules.dynamic_int8:
            int8_weights_dynamic(fp32, dst, rules.dynamic_int8_exclude.get(v.graph, exclude))
        else:
            unsigned_activations(static_int8_qdq(fp32, dst, calibration or (), exclude), dst)
        if v.graph in rules.fused_attention:
            fuse_attention(dst, dst)
        if v.graph in rules.int8_tables:
            int8_table_rows(dst, dst)
        mish_by_exp(dst, dst)  # ORT's CPU Softplus is scalar (mish_rewrite.py); a graph without Mish is unchanged
        return dst
    qdq = dst.with_name(f"{dst.stem}.qdq32.onnx")
    stripped, source = _without_cpu_inputs(fp32), fp32
    if stripped is not None:  # written here beside dst, as qdq, and removed once quantized
        source = dst.with_name(f"{dst.stem}.io32.onnx")
        onnx.save(stripped, str(source))
    static_int8_qdq(source, qdq, calibration or (), exclude)
    if stripped is not None:
        source.unlink()
    to_fp16(qdq, dst, fp32_island(v.graph, quantized=True, rules=rules))
    qdq.unlink()
    return dst


# Per target: the precision ladder of each stage, tried in order (the last one is the safe fallback), and the
# graphs of each stage that change precision (the others stay fp32).
STAGE_GRAPHS = {"llm": ("llm",), "flow": ("flow_encoder", "flow_estimator"),
                "hift": ("hift_source", "hift_decoder")}
# shared by cpu and cpu-int4. The flow's first rung has the encoder in int8 too; `int8-estimator` keeps the encoder
# fp32 (a stage rung, not a graph precision: RUNG_PRECISION), so a release whose end-to-end gate cannot take the int8
# encoder still keeps the int8 estimator.
_CPU_FLOW_HIFT = {"flow": ("int8", "int8-estimator", "fp32"), "hift": ("int8", "fp32")}
LADDERS: dict[str, dict[str, tuple[str, ...]]] = {
    "cpu": {"llm": ("int8", "fp32"), **_CPU_FLOW_HIFT},
    "cpu-int4": {"llm": ("int4", "int4-b32", "int8", "fp32"), **_CPU_FLOW_HIFT},
    "gpu-fp16": {"llm": ("fp16", "fp32"), "flow": ("fp16", "fp32"), "hift": ("fp16", "fp32")},
    "trt-int8": {"llm": ("int8", "fp16", "fp32"), "flow": ("int8", "fp16", "fp32"), "hift": ("int8", "fp16", "fp32")},
}
# Graphs that stay fp32 although their stage is quantized (cost too small or precision-critical).
_CPU_KEEP_FP32 = {"int8": frozenset({"hift_source"}), "int8-estimator": frozenset({"flow_encoder"})}
RUNG_PRECISION = {"int8-estimator": "int8", "int4-b32": "int4"}     # stage rung -> its quantized graphs' precision
RUNG_BLOCK = {"int4-b32": 32}                   # stage rung -> the block size of its 4-bit weights
# Rank of a stage rung for the end-to-end walk (lower = less precise, stepped down first).
RUNG_ORDER = {"int4": 0, "int8": 0, "int8-estimator": 0.5, "fp16": 1, "fp32": 2}
KEEP_FP32: dict[str, dict[str, frozenset[str]]] = {
    "cpu": _CPU_KEEP_FP32,
    "cpu-int4": _CPU_KEEP_FP32,
    "gpu-fp16": {"fp16": frozenset({"hift_source"})},
    "trt-int8": {"int8": frozenset({"hift_source"}), "fp16": frozenset({"hift_source"})},
}
# A stage of the cpu target that may silently stay fp32 when int8 misses the gate (HiFT: int8 only if it is fine).
OPTIONAL_INT8 = {"cpu": frozenset({"hift"}), "cpu-int4": frozenset({"hift"})}
# Targets whose int8 LLM is built by `CPU_LLM_METHOD` (recorded as `llm_int8` in the manifest).
CPU_TARGETS = ("cpu", "cpu-int4")
# For trt-int8 the flow encoder is fp16 (it runs once per request; its int8 gain is small).
INT8_AS_FP16 = {"trt-int8": frozenset({"flow_encoder"})}


def stage_variants(target: str, stage: str, precision: str, rules: GraphRules = CV2_RULES) -> list[Variant]:
    """The graphs of `stage` for `target` at stage precision `precision` (node rules of the family `rules`)."""
    out = []
    for graph in STAGE_GRAPHS[stage]:
        p = RUNG_PRECISION.get(precision, precision)
        if graph in KEEP_FP32.get(target, {}).get(precision, frozenset()) or \
                (target in CPU_TARGETS and graph in rules.cpu_fp32):
            p = "fp32"
        elif p == "int8" and graph in INT8_AS_FP16.get(target, frozenset()):
            p = "fp16"
        out.append(variant(target, graph, p, RUNG_BLOCK.get(precision, 0) if p == "int4" else 0))
    return out
