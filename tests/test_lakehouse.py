"""Lakehouse: archived topics become Delta tables, exactly once, with real Spark and real Delta.

One Spark session (``spark`` fixture) serves every in-process test; the fault and continuous
tests run the export as real child processes, as operators and the broker do.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import duckdb
import polars as pl
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
from broker_harness import REPO, tmq
from conftest import mounted_tmpfs
from deltalake import DeltaTable
from lakehouse_harness import Archive, LiveTopic, expected_rows, exported_to, run_in_thread
from s3_buckets import bucket_name, delete_bucket

from lakehouse.export import Export, ExportConfig, ExportError
from lakehouse.locations import Location
from lakehouse.lock import CheckpointLock
from lakehouse.runner import ContinuousExport, LakehouseConfig
from lakehouse.sink import ParquetWriterTask, commit_files
from lakehouse.source import Planner, SourceOptions, read_slice
from lakehouse.tables import LakeTable, app_id, exported_offsets
from lakehouse.tier import QueueRef
from tiered.cold.manifest import ManifestLog
from tiered.cold.storage import open_store
from tiered.record import Message

TOPICS = ("orders", "payments")


def delta_rows(lake: Path, topic: str) -> list[dict[str, Any]]:
    """The table's rows as delta-rs reads them (no tmq code involved)."""
    table = DeltaTable(str(lake / topic)).to_pyarrow_table()
    return sorted(
        (
            {
                "queue_id": r["queue_id"],
                "queue_offset": r["queue_offset"],
                "commitlog_offset": r["commitlog_offset"],
                "body": r["body"],
                "keys": r["keys"],
                "tags": r["tags"],
                "msg_id": r["msg_id"],
                "born_ms": int(r["born_ts"].timestamp() * 1000),
                "store_ms": int(r["store_ts"].timestamp() * 1000),
            }
            for r in table.to_pylist()
        ),
        key=lambda r: (r["queue_id"], r["queue_offset"]),
    )


# -- backfill over S3 -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def backfilled(
    tmp_path_factory: pytest.TempPathFactory, s3: Any, spark: Any
) -> Iterator[dict[str, Any]]:
    """20,000 messages on 2 topics in an S3 tier, exported once to a local lake; the bucket is
    deleted after the module's tests."""
    root = tmp_path_factory.mktemp("backfill")
    bucket = bucket_name("lake")
    client = s3.client()
    client.create_bucket(Bucket=bucket)
    try:
        yield _backfill(root, bucket, s3, spark)
    finally:
        delete_bucket(client, bucket)


def _backfill(root: Path, bucket: str, s3: Any, spark: Any) -> dict[str, Any]:
    tier_url = f"s3://{bucket}/tier"
    archive = Archive.open(root / "hot", open_store(tier_url, s3.storage_options()), queues=2)
    try:
        for topic in TOPICS:
            archive.produce(topic, 10_000)
            archive.offload(topic)
        expected = {t: expected_rows(archive.messages(t)) for t in TOPICS}
    finally:
        archive.close()
    config = ExportConfig(
        tier_url=tier_url,
        lake_root=str(root / "lake"),
        tier_options=s3.storage_options(),
        max_segments_per_trigger=6,  # 20 segments: four bounded micro-batches
    )
    started = time.monotonic()
    report = Export(spark, config).run(once=True, timeout=180)
    return {
        "root": root,
        "lake": root / "lake",
        "config": config,
        "report": report,
        "expected": expected,
        "seconds": time.monotonic() - started,
    }


def test_backfill_exports_every_archived_message_exactly_once(backfilled: dict[str, Any]) -> None:
    lake, expected, report = backfilled["lake"], backfilled["expected"], backfilled["report"]
    assert report.rows == 20_000
    assert len(report.batches) >= 4, "the admission cap splits the backfill into batches"
    for topic in TOPICS:
        got = delta_rows(lake, topic)
        assert len(got) == 10_000
        assert got == expected[topic], f"{topic}: bodies, keys, tags, offsets, timestamps"


def test_backfilled_tables_read_the_same_with_polars_and_duckdb(backfilled: dict[str, Any]) -> None:
    lake, expected = backfilled["lake"], backfilled["expected"]
    for topic in TOPICS:
        frame = pl.read_delta(str(lake / topic)).sort(["queue_id", "queue_offset"])
        assert frame.height == 10_000
        assert frame["body"].to_list() == [r["body"] for r in expected[topic]]
        assert frame["tags"].to_list() == [r["tags"] for r in expected[topic]]
        stamps = frame["store_ts"].dt.epoch("ms").to_list()
        assert stamps == [r["store_ms"] for r in expected[topic]]
        dates = frame.select(pl.col("store_ts").dt.date() == pl.col("store_date")).to_series()
        assert dates.all(), "store_date is the UTC date of store_ts"
    # DuckDB, offline: over delta-rs's Arrow dataset (docs/lakehouse.md).
    orders = DeltaTable(str(lake / "orders")).to_pyarrow_dataset()  # noqa: F841 (used by SQL)
    counts = duckdb.sql("select tags, count(*) from orders group by tags").fetchall()
    assert dict(counts) == Counter(r["tags"] for r in expected["orders"])


def test_a_second_once_adds_nothing(backfilled: dict[str, Any], spark: Any) -> None:
    lake = backfilled["lake"]
    versions = {t: DeltaTable(str(lake / t)).version() for t in TOPICS}
    started = time.monotonic()
    report = Export(spark, backfilled["config"]).run(once=True, timeout=120)
    assert time.monotonic() - started <= 5, "a caught-up --once starts no query"
    assert report.rows == 0 and report.batches == []
    assert {t: DeltaTable(str(lake / t)).version() for t in TOPICS} == versions


def test_tables_use_only_features_every_reader_supports(backfilled: dict[str, Any]) -> None:
    table = DeltaTable(str(backfilled["lake"] / "orders"))
    protocol = table.protocol()
    assert (protocol.min_reader_version, protocol.min_writer_version) == (1, 2)
    assert not protocol.reader_features and not protocol.writer_features
    assert table.metadata().partition_columns == ["store_date"]
    assert table.metadata().configuration["delta.appendOnly"] == "true"
    assert table.transaction_version(app_id(QueueRef("c1", "broker-a", "orders", 0))) == 5000


# -- analysts ---------------------------------------------------------------------------------


def test_query_counts_by_tag_match_the_produced_messages(backfilled: dict[str, Any]) -> None:
    expected = Counter(r["tags"] for r in backfilled["expected"]["orders"])
    done = tmq(
        "lakehouse",
        "query",
        "select tags, count(*) as n from orders group by tags",
        "--lake-root",
        str(backfilled["lake"]),
        "--json",
    )
    assert done.returncode == 0, done.stderr
    got = {row["tags"]: row["n"] for row in map(json.loads, done.stdout.splitlines())}
    assert got == dict(expected)


def test_spark_sql_over_the_snapshot_returns_the_same_counts(
    backfilled: dict[str, Any], spark: Any
) -> None:
    uri = str(backfilled["lake"] / "orders")
    files = DeltaTable(uri).file_uris()
    spark.read.option("basePath", uri).parquet(*files).createOrReplaceTempView("orders")
    rows = spark.sql("select tags, count(*) as n from orders group by tags").collect()
    expected = Counter(r["tags"] for r in backfilled["expected"]["orders"])
    assert {r["tags"]: r["n"] for r in rows} == dict(expected)
    dates = spark.sql("select count(*) from orders where to_date(store_ts) != store_date")
    assert dates.collect()[0][0] == 0


def test_status_reports_offsets_rows_and_zero_lag_when_caught_up(
    backfilled: dict[str, Any],
) -> None:
    done = tmq("lakehouse", "status", "--lake-root", str(backfilled["lake"]), "--json")
    assert done.returncode == 0, done.stderr
    by_topic = {s["topic"]: s for s in json.loads(done.stdout)}
    assert set(by_topic) == set(TOPICS)
    assert all(s["rows"] == 10_000 for s in by_topic.values())


# -- source and sink units --------------------------------------------------------------------


@pytest.fixture
def small_archive(tmp_path: Path) -> Iterator[Archive]:
    archive = Archive.open(
        tmp_path / "hot", open_store(f"file://{tmp_path}/tier"), queues=2, segment_messages=100
    )
    yield archive
    archive.close()


def test_admission_control_caps_segments_oldest_first(small_archive: Archive, tmp_path: Path):
    small_archive.produce("orders", 1000)  # 5 segments per queue
    small_archive.offload("orders")
    options = {"tier_url": f"file://{tmp_path}/tier", "maxSegmentsPerTrigger": "3"}
    planner = Planner(SourceOptions.parse(options))
    position = planner.initial()
    assert position == {"c1/broker-a/orders/0": 0, "c1/broker-a/orders/1": 0}
    batches = 0
    while True:
        end = planner.latest(position)
        if end == position:
            break
        admitted = sum(end[k] - position[k] for k in end)
        assert admitted <= 300, "at most three 100-message segments per micro-batch"
        slices = planner.slices(position, end)
        assert sum(s.end - s.first for s in slices) == admitted
        position, batches = end, batches + 1
    assert batches == 4 and position == {"c1/broker-a/orders/0": 500, "c1/broker-a/orders/1": 500}


def test_a_replayed_batch_is_written_and_committed_as_nothing(
    small_archive: Archive, tmp_path: Path
) -> None:
    """The crash after a Delta commit but before Spark's checkpoint: Spark replays the batch."""
    small_archive.produce("orders", 10)
    small_archive.offload("orders")
    lake = Location.of(str(tmp_path / "lake"))
    planner = Planner(SourceOptions.parse({"tier_url": f"file://{tmp_path}/tier"}))
    start = planner.initial()
    slices = planner.slices(start, planner.latest(start))
    source = [batch for s in slices for batch in read_slice(planner.options.tier, s)]

    def write(floors: dict[str, int]) -> list[dict[str, Any]]:
        task = ParquetWriterTask(lake, planner.options.tier, floors, export_ts_us=0, batch_id=0)
        return task.write_rows(iter(source))

    files = write({})
    first = commit_files(lake, "orders", files, 0, 0)
    assert first.rows == 10
    assert first.offsets == {"c1/broker-a/orders/0": 5, "c1/broker-a/orders/1": 5}
    floors = exported_offsets(LakeTable(lake, "orders").open(), planner.queues())
    assert write(floors) == [], "the executors skip rows the table has"
    again = commit_files(lake, "orders", files, 0, 0)  # and the driver skips stale files
    assert again.table_version is None and again.rows == 0
    assert DeltaTable(str(tmp_path / "lake" / "orders")).to_pyarrow_table().num_rows == 10


def watched(spark: Any, tmp_path: Path, **settings: Any) -> tuple[Export, list[Any]]:
    """An export of ``{tmp_path}/tier`` to ``{tmp_path}/lake`` with its lock named
    ``{tmp_path}/ckpt``, whose batches note the streaming queries active while they run."""
    queries: list[Any] = []
    config = ExportConfig(
        f"file://{tmp_path}/tier",
        str(tmp_path / "lake"),
        checkpoint_dir=str(tmp_path / "ckpt"),
        **settings,
    )
    job = Export(spark, config)
    job.on_batch = lambda _: queries.extend(spark.streams.active)
    return job, queries


def test_once_runs_plain_batch_jobs_not_a_streaming_query(
    small_archive: Archive, tmp_path: Path, spark: Any
) -> None:
    """--once plans on the driver and runs Spark jobs: no query, so no Python source processes
    to start and no Spark checkpoint; progress is the table's alone (decision 190)."""
    small_archive.produce("orders", 1000)  # ten segments
    small_archive.offload("orders")
    checkpoint = tmp_path / "ckpt"
    job, queries = watched(spark, tmp_path, max_segments_per_trigger=4)
    report = job.run(once=True, timeout=120)
    assert report.rows == 1000 and len(report.batches) == 3, "admission control still applies"
    assert queries == [] and not checkpoint.exists(), "no streaming query ran"
    assert delta_rows(tmp_path / "lake", "orders") == expected_rows(
        small_archive.messages("orders")
    )


def test_continuous_runs_the_same_batch_jobs_in_a_loop_and_picks_up_new_topics(
    small_archive: Archive, tmp_path: Path, spark: Any
) -> None:
    """Continuous mode is --once's batches in a loop in this one session: no streaming query
    and no Spark checkpoint, a backlog in bounded batches back to back, then one batch per
    trigger for what the tier gains (a topic that appears later included), each writing at
    most one file per partition, whatever the number of queues (decisions 270, 340)."""
    small_archive.produce("orders", 600)  # three segments per queue
    small_archive.offload("orders")
    checkpoint = tmp_path / "ckpt"
    job, queries = watched(
        spark, tmp_path, trigger_seconds=0.5, max_segments_per_trigger=2, compact_every_seconds=None
    )
    runner, errors = run_in_thread(job)
    try:
        lake = tmp_path / "lake"
        deadline = time.monotonic() + 120
        # The job's own record of a batch follows its Delta commit: wait for both, or the
        # third batch's rows can be visible while only two batches are counted.
        while exported_rows(lake, "orders") < 600 or sum(b.rows for b in job.batches) < 600:
            assert not errors and time.monotonic() < deadline, errors or "backlog not exported"
            time.sleep(0.1)
        backlog = len(job.batches)
        small_archive.produce("orders", 50)
        small_archive.produce("payments", 40)  # a topic the export has not seen yet
        small_archive.offload("orders")
        small_archive.offload("payments")
        while exported_rows(lake, "orders") < 650 or exported_rows(lake, "payments") < 40:
            assert not errors and time.monotonic() < deadline, errors or "new rows not exported"
            time.sleep(0.1)
    finally:
        job.stop()
        runner.join(60)
    assert not runner.is_alive() and not errors, errors
    assert backlog == 3, "six segments, two per batch"
    assert queries == [] and not checkpoint.exists(), "no streaming query ran"
    assert all(b.files <= 1 for b in job.batches if b.rows), "one file per partition and batch"
    for topic in ("orders", "payments"):
        assert delta_rows(lake, topic) == expected_rows(small_archive.messages(topic))


def export_commits(table: Path) -> list[Counter[str]]:
    """Per export commit in the Delta log (read as JSON, no tmq code): files added per
    partition."""
    commits = []
    for entry in sorted((table / "_delta_log").glob("*.json")):
        actions = [json.loads(line) for line in entry.read_text().splitlines() if line]
        info = next(a["commitInfo"] for a in actions if "commitInfo" in a)
        if "tmq.exportBatchId" in json.dumps(info):
            adds = [a["add"] for a in actions if "add" in a]
            commits.append(Counter(a["partitionValues"]["store_date"] for a in adds))
    return commits


def test_continuous_writes_one_file_per_partition_and_merges_small_files(
    tmp_path: Path, spark: Any
) -> None:
    """Four queues, a batch per offload: every export commit adds at most one file per
    partition, and the first compaction level keeps the partition to a few files (the count is
    measured from the Delta log; decision 340)."""
    archive = Archive.open(
        tmp_path / "hot", open_store(f"file://{tmp_path}/tier"), queues=4, segment_messages=1000
    )
    job, _ = watched(
        spark, tmp_path, trigger_seconds=0.2, compact_every_seconds=3600, compact_after_files=4
    )
    lake = tmp_path / "lake"
    runner, errors = run_in_thread(job)
    try:
        deadline = time.monotonic() + 150
        for round_ in range(1, 10):
            archive.produce("orders", 40)  # ten messages for each of the four queues
            archive.offload("orders")
            while exported_rows(lake, "orders") < 40 * round_:
                assert not errors and time.monotonic() < deadline, errors or "not exported"
                time.sleep(0.05)
        expected = expected_rows(archive.messages("orders"))
    finally:
        job.stop()
        runner.join(60)
        archive.close()
    assert not runner.is_alive() and not errors, errors
    commits = export_commits(lake / "orders")
    assert len(commits) >= 5 and all(c and max(c.values()) == 1 for c in commits), commits
    files = DeltaTable(str(lake / "orders")).get_add_actions(flatten=True).num_rows
    print(f"{len(commits)} export commits of one file each, {files} files in the table")
    assert files <= 4, "merged every four new files"
    assert delta_rows(lake, "orders") == expected, "exactly once, through the merges too"


def test_delta_spark_engine_without_jars_fails_with_a_clear_message(
    small_archive: Archive, tmp_path: Path, spark: Any
) -> None:
    small_archive.produce("orders", 10)
    small_archive.offload("orders")
    config = ExportConfig(f"file://{tmp_path}/tier", str(tmp_path / "lake"), engine="delta-spark")
    with pytest.raises(ExportError, match="needs the Delta Lake jars"):
        Export(spark, config).run(once=True)


def test_delta_spark_batches_leave_out_the_stopped_queues(
    small_archive: Archive, tmp_path: Path, spark: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """delta-spark's batches honour the stop list the default engine honours (decision 1185):
    a queue stopped mid-run (damage, a re-created archive, a table of another row format) is
    not read again. Its batches used to read every queue of the plan and append them. The
    Delta jars are absent here, so the two jar-bound steps are replaced: the jar check, and
    Spark's Delta write, which collects the batch's real DataFrame (the ``tmq`` source over a
    real archive, read by this Spark session) instead of writing it."""
    small_archive.produce("orders", 600)  # three segments of 100 in each of two queues
    small_archive.offload("orders")
    config = ExportConfig(
        f"file://{tmp_path}/tier", str(tmp_path / "lake"), engine="delta-spark",
        max_segments_per_trigger=2,
    )  # fmt: skip
    job = Export(spark, config)
    stopped = QueueRef("c1", "broker-a", "orders", 0)
    batches: list[list[tuple[int, int]]] = []

    def collect(df: Any, batch_id: int) -> None:
        rows = df.select("queue_id", "queue_offset").collect()
        batches.append(sorted((r.queue_id, r.queue_offset) for r in rows))
        if batch_id == 0:  # as damage or a replaced archive stops it
            job._stop_queue(stopped.key, 100, "stopped by the test")

    monkeypatch.setattr(job, "_check_engine", lambda: None)
    monkeypatch.setattr(job, "_write_batch_delta_spark", collect)
    report = job.run(once=True, timeout=300)
    assert set(report.stopped) == {stopped.key}
    assert len(batches) >= 2, batches
    assert (0, 0) in batches[0], "the queue was read before it stopped"
    later = [row for batch in batches[1:] for row in batch]
    assert not [r for r in later if r[0] == 0], "a stopped queue read again"
    first = {r for r in batches[0] if r[0] == 1}
    assert sorted(later) == sorted({(1, o) for o in range(300)} - first), "the other goes on"


def test_export_needs_once_or_continuous() -> None:
    done = tmq("lakehouse", "export", "orders")
    assert done.returncode == 2
    assert done.stderr.strip() == "error: give exactly one of --once and --continuous"


# -- exactly once under faults ----------------------------------------------------------------

# Child JVMs only start, shuttle Arrow buffers and stop: the C1 compiler alone halves their
# start-up on this 2-core machine, and start-up is most of what these tests wait for.
FAST_START = ["--conf", "spark.driver.extraJavaOptions=-Xss16m -XX:TieredStopAtLevel=1"]


class ExportChild:
    """``tmq lakehouse export --once`` as a child process in its own process group."""

    def __init__(self, tier: str, lake: Path, checkpoint: Path, *extra: str) -> None:
        self.proc = subprocess.Popen(
            [
                sys.executable, "-m", "cli.app", "lakehouse", "export", "--once",
                "--tier-url", tier, "--lake-root", str(lake), "--checkpoint", str(checkpoint),
                "--max-segments-per-trigger", "4", "--master", "local[1]", *FAST_START, *extra,
            ],
            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            start_new_session=True,  # its own group: SIGKILL reaches its Spark JVM too
        )  # fmt: skip
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)

    def wait_for(self, text: str, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while not any(text in line for line in self.lines):
            assert self.proc.poll() is None, "".join(self.lines[-30:])
            assert time.monotonic() < deadline, f"no {text!r} in {timeout} s"
            time.sleep(0.05)

    def kill(self) -> None:
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def finish(self, timeout: float = 180) -> str:
        self.proc.wait(timeout)
        self._reader.join(5)
        assert self.proc.returncode == 0, "".join(self.lines[-30:])
        return "".join(self.lines)


def parquet_files(table: Path) -> set[str]:
    return {str(p) for p in table.rglob("*.parquet") if "_delta_log" not in p.parts}


def wait_for_new_file(
    table: Path, known: set[str], child: ExportChild, timeout: float = 60
) -> None:
    deadline = time.monotonic() + timeout
    while not parquet_files(table) - known:
        assert child.proc.poll() is None, "the export ended first: " + "".join(child.lines[-5:])
        assert time.monotonic() < deadline, "no Parquet file written"
        time.sleep(0.01)


# Not `slow`: the export's only kill test, so it stays in the default run (decision 1183).
def test_exactly_once_across_kills_and_a_lost_checkpoint(tmp_path: Path) -> None:
    archive = Archive.open(
        tmp_path / "hot", open_store(f"file://{tmp_path}/tier"), queues=3, segment_messages=100
    )
    # 96 segments: 24 micro-batches of four. On a quiet machine a batch takes 0.2-0.4 s, so a
    # run killed at a random point commits several: with 12 the export could finish before the
    # fifth kill, which then waited for a file that never came (seen in CI).
    archive.produce("orders", 9600)
    archive.offload("orders")
    expected = expected_rows(archive.messages("orders"))
    archive.close()
    tier, lake, checkpoint = f"file://{tmp_path}/tier", tmp_path / "lake", tmp_path / "ckpt"
    table = lake / "orders"
    rng = random.Random(5)
    # A standby (Spark starting, then waiting for the checkpoint lock) takes over after each
    # kill, so the test pays for Spark's start-up beside a running export, not after it.
    child = ExportChild(tier, lake, checkpoint)
    standby = ExportChild(tier, lake, checkpoint, "--standby")
    t0 = time.monotonic()
    for kill in range(5):
        child.wait_for("committed")  # this run has made progress
        lost_checkpoint = kill == 2
        if lost_checkpoint:
            standby.kill()  # it must not take over before the checkpoint is gone
        if kill % 2 == 0:
            wait_for_new_file(table, parquet_files(table), child)  # mid-write, before the commit
        else:
            time.sleep(rng.uniform(0.0, 1.0))  # anywhere: write, commit or checkpoint
        child.kill()
        if lost_checkpoint:
            # The table's app transactions must take over. (--once runs batch jobs and keeps no
            # Spark checkpoint of its own; one left by a continuous export goes too.)
            shutil.rmtree(checkpoint, ignore_errors=True)
            standby = ExportChild(tier, lake, checkpoint)
        child, standby = standby, ExportChild(tier, lake, checkpoint, "--standby")
        print(f"{time.monotonic() - t0:.1f} s: kill {kill + 1}")
    child.finish()
    standby.finish()  # it takes over, finds everything exported, and stops
    print(f"{time.monotonic() - t0:.1f} s: finished")

    rows = delta_rows(lake, "orders")
    keys = Counter((r["queue_id"], r["queue_offset"]) for r in rows)
    assert [k for k, n in keys.items() if n > 1] == [], "no message twice"
    assert rows == expected, "every message, exactly once"

    # The killed batches' Parquet files were never committed; maintain removes them.
    assert parquet_files(table) > set(DeltaTable(str(table)).file_uris()), "orphans exist"
    maintained = tmq("lakehouse", "maintain", "--lake-root", str(lake), "--retention", "0h")
    assert maintained.returncode == 0, maintained.stderr
    assert parquet_files(table) == set(DeltaTable(str(table)).file_uris())
    assert DeltaTable(str(table)).to_pyarrow_table().num_rows == 9600


def test_a_second_export_on_the_same_checkpoint_is_refused(
    small_archive: Archive, tmp_path: Path, spark: Any
) -> None:
    small_archive.produce("orders", 10)
    small_archive.offload("orders")
    config = ExportConfig(
        f"file://{tmp_path}/tier", str(tmp_path / "lake"), checkpoint_dir=str(tmp_path / "ckpt")
    )
    held = CheckpointLock(config.checkpoint_dir or "")
    held.acquire(wait=False)
    try:
        with pytest.raises(ExportError, match=rf"another export \(pid {os.getpid()}\)"):
            Export(spark, config).run(once=True)
    finally:
        held.release()
    assert Export(spark, config).run(once=True, timeout=120).rows == 10, "free again"


def test_a_lock_whose_pid_could_not_be_written_is_released(tmp_path: Path) -> None:
    """The exporter writes its pid into the lock file once it holds the flock. On a full disk
    that write fails: the lock must be let go with the error, not held by a descriptor only
    the garbage collector closes (for as long as anything keeps the error, a standby could
    never take over)."""
    with mounted_tmpfs(tmp_path / "disk", "64k") as mnt:
        lock = CheckpointLock(str(mnt / "ckpt"))
        fd = os.open(mnt / "fill", os.O_WRONLY | os.O_CREAT)
        try:
            with contextlib.suppress(OSError):
                while os.write(fd, bytes(4096)):  # a real full disk: every page taken
                    pass
        finally:
            os.close(fd)
        with pytest.raises(OSError) as failed:
            lock.acquire(wait=False)
        assert failed.value.errno == errno.ENOSPC
        standby = CheckpointLock(str(mnt / "ckpt"))
        (mnt / "fill").unlink()
        assert standby.acquire(wait=False), "the failed exporter still holds the lock"
        standby.release()


# -- continuous -------------------------------------------------------------------------------


def exported_rows(lake: Path, topic: str) -> int:
    try:
        table = DeltaTable(str(lake / topic))
    except Exception:
        return 0
    actions = pa.table(table.get_add_actions(flatten=True))
    return int(pc.sum(actions.column("num_records")).as_py() or 0)


def wait_for_rows(lake: Path, topic: str, n: int, timeout: float, runner: Any) -> float:
    deadline = time.monotonic() + timeout
    while exported_rows(lake, topic) < n:
        assert runner.running(), runner.log_path.read_text()[-3000:]
        assert time.monotonic() < deadline, f"{topic}: fewer than {n} rows after {timeout} s"
        time.sleep(0.2)
    return time.monotonic()


def continuous_export(tmp_path: Path, lake: Path, **settings: Any) -> ContinuousExport:
    """The broker's export child over ``{tmp_path}/tier``, on one core, starting fast."""
    config = LakehouseConfig(
        enabled=True,
        lake_root=str(lake),
        master="local[1]",
        log_path=str(tmp_path / "export.log"),
        spark_conf={"spark.driver.extraJavaOptions": FAST_START[1].split("=", 1)[1]},
        **settings,
    )
    return ContinuousExport(config, f"file://{tmp_path}/tier")


def test_continuous_export_makes_new_offloads_visible_within_seconds(tmp_path: Path) -> None:
    archive = Archive.open(tmp_path / "hot", open_store(f"file://{tmp_path}/tier"), queues=2)
    lake = tmp_path / "lake"
    runner = continuous_export(tmp_path, lake, trigger_seconds=2)
    try:
        archive.produce("orders", 500)
        archive.offload("orders")
        runner.start()
        wait_for_rows(lake, "orders", 500, 120, runner)  # Spark's start-up
        delays = []
        for round_ in range(3):
            archive.produce("orders", 200)
            archive.offload("orders")  # the manifest commit
            committed = time.monotonic()
            visible = wait_for_rows(lake, "orders", 700 + 200 * round_, 60, runner)
            delays.append(visible - committed)
        print(f"continuous export delays (trigger 2 s): {[round(d, 2) for d in delays]}")
        assert max(delays) < 30, delays
        expected = expected_rows(archive.messages("orders"))
    finally:
        runner.stop()
        archive.close()
    assert not runner.running() and runner.restarts == 0
    assert delta_rows(lake, "orders") == expected


# -- the row analysts see ---------------------------------------------------------------------


def test_keys_are_an_array_and_unset_born_times_are_null(
    small_archive: Archive, tmp_path: Path, spark: Any
) -> None:
    store = small_archive.store
    store.put_messages(
        [
            Message("orders", b"a", 0, {"KEYS": "k1 k2  k3", "UNIQ_KEY": "id-a"}, born_timestamp=0),
            Message("orders", b"b", 0, {"UNIQ_KEY": "id-b"}, born_timestamp=1_700_000_000_123),
            Message("orders", b"c", 0, {"KEYS": "solo"}, born_timestamp=0),
        ]
    )
    assert store.wait_dispatched(30)
    small_archive.offloader.offload_queue("orders", 0)
    config = ExportConfig(f"file://{tmp_path}/tier", str(tmp_path / "lake"))
    assert Export(spark, config).run(once=True, timeout=120).rows == 3
    table = DeltaTable(str(tmp_path / "lake" / "orders"))
    schema = json.loads(table.schema().to_json())["fields"]
    types = {f["name"]: f["type"] for f in schema}
    assert types["keys"] == {"type": "array", "elementType": "string", "containsNull": True}
    rows = sorted(table.to_pyarrow_table().to_pylist(), key=lambda r: r["queue_offset"])
    assert [r["keys"] for r in rows] == [["k1", "k2", "k3"], [], ["solo"]]
    assert [r["born_ts"] is None for r in rows] == [True, False, True]
    assert int(rows[1]["born_ts"].timestamp() * 1000) == 1_700_000_000_123
    assert [r["msg_id"] for r in rows] == ["id-a", "id-b", None]
    # Spark reads the array and the nulls as Spark types (the file-list route).
    uri = str(tmp_path / "lake" / "orders")
    frame = spark.read.option("basePath", uri).parquet(*table.file_uris())
    hits = frame.where("array_contains(keys, 'k2') and born_ts is null").count()
    assert hits == 1


def test_every_filter_column_has_statistics_that_skip_files(backfilled: dict[str, Any]) -> None:
    table = DeltaTable(str(backfilled["lake"] / "orders"))
    actions = pa.table(table.get_add_actions(flatten=True)).to_pylist()
    assert actions
    filter_columns = [
        "topic", "broker", "queue_id", "queue_offset", "commitlog_offset", "msg_id", "tags",
        "born_ts", "store_ts", "export_ts", "segment",
    ]  # fmt: skip
    data = table.to_pyarrow_table()
    for action in actions:
        for column in filter_columns:
            assert action[f"min.{column}"] is not None, (column, action["path"])
            assert action[f"max.{column}"] is not None, (column, action["path"])
        assert action["null_count.keys"] == 0
    untagged = sum(1 for r in backfilled["expected"]["orders"] if r["tags"] is None)
    assert sum(a["null_count.tags"] for a in actions) == untagged > 0
    # The bounds are the files' real ones, so a lookup skips every file whose range lacks it.
    lake = backfilled["lake"] / "orders"
    for action in actions:
        ids = pq.read_table(lake / action["path"], columns=["msg_id"]).column("msg_id")
        bounds = pc.min_max(ids)
        assert action["min.msg_id"] == bounds["min"].as_py()
        assert action["max.msg_id"] == bounds["max"].as_py()
    absent = "orders-id-~"  # sorts after every id
    assert [a for a in actions if a["min.msg_id"] <= absent <= a["max.msg_id"]] == []
    some_id = data.column("msg_id")[1234].as_py()
    frame = pl.scan_delta(str(lake)).filter(pl.col("msg_id") == some_id)
    assert frame.collect().height == 1


# -- isolation --------------------------------------------------------------------------------


def test_a_missing_segment_stops_only_its_queue_with_one_clear_line(tmp_path: Path) -> None:
    archive = Archive.open(
        tmp_path / "hot", open_store(f"file://{tmp_path}/tier"), queues=2, segment_messages=100
    )
    for topic in TOPICS:
        archive.produce(topic, 600)  # three segments per queue
        archive.offload(topic)
    expected = {t: expected_rows(archive.messages(t)) for t in TOPICS}
    archive.close()
    tier = open_store(f"file://{tmp_path}/tier")
    damaged = ManifestLog(tier, QueueRef("c1", "broker-a", "orders", 0).prefix).load()
    lost = damaged.segments[1]
    lost_path = tmp_path / "tier" / lost.key
    saved = lost_path.read_bytes()
    lost_path.unlink()
    lake = tmp_path / "lake"
    args = ["--tier-url", f"file://{tmp_path}/tier", "--lake-root", str(lake)]
    spark_args = ["--master", "local[1]", *FAST_START]

    done = tmq("lakehouse", "export", "--once", *args, *spark_args, timeout=300)
    assert done.returncode == 1, done.stdout + done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, done.stderr
    assert lost.key in errors[0] and "tmq verify orders" in errors[0]
    assert f"resumes this queue at {lost.base_offset}" in errors[0]
    assert "Traceback" not in done.stderr and len(done.stderr.splitlines()) < 30, done.stderr
    # Every other queue, and the damaged queue up to the missing object, were exported.
    assert delta_rows(lake, "payments") == expected["payments"]
    orders = delta_rows(lake, "orders")
    assert orders == [
        r for r in expected["orders"] if r["queue_id"] == 1 or r["queue_offset"] < lost.base_offset
    ]

    status = tmq("lakehouse", "status", "--lake-root", str(lake), *args[:2], "--json")
    assert status.returncode == 0, status.stderr
    queues = {q["queue"]: q for s in json.loads(status.stdout) for q in s["queues"]}
    assert lost.key in queues["c1/broker-a/orders/0"]["error"]
    assert queues["c1/broker-a/orders/0"]["exported_offset"] == lost.base_offset
    assert queues["c1/broker-a/orders/1"]["error"] is None

    # The operator restores the object: the next run finishes the queue, exactly once.
    lost_path.write_bytes(saved)
    again = tmq("lakehouse", "export", "--once", *args, *spark_args, timeout=300)
    assert again.returncode == 0, again.stderr
    assert delta_rows(lake, "orders") == expected["orders"]


def test_low_latency_profile_is_fresh_from_produce_and_keeps_few_files(tmp_path: Path) -> None:
    """docs/lakehouse.md's low-latency profile: offload when the oldest pending message is 1 s
    old (checked every second), Spark trigger 1 s. At 20 msgs/s, p95 from the producer's
    acknowledgement to the rows being queryable in Delta is within 15 s, and automatic
    compaction keeps the partition to a few files."""
    archive = Archive.open(tmp_path / "hot", open_store(f"file://{tmp_path}/tier"), queues=2)
    archive.upload_after_ms = 1000
    lake = tmp_path / "lake"
    runner = continuous_export(tmp_path, lake, trigger_seconds=1, compact_every_seconds=5)
    live = LiveTopic(archive, "live", rate_per_s=20, offload_every_s=1.0)
    samples: list[float] = []
    try:
        archive.produce("live", 10)
        archive.offload("live")
        runner.start()
        wait_for_rows(lake, "live", 10, 180, runner)  # Spark's start-up is not freshness
        live.start()
        seen = 0
        stop_at = time.monotonic() + 40
        # Until the producer has stored its last batch: the rows expected below are read from the
        # store, so a batch still being stored is waited for too.
        while time.monotonic() < stop_at or live.producing or seen < len(live.produced):
            assert runner.running(), runner.log_path.read_text()[-3000:]
            assert time.monotonic() < stop_at + 60, "the last messages never became queryable"
            if time.monotonic() >= stop_at and live.producing:
                live.stop_producing()
            table = LakeTable(Location.of(str(lake)), "live").open()
            now = time.monotonic()
            while seen < len(live.produced) and exported_to(table, "live", live.produced[seen][1]):
                samples.append(now - live.produced[seen][0])
                seen += 1
            time.sleep(0.2)
        expected = expected_rows(archive.messages("live"))
    finally:
        live.stop()
        runner.stop()
        archive.close()
    p95 = statistics.quantiles(samples, n=20, method="inclusive")[18]
    print(f"freshness from produce: p50 {statistics.median(samples):.1f} s, p95 {p95:.1f} s")
    assert len(samples) >= 100 and p95 <= 15, sorted(samples)[-10:]
    assert delta_rows(lake, "live") == expected, "every message exactly once, compaction too"
    table = DeltaTable(str(lake / "live"))
    active = table.file_uris()
    written = parquet_files(lake / "live")
    print(f"{len(written)} files written, {len(active)} in the table after compaction")
    assert len(written) >= 3 * len(active), "compaction replaced the per-trigger files"
    assert len(active) <= 12, "one compacted file plus at most the last interval's files"
