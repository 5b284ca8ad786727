"""IndexFile: a hash index from message key (and unique id) to CommitLog offset, by time.

Layout (big-endian), as RocketMQ's ``IndexFile``:

========================== ============================================================
 bytes                      content
========================== ============================================================
 40                         header: begin timestamp (8), end timestamp (8), begin physical
                            offset (8), end physical offset (8), used slots (4), next
                            entry number (4)
 4 x slots                  slot ``h % slots``: number of the newest entry with that hash
 20 x entries               entry: key hash (4), physical offset (8), seconds since the
                            begin timestamp (4), number of the previous entry in the slot
========================== ============================================================

Entry numbers start at 1; 0 means "none". The header's physical range is the span of the
CommitLog this file has seen, keys or not: ``[begin, end)``. Files cover consecutive ranges, so a
missing file shows as a gap and is rebuilt from the CommitLog.

An entry is a hint. Every query result is checked against the record it points to (its key and
time), so a stale or torn entry after a crash can cost a lookup, never a wrong answer.
"""

from __future__ import annotations

import logging
import mmap
import os
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tiered.durable import fsync_dir, make_dirs
from tiered.formats import key_hash
from tiered.hot.mapped_file import close_all
from tiered.hot.notes_file import NotesFile
from tiered.record import INDEX_ENTRY_DTYPE, index_check, index_put

log = logging.getLogger(__name__)

_HEADER = struct.Struct(">qqqqii")
HEADER_SIZE = _HEADER.size  # 40
_SLOT = struct.Struct(">i")
_OFFSET = struct.Struct(">q")  # an entry's CommitLog offset, 4 bytes in
_ENTRY = struct.Struct(">iqii")
ENTRY_SIZE = _ENTRY.size  # 20
# A chain longer than this is corrupt (entries always point to strictly older ones).
_MAX_CHAIN = 1_000_000
_ENTRY_DTYPE = INDEX_ENTRY_DTYPE  # the tests read entries with it


class IndexDamagedError(ValueError):
    """An IndexFile's slots or entries are not what ``put_many`` writes: garbage (decision
    687). The file is rebuilt from its CommitLog range at the next start."""


@dataclass(slots=True)
class IndexHeader:
    begin_timestamp: int = 0
    end_timestamp: int = 0
    begin_offset: int = 0
    end_offset: int = 0
    used_slots: int = 0
    next_entry: int = 1


class IndexFile:
    def __init__(
        self, path: Path, slots: int, max_entries: int, *, create: bool, begin_offset: int = 0
    ) -> None:
        self.path = path
        self.slots = slots
        self.max_entries = max_entries
        self.size = self.file_size(slots, max_entries)
        self._entries_at = HEADER_SIZE + slots * _SLOT.size
        fd = os.open(path, os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0), 0o644)
        try:
            if create:
                os.ftruncate(fd, self.size)  # sparse: slots and entries are zero until used
                # The slots are written through the mapping, where a full disk would be a
                # SIGBUS: their blocks are allocated now, so a full disk fails here instead.
                os.posix_fallocate(fd, 0, HEADER_SIZE + slots * _SLOT.size)
            elif os.fstat(fd).st_size != self.size:
                raise ValueError(
                    f"{path}: {os.fstat(fd).st_size} bytes, expected {self.size} for "
                    f"{slots} slots and {max_entries} entries"
                )
            self.mm = mmap.mmap(fd, self.size)
        except BaseException:
            os.close(fd)
            if create:
                # A file this call made and could not size (a full disk): a start would find it
                # with a zero header, log it as unusable and rebuild a range for it.
                path.unlink(missing_ok=True)
            raise
        self._fd = fd
        if create:
            self.header = IndexHeader(begin_offset=begin_offset, end_offset=begin_offset)
            self._write_header()
            os.fsync(fd)  # the size and the header, before the name is made durable
        else:
            self.header = IndexHeader(*_HEADER.unpack_from(self.mm, 0))
            if not 1 <= self.header.next_entry <= max_entries + 1:
                raise ValueError(f"{path}: header entry count {self.header.next_entry} is corrupt")

    @staticmethod
    def file_size(slots: int, max_entries: int) -> int:
        return HEADER_SIZE + slots * _SLOT.size + (max_entries + 1) * ENTRY_SIZE

    @property
    def full(self) -> bool:
        return self.header.next_entry > self.max_entries

    @property
    def space(self) -> int:
        """Entries that still fit."""
        return self.max_entries + 1 - self.header.next_entry

    def _write_header(self) -> None:
        h = self.header
        os.pwrite(
            self._fd,
            _HEADER.pack(
                h.begin_timestamp,
                h.end_timestamp,
                h.begin_offset,
                h.end_offset,
                h.used_slots,
                h.next_entry,
            ),
            0,
        )

    def put_many(
        self,
        hashes: np.ndarray,
        offsets: np.ndarray,
        timestamps: np.ndarray,
    ) -> None:
        """Add entries (at most ``space``), in order, as if one at a time.

        Each entry links to the newest earlier entry of its slot: within this call that is the
        previous entry with the same slot, else what the slot held. Entries are written first,
        then slots, then the header, so a crash leaves slots that point at most to entries that
        exist (and a slot ahead of the saved header is detected and ignored). The record
        engine's ``index_put`` writes the entries and slots (natively: one call without the GIL,
        decision 540).
        """
        n = len(hashes)
        if n == 0:
            return
        h = self.header
        assert n <= self.space
        if h.begin_timestamp == 0:
            h.begin_timestamp = int(timestamps[0])
        h.used_slots += index_put(
            self.mm,
            self._fd,
            self.slots,
            h.next_entry,
            h.begin_timestamp,
            hashes,
            offsets,
            timestamps,
        )
        h.next_entry += n
        h.end_timestamp = max(h.end_timestamp, int(timestamps.max()))
        self._write_header()

    def advance(self, end_offset: int, store_timestamp: int) -> None:
        """Record that the CommitLog up to ``end_offset`` has been seen (saved on flush/put)."""
        h = self.header
        h.end_offset = end_offset
        if store_timestamp > h.end_timestamp:
            h.end_timestamp = store_timestamp
            if h.begin_timestamp == 0:
                h.begin_timestamp = store_timestamp

    def lookup(
        self, khash: int, begin_ms: int, end_ms: int, limit: int, below: int | None = None
    ) -> list[int]:
        """Physical offsets of entries with ``khash`` stored within [begin_ms, end_ms], newest
        first (candidates: the caller checks each record). Raises ``IndexDamagedError`` where
        the chain is not one ``put_many`` writes: an entry of another slot, a link forward or
        below zero (decision 687), or an offset out of CommitLog order: entries are written in
        record order, so along a chain offsets never rise, and none lies below the file's
        range or past ``below`` (the next file's start, for a file that is not the newest; a
        record indexed in both files is named by both). An entry naming another record of the
        same key passes the caller's record check, and it hid the record it stood for (decision
        756)."""
        h = self.header
        if h.next_entry <= 1 or end_ms < h.begin_timestamp - 1000 or begin_ms > h.end_timestamp:
            return []
        slot = khash % self.slots
        (number,) = _SLOT.unpack_from(self.mm, HEADER_SIZE + slot * _SLOT.size)
        found: list[int] = []
        steps = 0
        # The highest offset allowed. ``below`` itself is: a record whose entries did not all
        # fit this file (``put_many`` fills it to ``space``) has the rest in the next file,
        # which starts at that record, so both files name it.
        newer = (1 << 63) - 1 if below is None else below
        # A slot at or past the header's count is an entry being added right now (the header is
        # written last): the chain is read as empty, as before.
        while 0 < number < h.next_entry and len(found) < limit and steps < _MAX_CHAIN:
            steps += 1
            entry_hash, offset, seconds, prev = _ENTRY.unpack_from(
                self.mm, self._entries_at + number * ENTRY_SIZE
            )
            if entry_hash < 0 or entry_hash % self.slots != slot or not 0 <= prev < number:
                raise IndexDamagedError(
                    f"{self.path}: entry {number} in the chain of slot {slot} holds hash "
                    f"{entry_hash} and link {prev}"
                )
            # Its neighbours by number bound it too: an entry copying an older one of its chain
            # (the same key's earlier record) passes the chain's order, not theirs.
            low = self._offset_of(number - 1) if number > 1 else h.begin_offset
            high = self._offset_of(number + 1) if number + 1 < h.next_entry else newer
            if not max(low, h.begin_offset) <= offset <= min(high, newer):
                raise IndexDamagedError(
                    f"{self.path}: entry {number} in the chain of slot {slot} names CommitLog "
                    f"offset {offset}, out of order (entries {number - 1} and {number + 1} name "
                    f"{low} and {high}; the chain's newer entry {newer}; the file starts at "
                    f"{h.begin_offset})"
                )
            newer = offset
            stored = h.begin_timestamp + seconds * 1000
            # Seconds resolution: the record's own timestamp decides at the edges.
            if entry_hash == khash and begin_ms - 1000 <= stored <= end_ms:
                found.append(offset)
            number = prev
        if number < 0:
            raise IndexDamagedError(f"{self.path}: slot {slot} holds entry number {number}")
        return found

    def _offset_of(self, number: int) -> int:
        """The CommitLog offset entry ``number`` names."""
        (offset,) = _OFFSET.unpack_from(self.mm, self._entries_at + number * ENTRY_SIZE + 4)
        return int(offset)

    def check(self, *, full: bool = True) -> None:
        """Raise ``IndexDamagedError`` unless the slots and entries are what ``put_many``
        writes (decision 687): every slot empty or naming an entry of its own hash, and every
        entry's hash, link (to an older entry of the same slot) and offset (in the file's
        range) well formed. The record engine's ``index_check`` (natively one pass without the
        GIL, decision 830; the numpy reference about 0.1 s per million entries). Without
        ``full`` only the slots' entry numbers are checked. Run at start, after
        ``settle_slots``."""
        problem = self._damage(full)
        if problem is not None:
            raise IndexDamagedError(f"{self.path}: {problem}")

    def _damage(self, full: bool) -> str | None:
        """What ``check`` finds wrong, or None."""
        n = self.header.next_entry
        kind, where = index_check(self.mm, self.slots, n, self.header.begin_offset, full)
        if kind == 0:
            return None
        if kind in (1, 2):
            (head,) = _SLOT.unpack_from(self.mm, HEADER_SIZE + where * _SLOT.size)
            if kind == 1:
                return f"slot {where} names entry {head} of {n}"
            (entry_hash,) = _SLOT.unpack_from(self.mm, self._entries_at + head * ENTRY_SIZE)
            return f"slot {where} names entry {head} of hash {entry_hash}"
        entry_hash, offset, seconds, prev = _ENTRY.unpack_from(
            self.mm, self._entries_at + where * ENTRY_SIZE
        )
        return (
            f"entry {where} holds hash {entry_hash}, offset {offset}, seconds {seconds}, "
            f"link {prev}"
        )

    def settle_slots(self) -> int:
        """Slots naming entries past the saved header: a crash between ``index_put`` and the
        header's write (entries are written before slots, so the page cache holds them). Each
        is set back to its chain's newest entry under the header, following the links of those
        entries; returns how many. One that cannot be followed is left for ``check``."""
        n = self.header.next_entry
        slots = np.frombuffer(self.mm, np.dtype(">i4"), self.slots, HEADER_SIZE)
        try:
            ahead = np.flatnonzero(slots >= n).tolist()
        finally:
            del slots
        settled = 0
        for s in ahead:
            (number,) = _SLOT.unpack_from(self.mm, HEADER_SIZE + s * _SLOT.size)
            steps = 0
            while n <= number <= self.max_entries and steps < _MAX_CHAIN:
                steps += 1
                entry_hash, _, _, prev = _ENTRY.unpack_from(
                    self.mm, self._entries_at + number * ENTRY_SIZE
                )
                if entry_hash < 0 or entry_hash % self.slots != s or not 0 <= prev < number:
                    break
                number = prev
            if 0 <= number < n:
                _SLOT.pack_into(self.mm, HEADER_SIZE + s * _SLOT.size, number)
                settled += 1
        return settled

    def cut_entries_from(self, end_offset: int) -> int:
        """Drop the entries for records at or past CommitLog ``end_offset`` (recovery or a
        replica cut the CommitLog there, and new records will be written at those offsets):
        entries are in CommitLog order, so they are the newest ones; slots naming them go back
        along their chains. Returns how many were dropped."""
        h = self.header
        n = h.next_entry

        def offset_of(number: int) -> int:
            return int(_ENTRY.unpack_from(self.mm, self._entries_at + number * ENTRY_SIZE)[1])

        if n <= 1 or offset_of(n - 1) < end_offset:
            return 0  # the usual case: one entry read
        lo, hi = 1, n - 1  # the first entry at or past ``end_offset`` is in [lo, hi]
        while lo < hi:
            mid = (lo + hi) // 2
            if offset_of(mid) < end_offset:
                lo = mid + 1
            else:
                hi = mid
        cut = lo
        h.next_entry = cut
        self.settle_slots()
        self._write_header()
        return n - cut

    def flush(self) -> None:
        try:
            self._write_header()
            os.fdatasync(self._fd)  # releases the GIL, unlike mmap.flush
        except OSError as e:  # name the file: the store's DurabilityLostError quotes it
            e.filename = str(self.path)
            raise

    def close(self) -> None:
        if not self.mm.closed:
            try:
                self._write_header()
            finally:  # a dead disk (EIO) must not leave the mapping and descriptor open
                self.mm.close()
                os.close(self._fd)

    def destroy(self) -> None:
        if not self.mm.closed:
            self.mm.close()
            os.close(self._fd)
        self.path.unlink(missing_ok=True)


class IndexService:
    """The IndexFiles of a store: one being written, the rest read-only, ordered by offset."""

    def __init__(self, directory: Path, slots: int, max_entries: int) -> None:
        self.directory = directory
        self.slots = slots
        self.max_entries = max_entries
        self.files: list[IndexFile] = []
        # The dispatcher adds files while release deletes old ones: each replaces the list
        # under this lock, so neither loses the other's change.
        self._lock = threading.Lock()
        # Files a query found damaged (decision 687): the next start rebuilds them.
        self._notes = NotesFile(directory / ".damaged", "damaged IndexFile")
        self._reported: set[str] = set()  # files whose damage this run has logged

    def load(self) -> None:
        """Map the files; remove (for the start to rebuild) those of the wrong size or with a
        damaged header, slots or entries (decision 687), and those a query found damaged."""
        if not self.directory.exists():
            return
        noted = set(self._notes.read(_parse_file_note))
        files = []
        paths = [p for p in self.directory.iterdir() if not p.name.startswith(".")]
        newest = max(paths, key=lambda p: p.name.split("-")[1:], default=None)
        for path in sorted(self.directory.iterdir()):
            if path.name.startswith("."):
                continue
            if path.stat().st_size != IndexFile.file_size(self.slots, self.max_entries):
                # The geometry is checked against store.json, so this is a file whose creation
                # a crash interrupted (or damage). Derived data: rebuilt from the CommitLog.
                log.error(
                    "IndexFile %s has %d bytes, not %d; it is removed and rebuilt",
                    path,
                    path.stat().st_size,
                    IndexFile.file_size(self.slots, self.max_entries),
                )
                path.unlink()
                continue
            try:
                f = IndexFile(path, self.slots, self.max_entries, create=False)
            except ValueError as e:
                # Derived data: a damaged header costs a rebuild from the CommitLog, nothing more.
                log.error("IndexFile %s is unusable (%s); it is removed and rebuilt", path, e)
                path.unlink()
                continue
            try:
                if path.name in noted:
                    raise IndexDamagedError(f"{path}: a query found it damaged")
                settled = f.settle_slots()
                if settled:
                    log.warning(
                        "IndexFile %s: %d slot(s) named entries past its header (a crash while "
                        "adding them); set back along their chains",
                        path,
                        settled,
                    )
                # Every file's slots; the entries of the newest file only, the one a crash can
                # tear (older files are checked by the queries that read them).
                f.check(full=path == newest)
            except IndexDamagedError as e:
                log.error("IndexFile %s is damaged (%s); it is removed and rebuilt", path, e)
                f.destroy()
                continue
            files.append(f)
        files.sort(key=lambda f: (f.header.begin_offset, f.header.end_offset))
        self.files = files
        self._notes.clear()

    def _note(self, f: IndexFile) -> None:
        """Keep the name of a file a query found damaged, for the next start to rebuild
        (``NotesFile``: one the disk refused is tried again by the next query)."""
        self._notes.add(f.path.name)

    def check_all(self) -> list[str]:
        """Check every file's slots and entries in full (``IndexFile.check``), not only the
        newest file's entries as a start does: ``tmq store check`` (decision 734). Each damaged
        file is noted for the next start to remove and rebuild; what was found, one line a
        file. Seconds for a full file of 20M entries."""
        problems = []
        for f in list(self.files):
            try:
                f.check(full=True)
            except IndexDamagedError as e:
                self._note(f)
                problems.append(str(e))
        return problems

    @property
    def end_offset(self) -> int:
        """Where indexing resumes: the end of the newest file's range."""
        return self.files[-1].header.end_offset if self.files else 0

    def gaps(self, commitlog_min: int, commitlog_end: int) -> list[tuple[int, int]]:
        """CommitLog ranges below the newest file that no file covers (deleted or lost files)."""
        ranges: list[tuple[int, int]] = []
        cursor = commitlog_min
        for f in self.files:
            h = f.header
            if h.begin_offset > cursor:
                ranges.append((cursor, min(h.begin_offset, commitlog_end)))
            cursor = max(cursor, h.end_offset)
        return [(a, b) for a, b in ranges if a < b]

    def new_file(self, begin_offset: int) -> IndexFile:
        make_dirs(self.directory)
        stamp = time.strftime("%Y%m%d%H%M%S", time.gmtime())
        base = f"{stamp}{time.time_ns() // 1_000_000 % 1000:03d}-{begin_offset:020d}"
        path, n = self.directory / base, 0
        while path.exists():
            n += 1
            path = self.directory / f"{base}-{n}"
        f = IndexFile(path, self.slots, self.max_entries, create=True, begin_offset=begin_offset)
        fsync_dir(self.directory)
        return f

    def writer_at(self, offset: int, need: int = 1) -> IndexFile:
        """The file that takes ``need`` entries for a record at ``offset``: the newest file, or
        a new one starting at ``offset`` when the newest has no room for them."""
        tail = self.files[-1] if self.files else None
        if tail is None or tail.space < min(need, self.max_entries):
            if tail is not None:
                tail.flush()
            tail = self.new_file(offset)
            with self._lock:
                self.files = [*self.files, tail]
        return tail

    def insert_rebuilt(self, files: list[IndexFile]) -> None:
        """Add files rebuilt for gaps; they lie below the newest file, which stays last."""
        with self._lock:
            self.files = sorted([*self.files, *files], key=lambda f: f.header.begin_offset)

    def query(
        self,
        topic: str,
        key: str,
        begin_ms: int,
        end_ms: int,
        limit: int,
        scan: Callable[[int, int, int], list[int]] | None = None,
    ) -> list[tuple[int, IndexFile]]:
        """Candidate physical offsets for ``key`` in ``topic``, newest files first, deduplicated,
        each with the file whose entry named it.

        A file found damaged (``IndexDamagedError``, or ``damaged`` called by the caller) is
        noted for the next start to rebuild, and meanwhile answered by ``scan(start, end, hash)``:
        the offsets of the records in its CommitLog range with that key hash (decision 687)."""
        khash = key_hash(topic, key)
        seen: set[int] = set()
        result: list[tuple[int, IndexFile]] = []
        below: int | None = None  # the next file's start: an older file's entries lie under it
        for f in reversed(list(self.files)):
            try:
                offsets = f.lookup(khash, begin_ms, end_ms, limit, below)
            except IndexDamagedError as e:
                offsets = self._answer_damaged(f, str(e), khash, scan)
            except ValueError:  # unmapped by cleanup meanwhile
                continue
            finally:
                below = f.header.begin_offset
            for off in offsets:
                if off not in seen:
                    seen.add(off)
                    result.append((off, f))
            if len(result) >= limit:
                break
        return result

    def _answer_damaged(
        self,
        f: IndexFile,
        why: str,
        khash: int,
        scan: Callable[[int, int, int], list[int]] | None,
    ) -> list[int]:
        if f.path.name not in self._reported:
            self._reported.add(f.path.name)
            log.error(
                "IndexFile %s is damaged (%s); queries read its CommitLog range until a "
                "restart rebuilds it",
                f.path,
                why,
            )
        self._note(f)
        if scan is None:
            raise IndexDamagedError(why)
        h = f.header
        return sorted(scan(h.begin_offset, h.end_offset, khash), reverse=True)

    def damaged(self, f: IndexFile, why: str) -> None:
        """A caller found an entry of ``f`` naming a record without its key (decision 687)."""
        if f.path.name not in self._reported:
            self._reported.add(f.path.name)
            log.error("IndexFile %s is damaged (%s); a restart rebuilds it", f.path, why)
        self._note(f)

    def delete_before(self, commitlog_min: int) -> int:
        """Delete files whose whole range lies below ``commitlog_min`` (never the newest)."""
        keep: list[IndexFile] = []
        gone: list[IndexFile] = []
        with self._lock:
            for i, f in enumerate(self.files):
                last = i == len(self.files) - 1
                (gone if not last and f.header.end_offset <= commitlog_min else keep).append(f)
            self.files = keep
        for f in gone:
            f.destroy()
        return len(gone)

    def flush(self) -> None:
        for f in list(self.files[-1:]):
            f.flush()

    def close(self) -> None:
        close_all(self.files)

    def destroy_all(self) -> None:
        for f in self.files:
            f.destroy()
        self.files = []


def _parse_file_note(line: str) -> str:
    """A noted IndexFile's name: one word (the file names have no spaces)."""
    name = line.strip()
    if not name or " " in name or "/" in name:
        raise ValueError(f"not an IndexFile name: {line!r}")
    return name
