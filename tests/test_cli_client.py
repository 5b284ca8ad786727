"""``tmq topic|produce|consume|replay`` run as an operator runs them, against ``tmq standalone``."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import grpc
import pytest
from broker_harness import Standalone, tmq


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Standalone]:
    broker = Standalone(tmp_path_factory.mktemp("cli") / "data").start()
    yield broker
    broker.stop()


def run(*args: str, stdin: str | None = None) -> str:
    import subprocess
    import sys

    from broker_harness import REPO

    done = subprocess.run(
        [sys.executable, "-m", "cli.app", *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_topic_produce_consume_replay_and_describe(node: Standalone) -> None:
    ns = node.namesrv
    run("topic", "create", "cli-orders", "-n", ns, "--queues", "2")
    sent = [
        json.loads(line)
        for line in run(
            "produce",
            "cli-orders",
            "-n",
            ns,
            "--tag",
            "paid",
            "--key",
            "k1",
            "--json",
            stdin="one\ntwo\nthree\n",
        ).splitlines()
    ]
    assert len(sent) == 3 and all(s["message_id"] for s in sent)
    before = int(time.time() * 1000)
    time.sleep(0.05)
    run("produce", "cli-orders", "-n", ns, "--body", "later", "--count", "2")

    got = [
        json.loads(line)
        for line in run(
            "consume", "cli-orders", "-n", ns, "-g", "cli-group", "--count", "5", "--json"
        ).splitlines()
    ]
    assert sorted(m["body"] for m in got) == ["later", "later", "one", "three", "two"]
    assert {m["message_id"] for m in got} >= {s["message_id"] for s in sent}
    assert all(m["tag"] == "paid" and m["keys"] == ["k1"] for m in got if m["body"] != "later")
    by_sql = run(
        "consume", "cli-orders", "-n", ns, "-g", "cli-sql", "--sql", "TAGS = 'paid'", "--json"
    )  # fmt: skip
    assert sorted(json.loads(line)["body"] for line in by_sql.splitlines()) == [
        "one",
        "three",
        "two",
    ]

    replayed = [
        json.loads(line)
        for line in run(
            "replay", "cli-orders", "-n", ns, "--from-offset", "0", "--json"
        ).splitlines()
    ]
    assert sorted(m["body"] for m in replayed) == ["later", "later", "one", "three", "two"]
    recent = [
        json.loads(line)
        for line in run(
            "replay", "cli-orders", "-n", ns, "--from-time", str(before), "--json"
        ).splitlines()
    ]
    assert [m["body"] for m in recent] == ["later", "later"]

    described = json.loads(run("topic", "describe", "cli-orders", "-n", ns, "--json"))
    assert sum(q["max_offset"] for q in described[0]["queue_offsets"]) == 5
    listed = json.loads(run("topic", "list", "-n", ns, "--json"))
    assert "cli-orders" in {t["topic"] for t in listed}


def test_client_errors_are_one_line_with_a_nonzero_exit(node: Standalone) -> None:
    for args in (
        ["topic", "create", "../x", "-n", node.namesrv],
        ["topic", "describe", "no-such-topic", "-n", node.namesrv],
        ["replay", "no-such-topic", "-n", node.namesrv, "--from-offset", "0"],
        ["topic", "list", "-n", "127.0.0.1:1"],
        ["replay", "x", "-n", node.namesrv],
    ):
        done = tmq(*args)
        assert done.returncode != 0, args
        assert done.stderr.startswith("error: ") and done.stderr.count("\n") == 1, done.stderr
        assert "Traceback" not in done.stderr


def test_topic_describe_shows_pending_timers_and_half_messages(node: Standalone) -> None:
    from rocketmq.grpc_protocol import definition_pb2 as d
    from rocketmq.grpc_protocol import service_pb2 as s
    from rocketmq.grpc_protocol import service_pb2_grpc

    ns = node.namesrv
    run("topic", "create", "t-delay", "-n", ns, "--message-type", "DELAY", "--queues", "1")
    run("topic", "create", "t-txn", "-n", ns, "--message-type", "TRANSACTION", "--queues", "1")
    stub = service_pb2_grpc.MessagingServiceStub(grpc.insecure_channel(node.endpoint))
    for topic, kind in (("t-delay", d.DELAY), ("t-txn", d.TRANSACTION)):
        request = s.SendMessageRequest()
        for i in range(3):
            m = request.messages.add(topic=d.Resource(name=topic), body=b"later")
            m.system_properties.message_id = f"{topic}-{i}"
            m.system_properties.message_type = kind
            if kind == d.DELAY:
                due = time.time_ns() // 1_000_000 + 3_600_000
                m.system_properties.delivery_timestamp.FromMilliseconds(due)
        assert stub.SendMessage(request, timeout=10).status.code == d.OK
    deadline = time.monotonic() + 10
    while True:
        [delay] = json.loads(run("topic", "describe", "t-delay", "-n", ns, "--json"))
        if delay["timers_pending"] == 3 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert delay["timers_pending"] == 3
    assert delay["timer_delivery_lag_seconds"] == 0
    assert [q["max_offset"] for q in delay["queue_offsets"]] == [0], "nothing delivered yet"
    [txn] = json.loads(run("topic", "describe", "t-txn", "-n", ns, "--json"))
    assert txn["transactions_pending"] == 3
    text = run("topic", "describe", "t-delay", "-n", ns)
    assert "timers: 3 pending" in text


def test_topic_update_changes_only_what_it_is_given(node: Standalone) -> None:
    ns = node.namesrv
    run("topic", "create", "upd", "-n", ns, "--queues", "2", "--message-type", "FIFO", "--tiered")
    run("topic", "update", "upd", "-n", ns, "--queues", "4")
    [described] = json.loads(run("topic", "describe", "upd", "-n", ns, "--json"))
    assert (described["queues"], described["message_type"], described["tiered"]) == (
        4,
        "FIFO",
        True,
    )
    run("topic", "update", "upd", "-n", ns, "--no-tiered")
    [described] = json.loads(run("topic", "describe", "upd", "-n", ns, "--json"))
    assert (described["queues"], described["tiered"]) == (4, False)
    shrink = tmq("topic", "update", "upd", "-n", ns, "--queues", "1")
    assert shrink.returncode == 1 and "shrinking" in shrink.stderr
