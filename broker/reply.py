"""Cold reads answered as reply bytes: what a PullMessage stream sends, written in the cold worker.

A replay from the archive used to cost the broker, per message, a ``StoredMessage`` (the record
engine's decode), a ``d.Message`` (``to_proto_message``) and protobuf's serialization, all under
the interpreter lock that every append needs: a heavy replay made produce p99 jump. The cold
fetcher now asks its worker (a child process, ``tiered/cold/worker.py``) to write, beside each
span of records it fetches, the serialized ``PullMessageResponse(message=...)`` of every record
(``encode_pull_replies``, given to the fetcher as its ``reply_encoder``). The broker sends those
bytes as they are (``remoting.servicers`` passes a ``bytes`` response through its serializer):
nothing per message is built in the broker but the slice of the buffer.

A reply depends only on the record: PullMessage answers with the stored topic, no namespace, no
receipt handle, and the delivery attempt from the record's reconsume times. ReceiveMessage
(receipt handles, attempts per delivery) keeps the decoded path.

``encode_pull_replies_py`` is the reference (the broker's own ``to_proto_message`` and
protobuf); ``broker/_reply_native.pyx`` writes the same bytes field by field, and hands it any
message it does not take as it is. Tests compare the two byte for byte.
"""

from __future__ import annotations

from typing import Any

from rocketmq.grpc_protocol import definition_pb2 as d
from rocketmq.grpc_protocol import service_pb2 as s

from broker.protocol import _HIDDEN, MESSAGE_TYPE_VALUES, to_proto_message
from tiered.record import Buffer, StoredMessage, decode_many

# The replies of a run of records: their bytes back to back, where each ends, and each body's size.
Replies = tuple[bytes, list[int], list[int]]


def pull_reply(m: StoredMessage) -> bytes:
    """One record as the PullMessageResponse that carries it (the reference)."""
    reply = s.PullMessageResponse(message=to_proto_message(m, m.topic, None, None, None))
    raw: bytes = reply.SerializeToString()
    return raw


def encode_pull_replies_py(data: Buffer, positions: list[int]) -> Replies:
    """The reference: each record decoded, built as protobuf objects and serialized."""
    messages = decode_many(data, positions, check_crc=False)
    parts = [pull_reply(m) for m in messages]
    ends, at = [], 0
    for part in parts:
        at += len(part)
        ends.append(at)
    return b"".join(parts), ends, [len(m.body) for m in messages]


def _native() -> Any:
    try:
        from broker import _reply_native  # type: ignore[attr-defined]
    except ImportError:  # not built: the reference serves
        return None
    return _reply_native


_NATIVE = _native()
_TYPES = dict(MESSAGE_TYPE_VALUES)
# The same, as the bytes the records hold, for the writer that reads records (decision 481).
_HIDDEN_NAMES = tuple(sorted(name.encode() for name in _HIDDEN))
_TYPE_NAMES = tuple((name.encode(), value) for name, value in _TYPES.items())


def _one_reply(data: Buffer, position: int) -> tuple[bytes, int]:
    """The reply of one record the native writer does not take as it is, written from its
    decoded message (the writer of decision 400), and its body's size."""
    messages = decode_many(data, [position], check_crc=False)
    reply, _, bodies = _NATIVE.encode(messages, _HIDDEN, _TYPES, d.NORMAL, pull_reply)
    return reply, bodies[0]


def encode_pull_replies(data: Buffer, positions: list[int]) -> Replies:
    """The PullMessageResponse bytes of the records at ``positions`` of ``data`` (checked
    already): a job of the cold worker, given to ``ColdFetcher`` as its ``reply_encoder``."""
    if _NATIVE is None:
        return encode_pull_replies_py(data, positions)
    result: Replies = _NATIVE.encode_records(
        data, positions, _HIDDEN_NAMES, _TYPE_NAMES, d.NORMAL, _one_reply
    )
    return result


def encode_pull_replies_decoded(data: Buffer, positions: list[int]) -> Replies:
    """``encode_pull_replies`` through decoded messages (decision 400's writer): what the
    record-bytes writer is checked against byte for byte."""
    messages = decode_many(data, positions, check_crc=False)
    result: Replies = _NATIVE.encode(messages, _HIDDEN, _TYPES, d.NORMAL, pull_reply)
    return result
