"""Segment objects and manifests, built from a real hot store, on file:// and LocalStack S3."""

from __future__ import annotations

import pickle
import random
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from broker.reply import encode_pull_replies
from tiered.cold.counting import CountingObjectStore
from tiered.cold.manifest import (
    KEEP_VERSIONS,
    ManifestConflictError,
    ManifestError,
    ManifestLog,
    QueueManifest,
    queue_prefix,
    segment_key,
)
from tiered.cold.segment import (
    SegmentError,
    SegmentReader,
    build,
    read_footer,
    read_segment,
    read_span,
    read_spans,
    verify,
)
from tiered.cold.storage import ObjectStore, open_store
from tiered.config import StoreConfig
from tiered.formats import CQ_ENTRY_SIZE
from tiered.record import CorruptRecordError, Message, RecordEncoder, StoredMessage
from tiered.store import MessageStore


@pytest.fixture(params=["file", "s3"])
def tier(request: pytest.FixtureRequest, tmp_path: Path) -> ObjectStore:
    if request.param == "file":
        return open_store(f"file://{tmp_path}/tier")
    s3 = request.getfixturevalue("s3")
    return open_store(f"s3://{request.getfixturevalue('bucket')}/tier", s3.storage_options())


@pytest.fixture(scope="module")
def hot(tmp_path_factory: pytest.TempPathFactory) -> tuple[MessageStore, list[StoredMessage]]:
    store = MessageStore(
        StoreConfig(data_dir=tmp_path_factory.mktemp("hot"), commitlog_file_size=1 << 20)
    )
    store.start()
    rng = random.Random(3)
    for i in range(2000):
        store.put_message(
            Message(
                topic="archive",
                queue_id=0,
                body=rng.randbytes(rng.randint(0, 900)),
                properties={
                    "KEYS": f"k{i % 300}",
                    "UNIQ_KEY": f"id-{i}",
                    "TAGS": rng.choice(["a", "b"]),
                },
            )
        )
    assert store.wait_dispatched()
    messages = store.get_messages("archive", 0, 0, 5000, max_bytes=1 << 30).messages
    yield store, messages
    store.shutdown()


def raw_records(store: MessageStore, messages: list[StoredMessage]) -> list[bytes]:
    out = []
    for m in messages:
        raw = store.commitlog.read(m.commitlog_offset, m.size)
        assert raw is not None
        out.append(raw)
    return out


def archive(
    tier: ObjectStore, hot_store: MessageStore, messages: list[StoredMessage], per_segment: int
) -> QueueManifest:
    manifests = ManifestLog(tier, queue_prefix("c1", "broker-a", "archive", 0))
    manifest = manifests.load()
    for start in range(0, len(messages), per_segment):
        chunk = messages[start : start + per_segment]
        data, info = build(
            raw_records(hot_store, chunk),
            chunk[0].queue_offset,
            segment_key(manifests.prefix, chunk[0].queue_offset),
        )
        assert tier.put_if_absent(info.key, data)
        verify(tier, info)
        manifest = manifest.with_segment(info)
        manifests.commit(manifest)
    return manifests.load()


def test_every_message_reads_back_byte_identical_from_the_tier(tier, hot) -> None:
    store, messages = hot
    manifest = archive(tier, store, messages, per_segment=400)
    assert manifest.version == 5 and manifest.end_offset == len(messages)
    got: list[StoredMessage] = []
    offset = 0
    while offset < manifest.end_offset:
        info = manifest.find(offset)
        assert info is not None
        batch = SegmentReader(tier, info).read(offset, 64)
        got += batch
        offset += len(batch)
    assert got == messages
    for info in manifest.segments:
        assert read_footer(tier, info.key) == info, "the bucket alone describes each segment"


def test_a_random_read_costs_the_same_requests_at_1x_and_10x(tmp_path, hot) -> None:
    _, messages = hot
    encoder = RecordEncoder()
    costs = []
    for copies, root in ((1, "small"), (10, "large")):
        tier = CountingObjectStore(open_store(f"file://{tmp_path}/{root}"))
        manifests = ManifestLog(tier, queue_prefix("c1", "b", "archive", 0))
        manifest = manifests.load()
        # 10x: the same messages again and again, re-encoded at the following offsets.
        for copy in range(copies):
            for start in range(0, len(messages), 200):
                base = copy * len(messages) + start
                records = [
                    encoder.encode(
                        Message(topic=m.topic, body=m.body, queue_id=0, properties=m.properties),
                        base + i,
                        0,
                        m.store_timestamp,
                    )[0]
                    for i, m in enumerate(messages[start : start + 200])
                ]
                data, info = build(records, base, segment_key(manifests.prefix, base))
                tier.put_if_absent(info.key, data)
                manifest = manifest.with_segment(info)
        manifests.commit(manifest)
        manifest = manifests.load()  # cached by a reader; not part of a read's cost
        tier.calls.clear()
        rng = random.Random(copies)
        for _ in range(50):
            offset = rng.randrange(manifest.end_offset)
            info = manifest.find(offset)
            assert info is not None
            [msg] = SegmentReader(tier, info).read(offset, 1)
            assert msg.queue_offset == offset
        costs.append(dict(tier.calls))
    assert costs[0] == costs[1] == {"get_range": 100}, costs


def test_time_and_key_lookups_work_over_the_archive(tier, hot) -> None:
    store, messages = hot
    manifest = archive(tier, store, messages, per_segment=500)
    for m in random.Random(5).sample(messages, 30):
        info = next(s for s in manifest.segments if s.max_store_timestamp >= m.store_timestamp)
        expected = store.offset_for_timestamp("archive", 0, m.store_timestamp)
        assert SegmentReader(tier, info).offset_for_timestamp(m.store_timestamp) == expected
    wanted = {m.queue_offset for m in messages if "k7" in m.keys}
    found = set()
    for info in manifest.segments:
        reader = SegmentReader(tier, info)
        for offset in reader.offsets_for_key("archive", "k7"):
            [msg] = reader.read(offset, 1)
            if "k7" in msg.keys:
                found.add(offset)
    assert found == wanted and len(wanted) > 3


def test_damaged_records_are_refused_on_the_way_in(hot) -> None:
    store, messages = hot
    first = [m for m in messages if m.body][:10]
    records = raw_records(store, first)
    flipped = bytearray(records[3])
    flipped[88] ^= 0xFF  # the first body byte (both hosts IPv4)
    with pytest.raises(CorruptRecordError):
        build([*records[:3], bytes(flipped), *records[4:]], first[0].queue_offset, "k")
    torn = bytearray(records[5])
    torn[-25] ^= 0x01  # a property byte: the body and BODYCRC are intact, the record CRC is not
    with pytest.raises(CorruptRecordError, match="record CRC"):
        build([*records[:5], bytes(torn), *records[6:]], first[0].queue_offset, "k")
    with pytest.raises(SegmentError, match="expected"):
        build([records[0], records[2]], first[0].queue_offset, "k")


def test_a_record_damaged_outside_its_body_in_the_tier_is_never_served(tier, hot) -> None:
    store, messages = hot
    manifest = archive(tier, store, messages[:40], per_segment=40)
    [info] = manifest.segments
    reader = SegmentReader(tier, info)
    entry = reader.entries(info.base_offset + 3, 1)
    at, size = int(entry["offset"][0]), int(entry["size"][0])
    data = bytearray(tier.get(info.key))
    data[at + size - 25] ^= 0x01  # a property byte of record 3; its body and BODYCRC are intact
    tier.delete(info.key)
    tier.put(info.key, bytes(data))
    assert [m.queue_offset for m in reader.read(info.base_offset + 2, 1)] == [info.base_offset + 2]
    with pytest.raises((SegmentError, CorruptRecordError), match="record CRC"):
        reader.read(info.base_offset + 3, 1)
    with pytest.raises(SegmentError, match="record CRC"):
        read_span(tier, info, 0, reader.entries(info.base_offset, 5).tobytes())


def test_a_missing_or_damaged_object_is_detected(tier, hot) -> None:
    store, messages = hot
    manifest = archive(tier, store, messages[:600], per_segment=300)
    first, second = manifest.segments
    tier.put(first.key, b"garbage")
    tier.delete(second.key)
    with pytest.raises(SegmentError):
        verify(tier, first)
    with pytest.raises(SegmentError, match="missing"):
        verify(tier, second)
    with pytest.raises(SegmentError):
        read_footer(tier, first.key)


def test_manifest_commits_are_atomic_fenced_and_retry_safe(tier) -> None:
    prefix = queue_prefix("c1", "b", "t", 3)
    writer_a, writer_b = ManifestLog(tier, prefix), ManifestLog(tier, prefix)
    base = writer_a.load()
    assert base.version == 0 and base.end_offset == 0
    v1 = QueueManifest(prefix, 1, [], log_start_offset=0)
    writer_a.commit(v1)
    writer_a.commit(v1)  # a retry that finds its own bytes is done
    rival = QueueManifest(prefix, 1, [], log_start_offset=5)
    with pytest.raises(ManifestConflictError):
        writer_b.commit(rival)
    assert writer_b.load().log_start_offset == 0
    for version in range(2, 2 + KEEP_VERSIONS + 3):
        writer_a.commit(QueueManifest(prefix, version, [], 0))
    assert len(writer_a.versions()) == KEEP_VERSIONS
    assert writer_a.load().version == 1 + KEEP_VERSIONS + 3
    tier.put(f"{prefix}manifests/{99:020d}.json", b"{not json")
    with pytest.raises(ManifestError):
        writer_a.load()


def test_keys_are_built_only_from_safe_names() -> None:
    for bad in ("../x", "a/b", "", ".."):
        with pytest.raises(ValueError):
            queue_prefix("c1", "b", bad, 0)
    with pytest.raises(ValueError):
        queue_prefix("c1", "b", "t", -1)


def one_segment(
    tmp_path: Path, hot: tuple[MessageStore, list[StoredMessage]]
) -> tuple[ObjectStore, Any, bytes]:
    """The hot store's first 300 messages archived as one segment in a file tier: the tier,
    the segment's manifest entry and its offset table."""
    tier = open_store(f"file://{tmp_path}/tier")
    store, messages = hot
    manifest = archive(tier, store, messages[:300], per_segment=300)
    [info] = manifest.segments
    return tier, info, tier.get_range(info.key, info.offsets_at, info.count * CQ_ENTRY_SIZE)


def test_a_read_ahead_run_is_cut_into_batches_without_a_copy(
    tmp_path: Path, hot: tuple[MessageStore, list[StoredMessage]]
) -> None:
    """``read_spans`` cuts one GET's records and replies into batches as views of the two
    buffers (decision 550); what the broker receives (pickled as the worker sends it) and what
    a reader in this process keeps (``owned``) are bytes, identical to the records and replies
    of each batch read alone."""
    tier, info, table = one_segment(tmp_path, hot)
    messages = hot[1]
    counts = [100, 100, 100]
    spans = read_spans(tier, info, 0, table, counts, encode_pull_replies)
    assert [len(s) for s in spans] == counts
    views: list[Any] = [s.data for s in spans] + [s.replies[0] for s in spans if s.replies]
    assert all(isinstance(v, memoryview) for v in views), "cut without a copy"
    assert len({id(v.obj) for v in views}) == 2, "every batch a view of the run's two buffers"
    for i, span in enumerate(spans):
        one = table[i * 100 * CQ_ENTRY_SIZE : (i + 1) * 100 * CQ_ENTRY_SIZE]
        [alone] = read_spans(tier, info, i * 100, one, [100], encode_pull_replies)
        assert alone.replies is not None
        received = pickle.loads(pickle.dumps(span, protocol=5))
        for got in (received, span.owned()):
            assert isinstance(got.data, bytes) and got.replies is not None
            assert isinstance(got.replies[0], bytes)
            assert (got.base_offset, got.data, got.positions) == (
                alone.base_offset,
                bytes(alone.data),
                alone.positions,
            )
            assert got.replies[0] == bytes(alone.replies[0])
            assert got.replies[1:] == alone.replies[1:]
            assert got.messages(0, 100) == messages[i * 100 : (i + 1) * 100]


def test_a_replies_only_run_keeps_positions_and_sizes_but_not_the_records(
    tmp_path: Path, hot: tuple[MessageStore, list[StoredMessage]]
) -> None:
    """``read_spans(records=False)`` (decision 705): each batch carries its replies, positions
    and the records' length, not the records; ``take`` answers as for the whole batch, the
    replies are the same bytes, decoding refuses, and the pipe's pickling keeps all of that."""
    tier, info, table = one_segment(tmp_path, hot)
    counts = [100, 100, 100]
    whole = read_spans(tier, info, 0, table, counts, encode_pull_replies)
    only = read_spans(tier, info, 0, table, counts, encode_pull_replies, records=False)
    for full, span in zip(whole, only, strict=True):
        for got in (span, pickle.loads(pickle.dumps(span, protocol=5)), span.owned()):
            assert got.data == b"" and not got.has_records
            assert full.has_records and got.size == len(full.data) == full.size
            assert got.replies is not None and full.replies is not None
            assert got.nbytes == len(full.replies[0]) < full.nbytes
            assert bytes(got.replies[0]) == bytes(full.replies[0])
            assert got.replies[1:] == full.replies[1:]
            assert (got.base_offset, got.positions) == (full.base_offset, full.positions)
            for start, count, room in ((0, 100, 1 << 30), (3, 50, 4000), (99, 10, 1), (40, 0, 9)):
                assert got.take(start, count, room) == full.take(start, count, room)
            assert got.reply_run(5, 60) == full.owned().reply_run(5, 60)
            with pytest.raises(ValueError, match="replies-only"):
                got.messages(0, 1)
    with pytest.raises(ValueError, match="reply encoder"):
        read_spans(tier, info, 0, table, counts, None, records=False)


def test_a_whole_segment_read_is_what_its_ranged_reads_are(
    tmp_path: Path, hot: tuple[MessageStore, list[StoredMessage]]
) -> None:
    """``read_segment`` (decision 1220): one GET of the whole object gives the offset table the
    ranged read gives and the same batches, records and replies, as ``read_spans`` cuts them;
    it asks the tier once."""
    tier, info, table = one_segment(tmp_path, hot)
    counting = CountingObjectStore(tier)
    for records in (True, False):
        got_table, spans = read_segment(counting, info, 120, encode_pull_replies, records)
        assert got_table == table
        ranged = read_spans(tier, info, 0, table, [120, 120, 120], encode_pull_replies, records)
        assert [len(s) for s in spans] == [120, 120, 60]
        for span, alone in zip(spans, ranged, strict=True):
            for got in (pickle.loads(pickle.dumps(span, protocol=5)), span.owned()):
                assert (got.base_offset, bytes(got.data), got.positions, got.dropped) == (
                    alone.base_offset,
                    bytes(alone.data),
                    alone.positions,
                    alone.dropped,
                )
                assert got.replies is not None and alone.replies is not None
                assert got.replies[0] == bytes(alone.replies[0])
                assert got.replies[1:] == alone.replies[1:]
    _, [*decoded] = read_segment(tier, info, 1000)
    assert decoded[0].messages(0, 300) == hot[1][:300]
    assert sum(counting.calls.values()) == 2 and counting.calls["get_range"] == 2
    with pytest.raises(ValueError, match="reply encoder"):
        read_segment(tier, info, 100, None, records=False)


def test_a_whole_segment_read_refuses_a_damaged_object_as_a_ranged_read_does(
    tmp_path: Path, hot: tuple[MessageStore, list[StoredMessage]]
) -> None:
    """Each damage gives the error the ranged reads give (a record's own, a short read, a
    missing object), and damage only the whole object shows (the time table or key index, the
    footer) its own: never a segment served from wrong bytes."""
    tier, info, _ = one_segment(tmp_path, hot)
    good = tier.get(info.key)
    entry = SegmentReader(tier, info).entries(info.base_offset + 7, 1)
    at, size = int(entry["offset"][0]), int(entry["size"][0])

    def stored(data: bytes) -> None:
        tier.delete(info.key)
        tier.put(info.key, data)

    def flipped(i: int) -> bytes:
        data = bytearray(good)
        data[i] ^= 0x01
        return bytes(data)

    damages = [
        (flipped(at + size - 25), f"record at {at}: record CRC"),  # a property byte of record 7
        (flipped(info.offsets_at + 3), "offset table does not describe"),
        (flipped(info.times_at + 5), "content does not match its CRC"),  # the time table
        (flipped(len(good) - 30), "footer is damaged"),
        (good[: len(good) // 2], "short read"),
    ]
    for data, error in damages:
        stored(data)
        with pytest.raises(SegmentError, match=error):
            read_segment(tier, info, 100, encode_pull_replies, False)
    stored(good)
    other = replace(info, max_store_timestamp=info.max_store_timestamp + 1)
    with pytest.raises(SegmentError, match="footer is not the manifest's entry"):
        read_segment(tier, other, 100)
    tier.delete(info.key)
    with pytest.raises(SegmentError, match="missing"):
        read_segment(tier, info, 100)
