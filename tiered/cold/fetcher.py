"""The cold-read path: messages the hot store no longer (or never) holds, served from segments.

- Manifests are cached per queue and refreshed after ``manifest_ttl_s`` (or when a read runs
  past the cached end), so a random read costs two ranged GETs (offset-table entries, records).
- A byte-bounded read-ahead cache holds decoded batches; a sequential reader's next batch is
  fetched in the background while it consumes the current one.
- The fetcher owns its thread pool (``workers``): replays from the archive queue there, bounded,
  and never run on the broker's append path.
- A missing or damaged object raises ``SegmentError``: loud, never a silent gap.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from tiered.cold.manifest import ManifestLog, QueueManifest, queue_prefix
from tiered.cold.segment import SegmentError, SegmentInfo, SegmentReader
from tiered.cold.storage import ObjectStore
from tiered.record import StoredMessage

log = logging.getLogger(__name__)

# A read fetches about this many bytes of records with one ranged GET: big enough that request
# latency is not the limit, small enough for a consumer's first message to come quickly.
BATCH_BYTES = 1 << 20
# How many batches past the current one a sequential reader has in flight.
READ_AHEAD = 2


class ColdFetcher:
    def __init__(
        self,
        tier: ObjectStore,
        cluster: str,
        broker: str,
        *,
        workers: int = 4,
        cache_bytes: int = 64 << 20,
        manifest_ttl_s: float = 5.0,
        observe: Callable[[float, int], None] | None = None,
    ) -> None:
        """``observe(seconds, bytes)`` is told of every segment read (metrics)."""
        self.tier = tier
        self.cluster = cluster
        self.broker = broker
        self.cache_bytes = cache_bytes
        self.manifest_ttl_s = manifest_ttl_s
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="tmq-cold-fetch")
        self._manifests: dict[tuple[str, int], tuple[float, QueueManifest]] = {}
        self._cache: OrderedDict[tuple[str, int], list[StoredMessage]] = OrderedDict()
        self._cached_bytes = 0
        self._inflight: dict[tuple[str, int], Future[list[StoredMessage]]] = {}
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0
        self.bytes_fetched = 0
        self._observe = observe

    # -- manifests -------------------------------------------------------------------------------

    def manifest(self, topic: str, queue_id: int, *, refresh: bool = False) -> QueueManifest:
        key = (topic, queue_id)
        cached = self._manifests.get(key)
        if cached is None or refresh or time.monotonic() - cached[0] > self.manifest_ttl_s:
            prefix = queue_prefix(self.cluster, self.broker, topic, queue_id)
            cached = (time.monotonic(), ManifestLog(self.tier, prefix).load())
            self._manifests[key] = cached
        return cached[1]

    def set_manifest(self, topic: str, queue_id: int, manifest: QueueManifest) -> None:
        """A manifest this process just committed: newer than anything cached."""
        self._manifests[(topic, queue_id)] = (time.monotonic(), manifest)

    def start_offset(self, topic: str, queue_id: int) -> int | None:
        m = self.manifest(topic, queue_id)
        return m.start_offset if m.segments else None

    def end_offset(self, topic: str, queue_id: int) -> int:
        return self.manifest(topic, queue_id).end_offset

    # -- reads -----------------------------------------------------------------------------------

    def get(
        self,
        topic: str,
        queue_id: int,
        offset: int,
        max_count: int,
        tag_filter: Callable[[StoredMessage], bool] | None = None,
        max_bytes: int = 4 << 20,
    ) -> tuple[list[StoredMessage], int]:
        """Up to ``max_count`` messages from ``offset`` within one segment, and the next offset.
        Raises ``SegmentError`` when the archive does not hold ``offset``."""
        manifest = self.manifest(topic, queue_id)
        info = manifest.find(offset)
        if info is None and offset >= manifest.end_offset:
            manifest = self.manifest(topic, queue_id, refresh=True)
            info = manifest.find(offset)
        if info is None:
            raise SegmentError(
                f"{topic}/{queue_id}: offset {offset} is not in the archive "
                f"[{manifest.start_offset}, {manifest.end_offset})"
            )
        out: list[StoredMessage] = []
        size = 0
        next_offset = offset
        while next_offset < info.end_offset and len(out) < max_count and size < max_bytes:
            batch = self._batch(info, next_offset)
            for m in batch[next_offset - batch[0].queue_offset :]:
                next_offset = m.queue_offset + 1
                if tag_filter is None or tag_filter(m):
                    out.append(m)
                    size += m.size
                    if len(out) >= max_count or size >= max_bytes:
                        break
        return out, next_offset

    @staticmethod
    def _batch_len(info: SegmentInfo) -> int:
        """Messages per batch in this segment, from its average record size. Batches are fixed
        slices of the segment, so concurrent readers share them; one batch never holds more
        than the whole segment (64 MiB by default), however uneven its records are."""
        average = max(1, info.size // max(1, info.count))
        return max(16, min(4096, BATCH_BYTES // average))

    def _batch(self, info: SegmentInfo, offset: int) -> list[StoredMessage]:
        """The cached batch holding ``offset``."""
        n = self._batch_len(info)
        start = info.base_offset + (offset - info.base_offset) // n * n
        key = (info.key, start)
        with self._lock:
            batch = self._cache.get(key)
            if batch is not None:
                self._cache.move_to_end(key)
                self.hits += 1
            future = self._inflight.get(key) if batch is None else None
        if batch is None:
            if future is None:
                self.misses += 1
                future = self._submit(info, start)
            batch = future.result()
        for ahead in range(1, READ_AHEAD + 1):  # read-ahead for a sequential reader
            nxt = start + ahead * n
            if nxt >= info.end_offset:
                break
            with self._lock:
                wanted = (info.key, nxt) not in self._cache
            if wanted:
                self._submit(info, nxt)  # joins a fetch already in flight
        return batch

    def _submit(self, info: SegmentInfo, start: int) -> Future[list[StoredMessage]]:
        key = (info.key, start)
        with self._lock:
            existing = self._inflight.get(key)
            if existing is not None:
                return existing
            future = self._pool.submit(self._fetch, info, start)
            self._inflight[key] = future
        return future

    def _fetch(self, info: SegmentInfo, start: int) -> list[StoredMessage]:
        key = (info.key, start)
        try:
            started = time.perf_counter()
            n = self._batch_len(info)
            batch = SegmentReader(self.tier, info).read(start, n, max_bytes=1 << 62)
            size = sum(m.size for m in batch)
            self.bytes_fetched += size
            if self._observe is not None:
                self._observe(time.perf_counter() - started, size)
            with self._lock:
                self._cache[key] = batch
                self._cached_bytes += size
                while self._cached_bytes > self.cache_bytes and len(self._cache) > 1:
                    _, evicted = self._cache.popitem(last=False)
                    self._cached_bytes -= sum(m.size for m in evicted)
            return batch
        finally:
            with self._lock:
                self._inflight.pop(key, None)

    def offset_for_timestamp(self, topic: str, queue_id: int, timestamp_ms: int) -> int:
        manifest = self.manifest(topic, queue_id)
        for info in manifest.segments:
            if info.max_store_timestamp >= timestamp_ms:
                return SegmentReader(self.tier, info).offset_for_timestamp(timestamp_ms)
        return manifest.end_offset

    def query_by_key(
        self, topic: str, queue_id: int, key: str, begin_ms: int, end_ms: int, limit: int
    ) -> list[StoredMessage]:
        found: list[StoredMessage] = []
        for info in reversed(self.manifest(topic, queue_id).segments):
            if info.max_store_timestamp < begin_ms or info.min_store_timestamp > end_ms:
                continue
            reader = SegmentReader(self.tier, info)
            for offset in reversed(reader.offsets_for_key(topic, key)):
                [msg] = reader.read(offset, 1)
                if (
                    key in msg.keys or msg.msg_id == key
                ) and begin_ms <= msg.store_timestamp <= end_ms:
                    found.append(msg)
                    if len(found) >= limit:
                        return found
        return found

    @property
    def hit_ratio(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 0.0

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
