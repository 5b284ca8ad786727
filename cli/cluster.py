"""``tmq cluster status``: every replica group of a cluster as its controller (etcd) sees it:
master, slaves, epochs, replication lag in bytes and messages, and the SyncStateSet."""

from __future__ import annotations

import json
from typing import Annotated, Any

import typer

from broker.ha.etcd import EtcdClient

app = typer.Typer(
    help="Replica groups of a cluster, from their controller.\n\n"
    "Example: tmq cluster status --etcd http://127.0.0.1:2379",
    no_args_is_help=True,
)


def cluster_status(etcd: EtcdClient, cluster: str) -> list[dict[str, Any]]:
    """One entry per broker name: its master, epoch, SyncStateSet and members with their lag
    behind the master (bytes of CommitLog, messages of ConsumeQueues)."""
    prefix = f"/tmq/ha/{cluster}/".encode()
    groups: dict[str, dict[str, Any]] = {}
    for kv in etcd.get_prefix(prefix):
        name, _, rest = kv.key[len(prefix) :].decode().partition("/")
        empty: dict[str, Any] = {"broker": name, "master": None, "epoch": None}
        group = groups.setdefault(name, {**empty, "sync_state_set": [], "members": []})
        doc = json.loads(kv.value)
        if rest == "state":
            group["epoch"] = doc["epoch"]
            group["sync_state_set"] = doc.get("sync_state_set", [])
        elif rest == "master":
            group["master"] = doc["id"]
        elif rest.startswith("members/"):
            group["members"].append(doc)
    out = []
    for group in sorted(groups.values(), key=lambda g: g["broker"]):
        members = sorted(group["members"], key=lambda m: m["id"])
        master = next((m for m in members if m["id"] == group["master"]), None)
        for m in members:
            m["in_sync"] = m["id"] in group["sync_state_set"]
            if master is not None:
                m["lag_bytes"] = max(0, master["max_offset"] - m["max_offset"])
                m["lag_messages"] = max(0, master.get("messages", 0) - m.get("messages", 0))
        group["members"] = members
        out.append(group)
    return out


@app.command("status")
def status(
    etcd: Annotated[
        str,
        typer.Option("--etcd", help="etcd endpoints, comma-separated (the brokers' [ha] etcd)."),
    ] = "http://127.0.0.1:2379",
    cluster: Annotated[str, typer.Option("--cluster", help="Cluster name.")] = "DefaultCluster",
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """Masters, slaves, epochs, replication lag and SyncStateSets of every replica group.

    Example: tmq cluster status --etcd http://10.0.0.5:2379 --json
    """
    groups = cluster_status(EtcdClient([e for e in etcd.split(",") if e]), cluster)
    if as_json:
        typer.echo(json.dumps(groups, sort_keys=True))
        return
    if not groups:
        typer.echo(f"no replica group of cluster {cluster} is registered with the controller")
        raise typer.Exit(1)
    for g in groups:
        master = g["master"] if g["master"] is not None else "NONE (election pending)"
        typer.echo(
            f"{g['broker']}: master {master}, epoch {g['epoch']}, "
            f"SyncStateSet {g['sync_state_set']}"
        )
        for m in g["members"]:
            lag = (
                f"lag {m['lag_bytes']} bytes / {m['lag_messages']} messages"
                if "lag_bytes" in m
                else "lag unknown (no master)"
            )
            typer.echo(
                f"  member {m['id']:>3}  {m['role']:<6}  epoch {m['epoch']:<4}  "
                f"{m['endpoint']:<22}  end {m['max_offset']:<12}  {lag}"
                f"{'  in sync' if m['in_sync'] else ''}"
            )
