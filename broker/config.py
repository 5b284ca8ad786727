"""The broker's configuration: one typed object, from TOML, with ``TMQ_…`` environment overrides.

```toml
[broker]
cluster = "DefaultCluster"
name = "broker-a"
listen = "0.0.0.0"
port = 8081
advertise_host = "127.0.0.1"   # what clients are told to connect to
namesrv = "127.0.0.1:9876"     # several: "h1:9876;h2:9876"
auto_create_groups = true
heartbeat_interval_ms = 30000
metrics_port = 5557            # Prometheus /metrics; 0 turns it off

[store]
data_dir = "./tmq-data"
flush = "async"                # or "sync"
commitlog_file_size = "1GiB"

[offload]
upload_after_ms = 60000        # upload a queue once its oldest pending message is this old,
upload_min_bytes = "16MiB"     # or this many bytes are pending,
upload_min_messages = 10000    # or this many messages
segment_max_bytes = "64MiB"    # roll segment objects at this size

[retry]                        # the one retry policy for every object-store call
attempts = 6

[limits]
max_body_bytes = 4194304
```

Every key can be overridden from the environment as ``TMQ_{SECTION}_{KEY}`` (see
``load_config``); ``tmq.toml.example`` lists them all with their defaults. The loader is strict:
an unknown section or key, or a value of the wrong type, is an error naming the file and the key.
Values are converted by the fields' real types (``typing.get_type_hints``), never by reading
annotations as text.
"""

from __future__ import annotations

import os
import tomllib
import types
import typing
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from broker.ha.config import HaConfig
from broker.metadata import Limits
from broker.timer import DEFAULT_MAX_DELAY_MS
from broker.transaction import TransactionConfig
from lakehouse.runner import LakehouseConfig
from offload.offloader import OffloadPolicy
from remoting.security import AuthConfig, TlsConfig
from tiered.cold.storage import RetryPolicy
from tiered.config import StoreConfig, parse_duration_ms, parse_size


@dataclass(slots=True)
class BrokerConfig:
    cluster: str = "DefaultCluster"
    name: str = "broker-a"
    listen: str = "0.0.0.0"
    port: int = 8081
    advertise_host: str = "127.0.0.1"
    namesrv: list[str] = field(default_factory=lambda: ["127.0.0.1:9876"])
    auto_create_groups: bool = True
    # How often to re-register with the NameServers (they forget a broker after 120 s).
    heartbeat_interval_ms: int = 30_000
    # The cold tier: file://… (embedded default) or s3://bucket/prefix (standard AWS chain).
    tier_url: str | None = None
    # fsspec/s3fs options (endpoint_url, …). Secrets here (key, secret, token) are never printed:
    # repr() leaves them out (tiered/cold/credentials.py).
    tier_options: dict[str, Any] = field(default_factory=dict, repr=False)
    # How often tiered topics are uploaded and eligible CommitLog files released.
    offload_interval_ms: int = 10_000
    # Prometheus metrics at http://{listen}:{metrics_port}/metrics; 0 turns them off.
    metrics_port: int = 5557
    # How long an admin call waits for the cold tier: a topic change's check of the archives
    # (decision 785), a topic's description (decision 810). Well inside the CLI's 10 s; what
    # has not come by then is reported unknown (or left unchecked), never made up.
    admin_tier_wait_ms: int = 5_000
    # Transactional messages (RocketMQ's transactionTimeOut, transactionCheckInterval,
    # transactionCheckMax): the first check-back this long after the half message, then every
    # interval, at most this many; then "rollback" or "keep" the half message undecided.
    transaction_timeout_ms: int = 6_000
    transaction_check_interval_ms: int = 30_000
    transaction_check_max: int = 15
    transaction_check_exhausted: str = "rollback"
    # The most half messages one pass of the check loop (every second at most) checks back or
    # gives up on, whatever the backlog (decision 531).
    transaction_check_batch: int = 200
    # The latest delivery time a delay message may ask for, from now (RocketMQ's
    # timerMaxDelaySec, 3 days); later ones are refused with ILLEGAL_DELIVERY_TIME.
    timer_max_delay_ms: int = DEFAULT_MAX_DELAY_MS
    store: StoreConfig = field(default_factory=StoreConfig)
    offload: OffloadPolicy = field(default_factory=OffloadPolicy)
    # Every object-store call of the broker (upload, manifest, cold read, verify, retention).
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    # The continuous Delta export, run as a child process beside the broker when enabled.
    lakehouse: LakehouseConfig = field(default_factory=LakehouseConfig)
    limits: Limits = field(default_factory=Limits)
    # Replica group membership and replication (off by default: a single broker).
    ha: HaConfig = field(default_factory=HaConfig)
    # Signed requests and ACLs (docs/security.md); off by default.
    auth: AuthConfig = field(default_factory=AuthConfig)
    # TLS on every port (gRPC, metrics) when a certificate is named.
    tls: TlsConfig = field(default_factory=TlsConfig)

    def __post_init__(self) -> None:
        self.transactions  # noqa: B018  refuses a bad transaction_check_exhausted at load

    @property
    def config_dir(self) -> Path:
        return self.store.data_dir / "config"

    @property
    def transactions(self) -> TransactionConfig:
        return TransactionConfig(
            timeout_ms=self.transaction_timeout_ms,
            check_interval_ms=self.transaction_check_interval_ms,
            check_max=self.transaction_check_max,
            exhausted=self.transaction_check_exhausted,
            check_batch=self.transaction_check_batch,
        )


# Each section of tmq.toml and the dataclass it fills ("broker": the top-level fields).
SECTIONS: dict[str, type] = {
    "broker": BrokerConfig,
    "store": StoreConfig,
    "offload": OffloadPolicy,
    "retry": RetryPolicy,
    "limits": Limits,
    "lakehouse": LakehouseConfig,
    "ha": HaConfig,
    "auth": AuthConfig,
    "tls": TlsConfig,
}
# Keys that take a size ("64MiB", "1GiB" or a byte count) rather than a plain integer.
SIZE_KEYS = {
    "commitlog_file_size",
    "max_message_size",
    "max_dispatch_lag_bytes",
    "segment_max_bytes",
    "upload_min_bytes",
}
# Short forms of a few environment overrides.
SHORT_ENV = {
    "TMQ_NAMESRV_ADDR": "TMQ_BROKER_NAMESRV",
    "TMQ_PORT": "TMQ_BROKER_PORT",
    "TMQ_DATA_DIR": "TMQ_STORE_DATA_DIR",
    "TMQ_FLUSH": "TMQ_STORE_FLUSH",
    "TMQ_TIER_URL": "TMQ_BROKER_TIER_URL",
}


def section_fields(section: str) -> dict[str, Any]:
    """The keys of ``section`` and their types (nested sections left out of ``broker``)."""
    cls = SECTIONS[section]
    hints = typing.get_type_hints(cls)
    nested = set(SECTIONS.values())
    return {f.name: hints[f.name] for f in fields(cls) if hints[f.name] not in nested}


def convert(name: str, key: str, value: Any, kind: Any, from_env: bool) -> Any:
    """``value`` (from TOML, or a string from the environment) as a value of type ``kind``;
    ``ValueError`` naming ``name`` (where the value came from) and the key otherwise."""
    if key in SIZE_KEYS:
        try:
            return parse_size(value)
        except ValueError as e:
            raise ValueError(f"{name}: {key}: {e}") from None
    args = typing.get_args(kind)
    origin = typing.get_origin(kind)
    if origin in (types.UnionType, typing.Union):
        if from_env and value == "" and type(None) in args:
            return None
        (kind,) = [a for a in args if a is not type(None)]
        origin, args = typing.get_origin(kind), typing.get_args(kind)
    if origin is typing.Literal:
        if value not in args:
            raise ValueError(f"{name}: {key} must be one of {list(args)}, not {value!r}")
        return value
    if kind is bool:
        if from_env:
            if value.lower() not in ("1", "0", "true", "false", "yes", "no"):
                raise ValueError(f"{name}: {key}: {value!r} is not true or false")
            return value.lower() in ("1", "true", "yes")
        if not isinstance(value, bool):
            raise ValueError(f"{name}: {key}: {value!r} is not true or false")
        return value
    if kind in (int, float):
        if isinstance(value, bool) or not isinstance(value, int | float | str):
            raise ValueError(f"{name}: {key}: {value!r} is not a number")
        if isinstance(value, str) and not from_env:
            raise ValueError(f"{name}: {key}: {value!r} is not a number (write it unquoted)")
        try:
            number = kind(value)
        except ValueError:
            raise ValueError(f"{name}: {key}: {value!r} is not a number") from None
        if kind is int and isinstance(value, float) and value != number:
            raise ValueError(f"{name}: {key}: {value!r} is not a whole number")
        return number
    if kind in (str, Path):
        if not isinstance(value, str):
            raise ValueError(f"{name}: {key}: {value!r} is not a string")
        return kind(value)
    if origin is list:
        if from_env or isinstance(value, str):  # "h1:9876;h2:9876" or "a,b"
            return [a.strip() for a in value.replace(",", ";").split(";") if a.strip()]
        if not isinstance(value, list):
            raise ValueError(f"{name}: {key}: {value!r} is not a list")
        return [convert(name, key, v, args[0], False) for v in value]
    if origin is tuple:  # host:port
        if isinstance(value, str):
            host, _, port = value.rpartition(":")
        elif isinstance(value, list) and len(value) == 2:
            host, port = value
        else:
            host, port = "", ""
        try:
            return str(host), int(port)
        except ValueError:
            raise ValueError(f"{name}: {key}: {value!r} is not host:port") from None
    if origin is dict:
        if from_env:
            try:
                value = tomllib.loads(f"v = {value}")["v"]  # an inline table: { a = "b" }
            except tomllib.TOMLDecodeError:
                raise ValueError(f"{name}: {key}: {value!r} is not an inline table") from None
        if not isinstance(value, dict):
            raise ValueError(f"{name}: {key}: {value!r} is not a table")
        return value
    raise TypeError(f"{key}: no conversion for {kind!r}")  # a new field type: teach convert


def load_config(path: Path | None, env: dict[str, str] | None = None) -> BrokerConfig:
    """Read ``path`` (None: defaults only), then apply ``TMQ_{SECTION}_{KEY}`` overrides from
    ``env`` (for example ``TMQ_STORE_FLUSH=sync``, ``TMQ_OFFLOAD_UPLOAD_AFTER_MS=5000``), and the
    short forms ``TMQ_NAMESRV_ADDR``, ``TMQ_PORT``, ``TMQ_DATA_DIR``, ``TMQ_FLUSH``,
    ``TMQ_TIER_URL``. Unknown sections and keys are errors that name the file and the key."""
    where = str(path) if path is not None else "config"
    try:
        raw: dict[str, Any] = tomllib.loads(path.read_text()) if path is not None else {}
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"{where}: not valid TOML: {e}") from None
    unknown = sorted(set(raw) - set(SECTIONS))
    if unknown:
        raise ValueError(f"{where}: unknown section [{unknown[0]}] (known: {', '.join(SECTIONS)})")
    env = dict(os.environ if env is None else env)
    for alias, name in SHORT_ENV.items():
        if alias in env:
            env.setdefault(name, env[alias])
    sections: dict[str, dict[str, Any]] = {}
    for section in SECTIONS:
        known = section_fields(section)
        given = raw.get(section, {})
        if not isinstance(given, dict):
            raise ValueError(f"{where}: {section} must be a section ([{section}])")
        given = dict(given)
        if section == "lakehouse" and "trigger" in given:  # "10s", as on the command line
            given["trigger_seconds"] = parse_duration_ms(given.pop("trigger")) / 1000
        bad = sorted(set(given) - set(known))
        if bad:
            raise ValueError(f"{where}: unknown key {bad[0]!r} in [{section}]")
        values = {
            k: convert(f"{where}: [{section}]", k, v, known[k], False) for k, v in given.items()
        }
        for key, kind in known.items():
            name = f"TMQ_{section.upper()}_{key.upper()}"
            if name in env:
                values[key] = convert(f"environment {name}", key, env[name], kind, True)
        sections[section] = values
    try:
        return BrokerConfig(
            **sections["broker"],
            **{s: SECTIONS[s](**sections[s]) for s in SECTIONS if s != "broker"},
        )
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where}: {e}") from None
