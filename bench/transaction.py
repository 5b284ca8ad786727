"""Transactional produce + commit against plain produce, in one run, through Apache's client.

Both phases use ``Producer`` from ``rocketmq-python-client`` against one ``tmq standalone``
process, 1 KiB bodies, the same number of client threads: plain ``send`` on a NORMAL topic, then
``begin_transaction`` + ``send`` + ``commit`` on a TRANSACTION topic (a half message, then the
commit's copy and its op record: two round trips and three CommitLog records per message, where
plain produce has one of each). Goal: ratio >= 0.5.

The two phases alternate (``ROUNDS`` x 2 s each, in ABBA order so that neither always runs
first) so that load from other work on a shared machine falls on both alike. ``ratio`` is the
ratio of the totals; ``ratio_median_of_rounds`` pairs each transactional phase with the plain
phase next to it and takes the median, which one burst of someone else's work on one phase
cannot move (both are reported, with every round's ratio). Runs in about 30 s; prints one JSON
object on its last line.

``--unresolved``: the transactional phase sends half messages and never ends them, and the
producer's checker answers every check-back UNKNOWN, so the backlog of undecided halves grows by
every round, and from the third round on (past the 6 s transaction timeout) the broker checks
them back while both phases run (decision 531). Reports each phase's rate per round, and the
check-backs the broker sent.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from broker_harness import Standalone, free_port, metric_sample
from rocketmq import (
    ClientConfiguration,
    Credentials,
    Message,
    Producer,
    TransactionChecker,
    TransactionResolution,
)

BODY = os.urandom(1024)
ROUNDS = 6  # the phases alternate, 2 s each, so load from other work falls on both alike
PHASE_S = 2.0
THREADS = 2


class CommitAll(TransactionChecker):
    def check(self, message: Message) -> TransactionResolution:
        return TransactionResolution.COMMIT


class Unknown(TransactionChecker):
    """A producer that never decides: every check-back is answered UNKNOWN."""

    def __init__(self) -> None:
        self.asked = 0

    def check(self, message: Message) -> TransactionResolution:
        self.asked += 1
        return TransactionResolution.TRANSACTION_RESOLUTION_UNSPECIFIED


def phase(
    producer: Producer, topic: str, transactional: bool, resolve: bool = True
) -> tuple[int, float]:
    """Messages sent by THREADS threads in PHASE_S seconds, and the seconds it took."""
    counts = [0] * THREADS
    stop = time.monotonic() + PHASE_S

    def work(i: int) -> None:
        while time.monotonic() < stop:
            m = Message()
            m.topic = topic
            m.body = BODY
            if transactional:
                txn = producer.begin_transaction()
                producer.send(m, txn)
                if resolve:
                    txn.commit()
            else:
                producer.send(m)
            counts[i] += 1

    started = time.monotonic()
    threads = [threading.Thread(target=work, args=(i,)) for i in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(counts), time.monotonic() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument(
        "--unresolved", action="store_true", help="never end a transaction (see the docstring)"
    )
    args = parser.parse_args()
    resolve = not args.unresolved
    workdir = Path(tempfile.mkdtemp(prefix="tmq-bench-txn-"))
    metrics_port = free_port()
    node = Standalone(workdir / "data", metrics_port=metrics_port).start()
    checker = CommitAll() if resolve else Unknown()
    try:
        node.create_topic("bench-normal", queues=4)
        node.create_topic("bench-txn", queues=4, message_type="TRANSACTION")
        cfg = ClientConfiguration(node.endpoint, Credentials(), request_timeout=10)
        plain = Producer(cfg, topics=["bench-normal"])
        txn_producer = Producer(cfg, topics=["bench-txn"], checker=checker)
        plain.startup()
        txn_producer.startup()
        totals = {False: [0, 0.0], True: [0, 0.0]}
        rounds: list[float] = []
        per_round: list[dict[str, float]] = []
        try:
            warm = Message()  # routes and channels before anything is timed
            warm.topic, warm.body = "bench-normal", BODY
            plain.send(warm)
            warm = Message()
            warm.topic, warm.body = "bench-txn", BODY
            txn = txn_producer.begin_transaction()
            txn_producer.send(warm, txn)
            txn.commit()
            for r in range(ROUNDS):
                rate = {}
                for transactional in (False, True) if r % 2 == 0 else (True, False):
                    producer = txn_producer if transactional else plain
                    topic = "bench-txn" if transactional else "bench-normal"
                    n, seconds = phase(producer, topic, transactional, resolve)
                    totals[transactional][0] += n
                    totals[transactional][1] += seconds
                    rate[transactional] = n / seconds
                rounds.append(rate[True] / rate[False])
                per_round.append(
                    {"normal": round(rate[False], 1), "transactional": round(rate[True], 1)}
                )
            checks = metric_sample(node, "tmq_transaction_checks_total")
            pending = metric_sample(node, "tmq_transaction_half_pending")
        finally:
            plain.shutdown()
            txn_producer.shutdown()
        normal = totals[False][0] / totals[False][1]
        transactional_rate = totals[True][0] / totals[True][1]
    finally:
        node.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    print(
        json.dumps(
            {
                "bench": "transaction" if resolve else "transaction_unresolved",
                "threads": THREADS,
                "rounds": ROUNDS,
                "seconds_per_phase": PHASE_S,
                "normal_msgs_per_s": round(normal, 1),
                "transactional_msgs_per_s": round(transactional_rate, 1),
                "ratio": round(transactional_rate / normal, 3),
                "ratio_median_of_rounds": round(statistics.median(rounds), 3),
                "round_ratios": [round(x, 3) for x in rounds],
                "rounds_msgs_per_s": per_round,
                "checks_sent": checks,
                "halves_pending": pending,
                "goal_ratio": 0.5,
            }
        )
    )


if __name__ == "__main__":
    main()
