"""When may a hot CommitLog file be deleted?

A file may go only when, for every (topic, queue) with records in it:

- the topic is tiered, every one of those records is below the queue's tier watermark (uploaded,
  verified and committed), and the file is older than the topic's local retention; or
- the topic is not tiered and the file is older than its retention (RocketMQ's
  ``fileReservedTime`` rule, 72 h by default).

Records of ``pinned_topics`` (the timer and transaction system topics) never hold a file back:
the broker pins the files their undelivered or undecided records need (``release_commitlog_files``
is given a pin), and once delivered or decided they are copies of nothing anybody reads.

Never a record that is neither uploaded nor expired: this is the invariant RocketMQ's tieredstore
broke (local data deleted before upload), checked here with the ConsumeQueues, not the clock.
The rule fails closed: a ConsumeQueue entry that cannot be read, or a tier watermark that
cannot be learnt (the tier is down and the manifest was never loaded, or this broker was fenced
as a deposed master), keeps the file. On a slave the watermark is the one its master committed
(the broker refreshes it from the tier each pass), so a slave promoted later still holds
everything the tier does not.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from typing import Protocol

from offload.offloader import Offloader
from tiered.store import CommitLogFileInfo, MessageStore, UnreadableEntryError

log = logging.getLogger(__name__)

DEFAULT_FILE_RESERVED_MS = 72 * 3_600_000


class TopicRetention(Protocol):
    """What release needs to know of a topic (the broker's ``TopicConfig`` is one; None or 0:
    no limit set): offload sits below the broker and never imports it."""

    @property
    def tiered(self) -> bool: ...
    @property
    def retention_ms(self) -> int | None: ...
    @property
    def local_retention_ms(self) -> int | None: ...


def release_predicate(
    store: MessageStore,
    offloader: Offloader | None,
    topics: Mapping[str, TopicRetention],
    default_reserved_ms: int = DEFAULT_FILE_RESERVED_MS,
    now_ms: Callable[[], int] = lambda: time.time_ns() // 1_000_000,
    pinned_topics: frozenset[str] = frozenset(),
) -> Callable[[CommitLogFileInfo], bool]:
    def can_release(info: CommitLogFileInfo) -> bool:
        age = now_ms() - info.modified_ms
        try:
            spans = store.queues_in_file(info)
        except UnreadableEntryError as e:
            log.error(
                "%s: kept: the ConsumeQueue of %s/%d cannot be read at queue offset %d",
                info.path.name,
                e.topic,
                e.queue_id,
                e.offset,
            )
            return False
        for span in spans:
            if span.topic in pinned_topics:
                continue
            cfg = topics.get(span.topic)
            if cfg is not None and cfg.tiered:
                if offloader is None:
                    return False
                try:
                    watermark = offloader.release_watermark(span.topic, span.queue_id)
                except Exception as e:  # the tier is down and the manifest was never
                    # loaded, or this broker is fenced (a deposed master)
                    log.warning(
                        "%s: kept: no tier watermark for %s/%d: %s",
                        info.path.name,
                        span.topic,
                        span.queue_id,
                        e,
                    )
                    return False
                if watermark <= span.last:
                    return False  # not uploaded yet
                if age < (cfg.local_retention_ms or 0):
                    return False
            else:
                reserved = cfg.retention_ms if cfg and cfg.retention_ms else default_reserved_ms
                if age < reserved:
                    return False
        return True

    return can_release
