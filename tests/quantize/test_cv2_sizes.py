"""Any official size, CosyVoice2 (issue 24 item 3; the Fun-CosyVoice3 twin is test_cv3_sizes.py): the v2 loaders
read the pre-lookahead length and the HiFT stage count, kernels and dilations from the release. For each, the
project's random-init writer makes a small release at an unusual value; it loads strictly, exports, and ONNX Runtime
equals the project's torch modules; the bundle's streaming look-ahead is the release's pre-lookahead length."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import torch

from cosyedge.quantize.cosyvoice2.flow import build_flow
from cosyedge.quantize.cosyvoice2.flow_export import export_flow
from cosyedge.quantize.cosyvoice2.hift import build_hift
from cosyedge.quantize.cosyvoice2.hift_export import export_hift
from cosyedge.quantize.cosyvoice2.random_init import write_random_release
from cosyedge.quantize.cosyvoice2.release import Release

ATOL = 1e-4
PRE_LOOKAHEAD = {"yaml": {}, "qwen": {}, "yaml_text": [("pre_lookahead_len: 3", "pre_lookahead_len: 5")]}
HIFT_STAGES = {"yaml": {}, "qwen": {}, "yaml_text": [
    ("upsample_rates: [8, 5, 3]", "upsample_rates: [8, 15]"),
    ("upsample_kernel_sizes: [16, 11, 7]", "upsample_kernel_sizes: [16, 31]"),
    ("\n    resblock_kernel_sizes: [3, 7, 11]", "\n    resblock_kernel_sizes: [3, 5]"),
    ("\n    resblock_dilation_sizes: [[1, 3, 5], [1, 3, 5], [1, 3, 5]]",
     "\n    resblock_dilation_sizes: [[1, 2], [1, 3, 5, 7]]"),
    ("source_resblock_kernel_sizes: [7, 7, 11]", "source_resblock_kernel_sizes: [7, 11]"),
    ("source_resblock_dilation_sizes: [[1, 3, 5], [1, 3, 5], [1, 3, 5]]",
     "source_resblock_dilation_sizes: [[1, 3, 5], [1, 2]]")]}


def _sessions(paths: dict[str, Path]) -> dict[str, ort.InferenceSession]:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    return {name: ort.InferenceSession(str(p), options, providers=["CPUExecutionProvider"]) for name, p in paths.items()}


def _flag(on: bool) -> torch.Tensor:
    return torch.tensor([int(on)])


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("cv2sizes")


def test_pre_lookahead_length_other_than_three(golden_dir: Path, root: Path) -> None:
    release = Release.open(write_random_release(PRE_LOOKAHEAD, golden_dir / "cosyvoice2-tiny", root / "la"))
    flow = build_flow(release)
    k = flow.config.pre_lookahead_len
    assert k == 5
    s = _sessions(export_flow(flow, root / "la_onnx"))
    token = torch.randint(0, 6561, (1, 30 + k), generator=torch.Generator().manual_seed(1))
    embedding = torch.randn(1, 192)
    for finalize in (False, True):
        flags = (_flag(finalize), _flag(not finalize))
        with torch.no_grad():
            mu, spks = flow.encode(token, embedding, *flags)
        got_mu, got_spks = s["flow_encoder"].run(None, {"token": token.numpy(), "embedding": embedding.numpy(),
                                                        "finalize": flags[0].numpy(), "streaming": flags[1].numpy()})
        assert got_mu.shape == (1, 80, 2 * 30) and np.abs(got_mu - mu.numpy()).max() <= ATOL, finalize
        assert np.abs(got_spks - spks.numpy()).max() <= ATOL


def test_the_bundle_streams_with_the_release_lookahead(golden_dir: Path, root: Path) -> None:
    from cosyedge.device.bundle import Bundle
    from cosyedge.quantize.cosyvoice2.bundle import write_bundle
    release = root / "la"
    if not release.exists():
        write_random_release(PRE_LOOKAHEAD, golden_dir / "cosyvoice2-tiny", release)
    cfg = Bundle.load(write_bundle(release, root / "la_bundle")).manifest.config
    assert cfg["pre_lookahead_len"] == cfg["stream"]["lookahead"] == 5


def test_hift_stages_kernels_and_dilations_of_other_lengths(golden_dir: Path, root: Path) -> None:
    hift = build_hift(Release.open(write_random_release(HIFT_STAGES, golden_dir / "cosyvoice2-tiny", root / "hift")))
    cfg = hift.cfg
    assert cfg.upsample_rates == (8, 15) and cfg.samples_per_frame == 480 and len(hift.resblocks) == 4
    s = _sessions(export_hift(hift, root / "hift_onnx"))
    mel = torch.randn(1, 80, 23, generator=torch.Generator().manual_seed(3))
    noise = torch.zeros(1, 23 * 480, cfg.nb_harmonics + 1)
    with torch.no_grad():
        source, _ = hift.source(mel, noise)
        want = hift.decode(mel, source)
    got_source, _ = s["hift_source"].run(None, {"mel": mel.numpy(), "noise": noise.numpy()})
    (got,) = s["hift_decoder"].run(None, {"mel": mel.numpy(), "source": got_source})
    assert np.abs(got_source - source.numpy()).max() <= ATOL
    assert got.shape == tuple(want.shape) and np.abs(got - want.numpy()).max() <= ATOL
