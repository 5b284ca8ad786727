"""``tmq topic create|update|list|describe``: topics on every broker the NameServers know."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from datetime import datetime
from typing import Annotated, Any, TypeVar

import grpc
import typer

from broker import admin_pb2 as pb
from broker import admin_pb2_grpc as pb_grpc
from remoting.namesrv_client import NameServerClient, parse_addresses
from remoting.security import ChannelSecurity
from tiered.cold.credentials import scrub_known
from tiered.config import format_duration, format_size, parse_duration_ms, parse_size

app = typer.Typer(
    help="Create, change and inspect topics.\n\nExample: tmq topic describe orders --json",
    no_args_is_help=True,
)

NamesrvOption = Annotated[
    str,
    typer.Option(
        "--namesrv",
        "-n",
        envvar="TMQ_NAMESRV_ADDR",
        help="NameServer address(es), host:port[;host:port].",
    ),
]
JsonOption = Annotated[bool, typer.Option("--json", help="Print JSON.")]
_TIMEOUT = 10.0


def fail(message: str, code: int = 1) -> typer.Exit:
    """Print ``error: message`` (one line, known secrets scrubbed); raise the returned Exit."""
    typer.echo(f"error: {scrub_known(' '.join(message.split()))}", err=True)
    return typer.Exit(code)


def duration_ms(text: str | None, what: str) -> int | None:
    """An option's duration (90d, 12h, 30s) in milliseconds; exit 2 on nonsense."""
    if text is None:
        return None
    try:
        return parse_duration_ms(text)
    except ValueError as e:
        raise fail(f"{what}: {e}", 2) from None


def time_ms(text: str) -> int:
    """An option's time, epoch milliseconds or ISO 8601 (``2026-11-20T10:00:00Z``), as epoch
    milliseconds; exit 2 on nonsense."""
    if text.isdigit():
        return int(text)
    try:
        return int(datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp() * 1000)
    except ValueError:
        raise fail(f"not a time: {text!r} (epoch ms or ISO 8601)", 2) from None


def size_bytes(text: str | None, what: str) -> int | None:
    """An option's size (64MiB, 1g) in bytes; exit 2 on nonsense."""
    if text is None:
        return None
    try:
        return parse_size(text)
    except ValueError as e:
        raise fail(f"{what}: {e}", 2) from None


TtlOption = Annotated[str | None, typer.Option(help="Total TTL, both tiers (e.g. 90d).")]
LocalTtlOption = Annotated[
    str | None, typer.Option(help="Hot-tier TTL of a tiered topic (e.g. 1d).")
]
MaxBytesOption = Annotated[
    str | None, typer.Option(help="Per queue, the archive's size limit (e.g. 50GiB).")
]


T = TypeVar("T")


def security() -> ChannelSecurity:
    """How the CLI reaches tmq's servers: ``TMQ_ADMIN_ACCESS_KEY``/``TMQ_ADMIN_SECRET_KEY``
    sign every call, ``TMQ_TLS_CA_FILE`` turns TLS on (docs/security.md)."""
    return ChannelSecurity.from_env(os.environ)


def ask_namesrv(namesrv: str, question: Callable[[NameServerClient], T]) -> T:
    """``question`` put to the NameServers at ``namesrv``; exit with one line when the address
    is malformed (2) or none answers (1)."""
    try:
        client = NameServerClient(parse_addresses(namesrv), security())
        try:
            return question(client)
        finally:
            client.close()
    except ValueError as e:
        raise fail(str(e), 2) from None
    except grpc.RpcError as e:
        if e.code() in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
            raise fail(
                f"the NameServer at {namesrv} refused the call ({e.code().name}: {e.details()}); "
                "set TMQ_ADMIN_ACCESS_KEY and TMQ_ADMIN_SECRET_KEY to an admin's keys"
            ) from None
        raise fail(f"no NameServer at {namesrv} answered ({e.code().name})") from None


def set_retention(
    topic: pb.Topic, ttl_ms: int | None, local_ms: int | None, max_bytes: int | None
) -> bool:
    """Set the retention settings given (None: unchanged); True if any was given."""
    if ttl_ms is not None:
        topic.retention_ms = ttl_ms
    if local_ms is not None:
        topic.local_retention_ms = local_ms
    if max_bytes is not None:
        topic.retention_bytes = max_bytes
    return ttl_ms is not None or local_ms is not None or max_bytes is not None


def brokers(namesrv: str, only: str | None = None) -> list[tuple[str, pb_grpc.AdminStub]]:
    """(broker name, admin stub) of every live broker, or of the one named ``only``."""
    info = ask_namesrv(namesrv, lambda c: c.cluster_info())
    found = [
        (
            b.broker.broker_name,
            pb_grpc.AdminStub(
                security().channel(f"{b.broker.endpoint.host}:{b.broker.endpoint.port}")
            ),
        )
        for b in info.brokers
        if only is None or b.broker.broker_name == only
    ]
    if not found:
        raise fail(f"no live broker{'' if only is None else ' named ' + only} is registered")
    return found


# The exit code of a command that answered, but with a tiered queue whose tier watermark is
# unknown: its manifest was not cached and the cold tier did not answer within the broker's
# admin_tier_wait_ms (decision 810). 1 is "a broker did not answer", 2 a usage error, 3 a held
# offload (`tmq offload status`).
TIER_UNKNOWN = 4


def tier_unknown_exit(rows: list[tuple[str, str, int]]) -> None:
    """Exit ``TIER_UNKNOWN`` with one line naming the (topic, broker, queue) ``rows`` whose tier
    watermark is unknown; return when there are none."""
    if not rows:
        return
    typer.echo(
        f"error: the cold tier did not answer for {len(rows)} queue(s), so their tier watermark "
        "is unknown: " + ", ".join(f"{t}/{q} on {b}" for t, b, q in rows),
        err=True,
    )
    raise typer.Exit(TIER_UNKNOWN)


# Trailing metadata of a call the broker refused because the cold tier did not answer
# (broker/admin.py, decision 921).
TIER_UNAVAILABLE = ("tmq-cold-tier", "unavailable")


def call(what: str, fn: Any, *args: Any, timeout: float = _TIMEOUT) -> Any:
    """One admin RPC (``fn(*args)``); exit with one line naming ``what`` when it fails: exit
    ``TIER_UNKNOWN`` when the broker refused it because the cold tier did not answer, 1
    otherwise."""
    try:
        return fn(*args, timeout=timeout)
    except grpc.RpcError as e:
        trailing = e.trailing_metadata() if hasattr(e, "trailing_metadata") else None
        if TIER_UNAVAILABLE in tuple(trailing or ()):
            raise fail(f"{what}: {e.details()}", TIER_UNKNOWN) from None
        if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
            raise fail(
                f"{what}: no answer within {timeout:g} s (the broker may be waiting on the cold "
                "tier; see its log)"
            ) from None
        raise fail(f"{what}: {e.details() or e.code().name}") from None


def _raise(e: grpc.RpcError, timeout: float) -> None:
    raise e


def topic_on_brokers(
    namesrv: str, name: str, *, only: str | None = None, everywhere: bool = False
) -> list[tuple[str, pb_grpc.AdminStub, pb.TopicDescription]]:
    """(broker name, admin stub, description) of topic ``name`` on every live broker (or the
    one named ``only``) that has it; exit with one line when none has it (or, with
    ``everywhere``, when one lacks it)."""
    found = []
    for broker_name, stub in brokers(namesrv, only):
        try:
            described = stub.GetTopic(pb.GetTopicRequest(name=name), timeout=_TIMEOUT)
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.NOT_FOUND:
                call(f"broker {broker_name}", _raise, e)  # exits with call's one line
            if everywhere:
                raise fail(f"topic {name} does not exist on {broker_name}") from None
            continue
        found.append((broker_name, stub, described))
    if not found:
        raise fail(f"topic {name} does not exist")
    return found


def retention_text(ttl_ms: int, local_ttl_ms: int, max_bytes: int) -> str:
    """A topic's retention in one phrase: ``ttl 90d, local ttl 1d, archive limit 50GiB per
    queue``."""
    # A local TTL of 0 keeps nothing local once it is uploaded (offload/release.py).
    local = format_duration(local_ttl_ms) if local_ttl_ms else "0 (released once uploaded)"
    text = f"ttl {format_duration(ttl_ms)}, local ttl {local}"
    return text + (f", archive limit {format_size(max_bytes)} per queue" if max_bytes else "")


def positive_queues(queues: int | None) -> None:
    if queues is not None and queues < 1:
        raise fail(f"--queues: a topic needs at least 1 queue, not {queues}", 2)


@app.command("create")
def create(
    name: str,
    namesrv: NamesrvOption = "127.0.0.1:9876",
    queues: Annotated[int, typer.Option("--queues", "-q", help="Queues per broker.")] = 8,
    message_type: Annotated[
        str, typer.Option(help="NORMAL, FIFO, DELAY or TRANSACTION.")
    ] = "NORMAL",
    perm: Annotated[int, typer.Option(help="6 read-write, 4 read-only, 2 write-only.")] = 6,
    broker: Annotated[str | None, typer.Option(help="Only this broker (default: all).")] = None,
    tiered: Annotated[
        bool, typer.Option("--tiered/--no-tiered", help="Offload to the cold tier.")
    ] = False,
    ttl: TtlOption = None,
    local_ttl: LocalTtlOption = None,
    max_bytes: MaxBytesOption = None,
    as_json: JsonOption = False,
) -> None:
    """Create a topic on every broker (or one).

    Example: tmq topic create orders --queues 8 --tiered --ttl 90d --local-ttl 1d
    """
    positive_queues(queues)
    ttl_ms, local_ms = duration_ms(ttl, "--ttl"), duration_ms(local_ttl, "--local-ttl")
    limit = size_bytes(max_bytes, "--max-bytes")
    done = []
    for broker_name, stub in brokers(namesrv, broker):
        topic = pb.Topic(
            name=name,
            queues=queues,
            perm=perm,
            message_type=message_type.upper(),
            tiered=tiered,
            retention_ms=ttl_ms or 0,
            local_retention_ms=local_ms or 0,
            retention_bytes=limit or 0,
        )
        call(f"broker {broker_name}", stub.PutTopic, pb.PutTopicRequest(topic=topic))
        done.append(broker_name)
    _report(name, "created", done, as_json)


def _report(name: str, action: str, broker_names: list[str], as_json: bool) -> None:
    if as_json:
        typer.echo(
            json.dumps([{"broker": b, "topic": name, "action": action} for b in broker_names])
        )
        return
    for b in broker_names:
        typer.echo(f"{action} topic {name} on {b}")


@app.command("update")
def update(
    name: str,
    namesrv: NamesrvOption = "127.0.0.1:9876",
    queues: Annotated[int | None, typer.Option("--queues", "-q", help="Queues per broker.")] = None,
    perm: Annotated[
        int | None, typer.Option(help="6 read-write, 4 read-only, 2 write-only.")
    ] = None,
    broker: Annotated[str | None, typer.Option(help="Only this broker (default: all).")] = None,
    tiered: Annotated[
        bool | None, typer.Option("--tiered/--no-tiered", help="Offload to the cold tier.")
    ] = None,
    ttl: TtlOption = None,
    local_ttl: LocalTtlOption = None,
    max_bytes: MaxBytesOption = None,
    as_json: JsonOption = False,
) -> None:
    """Change what is given (queues, permission, tiering, TTLs); everything else stays as it is.

    Example: tmq topic update orders --queues 16 --tiered --ttl 30d
    """
    positive_queues(queues)
    ttl_ms, local_ms = duration_ms(ttl, "--ttl"), duration_ms(local_ttl, "--local-ttl")
    limit = size_bytes(max_bytes, "--max-bytes")
    done = []
    for broker_name, stub, described in topic_on_brokers(
        namesrv, name, only=broker, everywhere=True
    ):
        topic = described.topic
        if queues is not None:
            topic.queues = queues
        if perm is not None:
            topic.perm = perm
        if tiered is not None:
            topic.tiered = tiered
        set_retention(topic, ttl_ms, local_ms, limit)
        call(f"broker {broker_name}", stub.PutTopic, pb.PutTopicRequest(topic=topic, update=True))
        done.append(broker_name)
    _report(name, "updated", done, as_json)


def queue_divergence(q: pb.QueueStats) -> dict[str, Any] | None:
    """A queue's pending check or conflict with its archive, as the JSON shows it (null: none)."""
    if q.tier_diverged:
        return {
            "state": "diverged",
            "from": q.tier_unchecked_from,
            "archive_end": q.tier_archive_end,
            # A resolve that began copying here and did not finish (decision 801).
            "resolve_began_at": q.tier_resolve_copies_from or None,
        }
    if q.tier_check_pending:
        return {
            "state": "pending",
            "from": q.tier_unchecked_from,
            "archive_end": None,
            "resolve_began_at": None,
        }
    return None


def divergence_line(d: dict[str, Any]) -> str:
    """The text line under a queue's line in `tmq offload status` and `tmq topic describe`."""
    if d["state"] == "diverged":
        return (
            f"  DIVERGED from its archive: offsets {d['from']}..{d['archive_end'] - 1} hold "
            "acknowledged messages here and other, older ones in the archive; they are kept "
            "locally and not archived. Resolve with `tmq offload resolve` (docs/operations.md)"
            + (
                f"; a resolve began (its copies from offset {d['resolve_began_at']}) and did not "
                "finish: run it again"
                if d["resolve_began_at"] is not None
                else ""
            )
        )
    return (
        f"  NOT CHECKED against its archive yet (the object store did not answer): nothing from "
        f"offset {d['from']} on is uploaded or released until the check runs"
    )


def _description(broker_name: str, d: pb.TopicDescription) -> dict[str, Any]:
    return {
        "broker": broker_name,
        "topic": d.topic.name,
        "queues": d.topic.queues,
        "perm": d.topic.perm,
        "message_type": d.topic.message_type,
        "tiered": d.topic.tiered,
        "ttl_ms": d.topic.retention_ms,
        "local_ttl_ms": d.topic.local_retention_ms,
        "max_bytes": d.topic.retention_bytes,
        **(
            {
                "timers_pending": d.timers_pending,
                "timer_delivery_lag_seconds": round(d.timer_delivery_lag_seconds, 3),
            }
            if d.topic.message_type == "DELAY"
            else {}
        ),
        **(
            {"transactions_pending": d.transactions_pending}
            if d.topic.message_type == "TRANSACTION"
            else {}
        ),
        "queue_offsets": [
            {
                "queue": q.queue,
                "min_offset": q.min_offset,
                "hot_min_offset": q.hot_min_offset,
                # null: not known, the cold tier did not answer in time (decision 810)
                "tier_watermark": None if q.tier_unknown else q.tier_watermark,
                "max_offset": q.max_offset,
                "tier_divergence": queue_divergence(q),
            }
            for q in d.queues
        ],
    }


@app.command("list")
def list_topics(namesrv: NamesrvOption = "127.0.0.1:9876", as_json: JsonOption = False) -> None:
    """List every topic on every broker.

    Example: tmq topic list --json
    """
    rows = []
    for broker_name, stub in brokers(namesrv):
        listing = call(f"broker {broker_name}", stub.ListTopics, pb.ListTopicsRequest())
        rows += [_description(broker_name, t) for t in listing.topics]
    unknown = _unknown(rows)
    if as_json:
        typer.echo(json.dumps(rows))
        tier_unknown_exit(unknown)
        return
    for r in rows:
        total = sum(q["max_offset"] for q in r["queue_offsets"])
        tiering = "tiered" if r["tiered"] else "local"
        typer.echo(
            f"{r['topic']:40s} {r['broker']:16s} queues={r['queues']} "
            f"type={r['message_type']} {tiering} messages={total} "
            f"ttl={format_duration(r['ttl_ms'])} "
            f"local_ttl={format_duration(r['local_ttl_ms']) if r['local_ttl_ms'] else '0'}"
            + (f" max_bytes={format_size(r['max_bytes'])}" if r["max_bytes"] else "")
        )
    tier_unknown_exit(unknown)


def _unknown(rows: list[dict[str, Any]]) -> list[tuple[str, str, int]]:
    """(topic, broker, queue) of every queue in ``rows`` whose tier watermark is unknown."""
    return [
        (r["topic"], r["broker"], q["queue"])
        for r in rows
        for q in r["queue_offsets"]
        if q["tier_watermark"] is None
    ]


@app.command("describe")
def describe(
    name: str, namesrv: NamesrvOption = "127.0.0.1:9876", as_json: JsonOption = False
) -> None:
    """Show a topic's configuration and per-queue offsets on every broker.

    Example: tmq topic describe orders --json
    """
    rows = [_description(b, d) for b, _stub, d in topic_on_brokers(namesrv, name)]
    unknown = _unknown(rows)
    if as_json:
        typer.echo(json.dumps(rows))
        tier_unknown_exit(unknown)
        return
    for r in rows:
        typer.echo(
            f"{r['topic']} on {r['broker']}: {r['queues']} queues, perm {r['perm']}, "
            f"{r['message_type']}, {'tiered' if r['tiered'] else 'not tiered'}; "
            + retention_text(r["ttl_ms"], r["local_ttl_ms"], r["max_bytes"])
        )
        if "timers_pending" in r:
            typer.echo(
                f"  timers: {r['timers_pending']} pending, delivery lag "
                f"{r['timer_delivery_lag_seconds']:.3f} s"
            )
        if "transactions_pending" in r:
            typer.echo(f"  transactions: {r['transactions_pending']} half messages pending")
        for q in r["queue_offsets"]:
            first = "?" if q["min_offset"] < 0 else q["min_offset"]  # archive start unknown
            tier = ""
            if r["tiered"]:
                watermark = q["tier_watermark"]
                known = "unknown (the cold tier did not answer)" if watermark is None else watermark
                tier = f", tier watermark {known}"
            typer.echo(f"  queue {q['queue']}: offsets [{first}, {q['max_offset']}){tier}")
            if q["tier_divergence"]:
                typer.echo("  " + divergence_line(q["tier_divergence"]))
    tier_unknown_exit(unknown)
