"""Whether a tiered queue's local log and its archive agree on who holds which offsets
(decisions 720 and 750).

A standalone broker compares every tiered queue's local end with its archive's end before it
serves (``broker/server.py``): a queue that ends below its archive (a data directory restored
from an older copy, a power loss that cost archived records) continues at the archive's end,
so no append reuses an archived offset. That needs the queue's manifest, and a broker that
starts while the object store does not answer has none: it serves anyway (the hot path never
waits on the object store), and its appends may take offsets the archive already holds.

``Divergence`` keeps, durably in the data directory (``DATA_DIR/tier-divergence.json``):

- **pending** queues: tiered queues whose check could not run at start, with their local end
  at the first such start (the *base*). Until the check runs against a loaded manifest the
  queue is not uploaded (the offloader's claim runs the check first), nothing of it at or
  above the base is released, and no read at or above the base goes to the archive. A
  restart during the outage keeps the first base: the messages appended at the earlier start
  are as unchecked as the later ones.
- **conflicts**: a check that ran late and found the archive ending above the base. The
  offsets from the base to the archive's end were (or would be) given to messages this
  directory acknowledged while the archive holds older ones there. Those messages win their
  offsets: local release keeps every file from the base on, and reads at or above the base
  are never served from the archive (its objects there are kept, not deleted, and are the
  operator's to recover). The conflict is logged at ERROR at detection and at every start.
  A restart that finds nothing appended in the range yet (the queue still ends at the base)
  continues the queue at the archive's end instead, as decision 720 does, and the conflict
  is dropped: then no acknowledged message holds an archived offset.

Only for a standalone broker, and only for a prefix this data directory owns (decision 690).
"""

from __future__ import annotations

import json
import logging
import threading
from dataclasses import dataclass
from pathlib import Path

from tiered.cold.manifest import QueueManifest
from tiered.durable import settle_dir, write_file

log = logging.getLogger(__name__)

DIVERGENCE_FILE = "tier-divergence.json"

Key = tuple[str, int]


class DivergenceFileError(RuntimeError):
    """``tier-divergence.json`` cannot be read: the broker refuses to start rather than forget
    a queue whose messages must not be released or shadowed by its archive."""


@dataclass(frozen=True, slots=True)
class Conflict:
    base: int  # the queue's local end when it began to take offsets unchecked
    archive_end: int  # the archive's end when the check ran: it holds other messages below
    # Set once `tmq offload resolve` began (decision 800): the queue offset from which it
    # re-appends the local messages of [base, archive_end), recorded before the first copy.
    copies_from: int | None = None


class Divergence:
    def __init__(self, data_dir: Path) -> None:
        self.path = data_dir / DIVERGENCE_FILE
        self._lock = threading.Lock()
        self.pending: dict[Key, int] = {}
        self.conflicts: dict[Key, Conflict] = {}
        # Resolved conflicts whose queue floor (the archive's end) is not recorded in the store
        # yet (decision 800): applied before the broker serves, then forgotten.
        self.floors: dict[Key, int] = {}
        settle_dir(self.path.parent)  # what is read below is durable before it is acted on
        if self.path.exists():
            try:
                data = json.loads(self.path.read_bytes())
                self.pending = {(t, int(q)): int(b) for t, q, b in data["pending"]}
                self.conflicts = {
                    (row[0], int(row[1])): Conflict(
                        int(row[2]), int(row[3]), int(row[4]) if len(row) > 4 else None
                    )
                    for row in data["conflicts"]
                }
                self.floors = {(t, int(q)): int(f) for t, q, f in data.get("floors", [])}
            except (ValueError, KeyError, TypeError, IndexError) as e:
                raise DivergenceFileError(
                    f"{self.path} is unreadable ({e}): it names tiered queues whose local "
                    "messages must not be released or read from the archive. Restore it, or "
                    "remove it only once every queue it named has been checked by hand"
                ) from e

    def _save(
        self,
        pending: dict[Key, int],
        conflicts: dict[Key, Conflict],
        floors: dict[Key, int] | None = None,
    ) -> None:
        """Durably, then in memory: a crash never forgets a queue it named. One file, written
        whole (``write_file``: a temporary file, fsync, rename): every change is atomic."""
        floors = self.floors if floors is None else floors
        data: dict[str, list[list[object]]] = {
            "pending": sorted([t, q, b] for (t, q), b in pending.items()),
            "conflicts": sorted(_conflict_row(t, q, c) for (t, q), c in conflicts.items()),
        }
        if floors:  # absent otherwise: the file stays what decision 750's brokers read
            data["floors"] = sorted([t, q, f] for (t, q), f in floors.items())
        write_file(self.path, json.dumps(data).encode())
        self.pending, self.conflicts, self.floors = pending, conflicts, floors

    def begin_resolve(self, topic: str, queue_id: int, copies_from: int) -> Conflict:
        """Record, before the first copy is appended, where the copies of the queue's local
        messages in conflict begin (decision 800); a resolve begun already keeps its start,
        so a second run after a crash finds the copies the first one made."""
        key = (topic, queue_id)
        with self._lock:
            c = self.conflicts[key]
            if c.copies_from is not None:
                return c
            begun = Conflict(c.base, c.archive_end, copies_from)
            self._save(self.pending, {**self.conflicts, key: begun})
            return begun

    def commit_resolve(self, topic: str, queue_id: int) -> int:
        """The resolve's commit point, one atomic write: the conflict is gone and the queue's
        floor (the archive's end, returned) is to be raised, from now on or at the next start."""
        key = (topic, queue_id)
        with self._lock:
            c = self.conflicts[key]
            self._save(
                self.pending,
                {k: v for k, v in self.conflicts.items() if k != key},
                {**self.floors, key: c.archive_end},
            )
            return c.archive_end

    def floor_applied(self, topic: str, queue_id: int) -> None:
        """The store has recorded the floor of a resolved queue durably: forget it here."""
        key = (topic, queue_id)
        with self._lock:
            if key in self.floors:
                self._save(
                    self.pending,
                    self.conflicts,
                    {k: v for k, v in self.floors.items() if k != key},
                )

    def pend(self, ends: dict[Key, int]) -> None:
        """Record these queues (their local ends now) as unchecked, before the broker serves;
        a queue already pending keeps its first base, a queue in conflict stays one."""
        with self._lock:
            new = {
                k: e for k, e in ends.items() if k not in self.pending and k not in self.conflicts
            }
            if new:
                self._save({**self.pending, **new}, self.conflicts)

    def local_from(self, topic: str, queue_id: int) -> int | None:
        """The offset from which this queue's messages are local only (None: none are): its
        base while its check is pending or after it found a conflict. No release keeps fewer
        files and no read goes to the archive at or above it."""
        key = (topic, queue_id)
        c = self.conflicts.get(key)
        if c is not None:
            return c.base
        return self.pending.get(key)

    def state(self, topic: str, queue_id: int) -> tuple[int, Conflict | None] | None:
        """What operators are shown (decision 800): None for a queue that is neither pending
        nor in conflict, else its base and its conflict (None while only pending)."""
        key = (topic, queue_id)
        conflict = self.conflicts.get(key)
        if conflict is not None:
            return conflict.base, conflict
        base = self.pending.get(key)
        return None if base is None else (base, None)

    def report(self) -> None:
        """Log every standing conflict (once per start): loud until an operator resolves it."""
        for (topic, queue_id), c in sorted(self.conflicts.items()):
            log.error("%s", _conflict_text(topic, queue_id, c))
            if c.copies_from is not None:
                log.error(
                    "%s/%d: a `tmq offload resolve` began (its copies from offset %d) and did "
                    "not finish: the broker finishes it once its archive answers (decision 902)",
                    topic,
                    queue_id,
                    c.copies_from,
                )

    def check(
        self, topic: str, queue_id: int, manifest: QueueManifest, local_end: int
    ) -> Conflict | None:
        """Check a pending queue against its loaded manifest (nothing to do for any other):
        clear it when its archive ends at or below the base, else record the conflict, log it
        and return it. Call it under the queue's offload lock."""
        key = (topic, queue_id)
        with self._lock:
            base = self.pending.get(key)
            if base is None:
                return None
            pending = {k: v for k, v in self.pending.items() if k != key}
            if manifest.end_offset <= base:
                self._save(pending, self.conflicts)
                log.info(
                    "%s/%d: checked against its archive (ends at %d, the queue at %d): no "
                    "offset taken twice",
                    topic,
                    queue_id,
                    manifest.end_offset,
                    local_end,
                )
                return None
            conflict = Conflict(base, manifest.end_offset)
            self._save(pending, {**self.conflicts, key: conflict})
        log.error(
            "%s (%d message(s) appended there so far)",
            _conflict_text(topic, queue_id, conflict),
            max(0, min(local_end, conflict.archive_end) - conflict.base),
        )
        return conflict

    def resolved(self, topic: str, queue_id: int) -> None:
        """Forget the queue (pending or in conflict): the broker continued it above its
        archive before anything was appended at an archived offset."""
        key = (topic, queue_id)
        with self._lock:
            if key in self.pending or key in self.conflicts:
                self._save(
                    {k: v for k, v in self.pending.items() if k != key},
                    {k: v for k, v in self.conflicts.items() if k != key},
                )


def _conflict_row(topic: str, queue_id: int, c: Conflict) -> list[object]:
    row: list[object] = [topic, queue_id, c.base, c.archive_end]
    return row if c.copies_from is None else [*row, c.copies_from]


def _conflict_text(topic: str, queue_id: int, c: Conflict) -> str:
    return (
        f"{topic}/{queue_id}: DIVERGED from its archive: the broker started while the object "
        f"store did not answer, at local end {c.base}, and the archive ends at {c.archive_end}. "
        f"Offsets {c.base}..{c.archive_end - 1} belong to messages this data directory "
        "acknowledged; the archive holds other, older messages there (a data directory "
        "restored from an older copy, or records lost after they were archived). The local "
        "messages keep those offsets: their CommitLog files are kept and those offsets are "
        "never read from the archive. The archive's objects there are kept, and its older "
        "messages there are not readable by offset. `tmq offload resolve` ends it: see "
        "docs/operations.md"
    )
