"""A full-size CosyVoice2-0.5B release with random weights, in the official on-disk layout.

Real weights cannot be downloaded here, yet export time, bundle size, memory and speed must be
measured at full scale. The sizes are those of CosyVoice2-0.5B (facts sheet A2); the tokenizer
files, the two ONNX front-end models and spk2info are copied from a template release (random
weights cannot make a BPE vocabulary or a speaker encoder).
"""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch

from cosyedge.device.errors import ReleaseError
from cosyedge.quantize.cosyvoice2.flow import build_flow_random
from cosyedge.quantize.cosyvoice2.hift import build_hift_random
from cosyedge.quantize.cosyvoice2.llm import build_llm_random
from cosyedge.quantize.cosyvoice2.release import YAML_NAME, read_yaml

PRESETS = {
    "cosyvoice2-0.5b": {
        "yaml": {"llm_input_size": "896", "llm_output_size": "896", "attention_heads": "8", "linear_units": "2048",
                 "num_blocks": "6", "channels": "[256]", "attention_head_dim": "64", "n_blocks": "4",
                 "num_mid_blocks": "12", "num_heads": "8", "base_channels": "512", "cond_channels": "512"},
        "qwen": {"hidden_size": 896, "intermediate_size": 4864, "num_attention_heads": 14, "num_hidden_layers": 24,
                 "num_key_value_heads": 2, "max_window_layers": 24, "vocab_size": 151936, "rope_theta": 1000000.0,
                 "rms_norm_eps": 1e-06, "tie_word_embeddings": True},
    },
}
COPIED = ("campplus.onnx", "speech_tokenizer_v2.onnx", "spk2info.pt", "CosyVoice-BlankEN/vocab.json",
          "CosyVoice-BlankEN/merges.txt", "CosyVoice-BlankEN/tokenizer_config.json",
          "CosyVoice-BlankEN/generation_config.json")


def _sized_yaml(text: str, sizes: dict[str, str]) -> str:
    for key, value in sizes.items():
        text, count = re.subn(rf"^(\s*{key}:)[ \t]*(?![ \t]|!ref)[^\n#]*", rf"\g<1> {value}", text, flags=re.M)
        if count != 1:
            raise ReleaseError(f"template {YAML_NAME}: expected exactly one '{key}:' entry, found {count}")
    return text


def write_random_release(preset: str, template: Path, out: Path, seed: int = 0) -> Path:
    """Write `out` as an official-layout release of `preset` size with seeded random weights."""
    if preset not in PRESETS:
        raise ReleaseError(f"unknown preset {preset!r}; known: {', '.join(PRESETS)}")
    template, out = Path(template), Path(out)
    for rel in (YAML_NAME, "CosyVoice-BlankEN/config.json", *COPIED[:2], *COPIED[3:]):
        if not (template / rel).is_file():
            raise ReleaseError(f"template release lacks {rel}")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ReleaseError(f"--out {out.name!r} exists and is not an empty directory; nothing was changed: "
                           "choose a new or empty directory")
    spec = PRESETS[preset]
    (out / "CosyVoice-BlankEN").mkdir(parents=True, exist_ok=True)
    (out / YAML_NAME).write_text(_sized_yaml((template / YAML_NAME).read_text(encoding="utf-8"), spec["yaml"]),
                                 encoding="utf-8")
    qwen = json.loads((template / "CosyVoice-BlankEN/config.json").read_text(encoding="utf-8")) | spec["qwen"]
    (out / "CosyVoice-BlankEN/config.json").write_text(json.dumps(qwen, indent=2) + "\n", encoding="utf-8")
    for rel in COPIED:
        if (template / rel).is_file():
            shutil.copyfile(template / rel, out / rel)
    hparams = read_yaml(out / YAML_NAME)
    torch.manual_seed(seed)
    for name, build in (("llm.pt", lambda: build_llm_random(hparams, qwen)), ("flow.pt", lambda: build_flow_random(hparams)),
                        ("hift.pt", lambda: build_hift_random(hparams))):
        module = build()
        torch.save(module.state_dict(), out / name)
        del module
    return out
