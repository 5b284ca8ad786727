"""What the send path asks of replication, and why a replica group refuses to acknowledge a
send."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol


class SendGate(Protocol):
    """Replication as SendMessage sees it (``ReplicationMaster`` or ``ReplicationSlave``)."""

    def check_writable(self) -> None:
        """Before storing: raise ``ReplicationError`` when this broker must not take sends."""

    def wait_replicated(self, end_offset: int) -> None:
        """After storing: return once the send may be acknowledged; raise otherwise."""


class ReplicationError(RuntimeError):
    """A send this replica group cannot acknowledge."""


class NotEnoughReplicasError(ReplicationError):
    """SYNC mode with fewer than min_in_sync_replicas in the SyncStateSet: refused before the
    message is stored (RocketMQ's IN_SYNC_REPLICAS_NOT_ENOUGH)."""


class ReplicationTimeoutError(ReplicationError):
    """SYNC mode: stored on the master, but not on enough replicas in time (RocketMQ's
    FLUSH_SLAVE_TIMEOUT). The producer was not told it is safe; a retry may duplicate it."""


class NotMasterError(ReplicationError):
    """This broker is a slave: it takes no sends."""


class ReplicatedMetadata(Protocol):
    """Topics, groups and consumer offsets as replication moves them (``BrokerMetadata``)."""

    def snapshot(self) -> dict[str, Any]: ...

    def replace(self, snapshot: dict[str, Any]) -> None: ...

    def add_change_listener(self, listener: Callable[[], None]) -> None:
        """``listener`` is called after every change of what ``snapshot`` returns."""

    def remove_change_listener(self, listener: Callable[[], None]) -> None: ...


@dataclass(slots=True, frozen=True)
class ReplicaLag:
    """One slave as its master sees it."""

    broker_id: int
    address: str
    connected: bool
    acked_offset: int
    lag_bytes: int


@dataclass(slots=True, frozen=True)
class ReplicationStatus:
    """A replica group member's view, for metrics and operators."""

    role: str  # "master" or "slave"
    broker_id: int
    epoch: int
    mode: str
    max_offset: int  # this node's CommitLog end
    confirmed_offset: int  # SYNC: what the group acknowledged, as far as this node knows
    sync_state_set: list[int]  # the master's view; a slave reports []
    slaves: list[ReplicaLag]  # the master's view; a slave reports []
    master: str | None = None  # a slave: the master it follows
    connected: bool = True  # a slave: whether it is following one now
    lag_bytes: int = 0  # a slave: how far behind the master's last reported end
    last_error: str | None = None
    # With a controller ([ha] etcd): this node fenced itself, and its election counters.
    fenced: bool = False
    elections_won: int = 0
    fencings: int = 0
    role_changes: int = 0
    # Lease keepers restarted because they were alive but not renewing (decision 992).
    keeper_restarts: int = 0


class FencedError(NotMasterError):
    """A master of a higher epoch took this broker's tier prefix over: this broker was deposed
    and takes no sends (they would be acknowledged by a node no longer in the group)."""


class FencedGate:
    """``SendGate`` of a broker with a cold tier: refuses every send once the offloader was
    fenced (``offload/offloader.py``), and otherwise asks replication (if any)."""

    def __init__(self, inner: SendGate | None, fenced: Callable[[], str | None]) -> None:
        self.inner = inner
        # The fence's one-line reason, or None while not fenced.
        self.fenced = fenced

    def check_writable(self) -> None:
        reason = self.fenced()
        if reason is not None:
            raise FencedError(reason)
        if self.inner is not None:
            self.inner.check_writable()

    def wait_replicated(self, end_offset: int) -> None:
        if self.inner is not None:
            self.inner.wait_replicated(end_offset)
