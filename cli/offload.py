"""``tmq offload TOPIC``, ``tmq offload status TOPIC``, ``tmq verify [TOPIC]``."""

from __future__ import annotations

import json
import time
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn

from broker import admin_pb2 as pb
from cli.topic import (
    NamesrvOption,
    brokers,
    call,
    divergence_line,
    fail,
    queue_divergence,
    tier_unknown_exit,
    time_ms,
    topic_on_brokers,
)
from tiered.config import parse_size


def _status_rows(namesrv: str, topic: str) -> list[dict[str, Any]]:
    rows = []
    for broker_name, _stub, d in topic_on_brokers(namesrv, topic):
        rows += [
            {
                "broker": broker_name,
                "topic": topic,
                "queue": q.queue,
                "min_offset": q.min_offset,
                "hot_min_offset": q.hot_min_offset,
                # null: not known, the cold tier did not answer in time (decision 810)
                "tier_watermark": None if q.tier_unknown else q.tier_watermark,
                "max_offset": q.max_offset,
                "tiered": d.topic.tiered,
                # Held at a damaged ConsumeQueue entry (decision 755); null when it is not.
                "offload_held": {
                    "offset": q.offload_held_offset,
                    "reason": q.offload_held_reason,
                    "since": _iso(q.offload_held_since_ms),
                }
                if q.offload_held
                else None,
                # Not checked against its archive yet, or diverged from it (decision 800).
                "tier_divergence": queue_divergence(q),
            }
            for q in d.queues
        ]
    return rows


def _iso(ms: int) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(ms / 1000))


# `tmq offload status`'s exit code when a queue's offload is held at a damaged ConsumeQueue
# entry, or the queue diverged from its archive: 1 is "a broker did not answer" and 2 a usage
# error (decisions 755, 800).
OFFLOAD_HELD = 3


def _status(namesrv: str, topic: str, wait: bool, as_json: bool) -> None:
    rows = _status_rows(namesrv, topic)
    if wait:
        with Progress(
            TextColumn("offload {task.description}"),
            BarColumn(),
            TextColumn("{task.completed}/{task.total} messages"),
            console=Console(stderr=True),  # stdout stays for the result (and --json)
            transient=True,
            disable=as_json,
        ) as progress:
            task = progress.add_task(topic, total=sum(r["max_offset"] for r in rows))
            while not any(r["tier_watermark"] is None for r in rows):  # unknown: said below
                progress.update(
                    task,
                    completed=sum(r["tier_watermark"] for r in rows),
                    total=sum(r["max_offset"] for r in rows),
                )
                if all(r["tier_watermark"] >= r["max_offset"] for r in rows) or any(
                    r["offload_held"] or _diverged(r) for r in rows
                ):
                    break  # a held or diverged queue goes no further until an operator acts
                time.sleep(1)
                rows = _status_rows(namesrv, topic)
    held = [r for r in rows if r["offload_held"]]
    diverged = [r for r in rows if _diverged(r)]
    unknown = [(r["topic"], r["broker"], r["queue"]) for r in rows if r["tier_watermark"] is None]
    if as_json:
        typer.echo(json.dumps(rows))
    else:
        for r in rows:
            if r["tier_watermark"] is None:
                tier = f"unknown (the cold tier did not answer) of {r['max_offset']}"
            else:
                lag = r["max_offset"] - r["tier_watermark"]
                tier = f"{r['tier_watermark']} of {r['max_offset']} (lag {lag})"
            typer.echo(
                f"{r['topic']}/{r['queue']} on {r['broker']}: tier watermark {tier}; hot from "
                f"{r['hot_min_offset']}, readable from "
                f"{r['min_offset'] if r['min_offset'] >= 0 else 'unknown (cold tier unavailable)'}"
            )
            if r["offload_held"]:
                h = r["offload_held"]
                typer.echo(
                    f"  HELD at queue offset {h['offset']} since {h['since']}: {h['reason']}; "
                    "restart the broker to rebuild the entry (docs/operations.md)"
                )
            if r["tier_divergence"]:
                typer.echo(divergence_line(r["tier_divergence"]))
    if held:
        typer.echo(
            f"error: offload held at a damaged ConsumeQueue entry in {len(held)} queue(s): "
            + ", ".join(f"{r['topic']}/{r['queue']} on {r['broker']}" for r in held),
            err=True,
        )
    if diverged:
        typer.echo(
            f"error: diverged from its archive in {len(diverged)} queue(s): "
            + ", ".join(f"{r['topic']}/{r['queue']} on {r['broker']}" for r in diverged),
            err=True,
        )
    if held or diverged:
        raise typer.Exit(OFFLOAD_HELD)
    tier_unknown_exit(unknown)


def _diverged(row: dict[str, Any]) -> bool:
    d = row["tier_divergence"]
    return d is not None and d["state"] == "diverged"


def offload(
    words: Annotated[list[str], typer.Argument(help="TOPIC, or: status TOPIC", show_default=False)],
    namesrv: NamesrvOption = "127.0.0.1:9876",
    queue: Annotated[int, typer.Option(help="Only this queue (default: all).")] = -1,
    keep_local: Annotated[
        str | None,
        typer.Option(
            metavar="SIZE",
            help="Leave the newest SIZE of each queue only local: bytes, or with a unit "
            "(64KiB, 512MiB, 1GiB; powers of 1024).",
        ),
    ] = None,
    before: Annotated[str | None, typer.Option(help="Only messages stored before TIME.")] = None,
    wait: Annotated[bool, typer.Option(help="status: wait until everything is uploaded.")] = False,
    timeout: Annotated[
        float, typer.Option(help="Give up after this many seconds per broker.")
    ] = 3600.0,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
    discard_local: Annotated[
        bool,
        typer.Option(
            help="resolve: drop the queue's local messages in conflict instead of re-appending "
            "them (they are lost; asks first).",
        ),
    ] = False,
    yes: Annotated[bool, typer.Option("--yes", help="resolve: do not ask.")] = False,
) -> None:
    """Upload a tiered topic to the cold tier now, or show how far it is uploaded.

    Examples: tmq offload orders --keep-local 1GiB; tmq offload status orders --wait;
    tmq offload resolve orders (a queue diverged from its archive: its local messages there are
    re-appended at its end, and the archive is read below its end; decision 801)
    (status exits 3 while a queue's offload is held at a damaged ConsumeQueue entry, or the
    queue diverged from its archive).
    """
    if words[0] == "resolve":
        if len(words) != 2:
            raise fail("usage: tmq offload resolve TOPIC [--queue Q] [--discard-local]", 2)
        _resolve(namesrv, words[1], queue, discard_local, yes, as_json)
        return
    if words[0] == "status":
        if len(words) != 2:
            raise fail("usage: tmq offload status TOPIC [--wait]", 2)
        _status(namesrv, words[1], wait, as_json)
        return
    if len(words) != 1:
        raise fail("usage: tmq offload TOPIC [--queue Q] [--keep-local SIZE | --before TIME]", 2)
    if keep_local and before:
        raise fail("give at most one of --keep-local and --before", 2)
    try:
        keep = parse_size(keep_local) if keep_local else 0
    except ValueError as e:
        raise fail(f"--keep-local: {e}", 2) from None
    request = pb.OffloadRequest(
        topic=words[0],
        queue=queue,
        keep_local_bytes=keep,
        before_ms=time_ms(before) if before else 0,
    )
    rows = []
    for broker_name, stub in brokers(namesrv):
        # An upload of gigabytes takes minutes, not the 10 s other admin calls get.
        reply = call(f"broker {broker_name}", stub.Offload, request, timeout=timeout)
        rows += [
            {
                "broker": broker_name,
                "topic": words[0],
                "queue": q.queue,
                "segments": q.segments,
                "messages": q.messages,
                "bytes": q.bytes,
                "watermark": q.watermark,
            }
            for q in reply.queues
        ]
    if as_json:
        typer.echo(json.dumps(rows))
        return
    for r in rows:
        typer.echo(
            f"{r['topic']}/{r['queue']} on {r['broker']}: uploaded {r['messages']} "
            f"messages in {r['segments']} segment(s); tier watermark {r['watermark']}"
        )


def _resolve(
    namesrv: str, topic: str, queue: int, discard_local: bool, yes: bool, as_json: bool
) -> None:
    """`tmq offload resolve`: end each conflict of the topic's queues with their archive."""
    if discard_local and queue < 0:
        raise fail("--discard-local names one queue: give --queue", 2)
    rows = []
    # Each broker holds its own queues and archive: only those with a conflict are asked (one
    # without, listed first, used to end the command before the one that had it was reached).
    found = [
        (broker_name, stub, conflicts)
        for broker_name, stub, d in topic_on_brokers(namesrv, topic)
        if (conflicts := {q.queue: q for q in d.queues if q.tier_diverged})
        and (queue < 0 or queue in conflicts)
    ]
    if not found:
        raise fail(
            f"no queue of {topic} has a conflict with its archive on any broker"
            if queue < 0
            else f"{topic}/{queue} has no conflict with its archive on any broker",
            1,
        )
    for broker_name, stub, conflicts in found:
        count = 0
        if discard_local:
            q = conflicts[queue]
            count = q.tier_archive_end - q.tier_unchecked_from
            question = (
                f"Discard the {count} acknowledged local message(s) of {topic}/{queue} on "
                f"{broker_name} at offsets {q.tier_unchecked_from}..{q.tier_archive_end - 1}? "
                "They are not in the archive and cannot be read again"
            )
            if not yes and not typer.confirm(question, err=True):
                raise fail("nothing discarded", 1)
        reply = call(
            f"broker {broker_name}",
            stub.ResolveDivergence,
            pb.ResolveDivergenceRequest(
                topic=topic, queue=queue, discard_local=discard_local, discard_count=count
            ),
            timeout=600,
        )
        rows += [
            {
                "broker": broker_name,
                "topic": topic,
                "queue": r.queue,
                "from": r.base,
                "archive_end": r.archive_end,
                "discarded": r.discarded,
                "copied": r.copied,
                "copies": None if r.discarded else [r.copies_from, r.copies_end],
            }
            for r in reply.queues
        ]
    if as_json:
        typer.echo(json.dumps(rows))
        return
    for r in rows:
        where = f"{r['topic']}/{r['queue']} on {r['broker']}"
        if r["discarded"]:
            typer.echo(
                f"{where}: resolved; the local messages at {r['from']}..{r['archive_end'] - 1} "
                "were DISCARDED; the archive's are read there"
            )
        else:
            typer.echo(
                f"{where}: resolved; the local messages at {r['from']}..{r['archive_end'] - 1} "
                f"are now at {r['copies'][0]}..{r['copies'][1] - 1} (same ids); the archive's "
                "are read at their offsets"
            )


# `tmq verify`'s exit code when nothing could be judged (0-2 are the verdicts).
NOT_VERIFIED = 3


def verify(
    topic: Annotated[
        str | None, typer.Argument(help="Topic (default: every tiered topic).")
    ] = None,
    namesrv: NamesrvOption = "127.0.0.1:9876",
    repair: Annotated[bool, typer.Option(help="Delete orphaned objects.")] = False,
    deep: Annotated[bool, typer.Option(help="Re-read every object and check its CRC.")] = False,
    timeout: Annotated[
        float,
        typer.Option(help="Seconds per broker; what is not checked by then makes a WARNING."),
    ] = 60.0,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """Compare manifests with the bucket: OK, WARNING (orphans, or not all checked in time) or
    FAILURE (missing, damaged).

    Example: tmq verify orders --json; exit code 0 OK, 1 WARNING, 2 FAILURE, 3 not verified
    (a broker, the NameServer or the object store did not answer).
    """
    statuses = []
    rows = []
    try:
        replies = [
            (
                broker_name,
                call(
                    f"broker {broker_name}",
                    stub.Verify,
                    pb.VerifyRequest(topic=topic or "", repair=repair, deep=deep),
                    timeout=timeout,
                ),
            )
            for broker_name, stub in brokers(namesrv)
        ]
    except typer.Exit:
        # Said on stderr already. Not exit 1: that is WARNING, and a check that could not run
        # must not read as "orphans only" to a script (decision 692).
        raise typer.Exit(NOT_VERIFIED) from None
    for broker_name, reply in replies:
        statuses.append(reply.status)
        rows += [
            {
                "broker": broker_name,
                "topic": v.topic,
                "queue": v.queue,
                "status": v.status,
                "missing": list(v.missing),
                "damaged": list(v.damaged),
                "anomalies": list(v.anomalies),
                "orphans": list(v.orphans),
                "repaired": list(v.repaired),
            }
            for v in reply.queues
        ]
    overall = "FAILURE" if "FAILURE" in statuses else "WARNING" if "WARNING" in statuses else "OK"
    if as_json:
        typer.echo(json.dumps({"status": overall, "queues": rows}))
    else:
        for r in rows:
            detail = "; ".join(
                f"{k}: {', '.join(r[k])}"
                for k in ("missing", "damaged", "anomalies", "orphans", "repaired")
                if r[k]
            )
            typer.echo(
                f"{r['status']:8s} {r['topic']}/{r['queue']} on {r['broker']}"
                f"{'  ' + detail if detail else ''}"
            )
        typer.echo(overall)
    raise typer.Exit({"OK": 0, "WARNING": 1, "FAILURE": 2}[overall])
