"""synth-batch with lines in flight (issue 22): N lines in the engine at once through its door write the same files
as one at a time, a failing line is dead-lettered while the others finish, a chapter as one line is written with
bounded memory, and 24 kHz WAV comes out of every family. (A job SIGKILLed mid-run, lines in flight by default:
tests/device/test_cli.py.)"""
from __future__ import annotations

import json
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from cosyedge.device import request
from cosyedge.device.audio import Crossfade
from cosyedge.device.engine import Engine
from cosyedge.device.door import Door
from cosyedge.device.jobs import DEAD_LETTER, JOIN_S, Line, place, render_bytes, run_job, windows
from cosyedge.device.sessions import SessionConfig

ENGLISH = [Line("intro", "One small line. And a second sentence after it."), Line("b", "Two small lines."),
           Line("c", "Three small lines! Really? Yes, really."), Line("d", "Four."),
           Line("e", "The fifth line is a little longer than the others, with a clause."), Line("f", "Six.")]


def _job(engine: Engine, **values) -> request.Request:
    return request.parse(values, request.SYNTH_BATCH, engine)


def _files(out: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(out.iterdir()) if path.name != DEAD_LETTER}


def test_in_flight_writes_the_files_of_one_at_a_time_on_the_default_voice(default_engine, tmp_path):
    job = _job(default_engine, deterministic=True)
    one = run_job(default_engine, ENGLISH, tmp_path / "one", job, progress=False, in_flight=1)
    many = run_job(default_engine, ENGLISH, tmp_path / "many", job, progress=False, in_flight=4)
    assert one["done"] == many["done"] == len(ENGLISH) and many["in_flight"] == 4
    assert sorted(_files(tmp_path / "many")) == sorted(f"{line.key}.wav" for line in ENGLISH)  # ids stable
    assert _files(tmp_path / "many") == _files(tmp_path / "one")
    assert many["audio_s_per_s"] > 0 and many["rtf"] == pytest.approx(many["wall_s"] / many["audio_s"], rel=0.05)


@pytest.mark.parametrize("fmt", ["wav", "mp3"])
def test_a_line_rendered_to_bytes_and_placed_is_the_local_job_s_file(default_engine, tmp_path, fmt):
    """What a Ray actor runs (`render_bytes`: the job's one renderer into a scratch directory, read back) and the
    driver's write (`place`: subtitles, then audio, each renamed into place) make the local job's files."""
    job, lines = _job(default_engine, deterministic=True, format=fmt), ENGLISH[:2]
    local = run_job(default_engine, lines, tmp_path / "local", job, progress=False, in_flight=1, subtitles="vtt")
    out = tmp_path / "placed"
    out.mkdir()
    with Door(default_engine) as door:
        seconds = sum(place(out / f"{line.key}.{fmt}", render_bytes(default_engine, door, line, job, "vtt"), "vtt")
                      for line in lines)
    assert seconds == pytest.approx(local["audio_s"], abs=0.01)
    assert sorted(p.name for p in out.iterdir()) == sorted(f"{line.key}.{x}" for line in lines for x in (fmt, "vtt"))
    assert _files(out) == _files(tmp_path / "local")


@pytest.fixture(scope="module")
def cv2_engine(cv2_tiny_bundle: Path, tmp_path_factory: pytest.TempPathFactory) -> Engine:
    return Engine.load(cv2_tiny_bundle, precision="fp32", warmup=False, state_dir=tmp_path_factory.mktemp("batch"),
                       sessions=SessionConfig(providers=("cpu",), intra_op_threads=1))


def test_in_flight_writes_the_files_of_one_at_a_time_on_tiny_cosyvoice2(cv2_engine, tmp_path):
    lines = [Line("a", "你好。"), Line("b", "收到好友从远方寄来的生日礼物。"), Line("c", "今天天气很好。"),
             Line("d", "谢谢。")]
    job = _job(cv2_engine, voice="tiny_spk_zh", sampling="greedy", deterministic=True)
    steps = cv2_engine.decode_occupancy()
    one = run_job(cv2_engine, lines, tmp_path / "one", job, progress=False, in_flight=1)
    alone, steps = _steps_since(cv2_engine, steps), cv2_engine.decode_occupancy()
    many = run_job(cv2_engine, lines, tmp_path / "many", job, progress=False, in_flight=4)
    shared = _steps_since(cv2_engine, steps)
    assert one["done"] == many["done"] == len(lines)
    assert set(alone) == {1} and max(shared) > 1  # one at a time, one row per step; in flight, lines shared steps
    assert _files(tmp_path / "many") == _files(tmp_path / "one")


def _steps_since(engine: Engine, before: dict[int, int]) -> dict[int, int]:
    """Decode steps run since `before`, by rows decoded together."""
    return {rows: n - before.get(rows, 0) for rows, n in engine.decode_occupancy().items() if n > before.get(rows, 0)}


@pytest.mark.parametrize("family", ["default", "cosyvoice2"])
def test_24_khz_wav_from_every_family(family, default_engine, cv2_engine, tmp_path):
    engine, values = ((default_engine, {}) if family == "default" else
                      (cv2_engine, {"voice": "tiny_spk_zh", "sampling": "greedy"}))
    text = "Hello there. A second sentence." if family == "default" else "你好。"
    native = run_job(engine, [Line("a", text)], tmp_path / "native", _job(engine, deterministic=True, **values),
                     progress=False, in_flight=1)
    out = tmp_path / "24k"
    summary = run_job(engine, [Line("a", text)], out, _job(engine, deterministic=True, sample_rate=24000,
                                                           format="wav", **values), progress=False, in_flight=2)
    assert summary["done"] == 1
    info = sf.info(str(out / "a.wav"))
    assert info.samplerate == 24000 and info.subtype == "PCM_16"
    assert info.duration == pytest.approx(native["audio_s"], abs=0.01)  # the same audio, resampled


def test_a_failing_line_is_dead_lettered_while_the_others_finish(default_engine, tmp_path):
    lines = [*ENGLISH[:3], Line("emoji", "🙂🙂🙂"), Line("x" * 300, "An id too long to name a file."), *ENGLISH[3:]]
    summary = run_job(default_engine, lines, tmp_path, _job(default_engine), progress=False, in_flight=3)
    assert summary == {**summary, "done": len(ENGLISH), "failed": 2}
    dead = [json.loads(line) for line in (tmp_path / DEAD_LETTER).read_text().splitlines()]
    assert sorted(d["id"] for d in dead) == sorted(["emoji", "x" * 300]) and all(d["error"] for d in dead)
    assert sorted(_files(tmp_path)) == sorted(f"{line.key}.wav" for line in ENGLISH)
    assert not list(tmp_path.glob(".*partial"))


def test_a_chapter_as_one_line_is_written_in_bounded_memory(default_engine, tmp_path):
    """200 sentences in one line (several minutes of audio, over 10 MB as float32 at once): rendered window by
    window, sentence by sentence, and written as it comes; the Python heap (numpy's buffers included) never holds
    more than a few sentences, and the audio is as long as its sentences."""
    five = ["The cat sat down.", "It was late at night.", "Rain fell on the roof.", "Nobody spoke.",
            "Then the lights went out."]
    chapter = " ".join(five * 40)
    assert len(chapter) > 2 * default_engine.limits.max_text_len  # over the per-request bound: several windows
    job = _job(default_engine, deterministic=True)
    sample = run_job(default_engine, [Line("sample", " ".join(five))], tmp_path / "s", job, progress=False,
                     in_flight=1)
    tracemalloc.start()
    try:
        summary = run_job(default_engine, [Line("chapter", chapter)], tmp_path / "c", job, progress=False,
                          in_flight=2)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert summary["done"] == 1, (tmp_path / "c" / DEAD_LETTER).read_text()
    info = sf.info(str(tmp_path / "c" / "chapter.wav"))
    whole = info.frames * 4  # the chapter as one float32 waveform
    assert whole > 10 << 20
    assert peak < min(4 << 20, whole / 4), f"peak {peak / 2**20:.1f} MiB traced for {whole / 2**20:.1f} MiB of audio"
    assert info.duration == pytest.approx(summary["audio_s"], abs=0.01)
    joins = 199 - 40 * 4  # the chapter's joins beyond forty samples' own, JOIN_S shorter each
    assert info.duration == pytest.approx(40 * sample["audio_s"] - joins * JOIN_S, rel=0.02)


def test_windows_cut_a_long_line_at_sentence_ends_within_the_bound():
    text = "Short one. " * 50 + "Last!"
    pieces = list(windows(text, 100))
    assert "".join(pieces) == text and all(len(p) <= 100 for p in pieces) and len(pieces) > 5
    assert all(p.rstrip().endswith((".", "!")) for p in pieces)
    assert list(windows("Within the bound. Kept whole.", 100)) == ["Within the bound. Kept whole."]
    assert "".join(windows("收到了。" * 40, 50)) == "收到了。" * 40


def test_sentences_meet_in_an_equal_power_crossfade():
    overlap = round(JOIN_S * 22050)
    join = Crossfade(overlap)
    a, b = np.ones(1000, np.float32), np.ones(800, np.float32)
    out = np.concatenate([join(a), join(b), join.flush()])
    assert out.size == a.size + b.size - overlap  # one overlap per join
    middle = out[a.size - overlap:a.size]
    angle = (np.arange(overlap) + 0.5) * (np.pi / 2 / overlap)
    np.testing.assert_allclose(middle, np.cos(angle) + np.sin(angle), rtol=1e-6)  # gains with cos^2 + sin^2 = 1
    np.testing.assert_array_equal(out[:a.size - overlap], 1.0)
    np.testing.assert_array_equal(out[a.size:], 1.0)


def _cue_words(path: Path) -> list[tuple[str, float, float]]:
    """(text, start, end) of each cue of a WebVTT file, parsed back by webvtt-py."""
    import io

    import webvtt
    return [(c.text.replace("\n", " "), c.start_in_seconds + c.start_time.milliseconds / 1000,
             c.end_in_seconds + c.end_time.milliseconds / 1000)
            for c in webvtt.WebVTT.from_buffer(io.StringIO(path.read_text()), strict=True).captions]


def test_subtitles_beside_each_line_on_the_line_s_clock_and_resumed_with_it(default_engine, tmp_path):
    """`--subtitles vtt`: `<id>.vtt` beside each audio file, the words in order, the cues inside the audio and the
    last ending with it (24 kHz: the joins and the resampling moved); a line whose subtitle file is gone is made
    again, the others are skipped; the audio is the same as without subtitles."""
    lines = ENGLISH[:3]
    job = _job(default_engine, deterministic=True, sample_rate=24000)
    plain = run_job(default_engine, lines, tmp_path / "plain", job, progress=False, in_flight=2)
    timed = run_job(default_engine, lines, tmp_path / "timed", job, progress=False, in_flight=2, subtitles="vtt")
    assert plain["done"] == timed["done"] == 3
    files = _files(tmp_path / "timed")
    assert {name: data for name, data in files.items() if name.endswith(".wav")} == _files(tmp_path / "plain")
    for line in lines:
        cues = _cue_words(tmp_path / "timed" / f"{line.key}.vtt")
        audio, rate = sf.read(tmp_path / "timed" / f"{line.key}.wav")
        assert " ".join(text for text, _, _ in cues).split() == line.text.split()
        assert all(a[2] <= b[1] for a, b in zip(cues, cues[1:])) and cues[0][1] >= 0
        assert rate == 24000 and abs(cues[-1][2] - len(audio) / rate) < 0.002
    (tmp_path / "timed" / "b.vtt").unlink()
    again = run_job(default_engine, lines, tmp_path / "timed", job, progress=False, subtitles="vtt")
    assert (again["done"], again["skipped"]) == (1, 2) and (tmp_path / "timed" / "b.vtt").is_file()


def test_a_sentence_s_words_move_with_the_joins(default_engine, tmp_path):
    """Sentences meet in a 10 ms crossfade, so the k-th sentence's words come k x 10 ms earlier in the line than
    in the engine's own render of the whole text (no joins there); the first sentence's are the engine's."""
    text = "One small line. And a second sentence after it. Then a third one."
    run_job(default_engine, [Line("a", text)], tmp_path, _job(default_engine, deterministic=True), progress=False,
            subtitles="srt")
    import srt
    said = [c for c in srt.parse((tmp_path / "a.srt").read_text())]
    _, words = default_engine.synthesize_words(text, deterministic=True)
    sentence_starts = [w.start_s for w in words if w.text in ("One", "And", "Then")]
    starts = [c.start.total_seconds() for c in said]
    assert len(said) == 3 and [c.content for c in said] == ["One small line.", "And a second sentence after it.",
                                                             "Then a third one."]
    for k, (got, engine_start) in enumerate(zip(starts, sentence_starts)):
        assert got == pytest.approx(engine_start - k * JOIN_S, abs=0.0015), k
