"""``tmq status``: the cluster at a glance, through the NameServers.

Every broker the NameServers list is asked for its Status (admin service); one that does not
answer is reported with ``alive: false`` and the reason, and the command exits 1. The JSON shape
is documented in docs/operations.md ("JSON output") and pinned by tests/test_ops.py.
"""

from __future__ import annotations

import json
from typing import Any

import grpc
import typer

from broker import admin_pb2 as pb
from broker import admin_pb2_grpc as pb_grpc
from cli.topic import TIER_UNKNOWN, JsonOption, NamesrvOption, ask_namesrv, fail, security

_TIMEOUT = 5.0


def _human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _topics(broker: str, reply: pb.StatusResponse) -> list[dict[str, Any]]:
    by_topic: dict[str, list[pb.TieredQueueStatus]] = {}
    for q in reply.queues:
        by_topic.setdefault(q.topic, []).append(q)
    freshness = dict(reply.export_freshness_seconds) if reply.export_reported else None
    rows = []
    for topic, queues in sorted(by_topic.items()):
        known = all(q.known for q in queues)
        rows.append(
            {
                "broker": broker,
                "topic": topic,
                "lag_known": known,
                "tier_lag_messages": sum(q.lag_messages for q in queues) if known else None,
                "tier_lag_bytes": sum(q.lag_bytes for q in queues) if known else None,
                "tier_lag_seconds": max(q.lag_seconds for q in queues) if known else None,
                "dispatch_lag_bytes": reply.dispatch_lag_bytes,
                "store_bytes": {
                    "hot": sum(q.hot_bytes for q in queues),
                    # null: a manifest is not loaded, so its archive's size is not known
                    # (decision 810); 0 would say the archive is empty.
                    "cold": sum(q.archived_bytes for q in queues) if known else None,
                },
                "export_freshness_seconds": (freshness or {}).get(topic),
                "queues": [
                    {
                        "queue": q.queue,
                        "max_offset": q.max_offset,
                        "lag_known": q.known,
                        "tier_lag_messages": q.lag_messages if q.known else None,
                        "tier_lag_bytes": q.lag_bytes if q.known else None,
                        "tier_lag_seconds": round(q.lag_seconds, 3) if q.known else None,
                        "store_bytes": {
                            "hot": q.hot_bytes,
                            "cold": q.archived_bytes if q.known else None,
                        },
                    }
                    for q in queues
                ],
            }
        )
    return rows


def cluster_status(namesrv: str) -> dict[str, Any]:
    """The document ``tmq status --json`` prints."""
    info = ask_namesrv(namesrv, lambda c: c.cluster_info())
    brokers: list[dict[str, Any]] = []
    topics: list[dict[str, Any]] = []
    for b in sorted(info.brokers, key=lambda b: b.broker.broker_name):
        reg = b.broker
        address = f"{reg.endpoint.host}:{reg.endpoint.port}"
        row: dict[str, Any] = {
            "name": reg.broker_name,
            "cluster": reg.cluster,
            "address": address,
            "alive": False,
            "error": None,
            "topics": len(reg.topics),
            "dispatch_lag_bytes": None,
            "commitlog_files": None,
            "store_bytes": None,
            "has_tier": None,
            "export_freshness_seconds": None,
        }
        channel = security().channel(address)
        try:
            reply = pb_grpc.AdminStub(channel).Status(pb.StatusRequest(), timeout=_TIMEOUT)
        except grpc.RpcError as e:
            row["error"] = f"{e.code().name}: {e.details() or 'no answer'}"
        else:
            row.update(
                alive=True,
                topics=reply.topics,
                dispatch_lag_bytes=reply.dispatch_lag_bytes,
                commitlog_files=reply.commitlog_files,
                store_bytes={
                    "hot": reply.hot_store_bytes,
                    # The sum of the loaded manifests: null while one is not (decision 810).
                    "cold": reply.cold_store_bytes if all(q.known for q in reply.queues) else None,
                },
                has_tier=reply.has_tier,
                export_freshness_seconds=(
                    dict(reply.export_freshness_seconds) if reply.export_reported else None
                ),
            )
            topics += _topics(reg.broker_name, reply)
        finally:
            channel.close()
        brokers.append(row)
    return {"namesrv": namesrv, "brokers": brokers, "tiered_topics": topics}


def status(namesrv: NamesrvOption = "127.0.0.1:9876", as_json: JsonOption = False) -> None:
    """Brokers, tier upload lag, dispatch lag and bytes per tier, in one screen.

    Example: tmq status --json; exit code 0 when every broker answers, 1 when one does not, 4
    when the cold tier did not answer for a tiered queue (its upload lag unknown).
    """
    doc = cluster_status(namesrv)
    healthy = bool(doc["brokers"]) and all(b["alive"] for b in doc["brokers"])
    # Every broker answered, but a tiered queue's manifest is not loaded (the tier has not
    # answered for it): exit 4, as `tmq topic describe` (decision 810).
    unknown = [t for t in doc["tiered_topics"] if not t["lag_known"]]
    code = 1 if not healthy else TIER_UNKNOWN if unknown else 0
    if as_json:
        typer.echo(json.dumps(doc))
        raise typer.Exit(code)
    if not doc["brokers"]:
        raise fail(f"no live broker is registered with {namesrv}")
    for b in doc["brokers"]:
        if not b["alive"]:
            typer.echo(f"{b['name']:16s} {b['address']:21s} NOT ANSWERING  {b['error']}")
            continue
        stores = b["store_bytes"]
        typer.echo(
            f"{b['name']:16s} {b['address']:21s} alive  topics={b['topics']}  "
            f"dispatch lag {_human_bytes(b['dispatch_lag_bytes'])}  "
            f"hot {_human_bytes(stores['hot'])}  cold {_cold(stores['cold'])}"
            + ("" if b["has_tier"] else "  (no cold tier)")
        )
    for t in doc["tiered_topics"]:
        if t["lag_known"]:
            lag = (
                f"tier lag {t['tier_lag_messages']} messages, "
                f"{_human_bytes(t['tier_lag_bytes'])}, oldest {t['tier_lag_seconds']:.1f} s"
            )
        else:
            lag = "tier lag unknown (its manifests are not loaded yet: is the tier reachable?)"
        export = t["export_freshness_seconds"]
        typer.echo(
            f"  {t['topic']} on {t['broker']}: {lag}; hot {_human_bytes(t['store_bytes']['hot'])}, "
            f"cold {_cold(t['store_bytes']['cold'])}"
            + (f"; export {export:.0f} s behind" if export is not None else "")
        )
    raise typer.Exit(code)


def _cold(n: int | None) -> str:
    return "unknown" if n is None else _human_bytes(n)
