"""Where a producer's extra tail during a cold replay goes: run-queue wait, or blocked.

``bench/cold_read.py`` finds a producer's p99 higher during a replay than idle. This asks which
kind of wait the slowest puts are made of. One process plays the broker (40,960 1 KiB messages
offloaded to LocalStack in 8 MiB segments, a cold worker) and times single sends 1 ms apart
into its store, each with its thread's ``/proc/thread-self/schedstat`` before and after: time
on a CPU, and time **runnable but waiting for a core** (the kernel's run-queue delay). What is
left of a put's wall is time **blocked**: the GIL, a lock, the disk. Modes, alternated in
rounds:

- ``idle``: nothing else of the bench's;
- ``replay``: a thread of this process replays the archive as ``bench/cold_read.py``'s busy
  phase does (``get_replies``, an 8 MiB cache), its reads in the cold worker;
- ``replay_ext``: the same replay in another process (its own cold worker): the same load on
  the cores and LocalStack, no GIL shared with the producer;
- ``raw_ext``: another process GETs the segment objects whole, four at a time, without end:
  LocalStack and a client busy, no tmq code.

For the slowest 1 % of puts in each mode: mean wall, on CPU, on a run queue, blocked. A tail
made of run-queue wait in ``replay`` and ``replay_ext`` alike is the cores' (LocalStack, the
worker, other processes); one made of blocked time in ``replay`` only is this process's GIL.

    python bench/cold_p99_where.py [--tree DIR] [--rounds N] [--seconds S]

Prints one JSON line a mode and round, then a summary (medians over rounds); about 20 s a round.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any


def _args() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tree", default=str(Path(__file__).resolve().parent.parent))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--modes", default="idle,replay,replay_ext,raw_ext")
    # Internal: the other process of ``replay_ext`` / ``raw_ext``.
    parser.add_argument("--external", nargs=3, metavar=("MODE", "ENDPOINT", "BUCKET"))
    return parser.parse_known_args()[0]


# Also in the spawned worker, which imports this module as its ``__main__``.
sys.path.insert(0, _args().tree)

MESSAGES = 40_960


def _schedstat() -> tuple[int, int]:
    """This thread's ns on a CPU and ns runnable on a run queue, as the kernel counts them."""
    with open("/proc/thread-self/schedstat") as f:
        on_cpu, run_queue, _ = f.read().split()
    return int(on_cpu), int(run_queue)


def produce(store: Any, seconds: float) -> list[tuple[float, float, float]]:
    """Single sends 1 ms apart for ``seconds``: each one's wall, CPU and run-queue seconds (the
    wall spans the two ``schedstat`` reads, so it holds what they count)."""
    from tiered.record import Message

    m = Message(topic="hot", queue_id=0, body=os.urandom(1024))
    rows = []
    stop = time.perf_counter() + seconds
    while time.perf_counter() < stop:
        t = time.perf_counter()
        c0, q0 = _schedstat()
        store.put_message(m)
        c1, q1 = _schedstat()
        rows.append((time.perf_counter() - t, (c1 - c0) / 1e9, (q1 - q0) / 1e9))
        time.sleep(0.001)
    return rows


def summarize(rows: list[tuple[float, float, float]]) -> dict[str, Any]:
    walls = sorted(r[0] for r in rows)
    p99 = statistics.quantiles(walls, n=100)[98]
    tail = [r for r in rows if r[0] >= p99]

    def ms(x: float) -> float:
        return round(x * 1e3, 3)

    return {
        "p99_ms": ms(p99),
        "p50_ms": ms(statistics.median(walls)),
        "puts": len(rows),
        "tail_wall_ms": ms(statistics.mean(r[0] for r in tail)),
        "tail_on_cpu_ms": ms(statistics.mean(r[1] for r in tail)),
        "tail_run_queue_ms": ms(statistics.mean(r[2] for r in tail)),
        "tail_blocked_ms": ms(statistics.mean(max(0.0, r[0] - r[1] - r[2]) for r in tail)),
    }


def external(mode: str, endpoint: str, bucket: str) -> None:
    """The other process: a replay through its own cold worker, or raw whole GETs, until
    killed. Prints ``ready`` once under way."""
    if mode == "raw_ext":
        from concurrent.futures import ThreadPoolExecutor

        import boto3
        import botocore.config

        s3 = boto3.client(
            "s3", endpoint_url=endpoint, config=botocore.config.Config(max_pool_connections=4)
        )
        listed = s3.list_objects_v2(Bucket=bucket, Prefix="tier/")["Contents"]
        keys = [o["Key"] for o in listed if o["Size"] > 1 << 20]

        def get(key: str) -> int:
            return len(s3.get_object(Bucket=bucket, Key=key)["Body"].read())

        print("ready", flush=True)
        with ThreadPoolExecutor(4) as pool:
            while True:
                list(pool.map(get, keys))
    from bench.cold_common import PRELOAD, cold_fetcher, replay
    from tiered.cold.storage import open_store
    from tiered.cold.worker import ColdWorker, run_job, warm_up

    options = {"endpoint_url": endpoint}
    tier = open_store(f"s3://{bucket}/tier", options)
    worker = ColdWorker(f"s3://{bucket}/tier", options, preload=PRELOAD)
    worker.start()
    run_job(worker, warm_up)
    fetcher = cold_fetcher(tier, worker, cache_bytes=8 << 20)
    end = fetcher.manifest("cold", 1).end_offset
    print("ready", flush=True)
    while True:
        replay(fetcher, end)


def main() -> None:
    args = _args()
    if args.external:
        external(*args.external)
        return
    from bench.cold_common import QUEUE, TOPIC, cold_archive, cold_fetcher

    modes = args.modes.split(",")
    results: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
    with cold_archive("tmq-cold-p99-", MESSAGES, 8 << 20) as archive:
        for r in range(args.rounds):
            for mode in modes:
                stop = threading.Event()
                thread = proc = None
                if mode == "replay":

                    def loop(stop: threading.Event = stop) -> None:
                        f = cold_fetcher(archive.tier, archive.worker, cache_bytes=8 << 20)
                        end = f.manifest(TOPIC, QUEUE).end_offset
                        while not stop.is_set():
                            o = 0
                            while o < end and not stop.is_set():
                                _, o, _ = f.get_replies(TOPIC, QUEUE, o, 256, max_bytes=1 << 30)
                        f.close()

                    thread = threading.Thread(target=loop)
                    thread.start()
                elif mode in ("replay_ext", "raw_ext"):
                    proc = subprocess.Popen(
                        [
                            *(sys.executable, __file__, "--tree", args.tree),
                            *("--external", mode, archive.endpoint, archive.bucket),
                        ],
                        stdout=subprocess.PIPE,
                        stderr=subprocess.DEVNULL,
                        text=True,
                    )
                    assert proc.stdout is not None
                    proc.stdout.readline()
                time.sleep(0.5)  # under way before the first put
                rows = produce(archive.store, args.seconds)
                stop.set()
                if thread is not None:
                    thread.join()
                if proc is not None:
                    proc.kill()
                    proc.wait()
                line = {"round": r, "mode": mode, **summarize(rows)}
                line["load_average_1m"] = round(os.getloadavg()[0], 1)
                results[mode].append(line)
                print(json.dumps(line), flush=True)
    keys = ("p99_ms", "tail_wall_ms", "tail_on_cpu_ms", "tail_run_queue_ms", "tail_blocked_ms")
    print(
        json.dumps(
            {
                "bench": "cold_p99_where",
                "tree": args.tree,
                "medians": {
                    m: {k: round(statistics.median(x[k] for x in rows_), 3) for k in keys}
                    for m, rows_ in results.items()
                },
                "load_average_1m": round(os.getloadavg()[0], 1),
                "utc": time.strftime("%H:%M:%S", time.gmtime()),
            }
        )
    )


if __name__ == "__main__":
    main()
