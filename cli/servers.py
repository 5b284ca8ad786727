"""``tmq standalone``, ``tmq namesrv start``, ``tmq broker start``: the server processes."""

from __future__ import annotations

import logging
import os
import signal
import threading
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from namesrv import server as namesrv_server
from namesrv.registry import EXPIRY_MS, BrokerRegistry
from remoting.auth import StaticUsers
from remoting.security import ACCESS_KEY_ENV, SECRET_KEY_ENV, ChannelSecurity
from tiered.cold.credentials import scrub_known, scrub_logs, secret_values
from tiered.config import parse_duration_ms, parse_size

if TYPE_CHECKING:
    from broker.config import BrokerConfig
    from broker.server import Broker

# The broker and the store are imported when a server starts, not when the module loads:
# they cost a second of start-up to every other tmq command.

log = logging.getLogger(__name__)

namesrv_app = typer.Typer(
    help="The NameServer.\n\nExample: tmq namesrv start --port 9876", no_args_is_help=True
)
broker_app = typer.Typer(
    help="A broker.\n\nExample: tmq broker start --config tmq.toml", no_args_is_help=True
)


def _start(broker: Broker) -> int:
    """Start ``broker``; what stops it (a damaged or locked data dir, a configuration the data
    was not written with, a port in use) exits with one line."""
    from tiered.store import DataDirLockedError, StoreLoadError

    try:
        return broker.start()
    except (StoreLoadError, DataDirLockedError, OSError, ValueError) as e:
        raise _start_failed(e) from None


def _start_failed(e: Exception) -> typer.Exit:
    typer.echo(f"error: {scrub_known(str(e))}", err=True)
    return typer.Exit(1)


def _keep_secrets_out_of_logs(config: BrokerConfig) -> None:
    scrub_logs(secret_values(config.tier_options, os.environ))


def _namesrv_users(auth: bool) -> StaticUsers | None:
    """With auth on, a NameServer admits the environment's admin only (brokers register with
    it, the CLI signs with it; Apache's clients never call a NameServer)."""
    if not auth:
        return None
    access_key, secret_key = os.environ.get(ACCESS_KEY_ENV), os.environ.get(SECRET_KEY_ENV)
    if not access_key or not secret_key:
        typer.echo(
            f"error: auth is on but {ACCESS_KEY_ENV} and {SECRET_KEY_ENV} are not set: they "
            "name the first admin (docs/security.md)",
            err=True,
        )
        raise typer.Exit(2)
    return StaticUsers({access_key: (secret_key, True)})


def _wait_for_signal(stop: threading.Event | None = None) -> None:
    """Block until SIGTERM or SIGINT (Ctrl-C), or until ``stop`` is set."""
    stop = stop or threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    # Wake up now and then: Python runs a handler only in the main thread, between bytecodes,
    # and a signal the kernel delivers to one of gRPC's threads does not interrupt a wait
    # without timeout, so such a SIGTERM was never handled (a NameServer ignored it for 30 s
    # in CI and the test's teardown failed).
    while not stop.wait(0.5):
        pass


def standalone(
    data_dir: Annotated[Path, typer.Option(help="Where the store lives.")] = Path("tmq-data"),
    grpc_port: Annotated[
        int,
        typer.Option(
            help="The broker's gRPC port (RocketMQ proxy's).", envvar="TMQ_STANDALONE_GRPC_PORT"
        ),
    ] = 8081,
    namesrv_port: Annotated[
        int, typer.Option(help="The NameServer's port.", envvar="TMQ_STANDALONE_NAMESRV_PORT")
    ] = 9876,
    flush: Annotated[
        str | None,
        typer.Option(help="sync: ack after fsync; async: after the page cache (default async)."),
    ] = None,
    commitlog_file_size: Annotated[
        str | None,
        typer.Option(
            help="CommitLog file size, e.g. 1GiB (default: what the data dir was "
            "created with, else 1GiB)."
        ),
    ] = None,
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    tier_url: Annotated[
        str | None,
        typer.Option(help="Cold tier (default file://DATA_DIR/tier; s3://bucket/prefix)."),
    ] = None,
    offload_interval: Annotated[
        float | None,
        typer.Option(help="Seconds between offload and release passes (default 10)."),
    ] = None,
    upload_after: Annotated[
        str | None,
        typer.Option(
            help="Upload a tiered queue once its oldest pending message is this old "
            "(default 60s; [offload] upload_after_ms)."
        ),
    ] = None,
    metrics_port: Annotated[
        int | None,
        typer.Option(
            help="Prometheus /metrics port (default 5557; 0 turns metrics off).",
            envvar="TMQ_STANDALONE_METRICS_PORT",
        ),
    ] = None,
    config_file: Annotated[
        Path | None,
        typer.Option("--config", help="A tmq.toml; the options above override it."),
    ] = None,
    quickstart: Annotated[
        bool,
        typer.Option(
            help="Show the whole flow once started: produce, offload, replay from the tier, "
            "export to Delta, query; then keep serving (reads are served from the tier)."
        ),
    ] = False,
    auth: Annotated[
        bool,
        typer.Option(
            "--auth",
            help="Require signed requests and ACLs ([auth] enabled); the first admin is "
            "TMQ_ADMIN_ACCESS_KEY / TMQ_ADMIN_SECRET_KEY.",
        ),
    ] = False,
) -> None:
    """A NameServer and a broker in one process, on embedded defaults.

    Example: tmq standalone --data-dir ./tmq-data --flush sync
    """
    from broker.config import load_config
    from broker.server import Broker
    from tiered.store import recorded_geometry

    try:
        base = load_config(config_file)
    except (OSError, ValueError) as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
    if auth:
        base = replace(base, auth=replace(base.auth, enabled=True))
    if quickstart and base.auth.enabled:
        typer.echo("error: --quickstart runs without auth; drop --auth or [auth]", err=True)
        raise typer.Exit(2)
    try:
        ns_server, ns_port = namesrv_server.start(
            host,
            namesrv_port,
            tls=base.tls,
            users=_namesrv_users(base.auth.enabled),
            max_clock_skew_s=base.auth.max_clock_skew_s,
        )
    except OSError as e:
        raise _start_failed(e) from None
    try:
        geometry = recorded_geometry(data_dir) or {}
        if commitlog_file_size is not None:
            geometry["commitlog_file_size"] = parse_size(commitlog_file_size)
        store = replace(base.store, data_dir=data_dir, **geometry)  # type: ignore[arg-type]
        if flush is not None:
            store = replace(store, flush=flush)  # type: ignore[arg-type]  # checked by StoreConfig
        if quickstart:
            store = replace(store, read_from_tier="force")
        offload = base.offload
        if upload_after is not None:
            offload = replace(offload, upload_after_ms=parse_duration_ms(upload_after))
    except ValueError as e:
        ns_server.stop(None)
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
    config = replace(
        base,
        listen=host,
        port=grpc_port,
        advertise_host=host,
        namesrv=[f"{host}:{ns_port}"],
        store=store,
        offload=offload,
        tier_url=tier_url or base.tier_url or f"file://{data_dir.resolve()}/tier",
        lakehouse=(
            replace(base.lakehouse, lake_root=str(data_dir.resolve() / "lake"))
            if base.lakehouse.lake_root == type(base.lakehouse)().lake_root
            else base.lakehouse
        ),
        offload_interval_ms=(
            base.offload_interval_ms if offload_interval is None else int(offload_interval * 1000)
        ),
        metrics_port=base.metrics_port if metrics_port is None else metrics_port,
    )
    _keep_secrets_out_of_logs(config)
    broker = Broker(config, ChannelSecurity.for_server(config.tls, os.environ))
    try:
        port = _start(broker)
    except typer.Exit:
        ns_server.stop(None)
        raise
    metrics = (
        f", metrics http://{host}:{broker.metrics_port}/metrics" if broker.metrics_port else ""
    )
    secured = "".join(
        (
            ", TLS" if config.tls.enabled else "",
            ", signed requests only" if config.auth.enabled else "",
        )
    )
    typer.echo(
        f"tmq standalone: NameServer {host}:{ns_port}, broker {host}:{port}{metrics}, "
        f"data in {data_dir} (flush {store.flush}{secured}); Ctrl-C or SIGTERM stops it",
        err=True,
    )
    failed: list[str] = []
    stop = threading.Event()
    if quickstart:
        assert config.tier_url is not None
        threading.Thread(
            target=_run_quickstart,
            args=(f"{host}:{ns_port}", f"{host}:{port}", data_dir, config.tier_url, failed, stop),
            name="tmq-quickstart",
            daemon=True,
        ).start()
    try:
        _wait_for_signal(stop)
    finally:
        broker.stop()
        ns_server.stop(2).wait()
    if failed:
        typer.echo(f"error: quickstart failed: {failed[0]}", err=True)
        raise typer.Exit(1)
    typer.echo("tmq standalone: stopped cleanly", err=True)


def _run_quickstart(
    namesrv: str,
    endpoint: str,
    data_dir: Path,
    tier_url: str,
    failed: list[str],
    stop: threading.Event,
) -> None:
    from cli import quickstart

    try:
        quickstart.run(namesrv, endpoint, data_dir, tier_url)
    except Exception as e:  # one line for the operator; the servers stop and the exit code says
        log.debug("quickstart failed", exc_info=True)
        failed.append(str(e) or type(e).__name__)
        stop.set()


@namesrv_app.command("start")
def namesrv_start(
    port: Annotated[int, typer.Option(help="Port to listen on.")] = namesrv_server.DEFAULT_PORT,
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "0.0.0.0",
    expiry_ms: Annotated[
        int, typer.Option(help="Forget a broker silent for this long (RocketMQ: 120 s).")
    ] = EXPIRY_MS,
    config: Annotated[
        Path | None,
        typer.Option("--config", "-c", help="A tmq.toml: its [auth] and [tls] apply."),
    ] = None,
) -> None:
    """Run a NameServer until SIGTERM.

    Example: tmq namesrv start --port 9876
    """
    from broker.config import load_config

    try:
        cfg = load_config(config)
    except (OSError, ValueError) as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
    try:
        server, bound = namesrv_server.start(
            host,
            port,
            BrokerRegistry(expiry_ms=expiry_ms),
            tls=cfg.tls,
            users=_namesrv_users(cfg.auth.enabled),
            max_clock_skew_s=cfg.auth.max_clock_skew_s,
        )
    except OSError as e:
        raise _start_failed(e) from None
    typer.echo(f"NameServer listening on {host}:{bound}", err=True)
    try:
        _wait_for_signal()
    finally:
        server.stop(2).wait()


@broker_app.command("start")
def broker_start(
    config: Annotated[Path | None, typer.Option("--config", "-c", help="tmq.toml")] = None,
) -> None:
    """Run a broker until SIGTERM.

    Example: tmq broker start --config tmq.toml
    """
    from broker.config import load_config
    from broker.server import Broker

    try:
        cfg = load_config(config)
    except (OSError, ValueError) as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
    _keep_secrets_out_of_logs(cfg)
    broker = Broker(cfg, ChannelSecurity.for_server(cfg.tls, os.environ))
    port = _start(broker)
    typer.echo(f"broker {cfg.name} listening on {cfg.listen}:{port}", err=True)
    try:
        _wait_for_signal()
    finally:
        broker.stop()
