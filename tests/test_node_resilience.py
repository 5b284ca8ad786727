"""Apache's RocketMQ 5 Node.js client (tests/node_harness.py) against real tmq processes where
things go wrong: a FIFO consumer that stops mid-batch, a transactional producer killed before it
ends its transactions, a consumer killed (SIGKILL) during its long poll, hostile names, bodies
and groups, and a master killed under a Node producer and consumer. tests/test_node_client.py
covers the ordinary paths (tags, keys, FIFO, delay, transactions, push, SQL92)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from broker_harness import Standalone, send_batches
from node_harness import NODE_DIR, ensure_node_client, node
from rocketmq.grpc_protocol import definition_pb2 as d


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Standalone]:
    ensure_node_client()
    fast = {
        "TMQ_BROKER_TRANSACTION_TIMEOUT_MS": "1000",
        "TMQ_BROKER_TRANSACTION_CHECK_INTERVAL_MS": "1000",
    }
    b = Standalone(tmp_path_factory.mktemp("node-res") / "data", env=fast).start()
    yield b
    assert b.stop() == 0


def produce(endpoint: str, topic: str, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    result: list[dict[str, Any]] = node(
        {"cmd": "produce", "endpoint": endpoint, "topic": topic, "messages": messages}
    )
    return result


def simple(endpoint: str, topic: str, group: str, **options: Any) -> list[dict[str, Any]]:
    result: list[dict[str, Any]] = node(
        {"cmd": "simple", "endpoint": endpoint, "topic": topic, "group": group, **options},
        timeout=options.get("seconds", 60) + 60,
    )
    return result


def node_process(command: dict[str, Any], stderr: Path | None = None) -> subprocess.Popen[str]:
    """The driver as a child process whose stdout lines the test reads as they come; its
    stderr to a file (``stderr``) when it runs long enough to fill a pipe nobody reads."""
    return subprocess.Popen(
        ["node", str(NODE_DIR / "driver.js"), json.dumps(command)],
        cwd=NODE_DIR,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE if stderr is None else stderr.open("w"),
        text=True,
        env={**os.environ, "HOME": str(NODE_DIR)},
    )


def next_json_line(proc: subprocess.Popen[str], what: str) -> dict[str, Any]:
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line:
        proc.wait(10)
        stderr = proc.stderr.read() if proc.stderr else ""
        raise AssertionError(f"the driver ended before {what} ({proc.returncode}): {stderr}")
    value: dict[str, Any] = json.loads(line)
    assert "fatal" not in value, value
    return value


def sigkill(proc: subprocess.Popen[str]) -> None:
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(10)
    assert proc.returncode == -signal.SIGKILL


def test_node_fifo_many_groups_keep_order_across_a_consumer_that_stops_mid_batch(
    broker: Standalone,
) -> None:
    """30 message groups of 6 over 4 queues. The first consumer acks 50 messages and stops with
    the rest of its batch unacked (3 s invisible); a new consumer process then gets every other
    message, each group continuing exactly where the first left it: the unacked ones again
    (attempt 2), before anything later of their group."""
    broker.create_topic("node-fifo-restart", queues=4, message_type="FIFO")
    broker.create_group("g-node-fifo-restart", fifo=True)
    groups, per = 30, 6
    messages = [
        {"body": f"m-{g}-{i}", "messageGroup": f"grp-{g}", "properties": {"i": str(i)}}
        for i in range(per)
        for g in range(groups)
    ]
    receipts = produce(broker.endpoint, "node-fifo-restart", messages)
    assert all("error" not in r for r in receipts), receipts
    first = simple(
        broker.endpoint,
        "node-fifo-restart",
        "g-node-fifo-restart",
        want=groups * per,
        stopAfterAcks=50,
        invisibleMs=3000,
        batch=32,
        seconds=40,
    )
    acked_first = [m for m in first if not m.get("left")]
    left = [m for m in first if m.get("left")]
    assert len(acked_first) == 50 and left, "the first consumer stopped mid-batch"
    second = simple(
        broker.endpoint,
        "node-fifo-restart",
        "g-node-fifo-restart",
        want=groups * per - 50,
        invisibleMs=20000,
        batch=32,
        seconds=60,
    )
    order: dict[str, list[int]] = defaultdict(list)
    for m in acked_first + second:
        assert m["properties"]["__SHARDINGKEY"] == m["messageGroup"]
        order[m["messageGroup"]].append(int(m["properties"]["i"]))
    # Every group in order, each message acknowledged once, across the two processes.
    assert order == {f"grp-{g}": list(range(per)) for g in range(groups)}
    attempts = {m["messageId"]: m["deliveryAttempt"] for m in second}
    assert all(attempts[m["messageId"]] == 2 for m in left), (left, attempts)
    assert sum(a == 1 for a in attempts.values()) == groups * per - 50 - len(left)


def test_node_transaction_of_a_killed_producer_is_decided_by_another_producers_checker(
    broker: Standalone,
) -> None:
    """A Node producer sends two transactional messages and is killed (SIGKILL) before ending
    either. The broker's check-back goes to a second Node producer of the topic, whose checker
    commits one and rolls back the other: only the committed one is ever delivered."""
    broker.create_topic("node-txn-orphan", queues=2, message_type="TRANSACTION")
    doomed = node_process(
        {
            "cmd": "transact",
            "endpoint": broker.endpoint,
            "topic": "node-txn-orphan",
            "seconds": 0,
            "hang": True,
            # The doomed producer's own checker must never be the one that decides.
            "answers": {},
            "messages": [
                {"body": "orphan yes", "keys": ["k-orphan-yes"]},
                {"body": "orphan no", "keys": ["k-orphan-no"]},
            ],
        }
    )
    try:
        sent = next_json_line(doomed, "its sends")["sent"]
        assert len(sent) == 2 and all(s["transactionId"] for s in sent)
    finally:
        sigkill(doomed)
    # Nothing is visible before a decision.
    assert simple(broker.endpoint, "node-txn-orphan", "g-node-orphan", want=1, seconds=3) == []
    checker = node(
        {
            "cmd": "transact",
            "endpoint": broker.endpoint,
            "topic": "node-txn-orphan",
            "seconds": 6,
            "answers": {"k-orphan-yes": "COMMIT", "k-orphan-no": "ROLLBACK"},
            "messages": [],
        },
        timeout=60,
    )
    assert {"k-orphan-yes", "k-orphan-no"} <= set(checker["asked"]), checker
    got = simple(broker.endpoint, "node-txn-orphan", "g-node-orphan", want=2, seconds=6)
    assert [m["body"] for m in got] == ["orphan yes"]
    assert got[0]["messageId"] == sent[0]["messageId"]


def test_a_node_consumer_killed_during_its_long_poll_leaves_the_next_message_to_others(
    broker: Standalone,
) -> None:
    """Decision 1001 with the Node client: a SimpleConsumer in a 20 s long poll asking for
    5 minutes of invisibility is killed (SIGKILL) 2 s in; messages sent at once go to the
    next Node consumer of the group as first attempts, within seconds (not after 5 minutes).
    With decision 1001 undone (no check before the pop, no release), it failed."""
    broker.create_topic("node-killed-poll", queues=1)
    # The group's position is set by a first receive that finds nothing.
    assert simple(broker.endpoint, "node-killed-poll", "g-killed", want=1, seconds=3) == []
    victim = node_process(
        {
            "cmd": "simple",
            "endpoint": broker.endpoint,
            "topic": "node-killed-poll",
            "group": "g-killed",
            "want": 1,
            "seconds": 60,
            "awaitMs": 20000,
            "invisibleMs": 300000,
            "announce": True,
        }
    )
    try:
        assert next_json_line(victim, "its poll") == {"polling": 1}
        time.sleep(2)
    finally:
        sigkill(victim)
    # At once, as on a busy topic (a Node producer takes a second or two to start, by when
    # the abandoned poll has looked at its stream): it looks only after a pop, and otherwise
    # waits up to 1 s at a time for a message.
    sent = send_batches(
        broker.endpoint,
        "node-killed-poll",
        [(f"after-kill-{i}".encode(), "k", "t") for i in range(3)],
    )
    assert len(sent) == 3
    time.sleep(3)  # the abandoned poll wakes up at the new messages
    started = time.monotonic()
    got = simple(broker.endpoint, "node-killed-poll", "g-killed", want=3, seconds=20)
    assert time.monotonic() - started < 20
    assert sorted(m["body"] for m in got) == [f"after-kill-{i}" for i in range(3)]
    assert [m["deliveryAttempt"] for m in got] == [1, 1, 1]


def test_hostile_topics_bodies_and_groups_get_their_status_codes_in_the_node_client(
    broker: Standalone, tmp_path: Path
) -> None:
    """Every refusal reaches the Node client as the RocketMQ status its StatusChecker maps to
    an exception with that code, and the broker goes on serving. A name no topic can have was
    TOPIC_NOT_FOUND ("is not served"): QueryRoute asked the NameServers before checking it."""
    broker.create_topic("node-hostile", queues=1)
    # Spaces, a path, 200 characters (the limit is 127), non-ASCII, a newline.
    hostile = ["a b", "../../etc/passwd", "x" * 200, "topic\u00e9", "a\nb"]
    results = produce(
        broker.endpoint,
        "node-hostile",
        [{"topic": t, "body": "hostile"} for t in hostile]
        + [{"topic": "no-such-topic", "body": "missing"}, {"body": "fine"}],
    )
    assert [r.get("code") for r in results] == [d.ILLEGAL_TOPIC] * len(hostile) + [
        d.TOPIC_NOT_FOUND,
        None,
    ], results
    assert "error" not in results[-1], results
    # A hostile consumer group name: refused with ILLEGAL_CONSUMER_GROUP.
    with pytest.raises(AssertionError, match=f"response-code={d.ILLEGAL_CONSUMER_GROUP}"):
        simple(broker.endpoint, "node-hostile", "bad group/..", want=1, seconds=3)
    [fine] = simple(broker.endpoint, "node-hostile", "g-node-hostile", want=1, seconds=10)
    assert fine["body"] == "fine"

    # No auto-created groups, and a 64 KiB body limit, which the Node client learns from the
    # broker's Settings and enforces before sending.
    strict = Standalone(
        tmp_path / "strict",
        env={"TMQ_BROKER_AUTO_CREATE_GROUPS": "false", "TMQ_LIMITS_MAX_BODY_BYTES": "65536"},
    )
    strict.start()
    try:
        strict.create_topic("node-strict", queues=1)
        too_big, fits = produce(
            strict.endpoint,
            "node-strict",
            [{"body": "x", "repeat": 65537}, {"body": "y", "repeat": 65536}],
        )
        # Refused by the client once the broker's Settings reached it (its own default is
        # 4 MiB), or else by the broker with MESSAGE_BODY_TOO_LARGE: the first send can race
        # the Settings, which the client applies when the Telemetry stream brings them.
        if too_big.get("code") is None:
            assert "max size=65536 bytes" in too_big.get("error", ""), too_big
        else:
            assert too_big["code"] == d.MESSAGE_BODY_TOO_LARGE, too_big
            assert "the limit is 65536" in too_big["error"], too_big
        assert "error" not in fits, fits
        with pytest.raises(AssertionError, match=f"response-code={d.CONSUMER_GROUP_NOT_FOUND}"):
            simple(strict.endpoint, "node-strict", "g-never-created", want=1, seconds=3)
        strict.create_group("g-created")
        [got] = simple(strict.endpoint, "node-strict", "g-created", want=1, seconds=10)
        assert got["bodyLength"] == 65536 and not got["corrupted"]
    finally:
        assert strict.stop() == 0


class Lines:
    """A driver process's stdout read line by line on a thread; ``values(key)``: the values of
    every ``{key: value}`` line so far."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.proc = proc
        self.lines: list[dict[str, Any]] = []
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(json.loads(line))

    def values(self, key: str) -> list[Any]:
        return [line[key] for line in list(self.lines) if key in line]

    def result(self, timeout: float = 60) -> dict[str, Any]:
        self.proc.wait(timeout)
        self._thread.join(10)
        stderr = self.proc.stderr.read() if self.proc.stderr else ""
        assert self.proc.returncode == 0, (self.proc.returncode, self.lines[-1:], stderr[-3000:])
        last: dict[str, Any] = self.lines[-1]
        return last


def test_node_producer_and_consumer_carry_on_through_a_master_kill(tmp_path: Path) -> None:
    """A SYNC replica group (etcd-elected), a Node producer sending one message at a time and a
    Node SimpleConsumer receiving, both through the slave. The master is killed (SIGKILL): the
    slave is elected, the old master rejoins as its slave, the producer's sends are
    acknowledged again, and the same consumer
    process receives every acknowledged message, those sent before the kill and after it.
    Routes named each member as an address of the group's one broker: the Node client joins
    them into one gRPC target, "a:p,b:q", which no resolver takes, and never sent anything."""
    from tests.ha_failover import is_master, wait_for
    from tests.test_ha import TOPIC
    from tests.test_ha_failover import _etcd_sync_state_set, _topic_count, two_members

    ensure_node_client()
    stop_producer, stop_consumer = tmp_path / "stop-producer", tmp_path / "stop-consumer"
    with two_members(tmp_path, "sync") as (etcd, group):
        a, b = group.members[0], group.members[1]
        wait_for("b is in sync", lambda: group.in_sync(2))
        wait_for("b is in the SyncStateSet", lambda: _etcd_sync_state_set(etcd) == [1, 2])
        # The Node client takes one access point (given "a;b" it asks DNS for "a,b"): b, the
        # member that survives; it forwards to the master what needs it.
        common = {"endpoint": b.endpoint, "topic": TOPIC}
        producer = Lines(
            node_process(
                {"cmd": "produceFor", "stopFile": str(stop_producer), **common},
                stderr=tmp_path / "producer.err",
            )
        )
        consumer = Lines(
            node_process(
                {
                    "cmd": "simple",
                    "group": "g-node-failover",
                    "want": 0,
                    "stopFile": str(stop_consumer),
                    **common,
                },
                stderr=tmp_path / "consumer.err",
            )
        )
        try:
            wait_for("acks before the kill", lambda: len(producer.values("acked")) >= 30)
            wait_for("receipts before the kill", lambda: len(consumer.values("got")) >= 10)
            wait_for("a holds the acked", lambda: _topic_count(a, TOPIC) >= 30)
            a.kill9()
            killed_ms = time.time() * 1000
            wait_for("b is elected", lambda: is_master(b), timeout=90)
            # SYNC with min_in_sync_replicas 2: b takes sends once a slave is back in sync;
            # a returns (truncating any tail b lacks) as that slave.
            group.start(a)
            acked_at_kill = len(producer.values("acked"))
            wait_for(
                "acks after the election",
                lambda: len(producer.values("acked")) >= acked_at_kill + 30,
                timeout=90,
            )
        except BaseException:
            stop_consumer.touch()
            for name in ("producer", "consumer"):
                print(f"--- Node {name}:", (tmp_path / f"{name}.err").read_text()[-3000:])
            raise
        finally:
            stop_producer.touch()
        sent = producer.result()
        acked = {n for n, _ in sent["acked"]}
        before = {n for n, at in sent["acked"] if at < killed_ms}
        after = acked - before
        assert len(before) >= 30 and len(after) >= 30, sent["errors"]
        try:
            wait_for(
                "the consumer received every acknowledged message",
                lambda: acked <= {int(body.split("-")[1]) for body in consumer.values("got")},
                timeout=90,
            )
        finally:
            stop_consumer.touch()
        received = consumer.result()
        got = {int(body.split("-")[1]) for body in consumer.values("got")}
        # Every acknowledged message, and nothing but what was sent (a send that failed in the
        # failover may still have been stored).
        assert acked <= got <= acked | set(sent["failed"]), received


def test_a_one_address_route_names_the_member_asked_when_it_is_in_the_group() -> None:
    """broker/ha/routes.py's rule for the Node client, over every case: the asking member for
    its own group, the first registration for another group, and every member for everybody
    else (unchanged)."""
    from broker.ha.routes import group_queues
    from remoting import namesrv_pb2 as nspb

    route = nspb.TopicRoute(
        brokers=[
            nspb.BrokerQueues(
                broker_name=name,
                broker_id=member,
                endpoint=nspb.Endpoint(host="127.0.0.1", port=port),
                queues=2,
                perm=6,
                message_type="NORMAL",
            )
            for name, member, port in [("g-a", 0, 1001), ("g-a", 2, 1002), ("g-b", 0, 2001)]
        ]
    )

    def addresses(one: tuple[str, int] | None) -> dict[str, set[int]]:
        out: dict[str, set[int]] = defaultdict(set)
        for q in group_queues(route, "t", "", one):
            out[q.broker.name].update(a.port for a in q.broker.endpoints.addresses)
        return dict(out)

    assert addresses(None) == {"g-a": {1001, 1002}, "g-b": {2001}}
    assert addresses(("127.0.0.1", 1002)) == {"g-a": {1002}, "g-b": {2001}}
    assert addresses(("127.0.0.1", 2001)) == {"g-a": {1001}, "g-b": {2001}}
