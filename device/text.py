"""Text -> normalised text and sentences, shared by every model family, and the bounds of one model call.

Emoji, control characters and other symbols nobody can pronounce are removed here, so that no
model ever sees them; text left with nothing to say is an InputError.

Bounded work per request, whatever the text: a text's length is counted after NFKC (one character such as
U+FDFA stands for 18), what a family speaks after its own normalisation (numbers read out, phonemes) may be at
most `SPOKEN_EXPANSION` times that (`Engine.segments`), and every segment a family makes holds at most its
model-call bound (`VITS_MAX_IDS`, `COSYVOICE_MAX_TOKENS`): a sentence longer than that is cut by `cut_to_bound`
after a clause mark, else at a word, else between characters, so one model call's memory is bounded by the bound,
not by the text. The TensorRT profiles (`device/trt/profiles.py`) cover these bounds.
"""
from __future__ import annotations

import re
import unicodedata
from typing import Callable, Sequence

from cosyedge.device.errors import EmptyTextError, InputError, TextTooLongError

# Phoneme ids in one VITS call. RSS grows by about 0.65 MB per id at speed 1 on a CPU (the decoder's activations
# at audio rate; fp32 default voice: 500 ids -> +280 MB, 4,000 ids -> +2.7 GB); 400 ids are about 10 s of speech.
VITS_MAX_IDS = 400
# Text tokens in one CosyVoice LLM call (the official splitter aims at 60-80; a segment may decode up to 20 speech
# tokens per text token, and the flow's cost grows with their square). Tiny CosyVoice2: 100 -> +145 MB, 400 -> +700 MB.
COSYVOICE_MAX_TOKENS = 100
SPOKEN_EXPANSION = 4  # what a family speaks may be this many times max_text_len; prose grows a few %, digits 10x
CLAUSE_MARKS = frozenset(",;:，、；：")

_KEEP_CATEGORIES = ("L", "N", "P", "Zs", "M")  # letters, numbers, punctuation, spaces, combining marks
_KEEP_SYMBOLS = set("$%&+=@#€£¥°/\\<>")
SENTENCE_END = re.compile(r"(?<=[.!?。！？…])\s+|(?<=[。！？])")  # also the cut of textstream.SentenceStream
_SPACES = re.compile(r"\s+")
_SURROGATES = re.compile("[\ud800-\udfff]")


def check_unicode(text: str) -> str:
    """Refuse lone surrogates: JSON can carry them ("\\ud800"), but they are not characters and crash the
    tokenizers and normalisers that receive them."""
    if _SURROGATES.search(text):
        raise InputError("text contains invalid Unicode (lone surrogate code points U+D800-U+DFFF)")
    return text


def normalize(text: str) -> str:
    """NFKC, symbols and emoji dropped, whitespace collapsed."""
    text = unicodedata.normalize("NFKC", text)
    kept = []
    for char in text:
        category = unicodedata.category(char)
        if char in "\n\t\r":
            kept.append(" ")
        elif category.startswith(_KEEP_CATEGORIES) or char in _KEEP_SYMBOLS:
            kept.append(char)
        else:
            kept.append(" ")
    return _SPACES.sub(" ", "".join(kept)).strip()


def validate(text: object, max_chars: int) -> str:
    """The request text, normalised; InputError for anything that cannot be spoken."""
    if not isinstance(text, str):
        raise InputError("text must be a string")
    check_unicode(text)
    if not text.strip():
        raise EmptyTextError("text is empty")
    if len(text) > max_chars:
        raise TextTooLongError(f"text has {len(text)} characters; the limit is {max_chars}: split it into several requests")
    clean = normalize(text)
    if len(clean) > max_chars:  # NFKC: U+FDFA alone is 18 characters
        raise TextTooLongError(f"text has {len(clean)} characters after Unicode normalisation (NFKC: some characters "
                               f"stand for several); the limit is {max_chars}: split it into several requests")
    if not speakable(clean):
        raise EmptyTextError("text contains nothing speakable (only punctuation, symbols or emoji)")
    return clean


def speakable(text: str) -> bool:
    """Whether `text` has a letter or a number (something a voice can say)."""
    return any(unicodedata.category(c).startswith(("L", "N")) for c in text)


def split_sentences(text: str) -> list[str]:
    """Sentences of normalised text; each one is a streaming chunk and a batch item."""
    parts = (p.strip() for p in SENTENCE_END.split(text))
    return [p for p in parts if p and speakable(p)]


def cut_to_bound(units: Sequence[str], bound: int, size: Callable[[Sequence[str]], int],
                 window: int | None = None) -> list[list[str]]:
    """One sentence's units (characters, or VITS phonemes) -> consecutive pieces of `size` <= `bound` each.

    A sentence that fits is one piece. Otherwise each piece is the longest prefix that fits, cut back to just after
    its last clause mark, else to its last space, when that keeps at least half of it; else it ends where it must
    (a run without punctuation is split at words, then between characters, never refused). The pieces joined are
    the units (a space at a cut starts the next piece). `size` must not shrink when a piece grows; a single unit
    over the bound is a piece of its own.
    `window` caps a piece's units (so a costly `size`, a tokenizer, only ever sees a bounded piece).
    """
    pieces: list[list[str]] = []
    start, n = 0, len(units)
    window = window or n
    while start < n:
        if n - start <= window and size(units[start:]) <= bound:
            pieces.append(list(units[start:]))
            break
        low, high = start + 1, min(n - 1, start + window)  # the longest end within the bound (at least one unit)
        while low < high:
            middle = (low + high + 1) // 2
            if size(units[start:middle]) <= bound:
                low = middle
            else:
                high = middle - 1
        end = low
        half = start + (end - start + 1) // 2
        cut = next((i for i in range(end, half, -1) if units[i - 1] in CLAUSE_MARKS), None)
        if cut is None:
            cut = next((i for i in range(end, half, -1) if units[i].isspace()), end)
        pieces.append(list(units[start:cut]))
        start = cut
    return pieces
