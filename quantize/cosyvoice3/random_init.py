"""Fun-CosyVoice3 releases with random weights, in the official on-disk layout (`cosyedge quantize --random-init`).

`cosyvoice3-0.5b` has the sizes of Fun-CosyVoice3-0.5B (facts sheet B2: Qwen2 896 wide, 24 layers, 14 heads, 2 KV
heads; PreLookahead 1024 channels; DiT 1024 wide, 22 blocks of 16 x 64 heads; HiFT 512 base channels, f0 predictor
512): real weights cannot be downloaded here, yet export time, bundle size, memory and speed must be measured at
full scale. A `dict` spec (same form as a preset) re-sizes the template to any other dimensions, so tests can prove
that nothing in the loader, exports or runtime assumes the shared tiny release's sizes.

The file handling is CosyVoice2's (`cosyvoice2.random_init.write_sized_release`); the tokenizer files, the two ONNX
front-end models and spk2info are copied from the template (random weights cannot make a BPE vocabulary or a
speaker encoder). Weights are the modules' default PyTorch initialisation, seeded.
"""
from __future__ import annotations

from pathlib import Path

from cosyedge.device.errors import ReleaseError
from cosyedge.quantize.cosyvoice2.random_init import write_sized_release
from cosyedge.quantize.cosyvoice3.flow import build_flow_random
from cosyedge.quantize.cosyvoice3.hift import build_hift_random
from cosyedge.quantize.cosyvoice3.llm import build_llm_random
from cosyedge.quantize.cosyvoice3.release import YAML_NAME

QWEN_05B = {"hidden_size": 896, "intermediate_size": 4864, "num_attention_heads": 14, "num_hidden_layers": 24,
            "num_key_value_heads": 2, "max_window_layers": 24, "vocab_size": 151936, "rope_theta": 1000000.0,
            "rms_norm_eps": 1e-06, "tie_word_embeddings": True}
PRESETS = {
    "cosyvoice3-0.5b": {
        "yaml": {"llm_input_size": "896", "llm_output_size": "896", "channels": "1024", "dim": "1024",
                 "depth": "22", "heads": "16", "dim_head": "64", "base_channels": "512", "cond_channels": "512"},
        "qwen": QWEN_05B,
    },
    # the golden tiny release's sizes but the LLM's 32 channels as 2 query / 1 key-value heads of 16 (golden: 24 as
    # 3 / 1 of 8): the smallest head ONNX Runtime's GroupQueryAttention runs, so the cpu LLM built from it takes
    # the shared key/value cache graph (tests/quantize/test_llm_shared_kv.py), as CosyVoice2's `cosyvoice2-tiny`
    "cosyvoice3-tiny": {
        "yaml": {"llm_input_size": "32", "llm_output_size": "32"},
        "qwen": {"hidden_size": 32, "num_attention_heads": 2, "num_key_value_heads": 1},
    },
}
COPIED = ("campplus.onnx", "speech_tokenizer_v3.onnx", "spk2info.pt", "CosyVoice-BlankEN/vocab.json",
          "CosyVoice-BlankEN/merges.txt", "CosyVoice-BlankEN/tokenizer_config.json",
          "CosyVoice-BlankEN/generation_config.json")


def write_random_release(preset: str | dict, template: Path, out: Path, seed: int = 0) -> Path:
    """Write `out` as an official-layout Fun-CosyVoice3 release of `preset` size (a PRESETS name, or a spec dict
    with "yaml" and "qwen" entries) with seeded random float32 weights."""
    if isinstance(preset, str) and preset not in PRESETS:
        raise ReleaseError(f"unknown preset {preset!r}; known: {', '.join(PRESETS)}")
    spec = PRESETS[preset] if isinstance(preset, str) else preset
    return write_sized_release(spec, template, out, YAML_NAME, COPIED, seed, {
        "llm.pt": build_llm_random, "flow.pt": lambda hparams, qwen: build_flow_random(hparams),
        "hift.pt": lambda hparams, qwen: build_hift_random(hparams)})
