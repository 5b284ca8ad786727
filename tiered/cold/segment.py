"""Segment objects: one (topic, queue)'s messages for a range of queue offsets, in the cold tier.

An object is immutable. Layout (big-endian):

======================= ===========================================================================
 section                 content
======================= ===========================================================================
 records                 the messages, each a whole CommitLog record (``tiered/record.py``): the
                         same bytes as in the hot tier, so one codec reads both
 offset table            one ConsumeQueue entry (20 bytes, ``tiered/formats.py``) per record:
                         position of the record *in this object*, size, tag hash
 time table              the store timestamp of each record (8 bytes)
 key index               (key hash 4, record number 4) for every key and unique id, sorted: the
                         segment's IndexFile, searched with one ranged read and a bisection
 footer (64 bytes)       magic ``TMQSEG01``, version, base queue offset, record count, where each
                         section starts, min/max store timestamp, CRC32C of everything before
                         the footer, CRC32C of the footer
======================= ===========================================================================

Record ``i`` has queue offset ``base + i``: a segment has no gaps. The manifest keeps a copy of
the footer's fields, so reading record ``i`` costs two ranged GETs (its offset-table entry, then
the record) however large the archive is.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable
from dataclasses import asdict, dataclass

import numpy as np
from google_crc32c import value as crc32c

from tiered.cold.storage import ObjectNotFoundError, ObjectStore
from tiered.formats import CQ_DTYPE, CQ_ENTRY_SIZE, key_hash
from tiered.record import (
    CorruptRecordError,
    RecordError,
    StoredMessage,
    crc32c_of,
    decode,
    segment_tables,
    validate,
)

MAGIC = b"TMQSEG01"
VERSION = 1
_FOOTER_BODY = struct.Struct(">8siqiqqqiqqI")
_FOOTER = struct.Struct(_FOOTER_BODY.format + "I")
FOOTER_SIZE = _FOOTER.size
_TIME = np.dtype(">i8")
_KEY_DTYPE = np.dtype([("hash", ">u4"), ("record", ">u4")])
_PHYS = struct.Struct(">q")
_PHYS_AT = 28  # PHYSICALOFFSET's position in a record (tiered/record.py)


class SegmentError(Exception):
    """A segment object that is not what its manifest says (missing, truncated, corrupt)."""


@dataclass(slots=True, frozen=True)
class SegmentInfo:
    """What the manifest records about one segment object."""

    key: str
    base_offset: int
    count: int
    size: int
    offsets_at: int
    times_at: int
    keys_at: int
    key_count: int
    min_store_timestamp: int
    max_store_timestamp: int
    crc: int  # CRC32C of everything before the footer

    @property
    def end_offset(self) -> int:
        """The queue offset just past this segment."""
        return self.base_offset + self.count

    def to_dict(self) -> dict[str, int | str]:
        return asdict(self)

    def footer(self) -> bytes:
        """The object's footer: magic, version, then the fields of ``FOOTER_FIELDS``, then the
        footer's own CRC32C (everything but ``key`` and ``size``, which the object's name and
        length give)."""
        body = _FOOTER_BODY.pack(MAGIC, VERSION, *(getattr(self, f) for f in FOOTER_FIELDS))
        return body + struct.pack(">I", int(crc32c(body)))

    @classmethod
    def from_footer(cls, key: str, size: int, raw: bytes) -> SegmentInfo:
        """The manifest entry of the object ``key`` of ``size`` bytes whose footer is ``raw``."""
        magic, version, *values, footer_crc = _FOOTER.unpack(raw)
        if magic != MAGIC or crc32c(raw[:-4]) != footer_crc:
            raise SegmentError(f"{key}: not a segment object, or its footer is damaged")
        if version != VERSION:
            raise SegmentError(f"{key}: segment format version {version} is not supported")
        return cls(key=key, size=size, **dict(zip(FOOTER_FIELDS, values, strict=True)))


# The footer holds these fields of SegmentInfo, in this order (``_FOOTER_BODY``'s after magic
# and version): the manifest's entry and the object's footer are one record, written once.
FOOTER_FIELDS = (
    "base_offset",
    "count",
    "offsets_at",
    "times_at",
    "keys_at",
    "key_count",
    "min_store_timestamp",
    "max_store_timestamp",
    "crc",
)


def build(records: Iterable[bytes], base_offset: int, key: str) -> tuple[bytes, SegmentInfo]:
    """Lay out ``records`` (whole CommitLog records of one queue, in queue-offset order starting
    at ``base_offset``) as a segment object. Every record is checked on the way in (structure,
    body CRC, contiguous queue offsets) by the record engine's segment build: a damaged record
    is refused (``CorruptRecordError``), never archived."""
    body_records = b"".join(records)
    try:
        tables = segment_tables(body_records, base_offset)
    except CorruptRecordError:
        raise
    except RecordError as e:
        raise SegmentError(f"{key}: {e}") from None
    count = tables.count
    offsets_at = len(body_records)
    times_at = offsets_at + count * CQ_ENTRY_SIZE
    keys_at = times_at + 8 * count
    body = b"".join([body_records, tables.offset_table, tables.time_table, tables.key_index])
    info = SegmentInfo(
        key=key,
        base_offset=base_offset,
        count=count,
        size=len(body) + FOOTER_SIZE,
        offsets_at=offsets_at,
        times_at=times_at,
        keys_at=keys_at,
        key_count=tables.key_count,
        min_store_timestamp=tables.min_store_timestamp,
        max_store_timestamp=tables.max_store_timestamp,
        crc=crc32c_of(body),
    )
    return body + info.footer(), info


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


_QUEUE_OFFSET_AT = 20  # QUEUEOFFSET's position in a record (tiered/record.py)


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
            (phys,) = _PHYS.unpack_from(data, pos + _PHYS_AT)
            if validate(data, pos, phys, check_crc=True) != size:
                raise SegmentError(f"{info.key}: record at {begin + pos} is not its entry's size")
            (queue_offset,) = _PHYS.unpack_from(data, pos + _QUEUE_OFFSET_AT)
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
        times = np.frombuffer(raw, dtype=_TIME)
        return self.info.base_offset + int(np.searchsorted(times, timestamp_ms, "left"))

    def offsets_for_key(self, topic: str, key: str) -> list[int]:
        """Queue offsets whose key index entry matches (candidates: check the records)."""
        if self.info.key_count == 0:
            return []
        raw = self._range(self.info.keys_at, 8 * self.info.key_count)
        index = np.frombuffer(raw, dtype=_KEY_DTYPE)
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
