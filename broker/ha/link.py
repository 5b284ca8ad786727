"""Securing the replication link: TLS from ``[tls]``, and mutual authentication with ``[auth]``.

The link carries every message and the replicated metadata (users and their secrets included),
so it gets what every other tmq port has (decision 220):

- **TLS.** With ``[tls] cert_file`` set the master's replication port speaks TLS only and a
  slave dials it with TLS, trusting ``[tls] ca_file`` (the system roots when empty) and checking
  that the certificate names the address it dials. With ``client_ca_file`` set as well the
  master requires the slave's certificate, signed by that CA (mTLS); a slave always offers its
  own ``cert_file`` when asked.
- **Authentication** (``[auth] enabled``), before anything else is said (HELLO names offsets,
  WELCOME the epochs): a challenge-response over HMAC-SHA256, each side proving it holds the
  secret key of an **admin** user of the other side's user store, as Kafka's inter-broker
  principal must be a super user. Each member signs with the environment's admin
  (``TMQ_ADMIN_ACCESS_KEY`` / ``TMQ_ADMIN_SECRET_KEY``, what it registers with the NameServers
  with). Nonces from both sides and a role label go into each proof, so a proof is never valid
  twice nor in the other direction; proofs are compared in constant time; an unknown key, a
  non-admin and a wrong secret get the same refusal after the same work.

  ====== ============ =====================================================================
  step   direction    AUTH frame
  ====== ============ =====================================================================
  1      slave->master access key S, nonce Ns (32 random bytes)
  2      master->slave access key M, nonce Nm, proof HMAC(secret M, "tmq-ha master" | S | M |
                      Ns | Nm)
  3      slave->master proof HMAC(secret S, "tmq-ha slave" | S | M | Ns | Nm)
  ====== ============ =====================================================================

Refusals are logged on the side that refuses (peer address, access key, reason; never a secret,
nonce or proof) and answered with an ERROR frame before the connection closes.

``TlsConnection`` exists because ``ssl.SSLSocket`` must not be read by one thread while another
writes (OpenSSL's objects are not thread-safe; CPython takes no lock): the master reads ACKs and
pushes DATA on one connection from two threads. It runs OpenSSL over memory buffers under a lock
and does the socket I/O outside it.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import logging
import os
import socket
import ssl
import threading
from dataclasses import dataclass, field

from broker.ha import wire
from remoting.auth import Users
from remoting.security import TlsConfig

log = logging.getLogger(__name__)

_NONCE_BYTES = 32
_HANDSHAKE_TIMEOUT_S = 5.0
# Plaintext bytes per TLS write under the lock (TLS records are 16 KiB).
_WRITE_CHUNK = 256 << 10
_RECV_BYTES = 256 << 10
_TLS_RECORD_HANDSHAKE = 0x16


class LinkRefusedError(wire.ProtocolError):
    """The peer is not who the link requires (unauthenticated, wrong credentials, plaintext)."""


@dataclass(frozen=True, slots=True)
class LinkSecurity:
    """How this member secures its replication connections. The default: plaintext and
    unauthenticated (``[tls]`` and ``[auth]`` off), as before."""

    tls: TlsConfig = field(default_factory=TlsConfig)
    # [auth] on: the peer must prove an admin key of ``users``, and this member proves its own.
    users: Users | None = None
    access_key: str = ""
    secret_key: str = field(default="", repr=False)

    def __post_init__(self) -> None:
        if self.users is not None and not (self.access_key and self.secret_key):
            raise ValueError(
                "[auth] with [ha]: replica group members authenticate each other with the "
                "environment's admin; set TMQ_ADMIN_ACCESS_KEY and TMQ_ADMIN_SECRET_KEY"
            )

    @property
    def authenticates(self) -> bool:
        return self.users is not None

    # -- the master's side ---------------------------------------------------------------------

    def server_context(self) -> ssl.SSLContext | None:
        """Built once per master (reads the files; ``OSError`` names a missing one)."""
        if not self.tls.enabled:
            return None
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        context.load_cert_chain(self.tls.cert_file, self.tls.key_file)
        if self.tls.client_ca_file:
            context.load_verify_locations(self.tls.client_ca_file)
            context.verify_mode = ssl.CERT_REQUIRED
        return context

    def accept(
        self, sock: socket.socket, address: str, context: ssl.SSLContext | None
    ) -> wire.Connection:
        """A slave's connection, secured and authenticated as this member requires;
        ``LinkRefusedError`` (already logged and answered) when it is not."""
        sock.settimeout(_HANDSHAKE_TIMEOUT_S)
        conn: wire.Connection = sock
        try:
            if context is not None:
                conn = TlsConnection(sock, context, server_side=True)
            elif _peek(sock) == _TLS_RECORD_HANDSHAKE:
                raise LinkRefusedError("it speaks TLS, but [tls] is off on this master")
            if self.users is not None:
                self._authenticate_slave(conn)
            elif _peek_frame(conn) is wire.FrameType.AUTH:
                raise LinkRefusedError(
                    "it authenticates, but [auth] is off on this master: turn it on (or off) on "
                    "every member of the group"
                )
        except (ssl.SSLError, OSError, wire.ProtocolError) as e:
            reason = f"TLS handshake failed: {e}" if isinstance(e, ssl.SSLError) else str(e)
            log.warning("replication: refused the connection from %s: %s", address, reason)
            if not isinstance(e, ssl.SSLError) and "peer:" not in reason:
                _send_error(conn, "refused: " + reason)
            raise LinkRefusedError(reason) from None
        sock.settimeout(None)
        return conn

    def _authenticate_slave(self, conn: wire.Connection) -> None:
        assert self.users is not None
        kind, body = wire.read_frame(conn)
        if kind is not wire.FrameType.AUTH:
            raise LinkRefusedError(
                f"it sent {kind.name} without authenticating; this master requires it "
                "([auth] enabled): turn [auth] on on every member of the group"
            )
        hello = wire.decode_auth(body)
        nonce = os.urandom(_NONCE_BYTES)
        context = (hello.access_key, self.access_key, hello.nonce, nonce)
        conn.sendall(
            wire.encode_auth(
                wire.Auth(self.access_key, nonce, _proof(self.secret_key, b"master", *context))
            )
        )
        answer = wire.decode_auth(wire.expect(conn, wire.FrameType.AUTH))
        if len(hello.nonce) != _NONCE_BYTES or not self._verify(
            hello.access_key, answer.proof, b"slave", context
        ):
            raise LinkRefusedError(
                f"authentication failed for access key {hello.access_key!r} (unknown, not an "
                "admin, or a wrong secret key)"
            )

    # -- the slave's side ----------------------------------------------------------------------

    def client_context(self) -> ssl.SSLContext | None:
        if not self.tls.enabled:
            return None
        context = ssl.create_default_context(cafile=self.tls.ca_file or None)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        # Offered only when the master asks (its client_ca_file is set).
        context.load_cert_chain(self.tls.cert_file, self.tls.key_file)
        return context

    def connect(self, sock: socket.socket, host: str) -> wire.Connection:
        """This slave's connection to the master at ``host``, secured and authenticated;
        ``LinkRefusedError`` when the master is not who it must be. The socket keeps a
        handshake timeout: the caller clears it once the replication handshake is done."""
        sock.settimeout(_HANDSHAKE_TIMEOUT_S)
        conn: wire.Connection = sock
        context = self.client_context()
        if context is not None:
            try:
                conn = TlsConnection(sock, context, server_side=False, server_hostname=host)
            except ssl.SSLError as e:
                raise LinkRefusedError(f"TLS handshake with the master failed: {e}") from None
        if self.users is not None:
            self._authenticate_master(conn)
        return conn

    def _authenticate_master(self, conn: wire.Connection) -> None:
        nonce = os.urandom(_NONCE_BYTES)
        conn.sendall(wire.encode_auth(wire.Auth(self.access_key, nonce)))
        kind, body = wire.read_frame(conn)
        if kind is not wire.FrameType.AUTH:
            raise LinkRefusedError(f"the master answered {kind.name}, not AUTH")
        challenge = wire.decode_auth(body)
        context = (self.access_key, challenge.access_key, nonce, challenge.nonce)
        if len(challenge.nonce) != _NONCE_BYTES or not self._verify(
            challenge.access_key, challenge.proof, b"master", context
        ):
            reason = (
                f"the master failed authentication as {challenge.access_key!r} (unknown here, "
                "not an admin, or a wrong secret key); not following it"
            )
            _send_error(conn, "refused: the master failed authentication")
            raise LinkRefusedError(reason)
        conn.sendall(wire.encode_auth(wire.Auth(proof=_proof(self.secret_key, b"slave", *context))))

    def _verify(
        self, access_key: str, proof: bytes, role: bytes, context: tuple[str, str, bytes, bytes]
    ) -> bool:
        assert self.users is not None
        found = self.users.lookup(access_key)
        # The same work whether or not the key exists and is an admin.
        secret = found[0] if found is not None else os.urandom(24).hex()
        expected = _proof(secret, role, *context)
        matches = hmac.compare_digest(expected, proof)
        return matches and found is not None and found[1]


def _proof(
    secret: str, role: bytes, slave_key: str, master_key: str, ns: bytes, nm: bytes
) -> bytes:
    message = b"\0".join((b"tmq-ha " + role, slave_key.encode(), master_key.encode(), ns, nm))
    return hmac.new(secret.encode(), message, hashlib.sha256).digest()


def _peek(sock: socket.socket) -> int | None:
    try:
        first = sock.recv(1, socket.MSG_PEEK)
    except OSError:
        return None
    return first[0] if first else None


def _peek_frame(conn: wire.Connection) -> wire.FrameType | None:
    """The type of the first frame, without consuming it (plain sockets only)."""
    if not isinstance(conn, socket.socket):
        return None
    try:
        head = conn.recv(5, socket.MSG_PEEK | socket.MSG_WAITALL)
    except OSError:
        return None
    return wire.FrameType.AUTH if len(head) == 5 and head[4] == wire.FrameType.AUTH else None


def _send_error(conn: wire.Connection, reason: str) -> None:
    with contextlib.suppress(OSError, ssl.SSLError):
        conn.sendall(wire.encode_error(reason))


class TlsConnection:
    """A TLS session over a connected socket, for one reading and one writing thread at once.

    OpenSSL runs over memory buffers (``ssl.MemoryBIO``) under ``_ssl_lock``, held only while
    it encrypts or decrypts; the socket is read outside any lock. Ciphertext leaves in the order
    OpenSSL produced it because it is drained from the buffer and sent under ``_send_lock``.
    """

    def __init__(
        self,
        sock: socket.socket,
        context: ssl.SSLContext,
        *,
        server_side: bool,
        server_hostname: str | None = None,
    ) -> None:
        self.sock = sock
        self._incoming = ssl.MemoryBIO()
        self._outgoing = ssl.MemoryBIO()
        self._ssl = context.wrap_bio(
            self._incoming, self._outgoing, server_side=server_side, server_hostname=server_hostname
        )
        self._ssl_lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._handshake()

    def _handshake(self) -> None:
        while True:
            try:
                self._ssl.do_handshake()
                done = True
            except ssl.SSLWantReadError:
                done = False
            out = self._outgoing.read()
            if out:
                self.sock.sendall(out)
            if done:
                return
            data = self.sock.recv(_RECV_BYTES)
            if not data:
                raise ConnectionError("the peer closed the connection during the TLS handshake")
            self._incoming.write(data)

    def sendall(self, data: bytes | memoryview, /) -> None:
        view = memoryview(data)
        with self._send_lock:
            while view:
                with self._ssl_lock:
                    n = self._ssl.write(view[:_WRITE_CHUNK])
                    out = self._outgoing.read()
                self.sock.sendall(out)
                view = view[n:]

    def recv_into(self, buffer: memoryview, nbytes: int = 0, /) -> int:
        n = nbytes or len(buffer)
        while True:
            with self._ssl_lock:
                try:
                    got: int = self._ssl.read(n, buffer)  # type: ignore[assignment]
                except ssl.SSLWantReadError:
                    got = -1
                except (ssl.SSLZeroReturnError, ssl.SSLEOFError):
                    got = 0
                pending = self._outgoing.pending
            if pending:  # OpenSSL answered something (a key update): send it in order
                with self._send_lock:
                    with self._ssl_lock:
                        out = self._outgoing.read()
                    if out:
                        self.sock.sendall(out)
            if got >= 0:
                return got
            data = self.sock.recv(_RECV_BYTES)
            if not data:
                return 0
            with self._ssl_lock:
                self._incoming.write(data)

    def settimeout(self, timeout: float | None) -> None:
        self.sock.settimeout(timeout)

    def setsockopt(self, level: int, option: int, value: int) -> None:
        self.sock.setsockopt(level, option, value)

    def shutdown(self, how: int) -> None:
        self.sock.shutdown(how)

    def close(self) -> None:
        self.sock.close()
