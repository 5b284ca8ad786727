"""``tmq produce``, ``tmq consume``, ``tmq replay``: the data path from the command line.

Produce and consume use Apache's RocketMQ 5 client, exactly as applications do; replay uses the
broker's PullMessage, which that client does not expose. Brokers are found through the NameServers.
"""

from __future__ import annotations

import base64
import json
import sys
import time
from typing import Annotated, Any

import grpc
import typer
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

from cli.topic import (
    TIER_UNAVAILABLE,
    TIER_UNKNOWN,
    NamesrvOption,
    ask_namesrv,
    fail,
    security,
    time_ms,
)

_TIMEOUT = 10
# How long, by default, a replay goes on repeating a pull the broker answers PROXY_TIMEOUT (its
# cold read did not finish within the broker's 2.5 s deadline) before it gives up (decision 886).
_COLD_WAIT_S = 60.0


def route(namesrv: str, topic: str) -> Any:
    found = ask_namesrv(namesrv, lambda c: c.route(topic))
    if found is None:
        raise fail(f"topic {topic} is not served by any live broker")
    return found


def _client_config(namesrv: str, topic: str) -> tuple[Any, bool]:
    """Apache's client configuration for the broker serving ``topic``, signed with the
    environment's admin key, and whether to use TLS."""
    from rocketmq import ClientConfiguration, Credentials  # imported late: it sets up logging

    sec = security()  # with TLS, cli/__init__.py has made its CA gRPC's default roots
    b = route(namesrv, topic).brokers[0]
    credentials = Credentials(sec.access_key, sec.secret_key) if sec.signs else Credentials()
    config = ClientConfiguration(
        f"{b.endpoint.host}:{b.endpoint.port}", credentials, request_timeout=_TIMEOUT
    )
    return config, bool(sec.ca_file)


def _body_text(body: bytes) -> str:
    try:
        return body.decode()
    except UnicodeDecodeError:
        return "base64:" + base64.b64encode(body).decode()


def produce(
    topic: str,
    namesrv: NamesrvOption = "127.0.0.1:9876",
    body: Annotated[
        str | None, typer.Option(help="Message body (default: read lines from stdin).")
    ] = None,
    count: Annotated[int, typer.Option(help="Send the body this many times.")] = 1,
    tag: Annotated[str | None, typer.Option(help="Message tag.")] = None,
    key: Annotated[list[str] | None, typer.Option(help="Message key (repeatable).")] = None,
    group: Annotated[str | None, typer.Option(help="Message group (FIFO topics).")] = None,
    as_json: Annotated[
        bool, typer.Option("--json", help="One JSON line per message sent.")
    ] = False,
) -> None:
    """Send messages: one --body (--count times), or one message per line of stdin.

    Example: echo hello | tmq produce orders --tag paid --key order-1
    """
    from rocketmq import Message, Producer

    bodies = [body] * count if body is not None else [line.rstrip("\n") for line in sys.stdin]
    config, tls = _client_config(namesrv, topic)
    producer = Producer(config, topics=[topic], tls_enable=tls)
    producer.startup()
    try:
        for text in bodies:
            m = Message()
            m.topic, m.body = topic, text.encode()
            if tag:
                m.tag = tag
            for k in key or []:
                m.keys = k
            if group:
                m.message_group = group
            try:
                receipt = producer.send(m)
            except Exception as e:
                raise fail(f"send failed: {e}") from None
            if as_json:
                typer.echo(json.dumps({"message_id": receipt.message_id, "offset": receipt.offset}))
    finally:
        producer.shutdown()
    if not as_json:
        typer.echo(f"sent {len(bodies)} message(s) to {topic}", err=True)


def consume(
    topic: str,
    group: Annotated[str, typer.Option("--group", "-g", help="Consumer group.")],
    namesrv: NamesrvOption = "127.0.0.1:9876",
    tags: Annotated[str, typer.Option(help="Tag filter, e.g. 'a || b'.")] = "*",
    sql: Annotated[
        str | None,
        typer.Option(help="SQL92 filter on properties instead of tags, e.g. \"TAGS = 'paid'\"."),
    ] = None,
    count: Annotated[int, typer.Option(help="Stop after this many messages (0: no limit).")] = 0,
    wait: Annotated[float, typer.Option(help="Stop after this many idle seconds.")] = 5.0,
    invisible: Annotated[
        int, typer.Option(help="Seconds a received message stays invisible to others.")
    ] = 30,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON line per message.")] = False,
) -> None:
    """Receive and acknowledge messages as a SimpleConsumer of GROUP.

    Example: tmq consume orders --group billing --count 10 --json
    """
    from rocketmq import FilterExpression, SimpleConsumer
    from rocketmq.grpc_protocol import FilterType

    if sql is not None and tags != "*":
        typer.echo("error: give --tags or --sql, not both", err=True)
        raise typer.Exit(2)
    expression = FilterExpression(sql, FilterType.SQL) if sql else FilterExpression(tags)
    config, tls = _client_config(namesrv, topic)
    consumer = SimpleConsumer(config, group, {topic: expression}, await_duration=2, tls_enable=tls)
    consumer.startup()
    got, idle_since = 0, time.monotonic()
    try:
        while (count == 0 or got < count) and time.monotonic() - idle_since < wait:
            messages = consumer.receive(min(32, count - got) if count else 32, invisible)
            if messages:
                idle_since = time.monotonic()
            for m in messages:
                _print_message(
                    as_json,
                    topic=topic,
                    message_id=m.message_id,
                    tag=m.tag,
                    keys=sorted(m.keys or []),
                    properties=m.properties,
                    attempt=m.delivery_attempt,
                    body=_body_text(m.body),
                )
                try:
                    consumer.ack(m)
                except Exception as e:  # at least once: the broker will deliver it again
                    typer.echo(
                        f"warning: ack of {m.message_id} failed ({e}); it will be redelivered",
                        err=True,
                    )
                got += 1
    finally:
        consumer.shutdown()
    if not as_json:
        typer.echo(f"received {got} message(s)", err=True)


def _print_message(as_json: bool, **fields: Any) -> None:
    if as_json:
        typer.echo(json.dumps(fields))
    else:
        typer.echo(
            f"{fields.get('queue', '')}{'@' + str(fields['offset']) if 'offset' in fields else ''} "
            f"{fields['message_id']} tag={fields['tag']} {fields['body']}".strip()
        )


def _progress(as_json: bool) -> Progress:
    """A progress bar on stderr, shown only to a person: not with --json, not when stderr is
    a pipe or a file. Lines printed meanwhile appear above it."""
    return Progress(
        TextColumn("replay {task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TimeRemainingColumn(),
        console=Console(stderr=True),
        transient=True,
        disable=as_json or not sys.stderr.isatty(),
    )


def replay(
    topic: str,
    namesrv: NamesrvOption = "127.0.0.1:9876",
    from_offset: Annotated[int | None, typer.Option(help="Start at this queue offset.")] = None,
    from_time: Annotated[
        str | None, typer.Option(help="Start at this store time (ISO 8601 or epoch ms).")
    ] = None,
    queue: Annotated[int | None, typer.Option(help="Only this queue.")] = None,
    limit: Annotated[int, typer.Option(help="Stop after this many messages (0: all).")] = 0,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON line per message.")] = False,
    cold_wait: Annotated[
        float,
        typer.Option(
            min=0,
            help="Seconds to keep asking for a batch the cold tier has not given yet, then "
            "exit 4 naming it (the cold tier did not answer; 0: at its first refusal).",
        ),
    ] = _COLD_WAIT_S,
) -> None:
    """Read a topic from an offset or a time up to its current end, without a consumer group.

    Example: tmq replay orders --from-time 2026-11-20T00:00:00Z --queue 0 --json
    """
    from rocketmq.grpc_protocol import definition_pb2 as d
    from rocketmq.grpc_protocol import service_pb2 as s
    from rocketmq.grpc_protocol import service_pb2_grpc

    if (from_offset is None) == (from_time is None):
        raise fail("give exactly one of --from-offset and --from-time", 2)
    start_ms = time_ms(from_time) if from_time is not None else None
    # First every queue's range, so the progress bar knows its total; then the reads.
    ranges = []
    for b in route(namesrv, topic).brokers:
        stub = service_pb2_grpc.MessagingServiceStub(
            security().channel(f"{b.endpoint.host}:{b.endpoint.port}")
        )
        for q in [queue] if queue is not None else list(range(b.queues)):
            mq = d.MessageQueue(topic=d.Resource(name=topic), id=q)
            end = stub.QueryOffset(
                s.QueryOffsetRequest(message_queue=mq, query_offset_policy=d.END), timeout=_TIMEOUT
            ).offset
            if start_ms is not None:
                at = s.QueryOffsetRequest(message_queue=mq, query_offset_policy=d.TIMESTAMP)
                at.timestamp.FromMilliseconds(start_ms)
                offset = stub.QueryOffset(at, timeout=_TIMEOUT).offset
            else:
                offset = from_offset or 0
            ranges.append((b.broker_name, stub, q, mq, offset, end))
    total = sum(max(0, end - offset) for *_, offset, end in ranges)
    printed = done = 0
    with _progress(as_json) as progress:
        # With --limit the bar counts messages printed; without, queue offsets covered.
        task = progress.add_task(topic, total=min(total, limit) if limit else total)
        for broker_name, stub, q, mq, offset, end in ranges:
            refused_since: float | None = None  # the first of the refusals in a row
            while offset < end and (limit == 0 or printed < limit):
                request = s.PullMessageRequest(
                    group=d.Resource(name="tmq-replay"),
                    message_queue=mq,
                    offset=offset,
                    batch_size=256,
                )
                next_offset = offset
                retry = False
                for item in stub.PullMessage(request, timeout=60):
                    kind = item.WhichOneof("content")
                    if kind == "status" and item.status.code == d.PROXY_TIMEOUT:
                        # The cold tier did not answer within the broker's read deadline; the
                        # fetch goes on there, so the same pull soon finds it cached.
                        now = time.monotonic()
                        refused_since = now if refused_since is None else refused_since
                        if now - refused_since < cold_wait:
                            retry = True
                            break
                        raise fail(
                            f"{broker_name} {topic}/{q}: offset {offset}: {item.status.message} "
                            f"(gave up after {now - refused_since:.0f} s of asking; "
                            f"--cold-wait {cold_wait:g})",
                            TIER_UNKNOWN,  # the cold tier did not answer (decision 923)
                        )
                    if kind == "status" and item.status.code not in (d.OK, d.MESSAGE_NOT_FOUND):
                        raise fail(f"{broker_name} {topic}/{q}: {item.status.message}")
                    if kind == "message" and (limit == 0 or printed < limit):
                        m = item.message
                        sp = m.system_properties
                        _print_message(
                            as_json,
                            broker=broker_name,
                            queue=q,
                            offset=sp.queue_offset,
                            message_id=sp.message_id,
                            tag=sp.tag if sp.HasField("tag") else None,
                            keys=list(sp.keys),
                            properties=dict(m.user_properties),
                            store_time_ms=sp.store_timestamp.ToMilliseconds(),
                            body=_body_text(m.body),
                        )
                        printed += 1
                    if kind == "next_offset":
                        next_offset = item.next_offset
                if retry:
                    time.sleep(0.5)
                    continue
                refused_since = None  # refusals in a row count, not a replay's total
                if next_offset <= offset:
                    break
                done += min(next_offset, end) - offset
                progress.update(task, completed=printed if limit else done)
                offset = next_offset
    if not as_json:
        typer.echo(f"replayed {printed} message(s)", err=True)


def query(
    topic: Annotated[str, typer.Option("--topic", "-t", help="Topic to search.")],
    key: Annotated[str, typer.Option("--key", "-k", help="Message key or message id.")],
    namesrv: NamesrvOption = "127.0.0.1:9876",
    begin: Annotated[
        str | None, typer.Option(help="Stored at or after (ISO 8601 or epoch ms).")
    ] = None,
    end: Annotated[
        str | None, typer.Option(help="Stored at or before (ISO 8601 or epoch ms).")
    ] = None,
    limit: Annotated[int, typer.Option(help="At most this many per broker.")] = 64,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON line per message.")] = False,
) -> None:
    """Find messages by key or message id, in both tiers, newest first.

    Example: tmq query --topic orders --key order-42 --json
    """
    from broker import admin_pb2 as pb
    from cli.topic import brokers

    request = pb.QueryByKeyRequest(
        topic=topic,
        key=key,
        max=limit,
        begin_ms=time_ms(begin) if begin else 0,
        end_ms=time_ms(end) if end else 0,
    )
    found = 0
    for broker_name, stub in brokers(namesrv):
        try:
            reply = stub.QueryByKey(request, timeout=_TIMEOUT)
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.NOT_FOUND:
                continue
            tier_silent = TIER_UNAVAILABLE in tuple(e.trailing_metadata() or ())
            raise fail(
                f"broker {broker_name}: {e.details() or e.code().name}",
                TIER_UNKNOWN if tier_silent else 1,
            ) from None
        for m in reply.messages:
            _print_message(
                as_json,
                broker=broker_name,
                queue=m.queue,
                offset=m.queue_offset,
                message_id=m.message_id,
                tag=m.tag or None,
                keys=list(m.keys),
                properties=dict(m.properties),
                store_time_ms=m.store_time_ms,
                body=_body_text(m.body),
            )
            found += 1
    if not as_json:
        typer.echo(f"found {found} message(s)", err=True)
