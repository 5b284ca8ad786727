"""The offload pass and release keep working around one bad queue, and release keeps what it
cannot prove safe to delete."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from broker_harness import Standalone, send_batches
from test_tiered_e2e import QUICK_TIERING

from broker import admin_pb2 as apb
from broker.metadata import TopicConfig
from offload.release import release_predicate
from tiered.config import StoreConfig
from tiered.record import Message
from tiered.store import MessageStore


def test_release_keeps_a_file_when_a_consumequeue_entry_cannot_be_read(
    small_config: StoreConfig, start_store: Callable[[StoreConfig], MessageStore]
) -> None:
    """'young' still needs its messages (10 days of retention); 'old' may go. With one of
    young's ConsumeQueue files unreadable, the rule cannot tell whether young has records in a
    CommitLog file: it must keep the file, not assume "no record of young here"."""
    store = start_store(small_config)
    for i in range(1200):
        store.put_message(Message(topic="old" if i % 2 else "young", queue_id=0, body=b"x" * 400))
    assert store.wait_dispatched()
    topics = {
        "old": TopicConfig("old", queues=1, retention_ms=1),
        "young": TopicConfig("young", queues=1, retention_ms=10 * 86_400_000),
    }
    far_future = lambda: time.time_ns() // 1_000_000 + 86_400_000  # noqa: E731
    can_release = release_predicate(store, None, topics, now_ms=far_future)
    first = store.commitlog_files()[0]
    assert not can_release(first), "young's messages are in the first file"

    young = store.queues.get("young", 0)
    assert young is not None and len(young.files.files) > 1
    lost = young.files.files[0]  # entries 0..255 of young: the ones in the first file
    young.files.files.remove(lost)
    lost.destroy()
    assert young.get_entry(0) is None
    assert not can_release(first), "an unreadable entry keeps the file (fails closed)"
    assert store.release_commitlog_files(can_release) == 0


def test_a_broken_queue_stops_neither_other_queues_nor_release(tmp_path: Path) -> None:
    """One tiered topic's manifest is damaged in the tier, so its retention fails on every
    pass. Other topics still upload, and CommitLog files are still released."""
    node = Standalone(tmp_path / "data", extra=QUICK_TIERING).start()
    try:
        admin = node.admin()
        admin.PutTopic(
            apb.PutTopicRequest(
                topic=apb.Topic(
                    name="broken", queues=1, perm=6, tiered=True, retention_ms=3_600_000
                )
            ),
            timeout=10,
        )
        send_batches(node.endpoint, "broken", [(b"b" * 700, "k", "t")] * 300)

        def watermark(topic: str) -> int:
            return int(
                admin.GetTopic(apb.GetTopicRequest(name=topic), timeout=10).queues[0].tier_watermark
            )

        def commitlog_min() -> int:
            return int(admin.Stats(apb.StatsRequest(), timeout=10).commitlog_min_offset)

        deadline = time.monotonic() + 30
        while watermark("broken") < 300 or commitlog_min() == 0:
            assert time.monotonic() < deadline, "broken/0 was never uploaded and released"
            time.sleep(0.3)
        queue_dir = node.data_dir / "tier" / "DefaultCluster" / "broker-a" / "broken" / "0"
        manifests = sorted((queue_dir / "manifests").glob("*.json"))
        manifests[-1].write_text("{not a manifest")
        released_before = commitlog_min()

        admin.PutTopic(
            apb.PutTopicRequest(topic=apb.Topic(name="fine", queues=1, perm=6, tiered=True)),
            timeout=10,
        )
        send_batches(node.endpoint, "fine", [(b"f" * 700, "k", "t")] * 1200)
        deadline = time.monotonic() + 40
        while watermark("fine") < 1200 or commitlog_min() < released_before + 3 * 131072:
            assert time.monotonic() < deadline, (
                f"fine uploaded to {watermark('fine')}, CommitLog starts at {commitlog_min()}: "
                + node.log_path.read_text()[-1500:]
            )
            time.sleep(0.3)
        assert "retention of broken/0 failed" in node.log_path.read_text()
    finally:
        node.stop()
