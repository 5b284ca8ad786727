"""Transactional produce + commit against plain produce, in one run, through Apache's client.

Both phases use ``Producer`` from ``rocketmq-python-client`` against one ``tmq standalone``
process, 1 KiB bodies, the same number of client threads: plain ``send`` on a NORMAL topic, then
``begin_transaction`` + ``send`` + ``commit`` on a TRANSACTION topic (a half message, then the
commit's copy and its op record: two round trips and three CommitLog records per message, where
plain produce has one of each). Goal: ratio >= 0.5.

Runs in about 30 s; prints one JSON object on its last line.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from broker_harness import Standalone
from rocketmq import (
    ClientConfiguration,
    Credentials,
    Message,
    Producer,
    TransactionChecker,
    TransactionResolution,
)

BODY = os.urandom(1024)
SECONDS = 8.0
THREADS = 2


class CommitAll(TransactionChecker):
    def check(self, message: Message) -> TransactionResolution:
        return TransactionResolution.COMMIT


def run(node: Standalone, topic: str, transactional: bool) -> float:
    cfg = ClientConfiguration(node.endpoint, Credentials(), request_timeout=10)
    producer = Producer(cfg, topics=[topic], checker=CommitAll() if transactional else None)
    producer.startup()
    counts = [0] * THREADS
    stop = time.monotonic() + SECONDS

    def work(i: int) -> None:
        while time.monotonic() < stop:
            m = Message()
            m.topic = topic
            m.body = BODY
            if transactional:
                txn = producer.begin_transaction()
                producer.send(m, txn)
                txn.commit()
            else:
                producer.send(m)
            counts[i] += 1

    try:
        work(0)  # warm up routes and channels (counted out below)
        counts[0] = 0
        stop = time.monotonic() + SECONDS
        started = time.monotonic()
        threads = [threading.Thread(target=work, args=(i,)) for i in range(THREADS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return sum(counts) / (time.monotonic() - started)
    finally:
        producer.shutdown()


def main() -> None:
    workdir = Path(tempfile.mkdtemp(prefix="tmq-bench-txn-"))
    node = Standalone(workdir / "data").start()
    try:
        node.create_topic("bench-normal", queues=4)
        node.create_topic("bench-txn", queues=4, message_type="TRANSACTION")
        normal = run(node, "bench-normal", transactional=False)
        txn = run(node, "bench-txn", transactional=True)
    finally:
        node.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    print(
        json.dumps(
            {
                "bench": "transaction",
                "threads": THREADS,
                "seconds_per_phase": SECONDS,
                "normal_msgs_per_s": round(normal, 1),
                "transactional_msgs_per_s": round(txn, 1),
                "ratio": round(txn / normal, 3),
                "goal_ratio": 0.5,
            }
        )
    )


if __name__ == "__main__":
    main()
