"""Register generated gRPC servicers so that an undecodable request cannot hang the server.

grpcio's synchronous server (seen in 1.85.1) aborts a request whose bytes fail to deserialize but
leaves the worker thread waiting for that request forever (``_server.unary_request``): every
malformed request pins one worker, and a few hundred hang the server for good. Every tmq server
(NameServer, broker) therefore registers its servicers through ``add_safely``: gRPC hands the
servicer raw bytes, and the wrapper decodes them with the generated deserializer itself,
answering INVALID_ARGUMENT when they do not decode. The protocol is not re-typed: the generated
handlers are captured and only their deserializer is moved.

A servicer method marked ``@takes_bytes`` gets the request's bytes as they came (it decodes
them itself, with ``decode_request`` where it needs protobuf's parse): the broker's SendMessage
walks a plain batch natively (decision 310).

A response that is ``bytes`` already is sent as it is: the broker's PullMessage answers a cold
read with replies the cold worker serialized (decision 400), and SendMessage with the answer
it built as bytes (decision 391).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import grpc

log = logging.getLogger(__name__)

Deserializer = Callable[[bytes], Any]


F = TypeVar("F", bound=Callable[..., Any])


def takes_bytes(method: F) -> F:
    """Mark a servicer method that takes its request as bytes (or decoded, when an
    interceptor decoded it) and decodes it itself; it may answer with its response's bytes,
    which go out as they are (decision 391)."""
    method.takes_bytes = True  # type: ignore[attr-defined]
    return method


def decode_request(deserializer: Deserializer, raw: Any, context: grpc.ServicerContext) -> Any:
    """``raw`` decoded, or the call aborted with INVALID_ARGUMENT when it does not decode."""
    if not isinstance(raw, bytes):  # decoded already, by an interceptor (remoting/auth.py)
        return raw
    try:
        return deserializer(raw)
    except Exception as e:  # DecodeError, or anything a hostile payload provokes
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"malformed request: {e}")


def _passing_bytes(serializer: Callable[[Any], bytes] | None) -> Callable[[Any], bytes] | None:
    """``serializer``, except that a response already serialized (``bytes``) goes as it is."""
    if serializer is None:
        return None
    return lambda response: response if type(response) is bytes else serializer(response)


def _wrap(handler: Any) -> Any:
    handler = handler._replace(response_serializer=_passing_bytes(handler.response_serializer))
    deserializer: Deserializer | None = handler.request_deserializer
    if deserializer is None:
        return handler
    if handler.unary_unary is not None:
        fn = handler.unary_unary
        if getattr(fn, "takes_bytes", False):
            return handler._replace(request_deserializer=None)
        return handler._replace(
            request_deserializer=None,
            unary_unary=lambda raw, ctx: fn(decode_request(deserializer, raw, ctx), ctx),
        )
    if handler.unary_stream is not None:
        fn = handler.unary_stream
        return handler._replace(
            request_deserializer=None,
            unary_stream=lambda raw, ctx: fn(decode_request(deserializer, raw, ctx), ctx),
        )

    def requests(raws: Iterator[bytes], ctx: grpc.ServicerContext) -> Iterator[Any]:
        for raw in raws:
            yield decode_request(deserializer, raw, ctx)

    if handler.stream_unary is not None:
        fn = handler.stream_unary
        return handler._replace(
            request_deserializer=None, stream_unary=lambda raws, ctx: fn(requests(raws, ctx), ctx)
        )
    fn = handler.stream_stream
    return handler._replace(
        request_deserializer=None, stream_stream=lambda raws, ctx: fn(requests(raws, ctx), ctx)
    )


class _Capture:
    """Stands in for the server while a generated ``add_*_to_server`` function registers."""

    def __init__(self) -> None:
        self.registered: list[tuple[str, dict[str, Any]]] = []
        self.generic: list[Any] = []

    def add_registered_method_handlers(self, service: str, handlers: dict[str, Any]) -> None:
        self.registered.append((service, handlers))

    def add_generic_rpc_handlers(self, handlers: Any) -> None:
        self.generic.extend(handlers)


class _SafeGenericHandler(grpc.GenericRpcHandler):
    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self._wrapped: dict[str, Any] = {}

    def service(self, handler_call_details: grpc.HandlerCallDetails) -> Any:
        method = handler_call_details.method
        if method not in self._wrapped:
            handler = self._inner.service(handler_call_details)
            if handler is None:
                return None
            self._wrapped[method] = _wrap(handler)
        return self._wrapped[method]


def add_safely(
    add_to_server: Callable[[Any, Any], None], servicer: Any, server: grpc.Server
) -> None:
    """``add_XServicer_to_server(servicer, server)``, with requests decoded by the servicer side."""
    capture = _Capture()
    add_to_server(servicer, capture)
    registered = set()
    for service, methods in capture.registered:
        registered.add(service)
        wrapped = {name: _wrap(handler) for name, handler in methods.items()}
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, wrapped),))
    # Older generated code registers only a generic handler; newer code registers both.
    for generic in capture.generic:
        if generic.service_name() not in registered:
            server.add_generic_rpc_handlers((_SafeGenericHandler(generic),))
