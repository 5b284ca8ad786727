"""A transactional producer process for kill -9 tests, with Apache's Python client.

Run as ``python tests/txn_producer_child.py ENDPOINT TOPIC PROGRESS``. It first sends the half
messages ``open-0`` .. ``open-3`` and leaves them open, then loops over ``k-0``, ``k-1``, ...:
begin, send the half message, then COMMIT the even ones and ROLL BACK the odd ones. After each
acknowledgement it appends one line to PROGRESS and flushes it: ``half KEY`` once the half is
stored, ``commit KEY`` / ``rollback KEY`` once EndTransaction answered OK. The parent kill -9s it
whenever it likes, so the line it was about to write may be missing, never a line too many.

Its transaction checker answers UNKNOWN: what it knew died with it; a new producer decides.
"""

from __future__ import annotations

import sys
import time

from rocketmq import (
    ClientConfiguration,
    Credentials,
    Message,
    Producer,
    TransactionChecker,
    TransactionResolution,
)


class Forgetful(TransactionChecker):
    def check(self, message: Message) -> TransactionResolution:
        return TransactionResolution.TRANSACTION_RESOLUTION_UNSPECIFIED


def message(topic: str, key: str) -> Message:
    m = Message()
    m.topic = topic
    m.body = f"body of {key}".encode()
    m.keys = key
    return m


def main() -> None:
    endpoint, topic, progress_path = sys.argv[1:4]
    config = ClientConfiguration(endpoint, Credentials(), namespace="", request_timeout=10)
    producer = Producer(config, topics=[topic], checker=Forgetful())
    producer.startup()
    with open(progress_path, "a", buffering=1) as progress:

        def note(line: str) -> None:
            progress.write(line + "\n")
            progress.flush()

        for i in range(4):
            key = f"open-{i}"
            producer.send(message(topic, key), producer.begin_transaction())
            note(f"half {key}")
        i = 0
        while True:
            key = f"k-{i}"
            txn = producer.begin_transaction()
            producer.send(message(topic, key), txn)
            note(f"half {key}")
            if i % 2 == 0:
                txn.commit()
                note(f"commit {key}")
            else:
                txn.rollback()
                note(f"rollback {key}")
            i += 1
            time.sleep(0.005)


if __name__ == "__main__":
    main()
