"""``[ha]`` in tmq.toml: off by default, validated, overridable from the environment."""

from __future__ import annotations

from pathlib import Path

import pytest

from broker.config import load_config


def test_replication_is_off_unless_enabled(tmp_path: Path) -> None:
    config = load_config(None, env={})
    assert not config.ha.enabled and config.ha.mode == "async"


def test_ha_section_and_environment_overrides(tmp_path: Path) -> None:
    path = tmp_path / "tmq.toml"
    path.write_text(
        '[ha]\nenabled = true\nrole = "slave"\nbroker_id = 2\nmaster = "10.0.0.1:10912"\n'
        'peers = ["10.0.0.1:10912", "10.0.0.2:10912"]\nmin_in_sync_replicas = 2\n'
    )
    config = load_config(path, env={"TMQ_HA_MODE": "sync", "TMQ_HA_MAX_LAG_MS": "5000"})
    ha = config.ha
    assert (ha.role, ha.broker_id, ha.master, ha.mode) == ("slave", 2, "10.0.0.1:10912", "sync")
    assert ha.peers == ["10.0.0.1:10912", "10.0.0.2:10912"]
    assert (ha.min_in_sync_replicas, ha.max_lag_ms) == (2, 5000)


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ('role = "slave"\nbroker_id = 0\nmaster = "h:1"', "the master is 0"),
        ('role = "master"\nbroker_id = 3', "the master is 0"),
        ('role = "slave"\nbroker_id = 1', "needs master"),
        ('mode = "semi"', "mode must be"),
        ("min_in_sync_replicas = 0", "at least 1"),
        ('listen = "nowhere"', "not host:port"),
    ],
)
def test_bad_ha_settings_are_refused_with_the_key(tmp_path: Path, body: str, message: str) -> None:
    path = tmp_path / "tmq.toml"
    path.write_text(f"[ha]\nenabled = true\n{body}\n")
    with pytest.raises(ValueError, match=message):
        load_config(path, env={})


def test_with_etcd_the_member_id_is_one_or_more() -> None:
    import pytest as _pytest

    from broker.ha.config import HaConfig

    HaConfig(enabled=True, role="slave", broker_id=2, etcd=["http://127.0.0.1:2379"])
    with _pytest.raises(ValueError, match="stable id"):
        HaConfig(enabled=True, broker_id=0, etcd=["http://127.0.0.1:2379"])
    with _pytest.raises(ValueError, match="lease_ttl_ms"):
        HaConfig(lease_ttl_ms=500)
