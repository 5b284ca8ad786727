"""A slave stores a master's CommitLog bytes only after checking every record in them."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest
from conftest import SMALL

from tiered.config import StoreConfig
from tiered.record import Message, RecordError
from tiered.store import GetStatus, MessageStore


def open_store(path: Path) -> MessageStore:
    store = MessageStore(StoreConfig(data_dir=path, flush="sync", **SMALL))
    store.start()
    return store


@pytest.mark.parametrize("where", ["queue offset", "property", "record crc pair", "cut short"])
def test_a_slave_refuses_replicated_bytes_with_a_damaged_record(tmp_path: Path, where: str) -> None:
    master = open_store(tmp_path / "master")
    try:
        sizes = [
            r.size
            for r in master.put_messages(
                [Message("t", b"body %d" % i, properties={"UNIQ_KEY": f"id-{i}"}) for i in range(5)]
            )
        ]
        data = master.read_commitlog(0, 1 << 20)
    finally:
        master.shutdown()
    assert data is not None and len(data) == sum(sizes)
    third = sum(sizes[:2])
    damaged = bytearray(data)
    if where == "cut short":
        damaged = damaged[:-1]
    else:
        at = {"queue offset": 27, "property": sizes[2] - 25, "record crc pair": sizes[2] - 3}
        damaged[third + at[where]] ^= 0x01
    slave = open_store(tmp_path / "slave")
    try:
        slave.set_replica(True)
        with pytest.raises(RecordError):
            slave.append_replicated(0, bytes(damaged))
        assert slave.max_physical_offset == 0, "nothing of a refused payload is stored"
        slave.append_replicated(0, data)
        assert slave.max_physical_offset == len(data)
        assert slave.wait_dispatched()
        result = slave.get_messages("t", 0, 0, 10)
        assert result.status is GetStatus.FOUND
        assert [m.msg_id for m in result.messages] == [f"id-{i}" for i in range(5)]
        assert struct.unpack_from(">q", data, third + 20)[0] == 2
    finally:
        slave.shutdown()


def test_a_slave_appends_data_frames_read_into_one_reused_buffer(tmp_path: Path) -> None:
    """``wire.FrameReader`` hands a DATA payload over as a view of its buffer (no copies): the
    slave stores it as is, a frame larger than the buffer grows it, and the master's read of
    whole records (``read_commitlog``, which takes a tail of appends without walking it) cuts
    at record boundaries only."""
    import socket

    from broker.ha import wire

    master = open_store(tmp_path / "master")
    try:
        sizes = [
            r.size
            for r in master.put_messages(
                [Message("t", b"x" * 300, properties={"UNIQ_KEY": f"id-{i}"}) for i in range(8)]
            )
        ]
        everything = master.read_commitlog(0, 1 << 20)
        first = master.read_commitlog(0, sizes[0] + 1)  # room for one record and a byte
        rest = master.read_commitlog(sizes[0], 1 << 20)
    finally:
        master.shutdown()
    assert everything is not None and len(everything) == sum(sizes)
    assert first == everything[: sizes[0]] and rest == everything[sizes[0] :]
    a, b = socket.socketpair()
    slave = open_store(tmp_path / "slave")
    try:
        slave.set_replica(True)
        reader = wire.FrameReader(b, buffer_bytes=sizes[0] + 64)
        for offset, chunk in ((0, first), (sizes[0], rest)):
            frame = wire.Data(1, offset, len(everything), 0, chunk)
            a.sendall(wire.encode_data_header(frame) + chunk)
            kind, body = reader.read()
            assert kind is wire.FrameType.DATA and isinstance(body, memoryview)
            data = wire.decode_data(body)
            assert isinstance(data.payload, memoryview) and bytes(data.payload) == chunk
            slave.append_replicated(data.offset, data.payload)
        assert slave.max_physical_offset == len(everything)
        assert slave.read_commitlog(0, 1 << 20) == everything
        assert slave.wait_dispatched()
        result = slave.get_messages("t", 0, 0, 10)
        assert [m.msg_id for m in result.messages] == [f"id-{i}" for i in range(8)]
        a.sendall(wire.encode_error("bye"))
        with pytest.raises(wire.ProtocolError, match="bye"):
            reader.read()
    finally:
        slave.shutdown()
        a.close()
        b.close()


def master_records(path: Path, count: int) -> tuple[bytes, list[int]]:
    """A master's CommitLog after it appended ``count`` messages (ids ``id-0`` ...): its bytes
    and the size of each record."""
    master = open_store(path)
    try:
        appended = master.put_messages(
            [Message("t", b"body %d" % i, properties={"UNIQ_KEY": f"id-{i}"}) for i in range(count)]
        )
        data = master.read_commitlog(0, 1 << 20)
    finally:
        master.shutdown()
    assert data is not None
    return data, [r.size for r in appended]


@pytest.mark.parametrize("where", ["after records", "alone"])
def test_a_slave_refuses_a_blank_record_that_does_not_end_a_file(
    tmp_path: Path, where: str
) -> None:
    """A BLANK record pads a file to its end. One sent anywhere else (a buggy or hostile master)
    would make the slave's dispatch and recovery skip to the next file: whatever followed it in
    that file would be stored but never readable, and cut after a restart. It is refused with
    nothing stored, and the real bytes are taken afterwards."""
    from tiered.record import blank_record

    data, _ = master_records(tmp_path / "master", 5)
    hostile = (data if where == "after records" else b"") + blank_record(64)
    slave = open_store(tmp_path / "slave")
    try:
        slave.set_replica(True)
        with pytest.raises(RecordError, match="BLANK"):
            slave.append_replicated(0, hostile)
        assert slave.max_physical_offset == 0, "nothing of a refused payload is stored"
        slave.append_replicated(0, data)
        assert slave.wait_dispatched()
        # ... and a BLANK after them that does not reach the file's end is refused too.
        with pytest.raises(RecordError, match="BLANK"):
            slave.append_replicated(len(data), blank_record(64))
        assert slave.max_physical_offset == len(data)
        result = slave.get_messages("t", 0, 0, 10)
        assert [m.msg_id for m in result.messages] == [f"id-{i}" for i in range(5)]
    finally:
        slave.shutdown()


def test_a_slave_read_right_after_an_append_sees_everything_it_holds(tmp_path: Path) -> None:
    """A replica dispatches every 50 ms (decision 304). A read served by a slave (slave-read,
    while no master answers) right after its CommitLog took bytes must not report an older queue
    end than what it holds: a reader that stops at the end (a replay, a catch-up) would miss
    messages the slave has."""
    data, sizes = master_records(tmp_path / "master", 6)
    slave = open_store(tmp_path / "slave")
    try:
        slave.set_replica(True)
        at = 0
        for i, size in enumerate(sizes):
            slave.append_replicated(at, data[at : at + size])
            at += size
            result = slave.get_messages("t", 0, i, 10)
            assert result.status is GetStatus.FOUND, (i, result.status)
            assert [m.msg_id for m in result.messages] == [f"id-{i}"]
            assert slave.max_offset("t", 0) == i + 1
    finally:
        slave.shutdown()


def test_a_slave_ends_the_session_of_a_master_that_sends_a_misplaced_blank(tmp_path: Path) -> None:
    """The replication session against a master (here a hostile one, on a real socket) that
    sends a BLANK record inside a file: the slave answers ERROR naming it, closes the
    connection, stores nothing, and connects again a second later."""
    import socket

    from broker.ha import wire
    from broker.ha.config import HaConfig
    from broker.ha.slave import ReplicationSlave
    from tiered.epoch_file import EpochEntry, EpochFile
    from tiered.record import blank_record

    data, _ = master_records(tmp_path / "master", 3)
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(10)
    address = f"127.0.0.1:{listener.getsockname()[1]}"
    store = open_store(tmp_path / "slave")
    slave = ReplicationSlave(
        store,
        EpochFile(tmp_path / "slave"),
        HaConfig(enabled=True, role="slave", broker_id=1, master=address),
    )
    slave.start()
    try:
        conn, _ = listener.accept()
        conn.settimeout(10)
        with conn:
            hello = wire.decode_hello(wire.expect(conn, wire.FrameType.HELLO))
            assert hello.max_offset == 0
            end = len(data) + 64
            epochs = [EpochEntry(1, 0)]
            conn.sendall(wire.encode_welcome(wire.Welcome(1, 0, end, 0, epochs)))
            assert wire.decode_ack(wire.expect(conn, wire.FrameType.ACK)) == 0
            payload = data + blank_record(64)
            frame = wire.Data(1, 0, end, 0, payload)
            conn.sendall(wire.encode_data_header(frame) + payload)
            with pytest.raises(wire.ProtocolError, match="BLANK record"):
                wire.read_frame(conn)
            assert conn.recv(1) == b"", "the slave closed the connection"
        assert store.max_physical_offset == 0, "nothing of the refused frame is stored"
        assert slave.last_error is not None and "BLANK record" in slave.last_error
        again, _ = listener.accept()  # the slave reconnects
        again.close()
    finally:
        slave.stop()
        store.shutdown()
        listener.close()
