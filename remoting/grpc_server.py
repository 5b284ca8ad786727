"""How every tmq gRPC server (NameServer, broker with its admin service) opens its port.

grpcio sets SO_REUSEPORT on its listening sockets by default: a second server on a port already
in use binds without a complaint and the kernel then splits new connections between the two, so
half of the clients talk to the wrong process. tmq servers turn the option off and treat a
refused bind as an error that names the port.
"""

from __future__ import annotations

import errno
import socket
from collections.abc import Sequence
from concurrent import futures
from typing import Any

import grpc

# Passed to every grpc.server(): no SO_REUSEPORT, so a port in use is refused by the kernel.
NO_REUSEPORT = ("grpc.so_reuseport", 0)


class PortInUseError(OSError):
    """The address could not be bound (in use, or not ours to bind)."""


def new_server(
    workers: int,
    thread_name_prefix: str,
    options: Sequence[tuple[str, Any]] = (),
    interceptors: Sequence[grpc.ServerInterceptor] = (),
) -> grpc.Server:
    """A server; ``interceptors`` see every call (remoting/auth.py's, when auth is on)."""
    return grpc.server(
        futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix=thread_name_prefix),
        options=[NO_REUSEPORT, *options],
        interceptors=list(interceptors),
    )


def listen(
    server: grpc.Server,
    host: str,
    port: int,
    what: str,
    credentials: grpc.ServerCredentials | None = None,
) -> int:
    """Bind ``host:port`` (``port`` 0: any free one), with TLS if ``credentials`` are given
    (remoting/security.py); returns the bound port. Raises PortInUseError with one line naming
    ``what`` and the port when the bind is refused."""
    if port:
        _check_free(host, port, what)
    try:
        address = f"{host}:{port}"
        bound = (
            server.add_insecure_port(address)
            if credentials is None
            else server.add_secure_port(address, credentials)
        )
    except RuntimeError:  # grpcio raises instead of returning 0 in some releases
        bound = 0
    if bound == 0:  # taken between the check and here
        raise PortInUseError(f"{what}: cannot listen on {host}:{port}: the port is in use")
    return int(bound)


def _check_free(host: str, port: int, what: str) -> None:
    """Try the bind with a plain socket first, for a clear one-line error (gRPC's own failure
    is a C-core log line). SO_REUSEADDR as gRPC sets it: a port left in TIME_WAIT by a
    stopped server is free, one another process listens on is not."""
    try:
        infos = socket.getaddrinfo(
            host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
    except socket.gaierror as e:
        raise PortInUseError(f"{what}: cannot listen on {host}:{port}: {e}") from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
        except OSError as e:
            reason = (
                "the port is already in use (another tmq or RocketMQ process?)"
                if e.errno == errno.EADDRINUSE
                else e.strerror or str(e)
            )
            raise PortInUseError(f"{what}: cannot listen on {host}:{port}: {reason}") from None
