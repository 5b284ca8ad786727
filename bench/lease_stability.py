"""Unprovoked elections of a replica group under load: nothing is killed, so every election
counted is one the load caused (a master that could not renew its etcd lease in time). A 3-node
etcd, a NameServer and a group of three ``tmq broker start --config`` members (SYNC,
min_in_sync_replicas 2, a lease of ``--ttl-ms``, by default the broker's default). Once a
master is elected and all three are in sync, for ``--seconds`` (default 120): ``--hogs``
(default 3) CPU-bound processes (``while True``), and ``--senders`` (default 2) client threads
sending ``SendMessage`` batches of 32 x 1 KiB to whoever is master, each waiting for its reply.
The group's epoch is read from etcd before and after: ``elections`` is the difference.
``fenced`` counts the members' "fencing this master" log lines, and ``fence_reasons`` their
reasons; ``slow_ticks`` the controller ticks that took over 1 s (decision 1152) and
``slowest_ticks`` the eight longest, phase by phase. Prints one JSON line with
the 1-minute load average sampled every 10 s (``load_1m``).

Runs from any checkout: ``cd <checkout> && python bench/lease_stability.py`` measures that
checkout's broker (for an A/B against main, run the same file from main's tree)."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import grpc
from rocketmq.grpc_protocol import definition_pb2 as d
from rocketmq.grpc_protocol import service_pb2 as s
from rocketmq.grpc_protocol import service_pb2_grpc

from broker.ha.config import HaConfig
from broker.ha.etcd import EtcdClient
from tests.etcd_harness import EtcdCluster
from tests.ha_failover import Group, start_namesrv, wait_for
from tests.test_ha import TOPIC

BODY = os.urandom(1024)
HOG = "while True: pass"


def group_epoch(etcd: EtcdCluster) -> int:
    client = EtcdClient(etcd.endpoints)
    for kv in client.get_prefix(b"/tmq/ha/"):
        if kv.key.endswith(b"/state"):
            return int(json.loads(kv.value)["epoch"])
    return 0


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=120)
    parser.add_argument("--hogs", type=int, default=3)
    parser.add_argument("--senders", type=int, default=2)
    # The lease TTL the members run with: by default the broker's ([ha] lease_ttl_ms).
    parser.add_argument("--ttl-ms", type=int, default=HaConfig().lease_ttl_ms)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="tmq-lease-bench-"))
    etcd = EtcdCluster(root).start()
    namesrv, namesrv_address = start_namesrv(root)
    group = Group(root, etcd, namesrv_address, "sync", lease_ttl_ms=args.ttl_ms)
    hogs: list[subprocess.Popen[bytes]] = []
    stop = threading.Event()
    sent = [0]
    failed = [0]
    try:
        for m in group.members:
            group.start(m)
        master = wait_for("a master", group.master, timeout=120)
        master.create_topic()
        wait_for("all three in sync", lambda: group.in_sync(3), timeout=120)
        start_epoch = group_epoch(etcd)

        def sender() -> None:
            while not stop.is_set():
                current = group.master()
                if current is None:
                    failed[0] += 1
                    time.sleep(0.1)
                    continue
                with grpc.insecure_channel(current.endpoint) as channel:
                    stub = service_pb2_grpc.MessagingServiceStub(channel)
                    while not stop.is_set():
                        request = s.SendMessageRequest()
                        for _ in range(32):
                            m = request.messages.add(topic=d.Resource(name=TOPIC), body=BODY)
                            m.system_properties.message_id = os.urandom(16).hex().upper()
                            m.system_properties.body_encoding = d.IDENTITY
                        try:
                            reply = stub.SendMessage(request, timeout=10)
                        except grpc.RpcError:
                            failed[0] += 1
                            break
                        if reply.status.code != d.OK:
                            failed[0] += 1
                            break
                        sent[0] += 32

        threads = [threading.Thread(target=sender, daemon=True) for _ in range(args.senders)]
        hogs = [subprocess.Popen([sys.executable, "-c", HOG]) for _ in range(args.hogs)]
        for t in threads:
            t.start()
        loads = []
        began = time.monotonic()
        while time.monotonic() - began < args.seconds:
            time.sleep(min(10.0, args.seconds - (time.monotonic() - began)))
            loads.append(round(os.getloadavg()[0], 1))
        stop.set()
        for t in threads:
            t.join(30)
        end_epoch = group_epoch(etcd)
        reasons: dict[str, int] = {}
        fences: list[str] = []
        slow_ticks: list[str] = []
        for m in group.members:
            for line in m.log_path.read_text(errors="replace").splitlines():
                if "a tick took" in line:
                    slow_ticks.append(f"{m.name}: {line.split('a tick took ', 1)[1][:200]}")
                if "fencing this master" in line:
                    fences.append(line.split("fencing this master ", 1)[1][:260])
                    why = re.sub(r"\(epoch \d+\)|[\d.]+ s", "", line.split(": ", 2)[-1])[:60]
                    reasons[why] = reasons.get(why, 0) + 1
        print(
            json.dumps(
                {
                    "bench": "lease_stability",
                    "seconds": args.seconds,
                    "hogs": args.hogs,
                    "senders": args.senders,
                    "lease_ttl_ms": args.ttl_ms,
                    "elections": end_epoch - start_epoch,
                    "elections_per_10min": round((end_epoch - start_epoch) * 600 / args.seconds, 1),
                    "fenced": len(fences),
                    "fence_reasons": reasons,
                    "fences": fences,
                    "msgs_sent": sent[0],
                    "send_failures": failed[0],
                    "load_1m": loads,
                    "slow_ticks": len(slow_ticks),
                    "slowest_ticks": sorted(slow_ticks, key=lambda x: -float(x.split()[1]))[:8],
                }
            )
        )
    finally:
        stop.set()
        for h in hogs:
            h.kill()
            h.wait()
        group.kill_all()
        namesrv.kill()
        namesrv.wait()
        with contextlib.suppress(Exception):
            etcd.stop()
        # Each run writes about a GB of CommitLog: never leave it behind.
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
