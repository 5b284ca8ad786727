"""A file of notes a running store keeps for its next start: one note a line, appended.

The ConsumeQueue's ``damaged_entries`` and the IndexFiles' ``.damaged`` (decisions 686, 687)
name what a read found damaged, for the start to check and rebuild. A note is a hint: losing
one loses no message (the read that meets the damage fails or falls back again, and notes it
again), but a lost note makes the restart the read's error asks for rebuild nothing. So:

- a note counts as made only once it is written and fsynced, with its file's name durable the
  first time (decisions 1261, 1263): one a full disk refused is tried again by the next read;
- an append is whole or nothing (``append_whole``): a stub a full disk cut would join the next
  note into one line that is neither (decision 1263);
- reading never refuses a start: a line that is not text (a flipped byte), torn by a power
  loss, or zeros past the last write is skipped, with a warning for anything but blank lines
  and zeros (decision 1262).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from tiered.durable import append_whole, fsync_dir
from tiered.log_every import LogEvery

log = logging.getLogger(__name__)

T = TypeVar("T")


class NotesFile:
    def __init__(self, path: Path, what: str) -> None:
        self.path = path
        self.what = what  # what a note names, for the log ("damaged ConsumeQueue entry")
        self._lock = threading.Lock()
        self._noted: set[str] = set()
        self._name_durable = False
        # A full disk refuses every read's try: one line a minute, the log may share the disk.
        self._refusals = LogEvery()

    def add(self, note: str) -> bool:
        """Append ``note`` (one line of ASCII) unless this run wrote it already; False, with
        the error logged, when it could not be written (the next ``add`` tries again)."""
        with self._lock:
            if note in self._noted:
                return True
            try:
                fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
                try:
                    append_whole(fd, (note + "\n").encode())
                    os.fsync(fd)
                finally:
                    os.close(fd)
                if not self._name_durable:
                    # The first note creates the file: an fsync of a file does not make its
                    # name durable, and a power loss took the notes with it.
                    fsync_dir(self.path.parent)
                    self._name_durable = True
            except OSError as e:
                quiet = self._refusals.due(self.path)
                if quiet is not None:
                    log.error(
                        "cannot note the %s in %s: %s (%d more refused since the last line)",
                        self.what,
                        self.path,
                        e,
                        quiet,
                    )
                return False
            self._noted.add(note)
            return True

    def read(self, parse: Callable[[str], T]) -> list[T]:
        """Each line's ``parse`` (which raises ``ValueError`` or ``TypeError`` for a line that
        is not a note), in file order, duplicates once; [] when there is no file. Lines that
        do not parse are skipped and named in one warning; a file that cannot be read is an
        error logged, and no notes."""
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            return []
        except OSError as e:
            log.error(
                "cannot read the %s notes in %s (%s): the start rebuilds only the damage it "
                "finds itself, and a read that meets more notes it again",
                self.what,
                self.path,
                e,
            )
            return []
        out: list[T] = []
        seen: set[str] = set()
        skipped: list[int] = []
        for number, line in enumerate(raw.split(b"\n"), 1):
            if not line.strip(b"\0 \t\r"):
                continue  # blank, or the zeros a power loss leaves past the last write
            try:
                text = line.decode("ascii")
                if text not in seen:
                    out.append(parse(text))
                    seen.add(text)
            except (ValueError, TypeError):  # UnicodeDecodeError is a ValueError
                skipped.append(number)
        if skipped:
            log.warning(
                "%s: line(s) %s are not notes of a %s (torn by a crash, or damaged) and were "
                "skipped; the %d other note(s) are used, and a read that meets the damage "
                "notes it again",
                self.path,
                ", ".join(map(str, skipped[:10])),
                self.what,
                len(out),
            )
        return out

    def clear(self) -> None:
        """Remove the file: the start has acted on every note in it."""
        with self._lock:
            self.path.unlink(missing_ok=True)
            self._noted.clear()
            self._name_durable = False
