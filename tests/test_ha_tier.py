"""Tiered storage in a replica group, with real broker processes and LocalStack S3: only the
master uploads; a deposed master that still believes it leads is fenced by the manifest and
keeps its files; the new master resumes at the watermark with no range uploaded twice; a master
uploads only what its in-sync slaves hold; a slave releases local files only below the
watermark its master committed."""

from __future__ import annotations

import os
import signal
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from rocketmq.grpc_protocol import definition_pb2 as d

from broker import admin_pb2 as apb
from broker import admin_pb2_grpc as apb_grpc
from tests.broker_harness import sigstop
from tests.test_ha import QUEUES, TOPIC, GroupMember, caught_up, open_store, send, wait_until
from tiered.cold.manifest import ManifestLog, QueueManifest, queue_prefix
from tiered.cold.segment import SegmentReader
from tiered.cold.storage import ObjectStore
from tiered.cold.storage import open_store as open_tier

pytest_plugins = ["tests.test_ha"]  # the group fixture

CLUSTER = "DefaultCluster"


def tier_env(s3, bucket: str) -> dict[str, str]:  # type: ignore[no-untyped-def]
    return {
        **s3.env(),
        "TMQ_TIER_URL": f"s3://{bucket}/tier",
        "TMQ_BROKER_OFFLOAD_INTERVAL_MS": "1000",
    }


def admin(member: GroupMember) -> apb_grpc.AdminStub:
    return apb_grpc.AdminStub(grpc.insecure_channel(member.endpoint))


def create_tiered_topic(member: GroupMember) -> None:
    admin(member).PutTopic(
        apb.PutTopicRequest(
            topic=apb.Topic(name=TOPIC, queues=QUEUES, perm=6, message_type="NORMAL", tiered=True)
        ),
        timeout=10,
    )


def replicated_tiered_topic(
    group, env: dict[str, str], count: int
) -> tuple[GroupMember, GroupMember]:  # type: ignore[no-untyped-def]
    """Master a and its slave b (ASYNC) with a tiered topic of ``count`` messages on both."""
    a, b = group("a"), group("b")
    a.start("master", 0, mode="async", env=env)
    b.start("slave", 1, master=a, env=env)
    create_tiered_topic(a)
    assert all(st.code == d.OK for st in send(a.endpoint, 0, count))
    wait_until("b caught up", lambda: caught_up(a, b))
    wait_until("b has the topic", b.has_topic)
    return a, b


def offload(member: GroupMember, keep_local_bytes: int = 0) -> list[int]:
    """``tmq offload TOPIC``: each queue's watermark after it."""
    reply = admin(member).Offload(
        apb.OffloadRequest(topic=TOPIC, queue=-1, keep_local_bytes=keep_local_bytes), timeout=60
    )
    return [q.watermark for q in reply.queues]


def manifests(tier: ObjectStore) -> list[QueueManifest]:
    return [
        ManifestLog(tier, queue_prefix(CLUSTER, "broker-a", TOPIC, q)).load() for q in range(QUEUES)
    ]


def archived_texts(tier: ObjectStore, manifest: QueueManifest) -> list[bytes]:
    """The message numbers of the queue's archive, in queue-offset order."""
    out: list[bytes] = []
    for info in manifest.segments:
        batch = SegmentReader(tier, info).read(info.base_offset, info.count)
        assert [m.queue_offset for m in batch] == list(range(info.base_offset, info.end_offset))
        out += [m.body.split(b" ")[1] for m in batch]
    return out


def released(member: GroupMember) -> float:
    """CommitLog files the member deleted locally since it started."""
    value = member.metric("tmq_commitlog_files_released_total")
    assert value is not None
    return value


def health(member: GroupMember) -> int:
    stub = health_pb2_grpc.HealthStub(grpc.insecure_channel(member.endpoint))
    return int(stub.Check(health_pb2.HealthCheckRequest(), timeout=5).status)


def test_a_deposed_master_is_fenced_and_the_new_master_resumes_at_the_watermark(
    group, s3, bucket: str
) -> None:  # type: ignore[no-untyped-def]
    env = tier_env(s3, bucket)
    tier = open_tier(f"s3://{bucket}/tier", s3.storage_options())
    a, b = replicated_tiered_topic(group, env, 300)
    with pytest.raises(grpc.RpcError, match="slave"):
        offload(b)  # a slave never uploads
    assert sum(offload(a)) == 300
    first_keys = {s.key for m in manifests(tier) for s in m.segments}
    assert {m.epoch for m in manifests(tier)} == {1}
    assert all(st.code == d.OK for st in send(a.endpoint, 300, 150))
    wait_until("b caught up", lambda: caught_up(a, b))

    # b is promoted (epoch 2) while a, cut off from it, still believes it leads epoch 1.
    b.stop()
    b.start("master", 0, mode="async", env=env)
    assert b.metric("tmq_replication_epoch") == 2
    # Its first offload pass claims every tiered queue for epoch 2, though none is due.
    wait_until("b claimed every queue", lambda: {m.epoch for m in manifests(tier)} == {2})
    assert [m.end_offset for m in manifests(tier)] == [100, 100, 100]
    assert sum(offload(b)) == 450  # resumes at the watermark
    after_b = manifests(tier)
    assert {m.epoch for m in after_b} == {2}
    assert {m.writer for m in after_b} == {f"broker-a@127.0.0.1:{b.grpc_port}"}

    # a takes a few more sends (its divergent tail), then tries to upload them: refused.
    assert all(st.code == d.OK for st in send(a.endpoint, 1000, 60))
    with pytest.raises(grpc.RpcError, match="fenced") as refused:
        offload(a)
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    assert a.metric("tmq_tier_fenced") == 1
    assert b.metric("tmq_tier_fenced") == 0
    wait_until(
        "a reports NOT_SERVING", lambda: health(a) == health_pb2.HealthCheckResponse.NOT_SERVING
    )
    assert all(st.code == d.HA_NOT_AVAILABLE for st in send(a.endpoint, 2000, 20))
    assert "fenced" in a.log_path.read_text()

    # Nothing of a's reached the tier, and a kept every file though b's watermark (450) now
    # covers a's first CommitLog file: it must not trust an archive it could not commit to.
    assert manifests(tier) == after_b
    objects = {o.key for o in tier.list(f"{CLUSTER}/broker-a/{TOPIC}/") if "/segments/" in o.key}
    assert objects == {s.key for m in after_b for s in m.segments}  # a's upload was taken back
    assert first_keys <= objects  # b uploaded nothing twice: a's segments stand as they were
    for m in after_b:
        assert [s.base_offset for s in m.segments[1:]] == [s.end_offset for s in m.segments[:-1]]
    texts = [t for m in after_b for t in archived_texts(tier, m)]
    assert sorted(texts) == sorted(str(n).encode() for n in range(450))  # no gap, no duplicate
    time.sleep(2.5)  # two more offload passes (1 s apart), each followed by release
    assert (a.data_dir / "commitlog" / f"{0:020d}").exists()
    assert released(a) == 0

    # a rejoins as b's slave: its divergent tail is cut, and now it may release below b's
    # watermark (its log below it is b's).
    a.kill9()
    a.start("slave", 1, master=b, env=env)
    wait_until("a caught up with b", lambda: caught_up(b, a))
    assert a.metric("tmq_tier_fenced") == 0
    wait_until("a released its first file", lambda: released(a) > 0, 20)
    assert manifests(tier) == after_b
    verdict = admin(b).Verify(apb.VerifyRequest(topic=TOPIC), timeout=60)
    assert verdict.status == "OK", verdict
    a.stop()
    b.stop()


def test_uploads_wait_for_the_in_sync_slave_which_releases_only_below_the_watermark(
    group, s3, bucket: str
) -> None:  # type: ignore[no-untyped-def]
    # b stays in the SyncStateSet for a minute without acknowledging: a lagging member.
    env = {**tier_env(s3, bucket), "TMQ_HA_MAX_LAG_MS": "60000"}
    a, b = replicated_tiered_topic(group, env, 1500)
    wait_until("a knows b holds everything", lambda: a.metric("tmq_replication_lag_bytes") == 0)
    assert b.proc is not None
    sigstop(b.proc.pid)
    try:
        assert all(st.code == d.OK for st in send(a.endpoint, 1500, 600))  # ASYNC: acked
        assert a.metric("tmq_replication_sync_state_set_size") == 2
        # The master archives only what every in-sync member holds: b lacks the last 600.
        watermarks = offload(a)
        assert sum(watermarks) == 1500
    finally:
        os.kill(b.proc.pid, signal.SIGCONT)
    wait_until("b caught up", lambda: caught_up(a, b))
    # The CommitLog files below the watermark go on the master...
    wait_until("a released files", lambda: released(a) > 0)
    # ...and on the slave, from the watermark it reads in the tier, never above it.
    wait_until("b released files", lambda: released(b) > 0, 20)
    described = admin(b).GetTopic(apb.GetTopicRequest(name=TOPIC), timeout=10)
    assert [q.tier_watermark for q in described.queues] == watermarks
    for q, watermark in zip(described.queues, watermarks, strict=True):
        assert 0 < q.hot_min_offset <= watermark
    final = offload(a)
    assert sum(final) == 2100  # b holds everything again: the rest goes up
    b.stop()
    a.stop()
    # The second offload moved the watermark, so b may have released more meanwhile: up to
    # the new watermark, never above it, and what it keeps runs whole to the end.
    with open_store(b.data_dir) as store:
        assert store.min_physical_offset > 0
        assert sum(store.max_offset(TOPIC, q) for q in range(QUEUES)) == 2100
        for q, watermark in enumerate(final):
            first = store.hot_min_offset(TOPIC, q)
            assert first <= watermark
            kept = store.get_messages(TOPIC, q, first, max_count=2000).messages
            assert [m.queue_offset for m in kept] == list(range(first, store.max_offset(TOPIC, q)))
