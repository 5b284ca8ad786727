"""``tmq lakehouse export|status|query|maintain``: archived topics as Delta tables.

Spark, delta-rs and pyarrow are imported inside the commands, so ``tmq --help`` stays fast.
"""

from __future__ import annotations

import contextlib
import json
import logging
import signal
import sys
import time
from collections.abc import Iterator
from typing import Annotated, Any

import typer

from cli.topic import fail
from tiered.config import parse_duration_ms, parse_size

app = typer.Typer(
    help="Export archived topics to Delta tables (one per topic) and query them.\n\n"
    "Example: tmq lakehouse export orders --tier-url file://./tmq-data/tier "
    "--lake-root ./tmq-data/lake --once",
    no_args_is_help=True,
)

TierUrl = Annotated[
    str,
    typer.Option(
        "--tier-url",
        help="Cold tier: file://… or s3://bucket/prefix (endpoint and credentials: AWS_* env).",
    ),
]
LakeRoot = Annotated[
    str, typer.Option("--lake-root", help="Where the tables are: a path, file://… or s3://…")
]
JsonFlag = Annotated[bool, typer.Option("--json", help="Print JSON.")]
DEFAULT_TIER = "file://./tmq-data/tier"
DEFAULT_LAKE = "./tmq-data/lake"


def _lake(url: str) -> Any:
    from lakehouse.locations import Location

    try:
        return Location.of(url)
    except ValueError as e:
        raise fail(str(e), 2) from None


@app.command("export")
def export(
    topics: Annotated[
        list[str] | None, typer.Argument(help="Topics (default: every archived topic).")
    ] = None,
    tier_url: TierUrl = DEFAULT_TIER,
    lake_root: LakeRoot = DEFAULT_LAKE,
    once: Annotated[
        bool, typer.Option("--once", help="Backfill what is archived now, stop.")
    ] = False,
    continuous: Annotated[
        bool, typer.Option("--continuous", help="Keep exporting newly committed segments.")
    ] = False,
    trigger: Annotated[str, typer.Option(help="Continuous: batch interval.")] = "10s",
    compact_every: Annotated[
        str,
        typer.Option(help="Continuous: compact each partition's small files this often (0: off)."),
    ] = "5m",
    master: Annotated[str, typer.Option(help="Spark master (local[*], spark://…, yarn).")] = (
        "local[*]"
    ),
    engine: Annotated[
        str, typer.Option(help="delta-rs (default) or delta-spark (needs the Delta jars).")
    ] = "delta-rs",
    checkpoint: Annotated[
        str | None,
        typer.Option(help="The export's lock is {checkpoint}.lock (default: by topics)."),
    ] = None,
    compression: Annotated[
        str, typer.Option(help="Parquet codec: lz4 (LZ4_RAW), snappy or zstd.")
    ] = "lz4",
    max_bytes_per_trigger: Annotated[
        str, typer.Option(help="Admission cap: segment bytes per batch.")
    ] = "256MiB",
    max_segments_per_trigger: Annotated[
        int | None, typer.Option(help="Admission cap: segments per batch.")
    ] = None,
    standby: Annotated[
        bool,
        typer.Option(help="If another export holds the checkpoint, wait and take over."),
    ] = False,
    conf: Annotated[
        list[str] | None, typer.Option(help="Spark setting KEY=VALUE (repeatable).")
    ] = None,
    as_json: JsonFlag = False,
) -> None:
    """Export archived topics to Delta tables at {lake_root}/{topic}, exactly once.

    Examples: tmq lakehouse export orders --once; tmq lakehouse export --continuous --trigger 10s
    """
    if once == continuous:
        raise fail("give exactly one of --once and --continuous", 2)
    if engine not in ("delta-rs", "delta-spark"):
        raise fail(f"--engine: {engine!r} is not delta-rs or delta-spark", 2)
    if compression not in ("lz4", "snappy", "zstd"):
        raise fail(f"--compression: {compression!r} is not lz4, snappy or zstd", 2)
    try:
        trigger_s = parse_duration_ms(trigger) / 1000
        compact_s = parse_duration_ms(compact_every) / 1000
        max_bytes = parse_size(max_bytes_per_trigger)
    except ValueError as e:
        raise fail(str(e), 2) from None
    spark_conf = {}
    for setting in conf or []:
        key, sep, value = setting.partition("=")
        if not sep or not key.strip():
            raise fail(f"--conf: expected KEY=VALUE, got {setting!r}", 2)
        spark_conf[key.strip()] = value
    from lakehouse.export import Export, ExportConfig, ExportError
    from lakehouse.locations import Location
    from lakehouse.spark import spark_session

    try:
        Location.of(tier_url)
        Location.of(lake_root)
    except ValueError as e:
        raise fail(str(e), 2) from None
    config = ExportConfig(
        tier_url=tier_url,
        lake_root=lake_root,
        topics=list(topics) if topics else None,
        trigger_seconds=trigger_s,
        compact_every_seconds=compact_s or None,
        checkpoint_dir=checkpoint,
        max_bytes_per_trigger=max_bytes,
        max_segments_per_trigger=max_segments_per_trigger,
        engine="delta-spark" if engine == "delta-spark" else "delta-rs",
        standby=standby,
        compression=compression,
    )
    logging.getLogger("lakehouse").setLevel(logging.INFO)
    logging.getLogger("py4j").setLevel(logging.WARNING)
    try:
        job = Export(spark_session(master, conf=spark_conf), config)
        # SIGTERM (the broker's stop, kill) and Ctrl-C end the query after the current batch.
        signal.signal(signal.SIGTERM, lambda *_: job.stop())
        signal.signal(signal.SIGINT, lambda *_: job.stop())
        with _batch_progress(job, show=once and not as_json):
            report = job.run(once=once)
    except ExportError as e:
        raise fail(f"export: {e}") from None
    except Exception as e:  # storage or Delta errors: one line, no traceback, no options
        raise fail(f"export: {type(e).__name__}: {_first_line(e)}") from None
    summary = {
        "rows": report.rows,
        "batches": len(report.batches),
        "offsets": report.offsets,
        "stopped": report.stopped,
    }
    if as_json:
        typer.echo(json.dumps(summary))
    else:
        typer.echo(
            f"exported {report.rows} rows in {len(report.batches)} batch(es); "
            f"{len(report.offsets)} queue(s) exported"
        )
    if report.stopped:
        for line in report.stopped.values():
            typer.echo(f"error: {line}", err=True)
        raise typer.Exit(1)


@contextlib.contextmanager
def _batch_progress(job: Any, show: bool) -> Iterator[None]:
    """Progress on stderr while a backfill runs: rows and MB committed, and the rate. A live
    line on a terminal, one line per batch otherwise (logs, CI)."""
    if not show:
        yield
        return
    started = time.monotonic()
    totals = {"rows": 0, "bytes": 0}

    def line() -> str:
        elapsed = max(time.monotonic() - started, 1e-3)
        return (
            f"exported {totals['rows']:,} rows, {totals['bytes'] / 1e6:,.1f} MB in "
            f"{len(job.batches)} batch(es), {totals['rows'] / elapsed:,.0f} rows/s, "
            f"{totals['bytes'] / 1e6 / elapsed:,.1f} MB/s"
        )

    if not sys.stderr.isatty():

        def log_batch(batch: Any) -> None:
            totals["rows"] += batch.rows
            totals["bytes"] += batch.bytes
            print(line(), file=sys.stderr, flush=True)

        job.on_batch = log_batch
        yield
        return
    from rich.console import Console
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    with Progress(
        SpinnerColumn(),
        TextColumn("{task.fields[line]}"),
        TimeElapsedColumn(),
        console=Console(stderr=True),
        transient=True,
    ) as progress:
        task = progress.add_task("export", total=None, line="planning the first batch…")

        def advance(batch: Any) -> None:
            totals["rows"] += batch.rows
            totals["bytes"] += batch.bytes
            progress.update(task, line=line())

        job.on_batch = advance
        yield


@app.command("status")
def status(
    topics: Annotated[list[str] | None, typer.Argument(help="Topics (default: all).")] = None,
    lake_root: LakeRoot = DEFAULT_LAKE,
    tier_url: Annotated[
        str | None,
        typer.Option("--tier-url", help="Also compare with the tier: pending messages and lag."),
    ] = None,
    as_json: JsonFlag = False,
) -> None:
    """Per topic: exported offsets, rows and freshness lag in seconds.

    The lag is the age of the oldest archived message not yet in Delta (0: caught up).

    Example: tmq lakehouse status --tier-url s3://bucket/tier --json
    """
    from lakehouse.locations import Location
    from lakehouse.status import topic_status

    try:
        tier = Location.of(tier_url) if tier_url else None
        rows = topic_status(_lake(lake_root), list(topics) if topics else None, tier)
    except Exception as e:
        raise fail(f"status: {type(e).__name__}: {_first_line(e)}") from None
    if as_json:
        typer.echo(json.dumps([r.to_dict() for r in rows]))
        return
    if not rows:
        typer.echo("no tables")
    for r in rows:
        lag = "?" if r.lag_seconds is None else f"{r.lag_seconds:.1f}s"
        typer.echo(
            f"{r.topic}: {r.rows} rows in {r.files} files, table version {r.table_version}, "
            f"freshness lag {lag}"
        )
        for q in r.queues:
            if q.error:
                typer.echo(f"  {q.queue}: DAMAGED: exported to {q.exported_offset}; {q.error}")
                continue
            typer.echo(
                f"  {q.queue}: exported to {q.exported_offset} of {q.tier_watermark}"
                f" ({q.pending} pending)"
            )


@app.command("query")
def query(
    sql: Annotated[str, typer.Argument(help="SQL; tables are named after their topics.")],
    lake_root: LakeRoot = DEFAULT_LAKE,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object per row.")] = False,
) -> None:
    """Run SQL over the lake with delta-rs (no Spark needed).

    Example: tmq lakehouse query "select tags, count(*) from orders group by tags"
    """
    from lakehouse.query import QueryError, run_query

    try:
        result = run_query(_lake(lake_root), sql)
    except QueryError as e:
        raise fail(f"query: {e}", 2) from None
    except Exception as e:
        raise fail(f"query: {type(e).__name__}: {_first_line(e)}") from None
    records = result.to_pylist()
    if as_json:
        for record in records:
            typer.echo(json.dumps(record, default=_jsonable))
        return
    names = result.column_names
    typer.echo("\t".join(names))
    for record in records:
        typer.echo("\t".join("" if record[n] is None else str(_jsonable(record[n])) for n in names))


def _jsonable(value: Any) -> Any:
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return str(value)


@app.command("maintain")
def maintain(
    topics: Annotated[list[str] | None, typer.Argument(help="Topics (default: all).")] = None,
    lake_root: LakeRoot = DEFAULT_LAKE,
    target_size: Annotated[str, typer.Option(help="Compacted file size.")] = "128MiB",
    retention: Annotated[
        str, typer.Option(help="Vacuum files unreferenced for longer than this.")
    ] = "168h",
    dry_run: Annotated[bool, typer.Option(help="Only list what vacuum would delete.")] = False,
    as_json: JsonFlag = False,
) -> None:
    """Compact small files, vacuum unreferenced ones (incl. killed batches'), checkpoint.

    Example: tmq lakehouse maintain orders --retention 24h
    """
    from lakehouse.maintain import maintain as run_maintain

    try:
        hours = parse_duration_ms(retention) // 3_600_000
        size = parse_size(target_size)
    except ValueError as e:
        raise fail(str(e), 2) from None
    try:
        results = run_maintain(
            _lake(lake_root),
            list(topics) if topics else None,
            target_size=size,
            retention_hours=int(hours),
            dry_run=dry_run,
        )
    except Exception as e:
        raise fail(f"maintain: {type(e).__name__}: {_first_line(e)}") from None
    if as_json:
        typer.echo(json.dumps([r.to_dict() for r in results]))
        return
    for r in results:
        typer.echo(
            f"{r.topic}: compacted {r.files_removed} files into {r.files_added}; "
            f"vacuumed {r.vacuumed}; version {r.version}"
        )


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
