"""Per-client token buckets: `rate` requests per second on average, bursts of `burst`."""
from __future__ import annotations

import math
import threading
import time


class RateLimiter:
    def __init__(self, rate: float, burst: int, max_clients: int = 10000) -> None:
        self.rate, self.burst, self.max_clients = rate, burst, max_clients
        self._buckets: dict[str, tuple[float, float]] = {}  # client -> (tokens, last refill time)
        self._lock = threading.Lock()

    def take(self, client: str) -> int | None:
        """None if the request may go ahead, else the seconds to wait (for Retry-After)."""
        now = time.monotonic()
        with self._lock:
            tokens, last = self._buckets.get(client, (float(self.burst), now))
            tokens = min(float(self.burst), tokens + (now - last) * self.rate)
            if tokens >= 1.0:
                if len(self._buckets) >= self.max_clients and client not in self._buckets:
                    self._forget_full(now)
                self._buckets[client] = (tokens - 1.0, now)
                return None
            self._buckets[client] = (tokens, now)
            return max(1, math.ceil((1.0 - tokens) / self.rate))

    def _forget_full(self, now: float) -> None:
        """Drop buckets that have refilled completely: they hold no information."""
        for client, (tokens, last) in list(self._buckets.items()):
            if tokens + (now - last) * self.rate >= self.burst:
                del self._buckets[client]
