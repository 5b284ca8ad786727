"""Damaged files get the documented outcome (docs/operations.md, "Recovery") and never a silent
loss of valid data. Each test crashes a real writer process, damages real files, and restarts."""

from __future__ import annotations

import hashlib
import itertools
import os
import random
import shutil
import time
from pathlib import Path

import pytest
from conftest import brute_force_scan, crash_after_writing, run_child
from store_child import body_for

from tiered.config import StoreConfig
from tiered.hot.data_dir import DataDirLockedError
from tiered.hot.mapped_file import StoreLoadError
from tiered.record import CorruptRecordError, Message, StoredMessage
from tiered.store import MessageStore


def file_of(config: StoreConfig, offset: int) -> tuple[Path, int]:
    size = config.commitlog_file_size
    start = offset - offset % size
    return config.commitlog_dir / f"{start:020d}", offset - start


def patch(path: Path, pos: int, data: bytes) -> None:
    with path.open("r+b") as fh:
        fh.seek(pos)
        fh.write(data)


def zero_from(config: StoreConfig, offset: int) -> None:
    """The CommitLog zero-filled from ``offset`` to the end of its last file."""
    path, pos = file_of(config, offset)
    patch(path, pos, bytes(config.commitlog_file_size - pos))
    for later in sorted(config.commitlog_dir.iterdir()):
        if later.name > path.name:
            patch(later, 0, bytes(config.commitlog_file_size))


def digest(directory: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir())}


def assert_all_readable(store: MessageStore, msgs: list[StoredMessage]) -> None:
    for m in msgs:
        got = store.get_messages(m.topic, m.queue_id, m.queue_offset, 1).messages
        assert got and got[0] == m, f"message at {m.topic}/{m.queue_id}@{m.queue_offset} lost"
        assert got[0].body == body_for(got[0].msg_id)


@pytest.fixture
def crashed(small_config: StoreConfig) -> tuple[StoreConfig, list[StoredMessage]]:
    """A store whose writer appended 300 messages and died without shutting down."""
    crash_after_writing(small_config.data_dir, 300)
    msgs = brute_force_scan(small_config.commitlog_dir)
    assert len(msgs) == 300
    assert len(list(small_config.commitlog_dir.iterdir())) >= 3
    return small_config, msgs


def test_half_written_last_record_is_cut_and_copied_aside(crashed, start_store) -> None:
    config, msgs = crashed
    last = msgs[-1]
    path, pos = file_of(config, last.commitlog_offset)
    original = path.read_bytes()[pos : pos + last.size]
    patch(path, pos + last.size // 2, bytes(last.size - last.size // 2))

    store = start_store(config)
    report = store.start_report
    assert report is not None and not report.clean_exit
    assert report.commitlog.end_offset == store.commitlog.max_offset == last.commitlog_offset
    assert report.commitlog.truncated_bytes > 0
    assert_all_readable(store, msgs[:-1])
    assert store.max_offset(last.topic, last.queue_id) == last.queue_offset
    quarantined = list(config.quarantine_dir.iterdir())
    assert [q.read_bytes() for q in quarantined] == [original[: last.size // 2].rstrip(b"\0")]
    # The queue continues without a gap or a repeat.
    again = store.put_message(Message(topic=last.topic, queue_id=last.queue_id, body=b"next"))
    assert again.queue_offset == last.queue_offset
    assert again.commitlog_offset == last.commitlog_offset


def test_flipped_body_byte_is_reported_and_refused_not_truncated(crashed) -> None:
    config, msgs = crashed
    victim = next(m for m in msgs[140:] if len(m.body) > 10)
    path, pos = file_of(config, victim.commitlog_offset)
    body_at = pos + 88  # IPv4 hosts: the body starts 88 bytes into the record
    patch(path, body_at + 3, bytes([victim.body[3] ^ 0xFF]))
    (config.data_dir / "checkpoint").unlink()  # make recovery scan everything

    store = MessageStore(config)
    report = store.start()
    try:
        assert report.commitlog.corrupt_records == [victim.commitlog_offset]
        with pytest.raises(CorruptRecordError):
            store.get_messages(victim.topic, victim.queue_id, victim.queue_offset, 1)
        assert_all_readable(store, [m for m in msgs if m is not victim])
        assert store.commitlog.max_offset == msgs[-1].commitlog_offset + msgs[-1].size
    finally:
        store.shutdown()


def test_bit_rot_after_a_clean_exit_fails_the_read_loudly(small_config, start_store) -> None:
    crash_after_writing(small_config.data_dir, 120)
    store = start_store(small_config)
    store.shutdown()
    msgs = brute_force_scan(small_config.commitlog_dir)
    victim = next(m for m in msgs[50:] if len(m.body) > 10)
    path, pos = file_of(small_config, victim.commitlog_offset)
    patch(path, pos + 88 + 5, bytes([victim.body[5] ^ 0x10]))
    store = start_store(small_config)
    with pytest.raises(CorruptRecordError, match="CRC"):
        store.get_messages(victim.topic, victim.queue_id, victim.queue_offset, 5)
    assert_all_readable(store, [m for m in msgs if m is not victim])


def test_zero_filled_tail_is_cut_without_losing_what_precedes_it(crashed, start_store) -> None:
    config, msgs = crashed
    cut = msgs[280]
    zero_from(config, cut.commitlog_offset)

    store = start_store(config)
    assert store.commitlog.max_offset == cut.commitlog_offset
    assert_all_readable(store, msgs[:280])
    for topic in {m.topic for m in msgs}:
        for qid in range(4):
            kept = sum(1 for m in msgs[:280] if (m.topic, m.queue_id) == (topic, qid))
            assert store.max_offset(topic, qid) == kept
    assert not config.quarantine_dir.exists(), "zeros are not data: nothing to keep aside"


def test_deleted_consumequeue_directory_is_rebuilt_after_a_crash(crashed, start_store) -> None:
    config, msgs = crashed
    shutil.rmtree(config.consumequeue_dir)
    store = start_store(config)
    assert_all_readable(store, msgs)


def test_deleted_index_file_is_rebuilt(small_config, start_store) -> None:
    crash_after_writing(small_config.data_dir, 2500)  # ~5000 index entries: 3 files of 2000
    msgs = brute_force_scan(small_config.commitlog_dir)
    index_files = sorted(small_config.index_dir.iterdir(), key=lambda p: p.name.split("-")[1])
    assert len(index_files) >= 3
    index_files[1].unlink()

    store = MessageStore(small_config)
    report = store.start()
    try:
        assert len(report.index_gaps_rebuilt) == 1
        lo, hi = report.index_gaps_rebuilt[0]
        assert sum(1 for m in msgs if lo <= m.commitlog_offset < hi) > 100
        # Every key of every message, not only those in the rebuilt range: a file must hold
        # exactly the entries of the records in its range, or losing it loses keys elsewhere.
        for m in msgs:
            by_id = store.query_by_key(m.topic, m.msg_id)
            assert [x.commitlog_offset for x in by_id] == [m.commitlog_offset]
            by_key = store.query_by_key(m.topic, f"key-{m.msg_id}")
            assert [x.commitlog_offset for x in by_key] == [m.commitlog_offset]
    finally:
        store.shutdown()


@pytest.mark.parametrize("damage", ["shrink-middle", "grow-last"])
def test_wrong_size_segment_refuses_to_start_and_changes_nothing(crashed, damage) -> None:
    config, _ = crashed
    files = sorted(config.commitlog_dir.iterdir())
    if damage == "shrink-middle":
        os.truncate(files[1], config.commitlog_file_size - 4096)
    else:
        with files[-1].open("ab") as fh:
            fh.write(b"\0" * 10)
    before = digest(config.commitlog_dir)
    with pytest.raises(StoreLoadError, match="configured file size"):
        MessageStore(config).start()
    assert digest(config.commitlog_dir) == before
    # The failed start released the lock: a corrected configuration could start now.
    with pytest.raises(StoreLoadError):
        MessageStore(config).start()


def test_second_process_on_the_same_data_dir_is_refused(small_config, start_store) -> None:
    holder = run_child(small_config.data_dir, "hold", "async")
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "ready"
        with pytest.raises(DataDirLockedError, match=f"pid {holder.pid}"):
            MessageStore(small_config).start()
    finally:
        holder.kill()
        holder.wait()
    start_store(small_config)  # the kernel dropped the dead holder's lock


def test_unreadable_header_with_valid_data_after_it_refuses_to_start(crashed) -> None:
    config, msgs = crashed
    victim, after = msgs[100], msgs[101]
    path, pos = file_of(config, victim.commitlog_offset)
    patch(path, pos, b"\xde\xad\xbe\xef\xde\xad\xbe\xef")
    (config.data_dir / "checkpoint").unlink()
    before = digest(config.commitlog_dir)
    with pytest.raises(StoreLoadError, match=f"resume at offset {after.commitlog_offset}"):
        MessageStore(config).start()
    assert digest(config.commitlog_dir) == before, "a refused start must not modify the log"


def test_damaged_checkpoint_means_a_full_scan(crashed, start_store) -> None:
    config, msgs = crashed
    patch(config.data_dir / "checkpoint", 10, b"\xff\xff")
    store = MessageStore(config)
    report = store.start()
    try:
        assert not report.checkpoint_found
        assert report.commitlog.scanned_from == 0
        assert report.commitlog.records_scanned == len(msgs)
        assert_all_readable(store, msgs)
    finally:
        store.shutdown()


def test_empty_last_file_from_a_crash_during_a_roll_is_removed(crashed, start_store) -> None:
    config, msgs = crashed
    files = sorted(config.commitlog_dir.iterdir())
    stray = config.commitlog_dir / f"{int(files[-1].name) + config.commitlog_file_size:020d}"
    stray.touch()
    store = start_store(config)
    assert not stray.exists()
    assert_all_readable(store, msgs)


def test_files_whose_creation_a_crash_interrupted_are_removed(crashed, start_store) -> None:
    config, msgs = crashed
    last = sorted(config.commitlog_dir.iterdir())[-1]
    short = config.commitlog_dir / f"{int(last.name) + config.commitlog_file_size:020d}"
    short.write_bytes(bytes(4096))  # created, partly preallocated, never written
    queue_dir = next(config.consumequeue_dir.rglob("0"))
    last_cq = sorted(queue_dir.iterdir())[-1]
    entries_bytes = config.consumequeue_entries_per_file * 20
    (queue_dir / f"{int(last_cq.name) + entries_bytes:020d}").write_bytes(bytes(100))
    (config.index_dir / "20991231000000000-00000000000000000000").touch()  # before ftruncate
    store = start_store(config)
    assert not short.exists()
    assert_all_readable(store, msgs)
    m = msgs[-1]
    assert [x.queue_offset for x in store.query_by_key(m.topic, m.msg_id)] == [m.queue_offset]


def test_a_short_last_file_with_data_in_it_is_still_refused(crashed) -> None:
    config, _ = crashed
    last = sorted(config.commitlog_dir.iterdir())[-1]
    os.truncate(last, config.commitlog_file_size // 2)
    with pytest.raises(StoreLoadError, match="configured file size"):
        MessageStore(config).start()


def test_a_lost_checkpoint_redispatches_queues_whose_tail_was_never_flushed(
    crashed, start_store
) -> None:
    """Without a checkpoint, re-dispatch cannot start at the furthest ConsumeQueue: a queue
    whose last entries were never flushed would keep a hole that no reader could see past."""
    config, msgs = crashed
    start_store(config).shutdown()  # every file whole and flushed, the IndexFile up to date
    (config.data_dir / "abort").write_text("1\n")  # ... and then the next run crashed
    by_queue: dict[tuple[str, int], list[StoredMessage]] = {}
    for m in msgs:
        by_queue.setdefault((m.topic, m.queue_id), []).append(m)
    # The queue whose last message lies earliest in the CommitLog loses its last 5 entries, as
    # if its ConsumeQueue page never reached the disk; the other queues keep theirs.
    victim = min(by_queue, key=lambda q: by_queue[q][-1].commitlog_offset)
    lost = by_queue[victim][-5:]
    assert any(m.commitlog_offset > lost[-1].commitlog_offset for m in msgs)
    queue_dir = config.consumequeue_dir / victim[0] / str(victim[1])
    entries_bytes = config.consumequeue_entries_per_file * 20
    for m in lost:
        start = m.queue_offset * 20 - (m.queue_offset * 20) % entries_bytes
        patch(queue_dir / f"{start:020d}", m.queue_offset * 20 - start, bytes(20))
    (config.data_dir / "checkpoint").unlink()

    store = start_store(config)
    assert store.max_offset(*victim) == lost[-1].queue_offset + 1
    assert_all_readable(store, msgs)


def test_consumequeue_files_cut_short_after_a_crash_are_rebuilt(crashed, start_store) -> None:
    """kill -9, then every queue's last ConsumeQueue file cut inside an entry: the start used to
    refuse (a wrong-size file); it rebuilds them from the CommitLog and every queue goes on at
    its next offset (decision 685)."""
    config, msgs = crashed
    for queue_dir in sorted(p for p in config.consumequeue_dir.glob("*/*") if p.is_dir()):
        last = sorted(queue_dir.iterdir())[-1]
        os.truncate(last, last.stat().st_size // 3 + 7)
    store = start_store(config)
    assert_all_readable(store, msgs)
    for topic, qid in {(m.topic, m.queue_id) for m in msgs}:
        count = sum(1 for m in msgs if (m.topic, m.queue_id) == (topic, qid))
        assert store.max_offset(topic, qid) == count
        assert store.put_message(Message(topic, b"next", queue_id=qid)).queue_offset == count


def index_files_by_offset(config: StoreConfig) -> list[Path]:
    return sorted(
        (p for p in config.index_dir.iterdir() if not p.name.startswith(".")),
        key=lambda p: p.name.split("-")[1],
    )


def index_entry_at(config: StoreConfig, number: int) -> int:
    return 40 + config.index_hash_slots * 4 + number * 20


def assert_every_key_found(store: MessageStore, msgs: list[StoredMessage]) -> None:
    lost = []
    for m in msgs:
        by_id = store.query_by_key(m.topic, m.msg_id)
        by_key = store.query_by_key(m.topic, f"key-{m.msg_id}")
        if [x.commitlog_offset for x in by_id] != [m.commitlog_offset] or [
            x.commitlog_offset for x in by_key
        ] != [m.commitlog_offset]:
            lost.append(m.msg_id)
    assert not lost, f"{len(lost)} of {len(msgs)} messages not found by key"


@pytest.mark.parametrize("where", ["slots of an older file", "entries of the newest file"])
def test_garbage_over_an_index_file_is_found_and_rebuilt_at_start(small_config, where) -> None:
    """300 random bytes over an IndexFile's slots or entries (no checksum) lost keys silently
    (decision 663 left it): the start checks every file's slots and the newest file's entries
    and rebuilds a damaged file from its CommitLog range (decision 687)."""
    crash_after_writing(small_config.data_dir, 2500)  # kill -9: 3 IndexFiles of 2000 entries
    msgs = brute_force_scan(small_config.commitlog_dir)
    files = index_files_by_offset(small_config)
    if where.startswith("slots"):
        victim, at = files[1], 40 + 100 * 4
    else:
        victim, at = files[-1], index_entry_at(small_config, 300)
    patch(victim, at, random.Random(687).randbytes(300))

    store = MessageStore(small_config)
    store.start()
    try:
        assert not victim.exists()
        assert_every_key_found(store, msgs)
    finally:
        store.shutdown()


def test_a_query_that_meets_a_damaged_index_file_finds_every_key_and_a_start_rebuilds_it(
    small_config,
) -> None:
    """Damage while the store runs (the mapping is shared): a query meeting garbage in a chain,
    or an entry whose offset names a record without its key, answers from the file's
    CommitLog range instead of losing the key, and notes the file; the next start rebuilds
    it (decision 687)."""
    crash_after_writing(small_config.data_dir, 2500)
    msgs = brute_force_scan(small_config.commitlog_dir)
    first, victim = index_files_by_offset(small_config)[:2]
    store = MessageStore(small_config)
    store.start()
    try:
        patch(victim, index_entry_at(small_config, 900), random.Random(6870).randbytes(300))
        # In another file, only the CommitLog offset of entry 700: its hash and link are whole.
        patch(first, index_entry_at(small_config, 700) + 4, (64).to_bytes(8, "big"))
        assert_every_key_found(store, msgs)
    finally:
        store.shutdown()
    store = MessageStore(small_config)
    report = store.start()
    try:
        # Both files, side by side: one range of the CommitLog re-indexed.
        assert not first.exists() and not victim.exists()
        assert report.index_gaps_rebuilt and report.index_gaps_rebuilt[0][0] == 0
        assert not (small_config.index_dir / ".damaged").exists()
        assert_every_key_found(store, msgs)
    finally:
        store.shutdown()


@pytest.mark.parametrize(
    "tail", [b"0000000000000", b"\xff\xfe", bytes(512)], ids=["torn", "flipped byte", "zeros"]
)
def test_a_damaged_line_of_the_index_notes_is_skipped_and_the_noted_file_still_rebuilt(
    small_config, tail: bytes
) -> None:
    """``index/.damaged`` names the IndexFiles queries found damaged, for the next start to
    rebuild. A power loss or bit rot leaves a torn last line, a byte that is not text, or
    zeros: the start still rebuilds the file the whole line names, and starts. A byte that was
    not UTF-8 refused the start over a file that only points it at what to check (decision
    1262)."""
    crash_after_writing(small_config.data_dir, 2500)
    msgs = brute_force_scan(small_config.commitlog_dir)
    first = index_files_by_offset(small_config)[0]
    store = MessageStore(small_config)
    store.start()
    try:
        patch(first, index_entry_at(small_config, 700) + 4, (64).to_bytes(8, "big"))
        assert_every_key_found(store, msgs)  # the query notes the file
    finally:
        store.shutdown()
    notes = small_config.index_dir / ".damaged"
    assert notes.read_text() == first.name + "\n"
    with notes.open("ab") as fh:
        fh.write(tail)
    store = MessageStore(small_config)
    report = store.start()
    try:
        assert not first.exists()
        assert report.index_gaps_rebuilt and report.index_gaps_rebuilt[0][0] == 0
        assert not notes.exists()
        assert_every_key_found(store, msgs)
    finally:
        store.shutdown()


def test_index_entries_past_a_commitlog_cut_are_dropped_not_taken_for_damage(
    crashed, start_store
) -> None:
    """kill -9, then a zero-filled tail cuts the CommitLog: the IndexFile entries of the cut
    records are dropped with it (decision 687). Kept, they named the records appended there
    next, which a query now takes for damage: it would scan the file's range and have the next
    start rebuild it."""
    config, msgs = crashed
    cut = msgs[280]
    zero_from(config, cut.commitlog_offset)
    store = start_store(config)
    again = store.put_messages(
        [
            Message(
                m.topic, b"again", queue_id=m.queue_id, properties={"KEYS": f"again-{m.msg_id}"}
            )
            for m in msgs[280:]
        ]
    )
    assert again[0].commitlog_offset == cut.commitlog_offset
    assert store.wait_dispatched()
    for m in msgs[280:]:
        assert store.query_by_key(m.topic, m.msg_id) == []
        assert [x.body for x in store.query_by_key(m.topic, f"again-{m.msg_id}")] == [b"again"]
    assert not (config.index_dir / ".damaged").exists()
    for m in msgs[:280]:
        assert [x.commitlog_offset for x in store.query_by_key(m.topic, m.msg_id)] == [
            m.commitlog_offset
        ]


KEYS_PER_TOPIC = 40


def write_keyed_eras(config: StoreConfig) -> list[StoredMessage]:
    """2,400 messages of topics t and u sharing keys k0..k39 (one in three is u's), each with a
    unique id: 4,800 IndexFile entries, three files of 2,000. Three eras of 800 a second apart,
    so that time windows select whole eras. Every record, read back from the CommitLog."""
    store = MessageStore(config)
    store.start()
    try:
        for era in range(3):
            if era:
                time.sleep(1.2)
            store.put_messages(
                [
                    Message(
                        "u" if n % 3 == 0 else "t",
                        f"m{n}".encode(),
                        properties={"KEYS": f"k{n % KEYS_PER_TOPIC}", "UNIQ_KEY": f"id{n}"},
                    )
                    for n in range(era * 800, era * 800 + 800)
                ]
            )
        assert store.wait_dispatched()
    finally:
        store.shutdown()
    return brute_force_scan(config.commitlog_dir)


def index_entry_naming(config: StoreConfig, path: Path, topic: str, key: str, at: int) -> int:
    """The byte position in ``path`` of the entry of ``topic#key`` naming CommitLog ``at``."""
    import struct

    from tiered.formats import key_hash

    data = path.read_bytes()
    want = key_hash(topic, key)
    for number in range(1, config.index_max_entries + 1):
        pos = index_entry_at(config, number)
        khash, offset, _seconds, _prev = struct.unpack_from(">iqii", data, pos)
        if (khash, offset) == (want, at):
            return pos
    raise AssertionError(f"no entry of {topic}#{key} naming {at} in {path.name}")


@pytest.mark.parametrize(
    "names",
    [
        "a record of another key",
        "a record of another topic with the same key",
        "a record inside the file's range",
        "a newer file's record of the same key",
        "an older record of the same key",
        "the middle of a record",
    ],
)
def test_a_damaged_entry_in_an_older_index_file_never_changes_a_key_query_answer(
    small_config: StoreConfig, names: str
) -> None:
    """An older IndexFile's entries are checked only when a query meets them (decisions 687,
    734). Whatever one is rewritten to name, no key query, over all time or a time window,
    answers with a message of another key or topic, twice, or without one it should have:
    the record an entry names must hold its key (687), and entries are in CommitLog order, so
    a chain's offsets fall from newest to oldest and stay inside the file's range (756). A
    damaged file is answered by a scan of its range and noted; the next start rebuilds it."""
    import struct

    config = small_config
    msgs = write_keyed_eras(config)
    assert len(msgs) == 2400
    files = index_files_by_offset(config)
    assert len(files) == 3
    first, second = (struct.unpack_from(">q", f.read_bytes(), 16)[0] for f in files[1:])
    older = [m for m in msgs if m.commitlog_offset < first]
    victim = next(m for m in older[100:] if m.topic == "t")
    key = victim.properties["KEYS"]
    same_key = [m for m in msgs if m.topic == "t" and m.properties["KEYS"] == key]
    target = {
        "a record of another key": next(
            m for m in older if m.topic == "t" and m.properties["KEYS"] != key
        ),
        "a record of another topic with the same key": next(
            m for m in msgs if m.topic == "u" and m.properties["KEYS"] == key
        ),
        "a record inside the file's range": older[-1],
        "a newer file's record of the same key": same_key[-1],
        "an older record of the same key": same_key[0],
        "the middle of a record": None,
    }[names]
    assert target is None or target.commitlog_offset != victim.commitlog_offset
    at = victim.commitlog_offset + 24 if target is None else target.commitlog_offset
    assert second > at or target is same_key[-1]
    eras = [msgs[i * 800 : i * 800 + 800] for i in range(3)]
    windows = [(0, 2**62)] + [(e[0].store_timestamp, e[-1].store_timestamp) for e in eras]
    assert all(a[1] < b[0] for a, b in itertools.pairwise(windows[1:]))

    def expected(topic: str, k: str, lo: int, hi: int) -> list[int]:
        return sorted(
            (
                m.commitlog_offset
                for m in msgs
                if m.topic == topic and m.properties["KEYS"] == k and lo <= m.store_timestamp <= hi
            ),
            reverse=True,
        )

    store = MessageStore(config)
    store.start()
    try:
        pos = index_entry_naming(config, files[0], "t", key, victim.commitlog_offset)
        patch(files[0], pos + 4, at.to_bytes(8, "big"))  # the mapping is shared
        for topic in ("t", "u"):
            for k in (key, f"k{(int(key[1:]) + 1) % KEYS_PER_TOPIC}"):
                for lo, hi in windows:
                    got = store.query_by_key(topic, k, lo, hi, max_count=1000)
                    assert all(m.topic == topic and m.properties["KEYS"] == k for m in got)
                    assert all(lo <= m.store_timestamp <= hi for m in got)
                    assert [m.commitlog_offset for m in got] == expected(topic, k, lo, hi), (
                        topic,
                        k,
                        (lo, hi),
                    )
        got = store.query_by_key("t", victim.msg_id or "")
        assert [m.commitlog_offset for m in got] == [victim.commitlog_offset]
    finally:
        store.shutdown()
    store = MessageStore(config)
    report = store.start()
    try:
        assert not files[0].exists(), "noted by the query and rebuilt at start"
        assert report.index_gaps_rebuilt
        got = store.query_by_key("t", key, max_count=1000)
        assert [m.commitlog_offset for m in got] == expected("t", key, 0, 2**62)
    finally:
        store.shutdown()


def test_after_kill_9_every_index_file_stays_in_commitlog_order(crashed, start_store) -> None:
    """After kill -9 the newest IndexFile's header may count entries for records past its
    range's end. The start indexes the records from that end again: the entries it had for
    them stayed as duplicates at higher numbers with lower offsets, out of the CommitLog order
    a query now checks chains against (decision 757). The start drops them first."""
    import numpy as np

    from tiered.hot.index_file import _ENTRY_DTYPE

    config, msgs = crashed
    store = start_store(config)
    store.put_messages([Message("again", b"x", properties={"KEYS": "again"})])
    assert store.wait_dispatched()
    assert store.check_index_files() == []
    for f in store.index.files:
        n = f.header.next_entry
        data = f.path.read_bytes()
        entries = np.frombuffer(data, _ENTRY_DTYPE, n, 40 + config.index_hash_slots * 4)
        offsets = entries["offset"][1:].astype(np.int64)
        assert (offsets[1:] >= offsets[:-1]).all(), f"{f.path.name}: entries out of order"
        assert len(offsets) == 2 * len(msgs) + 1  # a unique id and a key each, and "again"


def test_after_kill_9_the_index_cut_runs_beside_the_scan(
    crashed, start_store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The entries past the newest IndexFile's range (the test above) are dropped by the
    thread that loads the ConsumeQueues and IndexFiles while the CommitLog scan runs, not
    after it: their slots' walk back along the chains was serial work of the restart
    (decision 930). The cut after the scan finds nothing left; queries by key still answer
    every record once, in order."""
    import threading

    from tiered.hot.index_file import IndexFile

    cuts: list[tuple[str, int]] = []
    cut = IndexFile.cut_entries_from

    def recording(self: IndexFile, end_offset: int) -> int:
        dropped = cut(self, end_offset)
        cuts.append((threading.current_thread().name, dropped))
        return dropped

    monkeypatch.setattr(IndexFile, "cut_entries_from", recording)
    config, msgs = crashed
    store = start_store(config)
    dropped = [(name, n) for name, n in cuts if n]
    assert dropped, f"the crash should leave entries past the newest IndexFile's range: {cuts}"
    assert all(name.startswith("tmq-recovery-cq") for name, _ in dropped), cuts
    assert store.check_index_files() == []
    for m in msgs[::37]:
        keys = m.properties["KEYS"].split()
        got = store.query_by_key(m.topic, keys[0], max_count=1000)
        want = [x.commitlog_offset for x in msgs if keys[0] in x.properties.get("KEYS", "").split()]
        assert sorted(x.commitlog_offset for x in got) == want


def test_an_extent_map_the_disk_cannot_read_fails_the_start_and_cuts_nothing(
    crashed, tmp_path: Path
) -> None:
    """Decision 981: recovery reads only the stretches of a file the extent map
    (``SEEK_DATA``/``SEEK_HOLE``) says may hold data. On main any error of ``SEEK_DATA`` read
    as "no data from here on": with a record in the middle of the log that fails its CRC, the
    search for valid records after it (``_find_valid_record``) then found none, recovery took
    the record for a torn tail and cut the log there, losing every valid record after it, and
    the cut neither copied the tail aside nor zeroed it (both read the extent map too). A disk
    that cannot read a file's extent map (EIO, from the power-loss filesystem's ``fail-lseek``)
    must fail the start naming the file and leave the log as it was."""
    import errno

    from conftest import SMALL
    from test_power_loss import PowerLossMount, _need_fuse

    _need_fuse()
    config, msgs = crashed
    durable, mountpoint = tmp_path / "durable", tmp_path / "mnt"
    shutil.copytree(config.data_dir, durable / "store")
    victim = next(m for m in msgs[140:] if len(m.body) > 10)
    mount = PowerLossMount(mountpoint, durable)
    try:
        on_mount = StoreConfig(data_dir=mountpoint / "store", **SMALL)
        path, pos = file_of(on_mount, victim.commitlog_offset)
        patch(path, pos + 88 + 3, bytes([victim.body[3] ^ 0xFF]))
        (on_mount.data_dir / "checkpoint").unlink()  # recovery scans everything
        before = digest(on_mount.commitlog_dir)
        assert mount.command(f"fail-lseek {on_mount.commitlog_file_size}") == "armed"
        store = MessageStore(on_mount)
        try:
            with pytest.raises(OSError) as failed:
                store.start()
        finally:
            if store._running:  # main: the start succeeded on a cut log
                report_end = store.commitlog.max_offset
                store.shutdown()
                pytest.fail(
                    f"the start succeeded, the log cut at {report_end} "
                    f"(the damaged record at {victim.commitlog_offset}, "
                    f"{len(msgs) - msgs.index(victim) - 1} valid records after it)"
                )
        assert failed.value.errno == errno.EIO
        assert str(on_mount.commitlog_dir) in str(failed.value.filename)
        assert digest(on_mount.commitlog_dir) == before, "a failed start must not cut the log"
    finally:
        mount.close()
