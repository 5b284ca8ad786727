"""Two NameServers and two brokers, each its own process, as in a small production cluster."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
from broker_harness import REPO, drain, free_port, tmq, wait_healthy
from rocketmq import (
    ClientConfiguration,
    Credentials,
    FilterExpression,
    Message,
    Producer,
    SimpleConsumer,
)

from remoting.namesrv_client import NameServerClient


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[dict[str, object]]:
    procs: list[subprocess.Popen[str]] = []

    def spawn(name: str, args: list[str]) -> tuple[subprocess.Popen[str], Path]:
        # A log file, not a pipe: nobody drains a pipe, and a full one blocks the server
        # (and its shutdown: a NameServer that filled its stderr pipe never exited).
        log = tmp_path / f"{name}.log"
        p = subprocess.Popen(
            [sys.executable, "-m", "cli.app", *args],
            cwd=REPO,
            stdout=subprocess.DEVNULL,
            stderr=log.open("ab"),
        )
        procs.append(p)
        return p, log

    namesrvs = []
    for i in range(2):
        port = free_port()
        p, log = spawn(
            f"namesrv-{i}",
            ["namesrv", "start", "--host", "127.0.0.1", "--port", str(port), "--expiry-ms", "3000"],
        )
        wait_healthy(p, f"127.0.0.1:{port}", log, "NameServer")
        namesrvs.append(f"127.0.0.1:{port}")
    brokers = {}
    for name in ("broker-a", "broker-b"):
        port = free_port()
        cfg = tmp_path / f"{name}.toml"
        cfg.write_text(f"""
[broker]
name = "{name}"
listen = "127.0.0.1"
port = {port}
advertise_host = "127.0.0.1"
namesrv = "{";".join(namesrvs)}"
heartbeat_interval_ms = 500
metrics_port = 0

[store]
data_dir = "{tmp_path / name}"
commitlog_file_size = "64MiB"
""")
        p, log = spawn(name, ["broker", "start", "--config", str(cfg)])
        wait_healthy(p, f"127.0.0.1:{port}", log, name)
        brokers[name] = (p, f"127.0.0.1:{port}")
    yield {"namesrvs": namesrvs, "brokers": brokers}
    for p in procs:
        p.terminate()
    for p in procs:
        try:
            p.wait(30)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(10)
            raise AssertionError(f"{p.args} ignored SIGTERM for 30 s") from None


def test_a_topic_spread_over_two_brokers_is_routed_and_consumed(cluster) -> None:
    namesrvs = ";".join(cluster["namesrvs"])
    done = tmq("topic", "create", "spread", "-n", namesrvs, "--queues", "2")
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("created topic spread") == 2
    deadline = time.monotonic() + 10
    while True:  # each broker registers its new topic with both NameServers
        routes = [NameServerClient([a]).route("spread") for a in cluster["namesrvs"]]
        if (
            all(r is not None and len(r.brokers) == 2 for r in routes)
            or time.monotonic() > deadline
        ):
            break
        time.sleep(0.2)
    assert all(
        r is not None and {b.broker_name for b in r.brokers} == {"broker-a", "broker-b"}
        for r in routes
    )

    access = cluster["brokers"]["broker-a"][1]
    config = ClientConfiguration(access, Credentials(), request_timeout=10)
    producer = Producer(config, topics=["spread"])
    producer.startup()
    ids = []
    for i in range(100):
        m = Message()
        m.topic, m.body = "spread", f"m{i}".encode()
        ids.append(producer.send(m).message_id)
    producer.shutdown()

    described = json.loads(tmq("topic", "describe", "spread", "-n", namesrvs, "--json").stdout)
    per_broker = {r["broker"]: sum(q["max_offset"] for q in r["queue_offsets"]) for r in described}
    assert per_broker["broker-a"] > 0 and per_broker["broker-b"] > 0
    assert sum(per_broker.values()) == 100

    consumer = SimpleConsumer(config, "g-spread", {"spread": FilterExpression()}, await_duration=1)
    consumer.startup()
    got = [m.message_id for m in drain(consumer, 100, seconds=60, invisible=30)]
    consumer.shutdown()
    assert Counter(got) == Counter(ids)


def test_a_dead_broker_leaves_the_routes_after_expiry(cluster) -> None:
    namesrvs = ";".join(cluster["namesrvs"])
    assert tmq("topic", "create", "failover", "-n", namesrvs).returncode == 0
    proc, _ = cluster["brokers"]["broker-b"]
    time.sleep(1.5)
    client = NameServerClient(cluster["namesrvs"])
    route = client.route("failover")
    assert route is not None and len(route.brokers) == 2
    proc.kill()  # no unregistration: the NameServers must notice the silence
    proc.wait()
    time.sleep(4.5)
    for address in cluster["namesrvs"]:
        route = NameServerClient([address]).route("failover")
        assert route is not None and [b.broker_name for b in route.brokers] == ["broker-a"]
