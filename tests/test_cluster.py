"""Two NameServers and two brokers, each its own process, as in a small production cluster."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
from broker_harness import (
    REPO,
    drain,
    free_port,
    send_batches,
    tmq,
    wait_healthy,
    wait_until,
)
from rocketmq import (
    ClientConfiguration,
    Credentials,
    FilterExpression,
    Message,
    Producer,
    SimpleConsumer,
)

from remoting.namesrv_client import NameServerClient


def _spawn(
    tmp_path: Path, name: str, args: list[str], env: dict[str, str] | None = None
) -> tuple[subprocess.Popen[str], Path]:
    """``tmq ARGS`` as its own process (``env`` added to its environment), its stderr in
    ``NAME.log``: the process and the log."""
    # A log file, not a pipe: nobody drains a pipe, and a full one blocks the server
    # (and its shutdown: a NameServer that filled its stderr pipe never exited).
    log = tmp_path / f"{name}.log"
    p = subprocess.Popen(
        [sys.executable, "-m", "cli.app", *args],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=log.open("ab"),
        env={**os.environ, **(env or {})},
    )
    return p, log


def _broker_config(tmp_path: Path, name: str, namesrv: str, extra: str = "") -> tuple[Path, int]:
    """A cluster broker's config (its store in ``tmp_path/NAME``, ``extra`` lines added to its
    ``[broker]`` table) and the free port it listens on."""
    port = free_port()
    cfg = tmp_path / f"{name}.toml"
    cfg.write_text(f"""
[broker]
name = "{name}"
listen = "127.0.0.1"
port = {port}
advertise_host = "127.0.0.1"
namesrv = "{namesrv}"
heartbeat_interval_ms = 500
metrics_port = 0
{extra}
[store]
data_dir = "{tmp_path / name}"
commitlog_file_size = "64MiB"
""")
    return cfg, port


def _stop(procs: list[subprocess.Popen[str]], strict: bool = True) -> None:
    """SIGTERM to every process, then wait for each; one that ignores it for 30 s is killed and,
    when ``strict``, fails the test (not in a ``finally``: it would hide the test's own error)."""
    for p in procs:
        p.terminate()
    for p in procs:
        try:
            p.wait(30)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(10)
            if strict:
                raise AssertionError(f"{p.args} ignored SIGTERM for 30 s") from None


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[dict[str, object]]:
    procs: list[subprocess.Popen[str]] = []

    def spawn(name: str, args: list[str]) -> tuple[subprocess.Popen[str], Path]:
        p, log = _spawn(tmp_path, name, args)
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
        cfg, port = _broker_config(tmp_path, name, ";".join(namesrvs))
        p, log = spawn(name, ["broker", "start", "--config", str(cfg)])
        wait_healthy(p, f"127.0.0.1:{port}", log, name)
        brokers[name] = (p, f"127.0.0.1:{port}")
    yield {"namesrvs": namesrvs, "brokers": brokers}
    _stop(procs)


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


def test_a_heartbeat_under_way_at_shutdown_does_not_list_the_stopped_broker_again(
    tmp_path: Path,
) -> None:
    """A broker stopped while its registration loop is sending a heartbeat: stop() unregisters,
    and the heartbeat must not reach the NameServer after that. It did (decision 1260): the
    NameServer listed the stopped broker again and routed clients to its closed port until
    the expiry, 120 s. The failpoint holds a heartbeat between its build and its send, the
    window a slow NameServer (3 s a call) or a broker of many topics opens on its own."""
    port = free_port()
    address = f"127.0.0.1:{port}"
    namesrv, namesrv_log = _spawn(
        tmp_path, "namesrv", ["namesrv", "start", "--host", "127.0.0.1", "--port", str(port)]
    )
    procs = [namesrv]
    client = NameServerClient([address])
    try:
        wait_healthy(namesrv, address, namesrv_log, "NameServer")
        cfg, broker_port = _broker_config(tmp_path, "broker-a", address)
        pausing = "failpoint register.before_send: pausing"
        broker, log = _spawn(
            tmp_path,
            "broker-a",
            ["broker", "start", "--config", str(cfg)],
            env={"TMQ_FAILPOINTS": "register.before_send=sleep:1.5"},
        )
        procs.append(broker)
        wait_healthy(broker, f"127.0.0.1:{broker_port}", log, "broker-a")

        def listed() -> list[str]:
            return [b.broker.broker_name for b in client.cluster_info().brokers]

        wait_until("the broker is registered", lambda: listed() == ["broker-a"], seconds=10)
        heard = log.read_text().count(pausing)
        wait_until(
            "a heartbeat is under way",
            lambda: log.read_text().count(pausing) > heard,
            seconds=10,
            every=0.02,
        )
        broker.terminate()
        broker.wait(30)
        assert listed() == []
        time.sleep(0.5)  # nothing left to send: the NameServer stays without it
        assert listed() == []
    finally:
        client.close()
        _stop(procs, strict=False)


def _tiered_broker(
    tmp_path: Path, name: str, namesrv: str
) -> tuple[subprocess.Popen[str], Path, str]:
    """A broker of the cluster with its own cold tier (a file:// one), offloading every second:
    its process, data directory and endpoint."""
    tier = f"file://{tmp_path / ('tier-' + name)}"
    extra = f'tier_url = "{tier}"\noffload_interval_ms = 1000\n'
    cfg, port = _broker_config(tmp_path, name, namesrv, extra)
    p, log = _spawn(tmp_path, name, ["broker", "start", "--config", str(cfg)])
    wait_healthy(p, f"127.0.0.1:{port}", log, name)
    return p, tmp_path / name, f"127.0.0.1:{port}"


def test_offload_resolve_resolves_the_broker_that_diverged_beside_one_that_did_not(
    tmp_path: Path,
) -> None:
    """A topic on two brokers of a cluster, each tiered to its own archive, and one of them
    diverged from it (decision 800; its record as the broker keeps it). `tmq offload resolve`
    must resolve that broker's queue whatever order the brokers are listed in: on main it
    stopped at the first broker without a conflict ("no queue ... on broker-a has a conflict",
    exit 1) and never asked the one that had it."""
    procs: list[subprocess.Popen[str]] = []
    try:
        port = free_port()
        ns, log = _spawn(
            tmp_path, "namesrv", ["namesrv", "start", "--host", "127.0.0.1", "--port", str(port)]
        )
        procs.append(ns)
        namesrv = f"127.0.0.1:{port}"
        wait_healthy(ns, namesrv, log, "NameServer")
        brokers = {}
        for name in ("broker-a", "broker-b"):
            p, data, endpoint = _tiered_broker(tmp_path, name, namesrv)
            procs.append(p)
            brokers[name] = (p, data, endpoint)
        created = tmq("topic", "create", "split", "-n", namesrv, "-q", "1", "--tiered")
        assert created.returncode == 0, created.stderr
        assert created.stdout.count("created topic split") == 2, created.stdout
        for name, (_p, _data, endpoint) in brokers.items():
            sent = [(f"{name}-{i}".encode(), f"k{i}", "t") for i in range(20)]
            send_batches(endpoint, "split", sent)
        deadline = time.monotonic() + 90
        while True:  # both archives hold the 20 messages of queue 0
            assert tmq("offload", "split", "-n", namesrv).returncode == 0
            rows = json.loads(tmq("offload", "status", "split", "-n", namesrv, "--json").stdout)
            if sorted(r["tier_watermark"] for r in rows) == [20, 20]:
                break
            assert time.monotonic() < deadline, rows
            time.sleep(1)
        # The broker listed last is the one that diverged: offsets 10-19 hold other messages
        # in its archive (the record a start in an outage and its late check leave).
        order = [r["broker"] for r in rows]
        diverged = order[-1]
        proc, data, _endpoint = brokers[diverged]
        proc.terminate()
        assert proc.wait(30) == 0
        (data / "tier-divergence.json").write_text(
            json.dumps({"pending": [], "conflicts": [["split", 0, 10, 20]]})
        )
        procs.remove(proc)
        proc, data, _endpoint = _tiered_broker(tmp_path, diverged, namesrv)
        procs.append(proc)
        deadline = time.monotonic() + 30
        while True:  # both registered again, the diverged one showing its conflict
            shown = tmq("offload", "status", "split", "-n", namesrv, "--json")
            rows = json.loads(shown.stdout) if shown.stdout else []
            if len(rows) == 2 and any(r["tier_divergence"] for r in rows):
                break
            assert time.monotonic() < deadline, (shown.stdout, shown.stderr)
            time.sleep(0.5)
        assert shown.returncode == 3, shown.stderr
        done = tmq("offload", "resolve", "split", "-n", namesrv, "--json", timeout=120)
        assert done.returncode == 0, (done.stdout, done.stderr)
        assert json.loads(done.stdout) == [
            {
                "broker": diverged,
                "topic": "split",
                "queue": 0,
                "from": 10,
                "archive_end": 20,
                "discarded": False,
                "copied": 10,
                "copies": [20, 30],
            }
        ]
        assert json.loads((data / "tier-divergence.json").read_text()) == {
            "pending": [],
            "conflicts": [],
        }
        again = tmq("offload", "resolve", "split", "-n", namesrv)
        assert again.returncode == 1, (again.stdout, again.stderr)
        assert "no queue of split has a conflict with its archive on any broker" in again.stderr, (
            again.stderr
        )
    finally:
        _stop(procs, strict=False)
