"""The in-flight journal: what a killed process accepted and never answered ends up in the dead-letter file."""
from __future__ import annotations

import signal
import subprocess
import sys

from cosyedge.api.journal import CRASHED, Journal, read_jsonl


def test_requests_open_at_a_sigkill_are_dead_lettered_at_the_next_start(tmp_path):
    code = (
        "import os, signal, sys\n"
        "from pathlib import Path\n"
        "from cosyedge.api.journal import Journal\n"
        "j = Journal(Path(sys.argv[1]))\n"
        "for i in range(5):\n"
        "    j.accepted(f'r{i}', '/v1/tts', {'input': f'text {i}'})\n"
        "j.finished('r0'); j.dead_letter('/v1/tts', 'r1', {'input': 'text 1'}, 'RuntimeError: boom')\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    child = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, timeout=60)
    assert child.returncode == -signal.SIGKILL  # the kill really happened with r2-r4 open

    journal = Journal(tmp_path)
    assert journal.recover() == 3
    dead = read_jsonl(tmp_path / "api_dead_letter.jsonl")
    assert [d["request_id"] for d in dead] == ["r1", "r2", "r3", "r4"]
    assert dead[0]["error"] == "RuntimeError: boom" and {d["error"] for d in dead[1:]} == {CRASHED}
    assert [d["request"]["input"] for d in dead] == ["text 1", "text 2", "text 3", "text 4"]
    assert journal.recover() == 0  # recovered once, not again
    assert len(read_jsonl(tmp_path / "api_dead_letter.jsonl")) == 4


def test_a_torn_last_line_is_skipped(tmp_path):
    journal = Journal(tmp_path)
    journal.accepted("a", "/v1/tts", {"input": "x"})
    with (tmp_path / "inflight.jsonl").open("a") as out:
        out.write('{"event": "accepted", "request_id": "b", "rou')  # killed mid-write
    assert Journal(tmp_path).recover() == 1
    assert [d["request_id"] for d in read_jsonl(tmp_path / "api_dead_letter.jsonl")] == ["a"]
