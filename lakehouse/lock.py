"""One export per checkpoint on a host, and a hot standby that takes over when it dies.

Two Spark queries sharing a checkpoint corrupt it, and two exporters of one table conflict on
every commit. The export therefore holds an exclusive ``flock`` on ``{checkpoint}.lock`` while
it runs. The kernel releases the lock when the holder exits in any way, SIGKILL included, so a
standby (``--standby``), which has already started its Spark session, takes over within a
fraction of a second and resumes from the Delta table's exported offsets.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import threading
from pathlib import Path
from typing import IO


class ExportLockedError(RuntimeError):
    """Another export holds this checkpoint."""


class CheckpointLock:
    POLL_SECONDS = 0.2

    def __init__(self, checkpoint: str) -> None:
        self.path = Path(checkpoint.removeprefix("file://") + ".lock")
        self._file: IO[str] | None = None

    def acquire(self, *, wait: bool, stop: threading.Event | None = None) -> bool:
        """Take the lock. Without ``wait``, ``ExportLockedError`` if it is held; with it, poll
        until it is free or ``stop`` is set (then return False)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        handle = open(self.path, "a+")  # noqa: SIM115 - held open for as long as the lock
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if not wait:
                    holder = self.path.read_text().strip() or "?"
                    handle.close()
                    raise ExportLockedError(
                        f"another export (pid {holder}) is running with checkpoint "
                        f"{self.path.with_suffix('')}; stop it, or pass --standby to take over "
                        "when it stops"
                    ) from None
                if stop is not None and stop.wait(self.POLL_SECONDS):
                    handle.close()
                    return False
                if stop is None:
                    threading.Event().wait(self.POLL_SECONDS)
        try:
            handle.seek(0)
            handle.truncate()
            handle.write(str(os.getpid()))
            handle.flush()
        except BaseException:
            # A full disk refuses the pid: the error goes up with the lock let go, not held by
            # a descriptor only the garbage collector would close (decision 1207).
            with contextlib.suppress(OSError):
                fcntl.flock(handle, fcntl.LOCK_UN)
            with contextlib.suppress(OSError):
                handle.close()  # the buffered pid's flush fails again; the descriptor closes
            raise
        self._file = handle
        return True

    def release(self) -> None:
        if self._file is not None:
            with contextlib.suppress(OSError):
                fcntl.flock(self._file, fcntl.LOCK_UN)
            self._file.close()
            self._file = None
