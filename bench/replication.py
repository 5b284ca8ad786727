"""Produce throughput of a replica group against the same broker without replication.

Each setup runs real ``tmq broker start --config`` processes on loopback (tests/test_ha.py's
``GroupMember``): no replication, SYNC to 1 slave (min_in_sync_replicas 2), SYNC to 2 slaves
(min_in_sync_replicas 3), and ASYNC to 1 slave (whose replication lag is sampled under load).
Two client threads send ``SendMessage`` batches of 32 messages of 1 KiB. Every setup's brokers
are up at once; each setup then gets ``ROUNDS`` phases of ``PHASE_S`` seconds, the setups taken
in forward and reverse order by turns (ABBA), so that the load other work puts on the machine
falls on every setup alike. The same client threads, batches and pipelining (none: each thread
waits for its reply) in every setup; the baseline is the same broker with replication off.

Then failover (tests/ha_failover.py): a 3-node etcd, a group of three members electing their
master, Apache's Python client producing one message per send, and ``KILLS`` (10) ``kill -9``s
of whoever is master, each restarted to rejoin as a slave. SYNC with min_in_sync_replicas 2
gives ``acked_lost`` (acknowledged messages missing from the queues afterwards: the goal is 0)
and the failover times (last ack before a kill to the first ack after it): ``failover_p50_s``
and ``failover_max_s``. ASYNC runs ``ASYNC_KILLS`` kills with ``ASYNC_PRODUCERS`` sending
threads, so that acknowledged messages are on their way to the slaves when the master dies, and
reports the acknowledged messages lost at each kill (``async_acked_lost_per_kill``, each loss
charged to the first kill after its acknowledgement) and their mean. ``--failover-only`` skips
the throughput part, ``--throughput-only`` the failover part. The failover group's lease TTL is
the broker's default (``lease_ttl_ms``, 8 s) unless ``--ttl-ms N`` says otherwise; it is in the
JSON. Prints one JSON object on its last line.

Each setup also reports the CPU its brokers spent per message sent (``cpu_us_per_msg``: user and
system time from /proc, master and each slave): on a machine shared with other work it moves far
less than msgs/s, so it is the figure to compare code changes by.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import grpc
from rocketmq.grpc_protocol import definition_pb2 as d
from rocketmq.grpc_protocol import service_pb2 as s
from rocketmq.grpc_protocol import service_pb2_grpc

from broker.ha.config import HaConfig
from tests.broker_harness import free_port
from tests.ha_failover import run_failover
from tests.test_ha import TOPIC, GroupMember

BODY = os.urandom(1024)
BATCH = 32
THREADS = 2
# Each setup sends for ROUNDS phases of PHASE_S seconds (6 s in all), after a warm-up.
PHASE_S = 1.5
ROUNDS = 4
WARMUP_S = 1.0
FILE_SIZE = 64 << 20
KILLS = 10
ASYNC_KILLS = 3
ASYNC_PRODUCERS = 8


def request() -> s.SendMessageRequest:
    r = s.SendMessageRequest()
    for _ in range(BATCH):
        m = r.messages.add(topic=d.Resource(name=TOPIC), body=BODY)
        m.system_properties.message_id = os.urandom(16).hex().upper()
        m.system_properties.message_type = d.NORMAL
        m.system_properties.body_encoding = d.IDENTITY
    return r


class Setup:
    """One setup of the throughput comparison, its brokers up for the whole run, and the
    client threads' stubs (one channel each, reused by every phase)."""

    def __init__(self, root: Path, name: str, slaves: int, mode: str) -> None:
        self.name = name
        self.slaves = slaves
        self.mode = mode
        self.master = GroupMember(root / name, "master", free_port())
        self.members = [self.master]
        self.stubs: list[service_pb2_grpc.MessagingServiceStub] = []
        self.sent = 0
        self.failed = 0
        self.elapsed = 0.0
        self.lags: list[float] = []
        self.cpu_s: list[float] = []  # per member, over the counted phases

    def start(self) -> None:
        (self.master.root).mkdir(parents=True, exist_ok=True)
        self.master.start(
            "master",
            0,
            mode=self.mode,
            min_in_sync_replicas=self.slaves + 1 if self.mode == "sync" else 1,
            sync_timeout_ms=10_000,
            ha=self.slaves > 0,
            file_size=FILE_SIZE,
        )
        for i in range(1, self.slaves + 1):
            slave = GroupMember(self.master.root, f"slave{i}", free_port())
            self.members.append(slave)
            slave.start("slave", i, master=self.master, file_size=FILE_SIZE)
        self.master.create_topic()
        deadline = time.monotonic() + 30
        while self.slaves and (
            self.master.metric("tmq_replication_sync_state_set_size") != self.slaves + 1
        ):
            assert time.monotonic() < deadline, "slaves did not join the SyncStateSet"
            time.sleep(0.2)
        self.stubs = [
            service_pb2_grpc.MessagingServiceStub(grpc.insecure_channel(self.master.endpoint))
            for _ in range(THREADS)
        ]

    def stop(self) -> None:
        for m in self.members:
            m.stop()

    def produce(self, seconds: float, *, count: bool = True) -> None:
        """One phase: ``THREADS`` threads send batches for ``seconds``."""
        sent = [0] * THREADS
        failed = [0] * THREADS
        stop = time.monotonic() + seconds

        def worker(i: int) -> None:
            while time.monotonic() < stop:
                reply = self.stubs[i].SendMessage(request(), timeout=30)
                if reply.status.code == d.OK:
                    sent[i] += BATCH
                else:
                    failed[i] += BATCH

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(THREADS)]
        cpu_before = [cpu_seconds(m) for m in self.members]
        started = time.monotonic()
        for t in threads:
            t.start()
        sample = self.mode == "async" and self.slaves and count
        while sample and time.monotonic() < stop:
            lag = self.master.metric("tmq_replication_lag_bytes")
            if lag is not None:
                self.lags.append(lag)
            time.sleep(0.2)
        for t in threads:
            t.join()
        if count:
            self.elapsed += time.monotonic() - started
            spent = [cpu_seconds(m) - b for m, b in zip(self.members, cpu_before, strict=True)]
            self.cpu_s = [
                a + b for a, b in zip(self.cpu_s or [0.0] * len(spent), spent, strict=True)
            ]
            self.sent += sum(sent)
            self.failed += sum(failed)

    def result(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "msgs_per_s": round(self.sent / self.elapsed),
            "failed": self.failed,
        }
        if self.sent:
            out["cpu_us_per_msg"] = {
                m.name: round(cpu / self.sent * 1e6, 1)
                for m, cpu in zip(self.members, self.cpu_s, strict=True)
            }
        if self.lags:
            out["lag_bytes_max"] = max(self.lags)
            out["lag_bytes_mean"] = round(sum(self.lags) / len(self.lags))
        return out


def cpu_seconds(member: GroupMember) -> float:
    """User and system CPU time of a member's process so far (Linux /proc)."""
    assert member.proc is not None
    fields = Path(f"/proc/{member.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def throughput(root: Path) -> dict[str, dict[str, Any]]:
    """Every setup is started first and stays up; then ``ROUNDS`` rounds of one ``PHASE_S``
    phase per setup, in forward and reverse order by turns (ABBA), so that a change in the
    machine's other load falls on every setup alike instead of on whichever ran at that time."""
    setups = [
        Setup(root, "none", 0, "async"),
        Setup(root, "sync_1_slave", 1, "sync"),
        Setup(root, "sync_2_slaves", 2, "sync"),
        Setup(root, "async_1_slave", 1, "async"),
    ]
    try:
        for setup in setups:
            setup.start()
        for setup in setups:
            setup.produce(WARMUP_S, count=False)
        for n in range(ROUNDS):
            for setup in setups if n % 2 == 0 else reversed(setups):
                setup.produce(PHASE_S)
        results = {setup.name: setup.result() for setup in setups}
    finally:
        for setup in setups:
            setup.stop()
    for name, result in results.items():
        print(name, result, file=sys.stderr, flush=True)
    return results


def lease_ttl_ms() -> int:
    """``--ttl-ms N``: the group's lease TTL; by default the broker's own (``HaConfig``), so the
    figures are what a deployment gets (the tests keep 2 s for their waits)."""
    args = sys.argv[1:]
    if "--ttl-ms" not in args:
        return HaConfig().lease_ttl_ms
    i = args.index("--ttl-ms")
    if i + 1 >= len(args) or not args[i + 1].isdigit() or int(args[i + 1]) < 1000:
        sys.exit("--ttl-ms takes a whole number of milliseconds, at least 1000")
    return int(args[i + 1])


def failover(mode: str, kills: int, producers: int = 1) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix=f"tmq-bench-failover-{mode}-") as tmp:
        summary = run_failover(Path(tmp), kills, mode, producers, lease_ttl_ms()).summary()
    print(f"failover {mode}", summary, file=sys.stderr, flush=True)
    return summary


def main() -> None:
    failover_only = "--failover-only" in sys.argv[1:]
    throughput_only = "--throughput-only" in sys.argv[1:]
    results: dict[str, dict[str, Any]] = {}
    if not failover_only:
        with tempfile.TemporaryDirectory(prefix="tmq-bench-ha-") as tmp:
            results = throughput(Path(tmp))
    none = results["none"]["msgs_per_s"] if results else None
    summary: dict[str, Any] = {
        "bench": "replication",
        "message_bytes": len(BODY),
        "batch": BATCH,
        "threads": THREADS,
        "seconds": PHASE_S * ROUNDS,
        "phases": f"{ROUNDS} x {PHASE_S} s per setup, interleaved (ABBA)",
        "results": results,
        "ratio_sync_vs_none": round(results["sync_1_slave"]["msgs_per_s"] / none, 3)
        if none
        else None,
        "ratio_sync_2_slaves_vs_none": round(results["sync_2_slaves"]["msgs_per_s"] / none, 3)
        if none
        else None,
        "async_lag_bytes_max": results["async_1_slave"].get("lag_bytes_max") if none else None,
    }
    if not throughput_only:
        summary["lease_ttl_ms"] = lease_ttl_ms()
        summary.update(failover_figures())
    print(json.dumps(summary))


def failover_figures() -> dict[str, Any]:
    sync = failover("sync", KILLS)
    asynchronous = failover("async", ASYNC_KILLS, ASYNC_PRODUCERS)
    per_kill = asynchronous["acked_lost_per_kill"]
    return {
        "kills": sync["kills"],
        "acked_lost": sync["acked_lost"],
        "duplicated_in_queues": sync["duplicated_in_queues"],
        "failover_p50_s": sync["failover_p50_s"],
        "failover_max_s": sync["failover_max_s"],
        "failover_s": sync["failover_s"],
        "groups_complete": all(sync["groups_complete"].values()),
        "async_kills": asynchronous["kills"],
        "async_producers": ASYNC_PRODUCERS,
        "async_acked": asynchronous["acked"],
        "async_acked_lost": asynchronous["acked_lost"],
        "async_acked_lost_per_kill": per_kill,
        "async_acked_lost_per_kill_mean": round(sum(per_kill) / max(1, len(per_kill)), 2),
        "async_failover_p50_s": asynchronous["failover_p50_s"],
    }


if __name__ == "__main__":
    main()
