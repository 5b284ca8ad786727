"""Bad days of the cold path rewritten in decisions 251-253: the cold worker's native gather and
span check, spans crossing the worker pipe out of band, no read-back after a PUT that wrote,
and read-ahead across segment ends. Real processes (the cold worker is a child), LocalStack
behind the HTTP fault proxy (localstack/fault_proxy.py), operator commands racing the offloader.

What every test pins: a cold reader sees the archive's messages, whole and in order, or a clear
error; never a gap, a short read taken for the queue's end, or wrong bytes; and once the store
heals, it reads everything again."""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import S3Endpoint

from broker.metadata import TopicConfig
from offload.offloader import Offloader, OffloadPolicy
from offload.release import release_predicate
from tiered.cold.fetcher import ColdFetcher, ColdTierUnavailableError
from tiered.cold.segment import SegmentError
from tiered.cold.storage import RetryPolicy, StorageError, open_store
from tiered.cold.worker import ColdWorker
from tiered.config import StoreConfig
from tiered.record import Message
from tiered.store import GetStatus, MessageStore

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


@pytest.mark.parametrize(
    "fault",
    [
        {"truncate": True},  # the answer's body cut off halfway, the connection closed
        {"error_rate": 1.0, "error_status": 503},
        {"reset": True},
        {"delay_ms": 3000},  # slower than the read's deadline
    ],
    ids=["truncated", "503", "reset", "slow"],
)
def test_a_failing_store_is_a_retryable_error_never_a_short_read_and_reads_recover(
    fault: dict[str, Any],
    fault_proxy: Any,
    worker: ColdWorker,
    hot: MessageStore,
    proxied: tuple[str, dict[str, Any]],
    s3: S3Endpoint,
) -> None:
    bodies = fill(hot, 600)
    direct = open_store(proxied[0], s3.storage_options())
    # Segments of 100 messages, each one batch: the first read reads ahead into the second.
    Offloader(hot, direct, "c", "b", OffloadPolicy(segment_max_messages=100)).offload_queue("t", 0)
    tier = open_store(*proxied, QUICK)
    fetcher = ColdFetcher(tier, "c", "b", runner=worker, read_timeout_s=2.0)
    try:
        assert fetcher.manifest("t", 0).end_offset == 600
        first, nxt = fetcher.get("t", 0, 0, 10)  # the first batch and its read-ahead
        assert [m.body for m in first] == bodies[:10] and nxt == 10
        fault_proxy.set(**fault, methods=["GET"])
        # Offsets past what was read ahead, in three other segments: every one is the tier's
        # retryable "unavailable", never a shorter answer or another segment's messages.
        for offset in (450, 250, 599):
            with pytest.raises(ColdTierUnavailableError):
                messages, nxt = fetcher.get("t", 0, offset, 50)
                pytest.fail(f"read {len(messages)} messages at {offset} (next {nxt})")
        fault_proxy.heal()
        fetcher.read_timeout_s = 20
        assert replay(fetcher, 600) == bodies
    finally:
        fetcher.close()


@pytest.mark.parametrize("who", ["this broker", "another process"])
def test_retention_under_a_read_ahead_answers_expired_never_wrong_messages(
    who: str,
    fault_proxy: Any,
    worker: ColdWorker,
    tmp_path: Path,
    proxied: tuple[str, dict[str, Any]],
    s3: S3Endpoint,
) -> None:
    tier = open_store(*proxied, QUICK)
    fetcher = ColdFetcher(tier, "c", "b", runner=worker, read_timeout_s=20, manifest_ttl_s=3600)
    hot = MessageStore(
        StoreConfig(data_dir=tmp_path / "hot", commitlog_file_size=64 << 10), cold=fetcher
    )
    hot.start()
    try:
        bodies = fill(hot, 600)
        # The broker's offloader tells its fetcher of every commit; "another process" (a
        # master, read by this slave's fetcher) does not, so this fetcher's manifest is stale.
        offloader = Offloader(
            hot,
            tier,
            "c",
            "b",
            OffloadPolicy(segment_max_messages=100),
            on_commit=fetcher.set_manifest,
            runner=worker,
        )
        offloader.offload_queue("t", 0)
        topics = {"t": TopicConfig("t", queues=1, tiered=True)}
        assert hot.release_commitlog_files(release_predicate(hot, offloader, topics)) > 0
        hot_min = hot.hot_min_offset("t", 0)
        assert hot_min >= 400, hot_min
        first = hot.get_messages("t", 0, 0, 50)
        assert first.status is GetStatus.FOUND
        assert [m.body for m in first.messages] == bodies[:50]
        # Segments 0 and 1 are in the fetcher's cache now (the read and its read-ahead).
        segments = offloader.manifest("t", 0).segments
        expirer = (
            offloader
            if who == "this broker"
            else Offloader(hot, open_store(proxied[0], s3.storage_options()), "c", "b")
        )
        # Retention: the first three segments go (by size), their objects deleted.
        keep = sum(s.size for s in segments[3:])
        result = expirer.expire("t", 0, cutoff_ms=0, max_bytes=keep)
        assert result.segments == 3 and result.new_start_offset == 300
        for offset in (50, 150, 250, 299):
            got = hot.get_messages("t", 0, offset, 20)
            if got.status is GetStatus.FOUND:
                # Only a stale cache may still serve them, and only the very messages asked.
                assert who == "another process" and offset < 200, (offset, got.status)
                assert [m.queue_offset for m in got.messages] == list(
                    range(offset, offset + len(got.messages))
                )
                assert [m.body for m in got.messages] == bodies[offset : offset + 20]
            else:
                assert got.status is GetStatus.OFFSET_TOO_SMALL, (offset, got.status)
                assert not got.messages and got.min_offset == 300, (offset, got)
        after = hot.get_messages("t", 0, 300, 20)
        assert after.status is GetStatus.FOUND
        assert [m.body for m in after.messages] == bodies[300:320]
    finally:
        hot.shutdown()
        fetcher.close()


def test_kill_9_of_the_worker_during_reads_and_read_ahead_hides_nothing(
    fault_proxy: Any,
    worker: ColdWorker,
    hot: MessageStore,
    proxied: tuple[str, dict[str, Any]],
    s3: S3Endpoint,
) -> None:
    bodies = fill(hot, 1200)
    direct = open_store(proxied[0], s3.storage_options())
    Offloader(hot, direct, "c", "b", OffloadPolicy(segment_max_messages=100)).offload_queue("t", 0)
    tier = open_store(*proxied, QUICK)
    # A cache of two batches: the replay fetches all the time, so kills land on fetches,
    # on read-ahead, and on spans crossing the pipe.
    fetcher = ColdFetcher(tier, "c", "b", runner=worker, read_timeout_s=30, cache_bytes=200_000)
    read: list[bytes] = []
    errors: list[BaseException] = []

    def reader() -> None:
        offset = 0
        try:
            while offset < 1200:
                try:
                    messages, nxt = fetcher.get("t", 0, offset, 40)
                except ColdTierUnavailableError:
                    continue  # retryable: what a client does
                assert [m.queue_offset for m in messages] == list(range(offset, nxt))
                read.extend(m.body for m in messages)
                offset = nxt
        except BaseException as e:
            errors.append(e)

    fault_proxy.set(delay_ms=200, methods=["GET"])  # each fetch is in flight a while
    thread = threading.Thread(target=reader)
    thread.start()
    try:
        for _ in range(2):
            time.sleep(0.7)
            pid = worker.pid
            assert pid is not None and len(read) < 1200, "the replay ended before the kill"
            os.kill(pid, signal.SIGKILL)
            deadline = time.monotonic() + 30
            while worker.pid == pid and time.monotonic() < deadline:
                time.sleep(0.05)
        thread.join(timeout=120)
        assert not thread.is_alive()
        assert not errors, errors
        assert read == bodies
        assert worker.restarts == 2
    finally:
        fault_proxy.heal()
        thread.join(timeout=60)
        fetcher.close()
