"""The store facade: what the broker and the tiering layer rely on."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tiered.config import StoreConfig, parse_duration_ms, parse_size
from tiered.hot.mapped_file import MappedFile, StoreLoadError
from tiered.record import Message
from tiered.store import CommitLogFileInfo, GetStatus, InvalidMessageError, MessageStore


def msg(topic: str = "t", qid: int = 0, body: bytes = b"x", **props: str) -> Message:
    return Message(topic=topic, queue_id=qid, body=body, properties=dict(props))


def all_files(root: Path) -> set[Path]:
    return {p for p in root.rglob("*")}


@pytest.mark.parametrize("topic", ["../x", "a/b", "..", "", "x" * 256, "tab\t", "ünï", "a.b"])
def test_hostile_topic_names_are_refused_before_any_file_is_made(
    tmp_path, start_store, topic
) -> None:
    store = start_store(StoreConfig(data_dir=tmp_path / "d", commitlog_file_size=1 << 20))
    before = all_files(tmp_path)
    with pytest.raises(InvalidMessageError, match="invalid topic"):
        store.put_message(msg(topic))
    assert all_files(tmp_path) == before
    assert store.commitlog.max_offset == 0


def test_oversized_body_is_refused_and_nothing_is_stored(tmp_path, start_store) -> None:
    store = start_store(
        StoreConfig(data_dir=tmp_path / "d", commitlog_file_size=1 << 20, max_message_size=1000)
    )
    store.put_message(msg(body=b"a" * 1000))
    with pytest.raises(InvalidMessageError, match="1001 bytes; the limit is 1000"):
        store.put_messages([msg(body=b"ok"), msg(body=b"a" * 1001)])
    assert store.wait_dispatched()
    assert store.max_offset("t", 0) == 1, "a refused batch stores none of its messages"


def test_record_larger_than_a_commitlog_file_is_refused(small_config, start_store) -> None:
    store = start_store(small_config)
    with pytest.raises(InvalidMessageError, match="does not fit"):
        store.put_message(msg(body=b"a" * small_config.commitlog_file_size))
    assert store.commitlog.max_offset == 0


def test_bad_queue_id_and_property_separators_are_refused(small_config, start_store) -> None:
    store = start_store(small_config)
    with pytest.raises(InvalidMessageError):
        store.put_message(msg(qid=-1))
    with pytest.raises(InvalidMessageError):
        store.put_message(Message(topic="t", body=b"", properties={"k": "v\x02"}))
    assert store.commitlog.max_offset == 0


def test_read_statuses_follow_rocketmq(small_config, start_store) -> None:
    store = start_store(small_config)
    assert store.get_messages("t", 0, 0).status is GetStatus.NO_MATCHED_LOGIC_QUEUE
    store.put_messages([msg(body=bytes([i])) for i in range(5)])
    assert store.wait_dispatched()
    assert store.get_messages("t", 0, 5).status is GetStatus.OFFSET_OVERFLOW_ONE
    bad = store.get_messages("t", 0, 9)
    assert bad.status is GetStatus.OFFSET_OVERFLOW_BADLY and bad.next_offset == 5
    found = store.get_messages("t", 0, 2, max_count=2)
    assert found.status is GetStatus.FOUND
    assert [m.body for m in found.messages] == [b"\x02", b"\x03"] and found.next_offset == 4


def test_a_batch_spanning_files_gets_consecutive_queue_offsets(small_config, start_store) -> None:
    store = start_store(small_config)
    results = store.put_messages([msg(body=os.urandom(1000)) for _ in range(400)])
    assert [r.queue_offset for r in results] == list(range(400))
    assert len(store.commitlog.files.files) >= 3
    assert store.wait_dispatched()
    got = store.get_messages("t", 0, 0, 400, max_bytes=1 << 30).messages
    assert [m.commitlog_offset for m in got] == [r.commitlog_offset for r in results]


def test_sync_flush_acknowledges_only_fsynced_bytes(small_config, start_store) -> None:
    small_config.flush = "sync"
    store = start_store(small_config)
    result = store.put_messages([msg(body=b"a" * 100) for _ in range(50)])[-1]
    assert store.commitlog.flushed_offset >= result.commitlog_offset + result.size


def _roll_hooked(store: MessageStore, hook: Callable[[], None]) -> None:
    """Run ``hook`` once, on the appending thread, right after the next roll created a file:
    the file the append started in is no longer the last, its tail not yet written."""
    files = store.commitlog.files
    create = files.create_file

    def create_then_hook(start: int) -> MappedFile:
        f = create(start)
        files.create_file = create  # type: ignore[method-assign]
        hook()
        return f

    files.create_file = create_then_hook  # type: ignore[method-assign]


def _ids(store: MessageStore) -> list[str]:
    out: list[str] = []
    offset = store.min_offset("t", 0)
    while True:
        got = store.get_messages("t", 0, offset, 256)
        if got.status is not GetStatus.FOUND:
            return out
        out += [m.properties["KEYS"] for m in got.messages]
        offset = got.next_offset


def test_a_release_during_a_roll_leaves_the_file_the_append_writes(
    small_config, start_store
) -> None:
    """Found reading the send path after a SendMessage failed once under load while a tiered
    topic filled (decision 725): a release pass that ran between a roll and the write of the
    tail of the file the append started in deleted that file, no longer the last; the append
    wrote into its closed mapping and the send was refused."""
    store = start_store(small_config)
    store.put_messages([msg(body=os.urandom(2000), KEYS=f"k{i}") for i in range(100)])
    assert store.wait_dispatched()
    released: list[int] = []
    _roll_hooked(store, lambda: released.append(store.release_commitlog_files(lambda i: True)))
    store.put_messages([msg(body=os.urandom(2000), KEYS=f"k{i}") for i in range(100, 300)])
    assert released and released[0] >= 1, released  # the full files before it went
    assert store.wait_dispatched()
    assert _ids(store)[-200:] == [f"k{i}" for i in range(100, 300)]


def test_a_release_decided_during_a_roll_loses_no_acknowledged_tail(
    small_config, start_store
) -> None:
    """The same race, the other way round: the release saw the file the append started in
    as it was before the roll (its records dispatched and, say, uploaded), decided, and
    deleted it only after the append had written its tail there: acknowledged messages went
    with it, never dispatched from the file nor uploaded."""
    store = start_store(small_config)
    store.put_messages([msg(body=os.urandom(2000), KEYS=f"k{i}") for i in range(100)])
    assert store.wait_dispatched()
    appended = threading.Event()

    def slow_yes(info: CommitLogFileInfo) -> bool:
        appended.wait(10)  # a predicate that reads ConsumeQueues and asks the tier
        return True

    release = threading.Thread(target=store.release_commitlog_files, args=(slow_yes,))
    _roll_hooked(store, lambda: (release.start(), time.sleep(0.2)))
    store.put_messages([msg(body=os.urandom(2000), KEYS=f"k{i}") for i in range(100, 300)])
    appended.set()
    release.join(10)
    assert store.wait_dispatched()
    assert _ids(store)[-200:] == [f"k{i}" for i in range(100, 300)]


def test_release_keeps_undispatched_and_current_files(small_config, start_store) -> None:
    store = start_store(small_config)
    store.put_messages([msg(body=os.urandom(2000), KEYS=f"k{i}") for i in range(300)])
    assert store.wait_dispatched()
    n_files = len(store.commitlog_files())
    released = store.release_commitlog_files(lambda info: True)
    assert released == n_files - 1, "every file but the one being written"
    lo = store.min_offset("t", 0)
    assert lo > 0
    assert store.get_messages("t", 0, 0).status is GetStatus.OFFSET_TOO_SMALL
    assert store.get_messages("t", 0, lo).messages[0].queue_offset == lo
    assert store.query_by_key("t", "k0") == []
    assert store.query_by_key("t", "k299")[0].queue_offset == 299


def test_release_stops_at_the_first_file_the_predicate_keeps(small_config, start_store) -> None:
    store = start_store(small_config)
    store.put_messages([msg(body=os.urandom(2000)) for _ in range(300)])
    assert store.wait_dispatched()
    second = store.commitlog_files()[1].from_offset
    assert store.release_commitlog_files(lambda info: info.from_offset < second) == 1
    assert store.commitlog.min_offset == second


def test_released_state_survives_a_restart(small_config, start_store) -> None:
    store = start_store(small_config)
    store.put_messages([msg(body=os.urandom(2000)) for _ in range(300)])
    assert store.wait_dispatched()
    store.release_commitlog_files(lambda info: True)
    lo, hi = store.min_offset("t", 0), store.max_offset("t", 0)
    store.shutdown()
    again = start_store(small_config)
    assert (again.min_offset("t", 0), again.max_offset("t", 0)) == (lo, hi)
    assert again.put_message(msg()).queue_offset == hi


def test_sizes_and_durations_parse_like_an_operator_writes_them() -> None:
    assert parse_size("64KiB") == 65536 and parse_size("1g") == 1 << 30 and parse_size(5) == 5
    assert parse_duration_ms("90d") == 90 * 86_400_000 and parse_duration_ms("500ms") == 500
    with pytest.raises(ValueError):
        parse_size("lots")


def test_a_config_with_other_file_sizes_is_refused(small_config, start_store) -> None:
    store = start_store(small_config)
    store.put_message(msg())
    store.shutdown()
    other = StoreConfig(data_dir=small_config.data_dir, commitlog_file_size=1 << 20)
    with pytest.raises(StoreLoadError, match="commitlog_file_size was 131072, configured 1048576"):
        MessageStore(other).start()
    assert start_store(small_config).max_offset("t", 0) == 1
