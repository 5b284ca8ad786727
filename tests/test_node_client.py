"""Apache's RocketMQ 5 Node.js client, unmodified, against ``tmq standalone`` in its own process,
and across clients with Apache's Python client."""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from broker_harness import Standalone, client_config, send_all
from node_harness import ensure_node_client, node
from rocketmq import FilterExpression, Message
from rocketmq import SimpleConsumer as PySimpleConsumer


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Standalone]:
    ensure_node_client()
    node_ = Standalone(tmp_path_factory.mktemp("node") / "data").start()
    yield node_
    assert node_.stop() == 0


def produce(b: Standalone, topic: str, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    result: list[dict[str, Any]] = node(
        {"cmd": "produce", "endpoint": b.endpoint, "topic": topic, "messages": messages}
    )
    return result


def consume(b: Standalone, cmd: str, topic: str, group: str, **options: Any) -> Any:
    """Run the driver's ``simple`` or ``push`` consumer; returns its deliveries."""
    return node(
        {"cmd": cmd, "endpoint": b.endpoint, "topic": topic, "group": group, **options},
        timeout=options.get("seconds", 60) + 60,
    )


def py_drain(b: Standalone, topic: str, group: str, want: int) -> list[Message]:
    consumer = PySimpleConsumer(
        client_config(b), group, {topic: FilterExpression()}, await_duration=2
    )
    consumer.startup()
    got: list[Message] = []
    try:
        for _ in range(30):
            for m in consumer.receive(32, 20):
                got.append(m)
                consumer.ack(m)
            if len(got) >= want:
                break
    finally:
        consumer.shutdown()
    return got


def test_node_producer_sends_tags_keys_and_properties_that_python_consumes(
    broker: Standalone,
) -> None:
    broker.create_topic("node-normal", queues=4)
    messages = [
        {
            "body": f"hello-{i}",
            "tag": f"tag-{i % 3}",
            "keys": [f"key-{i}", f"other-{i}"],
            "properties": {"index": str(i), "origin": "node"},
        }
        for i in range(30)
    ]
    receipts = produce(broker, "node-normal", messages)
    assert all("error" not in r for r in receipts), receipts
    # The proxy fills transaction_id with the message id for every send.
    assert all(r["transactionId"] == r["messageId"] for r in receipts)
    assert len({r["messageId"] for r in receipts}) == 30

    got = py_drain(broker, "node-normal", "g-node-to-py", 30)
    by_index = {int(m.properties["index"]): m for m in got}
    assert sorted(by_index) == list(range(30))
    for i, m in by_index.items():
        assert m.body == f"hello-{i}".encode()
        assert m.tag == f"tag-{i % 3}"
        assert sorted(m.keys) == sorted([f"key-{i}", f"other-{i}"])
        assert m.properties["origin"] == "node"
        assert m.message_id == receipts[i]["messageId"]


def test_node_fifo_groups_keep_order_and_consumers_see_the_sharding_key(
    broker: Standalone,
) -> None:
    broker.create_topic("node-fifo", queues=4, message_type="FIFO")
    broker.create_group("g-node-fifo", fifo=True)
    messages = [
        {"body": f"m-{i}", "messageGroup": f"order-{i % 4}", "properties": {"index": str(i)}}
        for i in range(40)
    ]
    receipts = produce(broker, "node-fifo", messages)
    assert all("error" not in r for r in receipts), receipts
    deliveries = consume(broker, "simple", "node-fifo", "g-node-fifo", want=40, seconds=60)
    per_group: dict[str, list[int]] = defaultdict(list)
    for d in deliveries:
        assert not d["corrupted"]
        # Like the proxy, the message group reaches consumers twice: message_group and the
        # __SHARDINGKEY user property.
        assert d["properties"]["__SHARDINGKEY"] == d["messageGroup"]
        per_group[d["messageGroup"]].append(int(d["properties"]["index"]))
    assert sorted(per_group) == [f"order-{g}" for g in range(4)]
    for indexes in per_group.values():
        assert indexes == sorted(indexes) and len(indexes) == 10


def test_node_simple_consumer_receives_acks_and_changes_invisibility_of_python_messages(
    broker: Standalone,
) -> None:
    broker.create_topic("py-to-node", queues=2)
    sent = []
    for i in range(20):
        m = Message()
        m.topic = "py-to-node"
        m.body = f"from-python-{i}".encode() * (1 + i % 5)
        m.tag = "py"
        m.keys = f"k{i}"
        m.add_property("index", str(i))
        if i % 5 == 0:
            m.add_property("nack", "1")
        sent.append(m)
    ids = send_all(broker, "py-to-node", sent)
    deliveries = consume(
        broker, "simple", "py-to-node", "g-py-to-node", want=20, seconds=60, nackMs=2000
    )
    assert not [d for d in deliveries if d["corrupted"]], "the Node client found bad digests"
    by_id: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for d in deliveries:
        by_id[d["messageId"]].append(d)
    assert sorted(by_id) == sorted(ids)
    for mid, seen in by_id.items():
        i = int(seen[0]["properties"]["index"])
        assert seen[0]["body"] == f"from-python-{i}" * (1 + i % 5)
        assert seen[0]["tag"] == "py" and seen[0]["keys"] == [f"k{i}"]
        if i % 5 == 0:
            # changeInvisibleDuration(2 s) instead of an ack: delivered again, attempt 2.
            assert [d["deliveryAttempt"] for d in seen] == [1, 2], mid
            assert seen[1]["at"] - seen[0]["at"] >= 1800
        else:
            assert [d["deliveryAttempt"] for d in seen] == [1], mid


def test_node_push_consumer_receives_every_message_and_retries_with_the_broker_backoff(
    broker: Standalone,
) -> None:
    """Before tmq sent MD5 digests, this client flagged every message corrupted and its
    PushConsumer discarded all of them: 0 of 100 reached the listener."""
    broker.create_topic("node-push", queues=4)
    messages = [
        {"body": f"push-{i}", "properties": {"index": str(i), **({"fail": "1"} if i < 3 else {})}}
        for i in range(100)
    ]
    receipts = produce(broker, "node-push", messages)
    assert all("error" not in r for r in receipts), receipts
    deliveries = consume(
        broker, "push", "node-push", "g-node-push", want=100, seconds=60, failTimes=1
    )
    assert not [d for d in deliveries if d["corrupted"]]
    by_index: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for d in deliveries:
        by_index[int(d["properties"]["index"])].append(d)
    assert sorted(by_index) == list(range(100)), "every message reaches the listener"
    for i in range(3):
        first, second = by_index[i][:2]
        assert [first["deliveryAttempt"], second["deliveryAttempt"]] == [1, 2]
        # The group's first backoff step is 1 s (the proxy's customized policy); this client
        # ignores that policy and asks for 0 ms, and the broker holds it to the step.
        assert second["at"] - first["at"] >= 950, by_index[i]
    for i in range(3, 100):
        assert [d["deliveryAttempt"] for d in by_index[i]] == [1]


def test_a_message_no_consumer_could_receive_is_refused_at_send(broker: Standalone) -> None:
    broker.create_topic("node-big", queues=1)
    four_mib = 4 * 1024 * 1024
    [too_big, fits] = produce(
        broker,
        "node-big",
        [{"body": "x", "repeat": four_mib}, {"body": "y", "repeat": four_mib - 8192}],
    )
    # A 4 MiB body passes the proxy's body limit but, with its envelope, exceeds what gRPC
    # clients receive by default: refused at send (the client checks the max_body_size its
    # Settings carry), not stuck in front of every consumer.
    assert "error" in too_big, too_big
    assert "error" not in fits, fits
    [delivered] = consume(broker, "simple", "node-big", "g-node-big", want=1, seconds=30)
    assert delivered["bodyLength"] == four_mib - 8192 and not delivered["corrupted"]


def test_node_simple_consumer_with_a_sql92_filter_gets_only_matching_messages(
    broker: Standalone,
) -> None:
    broker.create_topic("node-sql", queues=2)
    messages = [
        {"body": f"s-{i}", "tag": "t", "properties": {"n": str(i), "kind": ("a", "b")[i % 2]}}
        for i in range(20)
    ]
    assert all("error" not in r for r in produce(broker, "node-sql", messages))
    deliveries = consume(
        broker, "simple", "node-sql", "g-node-sql", sql="kind = 'a' AND n >= 10", want=5, seconds=30
    )
    assert sorted(int(d["properties"]["n"]) for d in deliveries) == [10, 12, 14, 16, 18]


def test_node_transactions_commit_roll_back_and_answer_check_backs(tmp_path: Path) -> None:
    """The Node client's Transaction and TransactionChecker: a committed and a rolled-back
    message, and two left to the broker's check-back, which the checker decides."""
    ensure_node_client()
    fast = {
        "TMQ_BROKER_TRANSACTION_TIMEOUT_MS": "1000",
        "TMQ_BROKER_TRANSACTION_CHECK_INTERVAL_MS": "1000",
    }
    b = Standalone(tmp_path / "data", env=fast).start()
    try:
        b.create_topic("node-txn", queues=2, message_type="TRANSACTION")
        result = node(
            {
                "cmd": "transact",
                "endpoint": b.endpoint,
                "topic": "node-txn",
                "seconds": 6,
                "answers": {"k-check-yes": "COMMIT", "k-check-no": "ROLLBACK"},
                "messages": [
                    {"body": "committed", "keys": ["k-commit"], "end": "commit"},
                    {"body": "rolled back", "keys": ["k-rollback"], "end": "rollback"},
                    {"body": "checked yes", "keys": ["k-check-yes"]},
                    {"body": "checked no", "keys": ["k-check-no"]},
                ],
            },
            timeout=90,
        )
        assert all(s["transactionId"] for s in result["sent"])
        assert {"k-check-yes", "k-check-no"} <= set(result["asked"])
        assert not {"k-commit", "k-rollback"} & set(result["asked"])
        got = py_drain(b, "node-txn", "g-node-txn", 2)
        assert sorted(m.body for m in got) == [b"checked yes", b"committed"]
    finally:
        b.stop()


def test_node_delay_messages_arrive_at_their_delivery_timestamp(broker: Standalone) -> None:
    broker.create_topic("node-delay", queues=2, message_type="DELAY")
    start = time.time_ns() // 1_000_000
    due = {f"k-delay-{i}": start + 2500 + 200 * i for i in range(5)}
    sent = produce(
        broker,
        "node-delay",
        [{"body": key, "keys": [key], "deliveryMs": ms} for key, ms in due.items()],
    )
    assert all("error" not in r for r in sent), sent
    got = consume(broker, "simple", "node-delay", "g-node-delay", want=5, seconds=20)
    assert sorted(m["body"] for m in got) == sorted(due)
    for m in got:
        assert m["deliveryTimestamp"] == due[m["body"]]
        assert m["receivedAt"] >= due[m["body"]], "not before its delivery time"
