"""A stored record whose property bytes are not UTF-8 (decision 660).

Such bytes cannot arrive by SendMessage (protobuf refuses a string that is not UTF-8, and the
native walker hands such a request to protobuf), but a CommitLog written by an older version,
by hand, or damaged where no record CRC guards it can hold them. One such record must not fail
the batch it is in (hot PullMessage, ReceiveMessage, both cold reply writers) nor stop the
dispatch that makes every later message of the store readable: the bad bytes are delivered as
U+FFFD, as Python's ``errors="replace"`` decodes them.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path
from typing import Any

import pytest
from broker_harness import Standalone, client_config
from rocketmq import FilterExpression, SimpleConsumer
from rocketmq.grpc_protocol import service_pb2 as s
from test_hostile_properties import pull, write_offline

from broker.reply import encode_pull_replies, encode_pull_replies_decoded, encode_pull_replies_py
from tiered import columnar
from tiered.record import (
    CRC_TRAILER_SIZE,
    NATIVE_ENGINE,
    PYTHON_ENGINE,
    Message,
    RecordEncoder,
    crc32c_of,
    crc_trailer,
)

BAD = b"\xff\xfe"  # never UTF-8
SHOWN = "\ufffd\ufffd"
# Message i: which property holds the bytes that are not UTF-8 (None: a good message).
WHERE = [None, "note", "TAGS", "KEYS", None]


def message(i: int, topic: str) -> Message:
    props = {"UNIQ_KEY": f"{i:032X}", "KEYS": f"k{i}", "TAGS": "t", "note": "fine"}
    where = WHERE[i]
    if where is not None:
        props[where] = f"ZZmark{i}"  # ZZ becomes BAD once stored
    return Message(topic=topic, body=f"body {i}".encode(), properties=props)


def expected(i: int) -> dict[str, str]:
    want = {"KEYS": f"k{i}", "TAGS": "t", "note": "fine"}
    where = WHERE[i]
    if where is not None:
        want[where] = f"{SHOWN}mark{i}"
    return want


def seal_bad_bytes(record: bytearray, pos: int) -> None:
    """Replace each ``ZZmark`` of the record at ``pos`` by bytes that are not UTF-8 and seal
    its record CRC again: only the UTF-8 is wrong, as a CRC-less damage or a writer that did
    not check would leave it."""
    total = int.from_bytes(record[pos : pos + 4], "big")
    end = pos + total
    at = record.find(b"ZZmark", pos, end)
    assert at >= 0
    record[at : at + 2] = BAD
    record[end - CRC_TRAILER_SIZE : end] = crc_trailer(
        crc32c_of(bytes(record[pos : end - CRC_TRAILER_SIZE]))
    )


def spoil_commitlog(data_dir: Path) -> int:
    """Apply ``seal_bad_bytes`` to every record holding the marker; returns how many."""
    spoiled = 0
    for path in sorted((data_dir / "commitlog").iterdir()):
        data = bytearray(path.read_bytes())
        pos = 0
        while pos + 8 <= len(data) and int.from_bytes(data[pos + 4 : pos + 8], "big") != 0:
            total = int.from_bytes(data[pos : pos + 4], "big")
            if total <= 0:
                break
            if data.find(b"ZZmark", pos, pos + total) >= 0:
                seal_bad_bytes(data, pos)
                fd = os.open(path, os.O_WRONLY)
                try:
                    os.pwrite(fd, bytes(data[pos : pos + total]), pos)
                    os.fsync(fd)
                finally:
                    os.close(fd)
                spoiled += 1
            pos += total
    return spoiled


def test_a_stored_record_with_bytes_that_are_not_utf8_is_delivered_and_dispatched(
    tmp_path: Path,
) -> None:
    """A broker whose CommitLog holds such records starts, dispatches them (its ConsumeQueues
    and IndexFiles are rebuilt from the CommitLog here, as after their loss or a crash), and
    delivers every message of the queue by PullMessage and to Apache's SimpleConsumer."""
    node = Standalone(tmp_path / "data").start()
    node.create_topic("spoiled", queues=1)
    assert node.stop() == 0
    write_offline(node.data_dir, [message(i, "spoiled") for i in range(len(WHERE))])
    assert spoil_commitlog(node.data_dir) == 3
    shutil.rmtree(node.data_dir / "consumequeue")
    shutil.rmtree(node.data_dir / "index")
    node.start()
    try:
        got = pull(node, "spoiled")
        assert [m.body for m in got] == [f"body {i}".encode() for i in range(len(WHERE))]
        for i, m in enumerate(got):
            props = dict(m.user_properties)
            want = expected(i)
            assert props.get("note") == want["note"], i
            assert m.system_properties.tag == want["TAGS"], i
            assert list(m.system_properties.keys) == [want["KEYS"]], i

        consumer = SimpleConsumer(
            client_config(node), "g-spoiled", {"spoiled": FilterExpression()}, await_duration=1
        )
        consumer.startup()
        bodies: set[bytes] = set()
        try:
            deadline = time.monotonic() + 20
            while len(bodies) < len(WHERE) and time.monotonic() < deadline:
                for m in consumer.receive(32, 15):
                    bodies.add(m.body)
                    consumer.ack(m)
        finally:
            consumer.shutdown()
        assert bodies == {f"body {i}".encode() for i in range(len(WHERE))}
    finally:
        assert node.stop() == 0


def spoiled_records() -> tuple[bytes, list[int]]:
    encoder = RecordEncoder(("10.1.2.3", 10911))
    data = bytearray()
    positions = []
    for i in range(len(WHERE)):
        record, _, _ = encoder.encode(message(i, "cold"), i, len(data), 1_700_000_000_500)
        positions.append(len(data))
        data += record
        if WHERE[i] is not None:
            seal_bad_bytes(data, positions[-1])
    return bytes(data), positions


@pytest.mark.parametrize(
    "writer", [encode_pull_replies, encode_pull_replies_decoded, encode_pull_replies_py]
)
def test_cold_replies_deliver_records_with_bytes_that_are_not_utf8(writer: Any) -> None:
    data, positions = spoiled_records()
    buffer, ends, _ = writer(data, positions)
    assert len(ends) == len(WHERE)
    replies = [buffer[a:b] for a, b in zip([0, *ends[:-1]], ends, strict=True)]
    for i, raw in enumerate(replies):
        m = s.PullMessageResponse.FromString(raw).message
        want = expected(i)
        assert m.body == f"body {i}".encode()
        assert dict(m.user_properties).get("note") == want["note"], i
        assert m.system_properties.tag == want["TAGS"], i
        assert list(m.system_properties.keys) == [want["KEYS"]], i
    assert writer(data, positions) == encode_pull_replies_py(data, positions)


@pytest.mark.parametrize("engine", [NATIVE_ENGINE, PYTHON_ENGINE], ids=["native", "python"])
def test_both_engines_decode_and_dispatch_such_records_alike(engine: Any) -> None:
    data, positions = spoiled_records()
    for i, m in enumerate(engine.decode_many(data, positions, True)):
        want = expected(i)
        assert {k: m.properties[k] for k in want} == want, i


@pytest.mark.parametrize("decode_run", [columnar.decode_run, columnar.decode_run_py])
def test_the_export_decodes_a_run_holding_such_records(decode_run: Any) -> None:
    """The lakehouse export's columnar decode took the run as damage (``RecordError``): the
    whole topic's export stopped on one record. It reads such a run as ``decode`` does."""
    data, positions = spoiled_records()
    rows = decode_run(data, positions).to_pylist()
    assert [r["body"] for r in rows] == [f"body {i}".encode() for i in range(len(WHERE))]
    for i, row in enumerate(rows):
        props = dict(row["properties"])
        assert {k: props[k] for k in expected(i)} == expected(i), i
    # The slow path builds exactly the columns the fast one builds, on records both take.
    good = [p for i, p in enumerate(positions) if WHERE[i] is None]
    fast = columnar.decode_run_py(data, good)
    slow = columnar.decoded_batch(NATIVE_ENGINE.decode_many(data, good, True))
    assert slow.equals(fast)
