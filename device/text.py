"""Text -> normalised text and sentences, shared by every model family.

Emoji, control characters and other symbols nobody can pronounce are removed here, so that no
model ever sees them; text left with nothing to say is an InputError.
"""
from __future__ import annotations

import re
import unicodedata

from cosyedge.device.errors import EmptyTextError, InputError, TextTooLongError

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
