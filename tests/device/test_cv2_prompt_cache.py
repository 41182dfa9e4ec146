"""The flow's per-voice prompt state (device/cosyvoice2/prompt_cache.py) on the tiny official-layout CosyVoice2
release, fp32: a streaming call that starts after the voice's prompt state gives the mel of the call that solves
the prompt frames again (fp32 round-off), for every preset, first chunks, later chunks and bounded re-solves; the
estimator then really runs fewer frames; a state that is wrong changes the mel (so the comparison can see a broken
state); the cache keeps within its cap, least recently used out first, and a cap smaller than a voice's state
keeps fewer whole chunks, with the same result."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from cosyedge.device.cosyvoice2.flow import FlowPrompt
from cosyedge.device.cosyvoice2.prompt_cache import Int8Hidden, PromptCache, PromptState, frames_within
from cosyedge.device.engine import Engine
from cosyedge.device.sessions import SessionConfig, create_session

ROUND_OFF = 1e-5      # fp32: the same arithmetic over fewer frames per call (measured <= 3e-6)
VOICE = "tiny_spk_zh"


class FrameCounter:
    """An estimator session that records the frames and outputs of each call (everything else delegates)."""

    def __init__(self, session) -> None:
        self._session, self.frames, self.outputs = session, [], []

    def run(self, outputs, feeds, *args):
        if "x" in feeds:
            self.frames.append(feeds["x"].shape[2])
            self.outputs.append(list(outputs or ()))
        return self._session.run(outputs, feeds, *args)

    def __getattr__(self, name):
        return getattr(self._session, name)


def _engine(bundle: Path, cap_mb: int, counters: list[FrameCounter] | None = None) -> Engine:
    def factory(path: Path, config: SessionConfig):
        session = create_session(path, config)
        if counters is not None and path.name.startswith("flow_estimator"):
            counters.append(FrameCounter(session))
            return counters[-1]
        return session
    sessions = SessionConfig(providers=("cpu",), intra_op_threads=1, prompt_cache_mb=cap_mb, session_factory=factory)
    return Engine.load(bundle, precision="fp32", sessions=sessions, warmup=False)


@pytest.fixture(scope="module")
def engines(cv2_tiny_bundle: Path):
    counters: list[FrameCounter] = []
    return _engine(cv2_tiny_bundle, 256, counters), _engine(cv2_tiny_bundle, 0), counters[0]


def _prompt(engine: Engine) -> FlowPrompt:
    return engine.pipeline._mode_inputs(engine.options(voice=VOICE)).flow


# first chunk (prompt 87 tokens: pad 13 + hop 25 + look-ahead 3), a later chunk, a bounded re-solve from token 100
CALLS = [(41, 0), (153, 0), (253, 100)]


def test_streaming_after_the_prompt_state_gives_the_mel_of_solving_the_prompt_again(engines):
    cached, plain, counter = engines
    prompt = _prompt(cached)
    assert prompt.tokens.size == 87 and prompt.mel.shape[0] == 174
    tokens = np.random.default_rng(0).integers(0, 6561, 300)
    for name in cached.pipeline.presets():
        preset = cached.pipeline._presets[name]
        state = cached.pipeline._flow.prompt_state(prompt, preset)
        # whole 50-frame chunks of the 174 prompt frames whose encoder output the prompt fixes (<= 2 x (87 - 3))
        assert state is not None and state.frames == 150 and len(state.steps) == preset.steps
        for size, start in CALLS:
            counter.frames.clear()
            mel = cached.pipeline._flow.mel(prompt, tokens[:size], False, True, preset, start)
            again = plain.pipeline._flow.mel(prompt, tokens[:size], False, True, preset, start)
            assert mel.shape == again.shape == (1, 80, 2 * (size - 3 - start))
            np.testing.assert_allclose(mel, again, atol=ROUND_OFF, rtol=0)
            # every estimator call of the cached solve skipped the 150 prompt frames
            assert counter.frames == [174 + 2 * (size - 3 - start) - 150] * preset.steps


def test_a_wrong_state_changes_the_mel(engines):
    """The comparison above sees a state that is not the prompt's: the state's hidden states perturbed."""
    cached, plain, _ = engines
    flow, prompt = cached.pipeline._flow, _prompt(cached)
    preset = cached.pipeline._presets["fastest"]
    state = flow.prompt_state(prompt, preset)
    wrong = PromptState(state.frames, tuple((hidden * 1.01, conv) for hidden, conv in state.steps))
    tokens = np.random.default_rng(0).integers(0, 6561, 41)
    mu, spks, cond = flow._condition(prompt, tokens, False, True)
    right = flow.solve(mu, spks, cond, True, preset=preset, past=[state])
    bent = flow.solve(mu, spks, cond, True, preset=preset, past=[wrong])
    assert np.abs(right - bent).max() > 100 * ROUND_OFF


def test_final_and_whole_calls_solve_everything(engines):
    """Full attention (the final chunk, whole synthesis) lets prompt frames see later ones: no state there."""
    cached, _, counter = engines
    prompt, preset = _prompt(cached), cached.pipeline._presets["official"]
    tokens = np.random.default_rng(1).integers(0, 6561, 60)
    counter.frames.clear()
    cached.pipeline._flow.mel(prompt, tokens, True, False, preset)
    assert counter.frames == [174 + 120] * preset.steps


def test_a_smaller_cap_keeps_fewer_whole_chunks_with_the_same_mel(cv2_tiny_bundle):
    cached = _engine(cv2_tiny_bundle, 256)
    full = cached.pipeline._flow
    prompt = _prompt(cached)
    preset = cached.pipeline._presets["official"]
    state = full.prompt_state(prompt, preset)
    frame_row = state.steps[0][0][:, :1, :1].nbytes   # one frame of one row, every block
    conv_row = state.steps[0][1][:1].nbytes
    rows = preset.estimator_rows()
    cap = rows * (101 * frame_row + conv_row)         # room for 101 frames: 2 whole chunks
    small = PromptCache(cap)
    full._cache, saved = small, full._cache
    try:
        kept = full.prompt_state(prompt, preset)
        assert kept.frames == 100 and kept.nbytes <= cap and len(small) == 1
        tokens = np.random.default_rng(2).integers(0, 6561, 41)
        fewer = full.mel(prompt, tokens, False, True, preset)
        full._cache = saved
        np.testing.assert_allclose(fewer, full.mel(prompt, tokens, False, True, preset), atol=ROUND_OFF, rtol=0)
    finally:
        full._cache = saved


def _state(nbytes: int) -> PromptState:
    return PromptState(50, ((np.zeros(nbytes // 4, np.float32), np.zeros(0, np.float32)),))


def test_the_cache_keeps_within_its_cap_least_recently_used_out():
    cache = PromptCache(1000)
    cache.put("a", _state(400))
    cache.put("b", _state(400))
    assert cache.get("a") is not None          # a is now the most recent
    cache.put("c", _state(400))
    assert cache.get("b") is None and cache.get("a") is not None and cache.get("c") is not None
    assert cache.nbytes <= 1000
    cache.put("big", _state(1200))              # larger than the cap: not kept, nothing evicted for it
    assert cache.get("big") is None and len(cache) == 2
    assert frames_within(174, 50, 10, 10_000) == 150
    assert frames_within(174, 50, 10, 1_010) == 100
    assert frames_within(174, 50, 10, 499) == 0


def test_the_cap_comes_from_the_environment(monkeypatch):
    from cosyedge.device.errors import ProviderError
    monkeypatch.setenv("COSYEDGE_PROVIDERS", "cpu")
    monkeypatch.setenv("COSYEDGE_PROMPT_CACHE_MB", "64")
    assert SessionConfig.from_env().prompt_cache_mb == 64
    monkeypatch.delenv("COSYEDGE_PROMPT_CACHE_MB")
    assert SessionConfig.from_env().prompt_cache_mb == 256
    for bad in ("-1", "lots", "1e3", "9999999"):
        monkeypatch.setenv("COSYEDGE_PROMPT_CACHE_MB", bad)
        with pytest.raises(ProviderError, match="COSYEDGE_PROMPT_CACHE_MB"):
            SessionConfig.from_env()


def test_a_kept_state_holds_no_graph_output(engines):
    """What the cache keeps are copies: a graph's output (its `present_conv`, say) lives in the arena region the
    call gave it, and held by the cache it kept that whole region resident for as long as the voice's state (a
    full-size `cpu` engine: +32 MB from the second preset's state on, in every later request's peak)."""
    cached, _, _ = engines
    flow = cached.pipeline._flow
    state = flow.prompt_state(_prompt(cached), cached.pipeline._presets["fastest"])
    assert state is not None and state.steps
    for hidden, conv in state.steps:
        arrays = (hidden.values, hidden.scales) if isinstance(hidden, Int8Hidden) else (hidden,)
        assert all(a.flags.owndata for a in (*arrays, conv))


def test_warm_up_builds_the_default_voices_state_once(cv2_tiny_bundle):
    """A warmed service has the default voice's state for the default preset before its first request (the
    bench prepares each run's preset the same way, `Engine.warmup(preset)`); a second warm-up finds it. The
    warm-up's synthesis comes after the state: a state-keeping call's outputs hold arena regions that only the
    estimator's next call hands back (37 MB of a full-size `cpu` engine, resident until its first request, and in
    the bench under the first stream-off request's encoder peak), and that synthesis is that call."""
    counters: list[FrameCounter] = []
    engine = _engine(cv2_tiny_bundle, 256, counters)
    pipeline = engine.pipeline
    prompt = _prompt(engine)
    assert engine.voices()[0] == VOICE
    assert pipeline._flow.prompt_state(prompt, pipeline._presets["official"], build=False) is None
    calls = counters[0].outputs
    assert engine.warmup()
    assert "present_hidden" in calls[0] and calls[-1] == ["velocity"]
    assert pipeline._flow.prompt_state(prompt, pipeline._presets["official"], build=False) is not None
    assert pipeline._flow.prompt_state(prompt, pipeline._presets["fastest"], build=False) is None
    del calls[:]
    assert engine.warmup("fastest")  # the bench's prepare
    assert "present_hidden" in calls[0] and calls[-1] == ["velocity"]
    assert not engine.warmup("fastest") and not pipeline.warm()
    assert pipeline._flow.prompt_state(prompt, pipeline._presets["fastest"], build=False) is not None


class FeedRecorder(FrameCounter):
    """Also records each call's prompt-state inputs: name -> dtype."""

    def __init__(self, session) -> None:
        super().__init__(session)
        self.fed: list[dict[str, str]] = []

    def run(self, outputs, feeds, *args):
        self.fed.append({k: str(v.dtype) for k, v in feeds.items() if k.startswith("past_hidden")})
        return super().run(outputs, feeds, *args)


def test_an_int8_state_is_fed_as_int8_with_the_mel_of_its_float_values(engines):
    """Where the state is kept in int8 (the cpu targets: `quantized_state`), the estimator is fed it as int8
    (`past_hidden_q` / `past_hidden_scale`: a quarter of the float feed) and gives the mel of feeding its float
    values, for a guided preset (2 rows per state) and for two streams in one call; a bundle whose estimator lacks
    those inputs is fed float32. Here on fp32 graphs, so any difference is the feed's."""
    from cosyedge.device.cosyvoice2.flow import Flow
    cached, _, _ = engines
    flow, prompt = cached.pipeline._flow, _prompt(cached)
    recorder = FeedRecorder(flow._estimator._session)
    int8 = Flow(flow._encoder, recorder, flow._noise, flow.config, PromptCache(256 << 20), quantized_state=True)
    preset = cached.pipeline._presets["official"]
    state = int8.prompt_state(prompt, preset)
    assert type(state.steps[0][0]).__name__ == "Int8Hidden"
    tokens = np.random.default_rng(2).integers(0, 6561, 41)
    mu, spks, cond = int8._condition(prompt, tokens, False, True)
    for past, rows in (([state], 1), ([state, state], 2)):
        recorder.fed.clear()
        got = int8.solve(*(np.concatenate([a] * rows) for a in (mu, spks, cond)), True, preset=preset, past=past)
        assert recorder.fed and all(f == {"past_hidden_q": "int8", "past_hidden_scale": "float32"}
                                    for f in recorder.fed)
        int8._int8_feed = False   # as for an older bundle's estimator: the float values of the same state
        recorder.fed.clear()
        want = int8.solve(*(np.concatenate([a] * rows) for a in (mu, spks, cond)), True, preset=preset, past=past)
        int8._int8_feed = True
        assert all(f == {"past_hidden": "float32"} for f in recorder.fed)
        np.testing.assert_allclose(got, want, atol=ROUND_OFF, rtol=0)


def test_int8_hidden_reads_back_within_half_a_frames_step():
    """`Int8Hidden` (the cpu targets' kept hidden states): each value comes back within half its frame's step
    (largest magnitude / 127), row slices read the same values, an all-zero frame stays zero, and it holds a byte
    per value plus one float32 per block, row and frame."""
    from cosyedge.device.cosyvoice2.prompt_cache import Int8Hidden
    rng = np.random.default_rng(3)
    hidden = (rng.standard_normal((4, 2, 6, 32)) * rng.uniform(0.01, 50, (4, 2, 6, 1))).astype(np.float32)
    hidden[1, 0, 2] = 0
    packed = Int8Hidden.of(hidden)
    step = np.abs(hidden).max(axis=-1, keepdims=True) / 127
    back = packed.astype(np.float32)
    assert back.dtype == np.float32 and back.shape == hidden.shape
    assert np.all(np.abs(back - hidden) <= step / 2 * (1 + 1e-5))
    assert not np.array_equal(back, hidden) and np.all(back[1, 0, 2] == 0)
    assert np.array_equal(packed[:, 1:2].astype(np.float32), back[:, 1:2])
    assert packed.dtype == np.int8 and packed.nbytes == hidden.size + 4 * 2 * 6 * 4
