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

import logging
import mmap
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tiered import failpoints
from tiered.cold.segment import SegmentError, SegmentInfo, build, read_footer
from tiered.cold.storage import ObjectStore
from tiered.formats import CQ_DTYPE
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


def read_records(job: SegmentJob) -> bytearray:
    """The job's whole records from the CommitLog files, one after the other: each file mapped,
    and its records copied straight into the result by the record engine (one copy, the bytes
    between them, other queues' records, never read)."""
    table = np.frombuffer(job.entries, dtype=CQ_DTYPE)
    phys = table["offset"].astype(np.int64)
    sizes = table["size"].astype(np.int64)
    out = bytearray(int(sizes.sum()))
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
    return out


def upload_segment(tier: ObjectStore, job: SegmentJob) -> SegmentInfo:
    """Build the job's segment, write it unless its key exists, and return its verified footer.
    Raises ``SegmentError`` (a damaged or missing record, a stored object that is not ours) or
    ``StorageError`` (after the tier's retries)."""
    data, info = build([read_records(job)], job.base_offset, job.key)
    written = tier.put_if_absent(info.key, data)
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
