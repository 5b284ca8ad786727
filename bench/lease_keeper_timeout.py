"""Does the keeper's per-endpoint timeout decide whether it renews under load?

A real 3-node etcd; ``--hogs`` CPU-bound processes (``while True``) load the machine. Two
``LeaseKeeper`` processes side by side, identical but for ``--timeout`` (the seconds each
keepalive waits per etcd endpoint): each renews its own ``--ttl`` lease, pulsed from here with a
generous pulse limit (so a stale pulse is not what stops it). Every ``--regrant`` seconds each is
handed a freshly granted lease, as a member that took a new lease would be: ``first_renewal_s``
is how long until its keeper renewed it (a member stands for election only after that, decision
910). Prints one JSON line per timeout: renewals, the longest gap between the send times of two
successful renewals, gaps past the 3/4-TTL fence, leases never renewed, keepalive latencies, and
the load average."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from broker.ha.etcd import EtcdClient, EtcdUnavailableError
from broker.ha.lease_keeper import LeaseKeeper
from tests.etcd_harness import EtcdCluster

HOG = "while True: pass"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=60)
    parser.add_argument("--hogs", type=int, default=40)
    parser.add_argument("--ttl", type=int, default=2)
    parser.add_argument("--regrant", type=float, default=8)
    parser.add_argument("--timeouts", default="1.0,3.0")
    args = parser.parse_args()
    etcd = EtcdCluster(Path(tempfile.mkdtemp(prefix="tmq-keeper-timeout-"))).start()
    client = EtcdClient(etcd.endpoints, timeout=5)
    timeouts = [float(t) for t in args.timeouts.split(",")]
    keepers = []
    for t in timeouts:
        k = LeaseKeeper(etcd.endpoints, args.ttl, interval_s=args.ttl / 8, pulse_limit_s=30)
        k.timeout_s = t
        keepers.append(k)
    hogs: list[subprocess.Popen[bytes]] = []
    stats = [
        {"timeout_s": t, "gaps": [], "first": [], "never": 0, "last_sent": 0.0} for t in timeouts
    ]
    loads: list[float] = []
    try:
        for k in keepers:
            k.ensure_running()
        hogs = [subprocess.Popen([sys.executable, "-c", HOG]) for _ in range(args.hogs)]
        began = time.monotonic()
        next_load = began
        while time.monotonic() - began < args.seconds:
            leases = []
            granted = []
            for k in keepers:
                while True:
                    try:
                        leases.append(client.grant(args.ttl))
                        break
                    except EtcdUnavailableError:
                        time.sleep(0.1)
                granted.append(time.monotonic())
                k.set_lease(leases[-1])
            first: list[float | None] = [None] * len(keepers)
            while time.monotonic() - granted[0] < args.regrant:
                for i, k in enumerate(keepers):
                    k.pulse()
                    st = k.renewed()
                    s = stats[i]
                    if st.lease == leases[i] and st.sent_at > s["last_sent"]:
                        if first[i] is None:
                            first[i] = st.sent_at - granted[i]
                        elif s["last_sent"]:
                            s["gaps"].append(st.sent_at - s["last_sent"])
                        s["last_sent"] = st.sent_at
                if time.monotonic() >= next_load:
                    loads.append(round(os.getloadavg()[0], 1))
                    next_load += 10
                time.sleep(0.05)
            for i, f in enumerate(first):
                if f is None:
                    stats[i]["never"] += 1
                else:
                    stats[i]["first"].append(round(f, 2))
                stats[i]["last_sent"] = 0.0
        for i, k in enumerate(keepers):
            st = k.renewed()
            gaps = sorted(stats[i]["gaps"])
            print(
                json.dumps(
                    {
                        "bench": "lease_keeper_timeout",
                        "hogs": args.hogs,
                        "ttl_s": args.ttl,
                        "timeout_s": stats[i]["timeout_s"],
                        "renewals": st.renewals,
                        "leases": len(stats[i]["first"]) + stats[i]["never"],
                        "leases_never_renewed": stats[i]["never"],
                        "first_renewal_s": stats[i]["first"],
                        "longest_gap_s": round(gaps[-1], 2) if gaps else None,
                        "gaps_past_fence": sum(g > args.ttl * 0.75 for g in gaps),
                        "max_keepalive_s": round(st.max_latency_s, 2),
                        "load_1m": loads,
                    }
                ),
                flush=True,
            )
    finally:
        for h in hogs:
            h.kill()
            h.wait()
        for k in keepers:
            k.stop()
        etcd.stop()


if __name__ == "__main__":
    main()
