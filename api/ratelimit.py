"""Per-client token buckets: `rate` requests per second on average, bursts of `burst`.

The table is bounded: past `max_clients` the least recently seen client is forgotten (it starts again with a
full bucket), so a client that rotates its identity can never grow the table.
"""
from __future__ import annotations

import math
import threading
import time
from collections import OrderedDict


class RateLimiter:
    def __init__(self, rate: float, burst: int, max_clients: int = 10000) -> None:
        self.rate, self.burst, self.max_clients = rate, burst, max_clients
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()  # client -> (tokens, last refill)
        self._lock = threading.Lock()

    def take(self, client: str) -> int | None:
        """None if the request may go ahead, else the seconds to wait (for Retry-After)."""
        now = time.monotonic()
        with self._lock:
            tokens, last = self._buckets.pop(client, (float(self.burst), now))
            tokens = min(float(self.burst), tokens + (now - last) * self.rate)
            allowed = tokens >= 1.0
            self._buckets[client] = (tokens - 1.0 if allowed else tokens, now)  # now the most recently seen
            while len(self._buckets) > self.max_clients:
                self._buckets.popitem(last=False)
            return None if allowed else max(1, math.ceil((1.0 - tokens) / self.rate))

    def __len__(self) -> int:
        return len(self._buckets)
