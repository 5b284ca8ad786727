"""Replica groups with real broker processes (``tmq broker start --config``) on loopback:
CommitLog replication, SYNC and ASYNC acknowledgement, catch-up, and truncation of a divergent
tail to the last common epoch boundary."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
from rocketmq.grpc_protocol import definition_pb2 as d
from rocketmq.grpc_protocol import service_pb2 as s
from rocketmq.grpc_protocol import service_pb2_grpc

from broker import admin_pb2 as apb
from broker import admin_pb2_grpc as apb_grpc
from broker.metadata import BrokerMetadata
from remoting.security import ChannelSecurity
from tests import process_logs
from tests.broker_harness import (
    REPO,
    free_port,
    send_all,
    sigstop,
    start_namesrv,
    terminate,
    wait_healthy,
)
from tiered.config import StoreConfig
from tiered.epoch_file import EpochEntry, EpochFile
from tiered.store import MessageStore, recorded_geometry

# Small CommitLog files: replication crosses many file boundaries (and their BLANK padding).
FILE_SIZE = 256 * 1024
TOPIC = "ha-topic"
QUEUES = 3


# The members of the test this process runs (those under the latest root), for the message of a
# wait that times out (``describe_members``).
_MEMBERS: list[GroupMember] = []


def describe_members(lines: int = 40) -> str:
    """Each member of the current test: its process state and the last ``lines`` of its log
    (and the NameServer's, when the test started one under the same root)."""
    out = []
    for m in _MEMBERS:
        if m.proc is None:
            state = "never started"
        elif m.proc.poll() is None:
            state = f"alive (pid {m.proc.pid})"
        else:
            state = f"exited with {m.proc.returncode}"
        out.append(f"--- {m.name} (gRPC {m.endpoint}, HA port {m.ha_port}): {state}")
        out.append(_log_tail(m.log_path, lines))
    if _MEMBERS and (_MEMBERS[0].root / "namesrv.log").exists():
        out.append("--- namesrv")
        out.append(_log_tail(_MEMBERS[0].root / "namesrv.log", lines))
    return "\n".join(out)


def _log_tail(path: Path, lines: int) -> str:
    try:
        tail = path.read_text(errors="replace").splitlines()[-lines:]
    except OSError as e:
        return f"    (no log: {e})"
    return "\n".join(f"    {line}" for line in tail) or "    (empty log)"


class GroupMember:
    """One broker of a replica group, run as ``tmq broker start --config``."""

    def __init__(self, root: Path, name: str, ha_port: int) -> None:
        if _MEMBERS and _MEMBERS[-1].root != root:
            _MEMBERS.clear()  # a new test
        _MEMBERS.append(self)
        self.root = root
        self.name = name
        self.data_dir = root / name
        self.ha_port = ha_port
        self.grpc_port = free_port()
        self.metrics_port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        # Appended to the member's tmq.toml ([tls], [auth]), and how tests then reach it.
        self.extra_toml = ""
        self.security = ChannelSecurity()

    def channel(self) -> grpc.Channel:
        return self.security.channel(self.endpoint)

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def log_path(self) -> Path:
        return self.root / f"{self.name}.log"

    def start(
        self,
        role: str,
        broker_id: int,
        *,
        master: GroupMember | None = None,
        mode: str = "sync",
        min_in_sync_replicas: int = 1,
        sync_timeout_ms: int = 2000,
        ha: bool = True,
        file_size: int = FILE_SIZE,
        namesrv: str = "",
        peers: list[GroupMember] | None = None,
        etcd: list[str] | None = None,
        lease_ttl_ms: int = 2000,
        max_lag_ms: int = 3000,
        env: dict[str, str] | None = None,
        store_toml: str = "",
    ) -> GroupMember:
        config = self.root / f"{self.name}.toml"
        config.write_text(
            f"""
[broker]
name = "broker-a"
listen = "127.0.0.1"
port = {self.grpc_port}
namesrv = "{namesrv}"
metrics_port = {self.metrics_port}

[store]
data_dir = "{self.data_dir}"
commitlog_file_size = {file_size}
index_hash_slots = 4096
index_max_entries = 16384
{store_toml}

[ha]
enabled = {str(ha).lower()}
role = "{role}"
broker_id = {broker_id}
listen = "127.0.0.1:{self.ha_port}"
master = "{f"127.0.0.1:{master.ha_port}" if master else ""}"
peers = {[f"127.0.0.1:{p.ha_port}" for p in peers or []]}
mode = "{mode}"
min_in_sync_replicas = {min_in_sync_replicas}
max_lag_ms = {max_lag_ms}
sync_timeout_ms = {sync_timeout_ms}
etcd = {etcd or []}
lease_ttl_ms = {lease_ttl_ms}
"""
            + self.extra_toml
        )
        process_logs.track(self.name, self.log_path, env)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "cli.app", "broker", "start", "--config", str(config)],
            cwd=REPO,
            stdout=subprocess.DEVNULL,
            stderr=self.log_path.open("ab"),
            # INFO: the log says when the link connected, streamed and joined the set.
            env={**os.environ, "TMQ_LOG_LEVEL": "INFO", **(env or {})},
        )
        wait_healthy(self.proc, self.endpoint, self.log_path, self.name, connect=self.channel)
        return self

    def stop(self) -> None:
        if self.proc is not None:
            terminate(self.proc, 30)
        assert self.proc is None or self.proc.returncode == 0, self.log_path.read_text()[-2000:]

    def kill9(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def metric(self, name: str) -> float | None:
        ca = self.security.ca_file
        with urllib.request.urlopen(
            f"{'https' if ca else 'http'}://127.0.0.1:{self.metrics_port}/metrics",
            timeout=5,
            context=ssl.create_default_context(cafile=ca) if ca else None,
        ) as r:
            text = r.read().decode()
        m = re.search(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.MULTILINE)
        return float(m.group(1)) if m else None

    def create_topic(self, *, exist_ok: bool = False) -> None:
        stub = apb_grpc.AdminStub(self.channel())
        try:
            stub.PutTopic(
                apb.PutTopicRequest(
                    topic=apb.Topic(name=TOPIC, queues=QUEUES, perm=6, message_type="NORMAL")
                ),
                timeout=10,
            )
        except grpc.RpcError as e:
            if not (exist_ok and e.code() == grpc.StatusCode.ALREADY_EXISTS):
                raise

    def has_topic(self) -> bool:
        stub = apb_grpc.AdminStub(self.channel())
        return TOPIC in [
            t.topic.name for t in stub.ListTopics(apb.ListTopicsRequest(), timeout=10).topics
        ]


def send(
    endpoint: str,
    first: int,
    count: int,
    batch: int = 20,
    topic: str = TOPIC,
    message_type: int = d.NORMAL,
    channel: grpc.Channel | None = None,
) -> list[d.Status]:
    """Send messages ``first .. first+count-1`` in batches; every batch's status, in order."""
    stub = service_pb2_grpc.MessagingServiceStub(channel or grpc.insecure_channel(endpoint))
    out = []
    for i in range(first, first + count, batch):
        request = s.SendMessageRequest()
        for n in range(i, min(i + batch, first + count)):
            m = request.messages.add(
                topic=d.Resource(name=topic), body=f"message {n} ".encode() * 40
            )
            m.system_properties.message_id = os.urandom(16).hex().upper()
            m.system_properties.message_type = message_type
            m.system_properties.body_encoding = d.IDENTITY
            m.system_properties.keys.append(f"key-{n}")
            m.system_properties.tag = "ha"
        out.append(stub.SendMessage(request, timeout=30).status)
    return out


def wait_until(what: str, condition: object, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"timed out waiting until {what}\n{describe_members()}"
        time.sleep(0.1)


def caught_up(master: GroupMember, *slaves: GroupMember) -> bool:
    top = master.metric("tmq_replication_max_offset")
    return all(s.metric("tmq_replication_max_offset") == top for s in slaves)


def slave_end(member: GroupMember) -> int:
    with open_store(member.data_dir) as store:
        return store.max_physical_offset


def open_store(data_dir: Path) -> MessageStore:
    geometry = recorded_geometry(data_dir) or {}
    return MessageStore(StoreConfig(data_dir=data_dir, **geometry))  # type: ignore[arg-type]


def commitlog_files(data_dir: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted((data_dir / "commitlog").iterdir())}


def queue_entries(store: MessageStore) -> dict[tuple[str, int], list[tuple[int, int, int, int]]]:
    """Every ConsumeQueue entry: (queue offset, physical offset, size, tag hash)."""
    return {
        (topic, q): [
            (qoff, *entry)
            for qoff, entry in store.queue_entries(
                topic, q, store.hot_min_offset(topic, q), store.max_offset(topic, q)
            )
        ]
        for topic in store.topics()
        for q in store.queue_ids(topic)
    }


def assert_same_replica(master_dir: Path, slave_dir: Path) -> int:
    """The slave's CommitLog is byte-identical to the master's, file for file, and its own
    ConsumeQueues and IndexFile answer the same; returns the messages compared."""
    assert commitlog_files(slave_dir) == commitlog_files(master_dir)
    with open_store(master_dir) as master, open_store(slave_dir) as slave:
        assert master.max_physical_offset == slave.max_physical_offset > 0
        entries = queue_entries(master)
        assert queue_entries(slave) == entries
        count = sum(len(v) for v in entries.values())
        for (topic, queue_id), rows in entries.items():
            got = slave.get_messages(topic, queue_id, rows[0][0], max_count=len(rows) + 1)
            want = master.get_messages(topic, queue_id, rows[0][0], max_count=len(rows) + 1)
            assert [(m.commitlog_offset, m.body) for m in got.messages] == [
                (m.commitlog_offset, m.body) for m in want.messages
            ]
        last_key = f"key-{count - 1}"
        assert (
            [m.commitlog_offset for m in slave.query_by_key(TOPIC, last_key)]
            == [m.commitlog_offset for m in master.query_by_key(TOPIC, last_key)]
            != []
        )
        return count


@pytest.fixture
def group(tmp_path: Path):  # type: ignore[no-untyped-def]
    members: list[GroupMember] = []

    def member(name: str) -> GroupMember:
        m = GroupMember(tmp_path, name, free_port())
        members.append(m)
        return m

    yield member
    for m in members:
        if m.proc is not None and m.proc.poll() is None:
            m.proc.kill()
            m.proc.wait()


def test_sync_acked_messages_are_on_every_slave_byte_identical(group) -> None:  # type: ignore[no-untyped-def]
    master, a, b = group("master"), group("slave1"), group("slave2")
    master.start("master", 0, mode="sync", min_in_sync_replicas=3)
    a.start("slave", 1, master=master)
    b.start("slave", 2, master=master)
    master.create_topic()
    wait_until(
        "both slaves are in sync", lambda: master.metric("tmq_replication_sync_state_set_size") == 3
    )
    statuses = send(master.endpoint, 0, 1170)
    assert all(st.code == d.OK for st in statuses), statuses[:3]
    # The confirmed offset (what the group acknowledged) reaches an idle slave as soon as the
    # last ACK moved it, not with the next 1 s heartbeat: three single sends, each confirmed on
    # both slaves within 0.4 s (with the heartbeat, all three in time had odds of about 1 in 15).
    for first in (1170, 1180, 1190):
        assert all(st.code == d.OK for st in send(master.endpoint, first, 10, batch=10))
        acked_at = time.monotonic()
        end = master.metric("tmq_replication_max_offset")
        wait_until(
            "both slaves hold the new confirmed offset",
            lambda end=end: all(  # type: ignore[misc]
                s.metric("tmq_replication_confirmed_offset") == end for s in (a, b)
            ),
            timeout=5,
        )
        assert time.monotonic() - acked_at < 0.4
    # SYNC with min_in_sync_replicas=3: every acknowledged byte is already on both slaves, so a
    # master killed right after the last ack loses nothing the slaves do not have.
    master.kill9()
    a.stop()
    b.stop()
    for slave in (a, b):
        assert assert_same_replica(master.data_dir, slave.data_dir) == 1200
    assert len(commitlog_files(master.data_dir)) > 3  # the stream crossed file boundaries
    for slave in (a, b):
        epochs = EpochFile(slave.data_dir / "ha")
        epochs.load()
        assert epochs.entries == [EpochEntry(1, 0)]
        # What the group acknowledged, as the master last told each slave: everything.
        assert epochs.confirmed_offset == slave_end(slave) > 0


def test_sync_send_fails_cleanly_without_enough_replicas_and_recovers(group) -> None:  # type: ignore[no-untyped-def]
    master, slave = group("master"), group("slave")
    master.start("master", 0, mode="sync", min_in_sync_replicas=2, sync_timeout_ms=1500)
    master.create_topic()
    # No slave yet: refused before anything is stored.
    refused = send(master.endpoint, 0, 20)
    assert [st.code for st in refused] == [d.HA_NOT_AVAILABLE]
    assert "min_in_sync_replicas=2" in refused[0].message
    # A transactional (half) message is a send like any other: refused the same way.
    apb_grpc.AdminStub(grpc.insecure_channel(master.endpoint)).PutTopic(
        apb.PutTopicRequest(
            topic=apb.Topic(name="ha-tx", queues=1, perm=6, message_type="TRANSACTION")
        ),
        timeout=10,
    )
    half = send(master.endpoint, 0, 1, topic="ha-tx", message_type=d.TRANSACTION)
    assert [st.code for st in half] == [d.HA_NOT_AVAILABLE]
    assert master.metric("tmq_replication_max_offset") == 0
    slave.start("slave", 1, master=master)
    wait_until(
        "the slave joins the SyncStateSet",
        lambda: master.metric("tmq_replication_sync_state_set_size") == 2,
    )
    assert all(st.code == d.OK for st in send(master.endpoint, 0, 200))
    # A slave that is connected but stops answering: the send is stored on the master, waits
    # sync_timeout_ms for the slave, and fails; after max_lag_ms the slave leaves the set and
    # sends are refused up front.
    assert slave.proc is not None
    # Stopped for real before the send: kill() returns before every thread of the slave has
    # stopped, and one still running acknowledged the send this test means to time out.
    sigstop(slave.proc.pid)
    try:
        timed_out = send(master.endpoint, 200, 20)
        assert [st.code for st in timed_out] == [d.SLAVE_PERSISTENCE_TIMEOUT]
        wait_until(
            "a silent slave leaves the SyncStateSet",
            lambda: master.metric("tmq_replication_sync_state_set_size") == 1,
        )
        before = master.metric("tmq_replication_max_offset")
        assert [st.code for st in send(master.endpoint, 220, 20)] == [d.HA_NOT_AVAILABLE]
        assert master.metric("tmq_replication_max_offset") == before
    finally:
        os.kill(slave.proc.pid, signal.SIGCONT)
    wait_until(
        "the slave catches up and rejoins",
        lambda: master.metric("tmq_replication_sync_state_set_size") == 2,
    )
    assert all(st.code == d.OK for st in send(master.endpoint, 220, 100))
    slave.stop()
    wait_until(
        "the SyncStateSet shrinks",
        lambda: master.metric("tmq_replication_sync_state_set_size") == 1,
    )
    before = master.metric("tmq_replication_max_offset")
    refused = send(master.endpoint, 320, 20)
    assert [st.code for st in refused] == [d.HA_NOT_AVAILABLE]
    assert master.metric("tmq_replication_max_offset") == before  # nothing stored, nothing acked
    slave.start("slave", 1, master=master)
    wait_until(
        "the slave rejoins", lambda: master.metric("tmq_replication_sync_state_set_size") == 2
    )
    assert all(st.code == d.OK for st in send(master.endpoint, 320, 80))
    master.stop()
    slave.stop()
    # 380 acknowledged, and the 20 that timed out: stored on the master (never acknowledged),
    # then replicated like any other bytes. Refused sends stored nothing.
    assert assert_same_replica(master.data_dir, slave.data_dir) == 400


def test_async_acks_without_slaves_and_a_restarted_slave_catches_up(group) -> None:  # type: ignore[no-untyped-def]
    master, slave = group("master"), group("slave")
    master.start("master", 0, mode="async")
    slave.start("slave", 1, master=master)
    master.create_topic()
    assert all(st.code == d.OK for st in send(master.endpoint, 0, 300))
    wait_until("the slave caught up", lambda: caught_up(master, slave))
    slave.kill9()
    # ASYNC: the master keeps acknowledging with no slave at all.
    assert all(st.code == d.OK for st in send(master.endpoint, 300, 900))
    behind = master.metric("tmq_replication_max_offset")
    assert behind is not None and behind > 3 * FILE_SIZE
    slave.start("slave", 1, master=master)
    wait_until("the restarted slave caught up", lambda: caught_up(master, slave))
    assert master.metric("tmq_replication_sync_state_set_size") == 2
    # Topics, groups and consumer offsets follow the master too (RocketMQ's SlaveSynchronize).
    queue = d.MessageQueue(topic=d.Resource(name=TOPIC), id=1)
    on_master = service_pb2_grpc.MessagingServiceStub(grpc.insecure_channel(master.endpoint))
    reply = on_master.UpdateOffset(
        s.UpdateOffsetRequest(group=d.Resource(name="ha-group"), message_queue=queue, offset=7),
        timeout=10,
    )
    assert reply.status.code == d.OK, reply.status
    on_slave = service_pb2_grpc.MessagingServiceStub(grpc.insecure_channel(slave.endpoint))

    def slave_offset() -> int | None:
        r = on_slave.GetOffset(
            s.GetOffsetRequest(group=d.Resource(name="ha-group"), message_queue=queue), timeout=10
        )
        return r.offset if r.status.code == d.OK else None

    wait_until("the slave has the group's offset", lambda: slave_offset() == 7)
    # A slave takes no sends.
    assert [st.code for st in send(slave.endpoint, 5000, 1)] == [d.HA_NOT_AVAILABLE]
    master.stop()
    slave.stop()
    assert assert_same_replica(master.data_dir, slave.data_dir) == 1200
    copy = BrokerMetadata(slave.data_dir / "config")
    copy.load()  # what the slave kept on disk
    assert TOPIC in copy.topics and "ha-group" in copy.groups
    assert copy.offset("ha-group", TOPIC, 1) == 7


def test_a_divergent_tail_is_cut_back_to_the_last_common_epoch(group) -> None:  # type: ignore[no-untyped-def]
    a, b = group("a"), group("b")
    # Epoch 1: a is master, b follows; both hold the first 300 messages.
    a.start("master", 0, mode="async")
    b.start("slave", 1, master=a)
    a.create_topic()
    assert all(st.code == d.OK for st in send(a.endpoint, 0, 300))
    wait_until("b caught up", lambda: caught_up(a, b))
    common = a.metric("tmq_replication_max_offset")
    wait_until("b has the topic's metadata", b.has_topic)
    b.stop()
    # a writes on alone in epoch 1: a tail nobody else has (ASYNC acked it; SYNC would not).
    assert all(st.code == d.OK for st in send(a.endpoint, 300, 200))
    a.stop()
    # b becomes master: epoch 2 starts where b's log ends, and it writes different messages.
    b.start("master", 0, mode="async")
    assert b.has_topic()  # replicated from a while b was its slave
    assert b.metric("tmq_replication_epoch") == 2
    assert all(st.code == d.OK for st in send(b.endpoint, 1000, 150))
    # a returns as b's slave: its epoch-1 tail past `common` must go, then b's bytes follow.
    a.start("slave", 1, master=b)
    wait_until("a caught up with b", lambda: caught_up(b, a))
    b.stop()
    a.stop()
    assert common is not None
    epochs = EpochFile(a.data_dir / "ha")
    epochs.load()
    assert epochs.entries == [EpochEntry(1, 0), EpochEntry(2, int(common))]
    # ASYNC acknowledges nothing on the group's behalf: no member may refuse a cut for it.
    assert epochs.confirmed_offset == 0
    b_epochs = EpochFile(b.data_dir / "ha")
    b_epochs.load()
    assert b_epochs.confirmed_offset == 0
    assert commitlog_files(a.data_dir) == commitlog_files(b.data_dir)
    quarantined = list((a.data_dir / "quarantine").iterdir())
    assert quarantined, "the divergent tail is kept aside, not silently dropped"
    with open_store(a.data_dir) as store:
        bodies = [
            m.body
            for q in range(QUEUES)
            for m in store.get_messages(TOPIC, q, 0, max_count=1000).messages
        ]
        assert len(bodies) == 450
        texts = {body.split(b" ")[1] for body in bodies}
        assert texts == {str(n).encode() for n in [*range(300), *range(1000, 1150)]}


def test_truncation_never_cuts_what_sync_acknowledged(group, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    a, b = group("a"), group("b")
    a.start("master", 0, mode="sync", min_in_sync_replicas=2)
    b.start("slave", 1, master=a)
    a.create_topic()
    wait_until("b is in sync", lambda: a.metric("tmq_replication_sync_state_set_size") == 2)
    assert all(st.code == d.OK for st in send(a.endpoint, 0, 100))
    b.stop()
    stale = tmp_path / "b-stale"
    shutil.copytree(b.data_dir, stale)  # b as it was after 100 messages
    b.start("slave", 1, master=a)
    wait_until("b is back in sync", lambda: a.metric("tmq_replication_sync_state_set_size") == 2)
    assert all(st.code == d.OK for st in send(a.endpoint, 100, 100))
    time.sleep(0.5)  # the master records its confirmed offset every 200 ms
    acked_end = a.metric("tmq_replication_max_offset")
    b.stop()
    a.stop()
    # The stale copy is made master (as a wrong election would): it lacks 100 acked messages.
    shutil.rmtree(b.data_dir)
    shutil.copytree(stale, b.data_dir)
    b.start("master", 0, mode="async")
    b.create_topic(exist_ok=True)
    assert all(st.code == d.OK for st in send(b.endpoint, 1000, 10))
    a_files = commitlog_files(a.data_dir)
    a.start("slave", 1, master=b)
    wait_until(
        "a refuses to follow",
        lambda: "refusing to truncate acknowledged messages" in a.log_path.read_text(),
    )
    assert a.metric("tmq_replication_connected") == 0
    assert a.metric("tmq_replication_max_offset") == acked_end
    a.stop()
    b.stop()
    assert commitlog_files(a.data_dir) == a_files


class LinkProxy:
    """A TCP forwarder on loopback between a slave and its master's replication port; ``cut``
    drops every connection and refuses new ones (a partition), ``heal`` lets them through."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.open = threading.Event()
        self.open.set()
        self.pairs: list[tuple[socket.socket, socket.socket]] = []
        self.lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            if not self.open.is_set():
                client.close()
                continue
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target_port))
            except OSError:
                client.close()
                continue
            with self.lock:
                self.pairs.append((client, upstream))
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(1 << 16):
                dst.sendall(data)
        except OSError:
            pass
        for sock in (src, dst):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def cut(self) -> None:
        self.open.clear()
        with self.lock:
            pairs, self.pairs = self.pairs, []
        for pair in pairs:
            for sock in pair:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
                sock.close()

    def heal(self) -> None:
        self.open.set()

    def close(self) -> None:
        self.cut()
        self.listener.close()


def test_a_partitioned_replication_link_shrinks_the_set_and_heals(group) -> None:  # type: ignore[no-untyped-def]
    master, slave = group("master"), group("slave")
    master.start("master", 0, mode="sync", min_in_sync_replicas=2, sync_timeout_ms=1500)
    proxy = LinkProxy(master.ha_port)
    try:
        # The slave reaches its master only through the proxy.
        via_proxy = GroupMember(master.root, "proxy", proxy.port)
        slave.start("slave", 1, master=via_proxy)
        master.create_topic()
        wait_until("in sync", lambda: master.metric("tmq_replication_sync_state_set_size") == 2)
        assert all(st.code == d.OK for st in send(master.endpoint, 0, 200))
        proxy.cut()
        wait_until(
            "the SyncStateSet shrinks",
            lambda: master.metric("tmq_replication_sync_state_set_size") == 1,
        )
        before = master.metric("tmq_replication_max_offset")
        assert [st.code for st in send(master.endpoint, 200, 20)] == [d.HA_NOT_AVAILABLE]
        assert master.metric("tmq_replication_max_offset") == before
        assert slave.metric("tmq_replication_connected") == 0
        proxy.heal()
        wait_until(
            "the slave rejoins", lambda: master.metric("tmq_replication_sync_state_set_size") == 2
        )
        assert all(st.code == d.OK for st in send(master.endpoint, 200, 200))
        master.stop()
        slave.stop()
    finally:
        proxy.close()
    assert assert_same_replica(master.data_dir, slave.data_dir) == 400


def test_slaves_register_under_their_id_and_clients_are_routed_to_the_master(
    group, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    from rocketmq import Message

    from remoting.namesrv_client import NameServerClient

    port = free_port()
    namesrv = start_namesrv(port, tmp_path / "namesrv.log")
    client = NameServerClient([f"127.0.0.1:{port}"])
    try:
        master, slave = group("master"), group("slave")
        master.start("master", 0, mode="sync", min_in_sync_replicas=2, namesrv=f"127.0.0.1:{port}")
        # No master address: the slave finds it among the group's peers (one of them down).
        down = GroupMember(tmp_path, "down", free_port())
        slave.start("slave", 1, peers=[down, master], namesrv=f"127.0.0.1:{port}")
        master.create_topic()
        wait_until(
            "both are registered",
            lambda: sorted(b.broker.broker_id for b in client.cluster_info().brokers) == [0, 1],
        )
        wait_until("the slave has the topic", slave.has_topic)
        route = client.route(TOPIC)
        assert route is not None
        assert [(b.broker_id, b.endpoint.port) for b in route.brokers] == [(0, master.grpc_port)]
        wait_until("in sync", lambda: master.metric("tmq_replication_sync_state_set_size") == 2)
        # Apache's client, given the slave as its access point, is routed to the master.
        messages = []
        for n in range(20):
            m = Message()
            m.topic = TOPIC
            m.body = f"message {n} ".encode()
            m.keys = f"key-{n}"
            messages.append(m)
        assert len(send_all(slave, TOPIC, messages)) == 20  # type: ignore[arg-type]
        master.stop()
        slave.stop()
        assert assert_same_replica(master.data_dir, slave.data_dir) == 20
    finally:
        client.close()
        namesrv.send_signal(signal.SIGTERM)
        namesrv.wait(30)


def test_metadata_reaches_the_slave_at_once_so_consumption_resumes_in_place_after_failover(
    group,
) -> None:  # type: ignore[no-untyped-def]
    master, slave = group("master"), group("slave")
    master.start("master", 0, mode="async")
    slave.start("slave", 1, master=master)
    wait_until("the slave follows", lambda: slave.metric("tmq_replication_connected") == 1)
    master.create_topic()
    created_at = time.monotonic()
    wait_until("the slave has the topic", slave.has_topic, timeout=5)
    # Pushed on change, not found by a once-a-second comparison.
    assert time.monotonic() - created_at < 0.5
    assert all(st.code == d.OK for st in send(master.endpoint, 0, 60))
    stub = service_pb2_grpc.MessagingServiceStub(grpc.insecure_channel(master.endpoint))
    consumer_group = d.Resource(name="g-failover")

    def ends() -> list[int]:
        return [
            stub.QueryOffset(
                s.QueryOffsetRequest(
                    message_queue=d.MessageQueue(topic=d.Resource(name=TOPIC), id=q),
                    query_offset_policy=d.END,
                ),
                timeout=10,
            ).offset
            for q in range(QUEUES)
        ]

    # The ConsumeQueues are dispatched just after the acknowledgement.
    wait_until("every message is dispatched", lambda: sum(ends()) == 60, timeout=10)
    committed = {q: (end + 1) // 2 for q, end in enumerate(ends())}  # inside each queue
    for q, offset in committed.items():
        queue = d.MessageQueue(topic=d.Resource(name=TOPIC), id=q)
        reply = stub.UpdateOffset(
            s.UpdateOffsetRequest(group=consumer_group, message_queue=queue, offset=offset),
            timeout=10,
        )
        assert reply.status.code == d.OK, reply.status
    # The master dies 0.5 s after the last commit: half the old window of a second, and room
    # for the slave's fsyncs of its copy on this loaded machine.
    time.sleep(0.5)
    master.kill9()
    slave.stop()
    slave.start("master", 0, mode="async")
    promoted = service_pb2_grpc.MessagingServiceStub(grpc.insecure_channel(slave.endpoint))
    for q, offset in committed.items():
        queue = d.MessageQueue(topic=d.Resource(name=TOPIC), id=q)
        reply = promoted.GetOffset(
            s.GetOffsetRequest(group=consumer_group, message_queue=queue), timeout=10
        )
        assert (reply.status.code, reply.offset) == (d.OK, offset)
    slave.stop()
