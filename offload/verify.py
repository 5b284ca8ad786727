"""``tmq verify``: a queue's manifest against what the bucket holds.

Per queue the verdict is:

- FAILURE: a segment the current manifest names is missing or damaged, or the manifest's
  segments do not form one contiguous range (a read of those offsets would fail);
- WARNING: objects under the queue's ``segments/`` that no manifest names (orphans: an upload
  that crashed before its commit, or a retention pass that crashed before its deletes), or
  segments left unchecked because the deadline came first;
- OK otherwise.

The tier is in use while this runs: the offloader uploads and commits, retention commits and
then deletes. So nothing is judged on one snapshot:

- a segment that looks missing or damaged is re-judged against a manifest loaded after the
  listing: retention may have removed it from the archive meanwhile (not a failure);
- an object no manifest named is an orphan only if, under the queue's offload lock (no upload
  or retention of this queue under way in this process), the manifest loaded then does not
  name it either. Only then may ``repair`` delete it, still under that lock. An object
  uploaded but not yet committed, or committed after the first load, is never deleted.

What is checked: without ``deep``, that every named object exists with the size the manifest
records, from the listing alone (one LIST request per 1,000 segments: the store checked the
body's CRC32 when the object was uploaded, decision 290, and objects are immutable).
``deep`` re-reads every segment and checks its CRC, in parallel on the caller's pool, until
``deadline`` (``time.monotonic()``); what is left by then is counted, and makes a WARNING.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Executor, Future
from concurrent.futures import TimeoutError as FutureTimeout
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

from tiered.cold.manifest import ManifestError, ManifestLog, QueueManifest, queue_prefix
from tiered.cold.segment import SegmentError, SegmentInfo, verify
from tiered.cold.storage import (
    ObjectNotFoundError,
    ObjectStore,
    StorageError,
    sweep_temporaries,
)

T = TypeVar("T")

OK, WARNING, FAILURE = "OK", "WARNING", "FAILURE"
_RANK = {OK: 0, WARNING: 1, FAILURE: 2}
# How long verify waits for a queue's offload lock before it leaves orphans unconfirmed.
LOCK_WAIT_S = 5.0


class QueueLock(Protocol):
    """The offloader's per-queue lock (``Offloader.queue_lock``)."""

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool: ...

    def release(self) -> None: ...


@dataclass(slots=True)
class QueueVerdict:
    topic: str
    queue_id: int
    status: str = OK
    missing: list[str] = field(default_factory=list)
    damaged: list[str] = field(default_factory=list)
    anomalies: list[str] = field(default_factory=list)
    orphans: list[str] = field(default_factory=list)
    repaired: list[str] = field(default_factory=list)
    unchecked: int = 0  # segments not checked before the deadline
    notes: list[str] = field(default_factory=list)  # what was not judged, and why


def worst(statuses: list[str]) -> str:
    return max(statuses, key=_RANK.__getitem__, default=OK)


def _gaps(manifest: QueueManifest) -> list[str]:
    out = []
    expected = manifest.start_offset
    for info in manifest.segments:
        if info.base_offset != expected:
            out.append(f"{info.key}: starts at {info.base_offset}, expected {expected}")
        expected = info.end_offset
    return out


def _check(tier: ObjectStore, info: SegmentInfo) -> str | None:
    """Why this listed segment is damaged (its bytes against its CRC), or None."""
    try:
        verify(tier, info)
    except ObjectNotFoundError:
        return "missing"  # deleted since the listing (retention): re-judged below
    except SegmentError as e:
        return str(e)
    return None


def _by(deadline: float | None, what: str, fn: Callable[[], T]) -> T:
    """``fn()``, one call to the tier, or ``StorageError`` once ``deadline`` has passed
    without its answer (decision 922): the call goes on in a daemon thread (the caller's tier
    retries nothing past the deadline, so it ends soon after), and the broker answers "could
    not verify" before the client's own timeout instead of waiting on a tier gone silent."""
    if deadline is None:
        return fn()
    out: Future[T] = Future()

    def run() -> None:
        try:
            out.set_result(fn())
        except BaseException as e:
            out.set_exception(e)

    threading.Thread(target=run, name="tmq-verify-tier", daemon=True).start()
    try:
        return out.result(timeout=max(0.0, deadline - time.monotonic()))
    except FutureTimeout:
        raise StorageError(f"{what}: no answer before the call's deadline") from None


@contextmanager
def _held(lock: QueueLock, timeout: float) -> Iterator[bool]:
    got = lock.acquire(timeout=max(0.0, timeout))
    try:
        yield got
    finally:
        if got:
            lock.release()


def verify_queue(
    tier: ObjectStore,
    cluster: str,
    broker: str,
    topic: str,
    queue_id: int,
    *,
    lock: QueueLock,
    repair: bool = False,
    deep: bool = False,
    pool: Executor | None = None,
    deadline: float | None = None,
    foreign: Callable[[QueueManifest], str | None] = lambda _m: None,
    first: QueueManifest | ManifestError | None = None,
) -> QueueVerdict:
    """``foreign(manifest)``: why this broker does not own the queue's prefix, if it does not
    (``Offloader.foreign``): the verdict is then a WARNING at best, since none of the queue's
    messages is archived, and ``repair`` deletes nothing, since what looks orphaned may be the
    other writer's upload in flight (decision 690). ``first``: the queue's manifest (or the
    error reading it) as the caller loaded it from the tier under its own deadline (the broker,
    decision 885); loaded here, with no deadline, when None."""
    verdict = QueueVerdict(topic, queue_id)
    store = ManifestLog(tier, queue_prefix(cluster, broker, topic, queue_id))
    try:
        if isinstance(first, ManifestError):
            raise first
        if first is None:
            first = store.load()
    except ManifestError as e:
        verdict.anomalies.append(f"manifest: {e}")
        verdict.status = FAILURE
        return verdict
    not_ours = foreign(first)
    if not_ours is not None:
        verdict.notes.append(not_ours)
        repair = False
    segments = f"{store.prefix}segments/"
    listed = {o.key: o.size for o in _by(deadline, f"list {segments}", lambda: tier.list(segments))}

    suspects = {s.key: "missing" for s in first.segments if s.key not in listed}
    for info in first.segments:
        if info.key in listed and listed[info.key] != info.size:
            suspects[info.key] = (
                f"{info.key}: {listed[info.key]} bytes, the manifest says {info.size}"
            )
    present = [s for s in first.segments if s.key not in suspects] if deep else []
    results: dict[str, str | None] = {}
    if pool is None:
        for info in present:
            if deadline is not None and time.monotonic() >= deadline:
                break
            results[info.key] = _check(tier, info)
    else:
        futures = {s.key: pool.submit(_check, tier, s) for s in present}
        for key, future in futures.items():
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0 and not future.done():
                future.cancel()
                continue
            try:
                results[key] = future.result(timeout=remaining)
            except TimeoutError:
                future.cancel()
    verdict.unchecked = len(present) - len(results)
    suspects.update({k: why for k, why in results.items() if why is not None})
    gaps = _gaps(first)

    latest = first
    if suspects or gaps:
        # Retention may have moved the archive on since the first load: judge the survivors.
        latest = _by(deadline, f"load {store.prefix}manifests/", store.load)
        named_now = {s.key for s in latest.segments}
        for key, why in sorted(suspects.items()):
            if key not in named_now:
                continue
            if why == "missing":
                if _by(deadline, f"head {key}", functools.partial(tier.size, key)) is None:
                    verdict.missing.append(key)
            else:
                verdict.damaged.append(why)
        gaps = _gaps(latest)
    verdict.anomalies += gaps

    named = {s.key for s in first.segments} | {s.key for s in latest.segments}
    candidates = sorted(k for k in listed if k not in named)
    if candidates:
        wait = LOCK_WAIT_S if deadline is None else min(LOCK_WAIT_S, deadline - time.monotonic())
        with _held(lock, wait) as locked:
            if not locked:
                verdict.notes.append(
                    f"{len(candidates)} object(s) not in the manifest left unjudged: the queue "
                    "was busy uploading or expiring"
                )
            else:
                # Nothing of this queue is being uploaded or expired now: what the current
                # manifest does not name is left over from an interrupted run.
                loaded = _by(deadline, f"load {store.prefix}manifests/", store.load)
                current = {s.key for s in loaded.segments}
                still = {
                    o.key for o in _by(deadline, f"list {segments}", lambda: tier.list(segments))
                }
                verdict.orphans = [k for k in candidates if k in still and k not in current]
                if repair and verdict.orphans:
                    not_ours = foreign(loaded)
                    if not_ours is not None:
                        verdict.notes.append(f"not repaired: {not_ours}")
                        repair = False
                if repair:
                    for key in verdict.orphans:
                        _by(deadline, f"delete {key}", functools.partial(tier.delete, key))
                        verdict.repaired.append(key)
    # A file:// tier's temporary files of killed writers (decision 1205) are orphans too, and
    # safe to delete under no lock: one whose writer may still be alive is never among them.
    if repair:
        verdict.repaired += sweep_temporaries(tier, store.prefix)
    else:
        verdict.orphans += sweep_temporaries(tier, store.prefix, delete=False)
    if verdict.unchecked:
        verdict.notes.append(f"{verdict.unchecked} segment(s) not checked before the deadline")
    if verdict.missing or verdict.damaged or verdict.anomalies:
        verdict.status = FAILURE
    elif (verdict.orphans and not repair) or verdict.unchecked or not_ours is not None:
        verdict.status = WARNING
    return verdict
