"""Residual sums and the RMS norms after them in one node, for the shared-cache LLM graphs (llm_shared_kv.py).

Why: ONNX Runtime fuses the exported RMS norm (Pow, ReduceMean, Add eps, Sqrt, Div, Mul, Mul weight) into its
SimplifiedLayerNormalization when it loads the graph, but not the residual Add before it, whose sum the next
residual Add reads as well. A one-row decode step pays a kernel call per node, so each of Qwen2's 48 residual
sums cost a call of its own. `com.microsoft` SkipSimplifiedLayerNormalization(a, b, weight) computes a + b, the
norm of the sum, and hands the sum on (its fourth output), in one call.

Equal to the unfused graph within fp32 round-off (tests/quantize/test_llm_shared_kv.py). A norm whose input is not
the sum of two computed tensors (the first layer's, over the input embeddings) is left for ONNX Runtime's own fusion.
"""
from __future__ import annotations

from pathlib import Path

import onnx
from onnx import helper

from cosyedge.quantize.cosyvoice2.graph_index import GraphIndex, finish, prune, scalar
from cosyedge.quantize.cosyvoice2.llm_shared_kv import MS_DOMAIN


def _is_constant(g: GraphIndex, name: str) -> bool:
    """An initializer, a Constant or the exporter's Identity alias of an initializer. (`GraphIndex.value` is not
    asked about computed tensors here: it would walk back through every residual branch of the network.)"""
    node = g.producer.get(name)
    return name in g.inits or (node is not None and (node.op_type == "Constant" or (
        node.op_type == "Identity" and node.input[0] in g.inits)))


def _constant(g: GraphIndex, name: str) -> float | None:
    """The value of a scalar constant (`_is_constant`); None for anything else."""
    return scalar(g, name) if _is_constant(g, name) else None


def _with_constant(g: GraphIndex, node: onnx.NodeProto | None, op: str) -> tuple[str, onnx.NodeProto] | None:
    """(the constant input, the other input's producer when it is an `op`) of a two-input node, in either order."""
    for i in (0, 1):
        other = g.node(node.input[1 - i], op) if node is not None else None
        if other is not None and _is_constant(g, node.input[i]):
            return node.input[i], other
    return None


def _rms_norm(g: GraphIndex, mul: onnx.NodeProto) -> tuple[str, str, float] | None:
    """(x, weight, eps) if `mul` = weight * (x / sqrt(mean(x^2, last axis) + eps)) as the export writes it."""
    found = _with_constant(g, mul, "Mul") if mul.op_type == "Mul" else None
    if found is None:
        return None
    weight, scaled_node = found
    for j in (0, 1):
        x, div = scaled_node.input[j], g.node(scaled_node.input[1 - j], "Div")
        if div is None or _constant(g, div.input[0]) != 1.0:
            continue
        sqrt = g.node(div.input[1], "Sqrt")
        eps_mean = _with_constant(g, g.node(sqrt.input[0], "Add") if sqrt is not None else None, "ReduceMean")
        if eps_mean is None:
            continue
        eps, mean = _constant(g, eps_mean[0]), eps_mean[1]
        pow_ = g.node(mean.input[0], "Pow")
        if eps is None or pow_ is None or pow_.input[0] != x or _constant(g, pow_.input[1]) != 2.0:
            continue
        axes = g.attr(mean, "axes") or (list(g.value(mean.input[1])) if len(mean.input) > 1
                                        and mean.input[1] in g.inits else None)
        rank = len(g.shapes.get(x) or []) or None    # unknown past the graph's contrib nodes
        if g.attr(mean, "keepdims", 1) == 1 and axes is not None and len(axes) == 1 \
                and (axes[0] == -1 or (rank is not None and axes[0] == rank - 1)):
            return x, weight, eps
    return None


def fuse_skip_norms(src: Path | onnx.ModelProto, dst: Path | None = None) -> tuple[onnx.ModelProto, int]:
    """Rewrite `src` (module docstring): returns the model (written to `dst` when given) and the norms fused."""
    model = onnx.load(str(src)) if not isinstance(src, onnx.ModelProto) else src
    g = GraphIndex(model)
    fused: dict[str, onnx.NodeProto] = {}       # the residual Add's output -> the node replacing it
    norms: set[str] = set()                      # the outputs of the norms fused (their old last Mul's)
    for node in g.graph.node:
        norm = _rms_norm(g, node)
        residual = g.node(norm[0], "Add") if norm is not None else None
        if residual is None or any(_is_constant(g, i) for i in residual.input):
            continue
        x, weight, eps = norm
        fused[x] = helper.make_node(
            "SkipSimplifiedLayerNormalization", [residual.input[0], residual.input[1], weight],
            [node.output[0], "", "", x], name=f"{node.name}/SkipSimplifiedLayerNormalization", domain=MS_DOMAIN,
            epsilon=eps)
        norms.add(node.output[0])
    nodes = [fused.get(node.output[0], node) for node in g.graph.node      # in the residual Add's place
             if node.output[0] not in norms]
    del g.graph.node[:]
    g.graph.node.extend(nodes)
    prune(g.graph)
    if fused and not any(o.domain == MS_DOMAIN for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid(MS_DOMAIN, 1))
    return finish(model, dst), len(fused)
