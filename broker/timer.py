"""Delay (timer) messages: a durable schedule on disk, delivered into their topics when due.

A delay message is acknowledged once it is in the CommitLog, in the system topic
``rmq_sys_wheel_timer`` (one queue), with its real topic and queue in ``REAL_TOPIC`` /
``REAL_QID`` and its delivery time in ``__STARTDELIVERTIME`` (RocketMQ's timer topic).

The timer log (``{data_dir}/timer/``) is a time wheel on disk: one append-only *bucket file*
per minute of delivery time, holding fixed-size entries that point into the CommitLog. Only the
bucket being delivered lives in memory, so millions of pending timers cost disk, not RAM:

====== ============ ==============================================================
 bytes  field        meaning
====== ============ ==============================================================
 8      DELIVER_MS   delivery time, ms since the epoch
 8      OFFSET       CommitLog offset of the timer record (its identity)
 4      SIZE         size of the timer record
 4      TOPIC_CRC    CRC32 of the real topic's name (per-topic pending counts)
====== ============ ==============================================================

Beside each bucket a *done file* lists the CommitLog offsets already delivered (8 bytes each).
``checkpoint.json`` holds the timer topic's queue offset below which every timer is in a bucket
file (fsynced first).

One thread, ``tmq-timer``, owns all of it: it *enqueues* new timer records (reads the timer
topic's ConsumeQueue from the checkpoint, appends entries to their bucket, or to the current
bucket when already due) and *delivers* the current bucket's due entries in time order, as copies
into their real topics that keep the born time and carry ``__STARTDELIVERTIME`` and
``__TIMER_OFFSET`` (the timer record's offset). A finished bucket is deleted only after a
checkpoint, so a timer re-read after a crash can never land in a bucket already gone.

Crash safety (kill -9): re-enqueued entries are de-duplicated by CommitLog offset; the first
bucket delivered after a start is checked against the IndexFile (a delivered copy with this
``__TIMER_OFFSET`` already in its topic) before each delivery, which covers a crash between a
delivery and its done record. Downtime is caught up: every bucket whose time has passed is due
at once. Undelivered timers pin their CommitLog files against release (``pinned_offset``).
"""

from __future__ import annotations

import errno
import heapq
import json
import logging
import os
import threading
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from broker.stored_properties import INT32_MAX, TIMESTAMP_MAX_MS, int_property
from broker.transaction import PROPERTY_REAL_QUEUE_ID, PROPERTY_REAL_TOPIC, copy_to
from tiered import fd_limit
from tiered.durable import append_whole, fsync_dir, fsync_file, make_dirs, settle_dir, write_file
from tiered.record import Message, StoredMessage
from tiered.store import GetStatus, MessageStore, StoreUnwritableError

log = logging.getLogger(__name__)

# A wheel that cannot write (its disk full, no descriptor left, or the store refusing the
# delivered copies) says so once in this many seconds, not a traceback a second (decision 1071).
_OUT_OF_ROOM_LOG_EVERY_S = 60.0


def _out_of_room(e: BaseException) -> str | None:
    """What ran out, when ``e`` (or what caused it) is a full disk, no descriptor left, or the
    store refusing writes; None for anything else (a bug: its traceback is logged)."""
    if fd_limit.exhausted(e):
        return fd_limit.describe()
    seen: set[int] = set()
    cur: BaseException | None = e
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        if isinstance(cur, OSError) and cur.errno in (errno.ENOSPC, errno.EDQUOT):
            return f"the disk is full ({cur})"
        if isinstance(cur, StoreUnwritableError):
            return str(cur)
        cur = cur.__cause__ or cur.__context__
    return None


TIMER_TOPIC = "rmq_sys_wheel_timer"
PROPERTY_DELIVER_TIME = "__STARTDELIVERTIME"
PROPERTY_TIMER_OFFSET = "__TIMER_OFFSET"
# On a timer record rolled forward (re-put): the CommitLog offset of the record it replaces.
PROPERTY_ROLLED_FROM = "__TIMER_ROLLED_FROM"
BUCKET_MS = 60_000
DEFAULT_MAX_DELAY_MS = 3 * 86_400_000  # RocketMQ's timerMaxDelaySec: 3 days
ENTRY = np.dtype([("due", ">i8"), ("offset", ">i8"), ("size", ">i4"), ("topic", ">u4")])
_DONE = np.dtype(">i8")
_ENQUEUE_BATCH = 1024
_DELIVER_BATCH = 256
_CHECKPOINT_EVERY_S = 1.0


def now_ms() -> int:
    return time.time_ns() // 1_000_000


def topic_crc(topic: str) -> int:
    return zlib.crc32(topic.encode())


def bucket_of(due_ms: int) -> int:
    return due_ms - due_ms % BUCKET_MS


@dataclass(slots=True)
class TimerStats:
    pending: int
    pending_by_topic: dict[str, int]
    delivered: int
    lag_seconds: float  # how far behind the oldest due, undelivered timer is


class TimerLog:
    """The bucket and done files (format in the module docstring); owned by one thread."""

    def __init__(self, directory: Path) -> None:
        self.dir = directory
        self._files: dict[tuple[int, str], int] = {}  # (bucket, kind) -> fd

    def buckets(self) -> list[int]:
        return sorted(int(p.name[:-7]) for p in self.dir.glob("*.bucket"))

    def _path(self, bucket: int, kind: str) -> Path:
        return self.dir / f"{bucket:013d}.{kind}"

    def _fd(self, bucket: int, kind: str) -> int:
        fd = self._files.get((bucket, kind))
        if fd is None:
            fd = os.open(self._path(bucket, kind), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            self._files[(bucket, kind)] = fd
        return fd

    def append(self, bucket: int, entries: np.ndarray) -> None:
        append_whole(self._fd(bucket, "bucket"), entries.astype(ENTRY).tobytes())

    def mark_done(self, bucket: int, offsets: list[int]) -> None:
        append_whole(self._fd(bucket, "done"), np.asarray(offsets, dtype=_DONE).tobytes())

    def entries(self, bucket: int) -> np.ndarray:
        path = self._path(bucket, "bucket")
        raw = path.read_bytes() if path.exists() else b""
        whole = len(raw) - len(raw) % ENTRY.itemsize  # a torn last entry is re-enqueued
        return np.frombuffer(raw[:whole], dtype=ENTRY)

    def done(self, bucket: int) -> set[int]:
        path = self._path(bucket, "done")
        raw = path.read_bytes() if path.exists() else b""
        return set(np.frombuffer(raw[: len(raw) - len(raw) % 8], dtype=_DONE).tolist())

    def sync(self) -> None:
        for fd in self._files.values():
            os.fsync(fd)
        fsync_dir(self.dir)  # the names of bucket files created since the last sync

    def sync_found(self) -> None:
        """fsync every bucket and done file on disk, whoever wrote it. After ``kill -9`` what
        the dead process appended is in the page cache only, and this process writes none of
        it again (a re-read entry of the current bucket is a duplicate, skipped), so its own
        ``sync`` would never reach it before a checkpoint claims it."""
        for path in sorted(self.dir.glob("*.bucket")) + sorted(self.dir.glob("*.done")):
            fsync_file(path)
        fsync_dir(self.dir)

    def delete(self, bucket: int) -> None:
        for kind in ("bucket", "done"):
            fd = self._files.pop((bucket, kind), None)
            if fd is not None:
                os.close(fd)
            self._path(bucket, kind).unlink(missing_ok=True)

    def close(self) -> None:
        self.sync()
        for fd in self._files.values():
            os.close(fd)
        self._files.clear()


class TimerService:
    def __init__(
        self,
        store: MessageStore,
        directory: Path,
        topics: Callable[[], list[str]],
        clock: Callable[[], int] = now_ms,
        leading: Callable[[], bool] = lambda: True,
    ) -> None:
        self.store = store
        self.log = TimerLog(directory)
        # Only a writable master delivers and rolls; a slave keeps its wheel in step from the
        # replicated timer topic (enqueue), so that it can take over when it is elected.
        self._leading = leading
        self._led = False
        # Due times up to which a delivery is first looked up in the IndexFile: everything that
        # came due before this broker began to lead may have been delivered already, by this
        # broker before a crash or by the master it replaced (whose deliveries replication
        # brought here, but not the marks of its own timer log).
        self._verify_until = 0
        self._checkpoint_path = directory / "checkpoint.json"
        self._topics = topics
        self._clock = clock
        self._lock = threading.Lock()  # guards what metrics and release read
        self._stop = threading.Event()
        self._wakeup = threading.Event()
        self._thread: threading.Thread | None = None
        self.enqueue_offset = 0
        self.delivered = 0
        # Per bucket file: entries not yet delivered, their lowest CommitLog offset, and the
        # undelivered count per topic CRC.
        self._pending: dict[int, int] = {}
        self._min_offset: dict[int, int] = {}
        self._by_topic: dict[int, int] = {}
        self._current = 0
        self._heap: list[tuple[int, int, int, int]] = []  # (due, offset, size, topic crc)
        self._seen: set[int] = set()  # offsets in the current bucket, delivered or not
        self._verify = False  # check deliveries against the IndexFile (first bucket after start)
        self._roll_below: int | None = None  # asked by release; done by the tmq-timer thread
        self.rolled = 0
        self.lateness_ms: list[int] = []  # of recent deliveries, for the benchmark and metrics

    # -- lifecycle -----------------------------------------------------------------------------

    def start(self) -> None:
        make_dirs(self.log.dir)
        settle_dir(self.log.dir)  # what is read below is durable before it is acted on
        settle_dir(self._checkpoint_path.parent)
        if self._checkpoint_path.exists():
            self.enqueue_offset = int(json.loads(self._checkpoint_path.read_text())["enqueue"])
        for bucket in self.log.buckets():
            entries = self.log.entries(bucket)
            done = self.log.done(bucket)
            keep = entries[~np.isin(entries["offset"], list(done))] if done else entries
            _, first = np.unique(keep["offset"], return_index=True)
            keep = keep[first]
            self._pending[bucket] = len(keep)
            self._min_offset[bucket] = int(keep["offset"].min()) if len(keep) else 2**62
            for crc, n in zip(*np.unique(keep["topic"], return_counts=True), strict=True):
                self._by_topic[int(crc)] = self._by_topic.get(int(crc), 0) + int(n)
        self.log.sync_found()  # before the first checkpoint counts what a killed run wrote
        buckets = self.log.buckets()
        self._load(
            min(buckets[0], bucket_of(self._clock())) if buckets else bucket_of(self._clock())
        )
        self._verify = True
        self._thread = threading.Thread(target=self._run, name="tmq-timer", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        if self._thread is None:
            return  # never started: its checkpoint must not be overwritten
        self._stop.set()
        self._wakeup.set()
        self._thread.join()
        self._checkpoint()
        self.log.close()

    def wakeup(self) -> None:
        self._wakeup.set()

    # -- the wheel -----------------------------------------------------------------------------

    def _load(self, bucket: int) -> None:
        self._current = bucket
        entries = self.log.entries(bucket)
        done = self.log.done(bucket)
        self._seen = set(entries["offset"].tolist())
        self._heap = []
        for due, offset, size, crc in entries.tolist():
            if offset not in done:
                done.add(offset)  # de-duplicates entries enqueued twice
                self._heap.append((due, offset, size, crc))
        heapq.heapify(self._heap)
        with self._lock:
            self._pending[bucket] = len(self._heap)

    def _advance(self, now: int) -> bool:
        """Move past a finished bucket (its time passed, nothing left); True if it moved."""
        if self._heap or now < self._current + BUCKET_MS:
            return False
        self._checkpoint()  # nothing enqueued before this can be re-read into a later bucket
        finished = self._current
        self.log.delete(finished)
        with self._lock:
            self._pending.pop(finished, None)
            self._min_offset.pop(finished, None)
        later = [b for b in self._pending if b > finished]
        self._load(min([*later, bucket_of(now)]))
        self._verify = False
        return True

    def _run(self) -> None:
        last_checkpoint = time.monotonic()
        # While the wheel cannot write, and when it last said so (monotonic): at most one line
        # a minute, even when a page freed now and then lets a pass through.
        out_of_room = False
        out_of_room_logged = -_OUT_OF_ROOM_LOG_EVERY_S
        while not self._stop.is_set():
            try:
                now = self._clock()
                enqueued = self._enqueue(now)
                delivered = moved = 0
                if self._leading():
                    if not self._led:  # started, or elected: see _verify_until
                        self._verify_until = now
                        self._led = True
                    self._roll()
                    delivered = self._deliver(now)
                    moved = self._advance(now)
                else:
                    self._led = False
                if time.monotonic() - last_checkpoint >= _CHECKPOINT_EVERY_S:
                    self._checkpoint()
                    last_checkpoint = time.monotonic()
                if out_of_room:
                    out_of_room = False
                    log.warning("timer wheel resumed: it can write again")
                if not (enqueued or delivered or moved):
                    wait = 0.05
                    if self._heap:
                        wait = min(wait, max(0.0, (self._heap[0][0] - self._clock()) / 1000))
                    self._wakeup.wait(wait)
                    self._wakeup.clear()
            except Exception as e:
                why = _out_of_room(e)
                if why is None:
                    log.exception("timer wheel failed; retrying in 1 s")
                else:
                    # One line a minute, not a traceback a second: the log may share that disk.
                    out_of_room = True
                    at = time.monotonic()
                    if at - out_of_room_logged >= _OUT_OF_ROOM_LOG_EVERY_S:
                        out_of_room_logged = at
                        log.error(
                            "timer wheel cannot write: %s. Delay messages are kept (in the "
                            "CommitLog and the timer log) and delivered late, not lost; the "
                            "wheel retries every second and resumes by itself",
                            why,
                        )
                self._stop.wait(1.0)

    def _enqueue(self, now: int) -> int:
        got = self.store.get_messages(
            TIMER_TOPIC, 0, self.enqueue_offset, _ENQUEUE_BATCH, hot_only=True
        )
        if got.status is not GetStatus.FOUND:
            if got.status is GetStatus.OFFSET_TOO_SMALL:
                self.enqueue_offset = got.next_offset
            return 0
        rows: dict[int, list[tuple[int, int, int, int]]] = {}
        replaced: dict[int, list[int]] = {}  # bucket -> offsets of records rolled forward
        in_heap: set[int] | None = None  # offsets in the current bucket's heap, when needed
        # Scheduled in memory only once their entries are in the bucket file: a failed append
        # (a full disk) is retried from the same offset, and must not find them "seen".
        now_due: list[tuple[int, int, int, int]] = []
        for m in got.messages:
            # A due time that is not a number, or past any Timestamp, is due now: delivered,
            # never stuck and never pinning its file for good (decision 530).
            due = int_property(m.properties, PROPERTY_DELIVER_TIME, now)
            if due > TIMESTAMP_MAX_MS:
                due = now
            bucket = max(bucket_of(due), self._current)
            crc = topic_crc(m.properties.get(PROPERTY_REAL_TOPIC, ""))
            row = (due, m.commitlog_offset, m.size, crc)
            rolled_from = m.properties.get(PROPERTY_ROLLED_FROM)
            if bucket == self._current:
                if m.commitlog_offset in self._seen:
                    continue  # re-read after a crash: already scheduled
                if rolled_from is not None:
                    if in_heap is None:
                        in_heap = {r[1] for r in self._heap} | {r[1] for r in now_due}
                    if int(rolled_from) not in in_heap:
                        continue  # the old record was delivered before this one was enqueued
                now_due.append(row)
            if rolled_from is not None:
                replaced.setdefault(bucket, []).append(int(rolled_from))
            rows.setdefault(bucket, []).append(row)
        with self._lock:
            for bucket, bucket_rows in rows.items():
                self.log.append(bucket, np.array(bucket_rows, dtype=ENTRY))
                self._pending[bucket] = self._pending.get(bucket, 0) + len(bucket_rows)
                low = min(r[1] for r in bucket_rows)
                self._min_offset[bucket] = min(self._min_offset.get(bucket, low), low)
                for r in bucket_rows:
                    self._by_topic[r[3]] = self._by_topic.get(r[3], 0) + 1
        for row in now_due:
            self._seen.add(row[1])
            heapq.heappush(self._heap, row)
        for bucket, offsets in replaced.items():
            self._retire(bucket, offsets)
            if bucket == self._current:  # the new entries replace the old ones in the heap
                gone = set(offsets)
                self._heap = [r for r in self._heap if r[1] not in gone]
                heapq.heapify(self._heap)
        self.enqueue_offset = got.next_offset
        return len(got.messages)

    def _deliver(self, now: int) -> int:
        batch: list[tuple[int, int, int, int]] = []
        while self._heap and self._heap[0][0] <= now and len(batch) < _DELIVER_BATCH:
            batch.append(heapq.heappop(self._heap))
        if not batch:
            return 0
        copies: list[Message] = []
        for due, offset, size, _ in batch:
            stored = self.store.read_message(offset, size)
            if stored is None:
                log.error("timer record at CommitLog offset %d is gone; not delivered", offset)
                continue
            verify = self._verify or due <= self._verify_until
            if verify and self._already_delivered(stored):
                continue
            copies.append(_delivered_copy(stored))
        if copies:
            try:
                self.store.put_messages(copies)
            except Exception:
                for row in batch:  # not delivered: due again on the next pass
                    heapq.heappush(self._heap, row)
                raise
        delivered_at = self._clock()
        self.log.mark_done(self._current, [b[1] for b in batch])
        with self._lock:
            self._pending[self._current] = self._pending.get(self._current, 0) - len(batch)
            for b in batch:
                self._by_topic[b[3]] = self._by_topic.get(b[3], 0) - 1
            self.delivered += len(copies)
            self.lateness_ms += [delivered_at - b[0] for b in batch]
            del self.lateness_ms[:-100_000]
        return len(batch)

    def roll_forward(self, below: int) -> None:
        """Ask for every undelivered timer whose record lies below CommitLog offset ``below``
        to be re-put (RocketMQ's timer "roll"), so that it no longer pins the files there. The
        tmq-timer thread does it on its next pass; ``pinned_offset`` moves once it has."""
        self._roll_below = below
        self._wakeup.set()

    def _roll(self) -> int:
        """Re-put the undelivered timer records below ``_roll_below`` as new records of the
        timer topic carrying ``__TIMER_ROLLED_FROM``; their enqueue marks the old entries done
        (and takes them out of the current bucket's heap), so a crash anywhere in between
        leaves either the old entry or the new one live, never both. The
        delivered copy keeps naming the first record (``__TIMER_OFFSET``): the IndexFile check
        after a restart finds it whichever record delivered it."""
        below, self._roll_below = self._roll_below, None
        if below is None:
            return 0
        with self._lock:
            buckets = [
                b
                for b, n in self._pending.items()
                if n > 0 and self._min_offset.get(b, 2**62) < below
            ]
        records: list[Message] = []
        for bucket in sorted(buckets):
            entries = self.log.entries(bucket)
            done = self.log.done(bucket)
            for offset, size in {
                (o, z) for _, o, z, _ in entries.tolist() if o < below and o not in done
            }:
                stored = self.store.read_message(offset, size)
                if stored is None:
                    log.error("timer record at CommitLog offset %d is gone; not rolled", offset)
                    continue
                props = dict(stored.properties)
                props.setdefault(PROPERTY_TIMER_OFFSET, str(offset))
                props[PROPERTY_ROLLED_FROM] = str(offset)
                records.append(copy_to(stored, TIMER_TOPIC, 0, props))
        for i in range(0, len(records), _DELIVER_BATCH):
            self.store.put_messages(records[i : i + _DELIVER_BATCH])
        if records:
            self.rolled += len(records)
            log.info("timers: %d record(s) rolled forward past offset %d", len(records), below)
        return len(records)

    def _retire(self, bucket: int, offsets: list[int]) -> None:
        """Mark entries of ``bucket`` done without delivering them (their records were rolled
        forward and re-enqueued), and recount the bucket's pin from its file."""
        entries = self.log.entries(bucket)
        done = self.log.done(bucket)
        live = set(entries["offset"].tolist()) - done
        retired = [o for o in set(offsets) if o in live]
        if retired:
            self.log.mark_done(bucket, retired)
        remaining = live - set(retired)
        with self._lock:
            self._pending[bucket] = self._pending.get(bucket, 0) - len(retired)
            for crc in entries["topic"][np.isin(entries["offset"], retired)].tolist():
                self._by_topic[crc] = self._by_topic.get(crc, 0) - 1
            self._min_offset[bucket] = min(remaining, default=2**62)

    def _already_delivered(self, stored: StoredMessage) -> bool:
        topic = stored.properties.get(PROPERTY_REAL_TOPIC, "")
        for m in self.store.query_by_key(
            topic, stored.msg_id or "", begin_ms=stored.store_timestamp
        ):
            identity = stored.properties.get(PROPERTY_TIMER_OFFSET, str(stored.commitlog_offset))
            if m.properties.get(PROPERTY_TIMER_OFFSET) == identity:
                return True
        return False

    def _checkpoint(self) -> None:
        self.log.sync()
        write_file(self._checkpoint_path, json.dumps({"enqueue": self.enqueue_offset}).encode())

    # -- what others read ----------------------------------------------------------------------

    def pinned_offset(self) -> int | None:
        """The lowest CommitLog offset an undelivered timer needs kept."""
        with self._lock:
            live = [self._min_offset[b] for b, n in self._pending.items() if n > 0]
        return min(live, default=None)

    def stats(self) -> TimerStats:
        now = self._clock()
        with self._lock:
            names = {topic_crc(t): t for t in self._topics()}
            by_topic = {names.get(c, f"crc:{c}"): n for c, n in self._by_topic.items() if n > 0}
            heap_head = self._heap[0][0] if self._heap else None
            return TimerStats(
                pending=sum(max(0, n) for n in self._pending.values()),
                pending_by_topic=by_topic,
                delivered=self.delivered,
                lag_seconds=max(0.0, (now - heap_head) / 1000) if heap_head is not None else 0.0,
            )


def _delivered_copy(stored: StoredMessage) -> Message:
    props = {
        k: v
        for k, v in stored.properties.items()
        if k not in (PROPERTY_REAL_TOPIC, PROPERTY_REAL_QUEUE_ID, PROPERTY_ROLLED_FROM)
    }
    # A rolled record already names the first one: the identity the IndexFile check looks for.
    props.setdefault(PROPERTY_TIMER_OFFSET, str(stored.commitlog_offset))
    topic = stored.properties.get(PROPERTY_REAL_TOPIC, "")
    queue_id = int_property(stored.properties, PROPERTY_REAL_QUEUE_ID, 0, 0, INT32_MAX)
    return copy_to(stored, topic, queue_id, props)


def as_timer_message(msg: Message) -> Message:
    """A delay message for its topic as the record the timer topic stores."""
    props = dict(msg.properties)
    props[PROPERTY_REAL_TOPIC] = msg.topic
    props[PROPERTY_REAL_QUEUE_ID] = str(msg.queue_id)
    return copy_to(msg, TIMER_TOPIC, 0, props)
