"""Roll-forward: a transaction left open, or a timer not yet due, is re-put past the oldest
CommitLog file when that file could otherwise be released (RocketMQ's put-back of half messages
and timer roll), and still resolves or delivers correctly afterwards, across kill -9."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

import grpc
from broker_harness import (
    Standalone,
    client_config,
    free_port,
    metric_sample,
    pull_all,
    send_batches,
    wait_until,
)
from rocketmq import Producer, TransactionResolution
from rocketmq.grpc_protocol import definition_pb2 as d
from rocketmq.grpc_protocol import service_pb2 as s
from rocketmq.grpc_protocol import service_pb2_grpc
from test_transactions import Checker

from broker.timer import PROPERTY_DELIVER_TIME, PROPERTY_ROLLED_FROM, TimerService, as_timer_message
from tiered.config import StoreConfig
from tiered.record import Message as StoreMessage
from tiered.store import MessageStore

QUICK = ["--commitlog-file-size", "128KiB", "--offload-interval", "1", "--upload-after", "1s"]
ENV = {
    "TMQ_BROKER_TIMER_MAX_DELAY_MS": "600000",
    # Checks start at once and never run out: nobody answers until the files are released.
    "TMQ_BROKER_TRANSACTION_TIMEOUT_MS": "1000",
    "TMQ_BROKER_TRANSACTION_CHECK_INTERVAL_MS": "1000",
    "TMQ_BROKER_TRANSACTION_CHECK_MAX": "1000",
}


def now_ms() -> int:
    return time.time_ns() // 1_000_000


def commitlog_starts(data: Path) -> list[int]:
    return sorted(int(p.name) for p in (data / "commitlog").iterdir() if p.name.isdigit())


def wait_for(predicate: Callable[[], object], seconds: float, what: str) -> None:
    wait_until(what, predicate, seconds, every=0.3)


def test_a_long_pending_transaction_and_timer_do_not_keep_the_oldest_file(
    tmp_path: Path,
) -> None:
    data = tmp_path / "data"
    node = Standalone(data, extra=QUICK, env=ENV, metrics_port=free_port()).start()
    try:
        for name, kind in (
            ("roll-txn", "TRANSACTION"),
            ("roll-delay", "DELAY"),
            ("roll-filler", "NORMAL"),
        ):
            node.create_topic(name, queues=1, message_type=kind, tiered=True)
        stub = service_pb2_grpc.MessagingServiceStub(grpc.insecure_channel(node.endpoint))
        txn_ids: dict[str, str] = {}
        for key in ("t-end", "t-check-commit", "t-check-rollback"):
            request = s.SendMessageRequest()
            m = request.messages.add(topic=d.Resource(name="roll-txn"), body=f"body {key}".encode())
            m.system_properties.message_id = f"MSG-{key}"
            m.system_properties.message_type = d.TRANSACTION
            m.system_properties.keys.append(key)
            [entry] = stub.SendMessage(request, timeout=10).entries
            txn_ids[key] = entry.transaction_id
        # The half messages' CommitLog offsets are the second half of their transaction ids.
        half_phys = max(int(t.split("-")[1], 16) for t in txn_ids.values())
        due = now_ms() + 30_000
        request = s.SendMessageRequest()
        m = request.messages.add(topic=d.Resource(name="roll-delay"), body=b"body d-late")
        m.system_properties.message_id = "MSG-d-late"
        m.system_properties.message_type = d.DELAY
        m.system_properties.keys.append("d-late")
        m.system_properties.delivery_timestamp.FromMilliseconds(due)
        assert stub.SendMessage(request, timeout=10).status.code == d.OK
        assert len(commitlog_starts(data)) == 1, "the halves and the timer are in the first file"
        send_batches(
            node.endpoint, "roll-filler", [(os.urandom(1000), f"f{i}", "x") for i in range(400)]
        )
        assert len(commitlog_starts(data)) >= 3
        # Without the roll the first file stays for as long as the transactions are open.
        wait_for(
            lambda: commitlog_starts(data)[0] > half_phys,
            25,
            "the oldest CommitLog file was never released: the pending records pin it",
        )
        assert now_ms() < due - 2000, "released too late for the test to show the timer pinned"
        assert metric_sample(node, "tmq_transaction_half_pending") == 3
        assert metric_sample(node, 'tmq_timer_pending{topic="roll-delay"}') == 1
        # The rolled records are the live ones across kill -9 too.
        node.kill9()
        node.start()
        stub = service_pb2_grpc.MessagingServiceStub(grpc.insecure_channel(node.endpoint))
        ended = stub.EndTransaction(
            s.EndTransactionRequest(
                topic=d.Resource(name="roll-txn"),
                message_id="MSG-t-end",
                transaction_id=txn_ids["t-end"],
                resolution=d.COMMIT,
                source=d.SOURCE_CLIENT,
            ),
            timeout=10,
        )
        assert ended.status.code == d.OK, ended.status
        checker = Checker(
            {
                "t-check-commit": TransactionResolution.COMMIT,
                "t-check-rollback": TransactionResolution.ROLLBACK,
            }
        )
        producer = Producer(client_config(node), topics=["roll-txn"], checker=checker)
        producer.startup()
        try:
            wait_for(
                lambda: metric_sample(node, "tmq_transaction_half_pending") == 0,
                20,
                f"the check-back did not resolve the rolled transactions: {checker.asked}",
            )
        finally:
            producer.shutdown()
        assert set(checker.asked) == {"t-check-commit", "t-check-rollback"}
        committed = pull_all(node, "roll-txn", 1)
        assert sorted((m.system_properties.keys[0], m.body) for m in committed) == [
            ("t-check-commit", b"body t-check-commit"),
            ("t-end", b"body t-end"),
        ]
        wait_for(lambda: len(pull_all(node, "roll-delay", 1)) >= 1, 45, "the timer never came")
        time.sleep(1.5)  # a second delivery (old and rolled record both live) would land now
        [delivered] = pull_all(node, "roll-delay", 1)
        assert delivered.body == b"body d-late"
        assert delivered.system_properties.delivery_timestamp.ToMilliseconds() == due
        assert delivered.system_properties.store_timestamp.ToMilliseconds() >= due
        assert dict(delivered.user_properties) == {}, "no roll bookkeeping leaks to consumers"
    finally:
        node.stop()


def test_a_timer_rolled_from_a_later_bucket_is_delivered_once_across_a_crash(
    small_config: StoreConfig, start_store: Callable[[StoreConfig], MessageStore]
) -> None:
    """The wheel on a test clock: timers due in a later minute are rolled (re-put), the pin
    moves past them, the service is abandoned without a shutdown (as kill -9 leaves it), and a
    new one delivers each timer exactly once, from its rolled record, at its time."""
    store = start_store(small_config)
    clock = [1_800_000_000_000]
    due = [clock[0] + 10 * 60_000 + i for i in range(5)]  # ten minutes on: a later bucket
    timer_dir = small_config.data_dir / "timer"
    store.put_messages(
        [
            as_timer_message(StoreMessage("orders", f"body {i}".encode(), 0, {
                "UNIQ_KEY": f"id-{i}", PROPERTY_DELIVER_TIME: str(d),
            }))
            for i, d in enumerate(due)
        ]
    )  # fmt: skip
    assert store.wait_dispatched(10)

    def run_until(service: TimerService, done: Callable[[], bool]) -> None:
        deadline = time.monotonic() + 10
        while not done():
            assert time.monotonic() < deadline
            time.sleep(0.02)

    first = TimerService(store, timer_dir, lambda: ["orders"], clock=lambda: clock[0])
    first.start()
    run_until(first, lambda: first.stats().pending == 5)
    below = store.max_physical_offset  # every timer record so far
    assert first.pinned_offset() == 0
    first.roll_forward(below)
    run_until(first, lambda: (first.pinned_offset() or 0) >= below)
    assert first.rolled == 5 and first.stats().pending == 5
    first._stop.set()  # abandoned: no checkpoint, no close (kill -9)
    first.wakeup()
    assert first._thread is not None
    first._thread.join()

    clock[0] = due[-1] + 1
    second = TimerService(store, timer_dir, lambda: ["orders"], clock=lambda: clock[0])
    second.start()
    try:
        run_until(second, lambda: store.max_offset("orders", 0) >= 5)
        time.sleep(0.3)  # a second delivery of any timer would land now
    finally:
        second.stop()
    got = store.get_messages("orders", 0, 0, 32).messages
    assert sorted(m.body for m in got) == [f"body {i}".encode() for i in range(5)]
    for m in got:
        assert PROPERTY_ROLLED_FROM not in m.properties
        assert int(m.properties[PROPERTY_DELIVER_TIME]) in due
    assert second.stats().pending == 0
