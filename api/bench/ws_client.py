"""One WebSocket request, timed from the client's side: first audio and total time (for `bench-api`).

Uses simple-websocket's client (already a runtime dependency of the server), so the bench needs nothing extra.
"""
from __future__ import annotations

import json
import time
from typing import Any, Sequence

from simple_websocket import Client, ConnectionClosed


def measure_ws(url: str, pieces: Sequence[str], voice: str | int | None = None, fmt: str = "pcm",
               api_key: str | None = None, timeout: float = 600.0, **start: Any) -> dict[str, Any]:
    """Send `pieces` as `text` messages to `url` (ws://host:port/v1/audio/stream) after `start`, then `end`.

    Returns first_audio_s (connect -> first binary frame), total_s (connect -> `done`), audio_s (the server's
    `done`), segments and audio_bytes. An `error` event raises RuntimeError with its code and message.
    """
    began = time.perf_counter()
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    ws = Client.connect(url, headers=headers)
    first_audio: float | None = None
    audio_bytes = segments = 0
    try:
        ws.send(json.dumps({"type": "start", "voice": voice, "format": fmt, **start}))
        for piece in pieces:
            ws.send(json.dumps({"type": "text", "text": piece}))
        ws.send(json.dumps({"type": "end"}))
        while True:
            data = ws.receive(timeout=timeout)
            if data is None:
                raise RuntimeError(f"no message from the server for {timeout:.0f} s")
            if isinstance(data, bytes):
                first_audio = first_audio if first_audio is not None else time.perf_counter() - began
                audio_bytes += len(data)
                continue
            event = json.loads(data)
            if event["type"] == "segment":
                segments += 1
            elif event["type"] == "error":
                raise RuntimeError(f"{event['code']}: {event['message']}")
            elif event["type"] == "done":
                return {"first_audio_s": first_audio if first_audio is not None else float("nan"),
                        "total_s": time.perf_counter() - began, "audio_s": event["audio_s"],
                        "segments": segments, "audio_bytes": audio_bytes}
    except ConnectionClosed:
        raise RuntimeError("the server closed the WebSocket before `done`") from None
    finally:
        try:
            ws.close()
        except ConnectionClosed:  # the server closed first, after `done` or `error`
            pass
