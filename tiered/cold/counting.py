"""An ``ObjectStore`` that counts the requests made through it, by kind: how benchmarks and
tests measure what a read costs (a random cold read must cost O(1) requests however large the
archive). Another implementation of the interface, like ``faults.py``."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from tiered.cold.storage import ObjectInfo, ObjectStore


class CountingObjectStore:
    def __init__(self, inner: ObjectStore) -> None:
        self.inner = inner
        self.url = inner.url
        self.calls: Counter[str] = Counter()  # method name -> requests

    def put_if_absent(self, key: str, data: bytes, *, crc32c: int | None = None) -> bool:
        self.calls["put_if_absent"] += 1
        return self.inner.put_if_absent(key, data, crc32c=crc32c)

    def put(self, key: str, data: bytes) -> None:
        self.calls["put"] += 1
        self.inner.put(key, data)

    def get(self, key: str) -> bytes:
        self.calls["get"] += 1
        return self.inner.get(key)

    def get_range(self, key: str, start: int, length: int) -> bytes:
        self.calls["get_range"] += 1
        return self.inner.get_range(key, start, length)

    def size(self, key: str) -> int | None:
        self.calls["size"] += 1
        return self.inner.size(key)

    def list(self, prefix: str) -> list[ObjectInfo]:
        self.calls["list"] += 1
        return self.inner.list(prefix)

    def delete(self, key: str) -> None:
        self.calls["delete"] += 1
        self.inner.delete(key)

    def children(self, prefix: str) -> Sequence[str]:
        self.calls["children"] += 1
        return self.inner.children(prefix)
