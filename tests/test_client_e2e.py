"""Apache's RocketMQ 5 Python client, unmodified, against ``tmq standalone`` in its own process."""

from __future__ import annotations

import threading
import time
from collections import Counter, defaultdict
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from broker_harness import Standalone, client_config, drain, send_all
from rocketmq import (
    ConsumeResult,
    FilterExpression,
    Message,
    MessageListener,
    PushConsumer,
    SimpleConsumer,
)
from rocketmq.grpc_protocol import definition_pb2 as d
from rocketmq.grpc_protocol import service_pb2 as s
from rocketmq.grpc_protocol import service_pb2_grpc


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Standalone]:
    node = Standalone(tmp_path_factory.mktemp("e2e") / "data").start()
    yield node
    assert node.stop() == 0, "SIGTERM must stop the broker cleanly"


def make(topic: str, i: int, tag: str | None = None, group: str | None = None) -> Message:
    m = Message()
    m.topic = topic
    m.body = f"body-{i}-".encode() * (1 + i % 7)
    m.keys = f"key-{i}"
    if tag:
        m.tag = tag
    if group:
        m.message_group = group
    m.add_property("index", str(i))
    return m


def test_a_thousand_messages_are_received_and_acked_exactly_once(broker: Standalone) -> None:
    broker.create_topic("e2e-thousand", queues=4)
    sent = [make("e2e-thousand", i, tag=f"t{i % 3}") for i in range(1000)]
    ids = send_all(broker, "e2e-thousand", sent)
    consumer = SimpleConsumer(
        client_config(broker), "g-thousand", {"e2e-thousand": FilterExpression()}, await_duration=2
    )
    consumer.startup()
    try:
        got = drain(consumer, 1000)
        extra = drain(consumer, 1, seconds=3)
    finally:
        consumer.shutdown()
    assert extra == [], "nothing is delivered twice once acknowledged"
    assert Counter(m.message_id for m in got) == Counter(ids)
    by_index = {int(m.properties["index"]): m for m in got}
    for i, m in by_index.items():
        assert m.body == sent[i].body
        assert m.tag == f"t{i % 3}"
        assert m.keys == {f"key-{i}"}
        assert m.delivery_attempt == 1


def test_an_unacked_message_comes_back_then_goes_to_the_dlq(broker: Standalone) -> None:
    broker.create_topic("e2e-retry", queues=1)
    broker.create_group("g-retry", max_attempts=3)
    [mid] = send_all(broker, "e2e-retry", [make("e2e-retry", 7)])
    consumer = SimpleConsumer(
        client_config(broker), "g-retry", {"e2e-retry": FilterExpression()}, await_duration=2
    )
    consumer.startup()
    try:
        attempts = []
        deadline = time.monotonic() + 60
        while len(attempts) < 3 and time.monotonic() < deadline:
            for m in consumer.receive(1, 1):  # invisible for 1 s, never acknowledged
                assert m.message_id == mid
                attempts.append(m.delivery_attempt)
        assert attempts == [1, 2, 3]
        time.sleep(2.5)  # the third delivery expires too: max attempts reached
        assert drain(consumer, 1, seconds=3) == []
    finally:
        consumer.shutdown()
    dlq = SimpleConsumer(
        client_config(broker),
        "g-dlq-reader",
        {"%DLQ%g-retry": FilterExpression()},
        await_duration=2,
    )
    dlq.startup()
    try:
        dead = drain(dlq, 1, seconds=20)
    finally:
        dlq.shutdown()
    assert [m.message_id for m in dead] == [mid]
    assert dead[0].body == make("e2e-retry", 7).body


def test_messages_of_one_message_group_are_consumed_in_order(broker: Standalone) -> None:
    broker.create_topic("e2e-fifo", queues=4, message_type="FIFO")
    broker.create_group("g-fifo", fifo=True)
    sent = [make("e2e-fifo", i, group=f"order-{i % 5}") for i in range(100)]
    send_all(broker, "e2e-fifo", sent)
    consumer = SimpleConsumer(
        client_config(broker), "g-fifo", {"e2e-fifo": FilterExpression()}, await_duration=2
    )
    consumer.startup()
    try:
        got = drain(consumer, 100)
    finally:
        consumer.shutdown()
    per_group: dict[str, list[int]] = defaultdict(list)
    for m in got:
        per_group[m.message_group].append(int(m.properties["index"]))
    assert sorted(per_group) == [f"order-{g}" for g in range(5)]
    for group, indexes in per_group.items():
        assert indexes == sorted(indexes), f"{group} out of order: {indexes}"
        assert len(indexes) == 20


def test_a_tag_filter_delivers_only_matching_messages(broker: Standalone) -> None:
    broker.create_topic("e2e-tags", queues=2)
    send_all(
        broker,
        "e2e-tags",
        [make("e2e-tags", i, tag=["red", "green", "blue"][i % 3]) for i in range(90)],
    )
    consumer = SimpleConsumer(
        client_config(broker),
        "g-tags",
        {"e2e-tags": FilterExpression("red || blue")},
        await_duration=2,
    )
    consumer.startup()
    try:
        got = drain(consumer, 60)
        extra = drain(consumer, 1, seconds=3)
    finally:
        consumer.shutdown()
    assert extra == []
    assert sorted(int(m.properties["index"]) for m in got) == [i for i in range(90) if i % 3 != 1]
    assert {m.tag for m in got} == {"red", "blue"}


def test_a_push_consumer_consumes_a_stream(broker: Standalone) -> None:
    broker.create_topic("e2e-push", queues=2)
    seen: list[str] = []
    lock = threading.Lock()

    class Listener(MessageListener):
        def consume(self, message: Message) -> ConsumeResult:
            with lock:
                seen.append(message.properties["index"])
            return ConsumeResult.SUCCESS

    consumer = PushConsumer(
        client_config(broker), "g-push", Listener(), {"e2e-push": FilterExpression()}
    )
    consumer.startup()
    try:
        send_all(broker, "e2e-push", [make("e2e-push", i) for i in range(200)])
        deadline = time.monotonic() + 60
        while len(seen) < 200 and time.monotonic() < deadline:
            time.sleep(0.2)
    finally:
        consumer.shutdown()
    assert sorted(map(int, seen)) == list(range(200))


def _pull(
    node: Standalone, topic: str, queue: int, offset: int, batch: int = 64
) -> tuple[int, list[d.Message], int]:
    stub = service_pb2_grpc.MessagingServiceStub(grpc.insecure_channel(node.endpoint))
    request = s.PullMessageRequest(
        group=d.Resource(name="g-replay"),
        message_queue=d.MessageQueue(topic=d.Resource(name=topic), id=queue),
        offset=offset,
        batch_size=batch,
    )
    code, messages, next_offset = 0, [], -1
    for item in stub.PullMessage(request, timeout=10):
        kind = item.WhichOneof("content")
        if kind == "status":
            code = item.status.code
        elif kind == "message":
            messages.append(item.message)
        else:
            next_offset = item.next_offset
    return code, messages, next_offset


def test_pull_replays_from_an_offset_and_from_a_time(broker: Standalone) -> None:
    broker.create_topic("e2e-replay", queues=1)
    send_all(broker, "e2e-replay", [make("e2e-replay", i) for i in range(50)])
    middle = time.time()
    time.sleep(0.05)
    send_all(broker, "e2e-replay", [make("e2e-replay", i) for i in range(50, 80)])
    code, messages, next_offset = _pull(broker, "e2e-replay", 0, 20, batch=100)
    assert code == d.OK
    assert [int(m.user_properties["index"]) for m in messages] == list(range(20, 80))
    assert [m.system_properties.queue_offset for m in messages] == list(range(20, 80))
    assert next_offset == 80
    stub = service_pb2_grpc.MessagingServiceStub(grpc.insecure_channel(broker.endpoint))
    q = d.MessageQueue(topic=d.Resource(name="e2e-replay"), id=0)
    at = s.QueryOffsetRequest(message_queue=q, query_offset_policy=d.TIMESTAMP)
    at.timestamp.FromMilliseconds(int(middle * 1000))
    offset = stub.QueryOffset(at, timeout=10).offset
    assert offset == 50
    code, messages, _ = _pull(broker, "e2e-replay", 0, offset, batch=100)
    assert [int(m.user_properties["index"]) for m in messages] == list(range(50, 80))
    code, _, _ = _pull(broker, "e2e-replay", 0, 500)
    assert code == d.ILLEGAL_OFFSET


def test_restart_keeps_topics_offsets_and_messages(tmp_path: Path) -> None:
    node = Standalone(tmp_path / "data", flush="sync").start()
    node.create_topic("e2e-restart", queues=2)
    ids = send_all(node, "e2e-restart", [make("e2e-restart", i) for i in range(40)])
    consumer = SimpleConsumer(
        client_config(node), "g-restart", {"e2e-restart": FilterExpression()}, await_duration=2
    )
    consumer.startup()
    first = drain(consumer, 15)  # acknowledged: must not come back after the restart
    consumer.shutdown()
    assert node.stop() == 0
    node.start()
    try:
        consumer = SimpleConsumer(
            client_config(node), "g-restart", {"e2e-restart": FilterExpression()}, await_duration=2
        )
        consumer.startup()
        rest = drain(consumer, 40 - len(first))
        extra = drain(consumer, 1, seconds=3)
        consumer.shutdown()
    finally:
        node.stop()
    assert extra == []
    assert Counter(m.message_id for m in first + rest) == Counter(ids)


def test_kill_9_under_sync_flush_loses_no_acknowledged_message(tmp_path: Path) -> None:
    node = Standalone(tmp_path / "data", flush="sync").start()
    node.create_topic("e2e-kill", queues=2)
    ids = send_all(node, "e2e-kill", [make("e2e-kill", i) for i in range(60)])
    node.kill9()
    node.start()
    try:
        consumer = SimpleConsumer(
            client_config(node), "g-kill", {"e2e-kill": FilterExpression()}, await_duration=2
        )
        consumer.startup()
        got = drain(consumer, 60)
        consumer.shutdown()
    finally:
        node.stop()
    assert Counter(m.message_id for m in got) == Counter(ids)


def test_update_offset_rewinds_a_group_and_get_offset_reports_it(broker: Standalone) -> None:
    broker.create_topic("e2e-rewind", queues=1)
    send_all(broker, "e2e-rewind", [make("e2e-rewind", i) for i in range(30)])
    consumer = SimpleConsumer(
        client_config(broker), "g-rewind", {"e2e-rewind": FilterExpression()}, await_duration=2
    )
    consumer.startup()
    try:
        assert len(drain(consumer, 30)) == 30
        stub = service_pb2_grpc.MessagingServiceStub(grpc.insecure_channel(broker.endpoint))
        group = d.Resource(name="g-rewind")
        q = d.MessageQueue(topic=d.Resource(name="e2e-rewind"), id=0)
        assert (
            stub.GetOffset(s.GetOffsetRequest(group=group, message_queue=q), timeout=10).offset
            == 30
        )
        reply = stub.UpdateOffset(
            s.UpdateOffsetRequest(group=group, message_queue=q, offset=25), timeout=10
        )
        assert reply.status.code == d.OK
        again = drain(consumer, 5)
        assert sorted(int(m.properties["index"]) for m in again) == [25, 26, 27, 28, 29]
        bad = stub.UpdateOffset(
            s.UpdateOffsetRequest(group=group, message_queue=q, offset=31), timeout=10
        )
        assert bad.status.code == d.ILLEGAL_OFFSET
        unknown = stub.GetOffset(
            s.GetOffsetRequest(group=d.Resource(name="g-never"), message_queue=q), timeout=10
        )
        assert unknown.status.code == d.OFFSET_NOT_FOUND
    finally:
        consumer.shutdown()
