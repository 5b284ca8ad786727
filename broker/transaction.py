"""Transactional messages: half messages, EndTransaction, and check-back (RocketMQ's 2PC).

State lives in the CommitLog, in two system topics, as in RocketMQ's
``TransactionalMessageServiceImpl``:

- ``RMQ_SYS_TRANS_HALF_TOPIC`` (one queue): every half message, with its real topic and queue in
  the ``REAL_TOPIC`` / ``REAL_QID`` properties. No consumer can subscribe to it, so a half message
  is invisible.
- ``RMQ_SYS_TRANS_OP_HALF_TOPIC`` (one queue): one small record per decision about a half message:
  its half queue offset in the body and the decision in ``__TXN_OP`` (``commit``, ``rollback``, or
  ``check`` with the number of check-backs so far in ``__TXN_CHECKS``).

COMMIT appends, in one CommitLog batch, the real message (a copy of the half message into its
topic, carrying ``__TXN_HALF_OFFSET``) and then the commit op. A crash can tear that batch after
the real message; on start-up every half message without a decision is looked up in the IndexFile
by its message id, and a copy carrying its half offset counts as committed (the missing op is
written then). So a COMMIT is never applied twice, and a retried EndTransaction is answered from
the recorded decision.

Start-up rebuilds the pending set from the CommitLog: every op, then every half message from the
watermark (the lowest half offset still undecided, saved as the offset of the system group
``CID_RMQ_SYS_TRANS``; a stale watermark only means more to scan). Pending half messages pin
their CommitLog files (``pinned_offset``): retention never releases them while undecided.

Threads: request threads call ``prepare`` and ``end``; ``tmq-transaction-check`` sends
check-backs (``RecoverOrphanedTransactionCommand``) to a producer of the topic through its
Telemetry stream every ``check_interval_ms``, and after ``check_max`` unanswered checks rolls the
half message back or keeps it, as configured. In a controller-run replica group the checks that
no producer connected to the master took are relayed to the producers connected to the other
members (``relay``, broker/ha/check_relay.py), and that thread waits for the members' answers.

A pass of the check loop costs the same whatever the backlog of undecided halves (decision 531):
the halves wait in a heap by their next check time, a pass takes the due ones oldest first, at
most ``check_batch`` of them, and writes their check records in one CommitLog batch. A backlog
larger than a pass is checked over several passes (each half still at most once per interval);
before, every due half was checked in the same pass, and each check costs a read, a CommitLog
append, a Telemetry command and the producer's EndTransaction: thousands at once took produce
down to a tenth.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from broker.metadata import BrokerMetadata
from broker.stored_properties import INT32_MAX, int_property
from tiered import failpoints
from tiered.record import Message, StoredMessage
from tiered.store import GetStatus, MessageStore

log = logging.getLogger(__name__)

HALF_TOPIC = "RMQ_SYS_TRANS_HALF_TOPIC"
OP_TOPIC = "RMQ_SYS_TRANS_OP_HALF_TOPIC"
SYSTEM_GROUP = "CID_RMQ_SYS_TRANS"

PROPERTY_REAL_TOPIC = "REAL_TOPIC"
PROPERTY_REAL_QUEUE_ID = "REAL_QID"
PROPERTY_TRANSACTION_PREPARED = "TRAN_MSG"
PROPERTY_PRODUCER_GROUP = "PGROUP"
PROPERTY_CHECK_IMMUNITY_MS = "__TXN_CHECK_IMMUNITY_MS"
PROPERTY_HALF_OFFSET = "__TXN_HALF_OFFSET"
PROPERTY_OP = "__TXN_OP"
PROPERTY_CHECKS = "__TXN_CHECKS"
# On a half message rolled forward (re-put): the transaction id its producer holds.
PROPERTY_TXN_ID = "__TXN_ID"
# Half-message bookkeeping that the committed copy does not keep.
_HALF_ONLY = (
    PROPERTY_REAL_TOPIC,
    PROPERTY_REAL_QUEUE_ID,
    PROPERTY_PRODUCER_GROUP,
    PROPERTY_CHECK_IMMUNITY_MS,
    PROPERTY_TXN_ID,
)

COMMIT = "commit"
ROLLBACK = "rollback"
CHECK = "check"
EXHAUSTED_POLICIES = ("rollback", "keep")
_PAST = {COMMIT: "committed", ROLLBACK: "rolled back"}
# Undecided halves whose committed copy is kept in memory (the common case: decided in ms).
_CACHED_COPIES = 10_000
# Decisions remembered below the watermark, newest first, so that a producer retrying its
# EndTransaction (a lost answer, a client retry) is answered from the decision it took.
_DECISIONS_KEPT = 100_000
# The longest check immunity a stored half message is read with: the proxy's one-hour limit on
# the orphaned-transaction recovery duration (broker.protocol.MAX_TRANSACTION_RECOVERY_MS).
_MAX_IMMUNITY_MS = 3_600_000
# How often the check loop saves the watermark (a lowest offset over every undecided half):
# it only shortens the scan at the next start.
_WATERMARK_EVERY_S = 5.0


class TransactionError(Exception):
    """An EndTransaction the broker refuses (unknown id, or a decision already taken)."""


@dataclass(slots=True)
class TransactionConfig:
    """RocketMQ's broker settings: ``transactionTimeOut``, ``transactionCheckInterval``,
    ``transactionCheckMax``; ``exhausted``: what happens after the last unanswered check;
    ``check_batch``: the most halves one pass of the check loop checks or gives up on (it runs
    every second at most), whatever the backlog (decision 531)."""

    timeout_ms: int = 6_000
    check_interval_ms: int = 30_000
    check_max: int = 15
    exhausted: str = "rollback"
    check_batch: int = 200

    def __post_init__(self) -> None:
        if self.exhausted not in EXHAUSTED_POLICIES:
            raise ValueError(
                f"transaction_check_exhausted must be one of {EXHAUSTED_POLICIES}, "
                f"not {self.exhausted!r}"
            )
        if self.check_batch < 1:
            raise ValueError(f"transaction_check_batch must be at least 1, not {self.check_batch}")


@dataclass(slots=True)
class Half:
    """An undecided half message. Its identity (``offset``, ``txn_phys``: the transaction id)
    is where it was first stored; rolled forward, its live record moves (``record_offset``,
    ``commitlog_offset``, ``size``)."""

    offset: int  # queue offset in HALF_TOPIC of the first record: the transaction's identity
    txn_phys: int  # CommitLog offset of the first record (the transaction id's second half)
    record_offset: int  # queue offset in HALF_TOPIC of the live record
    commitlog_offset: int
    size: int
    topic: str
    message_id: str
    stored_ms: int
    checks: int
    next_check_ms: int
    kept: bool = False  # checked check_max times and kept undecided: not checked again
    # The committed copy, built at prepare time while few halves are pending (saves reading
    # the half back from the CommitLog on COMMIT); None: read it then.
    copy: Message | None = None


@dataclass(slots=True)
class Prepared:
    transaction_id: str
    half_offset: int


# A producer's Telemetry stream: send it a check-back for (stored half message, transaction id).
CheckSender = Callable[[str, StoredMessage, str], bool]
# The checks no producer connected here took, as (topic, half message, transaction id), handed
# to the replica group's other members (broker/ha/check_relay.py): which of them one took.
CheckRelayer = Callable[[list[tuple[str, StoredMessage, str]]], list[bool]]


def copy_to(
    src: Message | StoredMessage, topic: str, queue_id: int, properties: dict[str, str]
) -> Message:
    """``src`` as a new record of ``topic``/``queue_id`` with ``properties``: same body, flag,
    born time and host (a half message, a committed copy, a timer record, a delivered timer)."""
    return Message(
        topic=topic,
        queue_id=queue_id,
        body=src.body,
        properties=properties,
        flag=src.flag,
        born_timestamp=src.born_timestamp,
        born_host=src.born_host,
    )


def transaction_id(half_offset: int, commitlog_offset: int) -> str:
    return f"{half_offset:X}-{commitlog_offset:X}"


def parse_transaction_id(text: str) -> tuple[int, int]:
    try:
        half, _, phys = text.partition("-")
        return int(half, 16), int(phys, 16)
    except ValueError:
        raise TransactionError(f"transaction id {text!r} was not issued by this broker") from None


def now_ms() -> int:
    return time.time_ns() // 1_000_000


class TransactionService:
    def __init__(
        self,
        store: MessageStore,
        metadata: BrokerMetadata,
        config: TransactionConfig,
        send_check: CheckSender,
        clock: Callable[[], int] = now_ms,
        leading: Callable[[], bool] = lambda: True,
        relay: CheckRelayer | None = None,
    ) -> None:
        self.store = store
        self.metadata = metadata
        self.config = config
        self.send_check = send_check
        # A controller-run group's master: where the checks go that no producer here took
        # (decision 1250); None on a single broker.
        self.relay = relay
        self._clock = clock
        # Only a writable master checks back; a slave's state is what it recovered at start,
        # and it recovers again from the replicated store when it is elected (_take_over).
        self._leading = leading
        self._led = True
        self._lock = threading.Lock()
        self._pending: dict[int, Half] = {}
        # (next check ms, half offset) of every undecided half, and stale entries (decided, or
        # rescheduled: their time differs from the half's) that a pass drops as it meets them
        self._due: list[tuple[int, int]] = []
        # half offset -> COMMIT/ROLLBACK, in decision order: every one above the watermark, and
        # the last _DECISIONS_KEPT below it (_forget_decisions)
        self._decided: dict[int, str] = {}
        self._busy: dict[int, str] = {}  # half offset -> decision being written right now
        self.commits = 0
        self.rollbacks = 0
        self.checks = 0
        self.relayed = 0  # check-backs another member of the group handed to its producer
        self.rolled = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- lifecycle -----------------------------------------------------------------------------

    def start(self) -> None:
        self._recover()
        self._thread = threading.Thread(
            target=self._check_loop, name="tmq-transaction-check", daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        if self._thread is None:
            return  # never started: nothing was recovered, nothing to save
        self._stop.set()
        self._thread.join()
        self._save_watermark()

    def _scan(self, topic: str, start: int) -> list[StoredMessage]:
        out: list[StoredMessage] = []
        offset = max(start, self.store.hot_min_offset(topic, 0))  # a hot-only read
        while True:
            got = self.store.get_messages(topic, 0, offset, 256, hot_only=True)
            if got.status is not GetStatus.FOUND:
                return out
            out += got.messages
            offset = got.next_offset

    def _recover(self) -> None:
        checks: dict[int, int] = {}
        for op in self._scan(OP_TOPIC, 0):
            if not (0 < len(op.body) <= 19 and op.body.isdigit()):
                log.warning("transaction op at %d names no half message; skipped", op.queue_offset)
                continue
            target = int(op.body)
            kind = op.properties.get(PROPERTY_OP)
            if kind in (COMMIT, ROLLBACK):
                self._decided[target] = kind
            elif kind == CHECK:
                count = int_property(op.properties, PROPERTY_CHECKS, 0, 0)
                checks[target] = max(checks.get(target, 0), count)
        watermark = self.metadata.offset(SYSTEM_GROUP, HALF_TOPIC, 0) or 0
        repaired = 0
        halves: dict[int, StoredMessage] = {}  # by identity: the last (live) record wins
        for m in self._scan(HALF_TOPIC, watermark):
            halves[self._identity(m)[0]] = m
        for identity, m in halves.items():
            if identity in self._decided:
                continue
            half = self._half(m, checks.get(identity, 0))
            if self._committed_copy_exists(half):
                # The crash tore the commit batch after the real message: finish it.
                self._append_op(half.offset, COMMIT)
                self._decided[half.offset] = COMMIT
                repaired += 1
                continue
            self._pending[half.offset] = half
            self._due.append((half.next_check_ms, half.offset))
        heapq.heapify(self._due)
        self._forget_decisions(watermark)
        if self._pending or repaired:
            log.info(
                "transactions: %d half message(s) undecided, %d commit(s) completed after a crash",
                len(self._pending),
                repaired,
            )

    @staticmethod
    def _identity(m: StoredMessage) -> tuple[int, int]:
        """(half offset, CommitLog offset) of the transaction a half record belongs to."""
        rolled = m.properties.get(PROPERTY_TXN_ID)
        return parse_transaction_id(rolled) if rolled else (m.queue_offset, m.commitlog_offset)

    def _half(self, m: StoredMessage, checks: int) -> Half:
        immunity = int_property(
            m.properties, PROPERTY_CHECK_IMMUNITY_MS, self.config.timeout_ms, 0, _MAX_IMMUNITY_MS
        )
        first = m.store_timestamp + immunity
        offset, txn_phys = self._identity(m)
        return Half(
            offset=offset,
            txn_phys=txn_phys,
            record_offset=m.queue_offset,
            commitlog_offset=m.commitlog_offset,
            size=m.size,
            topic=m.properties.get(PROPERTY_REAL_TOPIC, ""),
            message_id=m.msg_id or "",
            stored_ms=m.store_timestamp,
            checks=checks,
            next_check_ms=first if checks == 0 else self._clock() + self.config.check_interval_ms,
        )

    def _committed_copy_exists(self, half: Half) -> bool:
        for m in self.store.query_by_key(half.topic, half.message_id, begin_ms=half.stored_ms):
            if m.properties.get(PROPERTY_HALF_OFFSET) == str(half.offset):
                return True
        return False

    # -- prepare and end -----------------------------------------------------------------------

    def prepare(
        self, messages: list[Message], check_immunity_ms: list[int | None]
    ) -> list[Prepared]:
        """Store ``messages`` (each for its real topic and queue) as half messages."""
        halves = []
        for msg, immunity in zip(messages, check_immunity_ms, strict=True):
            props = dict(msg.properties)
            props[PROPERTY_REAL_TOPIC] = msg.topic
            props[PROPERTY_REAL_QUEUE_ID] = str(msg.queue_id)
            props[PROPERTY_TRANSACTION_PREPARED] = "true"
            props[PROPERTY_PRODUCER_GROUP] = msg.topic  # gRPC producers have no group
            if immunity:
                props[PROPERTY_CHECK_IMMUNITY_MS] = str(immunity)
            halves.append(copy_to(msg, HALF_TOPIC, 0, props))
        results = self.store.put_messages(halves)
        out = []
        with self._lock:
            for msg, half, r, immunity in zip(
                messages, halves, results, check_immunity_ms, strict=True
            ):
                first = r.store_timestamp + (immunity or self.config.timeout_ms)
                self._pending[r.queue_offset] = Half(
                    offset=r.queue_offset,
                    txn_phys=r.commitlog_offset,
                    record_offset=r.queue_offset,
                    commitlog_offset=r.commitlog_offset,
                    size=r.size,
                    topic=msg.topic,
                    message_id=half.properties.get("UNIQ_KEY", ""),
                    stored_ms=r.store_timestamp,
                    checks=0,
                    next_check_ms=first,
                    copy=self._copy(msg, r.queue_offset)
                    if len(self._pending) < _CACHED_COPIES
                    else None,
                )
                heapq.heappush(self._due, (first, r.queue_offset))
                out.append(
                    Prepared(transaction_id(r.queue_offset, r.commitlog_offset), r.queue_offset)
                )
        return out

    def end(self, topic: str, message_id: str, txn_id: str, commit: bool) -> None:
        """Commit or roll back; idempotent: repeating the decision already taken succeeds."""
        offset, phys = parse_transaction_id(txn_id)
        decision = COMMIT if commit else ROLLBACK
        with self._lock:
            busy = self._busy.get(offset)
            if busy is not None:
                if busy == decision:
                    return  # a repeat of a decision being written right now
                raise TransactionError(f"transaction {txn_id} is being {_PAST[busy]}")
            half = self._pending.get(offset)
            if half is None:
                done = self._decided.get(offset)
                if done == decision:
                    return
                if done is not None:
                    raise TransactionError(f"transaction {txn_id} was already {_PAST[done]}")
                raise TransactionError(f"transaction {txn_id} is unknown or long decided")
            if half.txn_phys != phys or half.message_id != message_id:
                raise TransactionError(
                    f"transaction {txn_id} does not belong to message {message_id}"
                )
            if half.topic != topic:
                raise TransactionError(f"transaction {txn_id} is for topic {half.topic}")
            self._busy[offset] = decision
        try:
            if commit:
                copy = half.copy
                if copy is None:
                    stored = self.store.read_message(half.commitlog_offset, half.size)
                    if stored is None:
                        raise TransactionError(f"half message of {txn_id} is no longer stored")
                    copy = self._real(stored, half)
                batch = [copy, self._op(offset, COMMIT)]
                if failpoints.armed("transaction.before_commit_op"):
                    self.store.put_messages(batch[:1])
                    failpoints.hit("transaction.before_commit_op")
                self.store.put_messages(batch)
            else:
                self.store.put_messages([self._op(offset, ROLLBACK)])
        finally:
            with self._lock:
                self._busy.pop(offset, None)
        with self._lock:
            self._pending.pop(offset, None)
            self._decided[offset] = decision
            if commit:
                self.commits += 1
            else:
                self.rollbacks += 1

    def _real(self, stored: StoredMessage, half: Half) -> Message:
        props = {k: v for k, v in stored.properties.items() if k not in _HALF_ONLY}
        props[PROPERTY_HALF_OFFSET] = str(half.offset)
        queue_id = int_property(stored.properties, PROPERTY_REAL_QUEUE_ID, 0, 0, INT32_MAX)
        return copy_to(stored, half.topic, queue_id, props)

    @staticmethod
    def _copy(msg: Message, half_offset: int) -> Message:
        props = dict(msg.properties)
        props[PROPERTY_TRANSACTION_PREPARED] = "true"
        props[PROPERTY_HALF_OFFSET] = str(half_offset)
        return copy_to(msg, msg.topic, msg.queue_id, props)

    @staticmethod
    def _op(half_offset: int, kind: str, checks: int = 0) -> Message:
        props = {PROPERTY_OP: kind}
        if kind == CHECK:
            props[PROPERTY_CHECKS] = str(checks)
        return Message(topic=OP_TOPIC, queue_id=0, body=str(half_offset).encode(), properties=props)

    def _append_op(self, half_offset: int, kind: str, checks: int = 0) -> None:
        self.store.put_messages([self._op(half_offset, kind, checks)])

    # -- check-back ----------------------------------------------------------------------------

    def _check_loop(self) -> None:
        tick = max(0.05, min(1.0, self.config.check_interval_ms / 4000))
        saved = 0.0
        while not self._stop.wait(tick):
            try:
                if not self._leading():
                    self._led = False
                    continue
                if not self._led:
                    self._take_over()
                    self._led = True
                self.check_due()
                if time.monotonic() - saved >= _WATERMARK_EVERY_S:
                    self._save_watermark()
                    saved = time.monotonic()
            except Exception:
                log.exception("transaction check-back failed; retrying")

    def _take_over(self) -> None:
        """Elected master: the half messages and decisions written while this broker was a
        slave reached its store by replication, not its memory. Recover again from the store,
        as a restart would, under the lock so that no prepare or end interleaves."""
        with self._lock:
            self._pending.clear()
            self._due.clear()
            self._decided.clear()
            self._recover()
        log.info(
            "transactions: taken over as master, %d half message(s) undecided", len(self._pending)
        )

    def check_due(self) -> int:
        """One pass: check back (or give up on) the due half messages, oldest due first, at most
        ``check_batch`` of them; returns how many check-backs were sent."""
        now = self._clock()
        due: list[Half] = []
        with self._lock:
            busy: list[tuple[int, int]] = []
            while self._due and self._due[0][0] <= now and len(due) < self.config.check_batch:
                entry = heapq.heappop(self._due)
                half = self._pending.get(entry[1])
                if half is None or half.kept or half.next_check_ms != entry[0]:
                    continue  # decided, kept or rescheduled since: a stale entry
                if half.offset in self._busy:
                    busy.append(entry)  # being decided: checked again if that fails
                    continue
                due.append(half)
            for entry in busy:
                heapq.heappush(self._due, entry)
        checks: list[tuple[Half, StoredMessage]] = []
        for half in due:
            with self._lock:  # a roll moves the record: take its offset and size together
                where = (half.commitlog_offset, half.size)
                # Due again in an interval, whatever happens below; a decision or a kept half
                # makes the entry stale.
                half.next_check_ms = now + self.config.check_interval_ms
                heapq.heappush(self._due, (half.next_check_ms, half.offset))
            if half.checks >= self.config.check_max:
                self._give_up(half, transaction_id(half.offset, half.txn_phys))
                continue
            stored = self.store.read_message(*where)
            if stored is not None:
                checks.append((half, stored))
        if not checks:
            return 0
        # One CommitLog batch for the pass's check records, before any check-back goes out.
        # Counted once stored: a store refusing writes (a full disk, dispatch stuck) asked no
        # producer, and counted first, ``check_max`` such passes rolled the transaction back
        # without its producer ever being asked (decision 1162).
        self.store.put_messages([self._op(h.offset, CHECK, h.checks + 1) for h, _ in checks])
        with self._lock:
            for half, _ in checks:
                half.checks += 1
        self.checks += len(checks)
        sent = 0
        unsent: list[tuple[Half, StoredMessage]] = []
        for half, stored in checks:
            if self._stop.is_set():
                return sent
            if self.send_check(half.topic, stored, transaction_id(half.offset, half.txn_phys)):
                sent += 1
            else:
                unsent.append((half, stored))
        if unsent and self.relay is not None:
            # A producer whose stream another member holds (decision 1250).
            reached = self.relay(
                [(h.topic, st, transaction_id(h.offset, h.txn_phys)) for h, st in unsent]
            )
            relayed = sum(reached)
            self.relayed += relayed
            sent += relayed
            unsent = [c for c, ok in zip(unsent, reached, strict=True) if not ok]
        for half, _ in unsent:
            log.info(
                "transaction %s of %s: no producer of the topic is connected%s (check %d/%d)",
                half.message_id,
                half.topic,
                "" if self.relay is None else " to any member of the group",
                half.checks,
                self.config.check_max,
            )
        return sent

    def _give_up(self, half: Half, txn: str) -> None:
        """After the last check went unanswered: roll back, or keep (never checked again)."""
        what = "kept undecided" if self.config.exhausted == "keep" else "rolled back"
        log.warning(
            "transaction %s of %s: no decision after %d checks; %s",
            half.message_id,
            half.topic,
            half.checks,
            what,
        )
        if self.config.exhausted == "keep":
            half.kept = True
            return
        with contextlib.suppress(TransactionError):  # decided meanwhile
            self.end(half.topic, half.message_id, txn, False)

    # -- watermark, pinning, metrics -----------------------------------------------------------

    def _save_watermark(self) -> None:
        with self._lock:
            low = min(
                (h.record_offset for h in self._pending.values()),
                default=self.store.max_offset(HALF_TOPIC, 0),
            )
            # A half being decided right now is still in _pending: its record is counted.
            watermark = low
            self._forget_decisions(watermark)
        if self.metadata.offset(SYSTEM_GROUP, HALF_TOPIC, 0) != watermark:
            self.metadata.commit_offset(SYSTEM_GROUP, HALF_TOPIC, 0, watermark)

    def _forget_decisions(self, watermark: int) -> None:
        """Drop the oldest decisions below ``watermark`` beyond the last ``_DECISIONS_KEPT``.
        Forgetting every one below it (as before) answered a repeated COMMIT with
        INVALID_TRANSACTION_ID as soon as the check loop had moved the watermark past it: a
        client retrying a lost answer a second later saw its committed transaction refused."""
        excess = len(self._decided) - _DECISIONS_KEPT
        if excess <= 0:
            return
        for offset in [h for h in itertools.islice(self._decided, excess) if h < watermark]:
            del self._decided[offset]

    def roll_forward(self, below: int) -> int:
        """Re-put every undecided half message whose live record lies below CommitLog offset
        ``below`` (RocketMQ's ``putBackHalfMsgQueue``), so that it no longer pins the files
        there; returns how many were re-put.

        The new record carries the transaction id (``__TXN_ID``): the producer's EndTransaction
        and the check-backs keep naming the transaction as before, and recovery takes the last
        record of each transaction as the live one, so a crash after the re-put (before the
        pin moves) only leaves a stale record the watermark soon passes. Holds the lock while
        it appends: an EndTransaction of the same half waits, and never sees it half-moved."""
        with self._lock:
            moving = [
                h
                for h in self._pending.values()
                if h.commitlog_offset < below and h.offset not in self._busy
            ]
            records: list[Message] = []
            for half in moving:
                stored = self.store.read_message(half.commitlog_offset, half.size)
                if stored is None:
                    raise TransactionError(f"half message {half.message_id} is no longer stored")
                props = dict(stored.properties)
                props[PROPERTY_TXN_ID] = transaction_id(half.offset, half.txn_phys)
                records.append(copy_to(stored, HALF_TOPIC, 0, props))
            if not records:
                return 0
            results = self.store.put_messages(records)
            for half, r in zip(moving, results, strict=True):
                half.record_offset = r.queue_offset
                half.commitlog_offset = r.commitlog_offset
                half.size = r.size
            self.rolled += len(moving)
        log.info(
            "transactions: %d half message(s) rolled forward past offset %d", len(moving), below
        )
        return len(moving)

    def pinned_offset(self) -> int | None:
        """The lowest CommitLog offset an undecided half message needs kept."""
        with self._lock:
            return min((h.commitlog_offset for h in self._pending.values()), default=None)

    def pending(self) -> int:
        return len(self._pending)

    def pending_by_topic(self) -> dict[str, int]:
        out: dict[str, int] = {}
        with self._lock:
            for h in self._pending.values():
                out[h.topic] = out.get(h.topic, 0) + 1
        return out
