"""How every tmq gRPC server (NameServer, broker with its admin service) opens its port.

grpcio sets SO_REUSEPORT on its listening sockets by default: a second server on a port already
in use binds without a complaint and the kernel then splits new connections between the two, so
half of the clients talk to the wrong process. tmq servers turn the option off and treat a
refused bind as an error that names the port.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent import futures
from typing import Any

import grpc

# Passed to every grpc.server(): no SO_REUSEPORT, so a port in use is refused by the kernel.
NO_REUSEPORT = ("grpc.so_reuseport", 0)


class PortInUseError(OSError):
    """The address could not be bound (in use, or not ours to bind)."""


def new_server(
    workers: int, thread_name_prefix: str, options: Sequence[tuple[str, Any]] = ()
) -> grpc.Server:
    return grpc.server(
        futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix=thread_name_prefix),
        options=[NO_REUSEPORT, *options],
    )


def listen(server: grpc.Server, host: str, port: int, what: str) -> int:
    """Bind ``host:port`` (``port`` 0: any free one); returns the bound port. Raises
    PortInUseError with one line naming ``what`` and the port when the bind is refused."""
    try:
        bound = server.add_insecure_port(f"{host}:{port}")
    except RuntimeError:  # grpcio raises instead of returning 0 in some releases
        bound = 0
    if bound == 0:
        raise PortInUseError(
            f"{what}: cannot listen on {host}:{port}: the port is already in use "
            "(another tmq or RocketMQ process?) or the address is not this host's"
        )
    return int(bound)
