"""The Wyoming server's transport, below the TTS handler (`wyoming.py`, which gives the events their meaning):
where it listens, the cap on its connections, and each connection's event loop with its bounds.

- every event is read bounded and checked (`wyoming_events`); a malformed or oversized one -> `error`
  `bad_request` / `event_too_large`, then a normal close (the byte stream cannot be trusted after it);
- beyond `wyoming_max_connections` -> `too_many_connections`; nothing received for `wyoming_idle_timeout_s` while
  the client waits for nothing -> `idle_timeout`; each then a normal close;
- a normal close after an `error` event is a FIN after it, not a reset that could lose it: what the client still
  sends is read and dropped a bounded while first.
One asyncio loop reads every client of a server; standalone (`cosyedge wyoming`) it is the command's, beside
`cosyedge serve` a daemon thread's (`start_in_thread`).
"""
from __future__ import annotations

import asyncio
import logging
import threading
from typing import Callable
from urllib.parse import urlparse

from wyoming.error import Error
from wyoming.server import AsyncEventHandler

from cosyedge.api.config import ServiceConfig
from cosyedge.api.errors import ApiError
from cosyedge.api.wyoming_events import max_event_bytes, read_event
from cosyedge.device import InputError

log = logging.getLogger("cosyedge.wyoming")

LINGER_S, LINGER_BYTES = 2.0, 1 << 20  # after an error event that ends a connection: what is read and dropped


class Connection(AsyncEventHandler):
    """One client connection's transport: its events read as they arrive, each bounded and checked, and handed
    to `handle_event` (the handler's); an error that ends the connection is an `error` event, then a normal close."""

    def __init__(self, config: ServiceConfig, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        super().__init__(reader, writer)
        self.config = config

    def busy(self) -> bool:
        """Whether the client waits for something from the server (then it is not idle, though it sends nothing)."""
        return False

    async def run(self) -> None:
        """Events as they arrive, each read bounded and checked (`wyoming_events`); a malformed one is answered
        with an `error` event, then the connection closes normally."""
        limit, idle = max_event_bytes(self.config.max_text_len), self.config.wyoming_idle_timeout_s
        read: asyncio.Future | None = None
        try:
            while True:
                read = read or asyncio.ensure_future(read_event(self.reader, limit))
                if not (await asyncio.wait({read}, timeout=idle))[0]:
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
                if event is None:
                    break
                await self.handle_event(event)
        finally:
            await self.disconnect()
            self.writer.close()

    async def end(self, why: ApiError) -> None:
        """The connection ends on an error: its event, then a normal close."""
        await self.send_error(why)
        await self._linger()

    async def send_error(self, why: ApiError) -> None:
        """`why` as an `error` event (its code and message), unless the client is gone."""
        try:
            await self.write_event(Error(text=why.message, code=why.code).event())
        except (ConnectionError, RuntimeError):  # the client is gone
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


async def serve_async(connect: Connect, config: ServiceConfig, uri: str,
                      started: Callable[[int], None] = lambda port: None, zeroconf: str | None = None) -> None:
    """Listen on `uri` until cancelled, each client a `connect(reader, writer)`; `started(port)` once bound."""
    host, port = parse_uri(uri)

    open_now = [0]  # connections of this server (one loop: no lock)

    async def client(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connection = connect(reader, writer)
        if open_now[0] >= config.wyoming_max_connections:
            await connection.end(ApiError(503, "too_many_connections", "too many Wyoming connections; retry later"))
            writer.close()
            return
        open_now[0] += 1
        try:
            await connection.run()
        finally:
            open_now[0] -= 1

    server = await asyncio.start_server(client, host, port, limit=max_event_bytes(config.max_text_len))
    bound = server.sockets[0].getsockname()[1]
    if zeroconf is not None:
        try:
            from wyoming.zeroconf import HomeAssistantZeroconf  # needs the `zeroconf` package: only with the flag
        except ImportError:
            raise InputError("--zeroconf needs the zeroconf package (pip install zeroconf)") from None
        await HomeAssistantZeroconf(port=bound, name=zeroconf or None).register_server()
    started(bound)
    async with server:
        await server.serve_forever()


def start_in_thread(connect: Connect, config: ServiceConfig, uri: str) -> tuple[int, Callable[[], None]]:
    """The server on its own loop in a daemon thread (beside the HTTP service): (port, stop)."""
    loop = asyncio.new_event_loop()
    ready = threading.Event()
    port: list[int] = []
    task: list[asyncio.Task] = []

    def run() -> None:
        asyncio.set_event_loop(loop)
        task.append(loop.create_task(serve_async(connect, config, uri, lambda p: (port.append(p), ready.set()))))
        try:
            loop.run_until_complete(task[0])
        except (asyncio.CancelledError, OSError) as exc:
            if isinstance(exc, OSError):
                log.error("wyoming: cannot listen on %s: %s", uri, exc.strerror or exc)
        finally:
            ready.set()

    threading.Thread(target=run, name="cosyedge-wyoming", daemon=True).start()
    ready.wait()
    if not port:
        raise InputError(f"cannot listen on {uri}")
    return port[0], lambda: loop.call_soon_threadsafe(task[0].cancel)
