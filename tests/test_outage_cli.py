"""Operator commands during an object-store outage (decision 810): each answers within a bounded
time and says a tier value it could not get is unknown, never 0. Real broker processes,
LocalStack S3 behind the tests' fault proxy (a black hole: connections accepted, no answer; and
503s), the `tmq` CLI as an operator runs it. The broker's admin_tier_wait_ms is set to 1 s here
(its default is 5 s) so the test takes seconds."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from broker_harness import Standalone, send_batches, start_tiered, tmq, wait_until
from conftest import S3Endpoint

TOPIC = "outage-orders"
TIER_UNKNOWN = 4  # cli/topic.py; docs/operations.md "Exit codes and errors"
NOT_VERIFIED = 3  # cli/offload.py: `tmq verify` could not judge


def _timed(*args: str) -> tuple[float, Any]:
    started = time.monotonic()
    done = tmq(*args, timeout=60)
    return time.monotonic() - started, done


def _archived_then_restarted(tmp_path: Path, fault_proxy: Any, bucket: str) -> Standalone:
    """A broker whose tiered topic's 200 messages are archived (watermark 100 on each of 2
    queues), restarted while the tier resets every connection, so no manifest is cached."""
    url = f"s3://{bucket}/outage"
    env = {**S3Endpoint(fault_proxy.url, "proxy").env(), "TMQ_BROKER_ADMIN_TIER_WAIT_MS": "1000"}
    data = tmp_path / "data"
    node = start_tiered(data, url, env)
    try:
        created = tmq(
            "topic", "create", TOPIC, "-n", node.namesrv, "-q", "2", "--tiered", "--ttl", "30d"
        )
        assert created.returncode == 0, created.stderr
        node.wait_routed(TOPIC)
        send_batches(node.endpoint, TOPIC, [(b"x" * 1000, f"k{i}", "t") for i in range(200)])
        offloaded = tmq("offload", TOPIC, "-n", node.namesrv, timeout=120)
        assert offloaded.returncode == 0, offloaded.stderr
        assert "tier watermark 100" in offloaded.stdout, offloaded.stdout
    finally:
        node.stop()

    fault_proxy.set(reset=True)  # the start's manifest loads fail at once: none is cached
    return start_tiered(data, url, env)


def test_describe_list_and_offload_status_answer_unknown_in_seconds_during_an_outage(
    tmp_path: Path, fault_proxy: Any, bucket: str
) -> None:
    """The topic's 200 messages are archived (watermark 100 on each of 2 queues); the broker
    restarts while the tier resets every connection, so no manifest is cached. Then the tier
    black-holes, then answers 503. On main `tmq topic describe`/`list`/`offload status` each
    failed after the CLI's own 10 s (`Deadline Exceeded`) while the broker went on loading
    manifests one after the other through the tier's retries, and `tmq status` said `cold 0 B`
    (exit 0). Now each answers within the broker's wait plus the CLI's start, with every
    queue's tier watermark (and archive size) null in JSON, `unknown` in text, and exit 4; once
    the tier answers, the real values again, exit 0."""
    node = _archived_then_restarted(tmp_path, fault_proxy, bucket)
    try:
        n = node.namesrv
        for outage in ({"blackhole": True}, {"error_rate": 1.0, "error_status": 503}):
            fault_proxy.set(**outage)
            took, described = _timed("topic", "describe", TOPIC, "-n", n, "--json")
            print(f"{outage}: topic describe --json {took:.1f} s rc {described.returncode}")
            assert described.returncode == TIER_UNKNOWN, (described.stdout, described.stderr)
            # Bounded by the broker's 1 s wait, not the CLI's 10 s nor the tier's retries; the
            # rest is the CLI's own start on a loaded machine.
            assert took < 9, took
            (row,) = json.loads(described.stdout)
            assert [q["tier_watermark"] for q in row["queue_offsets"]] == [None, None], row
            assert [q["max_offset"] for q in row["queue_offsets"]] == [100, 100], row
            assert f"{TOPIC}/0 on broker-a, {TOPIC}/1 on broker-a" in described.stderr

            took, text = _timed("topic", "describe", TOPIC, "-n", n)
            assert text.returncode == TIER_UNKNOWN and took < 9, (took, text.stderr)
            assert "queue 0: offsets [0, 100), tier watermark unknown (the cold tier did not" in (
                text.stdout
            ), text.stdout

            took, listed = _timed("topic", "list", "-n", n, "--json")
            assert listed.returncode == TIER_UNKNOWN and took < 9, (took, listed.stderr)
            (row,) = [r for r in json.loads(listed.stdout) if r["topic"] == TOPIC]
            assert [q["tier_watermark"] for q in row["queue_offsets"]] == [None, None], row

            took, status = _timed("offload", "status", TOPIC, "-n", n)
            assert status.returncode == TIER_UNKNOWN and took < 9, (took, status.stderr)
            assert f"{TOPIC}/0 on broker-a: tier watermark unknown (the cold tier did not " in (
                status.stdout
            ), status.stdout
            assert "(lag" not in status.stdout, "no lag computed from an unknown watermark"

            took, status = _timed("offload", "status", TOPIC, "-n", n, "--json", "--wait")
            assert status.returncode == TIER_UNKNOWN and took < 9, (took, status.stderr)
            assert [r["tier_watermark"] for r in json.loads(status.stdout)] == [None, None]

            # Retention reloads every manifest: it waited out the tier's retries while the CLI
            # gave up at 10 s ("no answer"). Now refused at once, naming the queues.
            took, retained = _timed("retain", TOPIC, "-n", n, "--apply", "--dry-run")
            assert retained.returncode == 1 and took < 9, (took, retained.stderr)
            assert "the cold tier did not answer for 2 queue(s) in time" in retained.stderr, (
                retained.stderr
            )

            # `tmq status` reported the archive as empty: `cold 0 B`, exit 0.
            took, status = _timed("status", "-n", n, "--json")
            assert status.returncode == TIER_UNKNOWN and took < 9, (took, status.stderr)
            doc = json.loads(status.stdout)
            (topic,) = doc["tiered_topics"]
            assert topic["lag_known"] is False and topic["store_bytes"]["cold"] is None, topic
            assert [q["store_bytes"]["cold"] for q in topic["queues"]] == [None, None], topic
            assert doc["brokers"][0]["store_bytes"]["cold"] is None, doc["brokers"]
            took, text = _timed("status", "-n", n)
            assert text.returncode == TIER_UNKNOWN and "cold unknown" in text.stdout, text.stdout
            assert "cold 0 B" not in text.stdout, text.stdout

        fault_proxy.heal()

        def answered() -> bool:
            done = tmq("topic", "describe", TOPIC, "-n", n, "--json", timeout=60)
            if done.returncode != 0:
                assert done.returncode == TIER_UNKNOWN, done.stderr
                return False
            (row,) = json.loads(done.stdout)
            assert [q["tier_watermark"] for q in row["queue_offsets"]] == [100, 100], row
            return True

        wait_until("the healed tier's watermarks described", answered, 60)
        wait_until(
            "retention applied again",
            lambda: tmq("retain", TOPIC, "-n", n, "--apply", "--dry-run").returncode == 0,
            30,
        )
        wait_until("the tier's size known", lambda: tmq("status", "-n", n).returncode == 0, 30)
        doc = json.loads(tmq("status", "-n", n, "--json").stdout)
        assert doc["tiered_topics"][0]["store_bytes"]["cold"] > 200_000, doc
    finally:
        fault_proxy.heal()
        node.stop()


def test_verify_answers_could_not_verify_within_the_broker_wait_during_an_outage(
    tmp_path: Path, fault_proxy: Any, bucket: str
) -> None:
    """`tmq verify` under a black-holed tier (decision 885). On main the broker's first manifest
    load of each queue ignored the call's deadline: the CLI gave up at its own `--timeout`
    (exit 3, `no answer within 20 s`) while the broker went on through the tier's retries. Now
    the broker loads every queue's manifest fresh (never the cache: the point is whether the
    tier answers now) within its admin_tier_wait_ms (1 s here) and answers "could not verify",
    naming the queues: exit 3 in seconds, with no cached manifest, under 503s, and with every
    manifest cached from before the outage. Once the tier answers, verify says OK."""
    node = _archived_then_restarted(tmp_path, fault_proxy, bucket)
    n = node.namesrv
    try:
        for outage in ({"blackhole": True}, {"error_rate": 1.0, "error_status": 503}):
            fault_proxy.set(**outage)
            took, verified = _timed("verify", TOPIC, "-n", n, "--timeout", "20")
            print(f"{outage}: verify {took:.1f} s rc {verified.returncode} {verified.stderr!r}")
            assert verified.returncode == NOT_VERIFIED, (verified.stdout, verified.stderr)
            assert took < 9, (took, verified.stderr)
            assert "could not verify: the cold tier did not answer for 2 queue(s)" in (
                verified.stderr
            ), verified.stderr
            assert f"({TOPIC}/0, {TOPIC}/1)" in verified.stderr, verified.stderr

        fault_proxy.heal()

        def verified_ok() -> bool:
            done = tmq("verify", TOPIC, "-n", n, "--json", timeout=60)
            if done.returncode == NOT_VERIFIED:
                return False
            if done.returncode == 1 and "next pass checks it" in done.stdout:
                return False  # still pending its divergence check (WARNING, decision 800)
            assert done.returncode == 0, (done.stdout, done.stderr)
            assert json.loads(done.stdout)["status"] == "OK", done.stdout
            return True

        wait_until("verify OK once the tier answers", verified_ok, 60)
        # Every manifest is cached now (describe answers at once): verify must still ask the
        # tier, not judge the cache and then wait on the tier's listing.
        wait_until(
            "every manifest cached",
            lambda: tmq("topic", "describe", TOPIC, "-n", n).returncode == 0,
            30,
        )
        fault_proxy.set(blackhole=True)
        took, verified = _timed("verify", "-n", n, "--timeout", "20")
        print(f"cached, black hole: verify {took:.1f} s rc {verified.returncode}")
        assert verified.returncode == NOT_VERIFIED and took < 9, (took, verified.stderr)
        assert "could not verify: the cold tier did not answer for 2 queue(s)" in (
            verified.stderr
        ), verified.stderr
    finally:
        fault_proxy.heal()
        node.stop()


def test_verify_of_more_queues_than_the_broker_loads_at_once_answers_ok(
    tmp_path: Path, fault_proxy: Any, bucket: str
) -> None:
    """Decision 885's loads share decision 810's 8 slots: a queue past them must wait for a slot
    within the broker's wait, not count as a silent tier. A healthy tier, a tiered topic of 12
    queues: `tmq verify` judges all 12 and never answers "could not verify"; once the broker's
    pass has checked the queues the topic's creation left unchecked (the creation's own check
    has the same 8 slots, decision 785), it says OK, exit 0."""
    env = S3Endpoint(fault_proxy.url, "proxy").env()
    node = start_tiered(tmp_path / "data", f"s3://{bucket}/wide", env)
    try:
        n = node.namesrv
        created = tmq("topic", "create", "wide", "-n", n, "-q", "12", "--tiered")
        assert created.returncode == 0, created.stderr
        node.wait_routed("wide")

        def verified_ok() -> bool:
            verified = tmq("verify", "wide", "-n", n, "--json", timeout=60)
            assert verified.returncode in (0, 1), (verified.stdout, verified.stderr)
            doc = json.loads(verified.stdout)
            assert len(doc["queues"]) == 12, doc
            if verified.returncode == 1:
                assert all(
                    "not checked against its archive yet" in " ".join(q["anomalies"])
                    for q in doc["queues"]
                    if q["status"] != "OK"
                ), doc
            return bool(verified.returncode == 0 and doc["status"] == "OK")

        wait_until("verify OK for all 12 queues", verified_ok, 60)
        assert verified_ok()
    finally:
        node.stop()
