"""Fun-CosyVoice3 release loader against the tiny official-layout release (cosyvoice3-tiny).

Every failure must name the file and the key; both weight-norm key styles must give identical folded weights;
float16 checkpoints must load like float32 ones (upcast on load).
"""
from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from cosyedge.device.errors import ReleaseError
from cosyedge.quantize.cosyvoice3.llm import build_llm
from cosyedge.quantize.cosyvoice3.release import REQUIRED_FILES, Release3, open_release


def _copy_release(src: Path, dst: Path, skip: tuple[str, ...] = ()) -> Path:
    """A writable release: symlinks to the shared files, except `skip` (to be written by the test)."""
    dst.mkdir()
    for item in src.iterdir():
        if item.name in skip or item.name == "vectors" or item.name == "README.md":
            continue
        (dst / item.name).symlink_to(item)
    return dst


def test_open_reads_sizes_from_files(cv3_tiny_dir: Path) -> None:
    release = open_release(cv3_tiny_dir)
    assert isinstance(release, Release3)
    assert release.qwen_config["hidden_size"] == 24
    assert release.hparams["llm"]["llm_input_size"] == 24
    assert release.hparams["flow"]["decoder"]["estimator"]["dim"] == 64
    assert release.hparams["hift"]["base_channels"] == 32
    # `!ref <hift>` (a class entry) resolves to the entry itself
    assert release.hparams["hifigan"]["generator"].target == release.hparams["hift"].target


@pytest.mark.parametrize("name", [n for n in REQUIRED_FILES if "/" not in n])
def test_missing_file_is_named(cv3_tiny_dir: Path, tmp_path: Path, name: str) -> None:
    root = _copy_release(cv3_tiny_dir, tmp_path / "rel", skip=(name,))
    with pytest.raises(ReleaseError, match=rf"^{name.replace('.', r'[.]')}: missing"):
        open_release(root)


def test_missing_tokenizer_file_is_named(cv3_tiny_dir: Path, tmp_path: Path) -> None:
    root = _copy_release(cv3_tiny_dir, tmp_path / "rel", skip=("CosyVoice-BlankEN",))
    (root / "CosyVoice-BlankEN").mkdir()
    for f in (cv3_tiny_dir / "CosyVoice-BlankEN").iterdir():
        if f.name != "merges.txt":
            (root / "CosyVoice-BlankEN" / f.name).symlink_to(f)
    with pytest.raises(ReleaseError, match=r"CosyVoice-BlankEN/merges\.txt: missing"):
        open_release(root)


def _with_llm(cv3_tiny_dir: Path, tmp_path: Path, edit) -> Release3:
    root = _copy_release(cv3_tiny_dir, tmp_path / "rel", skip=("llm.pt",))
    state = torch.load(cv3_tiny_dir / "llm.pt", map_location="cpu", weights_only=True)
    edit(state)
    torch.save(state, root / "llm.pt")
    return open_release(root)


def test_renamed_key_is_named(cv3_tiny_dir: Path, tmp_path: Path) -> None:
    def rename(state):
        state["llm.model.model.norm.scale"] = state.pop("llm.model.model.norm.weight")
    release = _with_llm(cv3_tiny_dir, tmp_path, rename)
    with pytest.raises(ReleaseError, match=r"llm\.pt: missing key 'llm\.model\.model\.norm\.weight'"):
        build_llm(release)


def test_unexpected_key_is_named(cv3_tiny_dir: Path, tmp_path: Path) -> None:
    def add(state):
        state["llm_embedding.weight"] = torch.zeros(2, 24)   # a CosyVoice2 key: not in a v3 release
    release = _with_llm(cv3_tiny_dir, tmp_path, add)
    with pytest.raises(ReleaseError, match=r"llm\.pt: unexpected key 'llm_embedding\.weight'"):
        build_llm(release)


def test_wrong_shape_is_named(cv3_tiny_dir: Path, tmp_path: Path) -> None:
    def reshape(state):
        state["llm.model.model.layers.1.mlp.up_proj.weight"] = torch.zeros(65, 24)
    release = _with_llm(cv3_tiny_dir, tmp_path, reshape)
    with pytest.raises(ReleaseError, match=r"llm\.pt: key 'llm\.model\.model\.layers\.1\.mlp\.up_proj\.weight' "
                                           r"has shape \(65, 24\), expected \(64, 24\)"):
        build_llm(release)


def test_decoder_bias_refused(cv3_tiny_dir: Path, tmp_path: Path) -> None:
    def bias(state):
        state["llm_decoder.bias"] = torch.zeros(6761)        # v2 style decoder: v3 has none
    release = _with_llm(cv3_tiny_dir, tmp_path, bias)
    with pytest.raises(ReleaseError, match=r"llm\.pt: unexpected key 'llm_decoder\.bias'"):
        build_llm(release)


def test_float16_checkpoint_loads(cv3_tiny_dir: Path, tmp_path: Path) -> None:
    def half(state):
        for k, v in state.items():
            state[k] = v.half()
    release = _with_llm(cv3_tiny_dir, tmp_path, half)
    module = build_llm(release)
    assert module.speech_embedding.weight.dtype == torch.float32
    ref = torch.load(cv3_tiny_dir / "llm.pt", map_location="cpu", weights_only=True)["speech_embedding.weight"]
    np.testing.assert_array_equal(module.speech_embedding.weight.detach().numpy(), ref.half().float().numpy())


def test_both_weight_norm_styles_equal(cv3_tiny_dir: Path, tmp_path: Path) -> None:
    root = _copy_release(cv3_tiny_dir, tmp_path / "rel", skip=("hift.pt",))
    state = torch.load(cv3_tiny_dir / "hift.pt", map_location="cpu", weights_only=True)
    legacy = {}
    for k, v in state.items():
        k = k.replace(".parametrizations.weight.original0", ".weight_g")
        legacy[k.replace(".parametrizations.weight.original1", ".weight_v")] = v
    assert any(k.endswith(".weight_g") for k in legacy) and not any("parametrizations" in k for k in legacy)
    torch.save({"generator." + k: v for k, v in legacy.items()}, root / "hift.pt")   # prefix stripped too
    new_gen, new_f0 = open_release(cv3_tiny_dir).hift_checkpoint()
    old_gen, old_f0 = open_release(root).hift_checkpoint()
    assert new_gen.keys() == old_gen.keys() and new_f0.keys() == old_f0.keys()
    for k in new_gen:
        assert torch.equal(new_gen[k], old_gen[k]), k
    for k in new_f0:
        assert new_f0[k].dtype == torch.float64 and torch.equal(new_f0[k], old_f0[k]), k
    assert "conv_pre.weight" in new_gen and "condnet.0.weight" in new_f0


def test_incomplete_weight_norm_pair_is_named(cv3_tiny_dir: Path, tmp_path: Path) -> None:
    root = _copy_release(cv3_tiny_dir, tmp_path / "rel", skip=("hift.pt",))
    state = torch.load(cv3_tiny_dir / "hift.pt", map_location="cpu", weights_only=True)
    del state["conv_post.parametrizations.weight.original0"]
    torch.save(state, root / "hift.pt")
    with pytest.raises(ReleaseError, match="conv_post"):
        open_release(root).hift_checkpoint()


def test_spk2info(cv3_tiny_dir: Path, cv3_vectors: Path) -> None:
    spk = open_release(cv3_tiny_dir).spk2info()
    front = np.load(cv3_vectors / "frontend.npz")
    assert set(spk) == {"zs_full", "zs_2s"}
    for name, fields in spk.items():
        for field, value in fields.items():
            np.testing.assert_array_equal(value, front[f"spk2info_{name}__{field}"], err_msg=f"{name}.{field}")


def _with_file(cv3_tiny_dir: Path, tmp_path: Path, name: str, edit) -> Path:
    root = _copy_release(cv3_tiny_dir, tmp_path / "rel", skip=(name,))
    state = torch.load(cv3_tiny_dir / name, map_location="cpu", weights_only=True)
    edit(state)
    torch.save(state, root / name)
    return root


def test_load_models(cv3_tiny_dir: Path) -> None:
    from cosyedge.quantize.cosyvoice3.models import load_models
    models = load_models(cv3_tiny_dir)
    assert models.llm.config.speech_vocab == 6761
    assert models.flow.config.estimator.depth == 2
    assert next(models.hift.f0_predictor.parameters()).dtype == torch.float64


@pytest.mark.parametrize("name,edit,message", [
    ("flow.pt", lambda s: s.__setitem__("pre_lookahead_layer.conv1.weight", torch.zeros(33, 80, 4)),
     r"flow\.pt: key 'pre_lookahead_layer\.conv1\.weight' has shape \(33, 80, 4\), expected \(32, 80, 4\)"),
    ("flow.pt", lambda s: s.__setitem__("decoder.estimator.proj.weight", s.pop("decoder.estimator.proj_out.weight")),
     r"flow\.pt: missing key 'decoder\.estimator\.proj_out\.weight'"),
    ("hift.pt", lambda s: s.__setitem__("conv_post.parametrizations.weight.original1", torch.ones(18, 4, 6)),
     r"hift\.pt: key 'conv_post\.weight' has shape \(18, 4, 6\), expected \(18, 4, 7\)"),
    ("hift.pt", lambda s: s.__setitem__("f0_predictor.classifier.weights", s.pop("f0_predictor.classifier.weight")),
     r"hift\.pt: missing key 'f0_predictor\.classifier\.weight'"),
])
def test_flow_and_hift_keys_named(cv3_tiny_dir: Path, tmp_path: Path, name: str, edit, message: str) -> None:
    from cosyedge.quantize.cosyvoice3.models import load_models
    root = _with_file(cv3_tiny_dir, tmp_path, name, edit)
    with pytest.raises(ReleaseError, match=message):
        load_models(root)
