"""Produce throughput over gRPC against ``tmq standalone`` in its own process, 1 KiB messages.

- Batch sends: ``SendMessage`` requests of 128 messages from 2 client threads in this process,
  then from 2 threads in each of ``--clients N`` (default 2) client processes (one Python
  client process cannot send faster than its own GIL allows), msgs/s, the p50/p99 latency of
  a call, and the CPU the client processes and the broker spent per message.
- Single sends with Apache's client (``Producer.send``), msgs/s and p50/p99, from 1 and 4 threads.
- The physical limit, measured in the same rounds: the same requests from the same clients to a
  raw gRPC server (its own process, built as the broker builds its server: same thread pool
  and options) whose SendMessage takes the request's bytes and answers a prebuilt response of
  the broker's size, with no broker work at all. ``ratio_batch_grpc_vs_grpc_echo`` is the
  broker's rate over that server's, round by round (median): what the broker leaves of what
  gRPC itself can carry on this machine.
- The same batches appended straight to a ``MessageStore`` in this process (the store's
  ceiling); ``ratio_batch_grpc_vs_store_in_process`` is kept as a second figure. It is not a
  physical limit: it shares the store's code with the broker.
- Auth and TLS: four brokers side by side (plain, ``[auth]`` on, TLS on, both); each round runs
  the batch sends (``--clients`` processes) and Apache's client (4 threads) against each in
  turn, so the ratios to the plain broker compare runs taken under the same load
  (docs/security.md; the goal is >= 0.8).

The batch sends and the ceiling run three rounds each; medians are reported (the machines are
shared, and the JSON carries the load average before and after). Runs with no arguments in
about three minutes; prints one JSON object on its last line.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import grpc
from broker_harness import Standalone, tmq
from rocketmq import ClientConfiguration, Credentials, Message, Producer
from rocketmq.grpc_protocol import definition_pb2 as d
from rocketmq.grpc_protocol import service_pb2 as s
from rocketmq.grpc_protocol import service_pb2_grpc

from broker.protocol import send_response_bytes
from remoting.auth import signing_metadata
from remoting.grpc_server import listen, new_server
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


def bench_batches(
    endpoint: str,
    threads: int = 2,
    sec: Security = PLAIN,
    processes: int = 1,
    seconds: float | None = None,
) -> dict[str, float]:
    """``threads`` threads in each of ``processes`` client processes send batches for
    ``seconds``; with one process they run in this one. Client CPU (every client process) is
    reported per message: on a 2-core machine the client takes CPU the broker could use.
    ``seconds``: ``SECONDS`` when None (read at the call: bench/all.py shortens it)."""
    seconds = SECONDS if seconds is None else seconds
    if processes == 1:
        cpu = time.process_time()
        counts, latencies, elapsed = _send_batches(endpoint, threads, sec, time.time(), seconds)
        client_cpu = time.process_time() - cpu
    else:
        context = multiprocessing.get_context("spawn")  # no fork of a process using gRPC
        begin = time.time() + 2.0  # every process starts sending at the same moment
        with context.Pool(processes) as pool:
            runs = pool.starmap(
                _send_batches_cpu, [(endpoint, threads, sec, begin, seconds)] * processes
            )
        counts = [c for run in runs for c in run[0]]
        latencies = [x for run in runs for x in run[1]]
        elapsed = max(run[2] for run in runs)
        client_cpu = sum(run[3] for run in runs)
    sent = sum(counts)
    return {
        "processes": processes,
        "threads": threads,
        "batch": BATCH,
        "msgs_per_s": round(sent / elapsed),
        **percentiles(latencies),
        "client_cpu_us_per_msg": round(client_cpu / max(1, sent) * 1e6, 2),
    }


def _send_batches(
    endpoint: str, threads: int, sec: Security, begin: float, seconds: float
) -> tuple[list[int], list[float], float]:
    latencies: list[float] = []
    counts = [0] * threads
    time.sleep(max(0.0, begin - time.time()))
    stop = time.perf_counter() + seconds

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
    return counts, latencies, time.perf_counter() - started


def _send_batches_cpu(
    endpoint: str, threads: int, sec: Security, begin: float, seconds: float
) -> tuple[list[int], list[float], float, float]:
    if sec.ca_file is not None:
        os.environ["GRPC_DEFAULT_SSL_ROOTS_FILE_PATH"] = str(sec.ca_file)
    cpu = time.process_time()
    counts, latencies, elapsed = _send_batches(endpoint, threads, sec, begin, seconds)
    return counts, latencies, elapsed, time.process_time() - cpu


def cpu_seconds(pid: int) -> float:
    """User and system CPU of process ``pid`` so far (every thread)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


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


SEND_METHOD = "/apache.rocketmq.v2.MessagingService/SendMessage"


def _serve_echo(ready: Any, stop: Any) -> None:
    """A gRPC server with nothing behind it: SendMessage gets the request's bytes and answers
    the bytes of an OK response for ``BATCH`` messages, built once. The server is made as the
    broker makes its own (broker/server.py: ``new_server``, worker count, message limits)."""
    from broker.server import _MAX_MESSAGE_BYTES, _WORKERS

    answer = send_response_bytes([uuid.uuid4().hex for _ in range(BATCH)], list(range(BATCH)))
    handler = grpc.unary_unary_rpc_method_handler(lambda raw, context: answer)
    server = new_server(
        _WORKERS,
        "echo",
        [
            ("grpc.max_receive_message_length", _MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", _MAX_MESSAGE_BYTES),
        ],
    )
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(SEND_METHOD.split("/")[1], {"SendMessage": handler}),)
    )
    port = listen(server, "127.0.0.1", 0, "echo")
    server.start()
    ready.send(port)
    stop.wait()
    server.stop(0)


class EchoServer:
    """``_serve_echo`` in a spawned process (its own GIL, as the broker has), on a free port."""

    def __enter__(self) -> EchoServer:
        context = multiprocessing.get_context("spawn")
        receive, send = context.Pipe(duplex=False)
        self._stop = context.Event()
        self.process = context.Process(target=_serve_echo, args=(send, self._stop), daemon=True)
        self.process.start()
        if not receive.poll(60):
            raise RuntimeError("the echo server did not start in 60 s")
        self.endpoint = f"127.0.0.1:{receive.recv()}"
        assert self.process.pid is not None
        self.pid: int = self.process.pid
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self.process.join(10)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()


def start_node(root: Path, name: str, auth: bool, ca: tuple[Path, Path, Path] | None) -> Any:
    """A ``tmq standalone`` with topic ``bench``: plain, with ``--auth``, with TLS, or both."""
    admin = {"TMQ_ADMIN_ACCESS_KEY": ADMIN_KEY, "TMQ_ADMIN_SECRET_KEY": ADMIN_SECRET}
    extra = ["--auth"] if auth else []
    if ca is not None:
        ca_file, cert, key = ca
        config = root / f"{name}.toml"
        config.write_text(
            f'[tls]\ncert_file = "{cert}"\nkey_file = "{key}"\nca_file = "{ca_file}"\n'
        )
        extra += ["--config", str(config)]
    node = Standalone(
        root / f"data-{name}", extra=extra, env=admin, ca_file=ca[0] if ca else None
    ).start()
    env = {**admin, **({"TMQ_TLS_CA_FILE": str(ca[0])} if ca else {})}
    done = tmq("topic", "create", "bench", "--queues", "8", "--namesrv", node.namesrv, env=env)
    assert done.returncode == 0, done.stderr
    return node


def ratios(runs: dict[str, dict[str, float]], plain: dict[str, float]) -> dict[str, float]:
    return {name: round(r["msgs_per_s"] / plain["msgs_per_s"], 3) for name, r in runs.items()}


def median_run(runs: list[dict[str, float]]) -> dict[str, float]:
    return sorted(runs, key=lambda r: r["msgs_per_s"])[len(runs) // 2]


def bench_security(root: Path, processes: int) -> dict[str, Any]:
    """Batch sends and Apache's client (4 threads) against four brokers running side by side:
    plain, auth on, TLS on, auth and TLS on. Every round runs each of the four in turn, so
    the ratios compare runs taken under the same load; medians of the rounds."""
    from tls_harness import make_ca

    (root / "ca").mkdir()
    ca = make_ca(root / "ca")
    # Apache's client trusts gRPC's default roots only, which gRPC reads from here on first
    # use (no TLS channel was opened before).
    os.environ["GRPC_DEFAULT_SSL_ROOTS_FILE_PATH"] = str(ca[0])
    setups = {
        "off": (False, None),
        "auth": (True, None),
        "tls": (False, ca),
        "auth_and_tls": (True, ca),
    }
    nodes = {name: start_node(root, name, auth, tls) for name, (auth, tls) in setups.items()}
    batches: dict[str, list[dict[str, float]]] = {name: [] for name in setups}
    clients: dict[str, list[dict[str, float]]] = {name: [] for name in setups}
    try:
        time.sleep(1)  # registration with the NameServer, which Apache's client does not need
        for _ in range(ROUNDS):
            for name, (auth, tls) in setups.items():
                sec = Security(sign=auth, ca_file=tls[0] if tls else None)
                endpoint = nodes[name].endpoint
                batches[name].append(
                    bench_batches(endpoint, sec=sec, processes=processes, seconds=SECONDS / 2)
                )
                clients[name].append(bench_client(endpoint, 4, sec))
    finally:
        for node in nodes.values():
            node.stop()
    batch = {name: median_run(runs) for name, runs in batches.items()}
    client = {name: median_run(runs) for name, runs in clients.items()}
    return {
        "batch_grpc": batch,
        "batch_grpc_msgs_per_s_rounds": {
            name: [r["msgs_per_s"] for r in runs] for name, runs in batches.items()
        },
        "single_real_client_4_threads": client,
        "ratio_batch_vs_off": ratios(batch, batch["off"]),
        # Per round, each broker's rate over the plain one's taken minutes apart at most, then
        # the median: steadier than a ratio of medians when the load moves between rounds.
        "ratio_batch_vs_off_paired": {
            name: round(
                statistics.median(
                    r["msgs_per_s"] / off["msgs_per_s"]
                    for r, off in zip(runs, batches["off"], strict=True)
                ),
                3,
            )
            for name, runs in batches.items()
        },
        "ratio_client_4_threads_vs_off": ratios(client, client["off"]),
    }


def main() -> None:
    processes = int(sys.argv[sys.argv.index("--clients") + 1]) if "--clients" in sys.argv else 2
    load_before = os.getloadavg()
    root = Path(tempfile.mkdtemp(prefix="tmq-produce-"))
    node = Standalone(root / "data").start()
    rounds: list[tuple[dict[str, float], dict[str, float], float]] = []
    # Per round, the raw gRPC server's runs with the same client setups (the physical limit).
    echoes: list[tuple[dict[str, float], dict[str, float]]] = []
    try:
        node.create_topic("bench", queues=8)
        assert node.proc is not None
        with EchoServer() as echo:
            for i in range(ROUNDS):
                runs, limits = [], []
                for n in (1, processes):
                    cpu = cpu_seconds(node.proc.pid)
                    run = bench_batches(node.endpoint, processes=n)
                    sent = run["msgs_per_s"] * SECONDS
                    run["broker_cpu_us_per_msg"] = round(
                        (cpu_seconds(node.proc.pid) - cpu) / sent * 1e6, 2
                    )
                    runs.append(run)
                    cpu = cpu_seconds(echo.pid)
                    limit = bench_batches(echo.endpoint, processes=n)
                    limit["server_cpu_us_per_msg"] = round(
                        (cpu_seconds(echo.pid) - cpu) / (limit["msgs_per_s"] * SECONDS) * 1e6,
                        2,
                    )
                    limits.append(limit)
                rounds.append((runs[0], runs[1], bench_store_ceiling(root / f"round-{i}")))
                echoes.append((limits[0], limits[1]))
                shutil.rmtree(root / f"round-{i}", ignore_errors=True)
        single_1 = bench_client(node.endpoint, 1)
        single_4 = bench_client(node.endpoint, 4)
    finally:
        node.stop()
    in_process = median_run([r[0] for r in rounds])
    spread = median_run([r[1] for r in rounds])
    ceiling = statistics.median(c for _, _, c in rounds)
    best = max(in_process["msgs_per_s"], spread["msgs_per_s"])
    # Each round: the broker's best client setup over the raw server's best, both measured
    # minutes apart at most; then the median of the rounds.
    vs_echo = statistics.median(
        max(r[0]["msgs_per_s"], r[1]["msgs_per_s"]) / max(e[0]["msgs_per_s"], e[1]["msgs_per_s"])
        for r, e in zip(rounds, echoes, strict=True)
    )
    security = bench_security(root, processes) if "--no-security" not in sys.argv else None
    shutil.rmtree(root, ignore_errors=True)
    report: dict[str, Any] = {
        "bench": "produce_grpc",
        "message_bytes": len(BODY),
        # 2 client threads in this process (the bench's figure before decision 261)
        "batch_grpc": in_process,
        "batch_grpc_msgs_per_s_rounds": [r[0]["msgs_per_s"] for r in rounds],
        # the same 2 threads in each of ``processes`` client processes
        f"batch_grpc_{processes}_client_processes": spread,
        "batch_grpc_client_processes_msgs_per_s_rounds": [r[1]["msgs_per_s"] for r in rounds],
        # the physical limit: the same clients against a gRPC server that does no work
        "grpc_echo": median_run([e[0] for e in echoes]),
        "grpc_echo_msgs_per_s_rounds": [e[0]["msgs_per_s"] for e in echoes],
        f"grpc_echo_{processes}_client_processes": median_run([e[1] for e in echoes]),
        "grpc_echo_client_processes_msgs_per_s_rounds": [e[1]["msgs_per_s"] for e in echoes],
        "ratio_batch_grpc_vs_grpc_echo": round(vs_echo, 3),
        "single_real_client_1_thread": single_1,
        "single_real_client_4_threads": single_4,
        # kept as a second figure: our own store in this process, not a physical limit
        "store_in_process_msgs_per_s": round(ceiling),
        "store_in_process_msgs_per_s_rounds": [round(c) for _, _, c in rounds],
        "ratio_batch_grpc_vs_store_in_process": round(best / ceiling, 3),
        "target_msgs_per_s": TARGET,
        "target_met": best >= TARGET,
    }
    if security is not None:
        report["security"] = security
        report["ratio_auth_on_vs_off"] = security["ratio_batch_vs_off"]["auth"]
        report["ratio_tls_on_vs_off"] = security["ratio_batch_vs_off"]["tls"]
        report["ratio_auth_and_tls_on_vs_off"] = security["ratio_batch_vs_off"]["auth_and_tls"]
    report["load_average"] = [round(x, 2) for x in (*load_before, *os.getloadavg())]
    report["cpus"] = os.cpu_count()
    print(json.dumps(report))


if __name__ == "__main__":
    main()
