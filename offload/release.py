"""When may a hot CommitLog file be deleted?

A file may go only when, for every (topic, queue) with records in it:

- the topic is tiered, every one of those records is below the queue's tier watermark (uploaded,
  verified and committed), and the file is older than the topic's local retention; or
- the topic is not tiered and the file is older than its retention (RocketMQ's
  ``fileReservedTime`` rule, 72 h by default).

Never a record that is neither uploaded nor expired: this is the invariant RocketMQ's tieredstore
broke (local data deleted before upload), checked here with the ConsumeQueues, not the clock.
The rule fails closed: a ConsumeQueue entry that cannot be read, or a tier watermark that
cannot be learnt (the tier is down and the manifest was never loaded), keeps the file.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping

from broker.metadata import TopicConfig
from offload.offloader import Offloader
from tiered.hot.consume_queue import ConsumeQueue
from tiered.store import CommitLogFileInfo, MessageStore

log = logging.getLogger(__name__)

DEFAULT_FILE_RESERVED_MS = 72 * 3_600_000


class UnreadableEntryError(Exception):
    """A ConsumeQueue entry between the queue's minimum and maximum could not be read."""


def first_offset_at_or_after(cq: ConsumeQueue, commitlog_offset: int) -> int:
    """The first queue offset whose record starts at or after ``commitlog_offset``. Raises
    ``UnreadableEntryError`` rather than guess past an entry it cannot read."""
    lo, hi = cq.min_offset, cq.max_offset
    while lo < hi:
        mid = (lo + hi) // 2
        entry = cq.get_entry(mid)
        if entry is None:
            raise UnreadableEntryError(f"queue offset {mid}")
        if entry[0] < commitlog_offset:
            lo = mid + 1
        else:
            hi = mid
    return lo


def release_predicate(
    store: MessageStore,
    offloader: Offloader | None,
    topics: Mapping[str, TopicConfig],
    default_reserved_ms: int = DEFAULT_FILE_RESERVED_MS,
    now_ms: Callable[[], int] = lambda: time.time_ns() // 1_000_000,
) -> Callable[[CommitLogFileInfo], bool]:
    def can_release(info: CommitLogFileInfo) -> bool:
        age = now_ms() - info.modified_ms
        for (topic, queue_id), cq in list(store.queues.queues.items()):
            try:
                first_in = first_offset_at_or_after(cq, info.from_offset)
                if first_in >= cq.max_offset:
                    continue
                entry = cq.get_entry(first_in)
                if entry is None:
                    raise UnreadableEntryError(f"queue offset {first_in}")
                if entry[0] >= info.end_offset:
                    continue  # no record of this queue in the file
                last_in = first_offset_at_or_after(cq, info.end_offset) - 1
            except UnreadableEntryError as e:
                log.error(
                    "%s: kept: the ConsumeQueue of %s/%d cannot be read at %s",
                    info.path.name,
                    topic,
                    queue_id,
                    e,
                )
                return False
            cfg = topics.get(topic)
            if cfg is not None and cfg.tiered:
                if offloader is None:
                    return False
                try:
                    watermark = offloader.watermark(topic, queue_id)
                except Exception as e:  # the tier is down and the manifest was never loaded
                    log.warning(
                        "%s: kept: no tier watermark for %s/%d: %s",
                        info.path.name,
                        topic,
                        queue_id,
                        e,
                    )
                    return False
                if watermark <= last_in:
                    return False  # not uploaded yet
                if age < (cfg.local_retention_ms or 0):
                    return False
            else:
                reserved = cfg.retention_ms if cfg and cfg.retention_ms else default_reserved_ms
                if age < reserved:
                    return False
        return True

    return can_release
