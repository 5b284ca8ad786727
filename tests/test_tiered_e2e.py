"""The mission's path through real processes: produce -> offload -> local release -> read the
archive back, with Apache's client and the CLI, across a kill -9."""

from __future__ import annotations

import json
import time
from collections import Counter
from pathlib import Path

from broker_harness import Standalone, tmq
from rocketmq import (
    ClientConfiguration,
    Credentials,
    FilterExpression,
    Message,
    Producer,
    SimpleConsumer,
)


def wait_for(what: str, predicate, seconds: float = 90) -> None:
    deadline = time.monotonic() + seconds
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.5)


def replay_all(node: Standalone, topic: str) -> list[dict]:
    done = tmq("replay", topic, "-n", node.namesrv, "--from-offset", "0", "--json", timeout=300)
    assert done.returncode == 0, done.stderr
    return [json.loads(line) for line in done.stdout.splitlines()]


def test_released_messages_are_read_back_from_the_tier(tmp_path: Path) -> None:
    node = Standalone(
        tmp_path / "data", extra=["--commitlog-file-size", "128KiB", "--offload-interval", "1"]
    ).start()
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
        got = []
        deadline = time.monotonic() + 120
        while len(got) < 1500 and time.monotonic() < deadline:
            for m in consumer.receive(32, 60):
                got.append(m.message_id)
                consumer.ack(m)
        consumer.shutdown()
        assert Counter(got) == Counter(ids), "every message, served from the archive"

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
