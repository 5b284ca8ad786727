"""The broker's CPU per message of a cold PullMessage, before and after decision 400.

CPU time (``time.process_time``, which a loaded machine inflates far less than wall time) per
1 KiB message of one span of 1,024 records, median of repeated runs:

- ``decoded``: what PullMessage did in the broker for a cold read before decision 400 (the
  record engine's decode, ``to_proto_message``, protobuf's serialization);
- ``replies``: what it does now (a bytes slice per message of the replies the worker wrote);
- ``worker_encode``: what the cold worker now spends instead (the native writer, from the record
  bytes since decision 481).

Prints one JSON object; a few seconds.
"""

from __future__ import annotations

import json
import os
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rocketmq.grpc_protocol import service_pb2 as s

from broker.protocol import to_proto_message
from broker.reply import encode_pull_replies
from tiered.cold.segment import RecordSpan
from tiered.record import Message, RecordEncoder

COUNT = 1024


def cpu_us_per_message(fn: Callable[[], object], runs: int) -> float:
    samples = []
    for _ in range(runs):
        t = time.process_time()
        fn()
        samples.append(time.process_time() - t)
    samples.sort()
    return round(samples[len(samples) // 2] / COUNT * 1e6, 2)


def main() -> None:
    encoder = RecordEncoder()
    body = os.urandom(1024)
    records, positions, at = [], [], 0
    for i in range(COUNT):
        m = Message(topic="cold", queue_id=1, body=body, properties={"UNIQ_KEY": uuid.uuid4().hex})
        record, _, _ = encoder.encode(m, i, at, 1_700_000_000_000)
        records.append(record)
        positions.append(at)
        at += len(record)
    data = b"".join(records)
    span = RecordSpan(0, data, positions, encode_pull_replies(data, positions))

    def decoded() -> list[bytes]:
        return [
            s.PullMessageResponse(
                message=to_proto_message(m, "cold", None, None, None)
            ).SerializeToString()
            for m in span.messages(0, COUNT)
        ]

    before = cpu_us_per_message(decoded, 9)
    after = cpu_us_per_message(lambda: span.reply_run(0, COUNT), 21)
    print(
        json.dumps(
            {
                "bench": "cold_reply_cpu",
                "message_bytes": 1024,
                "broker_cpu_us_per_message_decoded": before,
                "broker_cpu_us_per_message_replies": after,
                "worker_cpu_us_per_message_encode": cpu_us_per_message(
                    lambda: encode_pull_replies(data, positions), 9
                ),
                "ratio_broker_cpu_replies_vs_decoded": round(after / before, 3),
                "load_average_1m": round(os.getloadavg()[0], 1),
            }
        )
    )


if __name__ == "__main__":
    main()
