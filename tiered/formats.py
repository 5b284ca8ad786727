"""Binary formats that both tiers share, defined once beside the record codec (``record.py``).

**ConsumeQueue entry**: 20 bytes, big-endian. The hot tier's ConsumeQueue files hold one at byte
``queue_offset * 20``; a cold segment's offset table holds one per record, with the position in
the object instead of the CommitLog offset.

====== ================ ==============================================
 bytes  field            meaning
====== ================ ==============================================
 8      offset           physical offset of the record (CommitLog, or position in a segment)
 4      size             record size in bytes (0: no entry here)
 8      tag hash         ``record.tag_hash`` of the TAGS property
====== ================ ==============================================

**Segment object**: one (topic, queue)'s messages for a range of queue offsets, in the cold tier.
An object is immutable. Layout (big-endian):

======================= ===========================================================================
 section                 content
======================= ===========================================================================
 records                 the messages, each a whole CommitLog record (``tiered/record.py``): the
                         same bytes as in the hot tier, so one codec reads both
 offset table            one ConsumeQueue entry (20 bytes, above) per record:
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

**Key hash**: the 31-bit CRC32C of ``topic#key``, as the IndexFile and a segment's key index store
it (RocketMQ indexes keys per topic the same way).
"""

from __future__ import annotations

import struct
from collections.abc import Iterable
from dataclasses import asdict, dataclass

import numpy as np
from google_crc32c import extend as crc32c_extend
from google_crc32c import value as crc32c

from tiered.record import CQ_ENTRY as CQ_ENTRY
from tiered.record import Buffer, CorruptRecordError, RecordError, crc32c_of, segment_tables

CQ_ENTRY_SIZE = CQ_ENTRY.size  # 20
CQ_DTYPE = np.dtype([("offset", ">i8"), ("size", ">i4"), ("tag", ">i8")])

Entry = tuple[int, int, int]  # (offset, size, tag hash)


def key_hash(topic: str, key: str) -> int:
    """The 31-bit hash of ``topic#key``."""
    return int(crc32c(f"{topic}#{key}".encode())) & 0x7FFFFFFF


# -- segment objects ----------------------------------------------------------------------------

MAGIC = b"TMQSEG01"
VERSION = 1
_FOOTER_BODY = struct.Struct(">8siqiqqqiqqI")
_FOOTER = struct.Struct(_FOOTER_BODY.format + "I")
FOOTER_SIZE = _FOOTER.size
TIME_DTYPE = np.dtype(">i8")  # a segment's time table
KEY_DTYPE = np.dtype([("hash", ">u4"), ("record", ">u4")])  # a segment's key index


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

    def object_crc32c(self) -> int:
        """The CRC32C of the whole object (what S3 calls its ``ChecksumCRC32C``): ``crc``
        extended over the footer, no pass over the records again."""
        return int(crc32c_extend(self.crc, self.footer()))

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


def build(records: Iterable[Buffer], base_offset: int, key: str) -> tuple[bytes, SegmentInfo]:
    """Lay out ``records`` (whole CommitLog records of one queue, in queue-offset order starting
    at ``base_offset``) as a segment object. Every record is checked on the way in (structure,
    body CRC, contiguous queue offsets) by the record engine's segment build: a damaged record
    is refused (``CorruptRecordError``), never archived. The object is assembled with one copy
    of the records (a single buffer of them is used as it is)."""
    parts = list(records)
    body_records = parts[0] if len(parts) == 1 else b"".join(parts)
    tables, info = _layout(body_records, base_offset, key)
    return b"".join([body_records, *tables, info.footer()]), info


def seal(buf: bytearray, records: int, base_offset: int, key: str) -> SegmentInfo:
    """``build`` in place: ``buf[:records]`` holds the records (checked as ``build`` checks
    them); the tables and the footer are written after them and ``buf`` is cut to the object's
    size, so that ``buf`` is the object. No copy of the records: the offloader gathers them
    into a buffer it reuses, and a 16 MiB copy into fresh memory cost as much CPU as the
    checks (page faults, decision 410)."""
    with memoryview(buf) as whole, whole[:records] as view:
        tables, info = _layout(view, base_offset, key)
    del buf[records:]
    for part in (*tables, info.footer()):
        buf += part
    return info


def _layout(body_records: Buffer, base_offset: int, key: str) -> tuple[list[bytes], SegmentInfo]:
    """The tables that follow ``body_records`` in the object, and its manifest entry."""
    try:
        tables = segment_tables(body_records, base_offset)
    except CorruptRecordError:
        raise
    except RecordError as e:
        raise SegmentError(f"{key}: {e}") from None
    count = tables.count
    offsets_at = len(memoryview(body_records))
    times_at = offsets_at + count * CQ_ENTRY_SIZE
    keys_at = times_at + 8 * count
    layout = [tables.offset_table, tables.time_table, tables.key_index]
    crc = crc32c_of(body_records)
    for table in layout:
        crc = int(crc32c_extend(crc, table))
    info = SegmentInfo(
        key=key,
        base_offset=base_offset,
        count=count,
        size=keys_at + len(tables.key_index) + FOOTER_SIZE,
        offsets_at=offsets_at,
        times_at=times_at,
        keys_at=keys_at,
        key_count=tables.key_count,
        min_store_timestamp=tables.min_store_timestamp,
        max_store_timestamp=tables.max_store_timestamp,
        crc=crc,
    )
    return layout, info
