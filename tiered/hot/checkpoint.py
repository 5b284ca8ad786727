"""StoreCheckpoint: how far the CommitLog, ConsumeQueues and IndexFiles are known to be on disk.

Layout (big-endian, 60 bytes, in a file of its own):

====== ===================== ===================================================
 bytes  field                 meaning
====== ===================== ===================================================
 4      magic                 ``b"TMQC"``
 4      version               1
 8      physic timestamp      store timestamp of the last fsynced CommitLog record
 8      logics timestamp      store timestamp of the last dispatched record
 8      index timestamp       store timestamp of the last indexed record
 8      flushed offset        CommitLog bytes fsynced (a record boundary)
 8      dispatched offset     CommitLog bytes dispatched to the ConsumeQueues, whose files
                              were fsynced before this checkpoint was written
 8      index offset          CommitLog bytes indexed, likewise
 4      crc                   CRC32 of everything above
====== ===================== ===================================================

It is replaced atomically (write a temporary file, fsync, rename, fsync the directory), so a
crash leaves either the old or the new checkpoint, never a torn one; a checkpoint that fails its
CRC is ignored and recovery scans the whole CommitLog instead.
"""

from __future__ import annotations

import logging
import struct
import zlib
from dataclasses import astuple, dataclass
from pathlib import Path

from tiered.durable import settle_dir, write_file

log = logging.getLogger(__name__)

_MAGIC = b"TMQC"
_VERSION = 1
_BODY = struct.Struct(">4siqqqqqq")
_CRC = struct.Struct(">I")


@dataclass(slots=True)
class Checkpoint:
    physic_timestamp: int = 0
    logics_timestamp: int = 0
    index_timestamp: int = 0
    flushed_offset: int = 0
    dispatched_offset: int = 0
    index_offset: int = 0

    def encode(self) -> bytes:
        body = _BODY.pack(_MAGIC, _VERSION, *astuple(self))
        return body + _CRC.pack(zlib.crc32(body))

    @classmethod
    def decode(cls, raw: bytes) -> Checkpoint | None:
        if len(raw) != _BODY.size + _CRC.size:
            return None
        body = raw[: _BODY.size]
        (crc,) = _CRC.unpack_from(raw, _BODY.size)
        magic, version, *fields = _BODY.unpack(body)
        if magic != _MAGIC or version != _VERSION or zlib.crc32(body) != crc:
            return None
        return cls(*fields)


def load_checkpoint(path: Path) -> Checkpoint | None:
    settle_dir(path.parent)  # what is read below is durable before it is acted on
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None
    cp = Checkpoint.decode(raw)
    if cp is None:
        log.warning("%s is damaged; recovery will scan the whole CommitLog", path)
    return cp


def save_checkpoint(path: Path, cp: Checkpoint) -> None:
    write_file(path, cp.encode())
