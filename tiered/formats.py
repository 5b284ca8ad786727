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

**Key hash**: the 31-bit CRC32C of ``topic#key``, as the IndexFile and a segment's key index store
it (RocketMQ indexes keys per topic the same way).
"""

from __future__ import annotations

import struct

import numpy as np
from google_crc32c import value as crc32c

CQ_ENTRY = struct.Struct(">qiq")
CQ_ENTRY_SIZE = CQ_ENTRY.size  # 20
CQ_DTYPE = np.dtype([("offset", ">i8"), ("size", ">i4"), ("tag", ">i8")])

Entry = tuple[int, int, int]  # (offset, size, tag hash)


def key_hash(topic: str, key: str) -> int:
    """The 31-bit hash of ``topic#key``."""
    return int(crc32c(f"{topic}#{key}".encode())) & 0x7FFFFFFF
