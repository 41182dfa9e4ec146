"""The in-flight journal: what a killed process accepted and never answered ends up in the dead-letter file."""
from __future__ import annotations

import os
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


_HOLD = (
    "import sys, time\n"
    "from pathlib import Path\n"
    "from cosyedge.api.journal import Journal\n"
    "j = Journal(Path(sys.argv[1]))\n"
    "j.accepted('live', '/v1/tts', {'text': 'still being made'})\n"
    "print(j.inflight_path.name, flush=True)\n"
    "time.sleep(60)\n"
)


def test_a_live_service_sharing_the_state_directory_keeps_its_journal(tmp_path):
    """Two services on one state directory (templated units): a start-up never dead-letters a live one's work."""
    live = subprocess.Popen([sys.executable, "-c", _HOLD, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert live.stdout.readline().strip() == "inflight.jsonl"
        second = Journal(tmp_path)
        assert second.recover() == 0
        assert second.inflight_path.name != "inflight.jsonl"  # a journal of its own while the other one lives
        second.accepted("mine", "/v1/tts", {"text": "x"})
        assert not (tmp_path / "api_dead_letter.jsonl").exists()
        live.send_signal(signal.SIGKILL)
        assert live.wait(30) == -signal.SIGKILL
        second.close()
        third = Journal(tmp_path)  # the next start: both owners are gone
        assert third.recover() == 2
        assert sorted(d["request_id"] for d in read_jsonl(tmp_path / "api_dead_letter.jsonl")) == ["live", "mine"]
        assert sorted(p.name for p in tmp_path.iterdir()) == [".inflight.jsonl.lock", "api_dead_letter.jsonl",
                                                               "inflight.jsonl"]  # the other journal is gone
    finally:
        live.kill()
        live.wait()


def test_batch_items_are_entries_of_their_own_and_compaction_keeps_open_ones(tmp_path, monkeypatch):
    import cosyedge.api.journal as journal_module
    monkeypatch.setattr(journal_module, "_COMPACT_BYTES", 2000)
    journal = Journal(tmp_path)
    keys = [journal.accepted("req", "/v1/tts/batch", {"index": i, "text": f"item {i}"}, f"req/{i}") for i in range(3)]
    journal.dead_letter("/v1/tts/batch", "req", {"index": 1, "text": "item 1"}, "RuntimeError: boom", keys[1])
    journal.finished(keys[0])
    for n in range(40):  # traffic while req/2 stays open: the file is rewritten, never grows without bound
        journal.finished(journal.accepted(f"x{n}", "/v1/tts", {"text": "t" * 50}))
    assert (tmp_path / "inflight.jsonl").stat().st_size < 2600
    assert journal.open_count() == 1
    journal.close()
    assert Journal(tmp_path).recover() == 1
    dead = read_jsonl(tmp_path / "api_dead_letter.jsonl")
    assert [(d["request_id"], d["request"]["index"]) for d in dead] == [("req", 1), ("req", 2)]
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".new")]


def test_recovery_leaves_files_it_did_not_name_alone(tmp_path):
    (tmp_path / "inflight-notes.jsonl").write_text('{"event": "accepted", "request_id": "mine"}\n')
    Journal(tmp_path).recover()
    assert (tmp_path / "inflight-notes.jsonl").read_text() == '{"event": "accepted", "request_id": "mine"}\n'


def test_compaction_work_is_proportional_to_the_open_entries_not_to_the_file(tmp_path, monkeypatch):
    """Issue 21 item 7: 3,000 open entries (a 6.7 MB journal) dead-lettered one by one used to rewrite the whole
    file after every one of them (about 10 GB written); now a rewrite follows at least as many appended bytes."""
    rewrites: list[int] = []
    original = Journal._rewrite

    def counted(self, records):
        rewrites.append(len(records))
        assert len(rewrites) <= 50, "the journal is rewritten for every closed entry (quadratic compaction)"
        original(self, records)
    monkeypatch.setattr(Journal, "_rewrite", counted)
    monkeypatch.setattr(os, "fsync", lambda fd: None)  # 3,000 dead-letter fsyncs: seconds of disk time, not the point
    journal = Journal(tmp_path)
    keys = [journal.accepted(f"ws{n}", "/v1/audio/stream", {"text": "x" * 2200}) for n in range(3000)]
    assert (tmp_path / "inflight.jsonl").stat().st_size > 6_600_000
    for key in keys:
        journal.dead_letter("/v1/audio/stream", key, {"text": "x" * 2200}, "the client left")
    assert len(rewrites) <= 15, rewrites
    assert sum(rewrites) < 2 * len(keys)  # entries written again, over all rewrites: under twice the file
    assert journal.open_count() == 0 and (tmp_path / "inflight.jsonl").stat().st_size < (1 << 20) + 100
    assert len(read_jsonl(tmp_path / "api_dead_letter.jsonl")) == 3000
