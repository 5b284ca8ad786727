"""Cold reads under a produce load that keeps both cores busy: do they meet their deadline?

Cold reads run in the cold worker on threads at nice 19 (decision 841). This probe asks what
that costs when the cores are never free: one process plays the broker (a store, 20,480 1 KiB
messages offloaded to LocalStack in 4 MiB segments, a cold worker), ``--hogs`` other processes
produce into stores of their own as fast as they can at nice 0 (each a producer that saturates a
core), and the broker replays the archive through ``get_replies`` with the broker's real read
deadline (2.5 s). A read past its deadline raises ``ColdTierUnavailableError`` (the broker
answers "unavailable"); the probe retries it, as a client does, and counts it.

    python bench/cold_starve.py [--hogs 2] [--seconds 20] [--read-nice N] [--tree DIR]

``--read-nice``: the worker's ``read_nice`` (default: the code's own); ``--tree``: import tmq
from another checkout (main's, for an A/B in one venv). Prints one JSON object: each read's
latency (p50, p99, max), the reads past the deadline, the replay's MB/s while the hogs ran.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any


def _args() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tree", default=str(Path(__file__).resolve().parent.parent))
    parser.add_argument("--hogs", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--read-nice", type=int, default=None)
    return parser.parse_known_args()[0]


sys.path.insert(0, _args().tree)

MESSAGES = 20_480
DEADLINE_S = 2.5
# What a hog writes into one store before it starts another (and removes the first).
HOG_BYTES = 48 << 20


def hog(root: str, seconds: float) -> None:
    """Produce 1 KiB messages into a store of its own, as fast as it can, for ``seconds``."""
    from tiered.config import StoreConfig
    from tiered.record import Message
    from tiered.store import MessageStore

    batch = [Message(topic="hog", queue_id=0, body=os.urandom(1024)) for _ in range(64)]
    stop = time.monotonic() + seconds
    n = 0
    while time.monotonic() < stop:
        # A fresh store every HOG_BYTES: the disk this machine's sessions share stays free.
        data = Path(root) / str(n)
        store = MessageStore(StoreConfig(data_dir=data, commitlog_file_size=64 << 20))
        store.start()
        written = 0
        while written < HOG_BYTES and time.monotonic() < stop:
            store.put_messages(batch)
            written += 64 * 1100
        store.shutdown()
        shutil.rmtree(data, ignore_errors=True)
        n += 1


def main() -> None:
    args = _args()
    from bench.cold_common import cold_archive, cold_fetcher
    from tiered.cold.fetcher import ColdTierUnavailableError

    latencies: list[float] = []
    missed = replayed = 0
    worker_options: dict[str, Any] = {}
    if args.read_nice is not None:
        worker_options["read_nice"] = args.read_nice
    with cold_archive("tmq-cold-starve-", MESSAGES, 4 << 20, **worker_options) as archive:
        ctx = multiprocessing.get_context("spawn")
        hog_procs = [
            ctx.Process(target=hog, args=(str(archive.root / f"hog{i}"), args.seconds + 5))
            for i in range(args.hogs)
        ]
        try:
            for p in hog_procs:
                p.start()
            time.sleep(3)  # the hogs' imports and stores started: the cores are busy from here
            t_end = time.monotonic() + args.seconds
            t0 = time.perf_counter()
            while time.monotonic() < t_end:
                fetcher = cold_fetcher(archive.tier, archive.worker, read_timeout_s=DEADLINE_S)
                end = fetcher.manifest("cold", 1).end_offset
                offset = 0
                while offset < end and time.monotonic() < t_end:
                    t = time.perf_counter()
                    try:
                        _, nxt, bodies = fetcher.get_replies(
                            "cold", 1, offset, 32, max_bytes=1 << 30
                        )
                    except ColdTierUnavailableError:
                        missed += 1  # the client retries the same offset
                        latencies.append(time.perf_counter() - t)
                        continue
                    latencies.append(time.perf_counter() - t)
                    replayed += bodies
                    offset = nxt
                fetcher.close()
            wall = time.perf_counter() - t0
            for p in hog_procs:
                p.join(30)
        finally:
            for p in hog_procs:
                if p.is_alive():
                    p.kill()
    q = statistics.quantiles(latencies, n=100) if len(latencies) > 1 else [0.0] * 99
    print(
        json.dumps(
            {
                "bench": "cold_starve",
                "tree": args.tree,
                "hogs": args.hogs,
                "read_nice": args.read_nice,
                "reads": len(latencies),
                "reads_past_deadline": missed,
                "read_p50_ms": round(q[49] * 1e3, 1),
                "read_p99_ms": round(q[98] * 1e3, 1),
                "read_max_ms": round(max(latencies, default=0) * 1e3, 1),
                "replay_body_mb_per_s": round(replayed / wall / 1e6, 2),
                "load_average_1m": round(os.getloadavg()[0], 1),
                "utc": time.strftime("%H:%M:%S", time.gmtime()),
            }
        )
    )


if __name__ == "__main__":
    main()
