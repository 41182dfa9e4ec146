"""The control page at `/` in headless Chromium (Debian's `chromium`, driven by the `playwright` package, never a
downloaded browser): it loads without console errors and only from its own origin, a synthesis plays audio of
non-zero length (streamed wav, and an mp3 file), a repeated repeatable request is a cache hit, and a voice
registration (an uploaded clip, and one recorded in the page from a synthetic microphone) round-trips on the tiny
CosyVoice2 bundle; with "words" the page streams pcm with word times and highlights each word as it is heard,
with and without an API key. Skipped, with the reason printed, only where Chromium or playwright is missing.

`COSYEDGE_PAGE_SCREENSHOT=docs/control-page.png` also writes the screenshot the docs show."""
from __future__ import annotations

import os
import shutil
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Iterator

import pytest

from apitools import api_config, run_server
from cosyedge.api.bench.harness import ServiceProcess
from cosyedge.device.engine import Engine
from cosyedge.device.sessions import SessionConfig

CHROMIUM = "/usr/bin/chromium"
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
        "--disable-component-update", "--disable-sync",
        "--use-fake-device-for-media-stream", "--use-fake-ui-for-media-stream"]  # a synthetic microphone, no prompt
T = 120_000  # milliseconds: a bound for every wait in the browser, never an expectation


def _why_no_browser() -> str | None:
    if not Path(CHROMIUM).exists():
        return f"{CHROMIUM} is missing (apt-get install chromium; .ci/run installs it)"
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "the playwright package is not installed (the test extra)"
    return None


@pytest.fixture(scope="module")
def browser() -> Iterator:
    reason = _why_no_browser()
    if reason:
        print(f"\nbrowser test skipped: {reason}")
        pytest.skip(reason)
    from playwright.sync_api import sync_playwright
    with sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=ARGS)
        yield chromium
        chromium.close()


class Watched:
    """A page whose console errors, uncaught exceptions and requests are recorded."""

    def __init__(self, browser, origin: str, key: str | None = None) -> None:
        self.page = browser.new_page(viewport={"width": 1280, "height": 900})
        if key:  # where the page keeps an entered key: it loads without a 401 (the key field has its own test)
            self.page.add_init_script(f"sessionStorage.setItem('cosyedge-api-key', {key!r})")
        self.errors: list[str] = []
        self.foreign: list[str] = []
        self.page.on("console", lambda m: self.errors.append(m.text) if m.type == "error" else None)
        self.page.on("pageerror", lambda e: self.errors.append(str(e)))
        self.page.on("request", lambda r: None if r.url.startswith((origin, "blob:", "data:")) else self.foreign.append(r.url))
        self.page.goto(origin + "/")
        self.page.wait_for_selector("body[data-loaded=yes]", timeout=T)

    def wait(self, expression: str) -> None:
        """Poll `expression` (page.wait_for_function evaluates with eval, which the page's CSP forbids)."""
        deadline = time.monotonic() + T / 1000
        while not self.page.evaluate(expression):
            assert time.monotonic() < deadline, f"never true: {expression}"
            time.sleep(0.05)

    def played(self) -> dict:
        return self.page.evaluate("window.cosyedge.played")


def test_page_loads_plays_and_shows_the_service(browser, default_engine, tmp_path):
    with run_server(api_config(tmp_path), default_engine) as srv:
        watched = Watched(browser, srv.url)
        page = watched.page
        assert page.text_content("#ready") == "ready"
        assert page.eval_on_selector_all("#voice option", "os => os.map(o => o.value)") == default_engine.voices()
        assert page.text_content("#bundle-name") == default_engine.bundle.manifest.name
        assert "int8" in page.text_content("#quality")  # the default voice's measured int8 report

        page.fill("#text", "Please take your ticket. Counter three is free.")
        page.select_option("#format", "wav")
        page.click("#play")
        watched.wait("window.cosyedge.played.requests === 1")
        streamed = watched.played()
        assert streamed["samples"] > 22050 and streamed["seconds"] > 1.0  # over a second of audio scheduled

        page.select_option("#format", "mp3")
        page.click("#play")
        watched.wait("window.cosyedge.played.requests === 2")
        assert watched.played()["seconds"] - streamed["seconds"] > 1.0  # the <audio> element decoded the mp3
        assert page.evaluate("document.getElementById('player').duration") > 1.0
        assert page.text_content("#speak-status").endswith("(mp3)")

        page.check("#repeatable")
        for n in (3, 4):  # the same repeatable mp3 twice: the second comes from the phrase cache (streams never do)
            page.click("#play")
            watched.wait(f"window.cosyedge.played.requests === {n}")
        assert page.evaluate("window.cosyedge.recent.map(r => r.cache)")[:2] == ["hit", "miss"]

        watched.wait("document.querySelectorAll('#routes tr').length > 0")  # latency, /metrics
        assert "/v1/tts" in page.text_content("#routes")
        assert page.locator("#recent tr").count() == 4
        assert watched.errors == [] and watched.foreign == []
        shot = tmp_path / "control-page.png"
        page.screenshot(path=str(shot), full_page=True)
        assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        if os.environ.get("COSYEDGE_PAGE_SCREENSHOT"):
            shutil.copy(shot, os.environ["COSYEDGE_PAGE_SCREENSHOT"])


def test_the_page_asks_for_the_api_key(browser, default_engine, tmp_path):
    """With an API key the page's files load without it; the first 401 shows the key field, and with the key
    entered the page loads its data and speaks (every API call carries the Bearer header)."""
    key = "k3y-" + "0123456789abcdef0123456789ab"
    with run_server(api_config(tmp_path, api_key=key), default_engine) as srv:
        page = browser.new_page()
        crashes: list[str] = []  # the 401s are expected console messages; uncaught exceptions are not
        page.on("pageerror", lambda e: crashes.append(str(e)))
        page.goto(srv.url + "/")
        page.wait_for_selector("#key-form", state="visible", timeout=T)
        assert page.get_attribute("body", "data-loaded") is None  # nothing loaded without the key
        page.fill("#api-key", key)
        page.click("#key-form button")
        page.wait_for_selector("body[data-loaded=yes]", timeout=T)
        assert page.is_hidden("#key-form") and page.text_content("#bundle-name") == default_engine.bundle.manifest.name
        page.fill("#text", "Counter three is free.")
        page.select_option("#format", "mp3")
        page.click("#play")
        deadline = time.monotonic() + T / 1000
        while page.evaluate("window.cosyedge.played.requests") < 1:
            assert time.monotonic() < deadline, page.text_content("#speak-status")
            time.sleep(0.05)
        assert page.evaluate("window.cosyedge.played.seconds") > 0.5 and crashes == []


def test_voice_registration_round_trips(browser, cv2_tiny_bundle, golden_dir, tmp_path):
    state = tmp_path / "state"
    engine = Engine.load(cv2_tiny_bundle, precision="fp32", sessions=SessionConfig(providers=("cpu",), intra_op_threads=1),
                         warmup=False, state_dir=state)
    with run_server(api_config(state), engine) as srv:
        watched = Watched(browser, srv.url)
        page = watched.page
        page.fill("#voice-name", "guest")
        page.fill("#voice-text", "希望你以后能够做的比我还好呦。")
        page.set_input_files("#voice-file", str(golden_dir / "audio" / "zero_shot_prompt.wav"))
        page.click("#register button[type=submit]")
        page.wait_for_selector("li[data-voice=guest] button", timeout=T)
        assert page.text_content("#voice-status") == "registered guest"
        assert page.input_value("#voice") == "guest"  # the new voice is selected
        assert (state / "voices").exists() and any((state / "voices").rglob("guest.npz"))

        page.fill("#text", "收到好友从远方寄来的生日礼物。")
        page.select_option("#format", "pcm")
        page.click("#play")
        watched.wait("window.cosyedge.played.requests === 1")
        assert watched.played()["samples"] > 0

        page.click("li[data-voice=guest] button")
        page.wait_for_selector("li[data-voice=guest]", state="detached", timeout=T)
        assert page.text_content("#voice-status") == "deleted guest"
        assert not any((state / "voices").rglob("guest.npz"))

        # a clip recorded in the page (the synthetic microphone's tone), saved as WAV by the page
        page.set_input_files("#voice-file", [])
        page.fill("#voice-name", "mic")
        page.click("#record")
        watched.wait("window.cosyedge.recorder && window.cosyedge.recorder.chunks.length > 60")  # > 5 s at 48 kHz
        page.click("#record")
        watched.wait("window.cosyedge.recorded !== null")
        page.click("#register button[type=submit]")
        page.wait_for_selector("li[data-voice=mic] button", timeout=T)
        assert any((state / "voices").rglob("mic.npz"))
        page.click("li[data-voice=mic] button")
        page.wait_for_selector("li[data-voice=mic]", state="detached", timeout=T)
        assert watched.errors == [] and watched.foreign == []


@pytest.mark.parametrize("key", [None, "k3y-" + "0123456789abcdef0123456789ab"], ids=["no key", "api key"])
def test_words_appear_and_the_highlight_follows_the_audio(browser, cosyedge_home, default_bundle_path, key):
    """"words" streams pcm with `timestamps` (NDJSON) under `cosyedge serve`, with an API key configured too (the
    key goes as a Bearer header, never in a URL): every word of the text appears, and the highlighted word moves
    forward through them as the audio plays, ending on the last one (a highlight that jumped ahead, stood still or
    went back would fail)."""
    text = "Please take your ticket. Counter three is free."
    env = {"COSYEDGE_HOME": str(cosyedge_home), "COSYEDGE_PROVIDERS": "cpu", "COSYEDGE_THREADS": "1",
           **({"COSYEDGE_API_KEY": key} if key else {})}
    with ServiceProcess(env=env) as service:
        if key:
            with pytest.raises(urllib.error.HTTPError) as refused:
                urllib.request.urlopen(service.url + "/v1/bundle", timeout=30)
            assert refused.value.code == 401  # the key is really required
        watched = Watched(browser, service.url, key)
        page = watched.page
        urls: list[str] = []
        page.on("request", lambda r: urls.append(r.url))
        page.fill("#text", text)
        page.check("#words-on")
        page.click("#play")
        heard: list[int] = []
        deadline = time.monotonic() + T / 1000
        while not heard or heard[-1] < len(text.split()) - 1:
            status = page.text_content("#speak-status")
            assert time.monotonic() < deadline and not page.is_visible("#speak-status.error"), (heard, status)
            now = page.evaluate("window.cosyedge.heard")
            if now >= 0 and (not heard or now != heard[-1]):
                heard.append(now)
            time.sleep(0.02)
        watched.wait("window.cosyedge.played.requests === 1")
        assert page.eval_on_selector_all("#words span", "ss => ss.map(s => s.textContent)") == text.split()
        assert heard == sorted(heard) and len(heard) >= len(text.split()) // 2, heard  # it moved word by word
        assert page.eval_on_selector_all("#words .heard", "ss => ss.map(s => s.textContent)") == ["free."]
        assert page.text_content("#speak-status").endswith("(pcm, words)")
        assert watched.errors == [] and watched.foreign == []
        assert not key or not any(key in url for url in urls)  # a header only: URLs end up in logs
