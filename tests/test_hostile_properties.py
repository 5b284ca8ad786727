"""Message properties that protobuf cannot carry, on both sides of the broker (decision 530).

Send side: a delivery time or orphaned-transaction recovery duration outside what the proxy
takes is refused with the proxy's code, on the native walker's path and the reference's; a born
time outside protobuf's Timestamp range is ignored, as the proxy ignores it. Read side: a message
already stored with such a value (by an older version, or written straight into the store) is
delivered, hot by PullMessage and by Apache's SimpleConsumer, cold by both reply writers, with
the field omitted or clamped: one bad record never fails the batch it is in."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from broker_harness import Standalone, client_config
from google.protobuf import timestamp_pb2
from rocketmq import FilterExpression, SimpleConsumer
from rocketmq.grpc_protocol import definition_pb2 as d
from rocketmq.grpc_protocol import service_pb2 as s
from rocketmq.grpc_protocol import service_pb2_grpc

from broker.metadata import BrokerMetadata
from broker.reply import encode_pull_replies, encode_pull_replies_decoded, encode_pull_replies_py
from broker.stored_properties import TIMESTAMP_MAX_MS
from broker.timer import TIMER_TOPIC, TimerService
from broker.transaction import (
    HALF_TOPIC,
    OP_TOPIC,
    TransactionConfig,
    TransactionService,
    transaction_id,
)
from tiered.config import StoreConfig
from tiered.record import Message, RecordEncoder
from tiered.store import MessageStore, recorded_geometry

INT32_MAX = 2**31 - 1
GOOD_DELIVERY = "1700000000123"
# (what is stored, what a client must be handed): each message is one hostile value.
HOSTILE: list[tuple[dict[str, Any], dict[str, Any]]] = [
    ({}, {}),
    ({"deliver": "1" * 19}, {"delivery": None}),
    ({"deliver": "9" * 18}, {"delivery": None}),  # fits an int64, not a Timestamp
    ({"deliver": str(TIMESTAMP_MAX_MS + 1)}, {"delivery": None}),
    ({"deliver": str(TIMESTAMP_MAX_MS)}, {"delivery": TIMESTAMP_MAX_MS}),
    ({"deliver": "-5"}, {"delivery": None}),
    ({"deliver": "12x"}, {"delivery": None}),
    ({"born": 10**18}, {"born": None}),
    ({"born": -(10**18)}, {"born": None}),
    ({"reconsume": INT32_MAX}, {"attempt": INT32_MAX}),
    ({"reconsume": -7}, {"attempt": 1}),
    ({"deliver": GOOD_DELIVERY}, {"delivery": int(GOOD_DELIVERY)}),
]


def stored(i: int, topic: str, what: dict[str, Any]) -> Message:
    props = {"UNIQ_KEY": f"{i:032X}", "KEYS": f"k{i}"}
    if "deliver" in what:
        props["__STARTDELIVERTIME"] = what["deliver"]
    return Message(
        topic=topic,
        body=f"body {i}".encode(),
        properties=props,
        born_timestamp=what.get("born", 1_700_000_000_000),
        reconsume_times=what.get("reconsume", 0),
    )


def check_delivered(i: int, m: d.Message, expected: dict[str, Any], attempt: bool) -> None:
    """``m`` (message ``i`` as a client parsed it) carries what ``expected`` says."""
    sp = m.system_properties
    assert m.body == f"body {i}".encode(), i
    if "delivery" in expected:
        want = expected["delivery"]
        got = sp.delivery_timestamp.ToMilliseconds() if sp.HasField("delivery_timestamp") else None
        assert got == want, i
    if "born" in expected:
        assert not sp.HasField("born_timestamp"), i
    for field in ("born_timestamp", "store_timestamp", "delivery_timestamp"):
        if sp.HasField(field):
            getattr(sp, field).ToDatetime()  # in Timestamp's range: a client can use it
    if attempt and "attempt" in expected:
        assert sp.delivery_attempt == expected["attempt"], i


def write_offline(data_dir: Path, messages: list[Message]) -> None:
    """Append ``messages`` to a stopped broker's store as they are (no send-side checks), as an
    older version or a native path that let them through would have left them."""
    geometry = recorded_geometry(data_dir)
    assert geometry is not None
    sizes: dict[str, Any] = dict(geometry)  # the file sizes the data dir was created with
    store = MessageStore(StoreConfig(data_dir=data_dir, **sizes))
    store.start()
    try:
        store.put_messages(messages)
    finally:
        store.shutdown()


def pull(node: Standalone, topic: str) -> list[d.Message]:
    stub = service_pb2_grpc.MessagingServiceStub(grpc.insecure_channel(node.endpoint))
    request = s.PullMessageRequest(
        group=d.Resource(name="g-pull"),
        message_queue=d.MessageQueue(topic=d.Resource(name=topic), id=0),
        offset=0,
        batch_size=64,
        filter_expression=d.FilterExpression(type=d.TAG, expression="*"),
    )
    deadline = time.monotonic() + 10
    while True:  # dispatch is asynchronous: a message just sent may not be pullable yet
        replies = list(stub.PullMessage(request, timeout=15))
        if replies[0].status.code != d.MESSAGE_NOT_FOUND or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert replies[0].status.code == d.OK, replies[0].status
    return [r.message for r in replies if r.HasField("message")]


@pytest.fixture(scope="module")
def hostile_node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Standalone]:
    """A broker whose topic ``hostile`` holds one message per hostile value, stored while it
    was down."""
    node = Standalone(tmp_path_factory.mktemp("hostile") / "data").start()
    node.create_topic("hostile", queues=1)
    node.create_topic("sent", queues=1)
    node.create_topic("sent-txn", queues=1, message_type="TRANSACTION")
    assert node.stop() == 0
    write_offline(
        node.data_dir, [stored(i, "hostile", what) for i, (what, _) in enumerate(HOSTILE)]
    )
    node.start()
    yield node
    assert node.stop() == 0


def test_a_hot_pull_delivers_every_stored_message_with_bad_fields_omitted(
    hostile_node: Standalone,
) -> None:
    got = pull(hostile_node, "hostile")
    assert len(got) == len(HOSTILE)
    for i, (m, (_, expected)) in enumerate(zip(got, HOSTILE, strict=True)):
        check_delivered(i, m, expected, attempt=True)


def test_a_simple_consumer_receives_every_stored_message(hostile_node: Standalone) -> None:
    consumer = SimpleConsumer(
        client_config(hostile_node), "g-hostile", {"hostile": FilterExpression()}, await_duration=1
    )
    consumer.startup()
    got: dict[int, Any] = {}
    try:
        deadline = time.monotonic() + 20
        while len(got) < len(HOSTILE) and time.monotonic() < deadline:
            for m in consumer.receive(32, 15):
                got[int(next(iter(m.keys))[1:])] = m
                consumer.ack(m)
    finally:
        consumer.shutdown()
    assert sorted(got) == list(range(len(HOSTILE)))
    for i, (_, expected) in enumerate(HOSTILE):
        m = got[i]
        assert m.body == f"body {i}".encode()
        if "delivery" in expected:
            # The client reads an absent delivery time as 0.
            assert (m.delivery_timestamp or None) == expected["delivery"], i


def records(topic: str) -> tuple[bytes, list[int]]:
    """The hostile messages as records, with a store time past Timestamp's range on one."""
    encoder = RecordEncoder(("10.1.2.3", 10911))
    parts, positions, at = [], [], 0
    for i, (what, _) in enumerate(HOSTILE):
        store_ms = 10**18 if i == 1 else 1_700_000_000_500
        record, _, _ = encoder.encode(stored(i, topic, what), i, at, store_ms)
        parts.append(record)
        positions.append(at)
        at += len(record)
    return b"".join(parts), positions


@pytest.mark.parametrize(
    "writer", [encode_pull_replies, encode_pull_replies_decoded, encode_pull_replies_py]
)
def test_cold_replies_from_both_writers_deliver_every_record(writer: Any) -> None:
    """The cold worker's writers (native from record bytes, native from decoded messages, the
    pure-Python reference) write every record, with the same fields omitted or clamped."""
    data, positions = records("cold")
    buffer, ends, bodies = writer(data, positions)
    assert len(ends) == len(HOSTILE)
    assert bodies == [len(f"body {i}") for i in range(len(HOSTILE))]
    replies = [buffer[a:b] for a, b in zip([0, *ends[:-1]], ends, strict=True)]
    for i, (raw, (_, expected)) in enumerate(zip(replies, HOSTILE, strict=True)):
        m = s.PullMessageResponse.FromString(raw).message
        check_delivered(i, m, expected, attempt=True)
        if i == 1:
            assert not m.system_properties.HasField("store_timestamp")
    assert writer(data, positions) == encode_pull_replies_py(data, positions)


# -- send side ------------------------------------------------------------------------------------


def message(topic: str, **system: Any) -> d.Message:
    m = d.Message(topic=d.Resource(name=topic), body=b"payload")
    m.system_properties.message_id = os.urandom(16).hex().upper()
    m.system_properties.body_encoding = d.IDENTITY
    m.system_properties.message_type = d.NORMAL
    for key, value in system.items():
        getattr(m.system_properties, key).CopyFrom(value)
    return m


def send(node: Standalone, *messages: d.Message) -> s.SendMessageResponse:
    stub = service_pb2_grpc.MessagingServiceStub(grpc.insecure_channel(node.endpoint))
    return stub.SendMessage(s.SendMessageRequest(messages=messages), timeout=10)


def ts(seconds: int, nanos: int = 0) -> timestamp_pb2.Timestamp:
    return timestamp_pb2.Timestamp(seconds=seconds, nanos=nanos)


@pytest.mark.parametrize(
    "delivery",
    [
        ts(10**18),  # 19 digits, as the Python client sends a millisecond value in seconds
        ts(2**62),
        ts(-(10**12)),  # before year 1
        ts(1_700_000_000, -1),
        ts(1_700_000_000, 10**9),
    ],
)
@pytest.mark.parametrize("batch", [1, 3])
def test_a_delivery_time_outside_the_timestamp_range_is_refused_at_send(
    hostile_node: Standalone, delivery: timestamp_pb2.Timestamp, batch: int
) -> None:
    """On the native walker's path (one plain message) and in a batch alike."""
    plain = [message("sent") for _ in range(batch - 1)]
    reply = send(hostile_node, *plain, message("sent", delivery_timestamp=delivery))
    assert reply.status.code == d.ILLEGAL_DELIVERY_TIME, reply.status
    assert "delivery" in reply.status.message


@pytest.mark.parametrize("born", [ts(10**15), ts(2**62), ts(-(10**12)), ts(5, -3)])
def test_a_born_time_outside_the_timestamp_range_is_ignored(
    hostile_node: Standalone, born: timestamp_pb2.Timestamp
) -> None:
    reply = send(hostile_node, message("sent", born_timestamp=born))
    assert reply.status.code == d.OK, reply.status
    sent_id = reply.entries[0].message_id
    deadline = time.monotonic() + 10
    while True:  # dispatch is asynchronous: the pull may not reach the new message at once
        delivered = [
            m for m in pull(hostile_node, "sent") if m.system_properties.message_id == sent_id
        ]
        if delivered or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert len(delivered) == 1
    assert delivered[0].system_properties.born_timestamp.ToMilliseconds() == 0


def test_an_orphaned_transaction_recovery_past_the_proxys_hour_is_a_bad_request(
    hostile_node: Standalone,
) -> None:
    from google.protobuf import duration_pb2

    m = message("sent-txn")
    m.system_properties.message_type = d.TRANSACTION
    m.system_properties.orphaned_transaction_recovery_duration.CopyFrom(
        duration_pb2.Duration(seconds=3601)
    )
    reply = send(hostile_node, m)
    assert reply.status.code == d.BAD_REQUEST, reply.status
    m.system_properties.orphaned_transaction_recovery_duration.CopyFrom(
        duration_pb2.Duration(seconds=3600)
    )
    assert send(hostile_node, m).status.code == d.OK


# -- the broker's own properties, read back -------------------------------------------------------


def test_transaction_recovery_reads_numbers_it_cannot_parse_as_defaults(
    small_config: StoreConfig, start_store: Callable[[StoreConfig], MessageStore], tmp_path: Path
) -> None:
    """A half message whose check immunity and real queue id are not numbers, an op whose
    body names no half message and a check count that is not one: the broker still starts,
    the half is still pending, and its commit lands in queue 0."""
    store = start_store(small_config)
    store.put_messages(
        [
            Message(
                HALF_TOPIC,
                b"half",
                0,
                {
                    "UNIQ_KEY": "id-h",
                    "REAL_TOPIC": "orders",
                    "REAL_QID": "first",
                    "__TXN_CHECK_IMMUNITY_MS": "soon",
                },
            ),
            Message(OP_TOPIC, b"not-an-offset", 0, {"__TXN_OP": "commit"}),
            Message(OP_TOPIC, b"0", 0, {"__TXN_OP": "check", "__TXN_CHECKS": "many"}),
        ]
    )
    assert store.wait_dispatched(10)
    service = TransactionService(
        store, BrokerMetadata(tmp_path / "config"), TransactionConfig(), send_check=lambda *_: False
    )
    service.start()  # raised ValueError before: the broker could not start
    try:
        assert service.pending() == 1
        half = service._pending[0]
        assert half.checks == 0
        service.end("orders", "id-h", transaction_id(half.offset, half.txn_phys), commit=True)
    finally:
        service.stop()
    assert store.wait_dispatched(10)
    assert [m.body for m in store.get_messages("orders", 0, 0, 10).messages] == [b"half"]


def test_the_timer_wheel_delivers_timer_records_with_numbers_it_cannot_parse(
    small_config: StoreConfig, start_store: Callable[[StoreConfig], MessageStore]
) -> None:
    """A timer record whose due time is not a number (or past any Timestamp) is due now, and
    one whose real queue id is not a number goes to queue 0: each is delivered, and the
    records after them too. Before, the first one stopped the wheel for every timer."""
    store = start_store(small_config)
    clock = [1_800_000_000_000]
    records = [("soon", "0"), ("1" * 19, "0"), (str(clock[0] - 1), "first"), (str(clock[0]), "0")]
    for i, (due, queue) in enumerate(records):  # as an older version could have left them
        props = {
            "UNIQ_KEY": f"id-{i}",
            "__STARTDELIVERTIME": due,
            "REAL_TOPIC": "orders",
            "REAL_QID": queue,
        }
        store.put_messages([Message(TIMER_TOPIC, f"body {i}".encode(), 0, props)])
    assert store.wait_dispatched(10)
    timers = TimerService(
        store, small_config.data_dir / "timer", lambda: ["orders"], clock=lambda: clock[0]
    )
    timers.start()  # before, the first record stopped the wheel: ValueError on every pass
    try:
        deadline = time.monotonic() + 15
        while store.max_offset("orders", 0) < len(records) and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        timers.stop()
    got = store.get_messages("orders", 0, 0, 32).messages
    assert sorted(m.body for m in got) == [f"body {i}".encode() for i in range(len(records))]
