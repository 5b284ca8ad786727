"""Ownership of a data directory: the exclusive lock and the abort marker.

- ``lock``: held with ``flock(LOCK_EX | LOCK_NB)`` for the life of the store, so a second broker
  on the same directory is refused instead of corrupting it. The kernel drops the lock when the
  process dies, however it dies.
- ``abort``: created (with the PID) once the store is open and removed only by a clean shutdown
  that has dispatched every CommitLog byte. Finding it at start-up means the last run crashed.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from tiered.durable import make_dirs


class DataDirLockedError(RuntimeError):
    pass


class DataDir:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.lock_path = path / "lock"
        self.abort_path = path / "abort"
        self._lock_fd: int | None = None

    def lock(self) -> None:
        make_dirs(self.path)
        fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise DataDirLockedError(
                f"data dir {self.path} is in use by another tmq process (pid {holder}); "
                "stop it or choose another --data-dir"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._lock_fd = fd

    def unlock(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # closing the descriptor releases the flock
            self._lock_fd = None

    @property
    def last_exit_was_clean(self) -> bool:
        return not self.abort_path.exists()

    def mark_running(self) -> None:
        self.abort_path.write_text(f"{os.getpid()}\n")
        _fsync_dir(self.path)

    def mark_clean_exit(self) -> None:
        self.abort_path.unlink(missing_ok=True)
        _fsync_dir(self.path)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
