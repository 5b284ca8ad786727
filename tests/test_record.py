"""The record codec: one format for both tiers, the lakehouse reader and these tests."""

from __future__ import annotations

import pytest

from tiered.record import (
    BLANK_MAGIC_CODE,
    CorruptRecordError,
    EncodedBatch,
    Message,
    RecordEncoder,
    RecordError,
    blank_record,
    decode,
    read_dispatch_run,
    read_store_timestamp,
    read_total_and_magic,
    tag_hash,
    validate,
)


def roundtrip(msg: Message, store_host: tuple[str, int] = ("10.1.2.3", 10911)) -> object:
    raw, _, _ = RecordEncoder(store_host).encode(
        msg, queue_offset=42, physical_offset=123456, store_timestamp=1_700_000_000_123
    )
    out = decode(raw)
    assert out.size == len(raw)
    return out


def test_every_field_survives_a_round_trip() -> None:
    msg = Message(
        topic="orders",
        body=b"\x00\x01payload\xff",
        queue_id=7,
        properties={"KEYS": "k1 k2", "TAGS": "paid", "UNIQ_KEY": "AC11000100002A9F", "x": "y"},
        flag=3,
        born_timestamp=1_699_999_999_999,
        born_host=("192.168.7.9", 50123),
        reconsume_times=2,
        prepared_transaction_offset=99,
    )
    out = roundtrip(msg)
    assert (out.topic, out.queue_id, out.queue_offset, out.commitlog_offset) == (
        "orders",
        7,
        42,
        123456,
    )
    assert out.body == msg.body and out.flag == 3 and out.reconsume_times == 2
    assert out.born_timestamp == 1_699_999_999_999 and out.store_timestamp == 1_700_000_000_123
    assert out.born_host == ("192.168.7.9", 50123) and out.store_host == ("10.1.2.3", 10911)
    assert out.prepared_transaction_offset == 99
    assert out.properties == msg.properties
    assert out.keys == ["k1", "k2"] and out.tags == "paid" and out.msg_id == "AC11000100002A9F"


def test_empty_body() -> None:
    out = roundtrip(Message(topic="t", body=b""))
    assert out.body == b"" and out.properties == {}


def test_four_mib_body() -> None:
    body = bytes(range(256)) * (4 * 1024 * 1024 // 256)
    out = roundtrip(Message(topic="big", body=body))
    assert out.body == body


def test_non_ascii_properties_and_ipv6_hosts() -> None:
    props = {"KEYS": "ключ 鍵", "TAGS": "标签", "note": "naïve ✓ 🚀"}
    out = roundtrip(
        Message(topic="intl", body=b"b", properties=props, born_host=("::1", 9)),
        store_host=("fe80::1", 8081),
    )
    assert out.properties == props
    assert out.born_host == ("::1", 9) and out.store_host == ("fe80::1", 8081)
    assert out.keys == ["ключ", "鍵"]


def test_dispatch_fields_and_timestamp_read_without_decoding() -> None:
    enc = RecordEncoder(("::2", 1))
    props = {"TAGS": "x", "XKEYS": "not-a-key", "KEYS": "a b", "UNIQ_KEY": "u1"}
    first = enc.encode(Message(topic="t1", body=b"abc", queue_id=3, properties=props,
                               born_host=("::1", 2)), 5, 1000, 1234)[0]  # fmt: skip
    second = enc.encode(Message(topic="t2", body=b"", queue_id=0), 0, 1000 + len(first), 99)[0]
    buf = first + second + blank_record(16)
    out, stamps = EncodedBatch(), []
    stop = read_dispatch_run(buf, 0, len(buf), 1000, out, stamps)
    assert stop == len(first) + len(second), "stops at the BLANK record"
    assert out.offsets == [1000, 1000 + len(first)]
    assert out.sizes == [len(first), len(second)]
    assert out.queues == [("t1", 3), ("t2", 0)] and out.queue_offsets == [5, 0]
    assert (out.tags, out.keys, out.uniq_keys) == (["x", None], ["a b", None], ["u1", None])
    assert stamps == [1234, 99]
    assert read_store_timestamp(first, 0) == 1234


def test_validate_checks_size_offset_and_crc_without_decoding() -> None:
    raw = RecordEncoder().encode(Message(topic="t", body=b"hello"), 0, 4096, 1)[0]
    assert validate(raw, 0, 4096, check_crc=True) == len(raw)
    with pytest.raises(RecordError, match="names offset 4096"):
        validate(raw, 0, 8192, check_crc=True)
    bad = bytearray(raw)
    bad[raw.index(b"hello")] ^= 1
    with pytest.raises(CorruptRecordError):
        validate(bytes(bad), 0, 4096, check_crc=True)
    assert validate(bytes(bad), 0, 4096, check_crc=False) == len(raw)


def test_flipped_body_byte_fails_the_crc() -> None:
    raw = bytearray(RecordEncoder().encode(Message(topic="t", body=b"hello world"), 0, 0, 1)[0])
    raw[raw.index(b"hello") + 1] ^= 0x01
    with pytest.raises(CorruptRecordError):
        decode(bytes(raw))
    assert decode(bytes(raw), check_crc=False).body == b"hdllo world"


def test_truncated_record_is_not_a_record() -> None:
    raw = RecordEncoder().encode(Message(topic="t", body=b"x" * 100), 0, 0, 1)[0]
    with pytest.raises(RecordError):
        decode(raw[: len(raw) - 1])
    with pytest.raises(RecordError):
        decode(bytes(len(raw)))  # zeros: illegal magic


def test_blank_record_marks_the_end_of_a_file() -> None:
    blank = blank_record(64)
    assert len(blank) == 64
    assert read_total_and_magic(blank, 0) == (64, BLANK_MAGIC_CODE)
    with pytest.raises(RecordError):
        decode(blank)


def test_property_separators_are_refused() -> None:
    with pytest.raises(RecordError):
        RecordEncoder().encode(Message(topic="t", body=b"", properties={"a\x01": "b"}), 0, 0, 0)
    with pytest.raises(RecordError):
        RecordEncoder().encode(Message(topic="t", body=b"", properties={"a": "b\x02c"}), 0, 0, 0)


def test_tag_hash_is_stable_and_zero_for_no_tag() -> None:
    assert tag_hash(None) == 0 and tag_hash("") == 0
    assert tag_hash("paid") == tag_hash("paid") != tag_hash("unpaid")
