"""Issue 11/12: the scheduler's per-request bounds and withdrawal, and fair chunk work between concurrent streams
(device/cosyvoice2/scheduler.py, streaming.py) on the tiny CosyVoice2 bundle. Orders and counts, never times."""
from __future__ import annotations

import contextlib
import threading
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from cosyedge.device.cosyvoice2.pipeline import pinned
from cosyedge.device.cosyvoice2.streaming import ChunkGate
from cosyedge.device.engine import Engine
from cosyedge.device.errors import Cancelled
from cosyedge.device.options import BatchLimits
from cosyedge.device.sessions import SessionConfig
from schedulertools import (assert_first_chunk_goes_first, assert_first_chunks_share_one_flow_call,
                            stop_every_later_call_once, wait_until)

VOICE = "tiny_spk_zh"
TEXT = "收到好友从远方寄来的生日礼物。"


@pytest.fixture(scope="module")
def engine(cv2_tiny_bundle: Path) -> Engine:
    return Engine.load(cv2_tiny_bundle, precision="fp32", sessions=SessionConfig(providers=("cpu",), intra_op_threads=1),
                       warmup=False, limits=BatchLimits(batch_max=2))


def test_gate_gives_the_turn_to_the_fewest_chunks_emitted_then_the_earliest():
    gate, order, lock = ChunkGate(), [], threading.Lock()

    def wait_turn(emitted: int, began: float) -> None:
        with gate.turn(emitted, began):
            with lock:
                order.append((emitted, began))

    with gate.turn(0, 0.0):  # the test holds the only slot while the others queue up
        threads = [threading.Thread(target=wait_turn, args=args) for args in ((3, 1.0), (0, 5.0), (1, 0.5), (0, 2.0))]
        for thread in threads:
            thread.start()
        wait_until(lambda: gate.waiting() == 4, "the tickets never queued")
    for thread in threads:
        thread.join(30)
    assert order == [(0, 2.0), (0, 5.0), (1, 0.5), (3, 1.0)]


def test_one_first_chunk_runs_beside_a_running_later_chunk():
    """`first_beside`: while a later chunk holds the one slot, one first chunk starts beside it (its listener does
    not wait for the end of another stream's long call); a second first chunk and any later chunk still wait.
    Without first_beside the first chunk waits too (the last check)."""
    for beside in (True, False):
        gate, entered, leave = ChunkGate(first_beside=beside), [], threading.Event()

        def work(emitted: int, began: float) -> None:
            with gate.turn(emitted, began):
                entered.append((emitted, began))
                leave.wait(30)

        with gate.turn(1, 0.0):  # a later chunk's long call
            threads = [threading.Thread(target=work, args=args) for args in ((0, 1.0), (0, 2.0), (2, 0.5))]
            for thread in threads:
                thread.start()
            if beside:
                wait_until(lambda: entered == [(0, 1.0)], "the first chunk waited for the later chunk's call")
                wait_until(lambda: gate.waiting() == 2, "the others never queued")
            else:
                wait_until(lambda: gate.waiting() == 3, "the tickets never queued")
                assert entered == []
            leave.set()
        for thread in threads:
            thread.join(30)
        assert sorted(entered) == [(0, 1.0), (0, 2.0), (2, 0.5)]


def test_a_new_streams_first_chunk_goes_before_a_running_streams_next_chunk(engine: Engine):
    options = engine.options(voice=VOICE, seed=1, sampling="greedy")
    assert_first_chunk_goes_first(engine, engine.segments(TEXT)[0], pinned(options, 300))



def test_decoding_waits_while_a_first_chunk_is_in_the_flow(engine: Engine, monkeypatch: pytest.MonkeyPatch):
    """Issue 12 item 4: no decode step starts while a stream's first chunk is in flow + HiFT (at most the step
    already running ends), and decoding goes on after it. The first chunk's flow (its `mels` call, ChunkGate.first_mel)
    is held 0.3 s so that, without the pause, the decode loop (about a millisecond a step here) would run many steps
    meanwhile."""
    flow, decoder = engine.pipeline._flow, engine.pipeline._decoder
    real_mels, seen = flow.mels, []

    def held_mels(*args):
        before = decoder.stats()["decode_steps"]
        threading.Event().wait(0.3)
        mels = real_mels(*args)
        seen.append(decoder.stats()["decode_steps"] - before)
        return mels

    monkeypatch.setattr(flow, "mels", held_mels)
    options = pinned(engine.options(voice=VOICE, seed=3, sampling="greedy"), 200)
    start = decoder.stats()["decode_steps"]
    chunks = list(engine.pipeline.stream(engine.segments(TEXT)[0], options))
    assert len(chunks) >= 3 and len(seen) == 1
    assert seen[0] <= 1, f"{seen[0]} decode steps ran during the first chunk's flow"
    assert decoder.stats()["decode_steps"] - start >= 199


def test_on_a_cpu_decoding_waits_while_any_chunk_is_in_the_flow(engine: Engine, monkeypatch: pytest.MonkeyPatch):
    """On the CPU provider decode steps and chunk work take turns (oversubscribed cores slowed both ~2x): no decode
    step starts while a later chunk's flow runs either (held 0.3 s each), and the stream still gets every token."""
    flow, decoder = engine.pipeline._flow, engine.pipeline._decoder
    real_mel, seen = flow.mel, []

    def held_mel(*args, **kwargs):
        before = decoder.stats()["decode_steps"]
        threading.Event().wait(0.3)
        mel = real_mel(*args, **kwargs)
        seen.append(decoder.stats()["decode_steps"] - before)
        return mel

    monkeypatch.setattr(flow, "mel", held_mel)
    options = pinned(engine.options(voice=VOICE, seed=3, sampling="greedy"), 200)
    start = decoder.stats()["decode_steps"]
    chunks = list(engine.pipeline.stream(engine.segments(TEXT)[0], options))
    assert len(chunks) >= 3 and len(seen) == len(chunks) - 1     # every chunk but the first (`mels`)
    assert max(seen[:-1]) <= 1, f"decode steps during later chunks' flow: {seen}"   # the last: decoding is over
    assert decoder.stats()["decode_steps"] - start >= 199


def test_off_a_cpu_only_first_chunks_hold_the_decoder() -> None:
    """The gate's policy itself: a later chunk's turn holds the decode loop only where the decoder yields always,
    and not while another stream still waits for the tokens of its first chunk."""
    for always, newcomer, holds in ((False, False, False), (True, False, True), (True, True, False)):
        gate, entered, leave, waited = ChunkGate(decode_yields_always=always), threading.Event(), threading.Event(), []

        def later_chunk():
            with gate.turn(1, 0.0):
                entered.set()
                leave.wait(5)

        with contextlib.ExitStack() as stack:
            if newcomer:
                stack.enter_context(gate.awaiting_first())
            worker = threading.Thread(target=later_chunk)
            worker.start()
            entered.wait(5)
            decode = threading.Thread(target=lambda: (gate.before_decode_step(), waited.append(leave.is_set())))
            decode.start()
            decode.join(0.3)
            leave.set()
            worker.join(5)
            decode.join(5)
        assert waited == [holds], (always, newcomer)   # True: the step began only after the chunk's turn ended


def test_a_newcomer_arriving_during_a_later_chunk_releases_the_held_decode_loop() -> None:
    """The decode loop already waiting for a later chunk's turn (CPU) goes on as soon as a new stream starts to
    wait for its first tokens, not when that turn ends: a later chunk paused for the newcomer (`later_step`)
    would otherwise never end (the deadlock `bench-api` x4 ran into before the newcomer's count notified)."""
    gate, stepped = ChunkGate(decode_yields_always=True, first_beside=True), []
    with gate.turn(1, 0.0):
        decode = threading.Thread(target=lambda: (gate.before_decode_step(), stepped.append(True)))
        decode.start()
        decode.join(0.3)
        assert stepped == []                # held by the later chunk
        with gate.awaiting_first():
            decode.join(5)
            assert stepped == [True]        # while the later chunk's turn is still held


def test_on_a_cpu_a_later_chunk_pauses_for_a_newcomers_first_tokens_and_chunk() -> None:
    """`later_step`, which runs each estimator step of a later chunk's flow: where the decoder yields always (CPU)
    a step waits while a stream waits for its first tokens and while a first chunk's work runs, and goes on after
    both; elsewhere it never waits."""
    for always in (True, False):
        gate, passed = ChunkGate(decode_yields_always=always, first_beside=True), []

        def later_step() -> None:
            gate.later_step(lambda options: passed.append(True))

        with gate.turn(1, 0.0):     # the later chunk's turn, held across its steps
            with gate.awaiting_first() as first_done:
                step = threading.Thread(target=later_step)
                step.start()
                step.join(0.3)
                assert passed == ([] if always else [True]), always
                first_done()        # the newcomer's tokens are there; its first chunk now runs beside the turn
                with gate.turn(0, 1.0):
                    step.join(0.3)
                    assert passed == ([] if always else [True]), always
            step.join(5)
        assert passed == [True]


def _slow_graph() -> tuple[ort.InferenceSession, dict[str, np.ndarray]]:
    """A real graph long enough to be stopped midway: 200 chained 512 x 512 products (tens of GFLOP)."""
    size, layers = 512, 200
    nodes = [helper.make_node("MatMul", [f"x{i}", "w"], [f"x{i + 1}"]) for i in range(layers)]
    graph = helper.make_graph(nodes, "chain", [helper.make_tensor_value_info("x0", TensorProto.FLOAT, [size, size])],
                              [helper.make_tensor_value_info(f"x{layers}", TensorProto.FLOAT, [size, size])],
                              [numpy_helper.from_array(np.eye(size, dtype=np.float32) * 0.999, "w")])
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return session, {"x0": np.random.default_rng(0).standard_normal((size, size)).astype(np.float32)}


def test_a_later_step_in_flight_is_stopped_for_a_newcomer_and_runs_again_after_its_first_chunk() -> None:
    """A later chunk's estimator step already running when a stream starts to wait for its first tokens is stopped
    midway (ONNX Runtime's terminate flag on the step's run options) instead of sharing the cores to its end, and
    runs again, with the same inputs and result, once the newcomer's first chunk is made. A real graph: the first
    run must end in ORT's own termination, not complete."""
    session, feeds = _slow_graph()
    gate = ChunkGate(decode_yields_always=True, first_beside=True)
    started, attempts, results, first_made = threading.Event(), [], [], threading.Event()

    def call(options: ort.RunOptions | None) -> list[np.ndarray]:
        attempts.append(first_made.is_set())        # did this run start after the newcomer's first chunk?
        started.set()
        try:
            return session.run(None, feeds, options)
        except Exception:
            attempts.append("stopped")
            raise

    with gate.turn(1, 0.0):
        step = threading.Thread(target=lambda: results.append(gate.later_step(call)))
        step.start()
        assert started.wait(30)
        with gate.awaiting_first() as first_done:
            wait_until(lambda: "stopped" in attempts, "the running step was not stopped")
            first_done()
            with gate.turn(0, 1.0):                 # the newcomer's first chunk: the stopped step still waits
                step.join(0.3)
                assert step.is_alive() and attempts == [False, "stopped"]
                first_made.set()
        step.join(60)
    assert attempts == [False, "stopped", True] and gate.preempted == 1
    np.testing.assert_array_equal(results[0][0], session.run(None, feeds)[0])


def test_a_later_chunks_graph_calls_each_run_through_its_turn(engine: Engine, monkeypatch: pytest.MonkeyPatch):
    """The stream loop hands `later_step` to every later and final chunk's flow and vocoder, and each graph call of
    the chunk runs through it: the flow's encoder call (which re-reads the whole history), each Euler step (the
    official preset: n_timesteps) and HiFT's decoder calls, so a paused turn resumes within one call; every call
    stopped midway and run again gives the stream the audio it has undisturbed."""
    pipeline = engine.pipeline
    gate, steps = pipeline._chunk_gate, pipeline._flow.config.n_timesteps
    options = pinned(engine.options(voice=VOICE, seed=3, sampling="greedy"), 200)
    undisturbed = list(pipeline.stream(engine.segments(TEXT)[0], options))
    calls = stop_every_later_call_once(monkeypatch, pipeline)
    before = gate.preempted
    chunks = list(pipeline.stream(engine.segments(TEXT)[0], options))
    assert len(chunks) >= 3 and len(calls) >= (1 + steps + 1) * (len(chunks) - 1)  # encoder, steps, >= 1 decoder
    assert gate.preempted - before == len(calls)
    assert len(chunks) == len(undisturbed)
    for got, want in zip(chunks, undisturbed):
        np.testing.assert_array_equal(got, want)


def test_a_stream_shorter_than_its_first_hop_is_not_paused_by_its_own_turn(engine: Engine):
    """A segment that ends before its first hop goes straight to its final chunk, whose turn counts as a first
    chunk's; its flow must not wait in `later_step` for that turn to end (it did: the stream hung). Run in a
    thread so that a regression fails here instead of hanging the suite."""
    options = pinned(engine.options(voice=VOICE, seed=3, sampling="greedy"), 10)   # under 25 + 3 tokens
    chunks: list = []
    worker = threading.Thread(target=lambda: chunks.extend(engine.pipeline.stream(engine.segments(TEXT)[0], options)),
                              daemon=True)
    worker.start()
    worker.join(120)
    assert not worker.is_alive(), "a stream shorter than its first hop waited for its own turn"
    assert len(chunks) == 1 and chunks[0].size > 0


def test_batch_max_bounds_the_rows_decoded_together(engine: Engine):
    """Three requests at once under batch_max=2: no decode step holds more than two rows."""
    before = dict(engine.pipeline._decoder.stats()["rows_per_step"])
    options = engine.options(voice=VOICE, seed=2)
    segments = engine.segments(TEXT)
    waves = engine.pipeline.synthesize_many([(segments, options)] * 3, engine.limits.batch_max)
    assert all(w[0].size for w in waves)
    after = engine.pipeline._decoder.stats()["rows_per_step"]
    grew = {rows for rows, n in after.items() if n > before.get(rows, 0)}
    assert max(grew) == 2


def test_stop_withdraws_a_decoding_row_before_the_next_step(engine: Engine):
    decoder = engine.pipeline._decoder
    options = engine.options(voice=VOICE, seed=3)
    segment = engine.segments(TEXT)[0]
    long = pinned(options, 2000)
    before = decoder.stats()
    stop = threading.Event()
    chunks = engine.pipeline.stream_request(segment, long, stop, 8)
    next(chunks)
    stop.set()
    with pytest.raises(Cancelled):
        list(chunks)
    wait_until(lambda: decoder.stats()["cancelled_rows"] == before["cancelled_rows"] + 1, "the row never left")
    after = decoder.stats()
    assert after["tokens"] - before["tokens"] < 2000 and after["active_rows"] == 0
    # the engine's surface: a stop set by the caller ends the stream quietly, without a final chunk
    stop2 = threading.Event()
    stream = engine.stream_segments([segment], long, stop2)
    next(stream)
    stop2.set()
    assert list(stream) == []
    wait_until(lambda: decoder.stats()["cancelled_rows"] == before["cancelled_rows"] + 2, "the row never left")


def test_streaming_interleaves_decoding_with_the_flow(engine: Engine):
    """Issue 25: when a long stream's first chunk is delivered the decoder has produced a fraction of the
    utterance's tokens, not all of them (a stream that decodes everything before its first chunk fails here)."""
    decoder = engine.pipeline._decoder
    options = pinned(engine.options(voice=VOICE, seed=5, sampling="greedy"), 300)
    start = decoder.stats()["tokens"]
    chunks = engine.pipeline.stream(engine.segments(TEXT)[0], options)
    first = next(chunks)
    at_first_chunk = decoder.stats()["tokens"] - start
    rest = list(chunks)
    assert first.size > 0 and len(rest) >= 2
    assert decoder.stats()["tokens"] - start == 300
    assert at_first_chunk < 150, f"{at_first_chunk} of 300 tokens were decoded before the first chunk"


def test_first_chunks_waiting_together_share_one_flow_call(engine: Engine, monkeypatch):
    """Issue 25 item 4: first chunks queued at once share a flow call where their lengths match, audio exact."""
    first, second = np.random.default_rng(0).integers(0, 6561, (2, 120)).tolist()
    jobs = [("tiny_spk_zh", first), ("tiny_spk_zh", second), ("tiny_sft_spk", first)]
    assert_first_chunks_share_one_flow_call(engine, monkeypatch, jobs, [1, 2])
