"""A bundle update of a running `cosyedge serve` (issue 26 item 4), from the outside.

The service loads the bundle store's `current` (the tiny CosyVoice2 bundle); under load, `cosyedge bundle install`
switches it to a re-built one: every request is answered with audio or refused before it was accepted (503 +
Retry-After, then retried), nothing reaches the dead-letter file, /readyz is never 200 between the old engine's
drain and the new one's warm-up (and then names the new bundle); `bundle rollback` brings the old hash back; a
corrupt bundle is refused with the service untouched (no reload, same hash, /readyz 200 throughout).
"""
from __future__ import annotations

import http.client
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from cosyedge.api.bench.harness import ServiceProcess
from cosyedge.api.journal import DEAD_LETTER, INFLIGHT, read_jsonl
from cosyedge.device.bundle import MANIFEST, Bundle
from cosyedge.device.bundle_store import BundleStore

pytestmark = pytest.mark.slow

TEXT = "收到好友从远方寄来的生日礼物。"
CLIENTS = 3
T = 300  # seconds: a bound for every wait, never an expectation


def _get(port: int, path: str, method: str = "GET", body: dict | None = None) -> tuple[int | None, dict, bytes]:
    """One request on its own connection (no keep-alive to outlive a worker): status (None: no answer), headers,
    body."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=T)
    try:
        conn.request(method, path, body=json.dumps(body) if body else None,
                     headers={"Content-Type": "application/json", "Connection": "close"})
        response = conn.getresponse()
        return response.status, dict(response.getheaders()), response.read()
    except OSError as exc:  # what the client saw, for the failure message
        return None, {"error": f"{type(exc).__name__}: {exc}", "at": f"{time.monotonic():.3f}"}, b""
    finally:
        conn.close()


class Probe(threading.Thread):
    """/readyz every 20 ms: (status, bundle_sha256) in order."""

    def __init__(self, port: int) -> None:
        super().__init__(daemon=True)
        self.port, self.seen, self.stop = port, [], threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            status, _, body = _get(self.port, "/readyz")
            self.seen.append((status, json.loads(body).get("bundle_sha256") if status == 200 else None))
            time.sleep(0.02)

    def wait_for(self, sha256: str) -> None:
        deadline = time.monotonic() + T
        while (200, sha256) not in self.seen[-3:]:
            assert time.monotonic() < deadline, f"never ready on {sha256[:12]}: {self.seen[-10:]}"
            time.sleep(0.1)


def _clients(port: int, stop: threading.Event, outcomes: list) -> list[threading.Thread]:
    def client() -> None:
        while not stop.is_set():
            status, headers, body = _get(port, "/v1/tts", "POST", {"text": TEXT, "format": "wav", "sampling": "greedy"})
            outcomes.append((status, body[:4] == b"RIFF", headers.get("Retry-After"),
                             (headers.get("error"), headers.get("at"))))
            if status == 503:
                time.sleep(0.2)  # refused, not accepted: a client retries after a while
    threads = [threading.Thread(target=client, daemon=True) for _ in range(CLIENTS)]
    for thread in threads:
        thread.start()
    return threads


@pytest.fixture(scope="module")
def rebuilt(golden_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny CosyVoice2 release exported again: the same model, a new bundle (another build, another hash)."""
    import torch

    from cosyedge.quantize.cosyvoice2.bundle import write_bundle
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return write_bundle(golden_dir / "cosyvoice2-tiny", tmp_path_factory.mktemp("rebuilt") / "tiny")
    finally:
        torch.set_num_threads(threads)


def test_a_bundle_update_under_load_loses_nothing_and_rolls_back(cv2_tiny_bundle, rebuilt, tmp_path):
    store_dir = tmp_path / "store"
    BundleStore(store_dir).install(cv2_tiny_bundle, load_check=False)
    old, new = Bundle.load(cv2_tiny_bundle, verify=False).sha256, Bundle.load(rebuilt, verify=False).sha256
    assert old != new
    cli_env = {**os.environ, "COSYEDGE_BUNDLE_STORE": str(store_dir), "COSYEDGE_PROVIDERS": "cpu"}
    bundle_cli = lambda *args: subprocess.run([sys.executable, "-m", "cosyedge.device.cli", "bundle", *args],
                                              env=cli_env, capture_output=True, text=True, timeout=T)
    service = ServiceProcess(bundle=str(store_dir / "current"), ready_timeout_s=T,
                             env={"COSYEDGE_PROVIDERS": "cpu", "COSYEDGE_THREADS": "1", "COSYEDGE_CACHE_MAX_MB": "0"})
    with service:
        probe = Probe(service.port)
        probe.start()
        probe.wait_for(old)
        stop, outcomes = threading.Event(), []
        clients = _clients(service.port, stop, outcomes)
        while sum(1 for o in outcomes if o[0] == 200) < CLIENTS:  # load is on before the update
            time.sleep(0.05)
        installed = bundle_cli("install", str(rebuilt))  # with its load check, as an admin runs it
        assert installed.returncode == 0, installed.stderr
        probe.wait_for(new)
        served_before = len(outcomes)
        while len(outcomes) < served_before + CLIENTS:  # and on the new engine afterwards
            time.sleep(0.05)
        stop.set()
        for thread in clients:
            thread.join(T)

        # Rollback: the previous hash comes back; a corrupt bundle is refused and nothing reloads.
        assert bundle_cli("rollback").returncode == 0
        probe.wait_for(old)
        corrupt = Path(shutil.copytree(rebuilt, tmp_path / "corrupt"))
        manifest = json.loads((corrupt / MANIFEST).read_text())
        graph = corrupt / manifest["components"][0]["file"]
        graph.write_bytes(graph.read_bytes()[:-1] + b"\x00")
        mark = len(probe.seen)
        refused = bundle_cli("install", str(corrupt))
        assert refused.returncode == 2 and "does not match its sha256" in refused.stderr, refused.stderr
        time.sleep(3)  # longer than the watcher's poll: a reload would have begun
        after = probe.seen[mark:]
        probe.stop.set()
        probe.join(T)
        assert service.stop() == 0, service.log_tail()
        state = service.log_path.parent / "state"
        dead, journal, logs = read_jsonl(state / DEAD_LETTER), read_jsonl(state / INFLIGHT), service.log_tail(20000)

    statuses = [o[0] for o in outcomes]
    dropped = [error for status, _, _, error in outcomes if status is None]
    assert set(statuses) <= {200, 503}, (statuses, dropped, logs)  # no error, no dropped connection, no timeout
    assert all(riff for status, riff, _, _ in outcomes if status == 200)
    assert all(retry for status, _, retry, _ in outcomes if status == 503)
    assert dead == [], logs  # nothing accepted was lost
    accepted = {r.get("key") or r["request_id"] for r in journal if r["event"] == "accepted"}
    assert accepted <= {r["key"] for r in journal if r["event"] == "finished"}, logs  # and none left open

    hashes = [sha for status, sha in probe.seen if status == 200]
    first_new = hashes.index(new)
    assert set(hashes[:first_new]) == {old} and hashes[first_new:hashes.index(old, first_new)] == \
        [new] * (hashes.index(old, first_new) - first_new)  # old, then new, then (rollback) old: never mixed
    switch = probe.seen.index((200, new))
    last_old = max(i for i, seen in enumerate(probe.seen[:switch]) if seen == (200, old))
    gap = probe.seen[last_old + 1:switch]
    assert gap and all(status != 200 for status, _ in gap)  # drained, loading, warming: never 200 meanwhile
    assert after and all(seen == (200, old) for seen in after)  # the refused bundle: service untouched
    assert 503 in statuses or any(s == 503 for s, _ in gap)
    assert json.loads(bundle_cli("list").stdout)["current_sha256"] == old
    print(f"\nbundle update under load: {statuses.count(200)} answered, {statuses.count(503)} refused before "
          f"acceptance (retried); /readyz not 200 for {len(gap)} polls during the switch")
