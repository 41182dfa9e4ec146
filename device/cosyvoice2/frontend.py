"""CosyVoice2 text frontend without torch or transformers: normalisation, segment splitting, tokenisation.

It reproduces the official `text_normalize` as it behaves with wetext 0.1.8 (no ttsfrd), because the LLM was
trained on text normalised that way. Where the official code fails (wetext assertions, index errors on odd
whitespace, numbers too large to spell out) this raises `InputError` instead of crashing.
"""
from __future__ import annotations

import bisect
import re
import unicodedata
from pathlib import Path
from typing import Callable

from tokenizers import Tokenizer

from cosyedge.device.errors import BundleError, InputError, TextTooLongError
from cosyedge.device.text import COSYVOICE_MAX_TOKENS, check_unicode, cut_to_bound

# Official split settings (`split_paragraph` arguments in `text_normalize`).
TOKEN_MAX_N = 80
TOKEN_MIN_N = 60
MERGE_LEN = 20

ZH_SENTENCE_END = ("。", "？", "！", "；", "：", "、", ".", "?", "!", ";")
EN_SENTENCE_END = (".", "?", "!", ";", ":")
CLOSING_QUOTES = ('"', "”")

_CHINESE = re.compile(r"[\u4e00-\u9fff]")
# A word of the text as subtitles show it: a CJK character with the punctuation after it, or a run of other
# characters between spaces (punctuation attached).
_WORD = re.compile(r"[\u4e00-\u9fff][^\w\s]*|[^\s\u4e00-\u9fff]+")
_TRAILING_COMMAS = re.compile(r"[，,、]+$")

_UNITS = ("", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
_TEENS = ("ten", "eleven", "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen",
          "nineteen")
_TENS = ("", "", "twenty", "thirty", "forty", "fifty", "sixty", "seventy", "eighty", "ninety")
_SCALES = ("", " thousand", " million", " billion", " trillion", " quadrillion", " quintillion", " sextillion",
           " septillion", " octillion", " nonillion", " decillion")


END_OF_PROMPT = "<|endofprompt|>"


class TextFrontend:
    """Normalise, split and tokenise text as the official CosyVoice2 frontend does, and its prompt rules (the
    `instruction`, `check_prompt` and `voice_transcript` methods: what a family's frontend decides about prompts)."""

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

    def words(self, text: str) -> tuple[tuple[str, int, int], ...]:
        """The words of `text` with the range of its `encode(text)` ids each was read as, [start, end): each token
        belongs to the word holding its first non-space character (a token of spaces only to the word before it);
        a word whose first character lies inside a token begun in the word before (two CJK characters read as
        one token) joins that word, so every word has at least one token and every token one word."""
        encoding = self._tokenizer.encode(text)
        found = [(m.start(), m.end()) for m in _WORD.finditer(text)]
        if not found or not encoding.ids:
            return ()
        firsts = [a for a, _ in found]
        joined = [False] * len(found)
        leads = []
        for start, end in encoding.offsets:
            piece = text[start:end]
            lead = start + len(piece) - len(piece.lstrip())
            leads.append(lead if lead < end else start)
            for word in range(bisect.bisect_right(firsts, lead), bisect.bisect_left(firsts, end)):
                joined[word] = True  # the token runs across this word's first character
        heads = [word for word in range(len(found)) if not joined[word]]
        head_firsts = [firsts[word] for word in heads]
        owner: list[int] = []
        for lead in leads:
            owner.append(max(bisect.bisect_right(head_firsts, lead) - 1, owner[-1] if owner else 0))
        groups = [(token, heads[head]) for token, head in enumerate(owner) if not token or head != owner[token - 1]]
        out = []
        for index, (token, word) in enumerate(groups):
            next_token, next_word = groups[index + 1] if index + 1 < len(groups) else (len(owner), len(found))
            out.append((text[found[word][0]:found[next_word - 1][1]], token, next_token))
        return tuple(out)

    def instruction(self, text: str) -> str:
        """A request's instruct text as the LLM takes it: ending with the marker the LLM was trained with (the
        official caller must add it)."""
        return text if text.endswith(END_OF_PROMPT) else text + END_OF_PROMPT

    def check_prompt(self, prompt_text_ids: tuple[int, ...], text_ids: tuple[int, ...]) -> None:
        """Refuse (InputError) an LLM prompt the model cannot take; CosyVoice2 takes any."""

    def voice_transcript(self, text: str) -> str:
        """A registered voice's transcript as its LLM prompt text is made from (CosyVoice2: as given)."""
        return text

    def normalize(self, text: str, split: bool = True) -> list[str]:
        """Normalised text segments (split=True), or a one-element list with the whole normalised text.

        split=False is the zero-shot prompt-text path: the text is normalised but not cut into segments, and
        it is returned even when it is only punctuation (the split path drops such segments).
        """
        check_unicode(text)
        if ("<|" in text and "|>" in text) or text == "":
            if split and len(self.encode(text)) > COSYVOICE_MAX_TOKENS:  # markup is taken as given: never cut
                raise TextTooLongError(f"a text with <|...|> markup is one model call, at most "
                                       f"{COSYVOICE_MAX_TOKENS} tokens; this one has {len(self.encode(text))}")
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
            segments = _split_paragraph(text, len, zh=True, tokens=self._token_count)
        else:
            text = self._wetext(text, zh=False)
            text = _spell_out_numbers(text)
            segments = _split_paragraph(text, self._token_count, zh=False, tokens=self._token_count)
        if not split:
            return [text]
        return [segment for segment in segments if not _is_only_punctuation(segment)]

    def _token_count(self, text: str) -> int:
        return len(self.encode(text))

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


def _split_paragraph(text: str, length: Callable[[str], int], zh: bool,
                     tokens: Callable[[str], int] | None = None, bound: int = COSYVOICE_MAX_TOKENS) -> list[str]:
    """Cut after sentence punctuation, then greedily merge pieces into segments of about 60-80 units.

    Units are characters for Chinese and tokens for other text; a short tail (< 20 units) joins the previous segment.
    With `tokens`, no segment holds more than `bound` tokens (one model call's bound): a longer sentence is cut after
    a clause, else at a word, else between characters (`text.cut_to_bound`), and no merge passes the bound. Text
    whose sentences are shorter than that is split exactly as the official frontend splits it.
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

    def fits(candidate: str) -> bool:
        return tokens is None or tokens(candidate) <= bound

    if tokens is not None:
        pieces = [part for piece in pieces for part in _cut(piece, tokens, bound)]
    segments: list[str] = []
    pending = ""
    for piece in pieces:
        if pending and ((length(pending + piece) > TOKEN_MAX_N and length(pending) > TOKEN_MIN_N)
                        or not fits(pending + piece)):
            segments.append(pending)
            pending = ""
        pending += piece
    if pending:
        if length(pending) < MERGE_LEN and segments and fits(segments[-1] + pending):
            segments[-1] += pending
        else:
            segments.append(pending)
    return segments


def _cut(piece: str, tokens: Callable[[str], int], bound: int) -> list[str]:
    """A sentence within `bound` tokens as is; a longer one cut (a token covers at most ~8 characters of a piece
    that must be cut, so the tokenizer only ever sees 8 x bound characters at a time)."""
    if tokens(piece) <= bound:
        return [piece]
    return ["".join(part) for part in cut_to_bound(list(piece), bound, lambda units: tokens("".join(units)),
                                                     window=8 * bound)]


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
