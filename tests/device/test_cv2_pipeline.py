"""The torch-free CosyVoice2 runtime (device/cosyvoice2/) against the official goldens of cosyvoice2-tiny.

The bundle is written once per module by the quantize writer from the tiny release. Tolerances
(vectors/README.md): tokens, segment texts, token ids, lm_input, chunk sizes exact; mel atol 1e-4; waveforms by SNR
> 40 dB (the official float32 sine phase alone moves them by up to ~5e-3; observed here: per-case max abs error
<= 0.02, SNR >= 45 dB), streaming chunks atol 5e-3 or SNR > 40 dB; the CLI's int16 WAV within 2/32768 of the
in-process waveform.
"""
from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
import wave
from pathlib import Path
from typing import Iterator

import numpy as np
import pytest

from cosyedge.device.cosyvoice2.streaming import stream_tokens
from cosyedge.device.cosyvoice2.vocoder import CONTEXT_FRAMES, WINDOW_FRAMES, VocoderStream
from cosyedge.device.engine import Engine
from cosyedge.device.errors import InputError
from cosyedge.device.options import SynthesisOptions
from cosyedge.device.sessions import SessionConfig
from schedulertools import run_together

MEL_ATOL = 1e-4
SNR_DB = 40.0
CHUNK_ATOL = 5e-3
WAV_ATOL = 2 / 32768
ZH_VOICE, SFT_VOICE = "tiny_spk_zh", "tiny_sft_spk"
INSTRUCT = "用四川话说这句话<|endofprompt|>"


def _vectors() -> Path:
    return Path(__file__).resolve().parents[2].parent / "shared" / "golden" / "cosyvoice2-tiny" / "vectors"


E2E_CASES = json.loads((_vectors() / "index.json").read_text(encoding="utf-8"))["e2e"] \
    if (_vectors() / "index.json").is_file() else []
STREAM_VOICES = {"stream_zero_shot": ZH_VOICE, "stream_sft": SFT_VOICE}


@pytest.fixture(scope="module")
def vectors(cv2_tiny_dir: Path) -> dict[str, dict[str, np.ndarray]]:
    out = {}
    for name in ("e2e", "llm", "stream"):
        with np.load(cv2_tiny_dir / "vectors" / f"{name}.npz") as z:
            out[name] = dict(z)
    return out


@pytest.fixture(scope="module")
def stream_index(cv2_tiny_dir: Path) -> dict:
    return json.loads((cv2_tiny_dir / "vectors" / "index.json").read_text(encoding="utf-8"))["stream"]


@pytest.fixture(scope="module")
def cv2_bundle(cv2_tiny_bundle: Path) -> Path:
    return cv2_tiny_bundle


@pytest.fixture(scope="module")
def engine(cv2_bundle: Path) -> Engine:
    return Engine.load(cv2_bundle, precision="fp32", sessions=SessionConfig(providers=("cpu",), intra_op_threads=1),
                       warmup=False)


def _snr(ref: np.ndarray, out: np.ndarray) -> float:
    ref, out = np.asarray(ref, np.float64), np.asarray(out, np.float64)
    return float(10 * np.log10((ref ** 2).sum() / max(((out - ref) ** 2).sum(), 1e-30)))


def _options(case: dict) -> dict:
    options = {"voice": case["sft_spk_id"] or ZH_VOICE, "mode": case["mode"], "speed": case["speed"],
               "sampling": "greedy", "deterministic": True}
    if case["instruct_text"]:
        options["instruct_text"] = case["instruct_text"]
    return options


# ------------------------------------------------------------------------------------------------ end to end

@pytest.mark.parametrize("case", E2E_CASES, ids=[c["name"] for c in E2E_CASES])
def test_e2e_greedy_matches_golden(engine: Engine, vectors: dict, case: dict) -> None:
    request = engine.options(**_options(case))
    segments = engine.segments(case["text"])
    assert [u.text for u in segments] == case["segments"]
    for j, segment in enumerate(segments):
        key = f"{case['name']}_s{j}"
        assert list(segment.ids) == vectors["llm"][f"{key}__text_token"].reshape(-1).tolist()
        assert engine.pipeline.speech_tokens(segment, request) == vectors["llm"][f"{key}__greedy_tokens"].tolist()
    wave_ = engine.synthesize_waveform(case["text"], **_options(case))
    golden = np.concatenate([vectors["e2e"][f"{case['name']}_s{j}__tts_speech"][0] for j in range(len(segments))])
    assert wave_.dtype == np.float32 and wave_.shape == golden.shape
    assert _snr(golden, wave_) > SNR_DB


@pytest.mark.parametrize("names", [("sft0", "sft1", "sft2"), ("zero_shot0", "zero_shot1", "zero_shot2"),
                                   ("cross_lingual0", "cross_lingual1", "cross_lingual2")])
def test_batched_render_matches_single_goldens(engine: Engine, vectors: dict, names: tuple[str, ...]) -> None:
    """Several requests with equal options go through one padded LLM batch and one padded flow batch."""
    cases = [next(c for c in E2E_CASES if c["name"] == n) for n in names]
    request = engine.options(**_options(cases[0]))
    segments = [engine.segments(c["text"]) for c in cases]
    pipeline = engine.pipeline
    inputs = pipeline._mode_inputs(request)
    flat = [u for us in segments for u in us]
    rows = pipeline._lm.batch_tokens([pipeline._lm.lm_input(u.ids, inputs.prompt_text, inputs.prompt_speech)
                                      for u in flat], [len(u.ids) for u in flat], True, np.random.default_rng(0))
    keys = [f"{c['name']}_s{j}" for c, us in zip(cases, segments) for j in range(len(us))]
    assert rows == [vectors["llm"][f"{k}__greedy_tokens"].tolist() for k in keys]
    waves = engine.synthesize_many([(us, request) for us in segments])
    for case, us, wave_ in zip(cases, segments, waves):
        golden = np.concatenate([vectors["e2e"][f"{case['name']}_s{j}__tts_speech"][0] for j in range(len(us))])
        assert wave_.shape == golden.shape and _snr(golden, wave_) > SNR_DB


@pytest.mark.parametrize("key", ["sft0_s0", "zero_shot0_s0", "cross_lingual0_s0", "instruct20_s0"])
def test_lm_input_is_the_official_gather(engine: Engine, vectors: dict, key: str) -> None:
    case = next(c for c in E2E_CASES if f"{c['name']}_s0" == key)
    request = engine.options(**_options(case))
    inputs = engine.pipeline._mode_inputs(request)
    llm = vectors["llm"]
    assert list(inputs.prompt_text) == llm[f"{key}__prompt_text_token"].reshape(-1).tolist()
    assert list(inputs.prompt_speech) == llm[f"{key}__prompt_speech_token"].reshape(-1).tolist()
    lm_input = engine.pipeline._lm.lm_input(llm[f"{key}__text_token"].reshape(-1), inputs.prompt_text,
                                            inputs.prompt_speech)
    assert np.array_equal(lm_input, llm[f"{key}__lm_input"])


def test_cli_synth_writes_the_golden_waveform(cv2_bundle: Path, engine: Engine, vectors: dict,
                                              tmp_path: Path) -> None:
    text = next(c for c in E2E_CASES if c["name"] == "zero_shot0")["text"]
    out = tmp_path / "out.wav"
    env = {**os.environ, "COSYEDGE_HOME": str(tmp_path / "home"), "COSYEDGE_THREADS": "1",
           "COSYEDGE_PROVIDERS": "cpu"}
    result = subprocess.run([sys.executable, "-m", "cosyedge.device.cli", "synth", text, "--bundle", str(cv2_bundle),
                             "--voice", ZH_VOICE, "--sampling", "greedy", "--deterministic", "-o", str(out)],
                            capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    with wave.open(str(out)) as handle:
        assert handle.getframerate() == 24000 and handle.getsampwidth() == 2
        pcm = np.frombuffer(handle.readframes(handle.getnframes()), "<i2").astype(np.float32) / 32767.0
    direct = engine.synthesize_waveform(text, voice=ZH_VOICE, sampling="greedy", deterministic=True)
    golden = vectors["e2e"]["zero_shot0_s0__tts_speech"][0]
    assert pcm.shape == golden.shape
    assert float(np.abs(pcm - direct).max()) <= WAV_ATOL
    assert _snr(golden, pcm) > SNR_DB


# ------------------------------------------------------------------------------------------------ streaming

class _Recorder:
    """A vocoder stand-in that records what the streaming code gives HiFT, then runs the real one."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.mels: list[np.ndarray] = []
        self.sources: list[np.ndarray] = []

    def source(self, mel: np.ndarray, rng) -> np.ndarray:
        self.mels.append(mel.copy())
        return self.inner.source(mel, rng)

    def decode(self, mel: np.ndarray, source: np.ndarray, options=None) -> np.ndarray:
        self.sources.append(source.copy())
        return self.inner.decode(mel, source, options)


def _counted(tokens: list[int], seen: list[int]) -> Iterator[int]:
    for token in tokens:
        seen[0] += 1
        yield token


@pytest.mark.parametrize("case", sorted(STREAM_VOICES))
def test_stream_chunks_match_golden(engine: Engine, vectors: dict, stream_index: dict, case: str) -> None:
    golden = vectors["stream"]
    pipeline = engine.pipeline
    voice = pipeline._voices[STREAM_VOICES[case]]
    assert np.array_equal(voice.flow_embedding, golden[f"{case}__embedding"].reshape(-1))
    prompt = pipeline._mode_inputs(engine.options(voice=voice.name, deterministic=True)).flow
    assert np.array_equal(prompt.tokens, golden[f"{case}__prompt_token"].reshape(-1))
    recorder = _Recorder(pipeline._vocoder)
    tokens = golden[f"{case}__tokens"].reshape(-1).tolist()
    seen = [0]
    chunks, consumed = [], []
    for chunk in stream_tokens(_counted(tokens, seen), prompt, pipeline._flow,
                               VocoderStream(recorder, pipeline._vocoder.cache, None), pipeline._schedule):
        chunks.append(chunk)
        consumed.append(seen[0])
    table = stream_index[case]["chunks"]
    assert len(chunks) == len(table)
    assert consumed == [c["n_tokens_to_flow"] for c in table]   # each chunk leaves as soon as its tokens exist
    for i, chunk in enumerate(chunks):
        assert np.abs(recorder.mels[i] - golden[f"{case}__c{i}__hift_mel_in"]).max() <= MEL_ATOL
        cached = golden[f"{case}__c{i}__hift_cache_source_in"]
        if cached.size:
            assert np.abs(recorder.sources[i][:, :, :cached.shape[2]] - cached).max() <= CHUNK_ATOL
        ref = golden[f"{case}__c{i}__emitted"][0]
        assert chunk.shape == ref.shape
        assert np.abs(chunk - ref).max() <= CHUNK_ATOL or _snr(ref, chunk) > SNR_DB
    joined, ref = np.concatenate(chunks), golden[f"{case}__emitted_concat"][0]
    assert joined.shape == ref.shape and _snr(ref, joined) > SNR_DB


def test_concurrent_streams_keep_their_own_schedule(engine: Engine, vectors: dict) -> None:
    """Two requests streaming at once each get their first chunk after their own first hop (25 + pad + 3)."""
    pipeline = engine.pipeline
    tokens = vectors["stream"]["stream_zero_shot__tokens"].reshape(-1).tolist()
    expected_first = {ZH_VOICE: 25 + 13 + 3, SFT_VOICE: 25 + 0 + 3}
    alone = {v: list(pipeline.stream_tokens(tokens, engine.options(voice=v, deterministic=True)))
             for v in expected_first}
    start = threading.Barrier(2)
    results: dict[str, tuple[int, list[np.ndarray]]] = {}
    errors: list[BaseException] = []

    def worker(voice: str) -> None:
        try:
            seen, first, chunks = [0], None, []
            start.wait(timeout=30)
            request = engine.options(voice=voice, deterministic=True)
            for chunk in pipeline.stream_tokens(_counted(tokens, seen), request):
                first = seen[0] if first is None else first
                chunks.append(chunk)
            results[voice] = (first, chunks)
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(v,)) for v in expected_first]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    for voice, first in expected_first.items():
        got_first, chunks = results[voice]
        assert got_first == first
        assert len(chunks) == len(alone[voice])
        for a, b in zip(chunks, alone[voice]):
            np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)


def test_concurrent_renders_share_nothing(engine: Engine) -> None:
    """Requests rendered at once from several threads (greedy and seeded sampling, KV caches bound per call)
    give exactly what each gives alone."""
    jobs = [("你好，世界！", {"voice": SFT_VOICE, "sampling": "greedy", "deterministic": True}),
            ("收到好友从远方寄来的生日礼物。", {"voice": ZH_VOICE, "seed": 5}),
            ("Good morning, my friend.", {"voice": ZH_VOICE, "mode": "cross_lingual", "seed": 6})]
    alone = [engine.synthesize_waveform(text, **options) for text, options in jobs]
    together = run_together(jobs, lambda text, options: engine.synthesize_waveform(text, **options), 120)
    for a, b in zip(alone, together):
        assert a.shape == b.shape
        np.testing.assert_allclose(b, a, rtol=0, atol=1e-6)


def test_stream_with_the_llm_interleaves_and_equals_token_streaming(engine: Engine, vectors: dict) -> None:
    """sft0 (36 greedy tokens): the first chunk comes after 28 tokens, the rest at the end; same audio as feeding
    the same tokens to the chunker, and close to the non-streaming golden."""
    pipeline = engine.pipeline
    request = engine.options(voice=SFT_VOICE, sampling="greedy", deterministic=True)
    (segment,) = engine.segments("你好，世界！")
    chunks = list(pipeline.stream(segment, request))
    tokens = vectors["llm"]["sft0_s0__greedy_tokens"].tolist()
    direct = list(pipeline.stream_tokens(tokens, request))
    assert [len(c) for c in chunks] == [len(c) for c in direct] and len(chunks) == 2
    assert len(chunks[0]) == 2 * 25 * 480 - 3840
    np.testing.assert_allclose(np.concatenate(chunks), np.concatenate(direct), rtol=0, atol=1e-6)
    via_engine = np.concatenate(list(engine.stream("你好，世界！", voice=SFT_VOICE, sampling="greedy",
                                                   deterministic=True)))
    np.testing.assert_allclose(via_engine, np.concatenate(chunks), rtol=0, atol=1e-6)


def test_stream_with_speed_renders_the_segment_whole(engine: Engine, vectors: dict) -> None:
    chunks = list(engine.stream("收到好友从远方寄来的生日礼物。", voice=ZH_VOICE, speed=1.5, sampling="greedy",
                                deterministic=True))
    golden = vectors["e2e"]["zero_shot0_speed1.5_s0__tts_speech"][0]
    assert len(chunks) == 1 and chunks[0].shape == golden.shape and _snr(golden, chunks[0]) > SNR_DB


# ------------------------------------------------------------------------------------------------ sampling

def test_sampled_requests_are_seeded_and_private(engine: Engine) -> None:
    text = "Good morning, my friend."
    first = engine.synthesize_waveform(text, voice=ZH_VOICE, seed=11)
    again = engine.synthesize_waveform(text, voice=ZH_VOICE, seed=11)
    other = engine.synthesize_waveform(text, voice=ZH_VOICE, seed=12)
    assert np.array_equal(first, again)
    assert first.shape != other.shape or not np.array_equal(first, other)
    (segment,) = engine.segments(text)
    req = engine.options(voice=ZH_VOICE, seed=11, deterministic=True)
    tokens = engine.pipeline.speech_tokens(segment, req)
    assert tokens == engine.pipeline.speech_tokens(segment, req)
    _, max_len = engine.pipeline._lm.config.min_max_len(len(segment.ids))
    assert 0 < len(tokens) <= max_len and all(0 <= t < 6561 for t in tokens)


# ------------------------------------------------------------------------------------------------ requests

def test_modes_and_voices_are_checked_up_front(engine: Engine) -> None:
    assert engine.voices() == [ZH_VOICE, "tiny_spk_en", SFT_VOICE]   # spk2info order
    assert engine.options().voice == ZH_VOICE and engine.options().mode is None
    assert engine.options(voice=ZH_VOICE, instruct_text="用四川话说这句话").instruct_text == "用四川话说这句话"
    for bad in ({"voice": ZH_VOICE, "mode": "sft"}, {"voice": SFT_VOICE, "mode": "zero_shot"},
                {"voice": SFT_VOICE, "mode": "cross_lingual"}, {"voice": ZH_VOICE, "mode": "instruct2"},
                {"voice": ZH_VOICE, "mode": "zero_shot", "instruct_text": INSTRUCT},
                {"voice": ZH_VOICE, "mode": "whisper"}):
        with pytest.raises(InputError):
            engine.options(**bad)
    with pytest.raises(InputError):
        engine.segments("。。。")
    assert SynthesisOptions(voice="x").mode is None and SynthesisOptions(voice="x").instruct_text is None


def test_instruct_marker_is_added_when_missing(engine: Engine) -> None:
    plain = engine.pipeline._mode_inputs(engine.options(voice=ZH_VOICE, instruct_text="用四川话说这句话"))
    marked = engine.pipeline._mode_inputs(engine.options(voice=ZH_VOICE, instruct_text=INSTRUCT))
    assert plain.prompt_text == marked.prompt_text and len(marked.prompt_text) == 5 and not marked.prompt_speech


def test_describe(engine: Engine) -> None:
    info = engine.pipeline.describe()
    assert info["family"] == "cosyvoice2" and set(info["precision"].values()) == {"fp32"}
    assert info["stream"]["hops"] == (25, 50, 100) and info["voices"] == 3


# ------------------------------------------------------------------------------------------------ voices

def test_voice_from_prompt_audio_matches_the_release_entry(engine: Engine, vectors: dict, golden_dir: Path,
                                                           tmp_path: Path) -> None:
    """The prompt recording of the goldens gives the spk2info entry `tiny_spk_zh` (tokens exact, mel 1e-4, CAM++
    embedding 1e-3) and, registered, the zero_shot0 golden waveform; the voice file round-trips."""
    import soundfile

    from cosyedge.device.cosyvoice2.voices import Voice
    pipeline = engine.pipeline
    wav, sr = soundfile.read(golden_dir / "audio" / "zero_shot_prompt.wav", dtype="float32")
    voice = pipeline.make_voice("my_voice", wav, sr, "希望你以后能够做的比我还好呦。")
    ref = pipeline._voices[ZH_VOICE]
    assert voice.prompt_text_ids == ref.prompt_text_ids and voice.prompt_text == ref.prompt_text
    assert voice.llm_prompt_speech == ref.llm_prompt_speech
    assert np.array_equal(voice.flow_prompt_speech, ref.flow_prompt_speech)
    assert np.abs(voice.prompt_mel - ref.prompt_mel).max() <= MEL_ATOL
    assert np.abs(voice.flow_embedding - ref.flow_embedding).max() <= 1e-3
    voice.save(tmp_path / "my_voice.npz")
    loaded = Voice.load("my_voice", tmp_path / "my_voice.npz")
    assert loaded.prompt_text == voice.prompt_text and np.array_equal(loaded.prompt_mel, voice.prompt_mel)
    pipeline.add_voice(loaded)
    try:
        out = engine.synthesize_waveform("收到好友从远方寄来的生日礼物。", voice="my_voice", sampling="greedy",
                                      deterministic=True)
        golden = vectors["e2e"]["zero_shot0_s0__tts_speech"][0]
        assert out.shape == golden.shape and _snr(golden, out) > SNR_DB
    finally:
        pipeline._voices = {k: v for k, v in pipeline._voices.items() if k != "my_voice"}
    with pytest.raises(InputError):
        pipeline.add_voice(Voice.load(ZH_VOICE, tmp_path / "my_voice.npz"))
    with pytest.raises(InputError):
        pipeline.make_voice("bad name/", wav, sr, "text")


# ------------------------------------------------------------------------------------------------ no torch

def test_pipeline_runs_without_torch(cv2_bundle: Path, vectors: dict, golden_dir: Path, tmp_path: Path,
                                     torch_blocked_env: dict[str, str]) -> None:
    out = tmp_path / "speech.npy"
    code = (
        "import sys, numpy as np\n"
        "from cosyedge.device.engine import Engine\n"
        "from device.sessions import SessionConfig\n"
        f"e = Engine.load({str(cv2_bundle)!r}, precision='fp32', sessions=SessionConfig(providers=('cpu',), "
        "intra_op_threads=1))\n"
        "wave = e.synthesize_waveform('你好，世界！', voice='tiny_sft_spk', sampling='greedy', deterministic=True)\n"
        "chunks = list(e.stream('Hello there, this is streaming.', voice='tiny_spk_en', seed=3))\n"
        "import soundfile\n"
        f"wav, sr = soundfile.read({str(golden_dir / 'audio' / 'zero_shot_prompt.wav')!r}, dtype='float32')\n"
        "assert len(e.pipeline.make_voice('v', wav, sr, 'Hello.').llm_prompt_speech) == 87\n"
        f"np.save({str(out)!r}, wave)\n"
        "assert chunks and 'torch' not in sys.modules\n"
        "print('ok')\n"
    )
    env = {**torch_blocked_env, "COSYEDGE_HOME": str(tmp_path / "home")}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().endswith("ok")
    golden = vectors["e2e"]["sft0_s0__tts_speech"][0]
    assert _snr(golden, np.load(out)) > SNR_DB


def test_a_bundle_with_the_old_two_llm_graphs_is_refused_with_a_rebuild_hint(cv2_tiny_bundle: Path, tmp_path: Path):
    """A bundle written before the one `llm` graph (components llm_prefill / llm_decode): one line naming the missing
    graph and the fix, exit 2, no traceback."""
    import shutil
    old = tmp_path / "old"
    shutil.copytree(cv2_tiny_bundle, old)
    manifest = json.loads((old / "manifest.json").read_text())
    for component in manifest["components"]:
        if component["name"] == "llm":
            component["name"] = "llm_decode"
    (old / "manifest.json").write_text(json.dumps(manifest))
    result = subprocess.run([sys.executable, "-m", "cosyedge.device.cli", "synth", "你好。", "--bundle", str(old),
                             "--out", str(tmp_path / "x.wav")], capture_output=True, text=True, timeout=300)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "has no graph 'llm'" in result.stderr and "re-create it with cosyedge quantize" in result.stderr


@contextlib.contextmanager
def _decoded_widths(vocoder):
    """The mel width of each HiFT decoder call `vocoder` makes meanwhile."""
    widths: list[int] = []
    decode = vocoder.decode

    def counted(mel: np.ndarray, source: np.ndarray) -> np.ndarray:
        widths.append(mel.shape[2])
        return decode(mel, source)

    vocoder.decode = counted
    try:
        yield widths
    finally:
        del vocoder.decode


def test_a_long_mel_is_vocoded_in_windows_with_the_samples_of_one_call(engine: Engine) -> None:
    """Past WINDOW_FRAMES the stream-off HiFT decodes window by window (bounded memory): 700 frames (14 s) go in
    equal windows, none wider than the window and its context, and the samples equal one whole decoder call's."""
    vocoder = engine.pipeline._vocoder
    frames = 700
    assert frames > 2 * WINDOW_FRAMES
    mel = (np.random.default_rng(0).standard_normal((1, 80, frames)) * 2 - 6).astype(np.float32)
    whole = vocoder.decode(mel, vocoder.source(mel, None))[0]
    with _decoded_widths(vocoder) as widths:
        windowed = vocoder.render(mel, None)
    assert len(widths) == -(-frames // WINDOW_FRAMES) and max(widths) <= WINDOW_FRAMES + 2 * CONTEXT_FRAMES, widths
    assert windowed.shape == whole.shape and np.abs(whole).max() > 0
    np.testing.assert_array_equal(windowed, whole)


def test_a_long_stream_chunk_is_vocoded_in_windows_and_keeps_no_graph_output(engine: Engine) -> None:
    """A stream chunk past WINDOW_FRAMES (official hops grow: a 10 s stream's last chunk is ~200 frames) is decoded
    in windows like a whole mel, with the samples of one call per chunk (the official runtime's, which the bench's
    reference keeps: `windows_of` None); and the stream's caches between chunks are copies, never views of a graph's
    output, which would hold that output's whole arena region (device/sessions.py) until the request ends."""
    vocoder = engine.pipeline._vocoder
    frames = 2 * WINDOW_FRAMES + 40
    mels = (np.random.default_rng(1).standard_normal((1, 80, frames)) * 2 - 6).astype(np.float32)
    cut = WINDOW_FRAMES // 2
    with _decoded_widths(vocoder) as widths:
        windowed = vocoder.stream(None)
        first = windowed.chunk(mels[:, :, :cut], final=False)
        caches = (windowed._mel, windowed._source, windowed._speech)
        second = windowed.chunk(mels[:, :, cut:], final=True)
        calls = len(widths)
        one_call = VocoderStream(vocoder, vocoder.cache, None)
        want = [one_call.chunk(mels[:, :, :cut], final=False), one_call.chunk(mels[:, :, cut:], final=True)]
    assert calls > 2 and max(widths[:calls]) <= WINDOW_FRAMES + 2 * CONTEXT_FRAMES, widths
    assert widths[calls + 1] > WINDOW_FRAMES  # the one-call stream's second chunk went in one call
    np.testing.assert_array_equal(first, want[0])
    np.testing.assert_array_equal(second, want[1])
    assert all(cache is not None and cache.flags.owndata for cache in caches)
