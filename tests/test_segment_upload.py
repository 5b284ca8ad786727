"""The cold worker's upload job: what it asks of the object store, and its gather."""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import S3Endpoint

from offload.offloader import Offloader
from offload.segment_upload import SegmentJob, SegmentSourceError, upload_segment
from tiered.cold.counting import CountingObjectStore
from tiered.cold.segment import SegmentError, build, read_footer
from tiered.cold.storage import RetryPolicy, StorageError, open_store
from tiered.config import StoreConfig
from tiered.formats import CQ_DTYPE, CQ_ENTRY_SIZE
from tiered.record import Message
from tiered.store import MessageStore, commitlog_file_name


def test_a_put_that_wrote_is_not_read_back_and_a_retry_checks_the_stored_footer(
    tmp_path: Path,
) -> None:
    store = MessageStore(StoreConfig(data_dir=tmp_path / "hot", commitlog_file_size=1 << 20))
    store.start()
    try:
        # Two queues interleaved, across several CommitLog files: the gather skips the other's.
        store.put_messages(
            [Message(topic="t", queue_id=i % 2, body=os.urandom(700)) for i in range(3000)]
        )
        assert store.wait_dispatched()
        tier = CountingObjectStore(open_store(f"file://{tmp_path}/tier"))
        offloader = Offloader(store, tier, "c", "b")
        [job] = list(offloader._plan_segments("t", 1, 0, store.max_offset("t", 1)))
        offloader.close()
    finally:
        store.shutdown()

    info = upload_segment(tier, job)
    assert dict(tier.calls) == {"put_if_absent": 1}, "one request: the PUT"
    assert read_footer(tier, info.key) == info and info.count == 1500

    tier.calls.clear()
    assert upload_segment(tier, job) == info  # the job run again: its own object is found
    assert tier.calls["put_if_absent"] == 1 and tier.calls["get_range"] == 1

    # Somebody else's object under the key (here: a segment of fewer records): found, compared,
    # refused.
    rivals = open_store(f"file://{tmp_path}/rival")
    fewer = upload_segment(rivals, replace(job, entries=job.entries[: 20 * 100]))
    assert fewer.key == job.key and fewer.count == 100
    with pytest.raises(SegmentError, match="differs"):
        upload_segment(rivals, job)

    gone = replace(job, commitlog_dir=str(tmp_path / "nowhere"))
    with pytest.raises(SegmentSourceError):
        upload_segment(tier, gone)


def _planned_jobs(tmp_path: Path, segment_max_bytes: int) -> list[SegmentJob]:
    """Upload jobs of one queue (its records interleaved with another's, of many sizes, with
    keys), planned as the offloader plans them."""
    store = MessageStore(StoreConfig(data_dir=tmp_path / "hot", commitlog_file_size=1 << 20))
    store.start()
    try:
        store.put_messages(
            [
                Message(
                    topic="t",
                    queue_id=i % 2,
                    body=os.urandom(300 + i % 900),
                    properties={"KEYS": f"k{i}"},
                )
                for i in range(4000)
            ]
        )
        assert store.wait_dispatched()
        offloader = Offloader(store, open_store(f"file://{tmp_path}/plan"), "c", "b")
        offloader.policy.segment_max_bytes = segment_max_bytes
        jobs = list(offloader._plan_segments("t", 0, 0, store.max_offset("t", 0)))
        offloader.close()
    finally:
        store.shutdown()
    return jobs


def _reference_build(job: SegmentJob) -> bytes:
    """The object ``build`` makes of the job's records, read from the CommitLog with plain
    file reads."""
    table = np.frombuffer(job.entries, dtype=CQ_DTYPE)
    records = []
    for offset, size in zip(table["offset"].tolist(), table["size"].tolist(), strict=True):
        start = offset // job.commitlog_file_size * job.commitlog_file_size
        with open(Path(job.commitlog_dir) / commitlog_file_name(start), "rb") as f:
            f.seek(offset - start)
            records.append(f.read(size))
    return build(records, job.base_offset, job.key)[0]


def test_a_segment_built_in_a_reused_buffer_is_byte_for_byte_the_reference_build(
    tmp_path: Path,
) -> None:
    """The worker builds each segment in the buffer its thread built the last one in (decision
    410): whatever that buffer held before, the object is the reference ``build`` of the same
    records, so a retried upload of the same range writes identical bytes."""
    jobs = _planned_jobs(tmp_path, 400_000)
    big, tail = jobs[0], jobs[-1]
    assert len(tail.entries) < len(big.entries) * 0.6, "a small job after a large one"
    cut = len(big.entries) // CQ_ENTRY_SIZE * 4 // 5 * CQ_ENTRY_SIZE
    medium = replace(big, entries=big.entries[:cut])
    # One thread, as a worker thread runs them: large, small, smaller than the kept buffer,
    # large again (more records than the last object's bytes), the others, the first again.
    for n, job in enumerate([big, tail, medium, big, *jobs[1:-1], big]):
        tier = open_store(f"file://{tmp_path}/tier-{n}")
        info = upload_segment(tier, job)
        assert tier.get(info.key) == _reference_build(job), f"job {n}"


@pytest.mark.parametrize("fault", [{"reset": True}, {"corrupt": True}], ids=["reset", "corrupt"])
def test_an_upload_cut_off_by_an_outage_stores_nothing_and_its_retry_stores_the_build(
    fault: dict[str, Any], tmp_path: Path, fault_proxy: Any, bucket: str
) -> None:
    """Through the fault proxy: the connection reset under the PUT, or its body damaged on the
    way. Nothing is stored; the job run again after the outage, on a thread whose buffer
    another segment was built in meanwhile, stores exactly the reference build."""
    jobs = _planned_jobs(tmp_path, 400_000)
    options = S3Endpoint(fault_proxy.url, "proxy").storage_options()
    tier = open_store(f"s3://{bucket}/tier", options, RetryPolicy(attempts=1))
    fault_proxy.set(**fault, methods=["PUT"])
    with pytest.raises(StorageError):
        upload_segment(tier, jobs[0])
    assert tier.list("") == [], "nothing stored"
    fault_proxy.heal()
    upload_segment(open_store(f"file://{tmp_path}/other"), jobs[1])  # the buffer reused
    info = upload_segment(tier, jobs[0])
    assert tier.get(info.key) == _reference_build(jobs[0])
