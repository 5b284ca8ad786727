"""kill -9 of a real broker at each step of the offload pipeline (tiered/failpoints.py), against
LocalStack S3: after a restart nothing is lost or duplicated and every object in the bucket is
one a manifest names."""

from __future__ import annotations

import json
import random
import time
from pathlib import Path
from typing import Any

import pytest
from broker_harness import Standalone, body_bytes, send_batches, start_tiered, tmq, wait_until

from tiered.cold.manifest import ManifestLog, queue_prefix
from tiered.cold.storage import ObjectStore, open_store

TOPIC = "crash-orders"
QUEUES = 2
COUNT = 1200


def produce(node: Standalone) -> list[tuple[bytes, str, str]]:
    assert (
        tmq("topic", "create", TOPIC, "-n", node.namesrv, "-q", str(QUEUES), "--tiered").returncode
        == 0
    )
    rng = random.Random(3)
    sent = [(rng.randbytes(rng.randint(50, 300)), f"k{i}", "t") for i in range(COUNT)]
    send_batches(node.endpoint, TOPIC, sent, batch=100)
    return sent


def replayed_bodies(node: Standalone) -> list[bytes]:
    done = tmq("replay", TOPIC, "-n", node.namesrv, "--from-offset", "0", "--json", timeout=120)
    assert done.returncode == 0, done.stderr
    return [body_bytes(json.loads(line)["body"]) for line in done.stdout.splitlines()]


def manifests(tier: ObjectStore) -> list[Any]:
    return [
        ManifestLog(tier, queue_prefix("DefaultCluster", "broker-a", TOPIC, q)).load()
        for q in range(QUEUES)
    ]


def segment_objects(tier: ObjectStore) -> set[str]:
    return {o.key for o in tier.list(f"DefaultCluster/broker-a/{TOPIC}/") if o.key.endswith(".seg")}


def died_by_sigkill(node: Standalone, seconds: float = 90) -> None:
    assert node.proc is not None
    node.proc.wait(seconds)
    assert node.proc.returncode == -9, node.log_path.read_text()[-2000:]


def verified(node: Standalone) -> None:
    check = tmq("verify", TOPIC, "-n", node.namesrv, "--json")
    assert check.returncode == 0 and json.loads(check.stdout)["status"] == "OK"


def released_and_whole(
    node: Standalone,
    tier: ObjectStore,
    commitlog: Path,
    sent: list[tuple[bytes, str, str]],
    why: str,
) -> None:
    """The restarted ``node`` releases the first CommitLog file (``why``: what that shows),
    and then every message sent replays, every object is one a manifest names and ``tmq
    verify`` finds the topic OK."""
    wait_until(why, lambda: not (commitlog / f"{0:020d}").exists(), 90)
    assert sorted(replayed_bodies(node)) == sorted(b for b, _, _ in sent)
    named = {s.key for m in manifests(tier) for s in m.segments}
    assert segment_objects(tier) == named
    verified(node)


@pytest.fixture
def tier_env(s3: Any, bucket: str) -> tuple[str, dict[str, str], ObjectStore]:
    url = f"s3://{bucket}/crash"
    return url, s3.env(), open_store(url, s3.storage_options())


def test_kill9_between_object_write_and_manifest_commit(tmp_path: Path, tier_env) -> None:
    url, env, tier = tier_env
    node = start_tiered(tmp_path / "data", url, {**env, "TMQ_FAILPOINTS": "offload.before_commit"})
    sent = produce(node)
    died_by_sigkill(node)
    written = segment_objects(tier)
    assert written, "the failpoint fires after an object is written"
    assert all(m.end_offset == 0 for m in manifests(tier)), "and before its manifest is committed"

    node = start_tiered(tmp_path / "data", url, env)
    try:
        wait_until(
            "the restarted broker uploads everything",
            lambda: not any(m.end_offset < COUNT // QUEUES for m in manifests(tier)),
            90,
        )
        named = {s.key for m in manifests(tier) for s in m.segments}
        assert not written & named, "the interrupted upload is not reused..."
        wait_until(
            "...and swept: no object left unaccounted",
            lambda: segment_objects(tier) == named,
            30,
        )
        assert sorted(replayed_bodies(node)) == sorted(b for b, _, _ in sent), (
            "nothing lost, nothing duplicated"
        )
        verified(node)
    finally:
        node.stop()


def test_kill9_between_manifest_commit_and_local_release(tmp_path: Path, tier_env) -> None:
    url, env, tier = tier_env
    node = start_tiered(tmp_path / "data", url, {**env, "TMQ_FAILPOINTS": "offload.before_release"})
    sent = produce(node)
    died_by_sigkill(node)
    commitlog = tmp_path / "data" / "commitlog"
    files_at_crash = sorted(commitlog.iterdir())
    assert sum(m.end_offset for m in manifests(tier)) > 0, "a manifest was committed"
    assert files_at_crash[0].name == f"{0:020d}", "nothing was released"

    node = start_tiered(tmp_path / "data", url, env)
    try:
        released_and_whole(
            node, tier, commitlog, sent, "the restarted broker releases what is uploaded"
        )
    finally:
        node.stop()


def test_kill9_between_routing_readers_and_deleting_files(tmp_path: Path, tier_env) -> None:
    """Release's two steps (queue minimums moved past the files, then the files deleted): a
    kill -9 between them leaves files the restarted broker still holds and releases again, and
    every message readable from one tier or the other."""
    url, env, tier = tier_env
    node = start_tiered(tmp_path / "data", url, {**env, "TMQ_FAILPOINTS": "release.mid_switch"})
    sent = produce(node)
    died_by_sigkill(node)
    commitlog = tmp_path / "data" / "commitlog"
    assert (commitlog / f"{0:020d}").exists(), "the kill came before the files were deleted"
    assert "failpoint release.mid_switch" in node.log_path.read_text()

    node = start_tiered(tmp_path / "data", url, env)
    try:
        released_and_whole(node, tier, commitlog, sent, "the restarted broker releases them again")
    finally:
        node.stop()


def test_kill9_between_retention_commit_and_object_deletes(tmp_path: Path, tier_env) -> None:
    url, env, tier = tier_env
    node = start_tiered(tmp_path / "data", url, env)
    produce(node)
    assert tmq("offload", TOPIC, "-n", node.namesrv).returncode == 0
    before = manifests(tier)
    node.stop()
    node = start_tiered(
        tmp_path / "data", url, {**env, "TMQ_FAILPOINTS": "retention.before_delete"}
    )
    time.sleep(0.01)
    assert tmq("retain", TOPIC, "-n", node.namesrv, "--ttl", "1ms").returncode == 0
    tmq("retain", "--apply", "-n", node.namesrv)  # the broker dies answering it
    died_by_sigkill(node)
    after = manifests(tier)
    assert sum(len(m.segments) for m in after) < sum(len(m.segments) for m in before)
    expired = {s.key for m in before for s in m.segments} - {
        s.key for m in after for s in m.segments
    }
    assert expired <= segment_objects(tier), "their objects outlived the crash"

    node = start_tiered(tmp_path / "data", url, env)
    try:
        assert tmq("offload", "status", TOPIC, "-n", node.namesrv).returncode == 0
        wait_until(
            "the restarted broker deletes what expired",
            lambda: not expired & segment_objects(tier),
            30,
        )
    finally:
        node.stop()
