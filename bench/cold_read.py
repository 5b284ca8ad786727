"""Cold reads from LocalStack S3: sequential replay, random-read cost, and the hot path's latency.

- Sequential replay MB/s through the cold fetcher, its segment reads in the cold worker process
  as in the broker, against raw ``get_object`` of the same segment objects in the same run (one
  at a time and four at once; the faster is the limit). The replay reads what the broker's
  PullMessage sends: the replies the worker serialized (``get_replies``, decision 400), sliced
  one bytes object per message; ``--decoded`` reads ``StoredMessage`` objects instead (``get``,
  the path before decision 400, still the one of reads with a filter), and ``--decoded-pull``
  also builds and serializes each message's reply from them in the broker, as PullMessage did
  before decision 400.
- Requests per random read at 1x and 10x archive size (counted at the storage interface).
- Produce p99 while another thread replays the archive, against produce p99 when idle.

Prints one JSON object on its last line; about a minute.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import boto3
import botocore.config

from bench.cold_common import PRELOAD, cold_fetcher
from bench.offload import localstack_bucket
from broker.reply import pull_reply
from offload.offloader import Offloader, OffloadPolicy
from tiered.cold.counting import CountingObjectStore
from tiered.cold.fetcher import ColdFetcher
from tiered.cold.segment import SegmentReader
from tiered.cold.storage import open_store
from tiered.cold.worker import ColdWorker, run_job, warm_up
from tiered.config import StoreConfig
from tiered.record import Message
from tiered.store import MessageStore

BASE = 20_000  # messages in the 1x archive; the 10x one has 200,000
# The raw baseline: the same objects read whole one at a time and this many at once; the faster
# is the limit the replay is measured against.
RAW_GET_THREADS = (1, 4)
# A read's deadline: a client retries a cold read that passed the broker's 2.5 s, but one at a
# load average of 20-30 on two cores stopped the whole bench; the bench measures throughput.
READ_TIMEOUT_S = 60.0


def fill(store: MessageStore, queue_id: int, n: int) -> None:
    body = os.urandom(1024)
    batch = [
        Message(
            topic="cold", queue_id=queue_id, body=body, properties={"UNIQ_KEY": uuid.uuid4().hex}
        )
        for _ in range(256)
    ]
    for _ in range(n // 256):
        store.put_messages(batch)
    store.wait_dispatched(120)


def p99(samples: list[float]) -> float:
    return statistics.quantiles(samples, n=100)[98] * 1000


def produce_latencies(store: MessageStore, seconds: float) -> list[float]:
    m = Message(topic="hot", queue_id=0, body=os.urandom(1024))
    out = []
    stop = time.perf_counter() + seconds
    while time.perf_counter() < stop:
        t = time.perf_counter()
        store.put_message(m)
        out.append(time.perf_counter() - t)
        time.sleep(0.001)
    return out


def raw_get_seconds(s3: Any, bucket: str, keys: list[str], threads: int) -> float:
    """Seconds to ``get_object`` every key whole, ``threads`` at a time."""

    def get(key: str) -> int:
        return len(s3.get_object(Bucket=bucket, Key=f"tier/{key}")["Body"].read())

    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(get, keys))
    return time.perf_counter() - t0


def replay_step(fetcher: ColdFetcher, decoded: str, offset: int) -> tuple[int, int]:
    """One read of up to 256 messages from ``offset`` of queue 1, as the broker makes it for a
    PullMessage; the next offset and the bytes of message bodies the read delivered."""
    if decoded:
        messages, nxt = fetcher.get("cold", 1, offset, 256, max_bytes=1 << 30)
        if decoded == "--decoded-pull":
            for m in messages:
                pull_reply(m)
        return nxt, sum(len(m.body) for m in messages)
    _, nxt, bodies = fetcher.get_replies("cold", 1, offset, 256, max_bytes=1 << 30)
    return nxt, bodies


def main() -> None:
    decoded = next((a for a in sys.argv[1:] if a in ("--decoded", "--decoded-pull")), "")
    manage, started, endpoint, _s3, bucket = localstack_bucket()
    s3 = boto3.client(
        "s3",
        endpoint_url=endpoint,
        config=botocore.config.Config(max_pool_connections=max(RAW_GET_THREADS)),
    )
    root = Path(tempfile.mkdtemp(prefix="tmq-cold-"))
    try:
        store = MessageStore(StoreConfig(data_dir=root / "hot"))
        store.start()
        fill(store, 0, BASE)
        fill(store, 1, BASE * 10)
        options = {"endpoint_url": endpoint}
        tier = open_store(f"s3://{bucket}/tier", options)
        # The read path imported at the start, as the other cold benches' workers do: else the
        # replay times its first read's one-time import, 0.9-2.2 s at load 10 (decision 1110;
        # the broker's worker does not preload it yet).
        worker = ColdWorker(f"s3://{bucket}/tier", options, preload=PRELOAD)
        worker.start()
        run_job(worker, warm_up)  # started and connected, as a broker's is long before
        offloader = Offloader(
            store, tier, "bench", "broker-a", OffloadPolicy(segment_max_bytes=8 << 20)
        )
        for q in (0, 1):
            offloader.offload_queue("cold", q)

        # Sequential replay of queue 1 against raw GETs of the same objects.
        fetcher = cold_fetcher(tier, worker, read_timeout_s=READ_TIMEOUT_S, replies=not decoded)
        end = fetcher.manifest("cold", 1).end_offset
        t0 = time.perf_counter()
        offset = delivered = 0
        while offset < end:
            offset, bodies = replay_step(fetcher, decoded, offset)
            delivered += bodies
        replay_s = time.perf_counter() - t0
        # The same records' bytes whichever path read them (a reply is a record re-encoded).
        replayed = sum(s.offsets_at for s in fetcher.manifest("cold", 1).segments)
        keys = [s.key for s in fetcher.manifest("cold", 1).segments]
        raw = sum(s.size for s in fetcher.manifest("cold", 1).segments)
        raw_runs = {n: raw_get_seconds(s3, bucket, keys, n) for n in RAW_GET_THREADS}
        raw_s = min(raw_runs.values())
        fetcher.close()

        # Requests per random read at 1x and 10x, counted at the storage interface: the segment
        # read itself (the fetcher's read-ahead would add a prefetch; its cache would hide reads).
        per_read = {}
        for label, queue_id in (("1x", 0), ("10x", 1)):
            counting = CountingObjectStore(tier)
            manifest = ColdFetcher(tier, "bench", "broker-a").manifest("cold", queue_id)
            rng = random.Random(queue_id)
            reads = 100
            for _ in range(reads):
                offset = rng.randrange(manifest.end_offset)
                info = manifest.find(offset)
                assert info is not None
                SegmentReader(counting, info).read(offset, 1)
            per_read[label] = round(sum(counting.calls.values()) / reads, 2)

        # Produce p99, idle and during a heavy replay on another thread.
        idle = produce_latencies(store, 3)
        busy_stop = threading.Event()

        def replay_forever() -> None:
            f = cold_fetcher(
                tier,
                worker,
                read_timeout_s=READ_TIMEOUT_S,
                cache_bytes=8 << 20,
                replies=not decoded,
            )
            while not busy_stop.is_set():
                o = 0
                while o < end and not busy_stop.is_set():
                    o, _ = replay_step(f, decoded, o)
            f.close()

        replayer = threading.Thread(target=replay_forever)
        replayer.start()
        busy = produce_latencies(store, 3)
        busy_stop.set()
        replayer.join()
        worker.close()
        store.shutdown()
    finally:
        shutil.rmtree(root, ignore_errors=True)
        # LocalStack holds every object in memory until it stops: each run left ~250 MB.
        with contextlib.suppress(Exception):
            boto3.resource("s3", endpoint_url=endpoint).Bucket(bucket).objects.delete()
            s3.delete_bucket(Bucket=bucket)
        if started:
            manage.stop()
    print(
        json.dumps(
            {
                "bench": "cold_read",
                "endpoint": "localstack",
                "read_path": decoded.lstrip("-") or "replies",
                "replay_mb_per_s": round(replayed / replay_s / 1e6, 1),
                "raw_get_mb_per_s": round(raw / raw_s / 1e6, 1),
                "raw_get_mb_per_s_by_threads": {
                    str(n): round(raw / t / 1e6, 1) for n, t in raw_runs.items()
                },
                "ratio_replay_vs_raw_get": round((replayed / replay_s) / (raw / raw_s), 3),
                # What a replaying client gets: message bodies delivered per second, against the
                # raw GET of the same objects (records, tables and footer) in the same run.
                "replay_body_mb_per_s": round(delivered / replay_s / 1e6, 1),
                "ratio_body_replay_vs_raw_get": round((delivered / replay_s) / (raw / raw_s), 3),
                "load_average_1m": round(os.getloadavg()[0], 1),
                "requests_per_random_read": per_read,
                "produce_p99_ms_idle": round(p99(idle), 3),
                "produce_p99_ms_during_replay": round(p99(busy), 3),
                "ratio_p99_during_replay_vs_idle": round(p99(busy) / p99(idle), 2),
                "targets": {
                    "ratio_replay_vs_raw_get": 0.7,
                    "requests_constant": True,
                    "ratio_p99": 1.2,
                },
            }
        )
    )


if __name__ == "__main__":
    main()
