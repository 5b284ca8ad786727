"""A divergence resolve (`tmq offload resolve`, decisions 801, 880, 900-903) on bad days: the
power goes out at each of its steps (not only a kill -9: unsynced writes are lost too), live
producers, consumers and `tmq topic update --queues` run beside it, and a broker that restarts
after an interrupted resolve finishes it itself. Real broker processes, LocalStack S3 behind the
tests' fault proxy, the power-loss filesystem of tests/powerloss_fs.py, Apache's client."""

from __future__ import annotations

import json
import shutil
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import pytest
from broker_harness import (
    Standalone,
    body_bytes,
    client_config,
    send_batches,
    start_tiered,
    tiered_args,
    tmq,
    wait_until,
)
from conftest import S3Endpoint
from test_tier_restore import (
    TOPIC,
    archived_to,
    conflict_found,
    diverging,
    replay_rows,
)

from tiered.cold.storage import open_store

CLEAN = {"pending": [], "conflicts": []}


class OnMount(Standalone):
    """A tiered broker whose data directory is on the power-loss mount, and whose log is not
    (it must outlive the power cut)."""

    def __init__(self, data: Path, log: Path, tier_url: str, env: dict[str, str]) -> None:
        super().__init__(data, extra=tiered_args(tier_url), env=env)
        self._log = log

    @property
    def log_path(self) -> Path:
        return self._log


def assert_resolved(rows: list[dict[str, Any]], runs: tuple[list[bytes], ...]) -> None:
    """Queue 0 after the resolve of ``diverging``'s conflict: the archive's messages at 0-199,
    then each local message of 60-179 once, in order, as its copy (its old offset and the range
    in its properties)."""
    first, second, third, fourth = runs
    assert [body_bytes(r["body"]) for r in rows] == first + second + fourth + third
    assert [r["offset"] for r in rows] == list(range(320))
    for n, r in enumerate(rows[200:]):
        assert r["properties"]["TMQ_DIVERGED_FROM"] == str(60 + n)
        assert r["properties"]["TMQ_DIVERGED_RANGE"] == "60-180"


STEPS = [
    "resolve.mid_copy",  # 64 copies appended, not flushed
    "resolve.before_commit",  # every copy flushed and read back
    "resolve.before_floor",  # tier-divergence.json committed, the floor not raised
    "resolve.after_floor",  # queue-floors.json saved, the record's floor entry not dropped
]


@pytest.mark.slow
@pytest.mark.parametrize("step", STEPS)
def test_a_power_loss_at_each_step_of_a_resolve_loses_and_repeats_nothing(
    tmp_path: Path, s3: Any, bucket: str, fault_proxy: Any, step: str
) -> None:
    """Decision 900: the broker's data directory on the power-loss filesystem; the resolve is
    held at ``step`` (its failpoint as a pause), the power is cut there (only what was fsynced
    survives, a random part of the rest lands, torn at a sector) and the broker killed -9. A
    broker started on what the disk kept ends with the resolved queue: the archive's messages
    at 0-199 and each local message of 60-179 once at 200-319, the record clean; whatever the
    cut left (a conflict with 0..120 copies, or the commit with its floor), the restarted broker
    finishes it without an operator (decision 902)."""
    from test_power_loss import PowerLossMount, _need_fuse

    _need_fuse()
    name = step.split(".")[1].replace("_", "-")
    url, env = f"s3://{bucket}/pl-{name}", S3Endpoint(fault_proxy.url, "proxy").env()
    tier = open_store(url, s3.storage_options())
    data = tmp_path / "data"
    node, runs = diverging(tmp_path, data, url, env, tier, fault_proxy)
    try:
        conflict_found(node, tier, data / "tier-divergence.json", fault_proxy)
    finally:
        assert node.stop() == 0
    durable, mountpoint = tmp_path / "durable", tmp_path / "mnt"
    durable.mkdir()
    shutil.copytree(data, durable / "data")
    shutil.rmtree(data)  # each directory holds a 400 MB IndexFile: a small disk is shared
    shutil.rmtree(tmp_path / "backup")
    mount = PowerLossMount(mountpoint, durable)
    try:
        node = OnMount(
            mountpoint / "data",
            tmp_path / "on-mount.log",
            url,
            {**env, "TMQ_FAILPOINTS": f"{step}=sleep:600"},
        ).start()
        with ThreadPoolExecutor(1) as pool:
            resolving = pool.submit(
                tmq, "offload", "resolve", TOPIC, "-n", node.namesrv, timeout=600
            )
            wait_until(
                f"the resolve held at {step}",
                lambda: f"failpoint {step}: pausing" in node.log_path.read_text(),
                300,
            )
            mount.crash(f"resolve-{name}")
            node.kill9()
            assert resolving.result(timeout=120).returncode == 1, "the broker died under it"
    finally:
        mount.close()

    record = durable / "data" / "tier-divergence.json"
    node = start_tiered(durable / "data", url, env)
    try:
        wait_until(
            "the restarted broker finished the resolve",
            lambda: json.loads(record.read_text()) == CLEAN,
            180,
        )
        assert_resolved(replay_rows(node), runs)
        archived_to(node, tier, 320, None)  # the copies archive like any message
        assert_resolved(replay_rows(node), runs)
        checked = tmq("verify", TOPIC, "-n", node.namesrv, "--json", timeout=120)
        assert checked.returncode == 0, checked.stdout
    finally:
        assert node.stop() == 0


def test_producers_consumers_and_a_queue_change_beside_a_resolve_lose_and_repeat_nothing(
    tmp_path: Path, s3: Any, bucket: str, fault_proxy: Any
) -> None:
    """Decision 901: while a resolve runs (held 3 s after each batch of copies, before its
    commit and before its floor), a producer sends batches of ten with keys, a SimpleConsumer
    (Apache's client) pops and acknowledges, and `tmq topic update --queues 2` adds a queue.
    Every acknowledged send reads back at the queue and offset its receipt named; the copies
    are each local message once, in order, between the producer's messages; the consumer gets
    every sent message exactly once, and a local message of 60-179 at most twice (its original
    before the commit, its copy: the documented duplicate); the whole queue archives."""
    from rocketmq import FilterExpression, SimpleConsumer

    url, env = f"s3://{bucket}/beside", S3Endpoint(fault_proxy.url, "proxy").env()
    tier = open_store(url, s3.storage_options())
    data = tmp_path / "data"
    node, runs = diverging(tmp_path, data, url, env, tier, fault_proxy)
    shutil.rmtree(tmp_path / "backup")  # a 400 MB IndexFile: a small disk is shared
    first, second, third, fourth = runs
    try:
        conflict_found(node, tier, data / "tier-divergence.json", fault_proxy)
        before = {r["message_id"] for r in replay_rows(node)}
    finally:
        assert node.stop() == 0

    pauses = "resolve.mid_copy=sleep:3,resolve.before_commit=sleep:3,resolve.before_floor=sleep:3"
    node = start_tiered(data, url, {**env, "TMQ_FAILPOINTS": pauses})
    sent: list[tuple[str, int, bytes]] = []  # (message id, offset in its receipt, body)
    received: list[Any] = []
    stop_sending, stop_consuming = threading.Event(), threading.Event()
    errors: list[BaseException] = []

    refused: list[str] = []  # sends not acknowledged (a producer would retry): not counted

    def produce() -> None:
        n = 0
        while not stop_sending.is_set():
            batch = [(f"p-{n + i:05d}-".encode() * 20, f"p{n + i}", "t") for i in range(10)]
            n += 10
            try:
                receipts = send_batches(node.endpoint, TOPIC, batch, batch=10)
            except (AssertionError, grpc.RpcError) as e:
                refused.append(str(e)[:200])
                continue
            for (mid, offset), (body, _, _) in zip(receipts, batch, strict=True):
                sent.append((mid, offset, body))
            time.sleep(0.1)

    consumer = SimpleConsumer(
        client_config(node), "g-beside", {TOPIC: FilterExpression()}, await_duration=2
    )
    consumer.startup()

    def consume() -> None:
        try:
            while not stop_consuming.is_set():
                try:
                    got = consumer.receive(32, 30)
                except Exception as e:  # a cold read past the broker's wait: asked again
                    refused.append(str(e)[:200])
                    continue
                for m in got:
                    received.append(m)
                    consumer.ack(m)  # a failed ack is an error: it would deliver again
        except BaseException as e:
            errors.append(e)

    try:
        threads = [threading.Thread(target=produce), threading.Thread(target=consume)]
        for t in threads:
            t.start()
        try:
            with ThreadPoolExecutor(1) as pool:
                resolving = pool.submit(
                    tmq, "offload", "resolve", TOPIC, "-n", node.namesrv, "--json", timeout=300
                )
                wait_until(
                    "the resolve paused",
                    lambda: "failpoint resolve.mid_copy: pausing" in node.log_path.read_text(),
                    60,
                )
                grown = tmq("topic", "update", TOPIC, "-n", node.namesrv, "--queues", "2")
                assert grown.returncode == 0, grown.stderr
                done = resolving.result(timeout=300)
            assert done.returncode == 0, done.stderr
            (row,) = json.loads(done.stdout)
            assert (row["from"], row["archive_end"], row["copied"]) == (60, 180, 120), row
        finally:
            stop_sending.set()
            threads[0].join()
        assert not errors, errors
        assert len(sent) > 50, ("the producer ran beside the resolve", refused)
        sent_ids = {mid for mid, _, _ in sent}
        wanted = sent_ids | before
        deadline = time.monotonic() + 120
        while not wanted <= {m.message_id for m in received} and time.monotonic() < deadline:
            time.sleep(0.5)
        time.sleep(3)  # anything delivered twice would come now
        stop_consuming.set()
        threads[1].join()
    finally:
        stop_sending.set()
        stop_consuming.set()
        consumer.shutdown()
    try:
        assert not errors, errors
        rows = tmq("replay", TOPIC, "-n", node.namesrv, "--from-offset", "0", "--json", timeout=120)
        assert rows.returncode == 0, rows.stderr
        shown = [json.loads(line) for line in rows.stdout.splitlines()]
        at = {(r["queue"], r["offset"]): r for r in shown}
        assert len(at) == len(shown), "an offset read twice"
        for mid, offset, body in sent:  # every acknowledged send where its receipt said
            hits = [r for r in shown if r["message_id"] == mid]
            assert len(hits) == 1, (mid, offset, hits)
            assert hits[0]["offset"] == offset and body_bytes(hits[0]["body"]) == body
        q0 = sorted((r for r in shown if r["queue"] == 0), key=lambda r: r["offset"])
        assert [r["offset"] for r in q0] == list(range(len(q0))), "a hole in queue 0"
        assert [body_bytes(r["body"]) for r in q0[:200]] == first + second + fourth
        copies = [r for r in q0[200:] if "TMQ_DIVERGED_FROM" in r["properties"]]
        assert [body_bytes(r["body"]) for r in copies] == third
        assert [r["properties"]["TMQ_DIVERGED_FROM"] for r in copies] == [
            str(o) for o in range(60, 180)
        ]
        others = [r["message_id"] for r in q0[200:] if "TMQ_DIVERGED_FROM" not in r["properties"]]
        assert set(others) <= sent_ids
        assert sum(1 for r in shown if r["queue"] == 1) > 0, "the new queue took sends"
        # The consumer: every sent message once; a local message of the range at most twice.
        counts = Counter(m.message_id for m in received)
        assert all(counts[mid] == 1 for mid in sent_ids), [
            mid for mid in sent_ids if counts[mid] != 1
        ]
        local_ids = {r["message_id"] for r in copies}
        assert all(counts[mid] <= 2 for mid in local_ids)
        assert all(counts[mid] == 1 for mid in counts if mid not in local_ids), [
            (mid, c) for mid, c in counts.items() if c != 1 and mid not in local_ids
        ]
        assert set(counts) <= sent_ids | before | {r["message_id"] for r in shown}
        assert json.loads((data / "tier-divergence.json").read_text()) == CLEAN
        archived_to(node, tier, len(q0))
        checked = tmq("verify", TOPIC, "-n", node.namesrv, "--json", timeout=120)
        assert checked.returncode == 0, checked.stdout
    finally:
        assert node.stop() == 0
