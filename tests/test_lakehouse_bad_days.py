"""Lakehouse bad days over LocalStack with real Spark (local[2]): a damaged segment in one task
of a batch while another task exports another queue, and an object-store outage in the middle
of an export (the HTTP fault proxy, localstack/fault_proxy.py). Each asserts from the Delta
table itself (delta-rs reading it, no export code) that no row is lost or written twice."""

from __future__ import annotations

import dataclasses
import random
import struct
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import duckdb
import pyarrow.dataset as pds
import pytest
from conftest import S3Endpoint
from deltalake import DeltaTable
from deltalake.exceptions import TableNotFoundError
from lakehouse_harness import Archive, expected_rows, run_in_thread

from lakehouse import sink
from lakehouse.export import Export, ExportConfig, ExportError
from lakehouse.locations import Location
from lakehouse.query import run_query
from lakehouse.source import Planner, SegmentSlice, SourceOptions, balanced_packs, read_slice
from lakehouse.tables import LakeTable, app_id, archive_app_id
from lakehouse.tier import ManifestCache, QueueRef
from offload.verify import FAILURE, OK, verify_queue
from tiered.cold.manifest import ManifestLog, QueueManifest
from tiered.cold.segment import SegmentError
from tiered.cold.storage import ObjectStore, open_store
from tiered.record import Message

TOPIC = "orders"
A = QueueRef("c1", "broker-a", TOPIC, 0)  # the queue with the damaged segment
B = QueueRef("c1", "broker-a", TOPIC, 1)


def archived(tmp_path: Path, tier_url: str, options: dict[str, Any]) -> list[dict[str, Any]]:
    """Two queues of three segments each, B a little longer (about 10 MB: a batch of two
    equal packs, one per core, cut a little past the end of A, so that the second Spark task
    reads B alone); the expected rows."""
    archive = Archive.open(
        tmp_path / "hot", open_store(tier_url, options), queues=2, segment_messages=400
    )
    try:
        archive.produce(TOPIC, 2400, body_size=4096)
        extra = [Message(TOPIC, random.randbytes(4096), B.queue_id) for _ in range(40)]
        archive.store.put_messages(extra)
        assert archive.store.wait_dispatched(60)
        archive.offload(TOPIC)
        return expected_rows(archive.messages(TOPIC))
    finally:
        archive.close()


def table_rows(lake: Path) -> list[tuple[int, int, bytes]]:
    """(queue, offset, body) of every row of the table, as delta-rs reads it; [] if none."""
    try:
        table = DeltaTable(str(lake / TOPIC)).to_pyarrow_table(
            columns=["queue_id", "queue_offset", "body"]
        )
    except TableNotFoundError:
        return []
    return sorted(
        zip(
            table.column("queue_id").to_pylist(),
            table.column("queue_offset").to_pylist(),
            table.column("body").to_pylist(),
            strict=True,
        )
    )


def wanted(expected: list[dict[str, Any]]) -> list[tuple[int, int, bytes]]:
    return sorted((r["queue_id"], r["queue_offset"], r["body"]) for r in expected)


def first_archive(
    tmp_path: Path, tier_url: str, options: dict[str, Any]
) -> list[tuple[int, int, bytes]]:
    """The topic's first archive: 200 messages of one queue in segments of 50, offloaded; the
    rows an export of it must give."""
    first = growing_first_archive(tmp_path, open_store(tier_url, options))
    try:
        return wanted(expected_rows(first.messages(TOPIC)))
    finally:
        first.close()


def growing_first_archive(tmp_path: Path, store: ObjectStore) -> Archive:
    """``first_archive`` left open, to produce and offload more (the caller closes it)."""
    first = Archive.open(tmp_path / "hot1", store, queues=1, segment_messages=50)
    try:
        first.produce(TOPIC, 200, body_size=100)
        first.offload(TOPIC)
    except BaseException:
        first.close()
        raise
    return first


def archived_again(
    s3: S3Endpoint, bucket: str, tmp_path: Path, tier_url: str, options: dict[str, Any]
) -> Archive:
    """The topic deleted and re-created: its archive wiped from the tier, and a new hot store
    archiving it again from offset 0 (the caller produces and closes it)."""
    client = s3.client()
    listed = client.list_objects_v2(Bucket=bucket, Prefix=f"tier/{A.prefix}")
    for item in listed.get("Contents", []):
        client.delete_object(Bucket=bucket, Key=item["Key"])
    return Archive.open(tmp_path / "hot2", open_store(tier_url, options), queues=1,
                        segment_messages=50)  # fmt: skip


def test_damage_in_one_task_leaves_the_queue_of_another_task_committed_once(
    s3: S3Endpoint, bucket: str, spark: Any, tmp_path: Path
) -> None:
    tier_url, options = f"s3://{bucket}/tier", s3.storage_options()
    expected = wanted(archived(tmp_path, tier_url, options))
    tier = open_store(tier_url, options)
    damaged = ManifestLog(tier, A.prefix).load().segments[1]  # the middle one of three
    # The batch is one pack per core, in queue order: A's damaged segment and most of B are
    # read by two different Spark tasks (what this test is about).
    planner = Planner(
        SourceOptions(
            Location.of(tier_url, options), frozenset([TOPIC]), None, None, None, None, 32 << 20
        ),
        ManifestCache(tier),
    )
    start = planner.initial()
    packs = balanced_packs(planner.slices(start, planner.latest(start)), 2)
    holding = [{s.queue_key for s in p.slices} for p in packs]
    with_damage = [p for p in packs if any(s.segment["key"] == damaged.key for s in p.slices)]
    assert len(packs) == 2 and len(with_damage) == 1, holding
    assert any(keys == {B.key} for keys in holding), holding

    # One byte of a record body in the middle of the object: its CRC fails on decode.
    client = s3.client()
    key = f"tier/{damaged.key}"
    good = client.get_object(Bucket=bucket, Key=key)["Body"].read()
    bad = bytearray(good)
    bad[damaged.offsets_at // 2] ^= 0xFF
    client.put_object(Bucket=bucket, Key=key, Body=bytes(bad))

    lake = tmp_path / "lake"
    config = ExportConfig(tier_url, str(lake), [TOPIC], tier_options=options)
    report = Export(spark, config).run(once=True, timeout=300)
    assert set(report.stopped) == {A.key}, report.stopped
    line = report.stopped[A.key]
    assert damaged.key in line and f"tmq verify {TOPIC}" in line and "\n" not in line
    table = DeltaTable(str(lake / TOPIC))
    resumes_at = table.transaction_version(app_id(A))
    assert resumes_at is not None and damaged.base_offset <= resumes_at < damaged.end_offset
    assert f"resumes this queue at {resumes_at}" in line
    rows = table_rows(lake)
    assert not [k for k, n in Counter(rows).items() if n > 1], "a row was committed twice"
    # B: every row exactly once, though A's damage was in the same batch.
    assert [r for r in rows if r[0] == B.queue_id] == [r for r in expected if r[0] == B.queue_id]
    assert table.transaction_version(app_id(B)) == max(r[1] for r in expected if r[0] == 1) + 1
    # A: every row below where it stopped, none from there on.
    assert [r for r in rows if r[0] == A.queue_id] == [
        r for r in expected if r[0] == A.queue_id and r[1] < resumes_at
    ]

    # The operator's path: `tmq verify` (what the broker runs for it) names the object ...
    verdict = verify_queue(tier, "c1", "broker-a", TOPIC, 0, lock=threading.Lock(), deep=True)
    assert verdict.status == FAILURE and any(damaged.key in d for d in verdict.damaged), verdict
    # ... the object is restored from a good copy, verify agrees, and the export resumes A.
    client.put_object(Bucket=bucket, Key=key, Body=good)
    verdict = verify_queue(tier, "c1", "broker-a", TOPIC, 0, lock=threading.Lock(), deep=True)
    assert verdict.status == OK, verdict
    again = Export(spark, config).run(once=True, timeout=300)
    assert again.stopped == {} and again.rows == sum(1 for r in expected if r[0] == 0) - resumes_at
    assert table_rows(lake) == expected, "every row of both queues exactly once"
    assert Export(spark, config).run(once=True, timeout=300).rows == 0


def test_an_object_store_outage_during_export_commits_nothing_and_resumes_once(
    s3: S3Endpoint, bucket: str, spark: Any, fault_proxy: Any, tmp_path: Path
) -> None:
    tier_url = f"s3://{bucket}/tier"
    expected = wanted(archived(tmp_path, tier_url, s3.storage_options()))
    proxied = S3Endpoint(fault_proxy.url, "proxy").storage_options()
    lake = tmp_path / "lake"
    config = ExportConfig(tier_url, str(lake), [TOPIC], tier_options=proxied)

    # The store is down when the export starts: the listing fails through every retry.
    fault_proxy.set(reset=True)
    with pytest.raises(ExportError) as down:
        Export(spark, config).run(once=True, timeout=300)
    assert_one_clear_line(str(down.value), tier_url)
    assert table_rows(lake) == []

    # The store goes down in the middle of the batch: the driver has listed and planned (its
    # seven requests: three LISTs to find the queues, a LIST and a GET of each manifest), the
    # executors' ranged GETs are under way.
    fault_proxy.heal()
    fault_proxy.set(delay_ms=40)
    before = fault_proxy.snapshot()["counters"].get("requests", 0)
    finished = threading.Event()

    def outage_once_reading() -> None:
        while not finished.wait(0.005):
            if fault_proxy.snapshot()["counters"].get("requests", 0) >= before + 9:
                fault_proxy.set(reset=True)
                return

    watcher = threading.Thread(target=outage_once_reading, daemon=True)
    watcher.start()
    started = time.monotonic()
    try:
        with pytest.raises(ExportError) as cut:
            Export(spark, config).run(once=True, timeout=300)
    finally:
        finished.set()
        watcher.join(5)
    assert_one_clear_line(str(cut.value), tier_url)
    assert "batch 0" in str(cut.value), cut.value
    assert time.monotonic() - started < 120
    assert fault_proxy.snapshot()["counters"].get("reset", 0) > 0
    # Nothing of the batch is in the table: no data file, no exported offset.
    delta = LakeTable(Location.of(str(lake)), TOPIC).open()
    if delta is not None:
        assert delta.file_uris() == []
        assert delta.transaction_version(app_id(A)) is None
        assert delta.transaction_version(app_id(B)) is None
    assert table_rows(lake) == []

    # The store heals: the next run exports everything, exactly once; one more adds nothing.
    fault_proxy.heal()
    report = Export(spark, config).run(once=True, timeout=300)
    assert report.rows == len(expected) and report.stopped == {}
    assert table_rows(lake) == expected
    assert Export(spark, config).run(once=True, timeout=300).rows == 0


def assert_one_clear_line(line: str, tier_url: str) -> None:
    assert "\n" not in line and "Traceback" not in line, line
    assert f"the tier {tier_url} did not answer" in line, line
    assert "nothing of" in line and "was committed" in line, line
    assert "run the export again once the object store is back" in line, line


def test_a_damaged_offset_table_is_refused_naming_the_object_and_the_entry(
    s3: S3Endpoint, bucket: str, tmp_path: Path
) -> None:
    """Four segment objects in LocalStack, each with one offset-table entry damaged another way
    (a record past the record area, at a position near 2**63, at a negative one, overlapping
    the record before): reading a slice from the segment's start, or from the damaged entry on,
    fails with a ``SegmentError`` that names the object and the entry. They used to fail
    as whatever the entry steered the reads into ("short read (0 of -100 bytes)", "only
    -9223372036854758088 bytes left", an illegal magic code at byte -1000)."""
    tier_url, options = f"s3://{bucket}/tier", s3.storage_options()
    tier = open_store(tier_url, options)
    archive = Archive.open(tmp_path / "hot", tier, queues=1, segment_messages=25)
    try:
        archive.produce(TOPIC, 100, body_size=200)
        assert archive.store.wait_dispatched(60)
        archive.offload(TOPIC)
    finally:
        archive.close()
    segments = ManifestLog(tier, A.prefix).load().segments
    damage = [
        lambda at, size, end: (end + 100, size),
        lambda at, size, end: (2**63 - 60, size),
        lambda at, size, end: (-1000, size),
        lambda at, size, end: (at - 50, size),
    ]
    assert len(segments) == len(damage)
    client = s3.client()
    for segment, damaged in zip(segments, damage, strict=True):
        key = f"tier/{segment.key}"
        data = bytearray(client.get_object(Bucket=bucket, Key=key)["Body"].read())
        entry = segment.offsets_at + 10 * 20  # the 11th entry: (offset >i8, size >i4, tag >i8)
        struct.pack_into(
            ">qi",
            data,
            entry,
            *damaged(*struct.unpack_from(">qi", data, entry), segment.offsets_at),
        )
        client.put_object(Bucket=bucket, Key=key, Body=bytes(data))
        for first in (segment.base_offset, segment.base_offset + 10):
            part = SegmentSlice(A.key, segment.to_dict(), first, segment.end_offset)
            with pytest.raises(SegmentError) as refused:
                list(read_slice(Location.of(tier_url, options), part))
            message = str(refused.value)
            assert message.startswith(
                f"{segment.key}: its offset table does not describe its records: "
            )
            # The damaged entry, or (a slice that starts at it has no entry before it to compare
            # with) the next one, whose start is not where the damaged one says it ends.
            assert any(
                f"the entry of queue offset {segment.base_offset + k} says" in message
                for k in (10, 11)
            ), message


def test_retention_deleting_segments_under_a_batch_skips_the_expired_range_not_the_queue(
    s3: S3Endpoint,
    bucket: str,
    spark: Any,
    fault_proxy: Any,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """`tmq retain` expires a queue's oldest segments while an export batch is reading them
    (the manifest first, then the objects: the executors' GETs of planned slices find them
    gone). That is the documented retention race (Kafka's failOnDataLoss=false), not damage: the
    export used to stop the queue as "object is missing from the tier, run `tmq verify`", with
    its still-retained newest segments never exported (a continuous export kept the queue
    stopped until restarted). It must go on at the archive's new start: every retained row
    exactly once, the queue not stopped, and every row in the table the tier's own."""
    tier_url, options = f"s3://{bucket}/tier", s3.storage_options()
    archive = Archive.open(tmp_path / "hot", open_store(tier_url, options), queues=1,
                           segment_messages=50)  # fmt: skip
    try:
        archive.produce(TOPIC, 500, body_size=2048)  # ten segments of one queue
        archive.offload(TOPIC)
        expected = wanted(expected_rows(archive.messages(TOPIC)))
        proxied = S3Endpoint(fault_proxy.url, "proxy").storage_options()
        lake = tmp_path / "lake"
        config = ExportConfig(tier_url, str(lake), [TOPIC], tier_options=proxied)
        # Every request through the proxy waits: the executors' first GETs are still on their
        # way when the retention (straight to the store, not through the proxy) lands.
        fault_proxy.set(delay_ms=300)
        before = fault_proxy.snapshot()["counters"].get("requests", 0)
        expired: list[Any] = []
        finished = threading.Event()

        def retain_once_reading() -> None:
            # The driver's five requests (three LISTs to find the queue, the manifest's LIST
            # and GET), then the executors' first GET of a segment.
            while not finished.wait(0.005):
                if fault_proxy.snapshot()["counters"].get("requests", 0) >= before + 6:
                    # By size alone (no message is older than time 0): keep the newest two.
                    newest = ManifestLog(archive.tier, A.prefix).load().segments[-2:]
                    keep = sum(s.size for s in newest)
                    expired.append(archive.offloader.expire(TOPIC, 0, 0, max_bytes=keep))
                    return

        watcher = threading.Thread(target=retain_once_reading, daemon=True)
        watcher.start()
        try:
            report = Export(spark, config).run(once=True, timeout=300)
        finally:
            finished.set()
            watcher.join(30)
        fault_proxy.heal()
    finally:
        archive.close()
    assert expired and expired[0].segments == 8, expired
    new_start = expired[0].new_start_offset
    assert new_start == 400
    assert report.stopped == {}, report.stopped
    # The race this test is about happened: the batch's reads found expired objects.
    assert any("while a batch read them" in r.getMessage() for r in caplog.records)
    table = DeltaTable(str(lake / TOPIC))
    assert table.transaction_version(app_id(A)) == 500
    rows = table_rows(lake)
    assert not [k for k, n in Counter(rows).items() if n > 1], "a row was committed twice"
    assert set(rows) <= set(expected), "a row the tier never held"
    assert [r for r in rows if r[1] >= new_start] == [r for r in expected if r[1] >= new_start]
    assert Export(spark, config).run(once=True, timeout=300).rows == 0


def test_a_topic_archived_again_from_offset_zero_is_refused_not_dropped_or_mixed(
    s3: S3Endpoint, bucket: str, spark: Any, tmp_path: Path
) -> None:
    """A topic deleted and re-created, its tier prefix wiped (by hand, or a new broker on an
    empty disk after the old archive was removed) and archived again from offset 0, while its
    table still holds the old archive's rows and exported offset. The export used to take the
    new archive's messages below the old exported offset as a replay and drop them silently
    (a shorter new archive: "nothing new"), and to append the rest after the old archive's
    rows (a longer one): a table mixing two lineages. Both must stop the queue with one line
    saying what happened and what to do, and commit nothing."""
    tier_url, options = f"s3://{bucket}/tier", s3.storage_options()
    lake = tmp_path / "lake"
    config = ExportConfig(tier_url, str(lake), [TOPIC], tier_options=options)
    old = first_archive(tmp_path, tier_url, options)
    assert Export(spark, config).run(once=True, timeout=300).rows == 200
    assert table_rows(lake) == old

    # The topic is deleted and re-created: its archive is wiped and begins again at 0.
    second = archived_again(s3, bucket, tmp_path, tier_url, options)
    try:
        for count in (120, 180):  # below the old exported offset (200), then past it (300)
            second.produce(TOPIC, count, body_size=100)
            second.offload(TOPIC)
            report = Export(spark, config).run(once=True, timeout=300)
            assert report.rows == 0
            assert set(report.stopped) == {A.key}, (count, report.stopped)
            line = report.stopped[A.key]
            assert "\n" not in line and "exported up to offset 200 from another archive" in line
            assert "deleted and re-created" in line and f"rename it to {TOPIC}_old" in line
            assert table_rows(lake) == old, "nothing of the new archive committed"
            assert DeltaTable(str(lake / TOPIC)).transaction_version(app_id(A)) == 200
    finally:
        second.close()

    # The operator's path: the table moved aside, the export rebuilds it from the new archive.
    (lake / TOPIC).rename(lake / f"{TOPIC}_old")
    again = Export(spark, config).run(once=True, timeout=300)
    assert again.stopped == {} and again.rows == 300
    assert [(q, o) for q, o, _ in table_rows(lake)] == [(0, o) for o in range(300)]


def test_an_archive_re_created_at_the_same_manifest_version_under_a_batch_is_named(
    s3: S3Endpoint, bucket: str, spark: Any, tmp_path: Path
) -> None:
    """Decision 1080's first limit: the topic deleted and re-created between two batches of an
    export that has not caught up, the new archive's newest manifest at the very version the
    export's cache holds (so the cache keeps the old one). The next batch, planned on the old
    manifest, finds its objects gone with the wiped prefix. That used to stop the queue as
    damage ("run `tmq verify`, restore or re-upload the object"), advice that finds a healthy
    new archive; it must be decision 1051's line, and nothing of the new archive committed."""
    tier_url, options = f"s3://{bucket}/tier", s3.storage_options()
    lake = tmp_path / "lake"
    config = ExportConfig(
        tier_url, str(lake), [TOPIC], tier_options=options, max_segments_per_trigger=1
    )
    old = first_archive(tmp_path, tier_url, options)
    store = open_store(tier_url, options)
    old_version = max(ManifestLog(store, A.prefix).versions())
    job = Export(spark, config)

    def re_create(report: Any) -> None:
        if report.batch_id != 0:
            return
        second = archived_again(s3, bucket, tmp_path, tier_url, options)
        try:
            second.produce(TOPIC, 200, body_size=100)
            second.offload(TOPIC)
        finally:
            second.close()
        assert max(ManifestLog(store, A.prefix).versions()) == old_version

    job.on_batch = re_create
    report = job.run(once=True, timeout=300)
    assert report.rows == 50 and set(report.stopped) == {A.key}, report
    line = report.stopped[A.key]
    assert "\n" not in line and "exported up to offset 50 from another archive" in line, line
    assert "deleted and re-created" in line and "tmq verify" not in line, line
    assert table_rows(lake) == old[:50]


def test_a_re_created_archive_whose_retention_passed_the_exported_offset_is_not_appended(
    s3: S3Endpoint, bucket: str, spark: Any, tmp_path: Path
) -> None:
    """Decision 1051/1080's stated limit, shown: the topic deleted and re-created, archived
    again from 0 to 400, and retention expiring the new archive below 200, exactly the offset
    the table holds. Nothing of the new archive at or below the old end is left to compare
    (neither the watermark nor a segment key), so the export takes it as the old archive
    continued and appends offsets 200..399 of the new archive after the old 0..199: one table,
    two lineages, no line said. It must refuse the queue as for decision 1051: the archive id
    the table recorded beside its exported offset is not the new archive's (decision 1240)."""
    tier_url, options = f"s3://{bucket}/tier", s3.storage_options()
    lake = tmp_path / "lake"
    config = ExportConfig(tier_url, str(lake), [TOPIC], tier_options=options)
    old = first_archive(tmp_path, tier_url, options)
    assert Export(spark, config).run(once=True, timeout=300).rows == 200

    second = archived_again(s3, bucket, tmp_path, tier_url, options)
    try:
        second.produce(TOPIC, 400, body_size=100)
        second.offload(TOPIC)
        manifest = ManifestLog(open_store(tier_url, options), A.prefix).load()
        kept = sum(s.size for s in manifest.segments if s.base_offset >= 200)
        expired = second.offloader.expire(TOPIC, A.queue_id, 0, max_bytes=kept)
        assert expired.new_start_offset == 200, expired
    finally:
        second.close()
    report = Export(spark, config).run(once=True, timeout=300)
    rows = table_rows(lake)
    assert [r for r in rows if r[1] < 200] == old
    assert report.rows == 0 and set(report.stopped) == {A.key}, (
        f"{report.rows} rows of the new archive appended after the old archive's 200"
    )
    assert rows == old
    line = report.stopped[A.key]
    assert "\n" not in line and "exported up to offset 200 from another archive" in line, line
    assert f"the tier's archive has the id {manifest.archive}" in line, line
    assert f"rename it to {TOPIC}_old" in line, line


def test_an_archive_without_an_id_exports_on_and_its_re_creation_is_refused(
    s3: S3Endpoint, bucket: str, spark: Any, tmp_path: Path
) -> None:
    """Decision 1240 with manifests written before archive ids: an archive whose versions have
    none exports and continues as before, the table recording that its rows came from an
    archive without one. Such an archive never gains an id (only a first commit makes one),
    so the topic re-created later, its new archive's retention past the exported offset, is
    refused by the id the new archive has."""
    tier_url, options = f"s3://{bucket}/tier", s3.storage_options()
    store = open_store(tier_url, options)
    lake = tmp_path / "lake"
    config = ExportConfig(tier_url, str(lake), [TOPIC], tier_options=options)
    first = growing_first_archive(tmp_path, store)
    try:
        # Its manifests as a broker from before archive ids writes them: no id.
        manifests = ManifestLog(store, A.prefix)
        newest = manifests.load()
        manifests.commit(dataclasses.replace(newest, version=newest.version + 1, archive=""))
        assert Export(spark, config).run(once=True, timeout=300).rows == 200
        table = DeltaTable(str(lake / TOPIC))
        assert table.transaction_version(archive_app_id(A)) == 0  # rows of an archive without

        first.produce(TOPIC, 100, body_size=100)
        first.offload(TOPIC)
        assert manifests.load().archive == "" and manifests.load().end_offset == 300
        report = Export(spark, config).run(once=True, timeout=300)
        assert report.rows == 100 and report.stopped == {}, report.stopped
        old = wanted(expected_rows(first.messages(TOPIC)))
        assert table_rows(lake) == old
    finally:
        first.close()

    second = archived_again(s3, bucket, tmp_path, tier_url, options)
    try:
        second.produce(TOPIC, 400, body_size=100)
        second.offload(TOPIC)
        manifest = manifests.load()
        kept = sum(s.size for s in manifest.segments if s.base_offset >= 300)
        assert second.offloader.expire(TOPIC, A.queue_id, 0, max_bytes=kept).new_start_offset == 300
    finally:
        second.close()
    report = Export(spark, config).run(once=True, timeout=300)
    assert report.rows == 0 and set(report.stopped) == {A.key}, report.stopped
    line = report.stopped[A.key]
    assert "exported up to offset 300 from another archive" in line, line
    assert f"has the id {manifest.archive}, the one exported had none" in line, line
    assert table_rows(lake) == old


def test_a_table_exported_before_archive_ids_records_the_id_without_rewriting_anything(
    s3: S3Endpoint, bucket: str, spark: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Decision 1240 with a table written before archive ids (its commits hold only the queues'
    exported offsets): the next export, caught up, finds the table's last row in the tier's
    archive and records that archive's id beside the offset in a commit of no files; then it
    goes on exporting as before. Nothing is rewritten."""
    tier_url, options = f"s3://{bucket}/tier", s3.storage_options()
    store = open_store(tier_url, options)
    lake = tmp_path / "lake"
    config = ExportConfig(tier_url, str(lake), [TOPIC], tier_options=options)
    archive = growing_first_archive(tmp_path, store)
    try:
        with monkeypatch.context() as older:  # the commits of an export from before the ids
            recorded = sink._transactions
            older.setattr(sink, "_transactions", lambda offsets, _archives: recorded(offsets, {}))
            assert Export(spark, config).run(once=True, timeout=300).rows == 200
        table = DeltaTable(str(lake / TOPIC))
        assert table.transaction_version(app_id(A)) == 200
        assert table.transaction_version(archive_app_id(A)) is None
        files, version = set(table.file_uris()), table.version()

        report = Export(spark, config).run(once=True, timeout=300)
        assert report.rows == 0 and report.stopped == {}, report.stopped
        table.update_incremental()
        made = ManifestLog(store, A.prefix).load().archive
        assert table.transaction_version(archive_app_id(A)) == int(made, 16) > 0
        assert table.version() == version + 1 and set(table.file_uris()) == files
        assert table.transaction_version(app_id(A)) == 200

        archive.produce(TOPIC, 100, body_size=100)
        archive.offload(TOPIC)
        report = Export(spark, config).run(once=True, timeout=300)
        assert report.rows == 100 and report.stopped == {}, report.stopped
        table.update_incremental()
        assert files < set(table.file_uris()), "the older files kept, none rewritten"
        assert table.transaction_version(archive_app_id(A)) == int(made, 16)
        assert table_rows(lake) == wanted(expected_rows(archive.messages(TOPIC)))
    finally:
        archive.close()


def stopped_while_running(
    spark: Any, tmp_path: Path, tier_url: str, options: dict[str, Any], re_create: Any
) -> str:
    """A continuous export (trigger 0.5 s) of the topic's first archive (``first_archive``)
    until it holds its 200 rows; then ``re_create()`` under it. The export must stop the queue,
    commit nothing of the new archive and keep running; the line it stopped the queue with."""
    lake = tmp_path / "lake"
    config = ExportConfig(
        tier_url, str(lake), [TOPIC], tier_options=options, trigger_seconds=0.5,
        checkpoint_dir=str(tmp_path / "ckpt"), compact_every_seconds=None,
    )  # fmt: skip
    old = first_archive(tmp_path, tier_url, options)
    job = Export(spark, config)
    runner, errors = run_in_thread(job)
    try:
        deadline = time.monotonic() + 120
        while len(table_rows(lake)) < 200:
            assert not errors and time.monotonic() < deadline, errors or "not exported"
            time.sleep(0.2)
        assert table_rows(lake) == old
        re_create()
        deadline = time.monotonic() + 60
        while A.key not in job.stopped and len(table_rows(lake)) == 200:
            assert not errors and time.monotonic() < deadline, errors or "never noticed"
            time.sleep(0.2)
        time.sleep(2)  # four more triggers: nothing of the new archive may follow the stop
        assert table_rows(lake) == old, "nothing of the new archive dropped into or appended"
        assert DeltaTable(str(lake / TOPIC)).transaction_version(app_id(A)) == 200
        assert runner.is_alive() and not errors, errors
    finally:
        job.stop()
        runner.join(60)
    assert not runner.is_alive() and not errors, errors
    line = job.stopped[A.key]
    assert "\n" not in line and "exported up to offset 200 from another archive" in line, line
    assert "deleted and re-created" in line and f"rename it to {TOPIC}_old" in line, line
    return line


def test_a_continuous_export_stops_a_queue_whose_archive_is_re_created_while_it_runs(
    s3: S3Endpoint, bucket: str, spark: Any, tmp_path: Path
) -> None:
    """Decision 1051's refusal, while a continuous export runs: the topic is deleted and
    re-created under it, its archive wiped and archived again from offset 0, past the offset
    the table holds. The export used to notice only at its next restart, dropping the new
    archive's messages below the exported offset as a replay and appending the rest after the
    old archive's rows. It must stop the queue with the same line, and commit nothing of the
    new archive, while it keeps running."""
    tier_url, options = f"s3://{bucket}/tier", s3.storage_options()
    store = open_store(tier_url, options)

    def re_create() -> None:
        old_version = max(ManifestLog(store, A.prefix).versions())
        # Deleted and re-created under the running export: archived again from 0, to 300.
        second = archived_again(s3, bucket, tmp_path, tier_url, options)
        try:
            for count in (120, 180):  # below the exported offset (200), then past it (300)
                second.produce(TOPIC, count, body_size=100)
                second.offload(TOPIC)
        finally:
            second.close()
        # (a manifest version the export has not held: the cache re-reads it)
        assert max(ManifestLog(store, A.prefix).versions()) > old_version

    stopped_while_running(spark, tmp_path, tier_url, options, re_create)


def test_a_continuous_export_stops_a_queue_whose_archive_id_changed_while_it_runs(
    s3: S3Endpoint, bucket: str, spark: Any, tmp_path: Path
) -> None:
    """Decision 1240 while a continuous export runs: the topic re-created under it and the new
    archive's retention already past the exported offset before the export reads it, so no
    offset or key below the old end is left to compare (decision 1080's blind spot). The
    manifest cache sees the id change and the queue stops with decision 1051's line; nothing
    of the new archive is appended, and the export keeps running."""
    tier_url, options = f"s3://{bucket}/tier", s3.storage_options()
    manifests = ManifestLog(open_store(tier_url, options), A.prefix)
    seen: list[QueueManifest] = []

    def re_create() -> None:
        seen.append(manifests.load())
        # Archived again to 400 and retention keeping 200..399, in a scratch prefix whose
        # segments and newest manifest alone are then copied in, so that the export reads no
        # manifest of the new archive from before its retention (it would show the new keys
        # below 200, decision 1080's sign).
        second = Archive.open(tmp_path / "hot2", open_store(f"s3://{bucket}/scratch", options),
                              queues=1, segment_messages=50)  # fmt: skip
        try:
            second.produce(TOPIC, 400, body_size=100)
            second.offload(TOPIC)
            scratch = ManifestLog(second.tier, A.prefix).load()
            kept = sum(s.size for s in scratch.segments if s.base_offset >= 200)
            assert second.offloader.expire(TOPIC, 0, 0, max_bytes=kept).new_start_offset == 200
            newest = ManifestLog(second.tier, A.prefix).load()
        finally:
            second.close()
        client = s3.client()
        manifest_key = f"{A.prefix}manifests/{newest.version:020d}.json"
        for key in [s.key for s in newest.segments] + [manifest_key]:
            client.copy_object(Bucket=bucket, Key=f"tier/{key}",
                               CopySource={"Bucket": bucket, "Key": f"scratch/{key}"})  # fmt: skip
        seen.append(manifests.load())
        assert seen[1].version > seen[0].version and seen[1].start_offset == 200
        assert seen[1].archive != seen[0].archive

    line = stopped_while_running(spark, tmp_path, tier_url, options, re_create)
    assert f"has the id {seen[1].archive}, the one exported had {seen[0].archive}" in line, line


def test_a_second_export_committing_to_the_table_mid_batch_is_named_not_bare_delta_rs(
    s3: S3Endpoint, bucket: str, spark: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two exports of one topic by mistake (two checkpoints: no lock between them). The second
    runs to completion between the first's read of the table and its commit (the seam: the
    first's call into delta-rs's commit, which then proceeds unchanged), so the first's commit
    really conflicts in delta-rs. Its error used to be delta-rs's bare "Failed to commit
    transaction: Concurrent transaction failed."; it must name the table, say another export
    is committing to it and what to do, and the table hold every row once."""
    tier_url, options = f"s3://{bucket}/tier", s3.storage_options()
    lake = tmp_path / "lake"
    archive = Archive.open(tmp_path / "hot", open_store(tier_url, options), queues=1,
                           segment_messages=50)  # fmt: skip
    try:
        archive.produce(TOPIC, 100, body_size=100)
        archive.offload(TOPIC)
        expected = wanted(expected_rows(archive.messages(TOPIC)))
    finally:
        archive.close()

    def export(name: str) -> Export:
        return Export(spark, ExportConfig(tier_url, str(lake), [TOPIC], tier_options=options,
                                          checkpoint_dir=str(tmp_path / name)))  # fmt: skip

    first, second = export("ckpt-1"), export("ckpt-2")
    commit = DeltaTable.create_write_transaction
    raced: list[int] = []
    racing = threading.Event()

    def second_export_first(table: DeltaTable, *args: Any, **kwargs: Any) -> Any:
        if not racing.is_set():  # the first export's commit (the second's goes straight on)
            racing.set()
            raced.append(second.run(once=True, timeout=300).rows)
        return commit(table, *args, **kwargs)

    monkeypatch.setattr(DeltaTable, "create_write_transaction", second_export_first)
    with pytest.raises(ExportError) as refused:
        first.run(once=True, timeout=300)
    assert raced == [100], "the second export committed between the first's read and commit"
    line = str(refused.value)
    print(line)
    assert "\n" not in line and line.startswith(
        f"table {LakeTable(Location.of(str(lake), {}), TOPIC).uri}:"
    )
    assert "this one committed batch 0 (queues c1/broker-a/orders/0;" in line
    assert "Concurrent transaction failed" in line
    assert line.endswith("stop all but one, then run it again (it resumes where the table says)")
    assert table_rows(lake) == expected, "every row once: the second export's commit alone"


def test_filters_on_strings_beyond_the_bmp_find_every_row(
    s3: S3Endpoint, bucket: str, spark: Any, tmp_path: Path
) -> None:
    """Tags and message ids with characters of the planes past the first two (CJK extension B
    and on, as in 𠮷野家; the last planes, U+10FFFF included). The export wrote each file's
    Delta statistics as ASCII JSON, those characters as surrogate-pair escapes, which delta-rs
    1.6 reads back 0x10000 too low (𠮷 U+20BB7 as U+10BB7; emoji, plane 1, come back right): a
    file's max fell below its own rows, and `where tags = '𠮷野家'` skipped the file. So did
    every string longer than 32 characters whose next character sorted above U+FFFFF (the cut
    value's bound, U+10FFFF, read as U+FFFFF). DataFusion (`tmq lakehouse query`), delta-rs's
    pyarrow dataset and DuckDB over it answered 0 rows where the table holds them: a silent
    wrong answer for the analyst."""
    tier_url, options = f"s3://{bucket}/tier", s3.storage_options()
    archive = Archive.open(tmp_path / "hot", open_store(tier_url, options), queues=1,
                           segment_messages=100)  # fmt: skip
    tags = ["😀", "𠮷野家", "red 𠮷", "\U00020000" * 3, "\U0010fffd" * 40, "plain"]
    try:
        archive.store.put_messages(
            [
                Message(
                    TOPIC,
                    f"body {i}".encode(),
                    0,
                    {"TAGS": tags[i % len(tags)], "UNIQ_KEY": f"id-𠮷-{i}"},
                )
                for i in range(60)
            ]
        )
        assert archive.store.wait_dispatched(60)
        archive.offload(TOPIC)
    finally:
        archive.close()
    lake = tmp_path / "lake"
    config = ExportConfig(tier_url, str(lake), [TOPIC], tier_options=options)
    assert Export(spark, config).run(once=True, timeout=300).rows == 60
    table = DeltaTable(str(lake / TOPIC))
    dataset = table.to_pyarrow_dataset()
    for tag in tags:
        quoted = tag.replace("'", "''")
        sql = f"select count(*) as n from {TOPIC} where tags = '{quoted}'"
        assert run_query(Location.of(str(lake)), sql).column("n")[0].as_py() == 10, tag
        assert dataset.to_table(filter=pds.field("tags") == tag).num_rows == 10, tag
        found = duckdb.sql(f"select count(*) from dataset where tags = '{quoted}'").fetchall()
        assert found == [(10,)], tag
    for i in (0, 7, 59):
        sql = f"select body from {TOPIC} where msg_id = 'id-𠮷-{i}'"
        assert run_query(Location.of(str(lake)), sql).column("body").to_pylist() == [
            f"body {i}".encode()
        ]
