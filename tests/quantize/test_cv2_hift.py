"""CosyVoice2 HiFT vocoder against the official goldens (cosyvoice2-tiny/vectors/hift.npz, e2e.npz, stream.npz)
and its two ONNX graphs.

Tolerances (vectors/README.md): f0 atol 1e-3 Hz; decoder given a source atol 1e-4; source atol 5e-3.
Waveforms from mel with zero noise: criterion SNR > 40 dB (the README's alternative to atol 5e-3, chosen
because the official float32 phase rounding alone moves the golden waveforms by up to 4.5e-3 from a float64
run, so atol 5e-3 has no margin), plus a max-abs guard of 1e-2 against local glitches. ONNX Runtime vs the
torch module: f0 1e-3, source 5e-4, decoder 1e-4.
"""
from __future__ import annotations

import copy
import math
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
import torch.nn.functional as F

from cosyedge.device.errors import ReleaseError
from cosyedge.quantize.cosyvoice2.hift import HiFTConfig, HiFTGenerator, build_hift, build_hift_random, load_hift_state
from cosyedge.quantize.cosyvoice2.hift_export import export_hift
from cosyedge.quantize.cosyvoice2.release import Node, Release

F0_ATOL = 1e-3
SOURCE_ATOL = 5e-3
DECODE_ATOL = 1e-4
SPEECH_MIN_SNR_DB = 40.0
SPEECH_MAX_ABS = 1e-2
ONNX_SOURCE_ATOL = 5e-4
EXCITATION_ATOL = 1e-5
HEAVY = ("sft0_s0", "zero_shot0_s0", "cross_lingual0_s0", "instruct20_s0")
STANDARD_OPS = {"Abs", "Add", "Cast", "Clip", "Concat", "Constant", "ConstantOfShape", "Conv", "ConvTranspose",
                "Cos", "CumSum", "Div", "Elu", "Equal", "Exp", "Expand", "Floor", "Gather", "Greater", "Identity",
                "LeakyRelu", "MatMul", "Mul", "Pad", "Pow", "Reciprocal", "Reshape", "Shape", "Sin", "Slice",
                "Squeeze", "Sub", "Tanh", "Transpose", "Unsqueeze", "Where"}


@pytest.fixture(scope="module")
def vectors(golden_dir: Path) -> dict[str, dict[str, np.ndarray]]:
    root = golden_dir / "cosyvoice2-tiny" / "vectors"
    return {name: dict(np.load(root / f"{name}.npz")) for name in ("hift", "e2e", "stream")}


@pytest.fixture(scope="module")
def hift(release: Release) -> HiFTGenerator:
    return build_hift(release)


@pytest.fixture(scope="module")
def cases(vectors) -> list[str]:
    found = sorted(k.removesuffix("__mel_in") for k in vectors["hift"] if k.endswith("__mel_in"))
    assert set(HEAVY) <= set(found) and len(found) >= 10
    return found


@pytest.fixture(scope="module")
def torch_outputs(hift, vectors, cases) -> dict[str, dict[str, np.ndarray]]:
    """Per case: f0, source and speech of the torch module from `k__mel_in` with zero noise."""
    out = {}
    with torch.no_grad():
        for case in cases:
            mel = torch.from_numpy(vectors["hift"][f"{case}__mel_in"])
            source, f0 = hift.source(mel, _zero_noise(hift.cfg, mel.shape[-1]))
            out[case] = {"f0": f0.numpy(), "source": source.numpy(), "speech": hift.decode(mel, source).numpy()}
    return out


@pytest.fixture(scope="module")
def onnx_paths(hift, tmp_path_factory) -> dict[str, Path]:
    return export_hift(hift, tmp_path_factory.mktemp("hift_onnx"))


@pytest.fixture(scope="module")
def sessions(onnx_paths) -> dict[str, ort.InferenceSession]:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    return {name: ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
            for name, path in onnx_paths.items()}


def _zero_noise(cfg: HiFTConfig, frames: int, batch: int = 1) -> torch.Tensor:
    return torch.zeros(batch, frames * cfg.samples_per_frame, cfg.nb_harmonics + 1)


def _snr_db(reference: np.ndarray, estimate: np.ndarray) -> float:
    return float(10 * np.log10(np.sum(reference.astype(np.float64) ** 2)
                               / np.sum((reference.astype(np.float64) - estimate) ** 2)))


def _assert_waveform(reference: np.ndarray, estimate: np.ndarray, what: str) -> None:
    assert estimate.shape == reference.shape, what
    snr = _snr_db(reference, estimate)
    worst = float(np.abs(reference - estimate).max())
    assert snr > SPEECH_MIN_SNR_DB and worst < SPEECH_MAX_ABS, f"{what}: SNR {snr:.1f} dB, max abs {worst:.2e}"


# ---------------------------------------------------------------- release, config, weights


def test_config_read_from_yaml(release: Release):
    cfg = HiFTConfig.from_hparams(release.hparams)
    args = release.hparams["hift"].args
    assert cfg.base_channels == args["base_channels"] and cfg.nb_harmonics == args["nb_harmonics"]
    assert cfg.upsample_rates == tuple(args["upsample_rates"])
    assert (cfg.n_fft, cfg.hop_len) == (args["istft_params"]["n_fft"], args["istft_params"]["hop_len"])
    assert cfg.f0_cond_channels == args["f0_predictor"]["cond_channels"]
    assert cfg.samples_per_frame == 480  # 8 * 5 * 3 * 4: one mel frame at 50 Hz is 480 samples at 24 kHz


def test_config_errors_name_the_key(release: Release):
    hparams = dict(release.hparams)
    node = hparams["hift"]
    hparams["hift"] = Node(node.tag, "cosyvoice.hifigan.generator.CausalHiFTGenerator", node.args)
    with pytest.raises(ReleaseError, match="HiFTGenerator"):
        HiFTConfig.from_hparams(hparams)
    hparams["hift"] = Node(node.tag, node.target, {k: v for k, v in node.args.items() if k != "nsf_alpha"})
    with pytest.raises(ReleaseError, match="hift.nsf_alpha"):
        HiFTConfig.from_hparams(hparams)


def test_random_module_has_the_official_keys(release: Release):
    module = build_hift_random(release.hparams)
    state = release.checkpoint("hift.pt")
    own = module.state_dict()
    assert set(own) == set(state)
    assert all(tuple(own[k].shape) == tuple(state[k].shape) for k in state)
    load_hift_state(module, {k: v.clone() for k, v in own.items()})  # its own state loads strictly


def test_strict_load_errors_name_file_and_key(release: Release):
    state = release.checkpoint("hift.pt")
    module = build_hift_random(release.hparams)
    missing = {k: v for k, v in state.items() if k != "conv_post.bias"}
    with pytest.raises(ReleaseError, match=r"hift\.pt: missing key 'conv_post\.bias'"):
        load_hift_state(module, missing)
    reshaped = dict(state, **{"m_source.l_linear.weight": torch.zeros(1, 3)})
    with pytest.raises(ReleaseError, match=r"hift\.pt: key 'm_source\.l_linear\.weight' has shape"):
        load_hift_state(module, reshaped)
    extra = dict(state, **{"generator.unused": torch.zeros(1)})
    with pytest.raises(ReleaseError, match=r"hift\.pt: unexpected key 'generator\.unused'"):
        load_hift_state(module, extra)


# ---------------------------------------------------------------- building blocks


def test_stft_and_istft_match_torch(hift: HiFTGenerator):
    cfg = hift.cfg
    window = torch.hann_window(cfg.n_fft, periodic=True)
    generator = torch.Generator().manual_seed(0)
    signal = torch.randn(2, 1, 3 * cfg.samples_per_frame, generator=generator)
    spec = torch.stft(signal[:, 0], cfg.n_fft, cfg.hop_len, cfg.n_fft, window=window, return_complex=True)
    ours = hift.stft(signal)
    torch.testing.assert_close(ours, torch.cat([spec.real, spec.imag], dim=1), atol=1e-5, rtol=0)
    bins, frames = cfg.n_fft // 2 + 1, spec.shape[-1]
    magnitude = torch.rand(2, bins, frames, generator=generator) * 3
    phase = torch.randn(2, bins, frames, generator=generator) * 3
    expected = torch.istft(torch.polar(magnitude, phase), cfg.n_fft, cfg.hop_len, cfg.n_fft, window=window)
    torch.testing.assert_close(hift.istft(magnitude, phase), expected, atol=1e-5, rtol=0)
    # Analysis then synthesis is the identity (the normalisation by the overlap-added squared window).
    real, imag = ours[:, :bins], ours[:, bins:]
    resynth = hift.istft(torch.sqrt(real ** 2 + imag ** 2), torch.atan2(imag, real))
    torch.testing.assert_close(resynth, signal[:, 0], atol=1e-5, rtol=0)


def _reference_excitation(module: HiFTGenerator, f0: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """The official SineGen2 formula in float64 (cumsum, x 2 pi U, linear x U interpolation, sin), from the
    module's float32 per-frame increments: sines * uv + noise_amp * noise, [B, T*U, H]."""
    cfg = module.cfg
    upsample = cfg.samples_per_frame
    rad = module.m_source._frame_increments(f0).double()
    phase = torch.cumsum(rad, dim=1) * 2 * math.pi * upsample
    phase = F.interpolate(phase.transpose(1, 2), scale_factor=upsample, mode="linear").transpose(1, 2)
    uv = (f0 > cfg.nsf_voiced_threshold).double().repeat_interleave(upsample, dim=1)[..., None]
    amp = uv * cfg.nsf_sigma + (1 - uv) * cfg.nsf_alpha / 3
    return torch.sin(phase) * cfg.nsf_alpha * uv + amp * noise.double()


def test_sine_excitation_matches_float64_formula(hift: HiFTGenerator, vectors):
    """The exact-mod-1 phase against the official formula evaluated in float64, on a golden f0 and on a
    synthetic 30 s f0 (1500 frames, 0..400 Hz, voiced and unvoiced), with Gaussian noise."""
    generator = torch.Generator().manual_seed(1)
    golden_f0 = torch.from_numpy(vectors["hift"]["cross_lingual0_s0__f0"])
    long_f0 = torch.rand(1, 1500, generator=generator) * 400
    for f0 in (golden_f0, long_f0):
        noise = torch.randn(1, f0.shape[1] * hift.cfg.samples_per_frame, hift.cfg.nb_harmonics + 1,
                            generator=generator)
        with torch.no_grad():
            excitation = hift.m_source.excitation(f0, noise)
        expected = _reference_excitation(hift, f0, noise)
        assert float((excitation.double() - expected).abs().max()) < EXCITATION_ATOL


# ---------------------------------------------------------------- torch module vs goldens


def test_f0_matches_golden(vectors, cases, torch_outputs):
    for case in cases:
        np.testing.assert_allclose(torch_outputs[case]["f0"], vectors["hift"][f"{case}__f0"], atol=F0_ATOL, rtol=0,
                                   err_msg=case)


def test_source_noise0_matches_golden(vectors, torch_outputs):
    for case in HEAVY:
        np.testing.assert_allclose(torch_outputs[case]["source"], vectors["hift"][f"{case}__source_noise0"],
                                   atol=SOURCE_ATOL, rtol=0, err_msg=case)


def test_speech_noise0_matches_golden(vectors, cases, torch_outputs):
    for case in cases:
        _assert_waveform(vectors["e2e"][f"{case}__tts_speech"], torch_outputs[case]["speech"], case)


def test_decoder_given_source_matches_golden(hift, vectors):
    with torch.no_grad():
        for case in HEAVY:
            speech = hift.decode(torch.from_numpy(vectors["hift"][f"{case}__mel_in"]),
                                 torch.from_numpy(vectors["hift"][f"{case}__source_seeded"]))
            np.testing.assert_allclose(speech.numpy(), vectors["hift"][f"{case}__speech_seeded"],
                                       atol=DECODE_ATOL, rtol=0, err_msg=case)


# ---------------------------------------------------------------- ONNX graphs


def _signature(values) -> list[tuple[str, int, list]]:
    return [(v.name, v.type.tensor_type.elem_type, [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim])
            for v in values]


def test_onnx_signatures_and_standard_ops(onnx_paths, hift):
    float32 = onnx.TensorProto.FLOAT
    harmonics = hift.cfg.nb_harmonics + 1
    expected = {
        "hift_source": ([("mel", float32, ["B", 80, "T"]), ("noise", float32, ["B", "TU", harmonics])],
                        [("source", float32, ["B", 1, "TU"]), ("f0", float32, ["B", "T"])]),
        "hift_decoder": ([("mel", float32, ["B", 80, "T"]), ("source", float32, ["B", 1, "TU"])],
                         [("speech", float32, ["B", "TU"])]),
    }
    assert set(onnx_paths) == set(expected)
    for name, (inputs, outputs) in expected.items():
        model = onnx.load(onnx_paths[name])
        onnx.checker.check_model(model)
        assert [o.version for o in model.opset_import if o.domain in ("", "ai.onnx")] == [17]
        assert _signature(model.graph.input) == inputs and _signature(model.graph.output) == outputs
        ops = {node.op_type for node in model.graph.node}
        assert all(node.domain in ("", "ai.onnx") for node in model.graph.node)
        assert ops <= STANDARD_OPS, ops - STANDARD_OPS


def test_onnx_matches_torch_and_golden(sessions, vectors, cases, torch_outputs, hift):
    source_graph, decoder_graph = sessions["hift_source"], sessions["hift_decoder"]
    for case in cases:
        mel = vectors["hift"][f"{case}__mel_in"]
        noise = _zero_noise(hift.cfg, mel.shape[-1]).numpy()
        source, f0 = source_graph.run(["source", "f0"], {"mel": mel, "noise": noise})
        np.testing.assert_allclose(f0, torch_outputs[case]["f0"], atol=F0_ATOL, rtol=0, err_msg=case)
        np.testing.assert_allclose(f0, vectors["hift"][f"{case}__f0"], atol=F0_ATOL, rtol=0, err_msg=case)
        np.testing.assert_allclose(source, torch_outputs[case]["source"], atol=ONNX_SOURCE_ATOL, rtol=0, err_msg=case)
        (speech,) = decoder_graph.run(["speech"], {"mel": mel, "source": source})
        _assert_waveform(vectors["e2e"][f"{case}__tts_speech"], speech, f"{case} (chained ONNX)")
        if case in HEAVY:
            np.testing.assert_allclose(source, vectors["hift"][f"{case}__source_noise0"], atol=SOURCE_ATOL, rtol=0,
                                       err_msg=case)
            seeded = vectors["hift"][f"{case}__source_seeded"]
            (speech,) = decoder_graph.run(["speech"], {"mel": mel, "source": seeded})
            with torch.no_grad():
                expected = hift.decode(torch.from_numpy(mel), torch.from_numpy(seeded)).numpy()
            np.testing.assert_allclose(speech, expected, atol=DECODE_ATOL, rtol=0, err_msg=case)
            np.testing.assert_allclose(speech, vectors["hift"][f"{case}__speech_seeded"], atol=DECODE_ATOL, rtol=0,
                                       err_msg=case)


def test_onnx_batch_of_two(sessions, vectors, hift):
    """Dynamic batch: two cases cut to a common length give the same rows as two single runs."""
    frames = 26
    mel = np.concatenate([vectors["hift"][f"{case}__mel_in"][:, :, :frames] for case in HEAVY[:2]])
    generator = torch.Generator().manual_seed(2)
    noise = torch.randn(2, frames * hift.cfg.samples_per_frame, hift.cfg.nb_harmonics + 1, generator=generator).numpy()
    source, f0 = sessions["hift_source"].run(["source", "f0"], {"mel": mel, "noise": noise})
    (speech,) = sessions["hift_decoder"].run(["speech"], {"mel": mel, "source": source})
    for row in range(2):
        one_source, one_f0 = sessions["hift_source"].run(["source", "f0"], {"mel": mel[row:row + 1],
                                                                             "noise": noise[row:row + 1]})
        (one_speech,) = sessions["hift_decoder"].run(["speech"], {"mel": mel[row:row + 1], "source": one_source})
        np.testing.assert_allclose(source[row:row + 1], one_source, atol=1e-6, rtol=0)
        np.testing.assert_allclose(f0[row:row + 1], one_f0, atol=1e-6, rtol=0)
        np.testing.assert_allclose(speech[row:row + 1], one_speech, atol=1e-6, rtol=0)


def test_onnx_streaming_chunk_with_cached_source(sessions, vectors, hift):
    """Official v2 streaming rule between the two graphs (stream.npz, stream_sft chunk 1): the first 8 frames of
    source are the cached source of chunk 0; the head of the output is cross-faded with chunk 0's cached tail."""
    stream = vectors["stream"]
    mel = stream["stream_sft__c1__hift_mel_in"]
    cache_source = stream["stream_sft__c1__hift_cache_source_in"]
    cached_speech = stream["stream_sft__c0__speech_cache_out"]
    cache = cache_source.shape[-1]
    assert cache == 8 * hift.cfg.samples_per_frame
    noise = _zero_noise(hift.cfg, mel.shape[-1]).numpy()
    source, _ = sessions["hift_source"].run(["source", "f0"], {"mel": mel, "noise": noise})
    source = np.concatenate([cache_source, source[:, :, cache:]], axis=2)
    (speech,) = sessions["hift_decoder"].run(["speech"], {"mel": mel, "source": source})
    window = np.hamming(2 * cache)
    head = speech[:, :cache] * window[:cache] + cached_speech * window[cache:]
    speech = np.concatenate([head, speech[:, cache:]], axis=1).astype(np.float32)
    _assert_waveform(stream["stream_sft__c1__speech_cache_out"], speech[:, -cache:], "speech cache out")
    _assert_waveform(stream["stream_sft__c1__emitted"], speech[:, :-cache], "emitted chunk")


def test_export_keeps_module_usable(hift, tmp_path):
    module = copy.deepcopy(hift).train()
    paths = export_hift(module, tmp_path / "out")
    assert module.training and all(p.is_file() and p.parent == tmp_path / "out" for p in paths.values())


def test_full_size_module_from_hparams(release: Release):
    """The real CosyVoice2-0.5B HiFT (base 512, f0 cond 512) builds from hyper-parameters alone with the
    official shapes (fact sheet A3) and runs."""
    node = release.hparams["hift"]
    f0_node = node.args["f0_predictor"]
    args = dict(node.args, base_channels=512, f0_predictor=Node(f0_node.tag, f0_node.target,
                                                                 dict(f0_node.args, cond_channels=512)))
    module = build_hift_random(dict(release.hparams, hift=Node(node.tag, node.target, args)))
    shapes = {k: tuple(v.shape) for k, v in module.state_dict().items()}
    assert shapes["conv_pre.weight"] == (512, 80, 7)
    assert [shapes[f"ups.{i}.weight"] for i in range(3)] == [(512, 256, 16), (256, 128, 11), (128, 64, 7)]
    assert [shapes[f"source_downs.{i}.weight"] for i in range(3)] == [(256, 18, 30), (128, 18, 6), (64, 18, 1)]
    assert shapes["resblocks.8.convs1.2.weight"] == (64, 64, 11) and shapes["conv_post.weight"] == (18, 64, 7)
    assert shapes["f0_predictor.condnet.8.weight"] == (512, 512, 3)
    # 328 checkpoint keys, 82 weight-norm (g, v) pairs folded into one weight each; 20 821 295 parameters
    # in the checkpoint = ours + one g per output row of each folded weight (dim 0).
    folded = [k for k in shapes if k.endswith(".weight") and not k.startswith(("source_downs.", "m_source.",
                                                                                "f0_predictor.classifier."))]
    assert len(folded) == 82 and len(shapes) == 328 - 82
    assert sum(math.prod(s) for s in shapes.values()) + sum(shapes[k][0] for k in folded) == 20_821_295
    with torch.no_grad():
        speech = module(torch.randn(1, 80, 3), _zero_noise(module.cfg, 3))
    assert speech.shape == (1, 3 * 480) and bool(torch.isfinite(speech).all())
