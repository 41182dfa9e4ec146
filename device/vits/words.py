"""Which input words each VITS segment speaks, as ranges of its phoneme ids (the pipeline times them).

espeak-ng phonemises a whole text at once and separates phoneme words by spaces, but a phoneme word is not
always a text word: numbers and abbreviations expand ("412" -> "fˈɔːɹhˈʌndɹɪd twˈɛlv"), unstressed function words
join their neighbour ("of the" -> "ʌvðə"), an ellipsis can join two words. So each text word (a whitespace-separated
token) is also phonemised alone, and the letters of those isolated phonemes, each labelled with its token, are
aligned to the letters of the phonemes in context (edit distance, monotonic, in a band around the diagonal). Every
phoneme in context then belongs to one token: a letter to the token it is aligned with (a letter aligned with
nothing to the token before it), a stress mark to the letter after it, spaces and punctuation to none. A token
spans the phoneme ids from its first to its last phoneme, each phoneme with the pad after it, which is how
piper-tts counts its own alignments. A token with no phoneme (a lone dash) spans nothing, where the previous
token ended.
"""
from __future__ import annotations

import re
import unicodedata
from typing import Mapping, Sequence

import numpy as np

BOS, EOS, PAD = "^", "$", "_"  # piper's phoneme id map: sentence start, end, and the pad after every phoneme
_STRESS = frozenset("ˈˌ")
_LANGUAGE_SWITCH = re.compile(r"\([^)]+\)")  # espeak's "(en)" around words of another language
_BAND = 48  # letters either side of the diagonal the alignment may stray

WordSpan = tuple[str, int, int]  # a token and the phoneme ids it spans, [start, end)


def _spoken(char: str) -> bool:
    """A phoneme that is part of a word: a letter or a mark on one (not a space, not punctuation)."""
    return unicodedata.category(char)[0] in "LM"


def _letters(phonemes: str) -> list[str]:
    """The letters of an isolated token's phonemes, as the phonemiser decomposes them (NFD, no stress marks)."""
    text = unicodedata.normalize("NFD", _LANGUAGE_SWITCH.sub("", phonemes))
    return [c for c in text if _spoken(c) and c not in _STRESS]


def align(a: Sequence[str], b: Sequence[str], band: int = _BAND) -> list[int]:
    """For each element of `a`, the index of the element of `b` it is paired with, or -1: a monotonic alignment of
    least edit distance among those that stay within `band` of the diagonal (memory and time grow with the length
    times the band, never with the square of the length)."""
    n, m = len(a), len(b)
    if n == 0 or m == 0:
        return [-1] * n
    codes_a, codes_b = np.array([ord(c) for c in a]), np.array([ord(c) for c in b])
    centre = np.rint(np.arange(n + 1) * (m / n)).astype(np.int64)
    width = max(band, -(-m // n) + 2)  # consecutive rows' windows always overlap
    low, high = np.clip(centre - width, 0, m), np.clip(centre + width, 0, m)
    low, high = low.tolist(), high.tolist()
    unreachable = np.iinfo(np.int64).max // 4
    rows = [np.arange(low[0], high[0] + 1, dtype=np.int64)]  # row 0: j insertions
    for i in range(1, n + 1):
        prev, plo, phi, lo, hi = rows[-1], low[i - 1], high[i - 1], low[i], high[i]
        best = np.full(hi - lo + 1, unreachable)
        top = min(hi, phi)  # from above (a deletion): columns lo..top
        best[: top - lo + 1] = prev[lo - plo: top - plo + 1] + 1
        first, last = max(lo, plo + 1), min(hi, phi + 1)  # from the diagonal: columns first..last
        diagonal = prev[first - 1 - plo: last - plo] + (codes_b[first - 1: last] != codes_a[i - 1])
        best[first - lo: last - lo + 1] = np.minimum(best[first - lo: last - lo + 1], diagonal)
        cols = np.arange(lo, hi + 1)
        rows.append(np.minimum.accumulate(best - cols) + cols)  # then moves along the row (insertions)

    def cost(i: int, j: int) -> int:
        return int(rows[i][j - low[i]]) if low[i] <= j <= high[i] else unreachable

    pairs = [-1] * n
    i, j = n, m
    while i > 0 and j > 0:
        here = cost(i, j)
        if here == cost(i - 1, j - 1) + (b[j - 1] != a[i - 1]):
            pairs[i - 1] = j - 1
            i, j = i - 1, j - 1
        elif here == cost(i - 1, j) + 1:
            i -= 1
        else:
            j -= 1
    return pairs


def id_starts(phonemes: Sequence[str], id_map: Mapping[str, Sequence[int]]) -> list[int]:
    """Where each phoneme's ids start in the sentence's id sequence, and (last) where the sentence's phonemes end:
    the layout of piper's `phonemes_to_ids` (BOS, pad, then each known phoneme's ids and a pad, then EOS)."""
    position = len(id_map[BOS]) + len(id_map[PAD])
    starts = []
    for phoneme in phonemes:
        starts.append(position)
        if phoneme in id_map:
            position += len(id_map[phoneme]) + len(id_map[PAD])
    return starts + [position]


def _owners(sentence: Sequence[str], letter_tokens: Sequence[int]) -> list[int | None]:
    """The token each phoneme of a sentence belongs to, given the tokens of its letters in order."""
    owners: list[int | None] = [None] * len(sentence)
    letters = iter(letter_tokens)
    for q, phoneme in enumerate(sentence):
        if _spoken(phoneme) and phoneme not in _STRESS:
            owners[q] = next(letters)
    for q in range(len(sentence) - 1, -1, -1):  # a stress mark joins the letter after it in its word
        if sentence[q] in _STRESS:
            following = owners[q + 1] if q + 1 < len(sentence) and _spoken(sentence[q + 1]) else None
            owners[q] = following if following is not None else (owners[q - 1] if q and _spoken(sentence[q - 1])
                                                                else None)
    return owners


def word_spans(sentences: Sequence[Sequence[str]], tokens: Sequence[str], isolated: Sequence[str],
               id_map: Mapping[str, Sequence[int]]) -> list[tuple[WordSpan, ...]]:
    """Per sentence (phonemes in context, as the segments hold them), the tokens it speaks and their id ranges.

    `isolated`: each token's phonemes when phonemised alone. Every token appears once, in order."""
    context = [(s, q) for s, sentence in enumerate(sentences) for q, p in enumerate(sentence)
               if _spoken(p) and p not in _STRESS]
    labelled = [(t, letter) for t, phonemes in enumerate(isolated) for letter in _letters(phonemes)]
    pairs = align([sentences[s][q] for s, q in context], [letter for _, letter in labelled])
    letter_tokens, previous = [], None
    for k in pairs:  # a letter with no partner belongs to the token before it (the first ones: the first token)
        previous = labelled[k][0] if k >= 0 else previous
        letter_tokens.append(previous)
    first = next((t for t in letter_tokens if t is not None), 0)
    letter_tokens = [first if t is None else t for t in letter_tokens]

    places: dict[int, tuple[int, int, int]] = {}  # token -> (sentence, first id, end id)
    cursor = 0
    for s, sentence in enumerate(sentences):
        starts = id_starts(sentence, id_map)
        count = sum(1 for p in sentence if _spoken(p) and p not in _STRESS)
        owners = _owners(sentence, letter_tokens[cursor:cursor + count])
        cursor += count
        for q, token in enumerate(owners):
            if token is None:
                continue
            if token not in places:
                places[token] = (s, starts[q], starts[q + 1])
            elif places[token][0] == s:  # a token split by a sentence end stays in its first sentence
                places[token] = (s, places[token][1], starts[q + 1])
    spans: list[list[WordSpan]] = [[] for _ in sentences]
    home, where, _ = min(places.values(), default=(0, 0, 0))  # silent tokens before the first spoken one
    for t, token in enumerate(tokens):
        if t in places:
            home, begin, where = places[t]
            spans[home].append((token, begin, where))
        else:  # silent: nothing, where the token before it ended
            spans[home].append((token, where, where))
    return [tuple(words) for words in spans]
