"""A broker restarted while its object store is down does not know where its archives start: it
must say so (a retryable status), never answer the hot store's first offset as the queue's. A
reader told that the queue starts there skips the archive for good (the torture test saw a
replay jump from 0 to 3018, and a new group would start past the archive)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import grpc
from broker_harness import send_batches
from rocketmq.grpc_protocol import definition_pb2 as d
from rocketmq.grpc_protocol import service_pb2 as s
from rocketmq.grpc_protocol import service_pb2_grpc
from test_tier_readers import _archived_behind_proxy, body_of, end_offset, pull

from broker import admin_pb2 as apb

ARCHIVED = 1200


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


def test_a_broker_restarted_during_an_outage_never_moves_a_reader_past_its_archive(
    tmp_path: Path, fault_proxy: Any, bucket: str
) -> None:
    """Restarted with every S3 request failing, the broker cannot load the tiered queue's
    manifest. QueryOffset(BEGINNING), QueryOffset(TIMESTAMP) of the archive's time, a pull from
    0 and a new group's first receive are answered PROXY_TIMEOUT, not with the hot store's
    first offset; a never-tiered topic reads as always. Once the store heals, the same reader
    gets every archived message in order, and the new group starts at 0."""
    from rocketmq import ClientConfiguration, Credentials, FilterExpression, SimpleConsumer

    node = _archived_behind_proxy(tmp_path, fault_proxy, bucket, "kept", ARCHIVED)
    consumers: list[Any] = []
    try:
        node.admin().PutTopic(
            apb.PutTopicRequest(topic=apb.Topic(name="plain", queues=1, perm=6)), timeout=10
        )
        send_batches(node.endpoint, "plain", [(body_of(i), f"p{i}", "t") for i in range(50)])
        sent_ms = int(time.time() * 1000) - 600_000  # before every message
        assert node.stop() == 0
        fault_proxy.set(error_rate=1.0, error_status=503)  # the store refuses everything
        node.start()
        stub = service_pb2_grpc.MessagingServiceStub(grpc.insecure_channel(node.endpoint))
        end = end_offset(stub, "kept", 0)
        assert end == ARCHIVED

        code, begin = query(stub, "kept", d.BEGINNING)
        assert code == d.PROXY_TIMEOUT, f"told the queue begins at {begin} during the outage"
        code, at = query(stub, "kept", d.TIMESTAMP, sent_ms)
        assert code == d.PROXY_TIMEOUT, f"told the archive's time maps to {at}"
        cold = pull(stub, "kept", 0, 0)
        assert cold.code == d.PROXY_TIMEOUT, cold

        # A never-tiered topic is not held up by the outage of a tier it does not use.
        plain = pull(stub, "plain", 0, 0, 64)
        assert plain.code == d.OK and plain.offsets == list(range(50)), plain
        assert query(stub, "plain", d.BEGINNING) == (d.OK, 0)

        # A new group on the tiered topic: its first receive must not start past the archive.
        config = ClientConfiguration(node.endpoint, Credentials(), request_timeout=10)
        node.create_group("late-joiner")
        consumer = SimpleConsumer(
            config, "late-joiner", {"kept": FilterExpression()}, await_duration=1
        )
        consumers.append(consumer)
        consumer.startup()
        early: list[int] = []
        refused = 0
        for _ in range(3):
            try:
                early += [offset_of(m) for m in consumer.receive(32, 30)]
            except Exception as e:  # the client raises on a non-OK status: retryable here
                assert type(e).__name__ == "ProxyTimeoutException", repr(e)
                refused += 1
        assert early == [] and refused >= 1, f"a new group received {early[:5]} in the outage"

        fault_proxy.heal()
        assert replay(stub, "kept", ARCHIVED) == list(range(ARCHIVED))
        assert query(stub, "kept", d.BEGINNING) == (d.OK, 0)
        received: list[int] = []
        deadline = time.monotonic() + 120
        while len(received) < ARCHIVED and time.monotonic() < deadline:
            try:
                batch = consumer.receive(32, 30)
            except Exception:
                time.sleep(0.2)
                continue
            for m in batch:
                received.append(offset_of(m))
                consumer.ack(m)
        assert received == list(range(ARCHIVED)), (received[:5], len(received))
    finally:
        fault_proxy.heal()
        for consumer in consumers:
            consumer.shutdown()
        node.stop()
