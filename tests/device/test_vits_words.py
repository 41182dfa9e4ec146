"""Which ids each word spans (device/vits/words.py), on constructed phoneme sequences with known answers; the real
voice against piper-tts's own alignments is in test_piper_oracle.py."""
from __future__ import annotations

import unicodedata

from cosyedge.device.vits.words import align, word_spans

# A toy id map in piper's layout: one id per phoneme, pad 0, BOS 1, EOS 2.
PHONEMES = "_^$ ,.ˈˌəʌvðɪzɔːɹdɚtwɛlfaɪnks"
ID_MAP = {p: [i] for i, p in enumerate(PHONEMES)}


def _ids_of(sentence: str, first: int, last: int) -> tuple[int, int]:
    """[start, end) of phonemes first..last (inclusive): BOS + pad, then two ids (id, pad) per phoneme."""
    return 2 + 2 * first, 2 + 2 * (last + 1)


def _spans(sentences: list[str], tokens: list[str], isolated: list[str]):
    return word_spans([list(unicodedata.normalize("NFD", s)) for s in sentences], tokens, isolated, ID_MAP)


def test_align_pairs_equal_letters_and_leaves_gaps_for_the_rest():
    assert align(list("abc"), list("abc")) == [0, 1, 2]
    assert align(list("axc"), list("abc")) == [0, 1, 2]  # a substitution stays paired
    assert align(list("abxc"), list("abc")) == [0, 1, -1, 2]  # an extra letter in context: a gap
    assert align(list("ac"), list("abc")) == [0, 2]
    assert align(list("abc"), []) == [-1, -1, -1]


def test_align_stays_in_its_band_on_long_inputs():
    context = list("tə ðə stɔːɹ ænd bæk " * 400)  # 8000 letters: a full table would hold 64 million cells
    isolated = list("tuː ðə stɔːɹ ænd bæk " * 400)
    pairs = align(context, isolated)
    assert len(pairs) == len(context) and all(b >= a for a, b in zip(pairs, pairs[1:]) if a >= 0 and b >= 0)
    assert sum(context[i] == isolated[j] for i, j in enumerate(pairs) if j >= 0) > 0.9 * len(context)


def test_words_joined_in_context_are_split_where_the_second_begins():
    spans = _spans(["ʌvðə dɔːɹ."], ["of", "the", "door."], ["ʌv", "ðə", "dˈɔːɹ."])
    sentence = "ʌvðə dɔːɹ."
    assert spans == [(("of", *_ids_of(sentence, 0, 1)), ("the", *_ids_of(sentence, 2, 3)),
                      ("door.", *_ids_of(sentence, 5, 8)))]


def test_a_stress_mark_belongs_to_the_word_it_stresses():
    sentence = "ɪz ˈɔːɹdɚ."  # the mark opens "order": the word starts at it, not at its first letter
    spans = _spans([sentence], ["is", "order."], ["ɪz", "ˈɔːɹdɚ."])
    assert spans == [(("is", *_ids_of(sentence, 0, 1)), ("order.", *_ids_of(sentence, 3, 8)))]


def test_an_expanded_number_spans_all_its_phoneme_words():
    sentence = "ɪz twɛlv faɪv."
    spans = _spans([sentence], ["is", "12", "5."], ["ɪz", "twˈɛlv", "fˈaɪv."])
    assert spans == [(("is", *_ids_of(sentence, 0, 1)), ("12", *_ids_of(sentence, 3, 7)),
                      ("5.", *_ids_of(sentence, 9, 12)))]
    spans = _spans([sentence], ["is", "125."], ["ɪz", "twˈɛlv fˈaɪv."])  # one token, two phoneme words
    assert spans == [(("is", *_ids_of(sentence, 0, 1)), ("125.", *_ids_of(sentence, 3, 12)))]


def test_a_silent_token_takes_no_time_where_the_last_word_ended_and_sentences_keep_their_words():
    first, second = "ɪz dɔːɹ.", "ðə vɪz."
    tokens, isolated = ["-", "is", "door.", "-", "the", "viz."], ["", "ɪz", "dˈɔːɹ.", "", "ðə", "vɪz."]
    spans = _spans([first, second], tokens, isolated)
    start = _ids_of(first, 0, 1)[0]
    assert spans == [(("-", start, start), ("is", *_ids_of(first, 0, 1)), ("door.", *_ids_of(first, 3, 6)),
                      ("-", _ids_of(first, 3, 6)[1], _ids_of(first, 3, 6)[1])),
                     (("the", *_ids_of(second, 0, 1)), ("viz.", *_ids_of(second, 3, 5)))]
