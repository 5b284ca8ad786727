"""The epoch file: which master term wrote which part of the CommitLog (RocketMQ 5's
``EpochFileCheckpoint``).

Every time a broker becomes master it starts a new *epoch*, and records ``(epoch, start offset)``:
the physical offset of the first byte it appends in that term. A slave records the same entries
as it receives the master's bytes. Two replicas that hold the same entry for an epoch hold the
same bytes from its start up to the smaller of their two ends, so comparing the files tells a
returning node how much of its CommitLog it shares with the master (``consistent_point``), and
what it must cut: the tail it wrote alone, in a term the group has since moved past.

File format (``{data_dir}/ha/epochs``): one line per entry, ``"{epoch} {start_offset}\\n"``, in
increasing order of both. It is rewritten whole (temporary file, fsync, rename), so a crash leaves
the old or the new list, never a mix. Epoch 0 names history written before replication was on
(a standalone data dir turned into a master).

A second file, ``{data_dir}/ha/confirmed``, holds the highest physical offset this node knows
the replica group acknowledged under SYNC replication. Truncation never goes below it: that would
drop a message a producer was told is safe (``TruncationRefusedError``).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path

from tiered.durable import make_dirs, settle_dir, write_file


class TruncationRefusedError(RuntimeError):
    """Cutting the CommitLog where replication asks would drop acknowledged (SYNC) messages."""


@dataclass(slots=True, frozen=True)
class EpochEntry:
    epoch: int
    start_offset: int


class EpochFile:
    """The epoch entries of one data dir, and its SYNC-confirmed offset. Thread-safe; every
    change is durable when the call returns."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.path = directory / "epochs"
        self.confirmed_path = directory / "confirmed"
        self._lock = threading.Lock()
        # Serialises writes of the confirmed file; apart from ``_lock``, so that the two fsyncs
        # of a write never hold up ``epoch_at`` (every replicated frame asks it).
        self._confirmed_lock = threading.Lock()
        self._entries: list[EpochEntry] = []
        self._confirmed = 0

    def load(self) -> None:
        make_dirs(self.directory)
        settle_dir(self.directory)  # what is read below is durable before it is acted on
        entries: list[EpochEntry] = []
        if self.path.exists():
            for n, line in enumerate(self.path.read_text().splitlines(), 1):
                if not line.strip():
                    continue
                try:
                    epoch, start = (int(x) for x in line.split())
                except ValueError:
                    raise ValueError(
                        f"{self.path}:{n}: not 'epoch start_offset': {line!r}"
                    ) from None
                if entries and (epoch <= entries[-1].epoch or start < entries[-1].start_offset):
                    raise ValueError(f"{self.path}:{n}: entries out of order")
                entries.append(EpochEntry(epoch, start))
        self._entries = entries
        if self.confirmed_path.exists():
            self._confirmed = int(self.confirmed_path.read_text().strip() or 0)

    @property
    def entries(self) -> list[EpochEntry]:
        with self._lock:
            return list(self._entries)

    @property
    def last_epoch(self) -> int:
        with self._lock:
            return self._entries[-1].epoch if self._entries else -1

    @property
    def confirmed_offset(self) -> int:
        return self._confirmed

    def _save(self) -> None:
        lines = "".join(f"{e.epoch} {e.start_offset}\n" for e in self._entries)
        write_file(self.path, lines.encode())

    def append(self, epoch: int, start_offset: int) -> None:
        """Record that ``epoch`` starts at ``start_offset``. Epochs only grow."""
        with self._lock:
            if self._entries:
                last = self._entries[-1]
                if epoch <= last.epoch or start_offset < last.start_offset:
                    raise ValueError(
                        f"epoch ({epoch}, {start_offset}) does not follow "
                        f"({last.epoch}, {last.start_offset})"
                    )
            self._entries.append(EpochEntry(epoch, start_offset))
            self._save()

    def epoch_at(self, offset: int) -> tuple[int, int | None]:
        """The epoch that wrote ``offset``, and where the next epoch starts (None: it is the
        last). Offsets below the first entry belong to epoch 0's history."""
        with self._lock:
            entries = self._entries
            for i in range(len(entries) - 1, -1, -1):
                if entries[i].start_offset <= offset:
                    # Empty epochs (same start) resolve to the last of them.
                    nxt = next(
                        (e.start_offset for e in entries[i + 1 :] if e.start_offset > offset),
                        None,
                    )
                    return entries[i].epoch, nxt
            return 0, entries[0].start_offset if entries else None

    def truncate_from(self, offset: int) -> None:
        """Forget epochs that start at or after ``offset`` (their bytes are being cut)."""
        with self._lock:
            kept = [e for e in self._entries if e.start_offset < offset]
            if len(kept) != len(self._entries):
                self._entries = kept
                self._save()

    def set_confirmed(self, offset: int) -> None:
        """Record that the group acknowledged everything below ``offset`` (only grows)."""
        with self._confirmed_lock:
            if offset <= self._confirmed:
                return
            self._confirmed = offset
            write_file(self.confirmed_path, f"{offset}\n".encode())


def consistent_point(
    mine: list[EpochEntry], my_max: int, theirs: list[EpochEntry], their_max: int
) -> int | None:
    """The physical offset up to which two replicas hold the same bytes, or None when they
    share no epoch (RocketMQ's ``findLastConsistentPoint``).

    The newest epoch both record with the same start offset wins; within it, the two hold the
    same bytes up to the smaller of their ends (the next epoch's start, or the log's end).
    """

    def ends(entries: list[EpochEntry], end: int) -> dict[int, tuple[int, int]]:
        out = {}
        for i, e in enumerate(entries):
            stop = entries[i + 1].start_offset if i + 1 < len(entries) else end
            out[e.epoch] = (e.start_offset, stop)
        return out

    their_ranges = ends(theirs, their_max)
    for epoch, (start, my_end) in sorted(ends(mine, my_max).items(), reverse=True):
        other = their_ranges.get(epoch)
        if other is not None and other[0] == start:
            return min(my_end, other[1])
    return None
