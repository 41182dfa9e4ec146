"""The engine's one door (device/door.py) on the real default voice and the tiny CosyVoice2 bundle: what every
protocol reads is what the engine makes, jobs take turns, a stalled reader costs no work, a withdrawn or late job
gets none, and a failure stays with its job."""
from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
import pytest

from cosyedge.device.door import AHEAD, Door, Job, Observer, collect
from cosyedge.device.engine import Engine
from cosyedge.device.errors import DeadlineError, DoorClosed, SynthesisFailed
from cosyedge.device.options import Segment
from cosyedge.device.pipeline import Pipeline
from cosyedge.device.sessions import SessionConfig

TEXT = "One sentence here. A second sentence there. And a third one."
T = 120  # seconds: a bound for every wait, never an expectation


class _Calls(Observer):
    def __init__(self) -> None:
        self.calls: list[int] = []
        self.expired_jobs = 0

    def rendered(self, jobs: int, audio_s: float, compute_s: float) -> None:
        self.calls.append(jobs)

    def expired(self) -> None:
        self.expired_jobs += 1


def _job(engine: Engine, text: str = TEXT, **options) -> Job:
    return Job(engine.segments(text), engine.options(deterministic=True, **options))


def _wait_for(condition, what: str) -> None:
    end = time.monotonic() + T
    while not condition():
        assert time.monotonic() < end, what
        time.sleep(0.01)


def test_a_job_collected_is_the_engine_s_whole_render(default_engine):
    with Door(default_engine) as door:
        stream = door.open(_job(default_engine))
        chunks = list(stream)
    assert [(c.segment, c.last, c.words) for c in chunks] == [(0, True, ()), (1, True, ()), (2, True, ())]
    np.testing.assert_array_equal(collect(chunks), default_engine.synthesize_waveform(TEXT, deterministic=True))
    assert stream.skipped == 0


def test_jobs_take_turns_and_a_stalled_reader_costs_no_work(default_engine):
    """Round robin over open jobs, one sentence each, and no waiting for company (gather_s is for pipelines that
    batch: an hour here would hang the test); a reader that takes nothing gets AHEAD sentences made and no more,
    while another job goes on."""
    observer = _Calls()
    long_text = " ".join(f"Sentence number {i} is here." for i in range(8))
    with Door(default_engine, gather_s=3600.0, observer=observer) as door:
        stalled = door.open(_job(default_engine, long_text))
        moving = door.open(_job(default_engine, long_text))
        assert moving.ready(T), "a job waited for company"
        got = list(moving)
        assert len(got) == 8
        assert stalled._backlog() == AHEAD  # made ahead of its reader, then skipped while it did not read
        assert len(observer.calls) == 8 + AHEAD
        assert len(list(stalled)) == 8  # reading again resumes it
    assert observer.calls == [1] * 16  # one segment per engine call: no waiting for company


def test_a_withdrawn_job_gets_no_further_work(default_engine):
    observer = _Calls()
    long_text = " ".join(f"Sentence number {i} is here." for i in range(20))
    with Door(default_engine, observer=observer) as door:
        stream = door.open(_job(default_engine, long_text))
        next(stream)
        stream.close()
        assert list(stream) == []
        assert collect(door.stream(_job(default_engine, "Next."))).size > 0  # the door goes on
    assert len(observer.calls) <= 1 + AHEAD + 1 and stream.skipped == 19


def test_a_job_past_its_deadline_is_refused_before_any_work(default_engine):
    observer = _Calls()
    with Door(default_engine, observer=observer) as door:
        late = door.open(Job(default_engine.segments(TEXT), default_engine.options(), deadline=time.monotonic() - 1))
        with pytest.raises(DeadlineError):
            next(late)
    assert observer.calls == [] and observer.expired_jobs == 1


class _Failing(Pipeline):
    """The real VITS pipeline; a text with "kaboom" fails in the engine."""

    def __init__(self, inner: Pipeline) -> None:
        self.inner, self.sample_rate = inner, inner.sample_rate

    def voices(self):
        return self.inner.voices()

    def segments(self, text):
        segments = self.inner.segments(text)
        return [Segment("kaboom", s.ids) for s in segments] if "kaboom" in text else segments

    def synthesize(self, segments, options):
        if any(s.text == "kaboom" for s in segments):
            raise RuntimeError("injected")
        return self.inner.synthesize(segments, options)

    def stream(self, segment, options):
        yield self.synthesize([segment], options)[0]

    def describe(self):
        return self.inner.describe()


def test_a_failure_stays_with_its_job_and_the_door_closes_cleanly(default_engine):
    engine = Engine(default_engine.bundle, _Failing(default_engine.pipeline), default_engine.precision)
    door = Door(engine)
    failing = door.open(Job(engine.segments("kaboom."), engine.options()))
    fine = door.open(Job(engine.segments("Fine."), engine.options()))
    with pytest.raises(SynthesisFailed, match="RuntimeError: injected"):
        next(failing)
    assert collect(fine).size > 0
    waiting = door.open(Job(engine.segments(TEXT), engine.options()))
    door.close()
    with pytest.raises(DoorClosed):
        collect(waiting)
    with pytest.raises(DoorClosed):
        door.open(Job(engine.segments("Late."), engine.options()))


@pytest.fixture(scope="module")
def cv2_engine(cv2_tiny_bundle: Path, tmp_path_factory: pytest.TempPathFactory) -> Engine:
    return Engine.load(cv2_tiny_bundle, precision="fp32", warmup=False, state_dir=tmp_path_factory.mktemp("door"),
                       sessions=SessionConfig(providers=("cpu",), intra_op_threads=1))


def test_cosyvoice_chunks_and_whole_renders_are_the_engine_s(cv2_engine):
    text = "收到好友从远方寄来的生日礼物。"
    options = cv2_engine.options(voice="tiny_spk_zh", sampling="greedy", deterministic=True)
    segments = cv2_engine.segments(text)
    with Door(cv2_engine) as door:
        chunks = list(door.open(Job(segments, options)))
        whole = collect(door.open(Job(segments, options, chunked=False)))
    direct = list(cv2_engine.stream(text, voice="tiny_spk_zh", sampling="greedy", deterministic=True))
    assert len(chunks) == len(direct) + 1 and chunks[-1].last and chunks[-1].audio.size == 0  # the segment's end
    assert not any(c.last for c in chunks[:-1])
    np.testing.assert_array_equal(collect(chunks), np.concatenate(direct))
    np.testing.assert_array_equal(whole, cv2_engine.synthesize_waveform(text, voice="tiny_spk_zh", sampling="greedy",
                                                                        deterministic=True))


def test_cosyvoice_whole_jobs_arriving_together_share_a_prefill(cv2_engine):
    """An idle engine: the first whole job waits gather_s (30 s) for company, and once batch_max jobs are there
    they start at once, in one engine call with one prefill."""
    options = cv2_engine.options(voice="tiny_spk_zh", sampling="greedy", deterministic=True)
    observer = _Calls()
    prefills = cv2_engine.describe()["decode"]["prefill_calls"]
    with Door(cv2_engine, gather_s=30.0, observer=observer) as door:
        streams = []
        for _ in range(cv2_engine.limits.batch_max):
            streams.append(door.open(Job(cv2_engine.segments("你好。"), options, chunked=False)))
        results = [collect(stream) for stream in streams]
    assert observer.calls == [cv2_engine.limits.batch_max]
    assert cv2_engine.describe()["decode"]["prefill_calls"] == prefills + 1
    assert all(np.array_equal(r, results[0]) for r in results)


def test_a_cosyvoice_stream_withdrawn_leaves_its_decode_row(cv2_engine):
    long = "，".join(["收到好友从远方寄来的生日礼物"] * 100) + "。"
    options = cv2_engine.options(voice="tiny_spk_zh", sampling="greedy")
    cancelled = cv2_engine.stats()["decode_rows_cancelled"].value
    with Door(cv2_engine) as door:
        stream = door.open(Job(cv2_engine.segments(long), options))
        next(stream)
        threading.Thread(target=stream.close).start()  # from another thread, as a WebSocket reader does
        assert list(stream) == []
        _wait_for(lambda: cv2_engine.stats()["decode_rows_cancelled"].value > cancelled, "the row never left")
        _wait_for(lambda: door.in_flight() == 0, "the job still counts")


def _words_job(engine: Engine, text: str, chunked: bool, **options) -> Job:
    return Job(engine.segments(text, words=True), engine.options(deterministic=True, **options), chunked=chunked,
               words=True)


@pytest.mark.parametrize("chunked", [False, True])
def test_word_times_through_the_door_are_the_engine_s(default_engine, chunked):
    """A job asking for words: the same audio as without, and the words `synthesize_words` gives (on the job's
    clock: the second and third sentences' words come after the first's audio), each in the chunk that ends it."""
    with Door(default_engine) as door:
        chunks = list(door.open(_words_job(default_engine, TEXT, chunked)))
    wave, words = default_engine.synthesize_words(TEXT, deterministic=True)
    np.testing.assert_array_equal(collect(chunks), wave)
    assert [w for c in chunks for w in c.words] == words and len(words) == len(TEXT.split())
    heard = 0
    for chunk in chunks:
        heard += chunk.audio.size
        assert all(w.end_s <= heard / default_engine.sample_rate + 1e-6 for w in chunk.words)


def test_cosyvoice_word_times_through_the_door_stream_and_whole(cv2_engine):
    """CosyVoice chunks with the words each completes (as `Engine.stream_words`), and a whole job with word times
    that arrives with others is not gathered with them (its times need their own call) yet still gets them."""
    text = "收到好友从远方寄来的生日礼物。今天天气很好。"
    options = dict(voice="tiny_spk_zh", sampling="greedy")
    with Door(cv2_engine, gather_s=0.5) as door:
        streamed = list(door.open(_words_job(cv2_engine, text, True, **options)))
        plain = door.open(Job(cv2_engine.segments(text), cv2_engine.options(deterministic=True, **options),
                              chunked=False))
        whole = door.open(_words_job(cv2_engine, text, False, **options))
        plain_wave, whole_chunks = collect(plain), list(whole)
    direct = list(cv2_engine.stream_words(cv2_engine.segments(text, words=True),
                                          cv2_engine.options(deterministic=True, **options)))
    np.testing.assert_array_equal(collect(streamed), np.concatenate([c for c, _ in direct]))
    assert [w for c in streamed for w in c.words] == [w for _, ws in direct for w in ws]
    wave, words = cv2_engine.synthesize_words(text, deterministic=True, **options)
    np.testing.assert_array_equal(collect(whole_chunks), wave)
    np.testing.assert_array_equal(plain_wave, wave)
    assert [w for c in whole_chunks for w in c.words] == words and words and words[-1].end_s <= len(wave) / 24000
