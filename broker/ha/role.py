"""This broker's role in its replica group, and its epoch: the one place every other part asks.

The offloader (only the current master uploads, retains and releases, and stamps its manifest
commits with the epoch), the send path, health and registration all read ``RoleState``; only
the replication roles and the controller change it. A single broker (``[ha]`` off) is a master
of epoch 0 for ever.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

RoleName = Literal["master", "slave"]


@dataclass(slots=True, frozen=True)
class RoleSnapshot:
    role: RoleName
    # The master term this broker serves in (a slave: its master's, as far as it knows).
    epoch: int
    # A master that can no longer prove it leads (its controller lease expired, or a newer epoch
    # exists): it takes no sends, uploads nothing, and reports NOT_SERVING until it is a slave.
    fenced: bool = False

    @property
    def is_writable_master(self) -> bool:
        return self.role == "master" and not self.fenced


class RoleState:
    """Thread-safe; listeners are called (outside the lock) after every change."""

    def __init__(self, role: RoleName = "master", epoch: int = 0) -> None:
        self._lock = threading.Lock()
        self._snapshot = RoleSnapshot(role, epoch)
        self._listeners: list[Callable[[RoleSnapshot], None]] = []

    def get(self) -> RoleSnapshot:
        with self._lock:
            return self._snapshot

    @property
    def role(self) -> RoleName:
        return self.get().role

    @property
    def epoch(self) -> int:
        return self.get().epoch

    @property
    def fenced(self) -> bool:
        return self.get().fenced

    def is_master(self) -> bool:
        """True only for a master that may write (not fenced)."""
        return self.get().is_writable_master

    def set(self, role: RoleName, epoch: int, *, fenced: bool = False) -> None:
        with self._lock:
            new = RoleSnapshot(role, epoch, fenced)
            if new == self._snapshot:
                return
            self._snapshot = new
            listeners = list(self._listeners)
        for listener in listeners:
            listener(new)

    def fence(self) -> None:
        """Stop acting as master (keep the epoch: the node does not know the new one yet)."""
        current = self.get()
        self.set(current.role, current.epoch, fenced=True)

    def add_listener(self, listener: Callable[[RoleSnapshot], None]) -> None:
        with self._lock:
            self._listeners.append(listener)
