"""The incremental sentence splitter: any piecewise feeding of a text yields the sentences of the whole text."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from cosyedge.device import SentenceStream
from cosyedge.device.text import split_sentences

ALPHABET = st.sampled_from(list("ab cd,.!?;:\n。！？，、…1") + ["Dr.", "3.5", "1,000", " "])


def _feed(text: str, cuts: list[int], stream: SentenceStream) -> list[str]:
    bounds = sorted({0, len(text), *(c % (len(text) + 1) for c in cuts)})
    out: list[str] = []
    for start, end in zip(bounds, bounds[1:]):
        out += stream.feed(text[start:end])
    return out + stream.flush()


@settings(max_examples=300, deadline=None)
@given(st.lists(ALPHABET, max_size=60).map("".join), st.lists(st.integers(0, 200), max_size=12))
def test_any_piecewise_feed_gives_the_whole_texts_sentences(text, cuts):
    assert _feed(text, cuts, SentenceStream(first_min_chars=None, max_chars=10_000)) == split_sentences(text)


def test_sentences_leave_as_soon_as_they_end_and_the_tail_waits_for_flush():
    stream = SentenceStream(first_min_chars=None)
    assert stream.feed("Hello there. How are") == ["Hello there."]
    assert stream.feed(" you? I am") == ["How are you?"]
    assert stream.feed(" fine") == []
    assert stream.flush() == ["I am fine"]
    assert SentenceStream().feed("你好。今天") == ["你好。"]  # CJK stops end a sentence without a space


def test_the_first_sentence_is_cut_early_at_a_clause_once_long_enough():
    stream = SentenceStream(first_min_chars=20)
    assert stream.feed("Short, then") == []  # a clause boundary, but too early
    assert stream.feed(" a longer clause follows here, and") == ["Short, then a longer clause follows here,"]
    assert stream.feed(" the rest, with commas, waits") == []  # only the first sentence is cut early
    assert stream.feed(" for its end. ") == ["and the rest, with commas, waits for its end."]


def test_a_sentence_that_never_ends_is_cut_at_a_boundary_below_max_chars():
    stream = SentenceStream(first_min_chars=None, max_chars=30)
    out = stream.feed("word " * 20) + stream.flush()
    assert all(len(s) <= 30 for s in out) and " ".join(out) == ("word " * 20).strip()


@settings(max_examples=300, deadline=None)
@given(st.lists(ALPHABET, max_size=60).map("".join), st.lists(st.integers(0, 200), max_size=12))
def test_held_accounts_for_every_character_fed(text, cuts):
    """A WebSocket session's bound on unspoken text (issue 21 item 7) counts what `held` says the splitter keeps:
    what one feed lets go is never less than the sentences it returns, and nothing is held after `flush`."""
    stream = SentenceStream(first_min_chars=5, max_chars=12)  # every kind of cut: early, at an end, forced
    bounds = sorted({0, len(text), *(c % (len(text) + 1) for c in cuts)})
    for start, end in zip(bounds, bounds[1:]):
        before = stream.held + end - start
        sentences = stream.feed(text[start:end])
        assert 0 <= stream.held <= before - sum(map(len, sentences))
    stream.flush()
    assert stream.held == 0
