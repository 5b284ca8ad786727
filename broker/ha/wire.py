"""The replication wire format: CommitLog bytes from a master to a slave over one TCP connection.

The slave connects to the master's replication port. Every frame, both ways:

| field  | bytes | meaning                                        |
|--------|-------|------------------------------------------------|
| length | 4     | bytes after this field (type + body), unsigned |
| type   | 1     | one of ``FrameType``                           |
| body   | n     | per type, below; integers big-endian           |

Bodies:

- ``HELLO`` (slave -> master, first frame): version u16, broker id u32, CommitLog file size i64,
  max offset i64, confirmed offset i64, entry count u32, then per epoch entry: epoch u32,
  start offset i64.
- ``WELCOME`` (master -> slave, the answer): version u16, master epoch u32, min offset i64,
  max offset i64, confirmed offset i64, entry count u32, then the master's epoch entries.
- ``ACK`` (slave -> master): offset i64. The first ACK after WELCOME says where to start
  (the slave's CommitLog end after any truncation); every later one that everything below it is
  appended (and fsynced when the slave's flush is SYNC).
- ``DATA`` (master -> slave): epoch u32 (of the term that wrote these bytes), offset i64
  (physical offset of the first byte), master max offset i64, confirmed offset i64, then the
  bytes: whole CommitLog records within one file and one epoch. No bytes: a heartbeat.
- ``ERROR`` (either way): a UTF-8 reason; the sender closes the connection after it.
- ``METADATA`` (master -> slave): the master's topics, groups and consumer offsets as UTF-8 JSON
  (``BrokerMetadata.snapshot``); sent after WELCOME and as soon as they change.
- ``AUTH`` (both ways, before HELLO, only with ``[auth]`` on; broker/ha/link.py): access key
  (u16 length + UTF-8), nonce (u8 length + bytes), proof (u8 length + bytes). The slave sends
  its key and nonce; the master answers with its key, its nonce and its proof; the slave sends
  its proof (key and nonce empty). A DATA frame's confirmed offset moves with every ACK that
  moves it: an idle master sends a heartbeat with the new value at once.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from enum import IntEnum
from typing import Protocol

from tiered.epoch_file import EpochEntry

VERSION = 1
# A frame never carries more than this (a 4 MiB body in one record, and headers).
MAX_FRAME = 16 << 20

_LEN_TYPE = struct.Struct(">IB")
_HELLO = struct.Struct(">HIqqqI")
_WELCOME = struct.Struct(">HIqqqI")
_ENTRY = struct.Struct(">Iq")
_ACK = struct.Struct(">q")
_DATA = struct.Struct(">Iqqq")


_U16 = struct.Struct(">H")


class Connection(Protocol):
    """What frames travel over: a connected TCP socket, or a TLS session on one
    (``link.TlsConnection``)."""

    def sendall(self, data: bytes | memoryview, /) -> None: ...

    def recv_into(self, buffer: memoryview, nbytes: int = 0, /) -> int: ...

    def shutdown(self, how: int, /) -> None: ...

    def close(self) -> None: ...


class FrameType(IntEnum):
    HELLO = 1
    WELCOME = 2
    ACK = 3
    DATA = 4
    ERROR = 5
    METADATA = 6
    AUTH = 7


class ProtocolError(ConnectionError):
    """The peer sent something this protocol does not allow, or an ERROR frame."""


@dataclass(slots=True, frozen=True)
class Hello:
    broker_id: int
    file_size: int
    max_offset: int
    confirmed_offset: int
    epochs: list[EpochEntry]
    version: int = VERSION


@dataclass(slots=True, frozen=True)
class Welcome:
    epoch: int
    min_offset: int
    max_offset: int
    confirmed_offset: int
    epochs: list[EpochEntry]
    version: int = VERSION


@dataclass(slots=True, frozen=True)
class Data:
    epoch: int
    offset: int
    master_max_offset: int
    confirmed_offset: int
    # bytes, or (from ``FrameReader``) a view of its buffer, valid until its next frame.
    payload: bytes | memoryview


@dataclass(slots=True, frozen=True)
class Auth:
    access_key: str = ""
    nonce: bytes = b""
    proof: bytes = b""


def _entries(entries: list[EpochEntry]) -> bytes:
    return b"".join(_ENTRY.pack(e.epoch, e.start_offset) for e in entries)


def _read_entries(body: bytes, pos: int, count: int) -> list[EpochEntry]:
    if len(body) != pos + count * _ENTRY.size:
        raise ProtocolError("epoch entries do not match their count")
    return [EpochEntry(*_ENTRY.unpack_from(body, pos + i * _ENTRY.size)) for i in range(count)]


def _frame(kind: FrameType, body: bytes) -> bytes:
    return _LEN_TYPE.pack(len(body) + 1, kind) + body


def encode_hello(h: Hello) -> bytes:
    head = _HELLO.pack(
        h.version, h.broker_id, h.file_size, h.max_offset, h.confirmed_offset, len(h.epochs)
    )
    return _frame(FrameType.HELLO, head + _entries(h.epochs))


def encode_welcome(w: Welcome) -> bytes:
    head = _WELCOME.pack(
        w.version, w.epoch, w.min_offset, w.max_offset, w.confirmed_offset, len(w.epochs)
    )
    return _frame(FrameType.WELCOME, head + _entries(w.epochs))


def encode_ack(offset: int) -> bytes:
    return _frame(FrameType.ACK, _ACK.pack(offset))


def encode_data_header(d: Data) -> bytes:
    """The frame up to the payload: send it and the payload without joining them."""
    head = _DATA.pack(d.epoch, d.offset, d.master_max_offset, d.confirmed_offset)
    return _LEN_TYPE.pack(1 + len(head) + len(d.payload), FrameType.DATA) + head


def encode_metadata(document: bytes) -> bytes:
    return _frame(FrameType.METADATA, document)


def encode_auth(a: Auth) -> bytes:
    key = a.access_key.encode()
    nonce = bytes([len(a.nonce)]) + a.nonce
    return _frame(
        FrameType.AUTH, _U16.pack(len(key)) + key + nonce + bytes([len(a.proof)]) + a.proof
    )


def decode_auth(body: bytes) -> Auth:
    try:
        (n,) = _U16.unpack_from(body)
        key = body[2 : 2 + n].decode()
        pos = 2 + n
        nonce = body[pos + 1 : pos + 1 + body[pos]]
        pos += 1 + body[pos]
        proof = body[pos + 1 : pos + 1 + body[pos]]
        pos += 1 + body[pos]
    except (struct.error, IndexError, UnicodeDecodeError):
        raise ProtocolError("bad AUTH") from None
    if pos != len(body):
        raise ProtocolError("bad AUTH")
    return Auth(key, nonce, proof)


def encode_error(reason: str) -> bytes:
    return _frame(FrameType.ERROR, reason.encode()[:4096])


def _recv_into(sock: Connection, view: memoryview) -> None:
    got, n = 0, len(view)
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise ConnectionError("the peer closed the replication connection")
        got += k


class FrameReader:
    """Reads frames into one buffer it reuses: the body it returns is a view of that buffer,
    valid until the next ``read``. A slave's DATA payload goes from there to its CommitLog
    without a copy of its own."""

    def __init__(self, sock: Connection, buffer_bytes: int = 64 << 10) -> None:
        self.sock = sock
        self._head = memoryview(bytearray(_LEN_TYPE.size))
        self._buf = bytearray(buffer_bytes)

    def read(self) -> tuple[FrameType, memoryview]:
        _recv_into(self.sock, self._head)
        length, kind = _LEN_TYPE.unpack(self._head)
        if not 1 <= length <= MAX_FRAME:
            raise ProtocolError(f"frame of {length} bytes")
        try:
            frame_type = FrameType(kind)
        except ValueError:
            raise ProtocolError(f"unknown frame type {kind}") from None
        if len(self._buf) < length - 1:
            self._buf = bytearray(length - 1)
        body = memoryview(self._buf)[: length - 1]
        _recv_into(self.sock, body)
        if frame_type is FrameType.ERROR:
            raise ProtocolError(f"peer: {bytes(body).decode(errors='replace')}")
        return frame_type, body


def read_frame(sock: Connection) -> tuple[FrameType, bytes]:
    """One frame, its body as new ``bytes`` (the handshake, tests)."""
    kind, body = FrameReader(sock, 0).read()
    return kind, bytes(body)


def expect(sock: Connection, wanted: FrameType) -> bytes:
    kind, body = read_frame(sock)
    if kind is not wanted:
        raise ProtocolError(f"expected {wanted.name}, got {kind.name}")
    return body


def decode_hello(body: bytes) -> Hello:
    if len(body) < _HELLO.size:
        raise ProtocolError("short HELLO")
    version, broker_id, file_size, max_offset, confirmed, n = _HELLO.unpack_from(body)
    if version != VERSION:
        raise ProtocolError(f"replication protocol version {version}; this master speaks {VERSION}")
    return Hello(broker_id, file_size, max_offset, confirmed, _read_entries(body, _HELLO.size, n))


def decode_welcome(body: bytes) -> Welcome:
    if len(body) < _WELCOME.size:
        raise ProtocolError("short WELCOME")
    version, epoch, lo, hi, confirmed, n = _WELCOME.unpack_from(body)
    if version != VERSION:
        raise ProtocolError(f"replication protocol version {version}; this slave speaks {VERSION}")
    return Welcome(epoch, lo, hi, confirmed, _read_entries(body, _WELCOME.size, n))


def decode_ack(body: bytes | memoryview) -> int:
    if len(body) != _ACK.size:
        raise ProtocolError("bad ACK")
    return int(_ACK.unpack(body)[0])


def decode_data(body: bytes | memoryview) -> Data:
    if len(body) < _DATA.size:
        raise ProtocolError("short DATA")
    epoch, offset, master_max, confirmed = _DATA.unpack_from(body)
    return Data(epoch, offset, master_max, confirmed, body[_DATA.size :])
