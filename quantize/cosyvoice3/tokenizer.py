"""Build the Fun-CosyVoice3 text tokenizer as one `tokenizer.json` (Hugging Face `tokenizers` format).

The official `CosyVoice3Tokenizer` is CosyVoice2's (the BlankEN Qwen2 BPE + the v2 special tokens) with more
`additional_special_tokens` appended in this order: `<|endofsystem|>`, the 84 CMU phone tokens (39 ARPAbet
phones in alphabetical order, each vowel followed by its stress variants 0/1/2) and 176 pinyin initial/final tokens
with tones (code-point order). None of them is an existing BPE token, so they get consecutive ids after the v2 ones
(`<|endofprompt|>` 151646 ... `<|endofsystem|>` 151663 ... 151923 for Qwen2's vocabulary; checked against the
official table in the tests). Only `tokenizers` is needed (no torch, no transformers).
"""
from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer

from cosyedge.quantize.cosyvoice2 import tokenizer as v2

ENDOFSYSTEM = "<|endofsystem|>"
CMU_VOWELS = ("AA", "AE", "AH", "AO", "AW", "AY", "EH", "ER", "EY", "IH", "IY", "OW", "OY", "UH", "UW")
CMU_CONSONANTS = ("B", "CH", "D", "DH", "F", "G", "HH", "JH", "K", "L", "M", "N", "NG", "P", "R", "S", "SH", "T",
                  "TH", "V", "W", "Y", "Z", "ZH")
PINYIN = (
    "a ai an ang ao b c ch d e ei en eng f g h i ian in ing iu ià iàn iàng iào iá ián iáng iáo iè ié iòng ióng iù "
    "iú iā iān iāng iāo iē iě iōng iū iǎ iǎn iǎng iǎo iǒng iǔ j k l m n o ong ou p q r s sh t u uang ue un uo uà "
    "uài uàn uàng uá uái uán uáng uè ué uì uí uò uó uā uāi uān uāng uē uě uī uō uǎ uǎi uǎn uǎng uǐ uǒ vè w x y z zh "
    "à ài àn àng ào á ái án áng áo è èi èn èng èr é éi én éng ér ì ìn ìng í ín íng ò òng òu ó óng óu ù ùn ú ún ā āi "
    "ān āng āo ē ēi ēn ēng ě ěi ěn ěng ěr ī īn īng ō ōng ōu ū ūn ǎ ǎi ǎn ǎng ǎo ǐ ǐn ǐng ǒ ǒng ǒu ǔ ǔn ǘ ǚ ǜ"
).split()


def cmu_tokens() -> list[str]:
    out: list[str] = []
    for phone in sorted(CMU_VOWELS + CMU_CONSONANTS):
        out.append(f"[{phone}]")
        if phone in CMU_VOWELS:
            out.extend(f"[{phone}{stress}]" for stress in "012")
    return out


def cosyvoice3_extra_tokens() -> list[str]:
    """The specials CosyVoice3 appends after CosyVoice2's, in the official order (1 + 84 + 176)."""
    return [ENDOFSYSTEM, *cmu_tokens(), *(f"[{p}]" for p in sorted(PINYIN))]


def build_tokenizer(blank_en_dir: str | Path) -> Tokenizer:
    """The BlankEN BPE with the base, CosyVoice2 and CosyVoice3 special tokens (each matched whole, never split)."""
    return v2.build_tokenizer(blank_en_dir, cosyvoice3_extra_tokens())


def write_tokenizer_json(blank_en_dir: str | Path, out_path: str | Path) -> Path:
    """Write the CosyVoice3 tokenizer to `out_path` (one JSON file, loadable by `tokenizers` alone)."""
    return v2.write_tokenizer_json(blank_en_dir, out_path, cosyvoice3_extra_tokens())
