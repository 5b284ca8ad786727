"""Automatic compaction for the continuous export: few files per partition, not one per trigger.

A continuous export commits a file per queue and ``store_date`` every trigger: at 1 to 10 s,
thousands of small files an hour. Delta files are immutable, so the way to keep both freshness
(commit small batches now) and healthy tables (few large files) is to rewrite the small files of
a partition into one, every few minutes: ``optimize.compact`` with ``data_change=false``, which
an append-only table allows and which readers of the change feed skip. Files already at the
target size are never rewritten, so a busy partition's data is rewritten at most until its
files reach the target; a quiet one rewrites its one growing file each time (at 20 msgs/s of
1 KiB, about 70 MB an hour, every five minutes: under 1 GB of rewriting an hour).

The replaced files stay on storage until ``tmq lakehouse maintain`` vacuums them; until then a
reader of the table *directory* (not the Delta log) sees both copies (docs/lakehouse.md).

Between two of those, a 1 s trigger still adds up to 300 files to a partition. So the export
also counts the files it commits to each partition and, once one holds ``SMALL_FILES`` new
files, merges that partition's files below ``SMALL_FILE_BYTES`` (``compact_partition``), a
cheap first level: it never rewrites more than ``SMALL_FILE_BYTES`` at once, never touches
the large files, and keeps a partition to at most ``SMALL_FILES`` small files plus the few
first-level files since the last full compaction.
"""

from __future__ import annotations

import pyarrow as pa
import pyarrow.compute as pc

from lakehouse.durable import settle
from lakehouse.schema import PARTITION_COLUMN
from lakehouse.tables import LakeTable

# Compact a partition once it holds this many files below the target size.
MIN_SMALL_FILES = 2
# The first level (decided per batch): a partition with this many new files since its last
# compaction has its files below SMALL_FILE_BYTES merged into files of about that size.
SMALL_FILES = 16
SMALL_FILE_BYTES = 8 << 20


def compact_small_files(table: LakeTable, target_file_bytes: int) -> int:
    """Rewrite each partition's small files into files of about ``target_file_bytes``;
    return how many files were replaced (0 when no partition needed it)."""
    delta = table.open()
    if delta is None:
        return 0
    actions = pa.table(delta.get_add_actions(flatten=True))
    if actions.num_rows == 0:
        return 0
    small = actions.filter(pc.less(actions.column("size_bytes"), target_file_bytes))
    days = small.column(f"partition.{PARTITION_COLUMN}").to_pylist()
    counts: dict[str, int] = {}
    for day in days:
        counts[str(day)] = counts.get(str(day), 0) + 1
    replaced = 0
    for day, count in sorted(counts.items()):
        if count < MIN_SMALL_FILES:
            continue
        before = delta.version()
        metrics = delta.optimize.compact(
            partition_filters=[(PARTITION_COLUMN, "=", day)], target_size=target_file_bytes
        )
        settle(table.location, before)
        replaced += int(metrics["numFilesRemoved"])
    return replaced


def compact_partition(table: LakeTable, day: str, target_file_bytes: int) -> int:
    """Merge one partition's files below ``target_file_bytes`` into files of about that size;
    return how many files were replaced."""
    delta = table.open()
    if delta is None:
        return 0
    before = delta.version()
    metrics = delta.optimize.compact(
        partition_filters=[(PARTITION_COLUMN, "=", day)], target_size=target_file_bytes
    )
    settle(table.location, before)
    return int(metrics["numFilesRemoved"])
