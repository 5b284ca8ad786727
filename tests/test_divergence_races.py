"""Operator commands racing decision 750's divergence record: a tiered queue recorded as not
checked against its archive (``DATA_DIR/tier-divergence.json``), and decision 745's check of
the queues a topic change makes tiered. Real broker processes, LocalStack S3, the fault proxy
(decisions 790, 791)."""

from __future__ import annotations

import json
import shutil
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from broker_harness import Standalone, body_bytes, send_batches, start_tiered, tmq, wait_until
from conftest import S3Endpoint
from test_disk_full import _fill, _Node, small_disk, write_config
from test_tier_restore import BROKER, replayed

from broker import admin_pb2 as apb
from tiered.cold.manifest import ManifestLog, queue_prefix
from tiered.cold.storage import ObjectStore, open_store

__all__ = ["small_disk"]  # the fixture, used by name

TOPIC = "restored-orders"  # test_tier_restore's replay reads this topic


def record(data: Path) -> dict[str, list[list[Any]]]:
    path = data / "tier-divergence.json"
    if not path.exists():
        return {"pending": [], "conflicts": []}
    loaded: dict[str, list[list[Any]]] = json.loads(path.read_text())
    return loaded


def archive_end(tier: ObjectStore, queue_id: int = 0) -> int:
    return ManifestLog(tier, queue_prefix(*BROKER, TOPIC, queue_id)).load().end_offset


def archive_start(tier: ObjectStore, queue_id: int = 0) -> int:
    return ManifestLog(tier, queue_prefix(*BROKER, TOPIC, queue_id)).load().start_offset


def send(node: Standalone, tag: str, count: int) -> list[int]:
    sent = [(f"{tag}-{i:05d}-".encode() + b"x" * 1000, f"k{i}", "t") for i in range(count)]
    return [o for _, o in send_batches(node.endpoint, TOPIC, sent, batch=10)]


def test_a_topic_tiered_again_during_an_outage_is_checked_before_anything_of_it_is_uploaded(
    tmp_path: Path, s3: Any, bucket: str, fault_proxy: Any
) -> None:
    """A tiered topic, claimed and archived, is made untiered, then tiered again while the
    tier fails every request: its queue is recorded unchecked at its end (decision 785's
    ``pend``). Its claim and manifest were cached while it was tiered before, so on main the
    offloader's passes trusted them once the tier answered: they uploaded the queue past the
    record's base without the check (which runs only when a manifest is loaded), the record
    stayed pending for the life of the process (release kept every file), and the next start
    checked it against an archive this broker had itself moved past the base: a false
    "DIVERGED" conflict, its files kept for good. The queue must be checked before anything of
    it is uploaded (decision 790)."""
    url, env = f"s3://{bucket}/retiered", S3Endpoint(fault_proxy.url, "proxy").env()
    tier = open_store(url, s3.storage_options())
    data = tmp_path / "data"
    node = start_tiered(data, url, env)
    try:
        created = tmq("topic", "create", TOPIC, "-n", node.namesrv, "-q", "1", "--tiered")
        assert created.returncode == 0, created.stderr
        node.wait_routed(TOPIC)
        assert send(node, "a", 10) == list(range(10))
        assert tmq("offload", TOPIC, "-n", node.namesrv).returncode == 0
        wait_until("the first 10 never archived", lambda: archive_end(tier) == 10, 90)
        untiered = tmq("topic", "update", TOPIC, "-n", node.namesrv, "--no-tiered")
        assert untiered.returncode == 0, untiered.stderr
        assert send(node, "b", 10) == list(range(10, 20))
        # Every request fails at once (a reset), so the check's loads give up (their retries
        # run out) rather than wait for the tier to come back and check the queue late.
        fault_proxy.set(reset=True)
        tiered = tmq("topic", "update", TOPIC, "-n", node.namesrv, "--tiered")
        assert tiered.returncode == 0, tiered.stderr
        assert record(data)["pending"] == [[TOPIC, 0, 20]], record(data)
        time.sleep(12)  # the check's loads run out their six attempts (backoff up to ~9 s)
        fault_proxy.heal()
        assert send(node, "c", 10) == list(range(20, 30))
        # The tier answers: the queue is checked (its archive ends at 10, below 20: cleared)
        # before anything of it is uploaded, and its new messages are archived after.
        wait_until(
            f"never checked once the tier answered: {record(data)}",
            lambda: record(data)["pending"] == [],
            60,
        )
        assert tmq("offload", TOPIC, "-n", node.namesrv).returncode == 0
        wait_until("never archived to 30", lambda: archive_end(tier) == 30, 90)
        assert record(data) == {"pending": [], "conflicts": []}
    finally:
        fault_proxy.heal()
        node.stop()

    node = start_tiered(data, url, env)
    try:
        assert record(data) == {"pending": [], "conflicts": []}, "a false conflict"
        bodies = [b for _, b in replayed(node)]
        assert [b[:7] for b in bodies] == (
            [f"a-{i:05d}".encode() for i in range(10)]
            + [f"b-{i:05d}".encode() for i in range(10)]
            + [f"c-{i:05d}".encode() for i in range(10)]
        )
        assert "DIVERGED" not in node.log_path.read_text()
    finally:
        node.stop()


def test_two_topic_changes_at_once_never_move_a_queue_messages_reach(
    tmp_path: Path, s3: Any, bucket: str, fault_proxy: Any
) -> None:
    """Two `tmq topic update --queues 2` at once (a retry, two operators, automation) on a data
    directory restored from before queue 1 existed, whose archive holds 20 of queue 1's old
    messages. The first change cannot reach the tier: queue 1 is recorded unchecked at 0
    (decision 785) and made tiered, and messages reach it. The second had read the topic
    before the first stored it, so to it queue 1 was still new (decision 745): on main its
    check, answered once the tier was back, found the queue below its archive's end and moved
    it there (``start_queue_at``) under the messages already acknowledged at 0.., which then
    answered no read. A topic change reads, checks and stores the topic under one lock
    (decision 791)."""
    url = f"s3://{bucket}/two-updates"
    direct, proxied = s3.env(), S3Endpoint(fault_proxy.url, "proxy").env()
    tier = open_store(url, s3.storage_options())
    data, backup = tmp_path / "data", tmp_path / "backup"

    node = start_tiered(data, url, direct)
    try:
        created = tmq("topic", "create", TOPIC, "-n", node.namesrv, "-q", "1", "--tiered")
        assert created.returncode == 0, created.stderr
    finally:
        node.stop()
    shutil.copytree(data, backup)  # the backup: the tiered topic with one queue, empty
    node = start_tiered(data, url, direct)
    try:
        added = tmq("topic", "update", TOPIC, "-n", node.namesrv, "--queues", "2")
        assert added.returncode == 0, added.stderr
        node.wait_routed(TOPIC)
        send(node, "old", 40)  # round robin: 20 to each queue
        assert tmq("offload", TOPIC, "-n", node.namesrv).returncode == 0
        wait_until("queue 1 never archived", lambda: archive_end(tier, 1) == 20, 90)
    finally:
        node.stop()
    shutil.rmtree(data)
    shutil.copytree(backup, data)

    node = start_tiered(data, url, proxied)
    acknowledged: list[bytes] = []
    stop, reached_queue_1 = threading.Event(), threading.Event()

    def keep_sending() -> None:
        i = 0
        while not stop.is_set():
            body = f"new-{i:05d}-".encode() + b"x" * 100
            [(_, offset)] = send_batches(node.endpoint, TOPIC, [(body, f"k{i}", "t")])
            acknowledged.append(body)
            if offset < 20:  # queue 0 continues at its archive's end, 20; queue 1 from 0
                reached_queue_1.set()
            i += 1
            time.sleep(0.05)

    def update() -> Future[Any]:
        """`tmq topic update --queues 2`'s PutTopic, sent now (no CLI start in the timing)."""
        topic = apb.Topic(name=TOPIC, queues=2, perm=6, message_type="NORMAL", tiered=True)
        request = apb.PutTopicRequest(topic=topic, update=True)
        return pool.submit(node.admin().PutTopic, request, timeout=30)

    sender = threading.Thread(target=keep_sending, daemon=True)
    pool = ThreadPoolExecutor(2)
    try:
        node.wait_routed(TOPIC)
        sender.start()
        fault_proxy.set(reset=True)  # the first change's check: the tier fails at once
        first = update()
        time.sleep(1)  # inside the first one's 5 s check
        second = update()
        # Once queue 1 has taken a message, the tier answers the second one's check.
        reached_queue_1.wait(30)
        fault_proxy.heal()
        first.result(60)
        assert reached_queue_1.is_set(), "no message reached queue 1"
        second.result(60)
        time.sleep(3)
        stop.set()
        sender.join(30)
        log_text = node.log_path.read_text()
        assert f"{TOPIC}: queues 1 are not checked" in log_text, log_text[-3000:]
        done = tmq("replay", TOPIC, "-n", node.namesrv, "--from-offset", "0", "--json")
        assert done.returncode == 0, done.stderr
        rows = [json.loads(line) for line in done.stdout.splitlines()]
        replayed_bodies = {body_bytes(r["body"]) for r in rows}
        lost = [b[:9] for b in acknowledged if b not in replayed_bodies]
        assert not lost, f"{len(lost)} of {len(acknowledged)} acknowledged messages lost: {lost}"
    finally:
        stop.set()
        fault_proxy.heal()
        pool.shutdown()
        node.stop()


def test_a_topic_change_the_full_disk_refuses_is_not_made(
    tmp_path: Path, small_disk: Path, fault_proxy: Any, bucket: str
) -> None:
    """The broker's disk is full (a real 12 MiB tmpfs, filled by another writer). A tiered
    topic created while the tier does not answer must record its unchecked queues before it
    is stored (decision 785), and cannot; a plain topic cannot save ``topics.json``. Both must
    be refused clearly (RESOURCE_EXHAUSTED, naming the save) and change nothing: on main the
    tiered one was refused with a bare ``Exception calling application`` (UNKNOWN), and the
    plain one was refused yet served, from memory only, until a restart forgot it. Once space
    returns, without a restart, both are created and the tiered one's queues recorded
    (decision 793)."""
    node = _Node(
        small_disk / "data",
        extra=[
            *("--config", str(write_config(tmp_path / "tmq.toml"))),
            *("--commitlog-file-size", "1MiB", "--offload-interval", "1"),
            *("--tier-url", f"s3://{bucket}/full"),
        ],
        env=S3Endpoint(fault_proxy.url, "proxy").env(),
    )
    node.log_dir = tmp_path
    node.start()
    filler = None
    try:
        fault_proxy.set(reset=True)
        filler = _fill(small_disk)
        tiered = tmq("topic", "create", TOPIC, "-n", node.namesrv, "-q", "2", "--tiered")
        assert tiered.returncode != 0
        assert "not changed: the broker could not save it" in tiered.stderr, tiered.stderr
        assert "No space left on device" in tiered.stderr, tiered.stderr
        plain = tmq("topic", "create", "plain", "-n", node.namesrv, "-q", "1")
        assert plain.returncode != 0
        assert "not changed: the broker could not save it" in plain.stderr, plain.stderr
        for name in (TOPIC, "plain"):
            described = tmq("topic", "describe", name, "-n", node.namesrv)
            assert described.returncode != 0, f"{name}: refused, yet made: {described.stdout}"
        assert record(small_disk / "data") == {"pending": [], "conflicts": []}
        filler.unlink()
        filler = None
        tiered = tmq("topic", "create", TOPIC, "-n", node.namesrv, "-q", "2", "--tiered")
        assert tiered.returncode == 0, tiered.stderr
        plain = tmq("topic", "create", "plain", "-n", node.namesrv, "-q", "1")
        assert plain.returncode == 0, plain.stderr
        assert record(small_disk / "data")["pending"] == [[TOPIC, 0, 0], [TOPIC, 1, 0]]
    finally:
        if filler is not None:
            filler.unlink()
        fault_proxy.heal()
        node.stop()


@pytest.mark.slow
def test_operator_commands_racing_the_late_check_of_a_diverged_queue_lose_nothing(
    tmp_path: Path, s3: Any, bucket: str, fault_proxy: Any
) -> None:
    """Decision 750's restore (the queue ends at 60, its archive at 180), started while the
    tier resets every request: 120 messages acknowledged at 60-179, pending at 60. Then
    `tmq offload`, `tmq retain --ttl 1s` and `--apply`, `tmq verify --repair` and a topic
    update run over and over while the tier comes and goes, so the late check runs among them
    and retention expires the archive (the older messages at 60-179 too) as they go. Nothing
    may upload over the archive, release or delete the conflict's local files, drop the record,
    or serve the archive's older messages at 60-179. A guard: it passed before decisions
    790-793 too (decision 792)."""
    from test_tier_restore import produce, restored_behind_archive

    url, env = f"s3://{bucket}/race-late", S3Endpoint(fault_proxy.url, "proxy").env()
    tier = open_store(url, s3.storage_options())
    data = tmp_path / "data"
    restored_behind_archive(tmp_path, data, url, env, tier)
    fault_proxy.set(reset=True)
    node = start_tiered(data, url, env)
    try:
        third = produce(node, "c", 120)  # offsets 60-179, which the archive holds
        assert record(data)["pending"] == [[TOPIC, 0, 60]]
        ns = node.namesrv
        commands = [
            ("offload", TOPIC, "-n", ns),
            ("retain", TOPIC, "-n", ns, "--ttl", "1s"),
            ("verify", TOPIC, "-n", ns, "--repair"),
            ("retain", TOPIC, "-n", ns, "--apply"),
            ("topic", "update", TOPIC, "-n", ns, "--tiered"),
        ]
        more: list[bytes] = []
        for i in range(15):
            if i % 2:
                fault_proxy.heal()
            else:
                fault_proxy.set(reset=True)
            tmq(*commands[i % len(commands)], timeout=120)  # refusals under the outage: fine
            more += produce(node, f"d{i}", 4)
            conflicts = record(data)["conflicts"]
            assert conflicts in ([], [[TOPIC, 0, 60, 180]]), conflicts
        fault_proxy.heal()
        wait_until(
            f"never checked: {record(data)}",
            lambda: record(data) == {"pending": [], "conflicts": [[TOPIC, 0, 60, 180]]},
            60,
        )
        tmq(*commands[1], timeout=120)
        tmq(*commands[3], timeout=120)
        time.sleep(5)  # offload, retention and release passes
        # Retention did reach the conflict: the archive's older messages there are expired.
        assert archive_start(tier) > 60, archive_start(tier)
        want = list(enumerate(third + more, start=60))
        done = tmq("replay", TOPIC, "-n", ns, "--from-offset", "60", "--json", timeout=120)
        assert done.returncode == 0, done.stderr
        got = [
            (int(r["offset"]), body_bytes(r["body"]))
            for r in map(json.loads, done.stdout.splitlines())
        ]
        assert got == want, "the acknowledged messages at their own offsets"
    finally:
        fault_proxy.heal()
        node.stop()
    node = start_tiered(data, url, env)
    try:
        assert record(data) == {"pending": [], "conflicts": [[TOPIC, 0, 60, 180]]}
        done = tmq("replay", TOPIC, "-n", node.namesrv, "--from-offset", "60", "--json")
        assert done.returncode == 0, done.stderr
        got = [
            (int(r["offset"]), body_bytes(r["body"]))
            for r in map(json.loads, done.stdout.splitlines())
        ]
        assert got == want, "after a restart"
    finally:
        node.stop()
