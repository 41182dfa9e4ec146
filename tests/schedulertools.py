"""Checks of the cross-request decode scheduler shared by the CosyVoice2 and CosyVoice3 tests."""
from __future__ import annotations

import threading
import time
from typing import Any, Callable, Sequence

import numpy as np

from cosyedge.device.engine import Engine
from cosyedge.device.options import Segment, SynthesisOptions


def rows_per_step_delta(before: dict, after: dict) -> dict[int, int]:
    """Decode steps per row count that happened between two `stats()` snapshots of the decoder."""
    return {k: n - before["rows_per_step"].get(k, 0) for k, n in after["rows_per_step"].items()
            if n - before["rows_per_step"].get(k, 0)}


def run_together(jobs: Sequence[tuple[str, dict[str, Any]]], call: Callable[[str, dict[str, Any]], Any],
                 timeout: float) -> list[Any]:
    """`call(text, options)` for every job, each in its own thread, all released at once; the results in job order
    (the first error a thread hit is raised here)."""
    start = threading.Barrier(len(jobs))
    results: list[Any] = [None] * len(jobs)
    errors: list[BaseException] = []

    def worker(index: int) -> None:
        try:
            start.wait(timeout=30)
            results[index] = call(*jobs[index])
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=timeout)
    assert not errors, errors
    assert not any(t.is_alive() for t in threads), "a job did not finish in time"
    return results


def assert_concurrent_streams_match_alone(engine: Engine, jobs: Sequence[tuple[str, dict[str, Any]]],
                                          timeout: float) -> None:
    """Each job (text, options) streamed alone, then all at once from their own threads: the chunks are equal,
    the long job streams in several chunks, and the decoder really shared steps between them."""
    alone = [list(engine.stream(text, **options)) for text, options in jobs]
    assert sum(len(chunks) for chunks in alone) > len(jobs)  # some request streams in several chunks
    before = engine.pipeline._decoder.stats()
    together = run_together(jobs, lambda text, options: list(engine.stream(text, **options)), timeout)
    for a, b in zip(alone, together):
        assert len(a) == len(b) >= 1
        assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert max(rows_per_step_delta(before, engine.pipeline._decoder.stats())) > 1


def wait_until(condition: Callable[[], bool], what: str, seconds: float = 60) -> None:
    """Poll `condition` until it holds (bounded: fails with `what` after `seconds`)."""
    end = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < end, what
        time.sleep(0.005)


def assert_first_chunk_goes_first(engine: Engine, segment: Segment, options: SynthesisOptions) -> None:
    """Stream A has emitted a chunk; while another stream's later chunk holds the one slot, A waits for its next
    chunk and B's first chunk is made beside the held turn (`ChunkGate` first_beside), before the turn ends; A's
    next chunk after it. `options` must give A several chunks. On a CPU the decode loop would wait for the held turn
    too (`decode_yields_always`, tested in test_cv2_stream_scheduler.py) unless a stream waits for its first tokens,
    so here the gate holds it for first chunks only, as off a CPU: the order of turns is what this checks."""
    gate = engine.pipeline._chunk_gate
    a = engine.pipeline.stream(segment, options)
    next(a)  # A emitted its first chunk
    made: list[str] = []
    always, gate._decode_yields_always = gate._decode_yields_always, False
    try:
        with gate.turn(1, 0.0):  # another stream's later chunk holds the slot (a first chunk would pause decoding)
            threads = [threading.Thread(target=lambda: made.append(("A", next(a))[0])),
                       threading.Thread(target=lambda: made.append(("B", next(engine.pipeline.stream(segment,
                                                                                                    options)))[0]))]
            threads[0].start()
            wait_until(lambda: gate.waiting() == 1, "A never asked for its next chunk")
            threads[1].start()
            wait_until(lambda: made == ["B"], "B's first chunk waited for the held later chunk", seconds=60)
            assert gate.waiting() == 1  # A still waits for the slot
        for thread in threads:
            thread.join(60)
    finally:
        gate._decode_yields_always = always
    a.close()
    assert made == ["B", "A"]


def record_flow_batches(monkeypatch, pipeline) -> list[list[int]]:
    """Patch the pipeline's batched flow call so that each call records its rows (the FlowPrompt object of each:
    one per voice, `len(set(...))` the voices); the returned list fills as the pipeline renders."""
    batches: list[list[int]] = []
    mels = pipeline._flow.mels

    def recorded(prompts, token_rows, *preset):
        batches.append([id(p) for p in prompts])
        return mels(prompts, token_rows, *preset)

    monkeypatch.setattr(pipeline._flow, "mels", recorded)
    return batches


def assert_first_chunks_share_one_flow_call(engine: Engine, monkeypatch, jobs: Sequence[tuple[str, list[int]]],
                                            rows_per_call: list[int]) -> None:
    """Streams (voice, tokens) whose first chunks wait at once: those of one length share a flow call (the
    pipeline's ChunkGate.first_mel; `rows_per_call` sorted), and every chunk equals the stream's chunk alone."""
    pipeline, gate = engine.pipeline, engine.pipeline._chunk_gate
    alone = [list(pipeline.stream_tokens(t, engine.options(voice=v, deterministic=True))) for v, t in jobs]
    batches = record_flow_batches(monkeypatch, pipeline)
    together: list[list[np.ndarray]] = [[] for _ in jobs]

    def stream(index: int) -> None:
        voice, tokens = jobs[index]
        together[index] = list(pipeline.stream_tokens(tokens, engine.options(voice=voice, deterministic=True)))

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(len(jobs))]
    with gate.turn(0, 0.0):  # another stream's first chunk holds the slot (and the turn beside) until all wait
        for thread in threads:
            thread.start()
        wait_until(lambda: gate.waiting() == len(jobs), "the first chunks never queued")
    for thread in threads:
        thread.join(120)
    assert sorted(len(rows) for rows in batches) == rows_per_call
    for a, b in zip(alone, together):
        assert len(a) == len(b) > 1 and all(np.array_equal(x, y) for x, y in zip(a, b))


def stop_every_later_call_once(monkeypatch, pipeline) -> list[int]:
    """Patch the pipeline's chunk gate so that every graph call of a later chunk (`ChunkGate.later_step`) is stopped
    at its first try, as the gate stops one in flight when a newcomer comes (ONNX Runtime's terminate flag), and
    runs again; the returned list gets one entry per call. The stream must give the audio it gives undisturbed."""
    gate, calls = pipeline._chunk_gate, []
    real_step = gate.later_step

    def stopped_once(call):
        calls.append(len(calls))
        tries = []

        def first_try_stopped(run_options):
            tries.append(True)
            if len(tries) == 1:
                run_options.terminate = True
            return call(run_options)
        return real_step(first_try_stopped)

    monkeypatch.setattr(gate, "later_step", stopped_once)
    return calls
