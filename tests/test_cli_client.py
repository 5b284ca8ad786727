"""``tmq topic|produce|consume|replay`` run as an operator runs them, against ``tmq standalone``."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

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


def test_delay_and_transaction_topics_are_refused_until_supported(node: Standalone) -> None:
    for kind in ("DELAY", "TRANSACTION"):
        done = tmq(
            "topic", "create", f"t-{kind.lower()}", "-n", node.namesrv, "--message-type", kind
        )
        assert done.returncode == 1 and "not supported yet" in done.stderr, done.stderr


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
