"""Seeded noise inside a VITS graph: its random nodes become a counter-based generator fed by a `seed` input.

Piper exports draw their noise with RandomNormalLike, which no seed reaches, so the same request gave different
audio on every call. Each random node is replaced by nodes that compute, for every element of its output,
a standard normal value from (seed, node, element index) alone:

- counter = seed << 32 | node << 28 | element index within the batch row (each row has its own seed, so a row's
  noise does not depend on the rows beside it);
- u = Squares(counter): Widynski's counter-based generator ("Squares: a fast counter-based RNG", 2020), four
  rounds of x*x + (y or z) and a 32-bit rotation of the 64-bit word, the top 32 bits out. It needs only
  uint64 Mul, Add and BitShift, which ONNX Runtime's CPU provider runs at the voices' opset (15); the rotation
  is a sum because its two shifted halves share no bit;
- two consecutive u -> two normals (Box-Muller: radius from the first, angle from the second).

The key is fixed, with the properties the paper asks of a key (odd; no hex digit repeated within either half).
One row holds at most 2**28 elements per node (for the flow's 192 channels: 1.4 M frames, 4 hours of audio).
"""
from __future__ import annotations

import math

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from cosyedge.device.errors import ReleaseError

SEED_INPUT = "seed"
KEY = 0x8B5AD4CEF2A5C7E3
_REPLACED = ("RandomNormalLike", "RandomNormal")
_REFUSED = ("RandomUniform", "RandomUniformLike", "Multinomial", "Bernoulli")
_MAX_NODES = 16  # bits 28-31 of the counter
_INT64_MAX = 2**63 - 1


class _Nodes:
    """Nodes and constants of one replaced random node, each named under its own prefix."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.nodes: list[onnx.NodeProto] = []
        self.constants: list[onnx.TensorProto] = []

    def const(self, name: str, value: object, dtype: type) -> str:
        tensor = numpy_helper.from_array(np.array(value, dtype=dtype), f"{self.prefix}{name}")
        self.constants.append(tensor)
        return tensor.name

    def op(self, op_type: str, inputs: list[str], output: str | None = None, **attrs: object) -> str:
        out = output or f"{self.prefix}{op_type}_{len(self.nodes)}"
        self.nodes.append(helper.make_node(op_type, inputs, [out], name=out, **attrs))
        return out


def _normal(nodes: _Nodes, shape: str, stream: int, output: str, mean: float, scale: float) -> None:
    """Nodes computing `output`: standard normals of `shape` (int64 [rows, ...]) from the seed input and `stream`."""
    n = nodes
    one, two = n.const("one", [1], np.int64), n.const("two", [2], np.int64)
    numel = n.op("ReduceProd", [n.op("Slice", [shape, one, n.const("end", [_INT64_MAX], np.int64)])], keepdims=1)
    count = n.op("Mul", [n.op("Div", [n.op("Add", [numel, one]), two]), two])  # even: normals come in pairs
    index = n.op("Range", [n.const("zero", 0, np.int64), n.op("Squeeze", [count]), n.const("step", 1, np.int64)])
    shift = n.const("shift", 32, np.uint64)
    row_seed = n.op("Cast", [n.op("Unsqueeze", [SEED_INPUT, one])], to=TensorProto.UINT64)  # [rows, 1]
    counter = n.op("Add", [n.op("BitShift", [row_seed, shift], direction="LEFT"),
                           n.op("Add", [n.op("Cast", [index], to=TensorProto.UINT64),
                                        n.const("stream", stream << 28, np.uint64)])])
    key = n.const("key", KEY, np.uint64)

    def rotate(x: str) -> str:
        return n.op("Add", [n.op("BitShift", [x, shift], direction="RIGHT"),
                            n.op("BitShift", [x, shift], direction="LEFT")])

    y = n.op("Mul", [counter, key])
    z = n.op("Add", [y, key])
    x = rotate(n.op("Add", [n.op("Mul", [y, y]), y]))
    x = rotate(n.op("Add", [n.op("Mul", [x, x]), z]))
    x = rotate(n.op("Add", [n.op("Mul", [x, x]), y]))
    bits = n.op("BitShift", [n.op("Add", [n.op("Mul", [x, x]), z]), shift], direction="RIGHT")
    uniform = n.op("Mul", [n.op("Add", [n.op("Cast", [bits], to=TensorProto.FLOAT), n.const("half", 0.5, np.float32)]),
                           n.const("scale32", 2.0**-32, np.float32)])  # (0, 1]: the logarithm stays finite
    pairs = n.op("Reshape", [uniform, n.const("pairs", [0, -1, 2], np.int64)])
    first, second = f"{n.prefix}first", f"{n.prefix}second"
    n.nodes.append(helper.make_node("Split", [pairs], [first, second], name=f"{n.prefix}split", axis=2))
    radius = n.op("Sqrt", [n.op("Mul", [n.op("Log", [first]), n.const("minus2", -2.0, np.float32)])])
    angle = n.op("Mul", [second, n.const("tau", 2 * math.pi, np.float32)])
    normals = n.op("Concat", [n.op("Mul", [radius, n.op("Cos", [angle])]),
                              n.op("Mul", [radius, n.op("Sin", [angle])])], axis=2)
    flat = n.op("Slice", [n.op("Reshape", [normals, n.const("rows", [0, -1], np.int64)]),
                          n.const("start", [0], np.int64), numel, one])
    if mean == 0.0 and scale == 1.0:
        n.op("Reshape", [flat, shape], output)
        return
    shaped = n.op("Reshape", [flat, shape])
    n.op("Add", [n.op("Mul", [shaped, n.const("sd", scale, np.float32)]), n.const("mean", mean, np.float32)], output)


def seed_random_nodes(model: onnx.ModelProto) -> int:
    """Replace the model's random normal nodes, in place, by the seeded generator and add the `seed` input
    (int64 [batch_size], one seed per row). Returns how many nodes were replaced."""
    graph = model.graph
    refused = sorted({node.op_type for node in graph.node if node.op_type in _REFUSED})
    if refused:
        raise ReleaseError(f"voice model: random op {refused[0]} is not supported (only RandomNormal[Like])")
    random = [node for node in graph.node if node.op_type in _REPLACED]
    if len(random) > _MAX_NODES:
        raise ReleaseError(f"voice model: {len(random)} random nodes; at most {_MAX_NODES} can be seeded")
    rebuilt: list[onnx.NodeProto] = []
    constants: list[onnx.TensorProto] = []
    stream = 0
    for node in graph.node:
        if node.op_type not in _REPLACED:
            rebuilt.append(node)
            continue
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        if attrs.get("dtype", TensorProto.FLOAT) != TensorProto.FLOAT:
            raise ReleaseError(f"voice model: {node.name} draws {TensorProto.DataType.Name(attrs['dtype'])}; "
                               "only float noise can be seeded")
        nodes = _Nodes(f"cosyedge_noise{stream}/")
        if node.op_type == "RandomNormal":
            shape = nodes.const("shape", list(attrs["shape"]), np.int64)
        else:
            shape = nodes.op("Shape", [node.input[0]])
        _normal(nodes, shape, stream, node.output[0], float(attrs.get("mean", 0.0)), float(attrs.get("scale", 1.0)))
        rebuilt.extend(nodes.nodes)
        constants.extend(nodes.constants)
        stream += 1
    del graph.node[:]
    graph.node.extend(rebuilt)
    graph.initializer.extend(constants)
    graph.input.append(helper.make_tensor_value_info(SEED_INPUT, TensorProto.INT64, ["batch_size"]))
    return stream
