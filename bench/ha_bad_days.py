"""Failover when the master freezes (SIGSTOP, then SIGCONT) or is partitioned from etcd, at the
broker's default lease TTL (tests/ha_bad_days.py describes the scenario and the figures).

    .venv/bin/python bench/ha_bad_days.py freeze|partition [--rounds N] [--ttl-ms N]

Prints one JSON object on its last line: per-round ``elected_s`` (fault to another master named
in etcd), ``outage_s`` (the longest time without an acknowledgement across the fault),
``fenced_s`` (partition: fault to the old master fencing itself), ``rejoined_s`` (resume to the
old master back in the SyncStateSet as a slave), p50/max/all of each, ``acked_lost`` (the goal
is 0), per round ``probe_acked_cut`` (the old master's forwarded acknowledgements between the
election and the heal) and ``waited_for_resume`` (the producer's first acknowledgement after the
election came only after the resume), and the load average at the start and the end."""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from broker.ha.config import HaConfig
from tests.ha_bad_days import run_bad_day


def main() -> None:
    args = sys.argv[1:]
    if not args or args[0] not in ("freeze", "partition"):
        sys.exit(__doc__)
    fault = args[0]
    rounds = int(args[args.index("--rounds") + 1]) if "--rounds" in args else 4
    ttl = int(args[args.index("--ttl-ms") + 1]) if "--ttl-ms" in args else HaConfig().lease_ttl_ms
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix=f"tmq-bench-{fault}-") as tmp:
        summary = run_bad_day(Path(tmp), fault, rounds, ttl).summary()
    summary["load_before"] = round(load_before, 1)
    summary["load_after"] = round(os.getloadavg()[0], 1)
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
