"""A log line at most once a minute for a condition that repeats with every request.

A producer that retries as fast as it is refused would otherwise write one line a refusal, and
on a full disk the log usually shares that disk.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Hashable


class LogEvery:
    """``due(key)`` answers whether to log ``key`` now: its first time, then at most once every
    ``seconds``. The answer is the number of times it kept quiet about ``key`` since its last
    line (``None``: keep quiet now)."""

    def __init__(self, seconds: float = 60.0, clock: Callable[[], float] = time.monotonic) -> None:
        self._seconds = seconds
        self._clock = clock
        self._lock = threading.Lock()
        # key -> (when it was last logged, how many times it was kept quiet since)
        self._keys: dict[Hashable, tuple[float, int]] = {}

    def due(self, key: Hashable) -> int | None:
        now = self._clock()
        with self._lock:
            last = self._keys.get(key)
            if last is None or now - last[0] >= self._seconds:
                self._keys[key] = (now, 0)
                return 0 if last is None else last[1]
            self._keys[key] = (last[0], last[1] + 1)
            return None
