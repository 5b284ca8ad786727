"""What tmq answers on the wire, field by field, against Apache's proxy (docs/compatibility.md):
the client's own protocol stubs talk to a real ``tmq standalone``."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from broker_harness import REPO, Standalone, free_port
from rocketmq.grpc_protocol import definition_pb2 as d
from rocketmq.grpc_protocol import service_pb2 as s
from rocketmq.grpc_protocol import service_pb2_grpc


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Standalone]:
    node = Standalone(tmp_path_factory.mktemp("fidelity") / "data").start()
    node.create_topic("fid", queues=2)
    node.create_topic("fid-fifo", queues=2, message_type="FIFO")
    node.create_group("g-fifo", fifo=True, max_attempts=5)
    yield node
    assert node.stop() == 0


def stub(b: Standalone) -> service_pb2_grpc.MessagingServiceStub:
    return service_pb2_grpc.MessagingServiceStub(grpc.insecure_channel(b.endpoint))


def message(topic: str, body: bytes = b"payload", **system: object) -> d.Message:
    m = d.Message(topic=d.Resource(name=topic), body=body)
    m.system_properties.message_id = os.urandom(16).hex().upper()
    m.system_properties.body_encoding = d.IDENTITY
    m.system_properties.message_type = d.NORMAL
    for key, value in system.items():
        if key == "keys":
            m.system_properties.keys.extend(value)  # type: ignore[arg-type]
        else:
            setattr(m.system_properties, key, value)
    return m


def send(b: Standalone, *messages: d.Message) -> s.SendMessageResponse:
    return stub(b).SendMessage(s.SendMessageRequest(messages=messages), timeout=10)


def settings_for(b: Standalone, given: d.Settings) -> d.Settings:
    reply = next(iter(stub(b).Telemetry(iter([s.TelemetryCommand(settings=given)]), timeout=10)))
    assert reply.status.code == d.OK
    return reply.settings


def test_producer_settings_are_the_proxys(broker: Standalone) -> None:
    got = settings_for(
        broker,
        d.Settings(
            client_type=d.PRODUCER,
            publishing=d.Publishing(topics=[d.Resource(name="fid")]),
            backoff_policy=d.RetryPolicy(max_attempts=9),
        ),
    )
    assert got.backoff_policy.max_attempts == 3
    backoff = got.backoff_policy.exponential_backoff
    assert (backoff.initial.ToMilliseconds(), backoff.max.ToMilliseconds()) == (10, 1000)
    assert backoff.multiplier == 2
    assert got.publishing.validate_message_type
    # The proxy's 4 MiB body limit, less what delivery adds: what every client can receive.
    assert got.publishing.max_body_size == 4 * 1024 * 1024 - 2048
    assert not got.metric.on


def test_consumer_settings_carry_the_groups_fifo_flag_attempts_and_customized_backoff(
    broker: Standalone,
) -> None:
    got = settings_for(
        broker,
        d.Settings(
            client_type=d.PUSH_CONSUMER,
            subscription=d.Subscription(group=d.Resource(name="g-fifo")),
        ),
    )
    assert got.subscription.fifo
    assert got.subscription.receive_batch_size == 32
    assert got.subscription.long_polling_timeout.ToMilliseconds() == 20_000
    assert got.backoff_policy.max_attempts == 5
    steps = [x.ToMilliseconds() // 1000 for x in got.backoff_policy.customized_backoff.next]
    assert steps[:6] == [1, 5, 10, 30, 60, 120] and steps[-1] == 7200 and len(steps) == 18


def test_send_result_carries_transaction_id_and_delivery_an_md5_digest(
    broker: Standalone,
) -> None:
    body = b"digest me" * 50
    m = message("fid-fifo", body, message_group="grp-1", message_type=d.FIFO)
    m.user_properties["color"] = "red"
    reply = send(broker, m)
    assert reply.status.code == d.OK
    [entry] = reply.entries
    assert entry.transaction_id == entry.message_id == m.system_properties.message_id
    request = s.PullMessageRequest(
        group=d.Resource(name="g-reader"),
        message_queue=d.MessageQueue(topic=d.Resource(name="fid-fifo"), id=0),
        offset=0,
        batch_size=32,
    )
    # Dispatch to the ConsumeQueue is asynchronous (as in RocketMQ): poll until it is there.
    deadline = time.monotonic() + 10
    while True:
        got = []
        for q in (0, 1):
            request.message_queue.id = q
            got += [
                r.message for r in stub(broker).PullMessage(request, timeout=10) if r.message.body
            ]
        found = [x for x in got if x.system_properties.message_id == entry.message_id]
        if found or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    [delivered] = found
    sp = delivered.system_properties
    assert sp.body_digest.type == d.MD5
    assert sp.body_digest.checksum == hashlib.md5(body).hexdigest().upper()
    assert sp.message_group == "grp-1" and sp.delivery_attempt == 1
    assert dict(delivered.user_properties) == {"color": "red", "__SHARDINGKEY": "grp-1"}


@pytest.mark.parametrize(
    ("build", "code"),
    [
        (lambda: message("fid", b""), d.MESSAGE_BODY_EMPTY),
        (lambda: message("fid", tag="a|b"), d.ILLEGAL_MESSAGE_TAG),
        (lambda: message("fid", tag="  "), d.ILLEGAL_MESSAGE_TAG),
        (lambda: message("fid", keys=["bad\x07key"]), d.ILLEGAL_MESSAGE_KEY),
        (lambda: message("fid", message_id=""), d.ILLEGAL_MESSAGE_ID),
        (lambda: message("fid", message_group="g" * 64), d.ILLEGAL_MESSAGE_GROUP),
        (
            lambda: message("fid-fifo", message_group="g\x00", message_type=d.FIFO),
            d.ILLEGAL_MESSAGE_GROUP,
        ),
        (lambda: message("fid", message_type=d.FIFO), d.MESSAGE_PROPERTY_CONFLICT_WITH_TYPE),
        (lambda: message("fid", b"x" * (4 * 1024 * 1024)), d.MESSAGE_BODY_TOO_LARGE),
    ],
)
def test_send_is_refused_with_the_proxys_code(
    broker: Standalone, build: Callable[[], d.Message], code: int
) -> None:
    reply = send(broker, build())
    assert reply.status.code == code, reply.status


@pytest.mark.parametrize(
    ("key", "value"),
    [("UNIQ_KEY", "x"), ("__SHARDINGKEY", "x"), ("TIMER_DELIVER_MS", "1"), ("ok", "bad\nvalue")],
)
def test_system_property_names_and_control_characters_are_refused(
    broker: Standalone, key: str, value: str
) -> None:
    m = message("fid")
    m.user_properties[key] = value
    assert send(broker, m).status.code == d.ILLEGAL_MESSAGE_PROPERTY_KEY


def test_an_empty_or_mixed_request_is_message_corrupted(broker: Standalone) -> None:
    assert send(broker).status.code == d.MESSAGE_CORRUPTED
    assert send(broker, message("fid"), message("fid-fifo")).status.code == d.MESSAGE_CORRUPTED


def _start(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "cli.app", *args],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_a_second_server_on_a_port_in_use_refuses_to_start(tmp_path: Path) -> None:
    """grpcio sets SO_REUSEPORT: without turning it off, a second server bound the same port
    silently and took half of the connections."""
    first = Standalone(tmp_path / "a").start()
    try:
        cases = {
            "broker": [
                "standalone", "--data-dir", str(tmp_path / "b"),
                "--grpc-port", str(first.grpc_port), "--namesrv-port", str(free_port()),
                "--metrics-port", "0",
            ],
            "NameServer": [
                "standalone", "--data-dir", str(tmp_path / "c"),
                "--grpc-port", str(free_port()), "--namesrv-port", str(first.namesrv_port),
                "--metrics-port", "0",
            ],
            "NameServer ": ["namesrv", "start", "--port", str(first.namesrv_port)],
        }  # fmt: skip
        for what, args in cases.items():
            proc = _start(*args)
            try:
                _, err = proc.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                pytest.fail(f"a second {what} started on a port in use")
            port = first.grpc_port if what == "broker" else first.namesrv_port
            assert proc.returncode == 1, err
            [line] = err.strip().splitlines()
            assert what.strip() in line and str(port) in line and "in use" in line, line
    finally:
        assert first.stop() == 0


def test_a_metrics_port_in_use_stops_the_broker_with_one_line(tmp_path: Path) -> None:
    metrics = free_port()
    first = Standalone(tmp_path / "a", metrics_port=metrics).start()
    try:
        proc = _start(
            "standalone", "--data-dir", str(tmp_path / "b"),
            "--grpc-port", str(free_port()), "--namesrv-port", str(free_port()),
            "--metrics-port", str(metrics),
        )  # fmt: skip
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 1, err
        [line] = err.strip().splitlines()
        assert "metrics" in line and str(metrics) in line, line
    finally:
        assert first.stop() == 0


@pytest.mark.parametrize(("held", "wanted"), [("0.0.0.0", "127.0.0.1"), ("127.0.0.1", "0.0.0.0")])
def test_a_port_held_on_another_address_is_refused_too(held: str, wanted: str) -> None:
    """The case SO_REUSEPORT let through: a gRPC server (grpcio's defaults) on the wildcard
    address and a tmq NameServer on loopback, or the other way round, on one port."""
    holder = grpc.server(futures.ThreadPoolExecutor(max_workers=1))
    port = holder.add_insecure_port(f"{held}:0")
    holder.start()
    try:
        proc = _start("namesrv", "start", "--host", wanted, "--port", str(port))
        try:
            _, err = proc.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            pytest.fail(f"a NameServer started on {wanted}:{port} while {held}:{port} is served")
        assert proc.returncode == 1
        assert err.strip().splitlines() == [
            f"error: NameServer: cannot listen on {wanted}:{port}: the port is already in use "
            "(another tmq or RocketMQ process?)"
        ]
    finally:
        holder.stop(None)
