"""The failover scenario, shared by tests/test_ha_failover.py (a few kills) and
bench/replication.py (ten): a 3-node etcd, a NameServer, and one replica group of three
``tmq broker start --config`` processes electing their master through etcd. Apache's Python
client produces continuously (one message per send, each body unique); the master is killed
with SIGKILL ``kills`` times (each new master is the next victim) and restarted, so that it
rejoins as a slave. Afterwards every consumer group receives every message, and the queues are
read back to count losses and duplicates.

``producers`` > 1 sends from that many threads at once (each message still unique), so that
several acknowledged messages are in flight on the replication stream when the master dies:
ASYNC mode loses them, SYNC must not (a single sender has at most one message in flight, and
ASYNC's loss per kill is then mostly zero, which says nothing)."""

from __future__ import annotations

import bisect
import itertools
import json
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rocketmq.grpc_protocol.definition_pb2 import INVALID_RECEIPT_HANDLE

from tests import process_logs
from tests.broker_harness import REPO, free_port, pull_all, terminate, tmq
from tests.etcd_harness import EtcdCluster
from tests.test_ha import QUEUES, TOPIC, GroupMember, describe_members


@dataclass
class FailoverResult:
    acked: int = 0
    acked_lost: int = 0
    duplicated_in_queues: int = 0
    failover_s: list[float] = field(default_factory=list)
    groups_complete: dict[str, bool] = field(default_factory=dict)
    send_failures: int = 0
    # Acknowledged messages lost, attributed to the kill that followed their acknowledgement.
    acked_lost_per_kill: list[int] = field(default_factory=list)
    producers: int = 1
    epochs: list[int] = field(default_factory=list)
    # `tmq cluster status --json` at the end.
    cluster_status: list[dict[str, Any]] = field(default_factory=list)
    send_errors: dict[str, int] = field(default_factory=dict)
    # Acks answered INVALID_RECEIPT_HANDLE while the groups consumed (each message came again).
    acks_refused: int = 0

    def summary(self) -> dict[str, Any]:
        times = sorted(self.failover_s)
        return {
            "kills": len(times),
            "acked": self.acked,
            "acked_lost": self.acked_lost,
            "acked_lost_per_kill": self.acked_lost_per_kill,
            "producers": self.producers,
            "duplicated_in_queues": self.duplicated_in_queues,
            "failover_p50_s": round(statistics.median(times), 2) if times else None,
            "failover_max_s": round(max(times), 2) if times else None,
            "failover_s": [round(t, 2) for t in times],
            "send_failures": self.send_failures,
            "send_errors": self.send_errors,
            "groups_complete": self.groups_complete,
            "acks_refused": self.acks_refused,
            "epochs": self.epochs,
        }


def wait_for(what: str, condition: Any, timeout: float = 60.0) -> Any:
    """``condition()``'s first truthy value within ``timeout``; an exception counts as false
    (a member restarting refuses calls), and the last one is named if the wait times out, with
    every member's state and log tail."""
    deadline = time.monotonic() + timeout
    error: Exception | None = None
    while True:
        try:
            value = condition()
        except Exception as e:
            value, error = None, e
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(
                f"timed out waiting until {what} (last error: {error!r:.500})\n{describe_members()}"
            )
        time.sleep(0.1)


def is_master(member: GroupMember) -> bool:
    return (
        member.proc is not None
        and member.proc.poll() is None
        and (
            member.metric("tmq_replication_is_master") == 1
            and member.metric("tmq_replication_fenced") == 0
        )
    )


class Producer:
    """Apache's Producer, sending ``body-{n}`` for n = 0, 1, 2, ... from ``threads`` threads
    until stopped; records which were acknowledged and when."""

    def __init__(self, access_points: str, threads: int = 1) -> None:
        from rocketmq import ClientConfiguration, Credentials
        from rocketmq import Producer as ApacheProducer

        config = ClientConfiguration(access_points, Credentials(), request_timeout=5)
        self.producer = ApacheProducer(config, topics=[TOPIC])
        # n -> when its (successful) send started and when it was acknowledged
        self.acked: dict[int, tuple[float, float]] = {}
        self.failures = 0
        self.errors: Counter[str] = Counter()
        self._stop = threading.Event()
        self._numbers = itertools.count()
        self._threads = [
            threading.Thread(target=self._run, name=f"failover-producer-{i}", daemon=True)
            for i in range(threads)
        ]

    def start(self) -> None:
        self.producer.startup()
        for thread in self._threads:
            thread.start()

    def _run(self) -> None:
        from rocketmq import Message

        while not self._stop.is_set():
            n = next(self._numbers)
            m = Message()
            m.topic = TOPIC
            m.body = f"body-{n}".encode()
            m.keys = f"key-{n}"
            started = time.monotonic()
            try:
                self.producer.send(m)
            except Exception as e:
                self.failures += 1
                self.errors[str(e)[:160]] += 1
                time.sleep(0.05)
            else:
                self.acked[n] = (started, time.monotonic())

    def acked_since(self, t: float) -> int:
        """Sends started after ``t`` and acknowledged."""
        return sum(1 for started, _ in list(self.acked.values()) if started > t)

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(60)
        self.producer.shutdown()


@dataclass
class Consumed:
    """What one consumer group received, and which acknowledgements the broker refused."""

    got: set[int] = field(default_factory=set)
    # Bodies whose ack was answered INVALID_RECEIPT_HANDLE: the handle was issued in another
    # member's or another term's pop state (a failover, or a master fenced at load and
    # elected again), so the ack did not count and the message must come again (decision 860).
    refused: set[int] = field(default_factory=set)
    # Of those, the ones received again after the refusal.
    redelivered: set[int] = field(default_factory=set)

    @property
    def complete(self) -> bool:
        return self.refused <= self.redelivered


def consume_all(access_points: str, group: str, want: set[int], seconds: float) -> Consumed:
    """Receive and acknowledge until every body in ``want`` came, and every message whose ack
    the broker refused (code 40013, "not acknowledged") came again, or ``seconds`` pass. Any
    other failed ack fails the test: only a refusal says the ack had no effect."""
    from rocketmq import ClientConfiguration, Credentials, FilterExpression, SimpleConsumer
    from rocketmq.v5.exception import ClientException

    config = ClientConfiguration(access_points, Credentials(), request_timeout=10)
    consumer = SimpleConsumer(config, group, {TOPIC: FilterExpression()}, await_duration=2)
    consumer.startup()
    out = Consumed()
    deadline = time.monotonic() + seconds
    try:
        while not (want <= out.got and out.complete) and time.monotonic() < deadline:
            try:
                messages = consumer.receive(32, 30)
            except Exception:
                time.sleep(0.2)
                continue
            for m in messages:
                n = int(m.body.decode().split("-")[1])
                out.got.add(n)
                if n in out.refused:
                    out.redelivered.add(n)
                try:
                    consumer.ack(m)
                except ClientException as e:
                    if e.code != INVALID_RECEIPT_HANDLE:
                        raise
                    out.refused.add(n)
                    out.redelivered.discard(n)
    finally:
        consumer.shutdown()
    return out


def lost_per_kill(acked_at: list[float], kill_times: list[float]) -> list[int]:
    """How many of the lost messages (by acknowledgement time) each kill took: a message is
    charged to the first kill after it was acknowledged (one acknowledged after the last kill
    would be a loss with no kill to blame: charged to the last, so that none goes uncounted)."""
    counts = [0] * len(kill_times)
    for at in acked_at if kill_times else []:
        i = bisect.bisect_left(kill_times, at)
        counts[min(i, len(kill_times) - 1)] += 1
    return counts


def start_namesrv(root: Path, port: int = 0) -> tuple[subprocess.Popen[bytes], str]:
    """A NameServer on ``port`` (0: a free one), logging to ``root``/namesrv.log."""
    port = port or free_port()
    command = ["namesrv", "start", "--host", "127.0.0.1", "--port", str(port)]
    process_logs.track("namesrv", root / "namesrv.log")
    proc = subprocess.Popen(
        [sys.executable, "-m", "cli.app", *command],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=(root / "namesrv.log").open("ab"),
    )
    return proc, f"127.0.0.1:{port}"


class Group:
    """Three members with controller-elected roles."""

    def __init__(
        self,
        root: Path,
        etcd: EtcdCluster,
        namesrv: str,
        mode: str,
        max_lag_ms: int = 3000,
        lease_ttl_ms: int = 2000,
        env: dict[str, str] | None = None,
    ) -> None:
        self.max_lag_ms = max_lag_ms
        # Every member's extra environment (a test's transaction check timing, an admin).
        self.env = env
        # The tests keep a short lease (their waits are sized for it); the bench passes its own.
        self.lease_ttl_ms = lease_ttl_ms
        self.members = [GroupMember(root, f"node{i}", free_port()) for i in (1, 2, 3)]
        self.etcd = etcd
        self.namesrv = namesrv
        self.mode = mode

    def start(self, member: GroupMember) -> None:
        member.start(
            "slave",
            self.members.index(member) + 1,
            mode=self.mode,
            min_in_sync_replicas=2 if self.mode == "sync" else 1,
            sync_timeout_ms=3000,
            namesrv=self.namesrv,
            etcd=self.etcd.endpoints,
            lease_ttl_ms=self.lease_ttl_ms,
            max_lag_ms=self.max_lag_ms,
            file_size=4 << 20,
            env=self.env,
        )

    @property
    def access_points(self) -> str:
        return ";".join(m.endpoint for m in self.members)

    def master(self) -> GroupMember | None:
        for m in self.members:
            try:
                if is_master(m):
                    return m
            except OSError:
                continue
        return None

    def in_sync(self, size: int) -> bool:
        master = self.master()
        return master is not None and (master.metric("tmq_replication_sync_state_set_size") == size)

    def routed(self) -> bool:
        """Every live member is in the topic's route (clients can fail over without waiting
        for their next route refresh)."""
        import grpc
        from rocketmq.grpc_protocol import definition_pb2 as d
        from rocketmq.grpc_protocol import service_pb2 as s
        from rocketmq.grpc_protocol import service_pb2_grpc

        live = {m.grpc_port for m in self.members if m.proc is not None and m.proc.poll() is None}
        master = self.master()
        if master is None:
            return False
        with grpc.insecure_channel(master.endpoint) as channel:
            reply = service_pb2_grpc.MessagingServiceStub(channel).QueryRoute(
                s.QueryRouteRequest(topic=d.Resource(name=TOPIC)), timeout=5
            )
        ports = {a.port for q in reply.message_queues for a in q.broker.endpoints.addresses}
        return ports == live

    def kill_all(self) -> None:
        for m in self.members:
            if m.proc is not None and m.proc.poll() is None:
                m.proc.kill()
                m.proc.wait()


def run_failover(
    root: Path, kills: int, mode: str = "sync", producers: int = 1, lease_ttl_ms: int = 2000
) -> FailoverResult:
    result = FailoverResult(producers=producers)
    kill_times: list[float] = []
    etcd = EtcdCluster(root).start()
    namesrv, namesrv_address = start_namesrv(root)
    group = Group(root, etcd, namesrv_address, mode, lease_ttl_ms=lease_ttl_ms)
    producer: Producer | None = None
    try:
        first = group.members[0]
        group.start(first)
        wait_for("node1 is elected master", lambda: is_master(first))
        for m in group.members[1:]:
            group.start(m)
        first.create_topic()
        wait_for("all three are in sync", lambda: group.in_sync(3))
        wait_for("all three are routed", group.routed)
        producer = Producer(group.access_points, producers)
        producer.start()
        wait_for("the producer is acknowledged", lambda: len(producer.acked) >= 50)
        for _ in range(kills):
            victim = wait_for("a master", group.master)
            wait_for("all three are in sync", lambda: group.in_sync(3), timeout=90)
            mark = time.monotonic()
            wait_for("acks before the kill", lambda m=mark: producer.acked_since(m) >= 20)
            victim.kill9()
            killed_at = time.monotonic()
            kill_times.append(killed_at)
            last_before = max(at for _, at in list(producer.acked.values()) if at <= killed_at)
            try:
                wait_for(
                    "an acknowledgement after the kill",
                    lambda k=killed_at: producer.acked_since(k) > 0,
                    timeout=120,
                )
            except AssertionError as e:
                errors = producer.errors.most_common(5)
                raise AssertionError(f"{e}; send errors: {errors}") from None
            first_after = min(at for st, at in list(producer.acked.values()) if st > killed_at)
            result.failover_s.append(first_after - last_before)
            new_master = wait_for("a new master", group.master)
            epoch = new_master.metric("tmq_replication_epoch")
            result.epochs.append(int(epoch or 0))
            group.start(victim)  # the old master returns: it truncates and rejoins as a slave
        wait_for("all three are in sync", lambda: group.in_sync(3), timeout=90)
        time.sleep(1)
        producer.stop()
        result.send_failures = producer.failures
        result.send_errors = dict(producer.errors.most_common(5))
        producer_acked = dict(producer.acked)
        acked = set(producer_acked)
        producer = None
        result.acked = len(acked)
        master = wait_for("a master", group.master)
        bodies = Counter(
            int(m.body.decode().split("-")[1]) for m in pull_all(master, TOPIC, QUEUES)
        )
        lost = acked - set(bodies)
        result.acked_lost = len(lost)
        result.acked_lost_per_kill = lost_per_kill([producer_acked[n][1] for n in lost], kill_times)
        result.duplicated_in_queues = sum(c - 1 for c in bodies.values() if c > 1)
        for name in ("g-failover-1", "g-failover-2"):
            consumed = consume_all(group.access_points, name, acked, seconds=90)
            result.groups_complete[name] = acked <= consumed.got and consumed.complete
            result.acks_refused += len(consumed.refused)
        status = tmq("cluster", "status", "--etcd", ",".join(etcd.endpoints), "--json")
        assert status.returncode == 0, status.stderr
        result.cluster_status = json.loads(status.stdout)
        return result
    finally:
        if producer is not None:
            producer.stop()
        group.kill_all()
        terminate(namesrv, 10)
        etcd.stop()
