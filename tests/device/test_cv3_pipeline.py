"""The torch-free Fun-CosyVoice3 runtime (the CosyVoice pipeline with the parts of device/cosyvoice3/family.py) against the official goldens
(cosyvoice3-tiny/vectors): the 9 e2e cases greedy and deterministic (tokens exact, waveform abs 2e-4), and the two
streaming runs (chunk schedule exact, each emitted chunk abs 2e-4). Measured figures: MEASURED (printed with -s)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from cosyedge.device.bundle import Bundle
from cosyedge.device.cosyvoice2.voices import Voice
from cosyedge.device.errors import InputError
from cosyedge.device.families import load_pipeline
from cosyedge.device.options import Segment, SynthesisOptions
from cosyedge.device.sessions import SessionConfig
from schedulertools import stop_every_later_call_once

CASES = [f"{mode}_{i}" for mode in ("zero_shot", "cross_lingual", "instruct2") for i in (1, 2, 3)]
WAVE_ATOL = 2e-4
MEASURED: dict[str, float] = {}


def _err(name: str, got: np.ndarray, want: np.ndarray) -> float:
    assert got.shape == want.shape, (name, got.shape, want.shape)
    err = float(np.abs(got.astype(np.float64) - want.astype(np.float64)).max()) if got.size else 0.0
    MEASURED[name] = max(err, MEASURED.get(name, 0.0))
    return err


@pytest.fixture(scope="module")
def vectors(golden_dir: Path) -> Path:
    return golden_dir / "cosyvoice3-tiny" / "vectors"


@pytest.fixture(scope="module")
def meta(vectors: Path) -> dict:
    return json.loads((vectors / "meta.json").read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def pipeline(cv3_tiny_bundle: Path):
    return load_pipeline(Bundle.load(cv3_tiny_bundle), "fp32", SessionConfig(providers=("cpu",), intra_op_threads=1))


def _golden_voice(e, name: str, mode: str) -> Voice:
    """A run-time voice holding exactly the official prompt inputs of an e2e case."""
    tokens = e["seg0_flow_prompt_speech_token"].reshape(-1).astype(np.int64)
    prompt_text = tuple(int(i) for i in e["seg0_prompt_text_token"].reshape(-1)) if mode == "zero_shot" else ()
    return Voice(name, "zero_shot", e["seg0_flow_embedding"].reshape(-1), prompt_text_ids=prompt_text,
                 llm_prompt_speech=tuple(int(t) for t in tokens), flow_prompt_speech=tokens,
                 prompt_mel=e["seg0_prompt_speech_feat"][0])


def _request(meta: dict, case: str, voice: str) -> SynthesisOptions:
    c = meta["e2e"][case]["case"]
    return SynthesisOptions(voice=voice, mode=c["mode"], instruct_text=c.get("instruct_text"), sampling="greedy",
                            deterministic=True)


@pytest.fixture()
def voice(pipeline):
    added: list[str] = []

    def add(v: Voice) -> str:
        pipeline.add_voice(v)
        added.append(v.name)
        return v.name
    yield add
    for name in added:
        pipeline.remove_voice(name)


def test_registered_and_described(pipeline) -> None:
    d = pipeline.describe()
    assert d["family"] == "cosyvoice3" and d["sample_rate"] == 24000 and pipeline.voices() == ["zs_full", "zs_2s"]


@pytest.mark.parametrize("case", CASES)
def test_e2e_golden(pipeline, voice, vectors: Path, meta: dict, case: str) -> None:
    e = np.load(vectors / f"e2e_{case}.npz")
    mode = meta["e2e"][case]["case"]["mode"]
    request = _request(meta, case, voice(_golden_voice(e, f"g_{case}", mode)))
    text = meta["e2e"][case]["case"]["tts_text"]
    segments = pipeline.segments(pipeline.validate_text(text, 10_000))
    assert [list(s.ids) for s in segments] == [e["seg0_text_token"].reshape(-1).tolist()]
    tokens = pipeline.speech_tokens(segments[0], request)
    assert tokens == e["seg0_llm_tokens"].tolist()
    assert pipeline._flow_tokens(tokens) == e["seg0_flow_tokens"].reshape(-1).tolist()
    (wave,) = pipeline.synthesize(segments, request)
    assert _err("e2e_tts_speech", wave, e["seg0_tts_speech"][0]) <= WAVE_ATOL


def test_e2e_from_prompt_wav(pipeline, voice, golden_dir: Path, vectors: Path, meta: dict) -> None:
    """zero_shot_1 with a voice registered from the prompt recording (the runtime's own prompt features)."""
    e = np.load(vectors / "e2e_zero_shot_1.npz")
    wav, sr = sf.read(golden_dir / "audio" / "zero_shot_prompt.wav", dtype="float32")
    v = pipeline.make_voice("from_wav", wav, sr, "希望你以后能够做的比我还好呦。")  # system prompt added
    assert list(v.prompt_text_ids) == e["seg0_prompt_text_token"].reshape(-1).tolist()
    assert list(v.llm_prompt_speech) == e["seg0_llm_prompt_speech_token"].reshape(-1).tolist()
    request = _request(meta, "zero_shot_1", voice(v))
    segment = Segment(text="", ids=tuple(int(i) for i in e["seg0_text_token"].reshape(-1)))
    assert pipeline.speech_tokens(segment, request) == e["seg0_llm_tokens"].tolist()
    (wave,) = pipeline.synthesize([segment], request)
    assert _err("e2e_from_wav_tts_speech", wave, e["seg0_tts_speech"][0]) <= 1e-3  # embedding within 1e-4


def test_endofprompt_is_required(pipeline) -> None:
    request = SynthesisOptions(voice="zs_full", mode="cross_lingual", sampling="greedy", deterministic=True)
    with pytest.raises(InputError, match="endofprompt"):
        pipeline.synthesize(pipeline.segments("Hello there."), request)


def test_instruct2_saved_speaker_quirk(pipeline, vectors: Path) -> None:
    """Official: instruct2 with a saved speaker (spk2info) puts the speaker's prompt text, not the instruction,
    into the LLM; the flag restores the instruction."""
    request = SynthesisOptions(voice="zs_full", mode="instruct2", instruct_text="Speak slowly.<|endofprompt|>")
    spk = np.load(vectors / "frontend.npz")["spk2info_zs_full__prompt_text"].reshape(-1).tolist()
    inputs = pipeline._mode_inputs(request)
    assert list(inputs.prompt_text) == spk and inputs.prompt_speech == ()
    pipeline.instruct2_uses_instruction = True
    try:
        assert list(pipeline._mode_inputs(request).prompt_text) == \
            list(pipeline._frontend.encode("Speak slowly.<|endofprompt|>"))
    finally:
        del pipeline.instruct2_uses_instruction


def test_streaming_scripted(pipeline, vectors: Path) -> None:
    """The scripted run: saved speaker zs_2s (pad 0), 180 given tokens -> chunks [28, 78, 178 | 180]."""
    st = np.load(vectors / "streaming.npz")
    request = SynthesisOptions(voice="zs_2s", mode="zero_shot", sampling="greedy", deterministic=True)
    chunks = list(pipeline.stream_tokens(st["scripted_tokens"].tolist(), request))
    assert [c.shape[0] for c in chunks] == [20160, 48000, 96000, 8640]
    for i, chunk in enumerate(chunks):
        assert _err("stream_scripted_chunk", chunk, st[f"scripted_chunk{i}_tts_speech"][0]) <= WAVE_ATOL


def test_streaming_scripted_with_every_later_call_stopped_once(pipeline, vectors: Path, monkeypatch) -> None:
    """The scripted run again, each later chunk's graph call (flow encoder, each Euler step, HiFT source and
    decoder) stopped at its first try and run again, as the chunk gate does for a newcomer: the same golden chunks."""
    st = np.load(vectors / "streaming.npz")
    calls = stop_every_later_call_once(monkeypatch, pipeline)
    request = SynthesisOptions(voice="zs_2s", mode="zero_shot", sampling="greedy", deterministic=True)
    chunks = list(pipeline.stream_tokens(st["scripted_tokens"].tolist(), request))
    assert len(calls) == (1 + pipeline._flow.config.n_timesteps + 2) * (len(chunks) - 1)
    for i, chunk in enumerate(chunks):
        assert _err("stream_scripted_chunk", chunk, st[f"scripted_chunk{i}_tts_speech"][0]) <= WAVE_ATOL


def test_streaming_instruct2_llm(pipeline, voice, vectors: Path, meta: dict) -> None:
    """instruct2_3 streamed from the greedy LLM (prompt pad 13 -> first hop 38): chunks [41, 91 | 98]."""
    e, st = np.load(vectors / "e2e_instruct2_3.npz"), np.load(vectors / "streaming.npz")
    request = _request(meta, "instruct2_3", voice(_golden_voice(e, "g_stream", "instruct2")))
    segment = Segment(text="", ids=tuple(int(i) for i in e["seg0_text_token"].reshape(-1)))
    chunks = list(pipeline.stream(segment, request))
    assert [c.shape[0] for c in chunks] == [32640, 48000, 13440]
    for i, chunk in enumerate(chunks):
        assert _err("stream_instruct2_3_chunk", chunk, st[f"instruct2_3_chunk{i}_tts_speech"][0]) <= WAVE_ATOL


def test_streamed_hift_reruns_the_decoder_over_a_bounded_window(pipeline, cv3_tiny_bundle: Path) -> None:
    """A long stream's HiFT: the decoder re-runs from `hift_history_frames` before the first unsent sample, not from
    frame 0, so each call feeds it a chunk plus the history whatever the stream's length; the samples equal the
    official re-run from frame 0 (here exactly). A shorter history (2 frames) gives other samples: the manifest's
    measured reach is what makes the window exact."""
    from cosyedge.device.cosyvoice3.vocoder import RerunStream
    vocoder = pipeline._vocoder
    history = Bundle.load(cv3_tiny_bundle).manifest.config["hift_history_frames"]
    assert history >= 10
    u = vocoder.samples_per_frame
    rng = np.random.default_rng(0)
    chunks = [(rng.standard_normal((1, 80, n)) - 5).astype(np.float32) for n in (56, 100, 200, 200, 200, 37)]
    decoder = vocoder._decoder

    def stream(history_frames, fed: list[int] | None = None):
        """The stream's chunks; `fed` receives the mel frames of each decoder call."""
        class Recorded:
            def run(self, names, feeds):
                fed.append(feeds["mel"].shape[2])
                return decoder.run(names, feeds)

        rerun = RerunStream(vocoder, u, history_frames)
        vocoder._decoder = Recorded() if fed is not None else decoder
        try:
            return [rerun.chunk(mel, final=i == len(chunks) - 1) for i, mel in enumerate(chunks)]
        finally:
            vocoder._decoder = decoder

    official_fed, fed = [], []
    official, bounded = stream(None, official_fed), stream(history, fed)
    assert [c.shape for c in bounded] == [c.shape for c in official] and sum(c.size for c in official) == 793 * u
    for got, want in zip(bounded, official):
        np.testing.assert_array_equal(got, want)
    assert official_fed[-1] == 793                  # the official re-run: the whole utterance so far, each time
    # bounded: each call its own new frames (200 at most here), the history and the look-ahead still to voice
    assert max(fed) <= 200 + history + 8 and sum(fed) < sum(official_fed) / 2, (fed, official_fed)
    short = stream(2)
    assert not all(np.array_equal(a, b) for a, b in zip(short, official))


def test_whole_hift_renders_in_bounded_windows(pipeline) -> None:
    """Non-streamed HiFT of a long mel: the decoder renders RENDER_WINDOW frames per call (plus the history before
    and the look-ahead after), and the samples equal one call over the whole mel (here exactly); with a 2-frame
    history they would not."""
    from cosyedge.device.cosyvoice3.vocoder import RENDER_WINDOW
    vocoder, decoder, fed = pipeline._vocoder, pipeline._vocoder._decoder, []
    mel = (np.random.default_rng(1).standard_normal((1, 80, 2 * RENDER_WINDOW + 93)) - 5).astype(np.float32)

    class Recorded:
        def run(self, names, feeds):
            fed.append(feeds["mel"].shape[2])
            return decoder.run(names, feeds)

    whole = vocoder.run(mel, finalize=True)
    vocoder._decoder = Recorded()
    try:
        windowed = vocoder.render(mel, None)
    finally:
        vocoder._decoder = decoder
    np.testing.assert_array_equal(windowed, whole)
    history = vocoder._history_frames
    assert len(fed) == 3 and max(fed) <= RENDER_WINDOW + history + vocoder._conv_pre_lookahead + 1, fed
    vocoder._history_frames = 2
    try:
        assert not np.array_equal(vocoder.render(mel, None), whole)
    finally:
        vocoder._history_frames = history


def test_report() -> None:
    print("\ncosyvoice3 runtime parity (max abs):", json.dumps(MEASURED, indent=1))
