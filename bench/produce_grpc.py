"""Produce throughput over gRPC against ``tmq standalone`` in its own process, 1 KiB messages.

- Batch sends: ``SendMessage`` requests of 128 messages from 2 client threads, msgs/s and the
  p50/p99 latency of a call.
- Single sends with Apache's client (``Producer.send``), msgs/s and p50/p99, from 1 and 4 threads.
- The same batches appended straight to a ``MessageStore`` in this process: the store's ceiling
  for this machine, so the gRPC figures can be read as a ratio to it.

The batch sends and the ceiling run three rounds each, alternating; medians are reported (the
machines are shared). Runs with no arguments in about a minute and a half; prints one JSON
object on its last line.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import grpc
from broker_harness import Standalone
from rocketmq import ClientConfiguration, Credentials, Message, Producer
from rocketmq.grpc_protocol import definition_pb2 as d
from rocketmq.grpc_protocol import service_pb2 as s
from rocketmq.grpc_protocol import service_pb2_grpc

from tiered.config import StoreConfig
from tiered.record import Message as StoreMessage
from tiered.store import MessageStore

BODY = os.urandom(1024)
BATCH = 128
SECONDS = 8.0
ROUNDS = 3
TARGET = 100_000


def percentiles(samples: list[float]) -> dict[str, float]:
    if len(samples) < 2:
        return {"p50_ms": 0.0, "p99_ms": 0.0}
    q = statistics.quantiles(samples, n=100)
    return {"p50_ms": round(q[49] * 1000, 2), "p99_ms": round(q[98] * 1000, 2)}


def batch_request() -> s.SendMessageRequest:
    request = s.SendMessageRequest()
    for _ in range(BATCH):
        m = request.messages.add(topic=d.Resource(name="bench"), body=BODY)
        m.system_properties.message_id = uuid.uuid4().hex
        m.system_properties.message_type = d.NORMAL
        m.system_properties.body_encoding = d.IDENTITY
    return request


def bench_batches(endpoint: str, threads: int = 2) -> dict[str, float]:
    latencies: list[float] = []
    counts = [0] * threads
    stop = time.perf_counter() + SECONDS

    def worker(i: int) -> None:
        stub = service_pb2_grpc.MessagingServiceStub(grpc.insecure_channel(endpoint))
        request = batch_request()
        while time.perf_counter() < stop:
            started = time.perf_counter()
            reply = stub.SendMessage(request, timeout=30)
            latencies.append(time.perf_counter() - started)
            assert reply.status.code == d.OK, reply.status
            counts[i] += BATCH

    started = time.perf_counter()
    workers = [threading.Thread(target=worker, args=(i,)) for i in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    elapsed = time.perf_counter() - started
    return {
        "threads": threads,
        "batch": BATCH,
        "msgs_per_s": round(sum(counts) / elapsed),
        **percentiles(latencies),
    }


def bench_client(endpoint: str, threads: int) -> dict[str, float]:
    producer = Producer(
        ClientConfiguration(endpoint, Credentials(), request_timeout=10), topics=["bench"]
    )
    producer.startup()
    latencies: list[float] = []
    counts = [0] * threads
    stop = time.perf_counter() + SECONDS / 2

    def worker(i: int) -> None:
        while time.perf_counter() < stop:
            m = Message()
            m.topic, m.body = "bench", BODY
            started = time.perf_counter()
            producer.send(m)
            latencies.append(time.perf_counter() - started)
            counts[i] += 1

    started = time.perf_counter()
    workers = [threading.Thread(target=worker, args=(i,)) for i in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    elapsed = time.perf_counter() - started
    producer.shutdown()
    return {
        "threads": threads,
        "msgs_per_s": round(sum(counts) / elapsed),
        **percentiles(latencies),
    }


def bench_store_ceiling(root: Path) -> float:
    store = MessageStore(StoreConfig(data_dir=root / "ceiling"))
    store.start()
    batch = [
        StoreMessage(
            topic="bench", queue_id=i % 8, body=BODY, properties={"UNIQ_KEY": uuid.uuid4().hex}
        )
        for i in range(BATCH)
    ]
    sent = 0
    started = time.perf_counter()
    while time.perf_counter() - started < SECONDS / 2:
        store.put_messages(batch)
        sent += BATCH
    store.wait_dispatched(60)
    elapsed = time.perf_counter() - started
    store.shutdown()
    return sent / elapsed


def main() -> None:
    root = Path(tempfile.mkdtemp(prefix="tmq-produce-"))
    node = Standalone(root / "data").start()
    rounds: list[tuple[dict[str, float], float]] = []
    try:
        node.create_topic("bench", queues=8)
        for i in range(ROUNDS):
            batches = bench_batches(node.endpoint)
            rounds.append((batches, bench_store_ceiling(root / f"round-{i}")))
            shutil.rmtree(root / f"round-{i}", ignore_errors=True)
        single_1 = bench_client(node.endpoint, 1)
        single_4 = bench_client(node.endpoint, 4)
    finally:
        node.stop()
    shutil.rmtree(root, ignore_errors=True)
    batch_rate = statistics.median(b["msgs_per_s"] for b, _ in rounds)
    ceiling = statistics.median(c for _, c in rounds)
    median_batches = sorted((b for b, _ in rounds), key=lambda b: b["msgs_per_s"])[ROUNDS // 2]
    print(
        json.dumps(
            {
                "bench": "produce_grpc",
                "message_bytes": len(BODY),
                "batch_grpc": median_batches,
                "batch_grpc_msgs_per_s_rounds": [b["msgs_per_s"] for b, _ in rounds],
                "single_real_client_1_thread": single_1,
                "single_real_client_4_threads": single_4,
                "store_in_process_msgs_per_s": round(ceiling),
                "store_in_process_msgs_per_s_rounds": [round(c) for _, c in rounds],
                "ratio_batch_grpc_vs_store_in_process": round(batch_rate / ceiling, 3),
                "target_msgs_per_s": TARGET,
                "target_met": batch_rate >= TARGET,
                "cpus": os.cpu_count(),
            }
        )
    )


if __name__ == "__main__":
    main()
