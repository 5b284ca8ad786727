"""Any member of a controller-run replica group answers clients: what only the master can do is
forwarded to it (decision 134).

Routes name every member of a group as the addresses of one broker (``Endpoints`` with several
addresses; Apache's clients open one channel that picks the first address that answers). A
client whose member died reconnects to another member at once, without waiting for its next
route refresh (every 30 s), and that member forwards sends, receives, acks and the like to the
current master, byte for byte, with the client's metadata. While no master is up (an election,
or a master that died and etcd has not noticed yet, or etcd is down), the member answers
itself: a slave refuses sends (``HA_NOT_AVAILABLE``) but serves reads from its own copy
(RocketMQ's slave-read). Routing, heartbeats and the telemetry stream are always
answered by the member the client is connected to.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

import grpc

from remoting.security import ChannelSecurity

log = logging.getLogger(__name__)

SERVICE = "apache.rocketmq.v2.MessagingService"
# What needs the master's store or pop state. Everything else is answered by any member.
FORWARDED = frozenset(
    {
        "SendMessage",
        "ReceiveMessage",
        "AckMessage",
        "ChangeInvisibleDuration",
        "ForwardMessageToDeadLetterQueue",
        "EndTransaction",
        "RecallMessage",
        "PullMessage",
        "UpdateOffset",
        "GetOffset",
        "QueryOffset",
    }
)
# What a member serves from its own copy when the master it knows of does not answer (the
# master died and etcd has not said so yet, or etcd itself is down): slave-read, and the
# acknowledgements of what it delivered so (their receipt handles are its own).
READS = frozenset(
    {
        "ReceiveMessage",
        "PullMessage",
        "GetOffset",
        "QueryOffset",
        "AckMessage",
        "ChangeInvisibleDuration",
    }
)
_HOP = "x-tmq-forwarded"


def _encoded(request: Any) -> bytes:
    """The request's bytes. Under ``[auth]`` the interceptor (remoting/auth.py) decodes a request
    to authorize it and passes the decoded message on; it is encoded again to be forwarded
    (decision 1251: passed as it was, every forwarded call failed with a TypeError)."""
    return request if isinstance(request, bytes) else bytes(request.SerializeToString())


class _Capture:
    def __init__(self) -> None:
        self.handlers: list[grpc.GenericRpcHandler] = []

    def add_generic_rpc_handlers(self, handlers: Any) -> None:
        self.handlers.extend(handlers)

    def add_registered_method_handlers(self, service: str, handlers: Any) -> None:
        pass


class ForwardingHandler(grpc.GenericRpcHandler):
    """Wraps the MessagingService's handlers: local when ``master_endpoint()`` is None (this
    node is the writable master, or no master is known), forwarded otherwise."""

    def __init__(
        self,
        register: Callable[[Any], None],
        master_endpoint: Callable[[], str | None],
        security: ChannelSecurity | None = None,
    ) -> None:
        capture = _Capture()
        register(capture)  # e.g. add_safely(add_MessagingServiceServicer_to_server, servicer, _)
        self._inner = capture.handlers
        self._master_endpoint = master_endpoint
        # TLS to the master as to any member under [tls]; never this broker's signature: a
        # forwarded call carries its client's own (``_metadata``), and signing it as the admin
        # would run every client's request with the admin's rights (decision 1271).
        self._security = replace(security or ChannelSecurity(), access_key="", secret_key="")
        self._channels: dict[str, grpc.Channel] = {}
        self._lock = threading.Lock()
        self._wrapped: dict[str, Any] = {}
        self.forwarded = 0

    def service(self, handler_call_details: grpc.HandlerCallDetails) -> Any:
        method = handler_call_details.method
        if method in self._wrapped:
            return self._wrapped[method]
        handler = None
        for inner in self._inner:
            handler = inner.service(handler_call_details)
            if handler is not None:
                break
        if handler is None:
            return None
        service, _, name = method.lstrip("/").partition("/")
        if service == SERVICE and name in FORWARDED:
            handler = self._wrap(method, handler)
        self._wrapped[method] = handler
        return handler

    def _channel(self, endpoint: str) -> grpc.Channel:
        with self._lock:
            channel = self._channels.get(endpoint)
            if channel is None:
                channel = self._security.channel(
                    endpoint,
                    [
                        ("grpc.max_receive_message_length", 64 << 20),
                        ("grpc.max_send_message_length", 64 << 20),
                    ],
                )
                self._channels[endpoint] = channel
            return channel

    def _target(self, context: grpc.ServicerContext) -> str | None:
        if any(k == _HOP for k, _ in context.invocation_metadata()):
            return None  # never forward twice: two members that disagree must not loop
        return self._master_endpoint()

    @staticmethod
    def _metadata(context: grpc.ServicerContext) -> list[tuple[str, str | bytes]]:
        kept = [
            (k, v)
            for k, v in context.invocation_metadata()
            if not k.startswith(("grpc-", ":")) and k not in ("user-agent", "content-type")
        ]
        return [*kept, (_HOP, "1")]

    @staticmethod
    def _timeout(context: grpc.ServicerContext) -> float | None:
        left = context.time_remaining()
        return None if left is None or left > 3600 else max(0.1, left)

    def _wrap(self, method: str, handler: Any) -> Any:
        serialize = handler.response_serializer
        read = method.rpartition("/")[2] in READS

        def fall_back(e: grpc.RpcError) -> bool:
            if read and e.code() == grpc.StatusCode.UNAVAILABLE:
                log.warning(
                    "the master does not answer (%s); serving %s from this copy",
                    e.code().name,
                    method,
                )
                return True
            return False

        if handler.unary_unary is not None:
            local_unary = handler.unary_unary

            def unary(raw: bytes, context: grpc.ServicerContext) -> bytes:
                target = self._target(context)
                if target is None:
                    response = local_unary(raw, context)
                    return bytes(response if serialize is None else serialize(response))
                self.forwarded += 1
                call = self._channel(target).unary_unary(method)
                try:
                    answer: bytes = call(
                        _encoded(raw),
                        metadata=self._metadata(context),
                        timeout=self._timeout(context),
                    )
                    return answer
                except grpc.RpcError as e:
                    if fall_back(e):
                        response = local_unary(raw, context)
                        return bytes(response if serialize is None else serialize(response))
                    context.abort(e.code(), f"forwarded to the master {target}: {e.details()}")
                    raise  # unreachable: abort raises

            return handler._replace(unary_unary=unary, response_serializer=None)

        if handler.unary_stream is not None:
            local_stream = handler.unary_stream

            def stream(raw: bytes, context: grpc.ServicerContext) -> Iterator[bytes]:
                target = self._target(context)
                if target is None:
                    for response in local_stream(raw, context):
                        yield response if serialize is None else serialize(response)
                    return
                self.forwarded += 1
                call = self._channel(target).unary_stream(method)
                answered = False
                try:
                    for answer in call(
                        _encoded(raw),
                        metadata=self._metadata(context),
                        timeout=self._timeout(context),
                    ):
                        answered = True
                        yield answer
                except grpc.RpcError as e:
                    if not answered and fall_back(e):
                        for response in local_stream(raw, context):
                            yield response if serialize is None else serialize(response)
                        return
                    context.abort(e.code(), f"forwarded to the master {target}: {e.details()}")

            return handler._replace(unary_stream=stream, response_serializer=None)
        return handler

    def close(self) -> None:
        with self._lock:
            for channel in self._channels.values():
                channel.close()
            self._channels.clear()
