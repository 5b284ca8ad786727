"""The CommitLog: every message of every topic, appended to one stream of mapped files.

Offsets: a record's *physical offset* is its byte position in this stream; its *queue offset* is
its index within (topic, queue), assigned here under the put lock so it matches append order.

Threads: any number of producers call ``append``; they are serialised by the put lock (RocketMQ's
single writer). SYNC flush is a group commit (``tiered.hot.group_commit``): writers queue a
request after their append, one thread fsyncs once for the whole queue and wakes them all.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import struct
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import numpy as np

from tiered import failpoints
from tiered.config import StoreConfig
from tiered.durable import fsync_dir, fsync_file, make_dirs, write_file
from tiered.formats import CQ_ENTRY_SIZE
from tiered.hot.group_commit import GroupCommitService, new_put_lock
from tiered.hot.index_file import ENTRY_SIZE as INDEX_ENTRY_SIZE
from tiered.hot.index_file import HEADER_SIZE as INDEX_HEADER_SIZE
from tiered.hot.mapped_file import (
    _PWRITE_MIN,
    MappedFile,
    MappedFileQueue,
    StoreLoadError,
    _before_sizes,
    all_zero,
)
from tiered.record import (
    BLANK_MAGIC_CODE,
    BLANK_RECORD_SIZE,
    MAGIC_CODE_V2,
    CorruptRecordError,
    DispatchColumns,
    EncodedBatch,
    Message,
    RecordEncoder,
    RecordError,
    RecordSpans,
    StoredMessage,
    blank_record,
    decode,
    dispatch_columns,
    engine_encode_batch,
    read_total_and_magic,
    record_named,
    scan_records,
    validate,
)

log = logging.getLogger(__name__)

_MAGIC_BYTES = struct.pack(">i", MAGIC_CODE_V2)
# The native single send's call between a record's bytes and its size field: the failpoint
# (``commitlog.before_sizes``), or None when it is not armed. Failpoints are read from the
# environment once, at import, so a send need not call into Python for a no-op (decision 1020).
_SEND_BETWEEN = _before_sizes if failpoints.armed("commitlog.before_sizes") else None
# How much of a torn tail is copied aside before it is zeroed: a whole maximal record and more.
_QUARANTINE_LIMIT = 8 << 20
# The resync search checks this much of a file for non-zero bytes at a time.
_ZERO_SKIP_CHUNK = 16 << 20
# At most this many records' dispatch columns are kept per recovery scan thread (about 80
# bytes each); past it the scan only validates, and dispatch reads the rest of the bytes again.
_RECOVERY_COLUMNS_LIMIT = 2_000_000
# A full file with at least this much left to scan is checked by two threads.
_SPLIT_SCAN_BYTES = 64 << 20


class MessageTooLargeError(ValueError):
    """A record that cannot fit in one CommitLog file."""


class StoreUnwritableError(RuntimeError):
    """The store refuses writes; nothing of the refused batch was stored."""


class DiskFullError(StoreUnwritableError):
    """The disk cannot take the next CommitLog file (and room for its ConsumeQueue and
    IndexFile entries)."""


class DispatchStuckError(StoreUnwritableError):
    """Dispatch cannot proceed (the process has no file descriptor left to map a ConsumeQueue
    file): a send now would be acknowledged and yet not readable by any consumer until it
    recovers, so the store refuses it, as RocketMQ's does once a ConsumeQueue write fails
    (``WRITE_LOGICS_QUEUE_ERROR_BIT``: not writeable, SERVICE_NOT_AVAILABLE). Unlike there, the
    refusal ends by itself with the dispatcher's next good pass (decision 1070)."""


class DurabilityLostError(StoreUnwritableError):
    """An fsync failed. The kernel may already have dropped the unwritten pages and marked them
    clean, so a retried fsync that "succeeds" proves nothing (PostgreSQL's fsyncgate): the store
    takes no more writes and never again claims anything durable. A restart recovers from what
    the disk really holds."""


class AppendResult(NamedTuple):
    """Where one appended message went. A named tuple, not a frozen dataclass: the frozen
    dataclass's ``__init__`` set each field through ``object.__setattr__``, about a fifth of
    the Python a single SYNC send ran outside the native call (decision 1020)."""

    commitlog_offset: int
    size: int
    queue_offset: int
    store_timestamp: int


class AppendBatch(Sequence[AppendResult]):
    """The results of one append, one per message, built only when asked for."""

    __slots__ = ("_offsets", "_qoffs", "_sizes", "_ts")

    def __init__(self, chunks: list[EncodedBatch]) -> None:
        if len(chunks) == 1:
            c = chunks[0]
            self._offsets, self._sizes, self._qoffs = c.offsets, c.sizes, c.queue_offsets
        else:
            self._offsets = [o for c in chunks for o in c.offsets]
            self._sizes = [o for c in chunks for o in c.sizes]
            self._qoffs = [o for c in chunks for o in c.queue_offsets]
        self._ts = chunks[0].store_timestamp if chunks else 0

    def __len__(self) -> int:
        return len(self._offsets)

    def __getitem__(self, i: int) -> AppendResult:  # type: ignore[override]
        return AppendResult(self._offsets[i], self._sizes[i], self._qoffs[i], self._ts)

    @property
    def queue_offsets(self) -> list[int]:
        """The queue offset of every message, in order."""
        q = self._qoffs
        return q if isinstance(q, list) else list(q)

    @property
    def end_offset(self) -> int:
        """Just past the last record appended."""
        return self._offsets[-1] + self._sizes[-1] if self._offsets else 0


@dataclass(slots=True)
class RecoveryReport:
    """What recovery found and did; every number an operator may ask about after a crash."""

    scanned_from: int = 0
    end_offset: int = 0
    records_scanned: int = 0
    truncated_bytes: int = 0
    corrupt_records: list[int] = field(default_factory=list)
    quarantined: list[Path] = field(default_factory=list)


def free_bytes(directory: Path) -> int:
    """Bytes an unprivileged writer may still allocate on ``directory``'s filesystem."""
    st = os.statvfs(directory if directory.exists() else directory.parent)
    return st.f_bavail * st.f_frsize


def now_ms() -> int:
    return time.time_ns() // 1_000_000


_PAGE = 4096
# The free-space figure is measured again at least this often, so that space another writer
# took, or retention freed, counts within 100 ms.
_ROOM_MEASURE_MS = 100
# Kept free beside the index side's need: the checkpoint and the broker's own small files.
_ROOM_MARGIN = 1 << 20
# Undispatched batches' marks past which they are dropped as dispatch passes them, between
# measurements (which drop them too, every 100 ms): a dispatcher behind by this many keeps its
# marks, not one call per append.
_ROOM_MARKS = 65536
# Batches share a mark until the charge since the last one reaches this (decision 735): a
# charge is then paid at most this late, and a single send stores no mark of its own.
_ROOM_MARK_BYTES = 64 << 10


def _pages(n: int) -> int:
    return -(-n // _PAGE) * _PAGE


class DispatchRoom:
    """Disk room for what appended records not yet dispatched will take on the index side
    (decision 680): the append path refuses a batch the disk could not index, so no
    acknowledged message waits unreadable for space.

    Every batch is charged, from its own records, a strict upper bound of the bytes its
    dispatch allocates: a preallocated ConsumeQueue file for every queue offset that starts one
    (a multiple of ``consumequeue_entries_per_file``, the queue's first file included), and per
    IndexFile entry (a unique id, a key) its 20 bytes plus twice its share of an IndexFile roll
    (a file holds at least ``max_entries`` minus the entries of the record that did not fit,
    which that record is charged again for). ``appended`` sums the charges; a charge is paid
    once the dispatcher has passed the end of its batch's mark (``dispatched_to``): batches
    share the open mark (``open_end``, ``appended``) until their charges since the last closed
    one reach ``_ROOM_MARK_BYTES`` (decision 735), a later end, so a charge is never paid early.

    Free space is measured (``statvfs``) only when the cached figure cannot vouch for the
    batch, on a CommitLog roll, and every 100 ms; between measurements the dispatcher's own
    allocations are at most what was paid since (``paid`` at the measurement): a batch is
    taken while ``appended`` after it is at most ``limit`` (what was measured free, plus
    ``paid`` at the measurement, less two rolls, one per side of the measurement, and a
    margin) and the measurement is fresh (``ms < fresh_until``). The append path does that
    common case inline (``CommitLog.append``). Called under the CommitLog's put lock only."""

    def __init__(self, directory: Path, config: StoreConfig) -> None:
        self.directory = directory
        self.cq_entries = config.consumequeue_entries_per_file
        # A new file is preallocated whole; a new queue's topic and queue directories (or a
        # directory that grows) take a block each.
        self.cq_file_cost = _pages(self.cq_entries * CQ_ENTRY_SIZE) + 2 * _PAGE
        # A roll allocates the header and slots, a directory block, and the partly used
        # first and last pages of its entries.
        roll = _pages(INDEX_HEADER_SIZE + 4 * config.index_hash_slots) + 3 * _PAGE
        self.entry_cost = INDEX_ENTRY_SIZE + -(-2 * roll // config.index_max_entries)
        self.fixed = 2 * roll + _ROOM_MARGIN
        self.dispatched_to: Callable[[], int] = lambda: 1 << 62
        self.appended = 0
        self._marks: deque[tuple[int, int]] = deque()
        # The open mark: the end of the last charged batch; its charge is ``appended``.
        self.open_end = 0
        self.next_mark = _ROOM_MARK_BYTES  # ``appended`` at which the open mark is closed
        self._closed = 0  # ``appended`` at the last closed mark
        self._paid = 0
        self._free = -1  # not measured yet
        self._base = 0  # ``_paid`` when ``_free`` was measured
        self.limit = -1  # ``appended`` may reach this: ``_free + _base - fixed``
        self.fresh_until = 0  # the measurement vouches for nothing from this ms on

    def roomy(self, charge: int) -> bool:
        """Whether the last measurement vouches for ``charge`` more (no system call)."""
        return self.appended + charge <= self.limit

    def admit(self, charge: int, files: int, ms: int) -> None:
        """Raise ``DiskFullError`` unless the disk has room for every undispatched batch's
        charge, ``charge`` more and ``files`` bytes of new CommitLog files (created next)."""
        if files or ms >= self.fresh_until or not self.roomy(charge + files):
            self._measure(ms)
            if not self.roomy(charge + files):
                debt = self.appended - self._paid
                raise DiskFullError(
                    f"the disk is full: {self._free} bytes free in {self.directory}, but the "
                    f"ConsumeQueue and IndexFile entries of messages not yet dispatched need "
                    f"up to {debt}, this batch's {charge}, new CommitLog files {files}, and "
                    f"{self.fixed} are kept free; release or free space"
                )
        if files:
            self.fresh_until = 0  # the files are about to take space: measure next time

    def take(self, charge: int, end_offset: int, ms: int) -> None:
        """``admit`` then ``add``, for a batch that needs no new CommitLog file (the append
        path does the common case inline)."""
        appended = self.appended + charge
        if ms >= self.fresh_until or appended > self.limit:
            self.admit(charge, 0, ms)
        self.add(charge, end_offset)

    def add(self, charge: int, end_offset: int) -> None:
        """A batch ending at ``end_offset`` was written: its charge is owed until dispatched."""
        self.appended += charge
        self.open_end = end_offset
        if self.appended >= self.next_mark:
            self.close_mark()

    def close_mark(self) -> None:
        """The open mark becomes a mark of its own: later batches open the next."""
        if self.appended != self._closed:
            self._marks.append((self.open_end, self.appended))
            self._closed = self.appended
        self.next_mark = self.appended + _ROOM_MARK_BYTES
        if len(self._marks) >= _ROOM_MARKS:
            self._pay()

    def reset(self) -> None:
        """Nothing is owed (the log was cut, and dispatched to its end)."""
        self._marks.clear()
        self._paid = self._base = self._closed = self.appended
        self.next_mark = self.appended + _ROOM_MARK_BYTES
        self.fresh_until = 0

    def _pay(self) -> None:
        reput = self.dispatched_to()
        marks = self._marks
        while marks and marks[0][0] <= reput:
            self._paid = marks.popleft()[1]
        if not marks and self.appended != self._closed and self.open_end <= reput:
            # The open mark is dispatched too (the dispatcher keeps up).
            self._paid = self._closed = self.appended
            self.next_mark = self.appended + _ROOM_MARK_BYTES

    def _measure(self, ms: int) -> None:
        # What was paid is read first: an allocation after it shows in the free figure and is
        # still counted as owed, never the other way.
        self._pay()
        paid = self._paid
        self._free = free_bytes(self.directory)
        self._base = paid
        self.limit = self._free + paid - self.fixed
        self.fresh_until = ms + _ROOM_MEASURE_MS


class CommitLog:
    def __init__(self, config: StoreConfig) -> None:
        self.config = config
        # Called under the put lock with each appended chunk, in CommitLog order (dispatch).
        self.on_append: Callable[[EncodedBatch], None] | None = None
        self.files = MappedFileQueue(config.commitlog_dir, config.commitlog_file_size)
        self._encoder = RecordEncoder(config.store_host, config.consumequeue_entries_per_file)
        # What ``_encoder.encode_batch`` calls (the engine's, taking the encoder first), for the
        # native single send to call without a Python frame between (decision 1020).
        self.engine_encode: Callable[..., tuple[int, int]] = engine_encode_batch()
        # A native mutex with the native gate: its single send lets go of it without the GIL.
        self._put_lock = new_put_lock()
        # Next queue offset per (topic, queue): RocketMQ's topicQueueTable. Owned by the put lock.
        self.queue_offsets: dict[tuple[str, int], int] = {}
        self.last_store_timestamp = 0
        # The first fsync failure; once set, no write and no flush is ever accepted again.
        self.failed: OSError | None = None
        # Free bytes a roll must leave beside the new file, for the ConsumeQueue and IndexFile
        # files its messages will need (set by the store from its geometry).
        self.roll_reserve_bytes = 0
        # What undispatched records will take on the index side (decision 680).
        self.room = DispatchRoom(config.data_dir, config)
        # Owns the thread ``tmq-group-commit`` from ``load`` to ``close``, and the flushed
        # offset; its native flusher fdatasyncs the file appends go to (``_tracked``) itself.
        self.group_commit = GroupCommitService(self.flush, fail=self._fsync_failed)
        self._flush_lock = self.group_commit.flush_lock
        self._tracked: MappedFile | None = None
        # The native gate's single send (decision 820); None with the reference gate.
        self._native_send: Callable[..., int | None] | None = getattr(
            self.group_commit.gate, "send_one", None
        )

    # -- lifecycle -----------------------------------------------------------------------------

    def load(self) -> None:
        self.files.load()
        self.group_commit.start()

    def close(self) -> None:
        self.group_commit.stop()
        self._track(None)
        self.files.close()

    def _track(self, f: MappedFile | None) -> None:
        """Tell group commit which file appends go to now (None: none it may sync alone)."""
        self._tracked = f
        if f is None:
            self.group_commit.track_file(-1, 0, 0)
        else:
            self.group_commit.track_file(f.fileno(), f.from_offset, f.size)

    @property
    def _flushed_offset(self) -> int:
        return self.group_commit.flushed

    @_flushed_offset.setter
    def _flushed_offset(self, offset: int) -> None:
        self.group_commit.reset_flushed(offset)

    @property
    def min_offset(self) -> int:
        return self.files.min_offset

    @property
    def max_offset(self) -> int:
        return self.files.max_offset

    @property
    def flushed_offset(self) -> int:
        return self._flushed_offset

    @property
    def confirmed_offset(self) -> int:
        """Where dispatch may go: under SYNC only fsynced bytes become visible to consumers."""
        return self._flushed_offset if self.config.flush == "sync" else self.files.max_offset

    # -- append --------------------------------------------------------------------------------

    def append(self, messages: Sequence[Message] | RecordSpans) -> AppendBatch:
        """Append ``messages`` in order; all get consecutive queue offsets within their queue.

        Every record is encoded before any byte is written, so a message that cannot be encoded
        fails the call with nothing stored. (An I/O error while rolling a file may leave the
        records before it stored but unacknowledged: the producer's retry may duplicate them,
        but queue offsets never repeat.)
        """
        with self._put_lock:
            if self.failed is not None:
                raise self.durability_lost()
            store_ts = now_ms()
            last = self.files.last_file()
            size = self.files.file_size
            if last is None:
                file_from, wrote = self.files.max_offset, 0
            else:
                file_from, wrote = last.from_offset, last.wrote
            next_offsets: dict[tuple[str, int], int] = {}
            # One encoded chunk per file touched, with the queue offsets it publishes.
            chunks: list[tuple[int, EncodedBatch, dict[tuple[str, int], int]]] = []
            i = 0
            # A batch that fits whole in the open file may be written by the encoder in the same
            # release of the GIL as its encoding (decision 452), when the last free-space
            # measurement vouches for whatever its index side could take: such a batch is
            # written before its own charge is known (decision 680).
            room = self.room
            sink = None
            # The measurement must be fresh and cover any batch of these messages that fits the
            # open file: each record may start a ConsumeQueue file and makes fewer IndexFile
            # entries than half its bytes (a key takes a byte and a separator, a record far more
            # than its keys). Inline, not a method (decision 735). A single message is not
            # offered the file: the encoder writes through it only batches of 16 KiB or more.
            if (
                last is not None
                and len(messages) > 1
                and store_ts < room.fresh_until
                and room.appended
                + len(messages) * room.cq_file_cost
                + (size - wrote) // 2 * room.entry_cost
                <= room.limit
            ):
                sink = last.append_sink()
            while True:
                batch = EncodedBatch(store_timestamp=store_ts)
                try:
                    i, used = self._encoder.encode_batch(
                        messages,
                        i,
                        file_from + wrote,
                        size - wrote,
                        next_offsets,
                        self.queue_offsets,
                        batch,
                        sink,
                    )
                except (RecordError, TypeError, AttributeError) as e:
                    raise ValueError(f"message {i}: {e}") from e
                except OSError as e:
                    assert last is not None
                    raise self._write_failed(last, e) from e
                sink = None
                if i < len(messages):
                    if not batch.offsets and wrote == 0:
                        raise MessageTooLargeError(
                            f"message {i} does not fit in a {size}-byte CommitLog file"
                        )
                    if size - wrote - used > 0:
                        batch.parts.append(blank_record(size - wrote - used))
                    chunks.append((file_from, batch, dict(next_offsets)))
                    file_from, wrote = file_from + size, 0
                    continue
                chunks.append((file_from, batch, next_offsets))
                break
            # The disk must have room for what the batch's records, and every record appended
            # but not yet dispatched, will take on the index side (decision 680): the batch is
            # charged the ConsumeQueue files its queue offsets start (the multiples of the
            # file's entry count in each queue's new range) and its IndexFile entries.
            # Inline, not a call per step: this runs for every single send.
            if len(chunks) == 1:
                batch = chunks[0][1]
                charge = batch.cq_starts * room.cq_file_cost + batch.index_entries * room.entry_cost
            else:
                charge = sum(
                    c[1].cq_starts * room.cq_file_cost + c[1].index_entries * room.entry_cost
                    for c in chunks
                )
            if last is None or chunks[-1][0] > last.from_offset:
                rolls = len(chunks) if last is None else (chunks[-1][0] - last.from_offset) // size
                room.admit(charge, rolls * size + self.roll_reserve_bytes, store_ts)
                # Every file the batch needs exists before its first byte is written: a full
                # disk refuses the whole batch, never stores the part before the roll.
                self._create_files([c[0] for c in chunks])
                if charge:
                    room.add(charge, chunks[-1][1].end_offset)
            elif chunks[0][1].written:  # the bound above took it: nothing may refuse it now
                room.add(charge, chunks[-1][1].end_offset)
            elif charge:
                # ``room.take`` inline for the common case (decision 735): the measurement is
                # fresh and vouches for the batch; the batch joins the open mark.
                appended = room.appended + charge
                if store_ts < room.fresh_until and appended <= room.limit:
                    room.appended = appended
                    room.open_end = chunks[-1][1].end_offset
                    if appended >= room.next_mark:
                        room.close_mark()
                else:
                    room.take(charge, chunks[-1][1].end_offset, store_ts)
            for chunk_from, batch, published in chunks:
                # Most appends land in the last file: no lookup for it.
                if last is not None and chunk_from == last.from_offset:
                    f = last
                else:
                    f = self._file_for_append(chunk_from)
                if batch.written:
                    f.wrote += batch.end_offset - batch.offsets[0]
                else:
                    self._write(f, batch)
                self.queue_offsets.update(published)
                if batch.offsets and self.on_append is not None:
                    self.on_append(batch)
            if f is not self._tracked:
                self._track(f)
            self.last_store_timestamp = store_ts
        return AppendBatch([b for _, b, _ in chunks])

    @property
    def has_native_send(self) -> bool:
        return self._native_send is not None

    def send_one(self, one: list[Message]) -> EncodedBatch | None:
        """The native single SYNC send (decision 820): append ``one`` (a list of one message)
        and return once an fsync covers it, as ``append`` then ``wait_flushed`` would, in one
        native call that gives the GIL up once for the record's store and the wait (the
        record is encoded by whichever record engine is in use). None when it does not apply
        (the reference gate, a roll, a room measurement due, a record of 4 KiB or more, a
        message the encoder refuses, the store failed): nothing was appended, and the caller
        sends through ``append``. Raises what ``wait_flushed`` raises."""
        send = self._native_send
        if send is None:
            return None
        # Stamped under the put lock (``now_ms`` is called there), as ``append`` stamps. The
        # list fields given, not made by the dataclass's factories (decision 1020).
        batch = EncodedBatch([], [], [], [], [], [], [], [])
        joined = send(self._put_lock, self, one, batch, now_ms, _PWRITE_MIN, _SEND_BETWEEN)
        if joined is None:
            return None
        try:
            self.group_commit.settle(joined)
        except DurabilityLostError as e:
            raise self.durability_lost() from e.__cause__
        return batch

    def _write(self, f: MappedFile, batch: EncodedBatch) -> None:
        """Write an encoded chunk at the end of ``f``."""
        parts = batch.parts
        data = parts[0] if len(parts) == 1 else b"".join(parts)
        try:
            f.append_records(data, batch.offsets, f.from_offset + f.wrote)
        except OSError as e:
            raise self._write_failed(f, e) from e
        batch.parts = []

    def _create_files(self, starts: list[int]) -> None:
        last = self.files.last_file()
        needed = [s for s in starts if last is None or s > last.from_offset]
        created: list[MappedFile] = []
        try:
            for start in needed:
                self._check_room()
                created.append(self.files.create_file(start))
        except OSError as e:
            self.files.discard_last(created)
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                raise DiskFullError(
                    f"the disk is full: cannot create CommitLog file {start} of "
                    f"{self.files.file_size} bytes in {self.files.directory} ({e.strerror})"
                ) from e
            # Any other failure (EIO from the new file's or its directory's fsync) is an fsync
            # failure like the flusher's: a retry could report success over dropped pages.
            self.fail(e)
            raise self.durability_lost() from e
        except DiskFullError:
            self.files.discard_last(created)
            raise

    def _check_room(self) -> None:
        need = self.files.file_size + self.roll_reserve_bytes
        free = free_bytes(self.files.directory)
        if free < need:
            raise DiskFullError(
                f"the disk is full: {free} bytes free in {self.files.directory}, a new "
                f"CommitLog file needs {self.files.file_size} and {self.roll_reserve_bytes} "
                "more for its ConsumeQueue and IndexFile entries; release or free space"
            )

    def durability_lost(self) -> DurabilityLostError:
        return DurabilityLostError(
            f"the store refuses writes: a write or fsync failed ({self.failed}); what is not "
            "yet flushed may be lost. Check the disk, then restart the broker"
        )

    def _write_failed(self, f: MappedFile, error: OSError) -> StoreUnwritableError:
        """What a failed write of CommitLog bytes into ``f`` becomes (``wrote`` has not moved,
        and a record is whole only once its size field is set, which comes last: nothing of
        the batch is readable). A full disk (a filesystem that does not honour the file's
        preallocation) stored nothing and may have room later. Any other error (EIO) leaves
        those pages in an unknown state, as a failed fsync does: nothing written after it may
        be acknowledged until a restart recovers from what the disk holds."""
        if error.errno in (errno.ENOSPC, errno.EDQUOT):
            return DiskFullError(
                f"the disk is full: cannot write CommitLog file {f.path} ({error.strerror})"
            )
        log.critical("CommitLog write failed at offset %d: %s", f.end_offset, error)
        self.fail(error)
        return self.durability_lost()

    def _file_for_append(self, from_offset: int) -> MappedFile:
        f = self.files.find_file(from_offset)
        assert f is not None and f.from_offset == from_offset, "created by _create_files"
        return f

    # -- replication -------------------------------------------------------------------------

    def read_records(self, offset: int, max_bytes: int) -> bytes | None:
        """Whole records (a BLANK padding included) from ``offset``, a record boundary, within
        one file: at most ``max_bytes`` unless the first record alone is larger. ``b""`` when
        nothing is written there yet; None when ``offset`` is not held here (released)."""
        f = self.files.find_file(offset)
        if f is None:
            return b"" if offset == self.files.max_offset else None
        pos = offset - f.from_offset
        wrote = f.wrote  # appends publish ``wrote`` only after their bytes are in place
        end = pos
        mm = f.mm
        if 0 < wrote - pos <= max_bytes:
            # Appends are whole records (and so is ``wrote`` after each): everything from a
            # record boundary to ``wrote`` is whole records; no need to walk them one by one.
            end = wrote
        while end < wrote:
            total = read_total_and_magic(mm, end)[0]
            if total <= 0 or end + total > wrote:
                raise RecordError(f"CommitLog {f.path}: no record boundary at offset {end}")
            if end > pos and end + total - pos > max_bytes:
                break
            end += total
        try:
            return f.read(pos, end - pos)
        except ValueError:  # unmapped by retention meanwhile
            return None

    def append_replicated(self, offset: int, data: bytes | memoryview) -> None:
        """Append bytes a master wrote at ``offset`` (whole records, within one file), at the
        same physical offset. The slave's dispatcher parses them into its own ConsumeQueues and
        IndexFiles. Queue offsets are not tracked here; ``reset_queue_offsets`` rebuilds them
        from the ConsumeQueues before this log takes appends of its own.

        Every record is checked first (structure, its own offset, body and record CRC): bytes
        damaged on their way are refused (``RecordError``), never stored and served."""
        _check_replicated(offset, data, self.files.file_size)
        with self._put_lock:
            if self.failed is not None:
                raise self.durability_lost()
            last = self.files.last_file()
            expected = self.files.max_offset
            if last is None:
                if offset % self.files.file_size:
                    raise ValueError(
                        f"replicated bytes at {offset} do not start a CommitLog file "
                        f"({self.files.file_size} bytes)"
                    )
            elif offset != expected:
                raise ValueError(
                    f"replicated bytes at {offset}, but this CommitLog ends at {expected}"
                )
            if last is None or last.wrote == last.size:
                self._check_room()
                last = self.files.create_file(offset)
            if last.wrote + len(data) > last.size:
                raise ValueError(f"replicated bytes at {offset} run past the end of {last.path}")
            try:
                last.append(data)
            except OSError as e:
                raise self._write_failed(last, e) from e
            if last is not self._tracked:
                self._track(last)

    def truncate(self, offset: int) -> RecoveryReport:
        """Make ``offset`` (a record boundary) the end of the log; the bytes cut are copied to
        the quarantine directory first, so a divergent tail can still be inspected."""
        with self._put_lock, self._flush_lock:
            report = RecoveryReport(scanned_from=offset, end_offset=offset)
            self._track(None)  # the file may go; the next append tracks the one it writes
            self._cut(offset, report)
            self._flushed_offset = min(self._flushed_offset, offset)
            self.room.reset()  # the caller dispatches what is left before the next append
            return report

    def reset_queue_offsets(self, next_offsets: dict[tuple[str, int], int]) -> None:
        """Take the next queue offset of every queue (from the ConsumeQueues)."""
        with self._put_lock:
            self.queue_offsets = dict(next_offsets)

    # -- flush ---------------------------------------------------------------------------------

    def flush(self) -> int:
        """fsync (msync) everything appended so far; returns the flushed offset."""
        with self._flush_lock:
            self.group_commit.publish_flushed(self._flush_files())
            return self.group_commit.flushed

    def wait_flushed(self, offset: int) -> None:
        """Group commit: return once bytes up to ``offset`` are on disk; one fsync serves every
        writer waiting when it starts. Raises ``DurabilityLostError`` if that fsync failed."""
        try:
            self.group_commit.wait_flushed(offset)
        except DurabilityLostError as e:
            raise self.durability_lost() from e.__cause__

    def _flush_files(self) -> int:
        if self.failed is not None:
            raise self.durability_lost()
        try:
            return self.files.flush()
        except OSError as e:
            self.fail(e)
            raise self.durability_lost() from e

    def _fsync_failed(self, error: OSError) -> DurabilityLostError:
        """What the writers of a batch whose native fdatasync failed raise."""
        self.fail(error)
        return self.durability_lost()

    def fail(self, error: OSError) -> None:
        """Record an fsync failure (of this log or of data derived from it): from now on every
        append and flush is refused."""
        self.group_commit.mark_failed()
        if self.failed is None:
            self.failed = error
            log.critical(
                "write or fsync failed (%s): the store takes no more writes and no more "
                "checkpoints; check the disk and restart the broker",
                error,
            )

    # -- read ----------------------------------------------------------------------------------

    def read(self, offset: int, size: int) -> bytes | None:
        """The ``size`` bytes at ``offset``; None when that range is not (or no longer) here."""
        f = self.files.find_file(offset)
        if f is None:
            return None
        pos = offset - f.from_offset
        if pos + size > f.wrote:
            return None
        try:
            return f.read(pos, size)
        except ValueError:  # the file was unmapped by retention while we looked it up
            return None

    def record_named(
        self,
        offset: int,
        size: int,
        topic: bytes,
        queue_id: int,
        queue_offset: int,
        hint: MappedFile | None = None,
    ) -> tuple[str | None, MappedFile | None]:
        """``record.record_named`` at ``offset`` (``topic``: the TOPIC field, ``topic_field``):
        None when the ``size`` bytes there start the record of ``queue_id`` at
        ``queue_offset``, else what they hold; "released" when that range is not (or no longer)
        here, as ``read`` would say None. Also the file it looked in, to pass back as ``hint``
        for the next entry: a run of entries of one queue mostly lies in one file."""
        f = hint
        if f is None or not f.from_offset <= offset < f.from_offset + f.wrote:
            f = self.files.find_file(offset)
            if f is None:
                return "released", None
        pos = offset - f.from_offset
        if pos + size > f.wrote:
            return "a range past its file's data", f
        try:
            return record_named(f.mm, pos, size, topic, queue_id, queue_offset, offset), f
        except ValueError:  # the file was unmapped by retention while we looked it up
            return "released", None

    def read_message(self, offset: int, size: int, *, check_crc: bool) -> StoredMessage | None:
        raw = self.read(offset, size)
        if raw is None:
            return None
        return decode(raw, 0, check_crc=check_crc)

    def skip_blank(self, offset: int) -> int:
        """``offset``, or the next file's start when a BLANK record pads the file there."""
        f = self.files.find_file(offset)
        if f is None:
            return offset
        pos = offset - f.from_offset
        if pos < f.wrote and read_total_and_magic(f.mm, pos)[1] == BLANK_MAGIC_CODE:
            return f.tail_offset
        return offset

    # -- recovery ------------------------------------------------------------------------------

    def recover(
        self,
        start: int | None,
        *,
        check_crc: bool,
        durable_offset: int | None = None,
        columns: list[DispatchColumns] | None = None,
    ) -> RecoveryReport:
        """Find where valid data ends, scanning from ``start`` (a record boundary; None: the
        first file), and cut the log there. With ``columns``, the scan also collects the
        dispatch fields of the records it validates there (runs, in CommitLog order; up to
        ``_RECOVERY_COLUMNS_LIMIT`` records), so that re-dispatch need not read them again.

        - At or past ``durable_offset`` (the checkpoint's flushed offset: bytes known to have
          been fsynced), the first record that is not whole (a missing size, a failed body or
          record CRC) ends the log, whatever follows it. A power loss lands the pages written
          after the last fsync in any order, so whole records can follow a torn one; none of
          them was acknowledged under SYNC flush (decision 210).

        - A record that fails its checks with no valid record anywhere after it is a torn tail:
          the log ends before it. Its bytes are copied to the quarantine directory first.
        - A record whose body fails its CRC but which is followed by valid records is kept in
          place and reported; reading it raises ``CorruptRecordError``. Valid data is never cut.
        - A record whose header is unreadable but which is followed by valid records cannot be
          stepped over: recovery refuses to start rather than drop what follows.
        """
        files = self.files.files
        report = RecoveryReport()
        if not files:
            return report
        offset = files[0].from_offset if start is None else max(start, files[0].from_offset)
        report.scanned_from = offset
        end = self._scan(offset, check_crc, report, durable_offset, columns)
        report.end_offset = end
        self._cut(end, report)
        self._flushed_offset = end
        return report

    def sync_recovered(self, start: int) -> None:
        """fdatasync every file from the one holding ``start``: what recovery kept (and cut)."""
        for f in self.files.iter_from(start):
            f.flushed = 0
            f.flush()

    def defer_recovered_sync(self, start: int) -> None:
        """Leave what recovery kept from ``start`` on to the next flush, as freshly appended
        bytes are under ASYNC flush: it counts as unflushed until then (decision 241)."""
        for f in self.files.iter_from(start):
            f.flushed = 0
        self._flushed_offset = min(self._flushed_offset, start)

    def _scan(
        self,
        offset: int,
        check_crc: bool,
        report: RecoveryReport,
        durable_offset: int | None = None,
        columns: list[DispatchColumns] | None = None,
    ) -> int:
        """Return the end of valid data at or after ``offset``."""
        # A record torn by a kill keeps its size field (the encoder writes a batch in one
        # pwrite, decision 1040): only its record CRC tells it from a whole one. So past the
        # last known fsync (everywhere without a checkpoint) the CRC is checked whatever
        # ``check_crc`` says; before it, written bytes were fsynced whole (decision 1060).
        crc_from = 0 if check_crc or durable_offset is None else durable_offset
        while True:
            f = self.files.find_file(offset)
            if f is None:
                return offset  # exactly at the end of the last file
            pos = offset - f.from_offset
            mm = f.mm
            while True:
                # The record engine validates the run of good records in one call (natively,
                # without the GIL); what follows handles the record it stopped at.
                if f.from_offset + pos < crc_from:
                    if crc_from >= f.from_offset + f.size:
                        pos, scanned = self._scan_run(f, pos, False, columns)
                    else:  # up to the record ending at crc_from; a record crossing it stops
                        limit = min(f.size, crc_from - f.from_offset + BLANK_RECORD_SIZE)
                        pos, scanned = self._scan_part(f, pos, limit, False, columns)
                    report.records_scanned += scanned
                # From here on (a record crossing crc_from included) the CRC is checked; a
                # record before crc_from that fails it alone is judged below by ``check_crc``.
                pos, scanned = self._scan_run(f, pos, True, columns)
                report.records_scanned += scanned
                if f.size - pos < BLANK_RECORD_SIZE:
                    return f.from_offset + pos
                total, magic = read_total_and_magic(mm, pos)
                if magic == BLANK_MAGIC_CODE and total == f.size - pos:
                    break
                here = f.from_offset + pos
                if durable_offset is not None and here >= durable_offset:
                    return here  # past the last known fsync: the first torn record ends it
                if magic == MAGIC_CODE_V2 and 0 < total <= f.size - pos - BLANK_RECORD_SIZE:
                    try:
                        validate(mm, pos, here, check_crc=check_crc or here >= crc_from)
                    except CorruptRecordError:
                        if self._find_valid_record(here + total) is None:
                            return here  # a torn last record
                        log.error(
                            "CommitLog %s: record at offset %d fails its CRC; it is kept "
                            "in place, reported, and refused to readers",
                            f.path,
                            here,
                        )
                        report.corrupt_records.append(here)
                        report.records_scanned += 1
                        pos += total
                        continue
                    except RecordError:
                        pass
                    else:
                        report.records_scanned += 1
                        pos += total
                        continue
                # An unreadable header: the end of data, unless valid records follow it.
                found = self._find_valid_record(here + 1)
                if found is None:
                    return here
                raise StoreLoadError(
                    f"CommitLog {f.path}: unreadable record at offset {here}, but valid records "
                    f"resume at offset {found}. Refusing to start rather than drop them; restore "
                    "the file from a replica or backup, or move it aside to accept the loss."
                )
            offset = f.tail_offset

    def _scan_run(
        self, f: MappedFile, pos: int, check_crc: bool, columns: list[DispatchColumns] | None
    ) -> tuple[int, int]:
        """``scan_records`` over ``f`` from ``pos`` (position after the last valid record, and
        how many), collecting dispatch columns into ``columns`` while it may: one pass over
        the bytes validates and reads them. A large stretch of a full file is checked by two
        threads (``_scan_halves``)."""
        if (
            columns is not None
            and f.size - pos >= _SPLIT_SCAN_BYTES
            and f is not self.files.files[-1]
        ):
            halves = self._scan_halves(f, pos, check_crc, columns)
            if halves is not None:
                return halves
        return self._scan_part(f, pos, f.size, check_crc, columns)

    def _scan_halves(
        self, f: MappedFile, pos: int, check_crc: bool, columns: list[DispatchColumns]
    ) -> tuple[int, int] | None:
        """The scan of ``f`` from ``pos``, with the second half checked speculatively on
        another thread from the first valid record after the middle (a record names its own
        offset, so a false start is practically impossible; decision 242). The result is the
        sequential scan's: the second half counts only if the first one ends exactly where
        it starts; otherwise the first continues on its own. None: no second start found."""
        found = self._find_valid_record(f.from_offset + pos + (f.size - pos) // 2)
        if found is None or found >= f.from_offset + f.size - BLANK_RECORD_SIZE:
            return None
        middle = found - f.from_offset
        second: list[DispatchColumns] = []
        pool = ThreadPoolExecutor(1, thread_name_prefix="tmq-recovery-scan")
        later = pool.submit(self._scan_part, f, middle, f.size, check_crc, second)
        pool.shutdown(wait=False)
        try:
            # A record ending exactly at ``middle`` fits this limit; one crossing it does not.
            end, count = self._scan_part(f, pos, middle + BLANK_RECORD_SIZE, check_crc, columns)
        finally:
            later.exception()  # wait for it either way: the files may close next
        if end != middle:
            more_end, more = self._scan_part(f, end, f.size, check_crc, columns)
            return more_end, count + more
        end, more = later.result()
        columns.extend(second)
        return end, count + more

    @staticmethod
    def _scan_part(
        f: MappedFile,
        pos: int,
        limit: int,
        check_crc: bool,
        columns: list[DispatchColumns] | None,
    ) -> tuple[int, int]:
        count = 0
        while columns is not None:
            room = _RECOVERY_COLUMNS_LIMIT - sum(len(c) for c in columns)
            if room <= 0:
                break
            pos, status, run = dispatch_columns(
                f.mm,
                pos,
                limit,
                f.from_offset,
                validate=True,
                check_crc=check_crc,
                max_records=min(room, 1 << 20),
            )
            if len(run):
                columns.append(run)
                count += len(run)
            if status != 1:
                if status == 0:
                    return pos, count
                break  # a record the columns cannot take: validate the rest only
        pos, scanned = scan_records(f.mm, pos, limit, f.from_offset + pos, check_crc=check_crc)
        return pos, count + scanned

    def _find_valid_record(self, offset: int) -> int | None:
        """The offset of the first whole, CRC-valid record at or after ``offset``, if any.

        A record names its own physical offset, which makes a false match in garbage or in a
        body practically impossible. Only stretches that may hold data are read (the extent
        map skips a preallocated file's never-written end), and all-zero stretches among them
        are passed at memory speed before the magic code is searched for.
        """
        for f in self.files.iter_from(offset):
            mm = f.mm
            for region_start, region_end in f.data_regions(max(0, offset - f.from_offset)):
                pos = max(region_start, offset - f.from_offset)
                while pos < region_end:
                    end = min(region_end, pos + _ZERO_SKIP_CHUNK)
                    if not np.count_nonzero(np.frombuffer(mm, np.uint8, end - pos, pos)):
                        pos = end
                        continue
                    hit = mm.find(_MAGIC_BYTES, pos + 4, min(f.size, end + 4))
                    while hit != -1:
                        start = hit - 4
                        try:
                            validate(mm, start, f.from_offset + start, check_crc=True)
                            return f.from_offset + start
                        except RecordError:
                            pass
                        hit = mm.find(_MAGIC_BYTES, hit + 1, min(f.size, end + 4))
                    pos = end
        return None

    def _cut(self, end: int, report: RecoveryReport) -> None:
        quarantine = self.config.quarantine_dir
        f = self.files.find_file(end)
        if f is not None:
            pos = end - f.from_offset
            length = min(f.size - pos, _QUARANTINE_LIMIT)
            # Checked in place first: after kill -9 the tail is almost always zeros already,
            # and mostly never-written space, which the check skips (decision 831).
            torn = f.any_nonzero(pos, length) if length else False
            tail = f.read(pos, length).rstrip(b"\0") if torn else b""
            if tail:
                # Durable before the cut (decision 1206): from the cut on it is the only copy.
                make_dirs(quarantine)
                path = quarantine / f"commitlog-{end:020d}-{now_ms()}.bin"
                write_file(path, tail)
                report.quarantined.append(path)
                report.truncated_bytes += len(tail)
                log.warning(
                    "CommitLog: cut a torn tail of %d bytes at offset %d (copied to %s)",
                    len(tail),
                    end,
                    path,
                )
        for dropped in self.files.truncate_dirty(end):
            if all_zero(dropped.path):
                dropped.path.unlink()
                continue
            make_dirs(quarantine)
            target = quarantine / f"commitlog-file-{dropped.path.name}-{now_ms()}"
            shutil.move(str(dropped.path), target)
            # A rename within the data directory; a copy (the CommitLog directory on another
            # filesystem) is fsynced too. Either way the new name is made durable.
            fsync_file(target)
            fsync_dir(quarantine)
            report.quarantined.append(target)
            log.warning(
                "CommitLog: %s lies past the end of valid data; moved to %s", dropped.path, target
            )

    # -- retention hook ------------------------------------------------------------------------

    def delete_files_before(self, count: int) -> list[MappedFile]:
        """Delete the ``count`` oldest files (never the one being written)."""
        return self.files.delete_first_files(count)


def _check_replicated(offset: int, data: bytes | memoryview, file_size: int) -> None:
    """Raise ``RecordError`` unless ``data`` is whole, valid records written at ``offset``,
    optionally ending with the BLANK record that pads a file to its end (and only there: dispatch
    and recovery skip from a BLANK to the next file, so one inside a file would hide whatever
    followed it there)."""
    # The scan wants room for a BLANK record after each record; padding gives the last one it.
    padded = b"".join((data, bytes(BLANK_RECORD_SIZE)))
    end, _ = scan_records(padded, 0, len(data) + BLANK_RECORD_SIZE, offset, check_crc=True)
    if end == len(data):
        return
    total, magic = read_total_and_magic(data, end) if len(data) - end >= 8 else (0, 0)
    if magic == BLANK_MAGIC_CODE and total == len(data) - end:
        if (offset + len(data)) % file_size == 0:
            return
        raise RecordError(
            f"replicated bytes at {offset}: the BLANK record at {offset + end} ends at "
            f"{offset + len(data)}, not at the end of its {file_size}-byte CommitLog file"
        )
    validate(data, end, offset + end, check_crc=True)  # raises what is wrong with it
    raise RecordError(f"replicated bytes at {offset}: no whole record at offset {offset + end}")
