"""Who is calling: the signature Apache's RocketMQ 5 clients send, checked on every gRPC call.

A client given credentials (Python ``Credentials(ak, sk)``, Node ``sessionCredentials``, Java
``StaticSessionCredentialsProvider``) adds two headers to every request:

=================== ==================================================================
``x-mq-date-time``  the client's clock, ``%Y%m%dT%H%M%SZ`` (e.g. ``20261122T221500Z``)
``authorization``   ``MQv2-HMAC-SHA1 Credential=AK, SignedHeaders=x-mq-date-time,
                    Signature=HEX`` where HEX = hex(HMAC-SHA1(key=SK, msg=date-time))
=================== ==================================================================

Apache's proxy (``DefaultAuthenticationContextBuilder``) splits the header at the first space,
then on commas into ``key=value`` items; ``Credential`` is the access key (the part before any
``/``), ``Signature`` is hex; the signed content is the date-time header's bytes. tmq parses the
same way and adds two checks the proxy lacks: the date-time must lie within ``max_skew_s`` of
the server's clock (a captured header stops working after that), and the signature is compared
in constant time (``hmac.compare_digest``). The signature covers only the date-time, never the
request: within the window a captured header can be replayed with any request. TLS is what
keeps headers from being captured (docs/security.md).

Note that the Python client stamps its *local* time and labels it ``Z``: a client whose zone
is not UTC is up to 14 hours off unless its process runs with ``TZ=UTC``.

``AuthInterceptor`` applies this to every method of a server (the health service excepted:
load balancers probe it without credentials) and then asks the server's ``Authorize`` policy
about the decoded request. Refusals answer as Apache's proxy does on the MessagingService: an
in-band ``Status`` of UNAUTHORIZED (40100) or FORBIDDEN (40300) in the method's own response;
on tmq's own services (admin, NameServer), gRPC UNAUTHENTICATED or PERMISSION_DENIED. The
reason sent back never holds a secret or a signature.
"""

from __future__ import annotations

import binascii
import functools
import hashlib
import hmac
import logging
import time
from calendar import timegm
from collections import namedtuple
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import grpc
from google.protobuf import message_factory
from google.protobuf.descriptor import FileDescriptor, MethodDescriptor

log = logging.getLogger(__name__)

ALGORITHM = "MQv2-HMAC-SHA1"
DATE_TIME_HEADER = "x-mq-date-time"
AUTHORIZATION_HEADER = "authorization"
DATE_TIME_FORMAT = "%Y%m%dT%H%M%SZ"
# AWS SigV4's window; the date-time is the only thing signed, so wider would mean longer replays.
DEFAULT_MAX_SKEW_S = 900
# apache.rocketmq.v2.Code
UNAUTHORIZED = 40100
FORBIDDEN = 40300
# The header is a few hundred bytes; anything much longer is hostile and not parsed at all.
_MAX_HEADER_CHARS = 1024
_EXEMPT_SERVICES = ("/grpc.health.v1.Health/",)


class AuthenticationError(Exception):
    """The caller could not be identified; the message is safe to send back (no secret)."""


@dataclass(frozen=True, slots=True)
class Principal:
    """An authenticated caller: its access key and whether it is an admin (Apache's SUPER
    user: every permission, admin RPCs included)."""

    name: str
    admin: bool


class Users(Protocol):
    def lookup(self, access_key: str) -> tuple[str, bool] | None:
        """The secret key and admin flag of ``access_key``; None if there is no such user."""


# (caller, full method name "/pkg.Service/Method", decoded request) -> None if allowed, else
# the reason it is refused (sent to the client).
Authorize = Callable[[Principal, str, Any], str | None]
# (method, "unauthenticated" | "forbidden") for metrics.
OnDenied = Callable[[str, str], None]


class StaticUsers:
    """A fixed set of users: a NameServer's, which knows only the admin of its environment."""

    def __init__(self, users: dict[str, tuple[str, bool]]) -> None:
        self._users = dict(users)

    def __repr__(self) -> str:  # never the secrets
        return f"StaticUsers({sorted(self._users)})"

    def lookup(self, access_key: str) -> tuple[str, bool] | None:
        return self._users.get(access_key)


def admin_only(principal: Principal, method: str, request: Any) -> str | None:
    """The policy of tmq's own services: admins only."""
    return None if principal.admin else f"{method} needs an admin user"


def sign(secret_key: str, date_time: str) -> str:
    """The hex HMAC-SHA1 Apache's clients put in ``Signature=``."""
    return hmac.new(secret_key.encode(), date_time.encode(), hashlib.sha1).hexdigest()


def signing_metadata(
    access_key: str, secret_key: str, now: float | None = None
) -> list[tuple[str, str]]:
    """The two headers a client sends for ``access_key`` at ``now`` (default: the clock)."""
    stamp = time.strftime(DATE_TIME_FORMAT, time.gmtime(time.time() if now is None else now))
    return [
        (DATE_TIME_HEADER, stamp),
        (
            AUTHORIZATION_HEADER,
            f"{ALGORITHM} Credential={access_key}, SignedHeaders={DATE_TIME_HEADER}, "
            f"Signature={sign(secret_key, stamp)}",
        ),
    ]


# A client sends the same two headers on every call within a second (the date-time has no
# finer grain), so their parses are memoized; both are pure, and a refusal is not memoized
# (lru_cache keeps no exceptions), so hostile headers cannot fill it with their answers.
@functools.lru_cache(maxsize=256)
def _parse(authorization: str) -> tuple[str, bytes]:
    """(access key, signature bytes) from the header, as Apache's proxy reads it."""
    if len(authorization) > _MAX_HEADER_CHARS:
        raise AuthenticationError("authorization header is too long")
    algorithm, _, rest = authorization.partition(" ")
    if algorithm != ALGORITHM or not rest:
        raise AuthenticationError(f"authorization header must be {ALGORITHM} Credential=…")
    access_key = signature = None
    for item in rest.split(","):
        key, sep, value = item.strip().partition("=")
        if not sep:
            raise AuthenticationError("authorization header is malformed")
        if key == "Credential":
            access_key = value.split("/")[0]
        elif key == "Signature":
            try:
                signature = binascii.unhexlify(value)
            except (binascii.Error, ValueError):
                raise AuthenticationError("authorization signature is not hex") from None
    if not access_key or signature is None:
        raise AuthenticationError("authorization header needs a Credential and a Signature")
    return access_key, signature


@functools.lru_cache(maxsize=256)
def _timestamp(date_time: str) -> float:
    """Seconds since the epoch of ``20261122T221500Z``. Sliced by hand: ``time.strptime``
    took most of a call's authentication time (it takes a lock and compiles a pattern)."""
    d = date_time
    digits = d[:8] + d[9:15]
    if len(d) != 16 or d[8] != "T" or d[15] != "Z" or not (digits.isascii() and digits.isdigit()):
        raise AuthenticationError(f"{DATE_TIME_HEADER} is not {DATE_TIME_FORMAT}")
    fields = (int(d[0:4]), int(d[4:6]), int(d[6:8]), int(d[9:11]), int(d[11:13]), int(d[13:15]))
    year, month, day, hour, minute, second = fields
    if not (1 <= month <= 12 and 1 <= day <= 31 and hour < 24 and minute < 60 and second < 61):
        raise AuthenticationError(f"{DATE_TIME_HEADER} is not {DATE_TIME_FORMAT}")
    return float(timegm((year, month, day, hour, minute, second, 0, 0, 0)))


class Authenticator:
    """Checks a call's headers against ``users``; thread-safe if ``users`` is."""

    def __init__(
        self,
        users: Users,
        max_skew_s: float = DEFAULT_MAX_SKEW_S,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.users = users
        self.max_skew_s = max_skew_s
        self.clock = clock

    def authenticate(self, metadata: Iterable[tuple[str, Any]]) -> Principal:
        """The caller; ``AuthenticationError`` for missing, malformed, stale or wrong headers,
        or an unknown access key (the two are not told apart: no probing for user names)."""
        headers: dict[str, str] = {}
        for key, value in metadata:
            if key in (AUTHORIZATION_HEADER, DATE_TIME_HEADER) and isinstance(value, str):
                headers[key] = value
        authorization = headers.get(AUTHORIZATION_HEADER)
        date_time = headers.get(DATE_TIME_HEADER)
        if not authorization:
            raise AuthenticationError("no credentials: this server requires signed requests")
        if not date_time or len(date_time) > 32:
            raise AuthenticationError(f"no {DATE_TIME_HEADER} header")
        access_key, signature = _parse(authorization)
        if abs(self.clock() - _timestamp(date_time)) > self.max_skew_s:
            raise AuthenticationError(
                f"{DATE_TIME_HEADER} is more than {int(self.max_skew_s)} s from the server's "
                "clock (stale or replayed request, or a client clock not in UTC)"
            )
        found = self.users.lookup(access_key)
        # Compute an HMAC even for an unknown key, so timing does not tell the two apart.
        secret, admin = found if found is not None else ("", False)
        expected = hmac.digest(secret.encode(), date_time.encode(), "sha1")  # one C call
        if not hmac.compare_digest(expected, signature) or found is None:
            raise AuthenticationError("signature does not match (wrong secret or access key)")
        return Principal(access_key, admin)


@dataclass(frozen=True, slots=True)
class _Method:
    request: type[Any]
    response: type[Any]
    in_band_status: bool  # the response carries an apache.rocketmq.v2.Status in ``status``


def _methods(files: Sequence[FileDescriptor]) -> dict[str, _Method]:
    out = {}
    for file in files:
        for service in file.services_by_name.values():
            for m in service.methods:
                out[f"/{service.full_name}/{m.name}"] = _method(m)
    return out


def _method(m: MethodDescriptor) -> _Method:
    status = m.output_type.fields_by_name.get("status")
    return _Method(
        request=message_factory.GetMessageClass(m.input_type),
        response=message_factory.GetMessageClass(m.output_type),
        in_band_status=status is not None
        and status.message_type is not None
        and status.message_type.full_name == "apache.rocketmq.v2.Status",
    )


class _Denied(Exception):
    def __init__(self, code: int, reason: str) -> None:
        super().__init__(reason)
        self.code = code
        self.reason = reason


class AuthInterceptor(grpc.ServerInterceptor):
    """Authenticates every call of the services described in ``files``, then asks
    ``authorize`` about its decoded request. Methods of other services (health excepted) are
    refused: a service added later must be described here to be reachable.

    Requests reach it as bytes (remoting/servicers.py moves decoding into the handler); it
    decodes them once and hands the servicer the decoded message."""

    def __init__(
        self,
        authenticator: Authenticator,
        authorize: Authorize,
        files: Sequence[FileDescriptor],
        on_denied: OnDenied = lambda method, kind: None,
    ) -> None:
        self.authenticator = authenticator
        self.authorize = authorize
        self.on_denied = on_denied
        self._methods = _methods(files)
        # method name -> (handler as served, its wrapper); a GIL-atomic dict, racing fills agree
        self._wrapped: dict[str, tuple[Any, Any]] = {}

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = continuation(handler_call_details)
        method_name: str = handler_call_details.method
        if handler is None or method_name.startswith(_EXEMPT_SERVICES):
            return handler
        cached = self._wrapped.get(method_name)
        if cached is not None and cached[0] is handler:
            return cached[1]
        method = self._methods.get(method_name)
        if method is None:
            return _refuse_unknown(handler, method_name)
        wrapped = self._wrap(handler, method_name, method)
        # Registered handlers are the same object on every call: wrap each once, not per call
        # (the closures and the handler's _replace were most of an allowed call's own cost).
        self._wrapped[method_name] = (handler, wrapped)
        return wrapped

    def _check(self, method_name: str, context: grpc.ServicerContext, request: Any) -> None:
        try:
            principal = self.authenticator.authenticate(context.invocation_metadata())
        except AuthenticationError as e:
            self._log(method_name, context, "unauthenticated", str(e))
            raise _Denied(UNAUTHORIZED, str(e)) from None
        reason = self.authorize(principal, method_name, request)
        if reason is not None:
            self._log(method_name, context, "forbidden", f"{principal.name}: {reason}")
            raise _Denied(FORBIDDEN, reason)

    def _log(self, method_name: str, context: grpc.ServicerContext, kind: str, why: str) -> None:
        self.on_denied(method_name, kind)
        log.info("refused %s from %s (%s): %s", method_name, context.peer(), kind, why)

    def _decode(self, method: _Method, raw: Any) -> Any:
        if not isinstance(raw, bytes):
            return raw
        try:
            return method.request.FromString(raw)
        except Exception:  # the servicer answers INVALID_ARGUMENT for it (servicers.py)
            return raw

    def _answer(self, method: _Method, denied: _Denied, context: grpc.ServicerContext) -> Any:
        if method.in_band_status:
            response = method.response()
            response.status.code = denied.code
            response.status.message = denied.reason
            return response
        code = (
            grpc.StatusCode.UNAUTHENTICATED
            if denied.code == UNAUTHORIZED
            else grpc.StatusCode.PERMISSION_DENIED
        )
        context.abort(code, denied.reason)

    def _wrap(self, handler: Any, method_name: str, method: _Method) -> Any:
        if handler.unary_unary is not None:
            inner_uu = handler.unary_unary
            # A method that decodes its own request (remoting/servicers.py ``takes_bytes``) is
            # authorized on its bytes: ``authorize`` reads what it needs from them.
            as_bytes = getattr(inner_uu, "takes_bytes", False)

            def unary_unary(raw: Any, context: grpc.ServicerContext) -> Any:
                request = raw if as_bytes else self._decode(method, raw)
                try:
                    self._check(method_name, context, request)
                except _Denied as denied:
                    return self._answer(method, denied, context)
                return inner_uu(request, context)

            return handler._replace(unary_unary=unary_unary)
        if handler.unary_stream is not None:
            inner_us = handler.unary_stream

            def unary_stream(raw: Any, context: grpc.ServicerContext) -> Iterator[Any]:
                request = self._decode(method, raw)
                try:
                    self._check(method_name, context, request)
                except _Denied as denied:
                    yield self._answer(method, denied, context)
                    return
                yield from inner_us(request, context)

            return handler._replace(unary_stream=unary_stream)
        kind = "stream_stream" if handler.stream_stream is not None else "stream_unary"
        inner_stream = getattr(handler, kind)

        def checked(
            raws: Iterator[Any], context: grpc.ServicerContext, denied: list[_Denied]
        ) -> Iterator[Any]:
            # Every message of a client stream is checked (a Telemetry stream's settings name
            # its topics and group). A refused one ends the stream as the client closing it
            # would: the servicer may read in a thread of its own, where an exception is lost.
            for raw in raws:
                request = self._decode(method, raw)
                try:
                    self._check(method_name, context, request)
                except _Denied as e:
                    denied.append(e)
                    return
                yield request

        def authenticated(context: grpc.ServicerContext) -> _Denied | None:
            try:
                self.authenticator.authenticate(context.invocation_metadata())
            except AuthenticationError as e:
                self._log(method_name, context, "unauthenticated", str(e))
                return _Denied(UNAUTHORIZED, str(e))
            return None

        if kind == "stream_stream":

            def stream_stream(raws: Iterator[Any], context: grpc.ServicerContext) -> Any:
                refused = authenticated(context)
                if refused is not None:
                    yield self._answer(method, refused, context)
                    return
                denied: list[_Denied] = []
                yield from inner_stream(checked(raws, context, denied), context)
                if denied:
                    yield self._answer(method, denied[0], context)

            return handler._replace(stream_stream=stream_stream)

        def stream_unary(raws: Iterator[Any], context: grpc.ServicerContext) -> Any:
            refused = authenticated(context)
            if refused is not None:
                return self._answer(method, refused, context)
            denied: list[_Denied] = []
            response = inner_stream(checked(raws, context, denied), context)
            return self._answer(method, denied[0], context) if denied else response

        return handler._replace(stream_unary=stream_unary)


def _refuse_unknown(handler: Any, method_name: str) -> Any:
    def refuse(request: Any, context: grpc.ServicerContext) -> Any:
        context.abort(grpc.StatusCode.PERMISSION_DENIED, f"{method_name} is not authorized")

    kinds = ("unary_unary", "unary_stream", "stream_unary", "stream_stream")
    kind = next(k for k in kinds if getattr(handler, k) is not None)
    return handler._replace(**{kind: refuse})


class SigningInterceptor(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
):
    """Signs every call of a client channel (tmq's CLI, a broker registering with the
    NameServers) with one access key, as Apache's clients do."""

    def __init__(self, access_key: str, secret_key: str) -> None:
        self._access_key = access_key
        self._secret_key = secret_key

    def __repr__(self) -> str:  # never the secret
        return f"SigningInterceptor({self._access_key!r})"

    def _details(self, details: Any) -> Any:
        metadata = list(details.metadata or [])
        metadata += signing_metadata(self._access_key, self._secret_key)
        return _CallDetails(
            details.method,
            details.timeout,
            metadata,
            details.credentials,
            getattr(details, "wait_for_ready", None),
            getattr(details, "compression", None),
        )

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._details(details), request)


class _CallDetails(
    namedtuple(
        "_CallDetails",
        ("method", "timeout", "metadata", "credentials", "wait_for_ready", "compression"),
    ),
    grpc.ClientCallDetails,
):
    pass
