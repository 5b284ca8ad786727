"""``tmq verify`` against a tier in use: repair never deletes what the offloader is uploading or
has just committed, and verify reports a healthy tier as healthy while uploads and retention run,
with uploads that landed together committed in one manifest version (decision 411)."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import grpc
from broker_harness import Standalone, send_batches, tmq
from conftest import S3Endpoint
from rocketmq.grpc_protocol import definition_pb2 as d
from rocketmq.grpc_protocol import service_pb2_grpc
from test_tier_readers import body_of, end_offset, pull
from test_tiered_e2e import QUICK_TIERING

from broker import admin_pb2 as apb
from tiered.cold.manifest import ManifestLog, queue_prefix
from tiered.cold.segment import SegmentReader
from tiered.cold.storage import open_store


def test_verify_repair_racing_uploads_and_retention_loses_nothing(
    tmp_path: Path, fault_proxy: Any, bucket: str, s3: S3Endpoint
) -> None:
    # Slow writes a little, as a real store's are: the window between an upload and its
    # manifest commit (where the old repair deleted the new segment) is then tens of ms wide.
    fault_proxy.set(delay_ms=25, methods=["PUT"])
    node = Standalone(
        tmp_path / "data",
        extra=[*QUICK_TIERING, "--tier-url", f"s3://{bucket}/tier"],
        # Segments of 64 KiB: several per queue and pass, so that uploads land together.
        env={
            **S3Endpoint(fault_proxy.url, "proxy").env(),
            "TMQ_OFFLOAD_SEGMENT_MAX_BYTES": "64KiB",
        },
    ).start()
    stop = threading.Event()
    verdicts: list[str] = []
    failures: list[str] = []
    try:
        admin = node.admin()
        admin.PutTopic(
            apb.PutTopicRequest(topic=apb.Topic(name="keep", queues=2, perm=6, tiered=True)),
            timeout=10,
        )
        # A second topic whose archive retention keeps cutting: manifests change under verify.
        admin.PutTopic(
            apb.PutTopicRequest(
                topic=apb.Topic(name="churn", queues=1, perm=6, tiered=True, retention_ms=1500)
            ),
            timeout=10,
        )

        def verify_loop() -> None:
            stub = node.admin()
            repair = True
            while not stop.is_set():
                try:
                    reply = stub.Verify(apb.VerifyRequest(repair=repair), timeout=30)
                except grpc.RpcError as e:
                    failures.append(f"Verify(repair={repair}): {e.code().name} {e.details()}")
                    continue
                verdicts.append(reply.status)
                if reply.status == "FAILURE":
                    failures.append(str(reply.queues))
                repair = not repair

        def retain_loop() -> None:
            # `tmq retain --apply`, an operator's command, racing the offloader's own retention
            # and its batched commits (decision 501).
            stub = node.admin()
            while not stop.wait(0.2):
                try:
                    reply = stub.ApplyRetention(apb.ApplyRetentionRequest(), timeout=30)
                except grpc.RpcError as e:
                    failures.append(f"ApplyRetention: {e.code().name} {e.details()}")
                    continue
                retained.extend(o.segments for o in reply.outcomes if o.topic == "keep")
                retained.extend(0 for o in reply.outcomes if o.topic == "churn" and o.segments)

        retained: list[int] = []
        checker = threading.Thread(target=verify_loop)
        checker.start()
        retainer = threading.Thread(target=retain_loop)
        retainer.start()
        sent = 0
        started = time.monotonic()
        while time.monotonic() - started < 20:
            send_batches(
                node.endpoint, "keep", [(body_of(sent + i), "k", "t") for i in range(20)], 20
            )
            send_batches(node.endpoint, "churn", [(b"c" * 500, "k", "t")] * 20, 20)
            sent += 20
            time.sleep(0.03)
        time.sleep(3)  # the last uploads and releases
        stop.set()
        checker.join(timeout=60)
        retainer.join(timeout=60)
        assert len(verdicts) >= 10, f"only {len(verdicts)} verify passes ran"
        assert not failures, failures[:3]
        assert not any(retained), "retention removed segments of a topic without a TTL"
        assert retained, "the operator's retention never removed a churn segment"

        # Everything acknowledged is in the tier, and reads back through the broker.
        for q in (0, 1):
            admin.Offload(apb.OffloadRequest(topic="keep", queue=q), timeout=60)
        final = admin.Verify(apb.VerifyRequest(topic="keep"), timeout=60)
        assert final.status == "OK", final
        tier = open_store(f"s3://{bucket}/tier", s3.storage_options())
        stub = service_pb2_grpc.MessagingServiceStub(grpc.insecure_channel(node.endpoint))
        seen: dict[bytes, int] = {}
        versions = segments = 0
        for q in (0, 1):
            manifest = ManifestLog(tier, queue_prefix("DefaultCluster", "broker-a", "keep", q))
            archive = manifest.load()
            versions += archive.version
            segments += len(archive.segments)
            end = end_offset(stub, "keep", q)
            assert archive.start_offset == 0 and archive.end_offset == end
            for info in archive.segments:  # every named object is there and whole
                assert len(SegmentReader(tier, info).read(info.base_offset, info.count)) == (
                    info.count
                )
            offset = 0
            while offset < end:
                got = pull(stub, "keep", q, offset, batch=256)
                assert got.code == d.OK, (q, offset, got.message)
                assert got.offsets == list(range(offset, offset + len(got.offsets)))
                for body in got.bodies:
                    seen[body] = seen.get(body, 0) + 1
                offset = got.next_offset
        assert seen == {body_of(i): 1 for i in range(sent)}
        # One version per commit: fewer versions than segments means some commits were batches.
        print(f"keep: {segments} segments in {versions} manifest versions")
        assert versions < segments, f"no batched commit: {versions} versions, {segments} segments"
        churn = ManifestLog(tier, queue_prefix("DefaultCluster", "broker-a", "churn", 0)).load()
        for before, after in zip(churn.segments, churn.segments[1:], strict=False):
            assert before.end_offset == after.base_offset, "a hole in the churn archive"
        assert not (node.data_dir / "commitlog" / f"{0:020d}").exists(), "nothing was released"
    finally:
        stop.set()
        node.stop()


def test_verify_checks_six_hundred_segments_fast_and_answers_by_its_deadline(
    tmp_path: Path, s3: S3Endpoint, bucket: str
) -> None:
    """About 600 segments (what made `tmq verify` time out after 10 s): the routine check
    needs the listing only, and a deep check with a deadline too short for all of them gives a
    WARNING naming how many were left, never a hang or a FAILURE."""
    from concurrent.futures import ThreadPoolExecutor

    from offload.verify import FAILURE, OK, WARNING, verify_queue
    from tiered.cold.manifest import QueueManifest, segment_key
    from tiered.cold.segment import build
    from tiered.config import StoreConfig
    from tiered.record import Message
    from tiered.store import MessageStore

    hot = MessageStore(StoreConfig(data_dir=tmp_path / "hot", commitlog_file_size=1 << 20))
    hot.start()
    try:
        for i in range(600):
            hot.put_message(Message(topic="many", queue_id=0, body=body_of(i)))
        assert hot.wait_dispatched()
        entries = hot.queues.get("many", 0)
        assert entries is not None
        raws = [
            hot.commitlog.read(phys, size) for _o, (phys, size, _t) in entries.iter_entries(0, 600)
        ]
    finally:
        hot.shutdown()
    tier = open_store(f"s3://{bucket}/tier", s3.storage_options())
    prefix = queue_prefix("c", "b", "many", 0)
    built = [build([raw], i, segment_key(prefix, i)) for i, raw in enumerate(raws) if raw]
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda pair: tier.put_if_absent(pair[1].key, pair[0]), built))
    ManifestLog(tier, prefix).commit(QueueManifest(prefix, 1, [info for _data, info in built], 0))
    lock = threading.RLock()
    with ThreadPoolExecutor(16) as pool:
        started = time.monotonic()
        verdict = verify_queue(tier, "c", "b", "many", 0, lock=lock, pool=pool)
        seconds = time.monotonic() - started
        assert verdict.status == OK and verdict.unchecked == 0, verdict
        assert seconds < 5.0, f"{seconds:.1f} s for 600 segments"
        print(f"verify: 600 segments in {seconds:.2f} s")
        # Deep: every object re-read, which cannot finish in a fraction of a second.
        hurried = verify_queue(
            tier,
            "c",
            "b",
            "many",
            0,
            lock=lock,
            pool=pool,
            deep=True,
            deadline=time.monotonic() + 0.5,
        )
    assert hurried.status == WARNING and hurried.unchecked > 0, hurried
    assert any("not checked before the deadline" in n for n in hurried.notes)
    # A damaged object (same size, other bytes) is found by a deep check; a missing one by any.
    victim, lost = built[10][1], built[20][1]
    tier.put(victim.key, b"\0" * victim.size)
    tier.delete(lost.key)
    with ThreadPoolExecutor(16) as pool:
        deep = verify_queue(tier, "c", "b", "many", 0, lock=lock, pool=pool, deep=True)
    assert deep.status == FAILURE and deep.missing == [lost.key], deep
    assert [d.split(":")[0] for d in deep.damaged] == [victim.key]
    assert verify_queue(tier, "c", "b", "many", 0, lock=lock).missing == [lost.key]


def test_a_verify_that_could_not_run_exits_3_not_warning() -> None:
    """Exit 1 is WARNING (orphans only): a check that never ran must not read as one to a
    script (decision 692). One line on stderr, no traceback."""
    done = tmq("verify", "-n", "127.0.0.1:1", "--json")
    assert done.returncode == 3, (done.returncode, done.stderr)
    assert done.stdout == ""
    assert done.stderr.startswith("error: ") and "Traceback" not in done.stderr
