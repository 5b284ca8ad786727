"""Every native reader of bytes tmq did not produce, fed damaged runs and hostile offsets.

``test_hostile_bytes.py`` (decision 430) sets one length field of one record to a hostile value
and reseals the CRCs. This file does what a crash, a torn write, a bad disk or a hostile object
store does instead (decision 765): whole runs truncated anywhere, bits flipped, byte ranges
zeroed, duplicated or spliced, hostile integers written over any field, records resealed after
the damage; and the offsets and sizes the readers are *given* (an object's offset table, a
ConsumeQueue entry) set to what a damaged table holds: negative, past the end, 2**31 - 1,
near 2**63 (where ``pos + 88`` overflows), with sizes that disagree.

Each native function is called with the pure-Python reference's arguments and must answer
what the reference answers: the same result, or an error of the same class. The classes are
the documented ones: ``RecordError`` (and its subclasses ``CorruptRecordError``,
``RecordCrcError``) from the record readers, ``ValueError`` from ``gather`` and from a span or
offset outside the data. Anything else (a crash, a ``SystemError``, a ``MemoryError`` from a
length read as 2**63) fails. A crash fails the whole run, which is the point: run it under the
sanitizer build (docs/fuzzing.md) and an out-of-bounds read is a report, not luck.

The default run takes a few seconds; ``TMQ_FUZZ_EXAMPLES`` scales it, and the ``slow`` soak
runs 20 times as many (``-m slow``). Failures print the seed of their input.
"""

from __future__ import annotations

import contextlib
import os
import random
import struct
import subprocess
import sys
import textwrap
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from test_hostile_bytes import layout, seal
from test_record_engine import records_of, run_of
from test_send_native import TOPICS, check, plain, request

from broker import reply
from tiered import columnar
from tiered.record import (
    NATIVE_ENGINE,
    PYTHON_ENGINE,
    DispatchColumns,
    EncodedBatch,
    Message,
    RecordError,
    blank_record,
)

NATIVE: Any = NATIVE_ENGINE
PY: Any = PYTHON_ENGINE
EXAMPLES = int(os.environ.get("TMQ_FUZZ_EXAMPLES", "150"))
FAST = settings(
    deadline=None,
    suppress_health_check=list(HealthCheck),
    phases=[Phase.explicit, Phase.generate],  # a seed is its own minimal example
    database=None,
)
SEEDS = st.integers(0, 2**63 - 1)

pytestmark = pytest.mark.skipif(NATIVE is None, reason="the native record engine is not built")

# Offsets and sizes a damaged offset table or ConsumeQueue entry can hold: each is a way the
# sum ``pos + n`` of a check can leave int64, or a length field read as signed can turn negative.
HOSTILE_INTS = [
    0,
    1,
    -1,
    7,
    8,
    47,
    48,
    87,
    88,
    91,
    92,
    2**15,
    2**16 - 1,
    2**31 - 1,
    -(2**31),
    2**32 - 1,
    2**62,
    2**63 - 1,
    2**63 - 8,
    2**63 - 48,
    2**63 - 88,
    2**63 - 100,
    -(2**63),
    -(2**63) + 1,
]
HOSTILE_I32 = [0, 1, -1, 8, 20, 21, 88, 91, 92, 2**31 - 1, -(2**31), 0xFFFF, 0x10000]
HOSTILE_U16 = [0, 1, 19, 20, 21, 0x7FFF, 0x8000, 0xFFFF]


def _corpus() -> list[bytes]:
    """Runs of records of every shape the readers branch on: IPv4 and IPv6 hosts, empty,
    short and lane-sized bodies, no properties, the dispatch keys, many keys, non-ASCII text."""
    shapes = [
        [Message("t", b"x", queue_id=0, properties={"KEYS": "a b", "TAGS": "t"}) for _ in range(4)],
        [
            Message(f"topic-{i}", bytes(range(i * 97 % 256)) * (i + 1), queue_id=i % 3)
            for i in range(5)
        ],
        [
            Message("v6", b"body", born_host=("fe80::1", 7), properties={"UNIQ_KEY": "u" * 32}),
            Message("v6", b"", born_host=("::1", 1)),
            Message("v6", b"z" * 800, born_host=("10.0.0.1", 1), properties={"é": "ü", "a": ""}),
        ],
        [Message("k", b"k", properties={"KEYS": " ".join(f"k{i}" for i in range(300))})],
    ]
    runs = [run_of(shape) for shape in shapes]
    runs.append(run_of(shapes[2], store=("::2", 9)))  # an IPv6 store host
    return runs


CORPUS = _corpus()


def _positions(buf: bytes) -> list[int]:
    out, pos = [], 0
    for rec in records_of(buf):
        out.append(pos)
        pos += len(rec)
    return out


def _hostile_int(rng: random.Random, near: list[int], length: int) -> int:
    pick = rng.random()
    if pick < 0.4 and near:
        return rng.choice(near) + rng.choice([0, 0, 0, 1, -1, 4, -4, 88, -88])
    if pick < 0.7:
        return rng.choice(HOSTILE_INTS)
    if pick < 0.85:
        return rng.choice([length, length - 1, length + 1, length - 48, length - 88])
    return rng.randrange(-(2**63), 2**63)


def mutate(rng: random.Random, data: bytes) -> bytes:
    """``data`` damaged one to four times: what torn writes, flipped bits, a bad object and a
    hostile writer leave."""
    buf = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        op = rng.randrange(9)
        starts = _positions_tolerant(buf)
        if op == 0 and buf:  # torn: cut anywhere
            del buf[rng.randrange(len(buf)) :]
        elif op == 1 and buf:  # bits flipped
            for _ in range(rng.randint(1, 8)):
                i = rng.randrange(len(buf))
                buf[i] ^= 1 << rng.randrange(8)
        elif op == 2 and starts:  # a length field of a record set to a hostile value
            pos = rng.choice(starts)
            try:
                at = layout(buf, pos)
            except struct.error:
                continue
            field = rng.choice(["total", "body", "topic", "props", "sysflag"])
            where = at[field]
            if where + 4 > len(buf):
                continue
            if field in ("topic", "props"):
                struct.pack_into(">H", buf, where, rng.choice(HOSTILE_U16))
            elif field == "sysflag":
                struct.pack_into(">I", buf, where, rng.randrange(2**32))
            else:
                struct.pack_into(">i", buf, where, rng.choice(HOSTILE_I32))
            if rng.random() < 0.6:  # sealed again: only the structural checks stand
                with contextlib.suppress(struct.error):
                    seal(buf, pos, at)
        elif op == 3 and len(buf) >= 8:  # a hostile integer anywhere
            width = rng.choice([2, 4, 8])
            i = rng.randrange(len(buf) - width + 1)
            value = rng.choice(HOSTILE_INTS) & ((1 << (8 * width)) - 1)
            buf[i : i + width] = value.to_bytes(width, "big")
        elif op == 4 and buf:  # a range zeroed (a hole in a sparse file)
            i = rng.randrange(len(buf))
            buf[i : i + rng.randint(1, 256)] = bytes(min(len(buf) - i, rng.randint(1, 256)))
        elif op == 5 and buf:  # a chunk copied elsewhere (a misdirected write)
            i, j = rng.randrange(len(buf)), rng.randrange(len(buf))
            n = rng.randint(1, 300)
            chunk = buf[i : i + n]
            buf[j : j + len(chunk)] = chunk
        elif op == 6 and buf:  # bytes inserted or deleted: every later offset moves
            i = rng.randrange(len(buf))
            if rng.random() < 0.5:
                del buf[i : i + rng.randint(1, 16)]
            else:
                buf[i:i] = rng.randbytes(rng.randint(1, 16))
        elif op == 7:  # garbage or padding appended
            buf += rng.choice([rng.randbytes(rng.randint(1, 64)), blank_record(8), bytes(100)])
        elif op == 8 and starts:  # a record resealed over whatever it now holds
            pos = rng.choice(starts)
            with contextlib.suppress(struct.error):
                seal(buf, pos, layout(buf, pos))
    return bytes(buf)


def _positions_tolerant(buf: bytes | bytearray) -> list[int]:
    """Where records start, as far as TOTALSIZE still leads from one to the next."""
    out, pos = [], 0
    while pos + 8 <= len(buf) and len(out) < 64:
        out.append(pos)
        (size,) = struct.unpack_from(">i", buf, pos)
        if size <= 0:
            break
        pos += size
    return out


def damaged(seed: int) -> tuple[random.Random, bytes, list[int], list[int]]:
    """A damaged run, and the positions and sizes its undamaged records had."""
    rng = random.Random(seed)
    data = rng.choice(CORPUS)
    positions = _positions(data)
    sizes = [len(r) for r in records_of(data)]
    if rng.random() < 0.3:
        data += blank_record(rng.choice([8, 16, 200]))
    return rng, mutate(rng, data), positions, sizes


def outcome(call: Callable[..., Any], *args: Any) -> Any:
    """What ``call`` answers: its result, or the class of the documented error it raises."""
    try:
        result = call(*args)
    except (RecordError, ValueError) as e:  # RecordError is a ValueError; the class tells
        return type(e)
    if isinstance(result, tuple) and len(result) == 3 and isinstance(result[1], int):
        end, status, cols = result  # dispatch_columns
        cols = cols if isinstance(cols, DispatchColumns) else DispatchColumns(*cols)
        names = ("offsets", "sizes", "queue_offsets", "tags", "store_timestamps", "key_hashes")
        return end, status, [np.asarray(getattr(cols, n)).tolist() for n in names], cols.queues
    return result


def dispatch_run(engine: Any, buf: bytes, pos: int, limit: int) -> Any:
    out = EncodedBatch()
    stamps: list[int] = []
    end = engine.read_dispatch_run(buf, pos, limit, 4096, out, stamps)
    lists = (out.offsets, out.sizes, out.queue_offsets, out.queues, out.tags, out.keys)
    return end, lists, out.uniq_keys, stamps


def scans_agree(seed: int) -> None:
    """The recovery scan, the dispatch scan and the dispatch columns (restart), from the start
    and from a position inside the run, up to the end, short of it and past it."""
    rng, buf, positions, _ = damaged(seed)
    n = len(buf)
    starts = [0, rng.choice(positions), rng.randrange(n + 2) if n else 0]
    for pos in starts:
        limit = rng.choice([n, n + rng.randint(1, 1000), rng.randrange(n + 1), 2**62])
        for check_crc in (True, False):
            assert NATIVE.scan_records(buf, pos, limit, 4096 + pos, check_crc) == (
                PY.scan_records(buf, pos, limit, 4096 + pos, check_crc)
            ), (seed, pos, limit)
            for validate in (True, False):
                max_records = rng.choice([1, 2, 1 << 20])
                args = (buf, pos, limit, 4096, validate, check_crc, max_records)
                assert outcome(NATIVE.dispatch_columns, *args) == outcome(
                    PY.dispatch_columns, *args
                ), (seed, args[1:])
        assert outcome(dispatch_run, NATIVE, buf, pos, limit) == outcome(
            dispatch_run, PY, buf, pos, limit
        ), (seed, pos, limit)


def readers_agree(seed: int) -> None:
    """The readers given offsets: decode (cold reads, the CommitLog reader), the Arrow decode
    (the lakehouse source), the span check (a cold read), the reply writer (the cold worker),
    the segment build and ``gather`` (the offloader); the offsets from a damaged table."""
    rng, buf, positions, sizes = damaged(seed)
    n = len(buf)
    count = rng.randint(1, 4)
    at = [_hostile_int(rng, positions, n) for _ in range(count)]
    if rng.random() < 0.5:  # mostly the true offsets, one of them hostile
        at = positions[:count] + at[:1]
    sz = [_hostile_int(rng, sizes, n) for _ in at]
    if rng.random() < 0.5:
        sz = (sizes * 8)[: len(at)]
    for check_crc in (True, False):
        assert outcome(NATIVE.decode_many, buf, at, check_crc) == outcome(
            PY.decode_many, buf, at, check_crc
        ), (seed, at)

    def arrow(decode: Any) -> Any:
        return outcome(lambda: decode(buf, np.asarray(at, np.int64), check_crc=True).to_pylist())

    assert arrow(columnar.decode_run) == arrow(columnar.decode_run_py), (seed, at)
    p, s = np.asarray(at, np.int64), np.asarray(sz, np.int64)
    assert NATIVE.check_span(buf, p, s, 7) == PY.check_span(buf, p, s, 7), (seed, at, sz)

    def replies(encode: Any) -> Any:
        return outcome(encode, buf, [int(x) for x in at])

    # The reply writer takes records a span check passed ("checked already": it does not look
    # at the magic code or the CRCs), so it is held to the reference where ``decode`` takes every
    # record whole; elsewhere it must only answer cleanly (``outcome`` lets nothing else by).
    written = replies(reply.encode_pull_replies)
    if isinstance(outcome(PY.decode_many, buf, at, True), list):
        assert written == replies(reply.encode_pull_replies_decoded), (seed, at)
    assert outcome(NATIVE.segment_tables, buf, 7) == outcome(PY.segment_tables, buf, 7), seed

    room = rng.choice([n, 0, 100, sum(max(0, x) for x in sz if x < 1 << 20)])
    start = rng.choice([0, 0, 1, room, room + 1, 2**62, 2**63 - 1])

    def gathered(engine: Any) -> Any:
        out = bytearray(room)
        return outcome(engine.gather, buf, p, s, out, start), bytes(out)

    assert gathered(NATIVE) == gathered(PY), (seed, at, sz, room, start)


def requests_agree(seed: int) -> None:
    """A SendMessageRequest cut, flipped or overwritten: the walker builds what protobuf and
    the reference build, or hands the request to them (``test_send_native.check``)."""
    rng = random.Random(seed)
    raw = bytearray(request(*(plain(i) for i in range(rng.randint(1, 4)))))
    for _ in range(rng.randint(1, 3)):
        op = rng.randrange(4)
        if op == 0 and raw:
            del raw[rng.randrange(len(raw)) :]
        elif op == 1 and raw:
            raw[rng.randrange(len(raw))] ^= 1 << rng.randrange(8)
        elif op == 2 and raw:  # a varint-sized run of 0xFF: lengths near 2**64
            i = rng.randrange(len(raw))
            raw[i : i + rng.randint(1, 10)] = b"\xff" * rng.randint(1, 10)
        elif op == 3:
            i = rng.randrange(len(raw) + 1)
            raw[i:i] = rng.randbytes(rng.randint(1, 8))
    check(bytes(raw), TOPICS[rng.choice(sorted(TOPICS))])


@settings(FAST, max_examples=EXAMPLES)
@given(SEEDS)
def test_damaged_runs_are_scanned_as_the_reference_scans_them(seed: int) -> None:
    scans_agree(seed)


@settings(FAST, max_examples=EXAMPLES)
@given(SEEDS)
def test_hostile_offsets_are_read_as_the_reference_reads_them(seed: int) -> None:
    readers_agree(seed)


@settings(FAST, max_examples=EXAMPLES)
@given(SEEDS)
def test_damaged_send_requests_get_the_references_answer(seed: int) -> None:
    requests_agree(seed)


@pytest.mark.slow
@settings(FAST, max_examples=EXAMPLES * 20)
@given(SEEDS)
def test_soak_every_native_reader_on_damaged_input(seed: int) -> None:
    """The three above, 20 times as many inputs: for the sanitizer build (docs/fuzzing.md)."""
    scans_agree(seed)
    readers_agree(seed)
    requests_agree(seed)


# -- offsets near 2**63: each once crashed the process (decision 765) ---------------------------
#
# A check written ``pos + 48 > n`` overflows int64 for a position within 48 of 2**63, wraps
# negative, and passes: the reader then reads at ``buf + pos``, nowhere near the buffer. The
# reference's Python ints do not overflow, so it answers its error. Each case runs in a child
# process, so that a crash is this test's failure rather than the end of the test run.

SPAN = "np.array([len(buf)], np.int64), 0"
HOSTILE_CALLS = {
    "check_span": f"NATIVE.check_span(buf, np.array([2**63 - 48], np.int64), {SPAN})",
    "check_span_py": f"PY.check_span(buf, np.array([2**63 - 8], np.int64), {SPAN})",
    "decode_many": "NATIVE.decode_many(buf, [2**63 - 60], True)",
    "decode_run": "columnar.decode_run(buf, np.array([0, 2**63 - 60], np.int64))",
    "reply": "reply.encode_pull_replies(buf, [2**63 - 60])",
    "gather_source": "NATIVE.gather(buf, np.array([2**63 - 100], np.int64), "
    "np.array([200], np.int64), bytearray(4096), 0)",
    "gather_output": "NATIVE.gather(buf, np.array([0], np.int64), np.array([200], np.int64), "
    "bytearray(4096), 2**63 - 100)",
}
EXPECTED = {
    "check_span": "(0, -1)",
    "check_span_py": "(0, -1)",
    "decode_many": "RecordError",
    "decode_run": "RecordError",
    "reply": "RecordError",
    "gather_source": "ValueError",
    "gather_output": "ValueError",
}


@pytest.mark.parametrize("name", sorted(HOSTILE_CALLS))
def test_an_offset_near_two_to_the_63_is_refused_not_followed(name: str) -> None:
    code = textwrap.dedent(
        f"""
        import sys
        import numpy as np
        sys.path.insert(0, "tests")
        from broker import reply
        from tiered import columnar
        from tiered.record import NATIVE_ENGINE as NATIVE, PYTHON_ENGINE as PY, Message
        from test_record_engine import run_of
        buf = run_of([Message("t", b"x" * 100, properties={{"KEYS": "k"}})])
        try:
            print({HOSTILE_CALLS[name]})
        except ValueError as e:  # RecordError is one: the class is the answer
            print(type(e).__name__)
        """
    )
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    child = subprocess.run(
        [sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120
    )
    assert child.returncode == 0, (child.returncode, child.stderr[-2000:])
    assert child.stdout.strip() == EXPECTED[name]


@pytest.mark.parametrize("kind", [-1, -2, -3])
def test_a_refused_record_never_matches_a_negative_size_from_the_table(kind: int) -> None:
    """``check_span`` compares each record's checked size with its table entry's. The check
    answers -1 (not a record), -2 (body CRC) or -3 (record CRC) for a refused one, and a damaged
    table holding that same number as the size made the two match: the span passed (decision
    765; the fuzz suite found it with a size of -1)."""
    buf = bytearray(run_of([Message("t", b"body", properties={"KEYS": "k"})]))
    if kind == -1:
        struct.pack_into(">i", buf, 4, 0)  # the magic code
    elif kind == -2:
        buf[layout(buf)["body"] + 4] ^= 1  # a body byte: BODYCRC fails first
    else:
        buf[layout(buf)["topic"] + 2] ^= 1  # a topic byte: only the record CRC covers it
    data = bytes(buf)
    p, s = np.array([0], np.int64), np.array([kind], np.int64)
    assert PY.check_span(data, p, s, 7) == (0, kind)
    assert NATIVE.check_span(data, p, s, 7) == (0, kind)
