"""A fault-injecting HTTP proxy for an S3 endpoint (LocalStack or any other).

Tests and benchmarks put it between tmq and the object store to make the network fail the
way real ones do, at the HTTP level: tmq's own ``ObjectStore`` code, its SDK timeouts and
retries all run unchanged.

    proxy = FaultProxy("http://127.0.0.1:4566").start()
    # point the broker / ObjectStore at proxy.url instead of LocalStack
    proxy.set(blackhole=True)                   # accept, read the request, never answer
    proxy.set(delay_ms=800)                     # every request waits 800 ms first
    proxy.set(reset=True)                       # answer every request with a TCP reset
    proxy.set(error_rate=0.3, error_status=503) # 30 % of requests get 503 SlowDown
    proxy.set(error_rate=1.0, after_forward=True, methods=["PUT"])
                                                # the PUT happens upstream, the client sees 500
    proxy.set(corrupt=True, methods=["GET"])    # one bit of every answer's body flipped
    proxy.set(truncate=True, methods=["GET"])   # answers cut off halfway, connection closed
    proxy.set(blackhole=True, paths=["/segments/"])
                                                # only segment objects and their listings
    proxy.heal()                                # back to a clean pass-through
    proxy.stop()

Another process controls a running proxy through the same port: the S3 API never uses the
path ``/__fault__`` (bucket names cannot contain ``_``), so

    POST /__fault__   {"blackhole": true}   replaces the fault settings (JSON, ``FaultSettings``)
    GET  /__fault__                         {"settings": {...}, "counters": {...}}

``FaultControl(url)`` is the client for that, and the command line offers both sides:

    python localstack/fault_proxy.py serve --upstream http://127.0.0.1:4566 --port-file P
    python localstack/fault_proxy.py set http://127.0.0.1:PORT --blackhole
    python localstack/fault_proxy.py heal http://127.0.0.1:PORT

Healing drops the connections held by a black hole without an answer (as a real black hole
that came back would: the client's request never gets a reply). Only the standard library is
used, so any Python (a test, a benchmark, LocalStack's own venv) can import or run it.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import random
import socket
import struct
import sys
import threading
import time
import urllib.parse
import urllib.request
from collections import Counter
from dataclasses import asdict, dataclass, field, fields
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

CONTROL_PATH = "/__fault__"
HOP_BY_HOP = {
    "connection",
    "keep-alive",
    "proxy-connection",
    "transfer-encoding",
    "te",
    "trailer",
    "upgrade",
    "expect",
}
ERROR_CODES = {500: "InternalError", 503: "SlowDown"}


@dataclass
class FaultSettings:
    """What the proxy does to each request. The default is a clean pass-through.

    ``methods`` limits every fault to those HTTP methods (empty: all). Precedence: blackhole,
    then reset, then delay followed by the error roll."""

    blackhole: bool = False
    reset: bool = False
    delay_ms: int = 0
    error_rate: float = 0.0
    error_status: int = 503
    after_forward: bool = False  # forward first, then answer the error: the write happened
    # Wrong bytes: one bit flipped in the middle of the body, of the request (PUT, POST: what
    # the store receives) or of the answer (GET: what the client receives).
    corrupt: bool = False
    # A body cut off: the answer's headers promise the whole body, half of it is sent, and the
    # connection is closed (a connection lost mid-transfer).
    truncate: bool = False
    methods: list[str] = field(default_factory=list)
    # Limits every fault to requests whose target (path and query, percent-decoded) contains
    # one of these (empty: all): e.g. "/segments/" for a queue's segment objects and their
    # listing, while its manifests still answer.
    paths: list[str] = field(default_factory=list)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> FaultSettings:
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"unknown fault settings {sorted(unknown)}")
        settings = cls(**data)
        if not 0.0 <= settings.error_rate <= 1.0:
            raise ValueError("error_rate must be within [0, 1]")
        settings.methods = [m.upper() for m in settings.methods]
        return settings

    def applies_to(self, method: str, target: str = "") -> bool:
        if self.methods and method.upper() not in self.methods:
            return False
        return not self.paths or any(p in urllib.parse.unquote(target) for p in self.paths)


class FaultProxy:
    """The proxy: a threaded HTTP server on a free loopback port forwarding to ``upstream``."""

    def __init__(self, upstream: str, port: int = 0, seed: int | None = None) -> None:
        parsed = urllib.parse.urlsplit(upstream)
        if parsed.scheme != "http" or not parsed.hostname:
            raise ValueError(f"upstream must be an http:// URL, not {upstream!r}")
        self.upstream_host = parsed.hostname
        self.upstream_port = parsed.port or 80
        self.settings = FaultSettings()
        self.counters: Counter[str] = Counter()
        # Requests by method, path and Range header (absent: ""), as the client sent them: what a
        # test counts the GETs of one object by. In this process only, not in ``snapshot``.
        self.requests: Counter[tuple[str, str, str]] = Counter()
        self._lock = threading.Lock()
        self._random = random.Random(seed)
        self._healed = threading.Event()  # set on every change: held black-hole requests drop
        self._stopping = threading.Event()
        self._server = _Server(("127.0.0.1", port), _Handler, self)
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> FaultProxy:
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="fault-proxy", daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopping.set()
        self._healed.set()
        self._server.shutdown()
        self._server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def set(self, **settings: Any) -> None:
        """Replace the fault settings (fields of ``FaultSettings``; unnamed ones reset)."""
        self.apply(FaultSettings.from_json(settings))

    def apply(self, settings: FaultSettings) -> None:
        with self._lock:
            self.settings = settings
            held, self._healed = self._healed, threading.Event()
        held.set()  # requests held by the previous black hole are dropped, unanswered

    def heal(self) -> None:
        self.apply(FaultSettings())

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {"settings": asdict(self.settings), "counters": dict(self.counters)}

    def _count(self, name: str) -> None:
        with self._lock:
            self.counters[name] += 1

    def _decide(self, method: str, target: str = "") -> tuple[FaultSettings, threading.Event, bool]:
        """The settings in force for this request, its black-hole release event, and whether
        the error roll fails it."""
        with self._lock:
            settings = self.settings
            fail = (
                settings.applies_to(method, target) and self._random.random() < settings.error_rate
            )
            return settings, self._healed, fail


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, address: tuple[str, int], handler: type, proxy: FaultProxy) -> None:
        self.proxy = proxy
        super().__init__(address, handler)


class _Drop(Exception):
    """Close the client connection without an answer."""


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as S3 clients pool connections
    server: _Server
    _upstream: http.client.HTTPConnection | None = None

    def log_message(self, format: str, *args: Any) -> None:
        pass  # a test's output stays readable; the counters say what happened

    def do_GET(self) -> None:
        self._handle()

    do_PUT = do_POST = do_DELETE = do_HEAD = do_GET

    def _handle(self) -> None:
        proxy = self.server.proxy
        path = urllib.parse.urlsplit(self.path).path
        if path == CONTROL_PATH:
            self._control()
            return
        body = self._read_body()
        proxy._count("requests")
        with proxy._lock:
            proxy.requests[(self.command, path, self.headers.get("Range", ""))] += 1
        settings, released, fail = proxy._decide(self.command, self.path)
        try:
            if settings.applies_to(self.command, self.path):
                if settings.blackhole:
                    proxy._count("blackholed")
                    released.wait()  # until healed or stopped; then drop, unanswered
                    raise _Drop
                if settings.reset:
                    proxy._count("reset")
                    self._reset()
                    return
                if settings.delay_ms:
                    proxy._count("delayed")
                    time.sleep(settings.delay_ms / 1000)
            if fail and not settings.after_forward:
                proxy._count(f"error_{settings.error_status}")
                self._error(settings.error_status)
                return
            faulty = settings.applies_to(self.command, self.path)
            if faulty and settings.corrupt and body:
                proxy._count("corrupted")
                body = _flip(body)
            status, reason, headers, payload = self._forward(body)
            if faulty and settings.corrupt and payload and status < 300:
                proxy._count("corrupted")
                payload = _flip(payload)
            if fail:
                proxy._count(f"error_{settings.error_status}_after_forward")
                self._error(settings.error_status)
                return
            proxy._count("forwarded")
            if faulty and settings.truncate and len(payload) > 1 and status < 300:
                proxy._count("truncated")
                self._answer(status, reason, headers, payload, cut=len(payload) // 2)
                raise _Drop
            self._answer(status, reason, headers, payload)
        except _Drop:
            self.close_connection = True
            self._shutdown_socket()
        except OSError:
            proxy._count("upstream_failed")
            self.close_connection = True
            self._shutdown_socket()

    def _read_body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            parts: list[bytes] = []
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip(), 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass  # trailers
                    return b"".join(parts)
                parts.append(self.rfile.read(size))
                self.rfile.readline()
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length else b""

    def _forward(self, body: bytes) -> tuple[int, str, list[tuple[str, str]], bytes]:
        """Send the request upstream with the client's own headers (its Host header too: the
        signature covers it) and read the whole answer. One retry on a stale pooled
        connection."""
        headers = [(k, v) for k, v in self.headers.items() if k.lower() not in HOP_BY_HOP]
        chunked = self.headers.get("Transfer-Encoding", "").lower() == "chunked"
        if chunked:
            headers = [(k, v) for k, v in headers if k.lower() != "content-length"]
            headers.append(("Content-Length", str(len(body))))
        for attempt in (1, 2):
            conn = self._connection()
            try:
                conn.putrequest(self.command, self.path, skip_host=True, skip_accept_encoding=True)
                for key, value in headers:
                    conn.putheader(key, value)
                conn.endheaders(body if body else None)
                response = conn.getresponse()
                payload = response.read()
                return response.status, response.reason, response.getheaders(), payload
            except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError):
                conn.close()
                self._upstream = None
                if attempt == 2:
                    raise
        raise AssertionError("unreachable")

    def _connection(self) -> http.client.HTTPConnection:
        if self._upstream is None:
            proxy = self.server.proxy
            self._upstream = http.client.HTTPConnection(
                proxy.upstream_host, proxy.upstream_port, timeout=120
            )
        return self._upstream

    def _answer(
        self,
        status: int,
        reason: str,
        headers: list[tuple[str, str]],
        payload: bytes,
        cut: int | None = None,
    ) -> None:
        """Send the answer; ``cut``: only that many bytes of its body (the headers promise all)."""
        self.send_response_only(status, reason)
        has_length = False
        for key, value in headers:
            lower = key.lower()
            if lower in HOP_BY_HOP:
                continue
            if lower == "content-length":
                if self.command != "HEAD":
                    value = str(len(payload))
                has_length = True
            self.send_header(key, value)
        if not has_length:
            self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(payload if cut is None else payload[:cut])
            self.wfile.flush()

    def _error(self, status: int) -> None:
        code = ERROR_CODES.get(status, "InternalError")
        payload = (
            '<?xml version="1.0" encoding="UTF-8"?>\n'
            f"<Error><Code>{code}</Code><Message>injected by fault_proxy</Message>"
            "<RequestId>fault-proxy</RequestId></Error>"
        ).encode()
        self.send_response_only(status)
        self.send_header("Content-Type", "application/xml")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(payload)

    def _reset(self) -> None:
        # SO_LINGER with a zero timeout: close() sends RST instead of FIN.
        self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.close_connection = True
        self.connection.close()

    def _shutdown_socket(self) -> None:
        with contextlib.suppress(OSError):
            self.connection.shutdown(socket.SHUT_RDWR)

    def _control(self) -> None:
        proxy = self.server.proxy
        try:
            if self.command == "POST":
                proxy.apply(FaultSettings.from_json(json.loads(self._read_body() or b"{}")))
            elif self.command != "GET":
                raise ValueError(f"{self.command} is not a control method (GET or POST)")
            status, payload = 200, json.dumps(proxy.snapshot()).encode()
        except (ValueError, TypeError) as e:
            status, payload = 400, json.dumps({"error": str(e)}).encode()
        self.send_response_only(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def finish(self) -> None:
        try:
            super().finish()
        finally:
            if self._upstream is not None:
                self._upstream.close()


def _flip(data: bytes) -> bytes:
    """``data`` with the lowest bit of its middle byte flipped."""
    out = bytearray(data)
    out[len(out) // 2] ^= 0x01
    return bytes(out)


class FaultControl:
    """Drive a proxy running in another process (or this one) through its control path."""

    def __init__(self, proxy_url: str) -> None:
        self.url = proxy_url.rstrip("/") + CONTROL_PATH

    def set(self, **settings: Any) -> dict[str, Any]:
        return self._call(json.dumps(settings).encode())

    def heal(self) -> dict[str, Any]:
        return self.set()

    def snapshot(self) -> dict[str, Any]:
        return self._call(None)

    def _call(self, data: bytes | None) -> dict[str, Any]:
        request = urllib.request.Request(self.url, data=data, method="POST" if data else "GET")
        with urllib.request.urlopen(request, timeout=10) as response:
            answer: dict[str, Any] = json.loads(response.read())
            return answer


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="run a proxy until interrupted")
    serve.add_argument("--upstream", default="http://127.0.0.1:4566")
    serve.add_argument("--port", type=int, default=0)
    serve.add_argument("--port-file", type=Path, help="write the bound port here once serving")
    serve.add_argument("--seed", type=int)
    setter = commands.add_parser("set", help="replace a running proxy's fault settings")
    setter.add_argument("proxy")
    setter.add_argument("--blackhole", action="store_true")
    setter.add_argument("--reset", action="store_true")
    setter.add_argument("--delay-ms", type=int, default=0)
    setter.add_argument("--error-rate", type=float, default=0.0)
    setter.add_argument("--error-status", type=int, default=503)
    setter.add_argument("--after-forward", action="store_true")
    setter.add_argument("--corrupt", action="store_true")
    setter.add_argument("--truncate", action="store_true")
    setter.add_argument("--methods", nargs="*", default=[])
    setter.add_argument("--paths", nargs="*", default=[])
    for name in ("heal", "show"):
        commands.add_parser(name).add_argument("proxy")
    args = parser.parse_args(argv)
    if args.command == "serve":
        proxy = FaultProxy(args.upstream, args.port, args.seed).start()
        if args.port_file:
            args.port_file.write_text(str(proxy.port))
        print(proxy.url, flush=True)
        try:
            threading.Event().wait()
        except KeyboardInterrupt:
            proxy.stop()
        return 0
    control = FaultControl(args.proxy)
    if args.command == "set":
        answer = control.set(
            blackhole=args.blackhole,
            reset=args.reset,
            delay_ms=args.delay_ms,
            error_rate=args.error_rate,
            error_status=args.error_status,
            after_forward=args.after_forward,
            corrupt=args.corrupt,
            truncate=args.truncate,
            methods=args.methods,
            paths=args.paths,
        )
    elif args.command == "heal":
        answer = control.heal()
    else:
        answer = control.snapshot()
    print(json.dumps(answer))
    return 0


if __name__ == "__main__":
    sys.exit(main())
