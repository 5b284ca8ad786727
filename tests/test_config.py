"""The broker's configuration: TOML sections, typed ``TMQ_{SECTION}_{KEY}`` overrides, errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from broker.config import load_config


def test_every_section_reads_from_toml_and_the_environment_overrides_it(tmp_path: Path) -> None:
    toml = tmp_path / "tmq.toml"
    toml.write_text(
        '[broker]\nnamesrv = "a:1;b:2"\nport = 8081\n'
        '[store]\nflush = "sync"\ncommitlog_file_size = "64MiB"\n'
        "[offload]\nupload_after_ms = 1000\n"
    )
    env = {
        "TMQ_BROKER_PORT": "9999",
        "TMQ_OFFLOAD_UPLOAD_MIN_BYTES": "1MiB",
        "TMQ_BROKER_AUTO_CREATE_GROUPS": "false",
        "TMQ_FLUSH": "async",  # a short form
    }
    c = load_config(toml, env)
    assert c.namesrv == ["a:1", "b:2"]
    assert c.port == 9999 and c.auto_create_groups is False
    assert c.store.flush == "async" and c.store.commitlog_file_size == 64 << 20
    assert c.offload.upload_after_ms == 1000 and c.offload.upload_min_bytes == 1 << 20


@pytest.mark.parametrize(
    ("text", "env", "message"),
    [
        ("[brokr]\n", {}, "unknown section"),
        ("[store]\nflsh = 1\n", {}, "unknown key"),
        ("", {"TMQ_BROKER_PORT": "eighty"}, "not a number"),
        ("", {"TMQ_STORE_FLUSH": "sometimes"}, "flush must be"),
    ],
)
def test_mistakes_are_named(tmp_path: Path, text: str, env: dict[str, str], message: str) -> None:
    toml = tmp_path / "tmq.toml"
    toml.write_text(text)
    with pytest.raises(ValueError, match=message):
        load_config(toml, env)
