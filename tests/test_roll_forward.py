"""Roll-forward: a transaction left open, or a timer not yet due, is re-put past the oldest
CommitLog file when that file could otherwise be released (RocketMQ's put-back of half messages
and timer roll), and still resolves or delivers correctly afterwards, across kill -9."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import grpc
from broker_harness import (
    Standalone,
    client_config,
    free_port,
    metric_sample,
    pull_all,
    send_batches,
    tmq,
)
from rocketmq import Message, Producer, TransactionChecker, TransactionResolution
from rocketmq.grpc_protocol import definition_pb2 as d
from rocketmq.grpc_protocol import service_pb2 as s
from rocketmq.grpc_protocol import service_pb2_grpc

QUICK = ["--commitlog-file-size", "128KiB", "--offload-interval", "1", "--upload-after", "1s"]
ENV = {
    "TMQ_BROKER_TIMER_MAX_DELAY_MS": "600000",
    # Checks start at once and never run out: nobody answers until the files are released.
    "TMQ_BROKER_TRANSACTION_TIMEOUT_MS": "1000",
    "TMQ_BROKER_TRANSACTION_CHECK_INTERVAL_MS": "1000",
    "TMQ_BROKER_TRANSACTION_CHECK_MAX": "1000",
}


class Checker(TransactionChecker):
    def __init__(self, answers: dict[str, TransactionResolution]) -> None:
        self.answers = answers
        self.asked: set[str] = set()
        self._lock = threading.Lock()

    def check(self, message: Message) -> TransactionResolution:
        key = next(iter(message.keys))
        with self._lock:
            self.asked.add(key)
        return self.answers.get(key, TransactionResolution.TRANSACTION_RESOLUTION_UNSPECIFIED)


def now_ms() -> int:
    return time.time_ns() // 1_000_000


def commitlog_starts(data: Path) -> list[int]:
    return sorted(int(p.name) for p in (data / "commitlog").iterdir() if p.name.isdigit())


def wait_for(predicate: object, seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not predicate():  # type: ignore[operator]
        assert time.monotonic() < deadline, what
        time.sleep(0.3)


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
            done = tmq(
                "topic", "create", name, "-n", node.namesrv, "--queues", "1", "--tiered",
                "--message-type", kind,
            )  # fmt: skip
            assert done.returncode == 0, done.stderr
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
        assert checker.asked == {"t-check-commit", "t-check-rollback"}
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
