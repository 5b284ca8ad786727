"""Delta export throughput and freshness, against Spark writing the same rows to plain Parquet.

1. Fills a hot store with 1 KiB messages and offloads them to LocalStack S3.
2. Throughput: in one Spark session (local[*]), after a warm-up, (a) Spark reads the archive
   with the ``tmq`` source and writes plain Parquet with its own writer: the physical limit
   of this machine for "archive -> Parquet"; (b) ``export --once`` writes the same rows to a
   Delta table (Parquet on the executors + delta-rs commits). Ratio = (b) / (a).
3. Freshness: a continuous export at the default trigger (10 s) runs while new messages are
   produced and offloaded at random moments; each sample is the time from the manifest commit
   to the rows being visible in the Delta table (its app transactions reach the watermark).

Prints one JSON object on its last line; under three minutes.
"""

from __future__ import annotations

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
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import boto3

from bench.offload import localstack  # the same LocalStack the other benchmarks use
from lakehouse.export import DEFAULT_TRIGGER_SECONDS, Export, ExportConfig
from lakehouse.locations import Location
from lakehouse.spark import spark_session
from lakehouse.tables import LakeTable, exported_offsets
from lakehouse.tier import ManifestCache, QueueRef, discover
from offload.offloader import Offloader, OffloadPolicy
from tiered.cold.storage import open_store
from tiered.config import StoreConfig
from tiered.record import Message
from tiered.store import MessageStore

MESSAGES = 60_000
QUEUES = 4
SEGMENT_BYTES = 8 << 20
FRESHNESS_SAMPLES = 6
FRESHNESS_MESSAGES = 2_000


def progress(message: str) -> None:
    print(f"[bench/export] {message}", file=sys.stderr, flush=True)


def fill(store: MessageStore, topic: str, n: int) -> None:
    body = os.urandom(1024)
    tags = ["red", "green", "blue"]
    for start in range(0, n, 256):
        store.put_messages(
            [
                Message(
                    topic=topic,
                    queue_id=i % QUEUES,
                    body=body,
                    properties={"UNIQ_KEY": uuid.uuid4().hex, "KEYS": f"k{i}", "TAGS": tags[i % 3]},
                )
                for i in range(start, min(n, start + 256))
            ]
        )
    store.wait_dispatched(120)


def offload(offloader: Offloader, topic: str) -> None:
    for q in range(QUEUES):
        offloader.offload_queue(topic, q)


def wait_visible(
    lake: Location,
    topic: str,
    queues: list[QueueRef],
    manifests: ManifestCache,
    errors: list[BaseException],
) -> None:
    """Until the table's exported offsets reach every queue's tier watermark."""
    targets = {q.key: manifests.get(q).end_offset for q in queues}
    deadline = time.monotonic() + 90
    while True:
        if errors:
            raise errors[0]
        done = exported_offsets(LakeTable(lake, topic).open(), queues)
        if all(done.get(k, -1) >= v for k, v in targets.items()):
            return
        assert time.monotonic() < deadline, "rows never became visible"
        time.sleep(0.1)


def freshness(
    spark: Any, store: MessageStore, offloader: Offloader, tier: Location, lake: Location
) -> list[float]:
    """Seconds from each manifest commit to its rows being visible in Delta."""
    topic = "fresh"
    fill(store, topic, 100)
    offload(offloader, topic)
    job = Export(spark, ExportConfig(tier.url, lake.url, [topic], tier_options=tier.options))
    errors: list[BaseException] = []

    def run() -> None:
        try:
            job.run(once=False)
        except BaseException as e:
            errors.append(e)

    runner = threading.Thread(target=run, daemon=True)
    runner.start()
    store_tier = open_store(tier.url, tier.options)
    queues = discover(store_tier, frozenset([topic]))
    rng = random.Random(1)
    samples = []
    try:
        # Steady state first: the query's start-up is not freshness.
        wait_visible(lake, topic, queues, ManifestCache(store_tier), errors)
        for _ in range(FRESHNESS_SAMPLES):
            time.sleep(rng.uniform(0, DEFAULT_TRIGGER_SECONDS / 2))  # any phase of the trigger
            fill(store, topic, FRESHNESS_MESSAGES)
            offload(offloader, topic)
            committed = time.monotonic()
            wait_visible(lake, topic, queues, ManifestCache(store_tier), errors)
            samples.append(time.monotonic() - committed)
            progress(f"freshness sample: {samples[-1]:.1f} s")
    finally:
        job.stop()
        runner.join(60)
    return samples


def main() -> None:
    manage = localstack()
    started = manage.start()
    root = Path(tempfile.mkdtemp(prefix="tmq-export-"))
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "test")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "test")
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    bucket = f"tmq-bench-{uuid.uuid4().hex[:8]}"
    boto3.client("s3", endpoint_url=manage.endpoint()).create_bucket(Bucket=bucket)
    tier = Location.of(f"s3://{bucket}/tier", {"endpoint_url": manage.endpoint()})
    try:
        store = MessageStore(StoreConfig(data_dir=root / "hot"))
        store.start()
        offloader = Offloader(
            store,
            open_store(tier.url, tier.options),
            "bench",
            "broker-a",
            OffloadPolicy(segment_max_bytes=SEGMENT_BYTES),
        )
        fill(store, "bench", MESSAGES)
        offload(offloader, "bench")
        progress("archive ready")
        spark = spark_session("local[*]", "tmq-bench-export")
        source = (
            spark.read.format("tmq")
            .option("tier_url", tier.url)
            .option("tier_options", json.dumps(tier.options))
            .option("topics", "bench")
        )
        # Warm-up: Python workers, class loading and the S3 clients, for both paths alike.
        source.load().limit(10).write.mode("overwrite").parquet(str(root / "warm"))

        t0 = time.perf_counter()
        source.load().write.mode("overwrite").parquet(str(root / "plain"))
        plain_s = time.perf_counter() - t0
        progress(f"plain Parquet: {plain_s:.1f} s")
        plain_rows = spark.read.parquet(str(root / "plain")).count()

        lake = Location.of(str(root / "lake"))
        t0 = time.perf_counter()
        report = Export(
            spark, ExportConfig(tier.url, lake.url, ["bench"], tier_options=tier.options)
        ).run(once=True, timeout=170)
        export_s = time.perf_counter() - t0
        progress(f"export --once: {export_s:.1f} s")
        assert report.rows == MESSAGES == plain_rows, (report.rows, plain_rows)
        body_mb = MESSAGES * 1024 / 1e6

        samples = freshness(spark, store, offloader, tier, lake)
        store.shutdown()
        spark.stop()
    finally:
        shutil.rmtree(root, ignore_errors=True)
        if started:
            manage.stop()
    quantiles = statistics.quantiles(samples, n=20, method="inclusive")
    print(
        json.dumps(
            {
                "bench": "export",
                "endpoint": "localstack",
                "messages": MESSAGES,
                "export_rows_per_s": round(MESSAGES / export_s),
                "export_body_mb_per_s": round(body_mb / export_s, 1),
                "plain_parquet_rows_per_s": round(MESSAGES / plain_s),
                "plain_parquet_body_mb_per_s": round(body_mb / plain_s, 1),
                "ratio_export_vs_plain_parquet": round(plain_s / export_s, 3),
                "target_ratio": 0.5,
                "export_batches": len(report.batches),
                "trigger_s": DEFAULT_TRIGGER_SECONDS,
                "freshness_samples_s": [round(s, 2) for s in samples],
                "freshness_p50_s": round(statistics.median(samples), 2),
                "freshness_p95_s": round(quantiles[18], 2),
                "target_freshness_p95_s": 30,
            }
        )
    )


if __name__ == "__main__":
    main()
