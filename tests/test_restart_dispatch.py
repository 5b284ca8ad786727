"""Restart's fast re-dispatch builds exactly what normal dispatch builds (decision 240).

The recovery scan reads each record's dispatch fields as columns in the same pass that checks
it (``record.dispatch_columns``, a native twin beside the pure-Python reference), and the
dispatcher applies those columns in bulk. Two checks:

- both engines give the same columns, stop at the same record and for the same reason, on
  random, damaged and non-UTF-8 runs;
- a store restarted over the same CommitLog files ends with byte-identical ConsumeQueue and
  IndexFile files whether it re-dispatched through the columns or through the record-by-record
  path (``read_dispatch_run`` then ``Dispatcher.apply``), with several topics of several
  queues, keys, tags, BLANK records at the end of every CommitLog file, and files of all three
  kinds rolling.
"""

from __future__ import annotations

import random
import shutil
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from google_crc32c import value as crc32c
from hypothesis import given
from hypothesis import strategies as st
from test_record_engine import MESSAGES, NATIVE, PY, SETTINGS, run_of

from tiered import record
from tiered.config import StoreConfig
from tiered.hot import commitlog as commitlog_module
from tiered.hot import dispatcher as dispatcher_module
from tiered.hot.checkpoint import Checkpoint, save_checkpoint
from tiered.hot.commitlog import CommitLog
from tiered.hot.dispatcher import Dispatcher
from tiered.record import DispatchColumns, Message, blank_record
from tiered.store import MessageStore

BASE = 4096  # run_of encodes its records at this CommitLog offset


def columns(engine: Any, buf: Any, validate: bool, max_records: int = 1 << 20) -> Any:
    """Every run ``dispatch_columns`` returns until it stops for good, joined."""
    runs = []
    pos, status = 0, 1
    while status == 1:
        before = pos
        pos, status, cols = engine.dispatch_columns(
            buf, pos, len(buf), BASE, validate, True, max_records
        )
        run = cols if isinstance(cols, DispatchColumns) else DispatchColumns(*cols)
        runs.append(run)
        if status == 1 and pos == before and not len(run):
            raise AssertionError("a full table must have taken something")
    run = DispatchColumns.join(runs)
    arrays = [
        getattr(run, name).tolist()
        for name in (
            "offsets",
            "sizes",
            "queue_offsets",
            "tags",
            "store_timestamps",
            "key_hashes",
            "key_records",
        )
    ]
    queues = [run.queues[q] for q in run.queue_numbers.tolist()]
    return pos, status, arrays, queues


@SETTINGS
@given(
    st.lists(MESSAGES, min_size=1, max_size=25),
    st.one_of(st.none(), st.tuples(st.integers(0, 10**9), st.integers(0, 255))),
    st.booleans(),
    st.integers(1, 8),
)
def test_both_engines_give_the_same_columns(
    messages: list[Message], damage: tuple[int, int] | None, validate: bool, max_records: int
) -> None:
    data = bytearray(run_of(messages) + blank_record(24))
    if damage is not None:
        data[damage[0] % len(data)] = damage[1]
    native = columns(NATIVE, data, validate, max_records)
    assert native == columns(PY, data, validate, max_records)
    if damage is None:
        assert native[0] == len(data) - 24 and len(native[3]) == len(messages)
        # The columns say what the record-by-record scan says.
        batch = record.EncodedBatch()
        stamps: list[int] = []
        PY.read_dispatch_run(bytes(data), 0, len(data), BASE, batch, stamps)
        assert native[2][0] == batch.offsets and native[2][1] == batch.sizes
        assert native[2][3] == PY.tag_hashes(batch.tags).tolist()
        assert native[3] == batch.queues and native[2][4] == stamps
        hashes, numbers = PY.index_keys(batch.queues, batch.keys, batch.uniq_keys)
        assert native[2][5] == hashes.tolist() and native[2][6] == numbers.tolist()


@pytest.mark.parametrize("magic", [1, -626843477 ^ 1])
def test_an_unknown_magic_in_the_last_few_bytes_ends_the_run_in_both_engines(magic: int) -> None:
    """A damaged BLANK record (fewer than a record head's bytes left) with a magic code that is
    neither V2 nor BLANK: the native columns ended the run (status 0), the reference asked for
    the record-by-record path (status 2). Hypothesis found it; both now end the run there."""
    data = bytearray(run_of([Message("q", b"body")]) + blank_record(24))
    end = len(data) - 24
    struct.pack_into(">i", data, end + 4, magic)
    native = columns(NATIVE, data, False, 8)
    assert native == columns(PY, data, False, 8)
    assert native[:2] == (end, 0) and len(native[3]) == 1


@pytest.mark.parametrize("queue_id", [0x7FFFFFFF, 0x80000000, 0xFFFFFFFF])
def test_a_queue_id_field_with_its_high_bit_set_is_read_as_the_reference_reads_it(
    queue_id: int,
) -> None:
    """A damaged QUEUEID of 2^31 or more is a negative int32 to the reference; the native
    columns raised OverflowError building their queue list (hypothesis found it)."""
    data = bytearray(run_of([Message("q", b"body")]) + blank_record(24))
    struct.pack_into(">I", data, 12, queue_id)
    native = columns(NATIVE, data, False, 8)
    assert native == columns(PY, data, False, 8)
    assert native[3] == [("q", struct.unpack(">i", struct.pack(">I", queue_id))[0])]


@pytest.mark.parametrize(
    ("where", "text"),
    [
        ("topic", b"TOPICX"),
        ("tags", b"TAGS\x01ab"),
        ("keys", b"KEYS\x01k1 k2"),
        ("uniq", b"UNIQ_KEY\x01u"),
    ],
)
@pytest.mark.parametrize("validate", [True, False])
def test_text_that_is_not_utf8_stops_the_columns_at_its_record(
    where: str, text: bytes, validate: bool
) -> None:
    props = {"TAGS": "ab", "KEYS": "k1 k2", "UNIQ_KEY": "u"}
    messages = [Message(topic="ok", body=b"b", properties=props) for _ in range(3)]
    messages[1] = Message(topic="TOPICX", body=b"b", properties=props)
    data = bytearray(run_of(messages) + blank_record(8))
    second = len(run_of(messages[:1]))
    at = data.index(text, second)
    data[at + len(text) - 1] = 0xFF  # the last byte of the name or value
    # Seal the damaged record with its new record CRC (decision 210), so that what stops the
    # columns is the text, not the CRC.
    (total,) = struct.unpack_from(">i", data, second)
    end = second + total
    data[end - record.CRC_TRAILER_SIZE : end] = record.crc_trailer(
        crc32c(bytes(data[second : end - record.CRC_TRAILER_SIZE]))
    )
    for engine in (NATIVE, PY):
        pos, status, arrays, _ = columns(engine, data, validate)
        assert (pos, status, len(arrays[0])) == (second, 2, 1), where
    # The record-by-record path refuses a topic that is not UTF-8, so dispatch reports it as
    # before; a tag or key it reads as U+FFFD, as decode does (decision 660), in both engines.
    for engine in (NATIVE, PY):
        if where == "topic":
            with pytest.raises(record.RecordError):
                engine.read_dispatch_run(
                    bytes(data), second, len(data), BASE, record.EncodedBatch(), []
                )
            continue
        out = record.EncodedBatch()
        end = engine.read_dispatch_run(bytes(data), second, len(data), BASE, out, [])
        assert end == len(data) - 8  # the damaged record and the last, up to the BLANK
        field = {"tags": out.tags, "keys": out.keys, "uniq": out.uniq_keys}[where]
        value = text.split(b"\x01")[1].decode()
        assert field[0] == value[:-1] + "\ufffd", where


@pytest.mark.parametrize(
    ("field", "bad"),
    [("KEYS", b"\xff"), ("TAGS", b"\xed\xa0\x80"), ("UNIQ_KEY", b"\xc3"), ("KEYS", b"\xf4\x90")],
)
@pytest.mark.parametrize("after", [0, 7, 8, 9, 16, 23])
def test_text_not_utf8_past_a_run_of_ascii_stops_the_columns(
    field: str, bad: bytes, after: int
) -> None:
    """The native UTF-8 check passes ASCII eight bytes at a time (decision 651): a bad sequence
    after any number of ASCII bytes stops the columns at its record, as the reference does."""
    value = "v" * 30
    props = {"TAGS": value, "KEYS": value, "UNIQ_KEY": value}
    messages = [Message(topic="ok", body=b"b", properties=props) for _ in range(3)]
    data = bytearray(run_of(messages) + blank_record(8))
    second = len(run_of(messages[:1]))
    at = data.index(field.encode() + b"\x01", second) + len(field) + 1 + after
    data[at : at + len(bad)] = bad
    (total,) = struct.unpack_from(">i", data, second)
    end = second + total
    data[end - record.CRC_TRAILER_SIZE : end] = record.crc_trailer(
        crc32c(bytes(data[second : end - record.CRC_TRAILER_SIZE]))
    )
    for engine in (NATIVE, PY):
        pos, status, arrays, _ = columns(engine, data, True)
        assert (pos, status, len(arrays[0])) == (second, 2, 1), engine


# -- a whole store -----------------------------------------------------------------------------


def config(data_dir: Path) -> StoreConfig:
    return StoreConfig(
        data_dir=data_dir,
        commitlog_file_size=64 << 10,
        consumequeue_entries_per_file=50,
        index_hash_slots=101,
        index_max_entries=700,
        flush_interval_ms=3_600_000,
    )


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A store closed cleanly after 3,000 random messages in 3 topics x 4 queues."""
    data_dir = tmp_path_factory.mktemp("restart-dispatch") / "store"
    rng = random.Random(240)
    store = MessageStore(config(data_dir))
    store.start()
    for i in range(0, 3000, 50):
        batch = []
        for j in range(i, i + 50):
            props = {"UNIQ_KEY": f"u-{j}"}  # every client sets one
            if rng.random() < 0.6:
                props["KEYS"] = " ".join(f"k{rng.randrange(400)}" for _ in range(rng.randint(1, 3)))
            if rng.random() < 0.7:
                props["TAGS"] = rng.choice(["red", "green", "bløe", ""])
            batch.append(
                Message(
                    topic=f"t{rng.randrange(3)}",
                    queue_id=rng.randrange(4),
                    body=rng.randbytes(rng.randint(0, 900)),
                    properties=props,
                )
            )
        store.put_messages(batch)
    assert store.wait_dispatched(60)
    store.shutdown()
    return data_dir


def derived_files(data_dir: Path) -> dict[str, bytes]:
    """ConsumeQueue files by path, and IndexFiles by the CommitLog offset their range begins at
    (their names hold a wall time)."""
    files = {
        str(p.relative_to(data_dir)): p.read_bytes()
        for p in sorted((data_dir / "consumequeue").rglob("*"))
        if p.is_file()
    }
    # In the order of their ranges (a name's second and millisecond are read apart, so two
    # files made across a second's turn can sort the wrong way by name).
    index = sorted(p.read_bytes() for p in (data_dir / "index").iterdir())
    index.sort(key=lambda raw: int.from_bytes(raw[16:24], "big", signed=True))
    for n, raw in enumerate(index):
        files[f"index #{n}"] = raw
    return files


def restart(source: Path, target: Path, case: str) -> dict[str, bytes]:
    shutil.copytree(source, target)
    shutil.rmtree(target / "index")
    if case == "no checkpoint":
        # A crash with no checkpoint: the scan covers the whole log and hands over columns.
        (target / "checkpoint").unlink()
        (target / "abort").write_text("1")
        shutil.rmtree(target / "consumequeue")
    elif case == "checkpoint":
        # A clean exit: the scan covers nothing; dispatch reads the columns from the files.
        shutil.rmtree(target / "consumequeue")
    else:
        # A crash with the checkpoint held at the start (as bench/recovery.py makes it), and
        # torn ConsumeQueues: each lost 40% of its last file's entries (zeroed, as by a crash).
        save_checkpoint(target / "checkpoint", Checkpoint())
        (target / "abort").write_text("1")
        for queue_dir in sorted((target / "consumequeue").glob("*/*")):
            *_, path = sorted(queue_dir.iterdir())  # the file being written
            data = bytearray(path.read_bytes())
            keep = len(data.rstrip(b"\0")) * 6 // 10 // 20 * 20
            data[keep:] = bytes(len(data) - keep)
            path.write_bytes(bytes(data))
    store = MessageStore(config(target))
    report = store.start()
    assert report.redispatched_bytes > 0
    store.shutdown()
    return derived_files(target)


@pytest.mark.parametrize("engine", ["native", "python", "native, split scan"])
@pytest.mark.parametrize("case", ["no checkpoint", "checkpoint", "torn consumequeues"])
def test_fast_redispatch_builds_byte_identical_consume_queues_and_index(
    written: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, case: str, engine: str
) -> None:
    if engine == "python":
        monkeypatch.setattr(record, "_engine", PY)
    if engine.endswith("split scan"):
        # Every file is scanned in two halves on two threads (decision 242).
        monkeypatch.setattr(commitlog_module, "_SPLIT_SCAN_BYTES", 1024)
    calls: list[int] = []
    applied = Dispatcher.apply_columns

    def counting(self: Dispatcher, run: DispatchColumns) -> None:
        calls.append(len(run))
        applied(self, run)

    monkeypatch.setattr(Dispatcher, "apply_columns", counting)
    reads: list[int] = []
    read_columns = record.dispatch_columns

    def counting_reads(*args: Any, **kwargs: Any) -> Any:
        reads.append(args[1])
        return read_columns(*args, **kwargs)

    monkeypatch.setattr(dispatcher_module, "dispatch_columns", counting_reads)
    fast = restart(written, tmp_path / "fast", case)
    assert sum(calls) > 0, "the restart should have re-dispatched through the columns"
    # After a crash the scan's columns are all dispatch needs: no CommitLog byte is read twice.
    assert (len(reads) == 0) == (case != "checkpoint"), reads
    # The record-by-record path: no columns from the scan, none read from the files.
    monkeypatch.setattr(Dispatcher, "_read_columns", lambda self, start, end: None)
    plain_scan = CommitLog._scan_run
    monkeypatch.setattr(
        CommitLog,
        "_scan_run",
        lambda self, f, pos, crc, cols: plain_scan(self, f, pos, crc, None),
    )
    calls.clear()
    normal = restart(written, tmp_path / "normal", case)
    assert not calls
    assert fast.keys() == normal.keys()
    assert len([k for k in fast if k.startswith("index")]) >= 2, "the IndexFile should roll"
    assert sum(1 for k in fast if "consumequeue" in k) > 12, "ConsumeQueues should roll"
    for name in fast:
        assert fast[name] == normal[name], name
    # And both say what the appending store said, entry for entry.
    original = derived_files(written)
    cq = [k for k in original if "consumequeue" in k]
    for name in cq:
        a = np.frombuffer(original[name], np.uint8)
        assert np.array_equal(a, np.frombuffer(fast[name], np.uint8)), name


@pytest.mark.parametrize("where", [0.1, 0.45, 0.5, 0.55, 0.9])
@pytest.mark.parametrize("kind", ["torn header", "bad body crc"])
def test_a_scan_in_two_halves_finds_what_one_pass_finds(
    written: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: float, kind: str
) -> None:
    """Damage anywhere in a file, the middle included: the split scan ends, keeps and
    reports exactly what the sequential scan does."""
    reports: list[Any] = []
    halves: list[Any] = []
    scan_halves = CommitLog._scan_halves

    def recording(self: CommitLog, *args: Any) -> Any:
        halves.append(scan_halves(self, *args))
        return halves[-1]

    monkeypatch.setattr(CommitLog, "_scan_halves", recording)
    for split in (False, True):
        monkeypatch.setattr(commitlog_module, "_SPLIT_SCAN_BYTES", 1024 if split else 1 << 40)
        target = tmp_path / f"split-{split}"
        shutil.copytree(written, target)
        (target / "checkpoint").unlink()
        (target / "abort").write_text("1")
        first = sorted((target / "commitlog").iterdir())[2]
        data = bytearray(first.read_bytes())
        at = int(len(data.rstrip(b"\0")) * where)
        if kind == "torn header":
            data[at : at + 300] = bytes(300)  # records after it in later files: refused start
        else:
            body = data.index(b"\0\0", at)  # inside some record: flip bits in a body or header
            data[body] ^= 0xFF
        first.write_bytes(bytes(data))
        store = MessageStore(config(target))
        try:
            report = store.start()
        except Exception as e:  # refused to start: both must refuse alike
            reports.append(type(e).__name__)
            continue
        c = report.commitlog
        reports.append((c.end_offset, c.records_scanned, c.corrupt_records, c.truncated_bytes))
        store.shutdown()
    assert reports[0] == reports[1]
    assert any(h is not None for h in halves), "the files should have been scanned in halves"


def test_a_run_every_queue_holds_is_not_split_by_queue(
    small_config: StoreConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Re-dispatch after kill -9 of records whose ConsumeQueue entries were all written: one
    pass finds every queue's highest queue offset below its end, and the run is not split by
    queue (decision 930). A queue one entry short still gets its entry, the same bytes."""
    from tiered.hot.consume_queue import ConsumeQueueTable
    from tiered.hot.index_file import IndexService

    config = small_config
    msgs = [
        Message(f"t{i % 3}", b"x" * 40, queue_id=i % 2, properties={"KEYS": f"k{i}"})
        for i in range(30)
    ]
    store = MessageStore(config)
    store.start()
    try:
        store.put_messages(msgs)
        assert store.wait_dispatched()
        assert len(store.commitlog.files.files) == 1, "the test wants one CommitLog file"
        run = store.dispatcher._read_columns(0, store.commitlog.max_offset)
        assert run is not None and len(run) == len(msgs)
    finally:
        store.shutdown()
    split: list[int] = []
    by_queue = dispatcher_module._by_queue

    def recording(numbers: Any, queues: int) -> Any:
        split.append(queues)
        return by_queue(numbers, queues)

    monkeypatch.setattr(dispatcher_module, "_by_queue", recording)
    cq_dir = config.consumequeue_dir

    def cq_files() -> dict[str, bytes]:
        files = (p for p in cq_dir.rglob("*") if p.is_file())
        return {str(p.relative_to(cq_dir)): p.read_bytes() for p in files}

    written = cq_files()
    queues = ConsumeQueueTable(cq_dir, config.consumequeue_entries_per_file)
    queues.load_and_recover()
    index = IndexService(config.data_dir / "index-copy", 13, 50)
    d = Dispatcher(None, queues, index, reput_offset=0, index_from=1 << 62)  # type: ignore[arg-type]
    try:
        d.apply_columns(run)
        assert split == [], "every entry was held: nothing to split"
        lagging = queues.get("t1", 1)
        assert lagging is not None and lagging.max_offset == 5
        last = max(m for m in range(len(msgs)) if msgs[m].topic == "t1" and msgs[m].queue_id == 1)
        assert lagging.truncate_from_physical(int(run.offsets[last])) == 1
        d.apply_columns(run)
        assert split == [len(run.queues)]
        assert lagging.max_offset == 5
        queues.flush()
    finally:
        queues.close()
        index.close()
    assert cq_files() == written
