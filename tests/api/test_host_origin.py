"""Host and Origin (issue 21 item 10): with the default no-key loopback setup, a page on any web site could reach the
box through DNS rebinding (a name of the attacker's that resolves to 127.0.0.1: Host is that name) or a cross-site
simple request (Origin is the other site); it created and deleted voices that way. Now a Host must be a loopback
name, an address, this machine's name or a configured one, and a state change (or a WebSocket handshake) that
carries an Origin must come from the service's own origin, as the control page does (test_page.py)."""
from __future__ import annotations

import json
from typing import Iterator

import pytest

from apitools import Server, api_config, run_server
from cosyedge.api.bench.harness import ServiceProcess
from cosyedge.api.config import ConfigError, load_config

FOREIGN = "rebind.evil.example"


@pytest.fixture(scope="module")
def srv(default_engine, tmp_path_factory) -> Iterator[Server]:
    with run_server(api_config(tmp_path_factory.mktemp("hosts"), allowed_hosts=("kiosk.lan",)), default_engine) as s:
        yield s


def _code(raw: bytes) -> str:
    return json.loads(raw)["error"]["code"]


@pytest.mark.parametrize("method, path", [("GET", "/v1/audio/voices"), ("DELETE", "/v1/audio/voices/someone"),
                                          ("POST", "/v1/tts"), ("GET", "/v1/models")])
def test_a_foreign_host_is_refused_everywhere_but_the_probes(srv, method, path):
    body = {"text": "Hi.", "format": "pcm"} if method == "POST" else None
    for host in (FOREIGN, f"{FOREIGN}:{srv.port}", "127.0.0.1.evil.example"):
        status, _, raw = srv.request(method, path, body, headers={"Host": host})
        assert status == 400 and _code(raw) == "host_not_allowed", (host, raw[:200])
    assert srv.request("GET", "/healthz", headers={"Host": FOREIGN})[0] == 200


@pytest.mark.parametrize("host", ["127.0.0.1:{port}", "localhost:{port}", "LOCALHOST", "[::1]:{port}",
                                  "app.localhost:{port}", "192.168.1.20:{port}", "kiosk.lan:{port}", "kiosk.lan."])
def test_loopback_names_addresses_and_configured_names_are_served(srv, host):
    status, _, raw = srv.request("GET", "/v1/models", headers={"Host": host.format(port=srv.port)})
    assert status == 200, raw[:200]


def test_state_changes_from_a_foreign_origin_are_refused(srv):
    own = f"http://127.0.0.1:{srv.port}"
    body = {"text": "Hi.", "format": "pcm"}
    for origin in ("http://evil.example", "null", f"https://127.0.0.1:{srv.port}.evil.example", "http://127.0.0.1"):
        status, _, raw = srv.post("/v1/tts", body, headers={"Origin": origin})
        assert status == 403 and _code(raw) == "origin_not_allowed", (origin, raw[:200])
        status, _, raw = srv.request("DELETE", "/v1/audio/voices/someone", headers={"Origin": origin})
        assert status == 403 and _code(raw) == "origin_not_allowed"
    # the voice creation: a multipart form from another site (a CORS "simple request")
    form = (b"--b\r\nContent-Disposition: form-data; name=\"name\"\r\n\r\nvictim\r\n--b--\r\n")
    status, _, raw = srv.request("POST", "/v1/audio/voices", form, headers={
        "Origin": "http://evil.example", "Content-Type": "multipart/form-data; boundary=b"})
    assert status == 403 and _code(raw) == "origin_not_allowed"
    assert srv.post("/v1/tts", body, headers={"Origin": own})[0] == 200  # the control page
    assert srv.post("/v1/tts", body)[0] == 200  # a program: no Origin
    assert srv.request("GET", "/v1/models", headers={"Origin": "http://evil.example"})[0] == 200  # reads: CORS's job


def test_a_websocket_handshake_from_a_foreign_origin_is_refused(srv):
    headers = {"Upgrade": "websocket", "Connection": "Upgrade", "Sec-WebSocket-Version": "13",
               "Sec-WebSocket-Key": "dGhlIHNhbXBsZSBub25jZQ==", "Origin": "http://evil.example"}
    status, _, raw = srv.request("GET", "/v1/audio/stream", headers=headers)
    assert status == 403 and _code(raw) == "origin_not_allowed"


def test_allowed_hosts_come_from_the_environment_or_toml_and_must_be_names(tmp_path):
    assert load_config(env={"COSYEDGE_ALLOWED_HOSTS": " Kiosk.LAN, box.example. ,"}).allowed_hosts == \
        ("kiosk.lan", "box.example")
    toml = tmp_path / "c.toml"
    toml.write_text('allowed_hosts = ["kiosk.lan"]\n', encoding="utf-8")
    assert load_config(toml, env={}).allowed_hosts == ("kiosk.lan",)
    for bad in ("http://kiosk.lan", "kiosk.lan:8100", "*.lan", "a b"):
        with pytest.raises(ConfigError, match="allowed_hosts"):
            load_config(env={"COSYEDGE_ALLOWED_HOSTS": bad})


@pytest.mark.slow
def test_a_real_websocket_from_a_foreign_origin_is_refused_under_serve(cosyedge_home, default_bundle_path, tmp_path):
    """The issue's probe: a WebSocket opened from another site's page streamed audio. Under `cosyedge serve`
    (gunicorn, simple-websocket) the handshake from a foreign Origin is a 403 now; a client that sends the
    service's own origin (websocket-client does, like the control page) still streams."""
    import websocket
    env = {"COSYEDGE_HOME": str(cosyedge_home), "COSYEDGE_STATE_DIR": str(tmp_path / "state"),
           "COSYEDGE_PROVIDERS": "cpu", "COSYEDGE_THREADS": "1"}
    with ServiceProcess(bundle=str(default_bundle_path), env=env) as service:
        url = service.url.replace("http://", "ws://") + "/v1/audio/stream"
        with pytest.raises(websocket.WebSocketBadStatusException) as refused:
            websocket.create_connection(url, origin="http://evil.example", timeout=30)
        assert refused.value.status_code == 403 and b"origin_not_allowed" in (refused.value.resp_body or b"")
        ws = websocket.create_connection(url, timeout=30)
        try:
            ws.send(json.dumps({"type": "start", "format": "pcm"}))
            ws.send(json.dumps({"type": "text", "text": "Hello there."}))
            ws.send(json.dumps({"type": "end"}))
            audio = 0
            while True:
                message = ws.recv()
                if isinstance(message, bytes):
                    audio += len(message)
                elif json.loads(message).get("type") in ("done", "error"):
                    break
            assert audio > 0 and json.loads(message)["type"] == "done", message
        finally:
            ws.close()
