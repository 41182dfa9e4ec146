"""Offline batch jobs: thousands of lines to audio files, resumable, failures kept in a dead-letter file.

`in_flight` lines are in the engine at once, each a whole job through the engine's door (the same door as the
service: CosyVoice lines share decode steps, VITS lines take turns sentence by sentence). A line's output is
written to a temporary name as its sentences arrive and renamed when complete, so a killed job leaves no
half-written file; a rerun skips every line whose file exists and decodes. A line longer than the engine's text
bound (a chapter) is rendered in windows of whole sentences, one door job after the other, and written as it
comes: memory follows the sentences in flight, not the line's length. Sentences meet in a 10 ms equal-power
crossfade (docs/batch.md).
"""
from __future__ import annotations

import csv
import json
import re
import sys
import tempfile
import time
import unicodedata
import wave
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, Iterator, Sequence

import numpy as np
import soundfile as sf

from cosyedge.device.audio import Crossfade, Resampler, decodes, encode_pcm_file, to_pcm16
from cosyedge.device.door import Door, Job
from cosyedge.device.engine import Engine
from cosyedge.device.errors import CosyedgeError, InputError
from cosyedge.device.options import Word, on_rate
from cosyedge.device.paths import read_text
from cosyedge.device.request import Request, check_in_flight
from cosyedge.device.subtitles import FORMATS as SUBTITLE_FORMATS, write as write_subtitles
from cosyedge.device.text import SENTENCE_END

DEAD_LETTER = "dead_letter.jsonl"
MAX_INPUT_BYTES = 64 << 20  # a job's input file (a long book is a few MB); /dev/zero is refused, not read whole
MAX_ID = 200  # characters of an id: it names the output file (255 bytes at most, with the suffixes)
_SAFE_ID = re.compile(r"[^A-Za-z0-9._-]+")
JOIN_S = 0.010  # the equal-power crossfade where two sentences of a line meet


@dataclass(frozen=True)
class Line:
    key: str
    text: str


def read_lines(path: Path) -> list[Line]:
    """`.csv` with columns id,text (header optional) or `.txt` with one text per line (ids = line numbers); UTF-8,
    with or without a byte-order mark (Excel's "CSV UTF-8" has one)."""
    raw = read_text(path, "input file", MAX_INPUT_BYTES)
    lines: list[Line] = []
    if path.suffix.lower() == ".csv":
        reader = csv.reader(raw.splitlines())
        try:
            rows = [r for r in reader if r]
        except csv.Error as exc:  # e.g. a field over the csv module's 131,072 characters
            raise InputError(f"{path.name} line {reader.line_num}: not CSV ({exc})") from None
        if rows and [c.strip().lower() for c in rows[0][:2]] == ["id", "text"]:
            rows = rows[1:]
        for number, row in enumerate(rows, 1):
            if len(row) < 2:
                raise InputError(f"{path.name} row {number}: expected 'id,text'")
            lines.append(Line(_SAFE_ID.sub("_", row[0].strip()) or f"{number:06d}", ",".join(row[1:]).strip()))
    else:
        width = max(6, len(str(len(raw.splitlines()))))
        lines = [Line(f"{n:0{width}d}", t.strip()) for n, t in enumerate(raw.splitlines(), 1) if t.strip()]
    keys = [line.key for line in lines]
    if len(set(keys)) != len(keys):
        raise InputError(f"{path.name}: duplicate ids; every line needs its own id")
    return lines


def _complete(path: Path) -> bool:
    """A finished output decodes to some audio; anything else (empty, corrupt, foreign) is made again."""
    if not path.is_file() or path.stat().st_size == 0:
        return False
    if path.suffix == ".pcm":
        return path.stat().st_size % 2 == 0
    if path.suffix in (".wav", ".flac"):
        try:
            return sf.info(str(path)).frames > 0
        except (RuntimeError, sf.LibsndfileError):
            return False
    return decodes(path)  # compressed formats: through ffmpeg, as a player would


def _out_dir(path: Path) -> Path:
    if path.exists() and not path.is_dir():
        raise InputError(f"--out-dir {path.name!r} is a file; give a directory")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError:
        raise InputError(f"--out-dir {path.name!r} cannot be created") from None
    return path


def windows(text: str, limit: int) -> Iterator[str]:
    """A line's text in pieces of whole sentences (cut where `text.split_sentences` cuts), each at most `limit`
    characters after NFKC; a line within the limit is one piece, as it is. A sentence over the limit is a piece of
    its own (the engine refuses it, as it would the line)."""
    if len(unicodedata.normalize("NFKC", text)) <= limit:
        yield text
        return
    start = last = 0
    for cut in [m.end() for m in SENTENCE_END.finditer(text)] + [len(text)]:
        if last > start and len(unicodedata.normalize("NFKC", text[start:cut])) > limit:
            if text[start:last].strip():
                yield text[start:last]
            start = last
        last = cut
    if text[start:].strip():
        yield text[start:]


class _Output:
    """One line's file as its sentences arrive: joined (`Crossfade`), resampled as they come, pcm16 into a partial
    file (wav: the `wave` module patches its header at the end; a compressed format: ffmpeg encodes the partial
    pcm file to the partial output), renamed into place when whole; `discard` removes the partial files. With
    `subtitles` (vtt, srt) the sentences' words, moved onto the line's clock (after the joins), are written beside
    it (`<id>.<vtt|srt>`), before the audio is renamed into place: a line whose audio is there has its subtitles."""

    def __init__(self, target: Path, rate: int, fmt: str, out_rate: int | None, subtitles: str | None = None) -> None:
        self.target, self.fmt, self.rate = target, fmt, rate
        self.out_rate = out_rate or rate
        self.subtitles = subtitles
        self.words: list[Word] = []
        self._fed = 0  # samples given to `write`, before the joins
        self.partial = _partial(target)
        self.spool = self.partial if fmt in ("wav", "pcm") else target.with_name(f".{target.name}.pcm.partial")
        self.samples = 0  # at the engine's rate, after the joins
        self._join, self._resample = Crossfade(round(JOIN_S * rate)), Resampler(rate, out_rate)
        self._file = self.spool.open("wb")
        self._wave = None
        if fmt == "wav":
            self._wave = wave.open(self._file, "wb")
            self._wave.setnchannels(1)
            self._wave.setsampwidth(2)
            self._wave.setframerate(self.out_rate)

    def write(self, sentence: np.ndarray, words: Sequence[Word] = ()) -> None:
        """A sentence's audio and its words, timed from its first sample."""
        self._put(self._join(sentence))
        start = (self._fed - self._join.overlapped) / self.rate  # the join pulls the sentence into the one before
        self.words += [Word(w.text, start + w.start_s, start + w.end_s) for w in words]
        self._fed += len(sentence)

    def _put(self, samples: np.ndarray, last: bool = False) -> None:
        self.samples += len(samples)
        pcm = to_pcm16(np.concatenate([self._resample(samples), self._resample.flush()]) if last else
                       self._resample(samples))
        if self._wave is not None:
            self._wave.writeframesraw(pcm)
        else:
            self._file.write(pcm)

    def finish(self) -> float:
        """Write what is held back, close and rename into place; the line's audio seconds."""
        self._put(self._join.flush(), last=True)
        if self._wave is not None:
            self._wave.close()  # the header's sizes; the file itself is ours to close
        self._file.close()
        if self.spool != self.partial:
            encode_pcm_file(self.spool, self.out_rate, self.fmt, self.partial)
            self.spool.unlink()
        if self.subtitles is not None:
            _replace(subtitle_path(self.target, self.subtitles),
                     write_subtitles(on_rate(self.words, self.out_rate), self.samples / self.rate,
                                     self.subtitles).encode("utf-8"))
        self.partial.replace(self.target)
        return self.samples / self.rate

    def discard(self) -> None:
        self._file.close()
        for path in {self.spool, self.partial}:
            path.unlink(missing_ok=True)


def subtitle_path(audio: Path, fmt: str) -> Path:
    """Where a line's subtitles go: beside its audio, `<id>.<vtt|srt>`."""
    return audio.with_name(f"{audio.stem}.{fmt}")


def _partial(path: Path) -> Path:
    """The temporary name a file is written under before it is renamed into place."""
    return path.with_name(f".{path.name}.partial")


def _replace(path: Path, data: bytes) -> None:
    """`data` written under the partial name, then renamed onto `path`: a reader sees the whole file or none."""
    partial = _partial(path)
    try:
        partial.write_bytes(data)
        partial.replace(path)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise


def prepare(out_dir: Path, subtitles: str | None) -> None:
    """A job's checks before its first line: the subtitle format and the output directory (made if missing)."""
    if subtitles is not None and subtitles not in SUBTITLE_FORMATS:
        raise InputError(f"unknown subtitle format {str(subtitles)[:16]!r}; choose vtt or srt")
    _out_dir(out_dir)


def line_path(out_dir: Path, line: Line, fmt: str) -> Path:
    """Where a line's audio goes: `<out_dir>/<id>.<format>`."""
    if len(line.key.encode()) > MAX_ID:  # the file system would refuse its name (ENAMETOOLONG)
        raise InputError(f"id has {len(line.key.encode())} bytes; it names the output file: at most {MAX_ID}")
    return out_dir / f"{line.key}.{fmt}"


def line_done(audio: Path, subtitles: str | None) -> bool:
    """A line is done when its audio decodes and, with `subtitles`, its subtitle file is there (whoever made them)."""
    return _complete(audio) and (subtitles is None or subtitle_path(audio, subtitles).is_file())


def render_line(engine: Engine, door: Door, text: str, target: Path, job: Request, subtitles: str | None) -> float:
    """One line through the door into `target` (with its `subtitles` file beside it when asked), written as its
    sentences arrive (a long line: one door job per window of sentences) and renamed into place when whole; its
    audio seconds. The one renderer of a line: the local job writes into its output directory, a Ray actor into a
    scratch directory it reads back (`render_bytes`)."""
    words, rate = subtitles is not None, engine.sample_rate
    texts = windows(text, engine.limits.max_text_len)
    segments = engine.segments(next(texts, text), words=words)  # a first refusal leaves no file
    out = _Output(target, rate, job.format, job.rate(rate), subtitles)
    try:
        while segments is not None:
            heard = 0  # samples of this window's job so far: its chunks' words are on its clock
            for chunk in door.stream(Job(segments, job.options, chunked=False, words=words)):
                begin, heard = heard / rate, heard + chunk.audio.size  # whole jobs: a chunk a sentence
                out.write(chunk.audio, [Word(w.text, w.start_s - begin, w.end_s - begin) for w in chunk.words])
            segments = next((engine.segments(text, words=words) for text in texts), None)  # the next window
        return out.finish()
    except BaseException:
        out.discard()
        raise


@dataclass(frozen=True)
class Rendered:
    """A line's finished files as bytes: how a worker on another machine hands them to the job's one writer."""
    audio: bytes
    subtitles: str | None
    seconds: float


def render_bytes(engine: Engine, door: Door, line: Line, job: Request, subtitles: str | None) -> Rendered:
    """`render_line` into a scratch directory, read back (a whole line in memory: it travels as one object)."""
    with tempfile.TemporaryDirectory(prefix="cosyedge-line-") as scratch:
        target = Path(scratch) / f"line.{job.format}"
        seconds = render_line(engine, door, line.text, target, job, subtitles)
        text = subtitle_path(target, subtitles).read_text(encoding="utf-8") if subtitles is not None else None
        return Rendered(target.read_bytes(), text, seconds)


def place(target: Path, rendered: Rendered, subtitles: str | None) -> float:
    """Write a rendered line as `render_line` would have: its subtitle file first, then its audio, each under a
    partial name renamed into place (so `line_done` means the same); its audio seconds."""
    if subtitles is not None:
        _replace(subtitle_path(target, subtitles), (rendered.subtitles or "").encode("utf-8"))
    _replace(target, rendered.audio)
    return rendered.seconds


def run_job(engine: Engine, lines: list[Line], out_dir: Path, job: Request, progress: bool = True,
            in_flight: int | None = None, subtitles: str | None = None) -> dict:
    """Synthesize every line not yet done with the request's options, format and rate, `in_flight` lines at once
    (default: the engine's batch bound), each a whole job through the engine's door (a long line: one job per
    window of sentences), with its `subtitles` file (vtt, srt) when asked; return a summary (done, skipped,
    failed, audio seconds, audio seconds per second, RTF). A line is done when its audio decodes and, with
    `subtitles`, its subtitle file is there."""
    prepare(out_dir, subtitles)
    with Door(engine) as door:
        return run_lines(lines, lambda line: render_line(engine, door, line.text, line_path(out_dir, line, job.format),
                                                         job, subtitles),
                         lambda line: line_done(line_path(out_dir, line, job.format), subtitles),
                         out_dir / DEAD_LETTER, progress, engine.limits.batch_max if in_flight is None else in_flight)


def run_lines(lines: list[Line], render: Callable[[Line], float], done: Callable[[Line], bool], dead_letter: Path,
              progress: bool = True, in_flight: int = 1) -> dict:
    """The resumable loop of a job: skip the lines `done` says are done, `render` the others, `in_flight` at once on
    threads of their own (`render` returns the line's audio seconds; lines finish in any order), a line that fails
    goes to the `dead_letter` file; a progress bar on stderr (lines/s, ETA, audio seconds per second, running RTF)."""
    check_in_flight(in_flight)

    def pending(line: Line) -> bool:
        try:
            return not done(line)
        except CosyedgeError:
            return True  # an unusable line: render() meets the same refusal and dead-letters it

    left = [line for line in lines if pending(line)]
    summary = {"total": len(lines), "skipped": len(lines) - len(left), "done": 0, "failed": 0, "in_flight": in_flight,
               "audio_s": 0.0, "wall_s": 0.0}
    todo = iter(left)
    from tqdm import tqdm
    begin = time.perf_counter()
    running: dict[Future, Line] = {}
    pool = ThreadPoolExecutor(in_flight, "cosyedge-line")
    with dead_letter.open("a", encoding="utf-8") as dead:
        def submit() -> None:
            if (line := next(todo, None)) is not None:
                running[pool.submit(render, line)] = line
        for _ in range(in_flight):
            submit()
        bar = tqdm(total=len(lines), initial=summary["skipped"], unit="line", disable=not progress, file=sys.stderr,
                   dynamic_ncols=True)
        try:
            while running:
                for future in wait(running, return_when=FIRST_COMPLETED).done:
                    line = running.pop(future)
                    submit()
                    _record(summary, line, future, dead)
                    bar.update(1)
                    elapsed = time.perf_counter() - begin
                    if summary["audio_s"]:
                        bar.set_postfix({"audio": f"{summary['audio_s']:.0f}s",
                                         "audio/s": f"{summary['audio_s'] / elapsed:.2f}",
                                         "rtf": f"{elapsed / summary['audio_s']:.3f}", "failed": summary["failed"]})
        finally:  # all done, or interrupted: lines not started are dropped; closing the door ends those waiting in it
            pool.shutdown(wait=False, cancel_futures=True)
            bar.close()
    summary["wall_s"] = time.perf_counter() - begin
    audio = summary["audio_s"]
    summary["audio_s_per_s"] = round(audio / summary["wall_s"], 4) if summary["wall_s"] else None
    summary["rtf"] = round(summary["wall_s"] / audio, 4) if audio else None
    summary["audio_s"], summary["wall_s"] = round(audio, 2), round(summary["wall_s"], 2)
    return summary


def _record(summary: dict, line: Line, future: Future, dead) -> None:
    """A finished line in the summary, or its failure in the dead-letter file (one line's failure - input,
    runtime, encoder - never ends the job)."""
    try:
        seconds = future.result()
    except Exception as exc:  # noqa: BLE001
        summary["failed"] += 1
        error = str(exc) if isinstance(exc, CosyedgeError) else f"{type(exc).__name__}: {exc}"
        dead.write(json.dumps({"id": line.key, "text": line.text, "error": error,
                               "time": datetime.now(timezone.utc).isoformat(timespec="seconds")},
                              ensure_ascii=False) + "\n")
        dead.flush()
    else:
        summary["done"] += 1
        summary["audio_s"] += seconds
