"""The dispatcher (RocketMQ's ReputMessageService): CommitLog -> ConsumeQueue and IndexFile.

It follows the CommitLog from ``reput_offset`` up to the confirmed offset (every appended byte
under ASYNC flush, every fsynced byte under SYNC) and, per record, appends a ConsumeQueue entry
and IndexFile entries for the record's keys and unique id.

Two sources feed one path (``apply``):

- the append path hands over each appended chunk (``EncodedBatch``) with the fields dispatch
  needs, so the hot path never re-reads what it has just written;
- anything else (start-up recovery, or chunks dropped because dispatch fell far behind) is parsed
  from the CommitLog into the same shape.

Re-dispatching a record is harmless: a ConsumeQueue ignores queue offsets it already holds, and
records below ``index_from`` (already indexed) are not indexed again.

Threads: one dispatcher thread owns every write to ConsumeQueues and IndexFiles. Start-up
recovery and shutdown call ``dispatch`` directly while that thread is not running.
"""

from __future__ import annotations

import logging
import threading
import time
from array import array
from collections import deque
from collections.abc import Callable, Iterator

import numpy as np

from tiered import failpoints, fd_limit
from tiered.formats import CQ_DTYPE
from tiered.hot.commitlog import CommitLog
from tiered.hot.consume_queue import ConsumeQueueTable
from tiered.hot.group_commit import Wakeup, new_wakeup
from tiered.hot.index_file import IndexFile, IndexService
from tiered.record import (
    DispatchColumns,
    EncodedBatch,
    dispatch_columns,
    dispatch_pass,
    index_keys,
    read_dispatch_run,
)

log = logging.getLogger(__name__)

# CommitLog bytes parsed per step when reading from the file (recovery, catch-up).
_PARSE_BYTES = 4 << 20
# Appended chunks waiting for dispatch are dropped past this many bytes; dispatch then reads
# those records back from the CommitLog instead, so memory stays bounded when it falls behind.
_PENDING_LIMIT_BYTES = 64 << 20
# Below this much pending, a woken dispatcher waits 1 ms for more before a pass.
_COALESCE_BYTES = 256 << 10
# CommitLog bytes read per step as columns (dispatch from the file: restart, catch-up).
_COLUMNS_BYTES = 64 << 20


def _by_queue(numbers: np.ndarray, queues: int) -> list[tuple[int, np.ndarray]]:
    """(queue number, positions of its records in order) for every queue in ``numbers``."""
    if queues <= 16:  # a few queues: one comparison pass each beats a sort
        found = [(q, np.flatnonzero(numbers == q)) for q in range(queues)]
        return [(q, idx) for q, idx in found if len(idx)]
    order = np.argsort(numbers, kind="stable")
    ordered = numbers[order]
    bounds = np.flatnonzero(ordered[1:] != ordered[:-1]) + 1
    return [
        (int(ordered[lo]), order[lo:hi])
        for lo, hi in zip([0, *bounds.tolist()], [*bounds.tolist(), len(numbers)], strict=True)
    ]


_NEVER = -1e18


class Dispatcher:
    def __init__(
        self,
        commitlog: CommitLog,
        queues: ConsumeQueueTable,
        index: IndexService,
        *,
        reput_offset: int,
        index_from: int,
    ) -> None:
        self.commitlog = commitlog
        self.queues = queues
        self.index = index
        self.reput_offset = reput_offset
        self.index_from = index_from
        self.logics_timestamp = 0
        # Topics whose records get no IndexFile entries: the broker's bookkeeping topics
        # (half messages, transaction ops, timer records), which nobody looks up by key.
        self.unindexed_topics: frozenset[str] = frozenset()
        self._pending: deque[EncodedBatch] = deque()
        # Bytes of the chunks submitted and of those popped: each has one writer (``submit``,
        # under the put lock, and ``_pop``, the one thread that dispatches), so neither needs a
        # lock (the deque's ``append`` and ``popleft`` are atomic); their difference is what
        # waits. ``submit`` runs once per single SYNC send (decision 940).
        self._submitted_bytes = 0
        self._popped_bytes = 0
        self._tag_codes: dict[str | None, int] = {None: 0}
        # Runs of records the recovery scan read as columns, by CommitLog offset of their first
        # record: dispatch takes them instead of reading those bytes again (``preload``).
        self._preloaded: dict[int, DispatchColumns] = {}
        # How long a woken dispatcher waits for more appends before a pass (while less than
        # ``_COALESCE_BYTES`` wait): a pass has a fixed cost of about 200 us, so this sets how
        # many records share it. A SYNC-replicating master raises it (decision 370).
        self.coalesce_s = 0.001
        # Set by producers (ASYNC) and by the group commit's flusher (SYNC, without the GIL).
        self._wakeup = new_wakeup()
        self._progress = threading.Condition()
        self._stop = threading.Event()
        # When the last "out of file descriptors" line was logged (monotonic), or _NEVER.
        self._out_of_fds_logged = _NEVER
        # Why dispatch cannot proceed (descriptors ran out), or None: while set the store
        # refuses sends (decision 1070). Cleared by the next pass that gets through.
        self.stuck: str | None = None
        self._thread: threading.Thread | None = None

    # -- intake --------------------------------------------------------------------------------

    def submit(self, batch: EncodedBatch) -> None:
        """Take an appended chunk (called under the CommitLog's put lock, in order)."""
        nbytes = batch.offsets[-1] + batch.sizes[-1] - batch.offsets[0]
        submitted = self._submitted_bytes + nbytes
        # A stale ``_popped_bytes`` only overstates what waits: a chunk dropped early.
        if submitted - self._popped_bytes > _PENDING_LIMIT_BYTES:
            return  # dispatch will parse these records from the CommitLog
        self._pending.append(batch)
        self._submitted_bytes = submitted

    @property
    def _pending_bytes(self) -> int:
        return self._submitted_bytes - self._popped_bytes

    def dispatch(self, end: int) -> int:
        """Dispatch every record from ``reput_offset`` up to ``end``; returns the new offset."""
        while True:
            reput = self.commitlog.skip_blank(self.reput_offset)
            if reput != self.reput_offset:
                self._publish(min(reput, end), self.logics_timestamp)
            if reput >= end:
                return self.reput_offset
            batch = self._pending[0] if self._pending else None
            if batch is not None:
                start = batch.offsets[0]
                batch_end = batch.end_offset
                if batch_end <= reput or start < reput:
                    self._pop()  # already dispatched from the file
                    continue
                if start == reput:
                    if batch_end > end:
                        return self.reput_offset  # not confirmed yet (SYNC: not fsynced)
                    merged = self._take_consecutive(end)
                    self.apply(merged)
                    self._publish(merged.end_offset, merged.store_timestamp)
                    continue
                end_here = min(end, start)
            else:
                end_here = end
            columns = self._read_columns(reput, end_here)
            if columns is not None:
                self.apply_columns(columns)
                self._publish(columns.end_offset, int(columns.store_timestamps.max()))
                continue
            parsed = self._parse(reput, end_here)
            if parsed is None:
                return self.reput_offset
            self.apply(parsed)
            self._publish(parsed.end_offset, parsed.store_timestamp)

    def _take_consecutive(self, end: int) -> EncodedBatch:
        """Pop the head chunk and every confirmed chunk that follows it without a gap, as one:
        many small appends then cost one ``apply``."""
        merged = self._pending[0]
        self._pop()
        if not self._pending:
            return merged
        # The integer columns are int64 arrays, as the native encoder gives them (decision
        # 600): extending one by another is a copy of bytes, not of int objects.
        out = EncodedBatch(
            offsets=array("q"),
            sizes=array("q"),
            queue_offsets=array("q"),
            store_timestamp=merged.store_timestamp,
        )
        stamps = array("q")
        chunk: EncodedBatch | None = merged
        while chunk is not None:
            out.offsets.extend(chunk.offsets)
            out.sizes.extend(chunk.sizes)
            out.queue_offsets.extend(chunk.queue_offsets)
            out.queues += chunk.queues
            out.tags += chunk.tags
            out.keys += chunk.keys
            out.uniq_keys += chunk.uniq_keys
            if chunk.store_timestamps:
                stamps.extend(chunk.store_timestamps)
            else:
                stamps.extend(array("q", (chunk.store_timestamp,)) * len(chunk.offsets))
            out.store_timestamp = max(out.store_timestamp, chunk.store_timestamp)
            following = self._pending[0] if self._pending else None
            if (
                following is None
                or following.end_offset > end
                or len(out.offsets) >= 65536
                # Single sends' chunks abut: the BLANK check reads the file only at a gap.
                or (
                    following.offsets[0] != chunk.end_offset
                    and following.offsets[0] != self.commitlog.skip_blank(chunk.end_offset)
                )
            ):
                break
            self._pop()
            chunk = following
        out.store_timestamps = stamps
        return out

    def _pop(self) -> None:
        batch = self._pending.popleft()
        self._popped_bytes += batch.offsets[-1] + batch.sizes[-1] - batch.offsets[0]

    def _parse(self, start: int, end: int) -> EncodedBatch | None:
        """Read the records in CommitLog ``[start, end)`` (up to a step's worth)."""
        out = EncodedBatch()
        stamps: list[int] = []
        offset = start
        limit = min(end, start + _PARSE_BYTES)
        while offset < limit:
            f = self.commitlog.files.find_file(offset)
            if f is None:
                break
            pos = offset - f.from_offset
            stop = read_dispatch_run(
                f.mm, pos, min(f.wrote, limit - f.from_offset), f.from_offset, out, stamps
            )
            offset = self.commitlog.skip_blank(f.from_offset + stop)
            if offset == f.from_offset + stop:
                break  # not a BLANK: the end of what is written
        if not out.offsets:
            return None
        out.store_timestamp = max(stamps)
        out.store_timestamps = stamps
        return out

    def records(
        self, start: int, end: int
    ) -> Iterator[tuple[tuple[str, int], int, int, int, str | None]]:
        """((topic, queue id), queue offset, CommitLog offset, size, tag) of every record in
        CommitLog ``[start, end)`` (``start`` a record boundary), read from the file."""
        offset = self.commitlog.skip_blank(start)
        while offset < end:
            batch = self._parse(offset, end)
            if batch is None:
                return
            yield from zip(
                batch.queues,
                batch.queue_offsets,
                batch.offsets,
                batch.sizes,
                batch.tags,
                strict=True,
            )
            offset = self.commitlog.skip_blank(batch.end_offset)

    def key_offsets(self, start: int, end: int, khash: int) -> list[int]:
        """CommitLog offsets of the records in ``[start, end)`` (``start`` a record boundary)
        with an IndexFile entry of hash ``khash``, read from the file: what a damaged IndexFile
        would have answered (decision 687). Touches no dispatch state: any thread may call it."""
        out: list[int] = []
        offset = self.commitlog.skip_blank(start)
        while offset < end:
            batch = self._parse(offset, end)
            if batch is None:
                break
            hashes, numbers = index_keys(batch.queues, batch.keys, batch.uniq_keys)
            offsets = np.asarray(batch.offsets, np.int64)[numbers]
            out += offsets[hashes == khash].tolist()
            offset = self.commitlog.skip_blank(batch.end_offset)
        return out

    def preload(self, runs: list[DispatchColumns]) -> None:
        """Take runs the recovery scan already read as columns (``CommitLog.recover``), so that
        dispatch does not read those bytes again; ``preload([])`` drops what is left."""
        self._preloaded = {int(r.offsets[0]): r for r in runs if len(r)}

    def _read_columns(self, start: int, end: int) -> DispatchColumns | None:
        """The records in CommitLog ``[start, end)`` from ``start`` up to a step's worth (within
        one file) as columns: a preloaded run, else read from the file. None where a record
        cannot be taken as columns (``_parse`` then reads it, or says why it cannot)."""
        run = self._preloaded.pop(start, None)
        if run is not None:
            stop = int(np.searchsorted(run.offsets, end, "left"))
            if stop < len(run):
                self._preloaded[int(run.offsets[stop])] = run.take(stop, len(run))
                run = run.take(0, stop)
            return run if len(run) else None
        f = self.commitlog.files.find_file(start)
        if f is None:
            return None
        pos = start - f.from_offset
        limit = min(f.wrote, end - f.from_offset, pos + _COLUMNS_BYTES)
        _, _, run = dispatch_columns(f.mm, pos, limit, f.from_offset, validate=False)
        return run if len(run) else None

    def apply_columns(self, run: DispatchColumns) -> None:
        """``apply`` for a run read as columns: the same ConsumeQueue and IndexFile bytes, with
        Python loops only over queues (and over runs of queue offsets with a gap)."""
        if not self._holds_all(run):
            self._queue_columns(run)
        self._index_columns(run)

    def _holds_all(self, run: DispatchColumns) -> bool:
        """Whether every queue of ``run`` already holds an entry at or past each of its queue
        offsets: a re-dispatch after kill -9 of what was dispatched before it, the usual
        restart. One pass for the highest queue offset of each queue instead of splitting the
        run by queue (decision 930); a queue that does not exist yet means there is work."""
        if not len(run.queues):
            return True
        highest = np.full(len(run.queues), -1, np.int64)
        np.maximum.at(highest, run.queue_numbers, run.queue_offsets)
        for (topic, queue_id), top in zip(run.queues, highest.tolist(), strict=True):
            cq = self.queues.get(topic, queue_id)
            if cq is None or top >= cq.max_offset:
                return False
        return True

    def _queue_columns(self, run: DispatchColumns) -> None:
        for number, idx in _by_queue(run.queue_numbers, len(run.queues)):
            topic, queue_id = run.queues[number]
            cq = self.queues.get_or_create(topic, queue_id)
            qoffs = run.queue_offsets[idx]
            if int(qoffs.max()) < cq.max_offset:
                continue  # every entry held already (a re-dispatch): nothing to build
            # Consecutive queue offsets go in one block (entry by entry is the same bytes).
            breaks = np.flatnonzero(qoffs[1:] != qoffs[:-1] + 1) + 1
            for a, b in zip([0, *breaks.tolist()], [*breaks.tolist(), len(idx)], strict=True):
                first_q = int(qoffs[a])
                if first_q + (b - a) <= cq.max_offset:
                    continue
                part = idx[a:b]
                block = np.empty(b - a, CQ_DTYPE)
                block["offset"] = run.offsets[part]
                block["size"] = run.sizes[part]
                block["tag"] = run.tags[part]
                last = int(part[-1])
                cq.put_block(first_q, block.tobytes(), int(run.offsets[last] + run.sizes[last]))

    def _index_columns(self, run: DispatchColumns) -> None:
        index_from = self.index_from
        end = run.end_offset
        if end <= index_from:
            return
        # Records are in CommitLog order and keys in record order: those at or past
        # ``index_from`` are a suffix of both.
        first_key = int(
            np.searchsorted(run.key_records, np.searchsorted(run.offsets, index_from), "left")
        )
        hashes, numbers = run.key_hashes[first_key:], run.key_records[first_key:]
        offsets = run.offsets[numbers]
        keep = np.ones(len(numbers), bool)
        if self.unindexed_topics:
            skip = self.unindexed_topics
            unindexed = np.array([q[0] in skip for q in run.queues], bool)
            keep &= ~unindexed[run.queue_numbers[numbers]]
        if not keep.all():
            hashes, numbers, offsets = hashes[keep], numbers[keep], offsets[keep]
        self._put_index_entries(
            self.index.writer_at,
            hashes,
            offsets,
            run.store_timestamps[numbers],
            int(run.store_timestamps.max()),
            max(int(run.offsets[0]), index_from),
            end,
        )

    # -- applying a chunk ----------------------------------------------------------------------

    def apply(self, batch: EncodedBatch) -> None:
        """Write the ConsumeQueue and IndexFile entries for every record in ``batch``.

        One call of the record engine (``dispatch_pass``; natively, decision 695): every
        entry packed, each queue's run copied into its tail file's mapping and the IndexFile
        entries put without the GIL. Python runs only where a file must be created (a
        ConsumeQueue's first or next file: ``put_block``; an IndexFile roll: ``_put_index``),
        or a run is not its queue's next entries (a re-dispatch, a gap).
        """
        dispatch_pass(
            batch,
            self._tag_codes,
            self.queues,
            self.index_from,
            self.unindexed_topics,
            self.index,
            self._put_index,
        )

    def _put_index(
        self,
        hashes: np.ndarray,
        offsets: np.ndarray,
        stamps: np.ndarray | None,
        store_ts: int,
        begin: int,
        end: int,
    ) -> None:
        self._put_index_entries(self.index.writer_at, hashes, offsets, stamps, store_ts, begin, end)

    @staticmethod
    def _put_index_entries(
        writer_at: Callable[[int, int], IndexFile],
        hashes: np.ndarray,
        offsets: np.ndarray,
        stamps: np.ndarray | None,
        store_ts: int,
        begin: int,
        end: int,
    ) -> list[IndexFile]:
        """Add entries to ``writer_at``'s files in CommitLog order; returns the files used.

        A file rolls only between records: its range ``[begin, end)`` then holds exactly the
        records whose entries it has, which is what lets a lost file be rebuilt from its range.
        """
        n = len(hashes)
        o = np.asarray(offsets, np.int64)
        h = np.asarray(hashes, np.int64)
        t = np.asarray(stamps, np.int64) if stamps is not None else np.full(n, store_ts, np.int64)
        # Entries come in CommitLog order from every caller but a hand-built one: a stable sort
        # of sorted offsets is the identity, so it runs only when they are not (decision 601).
        if n > 1 and not bool((o[1:] >= o[:-1]).all()):
            order = np.argsort(o, kind="stable")
            o, h, t = o[order], h[order], t[order]
        used = [writer_at(begin, 1)]
        done = 0
        while done < n:
            writer = used[-1]
            take = min(n - done, writer.space)
            if take < n - done and o[done + take] == o[done + take - 1]:
                take = int(np.searchsorted(o, o[done + take - 1], "left")) - done
            if take <= 0 and writer.header.next_entry > 1:
                record_entries = int(np.searchsorted(o, o[done], "right")) - done
                writer.advance(int(o[done]), int(t[done - 1]) if done else store_ts)
                used.append(writer_at(int(o[done]), record_entries))
                continue
            take = max(take, min(n - done, writer.space))  # one record with more keys than a file
            writer.put_many(h[done : done + take], o[done : done + take], t[done : done + take])
            done += take
        used[-1].advance(end, int(t.max()) if n else store_ts)
        return used

    def rebuild_index(self, start: int, end: int) -> None:
        """Index CommitLog ``[start, end)`` into new files (a deleted or damaged IndexFile)."""
        built: list[IndexFile] = []
        offset = start

        def new_writer(begin: int, need: int) -> IndexFile:
            if built and built[-1].space >= need:
                return built[-1]
            built.append(self.index.new_file(begin))
            return built[-1]

        while offset < end:
            batch = self._parse(offset, end)
            if batch is None:
                break
            hashes, numbers = index_keys(batch.queues, batch.keys, batch.uniq_keys)
            batch_end = batch.end_offset
            stamps = batch.store_timestamps or []
            self._put_index_entries(
                new_writer,
                hashes,
                np.asarray(batch.offsets, np.int64)[numbers],
                np.asarray(stamps, np.int64)[numbers],
                batch.store_timestamp,
                batch.offsets[0],
                batch_end,
            )
            offset = self.commitlog.skip_blank(batch_end)
        for w in built:
            w.flush()
        self.index.insert_rebuilt(built)
        log.warning(
            "IndexFile: rebuilt CommitLog range [%d, %d) into %d file(s)", start, end, len(built)
        )

    # -- progress ------------------------------------------------------------------------------

    def _publish(self, offset: int, store_ts: int) -> None:
        with self._progress:
            self.reput_offset = offset
            self.logics_timestamp = store_ts
            self._progress.notify_all()

    def wait_for(self, offset: int, timeout: float) -> bool:
        """Block until everything below ``offset`` is dispatched; False on timeout."""
        with self._progress:
            return self._progress.wait_for(lambda: self.reput_offset >= offset, timeout)

    # -- the thread ----------------------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="tmq-dispatcher", daemon=True)
        self._thread.start()

    def wakeup(self) -> None:
        self._wakeup.set()

    @property
    def wakeup_event(self) -> Wakeup:
        """What ``wakeup`` sets, for a flusher to set directly."""
        return self._wakeup

    def _run(self) -> None:
        while not self._stop.is_set():
            end = self.commitlog.confirmed_offset
            if self.reput_offset < end:
                failpoints.hit("dispatch.before_pass")
                try:
                    before = self.reput_offset
                    self.dispatch(end)
                    self.stuck = None
                    if self._out_of_fds_logged > _NEVER:
                        self._out_of_fds_logged = _NEVER
                        log.warning(
                            "dispatch resumed: file descriptors are free again (CommitLog "
                            "offset %d)",
                            self.reput_offset,
                        )
                    if self.reput_offset > before:
                        continue
                except Exception as e:
                    # Never die silently: the store would stop serving new messages.
                    if fd_limit.exhausted(e):
                        self.stuck = fd_limit.describe()
                        # One line a minute, not a traceback a second: the log shares the disk.
                        now = time.monotonic()
                        if now - self._out_of_fds_logged >= 60:
                            self._out_of_fds_logged = now
                            log.error(
                                "%s. Messages from CommitLog offset %d on are stored and "
                                "acknowledged but not yet in their queues (not delivered); "
                                "new sends are refused until dispatch resumes, by itself once "
                                "descriptors are free",
                                self.stuck,
                                self.reput_offset,
                            )
                    else:
                        log.exception(
                            "dispatcher failed at CommitLog offset %d; retrying",
                            self.reput_offset,
                        )
                    self._stop.wait(1.0)
                    continue
            if self._wakeup.wait(0.05) and self._pending_bytes < _COALESCE_BYTES:
                # Like RocketMQ's 1 ms reput cadence: let small appends gather into one pass.
                self._stop.wait(self.coalesce_s)
            self._wakeup.clear()

    def stop(self) -> None:
        self._stop.set()
        self._wakeup.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
