"""The Delta sink: executors write Parquet files, the driver commits them in one transaction.

Two phases per micro-batch and per topic table:

1. **Write (executors).** ``ParquetWriterTask`` runs inside ``mapInArrow``: it writes the rows
   of its slices as Parquet under ``{lake_root}/{topic}/store_date=…/`` through fsspec and
   yields one small metadata row per file (path, size, partition value, offsets, Delta stats).
   Only those rows reach the driver, never the data. Rows below the table's exported offset
   (``floors``) are dropped here, so a replayed batch writes nothing twice.
2. **Commit (driver).** ``commit_files`` re-reads the table's app transactions, drops files
   another commit has already covered, and commits the rest as ``AddAction``s together with
   the new ``txn`` version of every queue in the batch, in ONE Delta transaction
   (``DeltaTable.create_write_transaction``), then checks that the versions landed.

Crash cases: a task killed mid-file leaves a partial file; a driver killed between phases
leaves complete files. Neither is referenced by the log, readers never see them, and
``tmq lakehouse maintain`` (vacuum) deletes them. A replay of the batch writes new files and
commits those. A batch whose commit landed but whose Spark checkpoint entry did not is replayed
by Spark and written as nothing, because the floors already cover it.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from deltalake import CommitProperties, Transaction
from deltalake.transaction import AddAction, RemoveAction

from lakehouse.locations import Location
from lakehouse.schema import FILE_SCHEMA, PARTITION_COLUMN, TABLE_SCHEMA
from lakehouse.tables import LakeTable, app_id
from lakehouse.tier import QueueRef

log = logging.getLogger(__name__)

# Roll a data file at about this many bytes of Arrow data (Parquet compresses below it).
TARGET_FILE_BYTES = 128 << 20
# Columns that get min/max statistics in the Delta log, for data skipping.
STATS_COLUMNS = (
    "queue_id",
    "queue_offset",
    "commitlog_offset",
    "body_size",
    "reconsume_times",
    "born_ts",
    "store_ts",
    "export_ts",
)

# One row per data file, sent from executors to the driver.
FILE_META_SCHEMA = pa.schema(
    [
        pa.field("topic", pa.string()),
        pa.field("queue_key", pa.string()),
        pa.field("path", pa.string()),  # relative to the table root
        pa.field("size", pa.int64()),
        pa.field("store_date", pa.string()),
        pa.field("num_rows", pa.int64()),
        pa.field("first_offset", pa.int64()),
        pa.field("last_offset", pa.int64()),
        pa.field("stats", pa.string()),
        pa.field("modification_time", pa.int64()),
    ]
)
FILE_META_DDL = (
    "topic string, queue_key string, path string, size bigint, store_date string, "
    "num_rows bigint, first_offset bigint, last_offset bigint, stats string, "
    "modification_time bigint"
)


class ExportConflictError(RuntimeError):
    """Another writer committed part of this batch's offsets: two exports of one topic."""


def queue_key_of_segment(segment: str) -> str:
    """``cluster/broker/topic/queue`` from a segment's object key (``…/segments/…``)."""
    return segment.split("/segments/", 1)[0]


def _stat_value(value: Any) -> Any:
    if isinstance(value, datetime):
        # Delta's timestamp statistics: ISO 8601, milliseconds, UTC.
        return (
            value.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.")
            + f"{value.microsecond // 1000:03d}Z"
        )
    return value


@dataclass(slots=True)
class _OpenFile:
    topic: str
    queue_key: str
    day: str
    relative: str
    stream: Any
    writer: pq.ParquetWriter
    rows: int = 0
    arrow_bytes: int = 0
    first_offset: int = 0
    last_offset: int = 0
    mins: dict[str, Any] = field(default_factory=dict)
    maxs: dict[str, Any] = field(default_factory=dict)

    def write(self, table: pa.Table) -> None:
        self.writer.write_table(table)
        offsets = table.column("queue_offset")
        if self.rows == 0:
            self.first_offset = pc.min(offsets).as_py()
        self.last_offset = max(self.last_offset, pc.max(offsets).as_py())
        self.rows += table.num_rows
        self.arrow_bytes += table.nbytes
        for name in STATS_COLUMNS:
            lo, hi = pc.min_max(table.column(name)).values()
            lo, hi = lo.as_py(), hi.as_py()
            self.mins[name] = lo if name not in self.mins else min(self.mins[name], lo)
            self.maxs[name] = hi if name not in self.maxs else max(self.maxs[name], hi)

    def close(self) -> dict[str, Any]:
        self.writer.close()
        size = self.stream.tell()
        self.stream.close()
        stats = {
            "numRecords": self.rows,
            "minValues": {k: _stat_value(v) for k, v in self.mins.items()},
            "maxValues": {k: _stat_value(v) for k, v in self.maxs.items()},
            "nullCount": dict.fromkeys(self.mins, 0),
        }
        return {
            "topic": self.topic,
            "queue_key": self.queue_key,
            "path": self.relative,
            "size": size,
            "store_date": self.day,
            "num_rows": self.rows,
            "first_offset": self.first_offset,
            "last_offset": self.last_offset,
            "stats": json.dumps(stats, separators=(",", ":")),
            "modification_time": int(time.time() * 1000),
        }


@dataclass(slots=True, frozen=True)
class ParquetWriterTask:
    """The ``mapInArrow`` function of one batch: source rows in, file metadata rows out.

    Each file holds rows of one queue and one ``store_date``, so its offsets are one range
    and the driver can tell exactly which queue progress it carries."""

    lake: Location
    floors: dict[str, int]  # queue key -> the table's exported offset when the batch began
    export_ts_us: int
    batch_id: int
    target_file_bytes: int = TARGET_FILE_BYTES

    def __call__(self, batches: Iterable[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        fs, root = self.lake.filesystem()
        files: dict[tuple[str, str], _OpenFile] = {}
        done: list[dict[str, Any]] = []
        for batch in batches:
            for (segment, day), part in _runs(batch):
                queue_key = queue_key_of_segment(segment)
                floor = self.floors.get(queue_key)
                if floor is not None:
                    part = part.filter(pc.greater_equal(part.column("queue_offset"), floor))
                if part.num_rows == 0:
                    continue
                topic = QueueRef.parse(queue_key).topic
                rows = self._file_rows(part)
                current = files.get((queue_key, day))
                if current is None:
                    current = files[(queue_key, day)] = self._open(fs, root, topic, queue_key, day)
                current.write(rows)
                if current.arrow_bytes >= self.target_file_bytes:
                    done.append(files.pop((queue_key, day)).close())
        done += [f.close() for f in files.values()]
        if done:
            yield pa.RecordBatch.from_pylist(done, schema=FILE_META_SCHEMA)

    def _file_rows(self, part: pa.Table) -> pa.Table:
        stamped = part.drop_columns([PARTITION_COLUMN]).append_column(
            "export_ts", pa.array([self.export_ts_us] * part.num_rows, pa.int64())
        )
        return pa.Table.from_arrays(
            [stamped.column(f.name).cast(f.type) for f in FILE_SCHEMA], schema=FILE_SCHEMA
        )

    def _open(self, fs: Any, root: str, topic: str, queue_key: str, day: str) -> _OpenFile:
        relative = f"{PARTITION_COLUMN}={day}/part-{self.batch_id:06d}-{uuid.uuid4().hex}.parquet"
        directory = f"{root}/{topic}/{PARTITION_COLUMN}={day}"
        fs.makedirs(directory, exist_ok=True)
        stream = fs.open(f"{root}/{topic}/{relative}", "wb")
        writer = pq.ParquetWriter(stream, FILE_SCHEMA, compression="snappy")
        return _OpenFile(topic, queue_key, day, relative, stream, writer)


def _runs(batch: pa.RecordBatch) -> Iterator[tuple[tuple[str, str], pa.Table]]:
    """Consecutive runs of rows with the same (segment, store_date)."""
    if batch.num_rows == 0:
        return
    table = pa.Table.from_batches([batch])
    segments = table.column("segment").to_pylist()
    days = [d.isoformat() for d in table.column(PARTITION_COLUMN).to_pylist()]
    start = 0
    for i in range(1, len(segments) + 1):
        if i == len(segments) or segments[i] != segments[start] or days[i] != days[start]:
            yield (segments[start], days[start]), table.slice(start, i - start)
            start = i


@dataclass(slots=True)
class CommitResult:
    topic: str
    table_version: int | None  # None: nothing new to commit
    files: int
    rows: int
    offsets: dict[str, int]  # queue key -> exported offset after the commit


def commit_files(
    lake: Location, topic: str, files: list[dict[str, Any]], batch_id: int, export_ts_us: int
) -> CommitResult:
    """Commit one topic's files of a batch in one Delta transaction with the queues' new
    exported offsets. Idempotent: files whose rows the table already has are left out."""
    table = LakeTable(lake, topic)
    delta = table.open_or_create()
    queues = {QueueRef.parse(f["queue_key"]) for f in files}
    current = {q.key: delta.transaction_version(app_id(q)) for q in queues}
    keep = []
    for f in files:
        exported = current[f["queue_key"]]
        if exported is None or f["first_offset"] >= exported:
            keep.append(f)
        elif f["last_offset"] >= exported:
            raise ExportConflictError(
                f"table {topic}: queue {f['queue_key']} was exported up to {exported} by another "
                f"writer while this batch wrote {f['first_offset']}..{f['last_offset']}; run one "
                "export per topic"
            )
    if not keep:
        return CommitResult(topic, None, 0, 0, {k: v for k, v in current.items() if v is not None})
    offsets: dict[str, int] = {}
    for f in keep:
        offsets[f["queue_key"]] = max(offsets.get(f["queue_key"], 0), f["last_offset"] + 1)
    actions: list[AddAction | RemoveAction] = [
        AddAction(
            path=f["path"],
            size=f["size"],
            partition_values={PARTITION_COLUMN: f["store_date"]},
            modification_time=f["modification_time"],
            data_change=True,
            stats=f["stats"],
        )
        for f in keep
    ]
    delta.create_write_transaction(
        actions,
        mode="append",
        schema=TABLE_SCHEMA,
        partition_by=[PARTITION_COLUMN],
        commit_properties=CommitProperties(
            custom_metadata={
                "tmq.exportBatchId": str(batch_id),
                "tmq.exportTs": datetime.fromtimestamp(export_ts_us / 1e6, UTC).isoformat(),
            },
            app_transactions=[
                Transaction(app_id(QueueRef.parse(k)), v, int(time.time() * 1000))
                for k, v in sorted(offsets.items())
            ],
        ),
    )
    delta.update_incremental()
    for key, version in offsets.items():
        landed = delta.transaction_version(app_id(QueueRef.parse(key)))
        if landed != version:
            raise ExportConflictError(
                f"table {topic}: queue {key} exported offset is {landed} after committing "
                f"{version}; is another export writing this table?"
            )
    return CommitResult(
        topic, delta.version(), len(keep), sum(f["num_rows"] for f in keep), offsets
    )
