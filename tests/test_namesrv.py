"""The NameServer: registration, heartbeat expiry, routes, over real gRPC on loopback."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from namesrv import server as namesrv_server
from namesrv.registry import BrokerRegistry
from remoting import namesrv_pb2 as pb
from remoting.namesrv_client import NameServerClient, parse_addresses


def registration(name: str, port: int, *topics: tuple[str, int]) -> pb.BrokerRegistration:
    return pb.BrokerRegistration(
        cluster="c1",
        broker_name=name,
        broker_id=0,
        endpoint=pb.Endpoint(host="127.0.0.1", port=port),
        topics=[
            pb.TopicConfig(topic=t, queues=q, perm=6, message_type="NORMAL") for t, q in topics
        ],
    )


def test_a_silent_broker_expires_and_a_heartbeat_keeps_it() -> None:
    now = [0]
    registry = BrokerRegistry(expiry_ms=120_000, clock=lambda: now[0])
    registry.register(registration("b1", 8081, ("orders", 4)))
    registry.register(registration("b2", 8082, ("orders", 2)))
    now[0] = 100_000
    registry.register(registration("b2", 8082, ("orders", 2)))  # b2's heartbeat
    now[0] = 120_001
    assert [b.broker_name for b in registry.route("orders").brokers] == ["b2"]
    now[0] = 220_001
    assert registry.route("orders").brokers == []


@pytest.fixture
def two_namesrvs() -> Iterator[list[str]]:
    servers = [namesrv_server.start("127.0.0.1", 0) for _ in range(2)]
    yield [f"127.0.0.1:{port}" for _, port in servers]
    for server, _ in servers:
        server.stop(None)


def test_routes_come_from_any_namesrv_a_broker_registered_with(two_namesrvs) -> None:
    client = NameServerClient(two_namesrvs)
    assert client.register(registration("b1", 8081, ("orders", 4), ("audit", 1))) == 2
    assert client.register(registration("b2", 8082, ("orders", 2))) == 2
    for addr in two_namesrvs:
        one = NameServerClient([addr])
        route = one.route("orders")
        assert route is not None
        assert [(b.broker_name, b.queues, b.endpoint.port) for b in route.brokers] == [
            ("b1", 4, 8081),
            ("b2", 2, 8082),
        ]
        assert one.route("nope") is None
        assert len(one.cluster_info().brokers) == 2
        one.close()
    client.unregister("c1", "b1", 0, pb.Endpoint(host="127.0.0.1", port=8081))
    route = client.route("orders")
    assert route is not None and [b.broker_name for b in route.brokers] == ["b2"]
    assert client.route("audit") is None
    client.close()


def test_a_deposed_masters_late_unregister_leaves_the_new_masters_route(two_namesrvs) -> None:
    """Failover in one group: master A (id 0, port 8081) is deposed, B (port 8082) is elected and
    registers as id 0, and only then does A's unregister of id 0 arrive (A steps down to its
    member id, or shuts down while fenced). The NameServers key entries by (cluster, name, id), so
    that unregister used to remove B's entry: clients had no route to the group's master until
    B's next heartbeat, up to ``heartbeat_interval_ms`` (30 s) later. It must leave B alone, and
    A's own entry under its member id, and still forget an entry that names A."""
    a, b = pb.Endpoint(host="127.0.0.1", port=8081), pb.Endpoint(host="127.0.0.1", port=8082)
    client = NameServerClient(two_namesrvs)
    assert client.register(registration("g1", 8081, ("orders", 4))) == 2  # A, master
    new_master = registration("g1", 8082, ("orders", 4))
    assert client.register(new_master) == 2  # B elected: id 0 is now B's
    a_as_slave = registration("g1", 8081, ("orders", 4))
    a_as_slave.broker_id = 1
    assert client.register(a_as_slave) == 2
    client.unregister("c1", "g1", 0, a)  # A's late unregister of the id it held
    for addr in two_namesrvs:
        one = NameServerClient([addr])
        route = one.route("orders")
        assert route is not None
        assert [(x.broker_id, x.endpoint.port) for x in route.brokers] == [(0, 8082), (1, 8081)]
        one.close()
    # An unregister that names the entry's own endpoint still removes it at once.
    client.unregister("c1", "g1", 1, a)
    client.unregister("c1", "g1", 0, b)
    assert client.route("orders") is None
    client.close()


def test_a_registration_without_an_endpoint_is_invalid(two_namesrvs) -> None:
    channel = grpc.insecure_channel(two_namesrvs[0])
    stub = namesrv_server.pb_grpc.NameServerStub(channel)
    with pytest.raises(grpc.RpcError) as e:
        stub.RegisterBroker(
            pb.RegisterBrokerRequest(broker=pb.BrokerRegistration(cluster="c", broker_name="b")),
            timeout=5,
        )
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    channel.close()


def test_an_unregister_without_an_endpoint_is_invalid(two_namesrvs) -> None:
    """Without the endpoint the NameServer cannot tell whose entry it would remove."""
    client = NameServerClient(two_namesrvs[:1])
    assert client.register(registration("b1", 8081, ("orders", 4))) == 1
    channel = grpc.insecure_channel(two_namesrvs[0])
    stub = namesrv_server.pb_grpc.NameServerStub(channel)
    with pytest.raises(grpc.RpcError) as e:
        stub.UnregisterBroker(pb.UnregisterBrokerRequest(cluster="c1", broker_name="b1"))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "endpoint" in (e.value.details() or "")
    route = client.route("orders")
    assert route is not None and [b.endpoint.port for b in route.brokers] == [8081]
    channel.close()
    client.close()


def test_health_says_serving(two_namesrvs) -> None:
    channel = grpc.insecure_channel(two_namesrvs[0])
    health = health_pb2_grpc.HealthStub(channel)
    for service in ("", namesrv_server.SERVICE_NAME):
        reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    channel.close()


def test_no_namesrv_answering_is_unavailable() -> None:
    client = NameServerClient(["127.0.0.1:1"])
    with pytest.raises(grpc.RpcError) as e:
        client.route("orders")
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    client.close()


def test_addresses_parse_like_rocketmq() -> None:
    assert parse_addresses("a:9876;b:9877") == ["a:9876", "b:9877"]
    assert parse_addresses("a:1, b:2") == ["a:1", "b:2"]
    with pytest.raises(ValueError):
        parse_addresses("nohostport")
