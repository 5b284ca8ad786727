"""The Delta sink: executors write Parquet files, the driver commits them in one transaction.

Two phases per batch and per topic table:

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
commits those; a batch planned again after its commit landed (a restart) writes nothing,
because the floors already cover it.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import UTC, date, datetime, timedelta
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from deltalake import CommitProperties, DeltaTable, Transaction
from deltalake.exceptions import CommitFailedError
from deltalake.transaction import AddAction, RemoveAction
from fsspec.implementations.local import LocalFileSystem

from lakehouse.durable import ACTIONS_KEY, settle
from lakehouse.locations import Location
from lakehouse.schema import FILE_SCHEMA, PARTITION_COLUMN, TABLE_SCHEMA
from lakehouse.source import SegmentSlice, SlicePack, read_slices
from lakehouse.tables import LakeTable, app_id, archive_app_id, archive_version
from lakehouse.tier import QueueRef
from tiered.cold.storage import StorageError
from tiered.durable import fsync_file, make_dirs

log = logging.getLogger(__name__)

# LZ4_RAW: as fast as writing uncompressed on incompressible bodies, where snappy costs more
# than the rest of the write (decision 271); every reader the docs name reads it.
DEFAULT_COMPRESSION = "lz4"
# Roll a data file at about this many bytes of Arrow data (Parquet compresses below it).
TARGET_FILE_BYTES = 128 << 20
# Columns whose min/max go into the Delta log, for data skipping: what analysts filter on.
STATS_COLUMNS = (
    "topic",
    "broker",
    "queue_id",
    "queue_offset",
    "commitlog_offset",
    "msg_id",
    "tags",
    "body_size",
    "born_ts",
    "store_ts",
    "born_host",
    "store_host",
    "reconsume_times",
    "segment",
    "export_ts",
)
# Columns with a null count only: Delta keeps no min/max for arrays, maps or binaries.
NULL_COUNT_COLUMNS = ("keys", "properties", "body")
# Delta-spark's own cut for string statistics: a 32-character prefix.
STRING_STATS_PREFIX = 32
_DICTIONARY_COLUMNS = ["topic", "broker", "tags", "born_host", "store_host", "segment"]
_PARQUET_STATS_COLUMNS = [*STATS_COLUMNS]

# One row per data file and queue in it (a file holds the rows of every queue of its topic and
# ``store_date`` that one task wrote; the file's fields repeat on each of its rows), or per
# damaged slice (empty path, ``error`` set): executors -> driver.
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
        pa.field("error", pa.string()),
    ]
)
FILE_META_DDL = (
    "topic string, queue_key string, path string, size bigint, store_date string, "
    "num_rows bigint, first_offset bigint, last_offset bigint, stats string, "
    "modification_time bigint, error string"
)


class ExportConflictError(RuntimeError):
    """Another writer committed part of this batch's offsets: two exports of one topic."""


def queue_key_of_segment(segment: str) -> str:
    """``cluster/broker/topic/queue`` from a segment's object key (``…/segments/…``)."""
    return segment.split("/segments/", 1)[0]


def _stat_value(value: Any, high: bool) -> Any:
    if isinstance(value, datetime):
        # Delta's timestamp statistics: ISO 8601, milliseconds, UTC; the max rounded up, so
        # that sub-millisecond values stay inside [min, max].
        micros = value.microsecond % 1000
        if high and micros:
            value = value + timedelta(microseconds=1000 - micros)
        return (
            value.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.")
            + f"{value.microsecond // 1000:03d}Z"
        )
    if isinstance(value, str) and len(value) > STRING_STATS_PREFIX:
        # A prefix is a lower bound; a prefix followed by the highest code point an upper one.
        prefix = value[:STRING_STATS_PREFIX]
        return prefix + "\U0010ffff" if high else prefix
    return value


@dataclass(slots=True)
class _QueueRange:
    """The rows of one queue in one data file: contiguous offsets ``[first, last]``."""

    first: int
    last: int
    rows: int


@dataclass(slots=True)
class _OpenFile:
    topic: str
    day: str
    relative: str
    stream: Any
    writer: pq.ParquetWriter
    local: str | None  # the file's path on a local lake, fsynced at close
    rows: int = 0
    arrow_bytes: int = 0
    queues: dict[str, _QueueRange] = field(default_factory=dict)
    mins: dict[str, Any] = field(default_factory=dict)
    maxs: dict[str, Any] = field(default_factory=dict)
    nulls: dict[str, int] = field(default_factory=dict)

    def continues(self, queue_key: str, first: int) -> bool:
        """Whether rows of ``queue_key`` from ``first`` on keep its range in this file
        contiguous (a queue without rows here always does)."""
        current = self.queues.get(queue_key)
        return current is None or current.last + 1 == first

    def write(self, queue_key: str, table: pa.Table) -> None:
        self.writer.write_table(table)
        lo, hi = (v.as_py() for v in pc.min_max(table.column("queue_offset")).values())
        current = self.queues.get(queue_key)
        if current is None:
            self.queues[queue_key] = _QueueRange(lo, hi, table.num_rows)
        else:
            current.last = max(current.last, hi)
            current.rows += table.num_rows
        self.rows += table.num_rows
        self.arrow_bytes += table.nbytes
        for name in STATS_COLUMNS:
            column = table.column(name)
            self.nulls[name] = self.nulls.get(name, 0) + column.null_count
            low, high = (v.as_py() for v in pc.min_max(column).values())
            if low is None:
                continue  # all null
            self.mins[name] = low if name not in self.mins else min(self.mins[name], low)
            self.maxs[name] = high if name not in self.maxs else max(self.maxs[name], high)
        for name in NULL_COUNT_COLUMNS:
            self.nulls[name] = self.nulls.get(name, 0) + table.column(name).null_count

    def close(self) -> list[dict[str, Any]]:
        """Close the file; its metadata rows, one per queue it holds (file fields repeated)."""
        self.writer.close()
        size = self.stream.tell()
        self.stream.close()
        if self.local is not None:
            # Durable before the driver's commit names it (decision 1270): delta-rs fsyncs
            # nothing of a local table, and a commit naming a file a power loss took back
            # makes every read of the table fail.
            fsync_file(self.local)
        stats = {
            "numRecords": self.rows,
            "minValues": {k: _stat_value(v, False) for k, v in self.mins.items()},
            "maxValues": {k: _stat_value(v, True) for k, v in self.maxs.items()},
            "nullCount": self.nulls,
        }
        # Raw UTF-8, never surrogate-pair escapes: delta-rs reads the pair of a character past
        # plane 1 0x10000 too low (U+20BB7 as U+10BB7, the bound U+10FFFF as U+FFFFF), so a
        # file's max fell below its own rows and `where tags = '𠮷野家'` skipped the file.
        encoded = json.dumps(stats, separators=(",", ":"), ensure_ascii=False)
        modified = int(time.time() * 1000)
        return [
            {
                "topic": self.topic,
                "queue_key": key,
                "path": self.relative,
                "size": size,
                "store_date": self.day,
                "num_rows": part.rows,
                "first_offset": part.first,
                "last_offset": part.last,
                "stats": encoded,
                "modification_time": modified,
                "error": None,
            }
            for key, part in sorted(self.queues.items())
        ]


def damage_row(queue_key: str, first_offset: int, error: str) -> dict[str, Any]:
    """The metadata row of a slice that could not be read: no file, the reason in ``error``."""
    return {
        "topic": QueueRef.parse(queue_key).topic,
        "queue_key": queue_key,
        "path": "",
        "size": 0,
        "store_date": "",
        "num_rows": 0,
        "first_offset": first_offset,
        "last_offset": first_offset - 1,
        "stats": "",
        "modification_time": 0,
        "error": error,
    }


def outage_row(error: str) -> dict[str, Any]:
    """The metadata row of a task the tier stopped answering: no queue, the reason in
    ``error``. The whole batch fails; nothing of it is committed."""
    return {**damage_row("-/-/-/0", 0, error), "topic": "", "queue_key": ""}


@dataclass(slots=True, frozen=True)
class ParquetWriterTask:
    """The ``mapInArrow`` function of one batch: pack ids in, file metadata rows out. Each
    task reads its slices with the columnar decode and writes the Arrow batches as Parquet
    straight away; message bytes never pass through the JVM.

    A task writes one file per topic and ``store_date`` (rolled at the target size): a small
    batch of many queues is one file per partition, not one per queue. Within a file each
    queue's rows are contiguous in queue offset, and the file's metadata rows (one per queue)
    say exactly which queue progress it carries. A slice that cannot be read (missing or
    damaged object) yields a damage row instead of failing the task, and the task reads no
    later slice of that queue: the driver stops that queue alone."""

    lake: Location
    tier: Location
    floors: dict[str, int]  # queue key -> the table's exported offset when the batch began
    export_ts_us: int
    batch_id: int
    stopped: frozenset[str] = frozenset()  # queues this export no longer reads
    target_file_bytes: int = TARGET_FILE_BYTES
    # The export plans on the driver: the batch's packs travel with the task, and its input
    # is ``spark.range(len(packs))``, each id one pack. (A DataFrame made from Python
    # rows costs a Python pass of its own in every task; a range is made in the JVM.)
    packs: tuple[SlicePack, ...] = ()
    compression: str = DEFAULT_COMPRESSION

    def __call__(self, slices: Iterable[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        files = _FileSet(self)
        damaged: list[dict[str, Any]] = []
        failed: set[str] = set()  # queues whose slice failed in this task: read no further
        parts = []
        for batch in slices:
            for part in self._slices(batch):
                floor = self.floors.get(part.queue_key, part.first)
                if part.queue_key in self.stopped or part.end <= floor:
                    continue  # stopped, or a replayed slice the table already has
                if floor > part.first:
                    part = SegmentSlice(part.queue_key, part.segment, floor, part.end)
                parts.append(part)
        try:
            # One read pipeline over every slice of the task (lakehouse.source.read_slices).
            for part, rows in read_slices(self.tier, parts, lambda p: p.queue_key in failed):
                if isinstance(rows, pa.RecordBatch):
                    files.add(rows)
                    continue
                # Rows decoded before the damage are whole and checked: keep them.
                written = files.last_offset(part.queue_key)
                at = part.first if written is None else max(part.first, written + 1)
                damaged.append(damage_row(part.queue_key, at, _first_line(rows)))
                failed.add(part.queue_key)
        except StorageError as e:
            # The tier did not answer through every retry (an outage): not one queue's damage.
            # The driver commits nothing of this batch; the files written are never referenced.
            files.close()
            yield pa.RecordBatch.from_pylist([outage_row(_first_line(e))], schema=FILE_META_SCHEMA)
            return
        done = files.close() + damaged
        if done:
            yield pa.RecordBatch.from_pylist(done, schema=FILE_META_SCHEMA)

    def _slices(self, batch: pa.RecordBatch) -> list[SegmentSlice]:
        """The slices of an input batch: the ids of ``spark.range`` naming packs."""
        return [s for i in batch.column("id").to_pylist() for s in self.packs[i].slices]

    def write_rows(self, batches: Iterable[pa.RecordBatch]) -> list[dict[str, Any]]:
        """Write source rows (``SOURCE_SCHEMA``) as files; their metadata rows."""
        files = _FileSet(self)
        for batch in batches:
            files.add(batch)
        return files.close()

    def file_rows(self, part: pa.Table) -> pa.Table:
        n = part.num_rows
        stamp = pa.repeat(pa.scalar(self.export_ts_us, pa.timestamp("us", tz="UTC")), n)
        columns = {name: part.column(name) for name in part.column_names}
        columns["export_ts"] = stamp
        return pa.Table.from_arrays([columns[f.name] for f in FILE_SCHEMA], schema=FILE_SCHEMA)

    def open(self, fs: Any, root: str, topic: str, day: str) -> _OpenFile:
        relative = f"{PARTITION_COLUMN}={day}/part-{self.batch_id:06d}-{uuid.uuid4().hex}.parquet"
        directory = f"{root}/{topic}/{PARTITION_COLUMN}={day}"
        path = f"{root}/{topic}/{relative}"
        local = isinstance(fs, LocalFileSystem)
        if local:
            make_dirs(Path(directory))  # the partition's name durable before a commit names it
        else:
            fs.makedirs(directory, exist_ok=True)
        # A local lake is written through Arrow's own file (C++, no GIL per write); fsspec's
        # Python file cost a Python call per column chunk, which the task's fetch threads
        # waited on.
        stream = pa.OSFile(path, "wb") if local else fs.open(path, "wb")
        writer = pq.ParquetWriter(
            stream,
            FILE_SCHEMA,
            compression=self.compression,
            use_dictionary=_DICTIONARY_COLUMNS,
            write_statistics=_PARQUET_STATS_COLUMNS,
        )
        return _OpenFile(topic, day, relative, stream, writer, path if local else None)


class _FileSet:
    """The open files of one task: one per topic and ``store_date``, holding every queue's rows
    of that partition, rolled at the target size (or when a queue's rows would not continue
    its range in the file)."""

    def __init__(self, task: ParquetWriterTask) -> None:
        self.task = task
        self.fs, self.root = task.lake.filesystem()
        self.open: dict[tuple[str, str], _OpenFile] = {}
        self.done: list[dict[str, Any]] = []
        self.written: dict[str, int] = {}  # queue key -> last offset written in this task

    def add(self, batch: pa.RecordBatch) -> None:
        for (segment, day), part in _runs(batch):
            queue_key = queue_key_of_segment(segment)
            floor = self.task.floors.get(queue_key)
            offsets = part.column("queue_offset")
            if floor is not None and offsets[0].as_py() < floor:  # ascending within a run
                part = part.filter(pc.greater_equal(offsets, floor))
            if part.num_rows == 0:
                continue
            topic = QueueRef.parse(queue_key).topic
            where = (topic, day)
            current = self.open.get(where)
            first = part.column("queue_offset")[0].as_py()
            if current is not None and not current.continues(queue_key, first):
                self.done.extend(self.open.pop(where).close())
                current = None
            if current is None:
                current = self.open[where] = self.task.open(self.fs, self.root, topic, day)
            current.write(queue_key, self.task.file_rows(part))
            self.written[queue_key] = current.queues[queue_key].last
            if current.arrow_bytes >= self.task.target_file_bytes:
                self.done.extend(self.open.pop(where).close())

    def last_offset(self, queue_key: str) -> int | None:
        """The last offset of ``queue_key`` this task wrote, or None."""
        return self.written.get(queue_key)

    def close(self) -> list[dict[str, Any]]:
        out = self.done + [row for f in self.open.values() for row in f.close()]
        self.open.clear()
        return out


def _runs(batch: pa.RecordBatch) -> Iterator[tuple[tuple[str, str], pa.Table]]:
    """Consecutive runs of rows with the same (segment, store_date)."""
    n = batch.num_rows
    if n == 0:
        return
    table = pa.Table.from_batches([batch])
    segments = pc.dictionary_encode(table.column("segment")).combine_chunks()
    codes = np.asarray(segments.indices)
    days = np.asarray(table.column(PARTITION_COLUMN).combine_chunks().cast(pa.int32()))
    cuts = np.flatnonzero((np.diff(codes) != 0) | (np.diff(days) != 0)) + 1
    for lo, hi in zip([0, *cuts.tolist()], [*cuts.tolist(), n], strict=True):
        segment = str(segments.dictionary[int(codes[lo])])
        day = (date(1970, 1, 1) + timedelta(days=int(days[lo]))).isoformat()
        yield (segment, day), table.slice(lo, hi - lo)


def _first_line(error: BaseException) -> str:
    text = str(error).strip() or type(error).__name__
    return text.splitlines()[0][:500]


@dataclass(slots=True)
class CommitResult:
    topic: str
    table_version: int | None  # None: nothing new to commit
    files: int
    rows: int
    offsets: dict[str, int]  # queue key -> exported offset after the commit
    bytes: int = 0  # Parquet bytes committed
    file_sizes: list[int] = field(default_factory=list)  # bytes of each file committed
    partitions: dict[str, int] = field(default_factory=dict)  # store_date -> files committed


def _transactions(offsets: dict[str, int], archives: Mapping[str, str]) -> list[Transaction]:
    """Each queue's exported offset, and the archive its rows came from where it is known."""
    now = int(time.time() * 1000)
    out = []
    for key, offset in sorted(offsets.items()):
        queue = QueueRef.parse(key)
        out.append(Transaction(app_id(queue), offset, now))
        if key in archives:
            out.append(Transaction(archive_app_id(queue), archive_version(archives[key]), now))
    return out


def record_archives(
    location: Location, delta: DeltaTable, archives: Mapping[str, tuple[int, str]]
) -> int | None:
    """Record, in one commit of no files, the archive each queue's rows came from, for queues
    exported before archive ids (decision 1240) whose last row the caller found in the tier's
    current archive: queue key -> (its exported offset, that archive's id). The offsets are set
    again to the same values, so that an export committing to the same queues meanwhile makes
    delta-rs refuse this commit rather than record an id beside another offset. Queues whose
    offset moved since the caller read it are left out. The new table version, or None."""
    delta.update_incremental()
    live = {
        key: (offset, archive)
        for key, (offset, archive) in archives.items()
        if delta.transaction_version(app_id(QueueRef.parse(key))) == offset
    }
    if not live:
        return None
    transactions = _transactions(
        {key: offset for key, (offset, _) in live.items()},
        {key: archive for key, (_, archive) in live.items()},
    )
    before = delta.version()
    delta.create_write_transaction(
        [],
        mode="append",
        schema=delta.schema(),  # the table's own: this commit changes nothing but transactions
        partition_by=[PARTITION_COLUMN],
        commit_properties=CommitProperties(
            custom_metadata={
                ACTIONS_KEY: str(len(transactions)),
                "tmq.recordArchives": str(len(live)),
            },
            app_transactions=transactions,
        ),
    )
    settle(location, before)
    delta.update_incremental()
    return delta.version()


def commit_files(
    lake: Location,
    topic: str,
    files: list[dict[str, Any]],
    batch_id: int,
    export_ts_us: int,
    delta: DeltaTable | None = None,
    archives: Mapping[str, str] | None = None,
) -> CommitResult:
    """Commit one topic's files of a batch in one Delta transaction with the queues' new
    exported offsets. ``files`` are metadata rows, one per file and queue. Idempotent: files
    whose rows the table already has are left out (a file is committed whole or not at all).
    ``delta``: the table as the caller last read it (brought up to date here), not reopened.
    ``archives``: queue key -> the archive id ("" none) of the manifest the queue's slices were
    planned from, recorded beside its offset in the same commit (decision 1240)."""
    table = LakeTable(lake, topic)
    if delta is None:
        delta = table.open_or_create()
    else:
        delta.update_incremental()
        table.check_row_version(delta)
        table.add_deliver_column(delta)
    queues = {QueueRef.parse(f["queue_key"]) for f in files}
    current = {q.key: delta.transaction_version(app_id(q)) for q in queues}
    by_path: dict[str, list[dict[str, Any]]] = {}
    for f in files:
        by_path.setdefault(f["path"], []).append(f)
    keep: list[dict[str, Any]] = []  # one row per file kept
    offsets: dict[str, int] = {}
    rows = 0
    for path, parts in by_path.items():
        # Each queue's rows in the file: all new to the table, or all already in it (a replay).
        fresh = [f for f in parts if (current[f["queue_key"]] or 0) <= f["first_offset"]]
        stale = [f for f in parts if (current[f["queue_key"]] or 0) > f["last_offset"]]
        if len(stale) == len(parts):
            continue  # the whole file is a replay
        if len(fresh) != len(parts):
            f = next(f for f in parts if f not in fresh)
            raise ExportConflictError(
                f"table {topic}: queue {f['queue_key']} was exported up to "
                f"{current[f['queue_key']]} by another writer while this batch wrote "
                f"{f['first_offset']}..{f['last_offset']} (file {path}); run one export per topic"
            )
        keep.append(parts[0])
        for f in fresh:
            offsets[f["queue_key"]] = max(offsets.get(f["queue_key"], 0), f["last_offset"] + 1)
            rows += f["num_rows"]
    if not keep:
        return CommitResult(topic, None, 0, 0, {k: v for k, v in current.items() if v is not None})
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
    transactions = _transactions(offsets, archives or {})
    before = delta.version()
    try:
        delta.create_write_transaction(
            actions,
            mode="append",
            schema=TABLE_SCHEMA,
            partition_by=[PARTITION_COLUMN],
            commit_properties=CommitProperties(
                custom_metadata={
                    # How many add and txn lines follow: what tells a commit a power loss cut
                    # at a line's end from a whole one (lakehouse/durable.py).
                    ACTIONS_KEY: str(len(actions) + len(transactions)),
                    "tmq.exportBatchId": str(batch_id),
                    "tmq.exportTs": datetime.fromtimestamp(export_ts_us / 1e6, UTC).isoformat(),
                },
                app_transactions=transactions,
            ),
        )
    except CommitFailedError as e:
        # delta-rs refuses a commit when one committed since this batch read the table set
        # the exported offset of one of its queues (the same app id): another export.
        if "Concurrent transaction" not in str(e):
            raise
        named = sorted(offsets)
        listed = ", ".join(named[:2]) + (f" and {len(named) - 2} more" if len(named) > 2 else "")
        raise ExportConflictError(
            f"table {table.uri}: another export committed to it while this one committed batch "
            f"{batch_id} (queues {listed}; delta-rs: {str(e).strip()}), so nothing of the batch "
            "was committed; two exports are writing this table (e.g. a second `tmq lakehouse "
            "export` with another --checkpoint): stop all but one, then run it again (it "
            "resumes where the table says)"
        ) from None
    settle(table.location, before)
    delta.update_incremental()
    for key, version in offsets.items():
        landed = delta.transaction_version(app_id(QueueRef.parse(key)))
        if landed != version:
            raise ExportConflictError(
                f"table {topic}: queue {key} exported offset is {landed} after committing "
                f"{version}; is another export writing this table?"
            )
    return CommitResult(
        topic,
        delta.version(),
        len(keep),
        rows,
        offsets,
        sum(f["size"] for f in keep),
        [f["size"] for f in keep],
        dict(Counter(f["store_date"] for f in keep)),
    )
