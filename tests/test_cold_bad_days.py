"""Bad days of the cold path rewritten in decisions 251-253: the cold worker's native gather and
span check, spans crossing the worker pipe out of band, no read-back after a PUT that wrote,
and read-ahead across segment ends. Real processes (the cold worker is a child), LocalStack
behind the HTTP fault proxy (localstack/fault_proxy.py), operator commands racing the offloader.

What every test pins: a cold reader sees the archive's messages, whole and in order, or a clear
error; never a gap, a short read taken for the queue's end, or wrong bytes; and once the store
heals, it reads everything again."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import S3Endpoint

from offload.offloader import Offloader, OffloadPolicy
from tiered.cold.fetcher import ColdFetcher
from tiered.cold.segment import SegmentError
from tiered.cold.storage import RetryPolicy, StorageError, open_store
from tiered.cold.worker import ColdWorker
from tiered.config import StoreConfig
from tiered.record import Message
from tiered.store import MessageStore

# A quick retry policy: the fault tests wait on it while the proxy fails every request.
QUICK = RetryPolicy(attempts=2, base_delay_s=0.05, max_delay_s=0.1)


@pytest.fixture
def hot(tmp_path: Path) -> Iterator[MessageStore]:
    store = MessageStore(StoreConfig(data_dir=tmp_path / "hot", commitlog_file_size=256 << 10))
    store.start()
    yield store
    store.shutdown()


def fill(store: MessageStore, n: int, seed: int = 5) -> list[bytes]:
    rng = random.Random(seed)
    bodies = [rng.randbytes(rng.randint(200, 900)) for _ in range(n)]
    store.put_messages([Message(topic="t", queue_id=0, body=b) for b in bodies])
    assert store.wait_dispatched(10)
    return bodies


@pytest.fixture
def proxied(fault_proxy: Any, bucket: str) -> tuple[str, dict[str, Any]]:
    """The tier's URL and the options that reach it through the fault proxy."""
    return f"s3://{bucket}/tier", S3Endpoint(fault_proxy.url, "proxy").storage_options()


@pytest.fixture
def worker(proxied: tuple[str, dict[str, Any]]) -> Iterator[ColdWorker]:
    """The cold worker (a child process) talking to the tier through the fault proxy."""
    w = ColdWorker(*proxied, QUICK, threads=2, max_inflight=8)
    w.start()
    yield w
    w.close()


def replay(fetcher: ColdFetcher, end: int) -> list[bytes]:
    """Every body from offset 0 to ``end``, as a replaying consumer reads them."""
    read: list[bytes] = []
    offset = 0
    while offset < end:
        messages, nxt = fetcher.get("t", 0, offset, 100)
        assert messages and nxt > offset, f"no progress at {offset} (next {nxt})"
        assert [m.queue_offset for m in messages] == list(range(offset, offset + len(messages)))
        read += [m.body for m in messages]
        offset = nxt
    return read


def test_wrong_bytes_from_the_store_fail_reads_until_healed_then_every_message_reads(
    fault_proxy: Any,
    worker: ColdWorker,
    hot: MessageStore,
    proxied: tuple[str, dict[str, Any]],
    s3: S3Endpoint,
) -> None:
    bodies = fill(hot, 900)
    direct = open_store(proxied[0], s3.storage_options())
    Offloader(hot, direct, "c", "b", OffloadPolicy(segment_max_messages=300)).offload_queue("t", 0)
    tier = open_store(*proxied, QUICK)
    fetcher = ColdFetcher(tier, "c", "b", runner=worker, read_timeout_s=20)
    try:
        assert fetcher.manifest("t", 0).end_offset == 900
        # Every ranged GET answers with one bit flipped (S3 checks no checksum of a range): the
        # offset tables and the records the reads fetch are all wrong bytes now.
        fault_proxy.set(corrupt=True, methods=["GET"])
        for offset in (0, 300, 650):
            with pytest.raises((SegmentError, StorageError)):
                fetcher.get("t", 0, offset, 50)
        assert fault_proxy.snapshot()["counters"]["corrupted"] >= 3
        fault_proxy.heal()
        assert replay(fetcher, 900) == bodies
    finally:
        fetcher.close()
