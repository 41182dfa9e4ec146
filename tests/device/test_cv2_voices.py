"""Zero-shot voices registered at run time: computed once, stored in the state directory, kept across restarts."""
from __future__ import annotations

import dataclasses
import io
import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from cosyedge.device.engine import Engine
from cosyedge.device.errors import InputError
from cosyedge.device.sessions import SessionConfig

TRANSCRIPT = "希望你以后能够做的比我还好呦。"
TEXT = "收到好友从远方寄来的生日礼物。"


@pytest.fixture()
def home(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("COSYEDGE_HOME", str(tmp_path / "state"))
    return tmp_path / "state"


def _load(bundle: Path) -> Engine:
    return Engine.load(bundle, precision="fp32", sessions=SessionConfig(providers=("cpu",), intra_op_threads=1),
                       warmup=False)


def _wav_bytes(wav: np.ndarray, rate: int, fmt: str = "WAV") -> bytes:
    buffer = io.BytesIO()
    sf.write(buffer, wav, rate, format=fmt)
    return buffer.getvalue()


@pytest.fixture(scope="module")
def prompt(golden_dir: Path) -> bytes:
    return (golden_dir / "audio" / "zero_shot_prompt.wav").read_bytes()


def test_registered_voice_survives_a_restart_and_speaks_like_the_release_entry(cv2_tiny_bundle, home, prompt):
    engine = _load(cv2_tiny_bundle)
    engine.add_voice("narrator", prompt, TRANSCRIPT)
    assert engine.voices()[-1] == "narrator"
    stored = list((home / "voices").glob("*/narrator.npz"))
    assert len(stored) == 1

    restarted = _load(cv2_tiny_bundle)  # a new process would do exactly this
    assert "narrator" in restarted.voices()
    # The release's tiny_spk_zh was made by the official add_zero_shot_spk from the same clip and transcript.
    ours = restarted.synthesize_waveform(TEXT, voice="narrator", sampling="greedy", deterministic=True)
    official = restarted.synthesize_waveform(TEXT, voice="tiny_spk_zh", sampling="greedy", deterministic=True)
    assert ours.shape == official.shape
    assert 10 * np.log10(np.sum(official.astype(np.float64) ** 2) / max(np.sum((ours - official) ** 2), 1e-30)) > 40

    restarted.remove_voice("narrator")
    assert "narrator" not in restarted.voices() and not stored[0].exists()
    assert "narrator" not in _load(cv2_tiny_bundle).voices()


def test_other_rates_and_formats_are_resampled_not_rejected(cv2_tiny_bundle, home, prompt):
    wav, rate = sf.read(io.BytesIO(prompt), dtype="float32")
    engine = _load(cv2_tiny_bundle)
    engine.add_voice("flac-44k", _wav_bytes(np.interp(np.arange(0, wav.size, rate / 44100), np.arange(wav.size), wav)
                                            .astype(np.float32), 44100, "FLAC"), TRANSCRIPT)
    assert engine.synthesize("你好。", voice="flac-44k", sampling="greedy", deterministic=True).duration_seconds > 0


@pytest.mark.parametrize("name, audio, text, message", [
    ("short", "0.5s", TRANSCRIPT, "0.50 s long"),
    ("long", "31s", TRANSCRIPT, "31.0 s long; at most 30 s"),
    ("quiet", "silent", TRANSCRIPT, "silent"),
    ("junk", "junk", TRANSCRIPT, "not a readable audio file"),
    ("notext", "prompt", "  ", "transcript of the prompt audio is missing"),
    ("../escape", "prompt", TRANSCRIPT, "voice names are"),
    (".hidden", "prompt", TRANSCRIPT, "voice names are"),
    ("a/b", "prompt", TRANSCRIPT, "voice names are"),
    ("tiny_spk_zh", "prompt", TRANSCRIPT, "already exists"),
])
def test_bad_voice_registrations_are_refused(cv2_tiny_bundle, home, prompt, name, audio, text, message):
    sources = {"prompt": prompt, "junk": b"this is not audio",
               "0.5s": _wav_bytes(np.full(12000, 0.1, np.float32), 24000),
               "31s": _wav_bytes(np.random.default_rng(0).uniform(-0.3, 0.3, 31 * 16000).astype(np.float32), 16000),
               "silent": _wav_bytes(np.zeros(3 * 16000, np.float32), 16000)}
    engine = _load(cv2_tiny_bundle)
    with pytest.raises(InputError, match=message):
        engine.add_voice(name, sources[audio], text)
    assert not (home / "voices").exists() or not any((home / "voices").rglob("*.npz"))


def test_fixed_voice_families_refuse_registration(default_bundle_path, prompt, home):
    engine = _load(default_bundle_path)
    with pytest.raises(InputError, match="vits bundles have fixed voices"):
        engine.add_voice("someone", prompt, TRANSCRIPT)


def test_cli_voices_add_list_and_synth(cv2_tiny_bundle, golden_dir, tmp_path):
    import subprocess
    import sys
    env = {**os.environ, "COSYEDGE_HOME": str(tmp_path / "state")}

    def cli(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "cosyedge.device.cli", *args], capture_output=True, text=True, env=env,
                              timeout=300)

    added = cli("voices", "add", "cli_voice", "--wav", str(golden_dir / "audio" / "zero_shot_prompt.wav"),
                "--text", TRANSCRIPT, "--bundle", str(cv2_tiny_bundle))
    assert added.returncode == 0, added.stderr
    listing = cli("voices", "--bundle", str(cv2_tiny_bundle))
    assert listing.stdout.splitlines()[-1] == "3\tcli_voice"
    out = tmp_path / "x.wav"
    synth = cli("synth", TEXT, "-o", str(out), "--bundle", str(cv2_tiny_bundle), "--voice", "cli_voice",
                "--sampling", "greedy", "--deterministic")
    assert synth.returncode == 0, synth.stderr
    assert sf.info(str(out)).frames > 0
    bad = cli("voices", "add", "x", "--wav", str(tmp_path / "missing.wav"), "--text", "hi", "--bundle", str(cv2_tiny_bundle))
    assert bad.returncode == 2 and "cannot be read" in bad.stderr and "Traceback" not in bad.stderr


def test_a_registration_while_a_removal_copies_the_voices_is_kept(cv2_tiny_bundle):
    """Registration and removal each replace the voice map with a new one made from the old: unguarded, a voice
    registered while a removal copies the map was dropped by the removal's write. The removal's copy is slowed
    here so that the two overlap every time; the map's lock makes the registration wait for it."""
    pipeline = _load(cv2_tiny_bundle).pipeline
    builtin = pipeline.voices()[0]
    leaving, arriving = (dataclasses.replace(pipeline._voice(builtin), name=name) for name in ("leaving", "arriving"))
    pipeline.add_voice(leaving)

    class SlowCopy(dict):
        def items(self):
            time.sleep(0.5)
            return super().items()

    pipeline._voices = SlowCopy(pipeline._voices)
    removal = threading.Thread(target=pipeline.remove_voice, args=("leaving",))
    removal.start()
    time.sleep(0.1)  # the removal is copying the map
    pipeline.add_voice(arriving)
    removal.join(10)
    assert "arriving" in pipeline.voices() and "leaving" not in pipeline.voices()
    assert pipeline.voice_kind("arriving") == pipeline.voice_kind(builtin)
