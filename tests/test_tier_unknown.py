"""A broker restarted while its object store is down cannot load its manifests. It answers
where a tiered queue's archive starts from its local record (``archive-starts.json``), and
without one says it does not know (PROXY_TIMEOUT, a retry): never the hot store's first offset,
which sends a reader past the archive for good (the torture test saw a replay jump from 0 to
3018; a new group started past the archive). Decision 520."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import grpc
import pytest
from broker_harness import Standalone, send_batches
from rocketmq.grpc_protocol import definition_pb2 as d
from rocketmq.grpc_protocol import service_pb2 as s
from rocketmq.grpc_protocol import service_pb2_grpc
from test_tier_readers import _archived_behind_proxy, body_of, end_offset, pull

from broker import admin_pb2 as apb

ARCHIVED = 1200


def archived(tmp_path: Path, fault_proxy: Any, bucket: str) -> Standalone:
    """A tiered one-queue topic "kept" of ``ARCHIVED`` messages, its first CommitLog file
    released, and a never-tiered topic "plain" of 50; S3 through the fault proxy, with few
    retries so that a start during an outage takes seconds, not the default retries' 16."""
    config = tmp_path / "tmq.toml"
    config.write_text("[retry]\nattempts = 2\nbase_delay_s = 0.1\n")
    node = _archived_behind_proxy(
        tmp_path, fault_proxy, bucket, "kept", ARCHIVED, "--config", str(config)
    )
    node.admin().PutTopic(
        apb.PutTopicRequest(topic=apb.Topic(name="plain", queues=1, perm=6)), timeout=10
    )
    send_batches(node.endpoint, "plain", [(body_of(i), f"p{i}", "t") for i in range(50)])
    return node


def restart_in_outage(node: Standalone, fault_proxy: Any, *, forget: bool) -> Any:
    """Stop, make every S3 read fail, start (``forget``: without the local record of where
    the archives start, as a broker upgraded from a version that kept none); a stub."""
    record = node.data_dir / "config" / "archive-starts.json"
    assert node.stop() == 0
    assert json.loads(record.read_text())["queues"] == [["kept", 0, 0]]
    if forget:
        record.unlink()
    fault_proxy.set(error_rate=1.0, error_status=503, methods=["GET"])  # no read answers
    node.start()
    return service_pb2_grpc.MessagingServiceStub(grpc.insecure_channel(node.endpoint))


def plain_reads_as_always(stub: Any) -> None:
    """A never-tiered topic is not held up by the outage of a tier it does not use."""
    plain = pull(stub, "plain", 0, 0, 64)
    assert plain.code == d.OK and plain.offsets == list(range(50)), plain
    assert query(stub, "plain", d.BEGINNING) == (d.OK, 0)


def receive_all(consumer: Any, count: int, seconds: float = 120) -> list[int]:
    received: list[int] = []
    deadline = time.monotonic() + seconds
    while len(received) < count and time.monotonic() < deadline:
        try:
            batch = consumer.receive(32, 30)
        except Exception:  # ProxyTimeoutException while the archive is read back
            time.sleep(0.2)
            continue
        for m in batch:
            received.append(offset_of(m))
            consumer.ack(m)
    return received


def new_group_during_outage(node: Standalone, name: str) -> Any:
    """A SimpleConsumer of a group with no committed offset, started during the outage: its
    receives are refused as retryable (ProxyTimeoutException), nothing is delivered."""
    from rocketmq import ClientConfiguration, Credentials, FilterExpression, SimpleConsumer

    node.create_group(name)
    consumer = SimpleConsumer(
        ClientConfiguration(node.endpoint, Credentials(), request_timeout=10),
        name,
        {"kept": FilterExpression()},
        await_duration=1,
    )
    consumer.startup()
    early: list[int] = []
    refused = 0
    try:
        for _ in range(3):
            try:
                early += [offset_of(m) for m in consumer.receive(32, 30)]
            except Exception as e:  # the client raises on a non-OK status: retryable here
                assert type(e).__name__ == "ProxyTimeoutException", repr(e)
                refused += 1
        assert early == [] and refused == 3, f"a new group received {early[:5]} in the outage"
    except BaseException:
        consumer.shutdown()
        raise
    return consumer


def query(stub: Any, topic: str, policy: int, at_ms: int = 0) -> tuple[int, int]:
    """QueryOffset: (status code, offset)."""
    request = s.QueryOffsetRequest(
        message_queue=d.MessageQueue(topic=d.Resource(name=topic), id=0),
        query_offset_policy=policy,
    )
    if policy == d.TIMESTAMP:
        request.timestamp.FromMilliseconds(at_ms)
    reply = stub.QueryOffset(request, timeout=10)
    return reply.status.code, int(reply.offset)


def key_lookup(node: Standalone, key: str) -> tuple[grpc.StatusCode, list[int]]:
    """``tmq query``'s RPC for ``key`` in "kept": its status and the queue offsets found."""
    try:
        found = node.admin().QueryByKey(apb.QueryByKeyRequest(topic="kept", key=key), timeout=30)
    except grpc.RpcError as e:
        return e.code(), []
    return grpc.StatusCode.OK, [m.queue_offset for m in found.messages]


def offset_of(message: Any) -> int:
    """The queue offset a ``body_of`` body names (the client's Message does not carry it)."""
    return int(message.body[:7])


def replay(stub: Any, topic: str, end: int, seconds: float = 60) -> list[int]:
    """Every offset a reader starting at 0 is given up to ``end``, as the torture test's reader
    does: PROXY_TIMEOUT is retried; ILLEGAL_OFFSET is followed to QueryOffset(BEGINNING)."""
    offsets: list[int] = []
    offset = 0
    deadline = time.monotonic() + seconds
    while offset < end:
        assert time.monotonic() < deadline, f"no progress at {offset}"
        got = pull(stub, topic, 0, offset, 256)
        if got.code == d.ILLEGAL_OFFSET:
            code, begin = query(stub, topic, d.BEGINNING)
            if code != d.OK:
                time.sleep(0.2)
                continue
            offset = begin  # what a reader does: the jump this file is about
            continue
        if got.code == d.PROXY_TIMEOUT:
            time.sleep(0.2)
            continue
        assert got.code == d.OK, got
        offsets += got.offsets
        offset = got.offsets[-1] + 1
    return offsets


def test_a_broker_restarted_during_an_outage_without_its_record_answers_retry_not_hot_minimum(
    tmp_path: Path, fault_proxy: Any, bucket: str
) -> None:
    """The reproduction (it failed before decision 520: QueryOffset(BEGINNING) answered the
    hot minimum, 1167). Restarted with every S3 read failing and no local record of the
    archive's start, the broker answers QueryOffset(BEGINNING), QueryOffset(TIMESTAMP) of the
    archive's time, a pull from 0 and a new group's receives with PROXY_TIMEOUT; the
    never-tiered topic reads as always. Once the store heals, the same reader gets every
    archived message in order, and the new group starts at 0."""
    node = archived(tmp_path, fault_proxy, bucket)
    consumer = None
    try:
        sent_ms = int(time.time() * 1000) - 600_000  # before every message
        stub = restart_in_outage(node, fault_proxy, forget=True)
        assert end_offset(stub, "kept", 0) == ARCHIVED
        code, begin = query(stub, "kept", d.BEGINNING)
        assert code == d.PROXY_TIMEOUT, f"told the queue begins at {begin} during the outage"
        code, at = query(stub, "kept", d.TIMESTAMP, sent_ms)
        assert code == d.PROXY_TIMEOUT, f"told the archive's time maps to {at}"
        cold = pull(stub, "kept", 0, 0)
        assert cold.code == d.PROXY_TIMEOUT, cold
        # An archived key is not "not found" while the archive cannot be asked (decision 661).
        assert key_lookup(node, "k0") == (grpc.StatusCode.UNAVAILABLE, [])
        plain_reads_as_always(stub)
        consumer = new_group_during_outage(node, "late-joiner")

        fault_proxy.heal()
        assert replay(stub, "kept", ARCHIVED) == list(range(ARCHIVED))
        assert key_lookup(node, "k0") == (grpc.StatusCode.OK, [0])
        assert query(stub, "kept", d.BEGINNING) == (d.OK, 0)
        assert receive_all(consumer, ARCHIVED) == list(range(ARCHIVED))
    finally:
        fault_proxy.heal()
        if consumer is not None:
            consumer.shutdown()
        node.stop()


def test_a_broker_restarted_during_an_outage_answers_the_archive_start_from_its_record(
    tmp_path: Path, fault_proxy: Any, bucket: str
) -> None:
    """With its local record (``archive-starts.json``, written when the manifest was
    committed), the restarted broker answers QueryOffset(BEGINNING) with the archive's start
    during the outage, as Kafka answers EARLIEST from its checkpointed log start offset; the
    reads themselves wait for the store (PROXY_TIMEOUT), a new group starts at 0 and is told to
    retry, and after the outage it receives every message from 0."""
    node = archived(tmp_path, fault_proxy, bucket)
    consumer = None
    try:
        stub = restart_in_outage(node, fault_proxy, forget=False)
        assert query(stub, "kept", d.BEGINNING) == (d.OK, 0)
        cold = pull(stub, "kept", 0, 0)
        assert cold.code == d.PROXY_TIMEOUT, cold
        assert key_lookup(node, "k0") == (grpc.StatusCode.UNAVAILABLE, [])
        assert key_lookup(node, f"k{ARCHIVED - 1}") == (grpc.StatusCode.UNAVAILABLE, [])
        plain_reads_as_always(stub)
        consumer = new_group_during_outage(node, "late-joiner")

        fault_proxy.heal()
        assert receive_all(consumer, ARCHIVED) == list(range(ARCHIVED))
        assert replay(stub, "kept", ARCHIVED) == list(range(ARCHIVED))
        assert key_lookup(node, "k0") == (grpc.StatusCode.OK, [0])
    finally:
        fault_proxy.heal()
        if consumer is not None:
            consumer.shutdown()
        node.stop()


def test_the_store_never_answers_a_minimum_it_does_not_know(
    tmp_path: Path, s3: Any, bucket: str, fault_proxy: Any
) -> None:
    """In process, through the fault proxy: with no manifest loaded and S3 reads failing, a
    tiered queue's first offset, a read below its hot store and a time lookup there are
    ``ColdTierUnavailableError`` (a list of tiered queues that cannot be read counts every
    queue as tiered); a never-tiered queue whose old files were released answers its hot
    minimum. Once the store answers, a read of that never-tiered queue below its hot store is
    OFFSET_TOO_SMALL (the empty manifest says there is no archive), and a fetcher started later
    with the local record answers the archive's start while the store is down again."""
    from conftest import S3Endpoint

    from offload.offloader import Offloader, OffloadPolicy
    from tiered.cold.fetcher import ColdFetcher, ColdTierUnavailableError
    from tiered.cold.storage import RetryPolicy, open_store
    from tiered.config import StoreConfig
    from tiered.record import Message
    from tiered.store import GetStatus, MessageStore

    url = f"s3://{bucket}/tier"
    hot = MessageStore(StoreConfig(data_dir=tmp_path / "hot", commitlog_file_size=256 << 10))
    hot.start()
    fetchers: list[ColdFetcher] = []
    try:
        for topic in ("t", "plain"):
            hot.put_messages(
                [Message(topic=topic, queue_id=0, body=body_of(i)) for i in range(600)]
            )
        assert hot.wait_dispatched(10)
        direct = open_store(url, s3.storage_options())
        Offloader(hot, direct, "c", "b", OffloadPolicy(segment_max_messages=200)).offload_queue(
            "t", 0
        )
        assert hot.release_commitlog_files(lambda _file: True) >= 1
        hot_t, hot_plain = hot.hot_min_offset("t", 0), hot.hot_min_offset("plain", 0)
        assert hot_t > 0 and hot_plain > 0

        proxied = open_store(
            url, S3Endpoint(fault_proxy.url, "proxy").storage_options(), RetryPolicy(attempts=1)
        )
        record = tmp_path / "archive-starts.json"

        def fetcher(tiered: Any) -> ColdFetcher:
            f = ColdFetcher(
                proxied, "c", "b", tiered_queues=tiered, archive_starts=record, read_timeout_s=2
            )
            fetchers.append(f)
            hot.cold = f
            return f

        def unreadable() -> list[tuple[str, int]]:
            raise RuntimeError("metadata being rewritten")

        fault_proxy.set(error_rate=1.0, error_status=503, methods=["GET"])
        for tiered in (lambda: [("t", 0)], unreadable):
            fetcher(tiered)
            with pytest.raises(ColdTierUnavailableError):
                hot.min_offset("t", 0)
            with pytest.raises(ColdTierUnavailableError):
                hot.get_messages("t", 0, 0, 10)
            with pytest.raises(ColdTierUnavailableError):
                hot.offset_for_timestamp("t", 0, 0)
        fetcher(lambda: [("t", 0)])
        assert hot.min_offset("plain", 0) == hot_plain
        assert hot.get_messages("plain", 0, hot_plain, 5).status is GetStatus.FOUND

        fault_proxy.heal()
        fetcher(unreadable)
        below = hot.get_messages("plain", 0, 0, 5)
        assert (below.status, below.next_offset) == (GetStatus.OFFSET_TOO_SMALL, hot_plain)
        got = hot.get_messages("t", 0, 0, 5)  # loads the manifest: the record is written
        assert got.status is GetStatus.FOUND and [m.queue_offset for m in got.messages] == [
            0,
            1,
            2,
            3,
            4,
        ]
        assert json.loads(record.read_text())["queues"] == [["t", 0, 0]]

        fault_proxy.set(error_rate=1.0, error_status=503, methods=["GET"])
        fetcher(lambda: [])  # even with the topic no longer tiered: the record names it
        assert hot.min_offset("t", 0) == 0
        with pytest.raises(ColdTierUnavailableError):
            hot.get_messages("t", 0, 0, 10)
    finally:
        fault_proxy.heal()
        for f in fetchers:
            f.close()
        hot.cold = None
        hot.shutdown()
