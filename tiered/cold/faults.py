"""A fault-injecting ``ObjectStore``: another implementation of the same interface.

It fails a share of calls with ``StorageError``, as S3 does with 503 SlowDown, and a share of
writes *after* they landed, as an S3 500 does when the PUT in fact succeeded (the case that makes
idempotent uploads necessary). It can also black-hole every call for a while: calls then fail
with a timeout instead of hanging. Deterministic for a given seed.
"""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
from collections.abc import Sequence

from tiered.cold.storage import ObjectInfo, ObjectStore, StorageError


class FaultyObjectStore:
    def __init__(
        self,
        inner: ObjectStore,
        *,
        failure_rate: float = 0.0,
        fail_after_write_rate: float = 0.0,
        seed: int = 0,
    ) -> None:
        self.inner = inner
        self.url = inner.url
        self.failure_rate = failure_rate
        self.fail_after_write_rate = fail_after_write_rate
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self._blackhole_until = 0.0
        self.injected: Counter[str] = Counter()

    def blackhole(self, seconds: float) -> None:
        """Every call fails with a timeout for ``seconds``."""
        self._blackhole_until = time.monotonic() + seconds

    def _before(self, op: str) -> None:
        if time.monotonic() < self._blackhole_until:
            self.injected["timeout"] += 1
            raise StorageError(f"{op}: timed out (injected black hole)")
        with self._lock:
            fail = self._rng.random() < self.failure_rate
        if fail:
            self.injected["503"] += 1
            raise StorageError(f"{op}: 503 SlowDown (injected)")

    def _after_write(self, op: str) -> None:
        with self._lock:
            fail = self._rng.random() < self.fail_after_write_rate
        if fail:
            self.injected["500-after-write"] += 1
            raise StorageError(f"{op}: 500 InternalError after the write landed (injected)")

    def put_if_absent(self, key: str, data: bytes, *, crc32c: int | None = None) -> bool:
        self._before("put_if_absent")
        written = self.inner.put_if_absent(key, data, crc32c=crc32c)
        self._after_write("put_if_absent")
        return written

    def put(self, key: str, data: bytes) -> None:
        self._before("put")
        self.inner.put(key, data)
        self._after_write("put")

    def get(self, key: str) -> bytes:
        self._before("get")
        return self.inner.get(key)

    def get_range(self, key: str, start: int, length: int) -> bytes:
        self._before("get_range")
        return self.inner.get_range(key, start, length)

    def size(self, key: str) -> int | None:
        self._before("size")
        return self.inner.size(key)

    def list(self, prefix: str) -> list[ObjectInfo]:
        self._before("list")
        return self.inner.list(prefix)

    def delete(self, key: str) -> None:
        self._before("delete")
        self.inner.delete(key)

    def children(self, prefix: str) -> Sequence[str]:
        self._before("list")
        return self.inner.children(prefix)
