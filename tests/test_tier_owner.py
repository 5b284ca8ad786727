"""A tier prefix that another data directory wrote: a broker started on a wiped (replaced,
ephemeral) disk, or a second broker given the same name, against the same bucket. Its queues
restart at offset 0 while the prefix's archive already holds other messages at those offsets.
It must neither release its own messages as "uploaded" (the archive holds others there) nor
serve the old messages in their place; real brokers, LocalStack S3, decision 690."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
from broker_harness import Standalone, body_bytes, send_batches, start_tiered, tmq

from offload.leadership import Term
from offload.offloader import FencedError, ForeignPrefixError, Offloader
from tiered.cold.manifest import ManifestLog, QueueManifest, queue_prefix
from tiered.cold.storage import ObjectStore, open_store
from tiered.config import StoreConfig
from tiered.record import Message
from tiered.store import MessageStore, store_identity

TOPIC = "owned-orders"


def produce(node: Standalone, tag: str, count: int) -> list[bytes]:
    created = tmq("topic", "create", TOPIC, "-n", node.namesrv, "-q", "1", "--tiered")
    assert created.returncode == 0, created.stderr
    sent = [(f"{tag}-{i:05d}-".encode() + b"x" * 1000, f"k{i}", "t") for i in range(count)]
    send_batches(node.endpoint, TOPIC, sent, batch=50)
    return [b for b, _, _ in sent]


def replayed(node: Standalone) -> list[bytes]:
    done = tmq("replay", TOPIC, "-n", node.namesrv, "--from-offset", "0", "--json", timeout=120)
    assert done.returncode == 0, done.stderr
    return [body_bytes(json.loads(line)["body"]) for line in done.stdout.splitlines()]


def manifest(tier: ObjectStore) -> Any:
    return ManifestLog(tier, queue_prefix("DefaultCluster", "broker-a", TOPIC, 0)).load()


def uploaded(node: Standalone, tier: ObjectStore, count: int) -> Any:
    """The manifest once ``count`` messages are archived (``tmq offload`` uploads what is
    dispatched when it asks; the periodic pass, every second, the rest)."""
    assert tmq("offload", TOPIC, "-n", node.namesrv).returncode == 0
    deadline = time.monotonic() + 60
    while (archived := manifest(tier)).end_offset < count:
        assert time.monotonic() < deadline, f"{archived.end_offset} of {count} archived"
        time.sleep(0.5)
    assert archived.end_offset == count
    return archived


def test_a_wiped_data_dir_never_releases_its_messages_as_archived(
    tmp_path: Path, s3: Any, bucket: str
) -> None:
    url, env = f"s3://{bucket}/owner", s3.env()
    tier = open_store(url, s3.storage_options())
    first = start_tiered(tmp_path / "disk1", url, env)
    try:
        old = produce(first, "old", 240)
        archived = uploaded(first, tier, len(old))
    finally:
        first.stop()

    # The disk is replaced: same broker name, same bucket, an empty data directory.
    second = start_tiered(tmp_path / "disk2", url, env)
    try:
        new = produce(second, "new", 120)  # over one 64 KiB CommitLog file
        commitlog = tmp_path / "disk2" / "commitlog"
        # Offload passes run every second: give release a few of them.
        deadline = time.monotonic() + 8
        while time.monotonic() < deadline and (commitlog / f"{0:020d}").exists():
            time.sleep(0.5)
        assert (commitlog / f"{0:020d}").exists(), (
            "the new messages were released as if the old archive held them"
        )
        assert replayed(second) == new, "every new message, and none of the old ones"
        # Nor by key (decision 751): the old archive's k5 and k200 are another log's offsets
        # 5 and 200 (this queue's offset 5 holds new[5]; it has no offset 200).
        for key, want in (("k5", [new[5]]), ("k200", [])):
            found = tmq("query", "-t", TOPIC, "-k", key, "-n", second.namesrv, "--json")
            assert found.returncode == 0, found.stderr
            bodies = [body_bytes(json.loads(line)["body"]) for line in found.stdout.splitlines()]
            assert bodies == want, key
        status = tmq("offload", "status", TOPIC, "-n", second.namesrv, "--json")
        assert status.returncode == 0, status.stderr
        assert [r["tier_watermark"] for r in json.loads(status.stdout)] == [0], (
            "status says nothing of this broker's is archived, not the old archive's end"
        )
        check = tmq("verify", TOPIC, "-n", second.namesrv, "--json")
        assert check.returncode == 1, "not OK: none of this broker's messages is archived"
        (queue,) = json.loads(check.stdout)["queues"]
        assert queue["status"] == "WARNING"
        assert any("another data directory" in a for a in queue["anomalies"])
        log = second.log_path.read_text()
        assert "another data directory" in log, "the refusal is said, not silent"
        after = manifest(tier)
        assert [s.key for s in after.segments] == [s.key for s in archived.segments], (
            "the old archive is left as it was"
        )
    finally:
        second.stop()


def test_a_second_broker_of_the_same_name_deletes_nothing_of_the_first(
    tmp_path: Path, s3: Any, bucket: str
) -> None:
    """What looks orphaned to a broker that does not own the prefix may be its writer's upload
    in flight: neither the claim's sweep nor ``verify --repair`` of the second broker deletes
    it."""
    url, env = f"s3://{bucket}/owner", s3.env()
    tier = open_store(url, s3.storage_options())
    first = start_tiered(tmp_path / "disk1", url, env)
    try:
        produce(first, "old", 60)
        archived = uploaded(first, tier, 60)
    finally:
        first.stop()
    # The first broker's next upload, written and not committed yet (a copy of a segment).
    in_flight = f"{archived.prefix}segments/{archived.end_offset:020d}-0123456789ab.seg"
    assert tier.put_if_absent(in_flight, tier.get(archived.segments[0].key))

    second = start_tiered(tmp_path / "disk2", url, env)
    try:
        produce(second, "new", 10)
        time.sleep(3)  # offload passes: the claim (and, on main, its orphan sweep) runs
        assert tier.size(in_flight) is not None, "the claim's sweep deleted another's upload"
        check = tmq("verify", TOPIC, "-n", second.namesrv, "--repair", "--json")
        assert check.returncode == 1, check.stdout + check.stderr
        report = json.loads(check.stdout)
        assert report["status"] == "WARNING"
        (queue,) = report["queues"]
        assert queue["repaired"] == [] and queue["orphans"] == [in_flight]
        assert any("another data directory" in a for a in queue["anomalies"])
        assert tier.size(in_flight) is not None, "verify --repair deleted another's upload"
    finally:
        second.stop()


def test_two_brokers_of_one_name_on_an_empty_prefix_delete_nothing_of_each_other(
    tmp_path: Path, s3: Any, bucket: str
) -> None:
    """Decision 752: before any manifest exists, decision 690's check cannot tell a second
    broker of this name that the prefix is not its own, and its claim's orphan sweep deleted
    the first broker's upload written but not committed yet. The first claim now stamps the
    empty prefix with its data directory before it uploads anything."""
    url, env = f"s3://{bucket}/owner-empty", s3.env()
    tier = open_store(url, s3.storage_options())
    first = start_tiered(tmp_path / "disk1", url, env)
    second = None
    try:
        created = tmq("topic", "create", TOPIC, "-n", first.namesrv, "-q", "1", "--tiered")
        assert created.returncode == 0, created.stderr
        # Offload passes (every second): the first broker claims the (empty) queue. Waited for
        # up to 10 s, not asserted: on main a claim leaves an empty prefix as it is.
        prefix = queue_prefix("DefaultCluster", "broker-a", TOPIC, 0)
        deadline = time.monotonic() + 10
        while ManifestLog(tier, prefix).load().version == 0 and time.monotonic() < deadline:
            time.sleep(0.3)
        # Its first upload, written and not committed yet.
        in_flight = f"{prefix}segments/{0:020d}-0123456789ab.seg"
        assert tier.put_if_absent(in_flight, b"a segment being uploaded")
        second = start_tiered(tmp_path / "disk2", url, env)
        produce(second, "new", 10)
        time.sleep(3)  # the second broker's passes: its claim (and, on main, its sweep) runs
        assert tier.size(in_flight) is not None, "the second broker swept the first's upload"
        assert "another data directory" in second.log_path.read_text()
    finally:
        if second is not None:
            second.stop()
        first.stop()


def _store(path: Path) -> MessageStore:
    store = MessageStore(StoreConfig(data_dir=path, commitlog_file_size=64 << 10))
    store.start()
    for i in range(20):
        store.put_message(Message(topic="t", queue_id=0, body=b"m%03d" % i))
    assert store.wait_dispatched()
    return store


def test_who_owns_a_prefix_in_which_epoch(tmp_path: Path) -> None:
    """Decision 690's rule in process, on file://: the same epoch from another directory is
    refused (upload and release); a higher epoch (a replica group's new master) takes the prefix
    over and fences the old one; a manifest committed before the rule (no ``store``) is adopted.
    """
    tier = open_store(f"file://{tmp_path}/tier")
    a, b = _store(tmp_path / "a"), _store(tmp_path / "b")
    assert a.store_id != b.store_id
    assert store_identity(tmp_path / "a") == a.store_id, "the identity stays with the directory"
    offloaders: list[Offloader] = []

    def offloader(store: MessageStore, epoch: int, who: str) -> Offloader:
        o = Offloader(store, tier, "c", "broker-a", leadership=lambda: Term(epoch, who))
        offloaders.append(o)
        return o

    try:
        first = offloader(a, 1, "a")
        assert first.offload_queue("t", 0).watermark == 20
        assert first.manifest("t", 0).store == a.store_id

        second = offloader(b, 1, "b")  # same epoch, another directory
        with pytest.raises(ForeignPrefixError, match="another data directory"):
            second.offload_queue("t", 0)
        with pytest.raises(ForeignPrefixError):
            second.release_watermark("t", 0)
        lag = second.upload_lag("t", 0, 0)
        assert lag is not None and lag.messages == 20 and lag.archived_bytes == 0

        promoted = offloader(b, 2, "b")  # a new master of the replica group
        promoted.claim("t", 0)
        assert promoted.manifest("t", 0).store == b.store_id
        assert promoted.release_watermark("t", 0) == 20
        with pytest.raises(FencedError):
            offloader(a, 1, "a").offload_queue("t", 0)

        # Committed before the rule: no ``store``; its writer's successor adopts it.
        legacy = ManifestLog(tier, queue_prefix("c", "broker-a", "t", 1))
        legacy.commit(QueueManifest(legacy.prefix, 1, [], 0, epoch=2, writer="old"))
        raw = tier.get(f"{legacy.prefix}manifests/{1:020d}.json")
        assert "store" not in json.loads(raw)["manifest"], "encoded as before the rule"
        assert promoted.release_watermark("t", 1) == 0
        promoted.claim("t", 1)
    finally:
        for o in offloaders:
            o.close()
        a.shutdown()
        b.shutdown()
