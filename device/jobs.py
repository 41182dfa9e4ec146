"""Offline batch jobs: thousands of lines to audio files, resumable, failures kept in a dead-letter file.

A line's output is written to a temporary name and renamed when complete, so a killed job
leaves no half-written file; a rerun skips every line whose file exists and decodes.
"""
from __future__ import annotations

import csv
import json
import re
import sys
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

import soundfile as sf

from cosyedge.device.audio import decodes, encode_wave
from cosyedge.device.door import Door, Job, collect
from cosyedge.device.engine import Engine
from cosyedge.device.errors import CosyedgeError, InputError
from cosyedge.device.paths import read_text
from cosyedge.device.request import Request

DEAD_LETTER = "dead_letter.jsonl"
MAX_INPUT_BYTES = 64 << 20  # a job's input file (a long book is a few MB); /dev/zero is refused, not read whole
MAX_ID = 200  # characters of an id: it names the output file (255 bytes at most, with the suffixes)
_SAFE_ID = re.compile(r"[^A-Za-z0-9._-]+")


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


def run_job(engine: Engine, lines: list[Line], out_dir: Path, job: Request, progress: bool = True) -> dict:
    """Synthesize every line not yet done with the request's options, format and rate, each a whole job through
    the engine's door; return a summary (done, skipped, failed, audio seconds, RTF)."""
    _out_dir(out_dir)
    fmt, rate = job.format, engine.sample_rate

    def output(line: Line) -> Path:
        if len(line.key.encode()) > MAX_ID:  # the file system would refuse its name (ENAMETOOLONG)
            raise InputError(f"id has {len(line.key.encode())} bytes; it names the output file: at most {MAX_ID}")
        return out_dir / f"{line.key}.{fmt}"

    with Door(engine) as door:
        def render(line: Line) -> float:
            target = output(line)
            wave = collect(door.stream(Job(engine.segments(line.text), job.options, chunked=False)))
            partial = target.with_name(f".{target.name}.partial")
            partial.write_bytes(encode_wave(wave, rate, fmt, job.sample_rate))
            partial.replace(target)
            return len(wave) / rate

        return run_lines(lines, render, lambda line: _complete(output(line)), out_dir / DEAD_LETTER, progress)


def run_lines(lines: list[Line], render: Callable[[Line], float], done: Callable[[Line], bool], dead_letter: Path,
              progress: bool = True) -> dict:
    """The resumable loop of a job: skip the lines `done` says are done, `render` the others (it returns the
    line's audio seconds), a line that fails goes to the `dead_letter` file; a progress bar on stderr."""
    def pending(line: Line) -> bool:
        try:
            return not done(line)
        except CosyedgeError:
            return True  # an unusable line: render() meets the same refusal and dead-letters it

    todo = [line for line in lines if pending(line)]
    summary = {"total": len(lines), "skipped": len(lines) - len(todo), "done": 0, "failed": 0,
               "audio_s": 0.0, "compute_s": 0.0}
    from tqdm import tqdm
    bar = tqdm(total=len(lines), initial=summary["skipped"], unit="line", disable=not progress, file=sys.stderr,
               dynamic_ncols=True)
    with dead_letter.open("a", encoding="utf-8") as dead:
        for line in todo:
            start = time.perf_counter()
            try:
                seconds = render(line)
            except Exception as exc:  # noqa: BLE001 - one line's failure (input, runtime, encoder) never ends the job
                summary["failed"] += 1
                error = str(exc) if isinstance(exc, CosyedgeError) else f"{type(exc).__name__}: {exc}"
                dead.write(json.dumps({"id": line.key, "text": line.text, "error": error,
                                       "time": datetime.now(timezone.utc).isoformat(timespec="seconds")},
                                      ensure_ascii=False) + "\n")
                dead.flush()
            else:
                summary["done"] += 1
                summary["audio_s"] += seconds
            summary["compute_s"] += time.perf_counter() - start
            bar.update(1)
            if summary["audio_s"]:
                bar.set_postfix(audio=f"{summary['audio_s']:.0f}s", rtf=f"{summary['compute_s'] / summary['audio_s']:.3f}",
                                failed=summary["failed"])
    bar.close()
    summary["rtf"] = round(summary["compute_s"] / summary["audio_s"], 4) if summary["audio_s"] else None
    summary["audio_s"], summary["compute_s"] = round(summary["audio_s"], 2), round(summary["compute_s"], 2)
    return summary
