"""A ConsumeQueue entry zeroed in the middle of a queue (a torn write, a power loss, bit rot) is
rebuilt from the CommitLog at the next start; a read that meets one before that fails at once
with an error naming it, and never sends a consumer to CommitLog offset 0."""

from __future__ import annotations

import struct
import time
from pathlib import Path

import pytest
from conftest import SMALL

from tiered.config import StoreConfig
from tiered.hot.consume_queue import DamagedEntryError
from tiered.record import Message
from tiered.store import MessageStore

PER_QUEUE = 600  # three ConsumeQueue files of 256 entries per queue


def body(queue_id: int, n: int) -> bytes:
    return f"q{queue_id}-m{n}-".encode() * 8


def write_two_queues(config: StoreConfig) -> None:
    """Queues 0 and 1 of topic t, interleaved in the CommitLog; a clean exit."""
    store = MessageStore(config)
    store.start()
    try:
        for i in range(0, PER_QUEUE, 20):
            store.put_messages(
                [Message("t", body(q, n), queue_id=q) for n in range(i, i + 20) for q in (0, 1)]
            )
        assert store.wait_dispatched()
    finally:
        store.shutdown()


def overwrite_entry(config: StoreConfig, queue_id: int, q: int, raw: bytes) -> None:
    """Entry ``q`` of queue ``queue_id`` of topic t overwritten in its file with ``raw``."""
    per_file = config.consumequeue_entries_per_file * 20
    pos = q * 20
    path = config.consumequeue_dir / "t" / str(queue_id) / f"{pos - pos % per_file:020d}"
    with path.open("r+b") as fh:
        fh.seek(pos % per_file)
        fh.write(raw)


def write_entry(config: StoreConfig, queue_id: int, q: int, entry: tuple[int, int, int]) -> None:
    overwrite_entry(config, queue_id, q, struct.pack(">qiq", *entry))


def zero_entries(config: StoreConfig, queue_id: int, first: int, count: int) -> None:
    for q in range(first, first + count):
        overwrite_entry(config, queue_id, q, bytes(20))


def read_queue(store: MessageStore, queue_id: int) -> list[bytes]:
    out: list[bytes] = []
    offset = 0
    while offset < store.max_offset("t", queue_id):
        result = store.get_messages("t", queue_id, offset, 32)
        assert result.next_offset > offset, (offset, result.status)
        out += [m.body for m in result.messages]
        offset = result.next_offset
    return out


def whole(queue_id: int) -> list[bytes]:
    """Every body written to queue ``queue_id`` by ``write_two_queues``, in order."""
    return [body(queue_id, n) for n in range(PER_QUEUE)]


def restart_repairs(config: StoreConfig, repaired: int, *queue_ids: int) -> None:
    """A start of the stopped store reports ``repaired`` ConsumeQueue entries rebuilt, and
    each of ``queue_ids`` reads back whole."""
    store = MessageStore(config)
    report = store.start()
    try:
        assert report.cq_entries_repaired == repaired
        for queue_id in queue_ids:
            assert read_queue(store, queue_id) == whole(queue_id)
    finally:
        store.shutdown()


def read_stops_at_40(store: MessageStore, match: str) -> float:
    """Queue 0 of the running store, damaged at its entry 40: a read from 0 returns the 40
    messages before it, and a read at 40 raises a ``DamagedEntryError`` matching ``match``.
    The seconds that failing read took."""
    result = store.get_messages("t", 0, 0, 64)
    assert [m.body for m in result.messages] == [body(0, n) for n in range(40)]
    assert result.next_offset == 40
    started = time.monotonic()
    with pytest.raises(DamagedEntryError, match=match):
        store.get_messages("t", 0, 40, 32)
    return time.monotonic() - started


@pytest.mark.parametrize(
    "first", [0, 100, 255, 300]
)  # the first entries, first file, across a file end, middle file
@pytest.mark.parametrize("exit_was", ["crash", "clean"])
def test_a_zeroed_consumequeue_entry_is_rebuilt_from_the_commitlog_at_start(
    tmp_path: Path, first: int, exit_was: str
) -> None:
    config = StoreConfig(data_dir=tmp_path / "store", **SMALL)
    write_two_queues(config)
    zero_entries(config, 1, first, 3)
    if exit_was == "crash":
        (config.data_dir / "abort").write_text("1\n")
    restart_repairs(config, 3, 1, 0)
    # The repair was written and flushed: the next start finds nothing to repair.
    restart_repairs(config, 0, 1)


def test_a_read_that_meets_a_zeroed_entry_fails_at_once_and_names_it(tmp_path: Path) -> None:
    """Damage while the store runs (the page cache holds the zeros): the read before it returns
    what precedes it, the read at it raises at once (a bounded, clear error a consumer is told),
    and a restart repairs it."""
    config = StoreConfig(data_dir=tmp_path / "store", **SMALL)
    write_two_queues(config)
    store = MessageStore(config)
    store.start()
    try:
        zero_entries(config, 0, 40, 1)  # the mapping is shared: the store sees the zeros
        assert read_stops_at_40(store, r"t/0.*queue offset 40.*restart") < 1.0
    finally:
        store.shutdown()
    restart_repairs(config, 1, 0)


def garble_entries(config: StoreConfig, queue_id: int, first: int, count: int) -> None:
    """Overwrite entries with non-zero garbage that points outside the CommitLog (past its end,
    or a negative offset), as random bytes over a ConsumeQueue page almost always do."""
    for i, q in enumerate(range(first, first + count)):
        phys = -(7 + i) * 4096 if i % 2 else 0x5E5E5E5E5E5E + i
        write_entry(config, queue_id, q, (phys, 0x5E5E + i, 0x5E5E5E5E))


@pytest.mark.parametrize("first", [100, 250])  # inside a file, across a file end
def test_consumequeue_entries_overwritten_with_garbage_are_rebuilt_at_start(
    tmp_path: Path, first: int
) -> None:
    """Entries with non-zero sizes pointing outside the CommitLog were not holes: the start kept
    them, and a read at the first one found no CommitLog file there, took it for a released one
    and answered NO_MATCHED_MESSAGE with the same offset as next, for ever: every later message
    of the queue hidden, nothing said (decision 663)."""
    config = StoreConfig(data_dir=tmp_path / "store", **SMALL)
    write_two_queues(config)
    garble_entries(config, 1, first, 9)
    restart_repairs(config, 9, 1, 0)


def test_a_read_that_meets_a_garbage_entry_fails_at_once_and_names_it(tmp_path: Path) -> None:
    config = StoreConfig(data_dir=tmp_path / "store", **SMALL)
    write_two_queues(config)
    store = MessageStore(config)
    store.start()
    try:
        garble_entries(config, 0, 40, 2)  # the mapping is shared: the store sees the garbage
        read_stops_at_40(store, r"t/0.*queue offset 40.*restart")
    finally:
        store.shutdown()
    restart_repairs(config, 2, 0)


def cq_file(config: StoreConfig, queue_id: int, index: int) -> Path:
    per_file = config.consumequeue_entries_per_file * 20
    return config.consumequeue_dir / "t" / str(queue_id) / f"{index * per_file:020d}"


@pytest.mark.parametrize(
    ("index", "keep"),
    [
        (1, 1010),  # a middle file, cut inside an entry: holes between surviving entries
        (2, 30 * 20 + 7),  # the last file, cut inside an entry: the queue's end is cut
        (2, 0),  # the last file emptied: the queue's end is cut
        (0, 100),  # the first file
    ],
)
@pytest.mark.parametrize("exit_was", ["crash", "clean"])
def test_a_consumequeue_file_cut_short_is_rebuilt_from_the_commitlog_at_start(
    tmp_path: Path, index: int, keep: int, exit_was: str
) -> None:
    """A ConsumeQueue file of the wrong size refused the start (decision 663 left it so); the
    operator had to move the consumequeue directory aside. Derived data is rebuilt instead
    (decision 685): every message reads back, and the queue's next message takes the next
    queue offset, not one the CommitLog already holds."""
    config = StoreConfig(data_dir=tmp_path / "store", **SMALL)
    write_two_queues(config)
    import os

    # Queue 0: queue 1's records come last in the CommitLog, so re-dispatch after a clean
    # exit starts past every record of queue 0.
    os.truncate(cq_file(config, 0, index), keep)
    if exit_was == "crash":
        (config.data_dir / "abort").write_text("1\n")
    store = MessageStore(config)
    store.start()
    try:
        assert read_queue(store, 1) == whole(1)
        assert read_queue(store, 0) == whole(0)
        assert store.put_message(Message("t", b"next", queue_id=0)).queue_offset == PER_QUEUE
        assert store.wait_dispatched()
    finally:
        store.shutdown()
    store = MessageStore(config)
    report = store.start()
    try:
        assert report.cq_entries_repaired == 0
        assert read_queue(store, 0) == [*whole(0), b"next"]
    finally:
        store.shutdown()


def entries_of(config: StoreConfig, queue_id: int) -> list[tuple[int, int, int]]:
    """The (CommitLog offset, size, tag hash) entries of queue ``queue_id`` of topic t, read
    from its files (the store is stopped)."""
    out = []
    for path in sorted((config.consumequeue_dir / "t" / str(queue_id)).iterdir()):
        out += [e for e in struct.iter_unpack(">qiq", path.read_bytes()) if e[1] > 0]
    return out


@pytest.mark.parametrize("first", [100, 250, 590])  # inside a file, across a file end, the end
def test_consumequeue_entries_pointing_inside_the_commitlog_at_other_bytes_are_rebuilt(
    tmp_path: Path, first: int
) -> None:
    """Garbage that names CommitLog bytes inside its range (another queue's record, the middle
    of a record) was kept by the start (decision 663 left it): a read returned the other
    queue's message as this one's, or failed on a record that is not there. The start finds
    such entries where they break the queue's CommitLog order and rebuilds them (686)."""
    config = StoreConfig(data_dir=tmp_path / "store", **SMALL)
    write_two_queues(config)
    other = entries_of(config, 0)
    for i, q in enumerate(range(first, min(first + 9, PER_QUEUE))):
        at, size, tag = other[(q * 7 + 300) % PER_QUEUE]
        # Another queue's whole record, or bytes inside one, far from this entry's place.
        write_entry(config, 1, q, (at, size, tag) if i % 2 else (at + 24, 90, 0x5E5E))
    restart_repairs(config, min(9, PER_QUEUE - first), 1, 0)


def test_a_read_that_meets_an_entry_naming_another_record_fails_and_the_start_rebuilds_it(
    tmp_path: Path,
) -> None:
    """An entry naming another queue's record that lies in order between its neighbours: no
    order check can see it, but the read decodes that record's header anyway, and refuses a
    record that is not the entry's own (686): a consumer is never handed another queue's
    message. The read notes it, and the next start checks and rebuilds it."""
    config = StoreConfig(data_dir=tmp_path / "store", **SMALL)
    write_two_queues(config)
    theirs = entries_of(config, 1)[40]  # written between queue 0's messages 40 and 41
    store = MessageStore(config)
    store.start()
    try:
        write_entry(config, 0, 40, theirs)  # the mapping is shared: the store sees it
        read_stops_at_40(store, r"t/0.*queue offset 40.*t/1.*restart")
    finally:
        store.shutdown()
    restart_repairs(config, 1, 0)
    store = MessageStore(config)
    assert store.start().cq_entries_repaired == 0
    store.shutdown()


def write_tagged(config: StoreConfig) -> None:
    """t/0 (tag A), t/1 (tag C) and u/0 (tag C), interleaved in the CommitLog; a clean exit."""
    store = MessageStore(config)
    store.start()
    try:
        for i in range(0, PER_QUEUE, 20):
            store.put_messages(
                [
                    Message(topic, body(q, n), queue_id=q, properties={"TAGS": tag})
                    for n in range(i, i + 20)
                    for topic, q, tag in (("t", 0, "A"), ("t", 1, "C"), ("u", 0, "C"))
                ]
            )
        assert store.wait_dispatched()
    finally:
        store.shutdown()


def read_filtered(store: MessageStore, tags: str, offset: int = 0) -> list[bytes]:
    from broker.pop import TagFilter

    tag_filter = TagFilter(tags)
    out: list[bytes] = []
    while offset < store.max_offset("t", 0):
        result = store.get_messages("t", 0, offset, 32, tag_filter=tag_filter.code_matches)
        assert result.next_offset > offset, (offset, result.status)
        out += [m.body for m in result.messages if tag_filter.matches(m)]
        offset = result.next_offset
    return out


@pytest.mark.parametrize("names", ["another queue", "another topic", "inside a record"])
def test_a_tag_filtered_read_checks_the_entries_its_filter_skips(
    tmp_path: Path, names: str
) -> None:
    """An entry that a tag filter skips is not read (its tag hash says "not for you"), but the
    hash is as much garbage as the offset: t/0's entry 40 (tag A) rewritten to name a tag-C
    record, or bytes inside one. Skipping it handed the tag-A consumer message 41 after 39 and
    dropped 40 without a word. The read now compares the skipped entry's record head and topic
    (decision 756): it stops before it, a read at it fails naming it, the entry is noted and
    the next start rebuilds it."""
    import struct

    config = StoreConfig(data_dir=tmp_path / "store", **SMALL)
    write_tagged(config)
    theirs = entries_of(config, 1)[40]  # t/1's record 40: queue id 1, tag C
    if names == "another topic":  # u/0's record 40: queue id 0 and queue offset 40 too
        path = config.consumequeue_dir / "u" / "0" / f"{0:020d}"
        theirs = struct.unpack_from(">qiq", path.read_bytes(), 40 * 20)
    elif names == "inside a record":
        theirs = (theirs[0] + 24, 90, theirs[2])
    store = MessageStore(config)
    store.start()
    try:
        assert read_filtered(store, "A")[:41] == [body(0, n) for n in range(41)]
        write_entry(config, 0, 40, theirs)  # the mapping is shared: the store sees it
        with pytest.raises(DamagedEntryError, match=r"t/0.*queue offset 40.*restart"):
            read_filtered(store, "A")
        from broker.pop import TagFilter

        code = TagFilter("A").code_matches
        result = store.get_messages("t", 0, 30, 32, tag_filter=code)
        assert [m.body for m in result.messages] == [body(0, n) for n in range(30, 40)]
        assert result.next_offset == 40
        with pytest.raises(DamagedEntryError, match=r"t/0.*queue offset 40.*holds"):
            store.get_messages("t", 0, 40, 32, tag_filter=TagFilter("B").code_matches)
    finally:
        store.shutdown()
    store = MessageStore(config)
    assert store.start().cq_entries_repaired == 1, "the read noted it for the start"
    try:
        assert read_filtered(store, "A") == [body(0, n) for n in range(PER_QUEUE)]
    finally:
        store.shutdown()


@pytest.mark.parametrize(
    "tail",
    [b'["t", 1, 12', b'["t", 1, 1\xff2]\n', bytes(4000)],
    ids=["torn", "flipped byte", "zeros"],
)
def test_a_damaged_line_of_the_damage_notes_is_skipped_and_the_other_notes_are_kept(
    tmp_path: Path, tail: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    """``damaged_entries`` after a power loss or bit rot: its last line torn, a byte of it
    flipped (not UTF-8), or zeros past the last write. The start still rebuilds the entries
    the whole lines name, and says which lines it skipped; it does not refuse to start over a
    file that only points it at entries to check (a flipped byte did, decision 1262)."""
    config = StoreConfig(data_dir=tmp_path / "store", **SMALL)
    write_two_queues(config)
    theirs = entries_of(config, 1)[40]
    store = MessageStore(config)
    store.start()
    try:
        write_entry(config, 0, 40, theirs)
        read_stops_at_40(store, r"t/0.*queue offset 40.*t/1.*restart")
    finally:
        store.shutdown()
    notes = config.data_dir / "damaged_entries"
    with notes.open("ab") as fh:
        fh.write(tail)
    restart_repairs(config, 1, 0, 1)
    skipped = [r.getMessage() for r in caplog.records if "were skipped" in r.getMessage()]
    if any(tail.strip(b"\0")):
        assert len(skipped) == 1 and f"{notes}: line(s) 2 " in skipped[0], skipped
    else:
        assert skipped == []
