"""Wide 1-D convolutions as 2-D ones of height 1 (device/vits/layout.py): the rewritten graph equals the one it
replaces within fp32 round-off, for every attribute the voices use (dilation, stride, padding, groups, bias, a
weight shared by two nodes), narrow ones stay 1-D; on the default voice the blocked layout runs at up to two
threads and is off beyond (seen in the output bits, which the layout changes). The voice against piper-tts is in
test_piper_oracle.py."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from cosyedge.device.engine import Engine
from cosyedge.device.sessions import SessionConfig
from cosyedge.device.vits.layout import wide_convolutions_as_2d


def _model() -> onnx.ModelProto:
    rng = np.random.default_rng(0)

    def weight(name: str, *shape: int) -> onnx.TensorProto:
        return numpy_helper.from_array(rng.standard_normal(shape).astype(np.float32) * 0.1, name)

    nodes = [
        helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], kernel_shape=[5], dilations=[3], pads=[6, 6]),
        helper.make_node("LeakyRelu", ["c1"], ["r1"], alpha=0.1),
        helper.make_node("Conv", ["r1", "w2"], ["c2"], kernel_shape=[3], strides=[2], pads=[1, 0], group=4),
        helper.make_node("Conv", ["c2", "w3"], ["c3"], kernel_shape=[1]),  # narrow: stays 1-D
        helper.make_node("Conv", ["c3", "w4", "b1"], ["y"], kernel_shape=[5], dilations=[3], pads=[6, 6]),
        helper.make_node("LeakyRelu", ["c3"], ["r3"], alpha=0.1),
        helper.make_node("Conv", ["r3", "w4", "b1"], ["z"], kernel_shape=[5], dilations=[3], pads=[6, 6]),  # shared
    ]
    graph = helper.make_graph(nodes, "convs", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 16, "t"])],
                              [helper.make_tensor_value_info(o, TensorProto.FLOAT, [1, 128, "u"]) for o in "yz"],
                              [weight("w1", 128, 16, 5), weight("b1", 128), weight("w2", 128, 32, 3),
                               weight("w3", 8, 128, 1), weight("w4", 128, 8, 5)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 15)])
    model.ir_version = 8
    return model


def test_the_2d_graph_equals_the_1d_graph_within_round_off():
    original, rewritten = _model(), _model()
    assert wide_convolutions_as_2d(rewritten) == 4  # not the 8-channel one
    onnx.checker.check_model(rewritten)
    dims = {t.name: len(t.dims) for t in rewritten.graph.initializer}
    assert dims["w3"] == 3 and "w1" not in dims and "w4" not in dims and dims["w4/2d"] == 4  # shared: one twin
    x = np.random.default_rng(1).standard_normal((1, 16, 101)).astype(np.float32)
    for threads in (1, 2):
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        ours, theirs = (ort.InferenceSession(m.SerializeToString(), options, providers=["CPUExecutionProvider"])
                        .run(None, {"x": x}) for m in (rewritten, original))
        for a, b in zip(ours, theirs):
            assert a.shape == b.shape == (1, 128, 50)
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * np.abs(b).max())


@pytest.mark.parametrize("threads, blocked", [(2, True), (4, False)])
def test_the_blocked_layout_runs_up_to_two_threads(default_bundle_path: Path, threads: int, blocked: bool):
    engine = Engine.load(default_bundle_path, precision="fp32", warmup=False,
                         sessions=SessionConfig(providers=("cpu",), intra_op_threads=threads))
    segment = engine.segments("Please keep your belongings with you.")[0]
    wave = engine.pipeline.synthesize([segment], engine.options(deterministic=True, seed=1))[0]
    graph = str(default_bundle_path / engine.bundle.component("vits", "fp32").file)
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    feeds = {"input": np.array([segment.ids]), "input_lengths": np.array([len(segment.ids)]),
             "scales": np.array([0, 1, 0], np.float32), "seed": np.array([1])}
    runs = {disabled: ort.InferenceSession(graph, options, providers=["CPUExecutionProvider"],
                                           disabled_optimizers=["NchwcTransformer"] if disabled else None)
            .run(["output"], feeds)[0].reshape(-1)[: wave.size] for disabled in (False, True)}
    assert not np.array_equal(runs[False], runs[True])  # the layout shows in the bits
    assert np.array_equal(wave, runs[not blocked])
