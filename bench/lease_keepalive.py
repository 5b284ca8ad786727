"""Why a master's lease renewal misses its deadline: keepalive latency from a Python process.

A real 3-node etcd (tests/etcd_harness.py); a lease of 2 s renewed every 0.5 s with
``EtcdClient.keepalive`` (urllib over etcd's JSON gateway), as the broker's renew thread did
before decision 910, for ``--seconds``. ``--gil-hogs`` CPU-bound Python threads in the same process
stand for a busy broker's threads; CPU hogs in other processes (start them yourself) stand for a
loaded machine. Prints one JSON line: keepalive latency percentiles, the longest gap between the
starts of two successful renewals and how many gaps passed the old fence deadline (2/3 of the
TTL, 1.33 s)."""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from broker.ha.etcd import EtcdClient, EtcdUnavailableError
from tests.etcd_harness import EtcdCluster


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=30)
    parser.add_argument("--gil-hogs", type=int, default=0)
    args = parser.parse_args()
    etcd = EtcdCluster(Path(tempfile.mkdtemp(prefix="tmq-keepalive-"))).start()
    stop = threading.Event()

    def hog() -> None:
        x = 0
        while not stop.is_set():
            for i in range(10_000):
                x += i * i

    for _ in range(args.gil_hogs):
        threading.Thread(target=hog, daemon=True).start()
    try:
        client = EtcdClient(etcd.endpoints)
        lease = client.grant(2)
        latencies: list[float] = []
        starts: list[float] = []
        failures = 0
        end = time.monotonic() + args.seconds
        while time.monotonic() < end:
            time.sleep(0.5)
            started = time.monotonic()
            try:
                ok = client.keepalive(lease) > 0
            except EtcdUnavailableError:
                ok = False
            latencies.append(time.monotonic() - started)
            if ok:
                starts.append(started)
            else:
                failures += 1
    finally:
        stop.set()
        etcd.stop()
    gaps = [b - a for a, b in itertools.pairwise(starts)]
    q = statistics.quantiles(latencies, n=100)
    print(
        json.dumps(
            {
                "bench": "lease_keepalive",
                "gil_hogs": args.gil_hogs,
                "keepalives": len(latencies),
                "failures": failures,
                "p50_ms": round(q[49] * 1000, 1),
                "p99_ms": round(q[98] * 1000, 1),
                "max_ms": round(max(latencies) * 1000, 1),
                "max_gap_s": round(max(gaps), 3),
                "gaps_over_1_33_s": sum(g > 4 / 3 for g in gaps),
                "load": [round(x, 1) for x in os.getloadavg()],
            }
        )
    )


if __name__ == "__main__":
    main()
