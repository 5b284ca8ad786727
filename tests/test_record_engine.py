"""The record engine's two implementations agree byte for byte (decision 150).

``tiered/record.py`` holds the pure-Python reference of every inner loop and
``tiered/_record_native.pyx`` its native twin. Each test runs both on the same random or
adversarial input and compares everything they produce: bytes, lists, arrays, and the class of
the error when the input is refused.
"""

from __future__ import annotations

import mmap
import os
import struct
import subprocess
import sys
import tempfile
from array import array
from pathlib import Path
from typing import Any

import google_crc32c
import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st

from tiered import columnar, record
from tiered.formats import key_hash
from tiered.record import (
    CRC_TRAILER_SIZE,
    NATIVE_ENGINE,
    PYTHON_ENGINE,
    SYSFLAG_BORNHOST_V6,
    SYSFLAG_RECORD_CRC,
    SYSFLAG_STOREHOST_V6,
    CorruptRecordError,
    EncodedBatch,
    Message,
    RecordEncoder,
    RecordError,
    blank_record,
)

ROOT = Path(__file__).resolve().parent.parent
PY = PYTHON_ENGINE
NATIVE: Any = NATIVE_ENGINE
# No shrinking: on a loaded 2-core machine it can run for minutes; a failure prints its input.
SETTINGS = settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    phases=[Phase.explicit, Phase.reuse, Phase.generate],
)

# Property text never holds the format's separators; everything else goes, surrogates excepted.
TEXT = st.text(
    st.characters(blacklist_categories=("Cs",), blacklist_characters="\x01\x02"), max_size=12
)
HOSTS = st.sampled_from(
    [("127.0.0.1", 0), ("10.1.2.3", 10911), ("::1", 5), ("fe80::1:2", 65535), ("0.0.0.0", -1)]
)
MESSAGES = st.builds(
    Message,
    topic=st.text(st.sampled_from("abcXYZ09_-%|"), min_size=1, max_size=20),
    body=st.binary(max_size=3000),
    queue_id=st.integers(0, 7),
    properties=st.dictionaries(
        st.one_of(st.sampled_from(["KEYS", "TAGS", "UNIQ_KEY", "x"]), TEXT), TEXT, max_size=5
    ),
    flag=st.integers(-(2**31), 2**31 - 1),
    born_timestamp=st.integers(0, 2**62),
    born_host=HOSTS,
    reconsume_times=st.integers(0, 16),
    prepared_transaction_offset=st.integers(0, 2**62),
)


def test_native_engine_is_built_and_used() -> None:
    """``pip install -e .`` compiles the native engine, and the store uses it by default."""
    assert NATIVE is not None, "tiered/_record_native was not built: run pip install -e ."
    expected = "python" if os.environ.get("TMQ_PURE_PYTHON") else "native"
    used = record.ENGINE_NAME
    assert used == expected


def test_pure_python_env_var_forces_the_reference() -> None:
    code = "from tiered import record; print(record.ENGINE_NAME)"
    env = {**os.environ, "TMQ_PURE_PYTHON": "1"}
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "python"


def encode(engine: Any, messages: list[Message], space: int, store_host: Any) -> tuple[Any, ...]:
    out = EncodedBatch(store_timestamp=1_700_000_000_123)
    next_offsets: dict[tuple[str, int], int] = {}
    base = {(m.topic, m.queue_id): 7 for m in messages[::3]}
    i, used = engine.encode_batch(
        RecordEncoder(store_host), messages, 0, 4096, space, next_offsets, base, out
    )
    cols = columns(engine, out, bool(messages))
    return i, used, b"".join(out.parts), next_offsets, cols, out.uniq_keys


def columns(engine: Any, out: EncodedBatch, filled: bool) -> tuple[list[Any], ...]:
    """``out``'s dispatch fields as lists. The native encoder gives the integer columns of a
    call that had messages as int64 arrays (decision 600), the reference as lists: the values
    must be the same."""
    ints = (out.offsets, out.sizes, out.queue_offsets)
    if engine is NATIVE and NATIVE is not PY and filled:
        assert all(type(c) is array and c.typecode == "q" for c in ints), ints
    return (*map(list, ints), out.queues, out.tags, out.keys)


@SETTINGS
@given(
    st.lists(MESSAGES, max_size=40),
    st.integers(8, 60_000),
    st.sampled_from([("10.0.0.9", 10911), ("2001:db8::7", 8081)]),
)
def test_encode_batch_is_byte_identical(messages: list[Message], space: int, store: Any) -> None:
    native = encode(NATIVE, messages, space, store)
    assert native == encode(PY, messages, space, store)
    i, used, data = native[0], native[1], native[2]
    assert len(data) == used
    # What fits is encoded; the first message that does not fit stops the batch.
    for n, m in enumerate(messages[:i]):
        assert record.decode(data, native[4][0][n] - 4096).body == m.body


class _OddHash(str):
    """A property name equal to ``TAGS`` that a dict files under another hash: a lookup by
    ``"TAGS"`` does not find it."""

    def __hash__(self) -> int:
        return 7


class _Name(str):
    """A ``str`` subclass property name with ``str``'s hash: a lookup by ``"TAGS"`` finds it."""


def test_encode_batch_reuses_shared_objects_and_finds_property_names_as_lookups_do() -> None:
    """The native encoder reuses the last topic and born host when a message carries the same
    object, and picks ``TAGS``, ``KEYS`` and ``UNIQ_KEY`` out while it encodes the properties
    (decision 851): runs of shared objects, objects equal but not the same, hosts that
    alternate, and ``str`` subclass names a lookup would or would not find give the reference's
    bytes and lists."""
    topic = "shared"
    a, b = ("10.0.0.1", 1), ("::1", 2)
    c = ("10.0.0.1", 1 + int("0"))  # equal to a, another object
    hosts = [a, a, b, a, c, c, b, b, a]
    messages = [
        Message(
            topic=topic if i % 4 else "".join(["sha", "red"]),
            queue_id=i % 3,
            body=bytes([i]) * (i * 37 % 200),
            born_host=hosts[i % len(hosts)],
            properties=(
                {_OddHash("TAGS"): "odd", "KEYS": f"k{i} j{i}", "UNIQ_KEY": f"u{i}"}
                if i % 5 == 0
                else {"UNIQ_KEY": f"u{i}", "TAGS": f"t{i}", "x": "y"}
                if i % 5 == 1
                else {"KEYS": "", "UNIQ_KEY": "", _Name("TAGS"): "sub"}
                if i % 5 == 2
                else {}
                if i % 5 == 3
                else {"TAGS": "t", "KEYS": " a  b ", "UNIQ_KEY": "u"}
            ),
        )
        for i in range(60)
    ]
    for store in (("10.0.0.9", 10911), ("2001:db8::7", 8081)):
        native = encode(NATIVE, messages, 1 << 20, store)
        assert native == encode(PY, messages, 1 << 20, store)
        tags = native[4][4]
        assert tags[0] is None and tags[1] == "t1" and tags[2] == "sub" and tags[4] == "t"


def _encode_rolled(
    engine: Any,
    encoder: RecordEncoder,
    messages: list[Message],
    base: dict[tuple[str, int], int],
    offset: int,
    spaces: tuple[int, ...],
) -> tuple[Any, ...]:
    """``messages`` encoded by ``engine`` from file offset ``offset``, one ``encode_batch`` call
    a space in ``spaces`` (a call stops where its space ends, as at a file's roll, and the next
    goes on from there): for each call its (next start, bytes used, bytes, queue offsets,
    queues), then ``next_offsets`` as it left them."""
    next_offsets: dict[tuple[str, int], int] = {}
    results: list[Any] = []
    start = 0
    for space in spaces:
        out = EncodedBatch(store_timestamp=1_700_000_000_123)
        start, used = engine.encode_batch(
            encoder, messages, start, offset, space, next_offsets, base, out
        )
        offset += used
        results.append((start, used, b"".join(out.parts), list(out.queue_offsets), out.queues))
        results.append(dict(next_offsets))
    return tuple(results)


class _QueueNumber(int):
    """An ``int`` subclass queue id: not an exact int, so the slots' fast path must not take it."""


def test_encode_batch_finds_a_queue_by_topic_object_and_queue_id_as_the_key_cache_does() -> None:
    """The native encoder takes a batch queue's slot by the message's topic object and exact int
    queue id before any dict lookup (decision 960). Two topics sharing queue ids, topics equal
    but not the same object, ``bool`` and ``int`` subclass queue ids equal to an int one, and
    a first call cut short by the file's end give the reference's offsets, keys, bytes and
    ``next_offsets``; every queue's offsets run on without a gap or a repeat."""
    a2 = "".join(["to", "pic-a"])  # equal to "topic-a", another object
    qids: list[int] = [1, True, _QueueNumber(1), 0, False, 2, _QueueNumber(2)]
    messages = [
        Message(
            topic=("topic-a", "topic-b", a2)[i % 3],
            queue_id=qids[(i // 3) % len(qids)],
            body=bytes([i % 251]) * (i % 50),
        )
        for i in range(300)
    ]
    base = {("topic-a", 1): 70, ("topic-b", 2): 5}

    def run(engine: Any) -> tuple[Any, ...]:
        return _encode_rolled(engine, RecordEncoder(), messages, base, 0, (9_000, 1 << 24))

    native = run(NATIVE)
    assert 0 < native[0][0] < len(messages)
    assert native == run(PY)
    seen: dict[tuple[str, int], list[int]] = {}
    for part in (native[0], native[2]):
        for key, q in zip(part[4], part[3], strict=True):
            seen.setdefault((key[0], int(key[1])), []).append(q)
    for key, offsets in seen.items():
        first = base.get(key, 0)
        assert offsets == list(range(first, first + len(offsets))), key


@pytest.mark.parametrize("cache_full", [False, True])
def test_encode_batch_queue_offsets_across_many_queues_and_a_roll(cache_full: bool) -> None:
    """The native encoder keeps a batch's queue offsets in 32 slots found by the identity of the
    cached queue key (decision 450): a batch over more queues than slots, queues that come back
    after others, a roll that continues the offsets in a second call, and keys the cache cannot
    keep (a new tuple at every call) all give the reference's offsets, bytes and
    ``next_offsets``."""
    messages = [
        Message(topic=f"t{i % 5}", queue_id=(i * 7) % 17, body=bytes([i % 251]) * (i % 40))
        for i in range(400)
    ]
    base = {(f"t{t}", q): 1000 * t + q for t in range(5) for q in range(0, 17, 2)}

    def run(engine: Any) -> tuple[Any, ...]:
        encoder = RecordEncoder()
        if cache_full:  # the topic cache is full: no key of this batch is kept
            encoder._queue_keys.update({f"other{k}": {} for k in range(100_000)})
        # The first call stops where the file would roll.
        return _encode_rolled(engine, encoder, messages, base, 4096, (20_000, 1 << 24))

    native = run(NATIVE)
    assert 0 < native[0][0] < len(messages)  # the roll happened mid-batch
    assert native == run(PY)
    assert native[-1][("t0", 0)] == 1000 * 0 + 0 + sum(
        1 for i in range(400) if i % 5 == 0 and (i * 7) % 17 == 0
    )


def test_encode_batch_is_byte_identical_at_every_crc_lane_boundary() -> None:
    """The native encoder reads a body once, three 256-byte lanes at a time, and joins its CRC
    into the record CRC by combination (decision 320): bodies just below, at and past each lane
    boundary, of mixed lengths in one batch (the combination operator changes with the length),
    are encoded byte for byte as the reference encodes them."""
    sizes = [0, 1, 7, 767, 768, 769, 1024, 1024, 1535, 1536, 1537, 2303, 2304, 2305, 5000, 65_537]
    messages = [
        Message(topic="lanes", body=bytes((n * 7 + i) % 251 for i in range(n)), queue_id=n % 3)
        for n in sizes
    ]
    native = encode(NATIVE, messages, 1 << 24, ("10.0.0.9", 10911))
    assert native == encode(PY, messages, 1 << 24, ("10.0.0.9", 10911))
    assert native[0] == len(messages)
    for n, pos in enumerate(native[4][0]):
        assert record.decode(native[2], pos - 4096, check_crc=True).body == messages[n].body


@pytest.mark.parametrize(
    ("properties", "error"),
    [
        ({"a\x01": "b"}, RecordError),
        ({"a": "b\x02"}, RecordError),
        ({"a": "x" * 40_000}, RecordError),
        ({"a": 5}, TypeError),
        ({5: "a"}, TypeError),
    ],
)
def test_encode_batch_refuses_the_same_properties(properties: Any, error: type) -> None:
    bad = [Message(topic="t", body=b"x"), Message(topic="t", body=b"y", properties=properties)]
    for engine in (PY, NATIVE):
        with pytest.raises(error):
            encode(engine, bad, 1 << 20, ("10.0.0.9", 1))


def test_encode_batch_refuses_a_topic_too_long_for_the_format() -> None:
    bad = [Message(topic="t" * 70_000, body=b"x")]
    for engine in (PY, NATIVE):
        with pytest.raises(RecordError):
            encode(engine, bad, 1 << 20, ("10.0.0.9", 1))


def run_of(messages: list[Message], store: Any = ("10.0.0.9", 1)) -> bytes:
    _, _, data, *_ = encode(PY, messages, 1 << 30, store)
    return data


def dispatch(engine: Any, buf: Any, pos: int, limit: int) -> Any:
    out = EncodedBatch()
    stamps: list[int] = []
    try:
        end = engine.read_dispatch_run(buf, pos, limit, 1000, out, stamps)
    except RecordError as e:
        return type(e)
    lists = (out.offsets, out.sizes, out.queue_offsets, out.queues, out.tags, out.keys)
    return end, lists, out.uniq_keys, stamps


@SETTINGS
@given(st.lists(MESSAGES, min_size=1, max_size=30), st.integers(0, 64))
def test_dispatch_scan_is_identical_and_stops_at_padding(messages: list[Message], pad: int) -> None:
    data = run_of(messages)
    buf = data + blank_record(8 + pad)
    native = dispatch(NATIVE, buf, 0, len(buf))
    assert native == dispatch(PY, buf, 0, len(buf))
    assert native[0] == len(data) and len(native[1][0]) == len(messages)
    # Through a mapping-like buffer and from a record in the middle.
    second = native[1][0][1] - 1000 if len(messages) > 1 else 0
    assert dispatch(NATIVE, memoryview(buf), second, len(buf)) == dispatch(
        PY, buf, second, len(buf)
    )


@SETTINGS
@given(
    st.lists(MESSAGES, min_size=1, max_size=12),
    st.integers(0, 10**9),
    st.integers(0, 255),
    st.booleans(),
)
def test_recovery_scan_agrees_on_damaged_runs(
    messages: list[Message], where: int, value: int, check_crc: bool
) -> None:
    data = bytearray(run_of(messages) + blank_record(16))
    data[where % len(data)] = value  # one byte changed anywhere, padding included
    limit = len(data)
    native = NATIVE.scan_records(data, 0, limit, 4096, check_crc)
    assert native == PY.scan_records(data, 0, limit, 4096, check_crc)
    # The scan stops exactly where validate first refuses a record.
    end, count = native
    assert end <= limit and count <= len(messages)


@SETTINGS
@given(
    st.sampled_from([0, 1, 200, 767, 768, 1024, 3000]),
    st.integers(0, 10**9),
    st.integers(0, 255),
    st.booleans(),
)
@example(0, 747, 54, True)  # SYSFLAG bit 16 cleared: read as a record without its pair (870)
def test_recovery_scan_of_same_sized_bodies_agrees_on_damage(
    body_len: int, where: int, value: int, check_crc: bool
) -> None:
    """Past a few records of one body size, the native scans join the record CRC from the
    body's CRC with a shift table (decision 650): a byte changed anywhere in a later record,
    header, body, topic, properties or CRC pair, stops both scans where the reference stops."""
    messages = [
        Message(
            topic=f"t{i % 3}",
            body=bytes([i % 251]) * body_len,
            queue_id=i % 4,
            properties={"KEYS": f"k{i}", "UNIQ_KEY": f"U{i:08d}"},
        )
        for i in range(40)
    ]
    clean = run_of(messages) + blank_record(16)
    sizes = [len(run_of([m])) for m in messages]
    start = sum(sizes[:20])  # damage after the table is built (8 records in a row)
    data = bytearray(clean)
    at = start + where % (len(clean) - 16 - start)
    data[at] = value if value != clean[at] else value ^ 0xFF
    limit = len(data)
    for buf in (bytes(clean), data):
        native = NATIVE.scan_records(buf, 0, limit, 4096, check_crc)
        assert native == PY.scan_records(buf, 0, limit, 4096, check_crc)
        pos, status, cols = NATIVE.dispatch_columns(buf, 0, limit, 4096, True, check_crc, 1 << 20)
        ref_pos, ref_status, ref_cols = PY.dispatch_columns(
            buf, 0, limit, 4096, True, check_crc, 1 << 20
        )
        assert (pos, status, len(cols[0])) == (ref_pos, ref_status, len(ref_cols))
    if check_crc:
        # The damaged record and everything after it are refused: the CRCs catch any byte.
        end, count = NATIVE.scan_records(data, 0, limit, 4096, True)
        damaged = max(i for i in range(40) if sum(sizes[:i]) <= at)
        assert count == damaged and end == sum(sizes[:damaged])


@SETTINGS
@given(
    st.lists(st.tuples(st.sampled_from(["a", "tøpic", "b#c"]), st.integers(0, 3)), max_size=20),
    st.data(),
)
def test_index_keys_and_tag_hashes_are_identical(queues: Any, data: Any) -> None:
    n = len(queues)
    keys = data.draw(
        st.lists(st.one_of(st.none(), TEXT, st.just(" k1  k2 ")), min_size=n, max_size=n)
    )
    uniqs = data.draw(st.lists(st.one_of(st.none(), TEXT), min_size=n, max_size=n))
    h_native, r_native = NATIVE.index_keys(queues, keys, uniqs)
    h_py, r_py = PY.index_keys(queues, keys, uniqs)
    assert h_native.tolist() == h_py.tolist() and r_native.tolist() == r_py.tolist()
    assert NATIVE.tag_hashes(keys).tolist() == PY.tag_hashes(keys).tolist()


def test_index_keys_hash_topic_and_key_as_the_index_file_does() -> None:
    hashes, numbers = NATIVE.index_keys(
        [("orders", 0), ("orders", 1)], ["k1 k2", None], ["U1", "U2"]
    )
    assert hashes.tolist() == [
        key_hash("orders", "U1"),
        key_hash("orders", "k1"),
        key_hash("orders", "k2"),
        key_hash("orders", "U2"),
    ]
    assert numbers.tolist() == [0, 0, 0, 1]


def segment(engine: Any, data: Any, base: int) -> Any:
    try:
        return engine.segment_tables(data, base)
    except (RecordError, CorruptRecordError) as e:
        return type(e)


@SETTINGS
@given(
    st.lists(MESSAGES, min_size=1, max_size=10),
    st.one_of(st.none(), st.tuples(st.integers(0, 10**9), st.integers(0, 255))),
)
def test_segment_build_agrees_on_good_and_damaged_runs(
    messages: list[Message], damage: tuple[int, int] | None
) -> None:
    one_queue = [
        Message(topic="seg", body=m.body, properties=m.properties, born_host=m.born_host)
        for m in messages
    ]
    data = bytearray(run_of(one_queue))
    if damage is not None:
        data[damage[0] % len(data)] = damage[1]
    native = segment(NATIVE, data, 7)
    assert native == segment(PY, data, 7)
    if damage is None:
        assert native.count == len(messages)
    assert segment(NATIVE, bytes(data), 8) == segment(PY, bytes(data), 8)  # wrong base offset


def test_segment_build_refuses_an_empty_run_and_trailing_bytes() -> None:
    for engine in (PY, NATIVE):
        with pytest.raises(RecordError, match="at least one"):
            engine.segment_tables(b"", 0)
        with pytest.raises(RecordError, match="not a record"):
            engine.segment_tables(run_of([Message(topic="s", body=b"x")]) + b"\0" * 9, 7)


@pytest.mark.parametrize("size", [0, 1, 7, 8, 9, 63, 64, 1000, 1024, 4099, 100_000])
def test_crc32c_matches_google_crc32c(size: int) -> None:
    data = os.urandom(size + 3)
    for start in (0, 1, 3):
        view = memoryview(data)[start : start + size]
        assert NATIVE.crc32c(view) == google_crc32c.value(bytes(view)) == PY.crc32c(view)


def arrow_rows(batch: Any) -> Any:
    return batch.to_pylist()


@SETTINGS
@given(st.lists(MESSAGES, max_size=20), st.booleans(), st.randoms(use_true_random=False))
def test_arrow_decode_is_identical(messages: list[Message], v6: bool, rnd: Any) -> None:
    store = ("2001:db8::7", 8081) if v6 else ("10.0.0.9", 1)
    data = run_of(messages, store)
    batch = EncodedBatch()
    PY.read_dispatch_run(data, 0, len(data), 0, batch, [])
    positions = np.asarray(batch.offsets, np.int64)
    rnd.shuffle(order := list(range(len(positions))))
    positions = positions[order] if len(positions) else positions
    native = NATIVE.decode_run(data, positions, True)
    reference = columnar.decode_run_py(data, positions, check_crc=True)
    assert native.schema == reference.schema == columnar.RECORD_SCHEMA
    assert arrow_rows(native) == arrow_rows(reference)
    assert native.equals(reference)


@SETTINGS
@given(st.lists(MESSAGES, min_size=1, max_size=8), st.integers(0, 10**9), st.integers(0, 255))
def test_arrow_decode_refuses_what_decode_refuses(
    messages: list[Message], where: int, value: int
) -> None:
    data = bytearray(run_of(messages))
    batch = EncodedBatch()
    PY.read_dispatch_run(bytes(data), 0, len(data), 0, batch, [])
    data[where % len(data)] = value

    def outcome(decode: Any) -> Any:
        try:
            return arrow_rows(decode(bytes(data), batch.offsets, check_crc=True))
        except RecordError as e:
            return type(e)

    assert outcome(columnar.decode_run) == outcome(columnar.decode_run_py)


@SETTINGS
@given(
    st.lists(MESSAGES, min_size=1, max_size=12),
    st.one_of(st.none(), st.tuples(st.integers(0, 10**9), st.integers(0, 255))),
    st.booleans(),
)
def test_decoding_a_run_into_messages_is_identical(
    messages: list[Message], damage: tuple[int, int] | None, check_crc: bool
) -> None:
    data = bytearray(run_of(messages, ("2001:db8::7", 8081)))
    batch = EncodedBatch()
    PY.read_dispatch_run(bytes(data), 0, len(data), 0, batch, [])
    if damage is not None:
        data[damage[0] % len(data)] = damage[1]

    def outcome(engine: Any) -> Any:
        try:
            return engine.decode_many(bytes(data), batch.offsets[::-1], check_crc)
        except RecordError as e:
            return type(e)

    native = outcome(NATIVE)
    assert native == outcome(PY)
    if damage is None:
        assert [m.body for m in native] == [m.body for m in messages][::-1]


@SETTINGS
@given(
    st.lists(MESSAGES, min_size=1, max_size=10),
    st.one_of(st.none(), st.tuples(st.integers(0, 10**9), st.integers(0, 255))),
    st.integers(0, 9),
    st.integers(-2, 2),
)
def test_span_check_agrees_on_good_and_damaged_spans(
    messages: list[Message], damage: tuple[int, int] | None, first: int, shift: int
) -> None:
    """The cold read's check of a fetched span: records at their entries' positions and sizes,
    body CRCs, consecutive queue offsets; damaged bytes, wrong sizes and wrong offsets alike."""
    one_queue = [Message(topic="span", body=m.body, properties=m.properties) for m in messages]
    data = bytearray(run_of(one_queue))
    batch = EncodedBatch()
    PY.read_dispatch_run(bytes(data), 0, len(data), 0, batch, [])
    first = first % len(batch.offsets)
    positions = np.asarray(batch.offsets[first:], np.int64)
    sizes = np.asarray(batch.sizes[first:], np.int64)
    assert PY.check_span(bytes(data), positions, sizes, 7 + first) == (-1, 0)
    if damage is not None:
        data[damage[0] % len(data)] = damage[1]
    for args in (
        (positions, sizes, 7 + first),
        (positions, sizes, 7 + first + shift),
        (positions, sizes + shift, 7 + first),
        (positions + shift, sizes, 7 + first),
    ):
        native = NATIVE.check_span(bytes(data), *args)
        assert native == PY.check_span(bytes(data), *args)
    if damage is None and shift:
        assert NATIVE.check_span(bytes(data), positions, sizes, 7 + first + shift)[0] == 0


def test_span_check_names_a_body_crc_mismatch() -> None:
    data = bytearray(run_of([Message(topic="span", body=b"y" * 300)] * 3))
    batch = EncodedBatch()
    PY.read_dispatch_run(bytes(data), 0, len(data), 0, batch, [])
    data[data.index(b"y" * 300, batch.offsets[1]) + 150] ^= 0xFF  # the second record's body
    for engine in (PY, NATIVE):
        assert engine.check_span(bytes(data), batch.offsets, batch.sizes, 7) == (1, -2)
        assert engine.check_span(bytes(data), batch.offsets[:1], batch.sizes[:1], 7) == (-1, 0)


@SETTINGS
@given(
    st.binary(min_size=0, max_size=400),
    st.lists(st.tuples(st.integers(-5, 420), st.integers(-2, 60)), max_size=12),
    st.integers(0, 30),
)
def test_gather_copies_the_same_bytes_and_refuses_the_same_ranges(
    src: bytes, ranges: list[tuple[int, int]], spare: int
) -> None:
    positions = np.asarray([p for p, _ in ranges], np.int64)
    sizes = np.asarray([s for _, s in ranges], np.int64)
    room = int(np.clip(sizes, 0, None).sum()) + spare - 10

    def outcome(engine: Any) -> Any:
        out = bytearray(max(0, room))
        try:
            end = engine.gather(src, positions, sizes, out, 3)
        except ValueError:
            return ValueError
        return end, bytes(out)

    native = outcome(NATIVE)
    assert native == outcome(PY)
    if native is not ValueError:
        expected = b"".join(src[p : p + s] for p, s in ranges)
        assert native[1][3 : native[0]] == expected


# -- the record CRC (decision 210) ----------------------------------------------------------------


def parts_of(rec: bytes) -> tuple[int, int, int]:
    """(SYSFLAG, position of the properties' length field, properties length) of a record."""
    sys_flag = struct.unpack_from(">i", rec, 36)[0]
    at = 48 + (20 if sys_flag & SYSFLAG_BORNHOST_V6 else 8) + 8
    at += (20 if sys_flag & SYSFLAG_STOREHOST_V6 else 8) + 16
    at += struct.unpack_from(">i", rec, at - 4)[0]
    at += 2 + struct.unpack_from(">H", rec, at)[0]
    return sys_flag, at, struct.unpack_from(">H", rec, at)[0]


def legacy(rec: bytes, physical_offset: int | None = None) -> bytes:
    """``rec`` as tmq wrote it before the record CRC: no pair, SYSFLAG bit 16 clear."""
    sys_flag, at, props_len = parts_of(rec)
    assert sys_flag & SYSFLAG_RECORD_CRC
    out = bytearray(rec[:-CRC_TRAILER_SIZE])
    struct.pack_into(">i", out, 0, len(out))
    struct.pack_into(">i", out, 36, sys_flag & ~SYSFLAG_RECORD_CRC)
    struct.pack_into(">H", out, at, props_len - CRC_TRAILER_SIZE)
    if physical_offset is not None:
        struct.pack_into(">q", out, 28, physical_offset)
    return bytes(out)


def records_of(data: bytes) -> list[bytes]:
    out, pos = [], 0
    while pos < len(data):
        size = struct.unpack_from(">i", data, pos)[0]
        out.append(data[pos : pos + size])
        pos += size
    return out


def scan(engine: Any, data: bytes, physical_offset: int = 4096) -> tuple[int, int]:
    """The recovery scan over ``data`` (``run_of``'s, from CommitLog offset 4096) and padding."""
    buf = bytes(data) + blank_record(8)
    end, count = engine.scan_records(buf, 0, len(buf), physical_offset, True)
    return end, count


def pair_value(rec: bytes) -> int:
    """The CRC a RocketMQ reader takes from the record's ``__CRC32#`` pair."""
    pair = rec[-CRC_TRAILER_SIZE:]
    assert pair[:9] == b"__CRC32#\x01" and pair[-1:] == b"\x02"
    return sum((d - 48) * 10**i for i, d in enumerate(pair[9:19]))


@SETTINGS
@given(st.lists(MESSAGES, min_size=1, max_size=10), HOSTS)
def test_every_record_ends_with_its_crc_as_rocketmq_writes_it(
    messages: list[Message], store: Any
) -> None:
    for engine in (PY, NATIVE):
        _, _, data, *_ = encode(engine, messages, 1 << 30, store)
        recs = records_of(data)
        assert len(recs) == len(messages)
        for rec, m in zip(recs, messages, strict=True):
            sys_flag, _, props_len = parts_of(rec)
            assert sys_flag & SYSFLAG_RECORD_CRC and props_len >= CRC_TRAILER_SIZE
            assert props_len <= 0x7FFF  # RocketMQ reads the length as a Java short
            expected = google_crc32c.value(rec[:-CRC_TRAILER_SIZE]) & 0x7FFFFFFF
            assert pair_value(rec) == expected
            assert record.decode(rec).properties == m.properties  # the pair is not a property


def test_a_producers_own_crc_property_is_an_ordinary_property() -> None:
    forged = {"a": "1", record.PROPERTY_CRC32: "0000000000"}
    data = run_of([Message("t", b"x", properties=forged), Message("t", b"y")])
    for engine in (PY, NATIVE):
        assert scan(engine, data) == (len(data), 2)
        assert [m.properties for m in engine.decode_many(data, [0], True)] == [forged]
    # In a record written before the record CRC, a trailing forged pair is a property too.
    old = legacy(records_of(data)[0])
    assert old.endswith(b"__CRC32#\x010000000000\x02")
    for engine in (PY, NATIVE):
        assert scan(engine, old) == (len(old), 1)
        assert engine.decode_many(old, [0], True)[0].properties == forged


@pytest.mark.parametrize(
    "field", ["queue offset", "store timestamp", "topic", "a property", "the pair's digits"]
)
def test_a_damaged_record_whose_body_crc_passes_is_refused(field: str) -> None:
    """Torn properties (a power loss lands a record's pages in any order), or any byte outside
    the body: BODYCRC still matches, the record CRC does not."""
    msgs = [Message("topic", b"b" * 50, properties={"UNIQ_KEY": "10ABCDEF"}) for _ in range(3)]
    data = bytearray(run_of(msgs))
    second = len(records_of(bytes(data))[0])
    size = len(records_of(bytes(data))[1])
    where = {
        "queue offset": second + 27,
        "store timestamp": second + 56 + 7,
        "topic": second + 88 + 50 + 2,
        "a property": second + size - CRC_TRAILER_SIZE - 3,
        "the pair's digits": second + size - 5,
    }[field]
    data[where] ^= 0x01 if field != "the pair's digits" else 0x03
    buf = bytes(data)
    for engine in (PY, NATIVE):
        assert scan(engine, buf) == (second, 1)
        with pytest.raises(CorruptRecordError, match="record CRC"):
            engine.decode_many(buf, [second], True)
        with pytest.raises(CorruptRecordError, match="record CRC"):
            engine.segment_tables(buf, 0)
    with pytest.raises(CorruptRecordError, match="record CRC"):
        columnar.decode_run(buf, [0, second])
    with pytest.raises(CorruptRecordError, match="record CRC"):
        columnar.decode_run_py(buf, [0, second])
    # Without the CRC checks (a caller that trusts the bytes) the record still decodes.
    assert len(NATIVE.decode_many(buf, [second], False)) == 1


@pytest.mark.parametrize("value", [0x00, 0x36, 0x03, 0x81])
def test_a_damaged_sysflag_byte_cannot_turn_the_record_crc_off(value: int) -> None:
    """SYSFLAG bit 16 says the record ends with its CRC pair (decision 210). A byte of damage
    that clears it must not make the record read as one written before the pair, with the pair
    served as a property: a bit no encoder sets is damage, and a record without the bit whose
    pair matches the record as it was written (bit set) is refused as damaged (decision 870)."""
    msgs = [Message("topic", b"", properties={"UNIQ_KEY": f"U{i}"}) for i in range(3)]
    data = bytearray(run_of(msgs))
    second = len(records_of(bytes(data))[0])
    assert data[second + 37] == 0x01  # SYSFLAG's bits 16-23: only the record CRC flag
    data[second + 37] = value
    buf = bytes(data)
    for engine in (PY, NATIVE):
        assert scan(engine, buf) == (second, 1)
        with pytest.raises(RecordError):
            engine.decode_many(buf, [second], True)
        with pytest.raises(RecordError):
            engine.segment_tables(buf, 0)
    for decode_run in (columnar.decode_run, columnar.decode_run_py):
        with pytest.raises(RecordError):
            decode_run(buf, [0, second])


def test_a_record_flagged_with_a_crc_too_short_to_hold_it_is_malformed() -> None:
    old = bytearray(legacy(run_of([Message("t", b"x")])))  # no properties at all
    assert scan(PY, bytes(old)) == (len(old), 1)
    struct.pack_into(">i", old, 36, SYSFLAG_RECORD_CRC)  # a flag no encoder would set here
    buf = bytes(old)
    for engine in (PY, NATIVE):
        assert scan(engine, buf) == (0, 0)
        with pytest.raises(RecordError, match="too short"):
            engine.decode_many(buf, [0], False)
        assert segment(engine, buf, 0) is RecordError


@SETTINGS
@given(
    st.lists(st.tuples(MESSAGES, st.booleans()), min_size=1, max_size=12),
    st.one_of(st.none(), st.tuples(st.integers(0, 10**9), st.integers(0, 255))),
)
def test_runs_mixing_old_and_new_records_read_identically(
    items: list[tuple[Message, bool]], damage: tuple[int, int] | None
) -> None:
    """Records written before the record CRC are still read, by both engines alike, in the
    same runs as new ones (a CommitLog upgraded in place)."""
    messages = [
        Message("q", m.body, properties=m.properties, born_host=m.born_host) for m, _ in items
    ]
    recs, pos = [], 0
    for rec, (_, old) in zip(records_of(run_of(messages)), items, strict=True):
        rec = legacy(rec, pos) if old else rec[:28] + struct.pack(">q", pos) + rec[36:]
        if not old:  # a new record moved to ``pos``: its pair follows its offset
            rec = rec[:-CRC_TRAILER_SIZE] + record.crc_trailer(
                google_crc32c.value(rec[:-CRC_TRAILER_SIZE])
            )
        recs.append(rec)
        pos += len(rec)
    data = bytearray(b"".join(recs))
    if damage is not None:
        data[damage[0] % len(data)] = damage[1]
    buf = bytes(data) + blank_record(8)
    scans = [engine.scan_records(buf, 0, len(buf), 0, True) for engine in (PY, NATIVE)]
    assert scans[0] == scans[1]
    if damage is None:
        assert scans[0] == (len(buf) - 8, len(items))
    assert segment(NATIVE, bytes(data), 0) == segment(PY, bytes(data), 0)
    offsets = [sum(map(len, recs[:i])) for i in range(len(recs))]

    def decoded(engine: Any) -> Any:
        try:
            return engine.decode_many(buf, offsets, True)
        except RecordError as e:
            return type(e)

    assert decoded(NATIVE) == decoded(PY)
    if damage is None:
        assert [m.properties for m in decoded(NATIVE)] == [m.properties for m in messages]


@given(st.lists(MESSAGES, min_size=1, max_size=12), st.integers(0, 600), st.booleans())
def test_append_records_writes_what_the_reference_writes(
    tmp_path_factory: Any, messages: list[Message], pad: int, large: bool
) -> None:
    """The native ``append_records`` (pwritev skipping the size fields, then the sizes through
    the mapping) leaves the file byte-identical to the reference's, whether the batch goes by
    pwrite or through the mapping, with a BLANK padding after the records; and while the
    failpoint between the two steps runs, every record's size field is still zero."""
    from tiered.hot.mapped_file import _PWRITE_MIN, MappedFile

    batch = EncodedBatch(store_timestamp=1_700_000_000_000)
    RecordEncoder().encode_batch(messages, 0, 4096, 1 << 24, {}, {}, batch)
    data = b"".join(batch.parts) + (blank_record(pad + 8) if pad else b"")
    if large:
        data += blank_record(_PWRITE_MIN)  # over the pwrite threshold
    at = 4096 + 3  # an unaligned position in the file
    root = tmp_path_factory.mktemp("append")
    files = [MappedFile(root / name, 0, 1 << 17, create=True) for name in ("py", "native")]
    seen: list[bytes] = []
    try:
        for f in files:
            f.wrote = at
        files[0].append_records_py(data, batch.offsets, 4096)
        NATIVE.append_records(
            files[1]._fd,
            files[1].mm,
            at,
            data,
            batch.offsets,
            4096,
            _PWRITE_MIN,
            lambda: seen.extend(files[1].mm[at + o - 4096 : at + o - 4092] for o in batch.offsets),
        )
        assert files[1].mm[:] == files[0].mm[:]
        assert files[0].mm[at : at + len(data)] == data
        assert seen == [bytes(4)] * len(batch.offsets)
        with pytest.raises(ValueError):  # offsets out of order are refused, nothing written
            NATIVE.append_records(
                files[1]._fd, files[1].mm, 0, data, [*batch.offsets[::-1], 4096], 4096, 1, None
            )
    finally:
        for f in files:
            f.close()


@pytest.mark.parametrize("count", [3, 20, 256])
def test_encode_batch_into_the_file_writes_what_append_records_writes(
    tmp_path: Path, count: int
) -> None:
    """Given a sink, the native encoder writes a batch that fits whole and is large enough
    (16 KiB) into the file itself, in the GIL release of its encoding (decision 452): the file is
    byte-identical to encoding then ``append_records_py``, and the dispatch fields are the same.
    The records go with their size fields in place (decision 1040): with the ``mid_write``
    failpoint armed, the file holds, while it runs, the batch's first bytes up to a file page
    past its middle, sizes and all, and zeros after, as a ``pwrite`` cut by SIGKILL leaves it.
    A smaller batch, or one that does not fit whole, is left to the caller in ``out.parts``."""
    from tiered.hot.mapped_file import MappedFile

    body = bytes(range(256)) * 4
    messages = [
        Message(
            topic=f"t{i % 3}", queue_id=i % 5, body=body[: 900 + i], properties={"KEYS": f"k{i}"}
        )
        for i in range(count)
    ]
    at = 4096 + 3  # an unaligned position in the file
    ref, direct = (MappedFile(tmp_path / n, 0, 1 << 20, create=True) for n in ("ref", "direct"))
    seen: list[bytes] = []
    try:
        expected = EncodedBatch(store_timestamp=1_700_000_000_000)
        nxt_ref: dict[tuple[str, int], int] = {}
        RecordEncoder().encode_batch(messages, 0, 4096, 1 << 19, nxt_ref, {}, expected)
        ref.wrote = at
        ref.append_records_py(b"".join(expected.parts), expected.offsets, 4096)
        direct.wrote = at
        out = EncodedBatch(store_timestamp=1_700_000_000_000)
        nxt: dict[tuple[str, int], int] = {}
        sink = (direct._fd, direct.mm, at, lambda: seen.append(direct.mm[at : at + (1 << 19)]))
        i, used = RecordEncoder().encode_batch(messages, 0, 4096, 1 << 19, nxt, {}, out, sink)
        assert (i, nxt, list(out.offsets), list(out.queue_offsets), out.keys) == (
            count,
            nxt_ref,
            list(expected.offsets),
            list(expected.queue_offsets),
            expected.keys,
        )
        # The reference (TMQ_PURE_PYTHON=1) never writes: the caller does.
        assert out.written == (record.ENGINE_NAME == "native" and used >= 16384)
        if out.written:
            assert out.parts == [] and len(seen) == 1
            assert direct.mm[:] == ref.mm[:]
            # At the cut: a prefix of the batch ending at a file page, sizes in place, then zeros.
            cut = (at + used // 2) // 4096 * 4096 + 4096 - at
            assert 0 < cut < used
            assert seen[0][:cut] == ref.mm[at : at + cut]
            assert seen[0][cut:] == bytes(len(seen[0]) - cut)
            # Unarmed (None, as in production) the same bytes go in one write.
            again = MappedFile(tmp_path / "again", 0, 1 << 20, create=True)
            try:
                plain = (again._fd, again.mm, at, None)
                again_out = EncodedBatch(store_timestamp=1_700_000_000_000)
                RecordEncoder().encode_batch(messages, 0, 4096, 1 << 19, {}, {}, again_out, plain)
                assert again.mm[:] == ref.mm[:]
            finally:
                again.close()
        else:
            assert b"".join(out.parts) == b"".join(expected.parts)
            assert direct.mm[:] == bytes(1 << 20)  # nothing written: the caller writes
        # A batch that does not fit whole is never written by the encoder.
        short = EncodedBatch(store_timestamp=1)
        before = direct.mm[:]
        j, _ = RecordEncoder().encode_batch(messages, 0, 4096, used - 1, {}, {}, short, sink)
        assert j < count and not short.written and direct.mm[:] == before
        # A write the file refuses (EBADF here, EIO from a device) raises, nothing written.
        if record.ENGINE_NAME == "native" and used >= 16384:
            fd = os.open(tmp_path / "direct", os.O_RDONLY)
            try:
                bad = (fd, direct.mm, at + used, lambda: None)
                with pytest.raises(OSError):
                    RecordEncoder().encode_batch(
                        messages, 0, 4096, 1 << 19, {}, {}, EncodedBatch(), bad
                    )
            finally:
                os.close(fd)
            assert direct.mm[:] == before
    finally:
        ref.close()
        direct.close()


@pytest.mark.parametrize(
    "raw",
    [
        b"\x02a\x01b\x01c\x02\x02x",  # empty pairs, a value holding \x01, a name without a value
        b"k\x011\x02k\x012\x02\x01\x02",  # a later name wins; an empty name
        b"\xc3\xa9\x01\xe2\x82\xac\x02zzz",  # UTF-8 both sides
        b"ok\x01\xff\xfe\x02zzzz",  # a value that is not UTF-8
        b"\xe2\x82\x01\xac\x02zzzz",  # a separator inside a multi-byte sequence
    ],
)
def test_native_property_decode_matches_the_reference_on_raw_property_bytes(raw: bytes) -> None:
    """The native decode parses properties in C (decision 332): the same dict, or the same
    refusal, as ``decode_properties`` over every shape the bytes can take."""
    rec = legacy(
        records_of(run_of([Message("t", b"x", properties={"p": "q" * (len(raw) - 3)})]))[0]
    )
    _, at, props_len = parts_of(rec)
    assert props_len == len(raw)
    buf = rec[: at + 2] + raw + rec[at + 2 + props_len :]
    outcomes = []
    for engine in (PY, NATIVE):
        try:
            outcomes.append([m.properties for m in engine.decode_many(buf, [0], True)])
        except Exception as e:
            outcomes.append(type(e))
    assert outcomes[0] == outcomes[1]


def index_file_bytes(slot_count: int, hashes: list[int], offsets: list[int]) -> bytearray:
    """An IndexFile's bytes (header zero) holding ``hashes`` at CommitLog ``offsets`` as entries
    1, 2, ..., written by the reference ``index_put`` into a real file and mapping."""
    n = len(hashes) + 1
    size = record.INDEX_HEADER_SIZE + slot_count * 4 + n * record.INDEX_ENTRY_SIZE
    with tempfile.TemporaryFile() as fh:
        fh.truncate(size)
        with mmap.mmap(fh.fileno(), size) as mm:
            if hashes:
                stamps = np.full(len(hashes), 1_700_000_000_000, np.int64)
                stamps[len(hashes) // 2 :] += 5_000  # two eras of seconds
                PY.index_put(
                    mm,
                    fh.fileno(),
                    slot_count,
                    1,
                    1_700_000_000_000,
                    np.asarray(hashes, np.int64),
                    np.asarray(offsets, np.int64),
                    stamps,
                )
            return bytearray(mm[:])


def index_checks(data: bytearray, slot_count: int, n: int, begin: int) -> list[tuple[int, int]]:
    """Both engines' ``index_check`` with and without ``full``; they must agree."""
    found = []
    for full in (False, True):
        native = NATIVE.index_check(data, slot_count, n, begin, full)
        assert native == PY.index_check(data, slot_count, n, begin, full)
        found.append(native)
    return found


@SETTINGS
@given(
    st.sampled_from([1, 3, 7, 64]),
    st.lists(st.integers(0, 2**31 - 1), max_size=200),
    st.lists(st.tuples(st.integers(0, 10**9), st.binary(min_size=1, max_size=8)), max_size=3),
    st.integers(0, 10**6),
)
def test_index_check_agrees_on_damaged_slots_and_entries(
    slot_count: int, hashes: list[int], damage: list[tuple[int, bytes]], begin: int
) -> None:
    """The IndexFile structure check at start (decision 830): the native twin reports the same
    first problem as the reference on well-formed files and on bytes overwritten anywhere in
    the slots and entries, with and without ``full``."""
    offsets = [begin + 100 * i for i in range(len(hashes))]
    data = index_file_bytes(slot_count, hashes, offsets)
    n = len(hashes) + 1
    assert index_checks(data, slot_count, n, begin) == [(0, 0), (0, 0)]
    for where, value in damage:
        at = record.INDEX_HEADER_SIZE + where % (len(data) - record.INDEX_HEADER_SIZE)
        data[at : at + len(value)] = value[: len(data) - at]
    index_checks(data, slot_count, n, begin)
    # A file whose header says fewer entries than it holds, and its begin offset moved up.
    index_checks(data, slot_count, max(1, n // 2), begin + 150)


def test_index_check_agrees_across_its_steps() -> None:
    """More entries than one step of the check (``INDEX_CHECK_STEP``): an entry with a link to
    another slot's entry is reported only when no entry of its step breaks a simpler rule, and
    a problem in the second step is found after a good first one; both engines agree on which
    entry they name."""
    step = record.INDEX_CHECK_STEP
    count = step + 4000
    rnd = np.random.default_rng(830)
    slot_count = 1 << 16
    hashes = rnd.integers(0, 2**31 - 1, count).tolist()
    offsets = list(range(0, 64 * count, 64))
    clean = index_file_bytes(slot_count, hashes, offsets)
    n = count + 1
    assert index_checks(clean, slot_count, n, 0) == [(0, 0), (0, 0)]
    entries_at = record.INDEX_HEADER_SIZE + slot_count * 4

    def entry_field(data: bytearray, number: int, at: int, fmt: str, value: int) -> None:
        struct.pack_into(fmt, data, entries_at + number * record.INDEX_ENTRY_SIZE + at, value)

    def linked_to_another_slot(number: int) -> int:
        prev = number - 1
        while hashes[prev - 1] % slot_count == hashes[number - 1] % slot_count:
            prev -= 1
        return prev

    # A link to an entry of another slot at 1,000, and a negative seconds field at 900,000 in
    # the same step: the step reports the seconds first.
    data = bytearray(clean)
    entry_field(data, 1_000, 16, ">i", linked_to_another_slot(1_000))
    assert index_checks(data, slot_count, n, 0)[1] == (3, 1_000)
    entry_field(data, 900_000, 12, ">i", -5)
    assert index_checks(data, slot_count, n, 0)[1] == (3, 900_000)
    # In the second step: an offset below the previous entry's, after a link problem.
    data = bytearray(clean)
    entry_field(data, step + 10, 16, ">i", linked_to_another_slot(step + 10))
    assert index_checks(data, slot_count, n, 0)[1] == (3, step + 10)
    entry_field(data, step + 3000, 4, ">q", 5)
    assert index_checks(data, slot_count, n, 0)[1] == (3, step + 3000)
    # The first offset against the file's begin offset, across the step boundary too.
    data = bytearray(clean)
    assert index_checks(data, slot_count, n, 1)[1] == (3, 1)
    entry_field(data, step, 4, ">q", 64 * (step - 2) - 1)  # below entry step - 1
    assert index_checks(data, slot_count, n, 0)[1] == (3, step)


_DROPS_A_FOUND_VALUE = '''
import sys
from tiered import record
from tiered.record import EncodedBatch, Message, RecordEncoder

JUNK = []


class Name(str):
    """A property name that a lookup of KEYS compares with (it files under KEYS's hash); its
    __eq__ drops TAGS from the dict, whose value had no other reference, and fills memory."""

    def __hash__(self):
        return hash("KEYS")

    def __eq__(self, other):
        if "TAGS" in PROPS:
            del PROPS["TAGS"]
            JUNK.extend("".join(["Z" * 9, str(i)]) for i in range(20000))
        return str.__eq__(self, other)

    __ne__ = str.__ne__


engine = record.NATIVE_ENGINE if sys.argv[1] == "native" else record.PYTHON_ENGINE
PROPS = {"TAGS": "".join(["ta", "g-value"]), Name("x"): "v", "UNIQ_KEY": "".join(["u", "1"])}
out = EncodedBatch(store_timestamp=1)
message = Message(topic="t", body=b"b", queue_id=0, properties=PROPS)
engine.encode_batch(RecordEncoder(), [message], 0, 0, 1 << 20, {}, {}, out)
print(repr((out.tags, out.keys, out.uniq_keys, b"".join(out.parts).hex())), flush=True)
'''


@pytest.mark.skipif(NATIVE is PY, reason="the native engine is not built")
def test_a_str_subclass_property_name_that_changes_the_dict_in_a_lookup_is_safe() -> None:
    """Decision 982: the native encoder took ``TAGS``, ``KEYS`` and ``UNIQ_KEY`` of a message
    with a ``str`` subclass property name by three dict lookups holding borrowed references
    until all three were done. A lookup that meets such a name runs its ``__eq__``, Python
    code, which can drop a value an earlier lookup found: on main the process then took a
    reference to freed memory (a segmentation fault here). Each value must be owned before the
    next lookup, and the result be the reference's."""
    got = {}
    for engine in ("python", "native"):
        run = subprocess.run(
            [sys.executable, "-c", _DROPS_A_FOUND_VALUE, engine],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert run.returncode == 0, (engine, run.returncode, run.stderr[-2000:])
        got[engine] = run.stdout
    assert got["native"] == got["python"]
    assert "['tag-value']" in got["native"]
