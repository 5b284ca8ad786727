"""Pop consumption (RocketMQ 5's ReceiveMessage / AckMessage / ChangeInvisibleDuration).

Per (consumer group, topic, queue) the broker keeps:

- ``next``: the next queue offset to hand out;
- in-flight deliveries, each invisible to other consumers until its deadline;
- the committed consumer offset: the lowest offset neither acknowledged nor skipped (everything
  below it is done), saved with the group's offsets.

A delivery that passes its deadline unacknowledged is *revived*: copied to the group's retry topic
``%RETRY%{group}`` with its delivery count raised, from where the group receives it again; after
``max_delivery_attempts`` it goes to ``%DLQ%{group}`` instead. Either way the original offset is
then done. FIFO groups never let two deliveries of one queue be in flight at once and redeliver an
expired one in place, so messages of one message group stay in order.

A slave serving pop reads while its master is unreachable has a replica store, which takes no
appends (decision 970): there an expired delivery is delivered again in place, from the queue it
was read from, whatever the group; one past its attempt limit cannot go to the DLQ, so it is held
(in flight, not delivered, not consumed) until the next change of role starts a new term.

In-flight state lives in memory: after a broker restart, consumption resumes from the committed
offset and anything not acknowledged is delivered again (at-least-once). A member of a replica
group starts a new *term* of this state at every change of its replication role (decision 860):
a master elected again must take its groups' positions from the offsets replicated to it, not
from what it handed out before it was deposed (its tail may since have been cut and the offsets
reused). A receipt handle names the term that issued it, and one of another term (another
master's, or this broker's before a failover or restart) is refused as not acknowledged: the
message is delivered again from the committed offset, which never passes a delivery in flight.
"""

from __future__ import annotations

import errno
import itertools
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from broker.metadata import BrokerMetadata, GroupConfig, TopicConfig, dlq_topic, retry_topic
from tiered.cold.storage import StorageError
from tiered.record import Message, StoredMessage, tag_hash
from tiered.store import GetStatus, MessageStore, ReplicaStoreError, StoreUnwritableError

log = logging.getLogger(__name__)

# A store that refuses the copies of expired deliveries (its disk full, dispatch stuck) says so
# at most once in this many seconds: revive runs every second and at every receive.
_REFUSED_LOG_EVERY_S = 60.0
# After a refusal, revive tries no copy for this long (one failed write a second, not one per
# expired delivery at every receive, all under the pop lock).
_REFUSED_RETRY_S = 1.0


def _refused(e: BaseException) -> bool:
    """``e`` says the broker cannot write now (and stored nothing): the store refuses writes,
    or the disk (or the descriptor table) refused the retry or DLQ topic's save."""
    if isinstance(e, StoreUnwritableError):
        return True
    return isinstance(e, OSError) and e.errno in (
        errno.ENOSPC,
        errno.EDQUOT,
        errno.EMFILE,
        errno.ENFILE,
    )


# Properties a retried message carries (RocketMQ's names).
PROPERTY_RETRY_TOPIC = "RETRY_TOPIC"  # the topic the message was first sent to
PROPERTY_ORIGIN_MESSAGE_ID = "ORIGIN_MESSAGE_ID"


def now_ms() -> int:
    """The clock of invisibility deadlines: monotonic. They never leave this process (a receipt
    handle names no time), and a wall clock stepped forward expired every delivery in flight at
    once (each delivered again while its consumer still held it), stepped back hid them for the
    length of the step (decision 1002)."""
    return time.monotonic_ns() // 1_000_000


class MessageFilter(Protocol):
    """What a subscription asks of each message: first of its ConsumeQueue tag hash (cheap,
    may say yes wrongly), then of the record."""

    def code_matches(self, code: int) -> bool: ...

    def matches(self, msg: StoredMessage) -> bool: ...


class TagFilter:
    """A TAG filter expression: ``*`` (everything), or tags joined by ``||``."""

    def __init__(self, expression: str) -> None:
        expression = (expression or "*").strip()
        if expression in ("", "*"):
            self.tags: frozenset[str] | None = None
        else:
            tags = frozenset(t.strip() for t in expression.split("||") if t.strip())
            if not tags:
                raise ValueError(f"not a tag expression: {expression!r}")
            self.tags = tags
        self.codes = None if self.tags is None else {tag_hash(t) for t in self.tags}

    def code_matches(self, code: int) -> bool:
        return self.codes is None or code in self.codes

    def matches(self, msg: StoredMessage) -> bool:
        return self.tags is None or msg.tags in self.tags


@dataclass(slots=True)
class Delivery:
    topic: str  # the topic stored in (the retry topic for a retried message)
    queue_id: int
    offset: int
    handle_seq: int
    deadline_ms: int
    attempt: int  # 1 for the first delivery
    # On a replica store (decision 970): expired, to be delivered again in place at the next
    # receive; or past its attempt limit, held until a new term (no DLQ append is possible).
    redeliver: bool = False
    held: bool = False


@dataclass(slots=True)
class QueueState:
    next: int
    in_flight: dict[int, Delivery] = field(default_factory=dict)


@dataclass(slots=True)
class Received:
    message: StoredMessage
    receipt_handle: str
    attempt: int
    original_topic: str


class InvalidReceiptHandleError(ValueError):
    pass


class PopService:
    def __init__(
        self,
        store: MessageStore,
        metadata: BrokerMetadata,
        clock: Callable[[], int] = now_ms,
        on_topic_created: Callable[[], None] = lambda: None,
    ) -> None:
        self.store = store
        self.metadata = metadata
        self._on_topic_created = on_topic_created
        self._clock = clock
        self._lock = threading.Lock()
        self._queues: dict[tuple[str, str, int], QueueState] = {}
        self._seq = itertools.count(1)
        self._rotation = itertools.count()
        self._term = os.urandom(4).hex()
        # When a refused copy of an expired delivery was last logged (monotonic).
        self._refused_logged = -_REFUSED_LOG_EVERY_S
        # When the store last refused such a copy (monotonic).
        self._refused_at = -_REFUSED_RETRY_S

    def new_term(self) -> None:
        """Forget every delivery in flight and every group's position: the next receive starts
        from the committed offsets (the replicated ones on a member just elected), and the
        handles issued so far are refused. Called at every change of replication role."""
        with self._lock:
            self._queues.clear()
            self._term = os.urandom(4).hex()

    # -- receive -------------------------------------------------------------------------------

    def receive(
        self,
        group: GroupConfig,
        topic: TopicConfig,
        tag_filter: MessageFilter,
        max_count: int,
        invisible_ms: int,
    ) -> list[Received]:
        """Deliver up to ``max_count`` messages of ``topic`` (and of the group's retry topic),
        each invisible to others for ``invisible_ms``."""
        self.revive_expired()
        sources = [(topic.name, q) for q in range(topic.queues)]
        retry = retry_topic(group.name)
        if self.store.queue_ids(retry):
            sources.append((retry, 0))
        start = next(self._rotation) % len(sources)
        out: list[Received] = []
        unavailable: StorageError | None = None
        with self._lock:
            for stored_topic, queue_id in sources[start:] + sources[:start]:
                if len(out) >= max_count:
                    break
                try:
                    out += self._pop_queue(
                        group,
                        stored_topic,
                        topic.name,
                        queue_id,
                        tag_filter,
                        max_count - len(out),
                        invisible_ms,
                    )
                except StorageError as e:
                    # The cold tier does not answer for this queue (its archive's start or a
                    # read of it): the other queues still deliver, and this one's offset stays.
                    unavailable = unavailable or e
        if not out and unavailable is not None:
            raise unavailable  # nothing to deliver: the client is told to retry
        return out

    def _state(self, group: str, topic: str, queue_id: int) -> QueueState:
        key = (group, topic, queue_id)
        state = self._queues.get(key)
        if state is None:
            committed = self.metadata.offset(group, topic, queue_id)
            start = self.store.min_offset(topic, queue_id) if committed is None else committed
            state = self._queues[key] = QueueState(next=start)
        return state

    def _pop_queue(
        self,
        group: GroupConfig,
        stored_topic: str,
        topic: str,
        queue_id: int,
        tag_filter: MessageFilter,
        max_count: int,
        invisible_ms: int,
    ) -> list[Received]:
        state = self._state(group.name, stored_topic, queue_id)
        now = self._clock()
        if group.fifo and state.in_flight:
            return self._redeliver_fifo(group, state, stored_topic, queue_id, now, invisible_ms)
        out = self._redeliver_in_place(state, stored_topic, queue_id, now, invisible_ms, max_count)
        max_count -= len(out)
        if max_count <= 0:
            self._commit(group.name, stored_topic, queue_id, state)
            return out
        result = self.store.get_messages(
            stored_topic, queue_id, state.next, max_count, tag_filter=tag_filter.code_matches
        )
        if result.status is GetStatus.OFFSET_TOO_SMALL:
            # Only a read says what is gone: before it, the first offset a restarted broker
            # knows may be the hot store's (the tier's manifest is not loaded yet), and
            # skipping to it would drop archived messages the group never received.
            lo = self.store.min_offset(stored_topic, queue_id)
            if state.next < lo:
                log.warning(
                    "group %s: %s/%d offsets %d..%d are gone (retention); skipping them",
                    group.name,
                    stored_topic,
                    queue_id,
                    state.next,
                    lo - 1,
                )
                state.next = lo
                result = self.store.get_messages(
                    stored_topic, queue_id, lo, max_count, tag_filter=tag_filter.code_matches
                )
        if result.status is GetStatus.FOUND or result.status is GetStatus.NO_MATCHED_MESSAGE:
            for msg in result.messages:
                if not tag_filter.matches(msg):
                    continue  # a tag-hash collision: not for this group
                if msg.queue_offset in state.in_flight:
                    continue
                attempt = msg.reconsume_times + 1
                delivery = Delivery(
                    stored_topic,
                    queue_id,
                    msg.queue_offset,
                    next(self._seq),
                    now + invisible_ms,
                    attempt,
                )
                state.in_flight[msg.queue_offset] = delivery
                original = msg.properties.get(PROPERTY_RETRY_TOPIC, topic)
                out.append(Received(msg, self._handle(delivery), attempt, original))
            state.next = max(state.next, result.next_offset)
        self._commit(group.name, stored_topic, queue_id, state)
        return out

    def _redeliver_in_place(
        self,
        state: QueueState,
        stored_topic: str,
        queue_id: int,
        now: int,
        invisible_ms: int,
        max_count: int,
    ) -> list[Received]:
        """The deliveries ``revive_expired`` could not copy to the retry topic (a replica store,
        decision 970), lowest offset first: the same message again, one attempt more."""
        out: list[Received] = []
        for offset in sorted(o for o, d in state.in_flight.items() if d.redeliver):
            if len(out) >= max_count:
                break
            delivery = state.in_flight[offset]
            got = self.store.get_messages(stored_topic, queue_id, offset, 1).messages
            if not got or got[0].queue_offset != offset:
                del state.in_flight[offset]  # gone (retention): nothing to deliver again
                continue
            delivery.redeliver = False
            delivery.attempt += 1
            delivery.deadline_ms = now + invisible_ms
            delivery.handle_seq = next(self._seq)
            original = got[0].properties.get(PROPERTY_RETRY_TOPIC, got[0].topic)
            out.append(Received(got[0], self._handle(delivery), delivery.attempt, original))
        return out

    def _hold(self, group: str, stored_topic: str, queue_id: int, delivery: Delivery) -> None:
        """A delivery past its attempt limit on a replica store: the DLQ takes no append here,
        and consuming it without one would lose it. In flight, delivered to no one, until a
        change of role starts a new term (which delivers it again from the committed offset)."""
        if not delivery.held:
            delivery.held = True
            log.warning(
                "group %s: %s/%d offset %d passed its %d deliveries on a replica store (no "
                "master to take it to the DLQ): held until this broker's role changes",
                group,
                stored_topic,
                queue_id,
                delivery.offset,
                delivery.attempt,
            )

    def _redeliver_fifo(
        self,
        group: GroupConfig,
        state: QueueState,
        stored_topic: str,
        queue_id: int,
        now: int,
        invisible_ms: int,
    ) -> list[Received]:
        """A FIFO queue with a delivery in flight: nothing until it expires, then the same
        message again (or, past the attempt limit, to the DLQ and on to the next)."""
        first = min(state.in_flight)
        delivery = state.in_flight[first]
        if delivery.deadline_ms > now or (delivery.held and self.store.replica):
            return []
        msg = self.store.get_messages(stored_topic, queue_id, first, 1).messages
        if not msg:
            del state.in_flight[first]
            return []
        if delivery.attempt >= group.max_delivery_attempts:
            if self.store.replica:
                self._hold(group.name, stored_topic, queue_id, delivery)
                return []
            try:
                self._to_dlq(group.name, msg[0], delivery.attempt)
            except ReplicaStoreError:  # the store became a replica since the check
                self._hold(group.name, stored_topic, queue_id, delivery)
                return []
            except Exception as e:
                # Nothing written: the queue waits (its order) and the next receive tries the
                # DLQ again; raised, it failed the whole receive, every other queue included.
                if not _refused(e):
                    raise
                self._log_refused(group.name, e)
                return []
            del state.in_flight[first]
            self._commit(group.name, stored_topic, queue_id, state)
            return []
        delivery.attempt += 1
        delivery.deadline_ms = now + invisible_ms
        delivery.handle_seq = next(self._seq)
        original = msg[0].properties.get(PROPERTY_RETRY_TOPIC, msg[0].topic)
        return [Received(msg[0], self._handle(delivery), delivery.attempt, original)]

    # -- ack and invisibility --------------------------------------------------------------------

    def ack(self, group: str, receipt_handle: str) -> None:
        with self._lock:
            state, delivery = self._find(group, receipt_handle)
            del state.in_flight[delivery.offset]
            self._commit(group, delivery.topic, delivery.queue_id, state)

    def change_invisible_duration(
        self,
        group: str,
        receipt_handle: str,
        invisible_ms: int,
        at_least: Callable[[int], int] | None = None,
    ) -> str:
        """Push the delivery's deadline to now + ``invisible_ms`` (raised to
        ``at_least(delivery attempt)`` when given); returns the new handle."""
        with self._lock:
            _, delivery = self._find(group, receipt_handle)
            if at_least is not None:
                invisible_ms = max(invisible_ms, at_least(delivery.attempt))
            delivery.deadline_ms = self._clock() + invisible_ms
            delivery.handle_seq = next(self._seq)
            return self._handle(delivery)

    def release(self, group: str, receipt_handles: list[str]) -> int:
        """Deliveries this broker popped and never handed over (the consumer went away during
        its long poll, or while the batch was being sent): visible again at once, as if never
        delivered, their attempt not counted. RocketMQ's proxy nacks a message it fails to
        write to the client's stream the same way. Non-FIFO ones are delivered again in place
        at the next receive of their queue (``_redeliver_in_place``; if none comes before
        their deadline, revive copies them to the retry topic at their attempt); a FIFO one
        at the next receive. Returns how many were released (a handle already acknowledged,
        or of another term, is skipped)."""
        released = 0
        with self._lock:
            group_cfg = self.metadata.group(group) or GroupConfig(group)
            for handle in receipt_handles:
                try:
                    _, delivery = self._find(group, handle)
                except InvalidReceiptHandleError:
                    continue
                delivery.attempt -= 1  # the next delivery counts it again
                delivery.handle_seq = next(self._seq)  # the lost handle is refused
                if group_cfg.fifo:
                    delivery.deadline_ms = self._clock()
                else:
                    delivery.redeliver = True
                released += 1
        return released

    def forward_to_dlq(self, group: str, receipt_handle: str) -> None:
        """The consumer gave up on a delivery (FIFO clients do this themselves): move the
        message to ``%DLQ%{group}`` and count it as consumed."""
        with self._lock:
            state, delivery = self._find(group, receipt_handle)
            got = self.store.get_messages(delivery.topic, delivery.queue_id, delivery.offset, 1)
            if got.messages and got.messages[0].queue_offset == delivery.offset:
                self._to_dlq(group, got.messages[0], delivery.attempt)
            del state.in_flight[delivery.offset]
            self._commit(group, delivery.topic, delivery.queue_id, state)

    def _find(self, group: str, receipt_handle: str) -> tuple[QueueState, Delivery]:
        try:
            topic, queue, offset, term_seq = receipt_handle.rsplit(":", 3)
            term, _, seq = term_seq.partition(".")
            int(seq)
        except ValueError:
            raise InvalidReceiptHandleError(
                f"receipt handle {receipt_handle!r} is not one this broker issues"
            ) from None
        if term != self._term:
            raise InvalidReceiptHandleError(
                f"receipt handle {receipt_handle!r} is not of this broker's current term (another "
                "member of its group issued it, or this broker before a restart or a change of "
                "role): not acknowledged, and the message will be delivered again"
            )
        try:
            key = (group, topic, int(queue))
            state = self._queues[key]
            delivery = state.in_flight[int(offset)]
        except (ValueError, KeyError):
            raise InvalidReceiptHandleError(
                f"receipt handle {receipt_handle!r} is unknown or already acknowledged"
            ) from None
        if delivery.handle_seq != int(seq):
            raise InvalidReceiptHandleError(
                "receipt handle expired: the message was redelivered since"
            )
        return state, delivery

    def _handle(self, d: Delivery) -> str:
        return f"{d.topic}:{d.queue_id}:{d.offset}:{self._term}.{d.handle_seq}"

    # -- revive ----------------------------------------------------------------------------------

    def revive_expired(self) -> int:
        """Move expired non-FIFO deliveries to the retry topic (or the DLQ); returns how many.
        On a replica store, which takes no appends, they are instead marked to be delivered
        again in place (or held, past the attempt limit) and not counted (decision 970)."""
        now = self._clock()
        moved = 0
        # Deliveries kept in place are tried again once the store takes appends (a change of
        # role starts a new term anyway; this does not depend on it).
        replica = self.store.replica
        with self._lock:
            for (group_name, stored_topic, queue_id), state in list(self._queues.items()):
                group = self.metadata.group(group_name) or GroupConfig(group_name)
                if group.fifo:
                    continue
                expired = [
                    d
                    for d in state.in_flight.values()
                    if d.deadline_ms <= now and not (replica and (d.redeliver or d.held))
                ]
                removed = False
                for d in expired:
                    got = self.store.get_messages(stored_topic, queue_id, d.offset, 1).messages
                    found = got and got[0].queue_offset == d.offset
                    if found and not self._revive(group, stored_topic, queue_id, d, got[0]):
                        # A replica store, or one refusing writes: stays in flight (again
                        # in place, or held)
                        continue
                    del state.in_flight[d.offset]
                    removed = True
                    moved += 1
                if removed:
                    self._commit(group_name, stored_topic, queue_id, state)
        return moved

    def _revive(
        self, group: GroupConfig, stored_topic: str, queue_id: int, d: Delivery, msg: StoredMessage
    ) -> bool:
        """Copy an expired delivery to the retry topic or the DLQ; False when the store is a
        replica, or refuses writes, and so the delivery stays in flight (again in place, or
        held)."""
        last = d.attempt >= group.max_delivery_attempts
        if not self.store.replica:
            if time.monotonic() - self._refused_at < _REFUSED_RETRY_S:
                if not last:
                    d.redeliver = True
                return False  # refused a moment ago: as below, without another try
            try:
                if last:
                    self._to_dlq(group.name, msg, d.attempt)
                else:
                    self._to_retry(group.name, msg, d.attempt)
                return True
            except ReplicaStoreError:
                pass  # the store became a replica since the check
            except Exception as e:
                # The broker cannot write now (a full disk, dispatch stuck): nothing was
                # copied. Raised, it failed every receive of every group on the broker (each
                # revives first), while reads were fine. Kept in flight as on a replica; the
                # copy is tried again at every pass while its deadline is past.
                if not _refused(e):
                    raise
                self._refused_at = time.monotonic()
                self._log_refused(group.name, e)
                if not last:
                    d.redeliver = True
                return False  # one past its limit waits, delivered to no one, for the DLQ
        if last:
            self._hold(group.name, stored_topic, queue_id, d)
        else:
            d.redeliver = True
        return False

    def _log_refused(self, group: str, e: BaseException) -> None:
        now = time.monotonic()
        if now - self._refused_logged >= _REFUSED_LOG_EVERY_S:
            self._refused_logged = now
            log.error(
                "group %s: an expired delivery cannot be copied to its retry or DLQ topic: "
                "%s. It stays in flight and is delivered again in place; the copy is tried "
                "again while it lasts (this is said once a minute)",
                group,
                e,
            )

    def _copy(self, msg: StoredMessage, topic: str, attempts: int) -> Message:
        props = dict(msg.properties)
        props.setdefault(PROPERTY_RETRY_TOPIC, msg.topic)
        if msg.msg_id:
            props.setdefault(PROPERTY_ORIGIN_MESSAGE_ID, msg.msg_id)
        return Message(
            topic=topic,
            queue_id=0,
            body=msg.body,
            properties=props,
            flag=msg.flag,
            born_timestamp=msg.born_timestamp,
            born_host=msg.born_host,
            reconsume_times=attempts,
        )

    def _to_retry(self, group: str, msg: StoredMessage, attempts: int) -> None:
        self._ensure_topic(retry_topic(group))
        self.store.put_message(self._copy(msg, retry_topic(group), attempts))

    def _to_dlq(self, group: str, msg: StoredMessage, attempts: int) -> None:
        self._ensure_topic(dlq_topic(group))
        self.store.put_message(self._copy(msg, dlq_topic(group), attempts))
        log.info(
            "group %s: message %s went to %s after %d deliveries",
            group,
            msg.msg_id,
            dlq_topic(group),
            attempts,
        )

    def _ensure_topic(self, name: str) -> None:
        if self.metadata.topic(name) is None:
            self.metadata.put_topic(TopicConfig(name=name, queues=1))
            self._on_topic_created()  # so the NameServers route it (operators read DLQs)

    # -- offsets ---------------------------------------------------------------------------------

    def _commit(self, group: str, topic: str, queue_id: int, state: QueueState) -> None:
        done = min(state.in_flight) if state.in_flight else state.next
        if self.metadata.offset(group, topic, queue_id) != done:
            self.metadata.commit_offset(group, topic, queue_id, done)

    def reset(self, group: str, topic: str, queue_id: int, offset: int) -> None:
        """Move a group's position (UpdateOffset); deliveries in flight there are forgotten."""
        with self._lock:
            self._queues[(group, topic, queue_id)] = QueueState(next=offset)
            self.metadata.commit_offset(group, topic, queue_id, offset)
