"""The `cosyedge` command line, run as a user runs it (a subprocess), on the real default voice."""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import pytest
import soundfile as sf

from cosyedge.device.jobs import DEAD_LETTER


def cosyedge(*args: str, env_home: Path, stdin: str | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "COSYEDGE_HOME": str(env_home), "COSYEDGE_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "cosyedge.device.cli", *args], input=stdin, capture_output=True, text=True,
                          env=env, timeout=timeout)


@pytest.fixture(scope="module")
def home(default_bundle_path: Path) -> Path:
    return default_bundle_path.parents[1]


def test_synth_writes_speech_whose_length_grows_with_text(home, tmp_path):
    short, long = tmp_path / "short.wav", tmp_path / "long.wav"
    assert cosyedge("synth", "Hello.", "-o", str(short), "--deterministic", env_home=home).returncode == 0
    result = cosyedge("synth", "-", "-o", str(long), "--deterministic", env_home=home,
                      stdin="Hello. This text is read from standard input and is much longer.")
    assert result.returncode == 0, result.stderr
    a, rate = sf.read(short)
    b, _ = sf.read(long)
    assert rate == 22050 and len(b) > 3 * len(a) and abs(b).max() > 0.05


@pytest.mark.parametrize("fmt", ["mp3", "flac", "opus"])
def test_synth_formats_and_sample_rate(home, tmp_path, fmt):
    out = tmp_path / f"x.{fmt}"
    result = cosyedge("synth", "Format check.", "-o", str(out), "--sample-rate", "24000", env_home=home)
    assert result.returncode == 0, result.stderr
    from pydub import AudioSegment
    decoded = AudioSegment.from_file(out, format="ogg" if fmt == "opus" else fmt)
    assert decoded.duration_seconds > 0.4
    assert decoded.frame_rate in (24000, 48000)  # opus decoders report 48 kHz


SUBTITLED = "Hello there, this is a subtitle check. It has two sentences, and 42 words maybe."


def test_synth_subtitles_are_the_engine_s_words_on_the_audio_s_clock(home, tmp_path, default_engine):
    """`synth --subtitles x.vtt` at another sample rate: the same audio as without it, a WebVTT file whose cues
    hold the engine's words in order (`Engine.synthesize_words`, checked against piper-tts elsewhere), the first
    cue starting with the first word and the last ending with the audio (within one sample of its rate)."""
    import io

    import webvtt
    plain, timed, vtt = tmp_path / "plain.wav", tmp_path / "timed.wav", tmp_path / "timed.vtt"
    common = ["--deterministic", "--sample-rate", "16000"]
    assert cosyedge("synth", SUBTITLED, "-o", str(plain), *common, env_home=home).returncode == 0
    result = cosyedge("synth", SUBTITLED, "-o", str(timed), "--subtitles", str(vtt), *common, env_home=home)
    assert result.returncode == 0, result.stderr
    assert timed.read_bytes() == plain.read_bytes()
    _, words = default_engine.synthesize_words(SUBTITLED, sample_rate=16000, deterministic=True)
    captions = webvtt.WebVTT.from_buffer(io.StringIO(vtt.read_text()), strict=True).captions
    assert " ".join(c.text.replace("\n", " ") for c in captions).split() == [w.text for w in words]
    assert abs(captions[0].start_in_seconds + captions[0].start_time.milliseconds / 1000 - words[0].start_s) < 0.002
    audio, rate = sf.read(timed)
    last = captions[-1]
    assert rate == 16000 and abs(last.end_in_seconds + last.end_time.milliseconds / 1000 - len(audio) / rate) < 0.002


def test_synth_subtitles_on_cosyvoice_are_valid_srt(tmp_path, cv2_tiny_bundle):
    """The tiny CosyVoice2 bundle: an SRT file (parsed by the `srt` library) whose words are the text's, in order,
    inside the audio."""
    import srt
    out, subs = tmp_path / "zh.wav", tmp_path / "zh.srt"
    result = cosyedge("synth", "收到好友从远方寄来的生日礼物。", "-o", str(out), "--subtitles", str(subs), "--bundle",
                      str(cv2_tiny_bundle), "--voice", "tiny_spk_zh", "--sampling", "greedy", "--deterministic",
                      env_home=tmp_path)
    assert result.returncode == 0, result.stderr
    cues = list(srt.parse(subs.read_text()))
    audio, rate = sf.read(out)
    assert cues and "".join(c.content.replace("\n", "") for c in cues) == "收到好友从远方寄来的生日礼物。"
    assert all(a.end <= b.start for a, b in zip(cues, cues[1:]))
    assert abs(cues[-1].end.total_seconds() - len(audio) / rate) < 0.002


@pytest.mark.parametrize("args, message", [
    (["synth", "", "-o", "{tmp}/x.wav"], "text is empty"),
    (["synth", "hi", "-o", "{tmp}/missing/x.wav"], "output directory 'missing' does not exist"),
    (["synth", "hi", "-o", "{tmp}/x.wav", "--speed", "9"], "speed 9.0 is out of range"),
    (["synth", "hi", "-o", "{tmp}/x.wav", "--voice", "nobody"], "unknown voice 'nobody'"),
    (["synth", "hi", "-o", "{tmp}/x.wav", "--voice", "²"], "unknown voice '²'"),  # a digit, but not a speaker id
    (["synth", "hi", "-o", "{tmp}/x.xyz"], "unknown audio format 'xyz'"),
    (["synth", "😀", "-o", "{tmp}/x.wav"], "nothing speakable"),
    (["synth", "hi", "-o", "{tmp}/x.wav", "--bundle", "{tmp}"], "has no manifest.json"),
    (["info", "{tmp}/nothing"], "'nothing' not found"),
    (["synth", "hi", "-o", "{tmp}/x.wav", "--target", "cpu"], "has no 'cpu' graphs"),
    (["synth", "hi", "-o", "{tmp}/x.wav", "--precision", "cpu"], "invalid choice: 'cpu'"),
    (["synth", "hi", "-o", "{tmp}/x.wav", "--subtitles", "{tmp}/x.txt"], "name it .vtt or .srt"),
    (["synth", "hi", "-o", "{tmp}/x.wav", "--subtitles", "{tmp}/missing/x.vtt"], "output directory 'missing'"),
])
def test_cli_errors_are_one_clear_line(home, tmp_path, args, message):
    result = cosyedge(*[a.format(tmp=tmp_path) for a in args], env_home=home)
    assert result.returncode == 2
    assert message in result.stderr
    assert "Traceback" not in result.stderr and str(tmp_path) not in result.stderr


def test_unwritable_output(home):
    """/proc takes no new files, for root too (root ignores permission bits, so a chmod'ed folder proves nothing)."""
    result = cosyedge("synth", "hi", "-o", "/proc/cosyedge-test.wav", env_home=home)
    assert result.returncode == 2, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr
    assert "cosyedge-test.wav" in result.stderr


@pytest.mark.parametrize("threads", ["abc", "-1", "1e9", "99999999"])
def test_bad_thread_count_is_one_line(home, tmp_path, threads):
    result = subprocess.run([sys.executable, "-m", "cosyedge.device.cli", "synth", "hi", "-o", str(tmp_path / "x.wav")],
                            capture_output=True, text=True, timeout=300,
                            env={**os.environ, "COSYEDGE_HOME": str(home), "COSYEDGE_THREADS": threads})
    assert result.returncode == 2 and "COSYEDGE_THREADS must be a whole number" in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_voices_and_info(home, default_bundle_path):
    voices = cosyedge("voices", env_home=home)
    assert voices.returncode == 0 and voices.stdout.strip() == "0\tjoe"
    info = cosyedge("info", str(default_bundle_path), "--verify", env_home=home)
    assert info.returncode == 0
    data = json.loads(info.stdout)
    assert data["family"] == "vits" and data["verified"] is True


def _lines(n: int) -> str:
    words = ["alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel"]
    return "\n".join(f"Line {i}: {words[i % 8]} and {words[(i * 3) % 8]} are here." for i in range(1, n + 1)) + "\n"


def test_synth_batch_resumes_after_kill_and_dead_letters_bad_lines(home, tmp_path):
    source = tmp_path / "book.txt"
    lines = _lines(50).splitlines()
    lines[9] = "😀 🎉"  # line 10 has nothing to say: it must land in the dead-letter file
    source.write_text("\n".join(lines) + "\n")
    out = tmp_path / "out"
    env = {**os.environ, "COSYEDGE_HOME": str(home), "COSYEDGE_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "cosyedge.device.cli", "synth-batch", str(source), "--out-dir", str(out)],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and len(list(out.glob("*.wav"))) < 20 and proc.poll() is None:
        time.sleep(0.2)
    assert proc.poll() is None, "the job ended before it could be killed: the test would prove nothing"
    proc.send_signal(signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL  # really killed, not finished
    first = {p.name: p.stat().st_mtime_ns for p in out.glob("*.wav")}
    assert 0 < len(first) < 49, "the job should have been killed halfway"

    result = cosyedge("synth-batch", str(source), "--out-dir", str(out), env_home=home)
    assert result.returncode == 1  # one line failed
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["total"] == 50 and summary["failed"] == 1
    assert summary["skipped"] == len(first) and summary["done"] == 50 - 1 - len(first)
    assert "50/50" in result.stderr  # the progress bar reached the end
    done = sorted(out.glob("*.wav"))
    assert len(done) == 49 and not list(out.glob(".*.partial"))
    for path in done:
        assert sf.info(str(path)).frames > 0
        if path.name in first:
            assert path.stat().st_mtime_ns == first[path.name], f"{path.name} was redone"
    dead = [json.loads(x) for x in (out / DEAD_LETTER).read_text().splitlines()]
    # Each attempt is recorded: the first run may have reached line 10 before it was killed.
    assert {d["id"] for d in dead} == {"000010"} and len(dead) in (1, 2)
    assert "nothing speakable" in dead[-1]["error"] and dead[-1]["text"] == "😀 🎉" and dead[-1]["time"]


def test_synth_batch_csv_with_sample_rate(home, tmp_path):
    source = tmp_path / "lines.csv"
    source.write_text("id,text\nintro,Welcome to the show.\noutro,\"Goodbye, and thanks.\"\n")
    result = cosyedge("synth-batch", str(source), "--out-dir", str(tmp_path / "o"), "--sample-rate", "24000",
                      "--quiet", env_home=home)
    assert result.returncode == 0, result.stderr
    for key in ("intro", "outro"):
        info = sf.info(str(tmp_path / "o" / f"{key}.wav"))
        assert info.samplerate == 24000 and info.frames > 10000


def test_bench_reports_precisions_and_peer_side_by_side(home, tmp_path):
    report_path = tmp_path / "bench.json"
    other = f"{home / 'bundles' / 'default-joe'}:int8"  # --compare: another bundle (here: the same one) interleaved
    result = cosyedge("bench", "--rounds", "1", "--threads", "1", "--precisions", "fp32", "--compare", other,
                      "--json", str(report_path), env_home=home)
    assert result.returncode == 0, result.stderr
    report = json.loads(report_path.read_text())
    assert set(report["results"]) == {"cosyedge-fp32", other, "cosyedge-fp32+words", "piper-tts"}
    for row in report["results"].values():
        assert row["rtf"] > 0 and len(row["sentences"]) == 5
    words = report["word_times"]
    assert words["runner"] == "cosyedge-fp32+words" and words["mapping_ms_per_sentence"] > 0  # a cost, not a figure
    assert "TOTAL RTF" in result.stdout and "word times: cosyedge-fp32+words RTF" in result.stdout


def _parsers(parser: argparse.ArgumentParser) -> Iterator[argparse.ArgumentParser]:
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                yield from _parsers(child)


def test_every_command_has_a_help_page():
    """`--help` of every command and subcommand renders (a stray % in a help text made `cosyedge bench --help` a
    traceback)."""
    from cosyedge.device.cli import build_parser
    pages = [p.format_help() for p in _parsers(build_parser())]
    assert len(pages) > 10 and all("usage:" in page for page in pages)


def test_every_target_flag_offers_every_build_target():
    """`--target` of every command that checks it takes the bundle's whole target list (wyoming and cache warm
    lacked cpu-int4)."""
    from cosyedge.device.bundle import TARGETS
    from cosyedge.device.cli import build_parser
    offered = {p.prog: tuple(a.choices) for p in _parsers(build_parser()) for a in p._actions
               if "--target" in a.option_strings and a.choices}
    assert {"cosyedge wyoming", "cosyedge cache warm", "cosyedge synth"} <= set(offered), offered
    assert {prog: choices for prog, choices in offered.items() if choices != tuple(TARGETS)} == {}


def test_synth_batch_subtitles_from_the_command_line(home, tmp_path):
    lines = tmp_path / "lines.csv"
    lines.write_text("id,text\nhello,Hello there. Good to see you.\nbye,Goodbye.\n")
    result = cosyedge("synth-batch", str(lines), "--out-dir", str(tmp_path / "out"), "--subtitles", "srt",
                      "--deterministic", "--quiet", env_home=home)
    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["bye.srt", "bye.wav", "dead_letter.jsonl",
                                                                   "hello.srt", "hello.wav"]
    assert "Good to see you." in (tmp_path / "out" / "hello.srt").read_text()


@pytest.mark.parametrize("where", ["local", "127.0.0.1:6379"])
def test_synth_batch_ray_without_ray_names_the_extra(home, tmp_path, where, blocked_imports):
    """cosyedge[ray] is optional: without it `--ray` is one line and exit 2, before any engine loads; and
    `--actors` without `--ray` is refused the same way."""
    book = tmp_path / "book.txt"
    book.write_text("One line.\n")
    env = {**blocked_imports(("ray",), "no ray here"), "COSYEDGE_HOME": str(home)}
    for args, message in ((["--ray", where], "pip install 'cosyedge[ray]'"),
                          (["--actors", "2"], "--actors goes with --ray")):
        result = subprocess.run([sys.executable, "-m", "cosyedge.device.cli", "synth-batch", str(book), "--out-dir",
                                 str(tmp_path / "out"), *args], capture_output=True, text=True, env=env, timeout=300)
        assert result.returncode == 2, result.stderr[-2000:]
        assert message in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr[-2000:]
