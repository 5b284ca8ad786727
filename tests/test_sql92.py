"""SQL92 subscriptions (RocketMQ's subset on message properties) for simple, push and pull
consumers, with Apache's Python client against ``tmq standalone``; malformed expressions are
refused with ILLEGAL_FILTER_EXPRESSION."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import grpc
import pytest
from broker_harness import Standalone, client_config
from rocketmq import (
    ConsumeResult,
    FilterExpression,
    Message,
    MessageListener,
    Producer,
    PushConsumer,
    SimpleConsumer,
)
from rocketmq.grpc_protocol import FilterType, service_pb2_grpc
from rocketmq.grpc_protocol import definition_pb2 as d
from rocketmq.grpc_protocol import service_pb2 as s

from broker.sql92 import compile_sql92

PROPS = {"a": "5", "region": "eu", "vip": "true", "TAGS": "t1", "name": "it's"}


@pytest.mark.parametrize(
    ("expression", "matches"),
    [
        ("a > 3", True),
        ("a >= 5 AND a <= 5", True),
        ("a < 5", False),
        ("a <> 5", False),
        ("a = 5.0", True),
        ("region = 'eu'", True),
        ("region IN ('us', 'eu')", True),
        ("region NOT IN ('eu')", False),
        ("a BETWEEN 1 AND 5", True),
        ("a NOT BETWEEN 1 AND 5", False),
        ("missing IS NULL", True),
        ("a IS NOT NULL", True),
        ("missing = 1", False),
        ("NOT (missing = 1)", False),  # UNKNOWN stays UNKNOWN: not delivered
        ("missing = 1 OR a = 5", True),
        ("region > 3", False),  # not a number: UNKNOWN
        ("vip = TRUE", True),
        ("vip = FALSE", False),
        ("TRUE", True),
        ("FALSE", False),
        ("TAGS = 't1' and a between 4 and 6", True),
        ("name = 'it''s'", True),
        ("region CONTAINS 'u' AND region STARTSWITH 'e' AND region NOT ENDSWITH 'x'", True),
        ("(a > 1 AND (region = 'us' OR region = 'eu')) OR FALSE", True),
    ],
)
def test_sql92_subset_evaluates_like_rocketmq(expression: str, matches: bool) -> None:
    assert (compile_sql92(expression)(PROPS) is True) is matches


@pytest.mark.parametrize(
    "expression",
    ["", "a >", "a = = 1", "a IN (1, 2)", "a BETWEEN 'x' AND 2", "a", "'x'", "a > TRUE",
     "a LIKE 'x%'", "a = 1; b = 2", "__import__('os')"],
)  # fmt: skip
def test_malformed_sql92_is_refused(expression: str) -> None:
    with pytest.raises(ValueError, match="SQL92"):
        compile_sql92(expression)


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Standalone]:
    node = Standalone(tmp_path_factory.mktemp("sql92") / "data").start()
    node.create_topic("sql", queues=2)
    producer = Producer(client_config(node), topics=["sql"])
    producer.startup()
    try:
        for i in range(60):
            m = Message()
            m.topic = "sql"
            m.body = f"m{i}".encode()
            m.tag = "even" if i % 2 == 0 else "odd"
            m.add_property("i", str(i))
            m.add_property("region", ("eu", "us", "apac")[i % 3])
            producer.send(m)
    finally:
        producer.shutdown()
    yield node
    assert node.stop() == 0


SQL = "region IN ('eu', 'us') AND i BETWEEN 10 AND 39 AND TAGS = 'even'"
WANTED = sorted(i for i in range(10, 40) if i % 2 == 0 and i % 3 in (0, 1))


def test_a_simple_consumer_receives_only_what_the_sql92_filter_selects(broker: Standalone) -> None:
    consumer = SimpleConsumer(
        client_config(broker), "g-sql-simple", {"sql": FilterExpression(SQL, FilterType.SQL)},
        await_duration=2,
    )  # fmt: skip
    consumer.startup()
    got: list[int] = []
    try:
        for _ in range(10):
            for m in consumer.receive(32, 20):
                got.append(int(m.properties["i"]))
                consumer.ack(m)
            if len(got) >= len(WANTED):
                break
        assert consumer.receive(32, 20) == []
    finally:
        consumer.shutdown()
    assert sorted(got) == WANTED


def test_a_push_consumer_receives_only_what_the_sql92_filter_selects(broker: Standalone) -> None:
    seen: list[int] = []
    lock = threading.Lock()

    class Listener(MessageListener):
        def consume(self, message: Message) -> ConsumeResult:
            with lock:
                seen.append(int(message.properties["i"]))
            return ConsumeResult.SUCCESS

    consumer = PushConsumer(
        client_config(broker), "g-sql-push", Listener(),
        {"sql": FilterExpression("i >= 50 OR region = 'apac' AND i < 6", FilterType.SQL)},
    )  # fmt: skip
    consumer.startup()
    try:
        deadline = time.monotonic() + 60
        while len(seen) < 12 and time.monotonic() < deadline:
            time.sleep(0.2)
        time.sleep(1)  # anything unwanted would arrive now
    finally:
        consumer.shutdown()
    assert sorted(seen) == [2, 5, *range(50, 60)]


def _pull(broker: Standalone, expression: str) -> tuple[int, list[int]]:
    stub = service_pb2_grpc.MessagingServiceStub(grpc.insecure_channel(broker.endpoint))
    code, got = d.OK, []
    for queue in (0, 1):
        request = s.PullMessageRequest(
            group=d.Resource(name="g-sql-pull"),
            message_queue=d.MessageQueue(topic=d.Resource(name="sql"), id=queue),
            offset=0,
            batch_size=64,
            filter_expression=d.FilterExpression(type=d.SQL, expression=expression),
        )
        for r in stub.PullMessage(request, timeout=10):
            if r.WhichOneof("content") == "status" and r.status.code not in (
                d.OK,
                d.MESSAGE_NOT_FOUND,
            ):
                code = r.status.code
            elif r.WhichOneof("content") == "message":
                got.append(int(r.message.user_properties["i"]))
    return code, sorted(got)


def test_pull_applies_sql92_and_refuses_a_malformed_expression(broker: Standalone) -> None:
    assert _pull(broker, SQL) == (d.OK, WANTED)
    assert _pull(broker, "i >")[0] == d.ILLEGAL_FILTER_EXPRESSION


def test_receive_refuses_a_malformed_expression(broker: Standalone) -> None:
    stub = service_pb2_grpc.MessagingServiceStub(grpc.insecure_channel(broker.endpoint))
    request = s.ReceiveMessageRequest(
        group=d.Resource(name="g-sql-bad"),
        message_queue=d.MessageQueue(topic=d.Resource(name="sql")),
        filter_expression=d.FilterExpression(type=d.SQL, expression="region = 'eu' AND"),
        batch_size=1,
    )
    request.invisible_duration.FromSeconds(20)
    [reply] = list(stub.ReceiveMessage(request, timeout=10))
    assert reply.status.code == d.ILLEGAL_FILTER_EXPRESSION
    assert "column" in reply.status.message
