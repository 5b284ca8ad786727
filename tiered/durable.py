"""Making names durable: what fsync of a file does not do.

fsync of a file makes its bytes durable, not its name. A file just created, a directory just
made, a rename or an unlink is only durable once the directory holding the name has been
fsynced too (POSIX; ext4 and XFS honour it, and the power-loss tests' filesystem enforces it).
"""

from __future__ import annotations

import contextlib
import os
import threading
from pathlib import Path

from tiered import failpoints

# One lock per file ``write_file`` replaces: two threads saving one file at once shared its
# temporary file. The second's O_TRUNC and write landed in the inode the first had just renamed
# into place, so the live file was rewritten in place (torn by a crash) and, when the second
# document was the shorter, kept the first's tail after it: a damaged file that stops the next
# start (decision 1180).
_path_locks: dict[str, threading.Lock] = {}
_path_locks_guard = threading.Lock()


def _path_lock(path: Path) -> threading.Lock:
    key = os.path.abspath(path)
    with _path_locks_guard:
        lock = _path_locks.get(key)
        if lock is None:
            lock = _path_locks[key] = threading.Lock()
        return lock


def fsync_dir(path: Path) -> None:
    """fsync the directory ``path``: the names in it (creates, renames, unlinks) are durable."""
    _fsync_path(path, os.O_RDONLY | os.O_DIRECTORY)


def fsync_file(path: str | Path) -> None:
    """fsync the file at ``path``, written by whoever wrote it: its bytes, not its name."""
    _fsync_path(path, os.O_RDONLY)


def _fsync_path(path: str | Path, flags: int) -> None:
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def settle_dir(path: Path) -> None:
    """Make the names in the directory ``path`` durable before a start reads from it (nothing
    when it does not exist). ``write_file`` renames into place, then fsyncs the directory: a
    process killed between the two left the new name in the page cache only, and a start that
    read it and acted on it could have it taken back by a power loss (decision 1184). Once per
    load: a directory with nothing unsynced costs one cheap fsync."""
    with contextlib.suppress(FileNotFoundError):
        fsync_dir(path)


def make_dirs(path: Path) -> None:
    """``mkdir -p`` whose new directories survive a power loss (each parent is fsynced)."""
    missing: list[Path] = []
    p = path
    while not p.exists():
        missing.append(p)
        p = p.parent
    for d in reversed(missing):
        try:
            d.mkdir()
        except FileExistsError:
            continue  # another thread made it; it fsyncs the parent itself
        fsync_dir(d.parent)


def replace(tmp: Path, path: Path) -> None:
    """Rename the fsynced ``tmp`` over ``path`` and make the rename durable."""
    os.replace(tmp, path)
    failpoints.hit("durable.after_rename")
    fsync_dir(path.parent)


def write_file(path: Path, data: bytes) -> None:
    """Replace ``path`` with ``data`` atomically and durably: a crash leaves the old or the new
    content, never a torn or empty file, and never the old one once this has returned.
    Threads replacing the same file take turns; which content stays is the last caller's."""
    with _path_lock(path):
        _write_file(path, data)


def _write_file(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    fill_new_file(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), tmp, data)
    replace(tmp, path)


def fill_new_file(fd: int, path: Path, data: bytes) -> None:
    """Write all of ``data`` to the new file ``path``, open on ``fd``, fsync it and close
    ``fd``; or remove the file and raise. A full disk can take part of a write without an error
    (``write`` returns less than asked, decision 1140), and the pages a fragment holds go back
    at once, not at the next save of the file (which may never come)."""
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        with contextlib.suppress(OSError):
            path.unlink()
        raise


def append_whole(fd: int, data: bytes) -> None:
    """Append all of ``data`` to ``fd`` (opened ``O_APPEND``) or, raising, none of it. A full
    disk can take the part that fits in the file's last page (a short write, and no error):
    left there, it would join the next record appended, or shift every fixed-size entry after
    it. Cutting it off needs no space."""
    size = os.fstat(fd).st_size
    view = memoryview(data)
    try:
        while view:
            view = view[os.write(fd, view) :]
    except OSError:
        os.ftruncate(fd, size)
        raise
