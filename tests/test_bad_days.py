"""Bad days around consumption: a disk that fills under the consumer offsets' save, and consumers
that go away in the middle of a long poll or of a batch being sent (decisions 1000 and 1001).

Real broker processes, a real tmpfs, Apache's Python client and the RocketMQ protocol's own stubs.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import resource
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from broker_harness import (
    Standalone,
    client_config,
    drain,
    send_batches,
    wait_until,
)
from conftest import SMALL, mounted_tmpfs
from google.protobuf.duration_pb2 import Duration
from rocketmq import FilterExpression, SimpleConsumer
from rocketmq.grpc_protocol import definition_pb2 as d
from rocketmq.grpc_protocol import service_pb2 as s
from rocketmq.grpc_protocol import service_pb2_grpc

from broker import admin_pb2 as apb


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 12 MiB tmpfs (root only)."""
    with mounted_tmpfs(tmp_path / "small", "12m") as mnt:
        yield mnt


class Filler:
    """Another writer on the broker's disk that keeps it full: it takes every free byte, and
    again every 50 ms (the broker frees a page now and then, when a save's rename drops the
    file it replaces)."""

    def __init__(self, directory: Path) -> None:
        self.path = directory / "filler"
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        self._stop = threading.Event()
        self._top_off()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _top_off(self) -> None:
        try:
            while True:
                os.write(self._fd, bytes(4096))
        except OSError as e:
            assert e.errno == errno.ENOSPC, e

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            self._top_off()

    def free(self) -> None:
        self._stop.set()
        self._thread.join()
        os.close(self._fd)
        self.path.unlink()


def saved_offsets(data_dir: Path) -> dict[tuple[str, str, int], int]:
    path = data_dir / "config" / "consumer_offsets.json"
    if not path.exists():
        return {}
    return {(r["group"], r["topic"], r["queue"]): r["offset"] for r in json.loads(path.read_text())}


def offsets_consumer(node: Standalone) -> SimpleConsumer:
    """Apache's SimpleConsumer of group g-bd-offsets on topic bd-offsets, started."""
    consumer = SimpleConsumer(
        client_config(node), "g-bd-offsets", {"bd-offsets": FilterExpression()}, await_duration=2
    )
    consumer.startup()
    return consumer


def test_consumer_offsets_a_full_disk_refused_are_saved_once_space_is_freed(
    small_disk: Path, tmp_path: Path
) -> None:
    """The broker saves the groups' offsets every 5 s when one moved. A save the full disk
    refused cleared the 'moved' mark all the same, so after the space came back nothing was
    saved until a consumer moved an offset again, and a kill -9 meanwhile rewound the group to
    the last saved file: every message acknowledged during the outage was delivered again."""
    data_dir = small_disk / "data"
    config = tmp_path / "tmq.toml"
    config.write_text(
        "[store]\ncommitlog_file_size = 1048576\nconsumequeue_entries_per_file = 1000\n"
        "index_hash_slots = 1000\nindex_max_entries = 4000\n"
    )
    node = Standalone(
        data_dir, extra=["--config", str(config), "--commitlog-file-size", "1MiB"]
    ).start()
    consumer = None
    try:
        node.create_topic("bd-offsets", queues=1)
        node.create_group("g-bd-offsets")
        send_batches(node.endpoint, "bd-offsets", [(b"x" * 100, f"k{i}", "t") for i in range(20)])
        consumer = offsets_consumer(node)
        key = ("g-bd-offsets", "bd-offsets", 0)
        assert len(drain(consumer, 10, batch=10)) == 10
        wait_until("the first offsets saved", lambda: saved_offsets(data_dir).get(key) == 10, 15)
        filler = Filler(small_disk)
        try:
            # Acknowledged while the disk is full: the offset moves in memory only.
            assert len(drain(consumer, 10, batch=10)) == 10
            wait_until(
                "a save the full disk refused",
                lambda: "saving consumer offsets failed" in node.log_path.read_text(),
                20,
            )
        finally:
            filler.free()
        consumer.shutdown()
        consumer = None
        # The next 5-s tick saves what the refused one could not.
        wait_until(
            "the offsets saved once space is back",
            lambda: saved_offsets(data_dir).get(key) == 20,
            15,
        )
        node.kill9()
        node.start()
        consumer = offsets_consumer(node)
        again = drain(consumer, 1, seconds=4)
        assert again == [], f"{len(again)} acknowledged message(s) delivered again after kill -9"
    finally:
        if consumer is not None:
            consumer.shutdown()
        if node.proc is not None and node.proc.poll() is None:
            node.stop()


def receive_request(
    group: str, topic: str, batch: int, invisible_s: int, poll_s: int
) -> s.ReceiveMessageRequest:
    return s.ReceiveMessageRequest(
        group=d.Resource(name=group),
        message_queue=d.MessageQueue(topic=d.Resource(name=topic), id=-1),
        filter_expression=d.FilterExpression(type=d.TAG, expression="*"),
        batch_size=batch,
        invisible_duration=Duration(seconds=invisible_s),
        long_polling_timeout=Duration(seconds=poll_s),
        auto_renew=False,
    )


def receive_all(
    stub: service_pb2_grpc.MessagingServiceStub, group: str, topic: str, want: int, seconds: float
) -> list[d.Message]:
    got: list[d.Message] = []
    deadline = time.monotonic() + seconds
    while len(got) < want and time.monotonic() < deadline:
        for reply in stub.ReceiveMessage(receive_request(group, topic, 32, 60, 2), timeout=10):
            if reply.HasField("message"):
                got.append(reply.message)
    return got


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Standalone]:
    node = Standalone(tmp_path_factory.mktemp("bd") / "data").start()
    yield node
    assert node.stop() == 0


def test_a_consumer_gone_during_its_long_poll_takes_nothing_with_it(broker: Standalone) -> None:
    """A long poll whose consumer went away (cancelled, timed out, killed) went on waiting,
    popped the next message to arrive and wrote it to the dead stream: invisible to every
    other consumer for the whole invisible duration, and counted as a delivery attempt."""
    broker.create_topic("bd-poll", queues=1)
    broker.create_group("g-bd-poll")
    stub = service_pb2_grpc.MessagingServiceStub(broker.channel())
    # Invisible for 5 minutes: a leak would outlast the test by far.
    call = stub.ReceiveMessage(receive_request("g-bd-poll", "bd-poll", 4, 300, 20), timeout=30)
    replies: list[s.ReceiveMessageResponse] = []

    def read() -> None:
        with contextlib.suppress(grpc.RpcError):
            replies.extend(call)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    time.sleep(1.5)  # the broker is waiting in its long poll
    call.cancel()
    reader.join(10)
    assert not any(r.HasField("message") for r in replies)
    sent = send_batches(broker.endpoint, "bd-poll", [(b"late", "k", "t")])
    time.sleep(3)  # the abandoned poll wakes up at the new message (it waits up to 1 s at a time)
    got = receive_all(stub, "g-bd-poll", "bd-poll", 1, 10)
    assert [m.system_properties.message_id for m in got] == [sent[0][0]]
    assert got[0].system_properties.delivery_attempt == 1


def test_a_consumer_gone_while_its_batch_is_sent_loses_none_of_it(broker: Standalone) -> None:
    """A batch of large messages outruns the stream's flow-control window: the consumer takes
    the first and cancels. Apache's clients drop a whole batch whose stream ends in an error
    (the Python client gathers the stream before returning anything), so none of it reached the
    application: all 8 must be delivered again at once, each once, as first attempts, not after
    their 5-minute invisibility (on main the ones not yet written stayed invisible)."""
    broker.create_topic("bd-batch", queues=1)
    broker.create_group("g-bd-batch")
    body = os.urandom(1 << 20)
    sent = send_batches(broker.endpoint, "bd-batch", [(body, f"k{i}", "t") for i in range(8)], 2)
    ids = [mid for mid, _ in sent]
    stub = service_pb2_grpc.MessagingServiceStub(broker.channel())
    call = stub.ReceiveMessage(receive_request("g-bd-batch", "bd-batch", 8, 300, 2), timeout=30)
    first = None
    for reply in call:
        if reply.HasField("message"):
            first = reply.message.system_properties.message_id
            call.cancel()
            break
    assert first == ids[0]
    time.sleep(1)
    got = receive_all(stub, "g-bd-batch", "bd-batch", 8, 15)
    got_ids = [m.system_properties.message_id for m in got]
    assert sorted(got_ids) == sorted(ids), f"missing {sorted(set(ids) - set(got_ids))}"
    assert all(m.system_properties.delivery_attempt == 1 for m in got)


CLOCK_SHIFT = Path(__file__).parent / "clock_shift"


def step_clock(shift_file: Path, shift_ms: int) -> None:
    tmp = shift_file.with_suffix(".tmp")
    tmp.write_text(str(shift_ms))
    os.replace(tmp, shift_file)


def test_a_step_of_the_wall_clock_neither_redelivers_nor_hides_messages_in_flight(
    tmp_path: Path,
) -> None:
    """Pop deadlines were wall-clock times. A clock stepped an hour forward (NTP catching up,
    an operator) expired every delivery in flight at once: each was copied to the retry topic
    and delivered to a second consumer while the first still held it, and the first one's
    acknowledgement was refused. Stepped back an hour, every delivery in flight stayed
    invisible an hour longer than its consumer asked. The broker's wall clock is shifted in its
    own process (tests/clock_shift); the machine's is never touched."""
    shift = tmp_path / "clock-shift-ms"
    step_clock(shift, 0)
    node = Standalone(
        tmp_path / "data",
        env={
            "PYTHONPATH": os.pathsep.join(
                [str(CLOCK_SHIFT), *filter(None, [os.environ.get("PYTHONPATH")])]
            ),
            "TMQ_CLOCK_SHIFT_FILE": str(shift),
        },
    ).start()
    try:
        node.create_topic("bd-clock", queues=1)
        node.create_group("g-bd-clock")
        stub = service_pb2_grpc.MessagingServiceStub(node.channel())
        ids = [mid for mid, _ in send_batches(node.endpoint, "bd-clock", [(b"a", "k1", "t")])]

        def receive(invisible_s: int, poll_s: int) -> list[d.Message]:
            req = receive_request("g-bd-clock", "bd-clock", 4, invisible_s, poll_s)
            return [
                r.message for r in stub.ReceiveMessage(req, timeout=30) if r.HasField("message")
            ]

        [held] = receive(60, 2)
        assert held.system_properties.message_id == ids[0]
        step_clock(shift, 3_600_000)  # an hour forward
        time.sleep(3)  # revives run every second
        again = receive(60, 2)
        assert again == [], "a delivery 57 s from its deadline was delivered again"
        ack = stub.AckMessage(
            s.AckMessageRequest(
                group=d.Resource(name="g-bd-clock"),
                topic=d.Resource(name="bd-clock"),
                entries=[
                    s.AckMessageEntry(
                        message_id=held.system_properties.message_id,
                        receipt_handle=held.system_properties.receipt_handle,
                    )
                ],
            ),
            timeout=10,
        )
        assert ack.status.code == d.OK, ack.status

        ids = [mid for mid, _ in send_batches(node.endpoint, "bd-clock", [(b"b", "k2", "t")])]
        [held] = receive(2, 2)  # invisible for 2 s
        assert held.system_properties.message_id == ids[0]
        step_clock(shift, 0)  # an hour back
        got = receive_all(stub, "g-bd-clock", "bd-clock", 1, 10)
        assert [m.system_properties.message_id for m in got] == ids, (
            "a delivery invisible for 2 s was still hidden 10 s later"
        )
        assert got[0].system_properties.delivery_attempt == 2
    finally:
        node.stop()


class FdLimited(Standalone):
    """A broker started under ``ulimit -n`` (soft, hard): the limit is set in the child before
    it execs, as a shell's ``ulimit`` or systemd's ``LimitNOFILE=`` would."""

    def __init__(self, data_dir: Path, soft: int, hard: int) -> None:
        super().__init__(data_dir)
        self.limits = (soft, hard)

    def start(self) -> FdLimited:
        real = subprocess.Popen
        limits = self.limits

        def popen(*args: Any, **kwargs: Any) -> Any:
            kwargs["preexec_fn"] = lambda: resource.setrlimit(resource.RLIMIT_NOFILE, limits)
            return real(*args, **kwargs)

        subprocess.Popen = popen  # type: ignore[misc]
        try:
            super().start()
        finally:
            subprocess.Popen = real  # type: ignore[misc]
        return self


FD_QUEUES = 8
# 320 ConsumeQueue files, two descriptors each (the file's and the one Python's mmap dups).
FD_TOPICS = 40


def send_one_per_queue(
    stub: service_pb2_grpc.MessagingServiceStub,
    topics: int = FD_TOPICS,
    refused: list[tuple[int, int, d.Status]] | None = None,
) -> list[str]:
    """The ids of the messages acknowledged; a refusal fails the test unless ``refused`` is
    given, which then gets (topic number, queue, status) of each."""
    ids: list[str] = []
    for t in range(topics):
        for q in range(FD_QUEUES):
            request = s.SendMessageRequest()
            m = request.messages.add(topic=d.Resource(name=f"bd-fd{t}"), body=f"{t}/{q}".encode())
            m.system_properties.message_id = os.urandom(16).hex().upper()
            m.system_properties.message_type = d.NORMAL
            m.system_properties.body_encoding = d.IDENTITY
            m.system_properties.queue_id = q
            reply = stub.SendMessage(request, timeout=30)
            if refused is not None and reply.status.code != d.OK:
                refused.append((t, q, reply.status))
                continue
            assert reply.status.code == d.OK, reply.status
            ids.append(m.system_properties.message_id)
    return ids


def make_fd_topics(node: Standalone, topics: int = FD_TOPICS) -> None:
    for t in range(topics):
        node.admin().PutTopic(
            apb.PutTopicRequest(topic=apb.Topic(name=f"bd-fd{t}", queues=FD_QUEUES, perm=6)),
            timeout=10,
        )
    node.create_group("g-bd-fd")


def stored_ids(stub: service_pb2_grpc.MessagingServiceStub, topics: int = FD_TOPICS) -> list[str]:
    """Every message of the topics by PullMessage, over one connection (a new one may find no
    descriptor to be accepted with)."""
    out: list[str] = []
    for t in range(topics):
        for q in range(FD_QUEUES):
            request = s.PullMessageRequest(
                group=d.Resource(name="g-bd-fd"),
                message_queue=d.MessageQueue(topic=d.Resource(name=f"bd-fd{t}"), id=q),
                offset=0,
                batch_size=32,
                filter_expression=d.FilterExpression(type=d.TAG, expression="*"),
            )
            for r in stub.PullMessage(request, timeout=30):
                if r.HasField("message"):
                    out.append(r.message.system_properties.message_id)
    return out


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def connect(endpoint: str, timeout: float = 10) -> grpc.Channel:
    """A channel with a connection of its own (not shared through gRPC's global pool)."""
    channel = grpc.insecure_channel(endpoint, options=[("grpc.use_local_subchannel_pool", 1)])
    stub = service_pb2_grpc.MessagingServiceStub(channel)
    try:
        stub.QueryRoute(s.QueryRouteRequest(topic=d.Resource(name="bd-fd0")), timeout=timeout)
    except grpc.RpcError:
        channel.close()
        raise
    return channel


def test_the_broker_raises_its_soft_fd_limit_to_the_hard_one(tmp_path: Path) -> None:
    """A soft limit of 256 under a hard one of 4096 (a login shell's usual 1024/524288, scaled
    down): the JVM's brokers raise the soft limit at start; this one stopped dispatching at the
    250th queue or so, every later message acknowledged and never delivered."""
    node = FdLimited(tmp_path / "data", 256, 4096).start()
    try:
        make_fd_topics(node)
        stub = service_pb2_grpc.MessagingServiceStub(node.channel())
        ids = send_one_per_queue(stub)
        wait_until("every message in its queue", lambda: len(stored_ids(stub)) == len(ids), 30)
        assert sorted(stored_ids(stub)) == sorted(ids)
        assert "run out of file descriptors" not in node.log_path.read_text()
    finally:
        node.stop()


FEW = 12  # 96 queues: 192 descriptors, under 256 once the other clients are gone


def test_a_broker_out_of_fds_says_so_and_delivers_everything_once_they_free_up(
    tmp_path: Path,
) -> None:
    """A hard limit of 256, most of it taken by client connections: the queues past it cannot
    map their ConsumeQueue files. The broker says in one line what ran out and how to raise it
    (it logged a bare traceback of ``[Errno 24]`` every second). While dispatch is stuck it
    refuses sends, as RocketMQ's store does once a ConsumeQueue write fails (it acknowledged
    them, and no consumer could read them until descriptors freed up: decision 1070). A
    checkpoint it could not open a ``.tmp`` for does not turn the store read-only (it did, as a
    failed fsync does), and once the clients go the stuck messages reach their queues, each
    once, and sends are taken again. A start under a limit below what the queues need is
    refused with the same explanation; with a higher one, everything is there."""
    node = FdLimited(tmp_path / "data", 256, 256).start()
    others: list[grpc.Channel] = []
    try:
        make_fd_topics(node, FEW)
        channel = connect(node.endpoint)
        stub = service_pb2_grpc.MessagingServiceStub(channel)
        assert node.proc is not None
        # Other clients take all but 60 of the broker's descriptors (a socket each): room
        # for about 30 queues' files.
        while open_fds(node.proc.pid) < 256 - 60 and len(others) < 300:
            others.append(connect(node.endpoint))
        assert open_fds(node.proc.pid) >= 256 - 60
        refused: list[tuple[int, int, d.Status]] = []
        ids = send_one_per_queue(stub, FEW, refused)
        wait_until(
            "the broker names the descriptor limit",
            lambda: "run out of file descriptors" in node.log_path.read_text(),
            30,
        )
        text = node.log_path.read_text()
        assert "limit 256" in text and "prlimit" in text, text[-2000:]
        assert len(stored_ids(stub, FEW)) < len(ids)  # some queues are stuck
        # Every last descriptor taken (a client connects while the dispatcher's retry has
        # freed one), across several flushes: no checkpoint can be saved meanwhile.
        deadline = time.monotonic() + 10
        while open_fds(node.proc.pid) < 256 and time.monotonic() < deadline:
            with contextlib.suppress(grpc.RpcError):
                others.append(connect(node.endpoint, timeout=1))
        time.sleep(2)
        # Dispatch is stuck: every send is refused, plainly, none acknowledged and hidden.
        before = len(refused)
        assert send_one_per_queue(stub, FEW, refused) == []
        assert len(refused) - before == FEW * FD_QUEUES
        for _, _, status in refused:
            assert status.code == d.INTERNAL_SERVER_ERROR, status
            assert "dispatch is stuck" in status.message, status
            assert "run out of file descriptors" in status.message, status
        for other in others:
            other.close()
        others.clear()
        wait_until("dispatch resumed", lambda: "dispatch resumed" in node.log_path.read_text(), 30)
        # Taken again (nothing turned the store read-only), the refused ones sent once more.
        more = send_one_per_queue(stub, FEW)
        wait_until(
            "every message in its queue",
            lambda: len(stored_ids(stub, FEW)) >= len(ids + more),
            30,
        )
        assert sorted(stored_ids(stub, FEW)) == sorted(ids + more), (
            "each message once, none missing"
        )
        channel.close()
    finally:
        for other in others:
            other.close()
        node.stop()
    # The same data under a limit below what its queues need: refused at start, clearly.
    again = FdLimited(tmp_path / "data", 100, 100)
    with pytest.raises(RuntimeError) as refused:
        again.start()
    assert "run out of file descriptors" in str(refused.value), refused.value
    node = FdLimited(tmp_path / "data", 4096, 4096).start()
    try:
        stub = service_pb2_grpc.MessagingServiceStub(node.channel())
        assert sorted(stored_ids(stub, FEW)) == sorted(ids + more)
    finally:
        node.stop()


def test_a_resolved_floor_the_full_disk_refused_is_raised_by_the_next_offload_pass(
    small_disk: Path, tmp_path: Path
) -> None:
    """A resolve's commit (decision 801) records the queue's new floor in tier-divergence.json,
    then the store records it in queue-floors.json. A full disk refusing the second left the
    floor to the next start (decision 902's ``apply_floors``): meanwhile the queue served its
    local originals at the offsets the archive holds, beside their copies at its end, to every
    consumer. The broker's offload pass (``Resumer.run``) now raises it once space is back.
    A real store on a real tmpfs; the record is the one a commit leaves."""
    from offload.divergence import Divergence
    from offload.offloader import Offloader
    from offload.resolve import Resumer
    from tiered.cold.storage import open_store
    from tiered.config import StoreConfig
    from tiered.record import Message
    from tiered.store import MessageStore

    config = StoreConfig(data_dir=small_disk / "store", **SMALL)
    store = MessageStore(config)
    store.start()
    try:
        store.put_messages([Message("t", f"m{n}".encode(), queue_id=0) for n in range(120)])
        assert store.wait_dispatched()
        store.flush()
        (config.data_dir / "tier-divergence.json").write_text(
            json.dumps({"pending": [], "conflicts": [], "floors": [["t", 0, 100]]})
        )
        divergence = Divergence(config.data_dir)
        offloader = Offloader(store, open_store(f"file://{tmp_path}/tier"), "c1", "b1")
        resumer = Resumer(store, offloader, divergence)
        filler = Filler(small_disk)
        try:
            with store._checkpoint_lock:  # no save in flight frees a page under the filler
                filler._top_off()
            resumer.run()
            assert store.hot_min_offset("t", 0) == 0, "the full disk refused the floor"
        finally:
            filler.free()
        resumer.run()
        assert store.hot_min_offset("t", 0) == 100
        assert divergence.floors == {}
        assert "floors" not in json.loads((config.data_dir / "tier-divergence.json").read_text())
        offloader.close()
    finally:
        store.shutdown()
    store = MessageStore(config)
    store.start()
    try:
        assert store.hot_min_offset("t", 0) == 100
    finally:
        store.shutdown()


def test_a_timer_wheel_on_a_full_disk_says_so_once_and_delivers_once_there_is_room(
    small_disk: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The timer wheel's log on a real full tmpfs (the store's disk has room): a due delay
    message cannot be enqueued. It logged a traceback every second (the log often shares that
    disk); now one ERROR line saying what ran out, and once there is room it delivers the
    message by itself and says it resumed (decision 1071)."""
    from broker.timer import PROPERTY_DELIVER_TIME, TimerService, as_timer_message
    from tiered.config import StoreConfig
    from tiered.record import Message
    from tiered.store import MessageStore

    caplog.set_level(logging.INFO, logger="broker.timer")
    store = MessageStore(StoreConfig(data_dir=tmp_path / "store", **SMALL))
    store.start()
    wheel = TimerService(store, small_disk / "timer", lambda: ["orders"])
    wheel.start()
    try:
        filler = Filler(small_disk)
        try:
            due = str(time.time_ns() // 1_000_000)
            store.put_messages(
                [as_timer_message(Message("orders", b"late", 0, {PROPERTY_DELIVER_TIME: due}))]
            )
            time.sleep(3.5)  # three retries or more
            errors = [
                r for r in caplog.records if r.name == "broker.timer" and r.levelno >= logging.ERROR
            ]
            assert len(errors) == 1, [r.getMessage() for r in errors]
            assert errors[0].exc_info is None, "one line, no traceback"
            assert "the disk is full" in errors[0].getMessage(), errors[0].getMessage()
            assert "No space left on device" in errors[0].getMessage()
            assert store.max_offset("orders", 0) == 0, "not delivered while the disk is full"
        finally:
            filler.free()
        wait_until("the delay message delivered", lambda: store.max_offset("orders", 0) == 1, 15)
        assert "timer wheel resumed" in caplog.text
    finally:
        wheel.stop()
        store.shutdown()


def test_an_offload_pass_skips_queues_whose_lock_is_held_instead_of_waiting(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The offload pass finishes interrupted resolves first (``Resumer.run``, decision 902),
    each through ``resolve()``, which waited up to 30 s for the queue's lock: with an upload of
    each of three such queues under way the pass sat 90 s before uploading anything else (and
    so before local retention could free a byte). The pass now skips a queue whose lock is held
    to its next pass at once, and that pass finishes the resolve. A real store, a real archive
    on a file tier, the record a resolve that copied nothing yet leaves."""
    import logging

    from offload.divergence import Divergence
    from offload.offloader import Offloader
    from offload.resolve import Resumer
    from tiered.cold.storage import open_store
    from tiered.config import StoreConfig
    from tiered.record import Message
    from tiered.store import MessageStore

    config = StoreConfig(data_dir=tmp_path / "store", **SMALL)
    store = MessageStore(config)
    store.start()
    offloader = Offloader(store, open_store(f"file://{tmp_path}/tier"), "c1", "b1")
    queues = (0, 1, 2)
    try:
        store.put_messages(
            [Message("t", f"m{q}-{n}".encode(), queue_id=q) for q in queues for n in range(120)]
        )
        assert store.wait_dispatched()
        store.flush()
        ends = {}
        for q in queues:
            offloader.offload_queue("t", q, up_to=100)
            ends[q] = offloader.manifest("t", q, refresh=True).end_offset
            assert 0 < ends[q] <= 100
        # Each queue's local [base, end) "diverged" from its archive; a resolve began copying
        # those messages at 120, the queue's end, and was interrupted before the first copy.
        (config.data_dir / "tier-divergence.json").write_text(
            json.dumps(
                {
                    "pending": [],
                    "conflicts": [["t", q, ends[q] - 10, ends[q], 120] for q in queues],
                }
            )
        )
        divergence = Divergence(config.data_dir)
        resumer = Resumer(store, offloader, divergence)
        held = threading.Event()
        release = threading.Event()

        def upload_under_way() -> None:
            locks = [offloader.queue_lock("t", q) for q in queues]
            for lock in locks:
                lock.acquire()
            held.set()
            release.wait(120)
            for lock in locks:
                lock.release()

        holder = threading.Thread(target=upload_under_way, daemon=True)
        holder.start()
        assert held.wait(10)
        try:
            started = time.monotonic()
            with caplog.at_level(logging.WARNING, logger="offload.resolve"):
                assert resumer.run() == []
            took = time.monotonic() - started
            assert took < 2.0, f"the pass waited {took:.1f} s for queues an upload held"
            assert store.max_offset("t", 0) == 120, "a busy queue was resolved anyway"
            assert "waits for the archive" not in caplog.text, "a busy queue is not the archive"
        finally:
            release.set()
            holder.join(10)
        done = resumer.run()
        assert sorted(r.copied for r in done) == [10, 10, 10]
        for q in queues:
            assert store.max_offset("t", q) == 130
            assert store.hot_min_offset("t", q) == ends[q]
        assert divergence.conflicts == {}
    finally:
        offloader.close()
        store.shutdown()


LEASE_CHILD = """
from broker.ha.lease_keeper import LeaseKeeper
keeper = LeaseKeeper(["http://127.0.0.1:9"], 2, interval_s=0.25, pulse_limit_s=1.0)
keeper.set_lease(7)
keeper.pulse()
print("written")
"""


def test_a_full_dev_shm_does_not_kill_the_broker_at_its_first_lease_write(tmp_path: Path) -> None:
    """The lease keeper's shared memory (decision 910) was a file in /dev/shm truncated to its
    size: on a full /dev/shm (another program's shared memory) it mapped fine, and the broker's
    first write of its lease died of SIGBUS, with not a line logged. Run in a mount namespace of
    its own whose /dev/shm is a full 8 KiB tmpfs (the machine's /dev/shm is not touched)."""
    if os.geteuid() != 0:
        pytest.skip("a mount namespace needs root")
    script = tmp_path / "child.py"
    script.write_text(LEASE_CHILD)
    shell = (
        "mount -t tmpfs -o size=8k tmpfs /dev/shm || exit 99; "
        "dd if=/dev/zero of=/dev/shm/fill bs=4k 2>/dev/null; "
        "[ \"$(df --output=avail /dev/shm | tail -1 | tr -d ' ')\" = 0 ] || exit 98; "
        f"exec {sys.executable} {script}"
    )
    child = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c", shell],
        cwd=Path(__file__).parent.parent,
        capture_output=True,
        text=True,
        timeout=60,
    )
    if child.returncode == 99 or "unshare failed" in child.stderr:
        pytest.skip(f"no private mount here: {child.stderr.strip()}")
    assert child.returncode != 98, "the tmpfs was not full"
    assert child.returncode == 0 and "written" in child.stdout, (child.returncode, child.stderr)


POLLING_CHILD = """
from rocketmq import ClientConfiguration, Credentials, FilterExpression, SimpleConsumer
config = ClientConfiguration({endpoint!r}, Credentials(), namespace="", request_timeout=10)
topics = {{"bd-killed": FilterExpression()}}
consumer = SimpleConsumer(config, "g-bd-killed", topics, await_duration=20)
consumer.startup()
consumer.receive(1, 5)  # the topic is empty: an answer, and the client's routes are warm
print("polling", flush=True)
consumer.receive(4, 300)
print("returned", flush=True)
"""


def test_a_consumer_process_killed_during_its_long_poll_leaks_nothing(broker: Standalone) -> None:
    """The same as a cancelled poll, with Apache's Python client in a process of its own that
    is killed (SIGKILL) while the broker holds its receive: the connection closes, and the
    message sent next goes to the next consumer at once, as its first attempt."""
    broker.create_topic("bd-killed", queues=1)
    broker.create_group("g-bd-killed")
    code = POLLING_CHILD.format(endpoint=broker.endpoint)
    child = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
    )
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "polling"
        time.sleep(2)  # inside the 20 s long poll
    finally:
        child.kill()
        child.wait()
    # At once, as on a busy topic: the abandoned poll looks at its stream only after a pop
    # (and otherwise waits up to 1 s at a time for a message).
    [(mid, _)] = send_batches(broker.endpoint, "bd-killed", [(b"after the kill", "k", "t")])
    time.sleep(3)  # the abandoned poll wakes up at the new message
    consumer = SimpleConsumer(
        client_config(broker), "g-bd-killed", {"bd-killed": FilterExpression()}, await_duration=5
    )
    consumer.startup()
    try:
        got = drain(consumer, 1, seconds=10, invisible=60)
    finally:
        consumer.shutdown()
    assert [m.message_id for m in got] == [mid]
    assert got[0].delivery_attempt == 1


def receive_once(
    stub: service_pb2_grpc.MessagingServiceStub,
    group: str,
    topic: str,
    batch: int,
    invisible_s: int,
) -> tuple[d.Status, list[d.Message]]:
    """One ReceiveMessage (no long poll): its first status and its messages."""
    first: d.Status | None = None
    got: list[d.Message] = []
    for reply in stub.ReceiveMessage(
        receive_request(group, topic, batch, invisible_s, 0), timeout=20
    ):
        if reply.HasField("status") and first is None:
            first = reply.status
        if reply.HasField("message"):
            got.append(reply.message)
    assert first is not None
    return first, got


def receive_first(
    stub: service_pb2_grpc.MessagingServiceStub, group: str, topic: str, invisible_s: int
) -> list[d.Message]:
    """One message, received as soon as it is dispatched (at most 15 s)."""
    deadline = time.monotonic() + 15
    while True:
        st, got = receive_once(stub, group, topic, 1, invisible_s)
        if got or time.monotonic() >= deadline:
            assert st.code == d.OK, st
            return got
        time.sleep(0.2)


def test_consumers_still_receive_while_a_full_disk_refuses_expired_deliveries_retry_copies(
    small_disk: Path, tmp_path: Path
) -> None:
    """An expired delivery is copied to the group's retry topic, a write. While the store
    refused writes (a full disk; or dispatch stuck for want of descriptors, decision 1070),
    that copy raised out of every ReceiveMessage, since each receive revives first: no group
    on the broker could receive the messages already stored, and the maintenance loop logged a
    traceback a second onto that full disk. Now the delivery stays in flight and is delivered
    again in place (as on a replica store, decision 970), every other message is delivered,
    and once there is room nothing is delivered twice."""
    data_dir = small_disk / "data"
    config = tmp_path / "tmq.toml"
    config.write_text(
        "[store]\ncommitlog_file_size = 1048576\nconsumequeue_entries_per_file = 1000\n"
        "index_hash_slots = 1000\nindex_max_entries = 4000\n"
    )
    node = Standalone(
        data_dir, extra=["--config", str(config), "--commitlog-file-size", "1MiB"]
    ).start()
    try:
        node.create_topic("bd-revive", queues=1)
        node.create_group("g-bd-revive")
        node.create_group("g-bd-other")
        ids = [mid for mid, _ in send_batches(node.endpoint, "bd-revive", [(b"a", "k", "t")] * 4)]
        stub = service_pb2_grpc.MessagingServiceStub(node.channel())
        held = receive_first(stub, "g-bd-revive", "bd-revive", 1)  # invisible for 1 s
        assert [m.system_properties.message_id for m in held] == ids[:1]
        filler = Filler(small_disk)
        try:
            with pytest.raises(AssertionError):  # the store refuses writes now
                send_batches(node.endpoint, "bd-revive", [(b"b", "k", "t")])
            time.sleep(2.5)  # the delivery expired; its retry copy cannot be written
            # The other group never had a delivery in flight: it receives everything.
            st, other = receive_once(stub, "g-bd-other", "bd-revive", 8, 60)
            assert st.code == d.OK, st
            assert [m.system_properties.message_id for m in other] == ids
            # The group itself: the rest, and the expired one again (its second attempt).
            got: list[d.Message] = []
            for _ in range(3):
                st, more = receive_once(stub, "g-bd-revive", "bd-revive", 8, 60)
                assert st.code in (d.OK, d.MESSAGE_NOT_FOUND), st
                got += more
            by_id = {m.system_properties.message_id: m for m in got}
            assert sorted(by_id) == sorted(ids) and len(got) == len(ids), got
            assert by_id[ids[0]].system_properties.delivery_attempt == 2
            for m in got:
                ack = stub.AckMessage(
                    s.AckMessageRequest(
                        group=d.Resource(name="g-bd-revive"),
                        topic=d.Resource(name="bd-revive"),
                        entries=[
                            s.AckMessageEntry(
                                message_id=m.system_properties.message_id,
                                receipt_handle=m.system_properties.receipt_handle,
                            )
                        ],
                    ),
                    timeout=10,
                )
                assert ack.status.code == d.OK, ack.status
        finally:
            filler.free()
        time.sleep(2.5)  # revive passes with room again: nothing is left to copy
        st, again = receive_once(stub, "g-bd-revive", "bd-revive", 8, 60)
        assert again == [], [m.system_properties.message_id for m in again]
        assert "reviving expired pop deliveries failed" not in node.log_path.read_text()
    finally:
        node.stop()


def send_to_queue(stub: service_pb2_grpc.MessagingServiceStub, topic: str, queue: int) -> str:
    request = s.SendMessageRequest()
    m = request.messages.add(topic=d.Resource(name=topic), body=f"q{queue}".encode())
    m.system_properties.message_id = os.urandom(16).hex().upper()
    m.system_properties.message_type = d.NORMAL
    m.system_properties.body_encoding = d.IDENTITY
    m.system_properties.queue_id = queue
    reply = stub.SendMessage(request, timeout=30)
    assert reply.status.code == d.OK, reply.status
    return m.system_properties.message_id


def pulled_ids(stub: service_pb2_grpc.MessagingServiceStub, group: str, topic: str) -> list[str]:
    request = s.PullMessageRequest(
        group=d.Resource(name=group),
        message_queue=d.MessageQueue(topic=d.Resource(name=topic), id=0),
        offset=0,
        batch_size=32,
        filter_expression=d.FilterExpression(type=d.TAG, expression="*"),
    )
    return [
        r.message.system_properties.message_id
        for r in stub.PullMessage(request, timeout=30)
        if r.HasField("message")
    ]


def store_dispatched(
    stub: service_pb2_grpc.MessagingServiceStub, topic: str, queue: int, message_id: str
) -> bool:
    """Wait (at most 15 s) until ``message_id`` can be read from its queue."""
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        request = s.PullMessageRequest(
            group=d.Resource(name="g-bd-fifo"),
            message_queue=d.MessageQueue(topic=d.Resource(name=topic), id=queue),
            offset=0,
            batch_size=32,
            filter_expression=d.FilterExpression(type=d.TAG, expression="*"),
        )
        for r in stub.PullMessage(request, timeout=30):
            if r.HasField("message") and r.message.system_properties.message_id == message_id:
                return True
        time.sleep(0.2)
    return False


def test_a_fifo_queue_whose_dlq_copy_a_full_disk_refuses_waits_and_the_others_deliver(
    small_disk: Path, tmp_path: Path
) -> None:
    """The same on the FIFO path: a queue's delivery past its attempt limit goes to the DLQ
    at the group's next receive. On a full disk that copy raised out of the receive, so the
    group's other queues delivered nothing either. Now that queue waits (its order kept),
    the others deliver, and once there is room the message reaches the DLQ, once."""
    data_dir = small_disk / "data"
    config = tmp_path / "tmq.toml"
    config.write_text(
        "[store]\ncommitlog_file_size = 1048576\nconsumequeue_entries_per_file = 1000\n"
        "index_hash_slots = 1000\nindex_max_entries = 4000\n"
    )
    node = Standalone(
        data_dir, extra=["--config", str(config), "--commitlog-file-size", "1MiB"]
    ).start()
    try:
        node.create_topic("bd-fifo", queues=2)
        node.create_group("g-bd-fifo", max_attempts=1, fifo=True)
        stub = service_pb2_grpc.MessagingServiceStub(node.channel())
        first = send_to_queue(stub, "bd-fifo", 0)
        held = receive_first(stub, "g-bd-fifo", "bd-fifo", 1)  # invisible for 1 s
        assert [m.system_properties.message_id for m in held] == [first]
        second = send_to_queue(stub, "bd-fifo", 1)
        assert store_dispatched(stub, "bd-fifo", 1, second)
        filler = Filler(small_disk)
        try:
            time.sleep(2.5)  # past its deadline, at its limit: for the DLQ
            got: list[str] = []
            for _ in range(3):
                st, more = receive_once(stub, "g-bd-fifo", "bd-fifo", 8, 60)
                assert st.code in (d.OK, d.MESSAGE_NOT_FOUND), st
                got += [m.system_properties.message_id for m in more]
            assert got == [second]
        finally:
            filler.free()
        wait_until(
            "the message in the DLQ once there is room",
            lambda: (
                receive_once(stub, "g-bd-fifo", "bd-fifo", 8, 60)[1] == []
                and pulled_ids(stub, "g-bd-fifo", "%DLQ%g-bd-fifo") == [first]
            ),
            20,
        )
    finally:
        node.stop()


def test_a_full_disk_does_not_use_up_a_transactions_check_backs(
    small_disk: Path, tmp_path: Path
) -> None:
    """Each pass of the check-back loop counted a check of every due half message before it
    stored the pass's CHECK records; while the store refused writes (a full disk, dispatch
    stuck) the store raised, no producer was asked, and yet the count went up. After
    ``check_max`` such passes the broker gave up and rolled the transaction back once there
    was room, its producer never asked: a committed local transaction's message lost. A real
    store on a real tmpfs filled by another writer; the check loop's clock is the test's."""
    from broker.metadata import BrokerMetadata
    from broker.transaction import TransactionConfig, TransactionService
    from tiered.config import StoreConfig
    from tiered.record import Message as StoreMessage
    from tiered.store import MessageStore, StoreUnwritableError

    store = MessageStore(StoreConfig(data_dir=small_disk / "store", **SMALL))
    store.start()
    now = [time.time_ns() // 1_000_000]
    asked: list[str] = []

    def send_check(topic: str, half: object, txn: str) -> bool:
        asked.append(txn)
        return True  # the producer is connected; it answers with EndTransaction

    config = TransactionConfig(timeout_ms=1000, check_interval_ms=1000, check_max=3)
    service = TransactionService(
        store, BrokerMetadata(tmp_path / "config"), config, send_check, clock=lambda: now[0]
    )
    try:
        service.prepare([StoreMessage("orders", b"x", 0, {"UNIQ_KEY": "k"})], [None])
        filler = Filler(small_disk)
        try:
            for _ in range(2 * config.check_max):
                now[0] += 2_000  # due again
                with pytest.raises(StoreUnwritableError):
                    service.check_due()
            assert asked == []
        finally:
            filler.free()
        now[0] += 2_000
        service.check_due()
        assert service.rollbacks == 0, "rolled back without ever asking its producer"
        assert len(asked) == 1, "the producer is asked once there is room"
        assert service.pending() == 1
    finally:
        store.shutdown()
