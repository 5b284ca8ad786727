"""A queue started above its local end (``MessageStore.start_queue_at``, decision 720: a tiered
queue whose archive ends above it) stays there: its next messages take offsets from the floor,
and no later start brings its older records back under the floor, not the repair of a queue's
leading zeroed entries (decision 503) and not a rebuild of every ConsumeQueue."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from conftest import SMALL

from tiered.config import StoreConfig
from tiered.record import Message
from tiered.store import MessageStore, StoreLoadError

FLOOR = 100  # in the first ConsumeQueue file, beside the queue's first 20 entries


def body(tag: str, n: int) -> bytes:
    return f"{tag}-{n}-".encode() * 8


def hot_queue(store: MessageStore) -> list[tuple[int, bytes]]:
    out: list[tuple[int, bytes]] = []
    offset = store.hot_min_offset("t", 0)
    while offset < store.max_offset("t", 0):
        result = store.get_messages("t", 0, offset, 32)
        assert result.next_offset > offset, (offset, result.status)
        out += [(m.queue_offset, m.body) for m in result.messages]
        offset = result.next_offset
    return out


@pytest.mark.parametrize("then", ["clean restart", "crash", "consumequeues lost"])
def test_a_queue_started_at_a_floor_stays_above_it(tmp_path: Path, then: str) -> None:
    config = StoreConfig(data_dir=tmp_path / "store", **SMALL)
    store = MessageStore(config)
    store.start()
    try:
        store.put_messages([Message("t", body("old", n), queue_id=0) for n in range(20)])
        store.put_messages([Message("t", body("other", n), queue_id=1) for n in range(5)])
        assert store.wait_dispatched()
        assert store.start_queue_at("t", 0, FLOOR)
        assert not store.start_queue_at("t", 0, FLOOR), "already there"
        store.put_messages([Message("t", body("new", n), queue_id=0) for n in range(10)])
        assert store.wait_dispatched()
        want = [(FLOOR + n, body("new", n)) for n in range(10)]
        assert hot_queue(store) == want
    finally:
        store.shutdown()
    if then == "crash":
        (config.data_dir / "abort").write_text("1\n")
    elif then == "consumequeues lost":
        shutil.rmtree(config.consumequeue_dir)
    store = MessageStore(config)
    report = store.start()
    try:
        assert report.cq_entries_repaired == 0 and report.cq_entries_unrepaired == 0
        assert store.hot_min_offset("t", 0) == FLOOR
        assert hot_queue(store) == want
        assert store.max_offset("t", 1) == 5
        store.put_messages([Message("t", body("next", 0), queue_id=0)])
        assert store.wait_dispatched()
        assert hot_queue(store) == [*want, (FLOOR + 10, body("next", 0))]
    finally:
        store.shutdown()


def test_an_unreadable_floor_record_refuses_the_start(tmp_path: Path) -> None:
    config = StoreConfig(data_dir=tmp_path / "store", **SMALL)
    store = MessageStore(config)
    store.start()
    store.shutdown()
    (config.data_dir / "queue-floors.json").write_text("{not json")
    with pytest.raises(StoreLoadError, match=r"queue-floors\.json is unreadable"):
        MessageStore(config).start()
