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
from tiered.record import MAGIC_CODE_V2, SYSFLAG_BORNHOST_V6, SYSFLAG_STOREHOST_V6, gather
from tiered.store import commitlog_file_name

log = logging.getLogger(__name__)


class SegmentSourceError(SegmentError):
    """A record the segment needs is no longer (or not) in the local CommitLog."""


class SegmentEntryError(SegmentError):
    """A ConsumeQueue entry of the job does not name its own record: the CommitLog does not
    hold at the entry's offset a record of the entry's size, with the queue's topic and queue
    id and the entry's queue offset (decision 730). Nothing of the job is uploaded."""

    def __init__(
        self, key: str, topic: str, queue_id: int, offset: int, at: int, size: int, found: str
    ) -> None:
        super().__init__(
            f"{key}: the ConsumeQueue entry {topic}/{queue_id} at queue offset {offset} names "
            f"CommitLog [{at}, {at + size}), which holds {found}, not its record"
        )
        self.key, self.topic, self.queue_id, self.offset = key, topic, queue_id, offset
        self.at, self.size, self.found = at, size, found

    def __reduce__(
        self,
    ) -> tuple[type[SegmentEntryError], tuple[str, str, int, int, int, int, str]]:
        # Raised in the cold worker and pickled back to the broker.
        return (
            type(self),
            (self.key, self.topic, self.queue_id, self.offset, self.at, self.size, self.found),
        )


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
    # The queue the entries are of: every record is checked to be this queue's (decision 730).
    topic: str = ""
    queue_id: int = -1


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


# The fixed head of a V2 record: TOTALSIZE, MAGICCODE, BODYCRC, QUEUEID, FLAG, QUEUEOFFSET,
# PHYSICALOFFSET (what an error says the bytes hold).
_HEAD_DTYPE = np.dtype(
    [
        ("total", ">i4"),
        ("magic", ">i4"),
        ("crc", ">u4"),
        ("queue_id", ">i4"),
        ("flag", ">i4"),
        ("queue_offset", ">i8"),
        ("physical", ">i8"),
    ]
)
# Every byte before the body when both hosts are IPv4, the body length, the topic and
# properties lengths: no V2 record is shorter.
_MIN_RECORD = 88 + 2 + 2


def _first_wrong_entry(job: SegmentJob, buf: bytearray, records: int) -> tuple[int, str] | None:
    """The index of the job's first entry whose gathered bytes are not its own record, and
    why; None when every entry names its record. Vectorized over the whole job: the head's
    five fields compared a column at a time, then each record's topic found through its host
    flags and body length (a few numpy passes, no Python per record). The bytes are left to
    ``seal``'s checks (structure, body CRC, queue offsets in sequence) once they are the
    queue's."""
    if not job.topic:
        return None  # a job planned without its queue (an older broker's): seal's checks only
    table = np.frombuffer(job.entries, dtype=CQ_DTYPE)
    sizes = table["size"].astype(np.int64)
    count = len(table)
    short = np.flatnonzero(sizes < _MIN_RECORD)
    if len(short):
        return int(short[0]), f"{int(sizes[short[0]])} bytes, too few for a record"
    starts = np.zeros(count, np.int64)
    np.cumsum(sizes[:-1], out=starts[1:])
    raw = np.frombuffer(buf, np.uint8, records)
    # A column at a time (a fancy index of count elements each), not one (count, 36) index.
    bad = np.zeros(count, bool)
    for at, width, want in (
        (0, 4, sizes),  # TOTALSIZE
        (4, 4, MAGIC_CODE_V2 & 0xFFFFFFFF),  # MAGICCODE, read unsigned
        (12, 4, job.queue_id & 0xFFFFFFFF),  # QUEUEID
        (20, 8, job.base_offset + np.arange(count, dtype=np.int64)),  # QUEUEOFFSET
        (28, 8, table["offset"].astype(np.int64)),  # PHYSICALOFFSET
    ):
        bad |= _ints(raw, starts + at, width) != want
    if bad.any():
        return int(np.flatnonzero(bad)[0]), ""
    # The topic: after the hosts (4 or 16 bytes of address, and a port, each) and the body.
    flags = _ints(raw, starts + 36, 4)
    born = np.where(flags & SYSFLAG_BORNHOST_V6, 20, 8)
    stored = np.where(flags & SYSFLAG_STOREHOST_V6, 20, 8)
    body_len_at = starts + 48 + born + 8 + stored + 12
    ends = starts + sizes
    body = _ints(raw, body_len_at, 4)
    body = np.where(body & 0x80000000, -1, body)  # negative: not a record
    topic_at = body_len_at + 4 + body
    name = job.topic.encode()
    fits = (body_len_at + 4 <= ends) & (body >= 0) & (topic_at + 2 + len(name) + 2 <= ends)
    topic_at = np.where(fits, topic_at, starts)  # anywhere inside the record: judged by ``fits``
    ok = fits & (_ints(raw, topic_at, 2) == len(name))
    if len(name):
        letters = raw[np.minimum(topic_at[:, None] + 2 + np.arange(len(name)), records - 1)]
        ok &= (letters == np.frombuffer(name, np.uint8)).all(axis=1)
    if ok.all():
        return None
    return int(np.flatnonzero(~ok)[0]), "another topic's record"


def _ints(raw: np.ndarray, at: np.ndarray, width: int) -> np.ndarray:
    """The big-endian unsigned ``width``-byte integers of ``raw`` at each of ``at``."""
    out = np.zeros(len(at), np.int64)
    last = len(raw) - 1
    for k in range(width):  # clipped: a garbage length may point past the bytes
        out = (out << 8) | raw[np.minimum(at + k, last)]
    return out


def _entry_error(job: SegmentJob, buf: bytearray, index: int, why: str) -> SegmentEntryError:
    """``SegmentEntryError`` for the job's entry ``index``, saying what its bytes hold."""
    entry = np.frombuffer(job.entries, dtype=CQ_DTYPE)[index]
    at, size = int(entry["offset"]), int(entry["size"])
    start = int(np.frombuffer(job.entries, dtype=CQ_DTYPE)["size"][:index].sum(dtype=np.int64))
    found = why
    if not found:
        head = np.frombuffer(bytes(buf[start : start + _HEAD_DTYPE.itemsize]), _HEAD_DTYPE)[0]
        if int(head["magic"]) != MAGIC_CODE_V2 or int(head["physical"]) != at:
            found = "no record starting there"
        else:
            found = (
                f"a record of {int(head['total'])} bytes of queue id {int(head['queue_id'])} at "
                f"queue offset {int(head['queue_offset'])}"
            )
    topic, queue_id, offset = job.topic, job.queue_id, job.base_offset + index
    return SegmentEntryError(job.key, topic, queue_id, offset, at, size, found)


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
        wrong = _first_wrong_entry(job, data, records)
        if wrong is not None:
            raise _entry_error(job, data, *wrong)
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
