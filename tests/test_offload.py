"""Offload: upload -> verify -> commit -> release, on file:// and LocalStack S3, with faults."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import pytest
from conftest import mounted_tmpfs

from broker.metadata import TopicConfig
from offload.offloader import Offloader, OffloadError, OffloadPolicy
from offload.release import release_predicate
from offload.verify import OK, WARNING, verify_queue
from tiered.cold.faults import FaultyObjectStore
from tiered.cold.fetcher import ColdFetcher
from tiered.cold.manifest import ManifestLog, queue_prefix, segment_key
from tiered.cold.segment import SegmentError, SegmentReader, build
from tiered.cold.storage import (
    ObjectStore,
    RetryingObjectStore,
    RetryPolicy,
    StorageError,
    open_store,
)
from tiered.cold.worker import LocalRunner
from tiered.config import StoreConfig
from tiered.record import Message, StoredMessage
from tiered.store import GetStatus, MessageStore

FAST = OffloadPolicy(segment_max_messages=700)
T = TypeVar("T")


@pytest.fixture(params=["file", "s3"])
def tier(request: pytest.FixtureRequest, tmp_path: Path) -> ObjectStore:
    if request.param == "file":
        return open_store(f"file://{tmp_path}/tier")
    s3 = request.getfixturevalue("s3")
    return open_store(f"s3://{request.getfixturevalue('bucket')}/tier", s3.storage_options())


@pytest.fixture
def hot(tmp_path: Path):
    store = MessageStore(
        StoreConfig(
            data_dir=tmp_path / "hot",
            commitlog_file_size=128 << 10,
            consumequeue_entries_per_file=256,
            index_hash_slots=509,
            index_max_entries=4000,
        )
    )
    store.start()
    yield store
    store.shutdown()


def fill(store: MessageStore, topic: str, n: int, queues: int = 2, seed: int = 1) -> None:
    rng = random.Random(seed)
    for i in range(n):
        store.put_message(
            Message(
                topic=topic,
                queue_id=i % queues,
                body=rng.randbytes(rng.randint(1, 400)),
                properties={"KEYS": f"{topic}-{i}", "UNIQ_KEY": f"{topic}-id-{i}"},
            )
        )
    assert store.wait_dispatched()


def snapshot(store: MessageStore, topic: str, queue_id: int) -> list[StoredMessage]:
    return store.get_messages(topic, queue_id, 0, 100_000, max_bytes=1 << 30).messages


def read_tier(tier: ObjectStore, topic: str, queue_id: int) -> list[StoredMessage]:
    manifest = ManifestLog(tier, queue_prefix("c1", "broker-a", topic, queue_id)).load()
    out: list[StoredMessage] = []
    offset = manifest.start_offset
    while offset < manifest.end_offset:
        info = manifest.find(offset)
        assert info is not None, f"gap at {offset}"
        batch = SegmentReader(tier, info).read(offset, 500)
        out += batch
        offset += len(batch)
    return out


def test_local_segment_is_kept_until_upload_verified(hot: MessageStore, tier: ObjectStore) -> None:
    fill(hot, "orders", 3000)
    before = {q: snapshot(hot, "orders", q) for q in (0, 1)}
    topics = {"orders": TopicConfig("orders", queues=2, tiered=True)}
    offloader = Offloader(hot, tier, "c1", "broker-a", FAST)
    can_release = release_predicate(hot, offloader, topics)
    files = len(hot.commitlog_files())
    assert files > 5
    assert hot.release_commitlog_files(can_release) == 0, "nothing is uploaded yet"

    half = offloader.offload_queue("orders", 0)  # queue 1 still only local
    assert half.watermark == len(before[0]) and half.segments == 3
    assert hot.release_commitlog_files(can_release) == 0, "queue 1's records are in every file"

    offloader.offload_queue("orders", 1)
    assert hot.release_commitlog_files(can_release) == files - 1
    for q in (0, 1):
        assert hot.min_offset("orders", q) > 0
        assert read_tier(tier, "orders", q) == before[q], "every message, byte-identical"


class InlineRunner:
    """Runs each cold job when it is submitted, on the caller's thread: every upload in flight
    has landed by the time the offloader waits for the oldest."""

    def __init__(self, tier: ObjectStore) -> None:
        self.tier = tier

    def submit(
        self, fn: Callable[..., T], *args: Any, block: bool = True, read: bool = False
    ) -> Future[T]:
        future: Future[T] = Future()
        try:
            future.set_result(fn(self.tier, *args))
        except BaseException as e:
            future.set_exception(e)
        return future

    def close(self) -> None:
        pass


def test_uploads_that_landed_together_are_committed_in_one_manifest_version(
    hot: MessageStore, tier: ObjectStore
) -> None:
    fill(hot, "orders", 3000)
    before = snapshot(hot, "orders", 0)
    policy = OffloadPolicy(segment_max_messages=250, parallel_uploads=4)
    offloader = Offloader(hot, tier, "c1", "broker-a", policy, runner=InlineRunner(tier))
    offloader.claim("orders", 0)  # an empty prefix is stamped at the claim (decision 752)
    start = offloader.manifest("orders", 0).version
    result = offloader.offload_queue("orders", 0)
    manifest = ManifestLog(tier, queue_prefix("c1", "broker-a", "orders", 0)).load()
    assert result.segments == len(manifest.segments) == 6 and result.watermark == len(before)
    # Five uploads in flight (four PUTs and one built ahead, decision 630) had landed when the
    # first was waited for: one version for them, one for the sixth; not a version (a PUT, a
    # LIST and a prune) per segment.
    assert manifest.version - start == 2
    assert read_tier(tier, "orders", 0) == before
    offloader.close()


class GatedRunner:
    """Runs each cold job on a thread of its own once the test opens its gate (jobs numbered in
    the order they are submitted): the test decides when, and in which order, uploads land.
    A job in ``fail`` fails like an upload the tier's retries gave up on."""

    def __init__(self, tier: ObjectStore, fail: frozenset[int] = frozenset()) -> None:
        self.tier = tier
        self.fail = fail
        self.gates = [threading.Event() for _ in range(32)]
        self.futures: list[Future[Any]] = []

    def submit(
        self, fn: Callable[..., T], *args: Any, block: bool = True, read: bool = False
    ) -> Future[T]:
        number = len(self.futures)
        future: Future[T] = Future()
        self.futures.append(future)

        def run() -> None:
            self.gates[number].wait(60)
            try:
                if number in self.fail:
                    raise StorageError(f"job {number}: 503 SlowDown (failed 6 attempts)")
                future.set_result(fn(self.tier, *args))
            except BaseException as e:
                future.set_exception(e)

        threading.Thread(target=run, daemon=True).start()
        return future

    def land(self, number: int) -> None:
        """Open job ``number``'s gate and wait until it has landed (or failed), then give the
        offloader time to act on it."""
        while len(self.futures) <= number:
            time.sleep(0.01)
        self.gates[number].set()
        with contextlib.suppress(Exception):
            self.futures[number].result(60)
        time.sleep(0.3)

    def close(self) -> None:
        for gate in self.gates:
            gate.set()


def test_a_pass_commits_one_manifest_version_for_uploads_that_land_one_by_one(
    hot: MessageStore, tier: ObjectStore
) -> None:
    """Three segments in flight land one after the other: one commit when the last has landed
    (a PUT, a LIST and a prune), not one per upload as they come in (decision 560)."""
    fill(hot, "orders", 900, queues=1)
    before = snapshot(hot, "orders", 0)
    runner = GatedRunner(tier)
    policy = OffloadPolicy(segment_max_messages=300, parallel_uploads=4)
    offloader = Offloader(hot, tier, "c1", "broker-a", policy, runner=runner)
    log = ManifestLog(tier, queue_prefix("c1", "broker-a", "orders", 0))
    offloader.claim("orders", 0)  # an empty prefix is stamped at the claim (decision 752)
    start = offloader.manifest("orders", 0).version
    with ThreadPoolExecutor(1) as pool:
        passing = pool.submit(offloader.offload_queue, "orders", 0)
        try:
            for number in (0, 1):
                runner.land(number)
                assert log.load().version == start, "nothing committed while uploads are in flight"
            runner.land(2)
            result = passing.result(60)
        finally:
            runner.close()
    manifest = log.load()
    assert result.segments == len(manifest.segments) == 3 and result.watermark == len(before)
    assert manifest.version - start == 1
    assert read_tier(tier, "orders", 0) == before
    offloader.close()


class PutGate:
    """The tier, with every segment PUT held until ``open`` is set; counts the PUTs under way
    and the most seen at once. Manifest commits pass straight through."""

    def __init__(self, tier: ObjectStore) -> None:
        self.tier = tier
        self.open = threading.Event()
        self.lock = threading.Lock()
        self.inside = 0
        self.most = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.tier, name)

    def put_if_absent(self, key: str, data: bytes, **kwargs: Any) -> bool:
        if "/segments/" not in key:
            return self.tier.put_if_absent(key, data, **kwargs)
        with self.lock:
            self.inside += 1
            self.most = max(self.most, self.inside)
        try:
            assert self.open.wait(60), "the test never opened the gate"
            return self.tier.put_if_absent(key, data, **kwargs)
        finally:
            with self.lock:
                self.inside -= 1


def test_the_next_segment_is_built_while_the_puts_run_and_puts_stay_bounded(
    hot: MessageStore, tier: ObjectStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With ``parallel_uploads`` PUTs held open, one more segment of the queue is built (sealed)
    meanwhile, ready for the first slot that frees, and no further PUT starts (decision 630)."""
    import offload.segment_upload as segment_upload

    sealed: list[str] = []
    real_seal = segment_upload.seal

    def counting_seal(*args: Any, **kwargs: Any) -> Any:
        info = real_seal(*args, **kwargs)
        sealed.append(info.key)
        return info

    monkeypatch.setattr(segment_upload, "seal", counting_seal)
    fill(hot, "orders", 1200, queues=1)
    before = snapshot(hot, "orders", 0)
    gate = PutGate(tier)
    policy = OffloadPolicy(segment_max_messages=300, parallel_uploads=2)
    offloader = Offloader(hot, gate, "c1", "broker-a", policy)  # type: ignore[arg-type]
    with ThreadPoolExecutor(1) as pool:
        passing = pool.submit(offloader.offload_queue, "orders", 0)
        try:
            deadline = time.monotonic() + 30
            while (gate.inside < 2 or len(sealed) < 3) and time.monotonic() < deadline:
                time.sleep(0.01)
            time.sleep(0.2)  # a third PUT or a fourth build would have started by now
            assert gate.inside == 2 and gate.most == 2, "PUTs at once: parallel_uploads"
            assert len(sealed) == 3, "one segment built ahead while both PUTs are held"
        finally:
            gate.open.set()
        result = passing.result(60)
    assert result.segments == 4 and result.watermark == len(before)
    assert gate.most == 2
    assert read_tier(tier, "orders", 0) == before
    offloader.close()


def test_uploads_landed_before_a_failed_one_are_committed_and_nothing_is_left_unnamed(
    hot: MessageStore, tier: ObjectStore
) -> None:
    """The second of three uploads fails for good: the first, landed before it, is committed
    (the next pass starts after it, as when every landed upload was committed at once), the
    third is deleted, and every object under the queue's prefix is one the manifest names."""
    fill(hot, "orders", 900, queues=1)
    before = snapshot(hot, "orders", 0)
    runner = GatedRunner(tier, fail=frozenset({1}))
    policy = OffloadPolicy(segment_max_messages=300, parallel_uploads=4)
    offloader = Offloader(hot, tier, "c1", "broker-a", policy, runner=runner)
    prefix = queue_prefix("c1", "broker-a", "orders", 0)
    with ThreadPoolExecutor(1) as pool:
        passing = pool.submit(offloader.offload_queue, "orders", 0)
        try:
            runner.land(0)
            runner.land(2)  # lands behind the one that will fail
            runner.land(1)
            with pytest.raises(OffloadError, match="503 SlowDown"):
                passing.result(60)
        finally:
            runner.close()
    manifest = ManifestLog(tier, prefix).load()
    assert [(s.base_offset, s.end_offset) for s in manifest.segments] == [(0, 300)]
    assert {o.key for o in tier.list(f"{prefix}segments/")} == {s.key for s in manifest.segments}
    # The next pass goes on from there, and the archive is whole.
    offloader.runner = InlineRunner(tier)
    assert offloader.offload_queue("orders", 0).watermark == len(before)
    assert read_tier(tier, "orders", 0) == before
    offloader.close()


def test_untiered_topics_in_the_same_files_keep_the_file_reserved_time(hot, tier) -> None:
    fill(hot, "orders", 1500, seed=2)
    fill(hot, "audit", 100, queues=1, seed=3)  # in the last files only
    fill(hot, "orders", 1500, seed=4)
    topics = {
        "orders": TopicConfig("orders", queues=2, tiered=True),
        "audit": TopicConfig("audit", queues=1, retention_ms=60_000),
    }
    offloader = Offloader(hot, tier, "c1", "broker-a", FAST)
    for q in (0, 1):
        offloader.offload_queue("orders", q)
    now = [0]
    can_release = release_predicate(
        hot,
        offloader,
        topics,
        now_ms=lambda: now[0] + max(f.modified_ms for f in hot.commitlog_files()),
    )
    released = hot.release_commitlog_files(can_release)
    assert released > 0
    assert hot.min_offset("audit", 0) == 0, "audit's file is younger than its retention"
    now[0] = 61_000
    assert hot.release_commitlog_files(can_release) > 0
    assert hot.min_offset("audit", 0) == 100


def test_offload_survives_failing_storage_without_loss_or_duplicates(hot, tier) -> None:
    fill(hot, "orders", 3000, seed=5)
    # Uploads run in parallel, so which call draws which fault varies from run to run: rates
    # high enough that every kind is drawn in any order (at 0.1, one run in five drew no
    # failure after a write and tested less than it claims).
    faulty = FaultyObjectStore(tier, failure_rate=0.2, fail_after_write_rate=0.3, seed=11)
    # The tier's one retry policy, around the faults (as open_store puts it around S3).
    retrying = RetryingObjectStore(
        faulty, RetryPolicy(attempts=30, base_delay_s=0.05, max_delay_s=0.2)
    )
    # Ten segments a queue: with one manifest commit per pipeline's worth of uploads (decision
    # 560), the writes that draw faults are mostly segment PUTs.
    offloader = Offloader(hot, retrying, "c1", "broker-a", OffloadPolicy(segment_max_messages=150))
    offloader.offload_queue("orders", 0)
    faulty.blackhole(0.5)  # every call times out for a while, then the store comes back
    offloader.offload_queue("orders", 1)
    assert faulty.injected["503"] > 5 and faulty.injected["500-after-write"] > 0
    assert faulty.injected["timeout"] > 0
    for q in (0, 1):
        assert read_tier(tier, "orders", q) == snapshot(hot, "orders", q)


def test_a_crash_between_object_write_and_commit_leaves_no_gap_and_the_orphan_is_swept(
    hot, tier
) -> None:
    fill(hot, "orders", 1000, queues=1, seed=6)
    prefix = queue_prefix("c1", "broker-a", "orders", 0)
    # A first offloader wrote a segment and "died" before committing the manifest.
    records = [
        hot.commitlog.read(m.commitlog_offset, m.size) for m in snapshot(hot, "orders", 0)[:300]
    ]
    data, orphan = build(records, 0, segment_key(prefix, 0))
    assert tier.put_if_absent(orphan.key, data)
    # The restarted broker deletes it, starts from the committed watermark (0) and writes new
    # objects under new keys.
    result = Offloader(hot, tier, "c1", "broker-a", FAST).offload_queue("orders", 0)
    assert result.watermark == 1000
    assert read_tier(tier, "orders", 0) == snapshot(hot, "orders", 0)
    manifest = ManifestLog(tier, prefix).load()
    assert orphan.key not in {s.key for s in manifest.segments}
    assert {o.key for o in tier.list(f"{prefix}segments/")} == {s.key for s in manifest.segments}


def _tier_writer(url: str, key: str, failpoint: str) -> subprocess.Popen[bytes]:
    """A real process writing one object to the file:// tier at ``url``, stopped by
    ``failpoint`` once its temporary file is linked into place and not yet deleted."""
    code = (
        "import sys; from tiered.cold.storage import open_store; "
        "open_store(sys.argv[1]).put_if_absent(sys.argv[2], bytes(200_000))"
    )
    env = {**os.environ, "TMQ_FAILPOINTS": failpoint}
    return subprocess.Popen([sys.executable, "-c", code, url, key], env=env)


def test_temporary_files_of_killed_tier_writers_are_swept_and_live_ones_kept(
    hot, tmp_path: Path
) -> None:
    url = f"file://{tmp_path}/tier"
    tier = open_store(url)
    fill(hot, "orders", 1000, queues=1, seed=8)
    prefix = queue_prefix("c1", "broker-a", "orders", 0)
    segments = tmp_path / "tier" / f"{prefix}segments"

    def temps() -> set[Path]:
        return set(segments.glob(".tmp-*")) if segments.exists() else set()

    killed = _tier_writer(url, f"{prefix}segments/killed", "tier.after_link")
    assert killed.wait(60) == -signal.SIGKILL
    (dead,) = temps()
    live = _tier_writer(url, f"{prefix}segments/live", "tier.after_link=sleep:120")
    try:
        deadline = time.monotonic() + 60
        while len(temps()) < 2:
            assert live.poll() is None and time.monotonic() < deadline, "the writer never wrote"
            time.sleep(0.05)
        (writing,) = temps() - {dead}

        # A start's sweep deletes what the killed writer left, and not the file being written.
        offloader = Offloader(hot, tier, "c1", "broker-a", FAST)
        assert offloader.offload_queue("orders", 0).watermark == 1000
        assert temps() == {writing}
        assert read_tier(tier, "orders", 0) == snapshot(hot, "orders", 0)
        lock = offloader.queue_lock("orders", 0)
        assert verify_queue(tier, "c1", "broker-a", "orders", 0, lock=lock).status == OK
    finally:
        live.kill()
        live.wait(60)
    # Its writer killed too, verify reports it as an orphan, and --repair deletes it.
    rel = writing.relative_to(tmp_path / "tier").as_posix()
    verdict = verify_queue(tier, "c1", "broker-a", "orders", 0, lock=lock)
    assert (verdict.status, verdict.orphans) == (WARNING, [rel])
    assert temps() == {writing}
    verdict = verify_queue(tier, "c1", "broker-a", "orders", 0, lock=lock, repair=True)
    assert (verdict.status, verdict.repaired) == (OK, [rel])
    assert temps() == set()


def test_retention_removes_exactly_the_expired_segments_then_their_objects(hot, tier) -> None:
    for chunk in range(5):  # one segment's worth each, a few ms apart: distinct store times
        fill(hot, "orders", 400, queues=1, seed=70 + chunk)
        time.sleep(0.01)
    offloader = Offloader(hot, tier, "c1", "broker-a", OffloadPolicy(segment_max_messages=400))
    offloader.offload_queue("orders", 0)
    manifest = offloader.manifest("orders", 0)
    assert len(manifest.segments) == 5
    cutoff = manifest.segments[2].max_store_timestamp + 1  # segments 0-2 wholly older
    # Segments expire whole: the third's last message is the youngest expired one.
    assert manifest.segments[3].max_store_timestamp >= cutoff

    preview = offloader.expire("orders", 0, cutoff, dry_run=True)
    assert (preview.segments, preview.new_start_offset) == (3, manifest.segments[3].base_offset)
    assert len(offloader.manifest("orders", 0, refresh=True).segments) == 5, (
        "dry run deletes nothing"
    )

    done = offloader.expire("orders", 0, cutoff)
    assert done.deleted_keys == [s.key for s in manifest.segments[:3]]
    after = offloader.manifest("orders", 0, refresh=True)
    assert [s.key for s in after.segments] == [s.key for s in manifest.segments[3:]]
    assert after.start_offset == manifest.segments[3].base_offset
    for key in done.deleted_keys:
        assert tier.size(key) is None
    assert offloader.expire("orders", 0, cutoff).segments == 0, "idempotent"
    assert read_tier(tier, "orders", 0) == snapshot(hot, "orders", 0)[after.start_offset :]


def test_a_cold_read_racing_retention_is_told_offset_too_small_not_an_error(hot, tier) -> None:
    """A reader whose cached manifest still names a segment that retention has just removed
    (manifest first, then the object) is told where the archive starts now, with
    OFFSET_TOO_SMALL: not an internal error, and not a gap."""
    for chunk in range(3):
        fill(hot, "orders", 400, queues=1, seed=90 + chunk)
        time.sleep(0.01)
    offloader = Offloader(hot, tier, "c1", "broker-a", OffloadPolicy(segment_max_messages=400))
    offloader.offload_queue("orders", 0)
    manifest = offloader.manifest("orders", 0)
    assert len(manifest.segments) == 3
    fetcher = ColdFetcher(tier, "c1", "broker-a")
    try:
        assert fetcher.manifest("orders", 0).segments == manifest.segments  # cached now
        cutoff = manifest.segments[0].max_store_timestamp + 1
        assert offloader.expire("orders", 0, cutoff).segments == 1  # the fetcher is not told
        messages, nxt = fetcher.get("orders", 0, 0, 10)
        assert (messages, nxt) == ([], manifest.segments[1].base_offset)
        assert fetcher.start_offset("orders", 0) == manifest.segments[1].base_offset

        # Through the store: the status says why, and where to go on from.
        hot.cold = fetcher
        hot.release_commitlog_files(lambda _file: True)
        assert hot.min_offset("orders", 0) == manifest.segments[1].base_offset
        result = hot.get_messages("orders", 0, 5, 10)
        assert result.status is GetStatus.OFFSET_TOO_SMALL
        assert result.next_offset == manifest.segments[1].base_offset

        # A segment the manifest still names but whose object is gone is a real loss: loud.
        tier.delete(manifest.segments[1].key)
        with pytest.raises(SegmentError):
            fetcher.get("orders", 0, manifest.segments[1].base_offset, 10)
    finally:
        fetcher.close()


class _CommitReplyLost:
    """The tier as the offloader sees it when the answer to a manifest PUT is lost: the PUT
    lands, the caller is told it failed (every retry's answer lost too)."""

    def __init__(self, inner: ObjectStore) -> None:
        self.inner = inner
        self.url = inner.url
        self.armed = True

    def put_if_absent(self, key: str, data: bytes, *, crc32c: int | None = None) -> bool:
        written = self.inner.put_if_absent(key, data, crc32c=crc32c)
        if self.armed and "/manifests/" in key:
            self.armed = False
            raise StorageError(f"put {key}: connection reset after the write landed (injected)")
        return written

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def test_release_after_a_commit_whose_reply_was_lost_leaves_readers_the_archive(
    tmp_path: Path, tier: ObjectStore
) -> None:
    """The first commit of a queue whose answer was lost (it landed): the next pass learns it
    from the tier and releases the files below it. Readers must learn it no later than release
    does: a reader that still knew "no archive" was told the hot store's first offset, past
    every released message (OFFSET_TOO_SMALL to a new start: the archive skipped). Decision
    691."""
    fetcher = ColdFetcher(tier, "c1", "broker-a", tiered_queues=lambda: [("orders", 0)])
    store = MessageStore(
        StoreConfig(data_dir=tmp_path / "hot", commitlog_file_size=64 << 10), cold=fetcher
    )
    store.start()
    offloader = None
    try:
        for i in range(200):
            store.put_message(Message(topic="orders", queue_id=0, body=b"%05d" % i + b"x" * 900))
        assert store.wait_dispatched()
        fetcher.prime()  # the reader knows the queue has no archive yet (refresher not running)
        assert fetcher.cached("orders", 0) is not None and store.min_offset("orders", 0) == 0
        lossy = _CommitReplyLost(tier)
        offloader = Offloader(
            store,
            lossy,  # type: ignore[arg-type]
            "c1",
            "broker-a",
            on_commit=fetcher.set_manifest,
            runner=LocalRunner(tier, threads=2, max_inflight=2),
        )
        # The claim stamps the empty prefix (decision 752): an empty archive, answered.
        lossy.armed = False
        offloader.claim("orders", 0)
        lossy.armed = True
        assert store.min_offset("orders", 0) == 0
        with pytest.raises(OffloadError):
            offloader.offload_queue("orders", 0)  # landed, but the answer was lost
        topics = {"orders": TopicConfig(name="orders", tiered=True)}
        released = store.release_commitlog_files(release_predicate(store, offloader, topics))
        assert released > 0, "the next pass releases below the commit that landed"
        assert store.hot_min_offset("orders", 0) > 0
        assert store.min_offset("orders", 0) == 0, "the archive is the queue's start"
        result = store.get_messages("orders", 0, 0, 10)
        assert result.status is GetStatus.FOUND
        assert [m.body[:5] for m in result.messages] == [b"%05d" % i for i in range(10)]
    finally:
        if offloader is not None:
            offloader.close()
        store.shutdown()
        fetcher.close()


def test_nothing_is_archived_before_it_is_on_the_local_disk(
    tmp_path: Path, tier: ObjectStore
) -> None:
    """ASYNC flush: a record is in the page cache before it is on disk. An archive holding a
    record the local disk may still lose would, after a power loss, hold other messages at the
    offsets the queue reuses (decision 693): the offloader flushes first."""
    store = MessageStore(
        StoreConfig(data_dir=tmp_path / "hot", flush="async", flush_interval_ms=3_600_000)
    )
    store.start()
    offloader = Offloader(store, tier, "c1", "broker-a")
    try:
        for i in range(50):
            store.put_message(Message(topic="orders", queue_id=0, body=b"m%03d" % i))
        assert store.wait_dispatched()
        end = store.max_physical_offset
        assert store.flushed_offset < end, "the flusher has not run: the records are unflushed"
        assert offloader.offload_queue("orders", 0).watermark == 50
        assert store.flushed_offset >= end, "archived while the local disk could still lose it"
    finally:
        offloader.close()
        store.shutdown()


@pytest.mark.parametrize("names", ["another queue", "another topic"])
def test_an_entry_naming_another_record_holds_the_queue_and_nothing_wrong_is_archived(
    tmp_path: Path, s3: Any, bucket: str, names: str
) -> None:
    """A ConsumeQueue entry of orders/0 rewritten on disk to name a real record in order (of
    queue 1, or of another topic's queue 0, at the same queue offset: the segment build's
    structure, CRC and queue-offset checks all pass it) is refused by the segment build in the
    cold worker process: the queue's archive stops before it, every archived message is the
    queue's own, the local files stay, the entry is noted, and the next start rebuilds it, after
    which the queue is archived whole and right (decision 730)."""
    from tiered.cold.worker import ColdWorker

    tier_url = f"s3://{bucket}/tier"
    tier = open_store(tier_url, s3.storage_options())
    config = StoreConfig(
        data_dir=tmp_path / "hot",
        commitlog_file_size=128 << 10,
        consumequeue_entries_per_file=256,
        index_hash_slots=509,
        index_max_entries=4000,
    )
    worker = ColdWorker(tier_url, s3.storage_options(), threads=2, max_inflight=4)
    worker.start()
    try:
        _hold_then_rebuild(tier, config, worker, names)
    finally:
        worker.close()


def test_a_hold_is_kept_for_the_status_logged_once_and_ended_by_a_commit_past_it(
    tmp_path: Path, s3: Any, bucket: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The offloader keeps where a queue's offload is held (``held``: offset, reason, since)
    for the admin status, logs it when it starts, not on every pass that meets it again, and
    ends the hold when a commit passes the entry (decision 755)."""
    from offload.offloader import DamagedEntryOffloadError
    from tiered.formats import CQ_DTYPE

    tier = open_store(f"s3://{bucket}/tier", s3.storage_options())
    config = StoreConfig(data_dir=tmp_path / "hot", consumequeue_entries_per_file=256)
    store = MessageStore(config)
    store.start()
    offloader = Offloader(store, tier, "c1", "broker-a", OffloadPolicy(segment_max_messages=100))
    try:
        fill(store, "orders", 400)  # 200 a queue
        ours = store.queue_entry_table("orders", 0, 150, 1)
        other = store.queue_entry_table("orders", 1, 150, 1)
        cq_file = config.data_dir / "consumequeue" / "orders" / "0" / f"{0:020d}"

        def put(entry: Any) -> None:
            with open(cq_file, "r+b") as f:
                f.seek(150 * 20)
                f.write(entry.astype(CQ_DTYPE).tobytes())

        put(other)
        assert offloader.held("orders", 0) is None
        with caplog.at_level("ERROR", logger="offload.offloader"):
            for _ in range(3):
                with pytest.raises(DamagedEntryOffloadError):
                    offloader.offload_queue("orders", 0)
        hold = offloader.held("orders", 0)
        assert hold is not None and hold.offset == 150
        assert f"names CommitLog [{int(other['offset'][0])}," in hold.reason
        assert "queue id 1 at queue offset 150" in hold.reason
        assert abs(hold.since_ms - time.time() * 1000) < 60_000
        held_lines = [r for r in caplog.records if "offload held at queue offset 150" in r.message]
        assert len(held_lines) == 1, "logged when it starts, not on every pass"
        assert offloader.watermark("orders", 0) == 100
        assert offloader.held("orders", 1) is None, "the other queue is not held"

        put(ours)  # the entry is right again (as a restart's rebuild makes it)
        caplog.clear()
        with caplog.at_level("WARNING", logger="offload.offloader"):
            assert offloader.offload_queue("orders", 0).watermark == 200
        assert offloader.held("orders", 0) is None
        assert any("no longer held at queue offset 150" in r.message for r in caplog.records)
    finally:
        offloader.close()
        store.shutdown()


def _hold_then_rebuild(tier: ObjectStore, config: StoreConfig, worker: Any, names: str) -> None:
    from offload.offloader import DamagedEntryOffloadError
    from tiered.formats import CQ_DTYPE

    store = MessageStore(config)
    store.start()
    policy = OffloadPolicy(segment_max_messages=100)
    offloader = Offloader(store, tier, "c1", "broker-a", policy, runner=worker)
    try:
        fill(store, "orders", 1200)  # 600 a queue, queue offsets 0..599
        fill(store, "audit", 1200, seed=2)
        before = snapshot(store, "orders", 0)
        assert len(before) == 600
        damaged = 400  # the first entry of the fifth segment of 100
        source = ("orders", 1) if names == "another queue" else ("audit", 0)
        other = store.queue_entry_table(*source, damaged, 1)
        ours = store.queue_entry_table("orders", 0, damaged, 1)
        assert len(other) == 1 and other["offset"][0] != ours["offset"][0]
        cq_file = config.data_dir / "consumequeue" / "orders" / "0" / f"{256 * 20:020d}"
        assert cq_file.exists(), sorted((cq_file.parent).iterdir())
        with open(cq_file, "r+b") as f:  # entry 400 is the 145th of the file from 256
            f.seek((damaged - 256) * 20)
            f.write(other.astype(CQ_DTYPE).tobytes())
        assert store.queue_entry_table("orders", 0, damaged, 1).tobytes() == other.tobytes()

        topics = {
            "orders": TopicConfig("orders", queues=2, tiered=True),
            "audit": TopicConfig("audit", queues=2, tiered=False),
        }
        can_release = release_predicate(store, offloader, topics)
        for _attempt in range(2):  # held: a second pass is refused the same way
            with pytest.raises(DamagedEntryOffloadError) as caught:
                offloader.offload_queue("orders", 0)
            message = str(caught.value)
            assert f"orders/0: offload held at queue offset {damaged}" in message
            assert f"CommitLog [{int(other['offset'][0])}," in message
            assert "restart the broker" in message
        watermark = offloader.watermark("orders", 0)
        assert watermark == damaged, "the segments before it are archived"
        archived = read_tier(tier, "orders", 0)
        assert archived == before[:watermark], "only the queue's own messages, byte-identical"
        assert all(m.queue_id == 0 and m.topic == "orders" for m in archived)
        store.release_commitlog_files(can_release)
        assert store.min_offset("orders", 0) <= watermark, "nothing unarchived was released"
        noted = (config.data_dir / "damaged_entries").read_text().splitlines()
        assert noted == [f'["orders", 0, {damaged}]']
    finally:
        offloader.close()
        store.shutdown()

    store = MessageStore(config)
    store.start()  # checks the noted entry and rebuilds it from the CommitLog
    offloader = Offloader(store, tier, "c1", "broker-a", policy, runner=worker)
    try:
        assert store.queue_entry_table("orders", 0, damaged, 1).tobytes() == ours.tobytes()
        assert not (config.data_dir / "damaged_entries").exists()
        assert offloader.offload_queue("orders", 0).watermark == 600
        assert read_tier(tier, "orders", 0) == before
    finally:
        offloader.close()
        store.shutdown()


def _fill_leaving(mnt: Path, free_bytes: int) -> None:
    """Fill the real filesystem at ``mnt`` with one file until only ``free_bytes`` are left."""
    fd = os.open(mnt / "filler", os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        with contextlib.suppress(OSError):  # ENOSPC: the disk is full
            while True:
                os.write(fd, b"\0" * 4096)
        os.ftruncate(fd, os.fstat(fd).st_size - free_bytes)
    finally:
        os.close(fd)


def test_a_tier_on_a_full_local_disk_never_commits_a_cut_off_manifest(
    hot: MessageStore, tmp_path: Path
) -> None:
    """A file:// tier on a real tmpfs that fills up during a pass: the disk has room for the
    pass's small segment but not for its manifest, which is bigger than one page. A write
    cut short by the full disk (``write`` returns less than asked, and no error) used to be
    fsynced and linked into place as the next manifest version: the commit "succeeded", the
    watermark moved, and every later load of the queue's manifest failed as unreadable (the
    whole queue's archive, not only the pass's messages). Now the commit fails, the archive
    stays the one committed before, and once the disk has room again the next pass uploads
    the rest: every message once."""
    with mounted_tmpfs(tmp_path / "tierdisk", "4m") as mnt:
        tier = open_store(f"file://{mnt}/tier", retry=RetryPolicy(attempts=2, base_delay_s=0.01))
        fill(hot, "orders", 400, queues=1, seed=3)
        # Many small segments: a manifest of well over one 4 KiB page.
        offloader = Offloader(hot, tier, "c1", "broker-a", OffloadPolicy(segment_max_messages=10))
        assert offloader.offload_queue("orders", 0).watermark == 400
        log = ManifestLog(tier, queue_prefix("c1", "broker-a", "orders", 0))
        committed = log.load()
        assert len(committed.encode()) > 2 * 4096
        fill(hot, "orders", 3, queues=1, seed=4)  # one small segment more: under one page
        _fill_leaving(mnt, 2 * 4096)  # the segment's page, and one page of the manifest
        with pytest.raises((StorageError, OffloadError, OSError)):
            offloader.offload_queue("orders", 0)
        current = log.load()  # raised ManifestError ("unreadable manifest") on main
        assert current.end_offset == 400 and current.segments == committed.segments
        assert not [p for p in (mnt / "tier").rglob(".tmp-*")], "no fragment left on the disk"
        os.unlink(mnt / "filler")
        assert offloader.offload_queue("orders", 0).watermark == 403
        assert read_tier(tier, "orders", 0) == snapshot(hot, "orders", 0)
