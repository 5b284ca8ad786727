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

[store]
data_dir = "./tmq-data"
flush = "async"                # or "sync"
commitlog_file_size = "1GiB"

[limits]
max_body_bytes = 4194304
```

Environment overrides: ``TMQ_NAMESRV_ADDR``, ``TMQ_DATA_DIR``, ``TMQ_FLUSH``, ``TMQ_PORT``.
"""

from __future__ import annotations

import os
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from broker.metadata import Limits
from tiered.config import StoreConfig, parse_size


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
    tier_options: dict[str, Any] = field(default_factory=dict)
    # How often tiered topics are uploaded and eligible CommitLog files released.
    offload_interval_ms: int = 10_000
    store: StoreConfig = field(default_factory=StoreConfig)
    limits: Limits = field(default_factory=Limits)

    @property
    def config_dir(self) -> Path:
        return self.store.data_dir / "config"


_SIZE_KEYS = {"commitlog_file_size", "max_message_size", "max_dispatch_lag_bytes"}


def load_config(path: Path | None, env: dict[str, str] | None = None) -> BrokerConfig:
    """Read ``path`` (None: defaults only), then apply ``TMQ_…`` overrides from ``env``."""
    raw: dict[str, Any] = tomllib.loads(path.read_text()) if path is not None else {}
    unknown = set(raw) - {"broker", "store", "limits"}
    if unknown:
        raise ValueError(f"{path}: unknown section(s) {sorted(unknown)}")
    b = dict(raw.get("broker", {}))
    if isinstance(b.get("namesrv"), str):
        b["namesrv"] = [a.strip() for a in b["namesrv"].replace(",", ";").split(";") if a.strip()]
    store_raw: dict[str, Any] = {
        k: (parse_size(v) if k in _SIZE_KEYS else v) for k, v in raw.get("store", {}).items()
    }
    env = dict(os.environ if env is None else env)
    if "TMQ_NAMESRV_ADDR" in env:
        b["namesrv"] = [a for a in env["TMQ_NAMESRV_ADDR"].replace(",", ";").split(";") if a]
    if "TMQ_PORT" in env:
        b["port"] = int(env["TMQ_PORT"])
    if "TMQ_DATA_DIR" in env:
        store_raw["data_dir"] = env["TMQ_DATA_DIR"]
    if "TMQ_FLUSH" in env:
        store_raw["flush"] = env["TMQ_FLUSH"]
    try:
        return BrokerConfig(
            **b, store=StoreConfig(**store_raw), limits=Limits(**raw.get("limits", {}))
        )
    except TypeError as e:
        raise ValueError(f"{path}: {e}") from None
