"""The native code that reads untrusted bytes, against hostile wire shapes.

Two parsers read bytes tmq does not control:

- ``broker/_send_native.pyx`` walks a SendMessageRequest as it arrives from the network
  (decision 310). Here a generator writes the protobuf wire format field by field, following
  the schema most of the time and breaking it on purpose the rest: truncated and overlong
  varints, lengths past the end or near 2**64, nested lengths that disagree with the outer one,
  repeated fields, unknown wire types, field number 0, non-UTF-8 strings, oversized bodies,
  hostile topic names. The walker must build exactly what protobuf plus the reference
  conversion build, or hand the request to them (decision 430).
- ``tiered/_record_native.pyx`` reads CommitLog records written by this broker, a master it
  replicates, or fetched back from S3. Here the length fields of a record are set to hostile
  values and the CRCs sealed again over the damage, so the parsers must stand on their
  structural checks alone; properties get bad separators and tens of thousands of pairs. Every
  scan, decode and table build must answer what the pure-Python reference answers.

Both run without shrinking (a failure prints its input) and take seconds.
"""

from __future__ import annotations

import os
import struct
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from test_record_engine import records_of, run_of
from test_send_native import TOPICS, check

from tiered import columnar
from tiered.record import (
    CRC_TRAILER_SIZE,
    NATIVE_ENGINE,
    PYTHON_ENGINE,
    SYSFLAG_BORNHOST_V6,
    SYSFLAG_RECORD_CRC,
    SYSFLAG_STOREHOST_V6,
    DispatchColumns,
    EncodedBatch,
    Message,
    RecordError,
    blank_record,
    crc32c_of,
    crc_trailer,
)

NATIVE: Any = NATIVE_ENGINE
PY: Any = PYTHON_ENGINE
# A longer run for a fuzzing session: TMQ_FUZZ_EXAMPLES=100000 (CI keeps the default).
EXAMPLES = int(os.environ.get("TMQ_FUZZ_EXAMPLES", "300"))
FAST = settings(
    deadline=None,
    suppress_health_check=list(HealthCheck),
    phases=[Phase.explicit, Phase.reuse, Phase.generate],
)

# -- the protobuf wire format, written by hand --------------------------------------------------

VARINT, I64, LEN, SGROUP, EGROUP, I32 = 0, 1, 2, 3, 4, 5


def varint(v: int) -> bytes:
    v &= (1 << 64) - 1
    out = bytearray()
    while True:
        b = v & 0x7F
        v >>= 7
        if v:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def key(field: int, wire: int) -> bytes:
    return varint(field << 3 | wire)


def ld(field: int, payload: bytes) -> bytes:
    return key(field, LEN) + varint(len(payload)) + payload


HOSTILE_TEXT = [
    b"orders",
    b"../x",
    b"..",
    b"a\x00b",
    b"\x00",
    b"/etc/passwd",
    b"",
    b" ",
    b"a|b",
    b"\xff\xfe",  # not UTF-8: protobuf refuses a proto3 string holding it
    b"\xc3",  # a cut multi-byte sequence
    b"\xed\xa0\x80",  # an encoded surrogate, which strict UTF-8 refuses
    b"\xc0\xaf",  # an overlong '/'
    "ünï".encode(),
    b"x" * 300,
]

# One field of each message, as the schema has it: (field number, wire type, kind).
SCHEMA: dict[str, dict[int, tuple[int, str]]] = {
    "request": {1: (LEN, "message")},
    "message": {1: (LEN, "resource"), 2: (LEN, "entry"), 3: (LEN, "system"), 4: (LEN, "bytes")},
    "resource": {1: (LEN, "text"), 2: (LEN, "topic")},
    "entry": {1: (LEN, "text"), 2: (LEN, "text")},
    "digest": {1: (VARINT, "enum"), 2: (LEN, "text")},
    "timestamp": {1: (VARINT, "int"), 2: (VARINT, "int")},
    "system": {
        1: (LEN, "text"),
        2: (LEN, "text"),
        3: (LEN, "id"),
        4: (LEN, "digest"),
        5: (VARINT, "enum"),
        6: (VARINT, "enum"),
        7: (LEN, "timestamp"),
        8: (LEN, "text"),
        11: (LEN, "timestamp"),
        13: (VARINT, "int"),
        17: (LEN, "text"),
    },
}
# The fields a plain message has, so that most generated requests reach the walker's end.
PLAIN = {
    "message": [1, 3, 4],
    "resource": [2],
    "system": [3, 6, 7, 8],
    "timestamp": [1, 2],
    "digest": [1, 2],
    "entry": [1, 2],
    "request": [1, 1, 1],
}
INTS = st.one_of(
    st.sampled_from([0, 1, 2, 3, -1, 2**31 - 1, -(2**31), 2**32 + 1, 2**63 - 1, 2**64 - 1]),
    st.integers(0, 2**64 - 1),
)


@st.composite
def scalar(draw: st.DrawFn, kind: str) -> bytes:
    if kind in ("int", "enum"):
        return varint(draw(INTS) if draw(st.integers(0, 3)) == 0 else draw(st.integers(0, 3)))
    if kind == "bytes":
        return draw(
            st.one_of(
                st.binary(min_size=1, max_size=24),
                st.sampled_from([b"", b"y" * 4097, b"z" * 5000]),
            )
        )
    if kind == "id":
        return draw(
            st.one_of(st.sampled_from([b"01ABCDEF", b"id-1"]), st.sampled_from(HOSTILE_TEXT))
        )
    if kind == "topic":
        return b"orders" if draw(st.integers(0, 3)) else draw(st.sampled_from(HOSTILE_TEXT))
    return draw(st.one_of(st.sampled_from(HOSTILE_TEXT), st.binary(max_size=6)))


@st.composite
def wire(draw: st.DrawFn, kind: str, depth: int = 0) -> bytes:
    """The fields of a ``kind`` message: the plain ones in a random order, each well formed
    most of the time and hostile sometimes, and now and then a field out of the schema."""
    schema = SCHEMA[kind]
    fields = list(PLAIN[kind])
    if draw(st.integers(0, 3)) == 0:
        fields.append(draw(st.sampled_from(sorted(schema))))  # a repeated or optional field
    fields = draw(st.permutations(fields))
    out = bytearray()
    for number in fields:
        wire_type, child = schema[number]
        hostile = draw(st.integers(0, 9)) == 0
        how = draw(st.integers(0, 11)) if hostile else -1
        if how == 0:  # another wire type, unknown and group ones included
            wire_type = draw(st.sampled_from([VARINT, I64, LEN, SGROUP, EGROUP, I32, 6, 7]))
        elif how == 1:  # a field number of nothing, or none at all
            number = draw(st.sampled_from([0, 9, 31, 32, 99, 2**29 - 1, 2**29, 2**32]))
        if child in SCHEMA and wire_type == LEN and depth < 6:
            payload = draw(wire(child, depth + 1))
            if how == 2:  # the nested message runs past the length its parent gave it
                payload += draw(wire(child, depth + 1))
        elif wire_type == LEN:
            payload = draw(scalar(child))
        elif wire_type == VARINT:
            payload = draw(scalar("int"))
        elif wire_type in (I64, I32):
            payload = draw(st.binary(min_size=0, max_size=8))
        else:
            payload = b""
        if how == 3:  # deep nesting: the value wrapped in itself many times
            for _ in range(draw(st.integers(2, 120))):
                payload = ld(number, payload)
        out += key(number, wire_type)
        if wire_type != LEN:
            out += payload
            continue
        length = len(payload)
        if how == 4:
            length = draw(st.sampled_from([length + 1, length + 7, max(length - 1, 0), 0]))
        elif how == 5:
            length = draw(st.sampled_from([2**31, 2**32 - 1, 2**63, 2**63 - 1, 2**64 - 1]))
        if how == 6:  # a non-minimal length varint: protobuf takes it
            out += bytes([(length & 0x7F) | 0x80, 0x80, 0x00])
        elif how == 7:  # a varint longer than ten bytes
            out += b"\x80" * 10 + b"\x01"
        elif how == 8:  # a varint cut short: the message ends there
            out += b"\xff\xff"
            break
        else:
            out += varint(length)
        out += payload
    return bytes(out)


@st.composite
def hostile_requests(draw: st.DrawFn) -> bytes:
    raw = draw(wire("request"))
    if raw and draw(st.integers(0, 5)) == 0:
        raw = raw[: draw(st.integers(0, len(raw) - 1))]  # cut anywhere
    if draw(st.integers(0, 7)) == 0:
        raw += draw(st.sampled_from([b"\x0a", b"\x0a\x80", b"\x08\x01", b"\x00", b"\x0b\x0c"]))
    return raw


@settings(FAST, max_examples=EXAMPLES)
@given(raw=hostile_requests(), kind=st.sampled_from(sorted(TOPICS)), first=st.integers(0, 9))
def test_hostile_wire_shapes_get_the_references_answer(raw: bytes, kind: str, first: int) -> None:
    check(raw, TOPICS[kind], first)


def nested(field: int, payload: bytes, depth: int) -> bytes:
    """``payload`` as field ``field`` of itself, ``depth`` times over."""
    for _ in range(depth):
        payload = ld(field, payload)
    return payload


def _message(topic: bytes = b"orders", body: bytes = b"x", mid: bytes = b"id-1") -> bytes:
    system = ld(3, mid) + key(6, VARINT) + varint(1)
    return ld(1, ld(2, topic)) + ld(3, system) + ld(4, body)


@pytest.mark.parametrize(
    "raw",
    [
        ld(1, _message()),  # the baseline the walker takes
        ld(1, _message()) + b"\x0a",  # a key with nothing after it
        ld(1, _message()) + b"\x0a\x80",  # a length varint cut short
        key(1, LEN) + varint(2**63) + _message(),  # a length of 2**63
        key(1, LEN) + varint(2**64 - 1) + _message(),  # of 2**64 - 1 (-1 as a signed length)
        key(1, LEN) + b"\xff" * 9 + b"\x7f" + _message(),  # the widest ten-byte varint
        key(1, LEN) + b"\x80" * 10 + b"\x00" + _message(),  # an eleven-byte varint
        key(1, LEN) + bytes([len(_message()) + 2]) + _message(),  # nested past the outer end
        ld(1, ld(1, ld(2, b"orders") + b"\x12\x05ab") + ld(4, b"x")),  # inner past its own
        ld(1, _message() + ld(4, b"again")),  # the body twice (protobuf keeps the last)
        ld(1, _message() + ld(1, ld(2, b"other"))),  # the topic twice (protobuf merges)
        ld(1, ld(3, key(6, VARINT) + varint(1)) + _message()),  # system properties twice
        ld(1, _message()) + key(0, VARINT) + b"\x01",  # field number 0
        ld(1, _message() + key(4, 6) + b"x"),  # wire type 6 does not exist
        ld(1, _message() + key(15, SGROUP) + key(15, EGROUP)),  # a group, unknown field
        ld(1, _message() + key(99, I64) + bytes(8)),  # an unknown fixed64 field
        ld(1, _message(topic=b"../x")),
        ld(1, _message(topic=b"a\x00b")),
        ld(1, _message(topic=b"\xff")),  # a topic that is not UTF-8
        ld(1, _message(mid=b"\xc3")),  # a message id that is not UTF-8
        ld(1, _message(mid=b"\xed\xa0\x80")),  # an encoded surrogate
        ld(1, _message(body=b"b" * 4097)),  # a body over the limit
        ld(1, _message(body=b"b" * 300_000)),
        ld(1, _message()) * 200,  # more messages than a batch may hold
        ld(1, _message(body=_message() * 50)),  # a body that is itself a message
        # deep nesting inside a body and inside the topic's resource
        ld(1, _message(body=nested(1, b"x", 500))),
        ld(1, ld(1, nested(2, b"orders", 200))),
    ],
)
def test_hand_written_hostile_requests_get_the_references_answer(raw: bytes) -> None:
    for topic in TOPICS.values():
        check(raw, topic)


def test_the_walker_takes_only_the_plain_baseline_of_the_hand_written_cases() -> None:
    # The comparisons above mean something only if the walker reaches its end on some of them.
    assert check(ld(1, _message()), TOPICS["NORMAL"])
    assert not check(key(1, LEN) + varint(2**63) + _message(), TOPICS["NORMAL"])


# -- CommitLog records with hostile fields, their CRCs sealed again -----------------------------


def records(messages: list[Message]) -> list[bytearray]:
    """``messages`` as the store writes them (record CRC included) from CommitLog offset 4096."""
    return [bytearray(r) for r in records_of(run_of(messages))]


def layout(rec: bytes | bytearray, pos: int = 0) -> dict[str, int]:
    """Where a record's length fields lie (from its SYSFLAG), as written, not as damaged."""
    sys_flag = struct.unpack_from(">i", rec, pos + 36)[0]
    body = pos + 48 + (20 if sys_flag & SYSFLAG_BORNHOST_V6 else 8) + 8
    body += (20 if sys_flag & SYSFLAG_STOREHOST_V6 else 8) + 12
    body_len = struct.unpack_from(">i", rec, body)[0]
    topic = body + 4 + body_len
    props = topic + 2 + struct.unpack_from(">H", rec, topic)[0]
    return {"total": pos, "body": body, "topic": topic, "props": props, "sysflag": pos + 36}


def seal(buf: bytearray, pos: int, at: dict[str, int]) -> None:
    """The body CRC and the record CRC recomputed over whatever the fields now say, where
    they say it: damage that only the structural checks can catch."""
    total = struct.unpack_from(">i", buf, pos)[0]
    body_len = struct.unpack_from(">i", buf, at["body"])[0]
    if body_len >= 0 and at["body"] + 4 + body_len <= len(buf):
        body = bytes(buf[at["body"] + 4 : at["body"] + 4 + body_len])
        struct.pack_into(">I", buf, pos + 8, crc32c_of(body))
    if total >= CRC_TRAILER_SIZE and pos + total <= len(buf):
        end = pos + total - CRC_TRAILER_SIZE
        buf[end : end + CRC_TRAILER_SIZE] = crc_trailer(crc32c_of(bytes(buf[pos:end])))


def outcome(call: Any, *args: Any) -> Any:
    try:
        result = call(*args)
    except (RecordError, UnicodeDecodeError) as e:
        return type(e)
    if isinstance(result, tuple) and len(result) == 3 and not isinstance(result[2], int):
        end, status, cols = result  # dispatch_columns
        cols = cols if isinstance(cols, DispatchColumns) else DispatchColumns(*cols)
        return end, status, vars_of(cols), cols.queues
    return result


def vars_of(cols: Any) -> list[Any]:
    names = ("offsets", "sizes", "queue_offsets", "tags", "store_timestamps", "key_hashes")
    return [np.asarray(getattr(cols, n)).tolist() for n in names]


def every_reader_agrees(buf: bytes, positions: list[int], sizes: list[int]) -> None:
    """Each native reader of records answers what its reference answers on ``buf``."""
    limit = len(buf)
    for check_crc in (True, False):
        assert NATIVE.scan_records(buf, 0, limit, 4096, check_crc) == PY.scan_records(
            buf, 0, limit, 4096, check_crc
        )
        assert outcome(NATIVE.decode_many, buf, positions, check_crc) == outcome(
            PY.decode_many, buf, positions, check_crc
        )
        columns = (buf, 0, limit, 4096, True, check_crc, 1 << 20)
        assert outcome(NATIVE.dispatch_columns, *columns) == outcome(PY.dispatch_columns, *columns)

    def arrow(decode: Any) -> Any:
        return outcome(lambda: decode(buf, positions, check_crc=True).to_pylist())

    # columnar.decode_run is the native decode, which hands a run it refuses to the reference
    assert arrow(columnar.decode_run) == arrow(columnar.decode_run_py)

    def segment(engine: Any) -> Any:
        return outcome(lambda: engine.segment_tables(buf[: sum(sizes)], 7))

    assert segment(NATIVE) == segment(PY)
    p, s = np.asarray(positions, np.int64), np.asarray(sizes, np.int64)
    assert NATIVE.check_span(buf, p, s, 7) == PY.check_span(buf, p, s, 7)


LENGTHS = st.sampled_from(["total", "body", "topic", "props", "sysflag"])
HOSTILE_I32 = [0, 1, 4, 8, 19, 20, 21, -1, -8, 2**31 - 1, -(2**31), 65535, 65536]
HOSTILE_U16 = [0, 1, 19, 20, 21, 0xFFFF, 0x8000]


@settings(FAST, max_examples=400)
@given(
    bodies=st.lists(st.binary(max_size=64), min_size=1, max_size=4),
    victim=st.integers(0, 3),
    field=LENGTHS,
    value=st.one_of(st.sampled_from(HOSTILE_I32), st.integers(-64, 64)),
    relative=st.booleans(),
    sealed=st.booleans(),
)
def test_records_with_hostile_length_fields_read_as_the_reference_reads_them(
    bodies: list[bytes], victim: int, field: str, value: int, relative: bool, sealed: bool
) -> None:
    recs = records(
        [
            Message(f"t{i % 2}", body or b"-", queue_id=i % 2, properties={"KEYS": "k"})
            for i, body in enumerate(bodies)
        ]
    )
    buf = bytearray(b"".join(recs) + blank_record(16))
    positions = list(np.cumsum([0] + [len(r) for r in recs[:-1]]))
    sizes = [len(r) for r in recs]
    victim %= len(recs)
    pos = int(positions[victim])
    at = layout(buf, pos)
    where = at[field]
    if field in ("topic", "props"):
        old = struct.unpack_from(">H", buf, where)[0]
        struct.pack_into(">H", buf, where, ((old + value) if relative else value) & 0xFFFF)
    elif field == "sysflag":
        old = struct.unpack_from(">I", buf, where)[0]
        bits = (SYSFLAG_BORNHOST_V6, SYSFLAG_STOREHOST_V6, SYSFLAG_RECORD_CRC, 1 << 31)
        struct.pack_into(">I", buf, where, old ^ bits[value % 4])
    else:
        old = struct.unpack_from(">i", buf, where)[0]
        new = (old + value) if relative else value
        struct.pack_into(">i", buf, where, max(-(2**31), min(2**31 - 1, new)))
    if sealed:
        seal(buf, pos, at)
    every_reader_agrees(bytes(buf), [int(p) for p in positions], sizes)


def with_properties(raw: bytes) -> bytes:
    """A sealed record whose properties field holds ``raw``, then its record CRC pair: up to
    the 65,535 bytes the format's length field allows, past what the encoder writes."""
    (rec,) = records([Message("t", b"body")])
    at = layout(rec)
    assert len(raw) + CRC_TRAILER_SIZE <= 0xFFFF
    out = rec[: at["props"]] + struct.pack(">H", len(raw) + CRC_TRAILER_SIZE) + raw
    out += bytes(CRC_TRAILER_SIZE)
    struct.pack_into(">i", out, 0, len(out))
    seal(out, 0, at)
    return bytes(out)


PROPERTY_BLOBS = [
    b"a\x01b\x02" * 15_000,  # 15,000 pairs
    b"\x01" * 60_000,  # separators only
    b"\x02" * 60_000,
    b"a\x01\x01\x01b\x02",  # a value holding \x01
    b"\x01\x02\x01\x02",  # empty names
    b"UNIQ_KEY\x01\xff\xfe\x02",  # a value that is not UTF-8
    b"KEYS\x01" + b"k " * 20_000 + b"\x02",  # 20,000 keys for the index
    b"TAGS\x01\xed\xa0\x80\x02",  # a surrogate as a tag
    b"noseparator",
    b"TAGS\x01t\x02TAGS\x01u\x02",  # a name twice
    b"KEYS\x01\x02UNIQ_KEY\x01\x02",  # empty values
    b"\x00\x01\x00\x02",
    b"__CRC32#\x010000000000\x02",  # a forged record CRC pair inside the properties
]


@pytest.mark.parametrize("raw", PROPERTY_BLOBS, ids=range(len(PROPERTY_BLOBS)))
def test_records_with_hostile_properties_read_as_the_reference_reads_them(raw: bytes) -> None:
    rec = with_properties(raw)
    buf = rec + blank_record(16)
    every_reader_agrees(buf, [0], [len(rec)])

    def dispatch(engine: Any) -> Any:
        out = EncodedBatch()
        stamps: list[int] = []
        try:
            end = engine.read_dispatch_run(buf, 0, len(buf), 4096, out, stamps)
        except RecordError as e:
            return type(e)
        return end, out.offsets, out.tags, out.keys, out.uniq_keys, stamps

    assert dispatch(NATIVE) == dispatch(PY)


@settings(FAST, max_examples=300)
@given(st.binary(min_size=3, max_size=200).map(lambda b: b.replace(b"\x03", b"\x01")))
def test_random_property_bytes_read_as_the_reference_reads_them(raw: bytes) -> None:
    rec = with_properties(raw)
    every_reader_agrees(rec + blank_record(16), [0], [len(rec)])


def test_a_record_holding_more_keys_than_the_encoder_writes_is_taken_not_spun_on() -> None:
    """The properties length field allows 65,535 bytes, twice what tmq's encoder writes: a
    record from elsewhere (a master, an object store) can hold up to 32,768 keys. The native
    dispatch scan once sized its key table for 16,384 and answered "table full, nothing taken"
    forever: the recovery scan called it again at the same place, and a restart never ended."""
    rec = with_properties(b"KEYS\x01" + b"k " * 30_000 + b"\x02")
    buf = rec + blank_record(16)
    for validate in (True, False):
        end, status, cols = NATIVE.dispatch_columns(buf, 0, len(buf), 4096, validate, True, 1 << 20)
        cols = cols if isinstance(cols, DispatchColumns) else DispatchColumns(*cols)
        assert (end, status, len(cols)) == (len(rec), 0, 1)
        assert len(cols.key_hashes) == 30_000
