"""Build the CosyVoice2 text tokenizer as a single `tokenizer.json` (Hugging Face `tokenizers` format).

The official code builds it at run time with transformers (`AutoTokenizer` on CosyVoice-BlankEN plus 17 added
special tokens). The device has neither transformers nor the BlankEN folder, so the build host writes one
self-contained file that `tokenizers.Tokenizer.from_file` loads. Only `tokenizers` is needed here (no torch,
no transformers), so this can run on any host.
"""
from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

from cosyedge.device.errors import ReleaseError

# Qwen2's pre-tokenizer split (contractions, letter runs, single digits, punctuation runs, newlines, spaces).
QWEN2_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# CosyVoice2Tokenizer's `additional_special_tokens`, in the official order. The first two already exist in
# BlankEN, so the 17 others get consecutive ids after the base vocabulary (151646 ... 151662 in Qwen2).
COSYVOICE2_SPECIAL_TOKENS = (
    "<|im_start|>", "<|im_end|>", "<|endofprompt|>", "[breath]", "<strong>", "</strong>", "[noise]",
    "[laughter]", "[cough]", "[clucking]", "[accent]", "[quick_breath]", "<laughter>", "</laughter>",
    "[hissing]", "[sigh]", "[vocalized-noise]", "[lipsmack]", "[mn]",
)


def _special(content: str) -> AddedToken:
    """An added special token as transformers adds it: matched verbatim on the raw text, never split."""
    return AddedToken(content, single_word=False, lstrip=False, rstrip=False, normalized=False, special=True)


def build_tokenizer(blank_en_dir: str | Path, extra_specials: Sequence[str] = ()) -> Tokenizer:
    """The BlankEN byte-level BPE (Qwen2 pipeline) with the base and CosyVoice2 special tokens added, then
    `extra_specials` (a later family's, e.g. CosyVoice3's) with the next ids, in order."""
    blank_en = Path(blank_en_dir)
    paths = {name: blank_en / name for name in ("vocab.json", "merges.txt", "tokenizer_config.json")}
    for name, path in paths.items():
        if not path.is_file():
            raise ReleaseError(f"CosyVoice-BlankEN/{name} is missing from the release")

    bpe = models.BPE.from_file(str(paths["vocab.json"]), str(paths["merges.txt"]), dropout=None, unk_token=None,
                               continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False,
                               byte_fallback=False)
    tokenizer = Tokenizer(bpe)
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)

    config = json.loads(paths["tokenizer_config.json"].read_text(encoding="utf-8"))
    base_added = sorted(((int(i), entry["content"]) for i, entry in config.get("added_tokens_decoder", {}).items()))
    for token_id, content in base_added:
        tokenizer.add_special_tokens([_special(content)])
        if tokenizer.token_to_id(content) != token_id:
            raise ReleaseError(f"CosyVoice-BlankEN/tokenizer_config.json: {content} should have id {token_id}, "
                               f"the vocabulary gives {tokenizer.token_to_id(content)}")
    tokenizer.add_special_tokens([_special(content) for content in COSYVOICE2_SPECIAL_TOKENS])
    if extra_specials:
        tokenizer.add_special_tokens([_special(content) for content in extra_specials])
    return tokenizer


def write_tokenizer_json(blank_en_dir: str | Path, out_path: str | Path, extra_specials: Sequence[str] = ()) -> Path:
    """Write the CosyVoice2 tokenizer (plus `extra_specials`, see `build_tokenizer`) to `out_path` (one JSON file,
    loadable by `tokenizers` alone)."""
    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    build_tokenizer(blank_en_dir, extra_specials).save(str(out))
    return out
