"""TLS and credentials for tmq's gRPC ports and for the channels tmq opens to them.

Servers (NameServer, broker with its admin service) take a ``TlsConfig`` (``[tls]`` of
tmq.toml): with ``cert_file`` set, the port speaks TLS only and a plaintext client is refused
at its handshake; with ``client_ca_file`` as well, a client must present a certificate signed
by that CA (mTLS). Clients (the ``tmq`` CLI, a broker registering with the NameServers) take a
``ChannelSecurity``: the CA to trust, an optional client certificate, and the access key they
sign with. The CLI reads it from the environment (``from_env``), like Apache's tools read
theirs; secrets are never part of a repr.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from remoting.auth import DEFAULT_MAX_SKEW_S, SigningInterceptor

ACCESS_KEY_ENV = "TMQ_ADMIN_ACCESS_KEY"
SECRET_KEY_ENV = "TMQ_ADMIN_SECRET_KEY"
CA_FILE_ENV = "TMQ_TLS_CA_FILE"
CLIENT_CERT_ENV = "TMQ_TLS_CLIENT_CERT_FILE"
CLIENT_KEY_ENV = "TMQ_TLS_CLIENT_KEY_FILE"


@dataclass(slots=True)
class AuthConfig:
    """``[auth]``: whether every call must be signed (docs/security.md)."""

    enabled: bool = False
    # How far a request's x-mq-date-time may be from the server's clock.
    max_clock_skew_s: int = DEFAULT_MAX_SKEW_S


@dataclass(slots=True)
class TlsConfig:
    """``[tls]``: the certificate every server port presents (PEM files)."""

    cert_file: str = ""
    key_file: str = ""
    # The CA that signed the servers' certificates: what this process trusts when it calls
    # another tmq server (a broker registering with the NameServers).
    ca_file: str = ""
    # Set: clients must present a certificate signed by this CA (mTLS).
    client_ca_file: str = ""

    def __post_init__(self) -> None:
        if bool(self.cert_file) != bool(self.key_file):
            raise ValueError("[tls] cert_file and key_file go together")

    @property
    def enabled(self) -> bool:
        return bool(self.cert_file)


def _read(path: str, what: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as e:
        raise OSError(f"[tls] {what} {path}: {e.strerror or e}") from None


def server_credentials(tls: TlsConfig) -> grpc.ServerCredentials:
    """The port's TLS credentials; ``OSError`` naming the file that cannot be read."""
    pair = (_read(tls.key_file, "key_file"), _read(tls.cert_file, "cert_file"))
    if tls.client_ca_file:
        return grpc.ssl_server_credentials(
            [pair],
            root_certificates=_read(tls.client_ca_file, "client_ca_file"),
            require_client_auth=True,
        )
    return grpc.ssl_server_credentials([pair])


@dataclass(frozen=True, slots=True)
class ChannelSecurity:
    """How a tmq client reaches tmq servers: TLS (``ca_file`` set) and signing (access key)."""

    access_key: str = ""
    secret_key: str = field(default="", repr=False)
    ca_file: str = ""
    cert_file: str = ""  # a client certificate, for servers that require mTLS
    key_file: str = ""

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> ChannelSecurity:
        return cls(
            access_key=env.get(ACCESS_KEY_ENV, ""),
            secret_key=env.get(SECRET_KEY_ENV, ""),
            ca_file=env.get(CA_FILE_ENV, ""),
            cert_file=env.get(CLIENT_CERT_ENV, ""),
            key_file=env.get(CLIENT_KEY_ENV, ""),
        )

    @classmethod
    def for_server(cls, tls: TlsConfig, env: Mapping[str, str]) -> ChannelSecurity:
        """A server's own outgoing calls: its ``[tls]`` CA (its certificate doubles as its
        client certificate for mTLS) and the admin credentials of the environment."""
        mine = cls.from_env(env)
        return cls(
            mine.access_key,
            mine.secret_key,
            tls.ca_file or mine.ca_file,
            tls.cert_file if tls.client_ca_file else mine.cert_file,
            tls.key_file if tls.client_ca_file else mine.key_file,
        )

    @property
    def signs(self) -> bool:
        return bool(self.access_key and self.secret_key)

    def channel(self, target: str, options: Sequence[tuple[str, Any]] = ()) -> grpc.Channel:
        """A channel to ``target``: TLS if a CA is set, signing every call if a key is."""
        if self.ca_file:
            credentials = grpc.ssl_channel_credentials(
                root_certificates=_read(self.ca_file, "ca_file"),
                private_key=_read(self.key_file, "client key_file") if self.key_file else None,
                certificate_chain=_read(self.cert_file, "client cert_file")
                if self.cert_file
                else None,
            )
            channel = grpc.secure_channel(target, credentials, options=list(options))
        else:
            channel = grpc.insecure_channel(target, options=list(options))
        if self.signs:
            return grpc.intercept_channel(
                channel, SigningInterceptor(self.access_key, self.secret_key)
            )
        return channel
