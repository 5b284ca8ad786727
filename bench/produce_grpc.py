"""Produce throughput over gRPC against ``tmq standalone`` in its own process, 1 KiB messages.

- Batch sends: ``SendMessage`` requests of 128 messages from 2 client threads, msgs/s and the
  p50/p99 latency of a call.
- Single sends with Apache's client (``Producer.send``), msgs/s and p50/p99, from 1 and 4 threads.
- The same batches appended straight to a ``MessageStore`` in this process: the store's ceiling
  for this machine, so the gRPC figures can be read as a ratio to it.
- The batch and 4-thread client runs again against a broker with ``[auth]`` on (every call
  signed, the ACL consulted), and with auth and TLS on, as ratios to the plain runs of the same
  invocation (docs/security.md; the goal is >= 0.8).

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
from broker_harness import Standalone, tmq
from rocketmq import ClientConfiguration, Credentials, Message, Producer
from rocketmq.grpc_protocol import definition_pb2 as d
from rocketmq.grpc_protocol import service_pb2 as s
from rocketmq.grpc_protocol import service_pb2_grpc

from remoting.auth import signing_metadata
from tiered.config import StoreConfig
from tiered.record import Message as StoreMessage
from tiered.store import MessageStore

BODY = os.urandom(1024)
BATCH = 128
SECONDS = 8.0
ROUNDS = 3
TARGET = 100_000
ADMIN_KEY, ADMIN_SECRET = "bench-admin", "bench-admin-secret-0123456789"


class Security:
    """How the benchmark reaches a node: plain, signed, or signed over TLS."""

    def __init__(self, sign: bool = False, ca_file: Path | None = None) -> None:
        self.sign = sign
        self.ca_file = ca_file

    def channel(self, endpoint: str) -> grpc.Channel:
        if self.ca_file is None:
            return grpc.insecure_channel(endpoint)
        roots = grpc.ssl_channel_credentials(self.ca_file.read_bytes())
        return grpc.secure_channel(endpoint, roots)

    def metadata(self) -> list[tuple[str, str]] | None:
        return signing_metadata(ADMIN_KEY, ADMIN_SECRET) if self.sign else None

    def credentials(self) -> Credentials:
        return Credentials(ADMIN_KEY, ADMIN_SECRET) if self.sign else Credentials()


PLAIN = Security()


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


def bench_batches(endpoint: str, threads: int = 2, sec: Security = PLAIN) -> dict[str, float]:
    latencies: list[float] = []
    counts = [0] * threads
    stop = time.perf_counter() + SECONDS

    def worker(i: int) -> None:
        stub = service_pb2_grpc.MessagingServiceStub(sec.channel(endpoint))
        request = batch_request()
        while time.perf_counter() < stop:
            started = time.perf_counter()
            reply = stub.SendMessage(request, metadata=sec.metadata(), timeout=30)
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


def bench_client(endpoint: str, threads: int, sec: Security = PLAIN) -> dict[str, float]:
    producer = Producer(
        ClientConfiguration(endpoint, sec.credentials(), request_timeout=10),
        topics=["bench"],
        tls_enable=sec.ca_file is not None,
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


def bench_secured(root: Path, tls: bool) -> dict[str, dict[str, float]]:
    """The batch and 4-thread client runs against a node with auth on (and TLS if ``tls``)."""
    admin = {"TMQ_ADMIN_ACCESS_KEY": ADMIN_KEY, "TMQ_ADMIN_SECRET_KEY": ADMIN_SECRET}
    name = "tls" if tls else "auth"
    extra = ["--auth"]
    ca_file = None
    if tls:
        from tls_harness import make_ca

        (root / name).mkdir()
        ca_file, cert, key = make_ca(root / name)
        # Apache's client trusts gRPC's default roots only, which gRPC reads from here on first
        # use (no TLS channel was opened before).
        os.environ["GRPC_DEFAULT_SSL_ROOTS_FILE_PATH"] = str(ca_file)
        config = root / name / "tmq.toml"
        config.write_text(
            f'[tls]\ncert_file = "{cert}"\nkey_file = "{key}"\nca_file = "{ca_file}"\n'
        )
        extra += ["--config", str(config)]
    node = Standalone(root / f"data-{name}", extra=extra, env=admin, ca_file=ca_file).start()
    sec = Security(sign=True, ca_file=ca_file)
    try:
        env = {**admin, **({"TMQ_TLS_CA_FILE": str(ca_file)} if ca_file else {})}
        done = tmq("topic", "create", "bench", "--queues", "8", "--namesrv", node.namesrv, env=env)
        assert done.returncode == 0, done.stderr
        time.sleep(1)  # registration with the NameServer, which Apache's client does not need
        return {
            "batch_grpc": bench_batches(node.endpoint, sec=sec),
            "single_real_client_4_threads": bench_client(node.endpoint, 4, sec),
        }
    finally:
        node.stop()


def ratios(
    secured: dict[str, dict[str, float]], plain: dict[str, dict[str, float]]
) -> dict[str, float]:
    return {run: round(secured[run]["msgs_per_s"] / plain[run]["msgs_per_s"], 3) for run in secured}


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
    batch_rate = statistics.median(b["msgs_per_s"] for b, _ in rounds)
    ceiling = statistics.median(c for _, c in rounds)
    median_batches = sorted((b for b, _ in rounds), key=lambda b: b["msgs_per_s"])[ROUNDS // 2]
    plain = {"batch_grpc": median_batches, "single_real_client_4_threads": single_4}
    auth_on = bench_secured(root, tls=False)
    tls_on = bench_secured(root, tls=True)
    shutil.rmtree(root, ignore_errors=True)
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
                "auth_on": auth_on,
                "auth_and_tls_on": tls_on,
                "ratio_auth_on_vs_off": ratios(auth_on, plain),
                "ratio_auth_and_tls_on_vs_off": ratios(tls_on, plain),
                "cpus": os.cpu_count(),
            }
        )
    )


if __name__ == "__main__":
    main()
