"""What the cold benches share: an archive offloaded to LocalStack with a started cold worker,
the fetcher the broker builds over it, and a replay of it through ``get_replies``.

``cold_replay_cpu.py``, ``cold_budget.py`` and ``cold_starve.py`` import tmq from ``--tree``
(put first on ``sys.path`` before they import this); tmq's modules are imported in the
functions here, so they come from that tree too.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# The read path's modules imported at the worker's start, not by the first replay's jobs (they
# would count as its CPU and its time).
PRELOAD = ("broker.reply", "tiered.cold.segment", "tiered.cold.fetcher")
# The queue every cold bench archives and replays (``bench.offload.cold_queue_store``).
TOPIC, QUEUE = "cold", 1


@dataclass
class ColdArchive:
    root: Path  # a temporary directory, removed on exit: room for the bench's own files
    endpoint: str
    bucket: str
    store: Any  # MessageStore: the hot store the archive was offloaded from
    tier: Any  # ObjectStore: the bucket's ``tier/`` prefix
    worker: Any  # ColdWorker, started and warmed up


@contextlib.contextmanager
def cold_archive(
    prefix: str, messages: int, segment_bytes: int, **worker_options: Any
) -> Iterator[ColdArchive]:
    """``messages`` 1 KiB messages in queue 1 of topic ``cold``, offloaded in segments of
    ``segment_bytes`` to a fresh LocalStack bucket, and a cold worker (``worker_options`` passed
    on) started and connected, as a broker's is long before a replay. On exit the worker and the
    store are closed (when the body did not raise), the bucket and ``root`` removed, and
    LocalStack stopped if this started it."""
    import boto3

    from bench.offload import cold_queue_store, localstack_bucket
    from offload.offloader import Offloader, OffloadPolicy
    from tiered.cold.storage import open_store
    from tiered.cold.worker import ColdWorker, run_job, warm_up

    manage, started, endpoint, _s3, bucket = localstack_bucket()
    root = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        store = cold_queue_store(root / "hot", messages)
        options = {"endpoint_url": endpoint}
        tier = open_store(f"s3://{bucket}/tier", options)
        worker = ColdWorker(f"s3://{bucket}/tier", options, preload=PRELOAD, **worker_options)
        worker.start()
        run_job(worker, warm_up)
        policy = OffloadPolicy(segment_max_bytes=segment_bytes)
        Offloader(store, tier, "bench", "broker-a", policy).offload_queue(TOPIC, QUEUE)
        yield ColdArchive(root, endpoint, bucket, store, tier, worker)
        worker.close()
        store.shutdown()
    finally:
        shutil.rmtree(root, ignore_errors=True)
        # LocalStack holds every object in memory until it stops.
        resource = boto3.resource("s3", endpoint_url=endpoint).Bucket(bucket)
        resource.objects.delete()
        resource.delete()
        if started:
            manage.stop()


def cold_fetcher(
    tier: Any,
    worker: Any,
    *,
    read_timeout_s: float = 60.0,
    cache_bytes: int = 32 << 20,
    replies: bool = True,
) -> Any:
    """The fetcher a broker builds over ``tier``, its reads in ``worker``: ``replies`` have the
    worker encode PullMessage replies (decision 400), else it returns decoded messages. The
    default deadline is the benches' (a read at a load average of 20-30 can pass the broker's
    2.5 s; they measure throughput)."""
    from broker.reply import encode_pull_replies
    from tiered.cold.fetcher import ColdFetcher

    return ColdFetcher(
        tier,
        "bench",
        "broker-a",
        cache_bytes=cache_bytes,
        runner=worker,
        reply_encoder=encode_pull_replies if replies else None,
        read_timeout_s=read_timeout_s,
    )


def archive_mb(manifest: Any) -> float:
    """The records' MB in a queue's manifest: what a replay reads, whichever way."""
    return float(sum(s.offsets_at for s in manifest.segments)) / 1e6


def replay(fetcher: Any, end: int, batch: int = 256) -> int:
    """Read queue 1 from offset 0 to ``end`` through ``get_replies``, ``batch`` messages a read
    as the broker does for a PullMessage; the bytes of message bodies delivered."""
    offset = delivered = 0
    while offset < end:
        _, offset, bodies = fetcher.get_replies(TOPIC, QUEUE, offset, batch, max_bytes=1 << 30)
        delivered += bodies
    return delivered
