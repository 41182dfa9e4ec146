"""CosyVoice2 releases with random weights, in the official on-disk layout.

Two presets:

* `cosyvoice2-0.5b`: the sizes of CosyVoice2-0.5B (facts sheet A2). Real weights cannot be downloaded here,
  yet export time, bundle size, memory and speed must be measured at full scale.
* `cosyvoice2-tiny`: the sizes of the golden tiny release (shared/golden/cosyvoice2-tiny), but the modules' own
  PyTorch initialisation instead of the golden generator's weights, and the LLM's 32 channels split into 2 query
  heads and 1 key/value head of 16 (golden: 4 / 2 of 8), the smallest head size ONNX Runtime's GroupQueryAttention
  runs, so that the cpu targets built from it take the shared key/value cache graph (llm_shared_kv.py). The golden tiny weights are chaotic: its HiFT
  turns a 0.1 % mel change into ~1.6 dB MCD, so every int8 flow / HiFT and every trt-int8 stage misses its
  quality gate and falls back. With the default initialisation every quantized stage of every target passes the
  unchanged gates (gates.THRESHOLDS) by a wide margin (tiny, seed 0: cpu HiFT int8 SNR ~40 dB >= 15, flow int8
  mel cosine ~0.9999 >= 0.995, e2e MCD ~0.4 dB <= 2; trt-int8 LLM QDQ KL ~1e-3 <= 0.05), so a bundle built from
  it holds, and the runtime loads, the quantized graphs themselves (tests/quantize/test_cv2_quantized_load.py).
  The speech-token head is scaled by `llm_decoder_gain` (10): default init gives near-uniform speech-token
  logits (only ~60 % of greedy steps have a top-1 margin >= gates.DECISIVE_NATS), whereas a trained LM is
  decisive; scaled, ~97 % are, so greedy decoding exercises real choices.

The tokenizer files, the two ONNX front-end models and spk2info are copied from a template release (random
weights cannot make a BPE vocabulary or a speaker encoder).
"""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Callable

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
    "cosyvoice2-tiny": {
        "yaml": {"llm_input_size": "32", "llm_output_size": "32", "attention_heads": "4", "linear_units": "64",
                 "num_blocks": "1", "channels": "[64]", "attention_head_dim": "16", "n_blocks": "1",
                 "num_mid_blocks": "2", "num_heads": "2", "base_channels": "32", "cond_channels": "32"},
        "qwen": {"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 2, "num_hidden_layers": 2,
                 "num_key_value_heads": 1, "max_window_layers": 2, "vocab_size": 151936, "rope_theta": 1000000.0,
                 "rms_norm_eps": 1e-06, "tie_word_embeddings": True},
        "llm_decoder_gain": 10.0,
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


def write_random_release(preset: str | dict, template: Path, out: Path, seed: int = 0) -> Path:
    """Write `out` as an official-layout release of `preset` size (a PRESETS name, or a spec dict of the same form)
    with seeded random weights (float32, like a real release): the modules' default PyTorch initialisation, the
    speech-token head times the preset's `llm_decoder_gain` (1 if absent)."""
    if isinstance(preset, str) and preset not in PRESETS:
        raise ReleaseError(f"unknown preset {preset!r}; known: {', '.join(PRESETS)}")
    spec = PRESETS[preset] if isinstance(preset, str) else preset
    return write_sized_release(spec, template, out, YAML_NAME, COPIED, seed, {
        "llm.pt": lambda hparams, qwen: _llm(hparams, qwen, float(spec.get("llm_decoder_gain", 1.0))),
        "flow.pt": lambda hparams, qwen: build_flow_random(hparams),
        "hift.pt": lambda hparams, qwen: build_hift_random(hparams)})


def write_sized_release(spec: dict, template: Path, out: Path, yaml_name: str, copied: tuple[str, ...], seed: int,
                        builders: dict[str, Callable[[dict, dict], torch.nn.Module]]) -> Path:
    """The template release re-sized by `spec` ("yaml": yaml key -> value of a key that occurs once; optional
    "yaml_text": (before, after) text replacements, every occurrence; "qwen": BlankEN config entries), every
    file of `copied` that the template has copied, and each checkpoint of `builders` (file -> module from the
    re-sized hparams and Qwen config) saved from a seeded build. Shared by every CosyVoice family."""
    template, out = Path(template), Path(out)
    for rel in (yaml_name, "CosyVoice-BlankEN/config.json", *(r for r in copied if r != "spk2info.pt")):
        if not (template / rel).is_file():
            raise ReleaseError(f"template release lacks {rel}")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ReleaseError(f"--out {out.name!r} exists and is not an empty directory; nothing was changed: "
                           "choose a new or empty directory")
    (out / "CosyVoice-BlankEN").mkdir(parents=True, exist_ok=True)
    text = (template / yaml_name).read_text(encoding="utf-8")
    for before, after in spec.get("yaml_text", ()):  # entries that occur more than once, lists, nested values
        if before not in text:
            raise ReleaseError(f"template {yaml_name}: no {before.strip()!r} to replace")
        text = text.replace(before, after)
    (out / yaml_name).write_text(_sized_yaml(text, spec["yaml"]), encoding="utf-8")
    qwen = json.loads((template / "CosyVoice-BlankEN/config.json").read_text(encoding="utf-8")) | spec["qwen"]
    (out / "CosyVoice-BlankEN/config.json").write_text(json.dumps(qwen, indent=2) + "\n", encoding="utf-8")
    for rel in copied:
        if (template / rel).is_file():
            shutil.copyfile(template / rel, out / rel)
    hparams = read_yaml(out / yaml_name)
    torch.manual_seed(seed)
    for name, build in builders.items():
        module = build(hparams, qwen)
        torch.save(module.state_dict(), out / name)
        del module
    return out


def _llm(hparams: dict, qwen: dict, gain: float) -> torch.nn.Module:
    module = build_llm_random(hparams, qwen)
    if gain != 1.0:
        with torch.no_grad():
            module.llm_decoder.weight.mul_(gain)
            module.llm_decoder.bias.mul_(gain)
    return module
