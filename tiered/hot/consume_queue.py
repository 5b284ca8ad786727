"""ConsumeQueue: the per-(topic, queue) index from queue offset to CommitLog position.

An entry (``tiered/formats.py``: CommitLog offset 8, size 4, tag hash 8) lives at byte
``queue_offset * 20`` of the queue's stream.

Files live at ``consumequeue/{topic}/{queue_id}/{20-digit byte offset}``. The ConsumeQueue is
derived data: it can always be rebuilt from the CommitLog, and re-dispatching a record it already
holds is a no-op.
"""

from __future__ import annotations

import json
import logging
import os
import struct
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import numpy as np

from tiered.formats import CQ_DTYPE, CQ_ENTRY, CQ_ENTRY_SIZE, Entry
from tiered.hot.mapped_file import OFFSET_NAME_DIGITS, MappedFile, MappedFileQueue, all_zero
from tiered.hot.notes_file import NotesFile
from tiered.names import is_valid_name
from tiered.record import CorruptRecordError

log = logging.getLogger(__name__)


class UnreadableEntryError(Exception):
    """A ConsumeQueue entry between the queue's minimum and maximum could not be read."""

    def __init__(self, topic: str, queue_id: int, offset: int) -> None:
        super().__init__(f"{topic}/{queue_id}: queue offset {offset}")
        self.topic = topic
        self.queue_id = queue_id
        self.offset = offset


class DamagedEntryError(CorruptRecordError):
    """A ConsumeQueue entry between the queue's minimum and maximum is zero (or names no
    record, or another record): a torn write or bit rot. The next start rebuilds it from the
    CommitLog."""

    def __init__(self, topic: str, queue_id: int, offset: int, detail: str = "") -> None:
        super().__init__(
            f"ConsumeQueue {topic}/{queue_id}: the entry at queue offset {offset} is damaged"
            f"{detail}; restart the broker to rebuild it from the CommitLog"
        )
        self.topic = topic
        self.queue_id = queue_id
        self.offset = offset


class DamageNotes:
    """ConsumeQueue entries a read found naming the wrong record, kept in a file for the next
    start, which checks them and rebuilds the bad ones (decision 686): the start's own check
    looks only where entries are out of order, and an entry may name a record in order. The
    file's rules (durable, whole lines, never refusing a start) are ``NotesFile``'s."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._file = NotesFile(path, "damaged ConsumeQueue entry")

    def note(self, topic: str, queue_id: int, offset: int) -> None:
        # The read still fails, naming the entry; a note not written is tried by the next.
        self._file.add(json.dumps([topic, queue_id, offset]))

    def load(self) -> dict[tuple[str, int], list[int]]:
        """The noted entries by queue (lines that are not notes skipped, decision 1262)."""
        out: dict[tuple[str, int], list[int]] = {}
        for note in self._file.read(_parse_entry_note):
            topic, queue_id, offset = note
            out.setdefault((topic, queue_id), []).append(offset)
        return out

    def clear(self) -> None:
        self._file.clear()


def _parse_entry_note(line: str) -> tuple[str, int, int]:
    topic, queue_id, offset = json.loads(line)
    return str(topic), int(queue_id), int(offset)


class ConsumeQueue:
    def __init__(self, topic: str, queue_id: int, directory: Path, entries_per_file: int) -> None:
        self.topic = topic
        self.queue_id = queue_id
        self.files = MappedFileQueue(directory, entries_per_file * CQ_ENTRY_SIZE)
        self.min_offset = 0  # first queue offset held
        self.max_offset = 0  # next queue offset to be written
        self.max_physical_end = 0  # CommitLog end of the last entry (offset + size)
        self._tail: MappedFile | None = None
        # Why loading cut entries off this queue's end that the checkpoint may claim (a file of
        # the wrong size, torn entries, an empty last file): the store re-dispatches them from
        # the CommitLog (decision 685). None when nothing was cut.
        self.tail_cut: str | None = None

    # -- load and recover ----------------------------------------------------------------------

    def _repair_sizes(self) -> None:
        """Give every file of the wrong size (a file cut short or grown by damage, an operator,
        a copy that stopped) the configured size before mapping it, instead of refusing to
        start (decision 685). A shorter file loses its partial last entry and is padded with
        zeros: its missing entries read as holes, which the start rebuilds from the CommitLog
        (``holes``) or re-dispatches (a cut tail, ``tail_cut``). An all-zero last file is what
        a crash during a roll leaves; ``MappedFileQueue.load`` removes it."""
        directory = self.files.directory
        if not directory.exists():
            return
        size = self.files.file_size
        names = sorted(
            p.name
            for p in directory.iterdir()
            if len(p.name) == OFFSET_NAME_DIGITS and p.name.isdigit()
        )
        for i, name in enumerate(names):
            path = directory / name
            length = path.stat().st_size
            if length == size:
                continue
            if i == len(names) - 1 and all_zero(path):
                self.tail_cut = self.tail_cut or f"an empty last file {name} ({length} bytes)"
                continue
            keep = min(length, size) // CQ_ENTRY_SIZE * CQ_ENTRY_SIZE
            log.error(
                "ConsumeQueue %s-%d: %s has %d bytes, not %d; it keeps its first %d whole "
                "entries and the rest is rebuilt from the CommitLog",
                self.topic,
                self.queue_id,
                path,
                length,
                size,
                keep // CQ_ENTRY_SIZE,
            )
            fd = os.open(path, os.O_RDWR)
            try:
                os.ftruncate(fd, keep)
                os.ftruncate(fd, size)  # sparse zeros: holes
                os.fsync(fd)
            finally:
                os.close(fd)
            self.tail_cut = f"file {name} had {length} bytes, not {size}"

    def load_and_recover(self) -> None:
        """Map the files and find the valid entries: from the first non-empty entry of the first
        file, up to the first empty entry after it (a crash may leave a torn tail)."""
        self._repair_sizes()
        self.files.load()
        files = self.files.files
        sizes_of: dict[int, np.ndarray] = {}  # a one-file queue reads its sizes once
        while files:
            last = files[-1]
            valid = sizes_of.setdefault(last.from_offset, _sizes(last)) > 0
            if not valid.any():  # an empty last file: a roll that a crash cut short
                self.tail_cut = self.tail_cut or f"an empty last file {last.path.name}"
                if len(files) == 1:
                    self.files.destroy()
                else:
                    self._drop_files_from(last.from_offset)
                files = self.files.files
                continue
            # First and last valid entry, and the first hole between them, without index arrays.
            first = int(valid.argmax()) if len(files) == 1 else 0
            last_valid = len(valid) - 1 - int(valid[::-1].argmax())
            between = valid[first : last_valid + 1]
            hole = int(between.argmin())
            if between[hole]:
                count = last_valid + 1
            else:
                count = first + hole
                self.tail_cut = self.tail_cut or "torn entries"
                log.warning(
                    "ConsumeQueue %s-%d: torn entries after offset %d are dropped",
                    self.topic,
                    self.queue_id,
                    (last.from_offset // CQ_ENTRY_SIZE) + count,
                )
            self._drop_files_from(last.from_offset + count * CQ_ENTRY_SIZE)
            break
        files = self.files.files
        if not files:
            return
        head = files[0]
        first_valid = sizes_of.get(head.from_offset)
        first_valid = (first_valid if first_valid is not None else _sizes(head)) > 0
        first_index = int(first_valid.argmax()) if first_valid.any() else 0
        self.min_offset = head.from_offset // CQ_ENTRY_SIZE + first_index
        self.max_offset = files[-1].end_offset // CQ_ENTRY_SIZE
        last_entry = self.get_entry(self.max_offset - 1)
        if last_entry is not None:
            self.max_physical_end = last_entry[0] + last_entry[1]
        self._tail = files[-1]

    # -- write ---------------------------------------------------------------------------------

    def put(self, queue_offset: int, commitlog_offset: int, size: int, tag_hash: int) -> bool:
        """Store the entry for ``queue_offset``; False when it is already here (re-dispatch)."""
        return self.put_block(
            queue_offset, CQ_ENTRY.pack(commitlog_offset, size, tag_hash), commitlog_offset + size
        )

    def put_block(self, queue_offset: int, entries: bytes | memoryview, physical_end: int) -> bool:
        """Store consecutive entries from ``queue_offset``, skipping any already here (a
        re-dispatch); False when all of them were."""
        count = len(entries) // CQ_ENTRY_SIZE
        if queue_offset + count <= self.max_offset:
            return False
        if queue_offset < self.max_offset:
            skip = self.max_offset - queue_offset
            entries = entries[skip * CQ_ENTRY_SIZE :]
            queue_offset += skip
            count -= skip
        empty = self.max_offset == self.min_offset
        if queue_offset > self.max_offset and not empty:
            log.error(
                "ConsumeQueue %s-%d: expected queue offset %d but got %d; the gap is unreadable",
                self.topic,
                self.queue_id,
                self.max_offset,
                queue_offset,
            )
        pos = queue_offset * CQ_ENTRY_SIZE
        view = memoryview(entries)
        while view:
            f = self._tail
            if f is None or not f.from_offset <= pos < f.tail_offset:
                f = self.files.find_file(pos)
                if f is None:
                    f = self.files.create_file(pos - pos % self.files.file_size)
                self._tail = f
            rel = pos - f.from_offset
            take = min(len(view), f.size - rel)
            f.write_at(rel, view[:take])
            f.wrote = rel + take
            view = view[take:]
            pos += take
        if empty:
            self.min_offset = queue_offset
        self.max_offset = queue_offset + count
        self.max_physical_end = physical_end
        return True

    def fill(
        self,
        queue_offset: int,
        commitlog_offset: int,
        size: int,
        tag_hash: int,
        commitlog_end: int | None = None,
        *,
        overwrite: bool = False,
    ) -> bool:
        """Write the entry of ``queue_offset``, a hole below ``max_offset`` (``holes``, or an
        empty slot before ``min_offset`` in the first file: ``leading_slots``), in place; False
        when that slot is not a hole. ``overwrite``: the caller has found the entry there
        wrong (``holes`` with ``verify``), whatever it holds. Only while the dispatcher is not
        running."""
        pos = queue_offset * CQ_ENTRY_SIZE
        f = self.files.find_file(pos)
        if f is None or not queue_offset < self.max_offset:
            return False
        rel = pos - f.from_offset
        held_at, held_size, _ = CQ_ENTRY.unpack(f.read(rel, CQ_ENTRY_SIZE))
        if (
            not overwrite
            and held_size > 0
            and (commitlog_end is None or in_commitlog(held_at, held_size, commitlog_end))
        ):
            return False
        f.write_at(rel, CQ_ENTRY.pack(commitlog_offset, size, tag_hash))
        f.flushed = 0  # the next flush fsyncs the file again
        self.min_offset = min(self.min_offset, queue_offset)
        return True

    def leading_slots(self) -> tuple[int, int, int] | None:
        """``(first_slot, min_offset, commitlog_offset)``: the empty slots of the first file
        before the queue's first entry, which sits at ``commitlog_offset``; None when there are
        none. A queue that started at a later offset (rebuilt from a CommitLog whose front was
        released, a replica that joined late) has them; so has one whose first entries were
        zeroed (a torn write, bit rot), whose records then precede ``commitlog_offset``."""
        if not self.files.files or self.min_offset >= self.max_offset:
            return None
        head = self.files.files[0]
        first_slot = head.from_offset // CQ_ENTRY_SIZE
        entry = self.get_entry(self.min_offset)
        if not first_slot < self.min_offset < first_slot + head.size // CQ_ENTRY_SIZE:
            return None  # no slot before the first entry, or entries released before it
        before = CQ_ENTRY.unpack(
            head.read((self.min_offset - 1 - first_slot) * CQ_ENTRY_SIZE, CQ_ENTRY_SIZE)
        )
        if entry is None or before[1] > 0:
            return None
        return first_slot, self.min_offset, entry[0]

    def holes(
        self,
        commitlog_end: int | None = None,
        verify: Callable[[int, int, int], bool] | None = None,
        suspects: Iterable[int] = (),
    ) -> list[tuple[int, int]]:
        """``[first, end)`` runs of entries in ``[min_offset, max_offset)`` whose size is zero:
        entries a torn write or bit rot zeroed, between entries that survived. With
        ``commitlog_end``, also entries that point outside the CommitLog ``[0, commitlog_end)``
        (bytes overwritten with garbage, decision 663). A file at a time with numpy, reading
        only what the extent map says may hold data.

        With ``verify(queue offset, CommitLog offset, size)`` (whether that record is this
        queue's record at that offset), also entries that point inside the CommitLog at
        something else (decision 686): records are in CommitLog order within a queue, so an
        entry is checked only where it is out of order with its neighbours (one numpy
        comparison per file), or where it is among ``suspects`` (entries a read found
        wrong)."""
        runs: list[tuple[int, int]] = []
        checked: dict[int, bool] = {}
        wanted = sorted(set(suspects))
        # The last good entries before a file (queue offset, CommitLog offset, size): a run of
        # garbage across a file end shows only against the next file's entries.
        context = (np.empty(0, np.int64), np.empty(0, np.int64), np.empty(0, np.int64))

        def good(qoff: int, at: int, size: int) -> bool:
            assert verify is not None
            ok = checked.get(qoff)
            if ok is None:
                ok = checked[qoff] = verify(qoff, at, size)
            return ok

        for f in self.files.files:
            base = f.from_offset // CQ_ENTRY_SIZE
            lo, hi = (
                max(self.min_offset, base),
                min(self.max_offset, base + f.size // CQ_ENTRY_SIZE),
            )
            if lo >= hi:
                continue
            at, sizes = _fields(f)
            at, sizes = at[lo - base : hi - base], sizes[lo - base : hi - base]
            empty = sizes <= 0
            if commitlog_end is not None:
                empty |= (at < 0) | (at > commitlog_end - sizes)
            if verify is not None:
                for q in wanted:
                    i = q - lo
                    if 0 <= i < len(at) and not empty[i] and not good(q, int(at[i]), int(sizes[i])):
                        empty[i] = True
                n = len(context[0])
                qoffs = np.concatenate((context[0], np.arange(lo, hi, dtype=np.int64)))
                all_at = np.concatenate((context[1], at))
                all_sizes = np.concatenate((context[2], sizes))
                bad = np.concatenate((np.zeros(n, bool), empty))
                _check_order(qoffs, all_at, all_sizes, bad, good)
                runs += [(q, q + 1) for q in qoffs[:n][bad[:n]].tolist()]
                empty = bad[n:]
                keep = np.flatnonzero(~bad)[-_ORDER_CONTEXT:]
                context = (qoffs[keep], all_at[keep], all_sizes[keep])
            if not empty.any():
                continue
            edges = np.flatnonzero(np.diff(np.concatenate(([0], empty.view(np.int8), [0]))))
            runs += zip((lo + edges[0::2]).tolist(), (lo + edges[1::2]).tolist(), strict=True)
        if verify is not None:
            runs += self._around(runs, good)
        out: list[tuple[int, int]] = []
        for a, b in sorted(runs):
            if out and out[-1][1] >= a:  # a run across a file boundary
                out[-1] = (out[-1][0], max(out[-1][1], b))
            else:
                out.append((a, b))
        return out

    def _around(
        self, runs: list[tuple[int, int]], good: Callable[[int, int, int], bool]
    ) -> list[tuple[int, int]]:
        """Damage comes in runs of bytes: the entries on both sides of each damaged run are
        checked one by one until ``_AROUND`` in a row are good, which finds garbage that
        happens to name a record in order (another queue's, between this one's)."""
        found: list[tuple[int, int]] = []
        for a, b in runs:
            for start, step in ((a - 1, -1), (b, 1)):
                q, fine = start, 0
                while fine < _AROUND and self.min_offset <= q < self.max_offset:
                    entry = self.get_entry(q)
                    if entry is None or good(q, entry[0], entry[1]):
                        fine += 1
                    else:
                        found.append((q, q + 1))
                        fine = 0
                    q += step
        return found

    def flush(self) -> None:
        self.files.flush()

    # -- read ----------------------------------------------------------------------------------

    def get_entry(self, queue_offset: int) -> Entry | None:
        if not self.min_offset <= queue_offset < self.max_offset:
            return None
        pos = queue_offset * CQ_ENTRY_SIZE
        f = self.files.find_file(pos)
        if f is None:
            return None
        try:
            entry: Entry = CQ_ENTRY.unpack(f.read(pos - f.from_offset, CQ_ENTRY_SIZE))
        except (ValueError, struct.error):  # unmapped by cleanup meanwhile
            return None
        return entry

    def _runs(self, start: int, end: int) -> Iterator[tuple[int, bytes]]:
        """(first queue offset, raw entries) per file for the entries in [start, end) still
        held here; stops early where a file was unmapped by cleanup meanwhile."""
        offset = max(start, self.min_offset)
        end = min(self.max_offset, end)
        while offset < end:
            pos = offset * CQ_ENTRY_SIZE
            f = self.files.find_file(pos)
            if f is None:
                return
            rel = pos - f.from_offset
            n = min(end - offset, (f.size - rel) // CQ_ENTRY_SIZE)
            try:
                raw = f.read(rel, n * CQ_ENTRY_SIZE)
            except ValueError:
                return
            yield offset, raw
            offset += n

    def iter_entries(self, queue_offset: int, max_count: int) -> Iterator[tuple[int, Entry]]:
        """(queue offset, entry) for up to ``max_count`` entries from ``queue_offset``."""
        start = max(queue_offset, self.min_offset)
        for offset, raw in self._runs(start, start + max_count):
            # A bare counter, not enumerate(): this loop is the read path's inner loop.
            for entry in CQ_ENTRY.iter_unpack(raw):
                yield offset, entry
                offset += 1

    def entry_table(self, start: int, max_count: int) -> np.ndarray:
        """Entries of ``[start, start + max_count)`` as one ``CQ_DTYPE`` array, contiguous from
        ``start`` (empty when ``start`` is not held; shorter where the held entries end)."""
        if start < self.min_offset:
            return np.empty(0, CQ_DTYPE)
        parts: list[bytes] = []
        expected = start
        for first, raw in self._runs(start, start + max_count):
            if first != expected:
                break
            parts.append(raw)
            expected += len(raw) // CQ_ENTRY_SIZE
        # Joined as bytes: np.concatenate would turn the big-endian fields native.
        return np.frombuffer(b"".join(parts), dtype=CQ_DTYPE)

    def bytes_between(self, start: int, end: int) -> int:
        """Total record size of the entries in [start, end) still held here (metrics: upload
        lag and hot bytes). Sums the size column a file at a time with numpy, so a million
        entries cost milliseconds, not a Python loop."""
        return sum(
            int(np.frombuffer(raw, dtype=CQ_DTYPE)["size"].sum(dtype=np.int64))
            for _, raw in self._runs(start, end)
        )

    # -- truncate and clean --------------------------------------------------------------------

    def bisect(self, below: Callable[[int, Entry | None], bool]) -> int:
        """The first offset in ``[min_offset, max_offset)`` whose entry is not ``below`` the
        boundary (``max_offset`` if every one is); ``below`` gets the offset and its entry (None
        if unreadable). It must hold for a prefix of the queue and not after it: entries are in
        CommitLog (and so store-time) order within a queue."""
        lo, hi = self.min_offset, self.max_offset
        while lo < hi:
            mid = (lo + hi) // 2
            if below(mid, self.get_entry(mid)):
                lo = mid + 1
            else:
                hi = mid
        return lo

    def first_offset_at_or_after(self, commitlog_offset: int, *, strict: bool = False) -> int:
        """The first queue offset whose record starts at or after ``commitlog_offset``. An entry
        that cannot be read counts as past it, or with ``strict`` raises
        ``UnreadableEntryError`` rather than guess (release must fail closed)."""

        def below(offset: int, entry: Entry | None) -> bool:
            if entry is None:
                if strict:
                    raise UnreadableEntryError(self.topic, self.queue_id, offset)
                return False
            return entry[0] < commitlog_offset

        return self.bisect(below)

    def truncate_from_physical(self, commitlog_end: int) -> int:
        """Drop entries that point at or past ``commitlog_end`` (a CommitLog cut after a crash).

        Entries are in CommitLog order within a queue, so the cut point is found by binary search.
        Returns how many entries were dropped.
        """
        if self.max_physical_end <= commitlog_end:
            return 0
        lo = self.bisect(lambda _, e: e is not None and e[0] + e[1] <= commitlog_end)
        dropped = self.max_offset - lo
        self._drop_files_from(lo * CQ_ENTRY_SIZE)
        self._tail = self.files.last_file()
        self.max_offset = lo
        if lo <= self.min_offset:
            self.min_offset = self.max_offset = lo
            self.max_physical_end = 0
        else:
            last = self.get_entry(lo - 1)
            self.max_physical_end = last[0] + last[1] if last else 0
        return dropped

    def mark_unflushed_from(self, commitlog_offset: int | None) -> None:
        """Count every file holding an entry for a record at or past ``commitlog_offset`` (None:
        every file) as unflushed, so the next flush fsyncs it. Loading takes a file's entries
        as flushed, but after ``kill -9`` the entries written since the last flush are in the
        page cache only, and a checkpoint saved once they are re-dispatched claims them."""
        first = (
            self.min_offset
            if commitlog_offset is None
            else self.first_offset_at_or_after(commitlog_offset)
        )
        if first < self.max_offset:
            for f in self.files.iter_from(first * CQ_ENTRY_SIZE):
                f.flushed = 0

    def _drop_files_from(self, pos: int) -> None:
        for f in self.files.truncate_dirty(pos):
            f.path.unlink(missing_ok=True)

    def correct_min_offset(self, commitlog_min: int) -> None:
        """Advance ``min_offset`` past entries whose records were deleted from the CommitLog, and
        delete ConsumeQueue files that hold nothing else."""
        lo = self.first_offset_at_or_after(commitlog_min)
        self.min_offset = lo
        whole_files = sum(1 for f in self.files.files if f.tail_offset <= lo * CQ_ENTRY_SIZE)
        self.files.delete_first_files(whole_files)

    def destroy(self) -> None:
        self.files.destroy()
        self._tail = None


def in_commitlog(commitlog_offset: int, size: int, commitlog_end: int) -> bool:
    """Whether an entry's record lies inside CommitLog ``[0, commitlog_end)``."""
    return size > 0 and 0 <= commitlog_offset <= commitlog_end - size


_ORDER_CONTEXT = 1024  # good entries of the previous file that a file's order check sees
_AROUND = 16  # good entries in a row that end the check around a damaged run


def _check_order(
    qoffs: np.ndarray,
    at: np.ndarray,
    sizes: np.ndarray,
    bad: np.ndarray,
    good: Callable[[int, int, int], bool],
) -> None:
    """Mark in ``bad`` the entries (queue offsets ``qoffs``, ascending) that are out of
    CommitLog order with their neighbours and fail ``good``: a record must start at or after
    the previous one's end. Only the two entries at each disorder are checked, again after
    dropping the bad ones, until none is left; genuine entries out of order (which the order
    cannot place) are left to the read check."""
    if not bad.any() and not (at[1:] < at[:-1] + sizes[:-1]).any():
        return  # the usual case: no gathers
    idx = np.flatnonzero(~bad)
    while len(idx) > 1:
        starts = at[idx]
        disorder = (np.flatnonzero(starts[1:] < (starts + sizes[idx])[:-1]) + 1).tolist()
        if not disorder:
            return
        drop = np.zeros(len(idx), bool)
        for k in disorder:
            for j in (int(idx[k - 1]), int(idx[k])):
                if not good(int(qoffs[j]), int(at[j]), int(sizes[j])):
                    drop[np.searchsorted(idx, j)] = True
        if not drop.any():
            return  # genuine entries out of order: nothing here can say which is wrong
        bad[idx[drop]] = True
        idx = idx[~drop]


def _columns(f: MappedFile, *names: str) -> list[np.ndarray]:
    """The named int64 fields of every entry slot in ``f``, as copies (so the mapping can be
    closed), zero where nothing was read.

    Read in place from the mapping, and only where the extent map says data may be: a file is
    preallocated, and recovery would otherwise fault in every never-written page of it."""
    count = f.size // CQ_ENTRY_SIZE
    columns = [np.zeros(count, np.int64) for _ in names]
    view = np.frombuffer(f.mm, dtype=CQ_DTYPE, count=count)
    try:
        for start, end in f.data_regions(0):
            lo, hi = start // CQ_ENTRY_SIZE, min(count, -(-end // CQ_ENTRY_SIZE))
            for column, name in zip(columns, names, strict=True):
                column[lo:hi] = view[name][lo:hi]
    finally:
        del view  # release the mapping's buffer at once
    return columns


def _fields(f: MappedFile) -> tuple[np.ndarray, np.ndarray]:
    """``_sizes`` with the CommitLog offsets beside them (zero where ``_sizes`` reads none)."""
    offsets, sizes = _columns(f, "offset", "size")
    return offsets, sizes


def _sizes(f: MappedFile) -> np.ndarray:
    """The size field of every entry slot in ``f`` (``_columns``)."""
    return _columns(f, "size")[0]


class ConsumeQueueTable:
    """Every ConsumeQueue of the store by (topic, queue id), created on first dispatch
    (RocketMQ's ``consumeQueueTable``)."""

    def __init__(self, root: Path, entries_per_file: int) -> None:
        self.root = root
        self.entries_per_file = entries_per_file
        self.queues: dict[tuple[str, int], ConsumeQueue] = {}
        # Queues whose loading cut entries off their end (``ConsumeQueue.tail_cut``), kept even
        # when nothing of them is left: the store re-dispatches what was cut.
        self.cut_tails: list[ConsumeQueue] = []

    def load_and_recover(self) -> None:
        if not self.root.exists():
            return
        for topic_dir in sorted(self.root.iterdir()):
            if not is_valid_name(topic_dir.name):
                log.warning("ignoring %s: not a topic directory", topic_dir)
                continue
            for queue_dir in sorted(topic_dir.iterdir()):
                if not queue_dir.name.isdigit():
                    log.warning("ignoring %s: not a queue directory", queue_dir)
                    continue
                cq = self._new(topic_dir.name, int(queue_dir.name))
                cq.load_and_recover()
                if cq.max_offset > cq.min_offset or cq.files.files:
                    self.queues[(cq.topic, cq.queue_id)] = cq
                if cq.tail_cut is not None:
                    self.cut_tails.append(cq)

    def _new(self, topic: str, queue_id: int) -> ConsumeQueue:
        if not is_valid_name(topic) or queue_id < 0:
            raise ValueError(f"not a valid topic/queue: {topic!r}/{queue_id}")
        return ConsumeQueue(
            topic, queue_id, self.root / topic / str(queue_id), self.entries_per_file
        )

    def get(self, topic: str, queue_id: int) -> ConsumeQueue | None:
        return self.queues.get((topic, queue_id))

    def get_or_create(self, topic: str, queue_id: int) -> ConsumeQueue:
        cq = self.queues.get((topic, queue_id))
        if cq is None:
            cq = self._new(topic, queue_id)
            self.queues[(topic, queue_id)] = cq
        return cq

    @property
    def max_physical_end(self) -> int:
        return max((cq.max_physical_end for cq in self.queues.values()), default=0)

    def flush(self) -> None:
        for cq in list(self.queues.values()):
            cq.flush()

    def mark_unflushed_from(self, commitlog_offset: int | None) -> None:
        for cq in list(self.queues.values()):
            cq.mark_unflushed_from(commitlog_offset)

    def truncate_from_physical(self, commitlog_end: int) -> int:
        return sum(cq.truncate_from_physical(commitlog_end) for cq in list(self.queues.values()))

    def correct_min_offsets(self, commitlog_min: int) -> None:
        for cq in list(self.queues.values()):
            cq.correct_min_offset(commitlog_min)

    def destroy(self) -> None:
        for cq in self.queues.values():
            cq.destroy()
        self.queues.clear()

    def close(self) -> None:
        for cq in self.queues.values():
            cq.files.close()
