"""The cold-read path: messages the hot store no longer (or never) holds, served from segments.

- Manifests are cached per queue. The hot path (``start_offset``, ``end_offset``, ``may_hold``,
  which every read and ``min_offset`` call) only ever reads that cache: it never waits on the
  object store. A background thread (``tmq-cold-manifests``) loads and refreshes the manifests
  of tiered queues every ``manifest_ttl_s``; a commit in this process updates the cache at once
  (``set_manifest``). During an outage the last manifest stays in use. Where each archive
  starts is also kept in a local file (``ArchiveStarts``), so a broker restarted during an
  outage still knows it; a tiered queue with neither is "not known yet", a retry for whoever
  asks, never "no archive" (decision 520).
- A cold read has its own deadline (``read_timeout_s``, shorter than a client's request
  timeout): past it, or when the store fails, it raises ``ColdTierUnavailableError`` rather than
  hold the request thread for the SDK's own timeouts and retries.
- Segment reads run as jobs of the cold worker (``tiered/cold/worker.py``): in the broker, a
  child process with its own interpreter lock, which does the ranged GETs and checks every
  record (structure, body CRC, queue offset), so none of that per-record work stalls an append.
  A batch is one ranged GET: each segment's offset table is fetched once and cached. A
  sequential reader gets a whole segment with one GET instead (decision 1220, ``_whole_starts``).
- A byte-bounded read-ahead cache holds batches as raw, checked spans of records
  (``RecordSpan``); a read decodes only the messages it returns. A sequential reader's next
  batches are fetched in the background, in parallel, while it consumes the current one.
- The fetcher owns its thread pool (``workers``), whose threads only wait on the worker, and
  bounds the fetches queued on it (``max_inflight``): replays from the archive queue there, and
  never run on the broker's append path.
- A missing or damaged object raises ``SegmentError``: loud, never a silent gap.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path
from typing import TypeVar

import numpy as np

from tiered.cold.manifest import ManifestError, ManifestLog, QueueManifest, queue_prefix
from tiered.cold.segment import (
    RecordSpan,
    ReplyEncoder,
    SegmentError,
    SegmentInfo,
    SegmentReader,
    check_offset_table,
    read_offset_table,
    read_segment,
    read_span,
    read_spans,
)
from tiered.cold.storage import ObjectStore, StorageError
from tiered.cold.worker import JobRunner, LocalRunner, run_job
from tiered.durable import make_dirs, settle_dir, write_file
from tiered.formats import CQ_DTYPE
from tiered.record import StoredMessage

log = logging.getLogger(__name__)

T = TypeVar("T")
# What a read takes from one batch: the items, their bytes, the offset after them.
Taken = tuple[list[T], int, int]

# A read fetches about this many bytes of records with one ranged GET: big enough that request
# latency is not the limit, small enough for a consumer's first message to come quickly.
BATCH_BYTES = 1 << 20
# A read decoding a batch hands the GIL over every this many messages (the record engine decodes
# them in about a quarter of a millisecond), so an append waits that long for the interpreter at
# most, not the switch interval (5 ms): decoding is the one per-message work a cold read still
# does in the broker. Not fewer: each hand-over is a system call that, on a loaded machine,
# gives the CPU away (0.1 ms or more).
_YIELD_EVERY = 128
# How many batches past the current one a sequential reader has in flight (at most half the
# cache's bytes): GETs in parallel are what brings a replay near the store's bandwidth.
READ_AHEAD = 16
# How many consecutive batches a read-ahead fetches with one GET: LocalStack (like any object
# store) spends a fixed cost per request, so four 1 MiB ranges cost it more than one of 4 MiB.
GET_BATCHES = 4


class ColdTierUnavailableError(StorageError):
    """The object store did not answer a cold read within its deadline, or failed it."""


class ArchiveStarts:
    """Where each queue's archive starts, as this broker last saw a manifest committed or loaded,
    kept in a local file (``path``; None: in memory only), as Kafka checkpoints a partition's
    log start offset and RocketMQ's tiered store keeps its queue metadata on local disk
    (decision 520). A broker restarted while the object store is down still knows which queues
    have an archive and where each starts. The record is only ever at or below the archive's
    real start (it is written after a commit, and retention only moves a start up): a reader
    sent there is told the truth by its first cold read, never sent past a message."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self._starts: dict[tuple[str, int], int] = {}
        self._unsaved = False  # the file is behind ``_starts``: a save failed
        self._lock = threading.Lock()
        if path is not None:
            settle_dir(path.parent)  # what is read below is durable before it is acted on
        if path is not None and path.exists():
            try:
                self._starts = {(t, q): s for t, q, s in json.loads(path.read_bytes())["queues"]}
            except (ValueError, KeyError, TypeError) as e:
                # Unreadable: as if absent; a tiered queue is then unknown until its manifest
                # loads (a retry for its readers), never taken for one with no archive.
                log.warning(
                    "%s is unreadable (%s); archive starts are reloaded from the tier", path, e
                )

    def get(self, topic: str, queue_id: int) -> int | None:
        return self._starts.get((topic, queue_id))

    def queues(self) -> set[tuple[str, int]]:
        return set(self._starts)

    def note(self, topic: str, queue_id: int, manifest: QueueManifest) -> None:
        """Record ``manifest``'s archive start (a queue whose archive is empty is dropped)."""
        key = (topic, queue_id)
        start = manifest.start_offset if manifest.segments else None
        with self._lock:
            if self._starts.get(key) == start and not self._unsaved:
                return
            if start is None:
                self._starts.pop(key, None)
            else:
                self._starts[key] = start
            if self.path is None:
                return
            rows = sorted([t, q, s] for (t, q), s in self._starts.items())
            try:
                make_dirs(self.path.parent)
                write_file(self.path, json.dumps({"queues": rows}).encode())
            except OSError as e:
                # A full disk: the tier stays the truth while this process runs, but a file
                # left stale would, after a restart, hide an un-tiered topic's archive or make
                # a restart in an outage forget a queue has one. Retried at the next note of
                # any queue, which the refresher makes every pass, changed or not.
                if not self._unsaved:
                    log.warning("cannot save %s (retried every manifest pass): %s", self.path, e)
                self._unsaved = True
            else:
                if self._unsaved:
                    log.info("saved %s again", self.path)
                self._unsaved = False


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
        read_timeout_s: float = 2.5,
        max_inflight: int = 64,
        tiered_queues: Callable[[], Iterable[tuple[str, int]]] = lambda: (),
        observe: Callable[[float, int], None] | None = None,
        runner: JobRunner | None = None,
        reply_encoder: ReplyEncoder | None = None,
        archive_starts: Path | None = None,
    ) -> None:
        """``tiered_queues()`` names the queues whose manifests the background thread keeps
        fresh (the broker's tiered topics; with those ``archive_starts``, the local record of
        where each archive starts, names); ``observe(seconds, bytes)`` is told of every
        segment read (metrics); ``runner`` runs the segment reads (the broker's cold worker;
        by default threads of this process); ``reply_encoder`` (a module-level function, run
        by the runner beside each segment read) writes each record as its reader's protocol
        sends it, for ``get_replies``."""
        self.tier = tier
        self.cluster = cluster
        self.broker = broker
        self.cache_bytes = cache_bytes
        self.manifest_ttl_s = manifest_ttl_s
        self.read_timeout_s = read_timeout_s
        self.max_inflight = max_inflight
        self.reply_encoder = reply_encoder
        self._listed_queues = tiered_queues
        self.starts = ArchiveStarts(archive_starts)
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="tmq-cold-fetch")
        self._manifests: dict[tuple[str, int], tuple[float, QueueManifest]] = {}
        self._own_runner = runner is None
        self.runner = runner or LocalRunner(tier, threads=workers, max_inflight=workers)
        # A batch is cached as records or as replies-only (the key's last item), decision 705.
        self._cache: OrderedDict[tuple[str, int, bool], RecordSpan] = OrderedDict()
        self._cached_bytes = 0
        # Offset tables of the segments being read, most recent last (bytes bounded too).
        self._tables: OrderedDict[str, np.ndarray] = OrderedDict()
        self._table_bytes = 0
        self._table_loads: dict[str, threading.Lock] = {}
        # The segments last read whole (by key and kind of batch): their readers are sequential.
        self._read_whole: OrderedDict[tuple[str, bool], None] = OrderedDict()
        self._inflight: dict[tuple[str, int, bool], Future[RecordSpan]] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._refresher: threading.Thread | None = None
        self.hits = 0
        self.misses = 0
        self.bytes_fetched = 0
        self.unavailable = 0  # cold reads refused: deadline passed, store failed, or too busy
        self._observe = observe
        # From which offset a queue's messages are local only (None: no such offset): a queue
        # whose start could not be checked against its archive, or that diverged from it
        # (decision 750). No read at or above it is served from the archive.
        self.local_from: Callable[[str, int], int | None] = lambda topic, queue_id: None

    def _tiered_queues(self) -> set[tuple[str, int]]:
        """The queues with (or meant to have) an archive: the tiered topics' queues, and every
        queue the local record says has one (its topic may have been un-tiered since)."""
        return set(self._listed_queues()) | self.starts.queues()

    # -- lifecycle -------------------------------------------------------------------------------

    def start(self) -> None:
        """Start the background thread that keeps tiered queues' manifests fresh."""
        self._refresher = threading.Thread(
            target=self._refresh_loop, name="tmq-cold-manifests", daemon=True
        )
        self._refresher.start()

    def prime(self, timeout_s: float = 10.0) -> None:
        """Load the tiered queues' manifests now, in parallel, waiting at most ``timeout_s``.

        The broker calls this before it serves: otherwise, after a restart, the first reads,
        ``QueryOffset(BEGINNING)`` and a new group's start would see only the hot store until
        the refresher came round, as if the archive were gone. A queue not loaded in time
        (the tier is down) is left to the refresher, and named in the log."""
        try:
            wanted = sorted(set(self._tiered_queues()))
        except Exception:
            log.exception("cold manifests: cannot list the tiered queues")
            return
        futures = {key: self._pool.submit(self._load, *key) for key in wanted}
        done, _ = wait(list(futures.values()), timeout=timeout_s)
        missed = [k for k, f in futures.items() if f not in done or f.exception() is not None]
        if missed:
            log.warning(
                "cold manifests: %d of %d tiered queue(s) not loaded at start (%s); reads of "
                "their archive wait for the tier",
                len(missed),
                len(futures),
                ", ".join(f"{t}/{q}" for t, q in missed[:5]),
            )

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self._own_runner:
            self.runner.close()
        if self._refresher is not None:
            self._refresher.join(timeout=5)

    def _refresh_loop(self) -> None:
        failing: set[tuple[str, int]] = set()
        while not self._stop.is_set():
            try:
                wanted = set(self._tiered_queues())
            except Exception:  # metadata being rewritten: next round
                log.exception("cold manifests: cannot list the tiered queues")
                wanted = set()
            now = time.monotonic()
            for key in sorted(wanted | set(self._manifests)):
                if self._stop.is_set():
                    return
                cached = self._manifests.get(key)
                if cached is not None and now - cached[0] < self.manifest_ttl_s:
                    continue
                try:
                    self._load(*key)
                    if key in failing:
                        failing.discard(key)
                        log.info("%s/%d: the cold tier answers again", *key)
                except (StorageError, ManifestError) as e:
                    if key not in failing:  # once per outage, not every round
                        failing.add(key)
                        log.warning(
                            "%s/%d: manifest refresh failed (%s); cold reads use the last "
                            "one loaded",
                            *key,
                            e,
                        )
            self._wake.wait(max(0.5, self.manifest_ttl_s / 2))
            self._wake.clear()

    # -- manifests -------------------------------------------------------------------------------

    def _load(self, topic: str, queue_id: int) -> QueueManifest:
        prefix = queue_prefix(self.cluster, self.broker, topic, queue_id)
        loaded_at = time.monotonic()
        manifest = ManifestLog(self.tier, prefix).load()
        key = (topic, queue_id)
        with self._lock:
            # A commit that landed while this load was under way is newer: keep it.
            current = self._manifests.get(key)
            if current is None or current[1].version <= manifest.version:
                self._manifests[key] = (loaded_at, manifest)
            else:
                manifest = current[1]
        self.starts.note(topic, queue_id, manifest)
        return manifest

    def manifest(self, topic: str, queue_id: int, *, refresh: bool = False) -> QueueManifest:
        """The queue's manifest, loaded from the tier when not cached or ``refresh`` (a
        blocking call: for cold reads and tools, never for the hot path)."""
        cached = self._manifests.get((topic, queue_id))
        if cached is None or refresh:
            return self._load(topic, queue_id)
        return cached[1]

    def set_manifest(self, topic: str, queue_id: int, manifest: QueueManifest) -> None:
        """A manifest this process just committed: newer than anything cached."""
        with self._lock:
            self._manifests[(topic, queue_id)] = (time.monotonic(), manifest)
        self.starts.note(topic, queue_id, manifest)

    def cached(self, topic: str, queue_id: int) -> QueueManifest | None:
        entry = self._manifests.get((topic, queue_id))
        return entry[1] if entry is not None else None

    def start_offset(self, topic: str, queue_id: int) -> int | None:
        """Where the archive starts, as last known (None: empty or not known yet). Never
        waits on the object store."""
        m = self.cached(topic, queue_id)
        return m.start_offset if m is not None and m.segments else None

    def end_offset(self, topic: str, queue_id: int) -> int:
        """The tier watermark as last known (0 when not known yet). Never waits."""
        m = self.cached(topic, queue_id)
        return m.end_offset if m is not None else 0

    def archive_start(self, topic: str, queue_id: int) -> int | None:
        """Where the queue's archive starts (None: it has none), from the cached manifest, or
        before one is loaded (the tier has been down since this broker started) from the local
        record (``ArchiveStarts``). Never waits on the object store. A tiered queue known to
        neither raises ``ColdTierUnavailableError`` (a retry) rather than answer None, which
        would make the hot store's first offset the queue's (decision 520)."""
        m = self.cached(topic, queue_id)
        if m is not None:
            return m.start_offset if m.segments else None
        recorded = self.starts.get(topic, queue_id)
        if recorded is not None:
            self._wake.set()  # load the manifest: the record may be behind retention
            return recorded
        if self._unknown(topic, queue_id):
            self.unavailable += 1
            raise ColdTierUnavailableError(
                f"{topic}/{queue_id}: where its archive starts is not known yet (the queue's "
                "manifest could not be loaded from the cold tier); retry"
            )
        return None

    def _unknown(self, topic: str, queue_id: int) -> bool:
        """Whether ``(topic, queue_id)`` is a tiered queue with no manifest loaded yet; wakes
        the refresher to load it. A list of tiered queues that cannot be read counts every
        queue as tiered: an unknown state is never taken for "no archive"."""
        try:
            tiered = (topic, queue_id) in self._tiered_queues()
        except Exception:
            log.exception("cold manifests: cannot list the tiered queues")
            tiered = True
        if tiered:
            self._wake.set()
        return tiered

    def may_hold(self, topic: str, queue_id: int, offset: int) -> bool:
        """Whether a read of ``offset`` (below the hot store) should ask the tier: the cached
        manifest holds it, or no manifest is known yet for a tiered queue (the read loads it,
        within its deadline). Never waits on the object store. Never for an offset the local
        log holds other messages at than the archive (``local_from``)."""
        local_from = self.local_from(topic, queue_id)
        if local_from is not None and offset >= local_from:
            return False
        m = self.cached(topic, queue_id)
        if m is not None:
            return bool(m.segments) and m.start_offset <= offset
        return self._unknown(topic, queue_id)

    def _within_deadline(self, what: str, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the fetcher's pool and wait at most ``read_timeout_s`` for it."""
        with self._lock:
            busy = len(self._inflight) >= self.max_inflight
        if busy:
            self.unavailable += 1
            raise ColdTierUnavailableError(f"{what}: the cold-read queue is full; retry later")
        future = self._pool.submit(fn)
        return self._wait(what, future)

    def _wait(self, what: str, future: Future[T]) -> T:
        try:
            return future.result(timeout=self.read_timeout_s)
        except FutureTimeout:
            self.unavailable += 1
            raise ColdTierUnavailableError(
                f"{what}: the cold tier did not answer within {self.read_timeout_s:g} s"
            ) from None
        except StorageError as e:
            self.unavailable += 1
            raise ColdTierUnavailableError(f"{what}: the cold tier is unavailable: {e}") from e
        except ManifestError as e:
            # A manifest failing its own CRC is, first of all, an answer damaged on the way
            # (one that stays damaged is `tmq verify`'s FAILURE): a retry, not a lost archive.
            self.unavailable += 1
            raise ColdTierUnavailableError(f"{what}: the queue's manifest read damaged: {e}") from e

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
        Raises ``SegmentError`` when the archive should hold ``offset`` and does not, and
        ``ColdTierUnavailableError`` when the object store does not answer in time. An offset
        below the archive (expired, or a queue with none), or a segment that retention removed
        while this read was under way, is not an error: the answer is no messages, and the
        archive's start as the next offset."""

        def step(batch: RecordSpan, i: int, count: int, room: int) -> Taken[StoredMessage]:
            if tag_filter is None:
                # Which records this read returns is known from the span's positions alone, so
                # nothing is done per message but the record engine's decode (decision 331).
                count, taken = batch.take(i, count, room)
                out: list[StoredMessage] = []
                for run in range(i, i + count, _YIELD_EVERY):
                    # Let a waiting append have the GIL between runs (_YIELD_EVERY).
                    time.sleep(0)
                    out += batch.messages(run, min(run + _YIELD_EVERY, i + count))
                return out, taken, batch.base_offset + i + count
            out, size, next_offset = [], 0, batch.base_offset + i
            while i < len(batch) and len(out) < count and size < room:
                # Decode only what this read returns, a run at a time in one call of the record
                # engine, and let a waiting append have the GIL between runs (_YIELD_EVERY).
                time.sleep(0)
                for m in batch.messages(i, i + _YIELD_EVERY):
                    i += 1
                    next_offset = m.queue_offset + 1
                    if tag_filter(m):
                        out.append(m)
                        size += m.size
                        if len(out) >= count or size >= room:
                            break
            return out, size, next_offset

        return self._read(topic, queue_id, offset, max_count, max_bytes, step, replies=False)

    def get_replies(
        self, topic: str, queue_id: int, offset: int, max_count: int, max_bytes: int = 4 << 20
    ) -> tuple[list[bytes], int, int]:
        """``get`` without a filter, answered with each message's reply as the worker wrote it
        (``reply_encoder``): the replies, the next offset, and the bodies' bytes. The broker
        decodes nothing and builds no object per message. Same errors as ``get``."""
        if self.reply_encoder is None:
            raise ValueError("this cold fetcher has no reply encoder")
        body_bytes = 0

        def step(batch: RecordSpan, i: int, count: int, room: int) -> Taken[bytes]:
            nonlocal body_bytes
            count, taken = batch.take(i, count, room)
            replies, bodies = batch.reply_run(i, i + count)
            body_bytes += bodies
            return replies, taken, batch.base_offset + i + count

        out, next_offset = self._read(
            topic, queue_id, offset, max_count, max_bytes, step, replies=True
        )
        return out, next_offset, body_bytes

    def _read(
        self,
        topic: str,
        queue_id: int,
        offset: int,
        max_count: int,
        max_bytes: int,
        step: Callable[[RecordSpan, int, int, int], Taken[T]],
        *,
        replies: bool,
    ) -> tuple[list[T], int]:
        """The loop of every read: batch after batch of the segment holding ``offset``, until
        ``max_count`` items, ``max_bytes`` or the segment's end. ``step(batch, i, count, room)``
        takes at most ``count`` items and about ``room`` bytes from record ``i`` of a batch on:
        the items, their bytes and the offset after the last record it looked at. Errors and the
        answer to a segment that retention removed meanwhile (no items, the archive's new start)
        as ``get``. ``replies``: the batches are replies-only spans (``get_replies``), else
        records without replies (decision 705)."""
        what = f"{topic}/{queue_id} offset {offset}"
        manifest, info = self._segment(topic, queue_id, offset, what)
        if info is None:  # below the archive: as if retention had just removed it
            return [], max(offset, manifest.start_offset)
        out: list[T] = []
        size = 0
        next_offset = offset
        while next_offset < info.end_offset and len(out) < max_count and size < max_bytes:
            batch = self._next_batch(
                topic, queue_id, manifest, info, next_offset, what, bool(out), replies
            )
            if batch is None:
                break  # what was read stands; the next read meets the error afresh
            if isinstance(batch, int):
                return [], batch
            items, taken, next_offset = step(
                batch, next_offset - batch.base_offset, max_count - len(out), max_bytes - size
            )
            out += items
            size += taken
        return out, next_offset

    def _next_batch(
        self,
        topic: str,
        queue_id: int,
        manifest: QueueManifest,
        info: SegmentInfo,
        offset: int,
        what: str,
        have_some: bool,
        replies: bool,
    ) -> RecordSpan | int | None:
        """The batch holding ``offset``. When its segment cannot be read: None if the read
        ``have_some`` messages already, the archive's new start if retention removed the
        segment meanwhile, else the ``SegmentError``."""
        try:
            following = manifest.find(info.end_offset)
            after = manifest.find(following.end_offset) if following is not None else None
            return self._batch(info, offset, what, following, replies, after)
        except SegmentError:
            if have_some:
                return None
            expired_to = self._expired_to(topic, queue_id, info, what)
            if expired_to is None:
                raise
            return expired_to

    def _segment(
        self, topic: str, queue_id: int, offset: int, what: str
    ) -> tuple[QueueManifest, SegmentInfo | None]:
        """The queue's manifest (refreshed within the deadline when the cached one does not
        reach ``offset``) and the segment that holds ``offset``: None when ``offset`` is below
        the archive (or the queue has none), ``SegmentError`` when the archive should hold it
        and does not."""
        manifest = self.cached(topic, queue_id)
        if manifest is None or (manifest.find(offset) is None and offset >= manifest.end_offset):
            manifest = self._within_deadline(
                what, lambda: self.manifest(topic, queue_id, refresh=True)
            )
        info = manifest.find(offset)
        if info is None and (not manifest.segments or offset < manifest.start_offset):
            return manifest, None  # below the archive: expired, or the queue has none
        if info is None:
            raise SegmentError(
                f"{topic}/{queue_id}: offset {offset} is not in the archive "
                f"[{manifest.start_offset}, {manifest.end_offset})"
            )
        return manifest, info

    def _expired_to(self, topic: str, queue_id: int, info: SegmentInfo, what: str) -> int | None:
        """Where the archive starts now, if retention removed ``info`` while a read of it was
        under way (its object is gone, and so is it from the manifest); None if the manifest
        still names it, which makes the missing object a real loss."""
        fresh = self._within_deadline(what, lambda: self.manifest(topic, queue_id, refresh=True))
        if any(s.key == info.key for s in fresh.segments):
            return None
        return fresh.start_offset

    @staticmethod
    def _batch_len(info: SegmentInfo) -> int:
        """Messages per batch in this segment, from its average record size. Batches are fixed
        slices of the segment, so concurrent readers share them; one batch never holds more
        than the whole segment (64 MiB by default), however uneven its records are."""
        average = max(1, info.size // max(1, info.count))
        return max(16, min(4096, BATCH_BYTES // average))

    def _batch(
        self,
        info: SegmentInfo,
        offset: int,
        what: str,
        following: SegmentInfo | None = None,
        replies: bool = False,
        after: SegmentInfo | None = None,
    ) -> RecordSpan:
        """The cached batch holding ``offset``, fetched within the read deadline. The read-ahead
        runs on into ``following`` (the next segment), so a replay does not stall at each
        segment's end for its successor's offset table and first batch, and for a reader of
        whole segments into ``after`` (the one after it). ``replies``: the batch as a
        replies-only span, else as records (two entries of the cache, decision 705)."""
        if replies and self.reply_encoder is None:
            raise ValueError("this cold fetcher has no reply encoder")
        n = self._batch_len(info)
        start = info.base_offset + (offset - info.base_offset) // n * n
        key = (info.key, start, replies)
        with self._lock:
            batch = self._cache.get(key)
            if batch is not None:
                self._cache.move_to_end(key)
                self.hits += 1
            future = self._inflight.get(key) if batch is None else None
        if batch is None:
            if future is None:
                self.misses += 1
                # From a segment's first message: a sequential reader (a replay, a consumer
                # that starts there), given the whole segment with one GET; from anywhere
                # else, a random read, given its batch alone (decision 1220).
                future = self._submit(info, [start], replies, whole=offset == info.base_offset)
                if future is None:
                    with self._lock:
                        batch = self._cache.get(key)  # read ahead meanwhile
                    if batch is None:
                        self.unavailable += 1
                        raise ColdTierUnavailableError(f"{what}: the cold-read queue is full")
            if future is not None:
                batch = self._wait(what, future)
        assert batch is not None
        self._read_ahead(info, start, following, replies)
        if following is not None and after is not None:
            self._read_ahead_whole(info, following, after, replies)
        return batch

    def _read_ahead_whole(
        self, info: SegmentInfo, following: SegmentInfo, after: SegmentInfo, replies: bool
    ) -> None:
        """For a reader in a segment read whole (it came to it sequentially), fetch ``after``
        whole too once ``following`` is fetched or under way, when the cache holds both beside
        the segment being read (decision 1220): one segment ahead makes the replay wait for
        each segment's whole job in turn, since taking a cached segment's replies is quick."""
        with self._lock:
            if (info.key, replies) not in self._read_whole:
                return
            n = self._batch_len(following)
            if not all(
                (following.key, x, replies) in self._cache
                or (following.key, x, replies) in self._inflight
                for x in range(following.base_offset, following.end_offset, n)
            ):
                return
        if self._whole_bytes(info, replies) * 3 <= self.cache_bytes:
            self._submit(after, [after.base_offset], replies, whole=True)

    def _whole_fits(self, info: SegmentInfo, replies: bool) -> bool:
        """Whether ``info`` may be read whole: it has no more batches than the read-ahead keeps
        ahead, and the cache holds it twice (the segment being read and the next)."""
        batches = -(-info.count // self._batch_len(info))
        return (
            batches <= self._ahead_limit(replies)
            and self._whole_bytes(info, replies) * 2 <= self.cache_bytes
        )

    def _whole_bytes(self, info: SegmentInfo, replies: bool) -> int:
        """What the cache holds of ``info`` read whole (its replies a little longer)."""
        return info.offsets_at * 5 // 4 if replies else info.offsets_at

    def _read_ahead(
        self, info: SegmentInfo, start: int, following: SegmentInfo | None, replies: bool
    ) -> None:
        """Fetch the batches after ``start`` that a sequential reader meets next, up to
        ``READ_AHEAD`` of them (fewer when the cache could not hold them), in runs of
        ``GET_BATCHES`` consecutive batches, each run one GET (decision 333). A shorter run
        waits until it can be whole, unless the reader needs its first batch next or it ends
        its segment."""
        # A batch holds its records or their replies, never both (decision 705); a reply is its
        # record re-encoded plus ids, digest, times and hosts, a little longer: half the cache in
        # batches ahead counts that, or the read-ahead evicts its own prefetch.
        limit = self._ahead_limit(replies)
        window = min(GET_BATCHES, limit)
        ahead: list[tuple[SegmentInfo, int]] = []
        segment, nxt, n = info, start, self._batch_len(info)
        for _ in range(limit):
            nxt += n
            if nxt >= segment.end_offset:
                if segment is not info or following is None:
                    break
                segment, nxt, n = following, following.base_offset, self._batch_len(following)
            ahead.append((segment, nxt))
        with self._lock:
            wanted = [
                (s.key, x, replies) not in self._cache and (s.key, x, replies) not in self._inflight
                for s, x in ahead
            ]
        i = 0
        while i < len(ahead):
            if not wanted[i]:
                i += 1
                continue
            segment = ahead[i][0]
            j = i + 1
            while j < len(ahead) and j - i < window and wanted[j] and ahead[j][0] is segment:
                j += 1
            last = ahead[j - 1][1]
            ends_segment = last + self._batch_len(segment) >= segment.end_offset
            # The reader goes on into the next segment: all of it with one GET (decision 1220).
            enters = segment is not info and ahead[i][1] == segment.base_offset
            enters = enters and self._whole_fits(segment, replies)
            if j - i == window or i == 0 or ends_segment or enters:
                run = [x for _, x in ahead[i:j]]
                self._submit(segment, run, replies, whole=enters)  # skipped when full
            i = j

    def _ahead_limit(self, replies: bool) -> int:
        """How many batches the read-ahead keeps ahead of a reader: ``READ_AHEAD``, fewer when
        they would take more than half the cache."""
        # A batch holds its records or their replies, never both (decision 705); a reply is its
        # record re-encoded plus ids, digest, times and hosts, a little longer: half the cache in
        # batches ahead counts that, or the read-ahead evicts its own prefetch.
        per_batch = BATCH_BYTES * 5 // 4 if replies else BATCH_BYTES
        return max(1, min(READ_AHEAD, self.cache_bytes // (2 * per_batch)))

    def _whole_starts(self, info: SegmentInfo, replies: bool) -> list[int] | None:
        """The starts of every batch of ``info``, when one GET of the whole object should fetch
        them (decision 1220): the segment may be read whole (``_whole_fits``: the cache holds
        it in full, so it must hold it twice), and none of its batches is cached or under way
        (a reader that met the segment before, or another one in it, fetches the rest by
        ranges). Else None. Under ``_lock``."""
        if not self._whole_fits(info, replies):
            return None
        starts = list(range(info.base_offset, info.end_offset, self._batch_len(info)))
        if any(
            (info.key, x, replies) in self._cache or (info.key, x, replies) in self._inflight
            for x in starts
        ):
            return None
        return starts

    def _submit(
        self, info: SegmentInfo, starts: list[int], replies: bool, *, whole: bool = False
    ) -> Future[RecordSpan] | None:
        """One fetch of the consecutive batches at ``starts`` (one GET), each joined if already
        in flight; the future of the first. None when ``max_inflight`` fetches are already
        queued (the pool's queue is bounded by this, not by the executor). ``whole``: ``starts``
        begins at the segment's first batch, and the fetch is of every batch of the segment,
        with one GET of the whole object, where ``_whole_starts`` allows it."""
        with self._lock:
            existing = self._inflight.get((info.key, starts[0], replies))
            if existing is not None:
                return existing
            if len(self._inflight) >= self.max_inflight:
                return None
            every = self._whole_starts(info, replies) if whole else None
            if every is not None:
                starts = every
            elif whole and (info.key, starts[0], replies) in self._cache:
                return None  # read ahead already, meanwhile
            futures: list[Future[RecordSpan]] = []
            for start in starts:
                if (info.key, start, replies) in self._inflight:
                    break  # the rest is under way already
                future: Future[RecordSpan] = Future()
                self._inflight[(info.key, start, replies)] = future
                futures.append(future)
            taken = starts[: len(futures)]
            self._pool.submit(self._fetch, info, taken, futures, replies, every is not None)
        return futures[0]

    def _fetch(
        self,
        info: SegmentInfo,
        starts: list[int],
        futures: list[Future[RecordSpan]],
        replies: bool,
        whole: bool = False,
    ) -> None:
        try:
            started = time.perf_counter()
            first = starts[0] - info.base_offset
            n = self._batch_len(info)
            encoder = self.reply_encoder if replies else None
            try:
                if whole:
                    # The table comes with the records, checked in the worker: kept for a
                    # later read of the segment whose batches were evicted meanwhile.
                    table, spans = run_job(
                        self.runner, read_segment, info, n, encoder, not replies, read=True
                    )
                    self._keep_table(info.key, np.frombuffer(table, dtype=CQ_DTYPE))
                    with self._lock:
                        self._read_whole[(info.key, replies)] = None
                        while len(self._read_whole) > 64:
                            self._read_whole.popitem(last=False)
                elif len(starts) == 1 and not replies:
                    entries = self._table(info)[first : first + n]
                    spans = [
                        run_job(self.runner, read_span, info, first, entries.tobytes(), read=True)
                    ]
                else:
                    # A replies-only span for a reader that sends replies: its records stay in
                    # the worker (decision 705); a reader that decodes gets records alone.
                    entries = self._table(info)[first : first + n * len(starts)]
                    counts = [n] * len(starts)
                    spans = run_job(
                        self.runner,
                        read_spans,
                        info,
                        first,
                        entries.tobytes(),
                        counts,
                        encoder,
                        not replies,
                        read=True,
                    )
            except SegmentError:
                # The table may be what was wrong: the next read of the segment fetches it again.
                self._forget_table(info.key)
                raise
            spans = [span.owned() for span in spans]  # as they came when read in this process
            size = sum(span.size for span in spans)
            self.bytes_fetched += size
            if self._observe is not None:
                self._observe(time.perf_counter() - started, size)
            with self._lock:
                for start, span in zip(starts, spans, strict=False):
                    self._cache[(info.key, start, replies)] = span
                    self._cached_bytes += span.nbytes
                while self._cached_bytes > self.cache_bytes and len(self._cache) > 1:
                    _, evicted = self._cache.popitem(last=False)
                    self._cached_bytes -= evicted.nbytes
            for future, span in zip(futures, spans, strict=False):
                future.set_result(span)
            for future in futures[len(spans) :]:
                future.set_exception(SegmentError(f"{info.key}: a batch past the segment's end"))
        except BaseException as e:
            for future in futures:
                if not future.done():
                    future.set_exception(e)
        finally:
            with self._lock:
                for start in starts:
                    self._inflight.pop((info.key, start, replies), None)

    def _table(self, info: SegmentInfo) -> np.ndarray:
        """The segment's offset table, from the cache or with one request (kept within a
        quarter of ``cache_bytes``, least recently used out first)."""
        with self._lock:
            table = self._tables.get(info.key)
            if table is not None:
                self._tables.move_to_end(info.key)
                return table
        with self._lock:
            loading = self._table_loads.setdefault(info.key, threading.Lock())
        with loading:  # one request per table, however many fetches of the segment start at once
            with self._lock:
                table = self._tables.get(info.key)
            if table is None:
                table = np.frombuffer(
                    run_job(self.runner, read_offset_table, info, read=True), dtype=CQ_DTYPE
                )
                # Never cache wrong bytes: every read would use them.
                check_offset_table(info, table)
                self._keep_table(info.key, table)
        with self._lock:
            self._table_loads.pop(info.key, None)
        return table

    def _keep_table(self, key: str, table: np.ndarray) -> None:
        """Cache a checked offset table (within a quarter of ``cache_bytes``)."""
        with self._lock:
            old = self._tables.pop(key, None)
            if old is not None:
                self._table_bytes -= old.nbytes
            self._tables[key] = table
            self._table_bytes += table.nbytes
            while self._table_bytes > self.cache_bytes // 4 and len(self._tables) > 1:
                _, evicted = self._tables.popitem(last=False)
                self._table_bytes -= evicted.nbytes

    def _forget_table(self, key: str) -> None:
        with self._lock:
            table = self._tables.pop(key, None)
            if table is not None:
                self._table_bytes -= table.nbytes

    def offset_for_timestamp(self, topic: str, queue_id: int, timestamp_ms: int) -> int:
        def work() -> int:
            manifest = self.manifest(topic, queue_id)
            for info in manifest.segments:
                if info.max_store_timestamp >= timestamp_ms:
                    return SegmentReader(self.tier, info).offset_for_timestamp(timestamp_ms)
            return manifest.end_offset

        return self._within_deadline(f"{topic}/{queue_id} time {timestamp_ms}", work)

    def query_by_key(
        self, topic: str, queue_id: int, key: str, begin_ms: int, end_ms: int, limit: int
    ) -> list[StoredMessage]:
        return self._within_deadline(
            f"{topic}/{queue_id} key {key!r}",
            lambda: self._query_by_key(topic, queue_id, key, begin_ms, end_ms, limit),
        )

    def _query_by_key(
        self, topic: str, queue_id: int, key: str, begin_ms: int, end_ms: int, limit: int
    ) -> list[StoredMessage]:
        found: list[StoredMessage] = []
        # Not the archive's messages at offsets the local log holds others at (decision 750),
        # nor any of a prefix another data directory wrote (``local_from`` 0, decision 751).
        local_from = self.local_from(topic, queue_id)
        for info in reversed(self.manifest(topic, queue_id).segments):
            if info.max_store_timestamp < begin_ms or info.min_store_timestamp > end_ms:
                continue
            if local_from is not None and info.base_offset >= local_from:
                continue
            reader = SegmentReader(self.tier, info)
            for offset in reversed(reader.offsets_for_key(topic, key)):
                if local_from is not None and offset >= local_from:
                    continue
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
