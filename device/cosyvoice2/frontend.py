"""CosyVoice2 text frontend without torch or transformers: normalisation, segment splitting, tokenisation.

It reproduces the official `text_normalize` as it behaves with wetext 0.1.8 (no ttsfrd), because the LLM was
trained on text normalised that way. Where the official code fails (wetext assertions, index errors on odd
whitespace, numbers too large to spell out) this raises `InputError` instead of crashing.
"""
from __future__ import annotations

import re
import unicodedata
from pathlib import Path
from typing import Callable

from tokenizers import Tokenizer

from cosyedge.device.errors import BundleError, InputError
from cosyedge.device.text import check_unicode

# Official split settings (`split_paragraph` arguments in `text_normalize`).
TOKEN_MAX_N = 80
TOKEN_MIN_N = 60
MERGE_LEN = 20

ZH_SENTENCE_END = ("。", "？", "！", "；", "：", "、", ".", "?", "!", ";")
EN_SENTENCE_END = (".", "?", "!", ";", ":")
CLOSING_QUOTES = ('"', "”")

_CHINESE = re.compile(r"[\u4e00-\u9fff]")
_TRAILING_COMMAS = re.compile(r"[，,、]+$")

_UNITS = ("", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
_TEENS = ("ten", "eleven", "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen",
          "nineteen")
_TENS = ("", "", "twenty", "thirty", "forty", "fifty", "sixty", "seventy", "eighty", "ninety")
_SCALES = ("", " thousand", " million", " billion", " trillion", " quadrillion", " quintillion", " sextillion",
           " septillion", " octillion", " nonillion", " decillion")


class TextFrontend:
    """Normalise, split and tokenise text as the official CosyVoice2 frontend does."""

    def __init__(self, tokenizer_json: str | Path):
        path = Path(tokenizer_json)
        if not path.is_file():
            raise BundleError(f"text tokenizer file {path.name} is missing from the bundle")
        self._tokenizer = Tokenizer.from_file(str(path))
        self._zh_normalizer = None
        self._en_normalizer = None

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`: byte-level BPE, special tokens matched whole, no BOS/EOS."""
        return self._tokenizer.encode(text).ids

    def normalize(self, text: str, split: bool = True) -> list[str]:
        """Normalised text segments (split=True), or a one-element list with the whole normalised text.

        split=False is the zero-shot prompt-text path: the text is normalised but not cut into segments, and
        it is returned even when it is only punctuation (the split path drops such segments).
        """
        check_unicode(text)
        if ("<|" in text and "|>" in text) or text == "":
            return [text]
        text = text.strip()
        if _CHINESE.search(text):
            text = self._wetext(text, zh=True)
            text = text.replace("\n", "")
            text = _drop_blanks(text)
            text = text.replace("²", "平方").replace("³", "立方")
            text = text.replace(".", "。").replace(" - ", "，")
            text = _remove_brackets(text)
            text = _TRAILING_COMMAS.sub("。", text)
            segments = _split_paragraph(text, len, zh=True)
        else:
            text = self._wetext(text, zh=False)
            text = _spell_out_numbers(text)
            segments = _split_paragraph(text, lambda s: len(self.encode(s)), zh=False)
        if not split:
            return [text]
        return [segment for segment in segments if not _is_only_punctuation(segment)]

    def _wetext(self, text: str, zh: bool) -> str:
        """wetext normaliser as built by the official frontend: zh keeps erhua, en uses the defaults (auto lang)."""
        from wetext import Normalizer  # loads its FSTs lazily; keeps tokenizer-only users light

        if zh and self._zh_normalizer is None:
            self._zh_normalizer = Normalizer(remove_erhua=False)
        if not zh and self._en_normalizer is None:
            self._en_normalizer = Normalizer()
        normalizer = self._zh_normalizer if zh else self._en_normalizer
        try:
            return normalizer.normalize(text)
        except AssertionError as error:
            raise InputError("the text normaliser cannot handle this text (it rejects some whitespace runs, "
                             "e.g. blank lines or repeated spaces): remove them and retry") from error


def _drop_blanks(text: str) -> str:
    """Keep a space only between two non-space ASCII characters (the neighbour before index 0 is the last char)."""
    out = []
    for i, char in enumerate(text):
        if char != " ":
            out.append(char)
            continue
        if i + 1 >= len(text):
            raise InputError("the normalised text ends with a space that the official frontend cannot process")
        after, before = text[i + 1], text[i - 1]
        if after.isascii() and after != " " and before.isascii() and before != " ":
            out.append(char)
    return "".join(out)


def _remove_brackets(text: str) -> str:
    for mark in ("（", "）", "【", "】", "`"):
        text = text.replace(mark, "")
    return text.replace("——", " ")


def _is_only_punctuation(text: str) -> bool:
    """True for text made only of Unicode punctuation (P*) and symbols (S*), including the empty string."""
    return all(unicodedata.category(char)[0] in "PS" for char in text)


def _split_paragraph(text: str, length: Callable[[str], int], zh: bool) -> list[str]:
    """Cut after sentence punctuation, then greedily merge pieces into segments of about 60-80 units.

    Units are characters for Chinese and tokens for other text; a short tail (< 20 units) joins the previous segment.
    """
    if text == "":
        raise InputError("the text is empty after normalisation")
    ends = ZH_SENTENCE_END if zh else EN_SENTENCE_END
    if text[-1] not in ends:
        text += "。" if zh else "."

    pieces: list[str] = []
    start = 0
    for i, char in enumerate(text):
        if char not in ends:
            continue
        if i > start:
            pieces.append(text[start:i] + char)
        if i + 1 < len(text) and text[i + 1] in CLOSING_QUOTES:
            if not pieces:
                raise InputError("the text starts with punctuation followed by a closing quote, "
                                 "which the official frontend cannot split")
            pieces[-1] += text[i + 1]
            start = i + 2
        else:
            start = i + 1

    segments: list[str] = []
    pending = ""
    for piece in pieces:
        if length(pending + piece) > TOKEN_MAX_N and length(pending) > TOKEN_MIN_N:
            segments.append(pending)
            pending = ""
        pending += piece
    if pending:
        if length(pending) < MERGE_LEN and segments:
            segments[-1] += pending
        else:
            segments.append(pending)
    return segments


def _spell_out_numbers(text: str) -> str:
    """Replace every run of digit characters (str.isdigit) by English words, as inflect's number_to_words does."""
    out: list[str] = []
    run: list[str] = []
    for char in text:
        if char.isdigit():
            run.append(char)
            continue
        if run:
            out.append(_number_to_words("".join(run)))
            run = []
        out.append(char)
    if run:
        out.append(_number_to_words("".join(run)))
    return "".join(out)


def _number_to_words(digits: str) -> str:
    """English words of a digit string: 'one thousand, two hundred and thirty-four' (inflect's default style).

    Decimal digits of any script count; other digit-like characters (superscripts, circled digits) are ignored.
    """
    ascii_digits = "".join(str(unicodedata.decimal(char)) for char in digits
                           if unicodedata.decimal(char, None) is not None).lstrip("0")
    if ascii_digits in ("", "1"):
        return "one" if ascii_digits else "zero"
    n_groups = (len(ascii_digits) + 2) // 3
    if n_groups > len(_SCALES):
        raise InputError(f"the number {ascii_digits[:12]}... is too long to be read out")
    padded = ascii_digits.rjust(3 * n_groups, "0")
    parts = []
    last_is_tens_only = False
    for index in range(n_groups):
        hundreds, tens, units = (int(c) for c in padded[3 * index:3 * index + 3])
        scale = _SCALES[n_groups - 1 - index]
        if hundreds:
            rest = f" and {_tens_word(tens, units)}" if tens or units else ""
            parts.append(f"{_UNITS[hundreds]} hundred{rest}{scale}")
        elif tens or units:
            parts.append(f"{_tens_word(tens, units)}{scale}")
        last_is_tens_only = index == n_groups - 1 and not hundreds and bool(tens or units)
    if last_is_tens_only and len(parts) > 1:
        return ", ".join(parts[:-1]) + " and " + parts[-1]
    return ", ".join(parts)


def _tens_word(tens: int, units: int) -> str:
    if tens == 1:
        return _TEENS[units]
    if tens and units:
        return f"{_TENS[tens]}-{_UNITS[units]}"
    return _TENS[tens] or _UNITS[units]
