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

from broker_harness import Standalone, body_bytes, send_batches, tmq

from tiered.cold.manifest import ManifestLog, queue_prefix
from tiered.cold.storage import ObjectStore, open_store

TOPIC = "owned-orders"


def start(data: Path, tier_url: str, env: dict[str, str]) -> Standalone:
    return Standalone(
        data,
        extra=[
            "--commitlog-file-size",
            "64KiB",
            "--offload-interval",
            "1",
            "--upload-after",
            "1s",
            "--tier-url",
            tier_url,
        ],
        env=env,
    ).start()


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


def test_a_wiped_data_dir_never_releases_its_messages_as_archived(
    tmp_path: Path, s3: Any, bucket: str
) -> None:
    url, env = f"s3://{bucket}/owner", s3.env()
    tier = open_store(url, s3.storage_options())
    first = start(tmp_path / "disk1", url, env)
    try:
        old = produce(first, "old", 240)
        assert tmq("offload", TOPIC, "-n", first.namesrv).returncode == 0
    finally:
        first.stop()
    archived = manifest(tier)
    assert archived.end_offset == len(old)

    # The disk is replaced: same broker name, same bucket, an empty data directory.
    second = start(tmp_path / "disk2", url, env)
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
    first = start(tmp_path / "disk1", url, env)
    try:
        produce(first, "old", 60)
        assert tmq("offload", TOPIC, "-n", first.namesrv).returncode == 0
    finally:
        first.stop()
    archived = manifest(tier)
    # The first broker's next upload, written and not committed yet (a copy of a segment).
    in_flight = f"{archived.prefix}segments/{archived.end_offset:020d}-0123456789ab.seg"
    assert tier.put_if_absent(in_flight, tier.get(archived.segments[0].key))

    second = start(tmp_path / "disk2", url, env)
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
