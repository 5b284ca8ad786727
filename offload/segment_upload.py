"""One segment's build and upload: the offloader's job for the cold worker (tiered/cold/worker.py).

The broker plans a segment (its key, its base queue offset and its ConsumeQueue entries, a few
bytes per message) and hands it over; the job reads the records straight from the CommitLog
files (the page cache the broker wrote them to, so nothing is copied through the pipe), builds
the segment object, writes it with ``put_if_absent`` and checks the stored footer. It returns
the ``SegmentInfo`` to commit: the commit itself stays with the broker, under the queue's lock.

Idempotent: the key is the broker's, chosen once per segment, so a job cut off by a crash of the
worker and run again either writes the object or finds its own earlier write (the same records
make the same bytes, so the same footer) and verifies that.

Reading another process's files is safe because release never deletes a CommitLog file holding a
record above the queue's committed tier watermark (``offload/release.py``), and every record of
a job is above it until the broker commits the job's result.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tiered import failpoints
from tiered.cold.segment import SegmentError, SegmentInfo, build, read_footer
from tiered.cold.storage import ObjectStore
from tiered.formats import CQ_DTYPE
from tiered.store import commitlog_file_name

log = logging.getLogger(__name__)

# Records of one queue closer than this in the CommitLog are read with one pread.
_COALESCE_GAP = 64 << 10


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


def read_records(job: SegmentJob) -> bytes:
    """The job's whole records from the CommitLog files, one after the other (one copy): a run
    of nearby records per read, the bytes between them (other queues' records) left out."""
    table = np.frombuffer(job.entries, dtype=CQ_DTYPE)
    phys = table["offset"].astype(np.int64)
    sizes = table["size"].astype(np.int64)
    parts: list[memoryview] = []
    files: dict[int, int] = {}
    try:
        i, n = 0, len(table)
        while i < n:
            file_start = int(phys[i]) - int(phys[i]) % job.commitlog_file_size
            file_end = file_start + job.commitlog_file_size
            # One run: records in the same file, each within _COALESCE_GAP of the previous end.
            j = i + 1
            while (
                j < n
                and phys[j] < file_end
                and phys[j] - (phys[j - 1] + sizes[j - 1]) < _COALESCE_GAP
            ):
                j += 1
            fd = files.get(file_start)
            if fd is None:
                path = Path(job.commitlog_dir) / commitlog_file_name(file_start)
                try:
                    fd = files[file_start] = os.open(path, os.O_RDONLY)
                except FileNotFoundError:
                    raise SegmentSourceError(
                        f"{job.key}: CommitLog file {path.name} is no longer local"
                    ) from None
            run_start = int(phys[i])
            run_len = int(phys[j - 1] + sizes[j - 1]) - run_start
            data = os.pread(fd, run_len, run_start - file_start)
            if len(data) != run_len:
                raise SegmentSourceError(
                    f"{job.key}: CommitLog offsets {run_start}..{run_start + run_len} are not local"
                )
            view = memoryview(data)
            for p, size in zip(phys[i:j].tolist(), sizes[i:j].tolist(), strict=True):
                parts.append(view[p - run_start : p - run_start + size])
            i = j
    finally:
        for fd in files.values():
            os.close(fd)
    return b"".join(parts)


def upload_segment(tier: ObjectStore, job: SegmentJob) -> SegmentInfo:
    """Build the job's segment, write it unless its key exists, and return its verified footer.
    Raises ``SegmentError`` (a damaged or missing record, a stored object that is not ours) or
    ``StorageError`` (after the tier's retries)."""
    data, info = build([read_records(job)], job.base_offset, job.key)
    if not tier.put_if_absent(info.key, data):
        # Our own earlier attempt landed (the key is unique to this segment's plan).
        log.info("%s already exists: a retried upload", info.key)
    failpoints.hit("offload.after_put")
    stored = read_footer(tier, info.key)
    if stored != info:
        raise SegmentError(f"{info.key}: stored object differs from what was written")
    return stored
