"""Registration files left by a dead writer (device/voice_store.py `remove_stale_partials`, run when an engine
starts): a `.partial` whose writer has exited goes, one whose writer still runs stays, and a writer that was killed
but not yet reaped (a zombie: a service's worker killed with its parent waits for PID 1, which in a container may reap
it seconds later, after a restart has looked) counts as dead."""
from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from cosyedge.device.voice_store import VoiceStore


def test_partials_of_a_zombie_writer_go_and_those_of_a_running_one_stay(tmp_path: Path) -> None:
    running = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    zombie = subprocess.Popen([sys.executable, "-c", "pass"])  # exits at once; not waited for until the end
    try:
        deadline = time.monotonic() + 30
        while "\nState:\tZ" not in Path(f"/proc/{zombie.pid}/status").read_text():
            assert time.monotonic() < deadline, "the child did not exit"
            time.sleep(0.05)
        names = {pid: f".voice{pid}.npz.{pid}.x1y2z3.partial" for pid in (running.pid, zombie.pid)}
        for name in names.values():
            (tmp_path / name).write_bytes(b"half a voice")
        removed = VoiceStore(tmp_path).remove_stale_partials()
        assert [path.name for path in removed] == [names[zombie.pid]]
        assert sorted(path.name for path in tmp_path.iterdir()) == [names[running.pid]]
    finally:
        running.kill()
        running.wait()
        zombie.wait()
