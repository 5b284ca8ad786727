"""The mission's path through real processes: produce -> offload -> local release -> read the
archive back, with Apache's client and the CLI, across a kill -9."""

from __future__ import annotations

import json
import time
from collections import Counter
from pathlib import Path

from broker_harness import Standalone, drain, tmq, wait_until
from rocketmq import (
    ClientConfiguration,
    Credentials,
    FilterExpression,
    Message,
    Producer,
    SimpleConsumer,
)


def wait_for(what: str, predicate, seconds: float = 90) -> None:
    wait_until(f"timed out waiting for {what}", predicate, seconds)


def replay_all(node: Standalone, topic: str) -> list[dict]:
    done = tmq("replay", topic, "-n", node.namesrv, "--from-offset", "0", "--json", timeout=300)
    assert done.returncode == 0, done.stderr
    return [json.loads(line) for line in done.stdout.splitlines()]


# Small CommitLog files and an offload pass every second that uploads whatever waits.
QUICK_TIERING = [
    "--commitlog-file-size",
    "128KiB",
    "--offload-interval",
    "1",
    "--upload-after",
    "1s",
]


def test_released_messages_are_read_back_from_the_tier(tmp_path: Path) -> None:
    node = Standalone(tmp_path / "data", extra=QUICK_TIERING).start()
    try:
        done = tmq(
            "topic", "create", "tiered-orders", "-n", node.namesrv, "--queues", "2", "--tiered"
        )
        assert done.returncode == 0, done.stderr
        config = ClientConfiguration(node.endpoint, Credentials(), request_timeout=10)
        producer = Producer(config, topics=["tiered-orders"])
        producer.startup()
        ids = []
        for i in range(1500):
            m = Message()
            m.topic, m.body = "tiered-orders", f"{i:05d}".encode() * 200  # 1 KB
            m.keys = f"order-{i}"
            ids.append(producer.send(m).message_id)
        producer.shutdown()

        commitlog = node.data_dir / "commitlog"
        wait_for("local release", lambda: len(list(commitlog.iterdir())) <= 2)
        assert any((node.data_dir / "tier").rglob("*.seg"))

        consumer = SimpleConsumer(
            config, "g-archive", {"tiered-orders": FilterExpression()}, await_duration=2
        )
        consumer.startup()
        got = [m.message_id for m in drain(consumer, 1500, seconds=120, invisible=60)]
        consumer.shutdown()
        assert Counter(got) == Counter(ids), "every message, served from the archive"

        found = tmq(
            "query", "--topic", "tiered-orders", "--key", "order-7", "-n", node.namesrv, "--json"
        )
        assert found.returncode == 0, found.stderr
        [hit] = [json.loads(line) for line in found.stdout.splitlines()]
        assert hit["keys"] == ["order-7"] and hit["body"] == "00007" * 200, "found in the archive"

        replayed = replay_all(node, "tiered-orders")
        assert sorted(r["body"] for r in replayed) == sorted(f"{i:05d}" * 200 for i in range(1500))

        node.kill9()
        node.start()
        assert len(replay_all(node, "tiered-orders")) == 1500, "the bucket alone is enough"

        node.stop()
        segments = sorted((node.data_dir / "tier").rglob("*.seg"))
        segments[0].unlink()  # an object lost from the bucket while the broker was down
        node.start()
        done = tmq(
            "replay",
            "tiered-orders",
            "-n",
            node.namesrv,
            "--from-offset",
            "0",
            "--queue",
            segments[0].parent.parent.name,
            timeout=120,
        )
        assert done.returncode != 0 and "missing" in done.stderr, "a loud error, not a gap"
    finally:
        node.stop()


def test_retain_sets_shows_and_enforces_ttls(tmp_path: Path) -> None:
    node = Standalone(tmp_path / "data", extra=QUICK_TIERING).start()
    try:
        ns = node.namesrv
        assert (
            tmq("topic", "create", "ttl-topic", "-n", ns, "--queues", "1", "--tiered").returncode
            == 0
        )
        config = ClientConfiguration(node.endpoint, Credentials(), request_timeout=10)
        producer = Producer(config, topics=["ttl-topic"])
        producer.startup()
        for _i in range(400):
            m = Message()
            m.topic, m.body = "ttl-topic", b"x" * 1000
            producer.send(m)
        producer.shutdown()
        tier = node.data_dir / "tier"
        wait_for("offload", lambda: any(tier.rglob("*.seg")))
        segments = set(tier.rglob("*.seg"))

        done = tmq("retain", "ttl-topic", "-n", ns, "--ttl", "2s", "--local", "1s", "--json")
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout)[0] | {"broker": None} == {
            "broker": None,
            "topic": "ttl-topic",
            "tiered": True,
            "ttl_ms": 2000,
            "local_ttl_ms": 1000,
            "max_bytes": 0,
        }
        time.sleep(2.5)
        done = tmq("retain", "--apply", "-n", ns, "--json")
        assert done.returncode == 0, done.stderr
        json.loads(done.stdout)  # the periodic pass may have got there first
        wait_for("expiry", lambda: not (segments & set(tier.rglob("*.seg"))), seconds=30)
        described = json.loads(tmq("topic", "describe", "ttl-topic", "-n", ns, "--json").stdout)
        assert described[0]["queue_offsets"][0]["min_offset"] > 0
        bad = tmq("retain", "ttl-topic", "-n", ns, "--ttl", "soon")
        assert bad.returncode == 2 and bad.stderr.startswith("error: --ttl")
    finally:
        node.stop()


def test_offload_status_and_verify_as_an_operator_runs_them(tmp_path: Path) -> None:
    node = Standalone(tmp_path / "data", extra=["--offload-interval", "3600"]).start()
    try:
        ns = node.namesrv
        assert tmq("topic", "create", "ops", "-n", ns, "--queues", "2", "--tiered").returncode == 0
        assert tmq("topic", "create", "plain", "-n", ns, "--queues", "1").returncode == 0
        config = ClientConfiguration(node.endpoint, Credentials(), request_timeout=10)
        producer = Producer(config, topics=["ops"])
        producer.startup()
        for _ in range(500):
            m = Message()
            m.topic, m.body = "ops", b"y" * 1000
            producer.send(m)
        producer.shutdown()

        def status() -> list[dict]:
            done = tmq("offload", "status", "ops", "-n", ns, "--json")
            assert done.returncode == 0, done.stderr
            return json.loads(done.stdout)

        assert [(r["tier_watermark"], r["max_offset"]) for r in status()] == [(0, 250), (0, 250)]
        partial = json.loads(
            tmq("offload", "ops", "-n", ns, "--keep-local", "50KiB", "--json").stdout
        )
        assert all(0 < r["watermark"] < 250 for r in partial)
        full = json.loads(tmq("offload", "ops", "-n", ns, "--json").stdout)
        assert [r["watermark"] for r in full] == [250, 250]
        done = tmq("offload", "status", "ops", "-n", ns, "--wait", "--json", timeout=30)
        assert done.returncode == 0 and all(
            r["tier_watermark"] == 250 for r in json.loads(done.stdout)
        )
        not_tiered = tmq("offload", "plain", "-n", ns)
        assert not_tiered.returncode == 1 and "not tiered" in not_tiered.stderr

        assert tmq("verify", "ops", "-n", ns).returncode == 0
        segments_dir = next((node.data_dir / "tier").rglob("ops/0/segments"))
        orphan = segments_dir / f"{0:020d}-deadbeef0000.seg"
        orphan.write_bytes(b"left behind by a crash")
        warned = tmq("verify", "ops", "-n", ns, "--json")
        report = json.loads(warned.stdout)
        assert warned.returncode == 1 and report["status"] == "WARNING"
        assert any(k.endswith("deadbeef0000.seg") for q in report["queues"] for k in q["orphans"])
        assert tmq("verify", "ops", "-n", ns, "--repair").returncode == 0
        assert not orphan.exists()

        victim = sorted(segments_dir.iterdir())[0]
        victim.unlink()
        failed = tmq("verify", "-n", ns, "--json")
        report = json.loads(failed.stdout)
        assert failed.returncode == 2 and report["status"] == "FAILURE"
        assert any(victim.name in k for q in report["queues"] for k in q["missing"])
    finally:
        node.stop()
