"""The columnar decode (tiered/columnar.py) against the reference codec (tiered/record.py),
field for field and error for error, on random and adversarial records."""

from __future__ import annotations

import random
import struct
from typing import Any

import google_crc32c
import pytest

from tiered.columnar import decode_run, host_string
from tiered.record import (
    CRC_TRAILER_SIZE,
    CorruptRecordError,
    Message,
    RecordEncoder,
    RecordError,
    crc_trailer,
    decode,
)

HOSTS = [
    ("10.0.0.1", 4000),
    ("192.168.1.20", 65535),
    ("::1", 8081),
    ("fe80::1:2", 1),
    ("0.0.0.0", 0),
]


def reference(buf: bytes, positions: list[int]) -> list[dict[str, Any]]:
    out = []
    for pos in positions:
        m = decode(buf, pos)
        out.append(
            {
                "size": m.size,
                "body_crc": m.body_crc,
                "queue_id": m.queue_id,
                "flag": m.flag,
                "queue_offset": m.queue_offset,
                "commitlog_offset": m.commitlog_offset,
                "sys_flag": m.sys_flag,
                "born_timestamp": m.born_timestamp,
                "born_host": host_string(*m.born_host),
                "store_timestamp": m.store_timestamp,
                "store_host": host_string(*m.store_host),
                "reconsume_times": m.reconsume_times,
                "prepared_transaction_offset": m.prepared_transaction_offset,
                "body": m.body,
                "topic": m.topic,
                "properties": list(m.properties.items()),
            }
        )
    return out


def columnar(buf: bytes, positions: list[int]) -> list[dict[str, Any]]:
    return decode_run(buf, positions).to_pylist()


def with_raw_properties(record: bytes, raw: bytes) -> bytes:
    """``record`` (encoded with no properties) carrying ``raw`` as its property bytes, then a
    record CRC pair that matches."""
    head = record[:-CRC_TRAILER_SIZE]
    assert head.endswith(struct.pack(">H", CRC_TRAILER_SIZE))
    out = head[:-2] + struct.pack(">H", len(raw) + CRC_TRAILER_SIZE) + raw
    out = struct.pack(">i", len(out) + CRC_TRAILER_SIZE) + out[4:]
    return out + crc_trailer(google_crc32c.value(out))


def random_run(rng: random.Random, n: int) -> tuple[bytes, list[int]]:
    parts, positions, at = [], [], rng.randint(0, 50)
    buf = bytearray(rng.randbytes(at))
    encoders = [RecordEncoder(h) for h in HOSTS]
    for i in range(n):
        props = {}
        if rng.random() < 0.8:
            props["UNIQ_KEY"] = f"id-{rng.getrandbits(64):x}"
        if rng.random() < 0.6:
            props["KEYS"] = " ".join(f"k{rng.randint(0, 99)}" for _ in range(rng.randint(0, 3)))
        if rng.random() < 0.5:
            props["TAGS"] = rng.choice(["red", "grün", "", "青"])
        if rng.random() < 0.2:
            props["x-ünïcode"] = "v\u2603" * rng.randint(0, 5)
        msg = Message(
            topic=rng.choice(["orders", "t", "ödeme"]),
            body=rng.randbytes(rng.choice([0, 1, 12, 13, 300, 5000])),
            queue_id=rng.randint(0, 7),
            properties=props,
            flag=rng.randint(-(2**31), 2**31 - 1),
            born_timestamp=rng.choice([0, 1_700_000_000_000 + i, -5]),
            born_host=rng.choice(HOSTS),
            reconsume_times=rng.randint(0, 16),
            prepared_transaction_offset=rng.randint(0, 2**40),
        )
        record, _, _ = rng.choice(encoders).encode(
            msg, rng.randint(0, 2**50), len(buf) + rng.randint(0, 2**40), rng.randint(0, 2**45)
        )
        positions.append(len(buf))
        buf += record
        if rng.random() < 0.3:
            buf += rng.randbytes(rng.randint(1, 20))  # gaps between records are skipped
        parts.append(record)
    return bytes(buf), positions


@pytest.mark.parametrize("seed", range(20))
def test_random_runs_decode_exactly_as_the_reference(seed: int) -> None:
    rng = random.Random(seed)
    buf, positions = random_run(rng, rng.randint(1, 200))
    assert columnar(buf, positions) == reference(buf, positions)


def test_an_empty_run_is_an_empty_batch() -> None:
    assert decode_run(b"", []).num_rows == 0


def test_positions_in_any_order_decode_in_that_order() -> None:
    buf, positions = random_run(random.Random(99), 50)
    shuffled = positions[::-1]
    assert columnar(buf, shuffled) == reference(buf, shuffled)


ADVERSARIAL_PROPERTIES = [
    b"",
    b"\x02",
    b"\x02\x02\x02",
    b"a\x01b",  # no trailing separator
    b"a\x01b\x02",
    b"\x02a\x01b\x02\x02c\x01d",
    b"noseparator",
    b"name-only\x02",
    b"a\x01b\x01c\x02",  # the value keeps the second \x01
    b"\x01\x02",  # empty name and value
    b"\x01v\x02",
    b"a\x011\x02b\x012\x02a\x013\x02",  # a repeated name: first position, last value
    b"k\x01\x02k\x01\x02k\x01x",
    "ü\x01ß\x02".encode(),
    b"x\x01y\x02" * 200,
]


@pytest.mark.parametrize("raw", ADVERSARIAL_PROPERTIES)
def test_adversarial_properties_decode_exactly_as_the_reference(raw: bytes) -> None:
    record, _, _ = RecordEncoder().encode(Message("t", b"body"), 1, 2, 3)
    plain = record
    buf = plain + with_raw_properties(record, raw) + plain + with_raw_properties(record, raw)
    second = len(plain)
    third = second + len(with_raw_properties(record, raw))
    positions = [0, second, third, third + len(plain)]
    assert columnar(buf, positions) == reference(buf, positions)


def refusals(buf: bytes, positions: list[int]) -> tuple[type[BaseException], str]:
    with pytest.raises(RecordError) as ours:
        decode_run(buf, positions)
    for pos in positions:
        try:
            decode(buf, pos)
        except RecordError as theirs:
            assert type(ours.value) is type(theirs)
            assert str(ours.value) == str(theirs)
            return type(theirs), str(theirs)
    raise AssertionError("the reference decodes what the columnar decode refused")


def test_a_flipped_body_byte_is_refused_with_the_references_crc_error() -> None:
    encoder = RecordEncoder()
    records = [encoder.encode(Message("t", bytes([i]) * 40), i, i, i)[0] for i in range(5)]
    data = bytearray(b"".join(records))
    positions = [sum(map(len, records[:i])) for i in range(5)]
    data[positions[3] + 88 + 7] ^= 0x10  # a byte of record 3's body (IPv4 hosts: 88-byte head)
    kind, message = refusals(bytes(data), positions)
    assert kind is CorruptRecordError and "queue offset 3" in message


@pytest.mark.parametrize("seed", range(30))
def test_random_damage_is_refused_as_the_reference_refuses_it(seed: int) -> None:
    rng = random.Random(1000 + seed)
    buf, positions = random_run(rng, 10)
    data = bytearray(buf)
    victim = rng.choice(positions)
    size = struct.unpack_from(">i", buf, victim)[0]
    for _ in range(rng.randint(1, 3)):
        data[victim + rng.randrange(size)] ^= 1 << rng.randrange(8)
    try:
        expected = reference(bytes(data), positions)
    except RecordError:
        refusals(bytes(data), positions)
    else:  # a flipped flag or offset bit is still a valid record
        assert columnar(bytes(data), positions) == expected


def test_truncated_data_is_refused_like_the_reference() -> None:
    buf, positions = random_run(random.Random(5), 5)
    refusals(buf[: positions[-1] + 50], positions)
    refusals(buf, [*positions[:-1], positions[-1] + 3])  # not a record start


def test_invalid_utf8_in_properties_decodes_as_the_reference_decodes_it() -> None:
    """Read as U+FFFD, as ``decode`` reads it (decision 660); refused before."""
    record, _, _ = RecordEncoder().encode(Message("t", b"x"), 1, 2, 3)
    for raw in (b"a\x01\xff\x02", b"a\x01\xc3\x02a\x01b\x02", b"\xed\xa0\x80\x01v\x02"):
        buf = with_raw_properties(record, raw)
        assert columnar(buf, [0]) == reference(buf, [0])
    assert columnar(with_raw_properties(record, b"a\x01\xff\x02"), [0])[0]["properties"] == [
        ("a", "\ufffd")
    ]


def test_crc_is_not_checked_when_asked_not_to() -> None:
    record, _, _ = RecordEncoder().encode(Message("t", b"abc"), 1, 2, 3)
    data = bytearray(record)
    data[88] ^= 0xFF  # the body's first byte (IPv4 hosts: 88 bytes of header)
    with pytest.raises(CorruptRecordError):
        decode_run(bytes(data), [0])
    assert decode_run(bytes(data), [0], check_crc=False).column("body").to_pylist() == [
        bytes(data[88:91])
    ]
