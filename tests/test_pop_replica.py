"""Pop reads served by a slave while its master is unreachable (decision 970).

A slave's store is a replica: it takes no appends of its own, so an expired delivery cannot be
copied to the retry topic or the dead-letter queue there. It is delivered again in place (as a
FIFO group's is), one past its attempt limit waits for a master, and every receive keeps working.
Real parts: a ``MessageStore`` that took the messages as a master and was then switched to
replica mode (what the HA controller does to a slave's store), the real ``PopService``, and its
clock moved by hand so that invisible times pass without sleeping.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import SMALL

from broker.metadata import BrokerMetadata, GroupConfig, TopicConfig, dlq_topic, retry_topic
from broker.pop import InvalidReceiptHandleError, PopService, Received, TagFilter
from tiered.config import StoreConfig
from tiered.record import Message
from tiered.store import MessageStore

ALL = TagFilter("*")


class Slave:
    """A replica store holding ``count`` messages of topic ``t`` (one queue) and a PopService
    over it, with a clock the test moves."""

    def __init__(
        self,
        tmp_path: Path,
        start_store: Callable[[StoreConfig], MessageStore],
        count: int,
    ) -> None:
        self.store = start_store(StoreConfig(data_dir=tmp_path / "store", **SMALL))
        self.metadata = BrokerMetadata(tmp_path / "config")
        self.topic = TopicConfig("t", queues=1)
        self.metadata.put_topic(self.topic)
        for i in range(count):
            self.store.put_message(
                Message(topic="t", queue_id=0, body=b"m%d" % i, properties={"KEYS": f"k{i}"})
            )
        assert self.store.wait_dispatched()
        self.store.set_replica(True)  # a slave's store: its master is unreachable
        self.now = 1_000_000
        self.pop = PopService(self.store, self.metadata, clock=lambda: self.now)

    def group(self, name: str, max_delivery_attempts: int = 16, fifo: bool = False) -> GroupConfig:
        """A consumer group, registered as the broker registers them (revives read it)."""
        cfg = GroupConfig(name, max_delivery_attempts=max_delivery_attempts, fifo=fifo)
        self.metadata.put_group(cfg)
        return cfg

    def receive(self, group: GroupConfig, count: int, invisible_ms: int = 1000) -> list[Received]:
        return self.pop.receive(group, self.topic, ALL, count, invisible_ms)


def offsets(got: list[Received]) -> list[int]:
    return [r.message.queue_offset for r in got]


def test_an_expired_delivery_on_a_replica_is_delivered_again_in_place_and_receives_go_on(
    tmp_path: Path, start_store: Callable[[StoreConfig], MessageStore]
) -> None:
    slave = Slave(tmp_path, start_store, 3)
    g1, g2 = slave.group("g1"), slave.group("g2")
    first = slave.receive(g1, 1)
    assert offsets(first) == [0] and first[0].attempt == 1
    slave.now += 5000  # its invisible time passes, unacknowledged

    # Another group, which has nothing in flight, still receives everything.
    assert offsets(slave.receive(g2, 3)) == [0, 1, 2]
    # The expired delivery comes again from the topic itself (no retry topic on a replica),
    # counted as a second attempt, before the messages not delivered yet.
    again = slave.receive(g1, 3)
    assert offsets(again) == [0, 1, 2]
    assert again[0].attempt == 2 and again[0].original_topic == "t"
    assert again[0].message.body == b"m0"
    assert slave.store.max_offset("t", 0) == 3
    assert not slave.store.queue_ids(retry_topic("g1"))
    assert slave.metadata.topic(retry_topic("g1")) is None
    # The first handle is of a delivery that was made again: refused.
    with pytest.raises(InvalidReceiptHandleError, match="redelivered"):
        slave.pop.ack("g1", first[0].receipt_handle)
    assert slave.metadata.offset("g1", "t", 0) == 0
    for r in again:
        slave.pop.ack("g1", r.receipt_handle)
    assert slave.metadata.offset("g1", "t", 0) == 3
    assert slave.receive(g1, 3) == []
    assert slave.pop.revive_expired() == 0


def test_a_delivery_past_its_attempt_limit_on_a_replica_waits_for_a_master(
    tmp_path: Path, start_store: Callable[[StoreConfig], MessageStore]
) -> None:
    """It cannot go to the DLQ (an append): it is neither delivered again nor counted as
    consumed, the group's other messages still flow, and a new term (the next change of role)
    delivers it from the committed offset."""
    slave = Slave(tmp_path, start_store, 2)
    group = slave.group("g", max_delivery_attempts=2)
    assert offsets(slave.receive(group, 1)) == [0]
    slave.now += 5000
    assert [(r.message.queue_offset, r.attempt) for r in slave.receive(group, 1)] == [(0, 2)]
    slave.now += 5000
    assert slave.pop.revive_expired() == 0  # nothing could be moved
    got = slave.receive(group, 3)
    assert offsets(got) == [1]
    slave.pop.ack("g", got[0].receipt_handle)
    slave.now += 5000
    assert slave.receive(group, 3) == []
    assert slave.metadata.offset("g", "t", 0) == 0  # offset 0 is not consumed
    assert slave.store.max_offset("t", 0) == 2
    assert not slave.store.queue_ids(dlq_topic("g"))
    assert slave.metadata.topic(dlq_topic("g")) is None

    slave.pop.new_term()
    assert offsets(slave.receive(group, 3)) == [0, 1]


def test_a_fifo_delivery_past_its_attempt_limit_on_a_replica_waits_and_other_groups_receive(
    tmp_path: Path, start_store: Callable[[StoreConfig], MessageStore]
) -> None:
    slave = Slave(tmp_path, start_store, 2)
    fifo = slave.group("f", max_delivery_attempts=1, fifo=True)
    assert offsets(slave.receive(fifo, 1)) == [0]
    slave.now += 5000
    assert slave.receive(fifo, 3) == []  # held: its successor waits behind it (FIFO)
    assert slave.metadata.offset("f", "t", 0) == 0
    assert offsets(slave.receive(slave.group("other"), 3)) == [0, 1]
    assert slave.store.max_offset("t", 0) == 2
    assert slave.metadata.topic(dlq_topic("f")) is None


def test_what_a_replica_kept_in_place_is_revived_once_the_store_takes_appends_again(
    tmp_path: Path, start_store: Callable[[StoreConfig], MessageStore]
) -> None:
    """Elected, the store takes appends: a held delivery goes to the DLQ and one waiting to be
    delivered again goes to the retry topic, as on any master (the new term the role change
    starts would forget them too; this does not rely on it)."""
    slave = Slave(tmp_path, start_store, 2)
    group = slave.group("g", max_delivery_attempts=2)
    assert offsets(slave.receive(group, 1)) == [0]
    slave.now += 5000
    assert offsets(slave.receive(group, 2)) == [0, 1]  # 0 in place (attempt 2), 1 first
    slave.now += 5000
    assert slave.pop.revive_expired() == 0  # 0 held, 1 to be delivered again
    slave.store.set_replica(False)
    assert slave.pop.revive_expired() == 2
    assert slave.store.wait_dispatched()
    assert [m.body for m in slave.store.get_messages(dlq_topic("g"), 0, 0, 8).messages] == [b"m0"]
    retried = slave.store.get_messages(retry_topic("g"), 0, 0, 8).messages
    assert [(m.body, m.reconsume_times) for m in retried] == [(b"m1", 1)]
    assert slave.metadata.offset("g", "t", 0) == 2
