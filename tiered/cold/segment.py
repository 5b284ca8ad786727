"""Segment objects in the cold tier: reading one with ranged GETs, verifying one, and rebuilding
its manifest entry from its footer.

The object layout (records, offset table, time table, key index, footer) and its build are
defined beside the record codec, in ``tiered/formats.py``: the offloader builds objects with the
record engine's segment build, and every reader (this module, the lakehouse source) reads them
with the same definitions. ``SegmentInfo``, ``SegmentError``, ``build`` and ``FOOTER_SIZE`` are
imported here from there, for the callers that know them by this module.
"""

from __future__ import annotations

import bisect
import pickle
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, SupportsIndex

import numpy as np
from google_crc32c import value as crc32c

from tiered.cold.storage import ObjectNotFoundError, ObjectStore
from tiered.formats import (
    CQ_DTYPE,
    CQ_ENTRY_SIZE,
    FOOTER_SIZE,
    KEY_DTYPE,
    TIME_DTYPE,
    SegmentError,
    SegmentInfo,
    build,
    key_hash,
)
from tiered.record import Buffer, StoredMessage, check_span, crc32c_of, decode, decode_many

__all__ = ["FOOTER_SIZE", "SegmentError", "SegmentInfo", "SegmentReader", "build"]


def read_footer(store: ObjectStore, key: str) -> SegmentInfo:
    """Rebuild a segment's manifest entry from the object alone (recovery, audits)."""
    size = store.size(key)
    if size is None:
        raise SegmentError(f"{key}: object is missing")
    if size < FOOTER_SIZE:
        raise SegmentError(f"{key}: {size} bytes is too small to be a segment")
    return SegmentInfo.from_footer(key, size, store.get_range(key, size - FOOTER_SIZE, FOOTER_SIZE))


def verify(store: ObjectStore, info: SegmentInfo) -> None:
    """Check the object against its manifest entry: size, footer and the CRC of its body.
    Raises ``SegmentError``. Reads the whole object: for upload verification and scrubbing."""
    try:
        data = store.get(info.key)
    except ObjectNotFoundError:
        raise SegmentError(f"{info.key}: object is missing") from None
    if len(data) != info.size:
        raise SegmentError(f"{info.key}: {len(data)} bytes, the manifest says {info.size}")
    if crc32c(data[: info.size - FOOTER_SIZE]) != info.crc:
        raise SegmentError(f"{info.key}: content does not match its CRC")


# The replies of a span's records, written by the cold worker (``ColdFetcher``'s
# ``reply_encoder``): their bytes back to back, where each ends, and each body's size.
Replies = tuple[bytes, list[int], list[int]]
ReplyEncoder = Callable[[Buffer, list[int]], Replies]


@dataclass(slots=True, frozen=True)
class RecordSpan:
    """Consecutive whole records of one segment, checked but not decoded: what the cold fetcher
    caches, so a read decodes only the messages it returns. With ``replies``, also each record
    as its reader's protocol sends it (written by the cold worker), so a read that answers with
    those decodes nothing at all."""

    base_offset: int  # queue offset of the first record
    data: bytes
    positions: list[int]  # where each record starts in ``data``
    replies: Replies | None = None
    # A replies-only span (``read_spans(records=False)``, decision 705) holds no records:
    # ``data`` is empty and this is the length they had. None: the records are ``data``.
    dropped: int | None = None

    def __len__(self) -> int:
        return len(self.positions)

    @property
    def size(self) -> int:
        """The bytes of the span's records (held or dropped)."""
        return len(self.data) if self.dropped is None else self.dropped

    @property
    def has_records(self) -> bool:
        """Whether the span holds its records (a read that decodes needs them)."""
        return self.dropped is None

    @property
    def nbytes(self) -> int:
        """What the span holds in memory, replies included (the cache's measure)."""
        return len(self.data) + (len(self.replies[0]) if self.replies is not None else 0)

    def __reduce_ex__(self, protocol: SupportsIndex) -> tuple[Any, ...]:
        # Protocol 5 (the cold worker's replies) carries the records out of band, uncopied.
        if int(protocol) < 5:
            return (_record_span, (self.base_offset, *self.owned()._fields()))
        replies = self.replies
        if replies is not None:
            replies = (pickle.PickleBuffer(replies[0]), replies[1], replies[2])  # type: ignore[assignment]
        data = pickle.PickleBuffer(self.data) if self.dropped is None else b""
        return (_record_span, (self.base_offset, data, self.positions, replies, self.dropped))

    def _fields(self) -> tuple[Any, ...]:
        return (self.data, self.positions, self.replies, self.dropped)

    def owned(self) -> RecordSpan:
        """This span with its own bytes objects. ``read_spans`` cuts its spans as views of the
        buffers it read and wrote, which the cold worker sends out of band as they are and its
        reader receives as bytes; a span read in this process (``LocalRunner``) is copied here
        once, since a reply must be a bytes object (gRPC sends nothing else) and the cache must
        not pin a whole read-ahead run for one of its batches."""
        if isinstance(self.data, bytes) and (
            self.replies is None or isinstance(self.replies[0], bytes)
        ):
            return self
        replies = self.replies
        if replies is not None:
            replies = (bytes(replies[0]), replies[1], replies[2])
        return RecordSpan(self.base_offset, bytes(self.data), self.positions, replies, self.dropped)

    def reply_run(self, start: int, stop: int) -> tuple[list[bytes], int]:
        """The replies of records ``start`` up to ``stop``, one bytes object each, and their
        bodies' bytes. Only for a span fetched with a reply encoder."""
        assert self.replies is not None, "a span fetched without a reply encoder"
        buffer, ends, bodies = self.replies
        if stop <= start:
            return [], 0
        begin = ends[start - 1] if start else 0
        out = []
        for end in ends[start:stop]:
            out.append(buffer[begin:end])
            begin = end
        return out, sum(bodies[start:stop])

    def _records(self) -> bytes:
        if self.dropped is not None:
            raise ValueError("a replies-only span holds no records to decode")
        return self.data

    def message(self, i: int) -> StoredMessage:
        """Record ``i`` (queue offset ``base_offset + i``), decoded. Its body CRC was checked
        when the span was read."""
        return decode(self._records(), self.positions[i], check_crc=False)

    def take(self, start: int, max_count: int, max_bytes: int) -> tuple[int, int]:
        """How many records from ``start`` a read of at most ``max_count`` messages and
        ``max_bytes`` returns (the record that reaches ``max_bytes`` is the last one, as a read
        always returns at least one), and their bytes: from the positions, decoding nothing.
        Records of a span lie back to back (the segment build joins them; ``read_span``
        checked each where its entry says, of its size)."""
        positions = self.positions
        if max_count <= 0 or max_bytes <= 0 or start >= len(positions):
            return 0, 0
        by_bytes = bisect.bisect_left(positions, positions[start] + max_bytes, start + 1) - start
        count = min(max_count, by_bytes, len(positions) - start)
        stop = start + count
        end = positions[stop] if stop < len(positions) else self.size
        return count, end - positions[start]

    def messages(self, start: int, stop: int) -> list[StoredMessage]:
        """Records ``start`` up to ``stop``, decoded in one call of the record engine."""
        return decode_many(self._records(), self.positions[start:stop], check_crc=False)


def _as_bytes(data: Buffer) -> bytes:
    """An out-of-band buffer arrives as a view of the bytes object the reader received, which is
    taken as it is."""
    if isinstance(data, memoryview):
        data = (
            data.obj
            if isinstance(data.obj, bytes) and data.nbytes == len(data.obj)
            else data.tobytes()
        )
    return bytes(data) if not isinstance(data, bytes) else data


def _record_span(
    base_offset: int,
    data: Buffer,
    positions: list[int],
    replies: tuple[Buffer, list[int], list[int]] | None = None,
    dropped: int | None = None,
) -> RecordSpan:
    """A ``RecordSpan`` unpickled."""
    out = None if replies is None else (_as_bytes(replies[0]), replies[1], replies[2])
    return RecordSpan(base_offset, _as_bytes(data), positions, out, dropped)


def read_offset_table(store: ObjectStore, info: SegmentInfo) -> bytes:
    """The segment's whole offset table (``CQ_DTYPE`` entries, one request): a cold job."""
    return SegmentReader(store, info)._range(info.offsets_at, info.count * CQ_ENTRY_SIZE)


def check_offset_table(info: SegmentInfo, table: np.ndarray) -> None:
    """Raise ``SegmentError`` unless ``table`` lays the segment's records out as a build does:
    one after the other from byte 0 up to the tables. A ranged GET carries no checksum, so an
    answer with wrong bytes is caught here, before the table is cached, rather than fail every
    later read of the segment (or point one at other bytes)."""
    starts = table["offset"].astype(np.int64)
    ends = starts + table["size"]
    if (
        len(table) != info.count
        or (len(table) and (starts[0] != 0 or ends[-1] != info.offsets_at))
        or not np.array_equal(starts[1:], ends[:-1])
        or bool((table["size"] <= 0).any())
    ):
        raise SegmentError(f"{info.key}: its offset table does not describe its records")


def read_span(store: ObjectStore, info: SegmentInfo, first: int, entries: bytes) -> RecordSpan:
    """The records ``first, first + 1, ...`` of the segment whose offset-table entries are
    ``entries``, with one ranged GET, each checked (structure, body CRC, queue offset): a cold
    job. Raises ``SegmentError`` for a record that is not what its entry says."""
    table = np.frombuffer(entries, dtype=CQ_DTYPE)
    begin = int(table["offset"][0])
    end = int(table["offset"][-1]) + int(table["size"][-1])
    return _checked_span(info, first, SegmentReader(store, info)._range(begin, end - begin), table)


def _checked_span(info: SegmentInfo, first: int, data: Buffer, table: np.ndarray) -> RecordSpan:
    """The records ``data`` holds, those ``table``'s entries (record ``first`` on) name, each
    checked where its entry says; ``data`` starts at the first entry's record."""
    starts = table["offset"].astype(np.int64)
    sizes = table["size"].astype(np.int64)
    begin = int(starts[0])
    relative = starts - begin
    bad, why = check_span(data, relative, sizes, info.base_offset + first)
    if bad >= 0:
        at = begin + int(relative[bad])
        problem = {-2: "body CRC mismatch", -3: "record CRC mismatch"}.get(
            why, "not the record its entry names"
        )
        raise SegmentError(f"{info.key}: record at {at}: {problem}")
    return RecordSpan(info.base_offset + first, data, relative.tolist())  # type: ignore[arg-type]


def read_segment(
    store: ObjectStore,
    info: SegmentInfo,
    batch: int,
    encoder: ReplyEncoder | None = None,
    records: bool = True,
) -> tuple[bytes, list[RecordSpan]]:
    """The whole segment with one GET (a sequential replay's read, decision 1220): its offset
    table, and all its records cut into spans of ``batch`` records as ``read_spans`` cuts them
    (``encoder`` and ``records`` as there): a cold job. Everything a ranged read checks is
    checked (the table describes the records, each record's structure, CRCs and queue offset),
    and what only the whole object allows: its footer is the manifest's entry, and the CRC of
    everything before the footer is the entry's. Raises ``SegmentError`` as the ranged reads
    do (missing, short, a damaged table or record), the record's own error first."""
    if not records and encoder is None:
        raise ValueError("a span without its records needs a reply encoder")
    data = SegmentReader(store, info)._range(0, info.size)
    if info.size < FOOTER_SIZE + info.offsets_at + info.count * CQ_ENTRY_SIZE:
        raise SegmentError(f"{info.key}: its manifest entry does not describe a segment")
    table_bytes = data[info.offsets_at : info.offsets_at + info.count * CQ_ENTRY_SIZE]
    table = np.frombuffer(table_bytes, dtype=CQ_DTYPE)
    check_offset_table(info, table)
    whole = _checked_span(info, 0, memoryview(data)[: info.offsets_at], table)
    if SegmentInfo.from_footer(info.key, info.size, data[-FOOTER_SIZE:]) != info:
        raise SegmentError(f"{info.key}: its footer is not the manifest's entry for it")
    if crc32c_of(memoryview(data)[: info.size - FOOTER_SIZE]) != info.crc:
        raise SegmentError(f"{info.key}: content does not match its CRC")
    counts = [batch] * -(-info.count // batch)
    return table_bytes, _cut(whole, counts, encoder, records)


def read_spans(
    store: ObjectStore,
    info: SegmentInfo,
    first: int,
    entries: bytes,
    counts: list[int],
    encoder: ReplyEncoder | None = None,
    records: bool = True,
) -> list[RecordSpan]:
    """``read_span`` of several consecutive batches with one ranged GET (a sequential reader's
    read-ahead: a few large requests cost the store far less than many small ones), cut into
    spans of ``counts`` records each: a cold job. With ``encoder``, each span also carries its
    records' replies, written here, in the worker. ``records=False`` (with ``encoder``): the
    spans carry only the replies and the records' positions, for a reader that sends replies
    (decision 705); the records are checked here all the same."""
    if not records and encoder is None:
        raise ValueError("a span without its records needs a reply encoder")
    return _cut(read_span(store, info, first, entries), counts, encoder, records)


def _cut(
    whole: RecordSpan, counts: list[int], encoder: ReplyEncoder | None, records: bool
) -> list[RecordSpan]:
    """``whole``, checked, cut into spans of ``counts`` records each (``read_spans``)."""
    replies = encoder(whole.data, whole.positions) if encoder is not None else None
    if replies is not None:
        # The spans below are views of these two buffers: cut without a copy (decision 550).
        replies = (memoryview(replies[0]), replies[1], replies[2])  # type: ignore[assignment]
    data = memoryview(whole.data)
    out, at = [], 0
    for count in counts:
        stop = min(at + count, len(whole))
        if stop <= at:
            break
        begin = whole.positions[at]
        end = whole.positions[stop] if stop < len(whole) else len(whole.data)
        positions = [p - begin for p in whole.positions[at:stop]]
        out.append(
            RecordSpan(
                whole.base_offset + at,
                data[begin:end] if records else b"",  # type: ignore[arg-type]
                positions,
                _cut_replies(replies, at, stop),
                None if records else end - begin,
            )
        )
        at = stop
    return out


def _cut_replies(replies: Replies | None, start: int, stop: int) -> Replies | None:
    """The replies of records ``start`` up to ``stop`` of a span's ``replies``."""
    if replies is None:
        return None
    buffer, ends, bodies = replies
    begin = ends[start - 1] if start else 0
    return buffer[begin : ends[stop - 1]], [e - begin for e in ends[start:stop]], bodies[start:stop]


class SegmentReader:
    """Reads one segment with ranged GETs; every method costs a fixed number of requests."""

    def __init__(self, store: ObjectStore, info: SegmentInfo) -> None:
        self.store = store
        self.info = info

    def entries(self, queue_offset: int, max_count: int) -> np.ndarray:
        """ConsumeQueue entries from ``queue_offset`` (one request)."""
        i = queue_offset - self.info.base_offset
        if not 0 <= i < self.info.count:
            raise SegmentError(f"{self.info.key}: queue offset {queue_offset} is not in it")
        n = min(max_count, self.info.count - i)
        raw = self._range(self.info.offsets_at + i * CQ_ENTRY_SIZE, n * CQ_ENTRY_SIZE)
        return np.frombuffer(raw, dtype=CQ_DTYPE)

    def read(
        self, queue_offset: int, max_count: int, max_bytes: int = 4 << 20
    ) -> list[StoredMessage]:
        """Messages from ``queue_offset``: two requests (entries, then one span of records)."""
        entries = self.entries(queue_offset, max_count)
        ends = entries["offset"] + entries["size"]
        keep = max(1, int(np.searchsorted(ends - entries["offset"][0], max_bytes, "right")))
        entries = entries[:keep]
        start = int(entries["offset"][0])
        span = self._range(start, int(ends[keep - 1]) - start)
        positions = entries["offset"].tolist()
        out = decode_many(span, [pos - start for pos in positions], check_crc=True)
        for pos, size, msg in zip(positions, entries["size"].tolist(), out, strict=True):
            if msg.size != size:
                raise SegmentError(f"{self.info.key}: record at {pos} is not where its entry says")
        return out

    def offset_for_timestamp(self, timestamp_ms: int) -> int:
        """The first queue offset stored at or after ``timestamp_ms`` (one request)."""
        raw = self._range(self.info.times_at, 8 * self.info.count)
        times = np.frombuffer(raw, dtype=TIME_DTYPE)
        return self.info.base_offset + int(np.searchsorted(times, timestamp_ms, "left"))

    def offsets_for_key(self, topic: str, key: str) -> list[int]:
        """Queue offsets whose key index entry matches (candidates: check the records)."""
        if self.info.key_count == 0:
            return []
        raw = self._range(self.info.keys_at, 8 * self.info.key_count)
        index = np.frombuffer(raw, dtype=KEY_DTYPE)
        h = key_hash(topic, key)
        lo, hi = np.searchsorted(index["hash"], [h, h + 1])
        return sorted({self.info.base_offset + int(r) for r in index["record"][lo:hi]})

    def _range(self, start: int, length: int) -> bytes:
        """``length`` bytes of the object from ``start`` (one request); ``SegmentError`` when
        the object is missing or short."""
        try:
            data = self.store.get_range(self.info.key, start, length)
        except ObjectNotFoundError:
            raise SegmentError(
                f"{self.info.key}: object is missing from the tier (run "
                "`tmq verify`); its messages cannot be read"
            ) from None
        if len(data) != length:
            raise SegmentError(f"{self.info.key}: short read ({len(data)} of {length} bytes)")
        return data
