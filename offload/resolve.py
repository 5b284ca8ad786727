"""``tmq offload resolve``: end a queue's divergence from its archive (decisions 750, 800).

A conflict ``[base, archive_end)`` (``offload/divergence.py``) means two lineages hold those
offsets: the archive's older messages, and messages this data directory acknowledged while it
could not check its archive. Kafka's unclean leader election settles the same split by
truncating one side, and the messages it truncates are gone. Here the archive is made the
truth for its offsets, and the local messages are not dropped but **re-appended** at the
queue's end: the same body, keys, tag, properties and message id (``UNIQ_KEY``), with two
properties added, ``TMQ_DIVERGED_FROM`` (their old queue offset) and ``TMQ_DIVERGED_RANGE``
(``base-archive_end``). Then the queue's floor is raised to the archive's end, so offsets below
it are read from the archive, and the conflict is gone.

Steps, each crash-safe (a kill at any point leaves the conflict, with nothing lost, or the
resolved queue; a second run after a crash finishes the first):

1. Under the queue's offload lock (no upload, commit, expiry or repair of the queue meanwhile,
   and no second resolve), the manifest is loaded from the tier (it must answer: a resolve
   that cannot see the archive refuses) and must still be this directory's and end at or
   above the conflict's ``archive_end``.
2. ``copies_from`` (the queue's end now) is recorded in ``tier-divergence.json`` before any
   copy (``Divergence.begin_resolve``). A run that finds it set scans the queue from there for
   copies already made (they carry ``TMQ_DIVERGED_RANGE``) and appends only the rest. Copies
   are appended in offset order, and a crash keeps a prefix of what was appended, so that scan
   finds exactly the copies made: none is made twice.
3. The copies are appended and the store flushed (CommitLog and ConsumeQueues fsynced, whatever
   the flush mode), and every copy is read back and compared with its original.
4. The commit point, one atomic write of ``tier-divergence.json``: the conflict goes and the
   queue's floor (``archive_end``) is recorded to be raised (``Divergence.commit_resolve``).
5. The store raises the floor durably (``queue-floors.json``), then the record of it is
   dropped. A start that finds a floor recorded and not dropped raises it before serving.

Until step 4 the conflict stands and nothing changed for readers but the copies at the end
(consumers receive them as new messages: the duplicates this design accepts, each with its
original message id). Between steps 4 and 5, in a running broker, a read of an offset in the
range may still be answered from the local files. With ``discard_local`` the local messages
of the range are not copied: steps 2-3 are skipped, and the caller must name how many
messages it discards (``E - base``), so a stale confirmation never discards another range.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass

from offload.divergence import Conflict, Divergence
from offload.offloader import Offloader, OffloadError
from tiered import failpoints
from tiered.record import Message, StoredMessage
from tiered.store import GetStatus, MessageStore

log = logging.getLogger(__name__)

PROPERTY_DIVERGED_FROM = "TMQ_DIVERGED_FROM"
PROPERTY_DIVERGED_RANGE = "TMQ_DIVERGED_RANGE"
# Copies appended (and originals read) per batch.
BATCH = 64
# How long a resolve waits for the queue's offload lock (an upload under way) before it refuses.
LOCK_WAIT_S = 30.0


class ResolveRefusedError(RuntimeError):
    """The resolve cannot run now, and changed nothing: the reason says why."""


class NoConflictError(ResolveRefusedError):
    """The queue has no conflict with its archive to resolve."""


class QueueBusyError(ResolveRefusedError):
    """The queue's offload lock was held past ``LOCK_WAIT_S`` (an upload): try again."""


class TierUnavailableError(ResolveRefusedError):
    """The archive's manifest could not be loaded: the resolve needs to see it."""


@dataclass(frozen=True, slots=True)
class Resolved:
    base: int
    archive_end: int
    copied: int  # copies appended by this run
    copies_from: int | None  # where the copies begin (None: discarded)
    copies_end: int | None  # the queue offset after the last copy


def copy_of(original: StoredMessage, rng: str) -> Message:
    """The re-appended copy of a local message: everything a consumer sees, and its id."""
    return Message(
        topic=original.topic,
        body=original.body,
        queue_id=original.queue_id,
        properties={
            **original.properties,
            PROPERTY_DIVERGED_FROM: str(original.queue_offset),
            PROPERTY_DIVERGED_RANGE: rng,
        },
        flag=original.flag,
        born_timestamp=original.born_timestamp,
        born_host=original.born_host,
        reconsume_times=original.reconsume_times,
    )


def _hot(
    store: MessageStore, topic: str, queue_id: int, start: int, end: int
) -> list[StoredMessage]:
    """The local messages of ``[start, end)``, every one of them, or ``ResolveRefusedError``."""
    out: list[StoredMessage] = []
    offset = start
    while offset < end:
        got = store.get_messages(topic, queue_id, offset, min(BATCH, end - offset), hot_only=True)
        if got.status is not GetStatus.FOUND or not got.messages:
            raise ResolveRefusedError(
                f"{topic}/{queue_id}: the local message at offset {offset} cannot be read "
                f"({got.status.value}); nothing was changed"
            )
        for m in got.messages:
            if m.queue_offset != offset:
                raise ResolveRefusedError(
                    f"{topic}/{queue_id}: expected the local message at offset {offset}, read "
                    f"{m.queue_offset}; nothing was changed"
                )
            out.append(m)
            offset += 1
            if offset == end:
                break
    return out


def _same(copy: StoredMessage, original: StoredMessage, rng: str) -> bool:
    want = {
        **original.properties,
        PROPERTY_DIVERGED_FROM: str(original.queue_offset),
        PROPERTY_DIVERGED_RANGE: rng,
    }
    return copy.body == original.body and copy.properties == want


def resolve(
    store: MessageStore,
    offloader: Offloader,
    divergence: Divergence,
    topic: str,
    queue_id: int,
    *,
    discard_local: int | None = None,
    lock_wait_s: float = LOCK_WAIT_S,
) -> Resolved:
    """Resolve the queue's conflict (module docstring). ``discard_local``: the number of local
    messages the caller agreed to lose (must be ``archive_end - base``); None: copy them.
    ``lock_wait_s``: how long to wait for the queue's lock (0: not at all)."""
    lock = offloader.queue_lock(topic, queue_id)
    if not (lock.acquire(timeout=lock_wait_s) if lock_wait_s > 0 else lock.acquire(False)):
        raise QueueBusyError(
            f"{topic}/{queue_id}: an upload of the queue did not finish within {lock_wait_s:g} s; "
            "try again"
        )
    try:
        conflict = divergence.conflicts.get((topic, queue_id))
        if conflict is None:
            why = (
                " (its check has not run yet: the object store has not answered)"
                if (topic, queue_id) in divergence.pending
                else ""
            )
            raise NoConflictError(f"{topic}/{queue_id} has no conflict with its archive{why}")
        try:
            manifest = offloader.manifest(topic, queue_id, refresh=True)
        except OffloadError as e:
            raise TierUnavailableError(
                f"{topic}/{queue_id}: the archive's manifest could not be loaded ({e}); "
                "nothing was changed"
            ) from e
        foreign = offloader.foreign(manifest)
        if foreign is not None:
            raise ResolveRefusedError(f"{topic}/{queue_id}: {foreign}; nothing was changed")
        base, end = conflict.base, conflict.archive_end
        if manifest.end_offset < end:
            raise ResolveRefusedError(
                f"{topic}/{queue_id}: the archive ends at {manifest.end_offset}, below the "
                f"{end} the conflict was found with; nothing was changed"
            )
        local_end = store.max_offset(topic, queue_id)
        if local_end < end:
            # Its next messages would still take offsets the archive holds: the copies too.
            raise ResolveRefusedError(
                f"{topic}/{queue_id} ends at {local_end}, below its archive's end {end}: "
                "resolve it once it has taken messages past that end (its new messages at "
                "archived offsets are in the conflict too); nothing was changed"
            )
        if store.hot_min_offset(topic, queue_id) > base:
            raise ResolveRefusedError(
                f"{topic}/{queue_id}: its local files start at "
                f"{store.hot_min_offset(topic, queue_id)}, above the conflict's {base}; "
                "nothing was changed"
            )
        if discard_local is not None:
            if conflict.copies_from is not None:
                raise ResolveRefusedError(
                    f"{topic}/{queue_id}: a resolve that copies began at offset "
                    f"{conflict.copies_from}; run it again without discarding"
                )
            if discard_local != end - base:
                raise ResolveRefusedError(
                    f"{topic}/{queue_id}: the conflict holds {end - base} local message(s) "
                    f"(offsets {base}..{end - 1}), not {discard_local}; nothing was changed"
                )
            # The queue's end was checked above: durable before the commit says so (under
            # ASYNC flush a power loss could otherwise leave it below the floor, decision 980).
            store.flush()
            divergence.commit_resolve(topic, queue_id)
            log.warning(
                "%s/%d: divergence resolved by DISCARDING the %d local message(s) at offsets "
                "%d..%d, as the operator asked: the archive's messages are read there",
                topic,
                queue_id,
                end - base,
                base,
                end - 1,
            )
            _raise_floor(store, divergence, topic, queue_id, end)
            return Resolved(base, end, 0, None, None)
        copied, copies_from, copies_end = _copy(store, divergence, topic, queue_id, conflict)
        failpoints.hit("resolve.before_commit")
        divergence.commit_resolve(topic, queue_id)
        log.warning(
            "%s/%d: divergence resolved: the %d local message(s) of offsets %d..%d re-appended "
            "at %d..%d (%d by this run); offsets below %d are read from the archive",
            topic,
            queue_id,
            end - base,
            base,
            end - 1,
            copies_from,
            copies_end - 1,
            copied,
            end,
        )
        _raise_floor(store, divergence, topic, queue_id, end)
        return Resolved(base, end, copied, copies_from, copies_end)
    finally:
        lock.release()


def _copy(
    store: MessageStore, divergence: Divergence, topic: str, queue_id: int, conflict: Conflict
) -> tuple[int, int, int]:
    """Steps 2 and 3: (copies appended now, where the copies begin, the offset after them).
    Streams in batches of ``BATCH``: memory does not grow with the range."""
    base, end = conflict.base, conflict.archive_end
    rng = f"{base}-{end}"
    for _ in _originals(store, topic, queue_id, base, end):
        pass  # every original readable before anything is recorded or appended
    # Durable up to the queue's end before that end is recorded: a power loss after this
    # never leaves the queue ending below where the copies begin.
    top = store.max_offset(topic, queue_id)
    store.flush()
    begun = divergence.begin_resolve(topic, queue_id, top)
    assert begun.copies_from is not None
    # Copies a run before this one made: a prefix of the originals, in order.
    made, _ = _check_copies(store, topic, queue_id, begun.copies_from, base, end, rng)
    copied = 0
    batch: list[Message] = []
    for m in _originals(store, topic, queue_id, base + made, end):
        batch.append(copy_of(m, rng))
        if len(batch) == BATCH or m.queue_offset == end - 1:
            store.put_messages(batch)
            copied += len(batch)
            batch = []
            failpoints.hit("resolve.mid_copy")
    store.flush()  # fsynced before the commit point, whatever the flush mode
    store.wait_dispatched()
    # Read back every copy: the commit point drops the originals from reads.
    n, last = _check_copies(store, topic, queue_id, begun.copies_from, base, end, rng)
    if n != end - base:
        raise ResolveRefusedError(
            f"{topic}/{queue_id}: {n} of {end - base} copies read back; the conflict stands "
            "(run it again)"
        )
    return copied, begun.copies_from, last + 1


def _originals(
    store: MessageStore, topic: str, queue_id: int, start: int, end: int
) -> Iterator[StoredMessage]:
    for offset in range(start, end, BATCH):
        yield from _hot(store, topic, queue_id, offset, min(end, offset + BATCH))


def _copies(
    store: MessageStore, topic: str, queue_id: int, start: int, rng: str
) -> Iterator[StoredMessage]:
    """The copies of this range in the queue from ``start`` on, in order."""
    top = store.max_offset(topic, queue_id)
    for offset in range(start, top, BATCH):
        for m in _hot(store, topic, queue_id, offset, min(top, offset + BATCH)):
            if m.properties.get(PROPERTY_DIVERGED_RANGE) == rng:
                yield m


def _check_copies(
    store: MessageStore, topic: str, queue_id: int, start: int, base: int, end: int, rng: str
) -> tuple[int, int]:
    """How many copies there are from ``start``, each checked against its original (the
    copies are a prefix of the originals, in order), and the offset of the last one (``start``
    - 1 when none); ``ResolveRefusedError`` on one that is not its original's."""
    originals = _originals(store, topic, queue_id, base, end)
    n, last = 0, start - 1
    for c in _copies(store, topic, queue_id, start, rng):
        o = next(originals, None)
        if o is None or not _same(c, o, rng):
            raise ResolveRefusedError(
                f"{topic}/{queue_id}: the copy at offset {c.queue_offset} is not the local "
                f"message at {base + n}; the conflict stands"
            )
        n, last = n + 1, c.queue_offset
    return n, last


def _raise_floor(
    store: MessageStore, divergence: Divergence, topic: str, queue_id: int, floor: int
) -> None:
    """Step 5 (also run at start for a floor a crash left recorded)."""
    failpoints.hit("resolve.before_floor")
    store.raise_queue_floor(topic, queue_id, floor)
    failpoints.hit("resolve.after_floor")
    divergence.floor_applied(topic, queue_id)


class Resumer:
    """Finishes, in the broker's offload passes, a copying resolve an earlier run began and
    did not end (decision 902): ``copies_from`` in the record is the operator's request,
    written before the first copy, as Kafka's controller resumes a reassignment from the
    intent it recorded. One attempt per queue and pass; a tier that does not answer is tried
    again the next pass, a refusal is logged once and left to the operator."""

    def __init__(self, store: MessageStore, offloader: Offloader, divergence: Divergence) -> None:
        self.store, self.offloader, self.divergence = store, offloader, divergence
        self._given_up: set[tuple[str, int]] = set()
        self._waiting: set[tuple[str, int]] = set()
        self._floor_failed: set[tuple[str, int, int]] = set()

    def interrupted(self) -> list[tuple[str, int]]:
        return sorted(
            k
            for k, c in list(self.divergence.conflicts.items())
            if c.copies_from is not None and k not in self._given_up
        )

    def raise_floors(self) -> int:
        """The floors of resolves committed and not yet applied, at runtime (decision 1004):
        one whose raise the store refused (a full disk refuses ``queue-floors.json``) waited
        for the next start, and meanwhile the queue served its local originals at the offsets
        the archive holds, beside their copies at its end. Returns how many were raised."""
        raised = 0
        for (topic, queue_id), floor in sorted(self.divergence.floors.items()):
            lock = self.offloader.queue_lock(topic, queue_id)
            if not lock.acquire(blocking=False):
                continue  # a resolve or an upload of the queue: the next pass
            try:
                if (topic, queue_id) not in self.divergence.floors:
                    continue  # its resolve raised it meanwhile
                _raise_floor(self.store, self.divergence, topic, queue_id, floor)
            except Exception as e:
                if (topic, queue_id, floor) not in self._floor_failed:
                    self._floor_failed.add((topic, queue_id, floor))
                    log.error(
                        "%s/%d: the floor %d of a resolved divergence is not raised yet "
                        "(retried every offload pass): %s",
                        topic,
                        queue_id,
                        floor,
                        e,
                    )
                continue
            finally:
                lock.release()
            raised += 1
            log.warning(
                "%s/%d: raised the floor of a resolved divergence to %d", topic, queue_id, floor
            )
        return raised

    def run(self) -> list[Resolved]:
        self.raise_floors()
        done: list[Resolved] = []
        for topic, queue_id in self.interrupted():
            key = (topic, queue_id)
            try:
                # Not waiting for the queue's lock: the pass runs before the uploads, and 30 s
                # per queue held by an upload or an operator's resolve stalled them (and local
                # retention) for minutes with many such queues (decision 1091).
                r = resolve(
                    self.store, self.offloader, self.divergence, topic, queue_id, lock_wait_s=0
                )
            except NoConflictError:
                continue  # an operator's run finished it meanwhile
            except QueueBusyError:
                log.debug(
                    "%s/%d: the queue's lock is held; its resolve waits for the next pass",
                    topic,
                    queue_id,
                )
                continue
            except TierUnavailableError as e:
                if key not in self._waiting:
                    self._waiting.add(key)
                    log.warning(
                        "%s/%d: the resolve an earlier run began waits for the archive: %s",
                        topic,
                        queue_id,
                        e,
                    )
                continue
            except ResolveRefusedError as e:
                self._given_up.add(key)
                log.error(
                    "%s/%d: the resolve an earlier run began cannot be finished by the broker "
                    "(%s): the conflict stands; `tmq offload resolve` after the cause is fixed",
                    topic,
                    queue_id,
                    e,
                )
                continue
            log.warning(
                "%s/%d: finished the resolve an earlier run began (its copies from %d): %d "
                "copie(s) appended now, the floor raised to %d",
                topic,
                queue_id,
                r.copies_from,
                r.copied,
                r.archive_end,
            )
            done.append(r)
        return done


def apply_floors(store: MessageStore, divergence: Divergence) -> None:
    """At start, before serving: the floors of resolves that crashed after their commit."""
    for (topic, queue_id), floor in sorted(divergence.floors.items()):
        log.warning(
            "%s/%d: raising the floor of a resolved divergence to %d (the resolve stopped "
            "after its commit)",
            topic,
            queue_id,
            floor,
        )
        local_end = store.max_offset(topic, queue_id)
        if local_end < floor:
            # Only a resolve that discarded checks the queue's end without flushing it first:
            # a power loss under ASYNC flush after its commit loses the queue's unflushed tail.
            # Its offsets below the floor are the archive's; the queue goes on at the floor, as
            # for any queue floor above a queue's end (decision 980). Refusing instead made
            # every start of the broker fail.
            log.warning(
                "%s/%d ends at %d, below that floor (its last messages were not on disk): it "
                "starts at %d",
                topic,
                queue_id,
                local_end,
                floor,
            )
            store.start_queue_at(topic, queue_id, floor)
        _raise_floor(store, divergence, topic, queue_id, floor)
