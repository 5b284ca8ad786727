"""Readers of a tiered topic against a real broker: the switch from the hot store to the tier
is atomic for them (no gap, no early end, no "offset too small" for what the tier holds), and an
object-store outage stops neither non-tiered reads nor hot reads."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from broker_harness import Standalone, send_batches
from rocketmq.grpc_protocol import definition_pb2 as d
from rocketmq.grpc_protocol import service_pb2 as s
from rocketmq.grpc_protocol import service_pb2_grpc

from broker import admin_pb2 as apb

TIERING = [
    "--commitlog-file-size",
    "128KiB",
    "--offload-interval",
    "1",
    "--upload-after",
    "1s",
]


def body_of(i: int) -> bytes:
    return f"{i:07d}".encode() * 100  # 700 bytes, names its own queue offset


@dataclass
class Pulled:
    code: int
    message: str
    offsets: list[int] = field(default_factory=list)
    bodies: list[bytes] = field(default_factory=list)
    next_offset: int = -1
    seconds: float = 0.0


def pull(
    stub: Any, topic: str, queue: int, offset: int, batch: int = 32, timeout: float = 30
) -> Pulled:
    request = s.PullMessageRequest(
        group=d.Resource(name="tier-reader"),
        message_queue=d.MessageQueue(topic=d.Resource(name=topic), id=queue),
        offset=offset,
        batch_size=batch,
    )
    request.long_polling_timeout.FromMilliseconds(0)
    started = time.monotonic()
    out = Pulled(-1, "")
    for item in stub.PullMessage(request, timeout=timeout):
        kind = item.WhichOneof("content")
        if kind == "status":
            out.code, out.message = item.status.code, item.status.message
        elif kind == "message":
            out.offsets.append(item.message.system_properties.queue_offset)
            out.bodies.append(item.message.body)
        elif kind == "next_offset":
            out.next_offset = item.next_offset
    out.seconds = time.monotonic() - started
    return out


def end_offset(stub: Any, topic: str, queue: int) -> int:
    reply = stub.QueryOffset(
        s.QueryOffsetRequest(
            message_queue=d.MessageQueue(topic=d.Resource(name=topic), id=queue),
            query_offset_policy=d.END,
        ),
        timeout=10,
    )
    return int(reply.offset)


def test_a_replay_racing_release_sees_no_gap_and_no_early_end(tmp_path: Path) -> None:
    """Release is slowed between its two steps (failpoint), so a replay from offset 0 keeps
    landing in the switch from hot to cold. Every pull must continue exactly where the last one
    ended, with the bytes sent for those offsets, up to the end the broker announced before it."""
    node = Standalone(
        tmp_path / "data",
        extra=TIERING,
        env={"TMQ_FAILPOINTS": "release.mid_switch=sleep:1.0"},
    ).start()
    topic = "switch"
    problems: list[str] = []
    done = threading.Event()
    replays = 0
    try:
        node.admin().PutTopic(
            apb.PutTopicRequest(topic=apb.Topic(name=topic, queues=1, perm=6, tiered=True)),
            timeout=10,
        )
        stub = service_pb2_grpc.MessagingServiceStub(grpc.insecure_channel(node.endpoint))
        total = 3000

        def produce() -> None:
            for start in range(0, total, 60):
                send_batches(
                    node.endpoint,
                    topic,
                    [(body_of(i), f"k{i}", "t") for i in range(start, start + 60)],
                    batch=60,
                )
                time.sleep(0.1)
            done.set()

        producer = threading.Thread(target=produce)
        producer.start()
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and (not done.is_set() or replays < 3):
            offset = 0
            while time.monotonic() < deadline:
                known_end = end_offset(stub, topic, 0)
                if offset >= known_end:
                    break
                got = pull(stub, topic, 0, offset)
                if got.code != d.OK:
                    problems.append(
                        f"offset {offset} (end {known_end}): code {d.Code.Name(got.code)} "
                        f"{got.message!r}, next {got.next_offset}"
                    )
                    break
                expected = list(range(offset, offset + len(got.offsets)))
                if got.offsets != expected or got.next_offset != offset + len(got.offsets):
                    problems.append(
                        f"offset {offset}: got {got.offsets[:3]}.. next {got.next_offset}"
                    )
                    break
                if any(b != body_of(o) for o, b in zip(got.offsets, got.bodies, strict=True)):
                    problems.append(f"offset {offset}: a body differs from what was sent")
                    break
                offset = got.next_offset
            replays += 1
            if problems:
                break
        producer.join(timeout=60)
        log = node.log_path.read_text()
        assert "failpoint release.mid_switch" in log, "release never ran: the race was not tried"
        assert not problems, problems[:5]
        assert replays >= 3
    finally:
        done.set()
        node.stop()
