"""The cold worker's upload job: what it asks of the object store, and its gather."""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import pytest

from offload.offloader import Offloader
from offload.segment_upload import SegmentSourceError, upload_segment
from tiered.cold.counting import CountingObjectStore
from tiered.cold.segment import SegmentError, read_footer
from tiered.cold.storage import open_store
from tiered.config import StoreConfig
from tiered.record import Message
from tiered.store import MessageStore


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
