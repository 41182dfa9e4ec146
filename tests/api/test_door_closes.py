"""Connections closed under a session, as the door fuzz campaign (`cosyedge.api.bench.door_fuzz`) found them: the
session ends quietly, with no traceback, no ERROR line and no HTTP answer written onto a WebSocket."""
from __future__ import annotations

import socket
import struct
import threading
import time
from types import SimpleNamespace

import pytest
from flask import Flask, g
from simple_websocket import ConnectionClosed
from wsproto.utilities import LocalProtocolError

from cosyedge.api.bench.harness import ServiceProcess, free_port
from cosyedge.api.config import ServiceConfig
from cosyedge.api.routes.websocket import Session

T = 60  # seconds: a bound for every wait, never an expectation


class _ClosingWs:
    """simple-websocket's Server as the campaign caught it: a frame queued just before its reader thread closed the
    connection itself (close 1009 for the next frame, over the bound; 1007 for a text frame that is not UTF-8) while
    `connected` was still True, so wsproto refuses every frame sent, the close included."""

    def __init__(self) -> None:
        self.queued: list[bytes | str] = [b"\x00"]  # a binary frame: the session answers bad_message
        self.sent = 0
        self.thread = threading.Thread(target=self.reader)  # simple-websocket's reader thread
        self.thread.start()

    def reader(self) -> None:
        """Its reader: already done here."""

    def receive(self, timeout: float | None = None) -> bytes | str | None:
        return self.queued.pop(0) if self.queued else None

    def send(self, data: bytes | str) -> None:
        self.sent += 1
        raise LocalProtocolError("Event TextMessage cannot be sent in state ConnectionState.LOCAL_CLOSING.")

    def close(self, reason: int | None = None, message: str | None = None) -> None:
        raise LocalProtocolError("Event CloseConnection cannot be sent in state ConnectionState.LOCAL_CLOSING.")


def test_a_websocket_that_simple_websocket_is_closing_ends_the_session_quietly():
    """Campaign input (seed 0): a binary frame, then at once a text frame over the frame bound (12 x max_text_len +
    4096 characters). The session's `bad_message` event and its close met wsproto's closing state: LocalProtocolError
    escaped the route, Flask logged a traceback and gunicorn wrote a 500 onto the closed socket (EBADF). The race
    is forced here: the session runs against a connection in exactly that state."""
    ws = _ClosingWs()
    service = SimpleNamespace(config=ServiceConfig(request_timeout_s=5.0, max_text_len=200), journal=None)
    with Flask(__name__).test_request_context():
        g.request_id = "closing"
        Session(ws, service, "127.0.0.1", lambda: None).run()  # type: ignore[arg-type]  (raised LocalProtocolError)
    assert ws.sent == 1  # the error event was tried once, then the session ended as for a client gone


class _ReplyingWs(_ClosingWs):
    """simple-websocket's Server after its reader took the client's close (sent right after a frame): `connected`
    is False, the reader thread sends its close reply a moment later."""

    def __init__(self) -> None:
        self.replied = threading.Event()
        super().__init__()

    def reader(self) -> None:
        time.sleep(0.2)
        self.replied.set()

    def send(self, data: bytes | str) -> None:
        raise ConnectionClosed()

    def close(self, reason: int | None = None, message: str | None = None) -> None:
        raise ConnectionClosed()


def test_a_websocket_session_ends_after_simple_websockets_close_reply():
    """Campaign input (seed 0): `{"type": "end",}` (invalid JSON) then the client's close, or a text frame that is not
    UTF-8 (`{"type": "text", "text": "\\xc3"}`): about 1 in 5 sessions ended without any close frame. The route
    returned (and gunicorn closed the socket) before simple-websocket's reader thread had sent the close reply it
    owed (1000, or its own 1007). The session now waits for that thread, up to a second."""
    ws = _ReplyingWs()
    service = SimpleNamespace(config=ServiceConfig(request_timeout_s=5.0, max_text_len=200), journal=None)
    with Flask(__name__).test_request_context():
        g.request_id = "replying"
        Session(ws, service, "127.0.0.1", lambda: None).run()  # type: ignore[arg-type]
    assert ws.replied.is_set()  # the close reply went out before the socket went back to gunicorn


def _reset(sock: socket.socket) -> None:
    """Close with a TCP reset (RST), not a FIN: a client killed or unplugged."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


def _describe(port: int) -> bytes:
    """The first line of the answer to `describe` on a new connection, then a reset."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=T)
    sock.sendall(b'{"type": "describe"}\n')
    line = sock.makefile("rb").readline()
    _reset(sock)
    return line


@pytest.mark.slow
def test_a_wyoming_client_that_resets_its_connection_leaves_no_traceback(cosyedge_home):
    """Campaign input (seed 0): `{"type": "describe"}` then a reset. The reset reached the connection's pending read:
    ConnectionResetError escaped `Handler.run` (asyncio: "Unhandled exception in client_connected_cb" and a traceback);
    or its write: "ERROR wyoming: describe failed: ConnectionResetError". A reset is the client leaving, as EOF.
    Forced here: the reset comes after the answer, while the server waits in its read."""
    port = free_port()
    env = {"COSYEDGE_WYOMING_URI": f"tcp://127.0.0.1:{port}", "COSYEDGE_HOME": str(cosyedge_home),
           "COSYEDGE_THREADS": "1"}
    with ServiceProcess(env=env) as service:
        deadline = time.monotonic() + T
        while (answer := _try(port)) is None:  # /readyz answers a moment before Wyoming listens
            assert time.monotonic() < deadline, service.log_tail()
            time.sleep(0.1)
        for _ in range(5):
            assert _describe(port).startswith(b'{"type": "info"')
            sock = socket.create_connection(("127.0.0.1", port), timeout=T)  # a reset before any answer, too
            sock.sendall(b'{"type": "describe"}\n')
            _reset(sock)
        time.sleep(0.5)  # the server's loop takes the resets
        assert _describe(port).startswith(b'{"type": "info"')  # and goes on
        log = service.log_path.read_text(errors="replace")
    assert answer.startswith(b'{"type": "info"')
    assert "Traceback" not in log and "\nERROR " not in log, log[-3000:]


def _try(port: int) -> bytes | None:
    try:
        return _describe(port)
    except OSError:
        return None
