"""The export job: archived topics -> one Delta table per topic, exactly once.

Every batch is the same Spark job: ``spark.range`` over packs of segment slices planned on the
driver (``Planner``: the source's own admission control), ``mapInArrow`` reading the slices and
writing Parquet on the executors, and one Delta commit per topic on the driver
(``lakehouse/sink.py``). The two modes differ only in when they stop:

* ``once``: bounded by every queue's tier watermark when the job starts, until the tables'
  exported offsets reach them.
* ``continuous``: the same batches in a loop in one Spark session, every trigger interval
  (default 10 s) reading the manifests again, until ``stop()`` or a signal.

No Structured Streaming query: starting one costs Spark's Python source processes (lookup,
planning, the source runner) seconds before the first byte, its checkpoint is a second record
of progress that can disagree with the table, and its micro-batches are planned by the same
planner anyway. Progress lives in the tables' app transactions alone (decisions 190, 270), so a
restarted or replacing export starts exactly where the tables say, and the sink drops rows a
table already has.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from deltalake import DeltaTable
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from lakehouse import source as tmq_source
from lakehouse.compaction import (
    SMALL_FILE_BYTES,
    SMALL_FILES,
    compact_partition,
    compact_small_files,
)
from lakehouse.locations import Location, is_local, local_path
from lakehouse.lock import CheckpointLock, ExportLockedError
from lakehouse.sink import (
    DEFAULT_COMPRESSION,
    FILE_META_DDL,
    TARGET_FILE_BYTES,
    CommitResult,
    ParquetWriterTask,
    commit_files,
    record_archives,
)
from lakehouse.source import Planner, SlicePack, SourceOptions, balanced_packs, tier_store
from lakehouse.tables import (
    LakeTable,
    TableVersionError,
    exported_archives,
    exported_offsets,
    exported_segment,
)
from lakehouse.tier import ManifestCache, QueueRef, archive_changed, discover
from tiered.cold.manifest import QueueManifest
from tiered.cold.storage import StorageError

log = logging.getLogger(__name__)

Engine = Literal["delta-rs", "delta-spark"]
DEFAULT_TRIGGER_SECONDS = 10.0
DEFAULT_COMPACT_EVERY_SECONDS = 300.0


class ExportError(RuntimeError):
    """The export cannot run or failed; the message is for an operator."""


@dataclass(slots=True)
class ExportConfig:
    tier_url: str
    lake_root: str
    topics: list[str] | None = None  # None: every archived topic
    trigger_seconds: float = DEFAULT_TRIGGER_SECONDS
    checkpoint_dir: str | None = None  # default: {lake_root}/_checkpoints/export-… (local lake)
    max_bytes_per_trigger: int | None = tmq_source.DEFAULT_MAX_BYTES_PER_TRIGGER
    max_segments_per_trigger: int | None = None
    bytes_per_partition: int = tmq_source.DEFAULT_BYTES_PER_PARTITION
    engine: Engine = "delta-rs"
    # Wait for the export holding the checkpoint to stop, then take over (hot standby).
    standby: bool = False
    # Continuous mode: compact a topic's partitions this often (None: never), so that small
    # per-trigger files do not pile up (lakehouse/compaction.py).
    compact_every_seconds: float | None = DEFAULT_COMPACT_EVERY_SECONDS
    target_file_bytes: int = TARGET_FILE_BYTES
    # Continuous mode, with compaction on: merge a partition's small files once it has this
    # many new ones (the first level, lakehouse/compaction.py).
    compact_after_files: int = SMALL_FILES
    # The data files' codec: LZ4_RAW by default (decision 271); snappy for readers older than
    # Spark 3.4 / parquet-mr 1.13.
    compression: str = DEFAULT_COMPRESSION
    tier_options: dict[str, Any] = field(default_factory=dict)
    lake_options: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class BatchReport:
    batch_id: int
    rows: int
    files: int
    seconds: float
    commits: list[CommitResult]
    # Wall seconds of its stages: "floors" (reading the tables' offsets), "job" (the Spark job:
    # GETs, decode, Parquet writes), "commit" (the Delta commits)
    stages: dict[str, float] = field(default_factory=dict)

    @property
    def bytes(self) -> int:
        return sum(c.bytes for c in self.commits)


@dataclass(slots=True)
class ExportReport:
    batches: list[BatchReport]
    offsets: dict[str, int]  # queue key -> exported offset (next to export)
    # queue key -> why this export stopped that queue (a missing or damaged segment)
    stopped: dict[str, str] = field(default_factory=dict)

    @property
    def rows(self) -> int:
        return sum(b.rows for b in self.batches)


def default_checkpoint(lake: Location, topics: list[str] | None) -> str:
    """Where the export's lock lives (``{checkpoint}.lock``; the name is from the days of a
    Spark checkpoint): beside a local lake, else under ./tmq-data. Named by the topic set, so
    exports of different topic sets never share one."""
    name = "all" if not topics else ",".join(sorted(topics))
    digest = hashlib.sha1(f"{lake.url}|{name}".encode()).hexdigest()[:10]
    label = name if len(name) <= 40 else name[:40]
    base = (
        local_path(lake.url) / "_checkpoints"
        if is_local(lake.url)
        else Path("tmq-data/checkpoints")
    )
    return str((base / f"export-{label}-{digest}").resolve())


class Export:
    """One export job in one Spark session."""

    def __init__(self, spark: SparkSession, config: ExportConfig) -> None:
        self.spark = spark
        self.config = config
        self.tier = Location.of(config.tier_url, config.tier_options)
        self.lake = Location.of(config.lake_root, config.lake_options)
        self.topics = frozenset(config.topics) if config.topics else None
        self.checkpoint = config.checkpoint_dir or default_checkpoint(self.lake, config.topics)
        self.offsets: dict[str, int] = {}
        self.batches: list[BatchReport] = []
        self.stopped: dict[str, str] = {}  # queue key -> the one line an operator reads
        # The process's client of the tier (one per process, as on the executors): making a
        # botocore client costs more than the listing a caught-up run does with it.
        self._store = tier_store(self.tier)
        self._manifests = ManifestCache(self._store)
        # topic -> its table as this run last read it, brought up to date before each use
        # (``update_incremental`` reads only the log's new commits)
        self._tables: dict[str, DeltaTable | None] = {}
        self._continuous = False
        self._last_compaction: dict[str, float] = {}
        # (topic, store_date) -> files committed since the partition was last compacted
        self._new_files: dict[tuple[str, str], int] = {}
        self._rewind: dict[str, int] = {}  # queue key -> next batch starts here, not at its end
        self._error: BaseException | None = None
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._next_batch_id = 0
        self._txn_base = int(time.time() * 1000)  # delta-spark's txnVersion, growing across runs
        self.on_batch: Callable[[BatchReport], None] | None = None

    # -- what is where -------------------------------------------------------------------

    def queues(self) -> list[QueueRef]:
        return discover(self._store, self.topics)

    def exported(self, queues: list[QueueRef]) -> dict[str, int]:
        """The tables' exported offsets (their app transactions) for ``queues``."""
        out: dict[str, int] = {}
        for topic in sorted({q.topic for q in queues}):
            table = self._table(topic)
            out.update(exported_offsets(table, [q for q in queues if q.topic == topic]))
        return out

    def _table(self, topic: str) -> DeltaTable | None:
        """The topic's table at its latest version (None while it does not exist): opened
        once per run, then only the log's new commits are read."""
        table = self._tables.get(topic)
        if table is None:
            table = self._tables[topic] = LakeTable(self.lake, topic).open_for_export()
        else:
            table.update_incremental()
        return table

    # -- the query ------------------------------------------------------------------------

    def _batch_reader(self, start: dict[str, int], end: dict[str, int]) -> DataFrame:
        """The messages ``[start, end)`` through the ``tmq`` source (Spark's own writers)."""
        return (
            self.spark.read.format(tmq_source.NAME)
            .option("tier_url", self.tier.url)
            .option("tier_options", json.dumps(self.tier.options))
            .option("startingOffsets", json.dumps(start))
            .option("endingOffsets", json.dumps(end))
            .load()
        )

    def _write_batch(
        self,
        df: DataFrame,
        batch_id: int,
        packs: tuple[SlicePack, ...] = (),
        archives: dict[str, str] | None = None,
    ) -> None:
        try:
            if self.config.engine == "delta-spark":
                self._write_batch_delta_spark(df, batch_id)
            else:
                self._write_batch_delta_rs(df, batch_id, packs, archives)
        except BaseException as e:
            self._error = e
            raise

    def _write_batch_delta_rs(
        self,
        df: DataFrame,
        batch_id: int,
        packs: tuple[SlicePack, ...] = (),
        archives: dict[str, str] | None = None,
    ) -> None:
        started = time.monotonic()
        export_ts_us = int(time.time() * 1_000_000)
        log.info("batch %d: writing", batch_id)
        # The floors of the batch's own queues (no listing of the tier: the plan names them).
        planned_queues = {QueueRef.parse(s.queue_key) for p in packs for s in p.slices}
        floors = self.exported(
            sorted(planned_queues, key=lambda q: q.key) if packs else self.queues()
        )
        planned = time.monotonic()
        self._check_replaced()  # the manifests this batch was planned on included
        with self._lock:
            stopped = frozenset(self.stopped)
        task = ParquetWriterTask(
            self.lake,
            self.tier,
            floors,
            export_ts_us,
            batch_id,
            stopped,
            packs=packs,
            compression=self.config.compression,
        )
        # Only file metadata comes back to the driver: one row per Parquet file.
        rows = [row.asDict() for row in df.mapInArrow(task, FILE_META_DDL).collect()]
        written = time.monotonic()
        outage = next((r["error"] for r in rows if r["error"] and not r["queue_key"]), None)
        if outage is not None:
            raise ExportError(_unreachable(self.tier.url, outage, batch_id))
        for damage in sorted((r for r in rows if r["error"]), key=lambda r: r["first_offset"]):
            self._damaged(damage["queue_key"], damage["first_offset"], damage["error"])
        files = self._contiguous([r for r in rows if not r["error"]], floors)
        commits = []
        for topic in sorted({f["topic"] for f in files}):
            mine = [f for f in files if f["topic"] == topic]
            delta = self._tables.get(topic)
            if delta is None:
                delta = self._tables[topic] = LakeTable(self.lake, topic).open_or_create()
            commits.append(
                commit_files(self.lake, topic, mine, batch_id, export_ts_us, delta, archives)
            )
        done = time.monotonic()
        report = BatchReport(
            batch_id,
            sum(c.rows for c in commits),
            sum(c.files for c in commits),
            done - started,
            commits,
            {"floors": planned - started, "job": written - planned, "commit": done - written},
        )
        with self._lock:
            self.offsets.update(floors)
            for c in commits:
                self.offsets.update(c.offsets)
            self.batches.append(report)
        log.info(
            "batch %d: committed %d rows in %d files, %.1f s",
            batch_id,
            report.rows,
            report.files,
            report.seconds,
        )
        if self._continuous:
            self._compact([c for c in commits if c.table_version is not None])
        if self.on_batch is not None:
            self.on_batch(report)

    def _compact(self, commits: list[CommitResult]) -> None:
        """Compact on the driver, between batches (never concurrent with the export's own
        commits): a partition that received ``SMALL_FILES`` files since its last compaction
        has its small files merged (the first level), and every ``compact_every_seconds``
        each partition's files below the target are rewritten into one (lakehouse/compaction.py)."""
        every = self.config.compact_every_seconds
        if every is None:
            return
        now = time.monotonic()
        for commit in commits:
            table = LakeTable(self.lake, commit.topic)
            for day, count in commit.partitions.items():
                key = (commit.topic, day)
                self._new_files[key] = self._new_files.get(key, 0) + count
                if self._new_files[key] >= self.config.compact_after_files:
                    self._new_files[key] = 0
                    merged = compact_partition(table, day, SMALL_FILE_BYTES)
                    log.info("%s/%s: merged %d small files", commit.topic, day, merged)
            last = self._last_compaction.setdefault(commit.topic, now)
            if now - last < every:
                continue
            self._last_compaction[commit.topic] = now
            for key in [k for k in self._new_files if k[0] == commit.topic]:
                self._new_files[key] = 0
            compacted = compact_small_files(table, self.config.target_file_bytes)
            if compacted:
                log.info("%s: compacted %d small files", commit.topic, compacted)

    def _check_tables(self, queues: list[QueueRef]) -> None:
        """Stop the queues of a table this export cannot append to (an older row format)."""
        for topic in sorted({q.topic for q in queues}):
            table = LakeTable(self.lake, topic)
            delta = self._tables[topic] = table.open_for_export()
            if delta is None:
                continue
            try:
                table.check_row_version(delta)
            except TableVersionError as e:
                for q in queues:
                    if q.topic == topic:
                        with self._lock:
                            self.stopped[q.key] = str(e)
                log.error("%s", e)

    def _damaged(self, queue_key: str, offset: int, reason: str) -> None:
        """A slice of ``queue_key`` from ``offset`` could not be read. If retention expired it
        while the batch was reading (``tmq retain`` removes segments from the manifest first,
        then deletes their objects), that is no damage: the queue goes on at the archive's new
        start in the next batch, as for a range that expired before it was planned (Kafka's
        ``failOnDataLoss=false``). Otherwise the queue stops here (a missing or damaged
        object the manifest still names)."""
        # Read it again, even at the version the cache holds: a re-created archive can be at
        # the very same version, its objects other ones (decision 1187).
        start = self._manifests.get(QueueRef.parse(queue_key), reload=True).start_offset
        self._check_replaced()  # the objects gone with the whole archive: not damage
        if queue_key in self.stopped:
            return
        if offset >= start:
            self._stop_queue(queue_key, offset, reason)
            return
        log.warning(
            "%s: offsets %d..%d expired from the tier while a batch read them; continuing at %d",
            queue_key,
            offset,
            start - 1,
            start,
        )
        with self._lock:
            self._rewind[queue_key] = min(offset, self._rewind.get(queue_key, offset))

    def _check_lineage(
        self, queues: list[QueueRef], manifests: list[Any], starting: dict[str, int]
    ) -> None:
        """Stop each queue whose table was exported from another archive than the tier's now:
        the topic deleted and re-created, or its tier prefix wiped and archived again from
        offset 0. Its offsets restart, and the table's exported offset would silently drop the
        new archive's messages below it as a replay (and append the rest after the old
        archive's rows). A queue's tier watermark never goes back, and a segment keeps its
        object key (a fresh suffix per upload) until it expires, so either shows it: the
        archive ends below the exported offset, or the table's last row of the queue came
        from another object than the one the manifest names for that offset. Or the archive id
        the table recorded beside the offset is not the manifest's (decision 1240): the one
        sign left when the new archive's retention already passed the exported offset."""
        recorded: dict[str, str] = {}  # queue key -> the archive its rows came from
        for topic in sorted({q.topic for q in queues}):
            mine = [q for q in queues if q.topic == topic]
            recorded.update(exported_archives(self._tables.get(topic), mine))
        unrecorded: dict[str, dict[str, tuple[int, str]]] = {}  # topic -> queue -> record
        for queue, manifest in zip(queues, manifests, strict=True):
            exported = starting.get(queue.key)
            if not exported or queue.key in self.stopped:
                continue
            why, same = self._lineage_break(queue, manifest, exported, recorded.get(queue.key))
            if why is not None:
                self._refuse_lineage(queue, exported, why)
            elif same and queue.key not in recorded:
                unrecorded.setdefault(queue.topic, {})[queue.key] = (exported, manifest.archive)
        for topic, archives in sorted(unrecorded.items()):
            # A table exported before archive ids: record them now, where the table's last
            # row proves the archive, rather than only at the queue's next commit of rows (a
            # caught-up queue would stay without one until then).
            table = self._tables.get(topic)
            try:
                if table is not None:
                    record_archives(LakeTable(self.lake, topic).location, table, archives)
            except Exception as e:  # the next commit of each queue records it all the same
                log.warning("%s: the archive ids were not recorded: %s", topic, _one_line(e))

    def _lineage_break(
        self, queue: QueueRef, manifest: QueueManifest, exported: int, recorded: str | None
    ) -> tuple[str | None, bool]:
        """How the tier's archive of ``queue`` is not the one its table was exported from up
        to ``exported`` (``recorded``: the archive id the table holds for it, None if none),
        or None; and whether the ids or the table's last row showed it is the same one."""
        if exported > manifest.end_offset:
            return f"the tier's archive of the queue ends at {manifest.end_offset}", False
        changed = None if recorded is None else archive_changed(recorded, manifest.archive)
        if changed is not None:
            return changed, False
        if recorded and recorded == manifest.archive:
            return None, True  # no row to read
        last = exported - 1
        if last < manifest.start_offset:
            return None, False  # expired: nothing left to compare
        segment = manifest.find(last)
        table = self._tables.get(queue.topic)
        source = None if table is None else exported_segment(table, queue, last)
        if segment is None or source is None:
            return None, False
        if source != segment.key:
            why = f"its row at offset {last} came from {source}, where the tier now holds"
            return f"{why} {segment.key}", False
        return None, True

    def _check_replaced(self) -> None:
        """The same refusal while the export runs: a queue whose archive a newer manifest
        replaced instead of continuing (``replaced_by``: the manifest cache compares each
        manifest it re-reads with the one it held, so this costs no request) stops before
        any of the new archive is written. A continuous export used to take the new archive's
        messages below the exported offset as a replay until its next restart."""
        for queue, why in sorted(self._manifests.take_replaced().items()):
            with self._lock:
                exported = self.offsets.get(queue.key)
                if not exported or queue.key in self.stopped:
                    continue
            self._refuse_lineage(queue, exported, why)

    def _refuse_lineage(self, queue: QueueRef, exported: int, why: str) -> None:
        line = (
            f"queue {queue.key}: the table {LakeTable(self.lake, queue.topic).uri} was "
            f"exported up to offset {exported} from another archive ({why}): the topic "
            "was deleted and re-created, or its tier prefix wiped; move the table aside "
            f"(e.g. rename it to {queue.topic}_old) and run the export again: it rebuilds "
            "the table from the tier's archive"
        )
        with self._lock:
            self.stopped[queue.key] = line
        log.error("%s", line)

    def _stop_queue(self, queue_key: str, offset: int, reason: str) -> None:
        """Stop exporting one queue for the rest of this run; every other queue goes on."""
        with self._lock:
            if queue_key in self.stopped:
                return
            topic = QueueRef.parse(queue_key).topic
            self.stopped[queue_key] = (
                f"queue {queue_key} stopped at offset {offset}: {reason}; run `tmq verify "
                f"{topic}`, restore or re-upload the object, then run the export again (it "
                f"resumes this queue at {offset})"
            )
            log.error("%s", self.stopped[queue_key])

    def _contiguous(
        self, files: list[dict[str, Any]], floors: dict[str, int]
    ) -> list[dict[str, Any]]:
        """The file rows that continue each queue's exported range without a gap. A gap (a
        slice that failed in another task, or a checkpoint ahead of the table) stops the queue
        rather than letting its exported offset jump over messages; a range that expired from
        the tier is no gap.

        A file holds several queues' rows and is committed whole or not at all, so a file
        dropped for one queue's gap cuts every other queue in it at that file: those queues
        are not stopped, their rest is left out of this batch and planned again by the next
        one (``_rewind``)."""
        by_queue: dict[str, list[dict[str, Any]]] = {}
        for f in files:
            by_queue.setdefault(f["queue_key"], []).append(f)
        dropped: set[str] = set()  # paths this batch does not commit
        cut_at: dict[str, int] = {}  # queue key -> where a dropped file cut it
        changed = True
        while changed:  # until no dropped file cuts another queue
            changed = False
            for key, mine in sorted(by_queue.items()):
                queue = QueueRef.parse(key)
                expected = floors.get(key)
                if expected is None:
                    expected = self._manifests.get(queue, refresh=False).start_offset
                cut = False
                for f in sorted(mine, key=lambda f: f["first_offset"]):
                    if not cut:
                        if f["last_offset"] < expected:
                            continue  # already exported (a replay): commit_files skips it too
                        gap = f["first_offset"] > expected
                        if f["path"] in dropped:
                            cut_at[key] = min(cut_at.get(key, expected), expected)
                            cut = True
                        elif gap and self._manifests.get(queue).start_offset < f["first_offset"]:
                            self._stop_queue(
                                key,
                                expected,
                                f"offsets {expected}..{f['first_offset'] - 1} were not read in "
                                "this batch",
                            )
                            cut = True
                        else:
                            expected = f["last_offset"] + 1
                            continue
                    if f["path"] not in dropped:  # the rest of a cut queue: left out
                        dropped.add(f["path"])
                        changed = True
        with self._lock:
            for key, offset in cut_at.items():
                if key not in self.stopped:
                    self._rewind[key] = min(offset, self._rewind.get(key, offset))
        return [f for f in files if f["path"] not in dropped]

    def _next_position(self, end: dict[str, int]) -> dict[str, int]:
        """Where the batch after one that planned up to ``end`` starts: ``end``, except for the
        queues whose last batch was cut short (``_contiguous``)."""
        with self._lock:
            rewind, self._rewind = self._rewind, {}
        return {**end, **rewind}

    def _write_batch_delta_spark(self, df: DataFrame, batch_id: int) -> None:
        """Spark's own Delta writer. Its idempotence is Delta's txnAppId/txnVersion pair; the
        version grows across runs (the run's start in ms plus the batch id), so no later run's
        batch is mistaken for one already written. Without app transactions per queue it is
        at-least-once across a crash, not exactly-once."""
        started = time.monotonic()
        stamped = df.withColumn("export_ts", F.current_timestamp())
        topics = [r.topic for r in stamped.select("topic").distinct().collect()]
        for topic in topics:
            (
                stamped.where(F.col("topic") == topic)
                .write.format("delta")
                .mode("append")
                .option("txnAppId", f"tmq-export:{self.checkpoint}")
                .option("txnVersion", self._txn_base + batch_id)
                .partitionBy("store_date")
                .save(LakeTable(self.lake, topic).location.url)
            )
        with self._lock:
            self.batches.append(BatchReport(batch_id, 0, 0, time.monotonic() - started, []))

    def _warm_up(self) -> None:
        """Run a tiny job through the same Python paths as a batch (the tmq source's planner
        and reader, mapInArrow), so that a standby's first batch after takeover does not pay
        for starting Python workers and loading classes."""
        sample = self.spark.read.format(tmq_source.NAME).options(
            tier_url=self.tier.url,
            tier_options=json.dumps(self.tier.options),
            endingOffsets=json.dumps({}),
            topics="-",  # no such topic: plans nothing, reads nothing
        )
        sample.load().mapInArrow(_passthrough, sample.load().schema).collect()

    def _check_engine(self) -> None:
        if self.config.engine != "delta-spark":
            return
        jvm = getattr(self.spark, "_jvm", None)
        try:
            assert jvm is not None
            jvm.java.lang.Class.forName("io.delta.tables.DeltaTable")
        except Exception:
            raise ExportError(
                "--engine delta-spark needs the Delta Lake jars (io.delta:delta-spark_2.13) on "
                "Spark's classpath and none were found; add them with --jars or "
                "spark.jars.packages, or use the default --engine delta-rs"
            ) from None

    def run(self, *, once: bool, timeout: float | None = None) -> ExportReport:
        """Export until caught up (``once``) or until ``stop()``; returns what was done."""
        self._check_engine()
        lock = CheckpointLock(self.checkpoint)
        try:
            if self.config.standby:
                self._warm_up()
                log.info("standby: waiting for the export holding %s", lock.path)
            if not lock.acquire(wait=self.config.standby, stop=self._stop):
                return ExportReport([], dict(self.offsets), dict(self.stopped))
        except ExportLockedError as e:
            raise ExportError(str(e)) from None
        try:
            return self._run(once=once, timeout=timeout)
        except StorageError as e:  # listing or manifests, on the driver
            raise ExportError(_unreachable(self.tier.url, _one_line(e), None)) from None
        finally:
            lock.release()

    def _run(self, *, once: bool, timeout: float | None) -> ExportReport:
        queues = self.queues()
        names = ", ".join(sorted(self.topics)) if self.topics else "any topic"
        if not queues and once:
            raise ExportError(f"{self.tier.url}: no archived queues of {names}")
        if not queues:
            # A broker's export starts before its first offload: wait for the first segment.
            log.info("%s: nothing archived of %s yet; waiting", self.tier.url, names)
            while not queues:
                if self._stop.wait(self.config.trigger_seconds):
                    return ExportReport([], {})
                queues = self.queues()
        self._check_tables(queues)
        starting = {}
        for topic in sorted({q.topic for q in queues}):  # the tables _check_tables just read
            mine = [q for q in queues if q.topic == topic]
            starting.update(exported_offsets(self._tables.get(topic), mine))
        self.offsets = dict(starting)
        # Read here for both modes: ``--once``'s targets, and the lineage check.
        manifests = self._manifests.get_many(queues)
        self._check_lineage(queues, manifests, starting)
        if once:
            # Bounded by the tier watermarks as they are now: what "archived so far" means.
            targets = {q.key: m.end_offset for q, m in zip(queues, manifests, strict=True)}
            if self._reached(targets, queues, self._manifests):
                log.info("nothing new to export")
                return ExportReport([], dict(self.offsets), dict(self.stopped))
            return self._run_batches(starting, targets, queues, timeout=timeout)
        self._continuous = True
        return self._run_continuous(starting, timeout=timeout)

    def _planner(self, starting: dict[str, int], ending: dict[str, int] | None) -> Planner:
        return Planner(
            SourceOptions(
                tier=self.tier,
                topics=self.topics,
                starting=starting or None,
                ending=ending,
                max_bytes_per_trigger=self.config.max_bytes_per_trigger,
                max_segments_per_trigger=self.config.max_segments_per_trigger,
                bytes_per_partition=self.config.bytes_per_partition,
            ),
            self._manifests,  # already read for the targets
        )

    def _run_batches(
        self,
        starting: dict[str, int],
        targets: dict[str, int],
        queues: list[QueueRef],
        *,
        timeout: float | None,
    ) -> ExportReport:
        """``--once`` as a sequence of batch jobs planned here, on the driver: the source's
        slices and admission control, bounded by ``targets``."""
        planner = self._planner(starting, targets)
        planner.relist(queues)  # the run's one listing: its targets name these queues
        deadline = None if timeout is None else time.monotonic() + timeout
        # The manifests were read for the targets a moment ago: the first batch is planned on
        # them; later batches look for newer ones (retention may have moved a start).
        position = planner.initial(refresh=False)
        first = True
        while not self._stop.is_set() and not self._reached(targets, queues, self._manifests):
            if deadline is not None and time.monotonic() > deadline:
                raise ExportError(f"export did not finish within {timeout:.0f} s")
            end = planner.latest(position, refresh=not first)
            first = False
            if end == position:
                break  # nothing left below the targets (the rest expired or is stopped)
            self._batch(planner, position, end)
            position = self._next_position(end)
        return ExportReport(list(self.batches), dict(self.offsets), dict(self.stopped))

    def _run_continuous(self, starting: dict[str, int], *, timeout: float | None) -> ExportReport:
        """Continuous mode: the batch jobs of ``--once`` in a loop, in this one Spark session,
        until ``stop()``. Every trigger interval the planner reads the manifests (new topics
        and queues included) and runs batches until it has nothing more to admit, then waits
        for the next interval. No streaming query and no Spark checkpoint: progress is the
        tables' app transactions, as for ``--once`` (decision 270)."""
        planner = self._planner(starting, None)
        deadline = None if timeout is None else time.monotonic() + timeout
        position = planner.initial()
        trigger = self.config.trigger_seconds
        while not self._stop.is_set():
            if deadline is not None and time.monotonic() > deadline:
                break
            started = time.monotonic()
            planner.relist()  # new topics and queues: once per interval, not once per batch
            end = planner.latest(position)
            self._check_replaced()  # reported at once, even with nothing to export
            while end != position and not self._stop.is_set():  # a backlog: back to back
                self._batch(planner, position, end)
                position = self._next_position(end)
                end = planner.latest(position)
                self._check_replaced()
            self._stop.wait(max(0.0, trigger - (time.monotonic() - started)))
        return ExportReport(list(self.batches), dict(self.offsets), dict(self.stopped))

    def _batch(self, planner: Planner, position: dict[str, int], end: dict[str, int]) -> None:
        """One batch job: the slices ``[position, end)`` spread over the cores, written and
        committed."""
        start, end = self._live_range(position, end)
        slices = planner.slices(start, end)
        # The archive each queue's slices were planned from (the manifests ``slices`` just
        # used): recorded beside its exported offset (decision 1240).
        archives = {
            key: self._manifests.get(QueueRef.parse(key), refresh=False).archive
            for key in {s.queue_key for s in slices}
        }
        cores = self.spark.sparkContext.defaultParallelism
        packs = tuple(balanced_packs(slices, cores))
        batch_id = self._next_batch_id
        self._next_batch_id += 1
        if self.config.engine == "delta-spark":
            frame = self._batch_reader(start, end)
        else:
            # One Spark task per pack.
            frame = self.spark.range(0, len(packs), 1, max(1, len(packs)))
        try:
            self._write_batch(frame, batch_id, packs, archives)
        except (ExportError, StorageError):
            raise  # already one line, or the tier's outage (``run`` says so)
        except Exception as e:  # a failed Spark job or commit: one line, no traceback
            raise ExportError(_one_line(e)) from None

    def _live_range(
        self, position: dict[str, int], end: dict[str, int]
    ) -> tuple[dict[str, int], dict[str, int]]:
        """The batch's range ``[position, end)`` without the stopped queues (each one's range
        made empty at its position), for either engine: the slices of the default engine and
        the ``tmq`` source's offsets of delta-spark's reader come from it. A queue stopped by
        an archive that was replaced (``_check_replaced``, taken here first), damage or a
        table it cannot append to is never read again in this run; delta-spark's batches used
        to read and append it regardless. (The default engine's writer also skips the queues
        stopped after this, while its batch was planned.)"""
        self._check_replaced()
        with self._lock:
            stopped = frozenset(self.stopped)
        start, bounded = dict(position), dict(end)
        for key in stopped & bounded.keys():
            start[key] = bounded[key] = position.get(key, bounded[key])
        return start, bounded

    def _reached(
        self,
        targets: dict[str, int],
        queues: list[QueueRef],
        manifests: ManifestCache,
    ) -> bool:
        """Every queue exported up to its target, or holding nothing below it."""
        with self._lock:
            offsets = dict(self.offsets)
        for q in queues:
            if q.key in self.stopped:
                continue
            target = targets[q.key]
            exported = offsets.get(q.key)
            if exported is not None and exported >= target:
                continue
            if manifests.get(q, refresh=False).start_offset >= target:
                continue  # nothing retained below the target (empty, or all expired)
            return False
        return True

    def stop(self) -> None:
        """Ask a running ``run()`` to stop after the current batch (thread- and signal-safe)."""
        self._stop.set()


def _passthrough(batches: Iterable[Any]) -> Iterator[Any]:
    yield from batches


def _unreachable(tier_url: str, reason: str, batch_id: int | None) -> str:
    """The one line of an export the object store stopped answering."""
    batch = "the batch it was planning" if batch_id is None else f"batch {batch_id}"
    return (
        f"the tier {tier_url} did not answer ({reason}); nothing of {batch} was committed: "
        "run the export again once the object store is back (it resumes where the tables say)"
    )


def _one_line(error: BaseException | None) -> str:
    if error is None:
        return "the export query stopped"
    text = str(error).strip() or type(error).__name__
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith(("Traceback", "File ", "JVM stacktrace")):
            return line[:500]
    return text.splitlines()[0][:500]
