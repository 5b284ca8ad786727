"""Columnar decode: a run of CommitLog records straight into Arrow arrays.

``tiered/record.py`` decodes one record into one ``StoredMessage``: right for a consumer, too
slow for the export, which turns whole segment objects into Arrow (DESIGN.md, "The record
engine"). ``decode_run`` reads the same byte layout for every record of a run at once with numpy:
each fixed field is one gather over the record positions, and the variable parts (body, topic,
properties) are copied out as whole columns, with offsets computed from the length fields, so no
Python object is made per record for them. Properties become a ``map<string,string>`` column by
locating the ``\\x01`` and ``\\x02`` separators in the concatenated property bytes.

The result equals ``record.decode`` field for field, and a record ``decode`` refuses is refused
with ``decode``'s own error: on any anomaly the run is handed to ``decode`` to raise it
(``tests/test_columnar.py`` checks both on random and adversarial records).

==========================  ===================  =============================================
 column                      type                 ``StoredMessage`` field
==========================  ===================  =============================================
 size                        int32                size (TOTALSIZE)
 body_crc                    int64                body_crc
 queue_id                    int32                queue_id
 flag                        int32                flag
 queue_offset                int64                queue_offset
 commitlog_offset            int64                commitlog_offset (PHYSICALOFFSET)
 sys_flag                    int32                sys_flag
 born_timestamp              int64                born_timestamp (ms)
 born_host                   string               born_host as ``ip:port`` (``[ip]:port`` v6)
 store_timestamp             int64                store_timestamp (ms)
 store_host                  string               store_host, as born_host
 reconsume_times             int32                reconsume_times
 prepared_transaction_offset int64                prepared_transaction_offset
 body                        binary               body
 topic                       string               topic
 properties                  map<string,string>   properties (first position, last value wins)
==========================  ===================  =============================================
"""

from __future__ import annotations

import socket
from collections.abc import Sequence
from typing import Any

import numpy as np
import pyarrow as pa
from google_crc32c import value as crc32c

from tiered.record import (
    CRC_TRAILER_SIZE,
    ENGINE_NAME,
    MAGIC_CODE_V2,
    NATIVE_ENGINE,
    SYSFLAG_BORNHOST_V6,
    SYSFLAG_KNOWN,
    SYSFLAG_RECORD_CRC,
    SYSFLAG_STOREHOST_V6,
    V4_HEAD_SIZE,
    Buffer,
    RecordError,
    StoredMessage,
    decode,
    record_crc_flag_lost,
    record_crc_matches,
)

RECORD_SCHEMA = pa.schema(
    [
        pa.field("size", pa.int32(), nullable=False),
        pa.field("body_crc", pa.int64(), nullable=False),
        pa.field("queue_id", pa.int32(), nullable=False),
        pa.field("flag", pa.int32(), nullable=False),
        pa.field("queue_offset", pa.int64(), nullable=False),
        pa.field("commitlog_offset", pa.int64(), nullable=False),
        pa.field("sys_flag", pa.int32(), nullable=False),
        pa.field("born_timestamp", pa.int64(), nullable=False),
        pa.field("born_host", pa.string(), nullable=False),
        pa.field("store_timestamp", pa.int64(), nullable=False),
        pa.field("store_host", pa.string(), nullable=False),
        pa.field("reconsume_times", pa.int32(), nullable=False),
        pa.field("prepared_transaction_offset", pa.int64(), nullable=False),
        pa.field("body", pa.binary(), nullable=False),
        pa.field("topic", pa.string(), nullable=False),
        pa.field("properties", pa.map_(pa.string(), pa.string()), nullable=False),
    ]
)
_MAX_COLUMN_BYTES = (1 << 31) - 1  # int32 offsets of binary/string columns
_NAME_VALUE = 1  # \x01
_PAIR_END = 2  # \x02


class _Anomaly(Exception):
    """Something ``decode`` may refuse: let it say what."""


def host_string(address: str, port: int) -> str:
    """A host as the table shows it: ``ip:port``, or ``[ip]:port`` for IPv6."""
    return f"[{address}]:{port}" if ":" in address else f"{address}:{port}"


def decode_run(
    buf: Buffer, positions: Sequence[int] | np.ndarray, *, check_crc: bool = True
) -> pa.RecordBatch:
    """Decode the records starting at ``positions`` in ``buf`` into one record batch
    (``RECORD_SCHEMA``), in the order given: with the native record engine when it is built
    (columns filled in C with the GIL released), else with ``decode_run_py``.

    Raises what ``record.decode`` raises for the first record it refuses: ``RecordError``
    (truncated, malformed, not UTF-8) or ``CorruptRecordError`` (body or record CRC, with
    ``check_crc``).
    """
    at = np.asarray(positions, dtype=np.int64)
    if ENGINE_NAME != "native" or len(at) == 0:
        return decode_run_py(buf, at, check_crc=check_crc)
    try:
        result: pa.RecordBatch = NATIVE_ENGINE.decode_run(buf, at, check_crc)
    except NATIVE_ENGINE.Anomaly as anomaly:
        return _refuse(buf, at, check_crc, anomaly)
    return result


def decode_run_py(
    buf: Buffer, positions: Sequence[int] | np.ndarray, *, check_crc: bool = True
) -> pa.RecordBatch:
    """The reference implementation of ``decode_run``, with numpy."""
    at = np.asarray(positions, dtype=np.int64)
    data = np.frombuffer(buf, dtype=np.uint8)
    try:
        return _decode(data, at, check_crc)
    except _Anomaly as anomaly:
        return _refuse(buf, at, check_crc, anomaly)


def _refuse(buf: Buffer, at: np.ndarray, check_crc: bool, anomaly: Exception) -> pa.RecordBatch:
    """Raise ``decode``'s own error for the first record of ``at`` it refuses. A run that
    ``decode`` takes whole (property bytes that are not UTF-8, which it reads as U+FFFD and the
    columns refuse: decision 660) is built from its decoded records instead."""
    messages = [decode(buf, pos, check_crc=check_crc) for pos in at.tolist()]
    if not messages:
        raise RecordError(f"records at {at[:3].tolist()}…: {anomaly}") from None
    return decoded_batch(messages)


def decoded_batch(messages: Sequence[StoredMessage]) -> pa.RecordBatch:
    """``messages`` as a ``RECORD_SCHEMA`` batch, one Python object per field: the slow path."""
    columns: dict[str, list[Any]] = {name: [] for name in RECORD_SCHEMA.names}
    for m in messages:
        for name in RECORD_SCHEMA.names:
            value = getattr(m, name)
            if name in ("born_host", "store_host"):
                value = host_string(value[0], value[1])
            elif name == "properties":
                value = list(value.items())
            columns[name].append(value)
    return pa.RecordBatch.from_pydict(columns, schema=RECORD_SCHEMA)


def _decode(data: np.ndarray, at: np.ndarray, check_crc: bool) -> pa.RecordBatch:
    n = len(at)
    if n == 0:
        return pa.RecordBatch.from_pylist([], schema=RECORD_SCHEMA)
    length = len(data)
    # ``at > length - n``, not ``at + n > length``: int64 wraps near 2**63 (decision 765).
    if (at < 0).any() or (at > length - V4_HEAD_SIZE).any():
        raise _Anomaly("a record runs past the data")

    def field(offset: np.ndarray, dtype: str) -> np.ndarray:
        width = np.dtype(dtype).itemsize
        if (offset < 0).any() or (offset > length - width).any():
            raise _Anomaly("a field runs past the data")
        raw = data[offset[:, None] + np.arange(width)]
        return raw.view(dtype).ravel().astype(np.dtype(dtype).newbyteorder("="))

    total = field(at, ">i4").astype(np.int64)
    if (field(at + 4, ">i4") != MAGIC_CODE_V2).any():
        raise _Anomaly("illegal magic code")
    if (total < V4_HEAD_SIZE + 4).any() or (at + total > length).any():
        raise _Anomaly("total size runs past the data")
    end = at + total
    sys_flag = field(at + 36, ">i4")
    if (sys_flag & ~SYSFLAG_KNOWN).any():
        raise _Anomaly("unknown SYSFLAG bits")
    born_v6 = (sys_flag & SYSFLAG_BORNHOST_V6) != 0
    store_v6 = (sys_flag & SYSFLAG_STOREHOST_V6) != 0
    born_at = at + 48
    store_ts_at = born_at + np.where(born_v6, 20, 8)
    store_host_at = store_ts_at + 8
    reconsume_at = store_host_at + np.where(store_v6, 20, 8)
    body_len_at = reconsume_at + 12
    body_at = body_len_at + 4
    # Every fixed field must lie inside its own record before the variable parts are read.
    if (body_at > end).any():
        raise _Anomaly("header runs past the record")
    body_len = field(body_len_at, ">i4").astype(np.int64)
    topic_len_at = body_at + body_len
    if (body_len < 0).any() or (topic_len_at + 2 > end).any():
        raise _Anomaly("body runs past the record")
    topic_len = field(topic_len_at, ">u2").astype(np.int64)
    props_len_at = topic_len_at + 2 + topic_len
    if (props_len_at + 2 > end).any():
        raise _Anomaly("topic runs past the record")
    props_len = field(props_len_at, ">u2").astype(np.int64)
    if (props_len_at + 2 + props_len != end).any():
        raise _Anomaly("fields do not add up to the total size")
    # The record CRC pair ends the properties of a record that has one; no column holds it.
    with_crc = (sys_flag & SYSFLAG_RECORD_CRC) != 0
    props_len = np.where(with_crc, props_len - CRC_TRAILER_SIZE, props_len)

    body = _binary(data, body_at, body_len)
    crc = field(at + 8, ">u4").astype(np.int64)
    if check_crc:
        bodies = body.buffers()[2]
        view = bodies.to_pybytes() if bodies is not None else b""
        ends = np.cumsum(body_len).tolist()
        starts = [0, *ends[:-1]]
        computed = [crc32c(view[s:e]) for s, e in zip(starts, ends, strict=True)]
        if computed != crc.tolist():
            raise _Anomaly("body CRC mismatch")
    if (props_len < 0).any():
        raise _Anomaly("properties too short for the record CRC")
    if check_crc:
        for pos, size in zip(at[with_crc].tolist(), total[with_crc].tolist(), strict=True):
            if not record_crc_matches(data.data, pos, size):
                raise _Anomaly("record CRC mismatch")
        for pos, size in zip(at[~with_crc].tolist(), total[~with_crc].tolist(), strict=True):
            if record_crc_flag_lost(data.data, pos, size):
                raise _Anomaly("record CRC flag cleared")
    try:
        topic = _binary(data, topic_len_at + 2, topic_len).cast(pa.string())
        properties = _properties(data, props_len_at + 2, props_len)
    except pa.ArrowInvalid as e:  # invalid UTF-8
        raise _Anomaly(str(e)) from None
    return pa.RecordBatch.from_arrays(
        [
            pa.array(total.astype(np.int32)),
            pa.array(crc),
            pa.array(field(at + 12, ">i4")),
            pa.array(field(at + 16, ">i4")),
            pa.array(field(at + 20, ">i8")),
            pa.array(field(at + 28, ">i8")),
            pa.array(sys_flag),
            pa.array(field(at + 40, ">i8")),
            _hosts(data, born_at, born_v6),
            pa.array(field(store_ts_at, ">i8")),
            _hosts(data, store_host_at, store_v6),
            pa.array(field(reconsume_at, ">i4")),
            pa.array(field(reconsume_at + 4, ">i8")),
            body,
            topic,
            properties,
        ],
        schema=RECORD_SCHEMA,
    )


def _gather(data: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """The bytes of every range ``[start, start + length)``, concatenated in order."""
    total = int(lengths.sum())
    if total == 0:
        return np.empty(0, np.uint8)
    ends = starts + lengths
    dense = total * 8 >= len(data)  # else an index of the wanted bytes is cheaper than a mask
    if dense and (len(starts) < 2 or (starts[1:] >= ends[:-1]).all()):
        # Ascending, disjoint ranges (records in object order): one mask over the buffer,
        # alternating runs of bytes skipped and bytes kept.
        skips = starts - np.concatenate([[0], ends[:-1]])
        runs = np.empty(2 * len(starts) + 1, np.int64)
        runs[0:-1:2], runs[1::2], runs[-1] = skips, lengths, len(data) - ends[-1]
        keep = np.zeros(len(runs), bool)
        keep[1::2] = True
        kept: np.ndarray = data[np.repeat(keep, runs)]
        return kept
    firsts = np.cumsum(lengths) - lengths
    index = np.repeat(starts - firsts, lengths) + np.arange(total)
    return data[index]


def _binary(data: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> pa.Array:
    values = _gather(data, starts, lengths)
    if len(values) > _MAX_COLUMN_BYTES:
        raise ValueError("a run of more than 2 GiB of one column: decode it in smaller runs")
    offsets = np.zeros(len(starts) + 1, np.int32)
    np.cumsum(lengths, out=offsets[1:])
    return pa.Array.from_buffers(
        pa.binary(), len(starts), [None, pa.py_buffer(offsets), pa.py_buffer(values)]
    )


def _hosts(data: np.ndarray, at: np.ndarray, v6: np.ndarray) -> pa.Array:
    """``ip:port`` strings, formatted once per distinct host (a run has a handful)."""
    width = np.where(v6, 16, 4)
    raw = np.zeros((len(at), 21), np.uint8)  # 16 address bytes, 4 port bytes, v6 flag
    ip4 = data[at[:, None] + np.arange(4)]
    raw[:, :4] = ip4
    if v6.any():
        rows = np.flatnonzero(v6)
        raw[rows, :16] = data[at[rows, None] + np.arange(16)]
    port_at = at + width
    raw[:, 16:20] = data[port_at[:, None] + np.arange(4)]
    raw[:, 20] = v6
    keys = np.ascontiguousarray(raw).view(np.dtype((np.void, 21))).ravel()
    distinct, inverse = np.unique(keys, return_inverse=True)
    names = []
    for key in distinct:
        b = bytes(key)
        is_v6 = b[20] == 1
        address = socket.inet_ntop(
            socket.AF_INET6 if is_v6 else socket.AF_INET, b[:16] if is_v6 else b[:4]
        )
        names.append(host_string(address, int.from_bytes(b[16:20], "big", signed=True)))
    return pa.array(names, pa.string()).take(pa.array(inverse.ravel().astype(np.int32)))


def _properties(data: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> pa.Array:
    """``name\\x01value\\x02…`` of each record as a map, with ``decode_properties``'s rules:
    empty pairs are skipped, a pair without ``\\x01`` is a name with an empty value, a value
    runs to the pair's end (``\\x01`` included), and a repeated name keeps its first position
    and its last value."""
    n = len(starts)
    if not lengths.any():
        return pa.MapArray.from_arrays(
            pa.array(np.zeros(n + 1, np.int32)),
            pa.array([], pa.string()),
            pa.array([], pa.string()),
        )
    raw = _binary(data, starts, lengths)
    raw.cast(pa.string())  # the whole text must be UTF-8, as decode() demands
    buffer = raw.buffers()[2]
    text = np.frombuffer(buffer, np.uint8) if buffer is not None else np.empty(0, np.uint8)
    text = text[: int(lengths.sum())]
    record_at = np.zeros(n + 1, np.int64)
    np.cumsum(lengths, out=record_at[1:])
    # A pair ends at each \x02, and at its record's end when the record does not end in one.
    seps = np.flatnonzero(text == _PAIR_END)
    sep_record = np.searchsorted(record_at, seps, "right") - 1
    nonempty = lengths > 0
    last = record_at[1:] - 1
    open_end = nonempty & (text[np.clip(last, 0, None)] != _PAIR_END)
    tail_records = np.flatnonzero(open_end)
    ends = np.concatenate([seps, record_at[1:][tail_records]])
    records = np.concatenate([sep_record, tail_records])
    order = np.lexsort((ends, records))
    ends, records = ends[order], records[order]
    pair_starts = record_at[:-1][records].copy()
    same = np.zeros(len(ends), bool)
    same[1:] = records[1:] == records[:-1]
    pair_starts[same] = ends[:-1][same[1:]] + 1
    keep = ends > pair_starts
    pair_starts, ends, records = pair_starts[keep], ends[keep], records[keep]
    # The name ends at the pair's first \x01, if it has one.
    marks = np.flatnonzero(text == _NAME_VALUE)
    first = np.searchsorted(marks, pair_starts)
    mark = marks[np.clip(first, 0, max(len(marks) - 1, 0))] if len(marks) else ends
    has_mark = (first < len(marks)) & (mark < ends) if len(marks) else np.zeros(len(ends), bool)
    name_end = np.where(has_mark, mark, ends)
    value_start = np.where(has_mark, name_end + 1, ends)
    names = _binary(text, pair_starts, name_end - pair_starts)
    value_starts, value_ends = value_start, ends
    kept = _dedupe(names, records)
    if kept is not None:
        keep_rows, value_from = kept
        value_starts, value_ends = value_start[value_from], ends[value_from]
        names = names.take(pa.array(keep_rows))
        records = records[keep_rows]
    values = _binary(text, value_starts, value_ends - value_starts)
    counts = np.bincount(records, minlength=n)
    offsets = np.zeros(n + 1, np.int32)
    np.cumsum(counts, out=offsets[1:])
    return pa.MapArray.from_arrays(
        pa.array(offsets), names.cast(pa.string()), values.cast(pa.string())
    )


def _dedupe(names: pa.Array, records: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """For a repeated name within a record: (pairs to keep, pair whose value each keeps), or
    None when no record repeats a name (the usual case)."""
    if len(records) < 2:
        return None
    codes = np.asarray(names.dictionary_encode().indices.to_numpy(zero_copy_only=False))
    key = records.astype(np.int64) * (int(codes.max()) + 1) + codes
    distinct, first, inverse = np.unique(key, return_index=True, return_inverse=True)
    if len(distinct) == len(key):
        return None
    last = np.zeros(len(distinct), np.int64)
    np.maximum.at(last, inverse.ravel(), np.arange(len(key)))  # the last pair's value wins
    keep = np.sort(first)
    group = inverse[keep]
    return keep, last[group]
