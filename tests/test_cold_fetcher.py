"""The cold fetcher's read-ahead: a sequential replay never waits at a segment's end, and asks
the tier for each segment's offset table once."""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path

from offload.offloader import Offloader, OffloadPolicy
from tiered.cold.counting import CountingObjectStore
from tiered.cold.fetcher import ColdFetcher
from tiered.cold.storage import ObjectStore, open_store
from tiered.config import StoreConfig
from tiered.record import Message
from tiered.store import MessageStore


class RangeLog(CountingObjectStore):
    """Counts ranged GETs by (key, start)."""

    def __init__(self, inner: ObjectStore) -> None:
        super().__init__(inner)
        self.ranges: Counter[tuple[str, int]] = Counter()

    def get_range(self, key: str, start: int, length: int) -> bytes:
        self.ranges[(key, start)] += 1
        return super().get_range(key, start, length)


def test_a_replay_reads_ahead_into_the_next_segment_and_each_table_once(tmp_path: Path) -> None:
    store = MessageStore(StoreConfig(data_dir=tmp_path / "hot"))
    store.start()
    try:
        bodies = [os.urandom(1000) for _ in range(1500)]
        store.put_messages([Message(topic="t", queue_id=0, body=b) for b in bodies])
        assert store.wait_dispatched()
        tier = RangeLog(open_store(f"file://{tmp_path}/tier"))
        policy = OffloadPolicy(segment_max_messages=300)
        Offloader(store, tier, "c", "b", policy).offload_queue("t", 0)
    finally:
        store.shutdown()
    fetcher = ColdFetcher(tier, "c", "b", cache_bytes=64 << 20)
    segments = fetcher.manifest("t", 0).segments
    assert len(segments) == 5
    tier.ranges.clear()
    read: list[bytes] = []
    offset = 0
    while offset < 1500:
        messages, offset = fetcher.get("t", 0, offset, 100)
        read += [m.body for m in messages]
    fetcher.close()
    assert read == bodies
    # Only the very first batch was waited for: every later one was read ahead, the first of
    # each segment while the previous segment was being read.
    assert fetcher.misses == 1, (fetcher.misses, fetcher.hits)
    assert all(tier.ranges[(s.key, s.offsets_at)] == 1 for s in segments), tier.ranges


def test_a_replay_fetches_its_batches_a_few_large_gets_at_a_time(tmp_path: Path) -> None:
    """Decision 333: read-ahead asks for ``GET_BATCHES`` consecutive batches with one ranged GET
    (a store's cost is per request as much as per byte). Reads bounded by count and by bytes
    still return exactly the messages in order, the one that reaches ``max_bytes`` last."""
    store = MessageStore(StoreConfig(data_dir=tmp_path / "hot"))
    store.start()
    try:
        bodies = [os.urandom(1000 + i % 7) for i in range(24_000)]
        for at in range(0, len(bodies), 4000):
            store.put_messages(
                [Message(topic="t", queue_id=0, body=b) for b in bodies[at : at + 4000]]
            )
        assert store.wait_dispatched()
        tier = RangeLog(open_store(f"file://{tmp_path}/tier"))
        Offloader(store, tier, "c", "b", OffloadPolicy()).offload_queue("t", 0)
    finally:
        store.shutdown()
    fetcher = ColdFetcher(tier, "c", "b", cache_bytes=64 << 20)
    [segment] = fetcher.manifest("t", 0).segments
    batch = ColdFetcher._batch_len(segment)
    batches = -(-len(bodies) // batch)
    assert batches >= 16
    tier.ranges.clear()
    read: list[bytes] = []
    offset, calls = 0, 0
    while offset < len(bodies):
        count, limit = (300, 1 << 30) if calls % 2 else (10_000, 50_000)
        messages, nxt = fetcher.get("t", 0, offset, count, max_bytes=limit)
        assert [m.queue_offset for m in messages] == list(range(offset, nxt))
        sizes = [m.size for m in messages]
        assert len(messages) <= count
        assert sum(sizes[:-1]) < limit, "no message past the one that reaches max_bytes"
        assert len(messages) == count or sum(sizes) >= limit or nxt == len(bodies)
        read += [m.body for m in messages]
        offset, calls = nxt, calls + 1
    fetcher.close()
    assert read == bodies
    record_gets = sum(n for (_, start), n in tier.ranges.items() if start != segment.offsets_at)
    # One GET for the first batch, then one per GET_BATCHES (4) batches: far fewer than one a
    # batch (the earlier read-ahead), whatever order the fetches finished in.
    assert record_gets <= 2 + batches // 4 + 2, (record_gets, batches)
    assert fetcher.misses == 1, (fetcher.misses, fetcher.hits)
