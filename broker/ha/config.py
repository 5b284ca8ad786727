"""``[ha]`` in tmq.toml: this broker's place in a replica group (RocketMQ's brokerRole,
brokerId, haListenPort, haMasterAddress, inSyncReplicas/minInSyncReplicas,
haMaxTimeSlaveNotCatchup)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

Role = Literal["master", "slave"]
ReplicationMode = Literal["async", "sync"]


def parse_address(text: str, what: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"[ha] {what}: {text!r} is not host:port")
    return host or "0.0.0.0", int(port)


@dataclass(slots=True)
class HaConfig:
    # Off: a single broker, exactly as before ([ha] absent).
    enabled: bool = False
    role: Role = "master"
    # 0 for the master, 1.. for slaves (RocketMQ's brokerId); the group shares [broker] name.
    broker_id: int = 0
    # Master: where slaves connect for the CommitLog stream (RocketMQ's haListenPort, 10912).
    listen: str = "0.0.0.0:10912"
    # Slave: the master's replication address. Empty: try each of ``peers`` in turn.
    master: str = ""
    # The replication addresses of every member of the group (this one included).
    peers: list[str] = field(default_factory=list)
    # "async": a send is acknowledged after the master's own store (and its flush mode);
    # "sync": only once min_in_sync_replicas members (the master counts) hold it.
    mode: ReplicationMode = "async"
    min_in_sync_replicas: int = 1
    # A slave leaves the SyncStateSet when it has not caught up with the master for this long
    # (RocketMQ's haMaxTimeSlaveNotCatchup), and rejoins as soon as it has.
    max_lag_ms: int = 15_000
    # How long a SYNC send waits for its replicas before failing (RocketMQ's syncFlushTimeout).
    sync_timeout_ms: int = 5_000
    # The controller: etcd endpoints ("http://host:2379"). Set, the group elects its master
    # (role is then decided by election, and broker_id is this member's stable id, 1 and up);
    # empty, roles are fixed by ``role`` (docs/ha.md).
    etcd: list[str] = field(default_factory=list)
    # The member's etcd lease: a master whose lease expires is replaced (RocketMQ's
    # controller heartbeat timeout, 10 s there). A master that dies is replaced at once (its
    # keeper revokes the lease); a frozen one, a dead machine or a partition after about this
    # long. 8 s: at load 55 and more etcd answered keepalives in up to 3.7 s, past a 2 s TTL's
    # 1.5 s fence (decision 993).
    lease_ttl_ms: int = 8_000

    def __post_init__(self) -> None:
        if self.role not in ("master", "slave"):
            raise ValueError(f"[ha] role must be 'master' or 'slave', not {self.role!r}")
        if self.mode not in ("async", "sync"):
            raise ValueError(f"[ha] mode must be 'async' or 'sync', not {self.mode!r}")
        if self.min_in_sync_replicas < 1:
            raise ValueError("[ha] min_in_sync_replicas must be at least 1")
        if self.max_lag_ms <= 0 or self.sync_timeout_ms <= 0:
            raise ValueError("[ha] max_lag_ms and sync_timeout_ms must be positive")
        if self.lease_ttl_ms < 1000:
            raise ValueError("[ha] lease_ttl_ms must be at least 1000 (etcd leases are in seconds)")
        if not self.enabled:
            return
        parse_address(self.listen, "listen")
        for peer in self.peers:
            parse_address(peer, "peers")
        if self.etcd:
            if self.broker_id < 1:
                raise ValueError(
                    "[ha] with etcd, broker_id is the member's stable id and must be 1 or more "
                    "(the elected master is routed as broker id 0)"
                )
            return
        if (self.role == "master") != (self.broker_id == 0):
            raise ValueError(
                f"[ha] broker_id {self.broker_id} with role {self.role}: the master is 0, "
                "slaves are 1 and up"
            )
        if self.role == "slave":
            if self.master:
                parse_address(self.master, "master")
            elif not self.peers:
                raise ValueError("[ha] a slave needs master = 'host:port' or peers")
