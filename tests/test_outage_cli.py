"""Operator commands during an object-store outage (decision 810): each answers within a bounded
time and says a tier value it could not get is unknown, never 0. Real broker processes,
LocalStack S3 behind the tests' fault proxy (a black hole: connections accepted, no answer; and
503s), the `tmq` CLI as an operator runs it. The broker's admin_tier_wait_ms is set to 1 s here
(its default is 5 s) so the test takes seconds."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator
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


def _create_tiered(node: Standalone, topic: str, queues: str = "2", *extra: str) -> None:
    """``tmq topic create TOPIC -q QUEUES --tiered EXTRA``, which must succeed, and the topic
    routed."""
    created = tmq("topic", "create", topic, "-n", node.namesrv, "-q", queues, "--tiered", *extra)
    assert created.returncode == 0, created.stderr
    node.wait_routed(topic)


@contextlib.contextmanager
def _running(node: Standalone, fault_proxy: Any) -> Iterator[str]:
    """The node's NameServer address; on the way out the fault proxy is healed and the node
    stopped, whatever the body raised."""
    try:
        yield node.namesrv
    finally:
        fault_proxy.heal()
        node.stop()


def _archived_then_restarted(tmp_path: Path, fault_proxy: Any, bucket: str) -> Standalone:
    """A broker whose tiered topic's 200 messages are archived (watermark 100 on each of 2
    queues), restarted while the tier resets every connection, so no manifest is cached."""
    url = f"s3://{bucket}/outage"
    env = {**S3Endpoint(fault_proxy.url, "proxy").env(), "TMQ_BROKER_ADMIN_TIER_WAIT_MS": "1000"}
    data = tmp_path / "data"
    node = start_tiered(data, url, env)
    try:
        _create_tiered(node, TOPIC, "2", "--ttl", "30d")
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
    with _running(node, fault_proxy) as n:
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
            # gave up at 10 s ("no answer"). Now refused at once, naming the queues, with the
            # exit code of "the cold tier did not answer" (decision 921; it was 1).
            took, retained = _timed("retain", TOPIC, "-n", n, "--apply", "--dry-run")
            assert retained.returncode == TIER_UNKNOWN and took < 9, (took, retained.stderr)
            assert "the cold tier did not answer for 2 queue(s) in time" in retained.stderr, (
                retained.stderr
            )

            # A lookup by key that cannot ask the archive says so: exit 4, the cold tier did
            # not answer (decision 923; it was 1, the exit code of a broker that does not).
            # Its bound is the broker's 2.5 s cold-read deadline, not the 1 s admin wait.
            took, queried = _timed("query", "-t", TOPIC, "-k", "k1", "-n", n)
            assert queried.returncode == TIER_UNKNOWN and took < 12, (took, queried.stderr)
            assert "the cold tier did not answer" in queried.stderr, queried.stderr
            assert queried.stdout == "", queried.stdout

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
    with _running(node, fault_proxy) as n:
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
        _create_tiered(node, "wide", "12")

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


def _tiered_node(tmp_path: Path, fault_proxy: Any, bucket: str, prefix: str) -> Standalone:
    env = {**S3Endpoint(fault_proxy.url, "proxy").env(), "TMQ_BROKER_ADMIN_TIER_WAIT_MS": "1000"}
    return start_tiered(tmp_path / "data", f"s3://{bucket}/{prefix}", env)


def _verified_ok(n: str, topic: str, *extra: str) -> bool:
    """`tmq verify` says OK (exit 0); False while the tier or a pending check keeps it from
    it; anything else fails the test."""
    done = tmq("verify", topic, "-n", n, "--json", *extra, timeout=60)
    if done.returncode == NOT_VERIFIED:
        return False
    if done.returncode == 1:
        doc = json.loads(done.stdout)
        # Orphans of the passes the outage cut off (swept by the next claim) or a check still
        # pending: not damage. Anything else is.
        assert all(
            not q["missing"] and not q["damaged"] and q["status"] != "FAILURE"
            for q in doc["queues"]
        ), doc
        return False
    assert done.returncode == 0, (done.stdout, done.stderr)
    return True


def _all_archived(n: str, total: int) -> bool:
    """Every one of the topic's ``total`` messages is below its queue's tier watermark."""
    done = tmq("offload", "status", TOPIC, "-n", n, "--json")
    if done.returncode != 0:
        return False
    rows = json.loads(done.stdout)
    assert sum(r["max_offset"] for r in rows) == total, rows
    return all(r["tier_watermark"] == r["max_offset"] for r in rows)


def test_offload_says_the_tier_is_unreachable_within_the_broker_wait_and_resumes_after(
    tmp_path: Path, fault_proxy: Any, bucket: str
) -> None:
    """`tmq offload TOPIC` against a black-holed tier took the tier's full retries on main (374
    s measured, decision 810); under 503s it ended after 6 attempts with exit 1. Now the broker
    asks the tier for the queues' manifests first and, when they do not come within its
    admin_tier_wait_ms (1 s here), refuses at once: exit 4 (the cold tier did not answer),
    naming the queues, nothing uploaded. Once the tier answers, the same command uploads
    everything, and the archive is whole: verify --deep OK."""
    node = _tiered_node(tmp_path, fault_proxy, bucket, "offload")
    with _running(node, fault_proxy) as n:
        _create_tiered(node, TOPIC)
        for outage in ({"blackhole": True}, {"error_rate": 1.0, "error_status": 503}):
            fault_proxy.set(**outage)
            send_batches(node.endpoint, TOPIC, [(b"x" * 1000, f"k{i}", "t") for i in range(100)])
            took, offloaded = _timed("offload", TOPIC, "-n", n)
            print(f"{outage}: offload {took:.1f} s rc {offloaded.returncode} {offloaded.stderr!r}")
            assert offloaded.returncode == TIER_UNKNOWN, (offloaded.stdout, offloaded.stderr)
            assert took < 9, (took, offloaded.stderr)
            assert "the cold tier did not answer for 2 queue(s)" in offloaded.stderr
            assert f"({TOPIC}/0, {TOPIC}/1)" in offloaded.stderr, offloaded.stderr
            assert "nothing was uploaded" in offloaded.stderr, offloaded.stderr
            assert offloaded.stdout == "", offloaded.stdout
        fault_proxy.heal()

        def uploaded() -> bool:
            done = tmq("offload", TOPIC, "-n", n, "--json", timeout=120)
            assert done.returncode in (0, TIER_UNKNOWN), (done.stdout, done.stderr)
            return done.returncode == 0 and _all_archived(n, 200)

        wait_until("every message uploaded once the tier answers", uploaded, 60)
        wait_until("the archive verified whole", lambda: _verified_ok(n, TOPIC, "--deep"), 60)


def test_offload_that_the_tier_stops_answering_during_says_so_and_commits_only_whole_segments(
    tmp_path: Path, fault_proxy: Any, bucket: str
) -> None:
    """The tier answers reads but holds every PUT (the upload hangs), then goes silent
    altogether. On main the Offload call waited out the tier's retries. Now, with no news of
    the upload for admin_tier_wait_ms, the broker asks the tier for the manifests and, when
    they do not come, answers UNAVAILABLE (marked as the tier's: the CLI's exit 4) saying
    what is committed so far. When the tier returns, the upload goes on and the archive holds
    every message in segments verified whole: nothing half-uploaded was committed."""
    import grpc

    from broker import admin_pb2 as pb
    from broker import admin_pb2_grpc as pb_grpc

    node = _tiered_node(tmp_path, fault_proxy, bucket, "during")
    with _running(node, fault_proxy) as n:
        _create_tiered(node, TOPIC)
        fault_proxy.set(blackhole=True, methods=["PUT"])
        send_batches(node.endpoint, TOPIC, [(b"x" * 1000, f"k{i}", "t") for i in range(200)])

        def dispatched() -> bool:  # else the call finds nothing to upload and answers at once
            done = tmq("topic", "describe", TOPIC, "-n", n, "--json")
            (row,) = json.loads(done.stdout)
            return sum(q["max_offset"] for q in row["queue_offsets"]) == 200

        wait_until("the 200 messages dispatched", dispatched, 30)
        channel = grpc.insecure_channel(node.endpoint)
        stub = pb_grpc.AdminStub(channel)
        started = time.monotonic()
        call = stub.Offload.future(pb.OffloadRequest(topic=TOPIC, queue=-1), timeout=120)
        # The manifests answer, so the call gets past its first check (1 s at most) and waits
        # on the upload: still under way after 3 s.
        time.sleep(3)
        assert not call.done(), call.exception()
        assert fault_proxy.snapshot()["counters"].get("blackholed", 0) >= 1
        fault_proxy.set(blackhole=True)
        silent = time.monotonic()
        try:
            call.result()
            raise AssertionError("the offload answered while the tier was silent")
        except grpc.RpcError as e:
            took = time.monotonic() - silent
            print(f"answered {took:.1f} s after the tier went silent ({e.details()!r})")
            assert e.code() == grpc.StatusCode.UNAVAILABLE, e
            assert ("tmq-cold-tier", "unavailable") in tuple(e.trailing_metadata() or ())
            assert "the cold tier stopped answering during the upload" in (e.details() or "")
            assert f"{TOPIC}/0 tier watermark" in (e.details() or ""), e.details()
            # Two of the broker's 1 s waits (the news, then the check), with room for load.
            assert took < 8, took
        assert time.monotonic() - started < 15
        channel.close()
        fault_proxy.heal()

        wait_until("the upload resumed once the tier answers", lambda: _all_archived(n, 200), 60)
        wait_until("the archive verified whole", lambda: _verified_ok(n, TOPIC, "--deep"), 60)


def test_verify_answers_could_not_verify_when_the_tier_goes_silent_after_the_manifests(
    tmp_path: Path, fault_proxy: Any, bucket: str
) -> None:
    """The manifests answer, the listing of the queue's segments does not (a tier gone silent
    between them). On main `verify_queue`'s listing ignored the call's deadline: the CLI gave
    up at its own `--timeout` (`no answer within 10 s`) while the broker went on through the
    tier's retries. Now the broker answers "could not verify" at the call's deadline (90% of
    it, less 0.5 s), naming the listing: exit 3 before the CLI's timeout."""
    node = _tiered_node(tmp_path, fault_proxy, bucket, "listing")
    with _running(node, fault_proxy) as n:
        _create_tiered(node, TOPIC)
        send_batches(node.endpoint, TOPIC, [(b"x" * 1000, f"k{i}", "t") for i in range(100)])
        offloaded = tmq("offload", TOPIC, "-n", n, timeout=120)
        assert offloaded.returncode == 0, offloaded.stderr
        fault_proxy.set(blackhole=True, paths=["/segments/"])
        took, verified = _timed("verify", TOPIC, "-n", n, "--timeout", "10")
        print(f"listing black-holed: verify {took:.1f} s rc {verified.returncode}")
        assert verified.returncode == NOT_VERIFIED, (verified.stdout, verified.stderr)
        assert "could not verify: the cold tier did not answer: list " in verified.stderr, (
            verified.stderr
        )
        assert "segments/: no answer before the call's deadline" in verified.stderr
        assert "no answer within 10 s" not in verified.stderr, verified.stderr
        fault_proxy.heal()
        wait_until("verify OK once the tier answers", lambda: _verified_ok(n, TOPIC), 60)


def test_loads_a_refused_verify_leaves_behind_free_their_slots_within_the_wait(
    tmp_path: Path, fault_proxy: Any, bucket: str
) -> None:
    """A tiered topic of 8 queues whose prefix is black-holed, another whose prefix answers.
    `verify held` is refused (could not verify) and leaves 8 manifest loads behind, one per
    slot. On main they ran out the tier's retries (6 attempts of 30 s read timeouts), so for
    minutes `verify free` found no slot within the broker's wait and was refused too, on a
    queue the tier answers for. Now a load an operator has given up on ends within about two
    of the broker's waits (1 s each here), and `verify free` says OK."""
    node = _tiered_node(tmp_path, fault_proxy, bucket, "slots")
    with _running(node, fault_proxy) as n:
        for topic, queues in (("held", "8"), ("free", "2")):
            _create_tiered(node, topic, queues)
        wait_until("verify of free OK", lambda: _verified_ok(n, "free"), 60)
        fault_proxy.set(blackhole=True, paths=["/held/"])
        took, held = _timed("verify", "held", "-n", n, "--timeout", "20")
        assert held.returncode == NOT_VERIFIED and took < 9, (took, held.stderr)
        assert "could not verify: the cold tier did not answer for 8 queue(s)" in held.stderr
        time.sleep(2)  # the loads' own deadline (1 s) and one last attempt's read timeout (1 s)
        took, free = _timed("verify", "free", "-n", n, "--json", "--timeout", "20")
        print(f"after a refused verify of 8 queues: verify free {took:.1f} s {free.stderr!r}")
        assert free.returncode == 0, (free.stdout, free.stderr)
        assert json.loads(free.stdout)["status"] == "OK", free.stdout


def test_a_tiered_topic_of_more_queues_than_the_load_slots_is_checked_at_creation(
    tmp_path: Path, fault_proxy: Any, bucket: str
) -> None:
    """`tmq topic create --tiered -q 12` on a healthy but slow tier (each request 100 ms): on
    main the creation's check took a queue that found the 8 load slots taken as not answered
    and recorded queues 8-11 unchecked (a WARNING from verify, logged as "not checked against
    their archives") although the tier answered. Now they wait for a slot within the same
    deadline: every queue is checked at creation, none is recorded unchecked."""
    node = _tiered_node(tmp_path, fault_proxy, bucket, "wide")
    with _running(node, fault_proxy) as n:
        fault_proxy.set(delay_ms=100)
        created = tmq("topic", "create", "wide", "-n", n, "-q", "12", "--tiered")
        assert created.returncode == 0, created.stderr
        log = node.log_path.read_text()
        assert "not checked against their archives" not in log, log[-2000:]
        described = tmq("topic", "describe", "wide", "-n", n, "--json")
        assert described.returncode == 0, described.stderr
        (row,) = json.loads(described.stdout)
        assert all(q["tier_divergence"] is None for q in row["queue_offsets"]), row
