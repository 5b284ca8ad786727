"""Operability: metrics, health, ``--json`` shapes, one-line errors, config, secrets.

Real ``tmq standalone`` processes and the real CLI, as an operator meets them.
"""

from __future__ import annotations

import json
import logging
import re
import threading
import time
import urllib.request
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import fields
from pathlib import Path
from typing import Any

import grpc
import pytest
from broker_harness import REPO, Standalone, free_port, send_batches, tmq
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families
from typer.testing import CliRunner

from broker.config import SECTIONS, BrokerConfig, load_config
from tiered.cold.credentials import REDACTED, ScrubSecrets, redact, scrub, secret_values

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
TIERED, PLAIN = "ops-tiered", "ops-plain"
SENT = 300


def ok(*args: str, timeout: float = 120) -> str:
    done = tmq(*args, timeout=timeout)
    assert done.returncode == 0, (args, done.stderr)
    return done.stdout


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Standalone]:
    """Small CommitLog files, a fast offload pass, and every archived read served from the tier
    (read_from_tier = force), so a replay exercises the cold-read path."""
    n = Standalone(
        tmp_path_factory.mktemp("ops") / "data",
        extra=["--commitlog-file-size", "128KiB", "--offload-interval", "1"],
        env={"TMQ_STORE_READ_FROM_TIER": "force"},
        metrics_port=free_port(),
    ).start()
    yield n
    n.stop()


@pytest.fixture(scope="module")
def traffic(node: Standalone) -> dict[str, Any]:
    """Produce to a tiered and a plain topic, upload, and read everything back."""
    ns = node.namesrv
    ok("topic", "create", TIERED, "-n", ns, "--queues", "2", "--tiered")
    ok("topic", "create", PLAIN, "-n", ns, "--queues", "1")
    bodies = [f"{i:04d}".encode() * 256 for i in range(SENT)]  # 1 KiB each
    send_batches(node.endpoint, TIERED, [(b, f"key-{i}", "t") for i, b in enumerate(bodies)], 100)
    send_batches(node.endpoint, PLAIN, [(b"plain", "k", "t")], 1)
    offloaded = json.loads(ok("offload", TIERED, "-n", ns, "--json"))
    replayed = ok("replay", TIERED, "-n", ns, "--from-offset", "0", "--json").splitlines()
    return {"bytes_in": sum(map(len, bodies)), "offloaded": offloaded, "replayed": replayed}


Samples = dict[str, dict[tuple[tuple[str, str], ...], float]]


def scrape(node: Standalone) -> Samples:
    """sample name -> {sorted labels: value} for every sample on /metrics, and family name ->
    {} for every family (a family with no samples yet still has its HELP line)."""
    url = f"http://127.0.0.1:{node.metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    out: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for family in text_string_to_metric_families(text):
        out.setdefault(family.name, {})
        for s in family.samples:
            out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return out


def documented_metrics() -> set[str]:
    """The metric names in docs/operations.md's metrics table."""
    doc = (REPO / "docs" / "operations.md").read_text()
    section = doc.split("## Metrics", 1)[1].split("\n## ", 1)[0]
    return set(re.findall(r"^\| `(tmq_[a-z_]+)", section, re.MULTILINE))


def test_metrics_after_traffic_hold_the_documented_names_with_sane_values(
    node: Standalone, traffic: dict[str, Any]
) -> None:
    assert len(traffic["replayed"]) == SENT
    uploaded = sum(r["bytes"] for r in traffic["offloaded"])
    assert uploaded > 0
    ns = node.namesrv
    # Retention by size: the next pass (every second) expires every archived segment, and
    # releases the CommitLog files whose records are all uploaded.
    ok("retain", TIERED, "-n", ns, "--max-bytes", "1")
    deadline = time.monotonic() + 30
    while True:
        m = scrape(node)
        done = m["tmq_store_bytes"][(("tier", "cold"),)] == 0
        # The cold gauge drops when the retention commit lands; the deletes, and the counters
        # that count them, follow it.
        deleted = m["tmq_retention_deleted_segments_total"][()]
        done = done and deleted >= m["tmq_tier_upload_segments_total"][()]
        if done and m["tmq_commitlog_files_released_total"][()] >= 1:
            break
        assert time.monotonic() < deadline, "retention and release did not happen in 30 s"
        time.sleep(0.5)

    documented = documented_metrics()
    for name in documented:
        assert name in m, f"{name} is documented but not exposed"
    # Families as documented: counters by their _total sample, histograms by their base name.
    exposed = {re.sub(r"_(bucket|count|sum|created)$", "", n) for n in m}
    exposed = {n for n in exposed if n.startswith("tmq_") and f"{n}_total" not in m}
    assert exposed == documented, f"not documented: {sorted(exposed - documented)}"

    topic = (("topic", TIERED),)
    assert m["tmq_messages_in_total"][topic] == SENT
    assert m["tmq_bytes_in_total"][topic] == traffic["bytes_in"]
    assert m["tmq_messages_in_total"][(("topic", PLAIN),)] == 1
    assert m["tmq_messages_out_total"][topic] == SENT  # the replay
    assert m["tmq_bytes_out_total"][topic] == traffic["bytes_in"]
    assert m["tmq_tier_upload_bytes_total"][()] == uploaded
    assert m["tmq_tier_upload_messages_total"][()] == SENT
    assert m["tmq_tier_upload_segments_total"][()] >= 2  # one per queue at least
    assert m["tmq_cold_read_seconds_count"][()] > 0
    assert m["tmq_tier_download_bytes_total"][()] > 0
    assert 0 <= m["tmq_cold_read_cache_hit_ratio"][()] <= 1
    assert m["tmq_cold_read_cache_misses_total"][()] > 0
    assert m["tmq_cold_read_unavailable_total"][()] == 0  # a healthy tier refuses no read
    segments = m["tmq_tier_upload_segments_total"][()]
    assert m["tmq_retention_deleted_segments_total"][()] == segments
    assert m["tmq_retention_deleted_messages_total"][()] == SENT
    assert m["tmq_retention_deleted_bytes_total"][()] == uploaded
    assert m["tmq_tier_deleted_objects_total"][()] == segments
    assert m["tmq_store_bytes"][(("tier", "hot"),)] == 128 * 1024 * m["tmq_commitlog_files"][()]
    assert m["tmq_dispatch_lag_bytes"][()] >= 0
    for q in ("0", "1"):
        labels = (("queue", q), ("topic", TIERED))
        assert m["tmq_tier_upload_lag_messages"][labels] == 0
        assert m["tmq_tier_upload_lag_bytes"][labels] == 0
        assert m["tmq_tier_upload_lag_seconds"][labels] == 0
    assert m["tmq_lakehouse_export_freshness_seconds"] == {}  # no provider given
    assert m["tmq_tier_upload_failures_total"][()] == 0


def test_health_answers_serving_on_both_servers_and_not_serving_on_shutdown(
    tmp_path: Path,
) -> None:
    n = Standalone(tmp_path / "data", extra=["--offload-interval", "3600"]).start()
    try:
        for address, services in (
            (n.namesrv, ["", "tmq.namesrv.v1.NameServer"]),
            (n.endpoint, ["", "apache.rocketmq.v2.MessagingService", "tmq.admin.v1.Admin"]),
        ):
            stub = health_pb2_grpc.HealthStub(grpc.insecure_channel(address))
            for service in services:
                reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
                assert reply.status == SERVING, (address, service)
        seen: list[int] = []
        watch = health_pb2_grpc.HealthStub(grpc.insecure_channel(n.endpoint)).Watch(
            health_pb2.HealthCheckRequest(), timeout=30
        )

        def follow() -> None:
            try:
                for reply in watch:
                    seen.append(reply.status)
                    if reply.status == NOT_SERVING:
                        watch.cancel()  # an open stream would hold the shutdown for its grace
            except grpc.RpcError:
                pass  # cancelled, or the server closed the stream

        follower = threading.Thread(target=follow)
        follower.start()
        deadline = time.monotonic() + 10
        while not seen and time.monotonic() < deadline:
            time.sleep(0.05)
        assert n.stop() == 0
        follower.join(10)
        assert seen[0] == SERVING and NOT_SERVING in seen, seen
    finally:
        n.stop()
    report = json.loads(ok("store", "check", "--data-dir", str(n.data_dir), "--json"))
    assert set(report) >= STORE_CHECK_KEYS and report["last_exit_clean"] is True


STORE_CHECK_KEYS = {"data_dir", "last_exit_clean", "checkpoint_found", "commitlog", "recovery"}
TOPIC_KEYS = {"broker", "topic", "queues", "perm", "message_type", "tiered", "ttl_ms"} | {
    "local_ttl_ms",
    "max_bytes",
    "queue_offsets",
}
# command -> (output kind, keys every item must have). "list": one JSON array; "lines": one
# object per line; "object": one object. docs/operations.md "JSON output" documents the same.
JSON_SHAPES: list[tuple[list[str], str, set[str]]] = [
    (["topic", "create", "ops-json", "--queues", "1", "--tiered"], "list", {"broker", "topic"}),
    (["topic", "update", "ops-json", "--ttl", "30d"], "list", {"broker", "topic", "action"}),
    (["produce", "ops-json", "--body", "x", "--key", "ops-key"], "lines", {"message_id", "offset"}),
    (["topic", "list"], "list", TOPIC_KEYS),
    (["topic", "describe", TIERED], "list", TOPIC_KEYS),
    (
        ["consume", "ops-json", "-g", "ops-g", "--count", "1", "--wait", "10"],
        "lines",
        {"topic", "message_id", "tag", "keys", "properties", "attempt", "body"},
    ),
    (
        ["replay", "ops-json", "--from-offset", "0"],
        "lines",
        {"broker", "queue", "offset", "message_id", "tag", "keys", "properties"}
        | {"store_time_ms", "body"},
    ),
    (
        ["query", "--topic", "ops-json", "--key", "ops-key"],
        "lines",
        {"broker", "queue", "offset", "message_id", "keys", "store_time_ms", "body"},
    ),
    (
        ["offload", "ops-json"],
        "list",
        {"broker", "topic", "queue", "segments", "messages", "bytes", "watermark"},
    ),
    (
        ["offload", "status", "ops-json"],
        "list",
        {"broker", "topic", "queue", "min_offset", "hot_min_offset", "tier_watermark"}
        | {"max_offset", "tiered", "offload_held"},
    ),
    (
        ["retain", "ops-json"],
        "list",
        {"broker", "topic", "tiered", "ttl_ms", "local_ttl_ms", "max_bytes"},
    ),
    (["verify", "ops-json"], "object", {"status", "queues"}),
    (["status"], "object", {"namesrv", "brokers", "tiered_topics"}),
]
STATUS_BROKER_KEYS = {"name", "cluster", "address", "alive", "error", "topics"} | {
    "dispatch_lag_bytes",
    "commitlog_files",
    "store_bytes",
    "has_tier",
    "export_freshness_seconds",
}
STATUS_TOPIC_KEYS = {"broker", "topic", "lag_known", "tier_lag_messages", "tier_lag_bytes"} | {
    "tier_lag_seconds",
    "dispatch_lag_bytes",
    "store_bytes",
    "export_freshness_seconds",
    "queues",
}


def test_every_json_output_parses_and_keeps_its_documented_keys(
    node: Standalone, traffic: dict[str, Any]
) -> None:
    doc = (REPO / "docs" / "operations.md").read_text().split("## JSON output", 1)[1]
    for args, _, _ in JSON_SHAPES:
        name = " ".join(a for a in args[:2] if a[0] != "-" and not a.startswith("ops-"))
        assert f"`tmq {name}" in doc, f"tmq {name} --json is not documented"
    # create, update and produce in order; the rest only read, so they run side by side.
    printed = [ok(*args, "-n", node.namesrv, "--json") for args, _, _ in JSON_SHAPES[:3]]
    with ThreadPoolExecutor(4) as pool:
        printed += pool.map(
            lambda args: ok(*args, "-n", node.namesrv, "--json"),
            [args for args, _, _ in JSON_SHAPES[3:]],
        )
    outputs: dict[str, Any] = {}
    for (args, kind, keys), out in zip(JSON_SHAPES, printed, strict=True):
        if kind == "lines":
            items = [json.loads(line) for line in out.splitlines()]
        else:
            parsed = json.loads(out)
            items = parsed if kind == "list" else [parsed]
            assert isinstance(parsed, list if kind == "list" else dict), args
        assert items, f"{args}: nothing printed"
        for item in items:
            assert keys <= set(item), f"{args}: missing {keys - set(item)}"
        outputs[" ".join(args[:2])] = items
    [status] = outputs["status"]
    [broker] = status["brokers"]
    assert set(broker) >= STATUS_BROKER_KEYS and broker["alive"] is True
    assert set(broker["store_bytes"]) == {"hot", "cold"}
    assert broker["export_freshness_seconds"] is None
    tiered = {t["topic"]: t for t in status["tiered_topics"]}
    assert set(tiered[TIERED]) >= STATUS_TOPIC_KEYS
    assert tiered[TIERED]["lag_known"] is True and tiered[TIERED]["tier_lag_messages"] == 0
    [verdict] = outputs["verify ops-json"]
    assert verdict["status"] == "OK"


def test_unreachable_object_store_fails_operator_commands_in_one_line_without_secrets(
    tmp_path: Path,
) -> None:
    secrets = ["supersecret123", "AKIAOPSTESTKEY0001", "optionsecret-789", "AKIAOPTIONKEY00002"]
    config = tmp_path / "tmq.toml"
    # tmq's one retry policy, short: a dead endpoint then fails in about a second (s3fs's and
    # botocore's own retries are off by default).
    config.write_text(
        "[broker]\n"
        'tier_options = { key = "AKIAOPTIONKEY00002", secret = "optionsecret-789",'
        " config_kwargs = { connect_timeout = 1 } }\n"
        "[retry]\nattempts = 2\nbase_delay_s = 0.05\n"
    )
    env = {
        "AWS_ENDPOINT_URL": "http://127.0.0.1:1",
        "AWS_ACCESS_KEY_ID": "AKIAOPSTESTKEY0001",
        "AWS_SECRET_ACCESS_KEY": "supersecret123",
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    n = Standalone(
        tmp_path / "data",
        extra=[
            "--tier-url",
            "s3://nobucket/x",
            "--config",
            str(config),
            "--offload-interval",
            "1",
            "--upload-after",
            "1s",
        ],
        env=env,
    ).start()
    try:
        ok("topic", "create", "ops-dead", "-n", n.namesrv, "--queues", "1", "--tiered")
        send_batches(n.endpoint, "ops-dead", [(b"x", "k", "t")] * 3)
        for args in (["offload", "ops-dead"], ["verify", "ops-dead"]):
            done = tmq(*args, "-n", n.namesrv, env=env, timeout=120)
            assert done.returncode != 0, args
            assert done.stderr.startswith("error: ") and done.stderr.count("\n") == 1, done.stderr
            assert "nobucket" in done.stderr, done.stderr  # says what failed
            for text in (done.stdout, done.stderr):
                assert "Traceback" not in text
                assert not [s for s in secrets if s in text], text
        status = tmq("status", "-n", n.namesrv, "--json", env=env)
        assert not [s for s in secrets if s in status.stdout + status.stderr]
        [topic] = json.loads(status.stdout)["tiered_topics"]
        assert topic["lag_known"] is False and topic["tier_lag_messages"] is None
        time.sleep(2)  # at least one periodic pass fails too, and logs it
    finally:
        n.stop()
    log = n.log_path.read_text()
    assert "offload of ops-dead/0 failed" in log
    assert not [s for s in secrets if s in log], "a secret reached the broker log"


def test_tmq_toml_example_lists_every_key_with_its_default() -> None:
    example = REPO / "tmq.toml.example"
    assert load_config(example, env={}) == BrokerConfig()
    text = example.read_text()
    for section, cls in SECTIONS.items():
        body = text.split(f"\n[{section}]", 1)[1].split("\n[", 1)[0]
        for f in fields(cls):
            if f.name in SECTIONS:
                continue
            name = "trigger" if f.name == "trigger_seconds" else f.name
            assert re.search(rf"^#? ?{name} = ", body, re.MULTILINE), f"[{section}] {name}"


def test_secrets_are_redacted_from_options_text_and_logs(caplog: pytest.LogCaptureFixture) -> None:
    options = {
        "endpoint_url": "http://s3.local",
        "key": "AKIAEXAMPLEKEY00001",
        "secret": "s3cr3t-value-123",
        "client_kwargs": {"aws_session_token": "token-abcdefgh"},
    }
    shown = redact(options)
    assert shown["endpoint_url"] == "http://s3.local"
    assert shown["key"] == shown["secret"] == shown["client_kwargs"]["aws_session_token"]
    assert shown["key"] == REDACTED
    assert "s3cr3t" not in repr(BrokerConfig(tier_options=options))
    found = secret_values(options, {"AWS_SECRET_ACCESS_KEY": "env-secret-999", "AWS_REGION": "x"})
    assert found == {"AKIAEXAMPLEKEY00001", "s3cr3t-value-123", "token-abcdefgh", "env-secret-999"}
    assert scrub("failed with s3cr3t-value-123 in it", found) == f"failed with {REDACTED} in it"
    assert secret_values({"secret": "test"}) == set()  # too short to scrub from free text

    scrubber = ScrubSecrets(found)
    caplog.handler.addFilter(scrubber)
    try:
        log = logging.getLogger("tmq.test")
        log.error("upload failed: %s", "denied for env-secret-999")
        try:
            raise OSError("connect s3cr3t-value-123")
        except OSError:
            log.exception("boom")
    finally:
        caplog.handler.removeFilter(scrubber)
    assert "env-secret-999" not in caplog.text and "s3cr3t-value-123" not in caplog.text
    assert REDACTED in caplog.text


def _commands() -> list[list[str]]:
    import typer.main

    from cli.app import app

    out = []

    def walk(cmd: Any, path: list[str]) -> None:
        out.append(path)
        for name, sub in getattr(cmd, "commands", {}).items():
            walk(sub, [*path, name])

    walk(typer.main.get_command(app), [])
    return out


def test_every_command_help_shows_an_example() -> None:
    from cli.app import app

    runner = CliRunner()
    commands = _commands()
    assert ["status"] in commands and ["topic", "create"] in commands
    for path in commands:
        result = runner.invoke(app, [*path, "--help"], prog_name="tmq")
        assert result.exit_code == 0, (path, result.output)
        assert "Example" in result.output, f"tmq {' '.join(path)} --help has no example"


def test_shell_completion_script_is_printed() -> None:
    from cli.app import app

    result = CliRunner().invoke(app, ["--show-completion", "bash"], prog_name="tmq")
    assert result.exit_code == 0, result.output
    assert "_TMQ_COMPLETE" in result.output and "complete -o default" in result.output


def test_an_error_escaping_a_command_is_one_scrubbed_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import sys

    from cli import app as cli_app
    from cli import status as status_module

    def refuse(namesrv: str) -> dict[str, Any]:
        raise ConnectionRefusedError("[Errno 111] refused\nwhile using sekret-value-42")

    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "sekret-value-42")
    monkeypatch.setattr(status_module, "cluster_status", refuse)
    monkeypatch.setattr(sys, "argv", ["tmq", "status"])
    with pytest.raises(SystemExit) as exit_:
        cli_app.main()
    assert exit_.value.code == 1
    err = capsys.readouterr().err
    assert err == f"error: ConnectionRefusedError: [Errno 111] refused while using {REDACTED}\n"


def test_a_broker_refuses_to_start_on_a_bucket_that_does_not_exist(tmp_path: Path, s3: Any) -> None:
    missing = f"tmq-missing-{uuid.uuid4().hex[:8]}"
    config = tmp_path / "tmq.toml"
    config.write_text(
        f'[broker]\nport = 0\nmetrics_port = 0\nnamesrv = []\ntier_url = "s3://{missing}/tmq"\n'
        f'[store]\ndata_dir = "{tmp_path / "data"}"\n'
    )
    done = tmq("broker", "start", "--config", str(config), env=s3.env(), timeout=60)
    assert done.returncode != 0
    assert done.stderr.startswith("error: the cold tier cannot be used: "), done.stderr
    assert done.stderr.count("\n") == 1, done.stderr
    assert f"s3://{missing}: NoSuchBucket" in done.stderr and "create it" in done.stderr
    assert not (tmp_path / "data" / "commitlog").exists(), "refused before opening the store"


# -- CLI consistency -----------------------------------------------------------------------------


def test_topic_text_shows_tiering_ttls_and_sizes_as_an_operator_writes_them(
    node: Standalone,
) -> None:
    ns = node.namesrv
    ok("topic", "create", "ops-text", "-n", ns, "-q", "1", "--tiered", "--ttl", "90d")
    ok("topic", "update", "ops-text", "-n", ns, "--local-ttl", "1d", "--max-bytes", "50GiB")
    described = ok("topic", "describe", "ops-text", "-n", ns)
    assert "tiered; ttl 90d, local ttl 1d, archive limit 50GiB per queue" in described
    [listed] = [line for line in ok("topic", "list", "-n", ns).splitlines() if "ops-text" in line]
    assert " tiered " in listed and "ttl=90d local_ttl=1d max_bytes=50GiB" in listed
    retained = ok("retain", "ops-text", "-n", ns)
    assert "archive limit 50GiB per queue" in retained and "53687091200" not in retained


@pytest.mark.parametrize("command", [["create", "ops-zero"], ["update", "ops-text"]])
def test_a_topic_without_queues_is_refused(node: Standalone, command: list[str]) -> None:
    done = tmq("topic", *command, "-n", node.namesrv, "--queues", "0")
    assert done.returncode == 2
    assert done.stderr == "error: --queues: a topic needs at least 1 queue, not 0\n"
    listed = ok("topic", "list", "-n", node.namesrv, "--json")
    assert "ops-zero" not in {t["topic"] for t in json.loads(listed)}


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["topic", "craete", "x"], "error: No such command 'craete'. Did you mean 'create'?"),
        (["topic", "create", "x", "--queus", "3"], "error: No such option: --queus"),
        (["offload", "x", "--keep-local", "lots"], "error: --keep-local: not a size: 'lots'"),
        (["offload", "x", "--before", "soon"], "error: not a time: 'soon'"),
        (["replay", "x", "--from-time", "yesterday"], "error: not a time: 'yesterday'"),
    ],
)
def test_a_typo_is_one_error_line(args: list[str], expected: str) -> None:
    done = tmq(*args)
    assert done.returncode == 2
    assert done.stderr.startswith(expected) and done.stderr.count("\n") == 1, done.stderr
    assert "╭" not in done.stderr


def test_offload_keep_local_states_its_unit() -> None:
    done = tmq("offload", "--help", env={"COLUMNS": "200"})
    [line] = [line for line in done.stdout.splitlines() if "│ --keep-local" in line]
    assert re.search(r"--keep-local\s+SIZE\s", line), line
    assert "(64KiB, 512MiB, 1GiB; powers of 1024)" in line


@pytest.mark.parametrize(
    ("shell", "marker"), [("zsh", "#compdef tmq"), ("bash", "complete -o default")]
)
def test_the_completion_script_is_for_the_shell_named(shell: str, marker: str) -> None:
    done = tmq("--show-completion", shell)
    assert done.returncode == 0, done.stderr
    assert marker in done.stdout and "_TMQ_COMPLETE" in done.stdout


def test_sizes_and_durations_print_as_they_are_written() -> None:
    from tiered.config import format_duration, format_size, parse_size

    assert format_size(53687091200) == "50GiB" and parse_size("50GiB") == 53687091200
    assert format_size(64 * 1024) == "64KiB" and format_size(1536 * 1024 * 1024) == "1.5GiB"
    assert format_size(512) == "512B"
    assert (format_duration(0), format_duration(90 * 86_400_000)) == ("forever", "90d")
    assert (format_duration(14 * 86_400_000), format_duration(1500)) == ("2w", "1500ms")
