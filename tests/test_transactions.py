"""Transactional messages through Apache's Python client against ``tmq standalone`` processes:
half messages, COMMIT and ROLLBACK, check-back of orphaned transactions, and kill -9."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from broker_harness import Standalone, client_config, free_port, metric_sample, pull_all
from rocketmq import (
    FilterExpression,
    Message,
    Producer,
    SendReceipt,
    SimpleConsumer,
    TransactionChecker,
    TransactionResolution,
)
from rocketmq.grpc_protocol import definition_pb2 as d

from broker.metadata import BrokerMetadata
from broker.transaction import (
    HALF_TOPIC,
    OP_TOPIC,
    SYSTEM_GROUP,
    TransactionConfig,
    TransactionError,
    TransactionService,
)
from tiered.config import StoreConfig
from tiered.record import Message as StoreMessage
from tiered.store import MessageStore

# Check-backs start 1 s after the half message and repeat every second, at most 4 times.
FAST_CHECKS = {
    "TMQ_BROKER_TRANSACTION_TIMEOUT_MS": "1000",
    "TMQ_BROKER_TRANSACTION_CHECK_INTERVAL_MS": "1000",
    "TMQ_BROKER_TRANSACTION_CHECK_MAX": "4",
}


class Checker(TransactionChecker):
    """Answers check-backs from a table: message key -> resolution; records what it was asked."""

    def __init__(self, answers: dict[str, TransactionResolution] | None = None) -> None:
        self.answers = answers or {}
        self.asked: list[str] = []
        self._lock = threading.Lock()

    def check(self, message: Message) -> TransactionResolution:
        key = next(iter(message.keys))
        with self._lock:
            self.asked.append(key)
        return self.answers.get(key, TransactionResolution.TRANSACTION_RESOLUTION_UNSPECIFIED)


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[Standalone]:
    node = Standalone(tmp_path / "data", env=FAST_CHECKS, metrics_port=free_port()).start()
    yield node
    node.stop()


def producer(node: Standalone, topic: str, checker: Checker) -> Producer:
    p = Producer(client_config(node), topics=[topic], checker=checker)
    p.startup()
    return p


def message(topic: str, key: str) -> Message:
    m = Message()
    m.topic = topic
    m.body = f"body of {key}".encode()
    m.keys = key
    m.add_property("k", key)
    return m


def receive_keys(node: Standalone, topic: str, group: str, seconds: float) -> list[str]:
    """Every message key a consumer group receives (and acks) within ``seconds``."""
    consumer = SimpleConsumer(
        client_config(node), group, {topic: FilterExpression()}, await_duration=1
    )
    consumer.startup()
    got: list[str] = []
    try:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            for m in consumer.receive(16, 10):
                got.append(next(iter(m.keys)))
                assert m.message_type == d.TRANSACTION
                assert m.body == f"body of {got[-1]}".encode()
                consumer.ack(m)
    finally:
        consumer.shutdown()
    return got


def end_transaction(
    p: Producer, sent: Message, receipt: SendReceipt, resolution: TransactionResolution
) -> int:
    """EndTransaction again for a half message already sent (a producer's late or repeated
    decision); the answer's status code."""
    ended = p.end_transaction(
        receipt.message_queue.endpoints,
        sent,
        receipt.transaction_id,
        resolution,
        d.SOURCE_CLIENT,
    )
    return int(ended.status.code)


def wait_for(predicate: object, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if predicate():  # type: ignore[operator]
            return True
        time.sleep(0.2)
    return False


def test_a_half_message_is_invisible_until_commit_and_a_repeated_commit_does_not_duplicate(
    broker: Standalone,
) -> None:
    broker.create_topic("txn-commit", queues=2, message_type="TRANSACTION")
    checker = Checker()
    p = producer(broker, "txn-commit", checker)
    try:
        txn = p.begin_transaction()
        sent = message("txn-commit", "k-commit")
        receipt = p.send(sent, txn)
        assert receipt.transaction_id
        assert receive_keys(broker, "txn-commit", "g-commit", 2.5) == [], "half is invisible"
        txn.commit()
        # The same decision again (a producer retrying a lost answer) is accepted, and no-op.
        assert end_transaction(p, sent, receipt, TransactionResolution.COMMIT) == d.OK
        # The opposite decision is refused.
        late = end_transaction(p, sent, receipt, TransactionResolution.ROLLBACK)
        assert late == d.INVALID_TRANSACTION_ID
    finally:
        p.shutdown()
    assert receive_keys(broker, "txn-commit", "g-commit", 4) == ["k-commit"]


def test_a_rolled_back_message_is_never_delivered(broker: Standalone) -> None:
    broker.create_topic("txn-rollback", queues=1, message_type="TRANSACTION")
    checker = Checker()
    p = producer(broker, "txn-rollback", checker)
    try:
        for key in ("k-rb-1", "k-rb-2"):
            txn = p.begin_transaction()
            p.send(message("txn-rollback", key), txn)
            if key == "k-rb-1":
                txn.rollback()
            else:
                txn.commit()
        time.sleep(2.5)  # past the first check-back time
    finally:
        p.shutdown()
    assert receive_keys(broker, "txn-rollback", "g-rb", 4) == ["k-rb-2"]
    assert checker.asked == [], "a transaction ended in time is never checked back"


def test_check_back_resolves_transactions_the_producer_never_ended(broker: Standalone) -> None:
    broker.create_topic("txn-check", queues=2, message_type="TRANSACTION")
    checker = Checker(
        {
            "k-yes": TransactionResolution.COMMIT,
            "k-no": TransactionResolution.ROLLBACK,
        }
    )
    p = producer(broker, "txn-check", checker)
    try:
        for key in ("k-yes", "k-no"):
            p.send(message("txn-check", key), p.begin_transaction())  # never ended
        assert metric_sample(broker, "tmq_transaction_half_pending") == 2
        assert wait_for(lambda: {"k-yes", "k-no"} <= set(checker.asked), 15), checker.asked
        got = receive_keys(broker, "txn-check", "g-check", 4)
    finally:
        p.shutdown()
    assert got == ["k-yes"]
    assert metric_sample(broker, "tmq_transaction_half_pending") == 0
    assert metric_sample(broker, "tmq_transaction_commits_total") == 1
    assert metric_sample(broker, "tmq_transaction_rollbacks_total") == 1
    assert metric_sample(broker, "tmq_transaction_checks_total") >= 2


def test_an_unanswered_transaction_is_rolled_back_after_the_last_check(
    broker: Standalone,
) -> None:
    broker.create_topic("txn-unknown", queues=1, message_type="TRANSACTION")
    checker = Checker()  # answers UNKNOWN to everything
    p = producer(broker, "txn-unknown", checker)
    try:
        txn = p.begin_transaction()
        receipt = p.send(message("txn-unknown", "k-unknown"), txn)
        # 4 checks, 1 s apart, then the broker gives up and rolls back.
        assert wait_for(lambda: checker.asked.count("k-unknown") >= 4, 20), checker.asked
        time.sleep(2.5)
        asked = len(checker.asked)
        time.sleep(2.5)
        assert len(checker.asked) == asked == 4, "no check after the last one"
        sent = txn._Transaction__message  # type: ignore[attr-defined]
        late = end_transaction(p, sent, receipt, TransactionResolution.COMMIT)
        assert late == d.INVALID_TRANSACTION_ID, "it was rolled back"
    finally:
        p.shutdown()
    assert receive_keys(broker, "txn-unknown", "g-unknown", 3) == []


def test_an_unanswered_transaction_is_kept_after_the_last_check_when_so_configured(
    tmp_path: Path,
) -> None:
    """``transaction_check_exhausted = "keep"``: after the last unanswered check the half
    message stays undecided, invisible and never checked again, across kill -9 too; the
    producer can still commit it, once."""
    env = {
        **FAST_CHECKS,
        "TMQ_BROKER_TRANSACTION_CHECK_MAX": "2",
        "TMQ_BROKER_TRANSACTION_CHECK_EXHAUSTED": "keep",
    }
    node = Standalone(tmp_path / "data", env=env, metrics_port=free_port()).start()
    checker = Checker()  # answers UNKNOWN to everything
    p: Producer | None = None
    try:
        node.create_topic("txn-keep", queues=1, message_type="TRANSACTION")
        p = producer(node, "txn-keep", checker)
        txn = p.begin_transaction()
        receipt = p.send(message("txn-keep", "k-keep"), txn)
        assert wait_for(lambda: checker.asked.count("k-keep") >= 2, 20), checker.asked
        time.sleep(3)  # three more check intervals
        assert checker.asked == ["k-keep", "k-keep"], "no check after the last one"
        assert metric_sample(node, "tmq_transaction_half_pending") == 1, "kept, not rolled back"
        assert metric_sample(node, "tmq_transaction_rollbacks_total") == 0
        node.kill9()
        node.start()  # the check count is recovered from the op records: still exhausted
        time.sleep(3)
        assert checker.asked == ["k-keep", "k-keep"], "not checked again after the restart"
        assert metric_sample(node, "tmq_transaction_half_pending") == 1
        assert receive_keys(node, "txn-keep", "g-keep", 2) == [], "a kept half stays invisible"
        sent = txn._Transaction__message  # type: ignore[attr-defined]
        for _ in range(2):  # a late COMMIT, then its retry
            assert end_transaction(p, sent, receipt, TransactionResolution.COMMIT) == d.OK
        assert receive_keys(node, "txn-keep", "g-keep", 4) == ["k-keep"]
        assert metric_sample(node, "tmq_transaction_half_pending") == 0
    finally:
        if p is not None:
            p.shutdown()
        node.stop()


def test_kill_9_between_half_and_commit_loses_nothing_and_shows_no_rollback(
    tmp_path: Path,
) -> None:
    # The orphans are due at once after the restart: enough checks to outlast the new
    # producer's start on a loaded machine (4 at 1 s sometimes ran out first).
    env = {**FAST_CHECKS, "TMQ_BROKER_TRANSACTION_CHECK_MAX": "30"}
    node = Standalone(tmp_path / "data", env=env).start()
    try:
        node.create_topic("txn-crash", queues=2, message_type="TRANSACTION")
        quiet = Checker()  # this producer dies with the broker: it answers nothing
        p = producer(node, "txn-crash", quiet)
        try:
            committed = p.begin_transaction()
            p.send(message("txn-crash", "k-committed"), committed)
            committed.commit()
            rolled = p.begin_transaction()
            p.send(message("txn-crash", "k-rolled-back"), rolled)
            rolled.rollback()
            for key in ("k-orphan-commit", "k-orphan-rollback"):
                p.send(message("txn-crash", key), p.begin_transaction())
            node.kill9()
        finally:
            p.shutdown()
        assert quiet.asked == [], "the broker died before the first check-back"
        node.start()
        checker = Checker(
            {
                "k-orphan-commit": TransactionResolution.COMMIT,
                "k-orphan-rollback": TransactionResolution.ROLLBACK,
            }
        )
        p = producer(node, "txn-crash", checker)
        try:
            assert wait_for(
                lambda: {"k-orphan-commit", "k-orphan-rollback"} <= set(checker.asked), 20
            ), checker.asked
            got = receive_keys(node, "txn-crash", "g-crash", 5)
        finally:
            p.shutdown()
        assert sorted(got) == ["k-committed", "k-orphan-commit"]
        assert "k-committed" not in checker.asked and "k-rolled-back" not in checker.asked
    finally:
        node.stop()


def test_a_commit_torn_by_a_crash_is_completed_once_at_restart(tmp_path: Path) -> None:
    """The crash lands after the committed copy is in the CommitLog and before the decision is:
    at restart the copy is found by its message id, and the broker neither checks back nor
    commits a second copy."""
    data = tmp_path / "data"
    node = Standalone(data, env={**FAST_CHECKS, "TMQ_FAILPOINTS": "transaction.before_commit_op"})
    node.start()
    node.create_topic("txn-torn", queues=2, message_type="TRANSACTION")
    p = producer(node, "txn-torn", Checker())
    try:
        txn = p.begin_transaction()
        p.send(message("txn-torn", "k-torn"), txn)
        with pytest.raises(Exception):  # noqa: B017  the broker dies under the request
            txn.commit()
        assert node.proc is not None and node.proc.wait(10) == -9
    finally:
        p.shutdown()
    node = Standalone(data, env=FAST_CHECKS)
    node.start()
    try:
        checker = Checker({"k-torn": TransactionResolution.COMMIT})
        p = producer(node, "txn-torn", checker)
        try:
            got = receive_keys(node, "txn-torn", "g-torn", 5)  # past the first check-back
        finally:
            p.shutdown()
        assert got == ["k-torn"]
        assert checker.asked == [], "the torn commit was completed, not checked back"
    finally:
        node.stop()


def test_kill_9_of_the_producer_before_it_commits_is_resolved_by_a_new_producer(
    tmp_path: Path,
) -> None:
    """A real producer process (Apache's client, a transaction checker) commits and rolls back
    transactions in a loop and holds four open ones; it is kill -9ed mid-loop, so one
    transaction may also be cut between its half message and its EndTransaction. A new
    producer of the topic starts, the broker checks every open transaction back to it, and
    in the end: every acknowledged commit is there, nothing rolled back is ever visible, and
    nothing stays pending."""
    env = {**FAST_CHECKS, "TMQ_BROKER_TRANSACTION_CHECK_MAX": "30"}
    node = Standalone(tmp_path / "data", env=env, metrics_port=free_port()).start()
    progress = tmp_path / "progress.txt"
    child_log = (tmp_path / "child.log").open("wb")
    try:
        node.create_topic("txn-producer-crash", queues=2, message_type="TRANSACTION")
        child = subprocess.Popen(
            [
                sys.executable,
                str(Path(__file__).with_name("txn_producer_child.py")),
                node.endpoint,
                "txn-producer-crash",
                str(progress),
            ],
            stdout=child_log,
            stderr=child_log,
        )
        try:
            assert wait_for(
                lambda: progress.exists() and progress.read_text().count("\n") >= 40, 60
            ), "the producer process made no progress"
            child.send_signal(signal.SIGKILL)
            assert child.wait(10) == -signal.SIGKILL
        finally:
            if child.poll() is None:
                child.kill()
                child.wait(10)
        lines = [line.split() for line in progress.read_text().splitlines()]
        halves = {key for kind, key in lines if kind == "half"}
        committed = {key for kind, key in lines if kind == "commit"}
        rolled_back = {key for kind, key in lines if kind == "rollback"}
        assert {f"open-{i}" for i in range(4)} <= halves and committed and rolled_back
        last = max(int(key[2:]) for key in halves if key.startswith("k-"))
        # k-(last+1) may have been stored, unacknowledged, when the process died.
        attempted = halves | {f"k-{last + 1}"}

        def decide(key: str) -> TransactionResolution:
            number = int(key.split("-")[1])
            return (
                TransactionResolution.COMMIT if number % 2 == 0 else TransactionResolution.ROLLBACK
            )

        checker = Checker({key: decide(key) for key in attempted})
        p = producer(node, "txn-producer-crash", checker)
        try:
            assert wait_for(lambda: metric_sample(node, "tmq_transaction_half_pending") == 0, 30), (
                f"still pending; checked back so far: {checker.asked}"
            )
        finally:
            p.shutdown()
        open_keys = {f"open-{i}" for i in range(4)}
        assert open_keys <= set(checker.asked), "every open transaction was checked back"
        assert not (committed | rolled_back) & set(checker.asked), "ended ones are not checked"
        visible = [m.system_properties.keys[0] for m in pull_all(node, "txn-producer-crash", 2)]
        assert len(visible) == len(set(visible)), "a commit applied twice"
        should_commit = {k for k in attempted if decide(k) == TransactionResolution.COMMIT}
        assert committed | {"open-0", "open-2"} <= set(visible), "a committed message was lost"
        assert set(visible) <= should_commit, "a rolled-back message became visible"
        rollbacks = metric_sample(node, "tmq_transaction_rollbacks_total")
        assert rollbacks is not None and rollbacks >= len(rolled_back) + 2
    finally:
        child_log.close()
        node.stop()


def test_bookkeeping_topics_get_no_index_entries(
    small_config: StoreConfig, start_store: Callable[[StoreConfig], MessageStore]
) -> None:
    """Half messages, decisions and timer records are never looked up by key (the committed
    copy and the delivered timer are, in their real topics), so the broker spares the
    IndexFile work for them: two of a transaction's three records."""
    store = start_store(small_config)
    assert store.dispatcher is not None
    store.dispatcher.unindexed_topics = frozenset({"RMQ_SYS_TRANS_HALF_TOPIC"})
    props = {"UNIQ_KEY": "id-1", "KEYS": "order-1"}
    store.put_messages(
        [
            StoreMessage("RMQ_SYS_TRANS_HALF_TOPIC", b"half", 0, dict(props)),
            StoreMessage("orders", b"copy", 0, dict(props)),
        ]
    )
    assert store.wait_dispatched(10)
    for key in ("id-1", "order-1"):
        assert store.query_by_key("RMQ_SYS_TRANS_HALF_TOPIC", key) == []
        assert [m.body for m in store.query_by_key("orders", key)] == [b"copy"]


def test_a_repeated_end_transaction_is_answered_after_the_watermark_moved_and_a_restart(
    small_config: StoreConfig, start_store: Callable[[StoreConfig], MessageStore], tmp_path: Path
) -> None:
    """A producer retrying EndTransaction (its answer was lost) after the check loop has moved
    the watermark past the half message, or after a restart, gets the decision it took, not
    INVALID_TRANSACTION_ID; the opposite decision is still refused, and nothing is doubled."""
    store = start_store(small_config)
    metadata = BrokerMetadata(tmp_path / "config")

    def service() -> TransactionService:
        return TransactionService(store, metadata, TransactionConfig(), send_check=lambda *_: False)

    first = service()
    first.start()
    sent = [
        StoreMessage("orders", f"body {i}".encode(), 0, {"UNIQ_KEY": f"id-{i}"}) for i in (0, 1)
    ]
    prepared = first.prepare(sent, [None, None])
    first.end("orders", "id-0", prepared[0].transaction_id, commit=True)
    first.end("orders", "id-1", prepared[1].transaction_id, commit=False)
    assert store.wait_dispatched(10)
    first._save_watermark()  # what tmq-transaction-check does every tick: no half is pending
    assert metadata.offset(SYSTEM_GROUP, HALF_TOPIC, 0) == 2, "the watermark passed both"
    first.end("orders", "id-0", prepared[0].transaction_id, commit=True)
    first.end("orders", "id-1", prepared[1].transaction_id, commit=False)
    first.stop()
    second = service()
    second.start()
    try:
        second.end("orders", "id-0", prepared[0].transaction_id, commit=True)
        second.end("orders", "id-1", prepared[1].transaction_id, commit=False)
        with pytest.raises(TransactionError, match="already committed"):
            second.end("orders", "id-0", prepared[0].transaction_id, commit=False)
    finally:
        second.stop()
    assert [m.body for m in store.get_messages("orders", 0, 0, 10).messages] == [b"body 0"]


def test_a_check_pass_costs_the_same_whatever_the_backlog_of_unresolved_halves(
    small_config: StoreConfig, start_store: Callable[[StoreConfig], MessageStore], tmp_path: Path
) -> None:
    """Decision 531: a pass of the check loop checks back at most ``check_batch`` halves and
    appends at most that many op records, with a backlog of 100 undecided halves or of 1,000;
    the rest wait for the next passes, oldest first, and every half is still checked
    ``check_max`` times, then rolled back."""
    store = start_store(small_config)
    now = [time.time_ns() // 1_000_000]
    asked: dict[str, int] = {}

    def send_check(topic: str, half: object, txn: str) -> bool:
        asked[txn] = asked.get(txn, 0) + 1
        return True

    config = TransactionConfig(timeout_ms=1000, check_interval_ms=60_000, check_max=2)
    config.check_batch = 50
    service = TransactionService(
        store, BrokerMetadata(tmp_path / "config"), config, send_check, clock=lambda: now[0]
    )

    def one_pass() -> tuple[int, int]:
        """(check-backs sent, op records appended) by one pass."""
        assert store.wait_dispatched(10)
        before = store.max_offset(OP_TOPIC, 0)
        sent = service.check_due()
        assert store.wait_dispatched(10)
        return sent, store.max_offset(OP_TOPIC, 0) - before

    def prepare(n: int, key: str) -> None:
        messages = [StoreMessage("orders", b"x", 0, {"UNIQ_KEY": f"{key}-{i}"}) for i in range(n)]
        service.prepare(messages, [None] * n)

    prepare(100, "a")
    now[0] += 5_000  # past the timeout of all 100
    assert [one_pass(), one_pass(), one_pass()] == [(50, 50), (50, 50), (0, 0)]
    prepare(900, "b")
    now[0] += 5_000  # the 900 due, the first 100 not (checked again in a minute)
    assert one_pass() == (50, 50), "the same cost with ten times the backlog"
    passes = 1
    while service.pending():
        sent, ops = one_pass()
        passes += 1
        assert sent <= 50 and ops <= 50
        if (sent, ops) == (0, 0):
            now[0] += 60_000  # an interval later, the next round of checks is due
        assert passes < 200
    assert len(asked) == 1000 and set(asked.values()) == {2}, "each checked check_max times"
    assert service.rollbacks == 1000
