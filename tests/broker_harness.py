"""Run ``tmq standalone`` as a real process and talk to it as applications and operators do."""

from __future__ import annotations

import base64
import contextlib
import os
import random
import resource
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from broker import admin_pb2 as apb
from broker import admin_pb2_grpc as apb_grpc

try:  # tests/ on the path (most tests), or the repository root (tests/test_ha.py)
    import process_logs
except ImportError:
    from tests import process_logs  # type: ignore[no-redef]

REPO = Path(__file__).resolve().parent.parent


# Ports free_port handed out, each reserved by an abstract Unix socket bound to its name: the
# reservation holds across every test process of this machine (both xdist workers, another
# checkout's run) and ends with the process. The oldest are let go past the cap (file descriptors).
_RESERVED: dict[int, socket.socket] = {}
_RESERVED_MAX = min(2000, resource.getrlimit(resource.RLIMIT_NOFILE)[0] // 4)


def _listen_range() -> tuple[int, int]:
    """Ports for test listeners: below the ephemeral range, above the well-known ones."""
    try:
        first = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0, 0  # not Linux: bind(0)
    return min(15000, first), first


def free_port() -> int:
    """A loopback port nothing listens on, and that no test process of this machine was handed
    before (while it runs). The kernel's "free" holds only until the child given the port binds
    it, a second or more later for a Python child on a loaded machine; meanwhile ``bind(0)``
    hands the same port out again (here about once in 800 calls within the next ten), and two
    children were given one port: a broker then failed to start while the NameServer on its
    port answered its health checks (decision 440).

    The port comes from below the kernel's ephemeral range (``ip_local_port_range``), where
    ``bind(0)`` finds its ports: there an outgoing connection of any process can take a
    broker's port as its own local port while the broker is down for a restart (a torture run
    in CI: `cannot listen on 127.0.0.1:60817: the port is already in use` after a kill -9)."""
    low, high = _listen_range()
    while True:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", random.randrange(low, high) if high > low else 0))
            except OSError:  # something listens there, or holds it
                continue
            port = int(s.getsockname()[1])
        claim = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            claim.bind(f"\0tmq-test-port-{port}")
        except OSError:  # handed out already, here or in another test process
            claim.close()
            continue
        _RESERVED[port] = claim
        while len(_RESERVED) > _RESERVED_MAX:
            _RESERVED.pop(next(iter(_RESERVED))).close()
        return port


def tmq(
    *args: str, timeout: float = 60, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "cli.app", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
        env={**os.environ, **(env or {})},
    )


def wait_healthy(
    proc: subprocess.Popen[Any],
    endpoint: str,
    log_path: Path,
    what: str,
    seconds: float = 60,
    connect: Callable[[], grpc.Channel] | None = None,
) -> None:
    """Wait until the server ``proc`` runs says SERVING on ``endpoint`` (over a channel from
    ``connect``, default a plaintext one); raise with the end of its log if it exits first or
    takes longer than ``seconds``. A SERVING answer counts only when ``proc`` itself listens on
    the port: another server there (one handed the same port) answers too, while ``proc`` fails
    to bind it and exits.

    Each failed check gets a new channel: a channel that found nothing listening retries
    connecting with exponential backoff (1 s, 1.6 times more each time, with jitter), so its
    attempts thin out to one in 17 s and then 27 s; a broker up at 28 s was seen SERVING 15 s
    later over one channel, 0.2 s later with a channel per check. One that took 45 s to start
    at load 30 then passed the 60 s deadline unseen (decision 744)."""
    # Its log's tail goes into the report of a test that fails (tests/process_logs.py).
    process_logs.track(what, log_path)
    connect = connect or (lambda: grpc.insecure_channel(endpoint))
    channel = connect()
    port = int(endpoint.rsplit(":", 1)[1])
    deadline = time.monotonic() + seconds
    impostor = False
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(
                    f"{what} exited with {proc.returncode}: {log_path.read_text()[-2000:]}"
                )
            try:
                health = health_pb2_grpc.HealthStub(channel)
                serving = health.Check(health_pb2.HealthCheckRequest(), timeout=1).status == 1
            except grpc.RpcError:
                serving = False
                channel.close()
                channel = connect()
            if serving:
                if listens_on(proc.pid, port) is not False:
                    return
                impostor = True
            if time.monotonic() > deadline:
                why = (
                    f"another process (not pid {proc.pid}) answers on port {port}"
                    if impostor
                    else "no SERVING answer"
                )
                raise RuntimeError(
                    f"{what} did not become healthy in {seconds:.0f} s ({why}): "
                    f"{log_path.read_text()[-2000:]}"
                )
            time.sleep(0.2)
    finally:
        channel.close()


def listens_on(pid: int, port: int) -> bool | None:
    """Whether process ``pid`` holds a socket listening on TCP ``port`` (None: this system has no
    /proc to tell)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            # sl, local address:port (hex), remote, state (0A: LISTEN), ..., inode
            if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(f"socket:[{fields[9]}]")
    fd_dir = Path(f"/proc/{pid}/fd")
    if not fd_dir.is_dir():
        return None if not Path("/proc/net/tcp").exists() else False
    for fd in fd_dir.iterdir():
        with contextlib.suppress(OSError):
            if os.readlink(fd) in inodes:
                return True
    return False


def thread_states(pid: int) -> list[str]:
    """The scheduler state letter (R, S, D, T, t, ...) of every thread of process ``pid``, from
    /proc; [] once it is gone."""
    states = []
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        return []
    for tid in tids:
        try:
            stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
        except (FileNotFoundError, ProcessLookupError):
            continue  # the thread ended meanwhile
        states.append(stat.rsplit(")", 1)[1].split()[0])  # the name, in (), may hold spaces
    return states


def sigstop(pid: int, seconds: float = 30) -> None:
    """SIGSTOP process ``pid`` and return only once every thread of it is stopped. ``kill``
    returns as soon as the signal is queued; the kernel stops a multi-threaded process's other
    threads only when the one thread that takes the signal next runs, and on a loaded machine
    the rest run on meanwhile: a child stopped this way and sent a byte at once still echoed it
    in 53 of 100 tries at load 27, and a SIGSTOPped slave acknowledged a SYNC send it was meant
    to time out (decision 742)."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + seconds
    while True:
        states = thread_states(pid)
        if states and all(state in "tT" for state in states):
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"pid {pid} did not stop in {seconds:.0f} s: threads {states}")
        time.sleep(0.002)


class Standalone:
    """A ``tmq standalone`` child process on free ports."""

    def __init__(
        self,
        data_dir: Path,
        flush: str = "async",
        extra: list[str] | None = None,
        env: dict[str, str] | None = None,
        metrics_port: int = 0,
        ca_file: Path | None = None,
        start_seconds: float = 60,
    ) -> None:
        self.data_dir = data_dir
        # How long a start may take to answer SERVING before it is killed and raises.
        self.start_seconds = start_seconds
        # Set: the node serves TLS with a certificate from this CA (tests/test_tls.py).
        self.ca_file = ca_file
        self.flush = flush
        self.extra = extra or []
        self.env = env or {}
        self.grpc_port = free_port()
        self.namesrv_port = free_port()
        # 0: no metrics endpoint, so several nodes (and a developer's own broker on 5557) can
        # run at once; tests of the endpoint pass free_port().
        self.metrics_port = metrics_port
        self.proc: subprocess.Popen[str] | None = None

    @property
    def log_path(self) -> Path:
        return self.data_dir.parent / f"{self.data_dir.name}-standalone.log"

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def namesrv(self) -> str:
        return f"127.0.0.1:{self.namesrv_port}"

    def start(self) -> Standalone:
        process_logs.track("standalone", self.log_path, self.env)
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "cli.app",
                "standalone",
                "--data-dir",
                str(self.data_dir),
                "--grpc-port",
                str(self.grpc_port),
                "--namesrv-port",
                str(self.namesrv_port),
                "--flush",
                self.flush,
                "--metrics-port",
                str(self.metrics_port),
                # Preallocated CommitLog files: the 1 GiB default, times every node of a
                # parallel suite, fills a small disk.
                *(
                    []
                    if "--commitlog-file-size" in self.extra
                    else ["--commitlog-file-size", "64MiB"]
                ),
                *self.extra,
            ],
            cwd=REPO,
            env={**os.environ, **self.env},
            stdout=subprocess.DEVNULL,
            # A file, not a pipe: nobody drains a pipe, and a full one would block the broker.
            stderr=self.log_path.open("ab"),
        )
        try:
            wait_healthy(
                self.proc,
                self.endpoint,
                self.log_path,
                "standalone",
                seconds=self.start_seconds,
                connect=self.channel,
            )
        except BaseException:
            # Not left running: the test's cleanup never stops a node whose start raised.
            self.proc.kill()
            self.proc.wait()
            raise
        return self

    def channel(self, target: str | None = None) -> grpc.Channel:
        """A channel to the broker (or ``target``), over TLS when the node serves it."""
        target = target or self.endpoint
        if self.ca_file is None:
            return grpc.insecure_channel(target)
        roots = grpc.ssl_channel_credentials(self.ca_file.read_bytes())
        return grpc.secure_channel(target, roots)

    def admin(self) -> apb_grpc.AdminStub:
        return apb_grpc.AdminStub(grpc.insecure_channel(self.endpoint))

    def create_topic(
        self, name: str, queues: int = 4, message_type: str = "NORMAL", tiered: bool = False
    ) -> None:
        topic = apb.Topic(
            name=name, queues=queues, perm=6, message_type=message_type, tiered=tiered
        )
        self.admin().PutTopic(apb.PutTopicRequest(topic=topic), timeout=10)
        self.wait_routed(name)

    def wait_routed(self, topic: str, seconds: float = 15) -> None:
        """Wait until the NameServer routes ``topic`` (the broker registers a new topic in the
        background): a client started right after create_topic would otherwise be told the
        topic is not served."""
        from rocketmq.grpc_protocol import definition_pb2 as d
        from rocketmq.grpc_protocol import service_pb2 as s
        from rocketmq.grpc_protocol import service_pb2_grpc

        stub = service_pb2_grpc.MessagingServiceStub(grpc.insecure_channel(self.endpoint))
        deadline = time.monotonic() + seconds
        while True:
            reply = stub.QueryRoute(s.QueryRouteRequest(topic=d.Resource(name=topic)), timeout=5)
            if reply.status.code == d.OK or time.monotonic() > deadline:
                return
            time.sleep(0.1)

    def create_group(self, name: str, max_attempts: int = 16, fifo: bool = False) -> None:
        self.admin().PutGroup(
            apb.PutGroupRequest(
                group=apb.Group(name=name, max_delivery_attempts=max_attempts, fifo=fifo)
            ),
            timeout=10,
        )

    def stop(self) -> int:
        """SIGTERM and wait; returns the exit code."""
        assert self.proc is not None
        terminate(self.proc, 30)
        return int(self.proc.returncode)

    def kill9(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait()


def terminate(proc: subprocess.Popen[Any], seconds: float) -> None:
    """SIGTERM ``proc`` if it still runs and wait for it; SIGKILL after ``seconds``."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(seconds)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def tiered_args(tier_url: str) -> list[str]:
    """Options of a broker that offloads to ``tier_url`` within about a second: 64 KiB
    CommitLog files, an offload pass every second, segments uploaded once a second old."""
    return [
        "--commitlog-file-size",
        "64KiB",
        "--offload-interval",
        "1",
        "--upload-after",
        "1s",
        "--tier-url",
        tier_url,
    ]


def start_tiered(
    data: Path, tier_url: str, env: dict[str, str], metrics_port: int = 0
) -> Standalone:
    """A started broker with ``tiered_args``."""
    return Standalone(data, metrics_port=metrics_port, extra=tiered_args(tier_url), env=env).start()


def wait_until(why: str, done: Callable[[], object], seconds: float, every: float = 0.5) -> None:
    """Polls ``done()`` every ``every`` seconds until it is true; an ``AssertionError`` saying
    ``why`` once ``seconds`` have passed without."""
    deadline = time.monotonic() + seconds
    while not done():
        assert time.monotonic() < deadline, why
        time.sleep(every)


def start_namesrv(port: int, log: Path) -> subprocess.Popen[bytes]:
    """``tmq namesrv start`` on 127.0.0.1:``port``, its own process, its stderr appended to
    ``log``."""
    process_logs.track("namesrv", log)
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "cli.app",
            "namesrv",
            "start",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
        ],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=log.open("ab"),
    )


def drain(
    consumer: Any,
    want: int,
    *,
    ack: bool = True,
    seconds: float = 60,
    invisible: int = 30,
    batch: int = 32,
) -> list[Any]:
    """What a started ``SimpleConsumer`` receives, ``batch`` at a time (each invisible for
    ``invisible`` seconds, acknowledged if ``ack``), until ``want`` messages or ``seconds``."""
    got: list[Any] = []
    deadline = time.monotonic() + seconds
    while len(got) < want and time.monotonic() < deadline:
        for m in consumer.receive(batch, invisible):
            got.append(m)
            if ack:
                consumer.ack(m)
    return got


def body_bytes(text: str) -> bytes:
    """The inverse of the CLI's body rendering: UTF-8 text, or ``base64:`` and the bytes."""
    return base64.b64decode(text[7:]) if text.startswith("base64:") else text.encode()


def send_batches(
    endpoint: str,
    topic: str,
    messages: list[tuple[bytes, str, str]],
    batch: int = 500,
) -> list[tuple[str, int]]:
    """Send ``(body, key, tag)`` messages in SendMessage batches over the client's own protocol
    stubs (Apache's client sends one message per call). Returns ``(message id, queue offset)``
    per message, in order."""
    from rocketmq.grpc_protocol import definition_pb2 as d
    from rocketmq.grpc_protocol import service_pb2 as s
    from rocketmq.grpc_protocol import service_pb2_grpc

    stub = service_pb2_grpc.MessagingServiceStub(grpc.insecure_channel(endpoint))
    out: list[tuple[str, int]] = []
    for i in range(0, len(messages), batch):
        request = s.SendMessageRequest()
        for body, key, tag in messages[i : i + batch]:
            m = request.messages.add(topic=d.Resource(name=topic), body=body)
            m.system_properties.message_id = os.urandom(16).hex().upper()
            m.system_properties.message_type = d.NORMAL
            m.system_properties.body_encoding = d.IDENTITY
            m.system_properties.keys.append(key)
            m.system_properties.tag = tag
        reply = stub.SendMessage(request, timeout=60)
        assert reply.status.code == d.OK, reply.status
        out += [(e.message_id, e.offset) for e in reply.entries]
    return out


def client_config(node: Standalone) -> Any:
    """Apache's Python client configured for ``node`` (a ``ClientConfiguration``)."""
    from rocketmq import ClientConfiguration, Credentials

    return ClientConfiguration(node.endpoint, Credentials(), namespace="", request_timeout=10)


def send_all(node: Standalone, topic: str, messages: list[Any]) -> list[str]:
    """Send ``messages`` (the Python client's ``Message``) one by one with its Producer;
    returns their message ids."""
    from rocketmq import Producer

    producer = Producer(client_config(node), topics=[topic])
    producer.startup()
    try:
        return [producer.send(m).message_id for m in messages]
    finally:
        producer.shutdown()


def metric_sample(node: Standalone, sample: str) -> float | None:
    """The value of one sample (``name`` or ``name{labels}``) on the broker's /metrics, or
    None when it is not there (``node`` started with a ``metrics_port``)."""
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{node.metrics_port}/metrics", timeout=10) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(sample + " "):
                return float(line.split()[1])
    return None


def pull_all(
    node: Standalone, topic: str, queues: int, channel: grpc.Channel | None = None
) -> list[Any]:
    """Every message of ``topic`` by PullMessage from offset 0 (the tier below the hot tier),
    as ``apache.rocketmq.v2.Message``; over ``channel`` when given (a signed one, under
    ``[auth]``)."""
    from rocketmq.grpc_protocol import definition_pb2 as d
    from rocketmq.grpc_protocol import service_pb2 as s
    from rocketmq.grpc_protocol import service_pb2_grpc

    stub = service_pb2_grpc.MessagingServiceStub(
        channel if channel is not None else grpc.insecure_channel(node.endpoint)
    )
    out: list[Any] = []
    for queue in range(queues):
        offset = 0
        while True:
            request = s.PullMessageRequest(
                group=d.Resource(name="g-replay"),
                message_queue=d.MessageQueue(topic=d.Resource(name=topic), id=queue),
                offset=offset,
                batch_size=256,
                filter_expression=d.FilterExpression(type=d.TAG, expression="*"),
            )
            got = 0
            for r in stub.PullMessage(request, timeout=60):
                if r.HasField("message"):
                    out.append(r.message)
                    got += 1
                elif r.WhichOneof("content") == "next_offset":
                    offset = r.next_offset
            if not got:
                break
    return out
