"""Bad days of the cold path rewritten in decisions 251-253: the cold worker's native gather and
span check, spans crossing the worker pipe out of band, no read-back after a PUT that wrote,
and read-ahead across segment ends. Real processes (the cold worker is a child), LocalStack
behind the HTTP fault proxy (localstack/fault_proxy.py), operator commands racing the offloader.

What every test pins: a cold reader sees the archive's messages, whole and in order, or a clear
error; never a gap, a short read taken for the queue's end, or wrong bytes; and once the store
heals, it reads everything again."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import S3Endpoint
from rocketmq.grpc_protocol import definition_pb2 as d
from rocketmq.grpc_protocol import service_pb2_grpc
from test_tier_readers import _archived_behind_proxy, body_of, end_offset, pull

from broker.metadata import TopicConfig
from offload.offloader import Offloader, OffloadError, OffloadPolicy
from offload.release import release_predicate
from offload.verify import FAILURE, OK, verify_queue
from tiered.cold.faults import FaultyObjectStore
from tiered.cold.fetcher import ColdFetcher, ColdTierUnavailableError
from tiered.cold.manifest import ManifestLog, queue_prefix
from tiered.cold.segment import SegmentError
from tiered.cold.storage import (
    PermanentStorageError,
    RetryPolicy,
    StorageError,
    open_store,
)
from tiered.cold.worker import ColdWorker, LocalRunner
from tiered.config import StoreConfig
from tiered.record import Message
from tiered.store import GetStatus, MessageStore

# A quick retry policy: the fault tests wait on it while the proxy fails every request.
QUICK = RetryPolicy(attempts=2, base_delay_s=0.05, max_delay_s=0.1)


@pytest.fixture
def hot(tmp_path: Path, start_store: Callable[[StoreConfig], MessageStore]) -> MessageStore:
    return start_store(StoreConfig(data_dir=tmp_path / "hot", commitlog_file_size=256 << 10))


def fill(store: MessageStore, n: int, seed: int = 5) -> list[bytes]:
    rng = random.Random(seed)
    bodies = [rng.randbytes(rng.randint(200, 900)) for _ in range(n)]
    store.put_messages([Message(topic="t", queue_id=0, body=b) for b in bodies])
    assert store.wait_dispatched(10)
    return bodies


def archive(hot: MessageStore, s3: S3Endpoint, url: str, n: int, per_segment: int) -> list[bytes]:
    """``n`` messages of queue t/0 uploaded straight to LocalStack (not through the proxy) in
    segments of ``per_segment``; their bodies."""
    bodies = fill(hot, n)
    direct = open_store(url, s3.storage_options())
    Offloader(hot, direct, "c", "b", OffloadPolicy(segment_max_messages=per_segment)).offload_queue(
        "t", 0
    )
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


def replay(fetcher: ColdFetcher, end: int, errors: int = 0) -> list[bytes]:
    """Every body from offset 0 to ``end``, as a replaying consumer reads them; up to
    ``errors`` failed reads are retried (a request the proxy answered before it healed)."""
    read: list[bytes] = []
    offset = 0
    while offset < end:
        try:
            messages, nxt = fetcher.get("t", 0, offset, 100)
        except (SegmentError, StorageError):
            errors -= 1
            if errors < 0:
                raise
            time.sleep(0.2)
            continue
        assert messages and nxt > offset, f"no progress at {offset} (next {nxt})"
        assert [m.queue_offset for m in messages] == list(range(offset, offset + len(messages)))
        read += [m.body for m in messages]
        offset = nxt
    return read


@contextlib.contextmanager
def proxied_fetcher(
    proxied: tuple[str, dict[str, Any]], worker: ColdWorker
) -> Iterator[ColdFetcher]:
    """Broker b's (cluster c) fetcher of the tier behind the fault proxy, its reads in
    ``worker``, with a deadline (20 s) for a loaded machine, not a broker's; closed on exit."""
    fetcher = ColdFetcher(open_store(*proxied, QUICK), "c", "b", runner=worker, read_timeout_s=20)
    try:
        yield fetcher
    finally:
        fetcher.close()


def test_wrong_bytes_from_the_store_fail_reads_until_healed_then_every_message_reads(
    fault_proxy: Any,
    worker: ColdWorker,
    hot: MessageStore,
    proxied: tuple[str, dict[str, Any]],
    s3: S3Endpoint,
) -> None:
    bodies = archive(hot, s3, proxied[0], 900, 300)
    with proxied_fetcher(proxied, worker) as fetcher:
        assert fetcher.manifest("t", 0).end_offset == 900
        # Every ranged GET answers with one bit flipped (S3 checks no checksum of a range): the
        # offset tables and the records the reads fetch are all wrong bytes now.
        fault_proxy.set(corrupt=True, methods=["GET"])
        for offset in (0, 300, 650):
            with pytest.raises((SegmentError, StorageError)):
                fetcher.get("t", 0, offset, 50)
        assert fault_proxy.snapshot()["counters"]["corrupted"] >= 3
        fault_proxy.heal()
        # A read-ahead the proxy answered before it healed may still fail a read or two; the
        # table it damaged must not outlive it (it was cached, and every read failed).
        assert replay(fetcher, 900, errors=3) == bodies


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
    # Segments of 100 messages, each one batch: the first read reads ahead into the second.
    bodies = archive(hot, s3, proxied[0], 600, 100)
    with proxied_fetcher(proxied, worker) as fetcher:
        assert fetcher.manifest("t", 0).end_offset == 600
        first, nxt = fetcher.get("t", 0, 0, 10)  # the first batch and its read-ahead
        assert [m.body for m in first] == bodies[:10] and nxt == 10
        fetcher.read_timeout_s = 2.0  # what a broker's cold read waits (its default is 2.5)
        fault_proxy.set(**fault, methods=["GET"])
        # Offsets past what was read ahead (segments 1 and 2, read whole: decision 1220), in
        # three other segments: every one is the tier's retryable "unavailable", never a
        # shorter answer or another segment's messages.
        for offset in (450, 350, 599):
            with pytest.raises(ColdTierUnavailableError):
                messages, nxt = fetcher.get("t", 0, offset, 50)
                pytest.fail(f"read {len(messages)} messages at {offset} (next {nxt})")
        fault_proxy.heal()
        fetcher.read_timeout_s = 20
        assert replay(fetcher, 600) == bodies


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
        # Segments 0, 1 and 2 are in the fetcher's cache now or on their way (the read and its
        # read-ahead, two segments ahead of a reader of whole segments: decision 1220).
        segments = offloader.manifest("t", 0).segments
        cached = {segment for segment, _, _ in [*fetcher._cache, *fetcher._inflight]}
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
                held = next(s.key for s in segments if s.base_offset <= offset < s.end_offset)
                assert who == "another process" and held in cached, (offset, got.status)
                assert [m.queue_offset for m in got.messages] == list(
                    range(offset, offset + len(got.messages))
                )
                # (A read stops at its segment's end: at 299, one message.)
                assert got.messages, offset
                assert [m.body for m in got.messages] == bodies[offset : offset + len(got.messages)]
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
    bodies = archive(hot, s3, proxied[0], 1200, 100)
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


def test_verify_repair_retain_and_release_racing_the_upload_pipeline_lose_nothing(
    fault_proxy: Any,
    worker: ColdWorker,
    tmp_path: Path,
    proxied: tuple[str, dict[str, Any]],
    s3: S3Endpoint,
) -> None:
    hot = MessageStore(StoreConfig(data_dir=tmp_path / "hot", commitlog_file_size=64 << 10))
    hot.start()
    tier = open_store(*proxied, QUICK)
    offloader = Offloader(
        hot, tier, "c", "b", OffloadPolicy(segment_max_messages=40), runner=worker
    )
    topics = {"t": TopicConfig("t", queues=1, tiered=True)}
    can_release = release_predicate(hot, offloader, topics)
    lock = offloader.queue_lock("t", 0)
    bodies: list[bytes] = []
    problems: list[str] = []
    stop = threading.Event()
    # A third of the PUTs fail, half of those after the object was written: uploads fail and
    # are abandoned, commits fail with their outcome unknown, passes end half-way.
    fault_proxy.set(error_rate=0.3, error_status=503, methods=["PUT"])

    def produce() -> None:
        rng = random.Random(7)
        while not stop.is_set():
            batch = [rng.randbytes(rng.randint(200, 900)) for _ in range(20)]
            hot.put_messages([Message(topic="t", queue_id=0, body=b) for b in batch])
            bodies.extend(batch)
            time.sleep(0.05)

    def loop(name: str, step: Any) -> None:
        while not stop.is_set():
            try:
                step()
            except (StorageError, OffloadError, SegmentError):
                pass  # a failed pass or command: the next one starts from what is committed
            except Exception as e:
                problems.append(f"{name}: {type(e).__name__}: {e}")
            time.sleep(0.02)

    def offload() -> None:
        fault_proxy.set(
            error_rate=0.3, error_status=503, after_forward=random.random() < 0.5, methods=["PUT"]
        )
        offloader.offload_queue("t", 0)

    def retain() -> None:
        segments = offloader.manifest("t", 0).segments
        # By size: the archive keeps its newest two segments.
        if len(segments) > 2:
            offloader.expire("t", 0, cutoff_ms=0, max_bytes=sum(s.size for s in segments[-2:]))

    def verify() -> None:
        verdict = verify_queue(tier, "c", "b", "t", 0, lock=lock, repair=True, deep=True)
        if verdict.status == FAILURE:
            problems.append(f"verify: {verdict}")

    def release() -> None:
        hot.release_commitlog_files(can_release)
        committed = ManifestLog(tier, queue_prefix("c", "b", "t", 0)).load().end_offset
        if hot.hot_min_offset("t", 0) > committed:
            problems.append(f"released to {hot.hot_min_offset('t', 0)}, committed {committed}")

    threads = [threading.Thread(target=produce)] + [
        threading.Thread(target=loop, args=(name, step))
        for name, step in (
            ("offload", offload),
            ("retain", retain),
            ("verify", verify),
            ("release", release),
        )
    ]
    try:
        for t in threads:
            t.start()
        # Seconds of racing, at least until retention and release both did something.
        started = time.monotonic()
        while time.monotonic() - started < 25 and (
            time.monotonic() - started < 5
            or offloader.stats.retention_segments == 0
            or hot.hot_min_offset("t", 0) == 0
        ):
            time.sleep(0.2)
        stop.set()
        for t in threads:
            t.join(timeout=60)
        assert not problems, problems[:5]
        fault_proxy.heal()
        result = offloader.offload_queue("t", 0)
        assert result.watermark == len(bodies) == hot.max_offset("t", 0)
        verdict = verify_queue(tier, "c", "b", "t", 0, lock=lock, repair=True, deep=True)
        assert verdict.status == OK, verdict
        manifest = offloader.manifest("t", 0, refresh=True)
        # Nothing but the manifest's segments in the bucket: each range uploaded once.
        listed = sorted(o.key for o in tier.list(f"{manifest.prefix}segments/"))
        assert listed == sorted(s.key for s in manifest.segments)
        assert manifest.start_offset > 0, f"retention never ran: {offloader.stats}"
        assert hot.hot_min_offset("t", 0) > 0, "release never ran"
        fetcher = ColdFetcher(tier, "c", "b", runner=worker, read_timeout_s=30)
        try:
            offset, read = manifest.start_offset, []
            while offset < manifest.end_offset:
                messages, offset = fetcher.get("t", 0, offset, 200)
                assert messages
                read += [m.body for m in messages]
        finally:
            fetcher.close()
        assert read == bodies[manifest.start_offset :]
    finally:
        stop.set()
        fault_proxy.heal()
        hot.shutdown()


@pytest.mark.parametrize("sdk_checksums", ["when_supported", "when_required"])
def test_a_put_whose_bytes_were_damaged_on_the_way_is_retried_never_stored(
    sdk_checksums: str, fault_proxy: Any, proxied: tuple[str, dict[str, Any]], s3: S3Endpoint
) -> None:
    """No read-back follows a PUT that wrote (decision 251): what makes that safe is a checksum
    of the body that the store checks. A PUT damaged in transit is refused by the store
    (BadDigest): a transient failure that the one retry policy retries, not a permanent one
    (which would, at start, stop the broker as if the bucket were unusable). Also where the
    SDK's own checksums are off ("when_required": AWS_REQUEST_CHECKSUM_CALCULATION, set for
    S3-compatible stores that refuse them), or a damaged segment would be stored, committed
    and its local copy released."""
    url, options = proxied
    options = {**options, "config_kwargs": {"request_checksum_calculation": sdk_checksums}}
    store = open_store(url, options, RetryPolicy(attempts=1))
    fault_proxy.set(corrupt=True, methods=["PUT"])
    with pytest.raises(StorageError) as refused:
        store.put_if_absent("seg/1", b"x" * 50_000)
    assert not isinstance(refused.value, PermanentStorageError), refused.value
    with pytest.raises(StorageError):
        store.put("manifest/1", b"y" * 5_000)
    assert s3.client().list_objects_v2(Bucket=url[5:].split("/")[0])["KeyCount"] == 0
    fault_proxy.heal()
    assert open_store(url, options, QUICK).put_if_absent("seg/1", b"x" * 50_000) is True
    assert store.get("seg/1") == b"x" * 50_000


def _cold_worker_pid(broker_pid: int) -> int:
    """The broker's cold worker: its one child that is a Python process of multiprocessing."""
    children = Path(f"/proc/{broker_pid}/task/{broker_pid}/children").read_text().split()
    for pid in map(int, children):
        with contextlib.suppress(FileNotFoundError):
            if b"multiprocessing" in Path(f"/proc/{pid}/cmdline").read_bytes():
                return pid
    raise AssertionError(f"broker {broker_pid} has no cold worker among {children}")


def test_a_broker_replay_through_wrong_bytes_and_a_killed_worker_sees_every_message(
    tmp_path: Path, fault_proxy: Any, bucket: str
) -> None:
    """End to end: PullMessage from a broker whose archive is read through the fault proxy.
    While the store answers wrong bytes, a pull is an error, never messages or an end; after
    healing, a replay with the cold worker killed -9 under it returns every message sent."""
    total = 1200
    node = _archived_behind_proxy(tmp_path, fault_proxy, bucket, "cold", total)
    try:
        stub = service_pb2_grpc.MessagingServiceStub(node.channel())
        assert end_offset(stub, "cold", 0) == total

        fault_proxy.set(corrupt=True, methods=["GET"])
        for offset in (0, 300):
            got = pull(stub, "cold", 0, offset)
            assert got.code not in (d.OK, d.MESSAGE_NOT_FOUND, d.ILLEGAL_OFFSET), got
            assert not got.offsets, got
        fault_proxy.heal()

        assert node.proc is not None
        worker = _cold_worker_pid(node.proc.pid)
        offset, errors, killed = 0, 0, False
        while offset < total:
            if offset >= 400 and not killed:
                os.kill(worker, signal.SIGKILL)
                killed = True
            got = pull(stub, "cold", 0, offset)
            if got.code != d.OK:  # retryable: the worker restarting
                assert got.code in (d.PROXY_TIMEOUT, d.INTERNAL_SERVER_ERROR), got
                assert not got.offsets
                errors += 1
                assert errors < 50, got
                time.sleep(0.2)
                continue
            assert got.offsets == list(range(offset, offset + len(got.offsets))), got.offsets
            assert got.bodies == [body_of(o) for o in got.offsets]
            offset = got.next_offset
        assert _cold_worker_pid(node.proc.pid) != worker
    finally:
        node.stop()


def test_a_manifest_read_with_wrong_bytes_is_a_retryable_error(
    fault_proxy: Any, hot: MessageStore, proxied: tuple[str, dict[str, Any]], s3: S3Endpoint
) -> None:
    """Where the SDK checks no response checksum (``response_checksum_validation =
    when_required``, as for S3-compatible stores without them), a manifest read with one bit
    flipped fails the manifest's own CRC: for a cold read that is the tier being unavailable
    (PROXY_TIMEOUT to a client, retried), not an internal error."""
    archive(hot, s3, proxied[0], 300, 100)
    url, options = proxied
    options = {**options, "config_kwargs": {"response_checksum_validation": "when_required"}}
    fetcher = ColdFetcher(open_store(url, options, QUICK), "c", "b", read_timeout_s=10)
    try:
        fault_proxy.set(corrupt=True, methods=["GET"])
        with pytest.raises(ColdTierUnavailableError, match="manifest"):
            fetcher.get("t", 0, 0, 10)  # no manifest cached: it is loaded, damaged
        fault_proxy.heal()
        messages, nxt = fetcher.get("t", 0, 0, 10)
        assert [m.queue_offset for m in messages] == list(range(10)) and nxt == 10
    finally:
        fetcher.close()


def test_a_commit_whose_answer_was_lost_is_not_uploaded_again(
    hot: MessageStore, tmp_path: Path
) -> None:
    """A manifest commit that landed although the store answered 500: the next pass must start
    from the archive as it is, not upload the same range again under a new key (and have its
    commit refused as "another writer", a broker's only writer being itself)."""
    clean = open_store(f"file://{tmp_path}/tier")
    tier = FaultyObjectStore(clean)
    offloader = Offloader(
        hot, tier, "c", "b", OffloadPolicy(segment_max_messages=100), runner=LocalRunner(clean)
    )
    # The claim's own commit (the empty prefix's stamp, decision 752) is not what this test is
    # about: it answers; the segment's commit below does not.
    offloader.claim("t", 0)
    tier.fail_after_write_rate = 1.0
    fill(hot, 100)
    with pytest.raises(OffloadError, match="commit manifest"):
        offloader.offload_queue("t", 0)
    prefix = queue_prefix("c", "b", "t", 0)
    [landed] = ManifestLog(clean, prefix).load().segments  # the commit landed all the same
    tier.fail_after_write_rate = 0.0
    fill(hot, 100, seed=6)
    result = offloader.offload_queue("t", 0)
    assert result.watermark == 200 and result.messages == 100
    manifest = ManifestLog(clean, prefix).load()
    assert manifest.segments[0] == landed and manifest.end_offset == 200
    # Each range was uploaded once: nothing to discard, no orphan.
    assert sorted(o.key for o in clean.list(f"{prefix}segments/")) == sorted(
        s.key for s in manifest.segments
    )
