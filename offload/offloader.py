"""Moving a queue's dispatched messages into the cold tier.

For one (topic, queue) the pipeline is:

1. plan the next segments from the ConsumeQueue, starting at the manifest's end (the tier
   watermark): each a fresh key, a base offset and its entries (numpy, no Python per message);
2. hand each plan to the cold worker (``offload/segment_upload.py``, run by
   ``tiered/cold/worker.py`` in a child process, off the broker's GIL), several in flight: it
   reads the records from the CommitLog files, builds the segment object
   (``tiered/cold/segment.py``) and writes it with ``put_if_absent`` (the tier's one retry
   policy retries transient failures; a retry never replaces anything);
3. the worker verifies it: the stored object has the expected size and its footer is the one it
   wrote;
4. the broker commits the next manifest version (``_commit``: atomic, fenced, under the queue's
   lock) in offset order, whatever order the uploads finish in: one version for every upload
   landed when nothing more of the queue is in flight, or a pipeline's worth has landed;
5. only now does the watermark move, and with it what local release may delete.

A crash of the broker between 2 and 4 leaves an orphaned object, never a gap or a duplicate: the
next run starts again at the committed watermark and writes a new object under a new key, and
the restarted process deletes the orphan before it uploads anything to that queue (``verify``
reports it meanwhile; ``--repair`` deletes it too). A crash of the worker only loses the jobs it
held: the worker is restarted and each job runs again under the same key (idempotent). A pass
that fails deletes the objects it uploaded but did not commit.

In a replica group only the master writes the tier (``offload/leadership.py``). Its first write
to a queue in a new epoch *claims* the queue: a manifest version stamped with its epoch, before
the orphan sweep and any upload. From then on every commit of a deposed master of that prefix
is refused by the manifest's conditional put and reported as ``FencedError``: the offloader
stops writing the tier for good (until this broker leads a later epoch), and release keeps
every tiered file, so nothing local goes because of an upload this broker could not commit.
``upload_limit`` keeps a master's uploads below what every member of its SyncStateSet holds,
so the tier never holds a message that the next elected master lacks.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

import numpy as np

from offload.divergence import Divergence
from offload.leadership import Leadership, Term, single_broker
from offload.segment_upload import SegmentEntryError, SegmentJob, upload_segment, worker_threads
from tiered import failpoints
from tiered.cold.manifest import (
    ManifestConflictError,
    ManifestFencedError,
    ManifestLog,
    QueueManifest,
    queue_prefix,
    segment_key,
)
from tiered.cold.segment import SegmentError, SegmentInfo
from tiered.cold.storage import ObjectStore, StorageError, sweep_temporaries
from tiered.cold.worker import JobRunner, LocalRunner, WorkerCrashedError
from tiered.store import MessageStore

log = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(slots=True)
class OffloadPolicy:
    """When and how much to upload (the ``[offload]`` section of tmq.toml).

    The periodic job uploads a queue when any trigger fires: its oldest message not yet in the
    tier is ``upload_after_ms`` old, or ``upload_min_bytes`` / ``upload_min_messages`` are
    pending. Like Kafka's segment.ms / segment.bytes, but sized for object stores: big enough
    that a busy queue makes few, large objects; old enough bounds how long data lives only on
    one disk. Segment objects roll at ``segment_max_bytes`` or ``segment_max_messages``.
    ``tmq offload`` uploads at once, whatever the triggers say."""

    upload_after_ms: int = 60_000
    upload_min_bytes: int = 16 * 1024 * 1024
    upload_min_messages: int = 10_000
    segment_max_bytes: int = 64 * 1024 * 1024
    segment_max_messages: int = 100_000
    # Segment PUTs at once (one queue's, and the cold worker's across queues); one segment more
    # per queue is handed over, to be built while they run (decision 630): one PUT at a time
    # leaves the link idle while the next segment is built.
    parallel_uploads: int = 4


@dataclass(slots=True)
class RetentionResult:
    topic: str
    queue_id: int
    segments: int  # expired segments (removed, or that would be with dry_run)
    messages: int
    bytes: int
    new_start_offset: int
    deleted_keys: list[str]


@dataclass(slots=True)
class UploadLag:
    """How far a queue's archive is behind its hot store: what a crash of this disk would lose
    (Kafka's RemoteCopyLag, RocketMQ's tiered dispatch lag)."""

    messages: int
    bytes: int
    seconds: float  # age of the oldest message not yet uploaded; 0 when none is pending
    archived_bytes: int  # bytes of the segments the queue's manifest holds


@dataclass(slots=True)
class OffloadResult:
    topic: str
    queue_id: int
    segments: int
    messages: int
    bytes: int
    watermark: int


class OffloadError(RuntimeError):
    pass


class DamagedEntryOffloadError(OffloadError):
    """A queue's offload is held at a ConsumeQueue entry that names another record (decision
    730): no segment holding it is uploaded until a restart rebuilds the entry. The hold is
    logged by the offloader (``Offloader.held``, decision 755), not by whoever catches this."""

    def __init__(self, message: str, hold: OffloadHold) -> None:
        super().__init__(message)
        self.hold = hold


# While a queue's offload stays held at the same entry, the offloader says so again this often
# (every pass meets it again: every 10 s by default, every second in the tests).
HELD_LOG_INTERVAL_S = 600.0


@dataclass(slots=True)
class OffloadHold:
    """Where and why a queue's offload is held (decision 755): the queue offset of the damaged
    ConsumeQueue entry, what the CommitLog holds where it points (no secrets: offsets, sizes
    and the record's queue), and since when (milliseconds since the epoch)."""

    offset: int
    reason: str
    since_ms: int
    logged_at: float  # monotonic seconds of the last log line about it


class ArchiveAheadError(OffloadError):
    """A queue of an existing topic, about to be made tiered, ends below the end of an archive
    already under its prefix (decision 745): made tiered as it is, its messages at archived
    offsets would be released as uploaded."""


class CommitRefusedError(OffloadError):
    """A manifest commit was not made: another writer committed that version first, or this
    broker must not write the tier. Nothing was committed (unlike a storage error, after which
    the commit may have landed)."""


class NotLeaderError(CommitRefusedError):
    """This broker is a slave: only the master writes the tier."""


class FencedError(CommitRefusedError):
    """A master of a higher epoch owns this broker's tier prefix: this one was deposed and
    writes nothing there any more."""


class ForeignPrefixError(CommitRefusedError):
    """The queue's manifest was committed in this broker's epoch from another data directory:
    a broker started on a wiped or replaced disk, or a second broker given this one's name,
    against the same bucket. Its queues restart at offsets the archive already holds with other
    messages, so this broker writes nothing there and release keeps its files (decision 690)."""


@dataclass(slots=True)
class OffloadStats:
    """What this process has moved into and out of the tier since it started (metrics read it;
    plain ints bumped under the queue's lock, once per segment, never per message)."""

    uploaded_segments: int = 0
    uploaded_messages: int = 0
    uploaded_bytes: int = 0
    retention_segments: int = 0
    retention_messages: int = 0
    retention_bytes: int = 0
    # Segment objects deleted: expired ones, and orphans swept at start or by retention.
    deleted_objects: int = 0


class Offloader:
    """Uploads dispatched messages of tiered topics. One instance per broker; thread-safe per
    queue (a lock per queue serialises the periodic job and operator requests)."""

    def __init__(
        self,
        store: MessageStore,
        tier: ObjectStore,
        cluster: str,
        broker: str,
        policy: OffloadPolicy | None = None,
        on_commit: Callable[[str, int, QueueManifest], None] | None = None,
        leadership: Leadership | None = None,
        upload_limit: Callable[[], int | None] | None = None,
        runner: JobRunner | None = None,
        divergence: Divergence | None = None,
    ) -> None:
        """``runner`` runs the segment builds and uploads: the broker's cold worker (a child
        process); by default threads of this process against ``tier``. ``divergence``: the
        queues whose local end could not be checked against their archive at start (a
        standalone broker's; decision 750): each is checked when its manifest first loads."""
        self.store = store
        self.tier = tier
        self.cluster = cluster
        self.broker = broker
        self.policy = policy or OffloadPolicy()
        # Told every manifest this offloader commits or loads (the broker's cold fetcher), so
        # no reader in this process ever sees an older archive than the one local release
        # relies on: release trusts the manifest last committed or loaded here, and a commit
        # whose answer was lost is learnt by a load (decision 691).
        self.on_commit = on_commit
        # Whether, and in which epoch, this broker may write the tier (a single broker: always,
        # epoch 0).
        self.leadership = leadership or single_broker(broker)
        # The CommitLog offset below which records may be uploaded (None: no limit): a
        # master's high watermark (every member of its SyncStateSet holds what is below).
        self.upload_limit = upload_limit or (lambda: None)
        self.divergence = divergence
        # Set when a commit was refused for a higher epoch's: who took the prefix over.
        self.fenced_by: Term | None = None
        # The epoch in which each queue's manifest was claimed (and its orphans swept).
        self._claimed: dict[tuple[str, int], int] = {}
        # Queues whose prefix another data directory wrote, once logged (``foreign``).
        self._foreign_reported: set[tuple[str, int]] = set()
        self._manifests: dict[tuple[str, int], QueueManifest] = {}
        # Queues whose offload is held at a damaged ConsumeQueue entry (decision 755), until a
        # commit passes it (after the restart that rebuilds the entry: this is not persisted).
        self._held: dict[tuple[str, int], OffloadHold] = {}
        self.stats = OffloadStats()
        self._locks: dict[tuple[str, int], threading.RLock] = {}
        self._guard = threading.Lock()
        parallel = max(1, self.policy.parallel_uploads)
        self._own_runner = runner is None
        self.runner = runner or LocalRunner(
            tier, threads=worker_threads(parallel), max_inflight=worker_threads(parallel)
        )
        self._queues_pool = ThreadPoolExecutor(parallel, thread_name_prefix="tmq-offload")

    def manifests(self, topic: str, queue_id: int) -> ManifestLog:
        return ManifestLog(self.tier, queue_prefix(self.cluster, self.broker, topic, queue_id))

    def manifest(self, topic: str, queue_id: int, *, refresh: bool = False) -> QueueManifest:
        key = (topic, queue_id)
        if refresh or key not in self._manifests:
            with self._lock(topic, queue_id):
                manifest = self._step(
                    f"load manifest {topic}/{queue_id}", self.manifests(topic, queue_id).load
                )
                self._manifests[key] = manifest
                if self.on_commit is not None:
                    self.on_commit(topic, queue_id, manifest)
                if self.divergence is not None and self.foreign(manifest) is None:
                    # Before anything uses it: no upload, release or archive read of a queue
                    # whose start could not be checked until it has been (decision 750).
                    self.divergence.check(
                        topic, queue_id, manifest, self.store.max_offset(topic, queue_id)
                    )
        return self._manifests[key]

    def read_manifest(
        self, topic: str, queue_id: int, tier: ObjectStore | None = None
    ) -> QueueManifest:
        """The queue's current manifest from the tier, without its lock and without caching it
        (a load racing a commit must not put the older manifest back in the cache): what
        ``tmq verify`` judges, which must not wait on an upload under way (decision 885).
        ``tier``: the store to read it through (default: the offloader's), e.g. one whose
        calls give up at the caller's deadline (decision 920)."""
        prefix = queue_prefix(self.cluster, self.broker, topic, queue_id)
        return self._step(
            f"load manifest {topic}/{queue_id}", ManifestLog(tier or self.tier, prefix).load
        )

    def _leading(self) -> Term:
        """This broker's term, if it may write the tier now; raises otherwise."""
        term = self.leadership()
        if term is None:
            raise NotLeaderError("this broker is a slave: only the master writes the tier")
        if self.fenced_by is not None and self.fenced_by.epoch >= term.epoch:
            raise FencedError(
                f"fenced: {self.fenced_by.writer} took this tier prefix over in epoch "
                f"{self.fenced_by.epoch} (this broker's epoch is {term.epoch}); it writes "
                "nothing to the tier any more"
            )
        return term

    @property
    def fenced(self) -> bool:
        """Whether a commit was refused because a higher epoch owns the prefix (and this broker
        has not led a later epoch since)."""
        term = self.leadership()
        return (
            self.fenced_by is not None and term is not None and self.fenced_by.epoch >= term.epoch
        )

    def _fence(self, current: QueueManifest) -> FencedError:
        if self.fenced_by is None or current.epoch > self.fenced_by.epoch:
            self.fenced_by = Term(current.epoch, current.writer or "another master")
            log.error(
                "fenced: %s committed %smanifests/ v%d in epoch %d, above this broker's; "
                "this broker stops uploading, retention and tier-based release",
                self.fenced_by.writer,
                current.prefix,
                current.version,
                current.epoch,
            )
        self._manifests.clear()  # none of them is current any more
        return FencedError(
            f"{current.prefix}: fenced by {self.fenced_by.writer} (epoch {self.fenced_by.epoch})"
        )

    def claim(self, topic: str, queue_id: int) -> None:
        """Claim the queue for this broker's term now, rather than at its first upload (no I/O
        once claimed in this term): a new master calls it for every tiered queue, so a deposed
        master is fenced on every queue at once, busy or not."""
        with self._lock(topic, queue_id):
            self._claim(topic, queue_id)

    def _claim(self, topic: str, queue_id: int) -> QueueManifest:
        """The queue's manifest, claimed for this broker's term: on the first write of a term
        (or of a process), reload it, refuse if a higher epoch owns it, commit a version
        stamped with this epoch when it was written in a lower one (from then on a deposed
        master's commits are refused), and only then sweep orphans. Under the queue's lock."""
        term = self._leading()
        key = (topic, queue_id)
        unchecked = self.divergence is not None and key in self.divergence.pending
        if self._claimed.get(key) == term.epoch and not unchecked:
            return self.manifest(topic, queue_id)
        # A queue not checked against its archive is loaded again, which checks it, even when
        # claimed in this term: a topic made tiered again while the tier did not answer is
        # recorded unchecked (decision 750) over a claim and a manifest cached while it was
        # tiered before, and nothing of it may be uploaded until the check has run (decision
        # 790).
        manifest = self.manifest(topic, queue_id, refresh=True)
        if manifest.epoch > term.epoch:
            raise self._fence(manifest)
        foreign = self.foreign(manifest, term)
        if foreign is not None:
            if key not in self._foreign_reported:
                self._foreign_reported.add(key)
                log.error("%s", foreign)
            raise ForeignPrefixError(foreign)
        if manifest.end_offset > self.store.max_offset(topic, queue_id):
            # Only after an unclean failover (an ASYNC master died with messages it had
            # archived but not replicated): this master will write other messages at those
            # offsets, and the tier keeps the old ones.
            log.error(
                "%s: the tier holds offsets up to %d, this master's queue ends at %d: messages "
                "archived by a previous master were never replicated here",
                manifest.prefix,
                manifest.end_offset,
                self.store.max_offset(topic, queue_id),
            )
        if manifest.epoch < term.epoch or manifest.version == 0:
            # A higher epoch takes the prefix over; an empty prefix (no manifest yet) is
            # stamped with this directory's store before the sweep (decision 752): a second
            # broker of this name starting on it at the same time then finds a foreign prefix
            # (its own stamp is refused by the conditional create) and sweeps nothing, where
            # before the first commit neither could tell the other's uploads from orphans.
            manifest = manifest.next_version()
            self._commit(topic, queue_id, manifest)
            log.info(
                "%s: claimed for epoch %d by %s (manifest v%d)",
                manifest.prefix,
                term.epoch,
                term.writer,
                manifest.version,
            )
        self._sweep_orphans(manifest)
        self._claimed[key] = term.epoch
        return manifest

    def foreign(self, manifest: QueueManifest, term: Term | None = None) -> str | None:
        """Why this broker does not own ``manifest``'s prefix (None: it does): the manifest was
        committed in this broker's epoch by a broker on another data directory. A higher epoch
        is a fence (``_fence``); a lower one is a term this broker's claim takes over (a new
        master of the replica group); a manifest without a directory identity (committed before
        decision 690) is taken as this directory's."""
        term = term or self.leadership()
        if term is None or not manifest.store or manifest.epoch != term.epoch:
            return None
        if manifest.store == self.store.store_id:
            return None
        return (
            f"{manifest.prefix}: this tier prefix was written from another data directory "
            f"(store {manifest.store}, by {manifest.writer or 'unknown'} in epoch "
            f"{manifest.epoch}; this broker's store is {self.store.store_id}): a wiped or "
            "replaced disk, or a second broker with this broker's name and bucket. Its queues "
            "would reuse offsets the archive holds other messages at, so this broker uploads "
            "nothing there and keeps its local files. Give this broker another name, or move "
            "the old archive out of the prefix (docs/operations.md)"
        )

    def _sweep_orphans(self, manifest: QueueManifest) -> None:
        """Delete segment objects the manifest does not name: uploads a crash (or a deposed
        master) cut off before their commit, and expired segments a crash left behind after
        theirs. Runs once per queue per term, under the queue's lock, after the claim and
        before this process uploads anything there: a broker name owns its prefix and a
        deposed master can commit nothing after the claim, so nothing an orphan-to-be could
        still become part of the archive."""
        named = {s.key for s in manifest.segments}
        listed = self._step(
            f"list {manifest.prefix}segments/",
            lambda: self.tier.list(f"{manifest.prefix}segments/"),
        )
        for obj in listed:
            if obj.key not in named:
                log.warning(
                    "%s: not in the manifest (an interrupted upload or expiry); deleted", obj.key
                )
                self._step(f"delete {obj.key}", functools.partial(self.tier.delete, obj.key))
                self.stats.deleted_objects += 1
        # A file:// tier's temporary files of writers killed mid-write (decision 1205): hidden
        # from the listing, and nothing else ever deletes them.
        for key in sweep_temporaries(self.tier, manifest.prefix):
            log.warning("%s: a temporary file of a killed writer; deleted", key)

    def cached_manifest(self, topic: str, queue_id: int) -> QueueManifest | None:
        """The last manifest this process loaded or committed, without asking the tier (None
        before the first load): what metrics and status read, so a scrape never waits on S3."""
        return self._manifests.get((topic, queue_id))

    def archived_bytes(self) -> int:
        """Bytes of every segment in the cached manifests (the cold tier's size, as committed)."""
        return sum(s.size for m in list(self._manifests.values()) for s in m.segments)

    def upload_lag(self, topic: str, queue_id: int, now_ms: int) -> UploadLag | None:
        """The queue's upload lag from the cached manifest and the local ConsumeQueue; None
        before this process has loaded the queue's manifest (no call to the tier here)."""
        manifest = self.cached_manifest(topic, queue_id)
        if manifest is None:
            return None
        archived = sum(s.size for s in manifest.segments)
        start = manifest.end_offset
        if self.foreign(manifest) is not None:
            archived, start = 0, 0  # none of this queue's messages is archived (decision 690)
        end = self.store.max_offset(topic, queue_id)
        if end <= start:
            return UploadLag(0, 0, 0.0, archived)
        hot_min = self.store.hot_min_offset(topic, queue_id)
        oldest = self.store.store_timestamp_at(topic, queue_id, max(start, hot_min))
        return UploadLag(
            end - start,
            self.store.queue_bytes(topic, queue_id, start, end),
            max(0.0, (now_ms - oldest) / 1000) if oldest is not None else 0.0,
            archived,
        )

    def watermark(self, topic: str, queue_id: int) -> int:
        """Every queue offset below this is durable in the tier."""
        return self.manifest(topic, queue_id).end_offset

    def release_watermark(self, topic: str, queue_id: int) -> int:
        """The watermark local release may trust: ``FencedError`` on a fenced broker, whose
        own uploads may never have been committed and whose log may differ from the new
        master's at the offsets that master archived (it keeps everything)."""
        if self.fenced:
            raise FencedError(f"{topic}/{queue_id}: fenced; local files are kept")
        manifest = self.manifest(topic, queue_id)
        foreign = self.foreign(manifest)
        if foreign is not None:
            raise ForeignPrefixError(foreign)
        if self.divergence is not None:
            if (topic, queue_id) in self.divergence.pending:
                raise OffloadError(
                    f"{topic}/{queue_id}: not yet checked against its archive; local files kept"
                )
            local_from = self.divergence.local_from(topic, queue_id)
            if local_from is not None:
                # Offsets from there on hold messages the archive does not: kept locally.
                return min(manifest.end_offset, local_from)
        return manifest.end_offset

    def due(self, topic: str, queue_id: int, now_ms: int) -> str | None:
        """Why this queue should be uploaded now (a trigger of the policy), or None."""
        start = self.watermark(topic, queue_id)
        pending = self.store.max_offset(topic, queue_id) - start
        if pending <= 0:
            return None
        if pending >= self.policy.upload_min_messages:
            return f"{pending} messages pending"
        stored_ms = self.store.store_timestamp_at(topic, queue_id, start)
        if stored_ms is None:
            return "pending messages are no longer local"  # let offload_queue report the gap
        if now_ms - stored_ms >= self.policy.upload_after_ms:
            return f"oldest pending message is {(now_ms - stored_ms) / 1000:.0f} s old"
        pending_bytes = self.store.queue_bytes(topic, queue_id, start, start + pending)
        if pending_bytes >= self.policy.upload_min_bytes:
            return f"{pending_bytes} bytes pending"
        return None

    def _lock(self, topic: str, queue_id: int) -> threading.RLock:
        with self._guard:
            return self._locks.setdefault((topic, queue_id), threading.RLock())

    def queue_lock(self, topic: str, queue_id: int) -> threading.RLock:
        """The lock held while this queue uploads, commits or expires: whoever holds it sees
        no upload of the queue under way (``tmq verify --repair`` deletes orphans under it)."""
        return self._lock(topic, queue_id)

    def offload_queue(self, topic: str, queue_id: int, up_to: int | None = None) -> OffloadResult:
        """Upload dispatched messages of one queue below ``up_to`` (default: all dispatched)."""
        with self._lock(topic, queue_id):
            manifest = self._claim(topic, queue_id)
            target = (
                self.store.max_offset(topic, queue_id)
                if up_to is None
                else min(up_to, self.store.max_offset(topic, queue_id))
            )
            result = OffloadResult(topic, queue_id, 0, 0, 0, manifest.end_offset)
            # The first readable offset, from the manifest just loaded: the fetcher's cache may
            # not hold it yet (decision 520).
            hot_min = self.store.hot_min_offset(topic, queue_id)
            if manifest.segments:
                hot_min = min(hot_min, manifest.start_offset)
            if manifest.end_offset < hot_min and target > manifest.end_offset:
                # Released locally before it was ever uploaded (tiering turned on late): say so
                # and record where the archive starts, rather than leave a silent gap.
                log.warning(
                    "%s/%d: offsets %d..%d are no longer in the hot store and were never "
                    "uploaded; the archive starts at %d",
                    topic,
                    queue_id,
                    manifest.end_offset,
                    hot_min - 1,
                    hot_min,
                )
                manifest = manifest.without_segments_before(hot_min)
                manifest.log_start_offset = hot_min
                self._commit(topic, queue_id, manifest)
            plans = self._plan_segments(topic, queue_id, manifest.end_offset, target)
            parallel = max(1, self.policy.parallel_uploads)
            # One job more than the PUTs at once: the worker builds it while they run and
            # starts its PUT the moment one ends (decision 630).
            in_flight = parallel + 1
            uploads: deque[tuple[SegmentJob, Future[SegmentInfo]]] = deque()
            # Uploaded and verified, not committed yet: offset order, each continuing the last.
            landed: list[SegmentInfo] = []
            try:
                while True:
                    self._fill(uploads, plans, in_flight)
                    if not uploads:
                        break
                    job, future = uploads[0]
                    info = self._uploaded(job, future)
                    uploads.popleft()
                    landed.append(info)
                    # The uploads behind it that have landed too join the same batch, still in
                    # offset order (decision 411).
                    while uploads and _landed(uploads[0][1]):
                        landed.append(uploads.popleft()[1].result())
                    self._fill(uploads, plans, in_flight)
                    # One manifest version (a PUT, a LIST, a prune) when nothing more of the
                    # queue is in flight or a pipeline's worth has landed, not one per batch
                    # that happened to land together: a pass of a few segments per queue makes
                    # one commit per queue (decision 560).
                    if uploads and len(landed) < parallel:
                        continue
                    batch, landed = landed, []
                    manifest = self._commit_uploads(topic, queue_id, manifest, batch, result)
            except BaseException:
                if landed:
                    # What landed before the failure is committed all the same, as it was when
                    # every landed upload was committed at once: the next pass starts after it.
                    batch, landed = landed, []
                    try:
                        manifest = self._commit_uploads(topic, queue_id, manifest, batch, result)
                    except Exception as e:
                        log.warning(
                            "%s/%d: %d upload(s) before a failure not committed: %s",
                            topic,
                            queue_id,
                            len(batch),
                            e,
                        )
                raise
            finally:
                self._abandon(uploads)
            result.watermark = manifest.end_offset
            return result

    def _fill(
        self,
        uploads: deque[tuple[SegmentJob, Future[SegmentInfo]]],
        plans: Iterator[SegmentJob],
        parallel: int,
    ) -> None:
        """Hand the worker the next planned segments until ``parallel`` are in flight."""
        while len(uploads) < parallel:
            job = next(plans, None)
            if job is None:
                return
            uploads.append((job, self.runner.submit(upload_segment, job)))

    def _commit_uploads(
        self,
        topic: str,
        queue_id: int,
        manifest: QueueManifest,
        batch: list[SegmentInfo],
        result: OffloadResult,
    ) -> QueueManifest:
        """Commit ``batch`` (landed uploads continuing ``manifest``) as the next version and
        count it; a refused commit deletes the batch's objects (keys unique to their plans)."""
        manifest = manifest.with_segments(batch)
        failpoints.hit("offload.before_commit")
        try:
            self._commit(topic, queue_id, manifest)
        except CommitRefusedError:
            for info in batch:
                self._discard(info.key)
            raise
        for info in batch:
            result.segments += 1
            result.messages += info.count
            result.bytes += info.size
            self.stats.uploaded_segments += 1
            self.stats.uploaded_messages += info.count
            self.stats.uploaded_bytes += info.size
        result.watermark = manifest.end_offset
        return manifest

    def offload_queues(
        self, queues: Sequence[tuple[str, int]]
    ) -> list[OffloadResult | BaseException]:
        """``offload_queue`` for several queues at once (up to ``parallel_uploads``), each
        isolated: the result or the exception of each, in the order given."""
        futures = [self._queues_pool.submit(self.offload_queue, t, q) for t, q in queues]
        out: list[OffloadResult | BaseException] = []
        for f in futures:
            error = f.exception()
            out.append(error if error is not None else f.result())
        return out

    def expire(
        self,
        topic: str,
        queue_id: int,
        cutoff_ms: int,
        *,
        max_bytes: int | None = None,
        dry_run: bool = False,
    ) -> RetentionResult:
        """Remove the archive's oldest segments whose every message was stored before
        ``cutoff_ms``, and then more of the oldest while the archive holds over ``max_bytes``:
        first from the manifest (a new version), then their objects. Segments go
        whole and only from the front, so the archive never has holes. Idempotent; a crash
        between the commit and the deletes leaves orphans, which the next start sweeps (and
        ``tmq verify`` reports meanwhile)."""
        with self._lock(topic, queue_id):
            self._claim(topic, queue_id)
            manifest = self.manifest(topic, queue_id, refresh=True)
            expired = []
            remaining = sum(s.size for s in manifest.segments)
            for info in manifest.segments:
                too_big = max_bytes is not None and remaining > max_bytes
                if info.max_store_timestamp >= cutoff_ms and not too_big:
                    break
                expired.append(info)
                remaining -= info.size
            result = RetentionResult(
                topic,
                queue_id,
                len(expired),
                sum(s.count for s in expired),
                sum(s.size for s in expired),
                expired[-1].end_offset if expired else manifest.start_offset,
                [s.key for s in expired],
            )
            if dry_run or not expired:
                return result
            self._commit(topic, queue_id, manifest.without_segments_before(expired[-1].end_offset))
            failpoints.hit("retention.before_delete")
            for info in expired:
                self._step(f"delete {info.key}", functools.partial(self.tier.delete, info.key))
                self.stats.deleted_objects += 1
            self.stats.retention_segments += result.segments
            self.stats.retention_messages += result.messages
            self.stats.retention_bytes += result.bytes
            log.info(
                "%s/%d: retention removed %d segment(s), %d messages; the archive now starts at %d",
                topic,
                queue_id,
                result.segments,
                result.messages,
                result.new_start_offset,
            )
            return result

    def _plan_segments(
        self, topic: str, queue_id: int, start: int, target: int
    ) -> Iterator[SegmentJob]:
        """The segments that take the queue from ``start`` to ``target``, each planned when the
        pipeline has room for it: a fresh key and the ConsumeQueue entries, cut at
        ``segment_max_messages`` or the record that reaches ``segment_max_bytes``, and stopped
        at ``upload_limit`` (the SyncStateSet's high watermark in a replica group)."""
        prefix = queue_prefix(self.cluster, self.broker, topic, queue_id)
        config = self.store.config
        while start < target:
            limit = min(target - start, self.policy.segment_max_messages)
            entries = self.store.queue_entry_table(topic, queue_id, start, limit)
            if len(entries) == 0:
                raise OffloadError(f"{topic}/{queue_id}: offset {start} is not in the hot store")
            below = self.upload_limit()
            if below is not None:
                # Queue offsets grow with CommitLog offsets: only a prefix can be below the
                # limit, and nothing later is; what is not on every in-sync replica waits.
                ends = entries["offset"].astype(np.int64) + entries["size"]
                entries = entries[: int(np.searchsorted(ends, below, side="right"))]
                if len(entries) == 0:
                    return
            reach = np.cumsum(entries["size"], dtype=np.int64)
            count = min(
                len(entries), int(np.searchsorted(reach, self.policy.segment_max_bytes)) + 1
            )
            last = entries[count - 1]
            if int(last["offset"]) + int(last["size"]) > self.store.flushed_offset:
                # Never archive a record this broker's own disk may still lose (ASYNC flush:
                # the page cache only): after a power loss its queue would reuse the offsets
                # the archive holds, and release would take the new messages for archived
                # ones. One fsync, and only for records younger than the flush interval
                # (decision 693).
                self.store.flush_commitlog()
            yield SegmentJob(
                key=segment_key(prefix, start),
                base_offset=start,
                entries=entries[:count].tobytes(),
                commitlog_dir=str(config.commitlog_dir),
                commitlog_file_size=config.commitlog_file_size,
                put_slots=max(1, self.policy.parallel_uploads),
                topic=topic,
                queue_id=queue_id,
            )
            start += count

    def _uploaded(self, job: SegmentJob, future: Future[SegmentInfo]) -> SegmentInfo:
        """The verified footer of ``job``'s upload. A crash of the worker runs the job again
        (same key: idempotent) on the restarted worker, twice at most."""
        for attempt in range(3):
            try:
                return self._step(f"upload {job.key}", future.result)
            except OffloadError as e:
                if isinstance(e.__cause__, SegmentEntryError):
                    raise self._damaged_entry(e.__cause__) from e
                if not isinstance(e.__cause__, WorkerCrashedError) or attempt == 2:
                    raise
                log.warning("%s: the cold worker crashed during the upload; again", job.key)
                future = self.runner.submit(upload_segment, job)
        raise AssertionError("unreachable")

    def _damaged_entry(self, e: SegmentEntryError) -> DamagedEntryOffloadError:
        """A segment refused because one of its ConsumeQueue entries names another record: the
        queue's offload stops at that entry (the archive keeps what is before it, the local
        files stay, as release keeps everything above the watermark) and the entry is noted for
        the next start, which rebuilds it from the CommitLog (decisions 686, 730). The hold is
        kept for ``held`` (the admin status) and logged when it starts or moves, then every
        ``HELD_LOG_INTERVAL_S`` while it lasts, not on every pass (decision 755)."""
        self.store.note_damaged_entry(e.topic, e.queue_id, e.offset)
        reason = (
            f"the ConsumeQueue entry names CommitLog [{e.at}, {e.at + e.size}), which holds "
            f"{e.found}, not its record"
        )
        key, now = (e.topic, e.queue_id), time.monotonic()
        with self._guard:
            hold = self._held.get(key)
            fresh = hold is None or hold.offset != e.offset or hold.reason != reason
            if hold is None or fresh:
                hold = OffloadHold(e.offset, reason, time.time_ns() // 1_000_000, now)
                self._held[key] = hold
            loud = fresh or now - hold.logged_at >= HELD_LOG_INTERVAL_S
            if loud:
                hold.logged_at = now
        message = (
            f"{e.topic}/{e.queue_id}: offload held at queue offset {e.offset}: {reason}; nothing "
            "of that segment was uploaded and the local files are kept; restart the broker to "
            "rebuild the entry from the CommitLog (noted in damaged_entries)"
        )
        if fresh:
            log.error("%s", message)
        elif loud:
            since = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(hold.since_ms / 1000))
            log.error("%s (still, since %s)", message, since)
        return DamagedEntryOffloadError(message, hold)

    def held(self, topic: str, queue_id: int) -> OffloadHold | None:
        """Where the queue's offload is held at a damaged ConsumeQueue entry; None when it is
        not (decision 755)."""
        with self._guard:
            return self._held.get((topic, queue_id))

    def _release_hold(self, topic: str, queue_id: int, manifest: QueueManifest) -> None:
        """A commit past the held entry ends the hold (the entry was rebuilt: a restart)."""
        with self._guard:
            hold = self._held.get((topic, queue_id))
            if hold is None or manifest.end_offset <= hold.offset:
                return
            del self._held[(topic, queue_id)]
        log.warning(
            "%s/%d: offload no longer held at queue offset %d; the tier watermark is %d",
            topic,
            queue_id,
            hold.offset,
            manifest.end_offset,
        )

    def _abandon(self, uploads: deque[tuple[SegmentJob, Future[SegmentInfo]]]) -> None:
        """After a failed pass: wait for the uploads still under way and delete what they wrote
        (never committed, under keys nobody else uses), so that a failed pass leaves no orphan
        behind when the tier answers. Best effort: the start-up sweep and ``verify`` remain."""
        for job, future in uploads:
            with contextlib.suppress(Exception):  # the object may exist all the same
                future.result()
            try:
                self.tier.delete(job.key)
            except Exception as e:
                log.warning("%s: an uncommitted upload could not be deleted: %s", job.key, e)

    def _discard(self, key: str) -> None:
        """Delete a segment whose commit was refused: its key is unique to this upload and no
        manifest can name it now, so it would only be an orphan (a fenced master leaves nothing
        behind). Best effort: the next claim's sweep or ``verify --repair`` get what stays."""
        try:
            self.tier.delete(key)
            self.stats.deleted_objects += 1
        except StorageError as e:
            log.warning("%s: not deleted after its refused commit: %s", key, e)

    def _commit(self, topic: str, queue_id: int, manifest: QueueManifest) -> None:
        """Commit ``manifest`` stamped with this broker's term. Refused (``FencedError``) when a
        higher epoch committed first; then this broker writes the tier no more."""
        term = self._leading()
        manifest.epoch, manifest.writer = term.epoch, term.writer
        manifest.store = self.store.store_id
        store = self.manifests(topic, queue_id)
        try:
            self._step(
                f"commit manifest {store.prefix} v{manifest.version}",
                lambda: store.commit(manifest),
            )
        except OffloadError:
            # The store failed to answer, not necessarily to write: the commit may have
            # landed. The next pass starts from the manifest as the tier has it, rather than
            # upload the same range again and meet its own commit as "another writer".
            self._manifests.pop((topic, queue_id), None)
            raise
        except ManifestFencedError as e:
            raise self._fence(e.current) from None
        except ManifestConflictError:
            self._manifests.pop((topic, queue_id), None)
            self._claimed.pop((topic, queue_id), None)
            current = self.manifest(topic, queue_id)
            if current.epoch > term.epoch:
                raise self._fence(current) from None
            raise CommitRefusedError(
                f"{store.prefix}: another writer committed a manifest; is a second "
                "broker offloading to the same prefix?"
            ) from None
        self._manifests[(topic, queue_id)] = manifest
        self._release_hold(topic, queue_id, manifest)
        if self.on_commit is not None:
            self.on_commit(topic, queue_id, manifest)

    def _step(self, what: str, fn: Callable[[], T]) -> T:
        """One step of a pass against the tier. Retries are the tier's (``RetryPolicy``, one
        layer); what still fails fails the pass, and the next pass starts again from the
        committed watermark."""
        try:
            return fn()
        except (StorageError, SegmentError) as e:
            raise OffloadError(f"{what}: {e}") from e

    def close(self) -> None:
        """Stop the threads this offloader started (not the runner it was given)."""
        self._queues_pool.shutdown(wait=False, cancel_futures=True)
        if self._own_runner:
            self.runner.close()


def _landed(future: Future[SegmentInfo]) -> bool:
    """Whether an upload has finished and succeeded (a failed one is left to ``_uploaded``)."""
    return future.done() and not future.cancelled() and future.exception() is None
