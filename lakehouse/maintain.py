"""``tmq lakehouse maintain``: compact small files, vacuum, checkpoint the log.

A continuous export commits a few files per topic every trigger, so tables collect small files;
compaction rewrites them per ``store_date`` partition into files of about ``target_size``
(``data_change=false``: readers of the change feed, and appendOnly, are unaffected). Vacuum
deletes files no longer referenced by the log and older than the retention, which includes the
orphans of batches that were killed before their commit. Never lower the retention below the
longest export batch: vacuum cannot tell a killed batch's file from one about to be committed.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from lakehouse.durable import settle
from lakehouse.locations import Location
from lakehouse.status import lake_topics
from lakehouse.tables import LakeTable

DEFAULT_TARGET_FILE_BYTES = 128 << 20
DEFAULT_RETENTION_HOURS = 168  # Delta's own default (7 days)


@dataclass(slots=True)
class MaintainResult:
    topic: str
    files_removed: int
    files_added: int
    vacuumed: int
    version: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def maintain(
    lake: Location,
    topics: list[str] | None = None,
    *,
    target_size: int = DEFAULT_TARGET_FILE_BYTES,
    retention_hours: int = DEFAULT_RETENTION_HOURS,
    dry_run: bool = False,
) -> list[MaintainResult]:
    out = []
    for topic in topics or lake_topics(lake):
        table = LakeTable(lake, topic)
        delta = table.open()
        if delta is None:
            raise FileNotFoundError(f"{lake.url}/{topic}: no Delta table")
        added = removed = 0
        before = delta.version()
        if not dry_run:
            metrics = delta.optimize.compact(target_size=target_size)
            added, removed = int(metrics["numFilesAdded"]), int(metrics["numFilesRemoved"])
        vacuumed = delta.vacuum(
            retention_hours=retention_hours,
            dry_run=dry_run,
            enforce_retention_duration=retention_hours >= DEFAULT_RETENTION_HOURS,
            full=True,  # also orphans never named by the log (killed export batches)
        )
        if not dry_run:
            delta.create_checkpoint()
            # The checkpoint is of the newest version, which is ``before`` itself when nothing
            # was compacted: settle from the one before it.
            settle(table.location, before - 1)
        out.append(MaintainResult(topic, removed, added, len(vacuumed), delta.version()))
    return out
