"""5,000 malformed or hostile requests: the broker stays up, answers each one clearly, and writes
nothing outside its data dir."""

from __future__ import annotations

import contextlib
import random
import socket
from pathlib import Path

import grpc
import pytest
from broker_harness import Standalone
from rocketmq.grpc_protocol import definition_pb2 as d
from rocketmq.grpc_protocol import service_pb2 as s
from rocketmq.grpc_protocol import service_pb2_grpc

from broker import admin_pb2 as apb

HOSTILE_NAMES = [
    "../x",
    "..",
    "a/b",
    "/etc/passwd",
    "x" * 300,
    "",
    " ",
    "tab\there",
    "ünï",
    "a.b",
    "%RETRY%../x",
    "\x00",
    "a\x01b",
    "CON",
    "a" * 128,
    "$(rm -rf)",
]
METHODS = [
    "QueryRoute",
    "Heartbeat",
    "SendMessage",
    "QueryAssignment",
    "ReceiveMessage",
    "AckMessage",
    "ForwardMessageToDeadLetterQueue",
    "PullMessage",
    "UpdateOffset",
    "GetOffset",
    "QueryOffset",
    "EndTransaction",
    "NotifyClientTermination",
    "ChangeInvisibleDuration",
]
STREAMING = {"ReceiveMessage", "PullMessage"}


def files_outside(root: Path, data_dir: Path) -> set[Path]:
    return {p for p in root.rglob("*") if data_dir not in p.parents and p != data_dir}


def hostile_requests(rng: random.Random) -> list[tuple[str, object]]:
    out: list[tuple[str, object]] = []
    for name in HOSTILE_NAMES:
        topic = d.Resource(name=name)
        msg = d.Message(topic=topic, body=b"x")
        msg.system_properties.message_id = "id"
        out += [
            ("QueryRoute", s.QueryRouteRequest(topic=topic)),
            ("SendMessage", s.SendMessageRequest(messages=[msg])),
            (
                "ReceiveMessage",
                s.ReceiveMessageRequest(
                    group=d.Resource(name=name), message_queue=d.MessageQueue(topic=topic)
                ),
            ),
            ("Heartbeat", s.HeartbeatRequest(group=d.Resource(name=name))),
            (
                "PullMessage",
                s.PullMessageRequest(
                    group=d.Resource(name="g"), message_queue=d.MessageQueue(topic=topic)
                ),
            ),
        ]
    good = d.Resource(name="fuzz")

    def message(**sp: object) -> d.Message:
        m = d.Message(topic=good, body=b"body")
        m.system_properties.message_id = "mid"
        for k, v in sp.items():
            if k == "body":
                m.body = v  # type: ignore[assignment]
            elif k == "props":
                m.user_properties.update(v)  # type: ignore[arg-type]
            elif k == "keys":
                m.system_properties.keys.extend(v)  # type: ignore[arg-type]
            else:
                setattr(m.system_properties, k, v)
        return m

    bad_messages = [
        message(body=b""),
        message(body=b"x" * (4 * 1024 * 1024 + 1)),
        message(props={"a\x01": "b"}),
        message(props={"k": "v\x02"}),
        message(props={f"k{i}": "v" for i in range(500)}),
        message(props={"UNIQ_KEY": "forged"}),
        message(tag="a||b"),
        message(tag=" "),
        message(keys=["has space"]),
        message(message_id=""),
        message(message_group=""),
        message(message_type=d.FIFO),
        message(body_encoding=d.GZIP, body=b"not gzip"),
    ]
    for m in bad_messages:
        out.append(("SendMessage", s.SendMessageRequest(messages=[m])))
    out.append(("SendMessage", s.SendMessageRequest()))
    out.append(
        (
            "SendMessage",
            s.SendMessageRequest(
                messages=[message(), d.Message(topic=d.Resource(name="other"), body=b"x")]
            ),
        )
    )
    q = d.MessageQueue(topic=good, id=0)
    for invisible in (-5, 0, 10**12):
        r = s.ReceiveMessageRequest(group=d.Resource(name="g"), message_queue=q, batch_size=10**6)
        r.invisible_duration.seconds = invisible
        out.append(("ReceiveMessage", r))
    out.append(
        (
            "ReceiveMessage",
            s.ReceiveMessageRequest(
                group=d.Resource(name="g"),
                message_queue=q,
                # SQL92 is served; a malformed expression is refused.
                filter_expression=d.FilterExpression(type=d.SQL, expression="a > 1 AND ("),
            ),
        )
    )
    out.append(
        (
            "ReceiveMessage",
            s.ReceiveMessageRequest(
                group=d.Resource(name="g"),
                message_queue=q,
                filter_expression=d.FilterExpression(type=d.TAG, expression="||"),
            ),
        )
    )
    for handle in ["", "x", "fuzz:0:0:1", "../../x:1:2:3", "a:b:c:d", ":" * 50, "fuzz:-1:-1:-1"]:
        out.append(
            (
                "AckMessage",
                s.AckMessageRequest(
                    group=d.Resource(name="g"),
                    topic=good,
                    entries=[s.AckMessageEntry(receipt_handle=handle)],
                ),
            )
        )
        out.append(
            (
                "ChangeInvisibleDuration",
                s.ChangeInvisibleDurationRequest(
                    group=d.Resource(name="g"), topic=good, receipt_handle=handle
                ),
            )
        )
        out.append(
            (
                "ForwardMessageToDeadLetterQueue",
                s.ForwardMessageToDeadLetterQueueRequest(
                    group=d.Resource(name="g"), topic=good, receipt_handle=handle
                ),
            )
        )
    for queue, offset in [(-1, 0), (0, -1), (0, 10**15), (10**6, 0), (0, 2**62)]:
        mq = d.MessageQueue(topic=good, id=queue)
        out.append(
            (
                "PullMessage",
                s.PullMessageRequest(group=d.Resource(name="g"), message_queue=mq, offset=offset),
            )
        )
        out.append(
            (
                "UpdateOffset",
                s.UpdateOffsetRequest(group=d.Resource(name="g"), message_queue=mq, offset=offset),
            )
        )
        out.append(("GetOffset", s.GetOffsetRequest(group=d.Resource(name="g"), message_queue=mq)))
        out.append(("QueryOffset", s.QueryOffsetRequest(message_queue=mq, query_offset_policy=7)))
    rng.shuffle(out)
    return out


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("fuzz")
    broker = Standalone(root / "data").start()
    broker.create_topic("fuzz", queues=2)
    yield root, broker
    assert broker.stop() == 0


def test_five_thousand_hostile_requests_leave_the_broker_serving(node) -> None:
    root, broker = node
    before = files_outside(root, broker.data_dir)
    rng = random.Random(1234)
    channel = grpc.insecure_channel(broker.endpoint)
    stub = service_pb2_grpc.MessagingServiceStub(channel)
    sent = 0

    # 1. Structured hostile requests: each gets a clear, non-OK answer in its status.
    crafted = hostile_requests(rng)
    for method, request in crafted:
        call = getattr(stub, method)
        if method in STREAMING:
            replies = list(call(request, timeout=10))
            statuses = [r.status for r in replies if r.WhichOneof("content") == "status"]
        else:
            statuses = [call(request, timeout=10).status]
        sent += 1
        assert statuses, method
        if method not in ("Heartbeat", "NotifyClientTermination"):
            assert statuses[0].code not in (d.OK, d.CODE_UNSPECIFIED), (method, request)
            assert statuses[0].code != d.INTERNAL_ERROR, (method, statuses[0].message)
            assert statuses[0].message, (method, "an error needs a message")

    # 2. Random bytes as every method's request: INVALID_ARGUMENT when they do not decode, a
    #    status in the response when they happen to. (grpcio's own decoding path leaked a worker
    #    per undecodable request and hung the server after 160: remoting/servicers.py.)
    for _ in range(3000 - len(crafted)):
        method = rng.choice(METHODS)
        path = f"/apache.rocketmq.v2.MessagingService/{method}"
        payload = rng.randbytes(rng.randint(0, 512))
        if method in STREAMING:
            call = channel.unary_stream(path, request_serializer=None, response_deserializer=None)
            try:
                list(call(payload, timeout=10))
            except grpc.RpcError as e:
                assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, e  # bytes that do not decode
        else:
            call = channel.unary_unary(path, request_serializer=None, response_deserializer=None)
            try:
                call(payload, timeout=10)
            except grpc.RpcError as e:
                assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, e  # bytes that do not decode
        sent += 1

    # 3. Hostile admin requests.
    admin = broker.admin()
    for name in [*HOSTILE_NAMES, "ok-topic"]:
        for queues in (0, -1, 100_000, 4):
            try:
                admin.PutTopic(
                    apb.PutTopicRequest(
                        topic=apb.Topic(name=name, queues=queues, message_type="WEIRD")
                    ),
                    timeout=10,
                )
                raise AssertionError(f"PutTopic accepted {name!r}/{queues}")
            except grpc.RpcError as e:
                assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and e.details()
            sent += 1

    # 4. Garbage on the socket itself, no HTTP/2 at all.
    host, port = broker.endpoint.split(":")
    while sent < 5000:
        with socket.create_connection((host, int(port)), timeout=5) as sock:
            sock.sendall(rng.randbytes(rng.randint(1, 2048)))
            with contextlib.suppress(TimeoutError, ConnectionError):
                sock.recv(1024)
        sent += 1
    channel.close()

    assert sent >= 5000
    assert broker.proc is not None and broker.proc.poll() is None, "the broker died"
    # Still serving: a well-formed send is accepted and readable.
    ok = d.Message(topic=d.Resource(name="fuzz"), body=b"still here")
    ok.system_properties.message_id = "after-fuzz"
    stub = service_pb2_grpc.MessagingServiceStub(grpc.insecure_channel(broker.endpoint))
    assert stub.SendMessage(s.SendMessageRequest(messages=[ok]), timeout=10).status.code == d.OK
    assert files_outside(root, broker.data_dir) == before, "nothing may be written outside"
    cq_dir = broker.data_dir / "consumequeue"
    topics_on_disk = {p.name for p in cq_dir.iterdir()} if cq_dir.exists() else set()
    assert topics_on_disk <= {"fuzz", "%RETRY%g", "%DLQ%g"}, topics_on_disk
