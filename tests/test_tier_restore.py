"""A broker's own data directory comes back with a tiered queue that ends below its archive: a
data directory restored from an older copy (the same store id; decision 690 cannot tell it from
the original), or a power loss that lost records the offloader had archived. Its next messages
must not reuse archived offsets: written there, they were released as uploaded (the archive's
end is the watermark) without ever being uploaded, and reads of those offsets returned the
archive's older messages. Real broker processes, LocalStack S3, decision 720."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
from broker_harness import (
    Standalone,
    body_bytes,
    free_port,
    metric_sample,
    send_batches,
    start_tiered,
    tmq,
    wait_until,
)
from conftest import S3Endpoint

from broker import admin_pb2 as apb
from tiered.cold.fetcher import ColdFetcher
from tiered.cold.manifest import ManifestLog, QueueManifest, queue_prefix
from tiered.cold.storage import ObjectStore, open_store

TOPIC = "restored-orders"
OTHER = "restored-audit"
BROKER = ("DefaultCluster", "broker-a")


def produce(node: Standalone, tag: str, count: int, *, create: bool = False) -> list[bytes]:
    if create:
        created = tmq("topic", "create", TOPIC, "-n", node.namesrv, "-q", "1", "--tiered")
        assert created.returncode == 0, created.stderr
    sent = [(f"{tag}-{i:05d}-".encode() + b"x" * 1000, f"k{i}", "t") for i in range(count)]
    send_batches(node.endpoint, TOPIC, sent, batch=20)
    return [b for b, _, _ in sent]


def replayed(node: Standalone) -> list[tuple[int, bytes]]:
    done = tmq("replay", TOPIC, "-n", node.namesrv, "--from-offset", "0", "--json", timeout=120)
    assert done.returncode == 0, done.stderr
    rows = [json.loads(line) for line in done.stdout.splitlines()]
    return [(int(r["offset"]), body_bytes(r["body"])) for r in rows]


def manifest(tier: ObjectStore) -> QueueManifest:
    return ManifestLog(tier, queue_prefix("DefaultCluster", "broker-a", TOPIC, 0)).load()


def archived_bodies(tier: ObjectStore, start: int, end: int) -> list[bytes]:
    """The archive's messages from ``start`` to ``end``, read straight from its segments."""
    fetcher = ColdFetcher(tier, "DefaultCluster", "broker-a", read_timeout_s=30)
    try:
        out: list[bytes] = []
        while start < end:
            messages, start = fetcher.get(TOPIC, 0, start, end - start)
            assert messages, f"nothing archived at {start}"
            out += [m.body for m in messages]
        return out
    finally:
        fetcher.close()


def archived_to(
    node: Standalone, tier: ObjectStore, end: int, ask: str | None = "yes"
) -> QueueManifest:
    """Wait for the archive to reach ``end``; ``ask``: run `tmq offload` first (None: leave it
    to the broker's passes)."""
    if ask is not None:
        assert tmq("offload", TOPIC, "-n", node.namesrv).returncode == 0
    deadline = time.monotonic() + 90
    while (m := manifest(tier)).end_offset < end:
        assert time.monotonic() < deadline, f"{m.end_offset} of {end} archived"
        time.sleep(0.5)
    return m


def restored_behind_archive(
    tmp_path: Path, data: Path, url: str, env: dict[str, str], tier: ObjectStore
) -> tuple[list[bytes], list[bytes]]:
    """60 messages archived, the directory copied, 120 more archived, the copy put back: the
    queue ends at 60, its archive at 180. Returns the two runs of bodies."""
    backup = tmp_path / "backup"
    node = start_tiered(data, url, env)
    try:
        first = produce(node, "a", 60, create=True)
        archived_to(node, tier, 60)
    finally:
        node.stop()
    shutil.copytree(data, backup)  # the backup: 60 messages, all archived
    node = start_tiered(data, url, env)
    try:
        second = produce(node, "b", 120)
        archived_to(node, tier, 180)
    finally:
        node.stop()
    shutil.rmtree(data)
    shutil.copytree(backup, data)
    return first, second


def diverging(
    tmp_path: Path, data: Path, url: str, env: dict[str, str], tier: ObjectStore, fault_proxy: Any
) -> tuple[Standalone, tuple[list[bytes], list[bytes], list[bytes], list[bytes]]]:
    """Decision 750's conflict in the making: ``restored_behind_archive`` (the queue at 60, its
    archive at 180), then two starts while the store resets every request, 120 messages at
    60-179 and 20 at 180-199. Returns the second node, still in the outage (the store heals
    when the caller says), with its metrics on, and the four runs of bodies."""
    first, second = restored_behind_archive(tmp_path, data, url, env, tier)
    fault_proxy.set(reset=True)  # every request to the store: connection reset
    node = start_tiered(data, url, env)
    try:
        third = produce(node, "c", 120)  # offsets 60-179, which the archive holds
    finally:
        node.stop()
    pending = json.loads((data / "tier-divergence.json").read_text())["pending"]
    assert pending == [[TOPIC, 0, 60]], "recorded before it served, with its end then"
    # A restart still in the outage: its queue now ends at 180, the archive's end. The check
    # must still start from 60, where the unchecked messages began.
    node = start_tiered(data, url, env, metrics_port=free_port())
    try:
        fourth = produce(node, "e", 20)  # offsets 180-199: above the archive's end
    except BaseException:
        node.stop()
        raise
    return node, (first, second, third, fourth)


def offload_status(node: Standalone, *extra: str) -> Any:
    return tmq("offload", "status", TOPIC, "-n", node.namesrv, "--json", *extra, timeout=120)


def assert_conflict_shown(node: Standalone, secrets: dict[str, str]) -> None:
    """Decision 800: the conflict [60, 180) of ``TOPIC``/0 in `tmq offload status` (JSON, text,
    exit 3), `tmq verify` (FAILURE), `tmq topic describe` and the metrics; no secret in any."""
    conflict = {"state": "diverged", "from": 60, "archive_end": 180, "resolve_began_at": None}
    shown = offload_status(node)
    assert shown.returncode == 3, (shown.stdout, shown.stderr)
    (row,) = json.loads(shown.stdout)
    assert row["tier_divergence"] == conflict and row["offload_held"] is None
    assert f"diverged from its archive in 1 queue(s): {TOPIC}/0" in shown.stderr
    text = tmq("offload", "status", TOPIC, "-n", node.namesrv, timeout=120)
    assert text.returncode == 3
    assert "DIVERGED from its archive: offsets 60..179" in text.stdout, text.stdout
    assert "tmq offload resolve" in text.stdout
    waited = offload_status(node, "--wait")  # returns: no watermark frees a conflict
    assert waited.returncode == 3
    checked = tmq("verify", TOPIC, "-n", node.namesrv, "--json", timeout=120)
    assert checked.returncode == 2, (checked.stdout, checked.stderr)
    verdict = json.loads(checked.stdout)
    assert verdict["status"] == "FAILURE"
    (q,) = verdict["queues"]
    assert q["status"] == "FAILURE" and not q["missing"] and not q["damaged"]
    assert any("DIVERGED from its archive: offsets 60..179" in a for a in q["anomalies"]), q
    described = tmq("topic", "describe", TOPIC, "-n", node.namesrv, "--json")
    assert described.returncode == 0
    assert json.loads(described.stdout)[0]["queue_offsets"][0]["tier_divergence"] == conflict
    described_text = tmq("topic", "describe", TOPIC, "-n", node.namesrv)
    assert "DIVERGED from its archive: offsets 60..179" in described_text.stdout
    assert metric_sample(node, f'tmq_tier_diverged_offsets{{queue="0",topic="{TOPIC}"}}') == 120
    assert metric_sample(node, f'tmq_tier_check_pending{{queue="0",topic="{TOPIC}"}}') is None
    everything = "".join(
        r.stdout + r.stderr for r in (shown, text, waited, checked, described, described_text)
    )
    for secret in secrets.values():
        if len(secret) >= 8:
            assert secret not in everything


def test_a_restored_data_dir_never_reuses_an_archived_offset(
    tmp_path: Path, s3: Any, bucket: str
) -> None:
    url, env = f"s3://{bucket}/restore", s3.env()
    tier = open_store(url, s3.storage_options())
    data = tmp_path / "data"
    first, second = restored_behind_archive(tmp_path, data, url, env, tier)
    node = start_tiered(data, url, env)
    try:
        third = produce(node, "c", 120)  # two 64 KiB CommitLog files' worth
        want = list(enumerate(first + second + third))
        assert replayed(node) == want, "every acknowledged message at its own offset"
        # Uploaded and released: the new messages are read back from the archive.
        archived_to(node, tier, len(want))
        commitlog = data / "commitlog"
        deadline = time.monotonic() + 60
        while (commitlog / f"{0:020d}").exists():
            assert time.monotonic() < deadline, "the first CommitLog file was never released"
            time.sleep(0.5)
        assert replayed(node) == want, "after release, from the archive"
        assert "below its archive's end" in node.log_path.read_text()
    finally:
        node.stop()

    # A restart keeps the queue where it continued (the floor is recorded in the directory).
    node = start_tiered(data, url, env)
    try:
        fourth = produce(node, "d", 10)
        assert replayed(node) == list(enumerate(first + second + third + fourth))
    finally:
        node.stop()


def test_a_topic_created_again_on_a_restored_data_dir_continues_above_its_archive(
    tmp_path: Path, s3: Any, bucket: str
) -> None:
    """The copy was taken before the topic existed, so the restored directory does not know
    it, and the start has no queue to check. The operator creates it again while the broker
    runs (``tmq topic create``): its queue must continue at the archive's end as a queue the
    start checked does, not take offsets 0.. again (where release deletes the new messages
    as archived, and reads return the archive's older ones)."""
    url, env = f"s3://{bucket}/recreated", s3.env()
    tier = open_store(url, s3.storage_options())
    data, backup = tmp_path / "data", tmp_path / "backup"

    node = start_tiered(data, url, env)
    try:
        created = tmq("topic", "create", OTHER, "-n", node.namesrv, "-q", "1")
        assert created.returncode == 0, created.stderr
    finally:
        node.stop()
    shutil.copytree(data, backup)  # the backup: OTHER, not tiered and empty; no TOPIC yet

    node = start_tiered(data, url, env)
    try:
        first = produce(node, "a", 60, create=True)
        archived_to(node, tier, 60)
        # OTHER is made tiered and archived too.
        assert tmq("topic", "update", OTHER, "-n", node.namesrv, "--tiered").returncode == 0
        send_batches(node.endpoint, OTHER, [(b"o" * 1000, "k", "t")] * 30, batch=10)
        assert tmq("offload", OTHER, "-n", node.namesrv).returncode == 0
        deadline = time.monotonic() + 90
        while ManifestLog(tier, queue_prefix(*BROKER, OTHER, 0)).load().end_offset < 30:
            assert time.monotonic() < deadline, "OTHER was never archived"
            time.sleep(0.5)
    finally:
        node.stop()

    shutil.rmtree(data)
    shutil.copytree(backup, data)
    node = start_tiered(data, url, env)
    try:
        created = tmq("topic", "create", TOPIC, "-n", node.namesrv, "-q", "1", "--tiered")
        assert created.returncode == 0, created.stderr
        node.wait_routed(TOPIC)
        sent = [(f"c-{i:05d}-".encode() + b"x" * 1000, f"k{i}", "t") for i in range(60)]
        offsets = [o for _, o in send_batches(node.endpoint, TOPIC, sent, batch=20)]
        assert offsets == list(range(60, 120)), "the new messages reused archived offsets"
        want = list(enumerate(first + [b for b, _, _ in sent]))
        archived_to(node, tier, 120)
        assert replayed(node) == want
        assert "below its archive's end" in node.log_path.read_text()
        # OTHER's queue exists, and messages may be reaching it: made tiered, the ones at
        # offsets its archive holds would be released as uploaded. Refused, said why.
        send_batches(node.endpoint, OTHER, [(b"p" * 1000, "k", "t")] * 5)
        update = tmq("topic", "update", OTHER, "-n", node.namesrv, "--tiered")
        assert update.returncode != 0
        assert "below the end of its archive (30" in update.stderr, update.stderr
        described = tmq("topic", "describe", OTHER, "-n", node.namesrv, "--json")
        assert json.loads(described.stdout)[0]["tiered"] is False, described.stdout
    finally:
        node.stop()


def test_queues_added_to_a_tiered_topic_on_a_restored_data_dir_continue_above_their_archive(
    tmp_path: Path, s3: Any, bucket: str
) -> None:
    """The copy was taken while the tiered topic had one queue; a second queue was added and
    archived after it. Restored, the directory knows queue 0 (the start checks it) but not queue
    1, and the operator adds it again (``tmq topic update --queues 2``): it must continue at its
    archive's end, as a new topic's queue does (decision 745), not take offsets 0.. again."""
    url, env = f"s3://{bucket}/added", s3.env()
    tier = open_store(url, s3.storage_options())
    data, backup = tmp_path / "data", tmp_path / "backup"

    def queue_end(queue_id: int) -> int:
        return ManifestLog(tier, queue_prefix(*BROKER, TOPIC, queue_id)).load().end_offset

    node = start_tiered(data, url, env)
    try:
        created = tmq("topic", "create", TOPIC, "-n", node.namesrv, "-q", "1", "--tiered")
        assert created.returncode == 0, created.stderr
    finally:
        node.stop()
    shutil.copytree(data, backup)  # the backup: TOPIC tiered with one queue, empty

    node = start_tiered(data, url, env)
    try:
        added = tmq("topic", "update", TOPIC, "-n", node.namesrv, "--queues", "2")
        assert added.returncode == 0, added.stderr
        node.wait_routed(TOPIC)
        # Round robin from queue 0: the odd messages go to queue 1.
        send_batches(node.endpoint, TOPIC, [(b"a" * 1000, "k", "t")] * 40, batch=20)
        assert tmq("offload", TOPIC, "-n", node.namesrv).returncode == 0
        deadline = time.monotonic() + 90
        while queue_end(1) < 20:
            assert time.monotonic() < deadline, f"{queue_end(1)} of queue 1's 20 archived"
            time.sleep(0.5)
    finally:
        node.stop()

    shutil.rmtree(data)
    shutil.copytree(backup, data)
    node = start_tiered(data, url, env)
    try:
        added = tmq("topic", "update", TOPIC, "-n", node.namesrv, "--queues", "2")
        assert added.returncode == 0, added.stderr
        node.wait_routed(TOPIC)
        archived = queue_end(0)  # before any send: the offloader moves it on after them
        offsets = [o for _, o in send_batches(node.endpoint, TOPIC, [(b"b" * 1000, "k", "t")] * 20)]
        # Queue 0 was known at the start (decision 720), queue 1 only to the update.
        assert offsets[0::2] == list(range(archived, archived + 10)), offsets
        assert offsets[1::2] == list(range(20, 30)), f"queue 1 reused archived offsets: {offsets}"
        log_text = node.log_path.read_text()
        assert "1: the local queue ends at 0, below its archive's end 20" in log_text
    finally:
        node.stop()


def test_a_tiered_topic_created_while_the_tier_does_not_answer_is_answered_in_seconds(
    tmp_path: Path, fault_proxy: Any, bucket: str
) -> None:
    """With the S3 endpoint black-holed, creating an eight-queue tiered topic loads eight
    manifests that never come. One after the other, each through the tier's retries and
    request timeouts, the call outlived the CLI's 10 s (the command failed) and went on for
    minutes before the topic was stored. The check has one deadline (decision 785): the topic
    is created within it, each queue not checked is logged, and the broker serves it."""
    from conftest import S3Endpoint

    node = Standalone(
        tmp_path / "data",
        extra=["--tier-url", f"s3://{bucket}/outage"],
        env=S3Endpoint(fault_proxy.url, "proxy").env(),
    ).start()
    try:
        fault_proxy.set(blackhole=True)
        started = time.monotonic()
        created = tmq("topic", "create", TOPIC, "-n", node.namesrv, "-q", "8", "--tiered")
        took = time.monotonic() - started
        print(f"tmq topic create --tiered -q 8 on a black-holed tier: {took:.1f} s")
        assert created.returncode == 0, created.stderr  # its call's own timeout is 10 s
        assert fault_proxy.snapshot()["counters"]["blackholed"] >= 1
        log_text = node.log_path.read_text()
        assert f"{TOPIC}: queues 0,1,2,3,4,5,6,7 are not checked against their archives" in (
            log_text
        ), log_text[-3000:]
        node.wait_routed(TOPIC)
        offsets = [o for _, o in send_batches(node.endpoint, TOPIC, [(b"x" * 100, "k", "t")] * 16)]
        assert offsets == [0] * 8 + [1] * 8, offsets
        # Unchecked, so recorded as decision 750 records a start in an outage: nothing of them
        # is uploaded, released or read from the archive before the check has run.
        divergence = tmp_path / "data" / "tier-divergence.json"
        pending = json.loads(divergence.read_text())["pending"]
        assert pending == [[TOPIC, q, 0] for q in range(8)], pending
        fault_proxy.heal()
        # The tier answers: each queue's archive (none) is checked, and the record cleared.
        deadline = time.monotonic() + 60
        while json.loads(divergence.read_text())["pending"]:
            assert time.monotonic() < deadline, divergence.read_text()
            time.sleep(0.5)
    finally:
        fault_proxy.heal()
        node.stop()


def test_a_restored_data_dir_started_while_the_store_is_down_keeps_its_new_messages(
    tmp_path: Path, s3: Any, bucket: str, fault_proxy: Any
) -> None:
    """Decision 750: the same restore, but the broker starts (twice) while the object store
    does not answer, so nothing can check the queue before it takes messages at offsets the
    archive holds. Those messages were acknowledged: once the store is back they must still be
    read at their offsets, never released as uploaded nor shadowed by the archive's older
    messages there; and the conflict must be said loudly. On main the replay after the store
    came back returned the archive's 'b' messages at offsets 60-179 (the 'c' ones released)."""
    url, env = f"s3://{bucket}/restore-outage", S3Endpoint(fault_proxy.url, "proxy").env()
    tier = open_store(url, s3.storage_options())
    data = tmp_path / "data"
    node, (first, second, third, fourth) = diverging(tmp_path, data, url, env, tier, fault_proxy)
    try:
        # Decision 800: the pending check shows where operators look, not only in the log.
        pending_shown = offload_status(node)
        # It resolves on its own, so it is no error of its own; the archive's end is unknown
        # while the store does not answer (exit 4, decision 810), never shown as 0.
        assert pending_shown.returncode == 4, pending_shown.stderr
        (row,) = json.loads(pending_shown.stdout)
        assert row["tier_watermark"] is None, row
        assert row["tier_divergence"] == {
            "state": "pending",
            "from": 60,
            "archive_end": None,
            "resolve_began_at": None,
        }
        assert metric_sample(node, f'tmq_tier_check_pending{{queue="0",topic="{TOPIC}"}}') == 1
        fault_proxy.heal()
        # The store answers: 180-199 are uploaded, and release runs after every pass.
        m = archived_to(node, tier, 200, None)
        assert m.end_offset == 200
        time.sleep(5)  # several offload-and-release passes
        want = list(enumerate(first + third + fourth))
        assert replayed(node) == want, "the acknowledged messages at their own offsets"
        assert "DIVERGED from its archive" in node.log_path.read_text()
        conflicts = json.loads((data / "tier-divergence.json").read_text())
        assert conflicts == {"pending": [], "conflicts": [[TOPIC, 0, 60, 180]]}
        # The archive's older messages there are kept, not swept: the operator's to recover.
        assert archived_bodies(tier, 60, 180) == second
        assert_conflict_shown(node, s3.env())
    finally:
        node.stop()

    # A restart with the store up keeps them there and says so again.
    node = start_tiered(data, url, env)
    try:
        fifth = produce(node, "d", 10)
        assert replayed(node) == list(enumerate(first + third + fourth + fifth))
        assert node.log_path.read_text().count("DIVERGED from its archive") >= 2
    finally:
        node.stop()


def replay_rows(node: Standalone) -> list[dict[str, Any]]:
    done = tmq("replay", TOPIC, "-n", node.namesrv, "--from-offset", "0", "--json", timeout=120)
    assert done.returncode == 0, done.stderr
    return [json.loads(line) for line in done.stdout.splitlines()]


def conflict_found(node: Standalone, tier: ObjectStore, record: Path, fault_proxy: Any) -> None:
    """After ``diverging``: the store heals, 180-199 are archived, the conflict is recorded."""
    fault_proxy.heal()
    archived_to(node, tier, 200, None)
    wait_until("the conflict found", lambda: 'conflicts": [[' in record.read_text(), 60)


def test_a_divergence_resolves_by_re_appending_the_local_messages_across_a_kill(
    tmp_path: Path, s3: Any, bucket: str, fault_proxy: Any
) -> None:
    """Decision 801: `tmq offload resolve` on decision 750's conflict (60-179 local 'c', the
    archive's 'b' there). It refuses while the store does not answer; killed -9 after its first
    batch of copies, the conflict stands with nothing lost, the restart says so at ERROR, and
    once the store answers the broker finishes it, appending only the rest (decision 902):
    afterwards the archive's messages are read at 60-179 and every 'c' message once,
    with its id, keys, tag and properties, at the queue's end, and the queue archives whole."""
    url, env = f"s3://{bucket}/resolve", S3Endpoint(fault_proxy.url, "proxy").env()
    tier = open_store(url, s3.storage_options())
    data = tmp_path / "data"
    node, (first, second, third, fourth) = diverging(tmp_path, data, url, env, tier, fault_proxy)
    record = data / "tier-divergence.json"
    try:
        conflict_found(node, tier, record, fault_proxy)
        before = replay_rows(node)
        assert [body_bytes(r["body"]) for r in before] == first + third + fourth
        local = before[60:180]  # the 'c' messages, as consumers read them
        # The store stops answering: the resolve cannot see the archive, and changes nothing.
        fault_proxy.set(reset=True)
        refused = tmq("offload", "resolve", TOPIC, "-n", node.namesrv, timeout=300)
        assert refused.returncode == 1, (refused.stdout, refused.stderr)
        assert "manifest could not be loaded" in refused.stderr and "nothing was changed" in (
            refused.stderr
        )
        assert json.loads(record.read_text())["conflicts"] == [[TOPIC, 0, 60, 180]]
        fault_proxy.heal()
    finally:
        assert node.stop() == 0

    node = start_tiered(data, url, {**env, "TMQ_FAILPOINTS": "resolve.mid_copy"})
    killed = tmq("offload", "resolve", TOPIC, "-n", node.namesrv, timeout=300)
    assert killed.returncode == 1
    assert node.proc is not None and node.proc.wait(60) == -9
    # The conflict stands, with where its copies began: 200, the queue's end then.
    assert json.loads(record.read_text())["conflicts"] == [[TOPIC, 0, 60, 180, 200]]

    # Restarted while the store does not answer: the broker cannot finish the resolve yet.
    fault_proxy.set(reset=True)
    node = start_tiered(data, url, env, metrics_port=free_port())
    try:
        interrupted = offload_status(node)
        assert interrupted.returncode == 3, "still diverged after the kill"
        assert json.loads(interrupted.stdout)[0]["tier_divergence"]["resolve_began_at"] == 200
        text = tmq("offload", "status", TOPIC, "-n", node.namesrv, timeout=120).stdout
        assert "a resolve began (its copies from offset 200) and did not finish" in text
        assert (
            f"{TOPIC}/0: a `tmq offload resolve` began (its copies from offset 200) and did "
            "not finish" in node.log_path.read_text()
        ), "said loudly at start (decision 902)"
        # The store answers again: the broker finishes the resolve itself (decision 902).
        fault_proxy.heal()
        wait_until(
            "the broker finished the resolve",
            lambda: json.loads(record.read_text()) == {"pending": [], "conflicts": []},
            120,
        )
        assert (
            f"{TOPIC}/0: finished the resolve an earlier run began (its copies from 200): 56 "
            "copie(s) appended now, the floor raised to 180" in node.log_path.read_text()
        ), "only what the killed run had not appended (64 were, before the kill)"
        after = replay_rows(node)
        bodies = [body_bytes(r["body"]) for r in after]
        # The archive is the truth below its end; each local message once, at the end.
        assert bodies == first + second + fourth + third
        assert [r["offset"] for r in after] == list(range(320))
        for old, new in zip(local, after[200:], strict=True):
            assert new["message_id"] == old["message_id"]
            assert (new["keys"], new["tag"]) == (old["keys"], old["tag"])
            assert new["properties"] == {
                **old["properties"],
                "TMQ_DIVERGED_FROM": str(old["offset"]),
                "TMQ_DIVERGED_RANGE": "60-180",
            }
        # Shown nowhere as diverged any more, and the copies are archived like any message.
        archived_to(node, tier, 320)
        status = offload_status(node)
        assert status.returncode == 0, status.stderr
        assert json.loads(status.stdout)[0]["tier_divergence"] is None
        checked = tmq("verify", TOPIC, "-n", node.namesrv, "--json", timeout=120)
        assert checked.returncode == 0, checked.stdout
        assert (
            metric_sample(node, f'tmq_tier_diverged_offsets{{queue="0",topic="{TOPIC}"}}') is None
        )
        again = tmq("offload", "resolve", TOPIC, "-n", node.namesrv)
        assert again.returncode == 1 and "has a conflict" in again.stderr, again.stderr
        direct = node.admin().ResolveDivergence  # the broker refuses too, not only the CLI
        try:
            direct(apb.ResolveDivergenceRequest(topic=TOPIC, queue=0), timeout=30)
            raise AssertionError("resolved a queue without a conflict")
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "has no conflict with its archive" in (e.details() or "")
    finally:
        assert node.stop() == 0

    node = start_tiered(data, url, env)  # a restart keeps it resolved
    try:
        assert [body_bytes(r["body"]) for r in replay_rows(node)] == (
            first + second + fourth + third
        )
    finally:
        assert node.stop() == 0


def test_discarding_a_divergence_is_confirmed_and_its_floor_survives_a_kill_after_the_commit(
    tmp_path: Path, s3: Any, bucket: str, fault_proxy: Any
) -> None:
    """Decision 801's `--discard-local`, Kafka's unclean way, made explicit: without the exact
    count the broker refuses, a "no" at the question changes nothing; confirmed, and killed -9
    between the commit and the floor (the `resolve.before_floor` failpoint), the next start
    raises the floor before it serves: the archive's messages are read at 60-179."""
    url, env = f"s3://{bucket}/discard", S3Endpoint(fault_proxy.url, "proxy").env()
    tier = open_store(url, s3.storage_options())
    data = tmp_path / "data"
    node, (first, second, _third, fourth) = diverging(tmp_path, data, url, env, tier, fault_proxy)
    record = data / "tier-divergence.json"
    conflict = {"pending": [], "conflicts": [[TOPIC, 0, 60, 180]]}
    try:
        conflict_found(node, tier, record, fault_proxy)
        try:  # a stale or mistaken count: the broker refuses, whatever the client asked
            node.admin().ResolveDivergence(
                apb.ResolveDivergenceRequest(
                    topic=TOPIC, queue=0, discard_local=True, discard_count=119
                ),
                timeout=60,
            )
            raise AssertionError("discarded with the wrong count")
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "holds 120 local message(s) (offsets 60..179), not 119" in (e.details() or "")
        unnamed = tmq("offload", "resolve", TOPIC, "-n", node.namesrv, "--discard-local")
        assert unnamed.returncode == 2 and "give --queue" in unnamed.stderr
        asked = subprocess.run(
            [
                sys.executable,
                "-m",
                "cli.app",
                "offload",
                "resolve",
                TOPIC,
                "-n",
                node.namesrv,
                "--queue",
                "0",
                "--discard-local",
            ],
            input="n\n",
            capture_output=True,
            text=True,
            timeout=60,
            cwd=Path(__file__).resolve().parent.parent,
        )
        assert asked.returncode == 1, (asked.stdout, asked.stderr)
        assert "Discard the 120 acknowledged local message(s) of" in asked.stderr
        assert "nothing discarded" in asked.stderr
        assert json.loads(record.read_text()) == conflict
    finally:
        assert node.stop() == 0

    node = start_tiered(data, url, {**env, "TMQ_FAILPOINTS": "resolve.before_floor"})
    cut = tmq(
        "offload", "resolve", TOPIC, "-n", node.namesrv, "--queue", "0", "--discard-local", "--yes"
    )
    assert cut.returncode == 1, "the broker died under it"
    assert node.proc is not None and node.proc.wait(60) == -9
    # Committed: the conflict is gone, and the floor is still to be raised.
    assert json.loads(record.read_text()) == {
        "pending": [],
        "conflicts": [],
        "floors": [[TOPIC, 0, 180]],
    }

    node = start_tiered(data, url, env)
    try:
        assert json.loads(record.read_text()) == {"pending": [], "conflicts": []}
        assert "raising the floor of a resolved divergence to 180" in node.log_path.read_text()
        bodies = [body_bytes(r["body"]) for r in replay_rows(node)]
        assert bodies == first + second + fourth, "the archive's at 60-179; the local discarded"
        assert offload_status(node).returncode == 0
    finally:
        assert node.stop() == 0


def queried(node: Standalone, key: str) -> list[tuple[int, bytes]]:
    found = tmq("query", "-t", TOPIC, "-k", key, "-n", node.namesrv, "--json", timeout=120)
    assert found.returncode == 0, found.stderr
    rows = [json.loads(line) for line in found.stdout.splitlines()]
    return sorted((int(r["offset"]), body_bytes(r["body"])) for r in rows)


def test_a_resolve_killed_after_its_copies_and_before_its_commit_is_finished_by_the_next_run(
    tmp_path: Path, s3: Any, bucket: str, fault_proxy: Any
) -> None:
    """Decision 880: killed -9 (the `resolve.before_commit` failpoint) once every copy is
    appended, fsynced and read back, and before the commit: the conflict stands with its
    ``copies_from``, and the restarted broker finishes it, appending none (decision 902). Then
    a lookup by key answers what reads by offset do: the archive's message at 60-179 and each
    local message once, at its copy's offset. On main the lookup returned the local original at
    its old offset beside its copy, while its CommitLog file was still there (release takes it
    later: how many originals are met depends on when; here k100's was), and hid the archive's
    message at that offset, which holds the same key in this data. The store-level test
    (tests/test_queue_floor.py) shows the same without the timing."""
    url, env = f"s3://{bucket}/resolve-commit", S3Endpoint(fault_proxy.url, "proxy").env()
    tier = open_store(url, s3.storage_options())
    data = tmp_path / "data"
    node, (first, second, third, fourth) = diverging(tmp_path, data, url, env, tier, fault_proxy)
    record = data / "tier-divergence.json"
    try:
        conflict_found(node, tier, record, fault_proxy)
    finally:
        assert node.stop() == 0

    node = start_tiered(data, url, {**env, "TMQ_FAILPOINTS": "resolve.before_commit"})
    killed = tmq("offload", "resolve", TOPIC, "-n", node.namesrv, timeout=300)
    assert killed.returncode == 1
    assert node.proc is not None and node.proc.wait(60) == -9
    assert json.loads(record.read_text()) == {
        "pending": [],
        "conflicts": [[TOPIC, 0, 60, 180, 200]],
    }, "not committed: the conflict stands, with where its copies began"

    node = start_tiered(data, url, env)
    try:
        # The broker finishes it (decision 902): every copy was made and kept, none twice.
        wait_until(
            "the broker finished the resolve",
            lambda: json.loads(record.read_text()) == {"pending": [], "conflicts": []},
            120,
        )
        assert (
            f"{TOPIC}/0: finished the resolve an earlier run began (its copies from 200): 0 "
            "copie(s) appended now" in node.log_path.read_text()
        )
        assert [body_bytes(r["body"]) for r in replay_rows(node)] == (
            first + second + fourth + third
        )
        # Keys k0..k119 are on 'b' and 'c' at 60-179; k5 also on 'a' at 5 and 'e' at 185.
        assert queried(node, "k5") == [
            (5, first[5]),
            (65, second[5]),
            (185, fourth[5]),
            (205, third[5]),
        ]
        assert queried(node, "k100") == [(160, second[100]), (300, third[100])]
    finally:
        assert node.stop() == 0


def test_operator_commands_beside_a_paused_resolve_neither_lose_nor_repeat_a_message(
    tmp_path: Path, s3: Any, bucket: str, fault_proxy: Any
) -> None:
    """Decision 880's race probe, kept as a guard (it passes on main): `tmq offload`,
    `tmq retain --apply` and `tmq verify --repair` run while a resolve is paused (the
    `resolve.mid_copy` and `resolve.before_commit` failpoints as sleeps) with the queue's lock
    held. They wait for it or report; afterwards each message is read once, at its place."""
    url, env = f"s3://{bucket}/resolve-race", S3Endpoint(fault_proxy.url, "proxy").env()
    tier = open_store(url, s3.storage_options())
    data = tmp_path / "data"
    node, (first, second, third, fourth) = diverging(tmp_path, data, url, env, tier, fault_proxy)
    record = data / "tier-divergence.json"
    try:
        conflict_found(node, tier, record, fault_proxy)
    finally:
        assert node.stop() == 0

    pauses = "resolve.mid_copy=sleep:4,resolve.before_commit=sleep:4"
    node = start_tiered(data, url, {**env, "TMQ_FAILPOINTS": pauses})
    try:
        with ThreadPoolExecutor(4) as pool:
            resolving = pool.submit(
                tmq, "offload", "resolve", TOPIC, "-n", node.namesrv, timeout=300
            )
            wait_until(  # the resolve holds the queue's lock in its first pause
                "the resolve paused",
                lambda: "failpoint resolve.mid_copy: pausing" in node.log_path.read_text(),
                60,
            )
            others = [
                pool.submit(tmq, "offload", TOPIC, "-n", node.namesrv, timeout=120),
                pool.submit(tmq, "retain", TOPIC, "-n", node.namesrv, "--apply", timeout=120),
                pool.submit(
                    tmq, "verify", TOPIC, "-n", node.namesrv, "--repair", "--json", timeout=120
                ),
            ]
            done = resolving.result(timeout=300)
            assert done.returncode == 0, done.stderr
            for other in others:
                other.result(timeout=300)  # exit codes vary with the timing; the data may not
        log_text = node.log_path.read_text()
        assert "failpoint resolve.before_commit: pausing" in log_text
        assert json.loads(record.read_text()) == {"pending": [], "conflicts": []}
        want = first + second + fourth + third
        assert [body_bytes(r["body"]) for r in replay_rows(node)] == want
        archived_to(node, tier, 320)
        assert [body_bytes(r["body"]) for r in replay_rows(node)] == want
        checked = tmq("verify", TOPIC, "-n", node.namesrv, "--json", timeout=120)
        assert checked.returncode == 0, checked.stdout
    finally:
        assert node.stop() == 0
