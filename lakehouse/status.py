"""How far each topic's export has got: exported offsets, rows, and freshness lag.

Freshness lag follows Firehose's DataFreshness: the age of the oldest archived message that is
not yet in Delta (0 when the table has everything the tier has). A backfill that has not
reached last month yet therefore reports a month, and a caught-up export reports 0.
"""

from __future__ import annotations

import struct
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from lakehouse.locations import Location
from lakehouse.tables import LakeTable, exported_offsets
from lakehouse.tier import ManifestCache, QueueRef, discover
from tiered.cold.manifest import ManifestError
from tiered.cold.segment import SegmentError
from tiered.cold.storage import ObjectNotFoundError, ObjectStore, open_store

_TIME = struct.Struct(">q")


@dataclass(slots=True)
class QueueStatus:
    queue: str  # cluster/broker/topic/queue
    exported_offset: int | None  # next offset to export; None: nothing exported yet
    tier_watermark: int | None  # None: the tier was not consulted
    pending: int | None  # archived messages not yet exported
    lag_seconds: float | None
    error: str | None = None  # the queue's manifest or segment cannot be read


@dataclass(slots=True)
class TopicStatus:
    topic: str
    table: str
    table_version: int | None
    rows: int
    files: int
    last_commit_age_seconds: float | None
    lag_seconds: float | None  # the worst queue's
    queues: list[QueueStatus] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def lake_topics(lake: Location) -> list[str]:
    """Topics that have a table under the lake root (a ``_delta_log`` directory)."""
    fs, root = lake.filesystem()
    try:
        entries = fs.ls(root, detail=True, refresh=True)
    except FileNotFoundError:
        return []
    out = []
    for entry in entries:
        name = str(entry["name"]).rstrip("/").rsplit("/", 1)[-1]
        is_table = entry.get("type") == "directory" and not name.startswith(("_", "."))
        if is_table and fs.exists(f"{root}/{name}/_delta_log"):
            out.append(name)
    return sorted(out)


def _oldest_pending_ms(
    store: ObjectStore, manifests: ManifestCache, queue: QueueRef, at: int
) -> int | None:
    manifest = manifests.get(queue)
    info = manifest.find(max(at, manifest.start_offset))
    if info is None:
        return None
    i = max(at, manifest.start_offset) - info.base_offset
    try:
        (ts,) = _TIME.unpack(store.get_range(info.key, info.times_at + 8 * i, 8))
    except ObjectNotFoundError:
        raise SegmentError(f"segment {info.key} is missing from the tier") from None
    return int(ts)


def _queue_status(
    store: ObjectStore, manifests: ManifestCache, q: QueueRef, exported: int | None, now: float
) -> QueueStatus:
    """One queue's progress; a queue whose manifest or segment cannot be read is reported
    with its error (one line: the object and what to do), never failing the whole status."""
    watermark: int | None = None
    try:
        manifest = manifests.get(q)
        watermark = manifest.end_offset
        at = exported if exported is not None else manifest.start_offset
        pending = max(0, watermark - max(at, manifest.start_offset))
        lag: float | None = 0.0
        if pending:
            oldest = _oldest_pending_ms(store, manifests, q, at)
            lag = max(0.0, now - oldest / 1000) if oldest is not None else None
    except (ManifestError, SegmentError, ObjectNotFoundError) as e:
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return QueueStatus(
            q.key,
            exported,
            watermark,
            None,
            None,
            f"{reason}; run `tmq verify {q.topic}`",
        )
    return QueueStatus(q.key, exported, watermark, pending, lag)


def topic_status(
    lake: Location, topics: list[str] | None = None, tier: Location | None = None
) -> list[TopicStatus]:
    """Status of ``topics`` (default: every table in the lake, plus every archived topic when
    the tier is given)."""
    now = time.time()
    store = open_store(tier.url, tier.options) if tier is not None else None
    queues = discover(store, frozenset(topics) if topics else None) if store is not None else []
    manifests = ManifestCache(store) if store is not None else None
    names = set(topics or lake_topics(lake)) | {q.topic for q in queues}
    out = []
    for topic in sorted(names):
        table = LakeTable(lake, topic)
        delta = table.open()
        mine = [q for q in queues if q.topic == topic]
        status = TopicStatus(topic, table.location.url, None, 0, 0, None, None)
        if delta is not None:
            status.table_version = delta.version()
            actions = pa.table(delta.get_add_actions(flatten=True))  # arro3 -> pyarrow
            status.files = actions.num_rows
            status.rows = int(pc.sum(actions.column("num_records")).as_py() or 0)
            history = delta.history(1)
            if history:
                status.last_commit_age_seconds = max(0.0, now - history[0]["timestamp"] / 1000)
        exported = exported_offsets(delta, mine)
        for q in mine:
            assert store is not None and manifests is not None
            status.queues.append(_queue_status(store, manifests, q, exported.get(q.key), now))
        lags = [q.lag_seconds for q in status.queues if q.lag_seconds is not None]
        status.lag_seconds = max(lags) if lags else None
        out.append(status)
    return out
