"""Packed weight products for the shared-cache LLM graphs (llm_shared_kv.py): the products that read one activation
become one product with their weights side by side.

Why: a decode step is one row, so each weight product is one kernel call whose fixed cost (dispatch, the thread
pool's hand-off, quantizing the row at 4 bits) is paid per product, not per weight. Qwen2's key and value
products are 896 -> 128 at full size, an eighth of the query product's weights, yet each cost about half as much
as it in a 4-bit decode step; the MLP's gate and up products read the same row twice. Two rewrites:

* each GroupQueryAttention's query, key and value products (`[Add(bias,] MatMul(x, W)[)]`, one x) become one
  MatMul (and one bias Add) feeding the kernel's packed-QKV input (query = [q | k | v], key and value empty);
* any other set of MatMuls with constant 2-D weights reading the same activation (Qwen2's gate and up) becomes one
  MatMul and a Split that gives each old output back.

Every output column is the same dot product over the same row as before, so results equal the unpacked graph
within fp32 round-off (tests/quantize/test_llm_shared_kv.py), and the weight-only quantizers that run after this
(4-bit blocks along K, int8 per column) quantize each column exactly as they would have.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

from cosyedge.quantize.cosyvoice2.graph_index import GraphIndex, finish, prune


def _single_reader(g: GraphIndex, name: str) -> bool:
    return len(g.consumers.get(name, [])) == 1 and name not in {o.name for o in g.graph.output}


def _weight(g: GraphIndex, node: onnx.NodeProto) -> onnx.TensorProto | None:
    """The constant 2-D fp32 weight [K, N] of MatMul `node` (not decoded), or None."""
    init = g.inits.get(node.input[1]) if node.op_type == "MatMul" else None
    return init if init is not None and init.data_type == onnx.TensorProto.FLOAT and len(init.dims) == 2 else None


def _projection(g: GraphIndex, name: str) -> tuple[onnx.NodeProto, np.ndarray, np.ndarray | None] | None:
    """(MatMul, W, bias) if `name` = Add(MatMul(x, W), bias) or MatMul(x, W), each read only on the way."""
    node, bias = g.producer.get(name), None
    if node is not None and node.op_type == "Add":
        for i in (0, 1):
            inner = g.producer.get(node.input[1 - i])
            if node.input[i] in g.inits and inner is not None and inner.op_type == "MatMul":
                bias = numpy_helper.to_array(g.inits[node.input[i]])
                if not _single_reader(g, inner.output[0]):
                    return None
                node = inner
                break
        else:
            return None
    if node is None or not _single_reader(g, name):
        return None
    w = _weight(g, node)
    if w is None or (bias is not None and bias.shape != (w.dims[1],)):
        return None
    return node, numpy_helper.to_array(w), bias


def _splice(graph: onnx.GraphProto, before: dict[str, list[onnx.NodeProto]], replaced: set[str],
            weights: list[onnx.TensorProto]) -> None:
    """Insert `before[first output]` ahead of each node, drop the nodes whose first output is `replaced`, add
    `weights` and prune what no longer feeds an output."""
    nodes = []
    for node in graph.node:
        nodes.extend(before.get(node.output[0], []))
        if node.output[0] not in replaced:
            nodes.append(node)
    del graph.node[:]
    graph.node.extend(nodes)
    graph.initializer.extend(weights)
    prune(graph)


def _pack_attention(g: GraphIndex) -> int:
    """The query, key and value products of each GroupQueryAttention -> one (module docstring); how many."""
    before: dict[str, list[onnx.NodeProto]] = {}
    weights: list[onnx.TensorProto] = []
    for node in g.graph.node:
        if node.op_type != "GroupQueryAttention" or len(node.input) < 3 or "" in node.input[:3]:
            continue
        parts = [_projection(g, name) for name in node.input[:3]]
        if any(p is None for p in parts) or len({p[0].input[0] for p in parts}) != 1 \
                or len({p[2] is None for p in parts}) != 1:
            continue
        prefix = node.name.rsplit("/", 1)[0] + "/qkv_proj"
        weights.append(numpy_helper.from_array(np.concatenate([p[1] for p in parts], axis=1), f"{prefix}.weight"))
        inserted = [helper.make_node("MatMul", [parts[0][0].input[0], f"{prefix}.weight"],
                                     [f"{prefix}/MatMul_output_0"], name=f"{prefix}/MatMul")]
        if parts[0][2] is not None:
            weights.append(numpy_helper.from_array(np.concatenate([p[2] for p in parts]), f"{prefix}.bias"))
            inserted.append(helper.make_node("Add", [inserted[0].output[0], f"{prefix}.bias"],
                                             [f"{prefix}/Add_output_0"], name=f"{prefix}/Add"))
        before[node.output[0]] = inserted
        node.input[0], node.input[1], node.input[2] = inserted[-1].output[0], "", ""
    _splice(g.graph, before, set(), weights)
    return len(before)


def _pack_siblings(g: GraphIndex) -> int:
    """Other MatMuls with constant weights of one K reading one activation -> MatMul + Split; how many groups."""
    siblings: dict[str, list[tuple[onnx.NodeProto, onnx.TensorProto]]] = {}
    for node in g.graph.node:
        w = _weight(g, node)
        if w is not None:
            siblings.setdefault(node.input[0], []).append((node, w))
    groups = [group for group in siblings.values() if len(group) > 1 and len({w.dims[0] for _, w in group}) == 1]
    before: dict[str, list[onnx.NodeProto]] = {}
    weights: list[onnx.TensorProto] = []
    for n, group in enumerate(groups):
        prefix = group[0][0].name.rsplit("/", 2)[0] + f"/packed_{n}"
        packed = np.concatenate([numpy_helper.to_array(w) for _, w in group], axis=1)
        weights += [numpy_helper.from_array(packed, f"{prefix}.weight"),
                    numpy_helper.from_array(np.array([w.dims[1] for _, w in group], np.int64), f"{prefix}.split")]
        before[group[0][0].output[0]] = [
            helper.make_node("MatMul", [group[0][0].input[0], f"{prefix}.weight"], [f"{prefix}/MatMul_output_0"],
                             name=f"{prefix}/MatMul"),
            helper.make_node("Split", [f"{prefix}/MatMul_output_0", f"{prefix}.split"],
                             [node.output[0] for node, _ in group], name=f"{prefix}/Split", axis=-1)]
    _splice(g.graph, before, {node.output[0] for group in groups for node, _ in group}, weights)
    return len(groups)


def pack_products(src: Path | onnx.ModelProto, dst: Path | None = None) -> tuple[onnx.ModelProto, int, int]:
    """Rewrite `src` (module docstring). Returns the model (written to `dst` when given), the attention layers
    whose query, key and value were packed, and the other sibling groups packed."""
    model = onnx.load(str(src)) if not isinstance(src, onnx.ModelProto) else src
    attention = _pack_attention(GraphIndex(model))
    groups = _pack_siblings(GraphIndex(model))      # indexed again: the old query, key and value are gone
    return finish(model, dst), attention, groups
