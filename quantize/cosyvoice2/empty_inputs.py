"""Graph rewrite: optional inputs whose default is empty (a 0-length axis) taken out of a graph, for graphs that
TensorRT builds. The flow estimator's int8 prompt state (`past_hidden_q` int8, `past_hidden_scale`;
flow_export.py) is a CPU-runtime saving: its frames are concatenated after the float past's. TensorRT graphs keep
float32 / int64 I/O (trt_int8.md), so the gpu-fp16 and trt-int8 estimators drop both inputs and the runtime feeds
them the float past (device/cosyvoice2/flow.py looks for the input).

What the rewrite knows of the export, and refuses otherwise: an empty input reaches only Shape (its static shape
becomes a constant) and chains of Gather / Cast / Mul / Expand / Unsqueeze / Reshape (their outputs are empty too),
which end in a Concat (the empty operand is dropped). The result equals the graph run with the defaults.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

from .graph_index import prune

# ops whose output is empty when their first (data) input is empty (Mul: either operand, by broadcasting)
_EMPTY_THROUGH = {"Gather", "Cast", "Mul", "Expand", "Unsqueeze", "Reshape"}


def drop_empty_inputs(model: onnx.ModelProto, names: tuple[str, ...]) -> onnx.ModelProto:
    """`model` without the overridable inputs `names` (each must default to an empty initializer); a name the graph
    lacks is skipped. Raises ValueError where an empty tensor reaches an op this rewrite does not know."""
    graph = model.graph
    inits = {t.name: t for t in graph.initializer}
    inputs = {i.name for i in graph.input}
    dropped = [n for n in names if n in inputs]
    if not dropped:
        return model
    empty: set[str] = set()
    for name in dropped:
        default = numpy_helper.to_array(inits[name]) if name in inits else None
        if default is None or default.size:
            raise ValueError(f"input {name!r} has no empty default")
        empty.add(name)
    nodes = []
    for node in graph.node:  # topological order: a tensor is marked empty before its consumers are seen
        reads = [i for i in node.input if i in empty]
        if not reads:
            nodes.append(node)
        elif node.op_type == "Shape" and node.input[0] in dropped:
            shape = numpy_helper.to_array(inits[node.input[0]]).shape
            nodes.append(helper.make_node("Constant", [], list(node.output), name=node.name,
                                          value=numpy_helper.from_array(np.array(shape, np.int64))))
        elif node.op_type in _EMPTY_THROUGH and (node.input[0] in empty or node.op_type == "Mul"):
            empty.update(node.output)
        elif node.op_type == "Concat" and len(reads) < len(node.input):
            node.input[:] = [i for i in node.input if i not in empty]
            nodes.append(node)
        else:
            raise ValueError(f"an empty input reaches {node.op_type} {node.name!r}")
    if any(o.name in empty for o in graph.output):
        raise ValueError("an empty input reaches a graph output")
    del graph.node[:]
    graph.node.extend(nodes)
    kept = [i for i in graph.input if i.name not in dropped]
    del graph.input[:]
    graph.input.extend(kept)
    prune(graph)
    return model


def drop_empty_inputs_file(src: Path, dst: Path, names: tuple[str, ...]) -> Path:
    onnx.save(drop_empty_inputs(onnx.load(str(src)), names), str(dst))
    return dst
