"""One segment's build and upload: the offloader's job for the cold worker (tiered/cold/worker.py).

The broker plans a segment (its key, its base queue offset and its ConsumeQueue entries, a few
bytes per message) and hands it over; the job reads the records straight from the CommitLog
files (the page cache the broker wrote them to, so nothing is copied through the pipe), builds
the segment object and writes it with ``put_if_absent`` (a key that already existed has its
stored footer checked against the build). It returns
the ``SegmentInfo`` to commit: the commit itself stays with the broker, under the queue's lock.

Idempotent: the key is the broker's, chosen once per segment, so a job cut off by a crash of the
worker and run again either writes the object or finds its own earlier write (the same records
make the same bytes, so the same footer) and verifies that.

Reading another process's files is safe because release never deletes a CommitLog file holding a
record above the queue's committed tier watermark (``offload/release.py``), and every record of
a job is above it until the broker commits the job's result.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tiered import failpoints
from tiered.cold.segment import SegmentError, SegmentInfo, read_footer
from tiered.cold.storage import ObjectStore
from tiered.formats import CQ_DTYPE, CQ_ENTRY_SIZE, FOOTER_SIZE, seal
from tiered.record import gather
from tiered.store import commitlog_file_name

log = logging.getLogger(__name__)


class SegmentSourceError(SegmentError):
    """A record the segment needs is no longer (or not) in the local CommitLog."""


@dataclass(slots=True, frozen=True)
class SegmentJob:
    """Everything the worker needs to build and upload one segment object."""

    key: str  # chosen once by the broker: a retry writes the same key
    base_offset: int  # queue offset of the first record
    entries: bytes  # the records' ConsumeQueue entries (``CQ_DTYPE``), in queue order
    commitlog_dir: str
    commitlog_file_size: int
    # PUTs of segments at once in the worker, across queues (the offloader's
    # ``parallel_uploads``; 0: no bound but the worker's threads). The worker runs one more
    # thread than this, which builds the next segment while the PUTs are under way.
    put_slots: int = 0


def read_records(job: SegmentJob, out: bytearray) -> int:
    """Copy the job's whole records from the CommitLog files into ``out`` from its start, one
    after the other, and return their size: each file mapped, and its records copied straight
    into ``out`` by the record engine (one copy; the bytes between them, other queues' records,
    never read). ``out`` must hold at least that many bytes."""
    table = np.frombuffer(job.entries, dtype=CQ_DTYPE)
    phys = table["offset"].astype(np.int64)
    sizes = table["size"].astype(np.int64)
    files = phys // job.commitlog_file_size
    # Queue offsets grow with CommitLog offsets: the records of one file are one run of the table.
    cuts = np.flatnonzero(files[1:] != files[:-1]) + 1
    at = 0
    for first, last in zip([0, *cuts.tolist()], [*cuts.tolist(), len(table)], strict=True):
        file_start = int(files[first]) * job.commitlog_file_size
        path = Path(job.commitlog_dir) / commitlog_file_name(file_start)
        try:
            with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
                at = gather(mm, phys[first:last] - file_start, sizes[first:last], out, at)
        except FileNotFoundError:
            raise SegmentSourceError(
                f"{job.key}: CommitLog file {path.name} is no longer local"
            ) from None
        except ValueError as e:  # a record past the file's end (an empty file maps as an error too)
            raise SegmentSourceError(
                f"{job.key}: records of CommitLog file {path.name} are not local: {e}"
            ) from None
    return at


# Each worker thread keeps the buffer its last segment was built in and builds the next one in
# it: a fresh 16 MiB buffer costs a page fault per 4 KiB page when it is first written, as
# much CPU as copying the records into it (decision 410). A thread holds at most one buffer of
# about ``segment_max_bytes``.
_kept = threading.local()

# Builds that run at once in a process: one per core. A build is CPU (the gather, the checks),
# a PUT mostly waits on the store; four builds started together (a pass's first four segments)
# only delayed every first PUT until all four were built (decision 413). One at a time on two
# cores left threads whose PUT had ended waiting for another's build: 1.5-4.9 s of waits per
# pass of 12 segments, their PUT slots idle meanwhile (decision 564).
_building = threading.BoundedSemaphore(max(1, os.cpu_count() or 1))

# PUTs at once, per ``SegmentJob.put_slots`` (one semaphore for each value seen): the worker runs
# ``worker_threads`` threads, one more than the PUT slots, so that a thread builds the next
# segment while the others' PUTs run and hands it over the moment a slot frees, instead of a
# PUT slot standing idle while its own thread builds (decision 630).
_put_slots: dict[int, threading.BoundedSemaphore] = {}
_put_slots_guard = threading.Lock()

# The modules a cold worker imports at its start for the offloader's jobs (numpy, the record
# engine, the seal): imported by the first upload job otherwise, 0.3-0.7 s on a loaded machine
# (decision 631).
WORKER_PRELOAD = (__name__,)


def worker_threads(parallel_uploads: int) -> int:
    """Threads for a cold worker that runs ``parallel_uploads`` PUTs at once: one more, to
    build ahead."""
    return max(1, parallel_uploads) + 1


def _putting(slots: int) -> threading.BoundedSemaphore | contextlib.nullcontext[None]:
    if slots <= 0:
        return contextlib.nullcontext()
    with _put_slots_guard:
        semaphore = _put_slots.get(slots)
        if semaphore is None:
            semaphore = _put_slots[slots] = threading.BoundedSemaphore(slots)
        return semaphore


def _object_buffer(job: SegmentJob) -> tuple[bytearray, int]:
    """A buffer for the job's object, its length the size of the job's records (its contents
    undefined), with room after them for the tables and footer; and that size."""
    count = len(job.entries) // CQ_ENTRY_SIZE
    records = int(np.frombuffer(job.entries, dtype=CQ_DTYPE)["size"].sum(dtype=np.int64))
    buf: bytearray | None = getattr(_kept, "buf", None)
    room: int = getattr(_kept, "room", 0)
    # The kept buffer when the records fit and fill at least 60% of it: a bytearray cut below
    # half its memory gives memory back, which the next large job would fault in again.
    if buf is None or not room * 3 <= records * 5 <= room * 5:
        # Room for the offset and time tables (28 bytes a record), two keys a record in the
        # key index, and the footer: the tables seldom grow the buffer again.
        size = records + count * (CQ_ENTRY_SIZE + 8 + 16) + FOOTER_SIZE
        buf = bytearray(size)
        if size > room:  # a smaller job (a queue's last segment) leaves the larger one kept
            _kept.buf, _kept.room = buf, size
    if len(buf) < records:  # the kept buffer, cut to a smaller object last time: within its room
        buf += bytes(records - len(buf))
    del buf[records:]
    return buf, records


def upload_segment(tier: ObjectStore, job: SegmentJob) -> SegmentInfo:
    """Build the job's segment, write it unless its key exists, and return its verified footer.
    Raises ``SegmentError`` (a damaged or missing record, a stored object that is not ours) or
    ``StorageError`` (after the tier's retries)."""
    with _building:
        data, records = _object_buffer(job)
        read_records(job, data)
        info = seal(data, records, job.base_offset, job.key)
    # The store does not keep ``data`` past the call: this thread's next job reuses it.
    with _putting(job.put_slots):
        written = tier.put_if_absent(info.key, data, crc32c=info.object_crc32c())  # type: ignore[arg-type]
    failpoints.hit("offload.after_put")
    if written:
        # A PUT that succeeded created the object with exactly these bytes (an object write is
        # atomic, and S3 answers success only for the whole body): reading its footer back
        # would cost two more requests per segment and tell nothing new.
        return info
    # The key existed: our own earlier attempt landed (the key is unique to this segment's
    # plan), or something else did. Only its stored footer tells which.
    log.info("%s already exists: a retried upload", info.key)
    stored = read_footer(tier, info.key)
    if stored != info:
        raise SegmentError(f"{info.key}: stored object differs from what was written")
    return stored
