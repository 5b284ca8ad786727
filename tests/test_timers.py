"""Delay (timer) messages through Apache's Python client against ``tmq standalone`` processes:
delivery at the requested time, the maximum delay, and kill -9 in the middle of a schedule."""

from __future__ import annotations

import os
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
from broker_harness import (
    Standalone,
    client_config,
    free_port,
    metric_sample,
    pull_all,
    send_batches,
)
from rocketmq import (
    FilterExpression,
    Message,
    Producer,
    SimpleConsumer,
)
from rocketmq.grpc_protocol import definition_pb2 as d
from rocketmq.grpc_protocol import service_pb2 as s
from rocketmq.grpc_protocol import service_pb2_grpc

from broker import admin_pb2 as apb
from broker.timer import ENTRY, PROPERTY_DELIVER_TIME, TimerService, as_timer_message
from tiered.config import StoreConfig
from tiered.record import Message as StoreMessage
from tiered.store import MessageStore

MAX_DELAY = {"TMQ_BROKER_TIMER_MAX_DELAY_MS": "600000"}  # 10 minutes


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[Standalone]:
    node = Standalone(tmp_path / "data", env=MAX_DELAY, metrics_port=free_port()).start()
    yield node
    node.stop()


def now_ms() -> int:
    return time.time_ns() // 1_000_000


def delayed(topic: str, key: str, due_ms: int) -> Message:
    m = Message()
    m.topic = topic
    m.body = f"body of {key}".encode()
    m.keys = key
    m.delivery_timestamp = due_ms
    return m


def receive(
    node: Standalone, topic: str, group: str, want: int, seconds: float
) -> list[tuple[Message, int]]:
    """(message, receive time in ms) for everything a group receives within ``seconds``, or
    until ``want`` messages came."""
    consumer = SimpleConsumer(
        client_config(node), group, {topic: FilterExpression()}, await_duration=1
    )
    consumer.startup()
    got: list[tuple[Message, int]] = []
    try:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and len(got) < want:
            for m in consumer.receive(32, 30):
                got.append((m, now_ms()))
                consumer.ack(m)
    finally:
        consumer.shutdown()
    return got


def send_raw(
    node: Standalone, topic: str, items: list[tuple[str, int]], pad: int = 0
) -> list[s.SendResultEntry]:
    """Delay messages ``(key, due ms)`` in batches over the protocol stubs."""
    stub = service_pb2_grpc.MessagingServiceStub(grpc.insecure_channel(node.endpoint))
    out = []
    for i in range(0, len(items), 100):
        request = s.SendMessageRequest()
        for key, due in items[i : i + 100]:
            body = f"body of {key}".encode() + b"." * pad
            m = request.messages.add(topic=d.Resource(name=topic), body=body)
            m.system_properties.message_id = os.urandom(16).hex().upper()
            m.system_properties.message_type = d.DELAY
            m.system_properties.keys.append(key)
            m.system_properties.born_timestamp.FromMilliseconds(now_ms())
            m.system_properties.delivery_timestamp.FromMilliseconds(due)
        reply = stub.SendMessage(request, timeout=30)
        assert reply.status.code == d.OK, reply.status
        out += list(reply.entries)
    return out


def messages_in_topic(node: Standalone, topic: str) -> int:
    described = node.admin().GetTopic(apb.GetTopicRequest(name=topic), timeout=10)
    return sum(q.max_offset - q.min_offset for q in described.queues)


def test_delay_messages_arrive_at_their_delivery_time_not_before(broker: Standalone) -> None:
    broker.create_topic("delay-basic", queues=2, message_type="DELAY")
    producer = Producer(client_config(broker), topics=["delay-basic"])
    producer.startup()
    start = now_ms()
    due = {f"k{i}": start + 3000 + 150 * i for i in range(10)}
    try:
        for key, when in due.items():
            producer.send(delayed("delay-basic", key, when))
        # Due in the past: delivered at once.
        producer.send(delayed("delay-basic", "k-past", start - 60_000))
    finally:
        producer.shutdown()
    deadline = time.monotonic() + 10  # dispatch is asynchronous
    while messages_in_topic(broker, "delay-basic") < 1 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert messages_in_topic(broker, "delay-basic") == 1, "only the past-due one is visible"
    deadline = time.monotonic() + 10  # the wheel reads the timer topic as it is dispatched
    while True:
        pending = metric_sample(broker, 'tmq_timer_pending{topic="delay-basic"}') or 0
        delivered = metric_sample(broker, "tmq_timer_delivered_total") or 0
        if pending + delivered == 10 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert (pending, delivered) == (10, 0) or now_ms() > start + 3000, (pending, delivered)
    assert pending + delivered == 10
    got = receive(broker, "delay-basic", "g-delay", 11, 20)
    keys = Counter(next(iter(m.keys)) for m, _ in got)
    assert keys == Counter([*due, "k-past"])
    for m, received in got:
        key = next(iter(m.keys))
        if key == "k-past":
            continue
        assert m.delivery_timestamp == due[key]
        assert received >= due[key], f"{key} arrived {due[key] - received} ms early"
        assert received - due[key] < 1500, f"{key} arrived {received - due[key]} ms late"
        assert m.born_timestamp // 1000 <= start // 1000 + 1, "the original born time is kept"
        assert m.body == f"body of {key}".encode()
    assert metric_sample(broker, "tmq_timer_delivered_total") == 10
    assert metric_sample(broker, 'tmq_timer_pending{topic="delay-basic"}') is None, "none pending"


def test_a_delivery_time_beyond_the_maximum_is_refused(broker: Standalone) -> None:
    broker.create_topic("delay-max", queues=1, message_type="DELAY")
    stub = service_pb2_grpc.MessagingServiceStub(grpc.insecure_channel(broker.endpoint))
    request = s.SendMessageRequest()
    m = request.messages.add(topic=d.Resource(name="delay-max"), body=b"too late")
    m.system_properties.message_id = "FAR0001"
    m.system_properties.message_type = d.DELAY
    m.system_properties.delivery_timestamp.FromMilliseconds(now_ms() + 3_600_000)
    reply = stub.SendMessage(request, timeout=10)
    assert reply.status.code == d.ILLEGAL_DELIVERY_TIME
    m.system_properties.delivery_timestamp.FromMilliseconds(now_ms() + 300_000)
    assert stub.SendMessage(request, timeout=10).status.code == d.OK


def test_kill_9_mid_schedule_delivers_every_timer_exactly_once(tmp_path: Path) -> None:
    node = Standalone(tmp_path / "data", env=MAX_DELAY).start()
    try:
        node.create_topic("delay-crash", queues=4, message_type="DELAY")
        start = now_ms()
        # 600 timers over 1..9 s; the broker dies at ~4 s and is down for ~3 s.
        items = [(f"k{i}", start + 1000 + (i * 8000) // 600) for i in range(600)]
        send_raw(node, "delay-crash", items)
        time.sleep(max(0.0, (start + 4000 - now_ms()) / 1000))
        delivered_before = messages_in_topic(node, "delay-crash")
        assert 0 < delivered_before < 600, delivered_before
        node.kill9()
        time.sleep(3)
        node.start()
        got = receive(node, "delay-crash", "g-crash", 600, 30)
        keys = Counter(next(iter(m.keys)) for m, _ in got)
        assert sorted(keys) == sorted(k for k, _ in items), "nothing lost"
        assert max(keys.values()) == 1, "nothing delivered twice"
        assert messages_in_topic(node, "delay-crash") == 600, "no duplicate in the topic either"
        for m, received in got:
            assert received >= m.delivery_timestamp
    finally:
        node.stop()


def test_delivered_and_committed_messages_replay_from_the_tier_after_release(
    tmp_path: Path,
) -> None:
    """Once delivered (or committed) they are ordinary messages: uploaded, released locally,
    and read back by PullMessage from the archive with their born and delivery times. The timer
    and transaction system topics hold no CommitLog file back once nothing there is pending."""
    quick = ["--commitlog-file-size", "128KiB", "--offload-interval", "1", "--upload-after", "1s"]
    node = Standalone(tmp_path / "data", extra=quick, env=MAX_DELAY).start()
    try:
        for name, kind in (
            ("tier-delay", "DELAY"),
            ("tier-txn", "TRANSACTION"),
            ("tier-filler", "NORMAL"),
        ):
            node.create_topic(name, queues=2, message_type=kind, tiered=True)
        start = now_ms()
        send_raw(
            node, "tier-delay", [(f"d{i}", start + 2000 + 5 * i) for i in range(200)], pad=1000
        )
        stub = service_pb2_grpc.MessagingServiceStub(grpc.insecure_channel(node.endpoint))
        for i in range(100):
            request = s.SendMessageRequest()
            m = request.messages.add(topic=d.Resource(name="tier-txn"), body=b"t" * 1000)
            m.system_properties.message_id = f"TXN{i:04d}"
            m.system_properties.message_type = d.TRANSACTION
            m.system_properties.keys.append(f"t{i}")
            [entry] = stub.SendMessage(request, timeout=10).entries
            ended = stub.EndTransaction(
                s.EndTransactionRequest(
                    topic=d.Resource(name="tier-txn"),
                    message_id=f"TXN{i:04d}",
                    transaction_id=entry.transaction_id,
                    resolution=d.COMMIT,
                    source=d.SOURCE_CLIENT,
                ),
                timeout=10,
            )
            assert ended.status.code == d.OK
        deadline = time.monotonic() + 30
        while messages_in_topic(node, "tier-delay") < 200:
            assert time.monotonic() < deadline, "the timers were not delivered"
            time.sleep(0.2)
        # Later traffic, so the last (never released) CommitLog files hold none of the above.
        send_batches(
            node.endpoint, "tier-filler", [(b"f" * 1000, f"f{i}", "x") for i in range(400)]
        )
        deadline = time.monotonic() + 90
        released = False
        while not released:
            assert time.monotonic() < deadline, "local CommitLog files were never released"
            time.sleep(0.5)
            released = all(
                all(q.hot_min_offset == q.max_offset for q in described.queues)
                for described in (
                    node.admin().GetTopic(apb.GetTopicRequest(name=topic), timeout=10)
                    for topic in ("tier-delay", "tier-txn")
                )
            )
        delayed_back = pull_all(node, "tier-delay", 2)
        assert sorted(m.system_properties.keys[0] for m in delayed_back) == sorted(
            f"d{i}" for i in range(200)
        )
        for m in delayed_back:
            sp = m.system_properties
            assert sp.delivery_timestamp.ToMilliseconds() >= start + 2000
            assert sp.store_timestamp.ToMilliseconds() >= sp.delivery_timestamp.ToMilliseconds()
            assert sp.born_timestamp.ToMilliseconds() <= start + 1000
        committed_back = pull_all(node, "tier-txn", 2)
        assert sorted(m.system_properties.message_id for m in committed_back) == [
            f"TXN{i:04d}" for i in range(100)
        ]
    finally:
        node.stop()


def test_pending_timers_wait_on_disk_and_an_overdue_one_shows_as_delivery_lag(
    small_config: StoreConfig, start_store: Callable[[StoreConfig], MessageStore]
) -> None:
    """The wheel on a test clock, not leading (a slave's: it enqueues, delivers nothing).
    Timers due in later minutes are in their bucket files on disk, not in memory; only the
    current minute is loaded. Two overdue timers show as delivery lag (what
    ``tmq_timer_delivery_lag_seconds`` and ``tmq topic describe`` report) until the wheel
    leads and delivers them."""
    store = start_store(small_config)
    minute = 1_800_000_000_000 - 1_800_000_000_000 % 60_000
    clock = [minute + 30_000]
    leading = [False]
    later = [minute + 60_000 * (1 + i % 10) + i for i in range(2000)]  # ten later minutes
    overdue = [clock[0] - 5_000, clock[0] - 4_000]
    store.put_messages(
        [
            as_timer_message(
                StoreMessage("orders", f"body {i}".encode(), 0, {PROPERTY_DELIVER_TIME: str(due)})
            )
            for i, due in enumerate(overdue + later)
        ]
    )
    assert store.wait_dispatched(10)
    timer_dir = small_config.data_dir / "timer"
    wheel = TimerService(
        store, timer_dir, lambda: ["orders"], clock=lambda: clock[0], leading=lambda: leading[0]
    )
    wheel.start()
    try:
        deadline = time.monotonic() + 10
        while wheel.stats().pending < 2002:
            assert time.monotonic() < deadline, wheel.stats()
            time.sleep(0.02)
        assert len(wheel._heap) == 2, "only the current minute is in memory"
        buckets = sorted(timer_dir.glob("*.bucket"))
        assert len(buckets) == 11
        assert sum(p.stat().st_size for p in buckets) == 2002 * ENTRY.itemsize
        stats = wheel.stats()
        assert stats.pending_by_topic == {"orders": 2002}
        assert stats.lag_seconds == 5.0, "the oldest overdue timer is 5 s late"
        assert store.max_offset("orders", 0) == 0, "a wheel that does not lead delivers nothing"
        leading[0] = True
        wheel.wakeup()
        deadline = time.monotonic() + 10
        while store.max_offset("orders", 0) < 2:
            assert time.monotonic() < deadline, "the overdue timers were not delivered"
            time.sleep(0.02)
        time.sleep(0.2)
        assert store.max_offset("orders", 0) == 2, "nothing before its time"
        assert wheel.stats().lag_seconds == 0.0
        assert wheel.stats().pending == 2000
    finally:
        wheel.stop()
