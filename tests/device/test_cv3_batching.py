"""Fun-CosyVoice3 through the cross-request decode scheduler (device/cosyvoice2/scheduler.py, shared) on the tiny
CosyVoice3 bundle: batching invariance. A request's speech tokens and audio do not depend on the requests it was
batched with: tokens exact, audio exact (the v3 vocoder's noise is fixed; with equal tokens a request's flow rows
and HiFT calls are the ones it makes alone), whether the requests come in one `synthesize_many` call or as
concurrent streams."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from cosyedge.device.cosyvoice2.pipeline import pinned, pinned_tokens
from cosyedge.device.engine import Engine
from cosyedge.device.sessions import SessionConfig
from schedulertools import (assert_concurrent_streams_match_alone, assert_first_chunk_goes_first,
                            assert_first_chunks_share_one_flow_call, record_flow_batches, rows_per_step_delta)

SYSTEM = "You are a helpful assistant.<|endofprompt|>"
LONG = ("人工智能正在改变我们的生活方式。从智能手机上的语音助手，到自动驾驶汽车，再到医疗诊断系统，这些技术已经深入到社会的各个角"
        "落。然而，随着技术的快速发展，人们也开始担心隐私保护、就业替代以及算法偏见等问题。专家们认为，我们需要在推动创新的同")
JOBS = [("Hello, this is a tiny test of CosyVoice three.", {"voice": "zs_full", "sampling": "greedy",
                                                             "deterministic": True}),
        (LONG, {"voice": "zs_2s", "seed": 5}),
        (f"{SYSTEM}Good morning! How are you today?", {"voice": "zs_full", "mode": "cross_lingual", "seed": 6}),
        ("Speak up, please. The tiny model is listening.", {"voice": "zs_2s", "sampling": "greedy",
                                                             "instruct_text": "请用尽可能快地语速说一句话。"})]


@pytest.fixture(scope="module")
def engine(cv3_tiny_bundle: Path) -> Engine:
    return Engine.load(cv3_tiny_bundle, precision="fp32",
                       sessions=SessionConfig(providers=("cpu",), intra_op_threads=1), warmup=False)


def _submit(pipeline, segments, request):
    """The request's segments as one decode group (what synthesize_many submits), with the request's own seed."""
    inputs = pipeline._mode_inputs(request)
    return pipeline._decoder.submit([pipeline._lm_input(s, inputs) for s in segments], [len(s.ids) for s in segments],
                                    request.sampling == "greedy", np.random.default_rng(request.seed),
                                    pinned_tokens(request))


def test_tokens_and_audio_do_not_depend_on_the_batch(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """Four requests (zero-shot, a two-segment text with seeded RAS, cross-lingual, instruct2; greedy and sampled)
    in one call give exactly what each gives alone; decode steps were shared and one flow batch held rows of
    different requests."""
    pipeline = engine.pipeline
    jobs = [(engine.segments(text), engine.options(**options)) for text, options in JOBS]
    assert len(jobs[1][0]) == 2   # the long text has two segments
    alone_tokens = [_submit(pipeline, *job).results() for job in jobs]
    before = pipeline._decoder.stats()
    groups = [_submit(pipeline, *job) for job in jobs]            # all queued before any result is awaited
    assert [g.results() for g in groups] == alone_tokens
    assert max(rows_per_step_delta(before, pipeline._decoder.stats())) >= 4   # four requests decoded in common steps
    alone = [engine.synthesize_many([job])[0] for job in jobs]
    flow_rows = record_flow_batches(monkeypatch, pipeline)
    before = pipeline._decoder.stats()
    together = engine.synthesize_many(jobs)
    assert max(rows_per_step_delta(before, pipeline._decoder.stats())) > 1
    assert any(len(rows) > 1 for rows in flow_rows)
    for a, b in zip(alone, together):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert x.size and np.array_equal(x, y)


def test_concurrent_streams_get_what_each_gets_alone(engine: Engine) -> None:
    assert_concurrent_streams_match_alone(engine, JOBS, timeout=300)


def test_a_new_streams_first_chunk_goes_before_a_running_streams_next_chunk(engine: Engine) -> None:
    """CosyVoice3 streams take turns through the same ChunkGate as CosyVoice2's: first chunks first."""
    options = engine.options(voice="zs_2s", seed=1, sampling="greedy")
    assert_first_chunk_goes_first(engine, engine.segments(LONG)[0], pinned(options, 300))


def test_first_chunks_waiting_together_share_one_flow_call(engine: Engine, monkeypatch) -> None:
    """Issue 25 item 4, as for CosyVoice2: one voice's two first chunks in one flow call, the other voice's alone."""
    first, second = np.random.default_rng(0).integers(0, 6561, (2, 120)).tolist()
    jobs = [("zs_full", first), ("zs_full", second), ("zs_2s", first)]
    assert_first_chunks_share_one_flow_call(engine, monkeypatch, jobs, [1, 2])
