"""Offload throughput to LocalStack S3 against a raw boto3 upload of the same bytes.

Fills a hot store with 1 KiB messages, offloads them as the broker does (its queues at once,
each segment built, PUT with a condition and its footer verified by the cold worker process,
then its manifest committed here), then uploads the very same segment bytes with plain
``put_object`` to the same endpoint in the same run. Prints one JSON object on its last line;
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
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import boto3

from offload.offloader import Offloader, OffloadPolicy
from tiered.cold.storage import open_store
from tiered.cold.worker import ColdWorker
from tiered.config import StoreConfig
from tiered.record import Message
from tiered.store import MessageStore

MESSAGES = 120_000
QUEUES = 4
SEGMENT_BYTES = 16 << 20


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


def main() -> None:
    manage = localstack()
    started = manage.start()
    root = Path(tempfile.mkdtemp(prefix="tmq-offload-"))
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "test")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "test")
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    s3 = boto3.client("s3", endpoint_url=manage.endpoint())
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
        t0 = time.perf_counter()
        for i, blob in enumerate(blobs):
            s3.put_object(Bucket=bucket, Key=f"raw/{i}", Body=blob)
        raw_s = time.perf_counter() - t0
        raw_bytes = sum(len(b) for b in blobs)
    finally:
        shutil.rmtree(root, ignore_errors=True)
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
                "ratio_offload_vs_raw_put": round(offload_mb_s / raw_mb_s, 3),
                "target_ratio": 0.8,
            }
        )
    )


if __name__ == "__main__":
    main()
