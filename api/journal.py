"""Nothing accepted is lost: every accepted synthesis is journalled until it is answered, and what failed (or
was cut off by a crash) lands in the dead-letter file.

`inflight.jsonl` gets one `accepted` line when a request is taken and one `finished` line when it is answered
(or dead-lettered). Lines are appended and flushed to the kernel before the work starts, so a SIGKILL cannot lose
them; at the next start `recover()` moves every accepted-but-unfinished request to the dead-letter file with the
reason, then starts a fresh journal. Both files are JSON Lines; a torn last line (a kill mid-write) is skipped.
"""
from __future__ import annotations

import json
import logging
import os
import threading
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

DEAD_LETTER = "api_dead_letter.jsonl"
INFLIGHT = "inflight.jsonl"
CRASHED = "the service stopped before this request was answered (killed or crashed); not synthesised"
_COMPACT_BYTES = 1 << 20  # an idle journal larger than this is started afresh


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


class Journal:
    """The in-flight journal and the dead-letter file of one service state directory. Thread-safe."""

    def __init__(self, state_dir: Path) -> None:
        self.dead_letter_path = state_dir / DEAD_LETTER
        self.inflight_path = state_dir / INFLIGHT
        self._lock = threading.Lock()
        self._open: set[str] = set()

    def _append(self, path: Path, record: dict[str, Any]) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a", encoding="utf-8") as out:
            out.write(json.dumps(record, ensure_ascii=False) + "\n")
            out.flush()

    def recover(self) -> int:
        """At start-up: dead-letter what a previous process accepted and never answered; returns how many."""
        with self._lock:
            records = read_jsonl(self.inflight_path)
            finished = {r.get("request_id") for r in records if r.get("event") == "finished"}
            lost = [r for r in records if r.get("event") == "accepted" and r.get("request_id") not in finished]
            for record in lost:
                self._append(self.dead_letter_path, {"time": _now(), "route": record.get("route"),
                                                     "request_id": record.get("request_id"),
                                                     "request": record.get("request"), "error": CRASHED,
                                                     "accepted": record.get("time")})
            if self.inflight_path.exists():
                os.replace(self._fresh_journal(), self.inflight_path)
        if lost:
            log.warning("%d request(s) accepted by the previous run were never answered; moved to %s",
                        len(lost), DEAD_LETTER)
        return len(lost)

    def _fresh_journal(self) -> Path:
        fresh = self.inflight_path.with_name(f".{INFLIGHT}.{os.getpid()}.new")
        fresh.write_text("", encoding="utf-8")
        return fresh

    def accepted(self, request_id: str, route: str, payload: dict[str, Any]) -> None:
        with self._lock:
            self._append(self.inflight_path, {"event": "accepted", "time": _now(), "request_id": request_id,
                                              "route": route, "request": payload})
            self._open.add(request_id)

    def finished(self, request_id: str) -> None:
        with self._lock:
            if request_id not in self._open:
                return
            self._open.discard(request_id)
            self._append(self.inflight_path, {"event": "finished", "request_id": request_id})
            if not self._open and self.inflight_path.stat().st_size > _COMPACT_BYTES:
                os.replace(self._fresh_journal(), self.inflight_path)  # nothing open: the history is not needed

    def dead_letter(self, route: str, request_id: str, payload: dict[str, Any], detail: str) -> None:
        """Record a failed accepted request (the detail goes here only, never to the client) and close it."""
        try:
            with self._lock:
                self._append(self.dead_letter_path, {"time": _now(), "route": route, "request_id": request_id,
                                                     "request": payload, "error": detail})
        except OSError as exc:
            log.error("cannot write the dead-letter record: %s", exc.strerror or type(exc).__name__)
        self.finished(request_id)
