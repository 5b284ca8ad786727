"""Tiered storage in a replica group, one offloader per role, on a real store and a real tier
(file:// and LocalStack S3): only the leader writes; a deposed master's commits are refused by
the manifest's conditional put; a master uploads only below its high watermark (what every
in-sync replica holds)."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest
from google_crc32c import value as crc32c

from offload.leadership import Term
from offload.offloader import FencedError, NotLeaderError, Offloader, OffloadPolicy
from offload.verify import verify_queue
from tests.test_offload import fill, read_tier, snapshot
from tiered.cold.manifest import (
    KEEP_VERSIONS,
    ManifestConflictError,
    ManifestFencedError,
    ManifestLog,
    QueueManifest,
    queue_prefix,
    segment_key,
)
from tiered.cold.segment import build
from tiered.cold.storage import ObjectStore, open_store
from tiered.store import MessageStore

pytest_plugins = ["tests.test_offload"]  # the hot and tier fixtures

SMALL = OffloadPolicy(segment_max_messages=200)
PREFIX = queue_prefix("c1", "broker-a", "orders", 0)


def offloader(hot: MessageStore, tier: ObjectStore, term: Term | None, **kw: object) -> Offloader:
    return Offloader(hot, tier, "c1", "broker-a", SMALL, leadership=lambda: term, **kw)  # type: ignore[arg-type]


def listed_segments(tier: ObjectStore) -> set[str]:
    return {o.key for o in tier.list(f"{PREFIX}segments/")}


def test_a_deposed_master_cannot_commit_and_leaves_nothing_behind(hot, tier) -> None:
    fill(hot, "orders", 1000, queues=1, seed=3)
    old = offloader(hot, tier, Term(1, "a"))
    new = offloader(hot, tier, Term(2, "b"))
    assert old.offload_queue("orders", 0, up_to=400).watermark == 400
    # The new master claims the queue in epoch 2 and resumes at the watermark.
    assert new.offload_queue("orders", 0, up_to=700).watermark == 700
    claimed = ManifestLog(tier, PREFIX).load()
    assert (claimed.epoch, claimed.writer, claimed.end_offset) == (2, "b", 700)
    # The old master still believes it leads: its upload is refused at commit, and deleted.
    with pytest.raises(FencedError, match="epoch 2"):
        old.offload_queue("orders", 0)
    assert old.fenced and old.fenced_by == Term(2, "b")
    assert ManifestLog(tier, PREFIX).load() == claimed
    assert listed_segments(tier) == {s.key for s in claimed.segments}
    # Fenced for good: no upload, no retention, and release may trust no watermark.
    with pytest.raises(FencedError):
        old.expire("orders", 0, cutoff_ms=1 << 62)
    with pytest.raises(FencedError):
        old.release_watermark("orders", 0)
    assert ManifestLog(tier, PREFIX).load() == claimed
    # The new master goes on from its own watermark: every message once, in order.
    assert new.offload_queue("orders", 0).watermark == 1000
    assert read_tier(tier, "orders", 0) == snapshot(hot, "orders", 0)
    assert not new.fenced


def test_a_fenced_broker_writes_again_only_in_a_later_epoch(hot, tier) -> None:
    fill(hot, "orders", 300, queues=1, seed=4)
    term = Term(1, "a")
    old = Offloader(hot, tier, "c1", "broker-a", SMALL, leadership=lambda: term)
    offloader(hot, tier, Term(2, "b")).offload_queue("orders", 0, up_to=100)
    with pytest.raises(FencedError):
        old.offload_queue("orders", 0)
    term = Term(3, "a")  # elected again later: a new term, a new claim
    assert not old.fenced
    assert old.offload_queue("orders", 0).watermark == 300
    assert ManifestLog(tier, PREFIX).load().epoch == 3


def test_a_slave_never_writes_the_tier_nor_sweeps_it(hot, tier) -> None:
    fill(hot, "orders", 500, queues=1, seed=5)
    master = offloader(hot, tier, Term(1, "a"))
    master.offload_queue("orders", 0, up_to=200)
    # An upload of the master in flight (written, not committed yet) looks like an orphan.
    records = [hot.commitlog.read(m.commitlog_offset, m.size) for m in snapshot(hot, "orders", 0)]
    data, in_flight = build(records[200:300], 200, segment_key(PREFIX, 200))
    assert tier.put_if_absent(in_flight.key, data)
    slave = offloader(hot, tier, None)
    assert slave.watermark("orders", 0) == slave.release_watermark("orders", 0) == 200
    with pytest.raises(NotLeaderError):
        slave.offload_queue("orders", 0)
    with pytest.raises(NotLeaderError):
        slave.expire("orders", 0, cutoff_ms=1 << 62)
    assert in_flight.key in listed_segments(tier)
    assert ManifestLog(tier, PREFIX).load().end_offset == 200


def test_uploads_stop_at_the_high_watermark(hot, tier) -> None:
    fill(hot, "orders", 600, queues=1, seed=6)
    messages = snapshot(hot, "orders", 0)
    held = messages[450].commitlog_offset  # every in-sync replica holds message 449
    limit: list[int | None] = [held]
    master = offloader(hot, tier, Term(1, "a"), upload_limit=lambda: limit[0])
    assert master.offload_queue("orders", 0).watermark == 450
    assert master.offload_queue("orders", 0).segments == 0  # nothing more is replicated
    limit[0] = hot.max_physical_offset
    assert master.offload_queue("orders", 0).watermark == 600
    assert read_tier(tier, "orders", 0) == messages


def test_a_writer_far_behind_cannot_commit_into_a_pruned_slot(tmp_path: Path) -> None:
    tier = open_store(f"file://{tmp_path}/tier")
    log = ManifestLog(tier, PREFIX)
    for version in range(1, KEEP_VERSIONS + 3):
        log.commit(QueueManifest(PREFIX, version, [], 0, epoch=2, writer="b"))
    assert 2 not in log.versions()  # pruned
    with pytest.raises(ManifestFencedError, match="epoch 1 is deposed"):
        log.commit(QueueManifest(PREFIX, 2, [], 0, epoch=1, writer="a"))
    assert 2 not in log.versions()  # the stale put was taken back
    # The same epoch (two writers the epochs cannot tell apart): a plain conflict.
    with pytest.raises(ManifestConflictError) as refused:
        log.commit(QueueManifest(PREFIX, 3, [], 5, epoch=2, writer="c"))
    assert not isinstance(refused.value, ManifestFencedError)
    assert log.load().version == KEEP_VERSIONS + 2


def test_manifests_written_before_epochs_read_as_epoch_zero(tmp_path: Path) -> None:
    tier = open_store(f"file://{tmp_path}/tier")
    inner = json.loads(QueueManifest(PREFIX, 1, [], 7).encode())["manifest"]
    del inner["epoch"], inner["writer"]  # as tmq wrote them before replica groups
    body = json.dumps(inner, sort_keys=True, separators=(",", ":"))
    tier.put_if_absent(
        f"{PREFIX}manifests/{1:020d}.json",
        json.dumps({"manifest": inner, "crc32c": int(crc32c(body.encode()))}).encode(),
    )
    loaded = ManifestLog(tier, PREFIX).load()
    assert (loaded.epoch, loaded.writer, loaded.log_start_offset) == (0, "", 7)


def test_an_archive_keeps_its_id_through_retention_repair_and_a_new_masters_claim(
    hot, tier
) -> None:
    """Decision 1240: the archive id made at a queue's first commit is carried by every later
    version, whoever writes it: uploads, retention (``tmq retain``), ``tmq verify --repair``
    and a new master's claim after a failover. A version rewritten by a broker that predates
    ids keeps none from then on (an archive never gains one back), and the prefix wiped and
    archived again is a new archive with a new id."""
    fill(hot, "orders", 1000, queues=1, seed=5)
    log = ManifestLog(tier, PREFIX)
    old = offloader(hot, tier, Term(1, "a"))
    assert old.offload_queue("orders", 0, up_to=600).watermark == 600
    first = log.load()
    assert re.fullmatch(r"[0-7][0-9a-f]{15}", first.archive), first.archive
    seen = {log.load().version: log.load().archive}

    retained = old.expire("orders", 0, cutoff_ms=0, max_bytes=sum(
        s.size for s in first.segments[1:]))  # fmt: skip
    assert retained.segments == 1 and log.load().start_offset == 200
    seen[log.load().version] = log.load().archive
    tier.put(segment_key(PREFIX, 600), b"an orphan: an upload whose commit never landed")
    repaired = verify_queue(tier, "c1", "broker-a", "orders", 0, lock=old.queue_lock(
        "orders", 0), repair=True)  # fmt: skip
    assert len(repaired.repaired) == 1, repaired
    seen[log.load().version] = log.load().archive

    new = offloader(hot, tier, Term(2, "b"))  # the failover: a new master claims the prefix
    new.claim("orders", 0)
    claimed = log.load()
    assert (claimed.epoch, claimed.version) == (2, max(seen) + 1)
    seen[claimed.version] = claimed.archive
    assert new.offload_queue("orders", 0, up_to=800).watermark == 800
    seen[log.load().version] = log.load().archive
    assert set(seen.values()) == {first.archive}, seen

    # A broker from before ids commits the next version: it writes none, and none comes back.
    stripped = dataclasses.replace(log.load(), version=log.load().version + 1, archive="")
    log.commit(stripped)
    later = offloader(hot, tier, Term(3, "c"))
    assert later.offload_queue("orders", 0).watermark == 1000
    assert log.load().version > stripped.version and log.load().archive == ""

    # The prefix wiped and archived again from 0: another archive, another id.
    for item in tier.list(PREFIX):
        tier.delete(item.key)
    again = offloader(hot, tier, Term(3, "c"))
    assert again.offload_queue("orders", 0, up_to=200).watermark == 200
    assert log.load().archive not in ("", first.archive)
    assert re.fullmatch(r"[0-7][0-9a-f]{15}", log.load().archive)
