"""The wide 1-D convolutions of a VITS graph as 2-D ones of height 1, so ONNX Runtime can run them in its blocked
(NCHWc) CPU layout, which it uses for 2-D convolutions only.

Each Conv whose weight is a rank-3 initializer with at least `WIDE` output channels becomes Unsqueeze(axis 2) ->
the same Conv on [batch, channels, 1, length] with an [out, in, 1, kernel] weight -> Squeeze(axis 2): the same
arithmetic in another order (92-101 dB SNR against the 1-D graph on the default voice, the same frame counts).

Why only the wide ones: MLAS splits an NCHWc convolution among threads by output rows times sets of four channel
blocks (64 channels with AVX-512), and a 1-D signal has one row, so a convolution of 64 channels or fewer runs on
one thread. The HiFi-GAN decoder's last stages (64 and 32 channels, the longest signals) are such convolutions:
in the blocked layout they were faster on one thread and slower on two. Measured on the default voice against
Piper's own graph (a loaded 2-core box; CPU time on one thread, the fastest of 10-12 interleaved rounds per
sentence on two): every convolution 2-D, -10 % on one thread but +9 % on two; those of >= 128 channels, -2 to
-5 % on one thread and -2 to -6 % on two. With more than two threads a 128-channel convolution has fewer channel
sets than threads, so `VitsPipeline` then turns the blocked layout off (`NchwcTransformer`) and the graph runs as
the 1-D one does (the same output bits).
"""
from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

WIDE = 128  # output channels: two 64-channel sets, one per thread of a two-thread session
NCHWC_THREADS_MAX = 2  # threads up to which every rewritten convolution still gives each thread a set
_AXIS = "cosyedge_layout/axis2"


def _attributes_2d(node: onnx.NodeProto) -> dict[str, object]:
    """The node's attributes for height 1: kernel 1, stride 1, dilation 1 and no padding along the new axis."""
    attrs: dict[str, object] = {}
    for attribute in node.attribute:
        value = helper.get_attribute_value(attribute)
        if attribute.name in ("kernel_shape", "strides", "dilations"):
            value = [1, *value]
        elif attribute.name == "pads":
            value = [0, value[0], 0, value[1]]
        attrs[attribute.name] = value
    return attrs


def wide_convolutions_as_2d(model: onnx.ModelProto, wide: int = WIDE) -> int:
    """Rewrite the model's 1-D convolutions of at least `wide` output channels in place; returns how many."""
    graph = model.graph
    weights = {t.name: t for t in graph.initializer}
    made: dict[str, str] = {}  # a 1-D weight -> its 2-D twin (a weight shared by several convolutions is one)
    rebuilt: list[onnx.NodeProto] = []
    count = 0
    for node in graph.node:
        weight = weights.get(node.input[1]) if node.op_type == "Conv" else None
        if weight is None or len(weight.dims) != 3 or weight.dims[0] < wide:
            rebuilt.append(node)
            continue
        if weight.name not in made:
            array = numpy_helper.to_array(weight)
            graph.initializer.append(numpy_helper.from_array(array[:, :, np.newaxis, :], f"{weight.name}/2d"))
            made[weight.name] = f"{weight.name}/2d"
        prefix = f"cosyedge_layout/{count}"
        rebuilt.append(helper.make_node("Unsqueeze", [node.input[0], _AXIS], [f"{prefix}/in"], name=f"{prefix}/in"))
        rebuilt.append(helper.make_node("Conv", [f"{prefix}/in", made[weight.name], *node.input[2:]],
                                        [f"{prefix}/out"], name=node.name or prefix, **_attributes_2d(node)))
        rebuilt.append(helper.make_node("Squeeze", [f"{prefix}/out", _AXIS], list(node.output), name=f"{prefix}/sq"))
        count += 1
    if not count:
        return 0
    del graph.node[:]
    graph.node.extend(rebuilt)
    graph.initializer.append(numpy_helper.from_array(np.array([2], dtype=np.int64), _AXIS))
    read = {name for node in graph.node for name in node.input}
    kept = [t for t in graph.initializer if t.name in read or t.name not in made]  # drop the 1-D weights
    del graph.initializer[:]
    graph.initializer.extend(kept)
    return count
