"""The cold fetcher's read-ahead: a sequential replay never waits at a segment's end, and asks
the tier for each segment once (its whole object); a random read asks for its batch alone."""

from __future__ import annotations

import os
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from conftest import S3Endpoint

from broker.reply import encode_pull_replies
from offload.offloader import Offloader, OffloadPolicy
from tiered.cold.counting import CountingObjectStore
from tiered.cold.fetcher import ColdFetcher
from tiered.cold.segment import SegmentInfo
from tiered.cold.storage import ObjectStore, open_store
from tiered.cold.worker import ColdWorker
from tiered.config import StoreConfig
from tiered.formats import CQ_ENTRY_SIZE
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


def _five_segments(tmp_path: Path) -> tuple[RangeLog, list[bytes]]:
    """1,500 messages of 1,000 bytes in queue t/0, offloaded to a file tier in five segments
    of 300 (one batch each); the tier, counting ranged GETs, and the bodies."""
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
    return tier, bodies


def replay(fetcher: ColdFetcher, end: int) -> list[bytes]:
    """Every body from offset 0 to ``end``, 100 messages a read; the fetcher closed after."""
    read: list[bytes] = []
    offset = 0
    while offset < end:
        messages, offset = fetcher.get("t", 0, offset, 100)
        read += [m.body for m in messages]
    fetcher.close()
    return read


def test_a_replay_reads_ahead_into_the_next_segment_each_with_one_get(tmp_path: Path) -> None:
    tier, bodies = _five_segments(tmp_path)
    fetcher = ColdFetcher(tier, "c", "b", cache_bytes=64 << 20)
    segments = fetcher.manifest("t", 0).segments
    assert len(segments) == 5
    tier.ranges.clear()
    assert replay(fetcher, 1500) == bodies
    # Only the very first batch was waited for: every later one was read ahead, the first of
    # each segment while the previous segment was being read. Each segment is one GET of the
    # whole object, its offset table taken from those bytes (decision 1220).
    assert fetcher.misses == 1, (fetcher.misses, fetcher.hits)
    assert tier.ranges == Counter({(s.key, 0): 1 for s in segments}), tier.ranges


def test_a_segment_the_cache_cannot_hold_twice_is_read_by_ranges(tmp_path: Path) -> None:
    """Decision 1220's bound: a segment is read whole only when the cache, which holds it in
    full, holds it twice (the one being read and the next); else a replay reads its offset
    table and its batches with ranged GETs, as before, and still reads every message."""
    tier, bodies = _five_segments(tmp_path)
    segments = ColdFetcher(tier, "c", "b").manifest("t", 0).segments
    fetcher = ColdFetcher(tier, "c", "b", cache_bytes=segments[0].offsets_at * 3 // 2)
    tier.ranges.clear()
    assert replay(fetcher, 1500) == bodies
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


def _archive_behind_proxy(
    tmp_path: Path, s3: S3Endpoint, bucket: str, bodies: list[bytes], per_segment: int
) -> list[SegmentInfo]:
    """Queue t/0 of ``bodies`` offloaded straight to LocalStack in segments of ``per_segment``
    messages; their manifest entries."""
    store = MessageStore(StoreConfig(data_dir=tmp_path / "hot"))
    store.start()
    try:
        for at in range(0, len(bodies), 1000):
            chunk = bodies[at : at + 1000]
            store.put_messages([Message(topic="t", queue_id=0, body=b) for b in chunk])
        assert store.wait_dispatched()
        direct = open_store(f"s3://{bucket}/tier", s3.storage_options())
        policy = OffloadPolicy(segment_max_messages=per_segment)
        Offloader(store, direct, "c", "b", policy).offload_queue("t", 0)
        return ColdFetcher(direct, "c", "b").manifest("t", 0).segments
    finally:
        store.shutdown()


def _segment_gets(proxy: Any, bucket: str, info: SegmentInfo) -> list[str]:
    """The Range headers of the GETs of ``info``'s object the proxy forwarded ("": whole)."""
    path = f"/{bucket}/tier/{info.key}"
    return sorted(
        r
        for (method, p, r), n in proxy.requests.items()
        for _ in range(n)
        if method == "GET" and p == path
    )


@pytest.mark.parametrize("replies", [True, False], ids=["replies", "decoded"])
def test_a_sequential_replay_asks_the_store_once_per_segment(
    replies: bool, tmp_path: Path, s3: S3Endpoint, bucket: str, fault_proxy: Any
) -> None:
    """Decision 1220, counted at HTTP between the cold worker (a child process, as in the
    broker) and LocalStack: a replay from the archive's start GETs each segment's object once,
    whole, its offset table and every batch of records from those bytes, where the ranged reads
    asked for the table and then for runs of batches (three requests or more a segment)."""
    bodies = [os.urandom(1000) for _ in range(6000)]
    segments = _archive_behind_proxy(tmp_path, s3, bucket, bodies, 2000)
    proxied = S3Endpoint(fault_proxy.url, "proxy").storage_options()
    worker = ColdWorker(f"s3://{bucket}/tier", proxied, threads=2)
    worker.start()
    fetcher = ColdFetcher(
        open_store(f"s3://{bucket}/tier", proxied),
        "c",
        "b",
        runner=worker,
        reply_encoder=encode_pull_replies if replies else None,
        read_timeout_s=30,
    )
    try:
        assert [ColdFetcher._batch_len(s) < s.count for s in segments] == [True] * 3
        fault_proxy.requests.clear()
        offset, read = 0, 0
        while offset < len(bodies):
            if replies:
                out, nxt, body_bytes = fetcher.get_replies("t", 0, offset, 256)
                assert len(out) == nxt - offset
                offset, read = nxt, read + body_bytes
            else:
                messages, offset = fetcher.get("t", 0, offset, 256)
                assert [m.body for m in messages] == bodies[read : read + len(messages)]
                read += len(messages)
        assert read == (sum(map(len, bodies)) if replies else len(bodies))
    finally:
        fetcher.close()
        worker.close()
    for info in segments:
        assert _segment_gets(fault_proxy, bucket, info) == [f"bytes=0-{info.size - 1}"], info.key


def test_a_random_read_gets_its_batch_with_a_range_never_its_whole_segment(
    tmp_path: Path, s3: S3Endpoint, bucket: str, fault_proxy: Any
) -> None:
    """A read of one message from the middle of a segment (a consumer resuming there, an old
    message looked up) asks for its offset table and its own batch with ranged GETs: it does
    not pay for the whole object (decision 1220). Only the segment after it, which the
    read-ahead enters at its start, is read whole."""
    bodies = [os.urandom(1000) for _ in range(6000)]
    first, second, third = _archive_behind_proxy(tmp_path, s3, bucket, bodies, 2000)
    proxied = S3Endpoint(fault_proxy.url, "proxy").storage_options()
    fetcher = ColdFetcher(open_store(f"s3://{bucket}/tier", proxied), "c", "b", read_timeout_s=30)
    try:
        fault_proxy.requests.clear()
        offset = second.base_offset + second.count // 2
        [message], nxt = fetcher.get("t", 0, offset, 1)
        assert (message.body, nxt) == (bodies[offset], offset + 1)
        deadline = time.monotonic() + 30
        while fetcher._inflight and time.monotonic() < deadline:  # the read-ahead settles
            time.sleep(0.05)
    finally:
        fetcher.close()
    gets = _segment_gets(fault_proxy, bucket, second)
    table = f"bytes={second.offsets_at}-{second.offsets_at + second.count * CQ_ENTRY_SIZE - 1}"
    assert table in gets and f"bytes=0-{second.size - 1}" not in gets, gets
    fetched = sum(int(b) - int(a) + 1 for a, b in (r[6:].split("-") for r in gets))
    assert fetched < second.size * 3 // 4, (fetched, second.size)
    assert _segment_gets(fault_proxy, bucket, first) == []
    assert _segment_gets(fault_proxy, bucket, third) == [f"bytes=0-{third.size - 1}"]
