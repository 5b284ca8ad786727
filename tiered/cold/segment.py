"""Segment objects in the cold tier: reading one with ranged GETs, verifying one, and rebuilding
its manifest entry from its footer.

The object layout (records, offset table, time table, key index, footer) and its build are
defined beside the record codec, in ``tiered/formats.py``: the offloader builds objects with the
record engine's segment build, and every reader (this module, the lakehouse source) reads them
with the same definitions. ``SegmentInfo``, ``SegmentError``, ``build`` and ``FOOTER_SIZE`` are
imported here from there, for the callers that know them by this module.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

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
from tiered.record import RecordError, StoredMessage, decode, validate

__all__ = ["FOOTER_SIZE", "SegmentError", "SegmentInfo", "SegmentReader", "build"]

_RECORD_FIELD = struct.Struct(">q")
_PHYS_AT = 28  # PHYSICALOFFSET's position in a record (tiered/record.py)
_QUEUE_OFFSET_AT = 20  # QUEUEOFFSET's position in a record


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


@dataclass(slots=True, frozen=True)
class RecordSpan:
    """Consecutive whole records of one segment, checked but not decoded: what the cold fetcher
    caches, so a read decodes only the messages it returns."""

    base_offset: int  # queue offset of the first record
    data: bytes
    positions: list[int]  # where each record starts in ``data``

    def __len__(self) -> int:
        return len(self.positions)

    def message(self, i: int) -> StoredMessage:
        """Record ``i`` (queue offset ``base_offset + i``), decoded. Its body CRC was checked
        when the span was read."""
        return decode(self.data, self.positions[i], check_crc=False)


def read_offset_table(store: ObjectStore, info: SegmentInfo) -> bytes:
    """The segment's whole offset table (``CQ_DTYPE`` entries, one request): a cold job."""
    return SegmentReader(store, info)._range(info.offsets_at, info.count * CQ_ENTRY_SIZE)


def read_span(store: ObjectStore, info: SegmentInfo, first: int, entries: bytes) -> RecordSpan:
    """The records ``first, first + 1, ...`` of the segment whose offset-table entries are
    ``entries``, with one ranged GET, each checked (structure, body CRC, queue offset): a cold
    job. Raises ``SegmentError`` for a record that is not what its entry says."""
    table = np.frombuffer(entries, dtype=CQ_DTYPE)
    starts = table["offset"].astype(np.int64)
    ends = starts + table["size"]
    begin = int(starts[0])
    data = SegmentReader(store, info)._range(begin, int(ends[-1]) - begin)
    positions = (starts - begin).tolist()
    for i, (pos, size) in enumerate(zip(positions, table["size"].tolist(), strict=True)):
        try:
            (phys,) = _RECORD_FIELD.unpack_from(data, pos + _PHYS_AT)
            if validate(data, pos, phys, check_crc=True) != size:
                raise SegmentError(f"{info.key}: record at {begin + pos} is not its entry's size")
            (queue_offset,) = _RECORD_FIELD.unpack_from(data, pos + _QUEUE_OFFSET_AT)
        except (RecordError, struct.error) as e:
            raise SegmentError(f"{info.key}: record at {begin + pos}: {e}") from e
        if queue_offset != info.base_offset + first + i:
            raise SegmentError(
                f"{info.key}: record at {begin + pos} has queue offset {queue_offset}"
            )
    return RecordSpan(info.base_offset + first, data, positions)


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
        out = []
        for pos, size in zip(entries["offset"].tolist(), entries["size"].tolist(), strict=True):
            msg = decode(span, pos - start, check_crc=True)
            if msg.size != size:
                raise SegmentError(f"{self.info.key}: record at {pos} is not where its entry says")
            out.append(msg)
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
