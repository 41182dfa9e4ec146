"""The front door of `cosyedge serve`'s gunicorn worker: what happens to a connection before the app sees it.

- **Header deadline and cap (slowloris)**: gunicorn 27's gthread worker waits 5 s for a connection's first byte,
  then hands it to a pool thread that blocks reading the rest of the request line and headers with no deadline, so
  32 sockets that each sent one byte held all 32 threads, before any API key was checked, for as long as they
  liked. gunicorn has no setting for a header-read deadline (`timeout` is the worker's heartbeat, `limit_request_*`
  bound sizes, not time), hence this small front check instead of a setting: a connection (new, or kept alive
  for its next request) first waits in the worker's poller, which costs no thread, until its whole header block
  has arrived; only then does a pool thread parse it (from the bytes read here). A block not complete within
  `HEADER_TIMEOUT_S` gets 408 and is closed, one that outgrows gunicorn's limits without ending gets 431 at once
  (handed to the parser, it would block a thread reading for the end); at most `MAX_HEADER_WAITS` connections
  may be sending headers at once, and a new one beyond that closes the one that has waited longest (a real client
  sends its headers in one packet, so it never waits long). The start of a pipelined next request, read together
  with the one before, waits the same way.
- **JSON errors**: what gunicorn's parser refuses (a bad request line or header: 400; a request line or header
  block over its bound: 414 / 431) is answered in the API's JSON error shape instead of gunicorn's HTML page, and
  a malformed chunked body (bad or negative chunk size, missing CRLF, bad trailer, a body cut short), which
  gunicorn raises inside the app's body read, is a 400 `malformed_body`, never a 500.
"""
from __future__ import annotations

import errno
import json
import logging
import selectors
import socket
import time
from collections import deque
from functools import partial
from typing import Any

from gunicorn import http as gunicorn_http
from gunicorn.http.errors import (ExpectationFailed, LimitRequestHeaders, LimitRequestLine, NoMoreData,
                                  ParseException, UnsupportedTransferCoding)
from gunicorn.workers.gthread import ThreadWorker, TConn

from cosyedge.api.errors import ApiError, ShuttingDown

log = logging.getLogger("cosyedge.serve")

HEADER_TIMEOUT_S = 10.0  # from a connection's first wait to its complete header block
MAX_HEADER_WAITS = 64  # connections still sending their headers; a new one past it closes the oldest
_READ = 16 << 10


def header_block_limit(line: int, fields: int) -> int:
    """More than the largest header block gunicorn's limits allow (request line + `fields` lines + CRLFs): a block
    this long without its end is refused here."""
    return (fields + 1) * (line + 2) + 4


def _complete(block: bytes | bytearray) -> bool:
    return b"\r\n\r\n" in block or b"\n\n" in block


class FrontWorker(ThreadWorker):
    """gthread with the header deadline and cap, and JSON error pages (module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.header_waits: deque[TConn] = deque()  # oldest first
        self.header_limit = header_block_limit(self.cfg.limit_request_line, self.cfg.limit_request_fields)

    # -- connections sending headers ---------------------------------------------------------
    def accept(self, listener: socket.socket) -> None:
        try:
            client_sock, client_addr = listener.accept()
        except OSError as exc:
            if exc.errno not in (errno.EAGAIN, errno.ECONNABORTED, errno.EWOULDBLOCK):
                raise
            return
        self.nr_conns += 1
        self._await_headers(TConn(self.cfg, client_sock, client_addr, listener.getsockname()))

    def on_client_socket_readable(self, conn: TConn, client: socket.socket) -> None:
        """A kept-alive connection's next request is starting: its headers are awaited the same way."""
        self.poller.unregister(client)
        self.keepalived_conns.remove(conn)
        self._await_headers(conn)

    def finish_request(self, conn: TConn, fs: Any) -> None:
        """A kept-alive connection whose next request gunicorn already began reading (it came in the same packet as
        the one before) waits for the rest of its headers here too, instead of in a pool thread."""
        keepalive = self.alive and not fs.cancelled() and fs.exception() is None and fs.result() is True
        ahead = conn.parser.unreader.take_buffered() if keepalive and conn.parser is not None else b""
        if ahead and not _complete(ahead):
            self._await_headers(conn, ahead)
            return
        if ahead:
            conn.parser.unreader.unread(ahead)
        super().finish_request(conn, fs)

    def _await_headers(self, conn: TConn, ahead: bytes = b"") -> None:
        while len(self.header_waits) >= MAX_HEADER_WAITS:
            oldest = self.header_waits[0]
            self._on_header_bytes(oldest, oldest.sock)  # what arrived since the last poll may complete it
            if self.header_waits and self.header_waits[0] is oldest:
                self._drop(oldest, None)
        conn.sock.setblocking(False)
        conn.header_deadline = time.monotonic() + HEADER_TIMEOUT_S
        conn.header_block = bytearray(ahead)
        self.header_waits.append(conn)
        self.poller.register(conn.sock, selectors.EVENT_READ, partial(self._on_header_bytes, conn))

    def _on_header_bytes(self, conn: TConn, sock: socket.socket) -> None:
        try:
            data = sock.recv(_READ)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:  # the client left
            self._drop(conn, None)
            return
        conn.header_block += data
        if not _complete(conn.header_block):
            if len(conn.header_block) >= self.header_limit:
                self._drop(conn, _response(431, "headers_too_large", "the request's headers are longer than the "
                                                                      "server accepts"))
            return
        self._forget(conn)
        if conn.parser is None:  # a new connection: its parser reads the block from here on (no TLS, no h2c)
            conn.parser = gunicorn_http.get_parser(self.cfg, conn.sock, conn.client)
        conn.parser.unreader.unread(bytes(conn.header_block))
        conn.header_block = bytearray()
        conn.data_ready = True
        self.enqueue_req(conn)

    def murder_pending(self) -> None:
        """gunicorn's clean-up of idle connections (each turn of the worker loop), plus the header deadline."""
        super().murder_pending()
        if not self.alive:  # stopping (SIGTERM, or a bundle reload that ends this worker): a request not read yet
            stopping = ShuttingDown()  # is told to come back (the next worker serves it), never dropped unanswered
            while self.header_waits:
                self._drop(self.header_waits[0], _response(stopping.status, stopping.code, stopping.message,
                                                           stopping.retry_after), linger=True)
        now = time.monotonic()
        while self.header_waits and self.header_waits[0].header_deadline <= now:
            self._drop(self.header_waits[0], _response(408, "request_timeout", "the request's headers did not "
                                                            f"arrive within {HEADER_TIMEOUT_S:.0f} s"))

    def _forget(self, conn: TConn) -> None:
        try:
            self.poller.unregister(conn.sock)
        except (KeyError, ValueError, OSError):
            pass
        try:
            self.header_waits.remove(conn)
        except ValueError:
            pass

    def _drop(self, conn: TConn, answer: bytes | None, linger: bool = False) -> None:
        """Answer (non-blocking, best effort: a slow client may not read it) and close. `linger`: close gracefully
        in a pool thread (FIN, then what the client still sends is read and discarded for up to 2 s), counted
        until then so that a stopping worker waits for it; closed at once, the unread rest of a request makes the
        kernel reset the connection, and a client still sending its body gets a broken pipe instead of the answer."""
        self._forget(conn)
        if answer is not None:
            try:
                conn.sock.send(answer)
            except OSError:
                pass
        if linger:
            closing = self.tpool.submit(conn.close, True)
            closing.add_done_callback(lambda _: self.method_queue.defer(self._closed))
            return
        self._closed()
        conn.close()

    def _closed(self) -> None:
        self.nr_conns -= 1

    # -- errors gunicorn answers itself ------------------------------------------------------
    def handle_error(self, req: Any, client: socket.socket, addr: Any, exc: BaseException) -> None:
        status, code, message = _parse_error(exc)
        if status >= 500:
            log.error("request failed before the app: %s", type(exc).__name__, exc_info=exc)
        else:
            log.info("refused before the app: %s", type(exc).__name__)
        try:
            client.setblocking(False)
            client.send(_response(status, code, message))
        except OSError:
            pass

    def _keepalive_after(self, conn: TConn, keepalive: bool) -> bool:
        """After the answer, gunicorn drains what the app left of the body; a malformed body raises again there
        (the app has answered it already with 400): the connection closes instead."""
        try:
            return super()._keepalive_after(conn, keepalive)
        except (ParseException, NoMoreData):
            return False


_REASONS = {400: "Bad Request", 408: "Request Timeout", 414: "URI Too Long", 417: "Expectation Failed",
            431: "Request Header Fields Too Large", 500: "Internal Server Error", 501: "Not Implemented",
            503: "Service Unavailable"}


def _parse_error(exc: BaseException) -> tuple[int, str, str]:
    """gunicorn's status for what its parser refused, with the API's code and a message without the request's
    bytes (an echoed header could carry a key)."""
    if isinstance(exc, LimitRequestLine):
        return 414, "request_line_too_long", "the request line is longer than the server accepts"
    if isinstance(exc, LimitRequestHeaders):
        return 431, "headers_too_large", "the request's headers are longer or more numerous than the server accepts"
    if isinstance(exc, ExpectationFailed):
        return 417, "expectation_failed", "only 'Expect: 100-continue' is supported"
    if isinstance(exc, UnsupportedTransferCoding):
        return 501, "unsupported_transfer_coding", "only chunked transfer coding is supported"
    if isinstance(exc, ParseException):
        return 400, "malformed_request", f"the request is not valid HTTP/1.1 ({_words(type(exc).__name__)})"
    return 500, "internal_error", "internal error"


def _words(name: str) -> str:
    return "".join(f" {c.lower()}" if c.isupper() else c for c in name).strip()


def _response(status: int, code: str, message: str, retry_after: int | None = None) -> bytes:
    body = json.dumps(ApiError(status, code, message).body()).encode()
    retry = "" if retry_after is None else f"Retry-After: {retry_after}\r\n"
    head = (f"HTTP/1.1 {status} {_REASONS.get(status, 'Error')}\r\nConnection: close\r\n{retry}"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n")
    return head.encode("latin-1") + body


class MalformedBody(ApiError):
    def __init__(self, exc: BaseException) -> None:
        kind = "the body ended early" if isinstance(exc, NoMoreData) else _words(type(exc).__name__)
        super().__init__(400, "malformed_body", f"the request body is malformed ({kind})")


class GuardedInput:
    """`wsgi.input` whose gunicorn parse errors (bad chunked encoding, a body cut short) become a 400
    `malformed_body` for the app's error handler, instead of a 500."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def _call(self, name: str, *args: Any) -> Any:
        try:
            return getattr(self._inner, name)(*args)
        except (ParseException, NoMoreData) as exc:
            raise MalformedBody(exc) from None

    def read(self, *args: Any) -> bytes:
        return self._call("read", *args)

    def readline(self, *args: Any) -> bytes:
        return self._call("readline", *args)

    def readlines(self, *args: Any) -> list[bytes]:
        return self._call("readlines", *args)

    def __iter__(self) -> "GuardedInput":
        return self

    def __next__(self) -> bytes:
        line = self.readline()
        if not line:
            raise StopIteration
        return line


def guard_input(wsgi_app: Any) -> Any:
    """The app with its `wsgi.input` guarded (`GuardedInput`)."""
    def app(environ: dict[str, Any], start_response: Any) -> Any:
        if "wsgi.input" in environ:
            environ["wsgi.input"] = GuardedInput(environ["wsgi.input"])
        return wsgi_app(environ, start_response)
    return app
