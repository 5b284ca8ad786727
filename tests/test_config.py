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
        ("[retry]\nattempt = 3\n", {}, r"tmq.toml: unknown key 'attempt' in \[retry\]"),
        ('[broker]\nport = "8081"\n', {}, r"tmq.toml: \[broker\]: port: '8081' is not a number"),
        ("[broker]\nauto_create_groups = 1\n", {}, "is not true or false"),
        ("[broker]\nnamesrv = 5\n", {}, "namesrv: 5 is not a list"),
        ("store = 1\n", {}, r"store must be a section"),
        ("[retry]\nattempts = 0\n", {}, r"\[retry\] attempts must be at least 1"),
        ("", {"TMQ_RETRY_ATTEMPTS": "many"}, "environment TMQ_RETRY_ATTEMPTS: attempts"),
    ],
)
def test_mistakes_are_named(tmp_path: Path, text: str, env: dict[str, str], message: str) -> None:
    toml = tmp_path / "tmq.toml"
    toml.write_text(text)
    with pytest.raises(ValueError, match=message):
        load_config(toml, env)


def test_every_value_is_converted_by_its_fields_type(tmp_path: Path) -> None:
    env = {
        "TMQ_RETRY_ATTEMPTS": "3",
        "TMQ_RETRY_BASE_DELAY_S": "0.5",
        "TMQ_BROKER_TIER_OPTIONS": '{ endpoint_url = "http://127.0.0.1:4566" }',
        "TMQ_STORE_STORE_HOST": "10.0.0.1:10911",
        "TMQ_LAKEHOUSE_TOPICS": "a,b",
        "TMQ_STORE_DATA_DIR": str(tmp_path),
    }
    c = load_config(None, env)
    assert (c.retry.attempts, c.retry.base_delay_s) == (3, 0.5)
    assert c.tier_options == {"endpoint_url": "http://127.0.0.1:4566"}
    assert c.store.store_host == ("10.0.0.1", 10911)
    assert c.lakehouse.topics == ["a", "b"]
    assert c.store.data_dir == tmp_path
