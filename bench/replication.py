"""Produce throughput of a replica group against the same broker without replication.

Each setup runs real ``tmq broker start --config`` processes on loopback (tests/test_ha.py's
``GroupMember``): no replication, SYNC to 1 slave (min_in_sync_replicas 2), SYNC to 2 slaves
(min_in_sync_replicas 3), and ASYNC to 1 slave (whose replication lag is sampled under load).
Two client threads send ``SendMessage`` batches of 32 messages of 1 KiB for ``SECONDS`` each.

Then failover (tests/ha_failover.py): a 3-node etcd, a group of three members electing their
master, Apache's Python client producing one message per send, and ``KILLS`` (10) ``kill -9``s
of whoever is master, each restarted to rejoin as a slave. SYNC with min_in_sync_replicas 2
gives ``acked_lost`` (acknowledged messages missing from the queues afterwards: the goal is 0)
and the failover times (last ack before a kill to the first ack after it): ``failover_p50_s``
and ``failover_max_s``. ASYNC runs ``ASYNC_KILLS`` kills with ``ASYNC_PRODUCERS`` sending
threads, so that acknowledged messages are on their way to the slaves when the master dies, and
reports the acknowledged messages lost at each kill (``async_acked_lost_per_kill``, each loss
charged to the first kill after its acknowledgement) and their mean. ``--failover-only`` skips
the throughput part, ``--throughput-only`` the failover part. Prints one JSON object on its last
line.
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

from tests.broker_harness import free_port
from tests.ha_failover import run_failover
from tests.test_ha import TOPIC, GroupMember

BODY = os.urandom(1024)
BATCH = 32
THREADS = 2
SECONDS = 6.0
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


def produce(endpoint: str, seconds: float, sample: GroupMember | None) -> dict[str, float]:
    sent = [0] * THREADS
    failed = [0] * THREADS
    lags: list[float] = []
    stop = time.monotonic() + seconds

    def worker(i: int) -> None:
        stub = service_pb2_grpc.MessagingServiceStub(grpc.insecure_channel(endpoint))
        while time.monotonic() < stop:
            reply = stub.SendMessage(request(), timeout=30)
            if reply.status.code == d.OK:
                sent[i] += BATCH
            else:
                failed[i] += BATCH

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(THREADS)]
    started = time.monotonic()
    for t in threads:
        t.start()
    while sample is not None and time.monotonic() < stop:
        lag = sample.metric("tmq_replication_lag_bytes")
        if lag is not None:
            lags.append(lag)
        time.sleep(0.2)
    for t in threads:
        t.join()
    elapsed = time.monotonic() - started
    out = {"msgs_per_s": round(sum(sent) / elapsed), "failed": sum(failed)}
    if lags:
        out["lag_bytes_max"] = max(lags)
        out["lag_bytes_mean"] = round(sum(lags) / len(lags))
    return out


def run(root: Path, slaves: int, mode: str) -> dict[str, float]:
    master = GroupMember(root, "master", free_port())
    members = [master]
    try:
        master.start(
            "master",
            0,
            mode=mode,
            min_in_sync_replicas=slaves + 1 if mode == "sync" else 1,
            sync_timeout_ms=10_000,
            ha=slaves > 0,
            file_size=64 << 20,
        )
        for i in range(1, slaves + 1):
            slave = GroupMember(root, f"slave{i}", free_port())
            members.append(slave)
            slave.start("slave", i, master=master, file_size=64 << 20)
        master.create_topic()
        deadline = time.monotonic() + 30
        while slaves and master.metric("tmq_replication_sync_state_set_size") != slaves + 1:
            assert time.monotonic() < deadline, "slaves did not join the SyncStateSet"
            time.sleep(0.2)
        produce(master.endpoint, 1.0, None)  # warm-up
        return produce(master.endpoint, SECONDS, master if mode == "async" and slaves else None)
    finally:
        for m in members:
            m.stop()


def failover(mode: str, kills: int, producers: int = 1) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix=f"tmq-bench-failover-{mode}-") as tmp:
        summary = run_failover(Path(tmp), kills, mode, producers).summary()
    print(f"failover {mode}", summary, file=sys.stderr, flush=True)
    return summary


def main() -> None:
    failover_only = "--failover-only" in sys.argv[1:]
    throughput_only = "--throughput-only" in sys.argv[1:]
    results: dict[str, dict[str, float]] = {}
    for name, slaves, mode in (
        ()
        if failover_only
        else (
            ("none", 0, "async"),
            ("sync_1_slave", 1, "sync"),
            ("sync_2_slaves", 2, "sync"),
            ("async_1_slave", 1, "async"),
        )
    ):
        with tempfile.TemporaryDirectory(prefix=f"tmq-bench-ha-{name}-") as tmp:
            results[name] = run(Path(tmp), slaves, mode)
        print(name, results[name], file=sys.stderr, flush=True)
    none = results["none"]["msgs_per_s"] if results else None
    summary: dict[str, Any] = {
        "bench": "replication",
        "message_bytes": len(BODY),
        "batch": BATCH,
        "threads": THREADS,
        "seconds": SECONDS,
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
