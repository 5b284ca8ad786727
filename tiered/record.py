"""The message record: tmq's one on-disk and on-object message format.

A record follows RocketMQ's CommitLog layout (``MESSAGE_MAGIC_CODE_V2``: two-byte topic length).
Every integer is big-endian, as Java's ``ByteBuffer`` writes it, so a RocketMQ engineer reading a
hex dump sees the fields where they expect them.

====== ===================== ===================================================================
 bytes  field                 meaning
====== ===================== ===================================================================
 4      TOTALSIZE             size of the whole record, this field included
 4      MAGICCODE             ``MAGIC_CODE_V2`` (format version 2) or ``BLANK_MAGIC_CODE``
 4      BODYCRC               CRC32C (Castagnoli) of the body, unsigned
 4      QUEUEID               queue id within the topic
 4      FLAG                  application flag, opaque to the store
 8      QUEUEOFFSET           logical offset within (topic, queue), assigned at append
 8      PHYSICALOFFSET        byte offset of this record in the CommitLog, assigned at append
 4      SYSFLAG               bit 4: born host is IPv6; bit 5: store host is IPv6;
                              bit 16: the record ends with its record CRC (below)
 8      BORNTIMESTAMP         producer's clock, ms since the epoch
 8|20   BORNHOST              IPv4 (4) or IPv6 (16) address, then port (4)
 8      STORETIMESTAMP        broker's clock at append, ms since the epoch
 8|20   STOREHOST             as BORNHOST
 4      RECONSUMETIMES        delivery attempts so far (retry topics)
 8      PREPAREDTXOFFSET      prepared-transaction offset (0: none)
 4+n    BODY                  length, then the body
 2+n    TOPIC                 length, then the UTF-8 topic
 2+n    PROPERTIES            length, then ``name\\x01value\\x02`` pairs, UTF-8; with SYSFLAG
                              bit 16 the last 20 bytes are the record CRC pair (below)
====== ===================== ===================================================================

The record CRC (decision 210) is RocketMQ 5's ``enabledAppendPropCRC`` pair, ``__CRC32#``
``\\x01`` ten decimal digits ``\\x02``, the last 20 bytes of the record (the end of PROPERTIES,
counted in its length): the CRC32C of every byte of the record before the pair, TOTALSIZE and the
offsets and STORETIMESTAMP assigned at append included, masked to 31 bits and written least
significant digit first, as RocketMQ writes it. BODYCRC alone lets a record whose properties
were torn (a power loss lands pages in any order) pass; the record CRC does not. SYSFLAG bit 16,
set only by the store's encoder, says the pair is there: records written before it existed
have the bit clear and are read as before, and a producer's own ``__CRC32#`` property is an
ordinary property that no reader mistakes for the pair. Decoders drop the pair: a message's
properties are what its producer sent.

A file's unused end is padded by a BLANK record: TOTALSIZE (the bytes left in the file, at least
8) followed by ``BLANK_MAGIC_CODE``. A reader that meets it moves to the next file.

Keys (``KEYS``, space separated), tags (``TAGS``) and the unique message id (``UNIQ_KEY``) are
properties, as in RocketMQ.
"""

from __future__ import annotations

import functools
import mmap
import os
import socket
import struct
import sys
from collections.abc import Callable, MutableSequence, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from google_crc32c import extend as crc32c_extend
from google_crc32c import value as crc32c

MAGIC_CODE_V2 = -626843477
BLANK_MAGIC_CODE = -875286124
# The smallest BLANK record: TOTALSIZE and MAGICCODE. A file always keeps room for it.
BLANK_RECORD_SIZE = 8

SYSFLAG_BORNHOST_V6 = 1 << 4
SYSFLAG_STOREHOST_V6 = 1 << 5
# tmq's: the record ends with the record CRC pair. RocketMQ's own flags use bits 0-10.
SYSFLAG_RECORD_CRC = 1 << 16
# Every SYSFLAG bit a tmq encoder has ever set; a record with any other bit is damaged (decision
# 870): one flipped bit must not turn the record CRC's flag off unnoticed.
SYSFLAG_KNOWN = SYSFLAG_BORNHOST_V6 | SYSFLAG_STOREHOST_V6 | SYSFLAG_RECORD_CRC
_SYSFLAG_BIT16_BYTE = 37  # SYSFLAG is the big-endian int at byte 36: bit 16 is byte 37's low bit

PROPERTY_KEYS = "KEYS"
PROPERTY_TAGS = "TAGS"
PROPERTY_UNIQ_KEY = "UNIQ_KEY"
PROPERTY_SHARDING_KEY = "__SHARDINGKEY"  # the message group of a FIFO message
KEY_SEPARATOR = " "
_NAME_VALUE_SEPARATOR = "\x01"
_PROPERTY_SEPARATOR = "\x02"

PROPERTY_CRC32 = "__CRC32#"  # RocketMQ's MessageConst.PROPERTY_CRC32
# ``__CRC32#`` \x01, ten digits, \x02: RocketMQ's CommitLog.CRC32_RESERVED_LEN.
CRC_TRAILER_SIZE = len(PROPERTY_CRC32) + 1 + 10 + 1
_CRC_TRAILER_NAME = (PROPERTY_CRC32 + "\x01").encode()

MAX_TOPIC_BYTES = 0xFFFF
# RocketMQ's Short.MAX_VALUE limit on the stored properties, which include the record CRC pair.
MAX_PROPERTIES_BYTES = 0x7FFF - CRC_TRAILER_SIZE

Host = tuple[str, int]
# Anything records are read from: a file's mapping, bytes read from an object, a view.
Buffer = bytes | bytearray | memoryview | mmap.mmap
# Positions and sizes of records: a list, or an int64 array straight from a table.
Ints = Sequence[int] | np.ndarray
LOCALHOST: Host = ("127.0.0.1", 0)

# The fixed head up to and including SYSFLAG and BORNTIMESTAMP (48 bytes), then the hosts.
_HEAD = struct.Struct(">iiIiiqqiq")
_TOTAL_AND_MAGIC = struct.Struct(">ii")
_OFFSET_OF_SYSFLAG = 36
_OFFSET_OF_BORNHOST = 48

# The dispatch's outputs (decision 540). A ConsumeQueue entry: CommitLog offset, size, tag hash
# (``tiered/formats.py`` names it for its readers). An IndexFile's header, hash slots and
# entries (``tiered/hot/index_file.py`` describes the layout).
CQ_ENTRY = struct.Struct(">qiq")
INDEX_HEADER_SIZE = 40
INDEX_SLOT_SIZE = 4
INDEX_ENTRY_SIZE = 20
INDEX_ENTRY_DTYPE = np.dtype(
    [("hash", ">i4"), ("offset", ">i8"), ("seconds", ">i4"), ("prev", ">i4")]
)
_INDEX_SLOT = struct.Struct(">i")
_INDEX_ENTRY = struct.Struct(">iqii")
# ``index_put_py`` of at most this many entries runs entry by entry.
_INDEX_SCALAR_MAX = 16


def _tail_struct(born_v6: bool, store_v6: bool) -> struct.Struct:
    born = "16si" if born_v6 else "4si"
    store = "16si" if store_v6 else "4si"
    # BORNHOST, STORETIMESTAMP, STOREHOST, RECONSUMETIMES, PREPAREDTXOFFSET, BODY length
    return struct.Struct(f">{born}q{store}iqi")


_TAILS = {(b, s): _tail_struct(b, s) for b in (False, True) for s in (False, True)}
# Where a record's BODY length is, by its SYSFLAG's host bits: after BORNHOST, STORETIMESTAMP,
# STOREHOST, RECONSUMETIMES and PREPAREDTRANSACTIONOFFSET (``record_named``).
_BODY_AT = {
    born * (1 << 4) + store * (1 << 5): 48 + (20 if born else 8) + (20 if store else 8) + 20
    for born in (0, 1)
    for store in (0, 1)
}
# The common case (both hosts IPv4) as one struct, for the append path.
_V4_RECORD_HEAD = struct.Struct(">iiIiiqqiq4siq4siiqi")
V4_HEAD_SIZE = _V4_RECORD_HEAD.size  # 88: every byte before the body when both hosts are IPv4
_U16 = struct.Struct(">H")
_EMPTY_PROPERTIES = struct.pack(">H", CRC_TRAILER_SIZE)  # the record CRC pair only
_I32 = struct.Struct(">i")
_I64 = struct.Struct(">q")


class RecordError(ValueError):
    """A record that cannot be decoded: a torn write, corruption, or a bug."""


class CorruptRecordError(RecordError):
    """A record whose body or whole bytes do not match their CRC: stored bytes were damaged."""


class RecordCrcError(CorruptRecordError):
    """A record whose body is whole but whose record CRC (decision 210) fails: torn or damaged
    outside the body."""


@dataclass(slots=True)
class Message:
    """A message as a producer hands it to the store (offsets are assigned at append)."""

    topic: str
    body: bytes
    queue_id: int = 0
    properties: dict[str, str] = field(default_factory=dict)
    flag: int = 0
    born_timestamp: int = 0
    born_host: Host = LOCALHOST
    reconsume_times: int = 0
    prepared_transaction_offset: int = 0

    @property
    def tags(self) -> str | None:
        return self.properties.get(PROPERTY_TAGS)

    @property
    def keys(self) -> list[str]:
        return split_keys(self.properties.get(PROPERTY_KEYS))


@dataclass(slots=True)
class StoredMessage:
    """A record as decoded from the CommitLog or a segment object."""

    topic: str
    queue_id: int
    queue_offset: int
    commitlog_offset: int
    size: int
    body: bytes
    body_crc: int
    flag: int
    sys_flag: int
    born_timestamp: int
    born_host: Host
    store_timestamp: int
    store_host: Host
    reconsume_times: int
    prepared_transaction_offset: int
    properties: dict[str, str]

    @property
    def tags(self) -> str | None:
        return self.properties.get(PROPERTY_TAGS)

    @property
    def keys(self) -> list[str]:
        return split_keys(self.properties.get(PROPERTY_KEYS))

    @property
    def msg_id(self) -> str | None:
        return self.properties.get(PROPERTY_UNIQ_KEY)


# One message of a ``RecordSpans`` batch: body offset and length in ``raw``, properties offset
# and length in ``props``, born timestamp, queue id, born host's index in ``hosts``; native byte
# order, as ``tmq_span`` in tiered/_record_native.h (decision 700).
SPAN_STRUCT = struct.Struct("=7q")


@dataclass(slots=True)
class RecordSpans:
    """Messages of one topic handed to the append path as spans of buffers, not ``Message``
    objects (decision 700): the SendMessage walker writes one ``SPAN_STRUCT`` per message into
    ``spans``, the bodies stay where they lie in ``raw`` (the request's bytes) and the encoded
    properties (``encode_properties``' bytes, in the order a ``Message``'s dict would hold
    them) in ``props``. Flag, reconsume times, prepared offset and born port are 0. ``tags``,
    ``keys`` and ``ids`` are each message's TAGS, KEYS and UNIQ_KEY property (dispatch reads
    them as it reads a ``Message``'s). ``messages()`` is the reference: the ``Message`` objects
    these spans stand for, which encode to the same bytes."""

    topic: str
    raw: bytes
    spans: bytes
    props: bytes
    hosts: list[str]
    tags: list[str | None]
    keys: list[str | None]
    ids: list[str]

    def __len__(self) -> int:
        return len(self.ids)

    def fields(self) -> np.ndarray:
        """The spans as a (messages, 7) int64 array."""
        return np.frombuffer(self.spans, dtype=np.int64).reshape(-1, SPAN_STRUCT.size // 8)

    def messages(self) -> list[Message]:
        out = []
        for body_at, body_len, props_at, props_len, born, queue_id, host in SPAN_STRUCT.iter_unpack(
            self.spans
        ):
            properties: dict[str, str] = {}
            text = self.props[props_at : props_at + props_len].decode()
            for pair in text.split(_PROPERTY_SEPARATOR)[:-1]:
                name, _, value = pair.partition(_NAME_VALUE_SEPARATOR)
                properties[name] = value
            out.append(
                Message(
                    topic=self.topic,
                    body=self.raw[body_at : body_at + body_len],
                    queue_id=queue_id,
                    properties=properties,
                    born_timestamp=born,
                    born_host=(self.hosts[host], 0),
                )
            )
        return out


def split_keys(value: str | None) -> list[str]:
    return [k for k in value.split(KEY_SEPARATOR) if k] if value else []


def tag_hash(tags: str | None) -> int:
    """The 8-byte tag code kept in a ConsumeQueue entry; 0 means "no tag".

    RocketMQ uses Java's ``String.hashCode``; tmq uses CRC32C, which is as good a filter hint,
    runs in C, and is stable across processes (Python's ``hash`` is salted).
    """
    if not tags:
        return 0
    return int(crc32c(tags.encode()))


def crc_trailer(crc: int) -> bytes:
    """The record CRC pair for a CRC32C ``crc``: ``__CRC32#\\x01``, ten digits of its low 31
    bits least significant first (RocketMQ's ``MessageDecoder.createCrc32``), ``\\x02``."""
    return _CRC_TRAILER_NAME + str(crc & 0x7FFFFFFF).zfill(10)[::-1].encode() + b"\x02"


def record_crc_matches(buf: Buffer, pos: int, total: int) -> bool:
    """Whether the record of ``total`` bytes at ``pos`` ends with the pair of its own CRC."""
    end = pos + total
    return bytes(buf[end - CRC_TRAILER_SIZE : end]) == crc_trailer(
        crc32c(bytes(buf[pos : end - CRC_TRAILER_SIZE]))
    )


def record_crc_flag_lost(buf: Buffer, pos: int, total: int) -> bool:
    """Whether a record without SYSFLAG bit 16 ends with the pair it would carry had the bit
    been set: a record written with its record CRC whose flag byte was damaged (decision 870).
    A record written before decision 210 ends with such a pair only by a 2**-31 chance."""
    end = pos + total
    if (
        total < V4_HEAD_SIZE + CRC_TRAILER_SIZE
        or bytes(buf[end - CRC_TRAILER_SIZE : end - CRC_TRAILER_SIZE + len(_CRC_TRAILER_NAME)])
        != _CRC_TRAILER_NAME
    ):
        return False
    flag_byte = pos + _SYSFLAG_BIT16_BYTE
    crc = crc32c(bytes(buf[pos:flag_byte]))
    crc = crc32c_extend(crc, bytes([buf[flag_byte] | 1]))
    crc = crc32c_extend(crc, bytes(buf[flag_byte + 1 : end - CRC_TRAILER_SIZE]))
    return bytes(buf[end - CRC_TRAILER_SIZE : end]) == crc_trailer(crc)


def encode_properties(properties: dict[str, str]) -> bytes:
    if not properties:
        return b""
    text = _PROPERTY_SEPARATOR.join(map(_NAME_VALUE_SEPARATOR.join, properties.items()))
    n = len(properties)
    if text.count(_NAME_VALUE_SEPARATOR) != n or text.count(_PROPERTY_SEPARATOR) != n - 1:
        raise RecordError("property names and values may not contain \\x01 or \\x02")
    return (text + _PROPERTY_SEPARATOR).encode()


def decode_properties(raw: bytes) -> dict[str, str]:
    if not raw:
        return {}
    props: dict[str, str] = {}
    # Bytes that are not UTF-8 (an older writer, damage no record CRC guards) are read as
    # U+FFFD: one such record must not fail its batch or stop dispatch (decision 660).
    for pair in raw.decode("utf-8", "replace").split(_PROPERTY_SEPARATOR):
        if pair:
            name, _, value = pair.partition(_NAME_VALUE_SEPARATOR)
            props[name] = value
    return props


def _pack_host(host: Host) -> tuple[bytes, int, bool]:
    address, port = host
    try:
        return socket.inet_pton(socket.AF_INET, address), port, False
    except OSError:
        return socket.inet_pton(socket.AF_INET6, address), port, True


@functools.lru_cache(maxsize=4096)  # a broker sees few hosts; decode meets each one per record
def _unpack_host(raw: bytes, port: int) -> Host:
    family = socket.AF_INET6 if len(raw) == 16 else socket.AF_INET
    return socket.inet_ntop(family, raw), port


class RecordEncoder:
    """Encodes messages for one broker (one store host), caching what does not change."""

    def __init__(self, store_host: Host = LOCALHOST, cq_entries_per_file: int = 300_000) -> None:
        self._store_ip, self._store_port, self._store_v6 = _pack_host(store_host)
        if cq_entries_per_file < 1:
            raise ValueError(f"cq_entries_per_file must be at least 1, got {cq_entries_per_file}")
        # The encoder counts the queue offsets that start a ConsumeQueue file of this many
        # entries (``EncodedBatch.cq_starts``, decision 735).
        self._cq_per_file = cq_entries_per_file
        self._born_cache: dict[str, tuple[bytes, bool]] = {}
        self._topic_parts: dict[str, bytes] = {}
        # (topic, queue id) keys by topic and queue id: the native encoder reuses them rather
        # than allocate a tuple per message (which also wakes the cyclic GC).
        self._queue_keys: dict[str, dict[int, tuple[str, int]]] = {}

    def encode(
        self,
        msg: Message,
        queue_offset: int,
        physical_offset: int,
        store_timestamp: int,
    ) -> tuple[bytes, bytes, bytes]:
        """Return (record, topic bytes, property bytes) for ``msg`` at the given offsets."""
        topic = msg.topic.encode()
        props = encode_properties(msg.properties)
        if len(topic) > MAX_TOPIC_BYTES:
            raise RecordError(f"topic is {len(topic)} bytes; the format allows {MAX_TOPIC_BYTES}")
        if len(props) > MAX_PROPERTIES_BYTES:
            raise RecordError(
                f"properties are {len(props)} bytes; the format allows {MAX_PROPERTIES_BYTES}"
            )
        body = msg.body
        born_port = msg.born_host[1]
        born_ip, born_v6 = self._born(msg.born_host[0])
        total = (
            V4_HEAD_SIZE
            + (12 if born_v6 else 0)
            + (12 if self._store_v6 else 0)
            + len(body)
            + 2
            + len(topic)
            + 2
            + len(props)
            + CRC_TRAILER_SIZE
        )
        sys_flag = (
            (SYSFLAG_BORNHOST_V6 if born_v6 else 0)
            | (SYSFLAG_STOREHOST_V6 if self._store_v6 else 0)
            | SYSFLAG_RECORD_CRC
        )
        crc = crc32c(body)
        # The general layout; encode_batch has the IPv4 fast path of the append hot path.
        head = _HEAD.pack(
            total,
            MAGIC_CODE_V2,
            crc,
            msg.queue_id,
            msg.flag,
            queue_offset,
            physical_offset,
            sys_flag,
            msg.born_timestamp,
        ) + _TAILS[(born_v6, self._store_v6)].pack(
            born_ip,
            born_port,
            store_timestamp,
            self._store_ip,
            self._store_port,
            msg.reconsume_times,
            msg.prepared_transaction_offset,
            len(body),
        )
        record = b"".join(
            (
                head,
                body,
                _U16.pack(len(topic)),
                topic,
                _U16.pack(len(props) + CRC_TRAILER_SIZE),
                props,
            )
        )
        return record + crc_trailer(crc32c(record)), topic, props

    def encode_batch(
        self,
        messages: Sequence[Message] | RecordSpans,
        start: int,
        physical_offset: int,
        space: int,
        next_offsets: dict[tuple[str, int], int],
        base_offsets: dict[tuple[str, int], int],
        out: EncodedBatch,
        sink: tuple[int, Any, int, Callable[[], None] | None] | None = None,
    ) -> tuple[int, int]:
        """Encode ``messages[start:]`` at ``physical_offset`` while each record fits in
        ``space`` bytes with room for a BLANK record after it.

        ``sink`` (``MappedFile.append_sink``): the native engine may write a batch that fits
        whole straight into that file, in one ``pwrite`` with its size fields in place
        (decision 1040), and set ``out.written`` (decision 452); the reference never does, and
        the caller writes ``out.parts`` as usual.

        ``messages`` may be a ``RecordSpans`` batch (decision 700): the same records as from its
        ``messages()``, with no ``Message`` object made by the native engine.

        Queue offsets come from ``next_offsets`` (this batch's), else ``base_offsets`` (the
        CommitLog's), and ``next_offsets`` is advanced. Returns (index of the first message not
        encoded, bytes used); the records are appended to ``out.parts`` (the native engine
        appends them as one buffer). This is the append hot path.
        """
        if sink is not None and _engine is NATIVE_ENGINE:
            i, used = _engine.encode_batch(
                self, messages, start, physical_offset, space, next_offsets, base_offsets, out, sink
            )
        else:
            i, used = _engine.encode_batch(
                self, messages, start, physical_offset, space, next_offsets, base_offsets, out
            )
        return int(i), int(used)

    def encode_batch_py(
        self,
        messages: Sequence[Message] | RecordSpans,
        start: int,
        physical_offset: int,
        space: int,
        next_offsets: dict[tuple[str, int], int],
        base_offsets: dict[tuple[str, int], int],
        out: EncodedBatch,
    ) -> tuple[int, int]:
        """The reference implementation of ``encode_batch``: one ``struct.pack`` and one CRC
        call per record, everything else cached. ``RecordSpans`` are encoded as the ``Message``
        objects they stand for (the native engine reads them in place)."""
        if isinstance(messages, RecordSpans):
            messages = messages.messages()
        pack = _V4_RECORD_HEAD.pack
        store_ts = out.store_timestamp
        store_ip, store_port = self._store_ip, self._store_port
        topic_parts = self._topic_parts
        born_cache = self._born_cache
        parts, offsets, sizes, qoffs = out.parts, out.offsets, out.sizes, out.queue_offsets
        queues, tags, keys, uniqs = out.queues, out.tags, out.keys, out.uniq_keys
        per_file = self._cq_per_file
        entries = starts = 0
        used = 0
        i = start
        count = len(messages)
        while i < count:
            m = messages[i]
            topic = m.topic
            tpart = topic_parts.get(topic)
            if tpart is None:
                tpart = self._topic_part(topic)
            props = m.properties
            if props:
                pbytes = encode_properties(props)
                if len(pbytes) > MAX_PROPERTIES_BYTES:
                    raise RecordError(
                        f"properties are {len(pbytes)} bytes; the format allows "
                        f"{MAX_PROPERTIES_BYTES}"
                    )
                ppart = _U16.pack(len(pbytes) + CRC_TRAILER_SIZE) + pbytes
            else:
                ppart = _EMPTY_PROPERTIES
            body = m.body
            born = born_cache.get(m.born_host[0])
            if born is None or born[1] or self._store_v6:
                # IPv6 somewhere: the general encoder handles the wider header.
                if used + 8 > space:
                    break
                key = (topic, m.queue_id)
                q = next_offsets.get(key)
                if q is None:
                    q = base_offsets.get(key, 0)
                record, _, _ = self.encode(m, q, physical_offset + used, store_ts)
                size = len(record)
                if used + size + BLANK_RECORD_SIZE > space:
                    break
                parts.append(record)
            else:
                size = V4_HEAD_SIZE + len(body) + len(tpart) + len(ppart) + CRC_TRAILER_SIZE
                if used + size + BLANK_RECORD_SIZE > space:
                    break
                key = (topic, m.queue_id)
                q = next_offsets.get(key)
                if q is None:
                    q = base_offsets.get(key, 0)
                head = pack(
                    size,
                    MAGIC_CODE_V2,
                    crc32c(body),
                    m.queue_id,
                    m.flag,
                    q,
                    physical_offset + used,
                    SYSFLAG_RECORD_CRC,
                    m.born_timestamp,
                    born[0],
                    m.born_host[1],
                    store_ts,
                    store_ip,
                    store_port,
                    m.reconsume_times,
                    m.prepared_transaction_offset,
                    len(body),
                )
                whole = crc32c_extend(
                    crc32c_extend(crc32c_extend(crc32c(head), body), tpart), ppart
                )
                parts += (head, body, tpart, ppart, crc_trailer(whole))
            next_offsets[key] = q + 1
            offsets.append(physical_offset + used)
            sizes.append(size)
            qoffs.append(q)
            queues.append(key)
            if q % per_file == 0:
                starts += 1
            if props:
                tags.append(props.get(PROPERTY_TAGS))
                value = props.get(PROPERTY_KEYS)
                keys.append(value)
                uniq = props.get(PROPERTY_UNIQ_KEY)
                uniqs.append(uniq)
                if uniq:
                    entries += 1
                if value:
                    entries += len(split_keys(value))
            else:
                tags.append(None)
                keys.append(None)
                uniqs.append(None)
            used += size
            i += 1
        out.index_entries += entries
        out.cq_starts += starts
        return i, used

    def _topic_part(self, topic: str) -> bytes:
        raw = topic.encode()
        if len(raw) > MAX_TOPIC_BYTES:
            raise RecordError(f"topic is {len(raw)} bytes; the format allows {MAX_TOPIC_BYTES}")
        part = _U16.pack(len(raw)) + raw
        if len(self._topic_parts) < 100_000:
            self._topic_parts[topic] = part
        return part

    def _born(self, address: str) -> tuple[bytes, bool]:
        cached = self._born_cache.get(address)
        if cached is None:
            ip, _, v6 = _pack_host((address, 0))
            cached = (ip, v6)
            if len(self._born_cache) < 4096:
                self._born_cache[address] = cached
        return cached


@dataclass(slots=True)
class EncodedBatch:
    """Records encoded for one CommitLog file, plus what dispatch needs to know of each.

    The dispatch fields are captured at encode time, so the dispatcher never re-reads the
    CommitLog on the hot path and a caller mutating a Message afterwards changes nothing.
    """

    parts: list[bytes] = field(default_factory=list)
    # The integer columns: lists from the reference engine and the CommitLog readers, int64
    # ``array('q')`` from the native encoder (decision 600); equal values either way.
    offsets: MutableSequence[int] = field(default_factory=list)  # physical offset of each record
    sizes: MutableSequence[int] = field(default_factory=list)
    queue_offsets: MutableSequence[int] = field(default_factory=list)
    queues: list[tuple[str, int]] = field(default_factory=list)
    tags: list[str | None] = field(default_factory=list)
    keys: list[str | None] = field(default_factory=list)
    uniq_keys: list[str | None] = field(default_factory=list)
    store_timestamp: int = 0
    # Per record, when they differ (records read back from the CommitLog); else None.
    store_timestamps: MutableSequence[int] | None = None
    # The native engine wrote the records into the CommitLog file itself (decision 452).
    written: bool = False
    # Counted by the encoder for the append path's room check (decisions 680, 735): the
    # IndexFile entries the records make (``index_entry_count`` of ``keys`` and ``uniq_keys``)
    # and the queue offsets that start a ConsumeQueue file (multiples of the encoder's
    # ``cq_entries_per_file``).
    index_entries: int = 0
    cq_starts: int = 0

    @property
    def end_offset(self) -> int:
        """Just past the last record."""
        return self.offsets[-1] + self.sizes[-1]


def blank_record(size: int) -> bytes:
    """The padding that ends a file: ``size`` bytes starting with TOTALSIZE and BLANK magic."""
    return _TOTAL_AND_MAGIC.pack(size, BLANK_MAGIC_CODE) + bytes(size - BLANK_RECORD_SIZE)


def read_total_and_magic(buf: Buffer, pos: int) -> tuple[int, int]:
    total, magic = _TOTAL_AND_MAGIC.unpack_from(buf, pos)
    return int(total), int(magic)


_ENTRY_HEAD = struct.Struct(">iiiiiqqi")  # TOTALSIZE .. SYSFLAG, less BODYCRC's sign


def record_named(
    buf: Buffer, pos: int, size: int, topic: bytes, queue_id: int, queue_offset: int, at: int
) -> str | None:
    """None when ``buf[pos:pos + size]`` starts the V2 record of ``queue_id`` at
    ``queue_offset`` of the topic whose TOPIC field (``topic_field``: length and name) is
    ``topic``, stored at CommitLog offset ``at``, of exactly ``size`` bytes; else what it
    holds. The check a read makes of a ConsumeQueue entry it does not decode (one a tag filter
    skips, decision 756): the fixed head and the topic, without the body or properties; two
    unpacks and a compare.
    ``buf`` must hold at least ``pos + size`` bytes."""
    if size < V4_HEAD_SIZE:
        return f"{size} bytes, too few for a record"
    total, magic, _crc, qid, _flag, qoff, phys, sys_flag = _ENTRY_HEAD.unpack_from(buf, pos)
    if magic != MAGIC_CODE_V2 or phys != at:
        return "no record starting there"
    if total != size or qid != queue_id or qoff != queue_offset:
        return f"a record of {total} bytes of queue id {qid} at queue offset {qoff}"
    body_at = pos + _BODY_AT[sys_flag & (SYSFLAG_BORNHOST_V6 | SYSFLAG_STOREHOST_V6)]
    end = pos + size
    if body_at + 4 > end:
        return "no record starting there"
    (body_len,) = _I32.unpack_from(buf, body_at)
    topic_at = body_at + 4 + body_len
    if body_len < 0 or topic_at + len(topic) > end:
        return "no record starting there"
    if buf[topic_at : topic_at + len(topic)] != topic:
        return f"another topic's record of queue id {qid} at queue offset {qoff}"
    return None


def topic_field(topic: str) -> bytes:
    """A record's TOPIC field for ``topic``: its length (2 bytes) and its name."""
    name = topic.encode()
    return _U16.pack(len(name)) + name


def decode(buf: Buffer, pos: int = 0, *, check_crc: bool = True) -> StoredMessage:
    """Decode the record at ``pos``.

    Raises ``RecordError`` for anything that is not a whole, well-formed record (including a BLANK
    record) and ``CorruptRecordError`` when the body fails BODYCRC or the record its record CRC.
    """
    end_of_buf = len(buf)
    if end_of_buf - pos < V4_HEAD_SIZE:
        raise RecordError(f"record at {pos}: only {end_of_buf - pos} bytes left")
    try:
        (total, magic, crc, queue_id, flag, queue_offset, physical_offset, sys_flag, born_ts) = (
            _HEAD.unpack_from(buf, pos)
        )
        if magic != MAGIC_CODE_V2:
            raise RecordError(f"record at {pos}: illegal magic code {magic}")
        if total < V4_HEAD_SIZE + 4 or pos + total > end_of_buf:
            raise RecordError(f"record at {pos}: total size {total} runs past the data")
        tail = _TAILS[(bool(sys_flag & SYSFLAG_BORNHOST_V6), bool(sys_flag & SYSFLAG_STOREHOST_V6))]
        (born_ip, born_port, store_ts, store_ip, store_port, reconsume, prepared, body_len) = (
            tail.unpack_from(buf, pos + _OFFSET_OF_BORNHOST)
        )
        p = pos + _OFFSET_OF_BORNHOST + tail.size
        body = bytes(buf[p : p + body_len])
        p += body_len
        (topic_len,) = _U16.unpack_from(buf, p)
        topic = bytes(buf[p + 2 : p + 2 + topic_len]).decode()
        p += 2 + topic_len
        (props_len,) = _U16.unpack_from(buf, p)
        props_raw = bytes(buf[p + 2 : p + 2 + props_len])
        p += 2 + props_len
    except (struct.error, UnicodeDecodeError) as e:
        raise RecordError(f"record at {pos}: {e}") from e
    if body_len < 0 or p - pos != total:
        raise RecordError(f"record at {pos}: fields add up to {p - pos} bytes, header says {total}")
    if check_crc and crc32c(body) != crc:
        raise CorruptRecordError(
            f"record at physical offset {physical_offset} (queue offset {queue_offset}): "
            "body CRC mismatch"
        )
    if sys_flag & ~SYSFLAG_KNOWN:
        raise RecordError(f"record at {pos}: unknown SYSFLAG bits {sys_flag:#x}")
    if sys_flag & SYSFLAG_RECORD_CRC:
        if props_len < CRC_TRAILER_SIZE:
            raise RecordError(f"record at {pos}: properties too short for the record CRC")
        if check_crc and not record_crc_matches(buf, pos, total):
            raise RecordCrcError(
                f"record at physical offset {physical_offset} (queue offset {queue_offset}): "
                "record CRC mismatch"
            )
        props_raw = props_raw[:-CRC_TRAILER_SIZE]
    elif check_crc and record_crc_flag_lost(buf, pos, total):
        raise RecordCrcError(
            f"record at physical offset {physical_offset} (queue offset {queue_offset}): "
            "its record CRC flag is cleared"
        )
    try:
        properties = decode_properties(props_raw)
    except UnicodeDecodeError as e:
        raise RecordError(f"record at {pos}: properties are not UTF-8") from e
    return StoredMessage(
        topic=topic,
        queue_id=queue_id,
        queue_offset=queue_offset,
        commitlog_offset=physical_offset,
        size=total,
        body=body,
        body_crc=crc,
        flag=flag,
        sys_flag=sys_flag,
        born_timestamp=born_ts,
        born_host=_unpack_host(born_ip, born_port),
        store_timestamp=store_ts,
        store_host=_unpack_host(store_ip, store_port),
        reconsume_times=reconsume,
        prepared_transaction_offset=prepared,
        properties=properties,
    )


_topic_cache: dict[bytes, str] = {}


def validate(buf: Buffer, pos: int, physical_offset: int, *, check_crc: bool) -> int:
    """Check the record at ``pos`` without decoding it; return its total size.

    It must be a whole V2 record whose fields add up to its TOTALSIZE, that names
    ``physical_offset`` as its own offset, and (with ``check_crc``) whose body matches BODYCRC
    and, when SYSFLAG says it has one, whose bytes match its record CRC.
    Raises ``RecordError`` or ``CorruptRecordError``. This is the crash-recovery scan's check.
    """
    try:
        (total, magic, crc, _qid, _flag, _qoff, phys, sys_flag, _born) = _HEAD.unpack_from(buf, pos)
        if magic != MAGIC_CODE_V2:
            raise RecordError(f"record at {physical_offset}: illegal magic code {magic}")
        if total < V4_HEAD_SIZE + 4 or pos + total > len(buf):
            raise RecordError(f"record at {physical_offset}: total size {total} is impossible")
        if phys != physical_offset:
            raise RecordError(f"record at {physical_offset} names offset {phys}")
        tail = _TAILS[(bool(sys_flag & SYSFLAG_BORNHOST_V6), bool(sys_flag & SYSFLAG_STOREHOST_V6))]
        body_at = pos + _OFFSET_OF_BORNHOST + tail.size
        (body_len,) = _I32.unpack_from(buf, body_at - 4)
        p = body_at + body_len
        (topic_len,) = _U16.unpack_from(buf, p)
        (props_len,) = _U16.unpack_from(buf, p + 2 + topic_len)
    except struct.error as e:
        raise RecordError(f"record at {physical_offset}: {e}") from e
    if body_len < 0 or p + 4 + topic_len + props_len - pos != total:
        raise RecordError(f"record at {physical_offset}: fields do not add up to {total} bytes")
    if check_crc and crc32c(bytes(buf[body_at:p])) != crc:
        raise CorruptRecordError(f"record at physical offset {physical_offset}: body CRC mismatch")
    if sys_flag & ~SYSFLAG_KNOWN:
        raise RecordError(f"record at {physical_offset}: unknown SYSFLAG bits {sys_flag:#x}")
    if sys_flag & SYSFLAG_RECORD_CRC:
        if props_len < CRC_TRAILER_SIZE:
            raise RecordError(
                f"record at {physical_offset}: properties too short for the record CRC"
            )
        if check_crc and not record_crc_matches(buf, pos, total):
            raise RecordCrcError(
                f"record at physical offset {physical_offset}: record CRC mismatch"
            )
    elif check_crc and record_crc_flag_lost(buf, pos, total):
        raise RecordCrcError(
            f"record at physical offset {physical_offset}: its record CRC flag is cleared"
        )
    return int(total)


def _property(raw: bytes, name: bytes, errors: str = "replace") -> str | None:
    """One property's value from encoded properties, without decoding the others."""
    if raw.startswith(name):
        start = len(name)
    else:
        at = raw.find(b"\x02" + name)
        if at < 0:
            return None
        start = at + 1 + len(name)
    end = raw.find(b"\x02", start)
    return raw[start : end if end >= 0 else len(raw)].decode("utf-8", errors)


_TAGS_NAME = (PROPERTY_TAGS + _NAME_VALUE_SEPARATOR).encode()
_KEYS_NAME = (PROPERTY_KEYS + _NAME_VALUE_SEPARATOR).encode()
_UNIQ_NAME = (PROPERTY_UNIQ_KEY + _NAME_VALUE_SEPARATOR).encode()


def read_dispatch_run_py(
    buf: Buffer,
    pos: int,
    limit: int,
    base_offset: int,
    out: EncodedBatch,
    stamps: list[int],
) -> int:
    """The reference implementation of ``read_dispatch_run``. Bytes that are not records
    (which validated data never holds) raise ``RecordError``."""
    try:
        return _read_dispatch_run(buf, pos, limit, base_offset, out, stamps)
    except (struct.error, UnicodeDecodeError) as e:
        raise RecordError(f"record at {pos}: {e}") from None


def _read_dispatch_run(
    buf: Buffer,
    pos: int,
    limit: int,
    base_offset: int,
    out: EncodedBatch,
    stamps: list[int],
    errors: str = "replace",
) -> int:
    """Append the dispatch fields of every record from ``pos`` up to ``limit`` (or a BLANK
    record) to ``out``; return the position after the last one. ``base_offset`` is the CommitLog
    offset of ``buf[0]``. The records have been validated already (append or recovery)."""
    offsets, sizes, qoffs, queues = out.offsets, out.sizes, out.queue_offsets, out.queues
    tags, keys, uniqs = out.tags, out.keys, out.uniq_keys
    topics = _topic_cache
    unpack_head = _HEAD.unpack_from
    while pos < limit:
        if _TOTAL_AND_MAGIC.unpack_from(buf, pos)[1] != MAGIC_CODE_V2:
            break  # BLANK padding, which may be only 8 bytes long: the end of this file
        (total, _magic, _crc, queue_id, _flag, queue_offset, _phys, sys_flag, _born) = unpack_head(
            buf, pos
        )
        tail = _TAILS[(bool(sys_flag & SYSFLAG_BORNHOST_V6), bool(sys_flag & SYSFLAG_STOREHOST_V6))]
        fields = tail.unpack_from(buf, pos + _OFFSET_OF_BORNHOST)
        if fields[7] < 0:  # a negative body length would read the topic from the header
            raise RecordError(f"record at {pos}: body length {fields[7]}")
        p = pos + _OFFSET_OF_BORNHOST + tail.size + fields[7]
        (topic_len,) = _U16.unpack_from(buf, p)
        raw_topic = bytes(buf[p + 2 : p + 2 + topic_len])
        topic = topics.get(raw_topic)
        if topic is None:
            topic = raw_topic.decode()
            if len(topics) < 100_000:
                topics[raw_topic] = topic
        p += 2 + topic_len
        (props_len,) = _U16.unpack_from(buf, p)
        if p + 2 + props_len > len(buf):  # a slice past the end would quietly be shorter
            raise RecordError(f"record at {pos}: properties run past the data")
        if props_len:
            props = bytes(buf[p + 2 : p + 2 + props_len])
            tags.append(_property(props, _TAGS_NAME, errors))
            keys.append(_property(props, _KEYS_NAME, errors))
            uniqs.append(_property(props, _UNIQ_NAME, errors))
        else:
            tags.append(None)
            keys.append(None)
            uniqs.append(None)
        offsets.append(base_offset + pos)
        sizes.append(total)
        qoffs.append(queue_offset)
        queues.append((topic, queue_id))
        stamps.append(fields[2])
        if total <= 0:
            raise RecordError(f"record at {pos}: total size {total}")
        pos += total
    return pos


def read_store_timestamp(buf: Buffer, pos: int) -> int:
    """STORETIMESTAMP of the record at ``pos``, without decoding the rest."""
    (sys_flag,) = struct.unpack_from(">i", buf, pos + _OFFSET_OF_SYSFLAG)
    host_size = 20 if sys_flag & SYSFLAG_BORNHOST_V6 else 8
    (ts,) = _I64.unpack_from(buf, pos + _OFFSET_OF_BORNHOST + host_size)
    return int(ts)


# -- the engine's other inner loops: reference implementations ---------------------------------


def scan_records_py(
    buf: Buffer, pos: int, limit: int, physical_offset: int, check_crc: bool
) -> tuple[int, int]:
    """Validate consecutive records from ``pos`` (CommitLog offset ``physical_offset``) while
    each is a whole V2 record that leaves room for a BLANK record before ``limit``; return
    (position after the last valid record, number of records). It stops at a BLANK record, at
    ``limit``, or before the first record ``validate`` refuses: the caller runs ``validate``
    there to learn why. This is the crash-recovery scan."""
    count = 0
    limit = min(limit, len(buf))
    while limit - pos >= BLANK_RECORD_SIZE:
        total, magic = _TOTAL_AND_MAGIC.unpack_from(buf, pos)
        if magic != MAGIC_CODE_V2 or not 0 < total <= limit - pos - BLANK_RECORD_SIZE:
            break
        try:
            validate(buf, pos, physical_offset, check_crc=check_crc)
        except RecordError:
            break
        pos += total
        physical_offset += total
        count += 1
    return pos, count


def tag_hashes_py(tags: Sequence[str | None]) -> np.ndarray:
    """``tag_hash`` of each entry, as int64."""
    return np.fromiter((tag_hash(t) for t in tags), np.int64, len(tags))


def index_entry_count_py(keys: Sequence[str | None], uniq_keys: Sequence[str | None]) -> int:
    """How many IndexFile entries ``index_keys`` makes for these records: one per unique id,
    one per key of ``KEYS``. The append path's disk-room check counts with it (decision 680);
    dispatch may write fewer (unindexed topics, records already indexed), never more."""
    count = 0
    for uniq in uniq_keys:
        if uniq:
            count += 1
    for value in keys:
        if value:
            count += len(split_keys(value))
    return count


def index_keys_py(
    queues: Sequence[tuple[str, int]],
    keys: Sequence[str | None],
    uniq_keys: Sequence[str | None],
) -> tuple[np.ndarray, np.ndarray]:
    """The IndexFile entries of a run of records: (key hashes, record numbers), both int64, in
    record order; per record the unique id first, then each key of ``KEYS`` in order. A hash
    is ``formats.key_hash(topic, key)``: the 31-bit CRC32C of ``topic#key``."""
    hashes: list[int] = []
    numbers: list[int] = []
    for i, (topic, _) in enumerate(queues):
        uniq = uniq_keys[i]
        if uniq:
            hashes.append(int(crc32c(f"{topic}#{uniq}".encode())) & 0x7FFFFFFF)
            numbers.append(i)
        for key in split_keys(keys[i]):
            hashes.append(int(crc32c(f"{topic}#{key}".encode())) & 0x7FFFFFFF)
            numbers.append(i)
    return np.asarray(hashes, np.int64), np.asarray(numbers, np.int64)


CqRun = tuple[tuple[str, int], int, int, int, int]


def cq_blocks_py(
    offsets: Sequence[int],
    sizes: Sequence[int],
    queue_offsets: Sequence[int],
    queues: Sequence[tuple[str, int]],
    tags: Sequence[str | None],
    tag_codes: dict[str | None, int],
) -> tuple[bytes, list[CqRun]]:
    """The ConsumeQueue entries of a dispatch pass, grouped for one write per run: ``(entries,
    runs)``, where ``entries`` holds every record's 20-byte entry (``formats.CQ_ENTRY``), the
    records of each queue together in record order, queues in order of first appearance, and a
    run ``(queue key, first queue offset, count, byte position in entries, CommitLog end of its
    last record)`` covers consecutive queue offsets of one queue. ``tag_codes`` caches
    ``tag_hash`` by tag (new tags are added)."""
    slot: dict[tuple[str, int], int] = {}
    members: list[list[int]] = []
    for i, key in enumerate(queues):
        j = slot.setdefault(key, len(members))
        if j == len(members):
            members.append([])
        members[j].append(i)
    parts: list[bytes] = []
    runs: list[CqRun] = []
    at = 0
    for idx in members:
        last_q = -2
        for i in idx:
            tag = tags[i]
            code = tag_codes.get(tag)
            if code is None:
                code = tag_codes[tag] = tag_hash(tag)
            parts.append(CQ_ENTRY.pack(offsets[i], sizes[i], code))
            q, end = queue_offsets[i], offsets[i] + sizes[i]
            if q == last_q + 1:
                key, first_q, count, pos, _ = runs[-1]
                runs[-1] = (key, first_q, count + 1, pos, end)
            else:
                runs.append((queues[i], q, 1, at, end))
            last_q = q
            at += CQ_ENTRY.size
    return b"".join(parts), runs


def index_put_py(
    mm: mmap.mmap,
    fd: int,
    slot_count: int,
    first: int,
    begin_timestamp: int,
    hashes: np.ndarray,
    offsets: np.ndarray,
    timestamps: np.ndarray,
) -> int:
    """Write IndexFile entries ``first, first + 1, ...`` (``hashes``, CommitLog ``offsets``,
    store ``timestamps``, in order, as if one at a time) and their hash slots; returns how many
    slots were empty before. Each entry links to the newest earlier entry of its slot: within
    this call the previous entry with the same slot, else what the slot held (0 where the slot
    is ahead of ``first``: written after the header was saved). Entries are written first (by
    ``pwrite``: their pages are not allocated, so a full disk is an error, not a SIGBUS), then
    the slots through the mapping; the caller saves the header last. The layout is
    ``tiered/hot/index_file.py``'s."""
    n = len(hashes)
    entries_at = INDEX_HEADER_SIZE + slot_count * INDEX_SLOT_SIZE + first * INDEX_ENTRY_SIZE
    if n <= _INDEX_SCALAR_MAX:
        # Entry by entry, in the same order of writes: the same bytes without numpy's fixed
        # cost, which a SYNC pass of a few records paid (decision 322).
        newest: dict[int, int] = {}  # slot -> the newest entry number this call gave it
        parts = []
        empty = 0
        for i, (khash, offset, stamp) in enumerate(
            zip(hashes.tolist(), offsets.tolist(), timestamps.tolist(), strict=True)
        ):
            slot = khash % slot_count
            link = newest.get(slot)
            if link is None:
                (link,) = _INDEX_SLOT.unpack_from(mm, INDEX_HEADER_SIZE + slot * INDEX_SLOT_SIZE)
                if link < 0 or link >= first:
                    link = 0  # written after the header was saved
                if link == 0:
                    empty += 1
            newest[slot] = first + i
            seconds = min(max((stamp - begin_timestamp) // 1000, 0), 0x7FFFFFFF)
            parts.append(_INDEX_ENTRY.pack(khash, offset, seconds, link))
        os.pwrite(fd, b"".join(parts), entries_at)
        for slot, number in newest.items():
            _INDEX_SLOT.pack_into(mm, INDEX_HEADER_SIZE + slot * INDEX_SLOT_SIZE, number)
        return empty
    slots_arr = np.frombuffer(mm, dtype=">i4", count=slot_count, offset=INDEX_HEADER_SIZE)
    numbers = np.arange(first, first + n, dtype=np.int64)
    slot_of = np.asarray(hashes, np.int64) % slot_count
    order = np.argsort(slot_of, kind="stable")
    sorted_slots = slot_of[order]
    sorted_numbers = numbers[order]
    head = np.ones(n, dtype=bool)
    head[1:] = sorted_slots[1:] != sorted_slots[:-1]
    tail = np.ones(n, dtype=bool)
    tail[:-1] = head[1:]
    prev_sorted = np.empty(n, dtype=np.int64)
    prev_sorted[1:] = sorted_numbers[:-1]
    held = slots_arr[sorted_slots[head]].astype(np.int64)
    held[(held < 0) | (held >= first)] = 0  # written after the header was saved
    prev_sorted[head] = held
    prev = np.empty(n, dtype=np.int64)
    prev[order] = prev_sorted
    entries = np.empty(n, dtype=INDEX_ENTRY_DTYPE)
    entries["hash"] = hashes
    entries["offset"] = offsets
    entries["seconds"] = np.clip(
        (np.asarray(timestamps, np.int64) - begin_timestamp) // 1000, 0, 0x7FFFFFFF
    )
    entries["prev"] = prev
    os.pwrite(fd, entries.tobytes(), entries_at)
    slots_arr[sorted_slots[tail]] = sorted_numbers[tail]
    del slots_arr  # the mapping may be closed once this returns
    return int(np.count_nonzero(held == 0))


# How many entries ``index_check_py`` reads at a time (its numpy arrays stay a few MB).
INDEX_CHECK_STEP = 1 << 20


def index_check_py(
    mm: Buffer, slot_count: int, n: int, begin_offset: int, full: bool
) -> tuple[int, int]:
    """The first thing wrong with an IndexFile's slots and entries ``1 .. n - 1`` (``n``: the
    header's next entry number; layout ``tiered/hot/index_file.py``'s), as ``put_many`` never
    writes it (decision 687): ``(0, 0)`` nothing; ``(1, slot)`` a slot naming an entry number
    outside ``[0, n)``; with ``full``, ``(2, slot)`` a slot whose entry has the hash of another
    slot, and ``(3, number)`` an entry with a negative hash or seconds, a link that is not to
    an older entry (0: none), a CommitLog offset below the previous entry's (the first entry's:
    below ``begin_offset``; entries are in record order, decision 756), or a link to an entry of
    another slot. Every slot is checked for ``(1, ...)`` before any for ``(2, ...)``; entries are
    checked ``INDEX_CHECK_STEP`` at a time, and within a step the links' slots only once every
    entry of it passed the rest (``(3, ...)`` names the first failing entry of that order)."""
    slots = np.frombuffer(mm, np.dtype(">i4"), slot_count, INDEX_HEADER_SIZE)
    entries = np.frombuffer(
        mm, INDEX_ENTRY_DTYPE, n, INDEX_HEADER_SIZE + slot_count * INDEX_SLOT_SIZE
    )
    try:
        heads = slots.astype(np.int64)
        bad = np.flatnonzero((heads < 0) | (heads >= n))
        if len(bad):
            return 1, int(bad[0])
        if not full:
            return 0, 0
        used = np.flatnonzero(heads)
        head_hashes = entries["hash"][heads[used]].astype(np.int64)
        wrong = np.flatnonzero(head_hashes % slot_count != used)
        if len(wrong):
            return 2, int(used[wrong[0]])
        del heads, used, head_hashes
        last = begin_offset
        for lo in range(1, n, INDEX_CHECK_STEP):
            hi = min(n, lo + INDEX_CHECK_STEP)
            part = entries[lo:hi]
            hashes = part["hash"].astype(np.int64)
            prev = part["prev"].astype(np.int64)
            numbers = np.arange(lo, hi, dtype=np.int64)
            linked = prev > 0
            ok = (hashes >= 0) & (prev >= 0) & (prev < numbers)
            offsets = part["offset"].astype(np.int64)
            ok &= offsets >= np.concatenate(([last], offsets[:-1]))
            last = int(offsets[-1])
            ok &= part["seconds"] >= 0
            if ok.all():
                targets = entries["hash"][prev[linked]].astype(np.int64)
                ok[linked] = targets % slot_count == hashes[linked] % slot_count
            if not ok.all():
                return 3, lo + int(np.argmin(ok))
        return 0, 0
    finally:
        del slots, entries


def dispatch_pass_py(
    offsets: Sequence[int],
    sizes: Sequence[int],
    queue_offsets: Sequence[int],
    queues: Sequence[tuple[str, int]],
    tags: Sequence[str | None],
    keys: Sequence[str | None],
    uniq_keys: Sequence[str | None],
    stamps: Sequence[int] | None,
    store_ts: int,
    tag_codes: dict[str | None, int],
    cq_table: Any,
    index_from: int,
    unindexed: frozenset[str],
    index: Any,
    put_index: Callable[..., Any],
) -> None:
    """A dispatch pass (``Dispatcher.apply``): the ConsumeQueue and IndexFile entries of a run of
    records in CommitLog order (the ``EncodedBatch`` columns; ``stamps`` per record, or empty
    for ``store_ts`` on all). Each run of ``cq_blocks_py`` goes to its queue's ``put_block``
    (``cq_table``: a ``ConsumeQueueTable``); then, unless every record lies below
    ``index_from``, the ``index_keys_py`` entries of records at or past ``index_from`` whose
    topic is not in ``unindexed`` go to ``put_index`` (``Dispatcher._put_index_entries`` over
    ``index``, an ``IndexService``) as (hashes, offsets, timestamps, store_ts, begin, end)."""
    entries, runs = cq_blocks_py(offsets, sizes, queue_offsets, queues, tags, tag_codes)
    view = memoryview(entries)
    get = cq_table.get_or_create
    for (topic, queue_id), first_q, count, at, physical_end in runs:
        get(topic, queue_id).put_block(first_q, view[at : at + count * CQ_ENTRY.size], physical_end)
    if not offsets:
        return
    end = offsets[-1] + sizes[-1]
    if end <= index_from:
        return
    hashes, numbers = index_keys_py(queues, keys, uniq_keys)
    record_offsets = np.asarray(offsets, np.int64)
    at_offsets = record_offsets[numbers]
    keep = at_offsets >= index_from
    if unindexed:
        keep &= np.array([q[0] not in unindexed for q in queues], bool)[numbers]
    if not keep.all():
        hashes, numbers, at_offsets = hashes[keep], numbers[keep], at_offsets[keep]
    times = (
        np.asarray(stamps, np.int64)[numbers]
        if stamps
        else np.full(len(numbers), store_ts, np.int64)
    )
    put_index(hashes, at_offsets, times, store_ts, max(offsets[0], index_from), end)


@dataclass(slots=True)
class DispatchColumns:
    """The dispatch fields of a run of records as flat int64 columns (``dispatch_columns``):
    what ``EncodedBatch`` carries as lists, without a Python object per record."""

    offsets: np.ndarray  # physical offset of each record
    sizes: np.ndarray
    queue_offsets: np.ndarray
    queue_numbers: np.ndarray  # each record's (topic, queue id), as an index into ``queues``
    tags: np.ndarray  # ``tag_hash`` of each record's TAGS
    store_timestamps: np.ndarray
    key_hashes: np.ndarray  # the IndexFile entries, as ``index_keys`` gives them
    key_records: np.ndarray
    queues: list[tuple[str, int]]

    @staticmethod
    def join(parts: Sequence[DispatchColumns]) -> DispatchColumns:
        """One run from consecutive runs (queue numbers renumbered into one table)."""
        if len(parts) == 1:
            return parts[0]
        numbers: dict[tuple[str, int], int] = {}
        renumbered = []
        records = 0
        key_records = []
        for part in parts:
            table = np.asarray([numbers.setdefault(q, len(numbers)) for q in part.queues], np.int64)
            renumbered.append(table[part.queue_numbers] if len(part.queues) else part.queue_numbers)
            key_records.append(part.key_records + records)
            records += len(part.offsets)

        def cat(name: str) -> np.ndarray:
            return np.concatenate([getattr(p, name) for p in parts])

        return DispatchColumns(
            cat("offsets"),
            cat("sizes"),
            cat("queue_offsets"),
            np.concatenate(renumbered),
            cat("tags"),
            cat("store_timestamps"),
            cat("key_hashes"),
            np.concatenate(key_records),
            list(numbers),
        )

    def __len__(self) -> int:
        return len(self.offsets)

    @property
    def end_offset(self) -> int:
        """Just past the last record."""
        return int(self.offsets[-1] + self.sizes[-1])

    def take(self, start: int, stop: int) -> DispatchColumns:
        """Records ``[start, stop)`` of the run (their keys renumbered from 0)."""
        keep = (self.key_records >= start) & (self.key_records < stop)
        return DispatchColumns(
            self.offsets[start:stop],
            self.sizes[start:stop],
            self.queue_offsets[start:stop],
            self.queue_numbers[start:stop],
            self.tags[start:stop],
            self.store_timestamps[start:stop],
            self.key_hashes[keep],
            self.key_records[keep] - start,
            self.queues,
        )


# What ``dispatch_columns`` returns: where it stopped, why, and the columns of what it took.
# Why: 0 the end of the run (validated: where ``scan_records`` stops; else a BLANK or ``limit``),
# 1 ``max_records`` taken, or a table of the native engine is full (call again from there), 2 the
# record there cannot be taken as columns (``read_dispatch_run`` says why).
ColumnsRun = tuple[int, int, DispatchColumns]


def _fields_within(buf: Buffer, pos: int) -> bool:
    """Whether the record at ``pos`` (not a BLANK one) has a positive size and its body, topic
    and properties lie within ``buf``: what the native column reader checks before it reads
    them (a slice past the end would quietly be shorter). A record whose magic code is not
    ``MAGIC_CODE_V2`` (BLANK padding, or damage) ends the run in both engines, however few
    bytes follow it, so it counts as within."""
    n = len(buf)
    if pos + 8 <= n and _I32.unpack_from(buf, pos + 4)[0] != MAGIC_CODE_V2:
        return True
    if pos + 48 > n:
        return False
    (total,) = _I32.unpack_from(buf, pos)
    (sys_flag,) = _I32.unpack_from(buf, pos + 36)
    body_at = (
        pos
        + 48
        + (20 if sys_flag & SYSFLAG_BORNHOST_V6 else 8)
        + 8
        + (20 if sys_flag & SYSFLAG_STOREHOST_V6 else 8)
        + 16
    )
    if body_at > n:
        return False
    (body_len,) = _I32.unpack_from(buf, body_at - 4)
    p = body_at + body_len
    if total <= 0 or body_len < 0 or p + 2 > n:
        return False
    (topic_len,) = _U16.unpack_from(buf, p)
    if p + 4 + topic_len > n:
        return False
    (props_len,) = _U16.unpack_from(buf, p + 2 + topic_len)
    return bool(p + 4 + topic_len + props_len <= n)


def dispatch_columns_py(
    buf: Buffer,
    pos: int,
    limit: int,
    base_offset: int,
    validate: bool,
    check_crc: bool,
    max_records: int,
) -> ColumnsRun:
    """The dispatch fields of the records from ``pos`` (``buf[0]`` is CommitLog offset
    ``base_offset``) as columns. With ``validate`` this is also the recovery scan: it takes
    exactly the records ``scan_records`` accepts and stops where it stops. Without, it takes the
    records that start before ``limit``, up to a BLANK record, as ``read_dispatch_run`` does."""
    stop = (
        scan_records_py(buf, pos, limit, base_offset + pos, check_crc)[0]
        if validate
        else min(limit, len(buf))  # as the native scan: nothing past the bytes at hand
    )
    out = EncodedBatch()
    stamps: list[int] = []
    status = 0
    while pos < stop:
        blank = pos + 8 <= len(buf) and _I32.unpack_from(buf, pos + 4)[0] != MAGIC_CODE_V2
        if blank and not validate:
            break  # the end of the run before "max_records taken", as the native scan answers
        if len(out.offsets) == max_records:
            status = 1 if validate or pos + 8 <= len(buf) else 2
            break
        one = EncodedBatch()
        one_stamps: list[int] = []
        if not _fields_within(buf, pos):
            status = 2  # a field runs past the bytes at hand: the record-by-record path says why
            break
        try:
            # Strict UTF-8, as the native columns: a value that is not UTF-8 goes to the
            # record-by-record path, which reads it as U+FFFD (decision 660).
            after = _read_dispatch_run(buf, pos, pos + 1, base_offset, one, one_stamps, "strict")
        except (RecordError, struct.error, UnicodeDecodeError):
            status = 2
            break
        if after == pos:
            break  # a BLANK record
        for name in ("offsets", "sizes", "queue_offsets", "queues", "tags", "keys", "uniq_keys"):
            getattr(out, name).extend(getattr(one, name))
        stamps += one_stamps
        pos = after
    numbers: dict[tuple[str, int], int] = {}
    queue_numbers = [numbers.setdefault(q, len(numbers)) for q in out.queues]
    key_hashes, key_records = index_keys_py(out.queues, out.keys, out.uniq_keys)
    n = len(out.offsets)
    return (
        pos,
        status,
        DispatchColumns(
            np.asarray(out.offsets, np.int64).reshape(n),
            np.asarray(out.sizes, np.int64).reshape(n),
            np.asarray(out.queue_offsets, np.int64).reshape(n),
            np.asarray(queue_numbers, np.int64).reshape(n),
            tag_hashes_py(out.tags),
            np.asarray(stamps, np.int64).reshape(n),
            key_hashes.reshape(-1),
            key_records.reshape(-1),
            list(numbers),
        ),
    )


@dataclass(slots=True, frozen=True)
class SegmentTables:
    """The tables of a segment object built over a run of records (``tiered/cold/segment.py``
    lays them out): one ConsumeQueue entry per record (position in the run, size, tag hash),
    the store timestamps (int64 big-endian), and the sorted key index ((key hash u32, record
    number u32) big-endian, per record its unique id and its keys)."""

    count: int
    offset_table: bytes
    time_table: bytes
    key_index: bytes
    key_count: int
    min_store_timestamp: int
    max_store_timestamp: int


def segment_tables_py(records: Buffer, base_offset: int) -> SegmentTables:
    """Check a run of whole records of one queue (structure, body CRC, queue offsets
    ``base_offset, base_offset + 1, …`` without gaps) and build its segment tables.

    Raises ``CorruptRecordError`` for a body that fails its CRC and ``RecordError`` for anything
    else (bytes that are not a record, an empty run, a queue offset out of sequence)."""
    fields = EncodedBatch()
    stamps: list[int] = []
    end = read_dispatch_run_py(records, 0, len(records), 0, fields, stamps)
    count = len(fields.offsets)
    if count == 0:
        raise RecordError("a segment needs at least one record")
    if end != len(records):
        raise RecordError(f"bytes at {end} are not a record")
    for pos in fields.offsets:
        (phys,) = _I64.unpack_from(records, pos + 28)
        validate(records, pos, phys, check_crc=True)
    for i, q in enumerate(fields.queue_offsets):
        if q != base_offset + i:
            raise RecordError(f"record has queue offset {q}, expected {base_offset + i}")
    table = np.empty(count, [("offset", ">i8"), ("size", ">i4"), ("tag", ">i8")])
    table["offset"] = fields.offsets
    table["size"] = fields.sizes
    table["tag"] = tag_hashes_py(fields.tags)
    hashes, numbers = index_keys_py(fields.queues, fields.keys, fields.uniq_keys)
    index = np.empty(len(hashes), [("hash", ">u4"), ("record", ">u4")])
    index["hash"] = hashes
    index["record"] = numbers
    index.sort(order=["hash", "record"])
    return SegmentTables(
        count=count,
        offset_table=table.tobytes(),
        time_table=np.asarray(stamps, ">i8").tobytes(),
        key_index=index.tobytes(),
        key_count=len(hashes),
        min_store_timestamp=min(stamps),
        max_store_timestamp=max(stamps),
    )


def gather_py(
    src: Buffer,
    positions: Ints,
    sizes: Ints,
    out: bytearray,
    at: int,
) -> int:
    """Copy ``src[positions[i] : positions[i] + sizes[i]]`` one after the other into ``out`` from
    ``at``, and return the position after the last (the offloader's gather of a queue's records
    from a CommitLog file). ``ValueError`` for a range outside ``src`` or ``out``."""
    view, target = memoryview(src), memoryview(out)
    for i, (pos, size) in enumerate(zip(positions, sizes, strict=True)):
        pos, size = int(pos), int(size)
        if pos < 0 or size <= 0 or pos + size > len(view) or at < 0 or at + size > len(target):
            raise ValueError(f"record {i} ({pos}+{size}) is outside the source or the output")
        target[at : at + size] = view[pos : pos + size]
        at += size
    return at


def check_span_py(
    buf: Buffer,
    positions: Ints,
    sizes: Ints,
    first_queue_offset: int,
) -> tuple[int, int]:
    """Check the records a cold read fetched: at each of ``positions`` a whole record (structure
    and body CRC, ``validate``) of the size in ``sizes``, with queue offsets
    ``first_queue_offset, first_queue_offset + 1, …``. Return ``(-1, 0)`` when every one is, else
    the index of the first that is not and why: -2 for a body that fails its CRC, -3 for a
    record that fails its record CRC (decision 210), -1 for anything else."""
    for i, (pos, size) in enumerate(zip(positions, sizes, strict=True)):
        pos, size = int(pos), int(size)
        if not 0 <= pos <= len(buf):  # past the end: and ``pos + 28`` overflows ssize_t near 2**63
            return i, -1
        try:
            (phys,) = _I64.unpack_from(buf, pos + 28)
            if validate(buf, pos, phys, check_crc=True) != size:
                return i, -1
            (queue_offset,) = _I64.unpack_from(buf, pos + 20)
        except RecordCrcError:
            return i, -3
        except CorruptRecordError:
            return i, -2
        except (RecordError, struct.error):
            return i, -1
        if queue_offset != first_queue_offset + i:
            return i, -1
    return -1, 0


def first_unchecked_py(
    messages: Sequence[Message], start: int, topics: set[str], max_queue_id: int, max_body: int
) -> int:
    """The index of the first message from ``start`` on that the store must check one by one:
    its topic is not in ``topics`` (names already found valid), its queue id is not in
    ``[0, max_queue_id]``, or its body is longer than ``max_body``; ``len(messages)`` if none."""
    for i in range(start, len(messages)):
        m = messages[i]
        if m.topic not in topics or not 0 <= m.queue_id <= max_queue_id or len(m.body) > max_body:
            return i
    return len(messages)


def decode_many_py(buf: Buffer, positions: Sequence[int], check_crc: bool) -> list[StoredMessage]:
    """``decode`` of the record at each of ``positions``, in order; raises what ``decode``
    raises for the first record it refuses."""
    return [decode(buf, int(pos), check_crc=check_crc) for pos in positions]


# -- choosing the engine ------------------------------------------------------------------------


def crc32c_py(data: Buffer) -> int:
    """CRC32C (Castagnoli) of ``data``, unsigned (google-crc32c, hardware-assisted)."""
    return int(crc32c(data if isinstance(data, bytes) else bytes(data)))


class _PythonEngine:
    """The reference implementation of every inner loop; ``tiered/_record_native.pyx`` is its
    native twin, with the same functions and byte-identical results."""

    name = "python"
    crc32c = staticmethod(crc32c_py)
    encode_batch = staticmethod(RecordEncoder.encode_batch_py)
    read_dispatch_run = staticmethod(read_dispatch_run_py)
    scan_records = staticmethod(scan_records_py)
    tag_hashes = staticmethod(tag_hashes_py)
    index_keys = staticmethod(index_keys_py)
    index_entry_count = staticmethod(index_entry_count_py)
    segment_tables = staticmethod(segment_tables_py)
    first_unchecked = staticmethod(first_unchecked_py)
    decode_many = staticmethod(decode_many_py)
    check_span = staticmethod(check_span_py)
    gather = staticmethod(gather_py)
    dispatch_columns = staticmethod(dispatch_columns_py)
    cq_blocks = staticmethod(cq_blocks_py)
    index_put = staticmethod(index_put_py)
    index_check = staticmethod(index_check_py)
    dispatch_pass = staticmethod(dispatch_pass_py)


PYTHON_ENGINE: Any = _PythonEngine()


def _native_engine() -> Any:
    try:
        from tiered import _record_native  # type: ignore[attr-defined]
    except ImportError:
        return None
    _record_native.bind(sys.modules[__name__])
    _record_native.bind_decode(sys.modules[__name__])
    return _record_native


NATIVE_ENGINE: Any = _native_engine()
# TMQ_PURE_PYTHON=1 forces the reference implementation (decision 150): for debugging, and to
# compare the two engines on one workload. The native engine is otherwise used when it is built.
_engine: Any = (
    PYTHON_ENGINE
    if NATIVE_ENGINE is None or os.environ.get("TMQ_PURE_PYTHON", "") not in ("", "0")
    else NATIVE_ENGINE
)
ENGINE_NAME: str = _engine.name


def engine_encode_batch() -> Callable[..., tuple[int, int]]:
    """The record engine in use's ``encode_batch(encoder, messages, start, ...)``: what
    ``RecordEncoder.encode_batch`` calls without a sink, for the native single send to call
    without that frame (decision 1020). Read when asked, so that a test that swaps the engine
    (``_engine``) before making a store gets the one it swapped in."""
    return _engine.encode_batch  # type: ignore[no-any-return]


def crc32c_of(data: Buffer) -> int:
    """CRC32C (Castagnoli) of ``data``, unsigned: BODYCRC, segment and footer checksums."""
    return int(_engine.crc32c(data))


def read_dispatch_run(
    buf: Buffer,
    pos: int,
    limit: int,
    base_offset: int,
    out: EncodedBatch,
    stamps: list[int],
) -> int:
    """Append the dispatch fields of every record from ``pos`` up to ``limit`` (or a BLANK
    record) to ``out``, and each STORETIMESTAMP to ``stamps``; return the position after the
    last one. ``base_offset`` is the CommitLog offset of ``buf[0]``. The records have been
    validated already (append or recovery): this is the dispatch scan."""
    return int(_engine.read_dispatch_run(buf, pos, limit, base_offset, out, stamps))


def scan_records(
    buf: Buffer, pos: int, limit: int, physical_offset: int, *, check_crc: bool
) -> tuple[int, int]:
    """See ``scan_records_py`` (the recovery scan)."""
    end, count = _engine.scan_records(buf, pos, limit, physical_offset, check_crc)
    return int(end), int(count)


def tag_hashes(tags: Sequence[str | None]) -> np.ndarray:
    """See ``tag_hashes_py``."""
    result: np.ndarray = _engine.tag_hashes(tags)
    return result


def index_keys(
    queues: Sequence[tuple[str, int]],
    keys: Sequence[str | None],
    uniq_keys: Sequence[str | None],
) -> tuple[np.ndarray, np.ndarray]:
    """See ``index_keys_py`` (the dispatch's IndexFile entries)."""
    hashes, numbers = _engine.index_keys(queues, keys, uniq_keys)
    return hashes, numbers


# See ``index_entry_count_py`` (the append path's count of IndexFile entries): the engine's own
# function, without a wrapper's call on the append path.
index_entry_count: Callable[[Sequence[str | None], Sequence[str | None]], int] = (
    _engine.index_entry_count
)


def segment_tables(records: Buffer, base_offset: int) -> SegmentTables:
    """See ``segment_tables_py`` (the offloader's segment build)."""
    result: SegmentTables = _engine.segment_tables(records, base_offset)
    return result


def first_unchecked(
    messages: Sequence[Message], start: int, topics: set[str], max_queue_id: int, max_body: int
) -> int:
    """See ``first_unchecked_py`` (the append path's checks, for a batch in one call)."""
    return int(_engine.first_unchecked(messages, start, topics, max_queue_id, max_body))


def decode_many(
    buf: Buffer, positions: Sequence[int], *, check_crc: bool = True
) -> list[StoredMessage]:
    """See ``decode_many_py`` (the cold fetcher's and the CommitLog reader's decode of a run)."""
    result: list[StoredMessage] = _engine.decode_many(buf, positions, check_crc)
    return result


def check_span(
    buf: Buffer,
    positions: Ints,
    sizes: Ints,
    first_queue_offset: int,
) -> tuple[int, int]:
    """See ``check_span_py`` (the cold read's check of what it fetched)."""
    bad, kind = _engine.check_span(buf, positions, sizes, first_queue_offset)
    return int(bad), int(kind)


def gather(
    src: Buffer,
    positions: Ints,
    sizes: Ints,
    out: bytearray,
    at: int,
) -> int:
    """See ``gather_py`` (the offloader's gather of a segment's records)."""
    return int(_engine.gather(src, positions, sizes, out, at))


def dispatch_columns(
    buf: Buffer,
    pos: int,
    limit: int,
    base_offset: int,
    *,
    validate: bool,
    check_crc: bool = True,
    max_records: int = 1 << 20,
) -> ColumnsRun:
    """See ``dispatch_columns_py`` (the dispatch scan as columns; with ``validate`` also the
    recovery scan). The native engine's columns are arrays built without the GIL."""
    end, status, cols = _engine.dispatch_columns(
        buf, pos, limit, base_offset, validate, check_crc, max_records
    )
    if not isinstance(cols, DispatchColumns):
        cols = DispatchColumns(*cols)
    return int(end), int(status), cols


def cq_blocks(
    offsets: Sequence[int],
    sizes: Sequence[int],
    queue_offsets: Sequence[int],
    queues: Sequence[tuple[str, int]],
    tags: Sequence[str | None],
    tag_codes: dict[str | None, int],
) -> tuple[bytes, list[CqRun]]:
    """See ``cq_blocks_py`` (the dispatch's ConsumeQueue entries of a pass, in one call)."""
    entries, runs = _engine.cq_blocks(offsets, sizes, queue_offsets, queues, tags, tag_codes)
    return entries, runs


def index_put(
    mm: mmap.mmap,
    fd: int,
    slot_count: int,
    first: int,
    begin_timestamp: int,
    hashes: np.ndarray,
    offsets: np.ndarray,
    timestamps: np.ndarray,
) -> int:
    """See ``index_put_py`` (the dispatch's IndexFile entries and slots, in one call)."""
    return int(
        _engine.index_put(mm, fd, slot_count, first, begin_timestamp, hashes, offsets, timestamps)
    )


def index_check(
    mm: Buffer, slot_count: int, n: int, begin_offset: int, full: bool
) -> tuple[int, int]:
    """See ``index_check_py`` (an IndexFile's structure check at start, in one call)."""
    kind, where = _engine.index_check(mm, slot_count, n, begin_offset, full)
    return int(kind), int(where)


def dispatch_pass(
    batch: EncodedBatch,
    tag_codes: dict[str | None, int],
    cq_table: Any,
    index_from: int,
    unindexed: frozenset[str],
    index: Any,
    put_index: Callable[..., Any],
) -> None:
    """See ``dispatch_pass_py`` (a dispatch pass in one call: natively, the ConsumeQueue entries
    copied into their files' mappings and the IndexFile entries put without the GIL, with Python
    only for file rolls and out-of-line runs, decision 695)."""
    _engine.dispatch_pass(
        batch.offsets,
        batch.sizes,
        batch.queue_offsets,
        batch.queues,
        batch.tags,
        batch.keys,
        batch.uniq_keys,
        batch.store_timestamps,
        batch.store_timestamp,
        tag_codes,
        cq_table,
        index_from,
        unindexed,
        index,
        put_index,
    )
