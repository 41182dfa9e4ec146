"""Subtitle files (device/subtitles.py): valid WebVTT and SRT of the default voice's word times, parsed back by
subtitle libraries (webvtt-py, and `srt` for SRT: another implementation than the writer's); cue and line rules on
constructed words; the default voice's stream of words."""
from __future__ import annotations

import html
import io
import re

import pytest
import srt
import webvtt

from cosyedge.device.errors import InputError
from cosyedge.device.options import Word
from cosyedge.device.subtitles import SubtitleStyle, cues, write

FRAME_S = 256 / 22050   # one output frame of the default voice
PARAGRAPH = ("Counter 3 is open again. Please bring your ticket, your passport and $12.50 for the fee; the bus "
             "leaves at 3:45 from platform 7. Thank you for waiting!")
VTT_TIMING = re.compile(r"^\d{2}:\d{2}:\d{2}\.\d{3} --> \d{2}:\d{2}:\d{2}\.\d{3}$")
SRT_TIMING = re.compile(r"^\d{2}:\d{2}:\d{2},\d{3} --> \d{2}:\d{2}:\d{2},\d{3}$")


@pytest.fixture(scope="module")
def spoken(default_engine):
    wave, words = default_engine.synthesize_words(PARAGRAPH, deterministic=True)
    return words, wave.size / default_engine.sample_rate


def test_webvtt_of_the_default_voice_parses_back_with_the_words_in_order(spoken) -> None:
    words, duration = spoken
    content = write(words, duration, "vtt", SubtitleStyle(width=32))
    lines = content.splitlines()
    assert lines[0] == "WEBVTT" and lines[1] == ""
    timings = [line for line in lines if "-->" in line]
    assert timings and all(VTT_TIMING.match(line) for line in timings)
    parsed = webvtt.WebVTT.from_buffer(io.StringIO(content), strict=True).captions
    assert len(parsed) == len(timings) >= 3          # cut at the sentence ends at least
    text = " ".join(html.unescape(c.text) for c in parsed).split()
    assert " ".join(text) == " ".join(w.text for w in words) == " ".join(PARAGRAPH.split())
    assert all(len(line) <= 32 for c in parsed for line in c.lines)
    assert abs(parsed[-1].end_time.in_milliseconds() / 1000 - duration) <= FRAME_S
    starts = [c.start_time.in_milliseconds() for c in parsed]
    assert starts == sorted(starts) and all(c.start_time.in_milliseconds() < c.end_time.in_milliseconds() for c in parsed)


def test_srt_of_the_default_voice_parses_back_with_numbering_and_comma_milliseconds(spoken) -> None:
    words, duration = spoken
    content = write(words, duration, "srt")
    blocks = content.strip().split("\n\n")
    assert [int(b.splitlines()[0]) for b in blocks] == list(range(1, len(blocks) + 1))
    assert all(SRT_TIMING.match(b.splitlines()[1]) for b in blocks)
    parsed = list(srt.parse(content))              # another implementation than the writer's
    assert [s.index for s in parsed] == list(range(1, len(parsed) + 1))
    assert " ".join(" ".join(s.content.split()) for s in parsed) == " ".join(w.text for w in words)
    assert abs(parsed[-1].end.total_seconds() - duration) <= FRAME_S
    assert len(webvtt.WebVTT.from_buffer(io.StringIO(content), format="srt").captions) == len(parsed)


def w(text: str, start: float, end: float) -> Word:
    return Word(text, start, end)


def test_cues_end_at_sentence_ends_and_long_pauses_and_fill_their_lines() -> None:
    words = [w("One", 0.0, 0.2), w("two.", 0.2, 0.5), w("Three", 0.6, 0.9), w("four", 0.9, 1.1),
             w("five", 1.9, 2.1), w("six", 2.1, 2.3)]              # a 0.8 s pause before "five"
    got = cues(words, 2.5, SubtitleStyle(width=20, pause_s=0.5))
    assert [c.lines for c in got] == [("One two.",), ("Three four",), ("five six",)]
    assert [(c.start_s, c.end_s) for c in got] == [(0.0, 0.5), (0.6, 1.1), (1.9, 2.5)]  # the last runs to the end
    long = [w(f"word{i}", i * 0.3, i * 0.3 + 0.3) for i in range(12)]
    wrapped = cues(long, 3.6, SubtitleStyle(width=16, lines=2))
    assert all(len(line) <= 16 for c in wrapped for line in c.lines) and all(len(c.lines) <= 2 for c in wrapped)
    assert [x for c in wrapped for line in c.lines for x in line.split()] == [x.text for x in long]
    assert len(wrapped) == 3                                       # 12 words of 5-6 letters: 4 a cue


def test_cjk_words_join_without_spaces_and_markup_is_escaped_in_webvtt() -> None:
    chinese = [w("欢", 0.0, 0.2), w("迎", 0.2, 0.4), w("光临。", 0.4, 0.9)]
    assert cues(chinese, 1.0)[0].lines == ("欢迎光临。",)
    tricky = [w("a<b>", 0.0, 0.5), w("&", 0.5, 0.7), w("c-->d", 0.7, 1.0)]
    vtt = write(tricky, 1.0, "vtt")
    assert "a&lt;b&gt; &amp; c--&gt;d" in vtt
    assert html.unescape(webvtt.WebVTT.from_buffer(io.StringIO(vtt), strict=True).captions[0].text) == "a<b> & c-->d"
    # SRT has no escapes and players take <b> as bold: the writer drops such a tag, keeps the rest
    assert list(srt.parse(write(tricky, 1.0, "srt")))[0].content == "a & c->d"


def test_the_style_is_checked_once() -> None:
    for bad in (dict(width=5), dict(lines=0), dict(pause_s=0)):
        with pytest.raises(InputError, match="width must be"):
            SubtitleStyle(**bad)
    with pytest.raises(InputError, match="unknown subtitle format"):
        write([w("Hi.", 0.0, 0.3)], 0.3, "ass")


def test_the_default_voice_streams_each_sentence_with_its_words(default_engine, spoken) -> None:
    """`Engine.stream_words`: a sentence is one chunk, sent with its words on the stream's clock (those of
    `synthesize_words`, whose waveform the chunks make up)."""
    options = default_engine.options(deterministic=True)
    sent, words = 0, []
    for chunk, done in default_engine.stream_words(default_engine.segments(PARAGRAPH, words=True), options):
        sent += chunk.size
        assert done and all(w.end_s <= sent / default_engine.sample_rate + 1e-9 for w in done)
        words += done
    whole, duration = spoken
    assert sent / default_engine.sample_rate == pytest.approx(duration)
    assert [(w.text, round(w.start_s, 9), round(w.end_s, 9)) for w in words] == \
        [(w.text, round(w.start_s, 9), round(w.end_s, 9)) for w in whole]
