"""Failover on the bad days a lease decides (decision 1150), shared by
tests/test_ha_bad_days.py (one round each) and bench/ha_bad_days.py (several):

- ``freeze``: the master's broker process is stopped (SIGSTOP; its lease keeper, a process of
  its own, keeps running and stops renewing once the broker's pulse is stale) and continued
  (SIGCONT) a few seconds after the group acknowledged through a new master;
- ``partition``: every etcd connection of the master (its controller's and its keeper's) goes
  through a forwarder of this process that, cut, drops everything in both directions without
  closing anything, as a partition does (calls hang until their timeouts); healed a few seconds
  after the group acknowledged through a new master. The master still reaches its slaves and
  its clients: the case where a master that did not fence would go on acknowledging.

A 3-node etcd, a NameServer, a SYNC group of three ``tmq broker start`` processes (min in-sync
replicas 2), Apache's Python client producing one message per send throughout. A prober sends
straight to the old master's endpoint by gRPC from the fault on, so that it is offered writes
while it is frozen (one send waits in its socket for SIGCONT) or partitioned, and after. After
every round the old master must rejoin as a slave by itself (no restart): the SyncStateSet
reaches 3 again. At the end every acknowledged message, the producer's and the prober's, must
be in the queues (read back by PullMessage): an old master that acknowledged after a new one
was elected, with a write the new one lacks, is a loss there.

Per round: ``elected_s`` (fault to etcd naming another master, polled every 50 ms through the
real endpoints), ``outage_s`` (the longest time without an acknowledgement from the last ack
before the fault to the first after the election), and for a partition ``fenced_s`` (fault to
the old master's ``tmq_replication_fenced`` reading 1, polled the same way) and the margin
between fence and election."""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import signal
import socket
import statistics
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from rocketmq.grpc_protocol import definition_pb2 as d
from rocketmq.grpc_protocol import service_pb2 as s
from rocketmq.grpc_protocol import service_pb2_grpc

from broker.ha.etcd import EtcdClient
from tests.broker_harness import pull_all, terminate
from tests.etcd_harness import EtcdCluster
from tests.ha_failover import Group, Producer, start_namesrv, wait_for
from tests.test_ha import QUEUES, TOPIC, GroupMember

# The prober's bodies are numbered from here, apart from the producer's.
PROBE_BASE = 10_000_000


class Blackhole:
    """A TCP forwarder on loopback in front of one etcd member. ``cut`` stops forwarding in
    both directions (what arrives is read and dropped) and holds new connections unanswered;
    nothing is closed, so callers wait for their own timeouts, as behind a partition. ``heal``
    closes what was held (as the callers' timeouts would have) and forwards again."""

    def __init__(self, target: str) -> None:
        host, port = target.removeprefix("http://").rsplit(":", 1)
        self.target = (host, int(port))
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.cut_now = threading.Event()
        self.socks: list[socket.socket] = []
        self.lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True, name="blackhole").start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            with self.lock:
                self.socks.append(client)
            if self.cut_now.is_set():
                continue  # held: never answered
            try:
                upstream = socket.create_connection(self.target, timeout=5)
                upstream.settimeout(None)
            except OSError:
                client.close()
                continue
            with self.lock:
                self.socks.append(upstream)
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(1 << 16):
                if not self.cut_now.is_set():
                    dst.sendall(data)
        except OSError:
            pass
        if not self.cut_now.is_set():
            for sock in (src, dst):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)

    def cut(self) -> None:
        self.cut_now.set()

    def heal(self) -> None:
        with self.lock:
            socks, self.socks = self.socks, []
        for sock in socks:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()
        self.cut_now.clear()

    def close(self) -> None:
        self.heal()
        self.listener.close()


class ProxiedGroup(Group):
    """A group whose members each reach etcd through forwarders of their own."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.proxies: dict[str, list[Blackhole]] = {
            m.name: [Blackhole(e) for e in self.etcd.endpoints] for m in self.members
        }

    def start(self, member: GroupMember) -> None:
        member.start(
            "slave",
            self.members.index(member) + 1,
            mode=self.mode,
            min_in_sync_replicas=2 if self.mode == "sync" else 1,
            sync_timeout_ms=3000,
            namesrv=self.namesrv,
            etcd=[p.endpoint for p in self.proxies[member.name]],
            lease_ttl_ms=self.lease_ttl_ms,
            max_lag_ms=self.max_lag_ms,
            file_size=4 << 20,
        )

    def close(self) -> None:
        for proxies in self.proxies.values():
            for p in proxies:
                p.close()


class Prober:
    """Sends one message at a time straight to ``endpoint`` (no client failover), bodies
    ``body-{PROBE_BASE + k}``; records which were answered OK, and when."""

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        self.acked: dict[int, float] = {}
        self.codes: Counter[str] = Counter()
        self._stop = threading.Event()
        self._next = PROBE_BASE
        self._thread = threading.Thread(target=self._run, daemon=True, name="prober")

    def start(self, first: int) -> Prober:
        self._next = first
        self._thread.start()
        return self

    def _run(self) -> None:
        stub = service_pb2_grpc.MessagingServiceStub(grpc.insecure_channel(self.endpoint))
        while not self._stop.is_set():
            n, self._next = self._next, self._next + 1
            request = s.SendMessageRequest()
            m = request.messages.add(topic=d.Resource(name=TOPIC), body=f"body-{n}".encode())
            m.system_properties.message_id = os.urandom(16).hex().upper()
            m.system_properties.message_type = d.NORMAL
            m.system_properties.body_encoding = d.IDENTITY
            try:
                reply = stub.SendMessage(request, timeout=60)
            except grpc.RpcError as e:
                self.codes[str(e.code())] += 1
                time.sleep(0.1)
                continue
            self.codes[d.Code.Name(reply.status.code)] += 1
            if reply.status.code == d.OK:
                self.acked[n] = time.monotonic()
            else:
                time.sleep(0.1)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join(90)
        return self._next


@dataclass
class Round:
    victim: str
    elected_s: float
    outage_s: float
    fenced_s: float | None
    probe_acked: int
    probe_codes: dict[str, int]
    rejoined_s: float
    # Probes the old master acknowledged after the election and before the resume: forwarded
    # to the new master (an old master that acknowledged by itself then would be split brain,
    # and its writes lost, counted in acked_lost).
    probe_acked_cut: int = 0
    # The producer's first acknowledgement after the election came only after the resume: its
    # channel sat on the old master (Apache's client stays on the first address that answers).
    waited_for_resume: bool = False


@dataclass
class BadDayResult:
    fault: str
    lease_ttl_ms: int
    rounds: list[Round] = field(default_factory=list)
    acked: int = 0
    acked_lost: list[int] = field(default_factory=list)
    probe_acked: int = 0
    duplicated_in_queues: int = 0
    epochs: list[int] = field(default_factory=list)
    send_errors: dict[str, int] = field(default_factory=dict)

    def summary(self) -> dict[str, Any]:
        def stats(values: list[float]) -> dict[str, Any]:
            v = sorted(values)
            return {
                "p50": round(statistics.median(v), 2) if v else None,
                "max": round(max(v), 2) if v else None,
                "all": [round(x, 2) for x in v],
            }

        fenced = [r.fenced_s for r in self.rounds if r.fenced_s is not None]
        return {
            "fault": self.fault,
            "lease_ttl_ms": self.lease_ttl_ms,
            "rounds": len(self.rounds),
            "elected_s": stats([r.elected_s for r in self.rounds]),
            "outage_s": stats([r.outage_s for r in self.rounds]),
            "fenced_s": stats(fenced) if fenced else None,
            "rejoined_s": stats([r.rejoined_s for r in self.rounds]),
            "acked": self.acked,
            "acked_lost": len(self.acked_lost),
            "probe_acked": self.probe_acked,
            "probe_codes": [r.probe_codes for r in self.rounds],
            "probe_acked_cut": [r.probe_acked_cut for r in self.rounds],
            "waited_for_resume": [r.waited_for_resume for r in self.rounds],
            "duplicated_in_queues": self.duplicated_in_queues,
            "epochs": self.epochs,
            "send_errors": self.send_errors,
        }


def etcd_master(client: EtcdClient, prefix: bytes) -> int | None:
    kv = client.get(prefix + b"master")
    return int(json.loads(kv.value)["id"]) if kv is not None else None


def run_bad_day(
    root: Path, fault: str, rounds: int, lease_ttl_ms: int, resume_after_s: float = 3.0
) -> BadDayResult:
    if fault not in ("freeze", "partition"):
        raise ValueError(f"fault must be freeze or partition, not {fault!r}")
    result = BadDayResult(fault, lease_ttl_ms)
    etcd = EtcdCluster(root).start()
    namesrv, namesrv_address = start_namesrv(root)
    group = ProxiedGroup(root, etcd, namesrv_address, "sync", lease_ttl_ms=lease_ttl_ms)
    watcher = EtcdClient(etcd.endpoints)
    prefix = b"/tmq/ha/DefaultCluster/broker-a/"
    producer: Producer | None = None
    frozen: GroupMember | None = None
    probe_next = PROBE_BASE
    probe_acked: dict[int, float] = {}
    try:
        first = group.members[0]
        group.start(first)
        wait_for("node1 is elected master", lambda: group.master() is first)
        for m in group.members[1:]:
            group.start(m)
        first.create_topic()
        wait_for("all three are in sync", lambda: group.in_sync(3), timeout=90)
        wait_for("all three are routed", group.routed)
        prefix = wait_for(
            "the group's keys in etcd",
            lambda: next(
                (
                    kv.key[: -len(b"master")]
                    for kv in watcher.get_prefix(b"/tmq/ha/")
                    if kv.key.endswith(b"/master")
                ),
                None,
            ),
        )
        producer = Producer(group.access_points, 1)
        producer.start()
        wait_for("the producer is acknowledged", lambda: len(producer.acked) >= 50)
        for _ in range(rounds):
            victim = wait_for("a master", group.master)
            victim_id = group.members.index(victim) + 1
            wait_for("all three are in sync", lambda: group.in_sync(3), timeout=120)
            mark = time.monotonic()
            wait_for("acks before the fault", lambda m=mark: producer.acked_since(m) >= 20)
            prober = Prober(victim.endpoint).start(probe_next)
            time.sleep(0.3)
            assert victim.proc is not None
            if fault == "freeze":
                os.kill(victim.proc.pid, signal.SIGSTOP)
                frozen = victim
            else:
                for p in group.proxies[victim.name]:
                    p.cut()
            at = time.monotonic()
            fenced_at: float | None = None
            while True:
                now = time.monotonic()
                if fault == "partition" and fenced_at is None:
                    with contextlib.suppress(OSError):
                        if victim.metric("tmq_replication_fenced") == 1:
                            fenced_at = time.monotonic()
                with contextlib.suppress(Exception):
                    if etcd_master(watcher, prefix) not in (None, victim_id):
                        break
                assert now - at < 120, "no other member was elected within 120 s"
                time.sleep(0.05)
            elected_at = time.monotonic()
            # The fault lasts ``resume_after_s`` past the election, acknowledged or not: a
            # client whose channel sits on a frozen master waits for it (decision 1150).
            time.sleep(resume_after_s)
            resumed = time.monotonic()
            if fault == "freeze":
                os.kill(victim.proc.pid, signal.SIGCONT)
                frozen = None
            else:
                for p in group.proxies[victim.name]:
                    p.heal()
            try:
                wait_for(
                    "an acknowledgement after the election",
                    lambda e=elected_at: any(a > e for _, a in list(producer.acked.values())),
                    timeout=60,
                )
            except AssertionError as e:
                errors = producer.errors.most_common(5)
                raise AssertionError(f"{e}; send errors: {errors}") from None
            times = sorted(a for _, a in list(producer.acked.values()))
            last_before = max(t for t in times if t <= at)
            first_after = min(t for t in times if t > elected_at)
            window = [last_before, *(t for t in times if last_before < t < first_after)]
            window.append(first_after)
            outage = max(b - a for a, b in itertools.pairwise(window))
            # The old master must rejoin as a slave by itself, the set reaching 3 again.
            new_master = wait_for("a new master", group.master)
            assert new_master is not victim
            wait_for(
                "the old master rejoined as a slave",
                lambda v=victim: group.in_sync(3) and v.metric("tmq_replication_is_master") == 0,
                timeout=120,
            )
            rejoined = time.monotonic() - resumed
            time.sleep(1.0)
            probe_next = prober.stop()
            probe_acked.update(prober.acked)
            result.epochs.append(int(new_master.metric("tmq_replication_epoch") or 0))
            result.rounds.append(
                Round(
                    victim.name,
                    elected_at - at,
                    outage,
                    None if fenced_at is None else fenced_at - at,
                    len(prober.acked),
                    dict(prober.codes),
                    rejoined,
                    sum(1 for a in prober.acked.values() if elected_at < a < resumed),
                    first_after > resumed,
                )
            )
        time.sleep(1)
        producer.stop()
        result.send_errors = dict(producer.errors.most_common(5))
        acked = set(producer.acked) | set(probe_acked)
        producer = None
        result.acked = len(acked)
        result.probe_acked = len(probe_acked)
        master = wait_for("a master", group.master)
        bodies = Counter(
            int(m.body.decode().split("-")[1]) for m in pull_all(master, TOPIC, QUEUES)
        )
        result.acked_lost = sorted(acked - set(bodies))
        result.duplicated_in_queues = sum(c - 1 for c in bodies.values() if c > 1)
        return result
    finally:
        if frozen is not None and frozen.proc is not None:
            with contextlib.suppress(OSError):
                os.kill(frozen.proc.pid, signal.SIGCONT)
        if producer is not None:
            producer.stop()
        group.kill_all()
        group.close()
        terminate(namesrv, 10)
        etcd.stop()
