"""The native ``put_messages`` of an ASYNC batch (decision 1230) stores what the Python path
stores, and refuses what it refuses.

Two stores take the same sends, one through the native call and one with it turned off (the
store's Python path, the reference), under one clock: every send's answer (its results, or its
error's class and text) must be the same, and so must the CommitLog bytes and the ConsumeQueue
entries at the end. The sends are random batches with adversarial members (an unknown or
invalid topic, a queue id out of range or not an int, a body over the limit or not bytes,
properties the format refuses, batches that need a roll).
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from tiered.config import StoreConfig
from tiered.hot import commitlog as commitlog_module
from tiered.hot.commitlog import AppendBatch
from tiered.hot.group_commit import bind_native_put, native_put_batch
from tiered.record import EncodedBatch, Message
from tiered.store import (
    DispatchStuckError,
    DurabilityLostError,
    MessageStore,
    ReplicaStoreError,
    StoreNotRunningError,
)

pytestmark = pytest.mark.skipif(
    native_put_batch() is None, reason="the native group commit module is not built (or off)"
)

BODY_LIMIT = 3000
TOPICS = ["orders", "pay-1", "t_2", "orders"]


class Clock:
    """One store timestamp for both stores: it moves only when the test moves it."""

    def __init__(self) -> None:
        self.ms = 1_700_000_000_000

    def __call__(self) -> int:
        return self.ms


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Iterator[Clock]:
    c = Clock()
    real = commitlog_module.now_ms
    monkeypatch.setattr(commitlog_module, "now_ms", c)
    bind_native_put(EncodedBatch, AppendBatch, c)
    yield c
    bind_native_put(EncodedBatch, AppendBatch, real)


def open_store(root: Path, native: bool, file_size: int = 256 * 1024) -> MessageStore:
    store = MessageStore(
        StoreConfig(
            data_dir=root,
            flush="async",
            commitlog_file_size=file_size,
            consumequeue_entries_per_file=64,
            index_hash_slots=1024,
            index_max_entries=4096,
            max_message_size=BODY_LIMIT,
        )
    )
    store.start()
    if not native:
        store._put_batch = None
    return store


def outcome(store: MessageStore, batch: list[Message]) -> Any:
    try:
        r = store.put_messages(batch)
    except Exception as e:  # the class and the text are compared
        return type(e).__name__, str(e)
    return [tuple(x) for x in r]


def commitlog_bytes(store: MessageStore) -> bytes:
    return b"".join(bytes(f.mm[: f.wrote]) for f in store.commitlog.files.files)


def consume_queue_bytes(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes()
        for p in sorted((root / "consumequeue").rglob("*"))
        if p.is_file()
    }


def message(rnd: random.Random, i: int, odd: bool) -> Message:
    props: dict[str, str] = {}
    if rnd.random() < 0.7:
        props["UNIQ_KEY"] = f"0A000001{i:024X}"
    if rnd.random() < 0.4:
        props["TAGS"] = rnd.choice(["a", "b", "tag c"])
    if rnd.random() < 0.3:
        props["KEYS"] = " ".join(f"k{rnd.randrange(50)}" for _ in range(rnd.randrange(1, 4)))
    m = Message(
        topic=rnd.choice(TOPICS),
        body=rnd.randbytes(rnd.choice([0, 1, 100, 1024, 1500, BODY_LIMIT])),
        queue_id=rnd.randrange(8),
        properties=props,
        born_timestamp=rnd.randrange(1 << 40),
        born_host=rnd.choice([("10.0.0.7", 5000), ("10.0.0.7", 5000), ("::1", 9)]),
        flag=rnd.randrange(-5, 5),
    )
    if odd:
        kind = rnd.randrange(9)
        if kind == 0:
            m.topic = f"new-{rnd.randrange(1000)}"  # valid, not yet checked by this process
        elif kind == 1:
            m.topic = "bad topic!"
        elif kind == 2:
            m.queue_id = rnd.choice([-1, 1 << 40])
        elif kind == 3:
            m.queue_id = True  # an int subclass: checked one by one
        elif kind == 4:
            m.body = bytes(BODY_LIMIT + 1)
        elif kind == 5:
            m.body = bytearray(b"not bytes")  # type: ignore[assignment]
        elif kind == 6:
            m.properties = {"x\x01y": "v"}  # a separator in a name: the format refuses it
        elif kind == 7:
            m.properties = {"big": "v" * 40_000}  # over the format's 32 KiB of properties
        else:
            m.topic = "t" * 200  # over the name limit
    return m


SETTINGS = settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    phases=[Phase.explicit, Phase.reuse, Phase.generate],
)


@SETTINGS
@given(st.integers(0, 2**32), st.sampled_from([64 * 1024, 256 * 1024]))
def test_native_put_stores_and_refuses_what_the_python_path_does(
    tmp_path_factory: pytest.TempPathFactory, clock: Clock, seed: int, file_size: int
) -> None:
    rnd = random.Random(seed)
    root = tmp_path_factory.mktemp("put")
    native, reference = (
        open_store(root / "n", True, file_size),
        open_store(root / "p", False, file_size),
    )
    calls = {"native": 0}
    put = native._put_batch
    assert put is not None

    def counted(*args: Any) -> Any:
        done = put(*args)
        calls["native"] += done is not None
        return done

    native._put_batch = counted
    try:
        for k in range(rnd.randrange(4, 14)):
            # The first three sends are plain and at one instant: the third, at least, finds
            # its topics checked and the room measured, and is the native call's when it fits.
            n = rnd.choice([1, 2, 3, 17, 40, 120]) if k > 2 else 40
            odd = k > 2 and rnd.random() < 0.3
            batch = [message(rnd, i, odd and rnd.random() < 0.1) for i in range(n)]
            assert outcome(native, batch) == outcome(reference, batch)
            if k > 2:
                clock.ms += rnd.randrange(0, 150)  # past a room measurement's 100 ms at times
        # (64 KiB files roll at almost every batch: their sends are mostly the Python path's.)
        assert calls["native"] >= 1 or file_size == 64 * 1024
        for s in (native, reference):
            s.wait_dispatched(30)
        assert native.commitlog.max_offset == reference.commitlog.max_offset
        assert commitlog_bytes(native) == commitlog_bytes(reference)
        assert consume_queue_bytes(root / "n") == consume_queue_bytes(root / "p")
        assert native.commitlog.queue_offsets == reference.commitlog.queue_offsets
    finally:
        native.shutdown()
        reference.shutdown()


def test_native_put_takes_the_common_batch_and_its_results_read_back(
    tmp_path: Path, clock: Clock
) -> None:
    """The bench's batch (256 of 1 KiB, one topic, eight queues) goes through the native call
    once its topic is known and the room measured, and every message reads back."""
    store = open_store(tmp_path, True, 64 << 20)
    put = store._put_batch
    assert put is not None
    taken = []

    def counted(*args: Any) -> Any:
        done = put(*args)
        taken.append(done is not None)
        return done

    store._put_batch = counted
    body = bytes(range(256)) * 4
    ends: list[int] = []
    store.add_append_listener(ends.append)
    try:
        sent = []
        for k in range(6):
            batch = [
                Message(
                    topic="bench",
                    queue_id=i % 8,
                    body=body,
                    properties={"UNIQ_KEY": f"{k:08X}{i:024X}", "KEYS": f"key{k}-{i}"},
                )
                for i in range(256)
            ]
            results = store.put_messages(batch)
            sent.append(results)
            assert ends[-1] == results.end_offset == store.commitlog.max_offset
        # The first send checks the new topic one by one; the second measures the disk's room.
        assert taken[:2] == [False, False] and all(taken[2:]), taken
        store.wait_dispatched(30)
        for k, results in enumerate(sent):
            for i in (0, 7, 255):
                got = store.get_messages("bench", i % 8, results[i].queue_offset, 1).messages[0]
                assert got.body == body
                assert got.properties["UNIQ_KEY"] == f"{k:08X}{i:024X}"
                assert got.commitlog_offset == results[i].commitlog_offset
        assert store.commitlog.queue_offsets[("bench", 3)] == 6 * 32
        assert store.query_by_key("bench", "key5-9")  # the IndexFile took the batch's keys
    finally:
        store.shutdown()


@pytest.mark.parametrize("state", ["stopped", "replica", "failed", "stuck"])
def test_a_refusing_store_refuses_a_batch_as_the_python_path_does(
    tmp_path: Path, state: str
) -> None:
    store = open_store(tmp_path, True)
    batch = [Message(topic="orders", queue_id=1, body=b"x" * 10) for _ in range(40)]
    store.put_messages(batch)
    store.put_messages(batch)
    before = store.commitlog.max_offset
    expected: type[Exception]
    if state == "stopped":
        store.shutdown()
        expected = StoreNotRunningError
    elif state == "replica":
        store.set_replica(True)
        expected = ReplicaStoreError
    elif state == "failed":
        store.commitlog.fail(OSError(5, "Input/output error"))
        expected = DurabilityLostError
    else:
        assert store.dispatcher is not None
        store.dispatcher.stuck = "a test's stuck pass"
        expected = DispatchStuckError
    try:
        with pytest.raises(expected):
            store.put_messages(batch)
        assert store.commitlog.max_offset == before
    finally:
        if state != "stopped":
            if store.dispatcher is not None:
                store.dispatcher.stuck = None
            store.shutdown()


def test_a_failed_write_of_the_native_put_fails_the_store_as_the_python_path_does(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The encoder's ``pwrite`` failing (EIO) inside the native call: the send raises what
    ``CommitLog.append`` raises for it, nothing is published, and the store takes no more."""
    store = open_store(tmp_path, True, 64 << 20)
    batch = [
        Message(topic="orders", queue_id=i % 4, body=bytes(1024), properties={"UNIQ_KEY": f"u{i}"})
        for i in range(64)
    ]
    store.put_messages(batch)
    store.put_messages(batch)  # the topic checked, the room measured (a key's charge)
    last = store.commitlog.files.files[-1]
    before = (store.commitlog.max_offset, dict(store.commitlog.queue_offsets))
    real_sink: Callable[[], Any] = last.append_sink

    def read_only_sink() -> Any:
        _fd, mm, pos, between = real_sink()
        bad = os.open(last.path, os.O_RDONLY)
        opened.append(bad)
        return bad, mm, pos, between

    opened: list[int] = []
    monkeypatch.setattr(last, "append_sink", read_only_sink)
    try:
        with pytest.raises(DurabilityLostError):
            store.put_messages(batch)
        assert opened, "the native call offered the encoder the file"
        assert (store.commitlog.max_offset, store.commitlog.queue_offsets) == before
        assert store.commitlog.failed is not None
        with pytest.raises(DurabilityLostError):
            store.put_messages(batch)
    finally:
        for fd in opened:
            os.close(fd)
        store.shutdown()
