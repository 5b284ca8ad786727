"""Torture run: everything that can happen to a tiered topic, at once, against real processes.

For ``--seconds`` (default 600) a ``tmq standalone`` broker with SYNC flush, tiny CommitLog files
and tiny segment objects archives a tiered topic to LocalStack S3, reached through the fault
proxy (``localstack/fault_proxy.py``) when it is there, while:

- producers (Apache's ``rocketmq-python-client``, unmodified) send and record every acknowledged
  message: message id, queue, queue offset, body hash, and the wall-clock time the send started;
- pull readers replay the topic from offset 0 to its end over and over (PullMessage, as
  ``tmq replay`` does) and report every gap (an offset skipped that was not legitimately expired),
  every early end ("no new message" below an offset acknowledged more than ``GRACE_S`` earlier)
  and every message whose id or body differs from what was acknowledged at that offset;
- a SimpleConsumer group receives and acks;
- the broker's own offload pass uploads every second, applies a TTL that expires the oldest part,
  and releases local CommitLog files; ``tmq verify --repair`` runs in a loop through the CLI;
- the broker is killed with SIGKILL and restarted at random intervals, and the proxy injects
  object-store faults (black-hole, 503s, connection resets, delays).

At the end (faults healed, broker up, producers stopped) every acknowledged message that the TTL
did not legitimately expire must be readable exactly once per queue, byte-identical, and
``tmq verify`` must say OK. What "legitimately expired" means: retention removes whole segments
from the front of a queue's archive, and only segments whose every message was stored more than
the TTL ago. So after the final read, the only acknowledged messages allowed to be missing are
those below the queue's first readable offset, and every one of them must have been sent more than
the TTL before that read; one that was sent later counts as lost (retention removed unexpired
data).

Prints one JSON line; exits 1 when anything was lost, duplicated, seen with a gap, an early end,
a wrong body, or when the final verify is not OK.

    .venv/bin/python bench/torture.py --seconds 600
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import functools
import hashlib
import importlib.util
import json
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

import grpc  # noqa: E402
from broker_harness import Standalone, tmq  # noqa: E402
from rocketmq import (  # noqa: E402
    ClientConfiguration,
    Credentials,
    FilterExpression,
    Message,
    Producer,
    SimpleConsumer,
)
from rocketmq.grpc_protocol import definition_pb2 as d  # noqa: E402
from rocketmq.grpc_protocol import service_pb2 as s  # noqa: E402
from rocketmq.grpc_protocol import service_pb2_grpc  # noqa: E402
from s3_buckets import delete_bucket  # noqa: E402

TOPIC = "torture"
GROUP = "torture-group"
# A message acknowledged this long ago must be readable (dispatch to the ConsumeQueue follows
# the CommitLog append asynchronously; max_dispatch_lag_bytes bounds how far).
GRACE_S = 3.0
REQUEST_TIMEOUT_S = 10


def _load(path: Path, name: str) -> Any:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def sha(body: bytes) -> str:
    return hashlib.sha256(body).hexdigest()[:32]


# -- what was acknowledged ---------------------------------------------------------------------


@dataclass(slots=True, frozen=True)
class Ack:
    offset: int  # the queue offset in the receipt
    body_hash: str
    sent_s: float  # wall clock when the send started: the store timestamp is not earlier
    acked_s: float


class Ledger:
    """Every acknowledged message by message id, in the order of the acks, and the queue each
    was found in. A RocketMQ 5 receipt names the queue offset but not the queue (the broker
    picks the queue, as Apache's proxy does), so the queue is learned from the reads.
    Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.acks: dict[str, Ack] = {}
        self._times: list[float] = []  # monotonic ack times, in order
        self._ids: list[str] = []
        self.queue_of: dict[str, int] = {}

    def add(self, message_id: str, ack: Ack) -> None:
        with self._lock:
            self.acks[message_id] = ack
            self._times.append(time.monotonic())
            self._ids.append(message_id)

    def acked_before(self, monotonic_s: float) -> list[str]:
        with self._lock:
            return self._ids[: bisect.bisect_right(self._times, monotonic_s)]

    def get(self, message_id: str) -> Ack | None:
        with self._lock:
            return self.acks.get(message_id)

    def locate(self, message_id: str, queue: int) -> None:
        with self._lock:
            self.queue_of.setdefault(message_id, queue)

    def snapshot(self) -> dict[str, Ack]:
        with self._lock:
            return dict(self.acks)


# -- what went wrong, as readers saw it --------------------------------------------------------


@dataclass(slots=True)
class Span:
    """What one replay of one queue covered: from ``start`` up to ``end`` (where it was told
    "no new message"), and the offsets it jumped over."""

    start: int = 0
    end: int = -1
    skipped: list[tuple[int, int]] = field(default_factory=list)
    aborted: str = ""


@dataclass(slots=True)
class Miss:
    """Acknowledged messages one replay pass did not see: each a gap or an early end."""

    spans: dict[int, Span]
    message_ids: list[str]


@dataclass(slots=True)
class Findings:
    lock: threading.Lock = field(default_factory=threading.Lock)
    misses: list[Miss] = field(default_factory=list)
    wrong_bodies: list[str] = field(default_factory=list)
    read_twice: list[str] = field(default_factory=list)
    refused: list[str] = field(default_factory=list)
    read_errors: Counter[str] = field(default_factory=Counter)
    passes: int = 0
    aborted_passes: int = 0
    messages_read: int = 0

    def note(self, kind: list[str], text: str) -> None:
        with self.lock:
            if len(kind) < 1000:
                kind.append(text)

    def error(self, what: str) -> None:
        with self.lock:
            self.read_errors[what] += 1


class Run:
    """Shared state of one torture run: the broker, the ledger, the clock, stop flags."""

    def __init__(self, node: Standalone, queues: int, ttl_s: float, seed: int) -> None:
        self.node = node
        self.queues = queues
        self.ttl_s = ttl_s
        self.rng = random.Random(seed)
        self.ledger = Ledger()
        self.findings = Findings()
        self.stop = threading.Event()  # producers, readers, consumers, verify loop
        self.chaos_stop = threading.Event()  # kills and faults
        self.producers_stop = threading.Event()
        self.kills = 0
        self.kill_walls: list[float] = []
        self.restart_seconds: list[float] = []
        self.sent_failed = 0
        self.consumed: set[str] = set()
        self.consumed_total = 0
        self.verify_runs: Counter[str] = Counter()
        self.verify_failures: list[str] = []
        self.verify_errors: list[str] = []
        self.faults: Counter[str] = Counter()
        self.thread_errors: list[str] = []

    def expirable(self, ack: Ack, at_wall: float) -> bool:
        """May retention have removed this message by wall time ``at_wall``?"""
        return ack.sent_s < at_wall - self.ttl_s

    def retried(self, ack: Ack) -> bool:
        """Might the client have sent this message twice? Apache's client retries a send whose
        reply it did not get (the broker was killed, or the reply took longer than the request
        timeout) with the same message id, so a second stored copy is the client's doing:
        at-least-once, as RocketMQ promises. Any other copy is the broker's."""
        return ack.acked_s - ack.sent_s >= REQUEST_TIMEOUT_S or any(
            ack.sent_s <= k <= ack.acked_s for k in self.kill_walls
        )


def say(what: str) -> None:
    """Progress on stderr; stdout carries only the JSON line."""
    print(f"{time.strftime('%H:%M:%S')} torture: {what}", file=sys.stderr, flush=True)


def guarded(run: Run, name: str, fn: Callable[[], None]) -> threading.Thread:
    def body() -> None:
        try:
            fn()
        except Exception as e:  # a harness bug must not pass for a quiet broker
            run.thread_errors.append(f"{name}: {type(e).__name__}: {e}")
            run.stop.set()

    t = threading.Thread(target=body, name=name, daemon=True)
    t.start()
    return t


# -- producers ----------------------------------------------------------------------------------


def produce(run: Run, index: int, rate: float) -> None:
    """Send at most ``rate`` messages a second, one at a time, as an application does."""
    config = ClientConfiguration(
        run.node.endpoint, Credentials(), request_timeout=REQUEST_TIMEOUT_S
    )
    producer = Producer(config, topics=[TOPIC])
    producer.startup()
    rng = random.Random(index)
    seq = 0
    next_send = time.monotonic()
    try:
        while not run.stop.is_set() and not run.producers_stop.is_set():
            next_send += 1 / rate
            time.sleep(max(0.0, next_send - time.monotonic()))
            seq += 1
            body = f"p{index}-{seq}-".encode() + rng.randbytes(rng.randint(100, 900))
            m = Message()
            m.topic, m.body, m.keys = TOPIC, body, f"p{index}-{seq}"
            sent = time.time()
            try:
                receipt = producer.send(m)
            except Exception:
                run.sent_failed += 1
                time.sleep(0.2)
                continue
            ack = Ack(int(receipt.offset), sha(body), sent, time.time())
            run.ledger.add(receipt.message_id, ack)
    finally:
        producer.shutdown()


# -- pull readers -------------------------------------------------------------------------------


def stub(run: Run) -> Any:
    return service_pb2_grpc.MessagingServiceStub(grpc.insecure_channel(run.node.endpoint))


def query_offset(messaging: Any, queue: int, policy: int) -> int:
    mq = d.MessageQueue(topic=d.Resource(name=TOPIC), id=queue)
    reply = messaging.QueryOffset(
        s.QueryOffsetRequest(message_queue=mq, query_offset_policy=policy), timeout=10
    )
    if reply.status.code != d.OK:
        raise RuntimeError(f"QueryOffset: {reply.status.code} {reply.status.message}")
    return int(reply.offset)


@dataclass(slots=True)
class Pulled:
    code: int
    text: str
    messages: list[tuple[int, str, bytes]]  # (queue offset, message id, body)
    next_offset: int | None


def pull(messaging: Any, queue: int, offset: int, batch: int = 64) -> Pulled:
    request = s.PullMessageRequest(
        group=d.Resource(name="tmq-replay"),
        message_queue=d.MessageQueue(topic=d.Resource(name=TOPIC), id=queue),
        offset=offset,
        batch_size=batch,
    )
    out = Pulled(d.OK, "", [], None)
    for item in messaging.PullMessage(request, timeout=30):
        kind = item.WhichOneof("content")
        if kind == "status":
            out.code, out.text = item.status.code, item.status.message
        elif kind == "message":
            sp = item.message.system_properties
            out.messages.append((sp.queue_offset, sp.message_id, item.message.body))
        elif kind == "next_offset":
            out.next_offset = item.next_offset
    return out


def check_message(run: Run, queue: int, offset: int, message_id: str, body: bytes) -> None:
    run.ledger.locate(message_id, queue)
    ack = run.ledger.get(message_id)
    if ack is not None and (
        ack.body_hash != sha(body) or (ack.offset != offset and not run.retried(ack))
    ):
        run.findings.note(
            run.findings.wrong_bodies,
            f"{message_id}: acknowledged at offset {ack.offset}, read at q{queue}/{offset} "
            f"(body {'same' if ack.body_hash == sha(body) else 'differs'})",
        )


# A replay gives up on a queue after this long without progress (errors, refusals): a read that
# fails loudly while the tier is down is allowed; one that never recovers is reported.
STUCK_S = 60.0


def read_queue_once(run: Run, messaging: Any, queue: int, seen: set[str]) -> Span:
    """Replay ``queue`` from offset 0 to its current end, checking every answer."""
    span = Span()
    in_queue: set[str] = set()
    offset = 0
    progress = time.monotonic()
    while not run.stop.is_set():
        if time.monotonic() - progress > STUCK_S:
            span.aborted = f"no progress at offset {offset} for {STUCK_S:.0f} s"
            return span
        try:
            got = pull(messaging, queue, offset)
        except grpc.RpcError as e:
            run.findings.error(f"rpc {e.code().name}")
            time.sleep(0.5)
            continue
        if got.code == d.ILLEGAL_OFFSET:
            try:
                begin = query_offset(messaging, queue, d.BEGINNING)
            except (grpc.RpcError, RuntimeError) as e:
                run.findings.error(f"begin {type(e).__name__}")
                time.sleep(0.5)
                continue
            if begin <= offset:
                # Refused an offset the broker itself says is readable (item 2's second half).
                run.findings.note(
                    run.findings.refused,
                    f"q{queue}: offset {offset} refused as out of range, though the first "
                    f"readable offset is {begin}: {got.text}",
                )
                time.sleep(0.5)
                continue
            span.skipped.append((offset, begin))
            offset = span.start = begin
            progress = time.monotonic()
            continue
        if got.code not in (d.OK, d.MESSAGE_NOT_FOUND):
            run.findings.error(f"status {d.Code.Name(got.code)}")
            time.sleep(0.5)
            continue
        progress = time.monotonic()
        expected = offset
        for at, message_id, body in got.messages:
            if at != expected:
                span.skipped.append((expected, at))
            if message_id in in_queue:
                ack = run.ledger.get(message_id)
                if ack is None or not run.retried(ack):
                    run.findings.note(
                        run.findings.read_twice, f"{message_id} again at q{queue}/{at}"
                    )
            in_queue.add(message_id)
            seen.add(message_id)
            check_message(run, queue, at, message_id, body)
            expected = at + 1
        with run.findings.lock:
            run.findings.messages_read += len(got.messages)
        next_offset = got.next_offset if got.next_offset is not None else expected
        if next_offset > expected:
            span.skipped.append((expected, next_offset))
        if not got.messages and next_offset <= offset:
            span.end = offset
            return span
        offset = max(next_offset, expected)
    span.aborted = "stopped"
    return span


def read_pass(run: Run, messaging: Any) -> None:
    """Replay every queue once; then every message acknowledged more than GRACE_S before the
    pass began, and not old enough to have expired, must have been seen."""
    began = time.monotonic()
    seen: set[str] = set()
    spans = {q: read_queue_once(run, messaging, q, seen) for q in range(run.queues)}
    if run.stop.is_set():
        return
    if any(span.aborted for span in spans.values()):
        with run.findings.lock:
            run.findings.aborted_passes += 1
        return
    ended = time.time()
    missing = []
    for message_id in run.ledger.acked_before(began - GRACE_S):
        if message_id not in seen:
            ack = run.ledger.get(message_id)
            if ack is not None and not run.expirable(ack, ended):
                missing.append(message_id)
    with run.findings.lock:
        run.findings.passes += 1
        if missing:
            run.findings.misses.append(Miss(spans, missing))


def read_forever(run: Run) -> None:
    messaging = stub(run)
    while not run.stop.is_set():
        read_pass(run, messaging)
        time.sleep(0.2)


def classify_misses(run: Run) -> tuple[list[str], list[str], int]:
    """Each message a pass missed, by where its queue's replay was: below the offset where the
    replay was told "no new message" is a gap; at or above it, an early end. Returns (gaps,
    early ends, messages missed) as one line per (pass, queue)."""
    gaps: list[str] = []
    early: list[str] = []
    total = 0
    for n, miss in enumerate(run.findings.misses):
        by_queue: dict[int | None, list[int]] = defaultdict(list)
        for message_id in miss.message_ids:
            ack = run.ledger.get(message_id)
            assert ack is not None
            by_queue[run.ledger.queue_of.get(message_id)].append(ack.offset)
            total += 1
        for queue, offsets in by_queue.items():
            offsets.sort()
            if queue is None:
                gaps.append(f"pass {n}: {len(offsets)} never seen in any queue: {offsets[:5]}")
                continue
            span = miss.spans[queue]
            above = [o for o in offsets if o >= span.end]
            below = [o for o in offsets if o < span.end]
            if above:
                early.append(
                    f"pass {n} q{queue}: 'no new message' at {span.end}, "
                    f"{len(above)} acknowledged above it: {above[:5]}"
                )
            if below:
                gaps.append(
                    f"pass {n} q{queue}: {len(below)} not returned between {span.start} and "
                    f"{span.end}: {below[:5]}, jumps {span.skipped[:3]}"
                )
    return gaps, early, total


# -- a consumer group ---------------------------------------------------------------------------


def consume(run: Run, until: Callable[[], bool]) -> None:
    config = ClientConfiguration(
        run.node.endpoint, Credentials(), request_timeout=REQUEST_TIMEOUT_S
    )
    consumer = SimpleConsumer(config, GROUP, {TOPIC: FilterExpression()}, await_duration=2)
    consumer.startup()
    try:
        while not until():
            try:
                messages = consumer.receive(32, 15)
            except Exception:
                time.sleep(0.5)
                continue
            for m in messages:
                run.consumed.add(m.message_id)
                run.consumed_total += 1
                with contextlib.suppress(Exception):  # redelivered after the invisible duration
                    consumer.ack(m)
    finally:
        consumer.shutdown()


# -- operators ------------------------------------------------------------------------------------


def verify(run: Run, repair: bool) -> dict[str, Any]:
    args = ["verify", TOPIC, "-n", run.node.namesrv, "--json"] + (["--repair"] if repair else [])
    done = tmq(*args, timeout=120)
    try:
        report: dict[str, Any] = json.loads(done.stdout)
    except ValueError:
        report = {"status": "ERROR", "error": (done.stderr.strip() or "no output")[-300:]}
    return report


def verify_loop(run: Run) -> None:
    while not run.stop.wait(run.rng.uniform(2, 5)):
        report = verify(run, repair=True)
        status = report.get("status", "ERROR")
        run.verify_runs[status] += 1
        if status == "ERROR" and len(run.verify_errors) < 3:
            run.verify_errors.append(str(report.get("error")))
        if status == "FAILURE":
            bad = [
                f"q{q['queue']}: missing {q.get('missing', [])[:2]} "
                f"damaged {q.get('damaged', [])[:1]} {q.get('anomalies', [])[:1]}"
                for q in report.get("queues", [])
                if q.get("status") == "FAILURE"
            ]
            run.verify_failures.append("; ".join(bad))


# -- chaos ----------------------------------------------------------------------------------------


def kill_loop(run: Run, every: tuple[float, float]) -> None:
    while not run.chaos_stop.wait(run.rng.uniform(*every)):
        run.kill_walls.append(time.time())
        run.node.kill9()
        run.kills += 1
        started = time.monotonic()
        run.node.start()
        run.restart_seconds.append(time.monotonic() - started)


class Faults:
    """Object-store faults from the fault proxy (``localstack/fault_proxy.py``), run as its own
    process in front of LocalStack so that the harness's threads never slow the S3 traffic."""

    # Each kind as the proxy's settings. "put_lost_reply": the PUT reaches the bucket and the
    # client is told 500, so its retry meets its own object.
    KINDS: ClassVar[dict[str, dict[str, Any]]] = {
        "blackhole": {"blackhole": True},
        "error_503": {"error_rate": 0.5, "error_status": 503},
        "put_lost_reply": {
            "error_rate": 0.5,
            "error_status": 500,
            "after_forward": True,
            "methods": ["PUT"],
        },
        "reset": {"reset": True},
        "delay": {"delay_ms": 1500},
    }

    def __init__(self, module: Path, upstream: str, workdir: Path) -> None:
        self.control_module = _load(module, "tmq_fault_proxy")
        port_file = workdir / "fault-proxy.port"
        self.proc = subprocess.Popen(
            [
                sys.executable,
                str(module),
                "serve",
                "--upstream",
                upstream,
                "--port-file",
                str(port_file),
            ],
            stdout=subprocess.DEVNULL,
            stderr=(workdir / "fault-proxy.log").open("ab"),
        )
        deadline = time.monotonic() + 30
        while not port_file.exists() or not port_file.read_text():
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise RuntimeError("the fault proxy did not start")
            time.sleep(0.1)
        self.url = f"http://127.0.0.1:{int(port_file.read_text())}"
        self.control = self.control_module.FaultControl(self.url)

    def inject(self, kind: str) -> None:
        self.control.set(**self.KINDS[kind])

    def heal(self) -> None:
        self.control.heal()

    def counters(self) -> dict[str, int]:
        return dict(self.control.snapshot()["counters"])

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)


def fault_loop(run: Run, faults: Faults, every: tuple[float, float]) -> None:
    while not run.chaos_stop.wait(run.rng.uniform(*every)):
        kind = run.rng.choice(sorted(Faults.KINDS))
        faults.inject(kind)
        run.faults[kind] += 1
        run.chaos_stop.wait(run.rng.uniform(3, 12))
        faults.heal()


# -- the end ------------------------------------------------------------------------------------


def read_all(
    run: Run,
) -> tuple[dict[int, int], dict[str, list[tuple[int, int, str]]], list[str]]:
    """Every queue from its first readable offset to its end, with no faults: (first offsets,
    message id -> [(queue, offset, body hash)], problems)."""
    messaging = stub(run)
    begins: dict[int, int] = {}
    found: dict[str, list[tuple[int, int, str]]] = defaultdict(list)
    problems: list[str] = []
    for queue in range(run.queues):
        begin = query_offset(messaging, queue, d.BEGINNING)
        end = query_offset(messaging, queue, d.END)
        begins[queue] = begin
        offset = begin
        tries = 0
        while offset < end:
            got = pull(messaging, queue, offset, batch=256)
            if got.code not in (d.OK, d.MESSAGE_NOT_FOUND) or not got.messages:
                # Reported however it ends; retried, so that what stays unreadable is lost.
                problems.append(f"q{queue}: read at {offset} of [{begin}, {end}): {got.text}")
                tries += 1
                if tries == 10:
                    break
                time.sleep(1)
                continue
            for at, message_id, body in got.messages:
                if at != offset:
                    problems.append(f"q{queue}: expected offset {offset}, read {at}")
                found[message_id].append((queue, at, sha(body)))
                run.ledger.locate(message_id, queue)
                offset = at + 1
    return begins, found, problems


def audit_final(run: Run) -> dict[str, Any]:
    """The end state against the ledger. An acknowledged message is expired (allowed to be
    gone) only below its queue's first readable offset, and only if it was sent more than the
    TTL before retention was stopped; gone otherwise, it is lost (``removed_before_ttl`` when
    retention took it too early). Retention is stopped first (the TTL raised to a year), so
    that the audit does not race expiry at the front of the queues."""
    done = tmq("retain", TOPIC, "-n", run.node.namesrv, "--ttl", "365d")
    if done.returncode != 0:
        # With the run's own failures first: a broker a failed restart left down shows here.
        raise RuntimeError(f"tmq retain: {done.stderr} (harness errors: {run.thread_errors})")
    # A retention pass that began before the new TTL took effect may still be deleting with
    # the old one; its cutoff is before this moment minus the old TTL.
    time.sleep(2)
    final_wall = time.time()
    begins, found, problems = read_all(run)
    acks = run.ledger.snapshot()
    lost: list[str] = []
    removed_early: list[str] = []
    wrong: list[str] = []
    duplicated: list[str] = []
    expired = retry_copies = unlocated = 0
    for message_id, ack in acks.items():
        places = found.get(message_id, [])
        if places:
            if not any(o == ack.offset and h == ack.body_hash for _q, o, h in places):
                wrong.append(f"{message_id}: acknowledged at {ack.offset}, found at {places}")
            queues = Counter(q for q, _o, _h in places)
            if len(places) > 1 and run.retried(ack):
                retry_copies += 1  # the client's retry after a lost reply
            elif any(n > 1 for n in queues.values()):
                duplicated.append(f"{message_id} at {places}")
            continue
        queue = run.ledger.queue_of.get(message_id)
        if queue is None:
            unlocated += 1  # never read by anyone: where it was is unknown
        below = (
            ack.offset < begins[queue] if queue is not None else ack.offset < min(begins.values())
        )
        if below and run.expirable(ack, final_wall):
            expired += 1
        elif below:
            removed_early.append(f"{message_id} at q{queue}/{ack.offset}")
        else:
            lost.append(f"{message_id} at q{queue}/{ack.offset}")
    live = {m for m, places in found.items() if m in acks}
    return {
        "lost": len(lost) + len(removed_early) + len(wrong),
        "lost_examples": (lost + removed_early + wrong)[:4],
        "removed_before_ttl": len(removed_early),
        "wrong_bodies_at_end": len(wrong),
        "expired_by_ttl": expired,
        "duplicated": len(duplicated),
        "duplicate_examples": duplicated[:3],
        "client_retry_copies": retry_copies,
        "never_read_by_anyone": unlocated,
        "first_offsets_at_end": [begins[q] for q in sorted(begins)],
        "group_missing": len(live - run.consumed),
        "final_read_problems": problems[:4],
    }


def drain_consumer(run: Run, seconds: float) -> None:
    wanted = set(run.ledger.snapshot())
    deadline = time.monotonic() + seconds
    consume(run, lambda: wanted <= run.consumed or time.monotonic() > deadline)


def wait_archived(run: Run, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        done = tmq("offload", "status", TOPIC, "-n", run.node.namesrv, "--json", timeout=60)
        if done.returncode == 0:
            rows = json.loads(done.stdout)
            if all(r["tier_watermark"] >= r["max_offset"] for r in rows):
                return True
        time.sleep(2)
    return False


def torture(args: argparse.Namespace) -> dict[str, Any]:
    root = Path(args.data or tempfile.mkdtemp(prefix="tmq-torture-"))
    root.mkdir(parents=True, exist_ok=True)
    manage = _load(REPO / "localstack" / "manage.py", "tmq_localstack_manage")
    manage.start()
    endpoint = manage.endpoint()
    bucket = args.bucket or f"tmq-torture-{uuid.uuid4().hex[:8]}"
    import boto3

    s3 = boto3.client(
        "s3",
        endpoint_url=endpoint,
        region_name="us-east-1",
        aws_access_key_id="test",
        aws_secret_access_key="test",
    )
    faults: Faults | None = None
    proxy_module = Path(args.fault_proxy)
    if not args.no_faults:
        if not proxy_module.exists():
            raise SystemExit(f"no fault proxy at {proxy_module} (or pass --no-faults)")
        faults = Faults(proxy_module, endpoint, root)
    config = root / "tmq.toml"
    # Short S3 timeouts: a black-holed request fails in seconds and the offloader retries it.
    config.write_text(
        "[broker]\n"
        "tier_options = { config_kwargs = { connect_timeout = 2, read_timeout = 5 } }\n"
        "[offload]\n"
        f'segment_max_bytes = "{args.segment_bytes}"\n'
        "upload_after_ms = 1000\n"
        "[retry]\n"
        "attempts = 3\n"
        "base_delay_s = 0.2\n"
    )
    node = Standalone(
        root / "data",
        flush="sync",
        # The run measures loss, not restart time (it reports restart_s_max): a restart took 44 s
        # under ten CPU hogs, and one past the harness's 60 s at load 30 was killed, which left
        # the broker down for the rest of the run and failed its final audit instead.
        start_seconds=300,
        extra=[
            "--commitlog-file-size",
            "64KiB",
            "--offload-interval",
            "1",
            "--tier-url",
            f"s3://{bucket}/tier",
            "--config",
            str(config),
        ],
        env={
            "AWS_ENDPOINT_URL": faults.url if faults is not None else endpoint,
            "AWS_ACCESS_KEY_ID": "test",
            "AWS_SECRET_ACCESS_KEY": "test",
            "AWS_DEFAULT_REGION": "us-east-1",
        },
    )
    s3.create_bucket(Bucket=bucket)
    try:
        node.start()
    except BaseException:
        if faults is not None:
            faults.stop()  # the proxy is a process of its own: never leave it behind
        delete_bucket(s3, bucket)
        raise
    run = Run(node, args.queues, args.ttl, args.seed)
    started = time.monotonic()
    try:
        ns = node.namesrv
        for cmd in (
            ["topic", "create", TOPIC, "-n", ns, "-q", str(args.queues), "--tiered"],
            ["retain", TOPIC, "-n", ns, "--ttl", f"{int(args.ttl)}s"],
        ):
            done = tmq(*cmd)
            if done.returncode != 0:
                raise RuntimeError(f"tmq {' '.join(cmd)}: {done.stderr}")
        node.create_group(GROUP)
        threads = [
            guarded(run, f"producer-{i}", functools.partial(produce, run, i, args.rate))
            for i in range(2)
        ]
        threads += [guarded(run, f"reader-{i}", lambda: read_forever(run)) for i in range(2)]
        threads.append(guarded(run, "consumer", lambda: consume(run, run.stop.is_set)))
        threads.append(guarded(run, "verify", lambda: verify_loop(run)))
        chaos = []
        if not args.no_kills:
            chaos.append(
                guarded(run, "kill", lambda: kill_loop(run, (args.kill_min, args.kill_max)))
            )
        if faults is not None:
            chaos.append(
                guarded(
                    run, "faults", lambda: fault_loop(run, faults, (args.fault_min, args.fault_max))
                )
            )
        say(f"chaos for {args.seconds:.0f} s (data in {root})")
        run.stop.wait(args.seconds)
        say(f"chaos over: {run.kills} kill(s), faults {dict(run.faults)}; healing")
        run.chaos_stop.set()
        for t in chaos:
            t.join(120)
        if faults is not None:
            faults.heal()
        run.producers_stop.set()
        say(f"producers stopped after {len(run.ledger.acks)} acks; readers finish their passes")
        # Two more replays after the last ack: every acknowledged message is seen (and its
        # queue learned) by a pass with no chaos around it.
        passes = run.findings.passes + run.findings.aborted_passes
        deadline = time.monotonic() + 180
        while (
            run.findings.passes + run.findings.aborted_passes < passes + 4
            and time.monotonic() < deadline
            and not run.stop.is_set()
        ):
            time.sleep(0.5)
        run.stop.set()
        for t in threads:
            t.join(120)
        # Quiet now: the group catches up, the archive catches up, then the final audit.
        run.stop.clear()
        say("the group drains")
        drain_consumer(run, 60)
        say("the archive catches up")
        archived = wait_archived(run, 120)
        say("final audit")
        audit = audit_final(run)
        verify_first = verify(run, repair=False)
        verify_final = verify_first
        if verify_first.get("status") == "WARNING":
            verify(run, repair=True)  # orphans of killed or failed uploads, swept while quiet
            verify_final = verify(run, repair=False)
        gaps, early, missed = classify_misses(run)
        f = run.findings
        result: dict[str, Any] = {
            "benchmark": "torture",
            "duration_s": round(time.monotonic() - started, 1),
            "chaos_s": args.seconds,
            "acknowledged": len(run.ledger.acks),
            "send_failures": run.sent_failed,
            **audit,
            "gaps_seen_by_readers": len(gaps),
            "early_ends": len(early),
            "messages_missed_by_readers": missed,
            "gap_examples": gaps[:4],
            "early_end_examples": early[:4],
            "wrong_bodies_seen_by_readers": len(f.wrong_bodies),
            "wrong_body_examples": f.wrong_bodies[:3],
            "read_twice_in_a_pass": len(f.read_twice),
            "refused_in_range": len(f.refused),
            "refused_examples": f.refused[:3],
            "reader_passes": f.passes,
            "reader_passes_aborted": f.aborted_passes,
            "reader_messages": f.messages_read,
            "reader_errors": dict(f.read_errors),
            "group_received": run.consumed_total,
            "archived_at_end": archived,
            "kills": run.kills,
            "restart_s_max": round(max(run.restart_seconds, default=0.0), 1),
            "faults": dict(run.faults),
            "fault_proxy": faults.counters() if faults is not None else None,
            "verify_during_run": dict(run.verify_runs),
            "verify_failure_examples": run.verify_failures[:2],
            "verify_error_examples": run.verify_errors[:2],
            "verify": verify_final.get("status"),
            "verify_before_repair": verify_first.get("status"),
            "harness_errors": run.thread_errors,
        }
        return result
    finally:
        run.stop.set()
        run.chaos_stop.set()
        node.stop()
        if faults is not None:
            faults.stop()
        # LocalStack holds every object in memory until it stops (decision 532).
        delete_bucket(s3, bucket)
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)


def failed(result: dict[str, Any]) -> bool:
    return bool(
        result["lost"]
        or result["duplicated"]
        or result["gaps_seen_by_readers"]
        or result["early_ends"]
        or result["wrong_bodies_seen_by_readers"]
        or result["read_twice_in_a_pass"]
        or result["refused_in_range"]
        or result["group_missing"]
        or result["final_read_problems"]
        or result["harness_errors"]
        or result["verify"] != "OK"
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seconds", type=float, default=600, help="how long the chaos lasts")
    p.add_argument("--queues", type=int, default=4)
    p.add_argument("--ttl", type=float, default=120, help="topic TTL in seconds")
    p.add_argument("--segment-bytes", default="64KiB", help="segment objects roll at this size")
    p.add_argument(
        "--rate", type=float, default=60, help="messages a second per producer (two producers)"
    )
    p.add_argument("--kill-min", type=float, default=20, help="seconds between kills, at least")
    p.add_argument("--kill-max", type=float, default=60)
    p.add_argument("--no-kills", action="store_true")
    p.add_argument("--no-faults", action="store_true", help="reach LocalStack directly")
    p.add_argument("--fault-proxy", default=str(REPO / "localstack" / "fault_proxy.py"))
    p.add_argument("--fault-min", type=float, default=5, help="seconds between faults, at least")
    p.add_argument("--fault-max", type=float, default=20)
    p.add_argument("--seed", type=int, default=int(time.time()))
    p.add_argument("--data", help="data directory (default: a fresh temporary one)")
    p.add_argument("--keep", action="store_true", help="keep the data directory and logs")
    p.add_argument("--bucket", help="the bucket to create, use and delete (default: a new name)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    result = torture(parse_args(argv))
    print(json.dumps(result), flush=True)
    return 1 if failed(result) else 0


if __name__ == "__main__":
    sys.exit(main())
