"""Nothing accepted is lost: every accepted synthesis is journalled until it is answered, and what failed (or
was cut off by a crash) lands in the dead-letter file.

`inflight.jsonl` gets one `accepted` line when a request (or one item of a batch) is taken and one `finished`
line when it is answered (or dead-lettered). Lines are appended and flushed to the kernel before the work
starts, so a SIGKILL cannot lose them; at the next start `recover()` moves every accepted-but-unfinished entry
to the dead-letter file with the reason, then starts a fresh journal. Both files are JSON Lines; a torn last
line (a kill mid-write) is skipped. The journal holds the request parameters only (text, voice, speed,
format), never audio, and only while the request is open: it is rewritten with just the open entries once it
is past 1 MiB and more than twice their size, so each rewrite follows at least as many appended bytes as it
writes (work proportional to what is appended, not to the file: 3,000 open entries closed one by one rewrite the
file about a dozen times, not 3,000).

Several services may share one state directory (the templated units share `StateDirectory=`): each process
holds an exclusive POSIX lock (`lockf`) on `.<journal>.lock` while it runs, takes `inflight.jsonl` if it is free and an
`inflight-<pid>-<n>.jsonl` of its own otherwise, and recovers only journals whose lock it can take (their
owner is dead). Delivery is at least once: an answer cut off between its last byte and the `finished` line is
dead-lettered too.
"""
from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import re
import threading
from collections import deque
from datetime import datetime, timezone
from pathlib import Path
from typing import IO, Any

log = logging.getLogger(__name__)

DEAD_LETTER = "api_dead_letter.jsonl"
INFLIGHT = "inflight.jsonl"
CRASHED = "the service stopped before this request was answered (killed or crashed); not synthesised"
_COMPACT_BYTES = 1 << 20  # a journal larger than this (and than twice its open entries) keeps only the open ones
_MODE = 0o640  # request text is in these files: owner and group (the unit's StateDirectoryMode) only


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds")


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Every complete record of a JSON Lines file; a torn or foreign line is skipped, never fatal."""
    try:
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    except FileNotFoundError:
        return []
    records = []
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict):
            records.append(record)
    return records


def _append(path: Path, lines: list[dict[str, Any]], sync: bool = False) -> int:
    data = "".join(json.dumps(record, ensure_ascii=False) + "\n" for record in lines).encode("utf-8")
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, _MODE)
    try:
        os.write(fd, data)  # one write: the kernel has it when this returns, a SIGKILL cannot lose it
        if sync:
            os.fsync(fd)
    finally:
        os.close(fd)
    return len(data)


def _lock_path(journal: Path) -> Path:
    return journal.with_name(f".{journal.name}.lock")


def _temp_path(journal: Path) -> Path:
    return journal.with_name(f".{journal.name}.new")


def _try_lock(journal: Path) -> IO[bytes] | None:
    """The journal's lock file, locked; None when a live process holds it."""
    handle = open(os.open(_lock_path(journal), os.O_RDWR | os.O_CREAT, _MODE), "r+b")
    try:
        fcntl.lockf(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)  # POSIX lock: per process, gone when it dies
    except OSError as exc:
        handle.close()
        if exc.errno in (errno.EACCES, errno.EAGAIN):
            return None
        raise
    return handle


class Journal:
    """The in-flight journal and the dead-letter file of one service state directory. Thread-safe."""

    def __init__(self, state_dir: Path, name: str = INFLIGHT) -> None:
        self.state_dir = Path(state_dir)
        self.dead_letter_path = self.state_dir / DEAD_LETTER
        self.inflight_path = self.state_dir / name
        self._stem = name.split(".")[0].split("-")[0]  # inflight.jsonl and inflight-<pid>-<n>.jsonl
        self._lock = threading.Lock()
        self._open: dict[str, dict[str, Any]] = {}  # key -> its `accepted` record
        self._sizes: dict[str, int] = {}  # key -> bytes of its `accepted` line
        self._owner: IO[bytes] | None = None
        self._bytes = 0  # the journal file's size
        self._open_bytes = 0  # what a rewrite would write: the open entries' lines

    # -- ownership ---------------------------------------------------------------------------
    def _claim(self) -> None:
        """Hold the lock of our journal: the usual name if free, else one named after this process."""
        if self._owner is not None:
            return
        self.state_dir.mkdir(parents=True, exist_ok=True)
        candidate, n = self.inflight_path, 0
        while (handle := _try_lock(candidate)) is None:
            n += 1
            candidate = self.state_dir / f"{self._stem}-{os.getpid()}-{n}.jsonl"
        self._owner, self.inflight_path = handle, candidate

    def close(self) -> None:
        """Release the journal's lock (the process exiting does the same)."""
        with self._lock:
            if self._owner is not None:
                self._owner.close()
                self._owner = None

    # -- start-up ----------------------------------------------------------------------------
    def recover(self) -> int:
        """At start-up: dead-letter what a dead process accepted and never answered; returns how many."""
        with self._lock:
            self._claim()
            lost = 0
            ours = re.compile(rf"{re.escape(self._stem)}(-\d+-\d+)?\.jsonl")  # only journals this tool names
            for journal in sorted(p for p in self.state_dir.glob(f"{self._stem}*.jsonl") if ours.fullmatch(p.name)):
                if journal == self.inflight_path:
                    lost += self._move_open(journal)
                    self._rewrite(list(self._open.values()))
                    continue
                handle = _try_lock(journal)
                if handle is None:
                    continue  # a live service's journal
                try:
                    lost += self._move_open(journal)
                    for leftover in (_temp_path(journal), journal, _lock_path(journal)):
                        leftover.unlink(missing_ok=True)
                finally:
                    handle.close()
            _temp_path(self.inflight_path).unlink(missing_ok=True)
        if lost:
            log.warning("%d request(s) accepted by a previous run were never answered; moved to %s",
                        lost, DEAD_LETTER)
        return lost

    def _move_open(self, journal: Path) -> int:
        records = read_jsonl(journal)
        finished = {r.get("key", r.get("request_id")) for r in records if r.get("event") == "finished"}
        lost = [r for r in records if r.get("event") == "accepted" and r.get("key", r.get("request_id")) not in finished]
        if lost:
            _append(self.dead_letter_path, [{"time": _now(), "route": r.get("route"), "request_id": r.get("request_id"),
                                             "request": r.get("request"), "error": CRASHED, "accepted": r.get("time")}
                                            for r in lost], sync=True)
        return len(lost)

    def _rewrite(self, records: list[dict[str, Any]]) -> None:
        """Replace the journal atomically with `records` (a kill leaves the old or the new one, never half)."""
        temp = _temp_path(self.inflight_path)
        temp.unlink(missing_ok=True)
        if records:
            self._bytes = self._open_bytes = _append(temp, records)
        else:
            temp.touch(_MODE)
            self._bytes = self._open_bytes = 0
        os.replace(temp, self.inflight_path)

    # -- requests ----------------------------------------------------------------------------
    def accepted(self, request_id: str, route: str, payload: dict[str, Any], key: str | None = None) -> str:
        """Journal an accepted request (or batch item, `key`) before it is queued; returns its key."""
        key = key or request_id
        record = {"event": "accepted", "time": _now(), "request_id": request_id, "route": route, "request": payload}
        if key != request_id:
            record["key"] = key
        with self._lock:
            self._claim()
            size = _append(self.inflight_path, [record])
            self._bytes += size
            self._open_bytes += size - self._sizes.get(key, 0)
            self._open[key], self._sizes[key] = record, size
        return key

    def finished(self, key: str) -> None:
        """The request was answered (or refused before it was queued): close its entry."""
        with self._lock:
            if self._open.pop(key, None) is None:
                return
            self._open_bytes -= self._sizes.pop(key, 0)
            self._bytes += _append(self.inflight_path, [{"event": "finished", "key": key}])
            if self._bytes > max(_COMPACT_BYTES, 2 * self._open_bytes):
                self._rewrite(list(self._open.values()))

    def dead_letter(self, route: str, request_id: str, payload: dict[str, Any], detail: str,
                    key: str | None = None) -> None:
        """Record a failed accepted request (the detail goes here only, never to the client) and close it."""
        try:
            with self._lock:
                _append(self.dead_letter_path, [{"time": _now(), "route": route, "request_id": request_id,
                                                 "request": payload, "error": detail}], sync=True)
        except OSError as exc:
            log.error("cannot write the dead-letter record: %s", exc.strerror or type(exc).__name__)
            return  # left open in the journal: the next start dead-letters it
        self.finished(key or request_id)

    def is_open(self, key: str) -> bool:
        with self._lock:
            return key in self._open

    def open_count(self) -> int:
        with self._lock:
            return len(self._open)


class PieceJournal:
    """The journal entries of one streaming request's text pieces (a WebSocket session's `text` messages, a Wyoming
    stream's `synthesize-chunk`s): each piece is journalled when it arrives, before anything else happens to it, and
    closed once the non-space characters of the sentences spoken reach its end (the sentence splitter keeps every
    non-space character of a speakable sentence). Thread-safe: a connection's reader accepts, its speaker closes."""

    def __init__(self, journal: Journal, route: str, request_id: str) -> None:
        self.journal, self.route, self.request_id = journal, route, request_id
        self._lock = threading.Lock()
        self._open: deque[tuple[str, dict[str, Any], int]] = deque()  # key, payload, cumulative end
        self._received = self._spoken = self._pieces = 0

    def accept(self, piece: str, payload: dict[str, Any]) -> None:
        """Journal a piece (OSError: the journal cannot be written, the piece is refused)."""
        with self._lock:
            key = f"{self.request_id}-{self._pieces}"
            payload = {"text": piece, **payload}
            self.journal.accepted(self.request_id, self.route, payload, key)
            self._pieces += 1
            self._received += _chars(piece)
            self._open.append((key, payload, self._received))

    def spoke(self, sentence: str) -> None:
        """A sentence's audio was delivered: close the pieces it completes."""
        with self._lock:
            self._spoken += _chars(sentence)
            while self._open and self._open[0][2] <= self._spoken:
                self.journal.finished(self._open.popleft()[0])

    def close(self, detail: str | None) -> None:
        """Every open piece: delivered or withdrawn by the client (detail None), else dead-lettered with `detail`."""
        with self._lock:
            left, self._open = list(self._open), deque()
        for key, payload, _ in left:
            if detail is None:
                self.journal.finished(key)
            else:
                self.journal.dead_letter(self.route, self.request_id, payload, detail, key)


def _chars(text: str) -> int:
    return sum(not c.isspace() for c in text)
