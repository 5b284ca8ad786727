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

[limits]
max_body_bytes = 4194304
```

Every key can be overridden from the environment as ``TMQ_{SECTION}_{KEY}`` (see
``load_config``); ``tmq.toml.example`` lists them all with their defaults.
"""

from __future__ import annotations

import os
import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from broker.ha.config import HaConfig
from broker.metadata import Limits
from lakehouse.runner import LakehouseConfig
from offload.offloader import OffloadPolicy
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
    store: StoreConfig = field(default_factory=StoreConfig)
    offload: OffloadPolicy = field(default_factory=OffloadPolicy)
    # The continuous Delta export, run as a child process beside the broker when enabled.
    lakehouse: LakehouseConfig = field(default_factory=LakehouseConfig)
    limits: Limits = field(default_factory=Limits)
    # Replica group membership and replication (off by default: a single broker).
    ha: HaConfig = field(default_factory=HaConfig)

    @property
    def config_dir(self) -> Path:
        return self.store.data_dir / "config"


_SIZE_KEYS = {
    "commitlog_file_size",
    "max_message_size",
    "max_dispatch_lag_bytes",
    "segment_max_bytes",
    "upload_min_bytes",
}
_SECTIONS = ("broker", "store", "offload", "limits", "lakehouse", "ha")


def _coerce(section: str, key: str, value: Any, target: type | str) -> Any:
    """A TOML or environment value as the field's type (sizes accept KiB/MiB/GiB)."""
    if key in _SIZE_KEYS:
        return parse_size(value)
    if key == "store_host":
        return _host(section, value)
    if not isinstance(value, str):
        return value
    kind = str(target).replace(" | None", "")
    if kind.startswith("list"):
        return [a.strip() for a in value.replace(",", ";").split(";") if a.strip()]
    if kind == "bool":
        if value.lower() not in ("1", "0", "true", "false", "yes", "no"):
            raise ValueError(f"[{section}] {key}: {value!r} is not true or false")
        return value.lower() in ("1", "true", "yes")
    if kind in ("int", "float"):
        try:
            return float(value) if kind == "float" else int(value)
        except ValueError:
            raise ValueError(f"[{section}] {key}: {value!r} is not a number") from None
    return value


def _host(section: str, value: Any) -> tuple[str, int]:
    """``"127.0.0.1:10911"`` or ``["127.0.0.1", 10911]`` as (host, port)."""
    host, _, port = value.rpartition(":") if isinstance(value, str) else ("", "", "")
    if isinstance(value, list) and len(value) == 2:
        host, port = value
    try:
        return str(host), int(port)
    except ValueError:
        pass
    raise ValueError(f"[{section}] store_host: {value!r} is not host:port")


def _section_fields(section: str) -> dict[str, Any]:
    cls = {
        "broker": BrokerConfig,
        "store": StoreConfig,
        "offload": OffloadPolicy,
        "limits": Limits,
        "lakehouse": LakehouseConfig,
        "ha": HaConfig,
    }
    return {f.name: f.type for f in fields(cls[section])}


def load_config(path: Path | None, env: dict[str, str] | None = None) -> BrokerConfig:
    """Read ``path`` (None: defaults only), then apply ``TMQ_{SECTION}_{KEY}`` overrides from
    ``env`` (for example ``TMQ_STORE_FLUSH=sync``, ``TMQ_OFFLOAD_UPLOAD_AFTER_MS=5000``), and the
    short forms ``TMQ_NAMESRV_ADDR``, ``TMQ_PORT``, ``TMQ_DATA_DIR``, ``TMQ_FLUSH``,
    ``TMQ_TIER_URL``."""
    raw: dict[str, Any] = tomllib.loads(path.read_text()) if path is not None else {}
    where = str(path) if path is not None else "config"
    unknown = set(raw) - set(_SECTIONS)
    if unknown:
        raise ValueError(f"{where}: unknown section(s) {sorted(unknown)}")
    env = dict(os.environ if env is None else env)
    short = {
        "TMQ_NAMESRV_ADDR": "TMQ_BROKER_NAMESRV",
        "TMQ_PORT": "TMQ_BROKER_PORT",
        "TMQ_DATA_DIR": "TMQ_STORE_DATA_DIR",
        "TMQ_FLUSH": "TMQ_STORE_FLUSH",
        "TMQ_TIER_URL": "TMQ_BROKER_TIER_URL",
    }
    for alias, name in short.items():
        if alias in env:
            env.setdefault(name, env[alias])
    sections: dict[str, dict[str, Any]] = {}
    for section in _SECTIONS:
        known = _section_fields(section)
        given = dict(raw.get(section, {}))
        if section == "lakehouse" and "trigger" in given:  # "10s", as on the command line
            given["trigger_seconds"] = parse_duration_ms(given.pop("trigger")) / 1000
        bad = set(given) - set(known)
        if bad:
            raise ValueError(f"{where}: unknown key(s) in [{section}]: {sorted(bad)}")
        for key in known:
            name = f"TMQ_{section.upper()}_{key.upper()}"
            if name in env:
                given[key] = env[name]
        sections[section] = {k: _coerce(section, k, v, known[k]) for k, v in given.items()}
    try:
        return BrokerConfig(
            **sections["broker"],
            store=StoreConfig(**sections["store"]),
            offload=OffloadPolicy(**sections["offload"]),
            limits=Limits(**sections["limits"]),
            lakehouse=LakehouseConfig(**sections["lakehouse"]),
            ha=HaConfig(**sections["ha"]),
        )
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where}: {e}") from None
