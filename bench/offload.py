"""Offload throughput to LocalStack S3 against a raw boto3 upload of the same bytes.

Fills a hot store with 1 KiB messages, then runs ``ROUNDS`` rounds, each an offload and its
baseline one right after the other: the offload as the broker does it (its queues at once,
each segment built and PUT with a condition by the cold worker process, then its manifest
committed here), then the very same segment bytes uploaded with plain ``put_object``
to the same endpoint, one at a time and four at once (the faster is that round's limit).
Each round's ratio divides by the limit measured seconds later, not minutes: on this shared
machine the store's rate drifts by 2x within a minute, and a limit taken once for all rounds
made the ratio move with the drift (decision 491). The ratio reported is the median of the
rounds'. One worker serves every round, as one serves all of a broker's passes; its first pass,
before the rounds, is reported apart (decision 715). Each round writes under its own prefix
and deletes what it wrote. Also reported,
not the goal's limit: the same bytes PUT four at once as the offload sends them (no SHA-256 of
the body, its CRC32C as the checksum; decision 490). Prints one JSON object on its last line;
about two and a half minutes.
"""

from __future__ import annotations

import base64
import importlib.util
import json
import os
import shutil
import statistics
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
import google_crc32c

from offload.offloader import Offloader, OffloadPolicy
from offload.segment_upload import WORKER_PRELOAD, worker_threads
from tiered.cold.counting import CountingObjectStore
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
ROUNDS = 3


def localstack() -> Any:
    spec = importlib.util.spec_from_file_location(
        "tmq_localstack_manage", Path(__file__).resolve().parent.parent / "localstack" / "manage.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def localstack_bucket() -> tuple[Any, bool, str, Any, str]:
    """LocalStack started (or found running), its test credentials in the environment, and a
    fresh bucket: ``(manage, started, endpoint, s3, bucket)``; ``started`` says whether the
    caller must stop it."""
    manage = localstack()
    started = manage.start()
    for name, value in (("AWS_ACCESS_KEY_ID", "test"), ("AWS_SECRET_ACCESS_KEY", "test")):
        os.environ.setdefault(name, value)
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    endpoint = manage.endpoint()
    s3 = boto3.client("s3", endpoint_url=endpoint)
    bucket = f"tmq-bench-{uuid.uuid4().hex[:8]}"
    s3.create_bucket(Bucket=bucket)
    return manage, started, endpoint, s3, bucket


def cold_queue_store(data_dir: Path, messages: int) -> MessageStore:
    """A started store holding ``messages`` 1 KiB messages in queue 1 of topic ``cold``
    (batches of 256), every one dispatched: the cold benches' archive to be."""
    store = MessageStore(StoreConfig(data_dir=data_dir))
    store.start()
    body = os.urandom(1024)
    batch = [
        Message(topic="cold", queue_id=1, body=body, properties={"UNIQ_KEY": uuid.uuid4().hex})
        for _ in range(256)
    ]
    for _ in range(messages // 256):
        store.put_messages(batch)
    store.wait_dispatched(120)
    return store


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


def raw_put_seconds(
    s3: Any, bucket: str, blobs: list[bytes], threads: int, prefix: str = "raw", lean: bool = False
) -> float:
    """Seconds to ``put_object`` every blob, ``threads`` at a time (its own keys). ``lean``:
    with each blob's CRC32C as its checksum (``s3`` then signs no payload, as the tier's
    client does), computed before the clock starts."""
    checksums = [
        {"ChecksumCRC32C": base64.b64encode(google_crc32c.value(b).to_bytes(4, "big")).decode()}
        if lean
        else {}
        for b in blobs
    ]

    def put(i: int) -> None:
        s3.put_object(Bucket=bucket, Key=f"{prefix}-{threads}/{i}", Body=blobs[i], **checksums[i])

    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(put, range(len(blobs))))
    return time.perf_counter() - t0


def drop_prefix(s3: Any, bucket: str, prefix: str) -> None:
    """Delete every object under ``prefix``: LocalStack keeps them in memory."""
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        keys = [{"Key": o["Key"]} for o in page.get("Contents", ())]
        if keys:
            s3.delete_objects(Bucket=bucket, Delete={"Objects": keys, "Quiet": True})


def worker_memory_mib(pid: int | None) -> int:
    """The cold worker's peak resident memory (``VmHWM``), MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) // 1024
    return 0


def offload_round(
    store: MessageStore, tier: CountingObjectStore, worker: ColdWorker, cluster: str
) -> tuple[float, int, list[bytes], dict[str, int]]:
    """One offload of every queue under ``cluster``'s prefix by ``worker``, the cold worker
    every round shares, as a broker's passes share its one worker: seconds, bytes uploaded, the
    segment objects' bytes (read back after the clock stopped), and the requests the broker's
    side made during the pass (the manifest commits; each segment is one PUT of the worker
    besides)."""
    policy = OffloadPolicy(segment_max_bytes=SEGMENT_BYTES)
    offloader = Offloader(store, tier, cluster, "broker-a", policy, runner=worker)
    try:
        for q in range(QUEUES):
            # Loaded and claimed first (the claim sweeps the queue's prefix once per process),
            # as the broker's first pass does long before the steady state measured here.
            offloader.claim("bench", q)
        tier.calls.clear()
        t0 = time.perf_counter()
        results = offloader.offload_queues([("bench", q) for q in range(QUEUES)])
        seconds = time.perf_counter() - t0
        requests = dict(tier.calls)
        uploaded = 0
        for r in results:
            if isinstance(r, BaseException):
                raise r
            uploaded += r.bytes
    finally:
        offloader.close()
    segments = [s for q in range(QUEUES) for s in offloader.manifest("bench", q).segments]
    return seconds, uploaded, [tier.get(s.key) for s in segments], requests


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
    config = botocore.config.Config(max_pool_connections=max(RAW_PUT_THREADS))
    s3 = boto3.client("s3", endpoint_url=manage.endpoint(), config=config)
    lean_s3 = boto3.client(
        "s3",
        endpoint_url=manage.endpoint(),
        config=config.merge(botocore.config.Config(s3={"payload_signing_enabled": False})),
    )
    bucket = f"tmq-bench-{uuid.uuid4().hex[:8]}"
    s3.create_bucket(Bucket=bucket)
    rounds: list[dict[str, Any]] = []
    first: dict[str, Any] = {}
    memory = 0
    try:
        store = MessageStore(StoreConfig(data_dir=root / "hot"))
        store.start()
        fill(store)
        options = {"endpoint_url": manage.endpoint()}
        tier = CountingObjectStore(open_store(f"s3://{bucket}", options))
        # As the broker makes it (broker/server.py): a thread per PUT and one to build ahead,
        # and the upload job's modules imported at its start. One worker for every round, as a
        # broker runs one for all its passes: a worker started for each round built each of
        # its first five segments in fresh memory, a page fault per 4 KiB page (16 ms of CPU
        # per 17 MB buffer here, as much as the rest of the build), which a broker's worker
        # pays in its first pass only (decision 715). That first pass is measured too, apart.
        worker = ColdWorker(
            f"s3://{bucket}",
            options,
            threads=worker_threads(OffloadPolicy().parallel_uploads),
            preload=WORKER_PRELOAD,
        )
        worker.start()
        try:
            # Started, connected and its modules imported, as a broker's is long before.
            run_job(worker, warm_up)
            for n in range(-1, ROUNDS):
                name = "first" if n < 0 else f"r{n}"
                load = os.getloadavg()[0]
                offload_s, uploaded, blobs, requests = offload_round(store, tier, worker, name)
                raw_bytes = sum(len(b) for b in blobs)
                raw_runs = {
                    t: raw_put_seconds(s3, bucket, blobs, t, f"{name}-raw") for t in RAW_PUT_THREADS
                }
                lean_s = raw_put_seconds(lean_s3, bucket, blobs, 4, f"{name}-lean", lean=True)
                drop_prefix(s3, bucket, name)
                offload_mb_s = uploaded / offload_s / 1e6
                raw_mb_s = raw_bytes / min(raw_runs.values()) / 1e6
                round_ = {
                    "segments": len(blobs),
                    "bytes": uploaded,
                    "offload_mb_per_s": offload_mb_s,
                    "raw_mb_per_s": raw_mb_s,
                    "raw_by_threads": {str(t): raw_bytes / s / 1e6 for t, s in raw_runs.items()},
                    "lean_raw_mb_per_s": raw_bytes / lean_s / 1e6,
                    "ratio": offload_mb_s / raw_mb_s,
                    "ratio_lean": offload_mb_s * lean_s / raw_bytes * 1e6,
                    "load": load,
                    "commit_requests": sum(requests.values()),
                }
                if n < 0:
                    first = round_
                else:
                    rounds.append(round_)
            memory = worker_memory_mib(worker.pid)
        finally:
            worker.close()
        store.shutdown()
    finally:
        shutil.rmtree(root, ignore_errors=True)
        drop_bucket(s3, bucket)
        if started:
            manage.stop()

    def median(field: str) -> float:
        return float(statistics.median(r[field] for r in rounds))

    print(
        json.dumps(
            {
                "bench": "offload",
                "endpoint": "localstack",
                "messages": MESSAGES,
                "segments": rounds[0]["segments"],
                "bytes": rounds[0]["bytes"],
                "rounds": ROUNDS,
                "offload_mb_per_s": round(median("offload_mb_per_s"), 1),
                "raw_boto3_put_mb_per_s": round(median("raw_mb_per_s"), 1),
                "raw_put_mb_per_s_by_threads": {
                    str(t): round(statistics.median(r["raw_by_threads"][str(t)] for r in rounds), 1)
                    for t in RAW_PUT_THREADS
                },
                "ratio_offload_vs_raw_put": round(median("ratio"), 3),
                "ratio_runs": [round(r["ratio"], 3) for r in rounds],
                "offload_mb_per_s_runs": [round(r["offload_mb_per_s"], 1) for r in rounds],
                "raw_put_mb_per_s_runs": [round(r["raw_mb_per_s"], 1) for r in rounds],
                "lean_raw_put_mb_per_s": round(median("lean_raw_mb_per_s"), 1),
                "ratio_offload_vs_lean_raw_put": round(median("ratio_lean"), 3),
                "load_average_runs": [round(r["load"], 1) for r in rounds],
                # Requests per pass besides the segments' PUTs: the manifest commits' (a PUT,
                # a LIST and, past ten versions, a prune each).
                "commit_requests_per_pass_runs": [r["commit_requests"] for r in rounds],
                "worker_peak_rss_mib": memory,
                # The worker's first pass (not in the ratio above): its segment buffers are
                # new memory, as in a broker's first pass after its start.
                "first_pass_offload_mb_per_s": round(first["offload_mb_per_s"], 1),
                "first_pass_ratio_offload_vs_raw_put": round(first["ratio"], 3),
                "target_ratio": 0.8,
            }
        )
    )


if __name__ == "__main__":
    main()
