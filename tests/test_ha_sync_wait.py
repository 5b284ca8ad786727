"""The SYNC wait of a replication master, in process, against a slave speaking the wire protocol
on a real socket: sends wait in a heap and an ACK releases exactly those below the offset the
group holds, in one pass; the rest wait on, time out with the holders counted, or fail at stop."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Literal

import pytest

from broker.ha import wire
from broker.ha.config import HaConfig
from broker.ha.gate import ReplicationTimeoutError
from broker.ha.master import ReplicationMaster
from tiered.config import StoreConfig
from tiered.epoch_file import EpochFile
from tiered.record import Message
from tiered.store import MessageStore

FILE_SIZE = 1 << 20


class Waiter:
    """One SYNC send waiting in its own thread."""

    def __init__(self, master: ReplicationMaster, end_offset: int) -> None:
        self.error: BaseException | None = None
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(master, end_offset), daemon=True)
        self.thread.start()

    def _run(self, master: ReplicationMaster, end_offset: int) -> None:
        try:
            master.wait_replicated(end_offset)
        except BaseException as e:
            self.error = e
        self.done.set()


def read_until(sock: socket.socket, end: int, got: bytearray, start: int) -> None:
    """Read DATA frames (heartbeats included) until the stream reached ``end``."""
    while start + len(got) < end:
        kind, body = wire.read_frame(sock)
        assert kind is wire.FrameType.DATA, kind
        data = wire.decode_data(body)
        if data.payload:
            assert data.offset == start + len(got)
            got += data.payload


def test_an_ack_releases_every_waiter_below_it_and_only_those(
    tmp_path: Path, start_store: Callable[[StoreConfig], MessageStore]
) -> None:
    store = start_store(StoreConfig(data_dir=tmp_path / "m", commitlog_file_size=FILE_SIZE))
    config = HaConfig(
        enabled=True,
        listen="127.0.0.1:0",
        mode="sync",
        min_in_sync_replicas=2,
        sync_timeout_ms=1500,
        max_lag_ms=60_000,
    )
    master = ReplicationMaster(store, EpochFile(tmp_path / "m"), config)
    port = master.start()
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    try:
        sock.sendall(wire.encode_hello(wire.Hello(1, FILE_SIZE, 0, 0, [])))
        welcome = wire.decode_welcome(wire.expect(sock, wire.FrameType.WELCOME))
        start = welcome.max_offset
        sock.sendall(wire.encode_ack(start))
        wire.expect(sock, wire.FrameType.DATA)  # the first heartbeat
        sock.sendall(wire.encode_ack(start))  # caught up: in the SyncStateSet
        deadline = time.monotonic() + 5
        while master.sync_state_set() != [0, 1]:
            assert time.monotonic() < deadline, master.sync_state_set()
            time.sleep(0.02)

        ends = []
        for i in range(3):
            store.put_messages([Message(topic="t", queue_id=0, body=b"%d" % i * 100)] * 8)
            ends.append(store.max_physical_offset)
        waiters = [Waiter(master, end) for end in ends]
        got = bytearray()
        read_until(sock, ends[-1], got, start)
        assert bytes(got) == store.read_commitlog(start, FILE_SIZE)
        time.sleep(0.3)
        assert not any(w.done.is_set() for w in waiters), "released before any ACK"

        sock.sendall(wire.encode_ack(ends[1]))
        assert waiters[0].done.wait(5) and waiters[1].done.wait(5)
        assert waiters[0].error is None and waiters[1].error is None
        time.sleep(0.3)
        assert not waiters[2].done.is_set(), "released by an ACK below its offset"

        sock.sendall(wire.encode_ack(ends[2]))
        assert waiters[2].done.wait(5) and waiters[2].error is None
        # Held already: returns at once, without waiting for anything.
        began = time.monotonic()
        master.wait_replicated(ends[1])
        assert time.monotonic() - began < 0.1

        store.put_messages([Message(topic="t", queue_id=0, body=b"late")])
        late = Waiter(master, store.max_physical_offset)
        assert late.done.wait(10)
        assert isinstance(late.error, ReplicationTimeoutError)
        assert "only 1 of min_in_sync_replicas=2" in str(late.error)

        store.put_messages([Message(topic="t", queue_id=0, body=b"at stop")])
        stopped = Waiter(master, store.max_physical_offset)
        time.sleep(0.2)
    finally:
        sock.close()
        master.stop()
    assert stopped.done.wait(5)
    with pytest.raises(ReplicationTimeoutError):
        raise stopped.error or AssertionError("a waiter was acknowledged at stop")


def _sync_master(
    tmp_path: Path,
    start_store: Callable[[StoreConfig], MessageStore],
    mode: Literal["sync", "async"] = "sync",
) -> tuple[MessageStore, ReplicationMaster, socket.socket, int]:
    """A master with one slave (this test's socket) in its SyncStateSet; returns where the
    stream starts."""
    store = start_store(StoreConfig(data_dir=tmp_path / "m", commitlog_file_size=FILE_SIZE))
    config = HaConfig(
        enabled=True,
        listen="127.0.0.1:0",
        mode=mode,
        min_in_sync_replicas=2 if mode == "sync" else 1,
        sync_timeout_ms=5000,
        max_lag_ms=60_000,
    )
    master = ReplicationMaster(store, EpochFile(tmp_path / "m"), config)
    port = master.start()
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.sendall(wire.encode_hello(wire.Hello(1, FILE_SIZE, 0, 0, [])))
    start = wire.decode_welcome(wire.expect(sock, wire.FrameType.WELCOME)).max_offset
    sock.sendall(wire.encode_ack(start))
    wire.expect(sock, wire.FrameType.DATA)  # the first heartbeat
    sock.sendall(wire.encode_ack(start))
    deadline = time.monotonic() + 5
    while len(master.sync_state_set()) != 2:
        assert time.monotonic() < deadline, master.sync_state_set()
        time.sleep(0.02)
    return store, master, sock, start


def test_a_send_that_finds_the_stream_busy_is_shipped_by_the_holder_not_the_push_thread(
    tmp_path: Path, start_store: Callable[[StoreConfig], MessageStore]
) -> None:
    """Producer A holds the stream (it has shipped its bytes and is about to let go) when
    producer B appends: B leaves at once, and A ships B's bytes after letting go, in its own
    thread. Waking the push thread for them (as before decision 371) is a thread hand-off more
    on the path every SYNC send waits for."""
    store, master, sock, start = _sync_master(tmp_path, start_store)
    shippers: list[str] = []
    a_done_shipping = threading.Event()
    b_appended = threading.Event()
    real_ship = master._ship

    def ship(state: object, *, block: bool) -> bool:
        shipped = real_ship(state, block=block)  # type: ignore[arg-type]
        if shipped:
            shippers.append(threading.current_thread().name)
        elif threading.current_thread().name == "producer-a" and not a_done_shipping.is_set():
            a_done_shipping.set()  # A's bytes are out; it still holds the stream
            assert b_appended.wait(5)
        return shipped

    master._ship = ship  # type: ignore[method-assign]
    try:

        def producer_a() -> None:
            master.check_writable()  # as a send does: its append then wakes no push thread
            store.put_messages([Message(topic="t", queue_id=0, body=b"a" * 500)])
            master._ship_now()

        a = threading.Thread(target=producer_a, name="producer-a")
        a.start()
        assert a_done_shipping.wait(5)
        master.check_writable()
        store.put_messages([Message(topic="t", queue_id=0, body=b"b" * 500)])
        end = store.max_physical_offset
        began = time.monotonic()
        master._ship_now()  # B: the stream is A's; returns without waiting for it
        assert time.monotonic() - began < 0.5
        b_appended.set()
        a.join(5)
        got = bytearray()
        read_until(sock, end, got, start)
        assert bytes(got) == store.read_commitlog(start, FILE_SIZE)
        assert shippers == ["producer-a", "producer-a"], shippers
    finally:
        b_appended.set()
        sock.close()
        master.stop()


def test_a_sync_master_dispatches_in_larger_passes_and_restores_the_cadence_at_stop(
    tmp_path: Path, start_store: Callable[[StoreConfig], MessageStore]
) -> None:
    store, master, sock, _ = _sync_master(tmp_path, start_store)
    assert store.dispatcher is not None
    try:
        assert store.dispatcher.coalesce_s == pytest.approx(0.004)
        store.put_messages([Message(topic="t", queue_id=0, body=b"x")])
        # Readable within the longer cadence all the same.
        assert store.wait_dispatched(timeout=5)
        assert store.max_offset("t", 0) == 1
    finally:
        sock.close()
        master.stop()
    assert store.dispatcher.coalesce_s == pytest.approx(0.001)


def test_an_async_master_keeps_the_one_millisecond_dispatch_cadence(
    tmp_path: Path, start_store: Callable[[StoreConfig], MessageStore]
) -> None:
    store, master, sock, _ = _sync_master(tmp_path, start_store, mode="async")
    try:
        assert store.dispatcher is not None
        assert store.dispatcher.coalesce_s == pytest.approx(0.001)
    finally:
        sock.close()
        master.stop()
