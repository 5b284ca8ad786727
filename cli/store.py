"""``tmq store``: offline operations on a broker's local data directory."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Annotated, Any

import typer

from tiered.config import StoreConfig

app = typer.Typer(
    help="Offline operations on a local store (the broker must be stopped).\n\n"
    "Example: tmq store check --data-dir ./tmq-data",
    no_args_is_help=True,
)


@app.command("check")
def check(
    data_dir: Annotated[Path, typer.Option("--data-dir", "-d", help="Store directory.")] = Path(
        "tmq-data"
    ),
    as_json: Annotated[bool, typer.Option("--json", help="Print the report as JSON.")] = False,
) -> None:
    """Open the store, run crash recovery, and report what it found and did.

    Example: tmq store check --data-dir ./tmq-data --json
    """
    from tiered.store import (
        GEOMETRY_FILE,
        DataDirLockedError,
        MessageStore,
        StoreLoadError,
        recorded_geometry,
    )

    if not data_dir.is_dir():
        typer.echo(f"error: {data_dir} is not a directory", err=True)
        raise typer.Exit(2)
    geometry = recorded_geometry(data_dir)
    if geometry is None:
        typer.echo(f"error: {data_dir} holds no tmq store ({GEOMETRY_FILE} is missing)", err=True)
        raise typer.Exit(2)
    store = MessageStore(
        StoreConfig(
            data_dir=data_dir,
            commitlog_file_size=geometry["commitlog_file_size"],
            consumequeue_entries_per_file=geometry["consumequeue_entries_per_file"],
            index_hash_slots=geometry["index_hash_slots"],
            index_max_entries=geometry["index_max_entries"],
        )
    )
    try:
        report = store.start()
    except (StoreLoadError, DataDirLockedError) as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(1) from None
    try:
        commitlog = store.commitlog_stats()
        summary: dict[str, Any] = {
            "data_dir": str(data_dir),
            "last_exit_clean": report.clean_exit,
            "checkpoint_found": report.checkpoint_found,
            "commitlog": {
                "min_offset": commitlog.min_offset,
                "max_offset": commitlog.max_offset,
                "files": commitlog.files,
            },
            "recovery": {
                **{k: v for k, v in asdict(report.commitlog).items() if k != "quarantined"},
                "quarantined": [str(p) for p in report.commitlog.quarantined],
                "consumequeue_entries_dropped": report.cq_entries_dropped,
                "consumequeue_rebuilt": report.consumequeue_rebuilt,
                "index_gaps_rebuilt": report.index_gaps_rebuilt,
                "redispatched_bytes": report.redispatched_bytes,
                "seconds": round(report.seconds, 3),
            },
            "queues": [
                {
                    "topic": t,
                    "queue": q,
                    "min_offset": store.min_offset(t, q),
                    "max_offset": store.max_offset(t, q),
                }
                for t in store.topics()
                for q in store.queue_ids(t)
            ],
        }
    finally:
        store.shutdown()
    if as_json:
        typer.echo(json.dumps(summary))
        return
    r = summary["recovery"]
    typer.echo(
        f"{data_dir}: last exit {'clean' if report.clean_exit else 'CRASHED'}; "
        f"CommitLog [{summary['commitlog']['min_offset']}, "
        f"{summary['commitlog']['max_offset']}) in {summary['commitlog']['files']} file(s)"
    )
    typer.echo(
        f"recovery: scanned {r['records_scanned']} records from offset {r['scanned_from']}, "
        f"cut {r['truncated_bytes']} torn bytes, {len(r['corrupt_records'])} corrupt "
        f"record(s), re-dispatched {r['redispatched_bytes']} bytes in {r['seconds']}s"
    )
    for q in summary["queues"]:
        typer.echo(f"  {q['topic']}/{q['queue']}: offsets [{q['min_offset']}, {q['max_offset']})")
    if r["corrupt_records"]:
        typer.echo(
            f"WARNING: records failing their CRC at offsets {r['corrupt_records']}", err=True
        )
