"""The phrase cache on real services: a hit after a miss is byte-identical to a fresh answer, the size cap evicts
the least recently used entries, a voice re-registration or a bundle change never serves stale audio, and a
`cosyedge cache warm` killed with SIGKILL resumes where it stopped."""
from __future__ import annotations

import io
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import requests
import soundfile as sf

from apitools import api_config, run_server
from cosyedge.api.cache import Entry, PhraseCache, open_cache
from cosyedge.device.engine import Engine
from cosyedge.device.sessions import SessionConfig

T = 120  # seconds: a bound for every HTTP call, never an expectation
PHRASE = "Please take your ticket and wait until your number is called at counter three."
CV2_TEXT = "收到好友从远方寄来的生日礼物。"


def _tts(srv, body: dict) -> requests.Response:
    response = requests.post(srv.url + "/v1/tts", json=body, timeout=T)
    assert response.status_code == 200, response.text[:300]
    return response


@pytest.mark.parametrize("fmt", ["wav", "mp3"])
def test_hit_after_miss_is_byte_identical_to_a_fresh_answer(default_engine, tmp_path, fmt):
    with run_server(api_config(tmp_path), default_engine) as srv:
        body = {"text": PHRASE, "format": fmt, "deterministic": True}
        first = _tts(srv, body)
        second = _tts(srv, body)
        assert (first.headers["X-Cosyedge-Cache"], second.headers["X-Cosyedge-Cache"]) == ("miss", "hit")
        assert second.content == first.content and len(first.content) > 10_000
        assert second.headers["Content-Type"] == first.headers["Content-Type"]
        assert second.headers["X-Audio-Seconds"] == first.headers["X-Audio-Seconds"]
        assert (srv.metric("cosyedge_cache_hits_total"), srv.metric("cosyedge_cache_misses_total")) == (1, 1)

        cache = open_cache(str(tmp_path), 256)
        assert cache.clear() == 1
        fresh = _tts(srv, body)  # synthesized again, nothing cached: the same bytes
        assert fresh.headers["X-Cosyedge-Cache"] == "miss" and fresh.content == first.content

        # a corrupt entry is a miss (and is replaced), never served
        entry = next(cache.root.glob("*/*.bin"))
        entry.write_bytes(entry.read_bytes()[:-100] + b"\0" * 100)
        repaired = _tts(srv, body)
        assert repaired.headers["X-Cosyedge-Cache"] == "miss" and repaired.content == first.content
        assert _tts(srv, body).headers["X-Cosyedge-Cache"] == "hit"

        # sampled audio is never cached; every answer is synthesized
        noisy = {"text": PHRASE, "format": fmt}
        assert [_tts(srv, noisy).headers["X-Cosyedge-Cache"] for _ in range(2)] == ["miss", "miss"]
        assert cache.stats()["entries"] == 1


def test_a_seeded_request_on_the_default_voice_is_cached(default_engine, tmp_path):
    """The default voice draws its noise from the seed (device/vits/noise.py): a repeat is a hit, byte-identical to
    a fresh synthesis of the same seed; another seed is other audio."""
    with run_server(api_config(tmp_path), default_engine) as srv:
        body = {"text": PHRASE, "format": "wav", "seed": 7}
        first, second = _tts(srv, body), _tts(srv, body)
        assert (first.headers["X-Cosyedge-Cache"], second.headers["X-Cosyedge-Cache"]) == ("miss", "hit")
        assert second.content == first.content
        assert open_cache(str(tmp_path), 256).clear() == 1
        assert _tts(srv, body).content == first.content  # synthesized again: the seed, not the cache, repeats it
        other = _tts(srv, {**body, "seed": 8})
        assert other.headers["X-Cosyedge-Cache"] == "miss" and other.content != first.content


def test_the_size_cap_evicts_the_least_recently_used(default_engine, tmp_path):
    options = default_engine.options(deterministic=True)
    texts = ["Counter one is free.", "Counter two is free.", "Counter three is free."]
    waves = [default_engine.synthesize(text, deterministic=True).export(format="wav").read() for text in texts]
    size = max(len(w) for w in waves) + 200
    cache = PhraseCache(tmp_path / "cache", max_bytes=int(size * 2.5))  # room for two entries
    keys = [cache.key(default_engine, default_engine.segments(t), options, "wav") for t in texts]
    assert len(set(keys)) == 3 and all(keys)
    cache.put(keys[0], Entry(waves[0], "audio/wav", 1.0))
    cache.put(keys[1], Entry(waves[1], "audio/wav", 1.0))
    assert cache.get(keys[0]) is not None  # used again: now the second one is the least recently used
    cache.put(keys[2], Entry(waves[2], "audio/wav", 1.0))
    assert [cache.has(k) for k in keys] == [True, False, True]
    assert cache.stats()["bytes"] <= cache.max_bytes


def test_eviction_and_clear_delete_only_what_the_cache_wrote(tmp_path):
    """Files someone else put in the cache folder (even named *.bin) survive eviction and `clear`."""
    cache = PhraseCache(tmp_path / "cache", max_bytes=10)
    key = "ab" + "0" * 62
    (tmp_path / "cache" / "ab").mkdir(parents=True)
    (tmp_path / "cache" / "ab" / f"{key}.bin").write_bytes(b"x" * 20)  # an entry of the cache's own shape
    foreign = [tmp_path / "cache" / "ab" / "notes.bin", tmp_path / "cache" / "ab" / f"{'cd' + '0' * 62}.bin",
               tmp_path / "cache" / "ab" / ".backup.partial"]
    for path in foreign:
        path.write_bytes(b"y" * 20)
    assert cache.evict() == 1 and all(path.exists() for path in foreign)
    (tmp_path / "cache" / "ab" / f"{key}.bin").write_bytes(b"x" * 20)
    assert cache.clear() == 1 and all(path.exists() for path in foreign)


def _cv2_engine(bundle: Path, state: Path) -> Engine:
    return Engine.load(bundle, precision="fp32", sessions=SessionConfig(providers=("cpu",), intra_op_threads=1),
                       warmup=False, state_dir=state)


def test_a_re_registered_voice_is_never_served_from_the_cache(cv2_tiny_bundle, golden_dir, tmp_path):
    prompt = (golden_dir / "audio" / "zero_shot_prompt.wav").read_bytes()
    wav, rate = sf.read(io.BytesIO(prompt), dtype="float32")
    other = io.BytesIO()
    sf.write(other, wav[: int(len(wav) * 0.7)][::-1] * 0.8, rate, format="WAV")  # another clip of the "speaker"
    state = tmp_path / "state"
    with run_server(api_config(state), _cv2_engine(cv2_tiny_bundle, state)) as srv:
        def register(clip: bytes) -> None:
            created = requests.post(srv.url + "/v1/audio/voices", data={"name": "guest", "text": "希望你以后能够做的比我还好呦。"},
                                    files={"audio": ("prompt.wav", clip, "audio/wav")}, timeout=T)
            assert created.status_code == 201, created.text

        register(prompt)
        body = {"text": CV2_TEXT, "voice": "guest", "format": "pcm", "seed": 7}
        first = _tts(srv, body)
        assert _tts(srv, body).headers["X-Cosyedge-Cache"] == "hit"
        assert requests.delete(srv.url + "/v1/audio/voices/guest", timeout=T).status_code == 200
        register(other.getvalue())
        after = _tts(srv, body)
        assert after.headers["X-Cosyedge-Cache"] == "miss"
        assert after.content != first.content  # the new voice speaks, not the cached old one
        assert _tts(srv, body).headers["X-Cosyedge-Cache"] == "hit"


def test_a_changed_bundle_is_never_served_from_the_cache(default_engine, default_bundle_path, tmp_path):
    changed = tmp_path / "bundle"
    shutil.copytree(default_bundle_path, changed)
    manifest = json.loads((changed / "manifest.json").read_text())
    manifest["provenance"] = {**manifest.get("provenance", {}), "note": "a new release of the same voice"}
    (changed / "manifest.json").write_text(json.dumps(manifest))
    engine = Engine.load(changed, precision="fp32", sessions=SessionConfig(providers=("cpu",), intra_op_threads=1),
                         warmup=False)
    body = {"text": PHRASE, "format": "wav", "deterministic": True}
    state = tmp_path / "state"
    with run_server(api_config(state), default_engine) as srv:
        assert [_tts(srv, body).headers["X-Cosyedge-Cache"] for _ in range(2)] == ["miss", "hit"]
    with run_server(api_config(state), engine) as srv:  # same state directory, another bundle
        assert [_tts(srv, body).headers["X-Cosyedge-Cache"] for _ in range(2)] == ["miss", "hit"]
    assert open_cache(str(state), 256).stats()["entries"] == 2


def test_a_killed_warm_resumes_and_the_service_serves_its_entries(default_engine, cosyedge_home, tmp_path):
    phrases = [f"Number {n} to counter {n % 5 + 1}, please." for n in range(30)]
    listing = tmp_path / "phrases.txt"
    listing.write_text("\n".join(phrases) + "\n")
    state = tmp_path / "state"
    env = {**os.environ, "COSYEDGE_HOME": str(cosyedge_home), "COSYEDGE_STATE_DIR": str(state),
           "COSYEDGE_THREADS": "1", "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "cosyedge.device.cli", "cache", "warm", str(listing), "--deterministic",
               "--precision", "fp32", "--quiet"]
    cache = open_cache(str(state), 256)
    warm = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300
        while cache.stats()["entries"] < 3 and warm.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        warm.send_signal(signal.SIGKILL)
        assert warm.wait(timeout=30) == -signal.SIGKILL, warm.stderr.read()[-2000:]  # killed, not finished
    finally:
        if warm.poll() is None:
            warm.kill()
            warm.wait()
    at_kill = cache.stats()["entries"]
    assert 3 <= at_kill < len(phrases), at_kill

    rerun = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    summary = json.loads(rerun.stdout.strip().splitlines()[-1])
    assert summary["skipped"] >= at_kill and summary["skipped"] + summary["done"] == len(phrases)
    assert summary["failed"] == 0 and summary["entries"] == len(phrases)

    with run_server(api_config(state), default_engine) as srv:  # the service's keys are the warm's keys
        for text in (phrases[0], phrases[-1]):
            response = _tts(srv, {"text": text, "format": "wav", "deterministic": True})
            assert response.headers["X-Cosyedge-Cache"] == "hit"
            got = np.frombuffer(response.content[44:], "<i2")
            assert got.size == default_engine.synthesize_waveform(text, deterministic=True).size

    stats = subprocess.run([sys.executable, "-m", "cosyedge.device.cli", "cache", "stats"], env=env,
                           capture_output=True, text=True, timeout=120)
    assert json.loads(stats.stdout)["entries"] == len(phrases)
    (state / "keep.txt").write_text("not the cache's")
    cleared = subprocess.run([sys.executable, "-m", "cosyedge.device.cli", "cache", "clear"], env=env,
                             capture_output=True, text=True, timeout=120)
    assert cleared.returncode == 0 and f"removed {len(phrases)}" in cleared.stderr
    assert cache.stats()["entries"] == 0 and (state / "keep.txt").exists()
