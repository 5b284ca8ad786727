"""The torture run (bench/torture.py) as tests: producers with Apache's client, replays from
offset 0, a consumer group, the offloader with tiny segments, a TTL, ``verify --repair`` in a
loop, broker kill -9 and object-store faults from the fault proxy, all at once, against a real
broker and LocalStack. Afterwards nothing acknowledged is lost, duplicated or seen with a gap."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from broker_harness import Standalone, tmq
from rocketmq import (
    ClientConfiguration,
    Credentials,
    FilterExpression,
    Message,
    Producer,
    SimpleConsumer,
)

REPO = Path(__file__).resolve().parent.parent


def torture(tmp_path: Path, s3: Any, *args: str, timeout: float) -> dict[str, Any]:
    if s3.kind != "localstack":
        pytest.skip("the torture run needs LocalStack")
    done = subprocess.run(
        [
            sys.executable,
            str(REPO / "bench" / "torture.py"),
            "--data",
            str(tmp_path),
            "--keep",
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
    )
    lines = done.stdout.strip().splitlines()
    assert lines, done.stderr[-3000:]
    result: dict[str, Any] = json.loads(lines[-1])
    assert done.returncode == 0, json.dumps(result, indent=1)
    return result


def assert_clean(result: dict[str, Any]) -> None:
    for key in (
        "lost",
        "duplicated",
        "gaps_seen_by_readers",
        "early_ends",
        "wrong_bodies_seen_by_readers",
        "read_twice_in_a_pass",
        "refused_in_range",
        "group_missing",
    ):
        assert result[key] == 0, (key, result)
    assert result["final_read_problems"] == [] and result["harness_errors"] == []
    assert result["verify"] == "OK"
    assert result["reader_passes"] > 0 and result["reader_messages"] > 0


def test_a_short_torture_run_loses_nothing_acknowledged(tmp_path: Path, s3: Any) -> None:
    """About a minute: one kill -9 and a few faults while everything else runs."""
    result = torture(
        tmp_path,
        s3,
        *("--seconds", "25", "--ttl", "600", "--kill-min", "10", "--kill-max", "14"),
        *("--fault-min", "3", "--fault-max", "6"),
        timeout=400,
    )
    assert_clean(result)
    assert result["kills"] >= 1 and sum(result["faults"].values()) >= 1
    assert result["acknowledged"] > 500


@pytest.mark.slow
def test_three_minutes_of_torture_with_expiry_lose_nothing_acknowledged(
    tmp_path: Path, s3: Any
) -> None:
    """Three minutes with a TTL that expires the oldest part of the topic while it runs."""
    result = torture(
        tmp_path,
        s3,
        *("--seconds", "180", "--ttl", "60", "--kill-min", "20", "--kill-max", "40"),
        timeout=900,
    )
    assert_clean(result)
    assert result["kills"] >= 3 and sum(result["faults"].values()) >= 5
    assert result["expired_by_ttl"] > 0, "retention removed the oldest part"


# -- what the torture run found ----------------------------------------------------------------


def tiered_queue_behind_proxy(
    tmp_path: Path, s3: Any, bucket: str, proxy: Any, topic: str
) -> Standalone:
    """A broker with one tiered queue ``topic`` on S3 through ``proxy``, offloading every
    second."""
    node = Standalone(
        tmp_path / "data",
        extra=[
            *("--commitlog-file-size", "64KiB", "--offload-interval", "1"),
            *("--upload-after", "1s", "--tier-url", f"s3://{bucket}/t"),
        ],
        env={**s3.env(), "AWS_ENDPOINT_URL": proxy.url},
    ).start()
    done = tmq("topic", "create", topic, "-n", node.namesrv, "-q", "1", "--tiered")
    assert done.returncode == 0, done.stderr
    return node


def produce(node: Standalone, topic: str, count: int) -> list[str]:
    producer = Producer(ClientConfiguration(node.endpoint, Credentials()), topics=[topic])
    producer.startup()
    ids = []
    for i in range(count):
        m = Message()
        m.topic, m.body = topic, f"{i:06d}".encode() * 170  # ~1 KB
        ids.append(producer.send(m).message_id)
    producer.shutdown()
    return ids


def receive(node: Standalone, group: str, topic: str, count: int, seconds: float) -> list[str]:
    """Receive and ack up to ``count`` messages within ``seconds``."""
    config = ClientConfiguration(node.endpoint, Credentials(), request_timeout=10)
    consumer = SimpleConsumer(config, group, {topic: FilterExpression()}, await_duration=2)
    consumer.startup()
    got: list[str] = []
    deadline = time.monotonic() + seconds
    while len(got) < count and time.monotonic() < deadline:
        try:
            received = consumer.receive(min(32, count - len(got)), 60)
        except Exception:  # the broker's answer while the tier does not (PROXY_TIMEOUT)
            time.sleep(0.5)
            continue
        for m in received:
            got.append(m.message_id)
            consumer.ack(m)
    consumer.shutdown()
    return got


def test_consumer_offsets_are_saved_while_an_offload_pass_hangs_on_the_tier(
    tmp_path: Path, s3: Any, bucket: str, fault_proxy: Any
) -> None:
    """The offload pass and the consumer-offset flush shared one thread: with the object store
    black-holed the pass hung for minutes, no offset was saved, and a kill -9 rewound the group
    to where it was before (everything redelivered)."""
    node = tiered_queue_behind_proxy(tmp_path, s3, bucket, fault_proxy, "hang")
    try:
        ids = produce(node, "hang", 40)
        fault_proxy.set(blackhole=True)  # the next offload pass waits on the tier
        time.sleep(3)
        assert sorted(receive(node, "g-hang", "hang", 40, 60)) == sorted(ids)
        time.sleep(7)  # offsets are saved every 5 s
        node.kill9()
        fault_proxy.heal()
        node.start()
        again = receive(node, "g-hang", "hang", 40, 8)
        assert again == [], f"{len(again)} acknowledged messages delivered again after kill -9"
    finally:
        node.stop()


def test_a_restarted_broker_delivers_archived_messages_a_lagging_group_has_not_received(
    tmp_path: Path, s3: Any, bucket: str, fault_proxy: Any
) -> None:
    """After a restart the tier's start is unknown until its manifest is loaded, so the first
    readable offset looked like the hot store's; the pop path took that for retention and
    skipped every archived message the group had not received yet."""
    node = tiered_queue_behind_proxy(tmp_path, s3, bucket, fault_proxy, "lag")
    try:
        ids = produce(node, "lag", 400)
        first = receive(node, "g-lag", "lag", 50, 60)
        assert len(first) == 50
        deadline = time.monotonic() + 90
        while True:  # released locally: the group's position is only in the tier now
            done = tmq("offload", "status", "lag", "-n", node.namesrv, "--json")
            [row] = json.loads(done.stdout)
            if row["hot_min_offset"] > 100:
                break
            assert time.monotonic() < deadline, row
            time.sleep(1)
        node.stop()
        fault_proxy.set(blackhole=True, methods=["GET"])  # the manifest is slow to come back
        # Healed while the broker starts: start-up waits for the tier (its probe, then the
        # manifests, up to 10 s); a heal timed from after start would never come.
        threading.Timer(8, fault_proxy.heal).start()
        node.start()
        rest = receive(node, "g-lag", "lag", 350, 90)
        assert sorted(set(first + rest)) == sorted(ids), f"{400 - len(set(first + rest))} skipped"
    finally:
        node.stop()
