"""Conversion between ``apache.rocketmq.v2`` protobuf messages and the store's records.

The stubs are the ones shipped in Apache's ``rocketmq-python-client`` (``rocketmq.grpc_protocol``),
so the wire format is exactly the client's. (Importing them runs that package's ``__init__``,
which creates the client's log directory ``~/logs/rocketmq_python``.)
"""

from __future__ import annotations

import functools
import hashlib
import ipaddress
import re
import zlib
from collections.abc import Callable, Sequence
from typing import Any

from google.protobuf import duration_pb2, timestamp_pb2
from rocketmq.grpc_protocol import definition_pb2 as d
from rocketmq.grpc_protocol import service_pb2 as s

import tiered.record
from broker.metadata import PERM_READ, PERM_WRITE, Limits, TopicConfig
from broker.stored_properties import INT32_MAX, TIMESTAMP_MAX_MS, TIMESTAMP_MIN_MS
from broker.timer import PROPERTY_ROLLED_FROM, PROPERTY_TIMER_OFFSET
from broker.transaction import PROPERTY_CHECK_IMMUNITY_MS, PROPERTY_HALF_OFFSET, PROPERTY_TXN_ID
from tiered.record import (
    ENGINE_NAME,
    NATIVE_ENGINE,
    PROPERTY_KEYS,
    PROPERTY_SHARDING_KEY,
    PROPERTY_TAGS,
    PROPERTY_UNIQ_KEY,
    Host,
    Message,
    StoredMessage,
)

# System properties kept as record properties, beside the user's.
PROPERTY_MESSAGE_TYPE = "__MESSAGE_TYPE"
PROPERTY_DELIVER_TIME = "__STARTDELIVERTIME"
# RocketMQ's MessageConst.STRING_HASH_SET: system properties. A producer may not set them
# (ILLEGAL_MESSAGE_PROPERTY_KEY) and a consumer never sees them among the user properties. The
# message group ``__SHARDINGKEY`` is not one of them: the proxy hands it to consumers as a user
# property as well as ``message_group``.
# fmt: off
ROCKETMQ_SYSTEM_PROPERTIES = frozenset((
    "TRACE_ON", "MSG_REGION", "KEYS", "TAGS", "WAIT", "DELAY", "RETRY_TOPIC", "REAL_TOPIC",
    "REAL_QID", "TRAN_MSG", "PGROUP", "MIN_OFFSET", "MAX_OFFSET", "BUYER_ID", "ORIGIN_MESSAGE_ID",
    "TRANSFER_FLAG", "CORRECTION_FLAG", "MQ2_FLAG", "RECONSUME_TIME", "UNIQ_KEY",
    "MAX_RECONSUME_TIMES", "CONSUME_START_TIME", "POP_CK", "POP_CK_OFFSET", "1ST_POP_TIME",
    "TRAN_PREPARED_QUEUE_OFFSET", "DUP_INFO", "EXTEND_UNIQ_INFO", "INSTANCE_ID", "CORRELATION_ID",
    "REPLY_TO_CLIENT", "TTL", "ARRIVE_TIME", "PUSH_REPLY_TIME", "CLUSTER", "MSG_TYPE",
    "INNER_MULTI_QUEUE_OFFSET", "TIMER_DELAY_SEC", "TIMER_DELIVER_MS", "TIMER_ENQUEUE_MS",
    "TIMER_DEQUEUE_MS", "TIMER_ROLL_TIMES", "TIMER_OUT_MS", "TIMER_DEL_UNIQKEY",
    "TIMER_DELAY_LEVEL", "__BORNHOST", "BORN_TIMESTAMP", "__CRC32#",
))
# fmt: on
# tmq's own record properties, hidden from consumers like the system properties above.
_INTERNAL = frozenset(
    (
        PROPERTY_MESSAGE_TYPE,
        PROPERTY_DELIVER_TIME,
        PROPERTY_HALF_OFFSET,
        PROPERTY_CHECK_IMMUNITY_MS,
        PROPERTY_TIMER_OFFSET,
        PROPERTY_ROLLED_FROM,
        PROPERTY_TXN_ID,
    )
)
_HIDDEN = ROCKETMQ_SYSTEM_PROPERTIES | _INTERNAL
# Names a producer may not use as user properties: the hidden ones and the message group.
_RESERVED_KEYS = _HIDDEN | {PROPERTY_SHARDING_KEY}
# The proxy's maxMessageGroupSize: a message group must be shorter than this (UTF-8 bytes).
MAX_MESSAGE_GROUP_BYTES = 64
# What every official client can receive in one gRPC message: grpc-js (Node) and grpcio (Python)
# keep gRPC's default 4 MiB receive limit, and each delivered message travels in its own
# ReceiveMessageResponse / PullMessageResponse.
CLIENT_RECEIVE_LIMIT = 4 * 1024 * 1024
# The proxy's maxTransactionRecoverySecond: a longer orphaned-transaction recovery is refused.
MAX_TRANSACTION_RECOVERY_MS = 3_600_000
# Room for what the broker adds to a message on delivery: receipt handle, store host, offsets,
# timestamps, the topic and the response's framing (measured well under 1 KiB).
DELIVERY_ENVELOPE_RESERVE = 2048

MESSAGE_TYPE_NAMES = {
    d.NORMAL: "NORMAL",
    d.FIFO: "FIFO",
    d.DELAY: "DELAY",
    d.TRANSACTION: "TRANSACTION",
}
MESSAGE_TYPE_VALUES = {v: k for k, v in MESSAGE_TYPE_NAMES.items()}


class ProtocolError(Exception):
    """A request the broker refuses; ``code`` is the ``apache.rocketmq.v2.Code`` to answer with."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def status(code: int = d.OK, message: str = "OK") -> d.Status:
    return d.Status(code=code, message=message)


def permission(perm: int) -> int:
    readable, writable = bool(perm & PERM_READ), bool(perm & PERM_WRITE)
    if readable and writable:
        return int(d.READ_WRITE)
    if readable:
        return int(d.READ)
    return int(d.WRITE) if writable else int(d.NONE)


def endpoints(host: str, port: int) -> d.Endpoints:
    try:
        scheme = d.IPv6 if ipaddress.ip_address(host).version == 6 else d.IPv4
    except ValueError:
        scheme = d.DOMAIN_NAME
    return d.Endpoints(scheme=scheme, addresses=[d.Address(host=host, port=port)])


def message_queue(
    topic: str,
    queue_id: int,
    perm: int,
    message_type: str,
    broker_name: str,
    host: str,
    port: int,
    namespace: str = "",
) -> d.MessageQueue:
    return d.MessageQueue(
        topic=d.Resource(name=topic, resource_namespace=namespace),
        id=queue_id,
        permission=permission(perm),
        broker=d.Broker(name=broker_name, id=0, endpoints=endpoints(host, port)),
        accept_message_types=[MESSAGE_TYPE_VALUES.get(message_type, d.NORMAL)],
    )


def _ms(ts: timestamp_pb2.Timestamp) -> int:
    return int(ts.seconds * 1000 + ts.nanos // 1_000_000)


def _timestamp_ms(ts: timestamp_pb2.Timestamp) -> int | None:
    """``ts`` in ms, or None when it is not a valid Timestamp (protobuf's ``isValid``: seconds
    in the range above, nanos in [0, 10**9))."""
    if not 0 <= ts.nanos < 1_000_000_000:
        return None
    ms = _ms(ts)
    return ms if TIMESTAMP_MIN_MS <= ms <= TIMESTAMP_MAX_MS else None


def born_ms(sp: d.SystemProperties) -> int:
    """A produced message's born time in ms; 0 (unset) when absent or not a valid Timestamp:
    the proxy ignores a born time it cannot read (``Timestamps.isValid``) rather than refuse
    the message, and the stored record must stay deliverable."""
    return (_timestamp_ms(sp.born_timestamp) or 0) if sp.HasField("born_timestamp") else 0


def delivery_ms(ts: timestamp_pb2.Timestamp) -> int:
    """A produced delivery time in ms, refused with ILLEGAL_DELIVERY_TIME (the proxy's code for
    a delivery time it does not take) when it is not a valid Timestamp. The Python client
    writes the user's millisecond value into ``seconds`` unconverted: seconds past 10**11
    (year 5138) are read as milliseconds."""
    seconds = ts.seconds
    ms = seconds if seconds > 10**11 else _timestamp_ms(ts)
    if ms is None or not TIMESTAMP_MIN_MS <= ms <= TIMESTAMP_MAX_MS:
        raise ProtocolError(
            d.ILLEGAL_DELIVERY_TIME,
            f"delivery timestamp (seconds {seconds}, nanos {ts.nanos}) is outside protobuf's "
            "Timestamp range, 0001-01-01 to 9999-12-31",
        )
    return ms


def transaction_recovery_ms(sp: d.SystemProperties) -> int | None:
    """A half message's orphaned-transaction recovery duration in ms; None: the broker's
    transaction timeout (absent, zero or negative). Longer than the proxy's hour, or not a
    valid Duration, it is refused with BAD_REQUEST, the proxy's code."""
    if not sp.HasField("orphaned_transaction_recovery_duration"):
        return None
    value = sp.orphaned_transaction_recovery_duration
    ms = duration_ms(value)
    if abs(value.nanos) >= 1_000_000_000 or ms > MAX_TRANSACTION_RECOVERY_MS:
        raise ProtocolError(
            d.BAD_REQUEST,
            f"orphaned transaction recovery duration (seconds {value.seconds}, nanos "
            f"{value.nanos}) is not a valid duration of at most "
            f"{MAX_TRANSACTION_RECOVERY_MS // 1000} s",
        )
    return ms if ms > 0 else None


def to_store_message(
    pm: d.Message, topic: TopicConfig, queue_id: int, limits: Limits, peer_host: str
) -> Message:
    """Check one produced message and turn it into a store Message."""
    sp = pm.system_properties
    body = pm.body
    if sp.body_encoding == d.GZIP:
        body = inflate(body, limits.max_body_bytes)
    if not body:
        raise ProtocolError(d.MESSAGE_BODY_EMPTY, "message body is empty")
    if len(body) > limits.max_body_bytes:
        raise ProtocolError(
            d.MESSAGE_BODY_TOO_LARGE,
            f"message body is {len(body)} bytes; the limit is {limits.max_body_bytes}",
        )
    if len(pm.user_properties) > limits.max_properties:
        raise ProtocolError(
            d.MESSAGE_PROPERTIES_TOO_LARGE,
            f"too many user properties ({len(pm.user_properties)}); "
            f"the limit is {limits.max_properties}",
        )
    props: dict[str, str] = {}
    # The proxy counts user properties, the tag and the keys, in UTF-8 bytes.
    size = 0
    # Sorted by key: protobuf's map iterates in its hash table's order, which is neither the
    # producer's nor stable across protobuf releases; sorted, the stored record is the same
    # whichever path (or protobuf) converts it, and the native walker can match it (decision 390).
    for key, value in sorted(pm.user_properties.items()):
        if not key or key in _RESERVED_KEYS:
            raise ProtocolError(
                d.ILLEGAL_MESSAGE_PROPERTY_KEY, f"property is used by system: {key!r}"
            )
        if _control(key) or _control(value):
            raise ProtocolError(
                d.ILLEGAL_MESSAGE_PROPERTY_KEY,
                f"property {key!r}: the key and value cannot contain control characters",
            )
        size += len(key.encode()) + len(value.encode())
        props[key] = value
    # A tag or message group that is present but empty is refused (the proxy takes it as
    # absent): a client that sets the field meant something by it.
    if sp.HasField("tag"):
        if not sp.tag.strip() or "|" in sp.tag or _control(sp.tag):
            raise ProtocolError(
                d.ILLEGAL_MESSAGE_TAG,
                f"illegal tag {sp.tag!r}: blank, '|' and control characters are not allowed",
            )
        props[PROPERTY_TAGS] = sp.tag
        size += len(sp.tag.encode())
    if sp.keys:
        for key in sp.keys:
            # A space separates keys in the stored record (RocketMQ's KEY_SEPARATOR).
            if not key.strip() or " " in key or _control(key):
                raise ProtocolError(
                    d.ILLEGAL_MESSAGE_KEY,
                    f"illegal message key {key!r}: blank, spaces and control characters "
                    "are not allowed",
                )
            size += len(key.encode())
        props[PROPERTY_KEYS] = " ".join(sp.keys)
    if size > limits.max_properties_bytes:
        raise ProtocolError(
            d.MESSAGE_PROPERTIES_TOO_LARGE,
            f"the total size of user properties is {size} bytes; "
            f"the limit is {limits.max_properties_bytes}",
        )
    if not sp.message_id.strip() or _control(sp.message_id) or len(sp.message_id) > 128:
        raise ProtocolError(d.ILLEGAL_MESSAGE_ID, "message id cannot be empty or illegal")
    props[PROPERTY_UNIQ_KEY] = sp.message_id
    type_name = MESSAGE_TYPE_NAMES.get(sp.message_type, "NORMAL")
    if type_name != topic.message_type:
        raise ProtocolError(
            d.MESSAGE_PROPERTY_CONFLICT_WITH_TYPE,
            f"topic {topic.name} takes {topic.message_type} messages, not {type_name}",
        )
    props[PROPERTY_MESSAGE_TYPE] = type_name
    if sp.HasField("message_group"):
        group = sp.message_group
        if not group.strip() or _control(group):
            raise ProtocolError(
                d.ILLEGAL_MESSAGE_GROUP,
                "message group cannot be blank or contain control characters",
            )
        if len(group.encode()) >= MAX_MESSAGE_GROUP_BYTES:
            raise ProtocolError(
                d.ILLEGAL_MESSAGE_GROUP,
                f"message group is longer than {MAX_MESSAGE_GROUP_BYTES - 1} bytes",
            )
        props[PROPERTY_SHARDING_KEY] = group
    # Refuse what no consumer could receive: the message as delivered must fit the clients'
    # gRPC receive limit (a 4 MiB body alone passes the body limit and still would not).
    delivered = len(body) + pm.ByteSize() - len(pm.body) + DELIVERY_ENVELOPE_RESERVE
    if delivered > CLIENT_RECEIVE_LIMIT:
        raise ProtocolError(
            d.MESSAGE_BODY_TOO_LARGE,
            f"message is {delivered} bytes as delivered (body {len(body)}); consumers' gRPC "
            f"clients receive at most {CLIENT_RECEIVE_LIMIT} bytes per message",
        )
    if sp.HasField("delivery_timestamp"):
        props[PROPERTY_DELIVER_TIME] = str(delivery_ms(sp.delivery_timestamp))
    born = born_ms(sp)
    return Message(
        topic=topic.name,
        queue_id=queue_id,
        body=body,
        properties=props,
        born_timestamp=born,
        born_host=(_ip_or(sp.born_host, peer_host), 0),
    )


def to_store_messages(
    pms: Sequence[d.Message],
    topic: TopicConfig,
    first_queue: int,
    limits: Limits,
    peer_host: str,
    request_bytes: int,
    message_ids: list[str] | None = None,
) -> list[Message]:
    """Check a whole SendMessage batch and turn it into store Messages in one pass.

    Message ``i`` without a message group goes to queue ``(first_queue + i) % topic.queues``
    (round robin); one with a group to the group's queue. ``request_bytes`` is the request's
    serialized size. What a plain message needs is checked for the whole batch at once (ids,
    sizes, type); each message then costs its protobuf field reads and one ``Message``. Any
    message off that plain path (user properties, tag, keys, group, GZIP, delivery time, a
    suspicious id) goes through ``to_store_message``, which refuses exactly as the proxy does,
    in message order. ``message_ids``: each message's ``system_properties.message_id``, if
    the caller has them already.
    """
    sps = [pm.system_properties for pm in pms]
    ids = [sp.message_id for sp in sps] if message_ids is None else message_ids
    # Ids that are all non-blank, short and free of control characters; and a request small
    # enough that every message, as delivered, fits the clients' receive limit.
    plain_batch = (
        all(map(str.strip, ids))
        and max(map(len, ids)) <= 128
        and _CONTROL.search("".join(ids)) is None
        and request_bytes + DELIVERY_ENVELOPE_RESERVE <= CLIENT_RECEIVE_LIMIT
    )
    type_name = topic.message_type
    type_code = MESSAGE_TYPE_VALUES.get(type_name, -1)
    max_body = limits.max_body_bytes
    queues = topic.queues
    name = topic.name
    gzip = d.GZIP
    out: list[Message] = []
    append = out.append
    for i, (pm, sp, message_id) in enumerate(zip(pms, sps, ids, strict=True)):
        body = pm.body
        if (
            not plain_batch
            or not body
            or len(body) > max_body
            or sp.message_type != type_code
            or sp.body_encoding == gzip
            or len(pm.user_properties)
            or len(sp.keys)
            or sp.HasField("tag")
            or sp.HasField("message_group")
            or sp.HasField("delivery_timestamp")
        ):
            group = sp.message_group if sp.HasField("message_group") else ""
            queue = zlib.crc32(group.encode()) % queues if group else (first_queue + i) % queues
            append(to_store_message(pm, topic, queue, limits, peer_host))
            continue
        append(
            Message(
                topic=name,
                queue_id=(first_queue + i) % queues,
                body=body,
                properties={PROPERTY_UNIQ_KEY: message_id, PROPERTY_MESSAGE_TYPE: type_name},
                born_timestamp=born_ms(sp),
                born_host=(_ip_or(sp.born_host, peer_host), 0),
            )
        )
    return out


def _send_engine() -> Any:
    """The native SendMessageRequest walker (broker/_send_native.pyx), when the record engine
    is native and the walker is built; None: every request is parsed by protobuf."""
    if ENGINE_NAME != "native":
        return None
    try:
        from broker import _send_native  # type: ignore[attr-defined]
    except ImportError:
        return None
    return _send_native if _send_native.bind(tiered.record) else None


SEND_ENGINE: Any = _send_engine()


def scan_send_request(raw: bytes) -> Any:
    """A serialized SendMessageRequest walked once natively (``.topic``, ``.count``), or None
    when the native walker is not built or the request is off its plain path: then protobuf
    parses it and ``to_store_messages`` converts it (decision 310)."""
    return None if SEND_ENGINE is None else SEND_ENGINE.scan(raw)


def scanned_batch(
    build: Any,
    topic: TopicConfig,
    first_queue: int,
    limits: Limits,
    peer_host: str,
    request_bytes: int,
) -> Any:
    """A scanned request's batch, built natively by ``build``, with the message ids and the
    total body bytes; None when a message is off the plain path for ``topic`` (its type, the
    body limit, its id; a tag, key, message group or user property the reference would refuse,
    or that is outside what the walker proves cheaply: a non-ASCII tag, key or group, a property
    name given twice), and the reference path must convert the batch (decisions 310, 390).

    ``build`` is the scanned request's ``messages`` (a list of ``Message``, what
    ``to_store_messages`` makes of it) or its ``spans`` (a ``RecordSpans``, decision 700: the
    store encodes its records from the request's bytes with no ``Message`` object per
    message). Both make the same checks, so the two answer None for the same requests."""
    if request_bytes + DELIVERY_ENVELOPE_RESERVE > CLIENT_RECEIVE_LIMIT:
        return None
    return build(
        MESSAGE_TYPE_VALUES.get(topic.message_type, -1),
        topic.message_type,
        limits.max_body_bytes,
        limits.max_properties,
        limits.max_properties_bytes,
        first_queue,
        topic.queues,
        peer_host,
        _ip_or,
        _RESERVED_KEYS,
    )


def send_results_py(status_bytes: bytes, message_ids: list[str], offsets: list[int]) -> bytes:
    """A serialized ``SendMessageResponse``: ``status_bytes`` (a serialized ``Status``) as its
    status and every entry's, entry ``i`` with ``message_ids[i]`` as message and transaction id
    and ``offsets[i]``. The reference of the native engine's ``send_results``."""
    if len(message_ids) != len(offsets):
        raise ValueError(f"{len(message_ids)} message ids but {len(offsets)} offsets")
    ok = d.Status.FromString(status_bytes)
    response = s.SendMessageResponse(status=ok)
    add = response.entries.add
    for message_id, offset in zip(message_ids, offsets, strict=True):
        add(status=ok, message_id=message_id, transaction_id=message_id, offset=offset)
    raw: bytes = response.SerializeToString()
    return raw


_send_results: Callable[[bytes, list[str], list[int]], bytes] = (
    NATIVE_ENGINE.send_results if ENGINE_NAME == "native" else send_results_py
)
_OK = d.Status(code=d.OK, message="OK").SerializeToString()


def send_response_bytes(message_ids: list[str], offsets: list[int]) -> bytes:
    """The OK answer to a SendMessage batch, serialized: every entry OK, with the message's id
    as message and transaction id (the broker's SendResult carries the unique key as the
    transaction id for every message, and the proxy passes it on). Built as bytes in one call
    (a protobuf ``add`` per message cost as much as storing the batch) and sent as it is
    (decision 391: parsing it for gRPC to serialize it again cost as much as building it)."""
    return _send_results(_OK, message_ids, offsets)


def send_response(message_ids: list[str], offsets: list[int]) -> s.SendMessageResponse:
    """``send_response_bytes`` parsed: the same answer as a protobuf message."""
    return s.SendMessageResponse.FromString(send_response_bytes(message_ids, offsets))


# Java's Character.isISOControl, which the proxy's GrpcValidator applies. It also keeps the
# record's property separators (\x01, \x02) out of stored properties.
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f]")


def _control(text: str) -> bool:
    return _CONTROL.search(text) is not None


def inflate(body: bytes, limit: int) -> bytes:
    """A GZIP (or zlib) body, inflated in steps that never produce more than ``limit + 1``
    bytes: a 1 MiB bomb that inflates to 1 GiB is refused after ``limit`` bytes, not after the
    broker has held the whole gigabyte (several at once took it to 5 GB)."""
    out: list[bytes] = []
    size = 0
    data = body
    try:
        while data:
            inflater = zlib.decompressobj(zlib.MAX_WBITS | 32)  # 32: a gzip or zlib header
            chunk = inflater.decompress(data, limit + 1 - size)
            size += len(chunk)
            out.append(chunk)
            if size > limit:
                raise ProtocolError(
                    d.MESSAGE_BODY_TOO_LARGE,
                    f"message body inflates to more than {limit} bytes; the limit is {limit}",
                )
            if not inflater.eof:  # all input consumed below the bound, yet no end of stream
                raise ProtocolError(d.MESSAGE_CORRUPTED, "body is not valid GZIP: truncated")
            data = inflater.unused_data  # a gzip file may hold several members
    except zlib.error as e:
        raise ProtocolError(d.MESSAGE_CORRUPTED, f"body is not valid GZIP: {e}") from e
    return b"".join(out)


@functools.lru_cache(maxsize=4096)
def _ip_or(host: str, fallback: str) -> str:
    """``host`` if it is an IP literal, else ``fallback`` (the peer), else 0.0.0.0. Cached:
    a producer's hosts repeat, and parsing them was a third of SendMessage's cost."""
    for candidate in (host, fallback, "0.0.0.0"):
        try:
            ipaddress.ip_address(candidate)
            return candidate
        except ValueError:
            continue
    return "0.0.0.0"


def host_string(host: Host) -> str:
    return f"{host[0]}:{host[1]}"


def to_proto_message(
    m: StoredMessage,
    topic_name: str,
    receipt_handle: str | None,
    attempt: int | None,
    invisible_ms: int | None,
    namespace: str = "",
) -> d.Message:
    """A stored message as the client receives it: GrpcConverter.buildMessage's fields."""
    props = m.properties
    sp = d.SystemProperties(
        message_id=props.get(PROPERTY_UNIQ_KEY) or f"{m.commitlog_offset:032X}",
        # MD5 in uppercase hex, as the proxy sends: every client verifies it the same way (the
        # Node client reads a CRC32 digest as a decimal string, the Python one as hex).
        body_digest=d.Digest(type=d.MD5, checksum=hashlib.md5(m.body).hexdigest().upper()),
        body_encoding=d.IDENTITY,
        message_type=MESSAGE_TYPE_VALUES.get(props.get(PROPERTY_MESSAGE_TYPE, "NORMAL"), d.NORMAL),
        born_host=m.born_host[0],
        store_host=host_string(m.store_host),
        queue_id=m.queue_id,
        queue_offset=m.queue_offset,
        delivery_attempt=delivery_attempt(m.reconsume_times + 1 if attempt is None else attempt),
    )
    # A stored value protobuf cannot carry is left out, never raised (decision 530): one such
    # record would otherwise fail every pull and receive of the batch it is in, for good.
    if TIMESTAMP_MIN_MS <= m.born_timestamp <= TIMESTAMP_MAX_MS:
        sp.born_timestamp.FromMilliseconds(m.born_timestamp)
    if TIMESTAMP_MIN_MS <= m.store_timestamp <= TIMESTAMP_MAX_MS:
        sp.store_timestamp.FromMilliseconds(m.store_timestamp)
    if m.tags:
        sp.tag = m.tags
    if m.keys:
        sp.keys.extend(m.keys)
    group = props.get(PROPERTY_SHARDING_KEY)
    if group:
        sp.message_group = group
    deliver = stored_delivery_ms(props.get(PROPERTY_DELIVER_TIME))
    if deliver is not None:
        sp.delivery_timestamp.FromMilliseconds(deliver)
    if receipt_handle is not None:
        sp.receipt_handle = receipt_handle
    if invisible_ms is not None:
        sp.invisible_duration.CopyFrom(duration(invisible_ms))
    return d.Message(
        topic=d.Resource(name=topic_name, resource_namespace=namespace),
        user_properties={k: v for k, v in props.items() if k not in _HIDDEN},
        system_properties=sp,
        body=m.body,
    )


def delivery_attempt(attempt: int) -> int:
    """A delivery attempt as the int32 field takes it: at least 1, at most INT32_MAX (a record's
    reconsume times is an int32 of its own, and 1 more overflows the field)."""
    return min(max(attempt, 1), INT32_MAX)


def stored_delivery_ms(text: str | None) -> int | None:
    """A stored ``__STARTDELIVERTIME`` as a client is handed it: plain ASCII digits within
    Timestamp's range, else None (not delivered). ``str.isdigit`` also takes "²", which
    ``int`` refuses; a negative time (a delivery time in the past) is not delivered either."""
    if not text or len(text) > 18 or not text.isascii() or not text.isdigit():
        return None  # more than 18 digits: past the range whatever they are (as the native writer)
    ms = int(text)
    return ms if ms <= TIMESTAMP_MAX_MS else None


def duration(ms: int) -> duration_pb2.Duration:
    out = duration_pb2.Duration()
    out.FromMilliseconds(ms)
    return out


def duration_ms(value: duration_pb2.Duration) -> int:
    return int(value.seconds * 1000 + value.nanos // 1_000_000)
