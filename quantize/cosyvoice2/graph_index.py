"""Read-only index of an ONNX graph for the build host's graph rewrites (attention_fusion.py, llm_shared_kv.py):
producers and consumers of every tensor, constants (static dimensions of a Shape included, so that shape
arithmetic such as SDPA's 1/sqrt(sqrt(D)) folds), inferred shapes, and the small helpers a rewrite needs to splice
nodes in (ordering, pruning, saving).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper


class GraphIndex:
    """Producer / consumer maps, constants and static shapes of one graph (read-only while matching)."""

    def __init__(self, model: onnx.ModelProto) -> None:
        self.graph = model.graph
        self.producer = {o: n for n in self.graph.node for o in n.output}
        self.consumers: dict[str, list[onnx.NodeProto]] = {}
        for node in self.graph.node:
            for name in node.input:
                self.consumers.setdefault(name, []).append(node)
        self.inits = {t.name: t for t in self.graph.initializer}
        inferred = onnx.shape_inference.infer_shapes(_weightless(model), data_prop=True).graph
        self.shapes: dict[str, list[int | None]] = {}
        for v in (*inferred.input, *inferred.value_info, *inferred.output):
            if v.type.tensor_type.HasField("shape"):
                self.shapes[v.name] = [d.dim_value if d.HasField("dim_value") else None
                                       for d in v.type.tensor_type.shape.dim]

    def node(self, name: str, op: str) -> onnx.NodeProto | None:
        node = self.producer.get(name)
        return node if node is not None and node.op_type == op else None

    def attr(self, node: onnx.NodeProto, name: str, default=None):
        for a in node.attribute:
            if a.name == name:
                return helper.get_attribute_value(a)
        return default

    def value(self, name: str) -> np.ndarray | None:
        """The value of `name` if it is a graph constant (static dimensions of a Shape count); else None."""
        if name in self.inits:
            return numpy_helper.to_array(self.inits[name])
        node = self.producer.get(name)
        if node is None:
            return None
        if node.op_type == "Constant":
            return numpy_helper.to_array(self.attr(node, "value")) if self.attr(node, "value") is not None else None
        if node.op_type == "Shape":
            dims = self.shapes.get(node.input[0])
            if dims is None:
                return None
            start, end = self.attr(node, "start", 0), self.attr(node, "end", len(dims))
            return _partial(dims[start:end])
        args = [self.value(i) if i else None for i in node.input]
        if args[0] is None or (node.op_type != "Slice" and any(a is None for a in args)):
            return None
        try:
            value = _evaluate(node, args, self)
        except TypeError:       # arithmetic on a dynamic dimension
            return None
        return value if value is None or value.dtype != object else _partial(list(value.reshape(-1)), value.shape)


def _partial(dims: list, shape: tuple[int, ...] | None = None) -> np.ndarray:
    """Shape values with their dynamic entries as None (object array); plain int64 once every entry is static, so
    that Slice / Gather can pick the static dimensions of a partly dynamic shape."""
    if all(d is not None for d in dims):
        return np.array(dims, np.int64).reshape(shape if shape is not None else (len(dims),))
    return np.array(dims, dtype=object).reshape(shape if shape is not None else (len(dims),))


_ARITHMETIC = {"Mul": np.multiply, "Div": np.divide, "Add": np.add, "Sub": np.subtract, "Pow": np.power}


def _evaluate(node: onnx.NodeProto, args: list, g: GraphIndex) -> np.ndarray | None:
    op = node.op_type
    if op in _ARITHMETIC:
        return _ARITHMETIC[op](args[0], args[1])
    if op == "Sqrt":
        return np.sqrt(args[0])
    if op == "Identity":       # the exporter's alias of a deduplicated constant
        return args[0]
    if op == "Reciprocal":
        return 1.0 / args[0]
    if op == "Cast":
        if args[0].dtype == object:
            return None
        return args[0].astype(helper.tensor_dtype_to_np_dtype(g.attr(node, "to")))
    if op == "Slice" and all(a is not None for a in args[:3]):
        data, starts, ends = args[:3]
        axes = args[3] if len(args) > 3 and args[3] is not None else range(len(starts))
        steps = args[4] if len(args) > 4 and args[4] is not None else [1] * len(starts)
        index = [slice(None)] * data.ndim
        for a, s, e, st in zip(axes, starts, ends, steps):
            index[int(a)] = slice(int(s), int(e), int(st))
        return data[tuple(index)]
    if op == "Gather":
        return np.take(args[0], args[1], axis=g.attr(node, "axis", 0))
    return None


def _weightless(model: onnx.ModelProto) -> onnx.ModelProto:
    """The graph with initializers as typed inputs (shape inference without copying full-size weights)."""
    graph = model.graph
    light = helper.make_model(helper.make_graph(
        graph.node, "shapes", [*graph.input, *(helper.make_tensor_value_info(t.name, t.data_type, list(t.dims))
                                               for t in graph.initializer)], graph.output),
        opset_imports=model.opset_import)
    light.ir_version = model.ir_version
    return light


def scalar(g: GraphIndex, name: str) -> float | None:
    value = g.value(name)
    return float(value.reshape(-1)[0]) if value is not None and value.size == 1 and value.dtype != object else None


def scaled(g: GraphIndex, name: str) -> tuple[str, float] | None:
    """(the tensor before an optional Mul / Div by a constant, that factor)."""
    node = g.producer.get(name)
    if node is not None and node.op_type in ("Mul", "Div"):
        for i, other in ((0, 1), (1, 0)):
            c = scalar(g, node.input[other])
            if c is not None and (node.op_type == "Mul" or i == 0):
                return node.input[i], (c if node.op_type == "Mul" else 1.0 / c)
    return name, 1.0


def heads(g: GraphIndex, name: str, perm: tuple[int, ...]) -> tuple[str, int, int] | None:
    """(x3, H, D) if `name` = Transpose(perm)(Reshape(x3, [B, S, H, D])) with constant H and D."""
    transpose = g.node(name, "Transpose")
    if transpose is None or tuple(g.attr(transpose, "perm", ())) != perm:
        return None
    reshape = g.node(transpose.input[0], "Reshape")
    if reshape is None:
        return None
    shape = g.value(reshape.input[1])
    if shape is None:
        concat = g.node(reshape.input[1], "Concat")
        tail = [g.value(i) for i in concat.input[-2:]] if concat is not None and len(concat.input) == 4 else [None]
        if any(t is None or t.size != 1 for t in tail):
            return None
        heads, dim = int(tail[0].reshape(-1)[0]), int(tail[1].reshape(-1)[0])
    elif shape.size == 4 and shape[2] > 0 and shape[3] > 0:
        heads, dim = int(shape[2]), int(shape[3])
    else:
        return None
    return reshape.input[0], heads, dim


def topological(nodes: list[onnx.NodeProto], g: GraphIndex) -> None:
    """Order `nodes` so that every input is produced before it is read (inserted bias nodes read tensors made
    after the first site)."""
    available = {i.name for i in g.graph.input} | {t.name for t in g.graph.initializer} | {""}
    pending, ordered = list(nodes), []
    while pending:
        rest = []
        for node in pending:
            reads = set(node.input) | outer_reads(node)
            if reads <= available:
                ordered.append(node)
                available.update(node.output)
            else:
                rest.append(node)
        if len(rest) == len(pending):
            raise ValueError("the graph rewrite left a cycle or a dangling input")
        pending = rest
    nodes[:] = ordered


def outer_reads(node: onnx.NodeProto) -> set[str]:
    reads: set[str] = set()
    for a in node.attribute:
        if a.type == onnx.AttributeProto.GRAPH:
            reads.update(i for n in a.g.node for i in n.input if i)
    return reads


def prune(graph: onnx.GraphProto) -> None:
    """Drop nodes and initializers that no longer feed a graph output."""
    needed = {o.name for o in graph.output}
    keep = []
    for node in reversed(graph.node):
        if any(o in needed for o in node.output):
            keep.append(node)
            needed.update(node.input)
            needed.update(outer_reads(node))
    del graph.node[:]
    graph.node.extend(reversed(keep))
    inits = [t for t in graph.initializer if t.name in needed]
    del graph.initializer[:]
    graph.initializer.extend(inits)
    values = [v for v in graph.value_info if v.name in needed]
    del graph.value_info[:]
    graph.value_info.extend(values)


def finish(model: onnx.ModelProto, dst: Path | None) -> onnx.ModelProto:
    if dst is not None:
        onnx.save(model, str(dst))
    return model
