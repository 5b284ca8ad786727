"""Fixed-size memory-mapped files, and a directory of them named by start offset.

This is RocketMQ's ``MappedFile`` / ``MappedFileQueue``. A file is named by the 20-digit offset of
its first byte in the logical stream (CommitLog bytes, or ConsumeQueue entry bytes), and every file
in a queue has the same size. A file is preallocated with ``posix_fallocate`` when created, so a
full disk fails the roll with ENOSPC instead of killing the process with SIGBUS on a later write
through the mapping.

Writes go to the page cache (``pwrite`` for large ones, a store through the mapping for small
ones) and reads come from the mapping of the same pages, so a ``kill -9`` loses nothing already
written; ``flush`` (``fdatasync``) is what makes bytes survive a
power loss.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from tiered import failpoints
from tiered.durable import fsync_dir, make_dirs
from tiered.record import ENGINE_NAME, NATIVE_ENGINE, Buffer

log = logging.getLogger(__name__)

OFFSET_NAME_DIGITS = 20
_ZERO_CHUNK = bytes(1 << 20)
_SIZE_FIELD = np.arange(4, dtype=np.int64)  # a record's first bytes: its total size
_PWRITE_MIN = 4096  # writes this large or larger use pwrite (see MappedFile.write_at)
# The record engine's append_records, when the native one runs (TMQ_PURE_PYTHON unset).
_NATIVE: Any = NATIVE_ENGINE if ENGINE_NAME == "native" else None


def _before_sizes() -> None:
    failpoints.hit("commitlog.before_sizes")


def _mid_write() -> None:
    failpoints.hit("commitlog.mid_write")


# The encoder's direct write is split in two around this only when a test arms it.
_MID_WRITE = _mid_write if failpoints.armed("commitlog.mid_write") else None


class StoreLoadError(RuntimeError):
    """The files on disk are not what the configuration says: the store refuses to start."""


def offset_name(offset: int) -> str:
    return f"{offset:0{OFFSET_NAME_DIGITS}d}"


class MappedFile:
    """One preallocated file of ``size`` bytes mapped read-write.

    ``wrote`` is the position of the next append (relative to the file), ``flushed`` the position
    up to which ``msync`` has returned. Only the owning queue's single writer moves ``wrote``.
    """

    def __init__(self, path: Path, from_offset: int, size: int, *, create: bool) -> None:
        self.path = path
        self.from_offset = from_offset
        self.size = size
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        self._fd = os.open(path, flags, 0o644)
        try:
            if create:
                os.posix_fallocate(self._fd, 0, size)
                # The size is metadata: without this a power loss can leave a zero-length file
                # in the middle of a queue, which recovery refuses as damage.
                os.fsync(self._fd)
            self.mm = mmap.mmap(self._fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(self._fd)
            if create:
                path.unlink(missing_ok=True)
            raise
        self.wrote = 0
        self.flushed = 0

    @property
    def end_offset(self) -> int:
        """Offset just past the last byte written."""
        return self.from_offset + self.wrote

    @property
    def tail_offset(self) -> int:
        """Offset just past the end of the file."""
        return self.from_offset + self.size

    def fileno(self) -> int:
        return self._fd

    def append(self, data: bytes | memoryview) -> None:
        self.write_at(self.wrote, data)
        self.wrote += len(data)

    def append_records(self, data: Buffer, offsets: Sequence[int], base: int) -> None:
        """Append whole records so that a crash in the middle never leaves one that looks whole.

        Record ``i`` of ``data`` starts at ``offsets[i] - base``. A write cut short by
        ``kill -9`` (pwrite stops at a page boundary on a fatal signal; a store through the
        mapping at any byte) leaves the front of a record and zeros after it. The record format
        checks the body alone (its CRC), so a record torn in its properties passed recovery with
        a damaged message id. Here every record's 4-byte size field is stored zero with the bulk
        copy, and set afterwards, in record order: a record has its size only once all its bytes
        are in the page cache, and recovery ends the log at the first record without one
        (RocketMQ closes the same hole with a CRC over the whole record,
        ``enabledAppendPropCRC``). The native record engine does it with one ``pwritev`` that
        skips the size fields, copying nothing (decision 260); ``append_records_py`` is the
        reference."""
        if _NATIVE is None:
            self.append_records_py(data, offsets, base)
            return
        _NATIVE.append_records(
            self._fd, self.mm, self.wrote, data, offsets, base, _PWRITE_MIN, _before_sizes
        )
        self.wrote += len(data)

    def append_sink(self) -> tuple[int, Any, int, Callable[[], None] | None] | None:
        """Where the native encoder may write a batch itself (``RecordEncoder.encode_batch``,
        decision 452), at ``wrote``; the caller then moves ``wrote``. The encoder writes its
        records with their size fields in place, in one ``pwrite``: each carries the record CRC,
        which is what tells recovery a record torn by ``kill -9`` (decision 1040). The last
        element is the ``commitlog.mid_write`` failpoint when it is armed, else None. None while
        ``append_records`` runs the reference."""
        if _NATIVE is None:
            return None
        return self._fd, self.mm, self.wrote, _MID_WRITE

    def append_records_py(self, data: Buffer, offsets: Sequence[int], base: int) -> None:
        pos = self.wrote
        data = bytearray(data)
        if offsets:
            view = np.frombuffer(data, np.uint8)
            fields = (np.asarray(offsets, np.int64)[:, None] - base + _SIZE_FIELD).ravel()
            sizes = view[fields].copy()
            view[fields] = 0
            del view
            self.write_at(pos, data)
            _before_sizes()
            mapped = np.frombuffer(self.mm, np.uint8)
            try:
                mapped[fields + pos] = sizes  # in index order: record by record, front to back
            finally:
                del mapped  # no export of the mapping outlives the call (close would refuse)
        else:
            self.write_at(pos, data)
        self.wrote += len(data)

    def write_at(self, pos: int, data: bytes | bytearray | memoryview) -> None:
        # Both paths land in the same page cache, so reads through the mapping see the bytes at
        # once. A store through the mapping holds the GIL, including while the first write to a
        # page waits on the filesystem; pwrite releases it and copies 3x faster from 16 KiB up
        # (measured here: 1 KiB 2.0 vs 2.2 us, 64 KiB 68 vs 22 us), but each call pays a
        # syscall and a journal handle, and small ones queue behind writeback. RocketMQ's
        # transientStorePool makes the same trade with FileChannel.write.
        n = len(data)
        if n < _PWRITE_MIN:
            self.mm[pos : pos + n] = data
        else:
            os.pwrite(self._fd, data, pos)

    def read(self, pos: int, size: int) -> bytes:
        return self.mm[pos : pos + size]

    def flush(self) -> int:
        """Make everything written so far durable; returns the new flushed position.

        ``fdatasync`` on the descriptor writes back the mapping's dirty pages (Linux tracks
        them through the page tables), and, unlike ``mmap.flush`` (``msync``), it releases the
        GIL: producers keep appending during an fsync, which is what lets group commit group.
        """
        wrote = self.wrote
        if wrote > self.flushed:
            try:
                os.fdatasync(self._fd)
            except OSError as e:  # name the file: the store's DurabilityLostError quotes it
                e.filename = str(self.path)
                raise
            self.flushed = wrote
        return self.flushed

    def data_regions(self, pos: int) -> Iterator[tuple[int, int]]:
        """``[start, end)`` stretches from ``pos`` on that may hold data, from the filesystem's
        extent map (``SEEK_DATA``/``SEEK_HOLE``): never-written preallocated space is skipped
        without reading it. Where the filesystem cannot tell, everything counts as data."""
        while pos < self.size:
            try:
                start = os.lseek(self._fd, pos, os.SEEK_DATA)
                if start >= self.size:
                    return
                end = min(self.size, os.lseek(self._fd, start, os.SEEK_HOLE))
            except OSError as e:
                if e.errno == errno.ENXIO:  # no data at or after pos
                    return
                if e.errno in (errno.EINVAL, errno.EOPNOTSUPP):  # the filesystem cannot tell
                    yield pos, self.size
                    return
                # EIO and the like: taken as "no data", recovery found no valid record past a
                # damaged one and cut acknowledged records as a torn tail (decision 981).
                e.filename = str(self.path)
                raise
            yield start, end
            pos = end

    def any_nonzero(self, pos: int, length: int) -> bool:
        """Whether ``[pos, pos + length)`` holds a byte that is not zero, reading only the
        stretches the extent map says may hold data (a hole reads as zeros): the tail recovery
        checks after its end is mostly a preallocated file's never-written space, and reading
        that in place faults in (and zero-fills) every page of it (decision 831)."""
        end = min(self.size, pos + length)
        for start, stop in self.data_regions(pos):
            if start >= end:
                break
            lo, hi = max(start, pos), min(stop, end)
            if hi > lo and np.count_nonzero(np.frombuffer(self.mm, np.uint8, hi - lo, lo)):
                return True
        return False

    def zero_from(self, pos: int) -> None:
        """Zero the file from ``pos`` to its end, touching only chunks that are not zero yet.

        Only stretches the extent map says may hold data are read (a preallocated file's
        never-written end is skipped without faulting its pages in), and they are checked in
        place: recovery cuts the log inside a mostly empty 1 GiB file after every crash."""
        for start, end in list(self.data_regions(pos)):
            at = max(start, pos)
            while at < end:
                stop = min(end, at + len(_ZERO_CHUNK))
                if np.count_nonzero(np.frombuffer(self.mm, np.uint8, stop - at, at)):
                    self.write_at(at, _ZERO_CHUNK[: stop - at])
                at = stop

    def close(self) -> None:
        if not self.mm.closed:
            self.mm.close()
            os.close(self._fd)

    def destroy(self) -> None:
        self.close()
        self.path.unlink(missing_ok=True)


class MappedFileQueue:
    """A directory of equal-size MappedFiles forming one logical byte stream.

    The list of files is replaced, never mutated in place, so readers can iterate a snapshot
    without a lock while the writer rolls or the cleaner deletes.
    """

    def __init__(self, directory: Path, file_size: int) -> None:
        if file_size <= 0:
            raise ValueError(f"file size {file_size} must be positive")
        self.directory = directory
        self.file_size = file_size
        self.files: list[MappedFile] = []
        self._lock = threading.Lock()

    # -- loading -------------------------------------------------------------------------------

    def load(self) -> None:
        """Map every file in the directory; refuse a file of the wrong size or with a bad name.

        A zero-length last file is what a crash between create and fallocate leaves: it is removed.
        """
        if not self.directory.exists():
            return
        names = sorted(p.name for p in self.directory.iterdir() if not p.name.startswith("."))
        files: list[MappedFile] = []
        for i, name in enumerate(names):
            path = self.directory / name
            if len(name) != OFFSET_NAME_DIGITS or not name.isdigit():
                raise StoreLoadError(f"{path}: not a store file (expected a 20-digit offset name)")
            length = path.stat().st_size
            if i == len(names) - 1 and length != self.file_size and all_zero(path):
                # A kill between creating the file and preallocating it: nothing was written.
                log.warning(
                    "%s: removing an incomplete last file (%d bytes, all zero) left by a "
                    "crash during a roll",
                    path,
                    length,
                )
                path.unlink()
                continue
            if length != self.file_size:
                for f in files:
                    f.close()
                raise StoreLoadError(
                    f"{path}: size is {length} bytes but the configured file size is "
                    f"{self.file_size}; refusing to start. Restore the file or set the size it "
                    "was written with."
                )
            offset = int(name)
            if offset % self.file_size:
                raise StoreLoadError(f"{path}: offset {offset} is not a multiple of the file size")
            files.append(MappedFile(path, offset, self.file_size, create=False))
        # A loaded file counts as full until recovery says where its data ends.
        for f in files:
            f.wrote = f.flushed = f.size
        self.files = files

    # -- lookups -------------------------------------------------------------------------------

    @property
    def min_offset(self) -> int:
        files = self.files
        return files[0].from_offset if files else 0

    @property
    def max_offset(self) -> int:
        """Offset just past the last written byte."""
        files = self.files
        return files[-1].end_offset if files else 0

    @property
    def flushed_offset(self) -> int:
        files = self.files
        for f in reversed(files):
            if f.flushed:
                return f.from_offset + f.flushed
        return files[0].from_offset if files else 0

    def last_file(self) -> MappedFile | None:
        files = self.files
        return files[-1] if files else None

    def find_file(self, offset: int) -> MappedFile | None:
        """The file holding ``offset``, or None when it is below the first or past the last."""
        files = self.files
        if not files or offset < files[0].from_offset:
            return None
        index = (offset - files[0].from_offset) // self.file_size
        if index < len(files) and files[index].from_offset <= offset < files[index].tail_offset:
            return files[index]
        # Files may not be contiguous (a ConsumeQueue rebuilt from a later offset); search.
        for f in files:
            if f.from_offset <= offset < f.tail_offset:
                return f
        return None

    def iter_from(self, offset: int) -> Iterator[MappedFile]:
        for f in self.files:
            if f.tail_offset > offset:
                yield f

    # -- writing -------------------------------------------------------------------------------

    def create_file(self, from_offset: int) -> MappedFile:
        """Create (preallocate and map) the file starting at ``from_offset`` and append it."""
        if from_offset % self.file_size:
            raise ValueError(f"offset {from_offset} is not a multiple of {self.file_size}")
        make_dirs(self.directory)
        # fallocate makes this cheap (milliseconds for 1 GiB), so a roll does not stall appends.
        f = MappedFile(
            self.directory / offset_name(from_offset), from_offset, self.file_size, create=True
        )
        try:
            # The file's own fsyncs never make its name durable: without this, a power loss
            # after a roll loses the whole new file, acknowledged messages and all.
            fsync_dir(self.directory)
        except BaseException:
            f.destroy()
            raise
        with self._lock:
            if self.files and self.files[-1].from_offset >= from_offset:
                f.destroy()
                raise ValueError(f"file at {from_offset} is not past the last file")
            self.files = [*self.files, f]
        return f

    def discard_last(self, files: list[MappedFile]) -> None:
        """Remove ``files``, just created at the end and never written (a refused batch)."""
        if not files:
            return
        with self._lock:
            self.files = [f for f in self.files if f not in files]
        for f in files:
            f.destroy()
        fsync_dir(self.directory)

    def flush(self) -> int:
        """fdatasync every file with unflushed bytes; returns the flushed offset."""
        for f in self.files:
            if f.wrote > f.flushed:
                f.flush()
        return self.flushed_offset

    def truncate_dirty(self, offset: int) -> list[MappedFile]:
        """Make ``offset`` the end of the stream.

        The file holding it is zeroed from there on, so no stale bytes can later pass for data;
        files wholly past it are unmapped and returned, for the caller to move aside or delete.
        """
        keep: list[MappedFile] = []
        dropped: list[MappedFile] = []
        for f in self.files:
            if f.from_offset >= offset and not (f.from_offset == offset and not keep):
                dropped.append(f)
                continue
            if f.tail_offset > offset:
                pos = offset - f.from_offset
                f.zero_from(pos)
                f.wrote = f.flushed = pos
            keep.append(f)
        with self._lock:
            self.files = keep
        for f in dropped:
            f.close()
        return dropped

    def delete_first_files(self, count: int) -> list[MappedFile]:
        """Unmap and delete the ``count`` oldest files (never the last one)."""
        with self._lock:
            count = min(count, len(self.files) - 1)
            if count <= 0:
                return []
            gone, self.files = self.files[:count], self.files[count:]
        for f in gone:
            f.destroy()
        if gone:
            fsync_dir(self.directory)  # else a power loss brings released files back
        return gone

    def destroy(self) -> None:
        with self._lock:
            files, self.files = self.files, []
        for f in files:
            f.destroy()

    def close(self) -> None:
        close_all(self.files)


class Closable(Protocol):
    def close(self) -> None: ...


def close_all(files: Iterable[Closable]) -> None:
    """Close every file, even when one fails (EIO from a dead disk); raise the first error."""
    first: OSError | None = None
    for f in files:
        try:
            f.close()
        except OSError as e:
            first = first or e
    if first is not None:
        raise first


def all_zero(path: Path) -> bool:
    """True when the file holds only zero bytes."""
    zero = _ZERO_CHUNK
    with path.open("rb") as fh:
        while data := fh.read(len(zero)):
            if data != zero[: len(data)]:
                return False
    return True
