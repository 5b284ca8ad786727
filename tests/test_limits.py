"""Limits that hold under hostile input, against a real broker process: bounded decompression,
capped auto-creation, and group metadata whose cost does not grow with the number of groups."""

from __future__ import annotations

import os
import statistics
import threading
import time
import zlib
from pathlib import Path

import grpc
import pytest
from broker_harness import Standalone
from rocketmq.grpc_protocol import definition_pb2 as d
from rocketmq.grpc_protocol import service_pb2 as s
from rocketmq.grpc_protocol import service_pb2_grpc

from broker import admin_pb2 as apb
from tiered.config import StoreConfig
from tiered.store import MessageStore, recorded_geometry

MiB = 1 << 20


def gzip_bomb(inflated: int) -> bytes:
    """A GZIP body of about inflated/1000 bytes that inflates to ``inflated`` zero bytes."""
    packer = zlib.compressobj(9, zlib.DEFLATED, zlib.MAX_WBITS | 16)
    zeros = bytes(MiB)
    parts = [packer.compress(zeros) for _ in range(inflated // MiB)]
    parts.append(packer.flush())
    return b"".join(parts)


def send_one(
    stub: service_pb2_grpc.MessagingServiceStub, topic: str, body: bytes, gz: bool
) -> d.Status:
    request = s.SendMessageRequest()
    m = request.messages.add(topic=d.Resource(name=topic), body=body)
    m.system_properties.message_id = os.urandom(16).hex().upper()
    m.system_properties.message_type = d.NORMAL
    m.system_properties.body_encoding = d.GZIP if gz else d.IDENTITY
    reply = stub.SendMessage(request, timeout=120)
    return reply.status


def peak_rss_bytes(pid: int) -> int:
    """The process's peak resident set (VmHWM): a spike between two samples still shows."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


def test_gzip_bombs_are_refused_without_inflating_them(tmp_path: Path) -> None:
    node = Standalone(tmp_path / "data").start()
    try:
        node.create_topic("bombs", queues=1)
        stub = service_pb2_grpc.MessagingServiceStub(grpc.insecure_channel(node.endpoint))
        # A legitimate compressed body still inflates.
        ok = zlib.compress(b"hello " * 1000)
        assert send_one(stub, "bombs", ok, gz=True).code == d.OK
        assert node.proc is not None
        before = peak_rss_bytes(node.proc.pid)
        bomb = gzip_bomb(512 * MiB)  # about 0.5 MiB on the wire
        assert len(bomb) < 2 * MiB
        codes: list[int] = []

        def fire() -> None:
            codes.append(send_one(stub, "bombs", bomb, gz=True).code)

        threads = [threading.Thread(target=fire) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        growth = peak_rss_bytes(node.proc.pid) - before
        assert codes == [d.MESSAGE_BODY_TOO_LARGE] * 4
        # Four bombs of 512 MiB each; the limit is 4 MiB a body. Unbounded, the peak grew by
        # at least one whole inflated body.
        assert growth < 128 * MiB, f"peak RSS grew by {growth / MiB:.0f} MiB"
        # Truncated GZIP is corrupt, not too large, and the broker still serves.
        assert send_one(stub, "bombs", ok[: len(ok) // 2], gz=True).code == d.MESSAGE_CORRUPTED
        assert send_one(stub, "bombs", b"plain", gz=False).code == d.OK
    finally:
        node.stop()


def test_a_grpc_compressed_request_past_the_message_limit_is_refused_without_inflating_it(
    tmp_path: Path,
) -> None:
    """gRPC's own message compression (``grpc-encoding: gzip``, the transport's, not the body's
    ``GZIP`` encoding) is a second way to send a bomb: 160 MiB of zeros, 160 KiB on the wire,
    against the broker's 64 MiB ``grpc.max_receive_message_length``. grpc-core must refuse it
    with RESOURCE_EXHAUSTED, bounding its inflation by the limit, and the broker keeps serving
    (decision 768)."""
    node = Standalone(tmp_path / "data").start()
    try:
        node.create_topic("wire", queues=1)
        stub = service_pb2_grpc.MessagingServiceStub(grpc.insecure_channel(node.endpoint))
        assert node.proc is not None
        assert send_one(stub, "wire", b"warm", gz=False).code == d.OK
        before = peak_rss_bytes(node.proc.pid)
        request = s.SendMessageRequest()
        m = request.messages.add(topic=d.Resource(name="wire"), body=bytes(160 * MiB))
        m.system_properties.message_id = os.urandom(16).hex().upper()
        m.system_properties.message_type = d.NORMAL
        with pytest.raises(grpc.RpcError) as e:
            stub.SendMessage(request, timeout=120, compression=grpc.Compression.Gzip)
        del request, m
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e.value
        growth = peak_rss_bytes(node.proc.pid) - before
        # grpc-core inflates up to the limit, then refuses: the peak grew by 68 MiB here (the
        # limit's buffer). Inflated whole before the check, it would grow by 160 MiB at least.
        assert growth < 128 * MiB, f"peak RSS grew by {growth / MiB:.0f} MiB"
        assert send_one(stub, "wire", b"after", gz=False).code == d.OK
    finally:
        node.stop()


@pytest.mark.parametrize("limit", [4 * MiB])
def test_a_body_at_the_limit_inflates_and_one_byte_more_is_refused(limit: int) -> None:
    from broker.protocol import ProtocolError, inflate

    exact = zlib.compress(bytes(limit))
    assert len(inflate(exact, limit)) == limit
    with pytest.raises(ProtocolError) as e:
        inflate(zlib.compress(bytes(limit + 1)), limit)
    assert e.value.code == d.MESSAGE_BODY_TOO_LARGE


def heartbeat(stub: service_pb2_grpc.MessagingServiceStub, group: str) -> d.Status:
    request = s.HeartbeatRequest(group=d.Resource(name=group), client_type=d.SIMPLE_CONSUMER)
    return stub.Heartbeat(request, timeout=30).status


def test_group_cost_stays_flat_as_groups_accumulate(tmp_path: Path) -> None:
    from broker.metadata import BrokerMetadata

    meta = BrokerMetadata(tmp_path / "config")
    meta.load()
    costs: list[float] = []
    for i in range(3000):
        started = time.perf_counter()
        meta.auto_create_group(f"group-{i}", limit=10_000)
        costs.append(time.perf_counter() - started)
    meta.close()
    first = statistics.median(costs[:300])
    last = statistics.median(costs[-300:])
    # Rewriting every group per group made the 3,000th cost 30x the first.
    assert last < 3 * first + 0.002, f"first {first * 1e3:.2f} ms, last {last * 1e3:.2f} ms"
    again = BrokerMetadata(tmp_path / "config")
    again.load()
    assert len(again.groups) == 3000 and again.auto_created_groups == 3000
    assert (tmp_path / "config" / "groups.json").exists(), "the log should have been compacted"


def test_auto_created_groups_are_capped_and_survive_kill_9(tmp_path: Path) -> None:
    node = Standalone(tmp_path / "data", env={"TMQ_LIMITS_MAX_AUTO_CREATED_GROUPS": "5"}).start()
    try:
        stub = service_pb2_grpc.MessagingServiceStub(grpc.insecure_channel(node.endpoint))
        for i in range(5):
            assert heartbeat(stub, f"auto-{i}").code == d.OK
        refused = heartbeat(stub, "auto-5")
        assert refused.code == d.CONSUMER_GROUP_NOT_FOUND
        assert "max_auto_created_groups" in refused.message
        assert heartbeat(stub, "auto-0").code == d.OK  # existing groups still answer
        node.create_group("by-operator")  # the cap is on clients, not on operators
        assert heartbeat(stub, "by-operator").code == d.OK
        node.kill9()
        node.start()
        stub = service_pb2_grpc.MessagingServiceStub(grpc.insecure_channel(node.endpoint))
        names = {
            g.name for g in node.admin().ListGroups(apb.ListGroupsRequest(), timeout=10).groups
        }
        assert names == {f"auto-{i}" for i in range(5)} | {"by-operator"}
        assert heartbeat(stub, "auto-6").code == d.CONSUMER_GROUP_NOT_FOUND
    finally:
        node.stop()


def test_a_batch_with_one_hostile_message_is_refused_whole_and_stores_nothing(
    tmp_path: Path,
) -> None:
    """Each hostile message rides in a batch behind a valid one: the native send path must
    answer the specific code and store no message of the batch (not the valid one before it),
    and a hostile topic name must create nothing, inside the data dir or outside it."""
    node = Standalone(tmp_path / "data", flush="sync").start()
    try:
        node.create_topic("hostile", queues=1)
        channel = grpc.insecure_channel(node.endpoint)
        stub = service_pb2_grpc.MessagingServiceStub(channel)

        def batch(label: str, topic: str = "hostile") -> tuple[s.SendMessageRequest, d.Message]:
            request = s.SendMessageRequest()
            for i in range(2):
                m = request.messages.add(topic=d.Resource(name=topic), body=b"body")
                m.system_properties.message_id = f"{label}-{i}"
                m.system_properties.message_type = d.NORMAL
            return request, request.messages[1]

        cases: list[tuple[str, s.SendMessageRequest, int]] = []
        request, m = batch("oversized")
        m.body = bytes(4 * MiB + 1)
        cases.append(("oversized", request, d.MESSAGE_BODY_TOO_LARGE))
        request, m = batch("crc")
        m.user_properties["__CRC32#"] = "1"  # the record CRC's own property (decision 210)
        cases.append(("crc", request, d.ILLEGAL_MESSAGE_PROPERTY_KEY))
        request, m = batch("separator")
        m.user_properties["k"] = "a\x01b\x02c"  # the record's property separators
        cases.append(("separator", request, d.ILLEGAL_MESSAGE_PROPERTY_KEY))
        request, m = batch("many")
        for i in range(10_000):
            m.user_properties[f"p{i}"] = "v"
        cases.append(("many", request, d.MESSAGE_PROPERTIES_TOO_LARGE))
        request, m = batch("bomb")
        m.system_properties.body_encoding = d.GZIP
        m.body = gzip_bomb(8 * MiB)
        cases.append(("bomb", request, d.MESSAGE_BODY_TOO_LARGE))
        request, m = batch("notgzip")
        m.system_properties.body_encoding = d.GZIP
        m.body = b"not gzip at all"
        cases.append(("notgzip", request, d.MESSAGE_CORRUPTED))
        request, _ = batch("escape", topic="../../escape")
        cases.append(("escape", request, d.ILLEGAL_TOPIC))
        for label, request, code in cases:
            reply = stub.SendMessage(request, timeout=60)
            assert reply.status.code == code, (label, reply.status)
            assert not reply.entries, label
        # Invalid UTF-8 in the topic name: refused by the request's parse, as a bad argument.
        raw = (
            batch("utf8")[0].SerializeToString().replace(b"\x12\x07hostile", b"\x12\x07hos\xfftle")
        )
        send_raw = channel.unary_unary(
            "/apache.rocketmq.v2.MessagingService/SendMessage",
            request_serializer=lambda b: b,
            response_deserializer=s.SendMessageResponse.FromString,
        )
        with pytest.raises(grpc.RpcError) as e:
            send_raw(raw, timeout=30)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        request, _ = batch("after")
        assert stub.SendMessage(request, timeout=60).status.code == d.OK
    finally:
        node.stop()
    assert not (tmp_path / "escape").exists() and not (tmp_path / "data" / "escape").exists()
    geometry = recorded_geometry(tmp_path / "data")
    assert geometry is not None
    store = MessageStore(StoreConfig(data_dir=tmp_path / "data", **geometry))  # type: ignore[arg-type]
    store.start()
    try:
        got = store.get_messages("hostile", 0, 0, 100)
        assert [m.msg_id for m in got.messages] == ["after-0", "after-1"]
    finally:
        store.shutdown()
