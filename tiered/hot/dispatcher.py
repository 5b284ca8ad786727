"""The dispatcher (RocketMQ's ReputMessageService): CommitLog -> ConsumeQueue and IndexFile.

It follows the CommitLog from ``reput_offset`` up to the confirmed offset (every appended byte
under ASYNC flush, every fsynced byte under SYNC) and, per record, appends a ConsumeQueue entry
and IndexFile entries for the record's keys and unique id. Re-dispatching a record is harmless:
the ConsumeQueue ignores queue offsets it already holds, and the IndexFile is skipped below the
offset it has already seen.

Threads: one dispatcher thread owns every write to ConsumeQueues and IndexFiles. Start-up
recovery calls ``dispatch`` directly before that thread starts.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from tiered.hot.commitlog import CommitLog
from tiered.hot.consume_queue import ConsumeQueueStore
from tiered.hot.index_file import IndexFile, IndexService, key_hash
from tiered.record import (
    KEY_SEPARATOR,
    PROPERTY_KEYS,
    PROPERTY_TAGS,
    PROPERTY_UNIQ_KEY,
    read_dispatch_fields,
    tag_hash,
)

log = logging.getLogger(__name__)

# How many CommitLog bytes one pass dispatches before publishing progress to readers.
_BATCH_BYTES = 4 << 20


class Dispatcher:
    def __init__(self, commitlog: CommitLog, queues: ConsumeQueueStore, index: IndexService,
                 *, reput_offset: int, index_from: int) -> None:  # fmt: skip
        self.commitlog = commitlog
        self.queues = queues
        self.index = index
        self.reput_offset = reput_offset
        self.index_from = index_from
        self.logics_timestamp = 0
        self._wakeup = threading.Event()
        self._progress = threading.Condition()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.listeners: list[Callable[[int], None]] = []

    # -- the dispatch loop ---------------------------------------------------------------------

    def dispatch(self, end: int) -> int:
        """Dispatch every record from ``reput_offset`` up to ``end``; returns the new offset."""
        get_cq = self.queues.get_or_create
        index = self.index
        index_from = self.index_from
        offset = self.reput_offset
        last_ts = self.logics_timestamp
        writer: IndexFile | None = None
        for f, pos, total in self.commitlog.iter_records(offset, end):
            phys = f.from_offset + pos
            _, topic, queue_id, queue_offset, store_ts, props = read_dispatch_fields(f.mm, pos)
            get_cq(topic, queue_id).put(queue_offset, phys, total, tag_hash(props.get(PROPERTY_TAGS)))
            if phys >= index_from:
                if writer is None or writer.full:
                    writer = index.writer_at(phys)
                keys = props.get(PROPERTY_KEYS)
                if keys:
                    for key in keys.split(KEY_SEPARATOR):
                        if key:
                            writer.put(key_hash(topic, key), phys, store_ts)
                            if writer.full:
                                writer = index.writer_at(phys)
                uniq = props.get(PROPERTY_UNIQ_KEY)
                if uniq:
                    writer.put(key_hash(topic, uniq), phys, store_ts)
                writer.advance(phys + total, store_ts)
            last_ts = store_ts
            offset = phys + total
            if offset - self.reput_offset >= _BATCH_BYTES:
                self._publish(offset, last_ts)
        # A file's BLANK padding carries the offset on to the next file's start.
        self._publish(min(end, self.commitlog.skip_blank(offset)), last_ts)
        return self.reput_offset

    def _publish(self, offset: int, store_ts: int) -> None:
        with self._progress:
            self.reput_offset = offset
            self.logics_timestamp = store_ts
            self._progress.notify_all()
        for listener in self.listeners:
            listener(offset)

    def rebuild_index(self, start: int, end: int) -> None:
        """Index CommitLog ``[start, end)`` into new files (a deleted or damaged IndexFile)."""
        built: list[IndexFile] = []
        writer: IndexFile | None = None
        for f, pos, total in self.commitlog.iter_records(start, end):
            phys = f.from_offset + pos
            _, topic, _, _, store_ts, props = read_dispatch_fields(f.mm, pos)
            if writer is None or writer.full:
                writer = self.index.new_file(phys)
                built.append(writer)
            keys = [k for k in (props.get(PROPERTY_KEYS) or "").split(KEY_SEPARATOR) if k]
            uniq = props.get(PROPERTY_UNIQ_KEY)
            for key in [*keys, uniq] if uniq else keys:
                if writer.full:
                    writer.advance(phys, store_ts)
                    writer = self.index.new_file(phys)
                    built.append(writer)
                writer.put(key_hash(topic, key), phys, store_ts)
            writer.advance(phys + total, store_ts)
        for w in built:
            w.flush()
        self.index.insert_rebuilt(built)
        log.warning("IndexFile: rebuilt CommitLog range [%d, %d) into %d file(s)",
                    start, end, len(built))  # fmt: skip

    # -- the thread ----------------------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="tmq-dispatcher", daemon=True)
        self._thread.start()

    def wakeup(self) -> None:
        self._wakeup.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            end = self.commitlog.confirmed_offset
            if self.reput_offset < end:
                try:
                    self.dispatch(end)
                except Exception:
                    # Never die silently: the store would stop serving new messages.
                    log.exception("dispatcher failed at CommitLog offset %d; retrying",
                                  self.reput_offset)  # fmt: skip
                    self._stop.wait(1.0)
                continue
            self._wakeup.wait(0.05)
            self._wakeup.clear()

    def stop(self) -> None:
        self._stop.set()
        self._wakeup.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def wait_for(self, offset: int, timeout: float) -> bool:
        """Block until everything below ``offset`` is dispatched; False on timeout."""
        with self._progress:
            return self._progress.wait_for(lambda: self.reput_offset >= offset, timeout)
