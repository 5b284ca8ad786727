"""``tmq retain``: per-topic TTLs. Set them, show them, or enforce them now."""

from __future__ import annotations

import json
from typing import Annotated, Any

import typer

from broker import admin_pb2 as pb
from cli.topic import (
    NamesrvOption,
    brokers,
    call,
    duration_ms,
    fail,
    retention_text,
    set_retention,
    size_bytes,
    topic_on_brokers,
)
from tiered.config import format_size


def retain(
    topic: Annotated[str | None, typer.Argument(help="Topic (all topics with --apply).")] = None,
    namesrv: NamesrvOption = "127.0.0.1:9876",
    ttl: Annotated[str | None, typer.Option(help="Total TTL, both tiers (e.g. 90d).")] = None,
    local: Annotated[
        str | None, typer.Option(help="Hot-tier TTL of a tiered topic (e.g. 1d).")
    ] = None,
    max_bytes: Annotated[
        str | None,
        typer.Option(help="Per queue, the archive's size limit (e.g. 50GiB; 0 for none)."),
    ] = None,
    apply: Annotated[bool, typer.Option("--apply", help="Enforce the TTLs now.")] = False,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="With --apply: only say what would go.")
    ] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """Set a topic's TTLs, show them, or enforce them now.

    Examples: tmq retain orders --ttl 90d --local 1d; tmq retain orders;
    tmq retain --apply --dry-run
    """
    ttl_ms, local_ms = duration_ms(ttl, "--ttl"), duration_ms(local, "--local")
    limit = size_bytes(max_bytes, "--max-bytes")
    if apply:
        _apply(topic, namesrv, dry_run, as_json)
        return
    if topic is None:
        raise fail("name a topic (or use --apply)", 2)
    rows: list[dict[str, Any]] = []
    for broker_name, stub, described in topic_on_brokers(namesrv, topic):
        t = described.topic
        if set_retention(t, ttl_ms, local_ms, limit):
            call(f"broker {broker_name}", stub.PutTopic, pb.PutTopicRequest(topic=t, update=True))
        rows.append(
            {
                "broker": broker_name,
                "topic": t.name,
                "tiered": t.tiered,
                "ttl_ms": t.retention_ms,
                "local_ttl_ms": t.local_retention_ms,
                "max_bytes": t.retention_bytes,
            }
        )
    if as_json:
        typer.echo(json.dumps(rows))
        return
    for r in rows:
        typer.echo(
            f"{r['topic']} on {r['broker']}: "
            + retention_text(r["ttl_ms"], r["local_ttl_ms"], r["max_bytes"])
            + ("" if r["tiered"] else " (not tiered)")
        )


def _apply(topic: str | None, namesrv: str, dry_run: bool, as_json: bool) -> None:
    rows = []
    for broker_name, stub in brokers(namesrv):
        reply = call(
            f"broker {broker_name}",
            stub.ApplyRetention,
            pb.ApplyRetentionRequest(topic=topic or "", dry_run=dry_run),
        )
        rows += [
            {
                "broker": broker_name,
                "topic": o.topic,
                "queue": o.queue,
                "segments": o.segments,
                "messages": o.messages,
                "bytes": o.bytes,
                "new_start_offset": o.new_start_offset,
                "objects": list(o.deleted_keys),
                "dry_run": dry_run,
            }
            for o in reply.outcomes
        ]
    if as_json:
        typer.echo(json.dumps(rows))
        return
    verb = "would delete" if dry_run else "deleted"
    for r in rows:
        typer.echo(
            f"{r['topic']}/{r['queue']} on {r['broker']}: {verb} {r['segments']} segment(s), "
            f"{r['messages']} messages, {format_size(r['bytes'])}; archive starts at "
            f"{r['new_start_offset']}"
        )
    if not rows:
        typer.echo("nothing has expired")
