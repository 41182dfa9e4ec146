"""The Wyoming server's transport, below the TTS handler (`wyoming.py`, which gives the events their meaning):
where it listens, the cap on its connections, and each connection's event loop with its bounds.

- every event is read bounded and checked (`wyoming_events`); a malformed or oversized one -> `error`
  `bad_request` / `event_too_large`, then a normal close (the byte stream cannot be trusted after it);
- beyond `wyoming_max_connections` -> `too_many_connections`; nothing received for `wyoming_idle_timeout_s` while
  the client waits for nothing -> `idle_timeout`; each then a normal close;
- an event not taken by the client within `wyoming_write_timeout_s` (it reads nothing: the socket's buffers are
  full) -> the connection is cut (socket reset); what it held is dead-lettered and its places given back;
- a normal close after an `error` event is a FIN after it, not a reset that could lose it: what the client still
  sends is read and dropped a bounded while first;
- `Listener.drain` (beside `serve`, with the worker's drain: a bundle reload, a SIGTERM): the listening socket
  closes, each connection finishes what it holds in flight but takes nothing new (`shutting_down`), then closes;
  what is still busy at the timeout is cut. Standalone, a signal cancels the server as before.
One asyncio loop reads every client of a server; standalone (`cosyedge wyoming`) it is the command's, beside
`cosyedge serve` a daemon thread's (`start_in_thread`).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import socket
import struct
import threading
from typing import Callable
from urllib.parse import urlparse

from wyoming.error import Error
from wyoming.event import Event
from wyoming.server import AsyncEventHandler

from cosyedge.api.config import ServiceConfig
from cosyedge.api.errors import ApiError, ShuttingDown
from cosyedge.api.wyoming_events import max_event_bytes, read_event
from cosyedge.device import InputError

log = logging.getLogger("cosyedge.wyoming")

LINGER_S, LINGER_BYTES = 2.0, 1 << 20  # after an error event that ends a connection: what is read and dropped


class Connection(AsyncEventHandler):
    """One client connection's transport: its events read as they arrive, each bounded and checked, and handed
    to `handle_event` (the handler's); an error that ends the connection is an `error` event, then a normal close.
    While its server drains (`stopping`) it closes once it holds nothing in flight."""

    def __init__(self, config: ServiceConfig, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        super().__init__(reader, writer)
        self.config = config
        self.stopping = False  # the server drains: finish what is in flight, take nothing new, then close
        self.cut_by: ApiError | None = None  # why the server cut this connection short (None: it was not)
        self._wake = asyncio.Event()  # set while stopping, when what is in flight may have changed

    def busy(self) -> bool:
        """Whether the client waits for something from the server (then it is not idle, though it sends nothing)."""
        return False

    def in_flight(self) -> bool:
        """Whether the connection holds a request not yet answered (a drain lets it finish)."""
        return self.busy()

    def stop(self) -> None:
        """The server drains: the connection takes no new request and closes once nothing is in flight."""
        self.stopping = True
        self._wake.set()

    def changed(self) -> None:
        """What is in flight may have changed (some work ended): while stopping, the loop looks again."""
        if self.stopping:
            self._wake.set()

    def cut(self, why: ApiError) -> None:
        """End the connection now (a drain out of time, a client that reads nothing): its unsent output is dropped
        and the socket reset, so neither the process's file nor the kernel's buffers stay held for it."""
        self.cut_by = self.cut_by or why
        sock = self.writer.get_extra_info("socket")
        with contextlib.suppress(OSError):  # already closed: nothing left to reset
            if sock is not None:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.writer.transport.abort()

    async def run(self) -> None:
        """Events as they arrive, each read bounded and checked (`wyoming_events`); a malformed one is answered
        with an `error` event, then the connection closes normally."""
        limit, idle = max_event_bytes(self.config.max_text_len), self.config.wyoming_idle_timeout_s
        read: asyncio.Future | None = None
        woken: asyncio.Future | None = None
        try:
            while True:
                if self.stopping and not self.in_flight():
                    if read is not None:
                        read.cancel()  # before the close reads what the client still sends
                    await self.end(ShuttingDown())
                    break
                read = read or asyncio.ensure_future(read_event(self.reader, limit))
                woken = woken or asyncio.ensure_future(self._wake.wait())
                done = (await asyncio.wait({read, woken}, timeout=idle, return_when=asyncio.FIRST_COMPLETED))[0]
                if woken in done:
                    self._wake.clear()
                    woken = None
                    continue
                if not done:
                    if self.busy():  # the client waits for its audio: not idle
                        continue
                    read.cancel()
                    await self.end(ApiError(408, "idle_timeout", f"nothing received for {idle:.0f} s"))
                    break
                try:
                    event, read = read.result(), None
                except ApiError as exc:
                    await self.end(exc)
                    break
                except ConnectionError:  # the client reset the connection: it left, as at EOF
                    break
                if event is None:
                    break
                await self.handle_event(event)
        finally:
            if woken is not None:
                woken.cancel()
            await self.disconnect()
            self.writer.close()

    async def write_event(self, event: Event) -> None:
        """The event out, within `wyoming_write_timeout_s`: a client that reads nothing for that long is cut (its
        place and connection given back), never waited for."""
        if self.cut_by is not None:  # nothing more goes out: what the connection still holds fails alike
            raise self.cut_by
        timeout = self.config.wyoming_write_timeout_s
        try:
            await asyncio.wait_for(super().write_event(event), timeout)
        except asyncio.TimeoutError:
            why = ApiError(408, "write_timeout", f"the client read nothing for {timeout:.0f} s")
            self.cut(why)
            raise why from None

    async def end(self, why: ApiError) -> None:
        """The connection ends on an error: its event, then a normal close."""
        await self.send_error(why)
        await self._linger()

    async def send_error(self, why: ApiError) -> None:
        """`why` as an `error` event (its code and message), unless the client is gone or cut."""
        if self.cut_by is not None:
            return
        try:
            await self.write_event(Error(text=why.message, code=why.code).event())
        except (ConnectionError, RuntimeError, ApiError):  # the client is gone, or reads nothing and was cut
            pass

    async def _linger(self) -> None:
        """Before closing after an error event: say we are done, then read (and drop) what the client is still
        sending, a bounded while, so the close is a FIN after the error event, not a reset that could lose it."""
        try:
            self.writer.write_eof()
            deadline, dropped = asyncio.get_running_loop().time() + LINGER_S, 0
            while dropped < LINGER_BYTES and (left := deadline - asyncio.get_running_loop().time()) > 0:
                piece = await asyncio.wait_for(self.reader.read(65536), left)
                if not piece:
                    return
                dropped += len(piece)
        except (OSError, RuntimeError, asyncio.TimeoutError):  # the client is gone or keeps talking: close anyway
            pass


Connect = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Connection]


def parse_uri(uri: str) -> tuple[str, int]:
    """tcp://HOST:PORT (port 0: a free one)."""
    parsed = urlparse(uri)
    try:
        port = parsed.port
    except ValueError:
        port = None
    if parsed.scheme != "tcp" or not parsed.hostname or port is None:
        raise InputError(f"--uri must look like tcp://127.0.0.1:10200, not {uri[:64]!r}")
    return parsed.hostname, port


class Listener:
    """One Wyoming server: its listening socket and connections (at most `wyoming_max_connections` at once);
    `drain` stops accepting and lets each connection finish what it holds in flight, then closes it."""

    def __init__(self, connect: Connect, config: ServiceConfig) -> None:
        self.connect, self.config = connect, config
        self.connections: dict[Connection, asyncio.Task] = {}
        self.port = 0
        self.loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.AbstractServer | None = None
        self._over: asyncio.Future[None] | None = None  # done once drained: `serve` returns
        self._draining: asyncio.Task[None] | None = None
        # whether the drain cut nothing; set by the drain itself before `serve` returns, so a caller in another
        # thread hears it even though the loop stops at once after (a future chained from a task of the loop
        # was left unset when the loop stopped first: a reload waited out its whole timeout)
        self._drained: concurrent.futures.Future[bool] | None = None
        self._drain_lock = threading.Lock()

    async def serve(self, uri: str, started: Callable[[int], None] = lambda port: None,
                    zeroconf: str | None = None) -> None:
        """Listen on `uri` until drained or cancelled; `started(port)` once bound."""
        host, port = parse_uri(uri)
        self.loop = asyncio.get_running_loop()
        self._over = self.loop.create_future()
        self._server = await asyncio.start_server(self._client, host, port,
                                                  limit=max_event_bytes(self.config.max_text_len))
        self.port = self._server.sockets[0].getsockname()[1]
        try:
            if zeroconf is not None:
                try:
                    from wyoming.zeroconf import HomeAssistantZeroconf  # the `zeroconf` package: only with the flag
                except ImportError:
                    raise InputError("--zeroconf needs the zeroconf package (pip install zeroconf)") from None
                await HomeAssistantZeroconf(port=self.port, name=zeroconf or None).register_server()
            started(self.port)
            await self._over
        finally:
            self._server.close()

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connection = self.connect(reader, writer)
        if self._draining is not None:  # accepted as the listening socket closed
            refused: ApiError | None = ShuttingDown()
        elif len(self.connections) >= self.config.wyoming_max_connections:
            refused = ApiError(503, "too_many_connections", "too many Wyoming connections; retry later")
        else:
            refused = None
        if refused is not None:
            await connection.end(refused)
            writer.close()
            return
        self.connections[connection] = asyncio.current_task()  # type: ignore[assignment]
        try:
            await connection.run()
        finally:
            del self.connections[connection]

    def drain(self, timeout: float) -> concurrent.futures.Future[bool]:
        """From any thread, as often as wanted (the first call's `timeout` holds): stop accepting (a new connection
        is refused), let every connection finish what it holds in flight, taking nothing new (`shutting_down`),
        then close it; those still busy after `timeout` are cut (what they held is dead-lettered). The future
        says whether none was cut."""
        with self._drain_lock:
            if self._drained is not None:
                return self._drained
            self._drained = concurrent.futures.Future()
            if self.loop is None or self.loop.is_closed() or (self._over is not None and self._over.done()):
                self._drained.set_result(True)
            else:
                self.loop.call_soon_threadsafe(self._start_drain, timeout)
            return self._drained

    def _start_drain(self, timeout: float) -> None:
        self._draining = asyncio.ensure_future(self._drain_once(timeout))

    async def _drain_once(self, timeout: float) -> None:
        assert self._server is not None and self._over is not None
        self._server.close()
        for connection in self.connections:
            connection.stop()
        busy = set(self.connections.values())
        late = (await asyncio.wait(busy, timeout=timeout))[1] if busy else set()
        for connection, task in list(self.connections.items()):
            if task in late:
                connection.cut(ShuttingDown())
        if late:
            await asyncio.wait(late, timeout=LINGER_S)
        assert self._drained is not None
        self._drained.set_result(not late)
        if not self._over.done():
            self._over.set_result(None)


def start_in_thread(listener: Listener, uri: str) -> Listener:
    """`listener` on its own loop in a daemon thread (beside the HTTP service), once it listens."""
    loop = asyncio.new_event_loop()
    ready = threading.Event()

    def run() -> None:
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(listener.serve(uri, lambda _: ready.set()))
        except OSError as exc:
            log.error("wyoming: cannot listen on %s: %s", uri, exc.strerror or exc)
        finally:
            ready.set()

    threading.Thread(target=run, name="cosyedge-wyoming", daemon=True).start()
    ready.wait()
    if not listener.port:
        raise InputError(f"cannot listen on {uri}")
    return listener
