"""The API's routes as blueprints, grouped by concern; `create_app` registers every one of `BLUEPRINTS`."""
from __future__ import annotations

from cosyedge.api.routes import native, openai, ops, page, voices, websocket

BLUEPRINTS = (openai.blueprint, native.blueprint, voices.blueprint, ops.blueprint, page.blueprint, websocket.blueprint)
# rate-limited (the WebSocket route: its handshake)
SYNTHESIS_ENDPOINTS = frozenset({"openai.speech", "native.tts", "native.tts_batch", "websocket.audio_stream"})
