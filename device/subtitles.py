"""Subtitle files from word times: WebVTT and SRT (written by webvtt-py, docs/architecture.md says why).

Words become cues in order: a cue ends after a word that ends a sentence, before a pause of at least
`pause_s` between two words, and when the next word would not fit its `lines` lines of `width` characters (lines
are filled word by word; a word longer than a line keeps a line of its own). A cue runs from its first word's
start to its last word's end; the last cue ends with the audio. Words join with a space, except between two CJK
characters or before CJK punctuation, which join as written.
"""
from __future__ import annotations

import html
import io
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from cosyedge.device.errors import InputError
from cosyedge.device.options import Word

FORMATS = ("vtt", "srt")
SENTENCE_ENDS = (".", "!", "?", "…", "。", "！", "？")
CLOSERS = "\"'”’)]}」』）"
DEFAULT_WIDTH = 42  # characters per line (a common subtitle guideline)
MIN_CUE_S = 0.001  # a cue must end after it starts (WebVTT); the smallest step both formats write


@dataclass(frozen=True)
class SubtitleStyle:
    """How words are cut into cues and lines (validated once)."""
    width: int = DEFAULT_WIDTH  # characters per line
    lines: int = 2         # lines per cue
    pause_s: float = 0.5   # a silence this long between two words starts a new cue

    def __post_init__(self) -> None:
        if not 8 <= self.width <= 200 or not 1 <= self.lines <= 5 or not 0 < self.pause_s <= 10:
            raise InputError("subtitles: width must be 8-200 characters, lines 1-5, pause 0-10 s")


@dataclass(frozen=True)
class Cue:
    start_s: float
    end_s: float
    lines: tuple[str, ...]


def _cjk(char: str) -> bool:
    return "\u3000" <= char <= "\u9fff" or "\uff00" <= char <= "\uffef"


def _join(left: str, right: str) -> str:
    if not left:
        return right
    return left + ("" if _cjk(left[-1]) and _cjk(right[0]) else " ") + right


def join_words(words: Sequence[str]) -> str:
    """Words as the text reads them: a space between two, none between two CJK characters."""
    joined = ""
    for word in words:
        joined = _join(joined, word)
    return joined


def _ends_sentence(text: str) -> bool:
    return text.rstrip(CLOSERS).endswith(SENTENCE_ENDS)


def _fits(lines: list[str], word: str, style: SubtitleStyle) -> list[str] | None:
    """The cue's lines with `word` added, or None if it needs more than `style.lines` lines."""
    if not lines:
        return [word]
    joined = _join(lines[-1], word)
    if len(joined) <= style.width:
        return [*lines[:-1], joined]
    return [*lines, word] if len(lines) < style.lines else None


def cues(words: Sequence[Word], duration_s: float, style: SubtitleStyle = SubtitleStyle()) -> list[Cue]:
    """The cues of `words` (in order, on the audio's clock) for audio of `duration_s` seconds."""
    out: list[Cue] = []
    lines: list[str] = []
    start = end = 0.0
    for index, word in enumerate(words):
        text = word.text.strip()
        if not text:
            continue
        added = _fits(lines, text, style)
        pause = bool(lines) and word.start_s - end >= style.pause_s
        if lines and (added is None or pause or _ends_sentence(lines[-1])):
            out.append(Cue(start, end, tuple(lines)))
            lines, added = [], [text]
        if not lines:
            start = word.start_s
        lines, end = added, max(word.end_s, end)
    if lines:
        out.append(Cue(start, max(end, duration_s), tuple(lines)))
    return [Cue(c.start_s, max(c.end_s, c.start_s + MIN_CUE_S), c.lines) for c in out]


def format_of(path: Path) -> str:
    """The subtitle format a file name asks for (`.vtt` or `.srt`)."""
    fmt = path.suffix.lower().lstrip(".")
    if fmt not in FORMATS:
        raise InputError(f"subtitle file {path.name!r}: name it .vtt or .srt")
    return fmt


def write(words: Sequence[Word], duration_s: float, fmt: str, style: SubtitleStyle = SubtitleStyle()) -> str:
    """The subtitle file (`vtt` or `srt`) of `words` for audio of `duration_s` seconds."""
    import webvtt
    from webvtt.models import Timestamp

    if fmt not in FORMATS:
        raise InputError(f"unknown subtitle format {str(fmt)[:16]!r}; choose vtt or srt")
    # WebVTT cue text is markup: &, < and > are escaped. SRT has no escapes (players read <b>, <i>, <u> as
    # formatting): the writer drops such tags, and an arrow that would read as a timing line loses a dash
    text = (lambda line: html.escape(line, quote=False)) if fmt == "vtt" else (lambda line: line.replace("-->", "->"))
    captions = [webvtt.Caption(start=str(Timestamp.from_seconds(c.start_s)), end=str(Timestamp.from_seconds(c.end_s)),
                               text=[text(line) for line in c.lines]) for c in cues(words, duration_s, style)]
    buffer = io.StringIO()
    webvtt.WebVTT(captions=captions).write(buffer, format=fmt)
    content = buffer.getvalue()
    return content if content.endswith("\n") else content + "\n"
