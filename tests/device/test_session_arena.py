"""The memory-arena policy of ONNX Runtime CPU sessions (device/sessions.py, `SessionConfig.arena`): flow and HiFT
sessions hand their call's activations back after each call ("shrink"), so the resident set after calls of varying
lengths stays near the loaded one; "keep" (ORT's default) holds the largest call's arena. Measured in a fresh
process on the tiny release's HiFT decoder with a long mel (the resident set of a test process is not its own).
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from cosyedge.device.bundle import Bundle
from cosyedge.device.errors import ProviderError
from cosyedge.device import sessions
from cosyedge.device.sessions import VITS_SHRINK_ABOVE, SessionConfig, ShrinkingSession

PROBE = r"""
import json, sys
from pathlib import Path
import numpy as np
import onnxruntime as ort
from cosyedge.device.sessions import SessionConfig

def rss():
    return int(Path("/proc/self/statm").read_text().split()[1]) * 4096 / 2**20

session = SessionConfig(providers=("cpu",), intra_op_threads=1, arena=sys.argv[2]).create(Path(sys.argv[1]))
rng = np.random.default_rng(0)
loaded = rss()
after = []
for frames in (3000, 2000, 3200):
    own = [ort.RunOptions()] if sys.argv[3] == "own-options" else []   # a caller's run options (a stream's steps)
    session.run(None, {"mel": rng.standard_normal((1, 80, frames)).astype(np.float32),
                       "source": rng.standard_normal((1, 1, frames * 480)).astype(np.float32)}, *own)
    after.append(rss() - loaded)
print(json.dumps({"type": type(session).__name__, "growth_mb": after}))
"""


SHARED_PROBE = r"""
import json, sys
from pathlib import Path
import numpy as np
from cosyedge.device.bundle import Bundle
from cosyedge.device.sessions import SessionConfig

def rss():
    return int(Path("/proc/self/statm").read_text().split()[1]) * 4096 / 2**20

bundle = Bundle.load(Path(sys.argv[1]))
config = SessionConfig(providers=("cpu",), intra_op_threads=1)
decoder = config.create(bundle.path(bundle.component("hift_decoder", "fp32").file))
source = config.create(bundle.path(bundle.component("hift_source", "fp32").file))
loaded = rss()
speech = decoder.run(None, {"mel": np.zeros((1, 80, 3200), np.float32),
                            "source": np.zeros((1, 1, 3200 * 480), np.float32)})
held = rss() - loaded
del speech
harmonics = source.get_inputs()[1].shape[2]
source.run(None, {"mel": np.zeros((1, 80, 4), np.float32), "noise": np.zeros((1, 4 * 480, harmonics), np.float32)})
print(json.dumps({"held_mb": held, "after_mb": rss() - loaded}))
"""


def _probe(graph: Path, arena: str, options: str = "default-options") -> dict:
    out = subprocess.run([sys.executable, "-c", PROBE, str(graph), arena, options], capture_output=True, text=True,
                         timeout=300, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_flow_and_hift_sessions_give_their_activations_back(cv2_tiny_bundle):
    bundle = Bundle.load(cv2_tiny_bundle)
    hift = bundle.path(bundle.component("hift_decoder", "fp32").file)
    keep, shrink = _probe(hift, "keep"), _probe(hift, "shrink")
    own = _probe(hift, "shrink", "own-options")     # calls with the caller's run options (ChunkGate.later_step's)
    assert (keep["type"], shrink["type"]) == ("InferenceSession", "ShrinkingSession")
    # the kept arena holds the largest call (tens of MB at 32 s of audio); the shrunk one gives nearly all back
    assert keep["growth_mb"][-1] >= 30, keep
    assert shrink["growth_mb"][-1] <= keep["growth_mb"][-1] / 2, (shrink, keep)     # measured 39 vs 113 MB
    assert own["growth_mb"][-1] <= keep["growth_mb"][-1] / 2, (own, keep)


def test_only_flow_hift_and_llm_graphs_shrink(cv2_tiny_bundle):
    """The flow, HiFT and LLM sessions hand their arenas back (the LLM after prefills only:
    tests/quantize/test_llm_shared_kv.py); CAM++ (one call per new voice) keeps ORT's default."""
    bundle = Bundle.load(cv2_tiny_bundle)
    config = SessionConfig(providers=("cpu",), intra_op_threads=1)
    for graph in ("flow_estimator", "llm"):
        assert isinstance(config.create(bundle.path(bundle.component(graph, "fp32").file)), ShrinkingSession), graph
    assert not isinstance(config.create(bundle.path(bundle.component("campplus", "fp32").file)), ShrinkingSession)
    with pytest.raises(ProviderError, match="arena"):
        SessionConfig(arena="grow")


def test_the_default_voice_shrinks_after_long_calls_only(default_engine, monkeypatch):
    """VITS calls over VITS_SHRINK_ABOVE phoneme ids give their arena back (hostile texts of such pieces took the
    service over its 700 MB budget, api/README.md); an everyday sentence keeps the arena, at full speed."""
    trims: list[int] = []
    monkeypatch.setattr(sessions, "return_freed_memory", lambda: trims.append(1))
    everyday = default_engine.segments("Good morning, and welcome to the station.")
    assert max(len(s.ids) for s in everyday) <= VITS_SHRINK_ABOVE
    default_engine.synthesize_waveform("Good morning, and welcome to the station.")
    assert trims == []
    long = "the old man walked slowly down the road, " * 8
    assert max(len(s.ids) for s in default_engine.segments(long)) > VITS_SHRINK_ABOVE
    default_engine.synthesize_waveform(long)
    assert trims


def test_shrinking_graphs_share_one_arena(cv2_tiny_bundle):
    """A call's outputs outlive its shrink and hold their arena regions; the shrinking graphs share one arena, so
    the next call of any of them hands those back (one arena per session kept them until that graph's own next call:
    32.6 MB still held after the source call, 1.4 MB with the shared arena)."""
    bundle = Bundle.load(cv2_tiny_bundle)
    out = subprocess.run([sys.executable, "-c", SHARED_PROBE, str(bundle.root)], capture_output=True, text=True,
                         timeout=300, check=True)
    probe = json.loads(out.stdout.strip().splitlines()[-1])
    assert probe["held_mb"] >= 20, probe    # the decoder's output really held its region (measured 32 MB)
    assert probe["after_mb"] <= 10, probe


LARGE_BUFFER_PROBE = r"""
import json, sys
from pathlib import Path
import numpy as np
from cosyedge.device.sessions import SessionConfig

def rss():
    return int(Path("/proc/self/statm").read_text().split()[1]) * 4096 / 2**20

SessionConfig(providers=("cpu",), intra_op_threads=1).create(Path(sys.argv[1]))
before = rss()
for _ in range(3):  # 8 MB each: glibc's default threshold would serve the 2nd and 3rd from the heap and keep them
    buffer = np.ones(2 << 20, np.float32)
    del buffer
print(json.dumps({"held_mb": rss() - before}))
"""


def test_freed_large_buffers_leave_the_process(cv2_tiny_bundle):
    """Once a flow or HiFT session exists, a freed buffer of several MB goes back to the system at once (glibc's
    mmap threshold is fixed): with glibc's default, the second and later 8 MB buffers stay resident (+8 MB)."""
    bundle = Bundle.load(cv2_tiny_bundle)
    path = bundle.path(bundle.component("hift_decoder", "fp32").file)
    done = subprocess.run([sys.executable, "-c", LARGE_BUFFER_PROBE, str(path)], capture_output=True, text=True,
                          check=True, timeout=120)
    assert json.loads(done.stdout.strip().splitlines()[-1])["held_mb"] < 2


HEAP_PROBE = r"""
import ctypes, json, sys, tempfile, threading
from pathlib import Path
import numpy as np
from cosyedge.device.sessions import SessionConfig

if sys.argv[2] == "session":
    SessionConfig(providers=("cpu",), intra_op_threads=1).create(Path(sys.argv[1]))
held, ready = [], threading.Barrier(4)

def allocate():
    ready.wait()                    # all four threads allocate at once, as a stream's threads do
    held.extend(np.ones(16 << 10, np.float32) for _ in range(50))   # 64 KB each: heap blocks, not mapped

threads = [threading.Thread(target=allocate) for _ in range(4)]
[t.start() for t in threads]
[t.join() for t in threads]
libc = ctypes.CDLL("libc.so.6")
libc.fopen.restype = ctypes.c_void_p
with tempfile.NamedTemporaryFile(suffix=".xml") as report:
    stream = libc.fopen(report.name.encode(), b"w")
    libc.malloc_info(0, ctypes.c_void_p(stream))
    libc.fclose(ctypes.c_void_p(stream))
    print(json.dumps({"heaps": Path(report.name).read_text().count("<heap nr=")}))
"""


def test_threads_share_one_malloc_heap_once_a_flow_session_exists(cv2_tiny_bundle):
    """A stream's decode thread and the server's request threads allocate from one glibc heap once a flow or HiFT
    session exists (`sessions.MALLOC_ARENAS`): a heap per thread keeps each thread's freed blocks (3-4 MB of a
    full-size stream's peak). Without such a session the same four threads get heaps of their own."""
    bundle = Bundle.load(cv2_tiny_bundle)
    path = bundle.path(bundle.component("hift_decoder", "fp32").file)

    def heaps(mode: str) -> int:
        done = subprocess.run([sys.executable, "-c", HEAP_PROBE, str(path), mode], capture_output=True, text=True,
                              check=True, timeout=120)
        return json.loads(done.stdout.strip().splitlines()[-1])["heaps"]

    assert heaps("none") > 1     # the probe sees per-thread heaps where glibc's default stands
    assert heaps("session") == sessions.MALLOC_ARENAS == 1
