"""Phrase cache: the encoded answer of a reproducible request, kept in the state directory and served again.

A kiosk says the same sentences all day; each repeat would cost a whole synthesis. Only requests whose options
give the same audio on every call are kept (`Engine.reproducible`: a fixed seed, or no noise where the family
needs no seed). The key is a sha256 over everything the audio depends on: the text's segments (the family's own
normalisation: phonemes or frontend tokens), every field of `SynthesisOptions`, the format, the sample rates,
the bundle's manifest (it lists every graph's sha256) and the selection loaded, and the content of a registered
voice's file, so a bundle or voice change can never serve stale audio: its requests simply have new keys.

Layout: `<state dir>/cache/<key[:2]>/<key>.bin`, each a JSON header line (payload sha256, content type, audio
seconds) and the payload. Writes go to a temporary name and are renamed, so a reader sees a whole entry or none;
an entry whose payload does not match its sha256 is deleted and counts as a miss. A hit touches the file's
mtime; beyond the size cap the least recently used entries are deleted.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from flask import Flask, Response, current_app
from prometheus_client import Counter, Gauge

from cosyedge.device import MIME, Engine, Segment, SynthesisOptions
from cosyedge.device.paths import state_dir as default_state_dir

log = logging.getLogger(__name__)

HEADER = "X-Cosyedge-Cache"
EXTENSION = "cosyedge_cache"
FOLDER = "cache"
_SCHEMA = 1  # part of every key: a change of what goes into the key or the entry never reads old entries


@dataclass(frozen=True)
class Entry:
    """One encoded answer and what its HTTP response says about it."""
    audio: bytes
    content_type: str
    audio_seconds: float


def content_type(fmt: str, rate: int) -> str:
    """The Content-Type of an answer (raw pcm carries its rate)."""
    return f"audio/L16; rate={rate}; channels=1" if fmt == "pcm" else MIME[fmt]


# The names the cache writes: <first two hex digits>/<sha256 key>.bin, and .<that name>.<pid>.<thread>.partial while
# writing. Eviction and `clear` delete only such names, never another file someone put in the folder.
_ENTRY = re.compile(r"[0-9a-f]{64}\.bin")
_PARTIAL = re.compile(r"\.[0-9a-f]{64}\.bin\.\d+\.\d+\.partial")


def _ours(path: Path, name: re.Pattern[str]) -> bool:
    return name.fullmatch(path.name) is not None and path.name.lstrip(".")[:2] == path.parent.name


def state_root(state_dir: str | None) -> Path:
    """The service's state directory (the configured one, else the default)."""
    return Path(state_dir) if state_dir else default_state_dir()


class PhraseCache:
    """Content-addressed entries under `root`, at most `max_bytes` in all. Safe across threads and processes."""

    def __init__(self, root: Path, max_bytes: int) -> None:
        self.root = root
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._hashes: dict[tuple[str, int, int, int], str] = {}  # (path, inode, size, mtime) -> sha256 of a voice file
        self._bundles: dict[int, tuple[Any, str]] = {}  # id(bundle) -> (the bundle, sha256 of its manifest)

    # -- keys --------------------------------------------------------------------------------------
    def key(self, engine: Engine, segments: Sequence[Segment], options: SynthesisOptions, fmt: str,
            sample_rate: int | None = None) -> str | None:
        """The request's key, or None when its audio is not reproducible (then it is never cached)."""
        if not engine.reproducible(options):
            return None
        voice_file = engine.voice_file(options.voice)
        material = {"schema": _SCHEMA, "segments": [[s.text, list(s.ids)] for s in segments],
                    "options": asdict(options), "format": fmt, "rate": engine.sample_rate, "out_rate": sample_rate,
                    "bundle": self._bundle_hash(engine),
                    "selection": engine.precision, "voice_file": self._file_hash(voice_file) if voice_file else None}
        return hashlib.sha256(json.dumps(material, sort_keys=True, ensure_ascii=False).encode()).hexdigest()

    def _bundle_hash(self, engine: Engine) -> str:
        """sha256 of the bundle's manifest (it lists every graph's sha256), once per loaded bundle."""
        bundle = engine.bundle
        with self._lock:
            known = self._bundles.get(id(bundle))
        if known is None or known[0] is not bundle:
            known = (bundle, hashlib.sha256(bundle.manifest.to_json().encode()).hexdigest())
            with self._lock:
                self._bundles[id(bundle)] = known
        return known[1]

    def _file_hash(self, path: Path) -> str:
        """sha256 of a file, remembered while its inode, size and mtime stay (a re-registration renames a new one in)."""
        stat = path.stat()
        memo = (str(path), stat.st_ino, stat.st_size, stat.st_mtime_ns)
        with self._lock:
            known = self._hashes.get(memo)
        if known is None:
            known = hashlib.sha256(path.read_bytes()).hexdigest()
            with self._lock:
                self._hashes[memo] = known
        return known

    # -- entries -----------------------------------------------------------------------------------
    def _path(self, key: str) -> Path:
        return self.root / key[:2] / f"{key}.bin"

    def get(self, key: str) -> Entry | None:
        """The entry, or None (absent, or corrupt: then it is deleted)."""
        path = self._path(key)
        try:
            data = path.read_bytes()
        except OSError:
            return None
        head, _, audio = data.partition(b"\n")
        try:
            meta = json.loads(head)
            entry = Entry(audio, str(meta["content_type"]), float(meta["audio_seconds"]))
            valid = meta["sha256"] == hashlib.sha256(audio).hexdigest()
        except (ValueError, KeyError, TypeError):
            valid = False
        if not valid:
            path.unlink(missing_ok=True)
            return None
        _touch(path)
        return entry

    def has(self, key: str) -> bool:
        return self.get(key) is not None

    def put(self, key: str, entry: Entry) -> None:
        """Store atomically (temporary name, then rename), then evict down to the cap."""
        head = json.dumps({"sha256": hashlib.sha256(entry.audio).hexdigest(), "content_type": entry.content_type,
                           "audio_seconds": entry.audio_seconds}).encode()
        if len(head) + 1 + len(entry.audio) > self.max_bytes:
            return  # larger than the whole cache
        path = self._path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.partial")
        with partial.open("wb") as handle:
            handle.write(head + b"\n" + entry.audio)
        partial.replace(path)
        _touch(path)
        self.evict()

    def _entries(self) -> list[tuple[int, int, Path]]:
        """(mtime, size, path) of every entry."""
        found = []
        for path in self.root.glob("*/*.bin"):
            if not _ours(path, _ENTRY):
                continue
            try:
                stat = path.stat()
            except OSError:
                continue
            found.append((stat.st_mtime_ns, stat.st_size, path))
        return found

    def evict(self) -> int:
        """Delete the least recently used entries until the total fits the cap; returns how many went."""
        with self._lock:
            entries = sorted(self._entries())
            total = sum(size for _, size, _ in entries)
            removed = 0
            for _, size, path in entries:
                if total <= self.max_bytes:
                    break
                path.unlink(missing_ok=True)
                total -= size
                removed += 1
            return removed

    def stats(self) -> dict[str, float]:
        entries = self._entries()
        return {"entries": len(entries), "bytes": sum(size for _, size, _ in entries), "max_bytes": self.max_bytes}

    def clear(self) -> int:
        """Delete every entry and unfinished write (nothing else), and the emptied folders; returns the entries."""
        count = 0
        for path in [*self.root.glob("*/*.bin"), *self.root.glob("*/.*.partial")]:
            if not (_ours(path, _ENTRY) or _ours(path, _PARTIAL)):
                continue
            path.unlink(missing_ok=True)
            count += path.suffix == ".bin"
        for folder in self.root.glob("*"):
            if folder.is_dir() and len(folder.name) == 2 and not any(folder.iterdir()):
                folder.rmdir()
        return count


def _touch(path: Path) -> None:
    """Mark an entry most recently used (nanoseconds: the file system's own clock ticks too coarsely)."""
    now = time.time_ns()
    try:
        os.utime(path, ns=(now, now))
    except OSError:
        pass  # evicted meanwhile: the caller still has the bytes


def open_cache(state_dir: str | None, max_mb: float) -> PhraseCache:
    return PhraseCache(state_root(state_dir) / FOLDER, int(max_mb * (1 << 20)))


# -- the HTTP side -----------------------------------------------------------------------------------
class HttpCache:
    """The app's cache and its counters in the app's metrics registry."""

    def __init__(self, cache: PhraseCache, registry) -> None:
        self.cache = cache
        self.hits = Counter("cosyedge_cache_hits_total", "reproducible requests answered from the phrase cache",
                            registry=registry)
        self.misses = Counter("cosyedge_cache_misses_total", "reproducible requests synthesized (then cached)",
                              registry=registry)
        Gauge("cosyedge_cache_bytes", "bytes in the phrase cache", registry=registry).set_function(
            lambda: cache.stats()["bytes"])


def install(app: Flask, state_dir: str | None, max_mb: float, registry) -> None:
    """Give the app its phrase cache (none when `max_mb` is 0)."""
    app.extensions[EXTENSION] = HttpCache(open_cache(state_dir, max_mb), registry) if max_mb > 0 else None


def answer(engine: Engine, job, speak: Callable[[], Response]) -> Response:
    """`speak()`'s answer to the job, or the cached one; says which in `X-Cosyedge-Cache` (streams: always miss)."""
    http: HttpCache | None = current_app.extensions.get(EXTENSION)
    try:
        key = None if http is None or job.stream else http.cache.key(engine, job.segments, job.options, job.answer,
                                                                     job.sample_rate)
    except OSError:  # a registered voice's file vanished under us: answer uncached
        key = None
    entry = http.cache.get(key) if key else None
    if entry is not None:
        http.hits.inc()
        return Response(entry.audio, content_type=entry.content_type, headers={
            "X-Sample-Rate": str(job.rate(engine.sample_rate)), "Cache-Control": "no-store",
            "X-Audio-Seconds": f"{entry.audio_seconds:.3f}", HEADER: "hit"})
    response = speak()
    if key and response.status_code == 200 and not response.is_streamed:
        http.misses.inc()
        try:
            http.cache.put(key, Entry(response.get_data(), response.headers["Content-Type"],
                                      float(response.headers.get("X-Audio-Seconds", 0))))
        except OSError as exc:  # a full or read-only disk costs the next repeat, never this answer
            log.warning("phrase cache: cannot store an entry (%s)", exc.strerror or type(exc).__name__)
    response.headers[HEADER] = "miss"
    return response
