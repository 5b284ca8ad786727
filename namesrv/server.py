"""The NameServer gRPC service (default port 9876), with ``grpc.health.v1`` beside it."""

from __future__ import annotations

import logging

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from namesrv.registry import HEARTBEAT_INTERVAL_MS, BrokerRegistry
from remoting import namesrv_pb2 as pb
from remoting import namesrv_pb2_grpc as pb_grpc
from remoting.auth import Authenticator, AuthInterceptor, Users, admin_only
from remoting.grpc_server import listen, new_server
from remoting.security import TlsConfig, server_credentials
from remoting.servicers import add_safely

log = logging.getLogger(__name__)

DEFAULT_PORT = 9876
SERVICE_NAME = "tmq.namesrv.v1.NameServer"


class NameServerServicer(pb_grpc.NameServerServicer):
    def __init__(self, registry: BrokerRegistry) -> None:
        self.registry = registry

    def RegisterBroker(
        self, request: pb.RegisterBrokerRequest, context: grpc.ServicerContext
    ) -> pb.RegisterBrokerResponse:
        b = request.broker
        if not b.broker_name or not b.cluster or not b.endpoint.host or b.endpoint.port <= 0:
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                "a registration needs cluster, broker_name and an endpoint",
            )
        self.registry.register(b)
        return pb.RegisterBrokerResponse(
            heartbeat_interval_ms=HEARTBEAT_INTERVAL_MS, expiry_ms=self.registry.expiry_ms
        )

    def UnregisterBroker(
        self, request: pb.UnregisterBrokerRequest, context: grpc.ServicerContext
    ) -> pb.UnregisterBrokerResponse:
        if not request.endpoint.host or request.endpoint.port <= 0:
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                "an unregister needs the endpoint the broker registered with",
            )
        self.registry.unregister(
            request.cluster, request.broker_name, request.broker_id, request.endpoint
        )
        return pb.UnregisterBrokerResponse()

    def GetRoute(self, request: pb.GetRouteRequest, context: grpc.ServicerContext) -> pb.TopicRoute:
        route = self.registry.route(request.topic)
        if not route.brokers:
            context.abort(
                grpc.StatusCode.NOT_FOUND, f"no live broker serves topic {request.topic!r}"
            )
        return route

    def GetClusterInfo(
        self, request: pb.GetClusterInfoRequest, context: grpc.ServicerContext
    ) -> pb.ClusterInfo:
        return self.registry.cluster_info()


def add_to_server(server: grpc.Server, registry: BrokerRegistry) -> None:
    add_safely(pb_grpc.add_NameServerServicer_to_server, NameServerServicer(registry), server)


def start(
    host: str = "0.0.0.0",
    port: int = DEFAULT_PORT,
    registry: BrokerRegistry | None = None,
    tls: TlsConfig | None = None,
    users: Users | None = None,
    max_clock_skew_s: float = 900,
) -> tuple[grpc.Server, int]:
    """Start a NameServer; returns the server and the port it bound (``port=0``: any free one).
    With ``users``, every call must be signed by an admin among them (brokers registering and
    the ``tmq`` CLI sign with the environment's admin key); with ``tls``, the port is TLS only.
    """
    interceptors = []
    if users is not None:
        authenticator = Authenticator(users, max_clock_skew_s)
        interceptors.append(AuthInterceptor(authenticator, admin_only, [pb.DESCRIPTOR]))
    server = new_server(8, "namesrv", interceptors=interceptors)
    add_to_server(server, registry or BrokerRegistry())
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    credentials = server_credentials(tls) if tls is not None and tls.enabled else None
    bound = listen(server, host, port, "NameServer", credentials)
    server.start()
    for name in ("", SERVICE_NAME):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    log.info(
        "NameServer listening on %s:%d%s%s",
        host,
        bound,
        " (TLS)" if credentials is not None else "",
        " (signed requests only)" if users is not None else "",
    )
    return server, bound
