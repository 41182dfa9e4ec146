"""Any official size (issue 24 item 3): every size and layout parameter of the Fun-CosyVoice3 loaders is read from
the release, as the official constructors allow it, not checked against the shared tiny release's values. For each
parameter, the project's own random-init writer (quantize/cosyvoice3/random_init.py) writes a small release at an
unusual value; it loads, exports, and ONNX Runtime equals the project's torch modules on that graph.

Parameters (the tiny release's value -> here): the DiT attention width heads x dim_head (= dim 64 -> 4 x 16 = 64 on
a 48-wide model, as the official to_q/k/v map dim -> heads*dim_head and to_out maps back); the pre-lookahead
length (3 -> 5, both yaml entries; it is also the streaming look-ahead); HiFT stages, kernels and dilations (3
stages [8, 5, 3] with 3 kernels of 3 dilations -> 2 stages [8, 15], resblock kernels [3, 5] with dilations of
lengths 2 and 4, source kernels [7, 11] with dilations of lengths 3 and 2). A random-init release has no BlankEN
weights file (only the tokenizer and config.json), as the runtime needs none. Weight-norm key styles and float16
checkpoints are covered in test_cv3_release.py."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import torch

from cosyedge.device.bundle import Bundle
from cosyedge.device.families import load_pipeline
from cosyedge.device.options import SynthesisOptions
from cosyedge.device.sessions import SessionConfig
from cosyedge.quantize.cosyvoice3 import export as E
from cosyedge.quantize.cosyvoice3 import hift_export as HX
from cosyedge.quantize.cosyvoice3.bundle import write_bundle
from cosyedge.quantize.cosyvoice3.models import Models, load_models
from cosyedge.quantize.cosyvoice3.random_init import write_random_release

ATOL = 1e-4
VARIANTS = {
    "dit_attention_width": {"yaml": {"dim": "48", "heads": "4", "dim_head": "16"}},
    "pre_lookahead_len": {"yaml_text": [("pre_lookahead_len: 3", "pre_lookahead_len: 5")]},
    "hift_stages": {"yaml_text": [
        ("upsample_rates: [8, 5, 3]", "upsample_rates: [8, 15]"),
        ("upsample_kernel_sizes: [16, 11, 7]", "upsample_kernel_sizes: [16, 30]"),
        ("\n    resblock_kernel_sizes: [3, 7, 11]", "\n    resblock_kernel_sizes: [3, 5]"),
        ("\n    resblock_dilation_sizes: [[1, 3, 5], [1, 3, 5], [1, 3, 5]]",
         "\n    resblock_dilation_sizes: [[1, 2], [1, 3, 5, 7]]"),
        ("source_resblock_kernel_sizes: [7, 7, 11]", "source_resblock_kernel_sizes: [7, 11]"),
        ("source_resblock_dilation_sizes: [[1, 3, 5], [1, 3, 5], [1, 3, 5]]",
         "source_resblock_dilation_sizes: [[1, 3, 5], [1, 2]]")]},
}
_BUILT: dict[str, tuple[Path, Models, dict[str, ort.InferenceSession]]] = {}


def _sessions(paths: dict[str, Path]) -> dict[str, ort.InferenceSession]:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    return {name: ort.InferenceSession(str(p), options, providers=["CPUExecutionProvider"]) for name, p in paths.items()}


def _built(name: str, template: Path, root: Path) -> tuple[Path, Models, dict[str, ort.InferenceSession]]:
    """The variant's release, its strictly loaded torch modules and its exported flow and HiFT graphs."""
    if name not in _BUILT:
        release = write_random_release({"qwen": {}, **VARIANTS[name], "yaml": VARIANTS[name].get("yaml", {})},
                                       template, root / name / "release")
        models = load_models(release)
        out = root / name / "onnx"
        out.mkdir()
        _BUILT[name] = release, models, _sessions(E.export_flow(models.flow, out) | HX.export_hift(models.hift, out))
    return _BUILT[name]


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("cv3sizes")


def _flag(on: bool) -> torch.Tensor:
    return torch.tensor([int(on)])


def test_dit_attention_width_other_than_the_model_width(cv3_tiny_dir: Path, root: Path) -> None:
    release, models, s = _built("dit_attention_width", cv3_tiny_dir, root)
    dit = models.flow.config.estimator
    assert (dit.dim, dit.heads * dit.dim_head) == (48, 64)
    assert not (release / "CosyVoice-BlankEN" / "model.safetensors").exists()   # no BlankEN weights needed
    g = torch.Generator().manual_seed(0)
    frames = 2 * 37   # crosses a 50-frame chunk
    feeds = {"x": torch.randn(2, 80, frames, generator=g), "mask": torch.ones(2, 1, frames),
             "mu": torch.randn(2, 80, frames, generator=g), "t": torch.rand(2, generator=g),
             "spks": torch.randn(2, 80, generator=g), "cond": torch.randn(2, 80, frames, generator=g)}
    for streaming in (False, True):
        with torch.no_grad():
            want = models.flow.velocity(*feeds.values(), _flag(streaming)).numpy()
        (got,) = s["flow_estimator"].run(None, {k: v.numpy() for k, v in feeds.items()}
                                         | {"streaming": _flag(streaming).numpy()})
        assert np.abs(got - want).max() <= ATOL, streaming


def test_pre_lookahead_length_other_than_three(cv3_tiny_dir: Path, root: Path) -> None:
    release, models, s = _built("pre_lookahead_len", cv3_tiny_dir, root)
    k = models.flow.config.pre_lookahead_len
    assert k == 5
    token = torch.randint(0, 6561, (1, 40 + k), generator=torch.Generator().manual_seed(1))
    embedding = torch.randn(1, 192)
    for finalize in (False, True):
        with torch.no_grad():
            mu, spks = models.flow.encode(token, embedding, _flag(finalize), _flag(not finalize))
        got_mu, got_spks = s["flow_encoder"].run(None, {"token": token.numpy(), "embedding": embedding.numpy(),
                                                        "finalize": _flag(finalize).numpy(),
                                                        "streaming": _flag(not finalize).numpy()})
        assert got_mu.shape == (1, 80, 2 * 40) and np.abs(got_mu - mu.numpy()).max() <= ATOL
        assert np.abs(got_spks - spks.numpy()).max() <= ATOL


def test_the_streaming_lookahead_is_the_pre_lookahead_length(cv3_tiny_dir: Path, root: Path) -> None:
    """The bundle's stream look-ahead comes from the flow (official: token_hop_len + flow.pre_lookahead_len), and
    the runtime's first chunk waits for first hop + 5 look-ahead tokens, then streams the whole text."""
    release, _, _ = _built("pre_lookahead_len", cv3_tiny_dir, root)
    bundle = Bundle.load(write_bundle(release, root / "pre_lookahead_len" / "bundle"))
    cfg = bundle.manifest.config
    assert cfg["pre_lookahead_len"] == cfg["stream"]["lookahead"] == 5
    pipeline = load_pipeline(bundle, "fp32", SessionConfig(providers=("cpu",), intra_op_threads=1))
    request = SynthesisOptions(voice="zs_2s", mode="zero_shot", sampling="greedy", deterministic=True)
    tokens = [int(t) for t in np.random.default_rng(2).integers(100, 2000, 120)]   # no silent codes
    seen: list[int] = []

    def counted():
        for token in tokens:
            seen.append(token)
            yield token

    consumed = []
    chunks = []
    for chunk in pipeline.stream_tokens(counted(), request):
        consumed.append(len(seen))
        chunks.append(chunk)
    prompt = len(pipeline._voices["zs_2s"].flow_prompt_speech)
    pad = -prompt % 25
    assert consumed[0] == 25 + pad + 5 and len(chunks) >= 3
    assert sum(c.size for c in chunks) == len(tokens) * 2 * 480


def test_hift_stages_kernels_and_dilations_of_other_lengths(cv3_tiny_dir: Path, root: Path) -> None:
    _, models, s = _built("hift_stages", cv3_tiny_dir, root)
    cfg = models.hift.cfg
    assert cfg.upsample_rates == (8, 15) and cfg.samples_per_frame == 480
    assert cfg.resblock_dilation_sizes == ((1, 2), (1, 3, 5, 7)) and len(models.hift.resblocks) == 4
    mel = torch.randn(1, 80, 31, generator=torch.Generator().manual_seed(3))
    for finalize in (True, False):
        with torch.no_grad():
            want, _, _ = models.hift.inference(mel, finalize)
        samples = mel.shape[2] * 480
        noise = models.hift.fixed_noise(samples)[1][:samples].numpy()
        source, _ = s["hift_source"].run(None, {"mel": mel.numpy(), "sine_noise": noise})
        frames, kept_source, kept_speech = HX.streaming_lengths(models.hift, mel.shape[2])
        if finalize:
            (got,) = s["hift_decoder"].run(None, {"mel": mel.numpy(), "source": source})
        else:
            (got,) = s["hift_decoder"].run(None, {"mel": mel.numpy()[:, :, :frames],
                                                  "source": source[:, :, :kept_source]})
            got = got[:, :kept_speech]
        assert got.shape == tuple(want.shape) and np.abs(got - want.numpy()).max() <= ATOL, finalize
    # the decoder's reach (a stream's bounded HiFT re-run) is measured on these stages, not the tiny release's value
    tiny = load_models(cv3_tiny_dir).hift
    assert HX.decoder_history_frames(models.hift) != HX.decoder_history_frames(tiny)
