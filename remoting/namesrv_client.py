"""A client of one or more NameServers, for brokers (registration) and tools (routes)."""

from __future__ import annotations

import logging

import grpc

from remoting import namesrv_pb2 as pb
from remoting import namesrv_pb2_grpc as pb_grpc
from remoting.security import ChannelSecurity

log = logging.getLogger(__name__)

# A NameServer call is small and local to the cluster; never wait long on one.
_TIMEOUT_S = 3.0


def parse_addresses(text: str) -> list[str]:
    """``"host:port;host:port"`` (RocketMQ's separator; commas work too) into a list."""
    out = [a.strip() for a in text.replace(",", ";").split(";") if a.strip()]
    for addr in out:
        host, _, port = addr.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"not a NameServer address: {addr!r} (expected host:port)")
    if not out:
        raise ValueError("no NameServer address given")
    return out


class NameServerClient:
    def __init__(self, addresses: list[str], security: ChannelSecurity | None = None) -> None:
        self.addresses = addresses
        security = security or ChannelSecurity()
        self._channels = {a: security.channel(a) for a in addresses}
        self._stubs = {a: pb_grpc.NameServerStub(c) for a, c in self._channels.items()}

    def register(self, registration: pb.BrokerRegistration) -> int:
        """Register with every NameServer; returns how many accepted (failures are logged)."""
        ok = 0
        for addr, stub in self._stubs.items():
            try:
                stub.RegisterBroker(
                    pb.RegisterBrokerRequest(broker=registration), timeout=_TIMEOUT_S
                )
                ok += 1
            except grpc.RpcError as e:
                log.warning("registering with NameServer %s failed: %s", addr, e.code().name)
        return ok

    def unregister(
        self, cluster: str, broker_name: str, broker_id: int, endpoint: pb.Endpoint
    ) -> None:
        """Forget this broker's entry on every NameServer, if the entry still names ``endpoint``
        (another broker may hold the id by now: a new master registers as id 0)."""
        request = pb.UnregisterBrokerRequest(
            cluster=cluster, broker_name=broker_name, broker_id=broker_id, endpoint=endpoint
        )
        for addr, stub in self._stubs.items():
            try:
                stub.UnregisterBroker(request, timeout=_TIMEOUT_S)
            except grpc.RpcError as e:
                log.warning("unregistering from NameServer %s failed: %s", addr, e.code().name)

    def route(self, topic: str) -> pb.TopicRoute | None:
        """The topic's route from the first NameServer that answers; None if no broker serves
        it. Raises ``grpc.RpcError`` (UNAVAILABLE) only when no NameServer answers at all."""
        last: grpc.RpcError | None = None
        for stub in self._stubs.values():
            try:
                route: pb.TopicRoute = stub.GetRoute(
                    pb.GetRouteRequest(topic=topic), timeout=_TIMEOUT_S
                )
                return route
            except grpc.RpcError as e:
                if e.code() == grpc.StatusCode.NOT_FOUND:
                    return None
                last = e
        assert last is not None
        raise last

    def cluster_info(self) -> pb.ClusterInfo:
        last: grpc.RpcError | None = None
        for stub in self._stubs.values():
            try:
                info: pb.ClusterInfo = stub.GetClusterInfo(
                    pb.GetClusterInfoRequest(), timeout=_TIMEOUT_S
                )
                return info
            except grpc.RpcError as e:
                last = e
        assert last is not None
        raise last

    def close(self) -> None:
        for channel in self._channels.values():
            channel.close()
