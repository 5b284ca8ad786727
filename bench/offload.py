"""Offload throughput to LocalStack S3 against a raw boto3 upload of the same bytes.

Fills a hot store with 1 KiB messages, offloads them as the broker does (its queues at once,
each segment built and PUT with a condition by the cold worker process, then its manifest
committed here), then uploads the very same segment bytes with plain
``put_object`` to the same endpoint in the same run, one at a time and four at once: the faster
of the two is the limit. Prints one JSON object on its last line;
under two minutes.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import boto3
import botocore.config

from offload.offloader import Offloader, OffloadPolicy
from tiered.cold.storage import open_store
from tiered.cold.worker import ColdWorker, run_job, warm_up
from tiered.config import StoreConfig
from tiered.record import Message
from tiered.store import MessageStore

MESSAGES = 120_000
QUEUES = 4
SEGMENT_BYTES = 16 << 20
# The raw baseline: the same bytes PUT one at a time and this many at once; the faster is the
# limit the offload is measured against.
RAW_PUT_THREADS = (1, 4)


def localstack() -> Any:
    spec = importlib.util.spec_from_file_location(
        "tmq_localstack_manage", Path(__file__).resolve().parent.parent / "localstack" / "manage.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def fill(store: MessageStore) -> None:
    body = os.urandom(1024)
    batch = [
        Message(
            topic="bench",
            queue_id=i % QUEUES,
            body=body,
            properties={"UNIQ_KEY": uuid.uuid4().hex, "KEYS": f"k{i}"},
        )
        for i in range(256)
    ]
    for _ in range(MESSAGES // 256):
        store.put_messages(batch)
    store.wait_dispatched(120)


def raw_put_seconds(s3: Any, bucket: str, blobs: list[bytes], threads: int) -> float:
    """Seconds to ``put_object`` every blob, ``threads`` at a time (its own keys)."""

    def put(i: int) -> None:
        s3.put_object(Bucket=bucket, Key=f"raw-{threads}/{i}", Body=blobs[i])

    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(put, range(len(blobs))))
    return time.perf_counter() - t0


def drop_bucket(s3: Any, bucket: str) -> None:
    """Delete the bench's objects and its bucket. LocalStack keeps every object until it stops,
    and a run writes three copies of the segments (450 MB): the runs of a shared day once filled
    the machine's memory (shared memory at 22 of 24 GiB) until the OOM killer stopped
    LocalStack."""
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket):
        keys = [{"Key": o["Key"]} for o in page.get("Contents", ())]
        if keys:
            s3.delete_objects(Bucket=bucket, Delete={"Objects": keys, "Quiet": True})
    s3.delete_bucket(Bucket=bucket)


def main() -> None:
    manage = localstack()
    started = manage.start()
    root = Path(tempfile.mkdtemp(prefix="tmq-offload-"))
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "test")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "test")
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    s3 = boto3.client(
        "s3",
        endpoint_url=manage.endpoint(),
        config=botocore.config.Config(max_pool_connections=max(RAW_PUT_THREADS)),
    )
    bucket = f"tmq-bench-{uuid.uuid4().hex[:8]}"
    s3.create_bucket(Bucket=bucket)
    try:
        store = MessageStore(StoreConfig(data_dir=root / "hot"))
        store.start()
        fill(store)
        options = {"endpoint_url": manage.endpoint()}
        tier = open_store(f"s3://{bucket}/tier", options)
        worker = ColdWorker(f"s3://{bucket}/tier", options)
        worker.start()
        run_job(worker, warm_up)  # started and connected, as a broker's is long before
        policy = OffloadPolicy(segment_max_bytes=SEGMENT_BYTES)
        offloader = Offloader(store, tier, "bench", "broker-a", policy, runner=worker)
        for q in range(QUEUES):
            offloader.manifest("bench", q)  # loaded first, as the broker's first pass does
        t0 = time.perf_counter()
        results = offloader.offload_queues([("bench", q) for q in range(QUEUES)])
        offload_s = time.perf_counter() - t0
        uploaded = 0
        for r in results:
            if isinstance(r, BaseException):
                raise r
            uploaded += r.bytes
        offloader.close()
        worker.close()
        store.shutdown()

        segments = [s for q in range(QUEUES) for s in offloader.manifest("bench", q).segments]
        blobs = [tier.get(s.key) for s in segments]
        raw_bytes = sum(len(b) for b in blobs)
        raw_runs = {n: raw_put_seconds(s3, bucket, blobs, n) for n in RAW_PUT_THREADS}
        raw_s = min(raw_runs.values())
    finally:
        shutil.rmtree(root, ignore_errors=True)
        drop_bucket(s3, bucket)
        if started:
            manage.stop()
    offload_mb_s = uploaded / offload_s / 1e6
    raw_mb_s = raw_bytes / raw_s / 1e6
    print(
        json.dumps(
            {
                "bench": "offload",
                "endpoint": "localstack",
                "messages": MESSAGES,
                "segments": len(segments),
                "bytes": uploaded,
                "offload_mb_per_s": round(offload_mb_s, 1),
                "raw_boto3_put_mb_per_s": round(raw_mb_s, 1),
                "raw_put_mb_per_s_by_threads": {
                    str(n): round(raw_bytes / t / 1e6, 1) for n, t in raw_runs.items()
                },
                "ratio_offload_vs_raw_put": round(offload_mb_s / raw_mb_s, 3),
                "target_ratio": 0.8,
            }
        )
    )


if __name__ == "__main__":
    main()
