"""MessageStore: the one facade through which the broker uses the storage engine.

Write path: ``put_messages`` -> CommitLog append (-> fsync under SYNC) -> dispatcher builds the
ConsumeQueue and IndexFile entries -> the messages become readable.

Start-up (``start``) follows RocketMQ's ``DefaultMessageStore.load/recover``:

1. lock the data dir; an ``abort`` marker left behind means the last run crashed;
2. map the CommitLog (refusing a file of the wrong size), ConsumeQueues and IndexFiles;
3. find the end of valid CommitLog data: after a clean exit from the checkpoint's flushed
   offset, after a crash from the older of its flushed and dispatched offsets (the whole log
   when there is no usable checkpoint), checking magic code, size and body CRC; cut a torn tail;
4. drop ConsumeQueue entries past that end; rebuild IndexFile ranges no file covers;
5. re-dispatch what the ConsumeQueues and IndexFiles lack (all of it when the consumequeue
   directory is gone), then restore the next queue offset of every queue from its ConsumeQueue.

Threads: producers (``put_*``), the dispatcher, and the flusher (ASYNC flush, ConsumeQueue and
IndexFile flush, checkpoint). Readers never block writers.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import threading
import time
import traceback
import uuid
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from tiered import failpoints, fd_limit
from tiered.config import StoreConfig
from tiered.durable import settle_dir, write_file
from tiered.formats import CQ_DTYPE, CQ_ENTRY_SIZE, Entry, key_hash
from tiered.hot.checkpoint import Checkpoint, load_checkpoint, save_checkpoint
from tiered.hot.commitlog import (
    AppendBatch,
    AppendResult,
    CommitLog,
    DiskFullError,
    DispatchStuckError,
    DurabilityLostError,
    RecoveryReport,
    StoreUnwritableError,
    free_bytes,
)
from tiered.hot.consume_queue import ConsumeQueue, ConsumeQueueTable, DamageNotes
from tiered.hot.consume_queue import DamagedEntryError as DamagedEntryError
from tiered.hot.consume_queue import UnreadableEntryError as UnreadableEntryError
from tiered.hot.data_dir import DataDir
from tiered.hot.data_dir import DataDirLockedError as DataDirLockedError
from tiered.hot.dispatcher import Dispatcher
from tiered.hot.index_file import IndexFile, IndexService

# What start() raises, for callers above tiered (they never import tiered.hot).
from tiered.hot.mapped_file import MappedFile
from tiered.hot.mapped_file import StoreLoadError as StoreLoadError
from tiered.hot.mapped_file import offset_name as commitlog_file_name  # the cold worker reads
from tiered.names import MAX_NAME_LENGTH, NAME_CHARS, is_valid_name
from tiered.record import (
    CorruptRecordError,
    DispatchColumns,
    Message,
    RecordError,
    RecordSpans,
    StoredMessage,
    first_unchecked,
    read_store_timestamp,
    split_keys,
    tag_hash,
    topic_field,
)

log = logging.getLogger(__name__)

__all__ = [
    "DiskFullError",
    "DispatchStuckError",
    "DurabilityLostError",
    "StoreUnwritableError",
    "commitlog_file_name",
]

MAX_QUEUE_ID = 65535
# A replica wakes its dispatcher early once this much replicated data is not yet dispatched.
_REPLICA_WAKE_BYTES = 1 << 20
_TOPIC_CHECK_CACHE: set[str] = set()


class InvalidMessageError(ValueError):
    """A message the store refuses (bad topic or queue, body too large, bad properties)."""


class StoreNotRunningError(RuntimeError):
    pass


class ReplicaStoreError(RuntimeError):
    """The store of a slave takes bytes only from its master."""


class GetStatus(Enum):
    """Outcome of a read by queue offset (RocketMQ's ``GetMessageStatus``)."""

    FOUND = "FOUND"
    NO_MATCHED_MESSAGE = "NO_MATCHED_MESSAGE"  # entries exist but the tag filter took none
    NO_MESSAGE_IN_QUEUE = "NO_MESSAGE_IN_QUEUE"  # the queue is empty
    OFFSET_TOO_SMALL = "OFFSET_TOO_SMALL"  # below the queue's minimum (deleted or tiered)
    OFFSET_OVERFLOW_ONE = "OFFSET_OVERFLOW_ONE"  # exactly the next offset: wait for it
    OFFSET_OVERFLOW_BADLY = "OFFSET_OVERFLOW_BADLY"  # past the next offset
    NO_MATCHED_LOGIC_QUEUE = "NO_MATCHED_LOGIC_QUEUE"  # no such topic/queue here


@dataclass(slots=True)
class GetResult:
    status: GetStatus
    messages: list[StoredMessage]
    next_offset: int
    min_offset: int
    max_offset: int
    # A cold read asked for ``replies``: each message as the cold worker wrote its reply (then
    # ``messages`` is empty), and the bodies' bytes. None: the messages are in ``messages``.
    replies: list[bytes] | None = None
    body_bytes: int = 0


@dataclass(slots=True, frozen=True)
class CommitLogFileInfo:
    """What a retention predicate may look at before a CommitLog file is released."""

    path: Path
    from_offset: int
    end_offset: int
    modified_ms: int


@dataclass(slots=True, frozen=True)
class CommitLogStats:
    """The CommitLog's extent: what `tmq status`, the admin Stats call and `tmq store check`
    report."""

    min_offset: int
    max_offset: int
    files: int


@dataclass(slots=True, frozen=True)
class QueueSpan:
    """The queue offsets ``[first, last]`` of one (topic, queue) whose records lie in a CommitLog
    file (what release checks against the tier watermark)."""

    topic: str
    queue_id: int
    first: int
    last: int


@dataclass(slots=True)
class StartReport:
    clean_exit: bool
    checkpoint_found: bool
    commitlog: RecoveryReport
    cq_entries_dropped: int = 0
    # Zeroed ConsumeQueue entries inside a queue, rebuilt from the CommitLog (and those whose
    # record the CommitLog no longer holds: lost, and logged).
    cq_entries_repaired: int = 0
    cq_entries_unrepaired: int = 0
    redispatched_bytes: int = 0
    index_gaps_rebuilt: list[tuple[int, int]] = field(default_factory=list)
    consumequeue_rebuilt: bool = False
    seconds: float = 0.0


def record_key_hashes(msg: StoredMessage) -> set[int]:
    """The IndexFile hashes of a record: its unique id's and each key's (``index_keys``)."""
    out = {key_hash(msg.topic, k) for k in split_keys(msg.properties.get("KEYS"))}
    if msg.msg_id:
        out.add(key_hash(msg.topic, msg.msg_id))
    return out


def check_topic(topic: str) -> None:
    if topic in _TOPIC_CHECK_CACHE:
        return
    if not is_valid_name(topic):
        raise InvalidMessageError(
            f"invalid topic {topic!r}: use 1-{MAX_NAME_LENGTH} characters from {NAME_CHARS}"
        )
    if len(_TOPIC_CHECK_CACHE) < 100_000:
        _TOPIC_CHECK_CACHE.add(topic)


def _check_spans(spans: RecordSpans, max_body: int) -> int:
    """``put_messages``' checks of a ``RecordSpans`` batch, in the order it makes them of a list
    of ``Message``: the topic, then each message's queue id and body size. Returns the batch's
    length (every message checked) or raises ``InvalidMessageError`` for the first failing."""
    if not len(spans):
        return 0
    check_topic(spans.topic)
    fields = spans.fields()
    queue_ids, body_lengths = fields[:, 5], fields[:, 1]
    bad = np.flatnonzero((queue_ids < 0) | (queue_ids > MAX_QUEUE_ID) | (body_lengths > max_body))
    if len(bad):
        i = int(bad[0])
        if not 0 <= queue_ids[i] <= MAX_QUEUE_ID:
            raise InvalidMessageError(f"queue id {int(queue_ids[i])} is out of range")
        raise InvalidMessageError(
            f"message body is {int(body_lengths[i])} bytes; the limit is {max_body}"
        )
    return len(spans)


GEOMETRY_FILE = "store.json"
# The data directory's identity: a random id made when the directory is first used, and stamped
# by the offloader in every manifest it commits, so that a broker on another (or a wiped) data
# directory knows a tier prefix it did not write (decision 690).
STORE_ID_FILE = "store-id"
# Queues that continue above their local end, at the end of their archive (decision 720): a
# queue offset below a queue's floor is never written in this directory again.
QUEUE_FLOORS_FILE = "queue-floors.json"
_GEOMETRY_KEYS = (
    "commitlog_file_size",
    "consumequeue_entries_per_file",
    "index_hash_slots",
    "index_max_entries",
)


def recorded_geometry(data_dir: Path) -> dict[str, int] | None:
    """The file sizes a data dir was created with (``store.json``), if it has been used."""
    path = data_dir / GEOMETRY_FILE
    settle_dir(data_dir)  # what is read below is durable before it is acted on
    if not path.exists():
        return None
    raw = json.loads(path.read_text())
    return {k: int(raw[k]) for k in _GEOMETRY_KEYS}


def store_identity(data_dir: Path) -> str:
    """The data directory's identity (``STORE_ID_FILE``), made durably on first use. It stays
    with the directory's files (a copy of the directory is the same store), and a new, wiped or
    other directory has another."""
    path = data_dir / STORE_ID_FILE
    settle_dir(data_dir)
    try:
        found = path.read_text().strip()
    except FileNotFoundError:
        found = ""
    if found:
        return found
    made = uuid.uuid4().hex
    write_file(path, (made + "\n").encode())
    return made


def load_queue_floors(data_dir: Path) -> dict[tuple[str, int], int]:
    """The queue floors recorded in ``data_dir`` (``QUEUE_FLOORS_FILE``; none if absent). An
    unreadable file refuses the start: without it a queue could be written again at offsets
    its archive holds (decision 720)."""
    path = data_dir / QUEUE_FLOORS_FILE
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raw = None
    try:
        floors = (
            {}
            if raw is None
            else {(str(t), int(q)): int(f) for t, q, f in json.loads(raw)["queues"]}
        )
    except (ValueError, KeyError, TypeError) as e:
        raise StoreLoadError(
            f"{path} is unreadable ({e}): it says where queues continue above their local "
            "end, at their archive's end. Restore it, or remove it only if no queue of this "
            "directory is tiered"
        ) from e
    # Durable before the start acts on it (decision 1184); after the parse, so that a damaged
    # file is what a start on a dying disk reports.
    settle_dir(data_dir)
    return floors


def check_geometry(config: StoreConfig) -> None:
    """Refuse a configuration whose file sizes differ from those the data was written with:
    every file would look damaged. Records the geometry on first use."""
    wanted = {k: getattr(config, k) for k in _GEOMETRY_KEYS}
    recorded = recorded_geometry(config.data_dir)
    if recorded is None:
        write_file(config.data_dir / GEOMETRY_FILE, (json.dumps(wanted, indent=2) + "\n").encode())
        return
    diff = {k: (recorded[k], wanted[k]) for k in _GEOMETRY_KEYS if recorded[k] != wanted[k]}
    if diff:
        detail = ", ".join(f"{k} was {a}, configured {b}" for k, (a, b) in diff.items())
        raise StoreLoadError(
            f"{config.data_dir} was created with other file sizes ({detail}); "
            f"configure the sizes in {GEOMETRY_FILE}"
        )


class ColdReader(Protocol):
    """The cold tier as the store sees it (``tiered.cold.fetcher.ColdFetcher``).

    ``start_offset``, ``end_offset``, ``may_hold`` and ``archive_start`` answer from what the
    reader last loaded: hot reads call them, and a hot read never waits on the object store.
    ``archive_start`` raises ``ColdTierUnavailableError`` while a tiered queue's archive is not
    known (no manifest loaded yet), where ``start_offset`` answers None. ``get`` and the
    lookups are cold reads, each with its own deadline. ``get_replies`` answers with what
    ``reply_encoder`` (None: no replies) wrote for each message."""

    reply_encoder: Callable[..., Any] | None

    def start_offset(self, topic: str, queue_id: int) -> int | None: ...

    def end_offset(self, topic: str, queue_id: int) -> int: ...

    def may_hold(self, topic: str, queue_id: int, offset: int) -> bool: ...

    def archive_start(self, topic: str, queue_id: int) -> int | None: ...

    def get(
        self,
        topic: str,
        queue_id: int,
        offset: int,
        max_count: int,
        tag_filter: Callable[[StoredMessage], bool] | None = None,
        max_bytes: int = 4 << 20,
    ) -> tuple[list[StoredMessage], int]: ...

    def get_replies(
        self, topic: str, queue_id: int, offset: int, max_count: int, max_bytes: int = 4 << 20
    ) -> tuple[list[bytes], int, int]: ...

    def offset_for_timestamp(self, topic: str, queue_id: int, timestamp_ms: int) -> int: ...

    def query_by_key(
        self, topic: str, queue_id: int, key: str, begin_ms: int, end_ms: int, limit: int
    ) -> list[StoredMessage]: ...


class MessageStore:
    """The facade over both tiers that everything above ``tiered`` uses: the broker, offload,
    status and the CLI reach the CommitLog, ConsumeQueues and IndexFiles only through these
    methods."""

    def __init__(self, config: StoreConfig, cold: ColdReader | None = None) -> None:
        self.config = config
        self._store_id: str | None = None
        self.data_dir = DataDir(config.data_dir)
        self.commitlog = CommitLog(config)
        self.queues = ConsumeQueueTable(
            config.consumequeue_dir, config.consumequeue_entries_per_file
        )
        self.index = IndexService(
            config.index_dir, config.index_hash_slots, config.index_max_entries
        )
        # A roll leaves room for a few ConsumeQueue files and the IndexFile slots its messages
        # may need: those are written through mappings, where a full disk is a SIGBUS.
        self.commitlog.roll_reserve_bytes = (
            16 * config.consumequeue_entries_per_file * CQ_ENTRY_SIZE
            + IndexFile.file_size(config.index_hash_slots, 0)
            + (1 << 20)
        )
        self.dispatcher: Dispatcher | None = None
        self.commitlog.room.dispatched_to = self._dispatched_to
        self.checkpoint_path = config.data_dir / "checkpoint"
        self._damage_notes = DamageNotes(config.data_dir / "damaged_entries")
        self.corrupt_records: list[int] = []
        self.start_report: StartReport | None = None
        # The cold tier's reader when topics are tiered: reads below the hot tier go there.
        self.cold = cold
        self._running = False
        self._flusher: threading.Thread | None = None
        self._stop_flusher = threading.Event()
        # Recovery left bytes for the flusher (ASYNC): its first flush runs at once.
        self._flush_at_start = False
        self._maintenance_lock = threading.Lock()
        # The last checkpoint save found the disk full (logged once until one succeeds).
        self._checkpoint_skipped = False
        # The flusher and a promotion's or truncation's checkpoint share one ``.tmp`` file.
        self._checkpoint_lock = threading.Lock()
        self._append_listeners: list[Callable[[int], None]] = []
        self._replica = False
        # The native single send (decision 820) is there: the native group commit gate.
        self._sync_native = self.commitlog.has_native_send
        self._dispatch_coalesce_s = 0.001
        # Where queues continue above their local end (``start_queue_at``, decision 720).
        self.queue_floors: dict[tuple[str, int], int] = {}

    # -- lifecycle -----------------------------------------------------------------------------

    def start(self) -> StartReport:
        started = time.monotonic()
        fd_limit.raise_soft_limit()  # one descriptor per mapped file (decision 1003)
        self.data_dir.lock()
        try:
            report = self._load_and_recover()
        except BaseException as e:
            # The failed frames' locals may hold views of the mappings closed next, and a
            # mapping with a view cannot close: its BufferError would hide this error.
            traceback.clear_frames(e.__traceback__)
            # Every part is closed and the lock released even when the disk refuses a close
            # (EIO writing an IndexFile's header on a dead disk): that error is logged and
            # noted on this one, which stays the one raised, as it is why the start failed.
            for close in (self.commitlog.close, self.queues.close, self.index.close):
                try:
                    close()
                except Exception as cleanup:
                    log.error("closing the store after its start failed: %s", cleanup)
                    e.add_note(f"closing the store after this failed also failed: {cleanup!r}")
            self.data_dir.unlock()
            if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
                raise StoreLoadError(
                    f"{self.config.data_dir}: the disk is full ({e.strerror}); recovery "
                    "cannot write its IndexFile entries and checkpoint. Free space and start "
                    "again: recovery resumes from the last checkpoint"
                ) from e
            if fd_limit.exhausted(e):
                raise StoreLoadError(
                    f"{self.config.data_dir}: {fd_limit.describe()}, and start again ({e})"
                ) from e
            raise
        self.data_dir.mark_running()
        self._running = True
        assert self.dispatcher is not None
        self.dispatcher.start()
        self._flusher = threading.Thread(target=self._flush_loop, name="tmq-flusher", daemon=True)
        self._flusher.start()
        report.seconds = time.monotonic() - started
        self.start_report = report
        log.info(
            "store open at %s: last exit %s, CommitLog [%d, %d), %d queues, recovery took %.2fs",
            self.config.data_dir,
            "clean" if report.clean_exit else "CRASHED",
            self.commitlog.min_offset,
            self.commitlog.max_offset,
            len(self.queues.queues),
            report.seconds,
        )
        return report

    @property
    def store_id(self) -> str:
        """This data directory's identity (``store_identity``)."""
        if self._store_id is None:
            self._store_id = store_identity(self.config.data_dir)
        return self._store_id

    def _load_and_recover(self) -> StartReport:
        check_geometry(self.config)
        self._store_id = store_identity(self.config.data_dir)
        self._check_room_for_a_commitlog_file()
        clean = self.data_dir.last_exit_was_clean
        cp = load_checkpoint(self.checkpoint_path)
        if not clean:
            log.warning(
                "%s: the last run did not shut down cleanly; recovering", self.config.data_dir
            )
        self.commitlog.load()
        cq_dir_present = self.config.consumequeue_dir.exists()
        # The ConsumeQueues and IndexFiles load beside the CommitLog scan (which runs without
        # the GIL): they touch different files, and only the cut below needs all three. The
        # IndexFile check is native too (decision 830).
        pool = ThreadPoolExecutor(1, thread_name_prefix="tmq-recovery-cq")
        queues_loaded = pool.submit(self._load_queues_and_index)
        pool.shutdown(wait=False)
        try:
            # The scan hands over the dispatch fields of what it validates: re-dispatch then
            # reads no CommitLog byte a second time (decision 240).
            scanned: list[DispatchColumns] = []
            start = self._recovery_start(clean, cp)
            cl_report = self.commitlog.recover(
                start,
                check_crc=self.config.check_crc_on_recover,
                durable_offset=None if cp is None else cp.flushed_offset,
                columns=scanned,
            )
        finally:
            queues_loaded.result()
        if not self.commitlog.files.files:
            # No CommitLog: nothing the ConsumeQueues or IndexFiles point at exists any more.
            if self.queues.queues or self.index.files:
                log.warning("no CommitLog files: dropping ConsumeQueues and IndexFiles")
            self.queues.destroy()
            self.index.destroy_all()

        self.corrupt_records = list(cl_report.corrupt_records)
        syncing: Future[None] | None = None
        if self.config.flush == "sync":
            # The fdatasync of what recovery kept (1 GiB after a crash may all be dirty) runs
            # beside the ConsumeQueue repair and re-dispatch, which touch other files.
            pool = ThreadPoolExecutor(1, thread_name_prefix="tmq-recovery-sync")
            syncing = pool.submit(self.commitlog.sync_recovered, cl_report.scanned_from)
            pool.shutdown(wait=False)
        end = cl_report.end_offset if self.commitlog.files.files else 0
        try:
            report = StartReport(
                clean_exit=clean, checkpoint_found=cp is not None, commitlog=cl_report
            )
            report.cq_entries_dropped = self.queues.truncate_from_physical(end)
            # Entries for records past the scan's start may be in the page cache only (kill -9):
            # they are fsynced before any checkpoint counts them as dispatched.
            self.queues.mark_unflushed_from(start)
            self._clamp_index(end)

            cl_min = self.commitlog.min_offset
            # Entries pointing below the CommitLog's first file were released (retention).
            self.queues.correct_min_offsets(cl_min)
            self.queue_floors = load_queue_floors(self.config.data_dir)
            self._apply_queue_floors()
            self.index.delete_before(cl_min)
            if self.queues.queues and cp is not None:
                reput = self.queues.max_physical_end
                if not clean:
                    reput = min(reput, cp.dispatched_offset)
            elif self.queues.queues:
                # No checkpoint says how far every ConsumeQueue was flushed, and queues flush
                # apart: the furthest one proves nothing of the others. Re-dispatch is
                # idempotent, so all of it runs again (RocketMQ's recovery from the first
                # file); the scan has already read it as columns.
                reput = cl_min
            else:
                reput = cl_min
                report.consumequeue_rebuilt = end > cl_min
                if report.consumequeue_rebuilt:
                    log.warning(
                        "%s: %s; rebuilding every ConsumeQueue from the CommitLog",
                        self.config.consumequeue_dir,
                        "is empty" if cq_dir_present else "is missing",
                    )
            reput = self._redispatch_cut_tails(reput, cl_min)
            reput = min(max(reput, cl_min), end)
            dispatcher = self._new_dispatcher(reput, end)
            index_from = dispatcher.index_from
            for gap in self.index.gaps(cl_min, min(index_from, end)):
                dispatcher.rebuild_index(*gap)
                report.index_gaps_rebuilt.append(gap)
            report.redispatched_bytes = end - dispatcher.reput_offset
            dispatcher.preload(scanned)
            del scanned
            dispatcher.dispatch(end)
            dispatcher.preload([])
            self._repair_holes(dispatcher, report)
            failpoints.hit("store.after_cq_repair")
            self.commitlog.on_append = dispatcher.submit
            for (topic, queue_id), cq in self.queues.queues.items():
                self.commitlog.queue_offsets[(topic, queue_id)] = cq.max_offset
        except BaseException:
            if syncing is not None:
                syncing.exception()  # the files close next: let the fdatasync finish first
            raise
        scanned_from = report.commitlog.scanned_from
        if syncing is None:
            # ASYNC: what recovery kept is flushed like fresh appends, by the flusher, which
            # starts at once; the checkpoint claims nothing past the scan's start until then.
            self.commitlog.defer_recovered_sync(scanned_from)
            self._flush_at_start = report.commitlog.end_offset > scanned_from
            self._save_checkpoint(scanned_from, scanned_from)
            return report
        # SYNC: what recovery kept is durable before anything is acknowledged on top of it.
        syncing.result()
        self.queues.flush()
        self.index.flush()
        self._save_checkpoint()
        return report

    def _load_queues_and_index(self) -> None:
        """Load (and check) the ConsumeQueues, then the IndexFiles: the derived files, which
        the start loads beside the CommitLog scan.

        Then the IndexFiles' entries past where indexing resumes are dropped here too, before
        the scan ends (decision 930): ``_new_dispatcher`` drops those at or past
        ``min(max(index end, CommitLog min), recovered end)``, and the recovered end only
        lowers that bound, which the cut after the scan (``_clamp_index``) then applies. Cutting
        at the higher bound first drops a subset of the same newest entries, and cuts compose
        (each sets the slots back along their chains to the newest entry left), so the result
        is the sequential one; what is left for after the scan is one entry read a file."""
        self.queues.load_and_recover()
        self.index.load()
        if self.index.files:
            index_from = max(self.index.end_offset, self.commitlog.min_offset)
            for f in self.index.files:
                f.cut_entries_from(index_from)

    def _apply_queue_floors(self) -> None:
        """Start every queue with a floor at or above it, before re-dispatch: a queue that ends
        below its floor is emptied and starts at it (its records below are archived; re-dispatch
        skips them, as it skips any offset below a queue's end), and one that holds entries
        below it starts at it (reads below go to the archive)."""
        for (topic, queue_id), floor in self.queue_floors.items():
            cq = self.queues.get_or_create(topic, queue_id)
            if cq.max_offset < floor:
                cq.destroy()
                cq.min_offset = cq.max_offset = floor
                cq.max_physical_end = 0
            elif cq.min_offset < floor:
                cq.min_offset = floor

    def start_queue_at(self, topic: str, queue_id: int, offset: int) -> bool:
        """Make ``offset`` the queue's next offset when its local end is below it (False: it
        is not), as Kafka's ``truncateFullyAndStartAt``: the queue's ConsumeQueue entries, all
        below ``offset``, are dropped, and reads below ``offset`` go to the cold tier. For a
        tiered queue whose archive ends above its local end (decision 720): its next messages
        must not reuse offsets the archive holds. Recorded durably first, so a crash before the
        next message still starts the queue there. Call it before any append can reach the
        queue (the broker calls it before it serves)."""
        if not self._running:
            raise StoreNotRunningError("the store is not running")
        key = (topic, queue_id)
        with self._maintenance_lock:
            self.wait_dispatched()
            if self.max_offset(topic, queue_id) >= offset:
                return False
            if self.commitlog.queue_offsets.get(key, 0) >= offset:
                return False
            self._save_queue_floors({**self.queue_floors, key: offset})
            self.commitlog.reset_queue_offsets({**self.commitlog.queue_offsets, key: offset})
            return True

    def _save_queue_floors(self, floors: dict[tuple[str, int], int]) -> None:
        """Record ``floors`` durably, then apply them (a restart keeps what a read saw)."""
        rows = sorted([t, q, f] for (t, q), f in floors.items())
        write_file(self.config.data_dir / QUEUE_FLOORS_FILE, json.dumps({"queues": rows}).encode())
        self.queue_floors = floors
        self._apply_queue_floors()

    def raise_queue_floor(self, topic: str, queue_id: int, offset: int) -> None:
        """Make ``offset`` the queue's first local offset when its entries start below it (a
        no-op when they do not): reads below go to the cold tier, as for a queue floor of
        ``start_queue_at``, and the floor is recorded durably first, so a restart keeps it.
        For a tiered queue whose archive is the truth below ``offset`` (a resolved divergence,
        decision 800); the queue must reach ``offset`` already."""
        if not self._running:
            raise StoreNotRunningError("the store is not running")
        key = (topic, queue_id)
        with self._maintenance_lock:
            self.wait_dispatched()
            if self.max_offset(topic, queue_id) < offset:
                raise ValueError(
                    f"{topic}/{queue_id} ends at {self.max_offset(topic, queue_id)}, below the "
                    f"floor {offset}"
                )
            if self.queue_floors.get(key, 0) >= offset:
                return
            self._save_queue_floors({**self.queue_floors, key: offset})

    def _redispatch_cut_tails(self, reput: int, cl_min: int) -> int:
        """Where re-dispatch must start so that the entries loading cut off a queue's end come
        back (decision 685). Re-dispatch starts at the furthest queue's end after a clean exit,
        and at the checkpoint after a crash: both count a queue's entries as written, so a
        queue whose file was cut short (or torn) by damage kept a shorter end, and its next
        message took a queue offset the CommitLog already held. After a crash a cut tail is
        usually a torn write or a roll the crash cut short, whose records lie past the
        checkpoint, so this costs little; but the checkpoint cannot tell that apart from damage
        to entries it counts, so every cut tail is re-dispatched. Re-dispatch is idempotent for
        every other queue."""
        for cq in self.queues.cut_tails:
            held = cq.max_offset > cq.min_offset and cq in self.queues.queues.values()
            resume = cq.max_physical_end if held else cl_min
            if resume < reput:
                log.warning(
                    "ConsumeQueue %s/%d: %s; its entries from queue offset %d are rebuilt by "
                    "re-dispatching the CommitLog from offset %d",
                    cq.topic,
                    cq.queue_id,
                    cq.tail_cut,
                    cq.max_offset,
                    resume,
                )
                reput = resume
        return reput

    def _repair_holes(self, dispatcher: Dispatcher, report: StartReport) -> None:
        """Rebuild ConsumeQueue entries zeroed inside a queue (a torn write, bit rot) from the
        CommitLog. Re-dispatch cannot: it writes only past a queue's end. A run of holes lies
        between two entries that survived, and entries are in CommitLog order within a queue,
        so its records are in the CommitLog between those two: only that range is read.

        A queue's first entries zeroed leave no surviving entry before them, and look like the
        empty slots a queue that started late has in its first file (decision 503): their
        records, if any, precede the queue's first surviving entry in the CommitLog. One pass
        over the CommitLog up to the furthest such entry finds them, for every queue at once."""
        self._repair_leading_slots(dispatcher, report)
        cl_end = self.commitlog.max_offset
        suspects = self._damage_notes.load()
        rebuilt: list[ConsumeQueue] = []
        for (topic, queue_id), cq in list(self.queues.queues.items()):

            def verify(
                qoff: int, at: int, size: int, topic: str = topic, qid: int = queue_id
            ) -> bool:
                return self._entry_names_its_record(topic, qid, qoff, at, size)

            runs = cq.holes(cl_end, verify, suspects.get((topic, queue_id), ()))
            for first, end in runs:
                before, after = cq.get_entry(first - 1), cq.get_entry(end)
                lo = before[0] + before[1] if before else self.commitlog.min_offset
                hi = after[0] if after else self.commitlog.max_offset
                found = 0
                for key, qoff, phys, size, tag in dispatcher.records(lo, hi):
                    if key == (topic, queue_id) and first <= qoff < end:
                        found += cq.fill(qoff, phys, size, tag_hash(tag), overwrite=True)
                report.cq_entries_repaired += found
                if found:
                    rebuilt.append(cq)
                if found == end - first:
                    log.warning(
                        "ConsumeQueue %s/%d: rebuilt the damaged entries [%d, %d) (zeroed, or "
                        "naming no record of theirs) from the CommitLog",
                        topic,
                        queue_id,
                        first,
                        end,
                    )
                    continue
                report.cq_entries_unrepaired += end - first - found
                log.error(
                    "ConsumeQueue %s/%d: %d of the damaged entries [%d, %d) have no record in "
                    "CommitLog [%d, %d): those messages are lost, and a read of them fails",
                    topic,
                    queue_id,
                    end - first - found,
                    first,
                    end,
                    lo,
                    hi,
                )

        if suspects:
            # The notes go only once the entries they led to are durable: an ASYNC start's
            # checkpoint fsyncs the data dir at once (making the notes' removal durable) while
            # the flusher writes the rebuilt entries back later, and a power loss between the
            # two kept the wrong entries with nothing left to say so (decision 1261).
            for cq in rebuilt:
                cq.flush()
        self._damage_notes.clear()

    def _entry_names_its_record(
        self, topic: str, queue_id: int, queue_offset: int, at: int, size: int
    ) -> bool:
        """Whether CommitLog ``[at, at + size)`` holds the record of ``topic``/``queue_id`` at
        ``queue_offset``: one whole record of that size, with that queue and queue offset."""
        try:
            msg = self.commitlog.read_message(at, size, check_crc=False)
        except RecordError:
            return False
        return (
            msg is not None
            and msg.size == size
            and msg.queue_offset == queue_offset
            and msg.queue_id == queue_id
            and msg.topic == topic
        )

    def _repair_leading_slots(self, dispatcher: Dispatcher, report: StartReport) -> None:
        """Rebuild a queue's zeroed first entries from the records before its first entry."""
        cl_min = self.commitlog.min_offset
        # Slots below a queue's floor are not the queue's any more: its records there (if
        # any are left) are archived, and the queue starts at the floor (decision 720).
        leading = {
            key: (max(slots[0], self.queue_floors.get(key, 0)), slots[1], slots[2])
            for key, cq in self.queues.queues.items()
            if (slots := cq.leading_slots()) is not None
            and slots[2] > cl_min
            and self.queue_floors.get(key, 0) < slots[1]
        }
        if not leading:
            return
        started = time.monotonic()
        end = max(phys for _first, _min, phys in leading.values())
        found: dict[tuple[str, int], int] = {}
        for key, qoff, phys, size, tag in dispatcher.records(cl_min, end):
            slots = leading.get(key)
            if slots is not None and slots[0] <= qoff < slots[1] and phys < slots[2]:
                filled = self.queues.queues[key].fill(qoff, phys, size, tag_hash(tag))
                found[key] = found.get(key, 0) + filled
        for (topic, queue_id), count in found.items():
            report.cq_entries_repaired += count
            log.warning(
                "ConsumeQueue %s/%d: rebuilt %d zeroed entries before queue offset %d from the "
                "CommitLog; the queue starts at %d again",
                topic,
                queue_id,
                count,
                leading[(topic, queue_id)][1],
                self.queues.queues[(topic, queue_id)].min_offset,
            )
        log.info(
            "checked the first entries of %d queue(s) against CommitLog [%d, %d) in %.3f s",
            len(leading),
            cl_min,
            end,
            time.monotonic() - started,
        )

    @staticmethod
    def _recovery_start(clean: bool, cp: Checkpoint | None) -> int | None:
        """Where the CommitLog scan starts: after a clean exit the flushed offset, after a
        crash the older of the flushed and dispatched offsets (None: the first file)."""
        if cp is None:
            return None
        if clean:
            return cp.flushed_offset
        return min(cp.flushed_offset, cp.dispatched_offset)

    def _new_dispatcher(self, reput: int, end: int) -> Dispatcher:
        """A new dispatcher (not started) resuming at ``reput``, or earlier where IndexFiles
        stop before it."""
        index_from = min(max(self.index.end_offset, self.commitlog.min_offset), end)
        # The records from ``index_from`` on are indexed again. Entries a file already has for
        # them (after kill -9 the header's end lags its entry count) would stay as duplicates
        # at higher numbers with lower offsets, where a query takes a chain that is not in
        # CommitLog order for damage (decision 757): drop them first.
        for f in self.index.files:
            f.cut_entries_from(index_from)
        self.dispatcher = Dispatcher(
            self.commitlog,
            self.queues,
            self.index,
            reput_offset=min(reput, index_from),
            index_from=index_from,
        )
        self.dispatcher.coalesce_s = self._dispatch_coalesce_s
        self._route_flush_wakeups()
        return self.dispatcher

    def _dispatched_to(self) -> int:
        """Where dispatch has reached: every record before it has its ConsumeQueue and
        IndexFile entries (what the append path's room check pays off, decision 680)."""
        dispatcher = self.dispatcher
        return dispatcher.reput_offset if dispatcher is not None else 0

    def _check_room_for_a_commitlog_file(self) -> None:
        """Refuse to start a store that could never store a message: no CommitLog file yet,
        and no room for the first one at the configured size."""
        cl_dir = self.config.commitlog_dir
        if cl_dir.exists() and any(not p.name.startswith(".") for p in cl_dir.iterdir()):
            return
        need = self.config.commitlog_file_size + self.commitlog.roll_reserve_bytes
        free = free_bytes(self.config.data_dir)
        if free < need:
            raise StoreLoadError(
                f"{self.config.data_dir} has {free} bytes free, but a CommitLog file of "
                f"commitlog_file_size = {self.config.commitlog_file_size} bytes (and "
                f"{self.commitlog.roll_reserve_bytes} for its ConsumeQueue and IndexFile "
                f"entries) needs {need}: free space or configure a smaller commitlog_file_size"
            )

    def _clamp_index(self, end: int) -> None:
        """IndexFiles must not claim CommitLog bytes that recovery cut off."""
        for f in list(self.index.files):
            if f.header.begin_offset >= end:
                self.index.files.remove(f)
                f.destroy()
            else:
                if f.header.end_offset > end:
                    f.header.end_offset = end
                # Its entries past ``end`` (the header's end may lag them after a crash) would
                # name the records written there next.
                f.cut_entries_from(end)

    def shutdown(self) -> None:
        if not self._running:
            return
        self._running = False
        self._stop_flusher.set()
        if self._flusher is not None:
            self._flusher.join()
        assert self.dispatcher is not None
        if self.commitlog.failed is not None:
            # Failed before: whoever flushed was told then; nothing more to raise.
            self._close_failed()
            return
        try:
            self.commitlog.flush()
        except DurabilityLostError:
            # The disk died since the last flush: nobody was told yet. Close as a failed
            # store, then raise, so the caller does not take this for a clean stop.
            self._close_failed()
            raise
        # A clean exit means every CommitLog byte is also in the ConsumeQueues and IndexFiles.
        self.dispatcher.stop()
        try:
            self.dispatcher.dispatch(self.commitlog.max_offset)
        except OSError as e:
            # A disk too full for a ConsumeQueue file or IndexFile entries: what is not
            # dispatched is in the flushed CommitLog, and the next start re-dispatches it.
            log.error("dispatch at shutdown failed (%s)", e)
        clean = self.dispatcher.reput_offset >= self.commitlog.max_offset
        try:
            self.queues.flush()
            self.index.flush()
            # A checkpoint the full disk refused leaves the exit unclean: the next start
            # recovers.
            saved = self._save_checkpoint_if_room()
        except OSError as e:
            self.commitlog.fail(e)
            self._close_failed()
            raise DurabilityLostError(f"the store refuses writes: an fsync failed ({e})") from e
        self.commitlog.close()
        self.queues.close()
        self.index.close()
        if clean and saved:
            self.data_dir.mark_clean_exit()
        elif clean:
            log.error("no checkpoint could be saved at shutdown; the next start will recover")
        else:
            log.error(
                "dispatch is behind at shutdown; the next start will recover as after a crash"
            )
        self.data_dir.unlock()

    def _close_failed(self) -> None:
        """Shut down a store whose disk failed: nothing more may be claimed durable, so the
        abort marker stays and the next start recovers from what the disk really holds. The
        disk that failed may fail the closes too (an IndexFile's header write meets EIO):
        every part is still closed and the lock released, and those errors only logged."""
        assert self.dispatcher is not None
        self.dispatcher.stop()
        for close in (self.commitlog.close, self.queues.close, self.index.close):
            try:
                close()
            except OSError as e:
                log.error("closing a failed store: %s", e)
        self.data_dir.unlock()

    def __enter__(self) -> MessageStore:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # -- flush ---------------------------------------------------------------------------------

    def _flush_loop(self) -> None:
        interval = self.config.flush_interval_ms / 1000
        wait = 0.0 if self._flush_at_start else interval
        while not self._stop_flusher.wait(wait):
            wait = interval
            try:
                self.flush()
            except DurabilityLostError:
                return  # logged once by the CommitLog; retrying would claim lost bytes durable
            except Exception:
                log.exception("flush failed; retrying in %.1fs", interval)

    def flush(self) -> None:
        """fsync the CommitLog, then ConsumeQueues and IndexFiles, then save the checkpoint.

        Any fsync failure, of the CommitLog or of derived files, stops the store taking writes
        (``DurabilityLostError``), and no checkpoint is written after it.
        """
        d = self.dispatcher
        # Read how far dispatch and indexing got *before* flushing their files: whatever they
        # add during the flush may not be on disk, and a checkpoint must never claim it.
        dispatched = d.reput_offset if d else 0
        indexed = self.index.end_offset
        self.commitlog.flush()
        try:
            self.queues.flush()
            self.index.flush()
            self._save_checkpoint_if_room(dispatched, indexed)
        except OSError as e:
            self.commitlog.fail(e)
            raise DurabilityLostError(f"the store refuses writes: an fsync failed ({e})") from e

    def _save_checkpoint_if_room(
        self, dispatched: int | None = None, indexed: int | None = None
    ) -> bool:
        """``_save_checkpoint``, skipped (False) when the disk has no room for it. Nothing
        durable is at stake: the checkpoint is replaced whole (write, fsync, rename), so the
        previous one stays, and it claims less than the new one would (its offsets only grow),
        which costs the next recovery a longer scan. A disk filled by another writer must not
        turn the store read-only as a failed fsync does: appends into the preallocated CommitLog
        file are still durable, and the next flush after space is freed saves it again."""
        try:
            self._save_checkpoint(dispatched, indexed)
        except OSError as e:
            if e.errno in (errno.EMFILE, errno.ENFILE):
                # No descriptor for the ``.tmp`` or for the directory's fsync: nothing was
                # lost either (the fsyncs of the data came before), and a store turned
                # read-only by it would refuse every send until a restart (decision 1003).
                if not self._checkpoint_skipped:
                    log.warning("%s: not updated: %s", self.checkpoint_path, fd_limit.describe())
                self._checkpoint_skipped = True
                return False
            if e.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
            if not self._checkpoint_skipped:
                log.warning(
                    "%s: the disk is full (%s); the checkpoint is not updated until space is "
                    "freed (a restart meanwhile recovers from the previous one)",
                    self.checkpoint_path,
                    e.strerror,
                )
            self._checkpoint_skipped = True
            return False
        self._checkpoint_skipped = False
        return True

    def _save_checkpoint(self, dispatched: int | None = None, indexed: int | None = None) -> None:
        """Record what is on disk. ``dispatched`` and ``indexed`` must have been read before
        the ConsumeQueues and IndexFiles were flushed (default: now, when nothing runs)."""
        d = self.dispatcher
        if dispatched is None:
            dispatched = d.reput_offset if d else 0
        if indexed is None:
            indexed = self.index.end_offset
        with self._checkpoint_lock:
            save_checkpoint(
                self.checkpoint_path,
                Checkpoint(
                    physic_timestamp=self.commitlog.last_store_timestamp,
                    logics_timestamp=d.logics_timestamp if d else 0,
                    index_timestamp=d.logics_timestamp if d else 0,
                    flushed_offset=self.commitlog.flushed_offset,
                    dispatched_offset=min(dispatched, self.commitlog.flushed_offset),
                    index_offset=min(indexed, dispatched),
                ),
            )

    # -- write ---------------------------------------------------------------------------------

    def put_message(self, msg: Message) -> AppendResult:
        one = [msg]
        if (
            self._sync_native
            and self._running
            and not self._replica
            and self.config.flush == "sync"
            and first_unchecked(
                one, 0, _TOPIC_CHECK_CACHE, MAX_QUEUE_ID, self.config.max_message_size
            )
            == 1
        ):
            # The native single send (decision 820): encode, append and the group commit's
            # wait in one call. It declines what it does not do (see ``CommitLog.send_one``),
            # and ``put_messages`` then does the whole send, its errors included.
            dispatcher = self.dispatcher
            assert dispatcher is not None
            lag_limit = self.config.max_dispatch_lag_bytes
            if (
                dispatcher.stuck is None
                and self.commitlog.max_offset - dispatcher.reput_offset <= lag_limit
            ):
                batch = self.commitlog.send_one(one)
                if batch is not None:
                    end = batch.end_offset
                    for listener in self._append_listeners:
                        listener(end)
                    return AppendResult(
                        batch.offsets[0],
                        batch.sizes[0],
                        batch.queue_offsets[0],
                        batch.store_timestamp,
                    )
        return self.put_messages(one)[0]

    def put_messages(self, messages: Sequence[Message] | RecordSpans) -> AppendBatch:
        """Append ``messages`` (atomically with respect to their queue offsets) and return once
        they are as durable as the flush mode promises: fsynced under SYNC, in the page cache
        under ASYNC. ``messages`` may be a ``RecordSpans`` batch (decision 700), checked as its
        ``messages()`` would be."""
        if not self._running:
            raise StoreNotRunningError("the store is not running")
        if self.commitlog.failed is not None:
            raise self.commitlog.durability_lost()
        if self._replica:
            raise ReplicaStoreError("this store follows a master; it takes no appends of its own")
        limit = self.config.max_message_size
        # The record engine passes the messages that need no check of their own in one call.
        i = (
            _check_spans(messages, limit)
            if isinstance(messages, RecordSpans)
            else first_unchecked(messages, 0, _TOPIC_CHECK_CACHE, MAX_QUEUE_ID, limit)
        )
        while i < len(messages):
            assert not isinstance(messages, RecordSpans)
            msg = messages[i]
            check_topic(msg.topic)
            if not 0 <= msg.queue_id <= MAX_QUEUE_ID:
                raise InvalidMessageError(f"queue id {msg.queue_id} is out of range")
            if len(msg.body) > limit:
                raise InvalidMessageError(
                    f"message body is {len(msg.body)} bytes; the limit is {limit}"
                )
            i = first_unchecked(messages, i + 1, _TOPIC_CHECK_CACHE, MAX_QUEUE_ID, limit)
        assert self.dispatcher is not None
        stuck = self.dispatcher.stuck
        if stuck is not None:
            # Acknowledged now, it could not be read until dispatch recovers (decision 1070).
            raise DispatchStuckError(
                f"the store refuses writes while dispatch is stuck: {stuck}. Nothing of this "
                "send was stored; sends are taken again once dispatch resumes"
            )
        lag_limit = self.config.max_dispatch_lag_bytes
        if self.commitlog.max_offset - self.dispatcher.reput_offset > lag_limit:
            # Back-pressure: let dispatch catch up rather than let readability fall behind.
            self.dispatcher.wakeup()
            self.dispatcher.wait_for(self.commitlog.max_offset - lag_limit // 2, timeout=10.0)
        try:
            results = self.commitlog.append(messages)
        except ValueError as e:
            raise InvalidMessageError(str(e)) from e
        if self.config.flush != "sync":
            self.dispatcher.wakeup()
        elif len(results):
            # The fsync that covers these records wakes the dispatcher
            # (``_route_flush_wakeups``): once per batch of writers, not once per send.
            self.commitlog.wait_flushed(results.end_offset)
        if len(results):
            for listener in self._append_listeners:
                listener(results.end_offset)
        return results

    # -- replication -------------------------------------------------------------------------

    @property
    def min_physical_offset(self) -> int:
        return self.commitlog.min_offset

    @property
    def max_physical_offset(self) -> int:
        """Just past the last CommitLog byte written."""
        return self.commitlog.max_offset

    def flush_commitlog(self) -> int:
        """fsync the CommitLog; returns the flushed offset."""
        return self.commitlog.flush()

    @property
    def flushed_offset(self) -> int:
        """Just past the last CommitLog byte known to be on disk (fsynced)."""
        return self.commitlog.flushed_offset

    def _route_flush_wakeups(self) -> None:
        """Under SYNC each group commit fsync wakes the dispatcher (what it covered may be
        dispatched now), set by the native flusher without the GIL. A replica's dispatcher
        keeps its own cadence (decision 304)."""
        d = self.dispatcher
        wake = d.wakeup_event if d is not None and self.config.flush == "sync" else None
        self.commitlog.group_commit.wake_after_flush(None if self._replica else wake)

    @property
    def replica(self) -> bool:
        """Whether this store follows a master (and so refuses appends of its own)."""
        return self._replica

    def set_replica(self, replica: bool) -> None:
        """A replica (a slave's store) refuses ``put_messages``: its CommitLog must hold exactly
        its master's bytes, so nothing of its own (a producer, a pop revive) may be appended."""
        self._replica = replica
        self._route_flush_wakeups()

    def set_dispatch_coalescing(self, seconds: float) -> None:
        """How long the dispatcher lets appends gather before a pass (1 ms by default, like
        RocketMQ's reput cadence): a message becomes readable up to that much later, and one
        pass's fixed cost is shared by that many more records."""
        self._dispatch_coalesce_s = seconds
        if self.dispatcher is not None:
            self.dispatcher.coalesce_s = seconds

    def add_append_listener(self, listener: Callable[[int], None]) -> None:
        """Call ``listener(end_offset)`` after every append (outside the put lock): what
        replication uses to push new bytes at once."""
        self._append_listeners.append(listener)

    def read_commitlog(self, offset: int, max_bytes: int) -> bytes | None:
        """Whole CommitLog records from ``offset`` within one file (see
        ``CommitLog.read_records``): what a master streams to its slaves."""
        return self.commitlog.read_records(offset, max_bytes)

    def append_replicated(self, offset: int, data: bytes | memoryview) -> None:
        """Append a master's CommitLog bytes at the same physical offset; they become readable
        once this store's dispatcher has built their ConsumeQueue and IndexFile entries."""
        if not self._running:
            raise StoreNotRunningError("the store is not running")
        self.commitlog.append_replicated(offset, data)
        if self.config.flush == "sync":
            self.commitlog.wait_flushed(offset + len(data))
        assert self.dispatcher is not None
        # The dispatcher polls every 50 ms: a replica's queues (read only while no master is
        # up) may trail by that much, and one pass over many frames costs far less CPU than a
        # pass per frame, CPU the group's master needs on a shared machine. Wake it early only
        # for a backlog worth a pass of its own.
        if offset + len(data) - self.dispatcher.reput_offset >= _REPLICA_WAKE_BYTES:
            self.dispatcher.wakeup()

    def truncate_to(self, offset: int) -> None:
        """Cut the CommitLog at ``offset`` (a record boundary) with the ConsumeQueue and
        IndexFile data that pointed past it, as recovery does for a torn tail; a replica does
        this to drop a tail the rest of its group never had. Appends must not run meanwhile."""
        if not self._running:
            raise StoreNotRunningError("the store is not running")
        with self._maintenance_lock:
            assert self.dispatcher is not None
            self.dispatcher.stop()
            if offset < self.commitlog.max_offset:
                report = self.commitlog.truncate(offset)
                log.warning(
                    "replication: cut the CommitLog at %d (%d bytes copied to %s)",
                    offset,
                    report.truncated_bytes,
                    ", ".join(map(str, report.quarantined)) or "nowhere: they were zero",
                )
            end = self.commitlog.max_offset
            self.queues.truncate_from_physical(end)
            self._clamp_index(end)
            dispatcher = self._new_dispatcher(min(self.dispatcher.reput_offset, end), end)
            dispatcher.dispatch(self.commitlog.confirmed_offset)
            self.commitlog.on_append = dispatcher.submit
            self.commitlog.reset_queue_offsets(
                {key: cq.max_offset for key, cq in self.queues.queues.items()}
            )
            self.queues.flush()
            self.index.flush()
            self._save_checkpoint()
            dispatcher.start()

    # -- read ----------------------------------------------------------------------------------

    def _cq(self, topic: str, queue_id: int) -> ConsumeQueue | None:
        return self.queues.get(topic, queue_id)

    def min_offset(self, topic: str, queue_id: int) -> int:
        """The first readable queue offset, in either tier. Never waits on the object store:
        while where a tiered queue's archive starts is not known (its manifest not loaded since
        a restart), raises ``ColdTierUnavailableError`` rather than answer the hot store's
        first offset, past the archive (decision 520). A hot store that starts at 0 needs no
        archive to answer."""
        cq = self._cq(topic, queue_id)
        hot = cq.min_offset if cq else 0
        if hot == 0 or self.cold is None:
            return hot
        cold = self.cold.archive_start(topic, queue_id)
        return hot if cold is None else min(hot, cold)

    def hot_min_offset(self, topic: str, queue_id: int) -> int:
        cq = self._cq(topic, queue_id)
        return cq.min_offset if cq else 0

    def max_offset(self, topic: str, queue_id: int) -> int:
        """The next queue offset to be dispatched (messages below it are readable)."""
        cq = self._cq(topic, queue_id)
        return cq.max_offset if cq else 0

    def queue_ids(self, topic: str) -> list[int]:
        return sorted(q for t, q in self.queues.queues if t == topic)

    def topics(self) -> list[str]:
        return sorted({t for t, _ in self.queues.queues})

    def get_messages(
        self,
        topic: str,
        queue_id: int,
        offset: int,
        max_count: int = 32,
        max_bytes: int = 4 << 20,
        tag_filter: Callable[[int], bool] | None = None,
        *,
        hot_only: bool = False,
        replies: bool = False,
    ) -> GetResult:
        """Read up to ``max_count`` messages from ``offset``.

        ``tag_filter`` sees each entry's tag hash; entries it rejects are skipped without
        reading the CommitLog. A body failing its CRC raises ``CorruptRecordError``.
        ``replies``: a cold read without a filter answers with the replies the cold worker
        wrote (``GetResult.replies``), when the cold reader has a reply encoder.
        """
        cq = self._cq(topic, queue_id)
        if self._replica and (cq is None or offset >= cq.max_offset) and self._catch_up():
            cq = self._cq(topic, queue_id)
        if cq is None:
            return GetResult(GetStatus.NO_MATCHED_LOGIC_QUEUE, [], 0, 0, 0)
        if not hot_only and self.cold is not None and self._from_cold(topic, queue_id, offset, cq):
            if replies and tag_filter is None and self.cold.reply_encoder is not None:
                return self._get_cold_replies(topic, queue_id, offset, max_count, max_bytes, cq)
            return self._get_cold(topic, queue_id, offset, max_count, max_bytes, tag_filter, cq)
        lo, hi = cq.min_offset, cq.max_offset
        if hi == lo:
            status, nxt = GetStatus.NO_MESSAGE_IN_QUEUE, lo
        elif offset < lo:
            status, nxt = GetStatus.OFFSET_TOO_SMALL, lo
        elif offset == hi:
            status, nxt = GetStatus.OFFSET_OVERFLOW_ONE, offset
        elif offset > hi:
            status, nxt = GetStatus.OFFSET_OVERFLOW_BADLY, hi
        else:
            status, nxt = GetStatus.NO_MATCHED_MESSAGE, offset
        if status is GetStatus.OFFSET_TOO_SMALL:
            # Below both tiers: the first readable offset may be in the archive, below ``lo``
            # (a hot-only reader, the timer wheel or the transaction check, goes on at ``lo``).
            first = lo if hot_only or self.cold is None else self.min_offset(topic, queue_id)
            return GetResult(status, [], first, first, hi)
        if status is not GetStatus.NO_MATCHED_MESSAGE:
            return GetResult(status, [], nxt, lo, hi)
        messages: list[StoredMessage] = []
        size = 0
        # Scan at most this many entries per call, so a filter that matches nothing still returns.
        scan_limit = max(max_count, 16_000 if tag_filter else max_count)
        check = self.config.check_crc_on_read
        cl_end = self.commitlog.max_offset
        topic_field_bytes = topic_field(topic)
        skipped_in: MappedFile | None = None  # the CommitLog file of the last entry skipped
        wrong: str | None
        for qoff, (phys, length, code) in cq.iter_entries(offset, scan_limit):
            if (
                length <= 0
                or phys < 0
                or (phys > cl_end - length and phys > self.commitlog.max_offset - length)
            ):
                # A zeroed entry (a torn write, bit rot), or one pointing past the CommitLog
                # (garbage; the end is read again: the entry may be newer than ``cl_end``):
                # never read CommitLog offset 0 for it, nor let a tag filter skip it, nor take
                # it for a released file (decision 663). What precedes it is returned; a read
                # that starts at it fails at once, naming it, until a restart rebuilds it
                # (_repair_holes).
                if messages or qoff > offset:
                    break
                raise DamagedEntryError(topic, queue_id, qoff)
            nxt = qoff + 1
            if tag_filter is not None and not tag_filter(code):
                # Skipped unread, but not unchecked: the entry's tag hash is as much garbage as
                # its offset may be, and a skip would drop the queue's own message silently.
                # The record's fixed head and topic are compared instead (decision 756).
                found, skipped_in = self.commitlog.record_named(
                    phys, length, topic_field_bytes, queue_id, qoff, skipped_in
                )
                if found is None:
                    continue
                if found == "released":
                    nxt = qoff  # released under this read: as a read that finds it gone
                    break
                wrong = f" (CommitLog {phys} + {length} holds {found})"
                self._damage_notes.note(topic, queue_id, qoff)
                if messages or qoff > offset:
                    nxt = qoff
                    break
                raise DamagedEntryError(topic, queue_id, qoff, wrong)
            try:
                msg = self.commitlog.read_message(phys, length, check_crc=check)
            except CorruptRecordError:
                raise  # a whole record of that size whose CRC fails: the record is damaged
            except RecordError as e:
                # No whole record of the entry's size there: the entry is garbage that points
                # inside the CommitLog (decision 686).
                msg, wrong = None, f" (CommitLog {phys} + {length} is no record: {e})"
            else:
                # The header just decoded must be the entry's own record: a few compares.
                wrong = None
                if msg is None:
                    # The CommitLog file went away (released) between the entry and the read,
                    # or the entry's range runs past its file's data (garbage).
                    if self.commitlog.files.find_file(phys) is not None:
                        wrong = f" (CommitLog {phys} + {length} runs past its file's data)"
                elif (
                    msg.queue_offset != qoff
                    or msg.size != length
                    or msg.queue_id != queue_id
                    or msg.topic != topic
                ):
                    wrong = (
                        f" (CommitLog {phys} holds {msg.topic}/{msg.queue_id} queue offset "
                        f"{msg.queue_offset}, {msg.size} bytes, not {length})"
                    )
            if wrong is not None:
                self._damage_notes.note(topic, queue_id, qoff)
                if messages or qoff > offset:
                    nxt = qoff
                    break
                raise DamagedEntryError(topic, queue_id, qoff, wrong)
            if msg is None:
                nxt = qoff
                break
            messages.append(msg)
            size += length
            if len(messages) >= max_count or size >= max_bytes:
                break
        if messages:
            status = GetStatus.FOUND
        elif nxt == offset and offset < cq.min_offset:
            # Released while this read was under way: the tier holds it now (or nobody does).
            if (
                not hot_only
                and self.cold is not None
                and self._from_cold(topic, queue_id, offset, cq)
            ):
                return self._get_cold(topic, queue_id, offset, max_count, max_bytes, tag_filter, cq)
            status = GetStatus.OFFSET_TOO_SMALL
        return GetResult(status, messages, nxt, cq.min_offset, cq.max_offset)

    def _catch_up(self) -> bool:
        """A replica's dispatcher runs every 50 ms (decision 304), so its queues may end before
        its CommitLog does. A read at a queue's end (slave-read) first lets dispatch reach what
        the CommitLog holds, so that it never reports an older end than this store has (a
        reader that stops there would miss messages). True when dispatch was behind."""
        d = self.dispatcher
        end = self.commitlog.confirmed_offset
        if d is None or d.reput_offset >= end:
            return False
        d.wakeup()
        d.wait_for(end, timeout=1.0)
        return True

    def _from_cold(self, topic: str, queue_id: int, offset: int, cq: ConsumeQueue) -> bool:
        """Whether this read goes to the tier: below the hot store, when the tier may hold it
        (or, with ``read_from_tier = "force"``, whenever it does). Answers from cached state."""
        assert self.cold is not None
        if offset < cq.min_offset:
            return self.cold.may_hold(topic, queue_id, offset)
        start = self.cold.start_offset(topic, queue_id)
        return (
            self.config.read_from_tier == "force"
            and start is not None
            and start <= offset < self.cold.end_offset(topic, queue_id)
            and self.cold.may_hold(topic, queue_id, offset)
        )

    def _get_cold(
        self,
        topic: str,
        queue_id: int,
        offset: int,
        max_count: int,
        max_bytes: int,
        tag_filter: Callable[[int], bool] | None,
        cq: ConsumeQueue,
    ) -> GetResult:
        """Read from the archive; a missing or damaged object raises ``SegmentError``."""
        assert self.cold is not None
        keep = None if tag_filter is None else (lambda m: tag_filter(tag_hash(m.tags)))
        messages, nxt = self.cold.get(topic, queue_id, offset, max_count, keep, max_bytes)
        status, lo = self._cold_status(topic, queue_id, offset, bool(messages))
        nxt = lo if status is GetStatus.OFFSET_TOO_SMALL else nxt
        return GetResult(status, messages, nxt, lo, cq.max_offset)

    def _cold_status(
        self, topic: str, queue_id: int, offset: int, found: bool
    ) -> tuple[GetStatus, int]:
        """A cold read's status, and the queue's first readable offset."""
        lo = self.min_offset(topic, queue_id)
        if found:
            return GetStatus.FOUND, lo
        if offset < lo:
            return GetStatus.OFFSET_TOO_SMALL, lo  # expired by retention while it was being read
        return GetStatus.NO_MATCHED_MESSAGE, lo

    def _get_cold_replies(
        self,
        topic: str,
        queue_id: int,
        offset: int,
        max_count: int,
        max_bytes: int,
        cq: ConsumeQueue,
    ) -> GetResult:
        """``_get_cold`` answered with the replies the cold worker wrote."""
        assert self.cold is not None
        replies, nxt, body_bytes = self.cold.get_replies(
            topic, queue_id, offset, max_count, max_bytes
        )
        status, lo = self._cold_status(topic, queue_id, offset, bool(replies))
        nxt = lo if status is GetStatus.OFFSET_TOO_SMALL else nxt
        return GetResult(status, [], nxt, lo, cq.max_offset, replies, body_bytes)

    def read_message(self, commitlog_offset: int, size: int) -> StoredMessage | None:
        return self.commitlog.read_message(
            commitlog_offset, size, check_crc=self.config.check_crc_on_read
        )

    def queue_entries(
        self, topic: str, queue_id: int, start: int, max_count: int
    ) -> Iterator[tuple[int, Entry]]:
        """(queue offset, ConsumeQueue entry) of up to ``max_count`` hot entries from ``start``
        (from the hot minimum if ``start`` is below it); nothing for an unknown queue."""
        cq = self._cq(topic, queue_id)
        return cq.iter_entries(start, max_count) if cq is not None else iter(())

    def queue_entry_table(
        self, topic: str, queue_id: int, start: int, max_count: int
    ) -> np.ndarray:
        """The ConsumeQueue entries of ``[start, start + max_count)`` as one ``CQ_DTYPE`` array,
        contiguous from ``start``: fewer where the queue (or what is still held) ends, none when
        ``start`` itself is not held. A file at a time with numpy: what the offloader plans its
        segments from, with no Python per entry."""
        cq = self._cq(topic, queue_id)
        return cq.entry_table(start, max_count) if cq is not None else np.empty(0, CQ_DTYPE)

    def check_index_files(self) -> list[str]:
        """Check every IndexFile in full (a start checks only the newest file's entries): the
        damage found, one line a file, each file noted so that the next start rebuilds it
        (decisions 687, 734)."""
        return self.index.check_all()

    def note_damaged_entry(self, topic: str, queue_id: int, queue_offset: int) -> None:
        """Note a ConsumeQueue entry found naming the wrong record outside a read (the
        offloader's segment build, decision 730) for the next start to check and rebuild,
        as a read notes it (decision 686)."""
        self._damage_notes.note(topic, queue_id, queue_offset)

    def read_record_bytes(self, commitlog_offset: int, size: int) -> bytes | None:
        """One whole CommitLog record, undecoded (what a segment object holds); None once its
        file is released."""
        return self.commitlog.read(commitlog_offset, size)

    def queue_bytes(
        self, topic: str, queue_id: int, start: int | None = None, end: int | None = None
    ) -> int:
        """Total record size of the queue's hot entries in ``[start, end)`` (default: all)."""
        cq = self._cq(topic, queue_id)
        if cq is None:
            return 0
        lo = cq.min_offset if start is None else start
        return cq.bytes_between(lo, cq.max_offset if end is None else end)

    def commitlog_stats(self) -> CommitLogStats:
        return CommitLogStats(
            self.commitlog.min_offset, self.commitlog.max_offset, len(self.commitlog.files.files)
        )

    def queues_in_file(self, info: CommitLogFileInfo) -> list[QueueSpan]:
        """Every queue with records in the CommitLog file ``info``, with their queue offsets
        there (two bisections per queue over its ConsumeQueue). Raises ``UnreadableEntryError``
        rather than guess past a ConsumeQueue entry it cannot read."""
        spans = []
        for (topic, queue_id), cq in list(self.queues.queues.items()):
            first = cq.first_offset_at_or_after(info.from_offset, strict=True)
            if first >= cq.max_offset:
                continue
            entry = cq.get_entry(first)
            if entry is None:
                raise UnreadableEntryError(topic, queue_id, first)
            if entry[0] >= info.end_offset:
                continue  # no record of this queue in the file
            last = cq.first_offset_at_or_after(info.end_offset, strict=True) - 1
            spans.append(QueueSpan(topic, queue_id, first, last))
        return spans

    def store_timestamp_at(self, topic: str, queue_id: int, queue_offset: int) -> int | None:
        cq = self._cq(topic, queue_id)
        entry = cq.get_entry(queue_offset) if cq else None
        if entry is None:
            return None
        raw = self.commitlog.read(entry[0], entry[1])
        return read_store_timestamp(raw, 0) if raw else None

    def offset_for_timestamp(self, topic: str, queue_id: int, timestamp_ms: int) -> int:
        """The first queue offset whose store timestamp is at or after ``timestamp_ms``
        (the max offset when there is none), by binary search over the ConsumeQueue."""
        cq = self._cq(topic, queue_id)
        if cq is None:
            return 0
        if self.cold is not None and cq.min_offset > 0:
            first_hot = self.store_timestamp_at(topic, queue_id, cq.min_offset)
            # Before the hot store: the archive's, or an error while it is not known (never
            # the hot store's first offset in its place, decision 520).
            if (first_hot is None or timestamp_ms < first_hot) and self.cold.archive_start(
                topic, queue_id
            ) is not None:
                cold = self.cold.offset_for_timestamp(topic, queue_id, timestamp_ms)
                if cold < self.cold.end_offset(topic, queue_id) and self.cold.may_hold(
                    topic, queue_id, cold
                ):
                    return cold
        return cq.bisect(lambda _, entry: self._stored_before(entry, timestamp_ms))

    def _stored_before(self, entry: Entry | None, timestamp_ms: int) -> bool:
        """Whether the record of ``entry`` was stored before ``timestamp_ms``; a record released
        meanwhile counts as older (everything below it is older still)."""
        raw = self.commitlog.read(entry[0], entry[1]) if entry is not None else None
        return raw is None or read_store_timestamp(raw, 0) < timestamp_ms

    def query_by_key(
        self,
        topic: str,
        key: str,
        begin_ms: int = 0,
        end_ms: int = 2**62,
        max_count: int = 64,
        *,
        complete: bool = False,
    ) -> list[StoredMessage]:
        """Messages of ``topic`` whose KEYS or unique id equal ``key``, stored in
        [begin_ms, end_ms], newest first. With ``complete``, a tiered queue whose archive is
        not known yet (a restart during an object-store outage) raises
        ``ColdTierUnavailableError`` (a retry) instead of being left out of the answer
        (decision 661); without, it is skipped, as the broker's own checks at start need."""
        found: list[StoredMessage] = []
        khash = key_hash(topic, key)
        # Ask for more candidates than needed: hash collisions are filtered out below.
        candidates = self.index.query(
            topic, key, begin_ms, end_ms, max_count * 4, self._scan_key_hash
        )
        named = {phys for phys, _ in candidates}
        rescanned: set[str] = set()
        for phys, source in candidates:  # grows when a damaged file is read by a scan
            msg, has_key = self._record_with_key_hash(phys, khash)
            if not has_key and source.path.name not in rescanned:
                # An entry of ``source`` names a record without the key: its offset is
                # damaged, and the record it stood for is found by a scan of the file's range,
                # as for a damaged chain (decision 687).
                rescanned.add(source.path.name)
                self.index.damaged(
                    source, f"an entry of hash {khash} names CommitLog offset {phys}"
                )
                h = source.header
                more = self._scan_key_hash(h.begin_offset, h.end_offset, khash)
                candidates += [(o, source) for o in sorted(more, reverse=True) if o not in named]
                named.update(more)
            if msg is None:
                continue
            if msg.topic != topic or not begin_ms <= msg.store_timestamp <= end_ms:
                continue
            if msg.queue_offset < self.hot_min_offset(topic, msg.queue_id):
                # Below the queue's floor: not the queue's message at that offset any more (a
                # resolved divergence, decision 880: the archive's is, and the local one was
                # re-appended), or a record the archive holds (decision 720).
                continue
            if key in split_keys(msg.properties.get("KEYS")) or msg.msg_id == key:
                found.append(msg)
                if len(found) >= max_count:
                    break
        # Newest first, also when a damaged file's scan added candidates at the end.
        found.sort(key=lambda m: m.commitlog_offset, reverse=True)
        if self.cold is not None and len(found) < max_count:
            seen = {(m.queue_id, m.queue_offset) for m in found}
            for queue_id in self.queue_ids(topic):
                if self.cold.start_offset(topic, queue_id) is None and (
                    not complete or self.cold.archive_start(topic, queue_id) is None
                ):
                    continue  # no archive (``archive_start`` raises when that is not known)
                for m in self.cold.query_by_key(
                    topic, queue_id, key, begin_ms, end_ms, max_count - len(found)
                ):
                    if (m.queue_id, m.queue_offset) not in seen:
                        seen.add((m.queue_id, m.queue_offset))
                        found.append(m)
        return found

    def _scan_key_hash(self, start: int, end: int, khash: int) -> list[int]:
        """``Dispatcher.key_offsets`` over what the CommitLog still holds of ``[start, end)``."""
        d = self.dispatcher
        start = max(start, self.commitlog.min_offset)
        end = min(end, self.commitlog.confirmed_offset)
        return d.key_offsets(start, end, khash) if d is not None and start < end else []

    def _record_with_key_hash(self, phys: int, khash: int) -> tuple[StoredMessage | None, bool]:
        """The record at ``phys``, named by an IndexFile entry of ``khash`` (None when it is
        released or unreadable), and whether it is one with a key of that hash. Not is damage
        (decision 687): stale entries are cut at start (``IndexFile.cut_entries_from``)."""
        raw = self.commitlog.read(phys, 4)
        if raw is None:
            return None, True  # released, or past what is written
        size = int.from_bytes(raw, "big", signed=True)
        msg: StoredMessage | None = None
        try:
            msg = self.read_message(phys, size) if size > 0 else None
        except CorruptRecordError:
            return None, True  # a whole record whose CRC fails: a read of it says so
        except RecordError:
            msg = None
        if msg is not None and khash in record_key_hashes(msg):
            return msg, True
        return None, False

    # -- progress ------------------------------------------------------------------------------

    @property
    def dispatched_offset(self) -> int:
        return self.dispatcher.reput_offset if self.dispatcher else 0

    def wait_dispatched(self, timeout: float = 30.0) -> bool:
        """Block until everything appended so far is readable."""
        assert self.dispatcher is not None
        return self.dispatcher.wait_for(self.commitlog.confirmed_offset, timeout)

    # -- retention hook ------------------------------------------------------------------------

    def commitlog_files(self) -> list[CommitLogFileInfo]:
        out = []
        for f in self.commitlog.files.files:
            try:
                mtime = os.stat(f.path).st_mtime_ns // 1_000_000
            except FileNotFoundError:
                continue
            out.append(CommitLogFileInfo(f.path, f.from_offset, f.end_offset, mtime))
        return out

    def release_commitlog_files(self, can_release: Callable[[CommitLogFileInfo], bool]) -> int:
        """Delete the oldest CommitLog files while ``can_release`` says yes, then drop the
        ConsumeQueue and IndexFile data that pointed into them. Returns the files deleted.

        Never deleted, whatever the predicate says: the file being written, any file not yet
        full, and any file with bytes not yet dispatched (their ConsumeQueue entries would be
        lost with them). An append that rolls creates its new files before it writes the tail
        of the one it started in (decision 725): that file is no longer the last, and what the
        predicate saw of it is not what it will hold. Deleted then, the append wrote into a
        closed mapping (the send refused) or, the write landing first, its acknowledged tail
        went with the file, never dispatched nor uploaded. Only a file that is not the last
        may be full, and once full it no longer changes.
        """
        size = self.commitlog.files.file_size
        with self._maintenance_lock:
            files = self.commitlog_files()[:-1]
            count = 0
            for info in files:
                if (
                    info.end_offset - info.from_offset < size
                    or info.end_offset > self.dispatched_offset
                    or not can_release(info)
                ):
                    break
                count += 1
            if not count:
                return 0
            # Readers first, files second: once the queue minimums have moved past the files,
            # every new read of those offsets goes to the tier (or is told OFFSET_TOO_SMALL);
            # a read already under way that finds its file gone is re-routed by get_messages.
            # Deleting first would let a reader see "no message" in the middle of its history.
            cl_min = files[count].from_offset if count < len(files) else files[-1].end_offset
            self.queues.correct_min_offsets(cl_min)
            self.index.delete_before(cl_min)
            failpoints.hit("release.mid_switch")
            self.commitlog.delete_files_before(count)
            log.info("released %d CommitLog file(s); CommitLog now starts at %d", count, cl_min)
            return count
