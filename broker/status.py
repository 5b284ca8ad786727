"""One snapshot of a broker's storage state: what ``tmq status`` and the metrics endpoint report.

Everything here is read from memory and the local disk at the time of the call: the CommitLog's
offsets, ConsumeQueues, and the offloader's cached manifests. Nothing calls the object store, so
a scrape or a status request never waits on S3, and a slow or unreachable tier shows up as
growing lag rather than as a hung endpoint.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from broker.metadata import BrokerMetadata
from offload.offloader import Offloader, UploadLag
from tiered.store import MessageStore

log = logging.getLogger(__name__)

# The lakehouse export's freshness per topic, in seconds; given to the Broker by whoever runs
# the export (None: nothing to report).
ExportFreshness = Callable[[], dict[str, float]]


@dataclass(slots=True)
class TieredQueueStatus:
    topic: str
    queue: int
    max_offset: int
    # None until this process has loaded the queue's manifest (the first offload pass).
    lag: UploadLag | None
    # Bytes of the queue's records still on local disk (only when asked: it reads the
    # ConsumeQueue's size column).
    hot_bytes: int | None


@dataclass(slots=True)
class BrokerStatus:
    # Bytes appended to the CommitLog but not yet dispatched to ConsumeQueues and IndexFiles
    # (RocketMQ's dispatch_behind_bytes): not yet readable by consumers.
    dispatch_lag_bytes: int
    commitlog_files: int
    # CommitLog files on disk (allocated size), and the segments the cached manifests name.
    hot_store_bytes: int
    cold_store_bytes: int
    has_tier: bool
    tiered_queues: list[TieredQueueStatus]
    export_freshness: dict[str, float] | None


def export_freshness_or_none(provider: ExportFreshness | None) -> dict[str, float] | None:
    """The provider's answer, or None when there is none or it failed (logged, never raised:
    a broken exporter must not break the broker's own metrics)."""
    if provider is None:
        return None
    try:
        return {str(k): float(v) for k, v in provider().items()}
    except Exception as e:
        log.warning("export freshness is unavailable: %s", e)
        return None


def broker_status(
    store: MessageStore,
    metadata: BrokerMetadata,
    offloader: Offloader | None,
    export_freshness: ExportFreshness | None,
    *,
    hot_bytes: bool = False,
) -> BrokerStatus:
    now_ms = time.time_ns() // 1_000_000
    queues: list[TieredQueueStatus] = []
    if offloader is not None:
        for cfg in sorted(list(metadata.topics.values()), key=lambda t: t.name):
            if not cfg.tiered:
                continue
            for q in range(cfg.queues):
                queues.append(
                    TieredQueueStatus(
                        cfg.name,
                        q,
                        store.max_offset(cfg.name, q),
                        offloader.upload_lag(cfg.name, q, now_ms),
                        store.queue_bytes(cfg.name, q) if hot_bytes else None,
                    )
                )
    commitlog = store.commitlog_stats()
    return BrokerStatus(
        dispatch_lag_bytes=max(0, commitlog.max_offset - store.dispatched_offset),
        commitlog_files=commitlog.files,
        hot_store_bytes=commitlog.files * store.config.commitlog_file_size,
        cold_store_bytes=offloader.archived_bytes() if offloader is not None else 0,
        has_tier=offloader is not None,
        tiered_queues=queues,
        export_freshness=export_freshness_or_none(export_freshness),
    )
