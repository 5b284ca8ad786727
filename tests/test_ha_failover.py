"""Failover with a real 3-node etcd as the controller: a replica group of three broker processes
elects its master, Apache's Python client produces through repeated ``kill -9`` of the master,
and nothing acknowledged is lost (tests/ha_failover.py runs the scenario; bench/replication.py
runs it with ten kills)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from rocketmq.grpc_protocol import definition_pb2 as d
from rocketmq.grpc_protocol import service_pb2 as s
from rocketmq.grpc_protocol import service_pb2_grpc

from broker import admin_pb2 as apb
from broker import admin_pb2_grpc as apb_grpc
from broker.ha.etcd import Compare, EtcdClient, put_op
from tests.broker_harness import pull_all, sigstop
from tests.etcd_harness import EtcdCluster
from tests.ha_failover import Group, is_master, run_failover, start_namesrv, wait_for
from tests.test_ha import (
    QUEUES,
    TOPIC,
    GroupMember,
    caught_up,
    commitlog_files,
    open_store,
    queue_entries,
    send,
)


def test_etcd_compare_and_swap_and_leases(tmp_path: Path) -> None:
    """The controller's primitives against a real 3-node etcd: only one of two racing
    transactions wins, and a key on a lease vanishes when the lease is not kept alive."""
    etcd = EtcdCluster(tmp_path).start()
    try:
        a, b = EtcdClient(etcd.endpoints), EtcdClient(list(reversed(etcd.endpoints)))
        lease = a.grant(1)
        key = b"/tmq/test/master"
        won = [
            c.txn([Compare(key, "VERSION", 0)], [put_op(key, json.dumps(i).encode(), lease)])
            for i, c in enumerate((a, b))
        ]
        assert won == [True, False]
        got = b.get(key)
        assert got is not None and got.value == b"0" and got.lease == lease
        deadline = 10.0
        start = time.monotonic()
        while b.get(key) is not None:
            assert time.monotonic() - start < deadline, "the leased key outlived its lease"
            time.sleep(0.2)
        assert a.keepalive(lease) == 0
    finally:
        etcd.stop()


def test_sync_group_survives_repeated_kill_9_of_the_master(tmp_path: Path) -> None:
    """SYNC, min_in_sync_replicas = 2, three kills of whoever is master (each restarted to
    rejoin as a slave, truncating its divergent tail): zero acknowledged messages lost, none
    duplicated in the queues, every consumer group receives every message, and each failover
    started a new epoch."""
    result = run_failover(tmp_path, kills=3, mode="sync")
    summary = result.summary()
    assert result.acked > 100, summary
    assert result.acked_lost == 0, summary
    assert result.duplicated_in_queues == 0, summary
    assert all(result.groups_complete.values()) and len(result.groups_complete) == 2, summary
    assert len(result.epochs) == 3 and result.epochs == sorted(set(result.epochs)), summary
    assert max(result.failover_s) < 60, summary
    # `tmq cluster status --json`: the last elected master, its epoch, all three in sync.
    (group,) = result.cluster_status
    assert group["epoch"] == result.epochs[-1]
    assert sorted(group["sync_state_set"]) == [1, 2, 3]
    assert [m["role"] for m in group["members"]].count("master") == 1
    master = next(m for m in group["members"] if m["role"] == "master")
    assert group["master"] == master["id"]
    assert master["lag_bytes"] == master["lag_messages"] == 0
    assert all(m["lag_bytes"] >= 0 and m["lag_messages"] >= 0 for m in group["members"])


@contextlib.contextmanager
def two_members(
    tmp_path: Path, mode: str, max_lag_ms: int = 3000
) -> Iterator[tuple[EtcdCluster, Group]]:
    """A 3-node etcd, a NameServer and members 1 (elected master) and 2 (its slave, holding the
    topic) of a controller-run group; everything is killed afterwards (etcd thawed first, in
    case a test froze it)."""
    etcd = EtcdCluster(tmp_path).start()
    namesrv, namesrv_address = start_namesrv(tmp_path)
    group = Group(tmp_path, etcd, namesrv_address, mode, max_lag_ms)
    a, b = group.members[0], group.members[1]
    try:
        group.start(a)
        wait_for("a is elected", lambda: is_master(a))
        group.start(b)
        a.create_topic()
        # Metadata follows within a second of a change (docs/ha.md names the window).
        wait_for("b has the topic", b.has_topic)
        # Members log at INFO (TMQ_LOG_LEVEL): the link's life is there when a wait times out.
        assert "replication: following master" in b.log_path.read_text()
        yield etcd, group
    finally:
        for p in etcd.procs:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.pid, signal.SIGCONT)
        group.kill_all()
        namesrv.kill()
        namesrv.wait()
        etcd.stop()


STALLED = 40_000


def test_async_old_master_truncates_its_divergent_tail_and_rejoins(tmp_path: Path) -> None:
    """ASYNC: the master acknowledges messages its stalled slave never gets, and dies; the slave
    is elected (it is still in the SyncStateSet) and starts a newer epoch at its own end. The old
    master comes back, cuts its epoch-1 tail (to quarantine/), and rejoins as a slave holding
    exactly the new master's bytes. The acknowledged tail is lost: what ASYNC means."""
    # b stays in the SyncStateSet while stopped (max_lag_ms 15 s): it remains electable.
    with two_members(tmp_path, "async", max_lag_ms=15_000) as (_etcd, group):
        a, b = group.members[0], group.members[1]
        wait_for("b is in sync", lambda: group.in_sync(2))
        assert {st.code for st in send(a.endpoint, 0, 100)} == {d.OK}
        wait_for("b caught up", lambda: caught_up(a, b))
        assert b.proc is not None
        sigstop(b.proc.pid)
        try:
            # Acknowledged by the ASYNC master alone: b is stopped. ~25 MB, more than the
            # master's 16 MiB send window and the kernel's socket buffers hold for b.
            assert {st.code for st in send(a.endpoint, 1000, STALLED, batch=1000)} == {d.OK}
            diverged_end = a.metric("tmq_replication_max_offset")
            # Usually 1; 2 if a loaded machine kept a from renewing its 2 s lease in time and
            # it was fenced and elected again (b, stopped, could not be a candidate).
            diverged_epoch = a.metric("tmq_replication_epoch")
            a.kill9()
        finally:
            os.kill(b.proc.pid, signal.SIGCONT)
        wait_for("b is elected", lambda: is_master(b), timeout=60)
        # A newer epoch than the one a wrote its tail in: that is what makes a cut it. Not
        # "== 2": b too may be fenced at load and elected again before it is asked.
        assert diverged_epoch is not None and diverged_epoch >= 1
        assert (b.metric("tmq_replication_epoch") or 0) > diverged_epoch
        b_end = b.metric("tmq_replication_max_offset")
        assert b_end is not None and diverged_end is not None and b_end < diverged_end
        assert {st.code for st in send(b.endpoint, 100, 50)} == {d.OK}
        group.start(a)  # the old master returns
        wait_for("a rejoined b's SyncStateSet", lambda: group.in_sync(2))
        assert a.metric("tmq_replication_is_master") == 0
        assert "diverged from the master's" in a.log_path.read_text()
        assert list((a.data_dir / "quarantine").iterdir())
        wait_for("a caught up", lambda: caught_up(b, a))
        b.stop()
        a.stop()
        # Byte-identical CommitLogs, the same ConsumeQueues; of the stalled batch only what the
        # kernel had buffered for b survived (so some acknowledged messages are gone).
        assert commitlog_files(a.data_dir) == commitlog_files(b.data_dir)
        with open_store(a.data_dir) as old, open_store(b.data_dir) as new:
            entries = queue_entries(new)
            assert queue_entries(old) == entries
            total = sum(len(v) for v in entries.values())
            assert all(new.query_by_key(TOPIC, f"key-{n}") for n in range(150))
        # What the kernel had buffered for b survived; the rest of the stalled batch is gone.
        assert 150 <= total < 150 + STALLED


def test_a_master_that_loses_etcd_fences_itself_and_reports_not_serving(tmp_path: Path) -> None:
    """With every etcd member frozen the master cannot renew its lease: within the TTL it stops
    acknowledging (HA_NOT_AVAILABLE), its MessagingService health turns NOT_SERVING and
    tmq_replication_fenced is 1. Once etcd is back the group elects a master again (a new
    epoch) and sends succeed."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with two_members(tmp_path, "sync") as (etcd, group):
        a = group.members[0]
        wait_for("both in sync", lambda: group.in_sync(2))
        assert {st.code for st in send(a.endpoint, 0, 20)} == {d.OK}
        health = health_pb2_grpc.HealthStub(grpc.insecure_channel(a.endpoint))

        def messaging_health() -> int:
            request = health_pb2.HealthCheckRequest(service="apache.rocketmq.v2.MessagingService")
            return int(health.Check(request, timeout=5).status)

        assert messaging_health() == health_pb2.HealthCheckResponse.SERVING
        for p in etcd.procs:
            sigstop(p.pid)
        frozen_at = time.monotonic()
        wait_for("a is fenced", lambda: a.metric("tmq_replication_fenced") == 1, timeout=10)
        # Idle, its tick stuck in etcd calls that time out (2 s per endpoint, three of them),
        # it still fences by its lease deadline (3/4 of the 2 s TTL after the last renewal sent):
        # before etcd could have expired its lease and elected another master.
        assert time.monotonic() - frozen_at < 2.0
        assert messaging_health() == health_pb2.HealthCheckResponse.NOT_SERVING
        codes = {st.code for st in send(a.endpoint, 100, 20)}
        assert codes == {d.HA_NOT_AVAILABLE}, codes
        for p in etcd.procs:
            os.kill(p.pid, signal.SIGCONT)
        master = wait_for("a master again", group.master, timeout=60)
        assert (master.metric("tmq_replication_epoch") or 0) >= 2
        wait_for("both in sync", lambda: group.in_sync(2), timeout=60)
        assert {st.code for st in send(master.endpoint, 200, 20)} == {d.OK}
        health = health_pb2_grpc.HealthStub(grpc.insecure_channel(master.endpoint))
        assert messaging_health() == health_pb2.HealthCheckResponse.SERVING


def _keeper_pid(member_pid: int) -> int:
    """The lease keeper child (broker/ha/lease_keeper.py) of the broker process ``member_pid``."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            cmdline = (entry / "cmdline").read_bytes()
            if int(stat[1]) == member_pid and b"broker.ha.lease_keeper" in cmdline:
                return int(entry.name)
    raise AssertionError(f"no lease keeper under process {member_pid}")


def test_a_slave_whose_lease_keeper_is_frozen_is_still_elected(tmp_path: Path) -> None:
    """A member stands for election only once its keeper has renewed its lease (decision 910),
    but not for ever: with b's keeper frozen (SIGSTOP: alive, renewing nothing) and the master
    killed, b is elected after at most two TTLs and renews through its own tick (decision 911;
    two CI runs saw a slave never elected, its keeper not renewing)."""
    with two_members(tmp_path, "async", max_lag_ms=15_000) as (etcd, group):
        a, b = group.members[0], group.members[1]
        wait_for("b is in sync", lambda: group.in_sync(2))
        assert b.proc is not None
        keeper = _keeper_pid(b.proc.pid)
        os.kill(keeper, signal.SIGSTOP)
        try:
            # b's lease gone (as if it expired): b takes a new one, which its frozen keeper
            # never renews.
            client = EtcdClient(etcd.endpoints)
            (member,) = [
                kv for kv in client.get_prefix(b"/tmq/ha/") if kv.key.endswith(b"/members/2")
            ]
            client.revoke(member.lease)
            wait_for("b took a new lease", lambda: "taking a new one" in b.log_path.read_text())
            a.kill9()
            wait_for("b is elected", lambda: is_master(b), timeout=30)
            # Either bound let it stand: the guard's two TTLs, or the controller restarting the
            # keeper that etcd answered instead of (decision 992), whose successor renewed.
            log_text = b.log_path.read_text()
            assert (
                "standing for election without it" in log_text
                or "has not renewed lease" in log_text
            ), log_text[-3000:]
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(keeper, signal.SIGCONT)


def test_a_master_whose_lease_keeper_hangs_restarts_it_and_stays_master(tmp_path: Path) -> None:
    """The master's keeper alive but renewing nothing (SIGSTOP: as if hung in a call). The
    master renews through its own tick meanwhile, so it stays master in the same epoch; the
    controller sees etcd answer it but not the keeper for two TTLs, says so once at ERROR, kills
    the keeper and starts another, which renews (the tick's fallback stops being needed), and
    sends are acknowledged throughout (decision 992). Without this, the hung keeper stayed."""
    with two_members(tmp_path, "sync") as (_etcd, group):
        a = group.members[0]
        wait_for("both in sync", lambda: group.in_sync(2))
        assert a.proc is not None
        epoch = a.metric("tmq_replication_epoch")
        hung = _keeper_pid(a.proc.pid)
        sigstop(hung)
        try:
            assert {st.code for st in send(a.endpoint, 0, 20)} == {d.OK}
            wait_for(
                "a restarts its hung keeper",
                lambda: "has not renewed lease" in a.log_path.read_text(),
                timeout=30,
            )
            pid = a.proc.pid
            wait_for("a new keeper", lambda: _keeper_pid(pid) != hung)
            assert not Path(f"/proc/{hung}").exists(), "the hung keeper was not killed"
            assert {st.code for st in send(a.endpoint, 100, 20)} == {d.OK}
            # The new keeper renews: no second restart over three more TTLs.
            time.sleep(6)
            log_text = a.log_path.read_text()
            assert log_text.count("has not renewed lease") == 1, log_text[-3000:]
            assert "ERROR" in next(
                line for line in log_text.splitlines() if "has not renewed lease" in line
            )
            assert is_master(a) and a.metric("tmq_replication_epoch") == epoch
            assert a.metric("tmq_replication_keeper_restarts_total") == 1
            assert "fencing this master" not in log_text
            assert {st.code for st in send(a.endpoint, 200, 20)} == {d.OK}
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(hung, signal.SIGCONT)


def test_a_slave_serves_reads_while_no_master_is_up(tmp_path: Path) -> None:
    """The master is killed while etcd is frozen, so no election can happen: the slave forwards
    nothing to the dead master but serves reads from its own copy (PullMessage, and Apache's
    SimpleConsumer receiving and acknowledging), and refuses sends. Once etcd is back it is
    elected and takes sends."""
    from rocketmq import ClientConfiguration, Credentials, FilterExpression, SimpleConsumer

    with two_members(tmp_path, "async") as (etcd, group):
        a, b = group.members[0], group.members[1]
        assert {st.code for st in send(a.endpoint, 0, 60)} == {d.OK}
        wait_for("b caught up", lambda: caught_up(a, b))
        # Only a member of the SyncStateSet etcd holds can be elected: b must be there before
        # etcd freezes (the master publishes it at a tick; on a loaded machine a tick can come
        # after the catch-up the test saw).
        wait_for("b is in the SyncStateSet", lambda: _etcd_sync_state_set(etcd) == [1, 2])
        # No wait for b's ConsumeQueues: b dispatches every 50 ms (decision 304), and its
        # slave-read must serve everything its CommitLog holds all the same (decision 360).
        # (The wait that stood here pulled through b, which forwarded to a: it counted a's.)
        for p in etcd.procs:
            sigstop(p.pid)
        a.kill9()
        assert sorted(m.system_properties.keys[0] for m in pull_all(b, TOPIC, QUEUES)) == sorted(
            f"key-{n}" for n in range(60)
        )
        consumer = SimpleConsumer(
            ClientConfiguration(b.endpoint, Credentials(), request_timeout=10),
            "g-slave-read",
            {TOPIC: FilterExpression()},
            await_duration=2,
        )
        consumer.startup()
        got: set[str] = set()
        try:
            # A delivery left to expire on the slave is delivered again in place (its replica
            # store takes no retry-topic append), and receives go on (decision 970).
            held = {k for m in consumer.receive(4, 1) for k in m.keys}
            assert held
            time.sleep(1.5)
            deadline = time.monotonic() + 60
            while len(got) < 60 and time.monotonic() < deadline:
                for m in consumer.receive(32, 30):
                    got.update(m.keys)
                    consumer.ack(m)
        finally:
            consumer.shutdown()
        assert got == {f"key-{n}" for n in range(60)}  # the held ones too, received again
        # A send is still forwarded to the master etcd last named, which is dead: UNAVAILABLE,
        # never acknowledged (the master may have stored it before dying, so the member does
        # not claim HA_NOT_AVAILABLE, "nothing stored").
        with pytest.raises(grpc.RpcError) as refused:
            send(b.endpoint, 100, 20)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        for p in etcd.procs:
            os.kill(p.pid, signal.SIGCONT)
        wait_for("b is elected", lambda: is_master(b), timeout=60)
        assert {st.code for st in send(b.endpoint, 100, 20)} == {d.OK}


def _put_topic(member: GroupMember, name: str, message_type: str) -> None:
    stub = apb_grpc.AdminStub(grpc.insecure_channel(member.endpoint))
    stub.PutTopic(
        apb.PutTopicRequest(
            topic=apb.Topic(name=name, queues=1, perm=6, message_type=message_type)
        ),
        timeout=10,
    )


def _topic_count(member: GroupMember, name: str) -> int:
    stub = apb_grpc.AdminStub(grpc.insecure_channel(member.endpoint))
    described = stub.GetTopic(apb.GetTopicRequest(name=name), timeout=10)
    return sum(q.max_offset - q.min_offset for q in described.queues)


def _send_special(
    endpoint: str, topic: str, message_type: int, keys_due: list[tuple[str, int]]
) -> None:
    stub = service_pb2_grpc.MessagingServiceStub(grpc.insecure_channel(endpoint))
    request = s.SendMessageRequest()
    for key, due in keys_due:
        m = request.messages.add(topic=d.Resource(name=topic), body=f"body of {key}".encode())
        m.system_properties.message_id = os.urandom(16).hex().upper()
        m.system_properties.message_type = message_type
        m.system_properties.keys.append(key)
        m.system_properties.born_timestamp.FromMilliseconds(int(time.time() * 1000))
        if due:
            m.system_properties.delivery_timestamp.FromMilliseconds(due)
    reply = stub.SendMessage(request, timeout=30)
    assert reply.status.code == d.OK, reply.status


def test_an_elected_slave_takes_over_timers_and_open_transactions(tmp_path: Path) -> None:
    """Delay messages due before and after a failover are each delivered once, and a half
    message written while the new master was a slave is pending on it (checked back, not
    forgotten): a slave keeps its wheel in step but delivers nothing, and takes over both when
    it is elected (it used to deliver again what the old master had delivered, and knew only
    the half messages it had recovered at its own start)."""
    with two_members(tmp_path, "sync") as (etcd, group):
        a, b = group.members[0], group.members[1]
        wait_for("b is in sync", lambda: group.in_sync(2))
        wait_for("b is in the SyncStateSet", lambda: _etcd_sync_state_set(etcd) == [1, 2])
        _put_topic(a, "later", "DELAY")
        _put_topic(a, "txn", "TRANSACTION")
        stub = apb_grpc.AdminStub(grpc.insecure_channel(b.endpoint))
        wait_for(
            "b has the topics",
            lambda: (
                {"later", "txn"}
                <= {
                    t.topic.name
                    for t in stub.ListTopics(apb.ListTopicsRequest(), timeout=10).topics
                }
            ),
        )
        now = int(time.time() * 1000)
        early = [(f"early-{n}", now + 1000) for n in range(20)]
        late = [(f"late-{n}", now + 20_000) for n in range(20)]
        _send_special(a.endpoint, "later", d.DELAY, early + late)
        _send_special(a.endpoint, "txn", d.TRANSACTION, [("open-1", 0)])
        wait_for("a delivered the early ones", lambda: _topic_count(a, "later") == 20)
        wait_for("b caught up", lambda: caught_up(a, b))
        # A slave's ConsumeQueues trail its CommitLog by up to 50 ms (decision 304).
        wait_for("b dispatched the early ones", lambda: _topic_count(b, "later") == 20, 5.0)
        a.kill9()
        wait_for("b is elected", lambda: is_master(b), timeout=60)
        wait_for("b delivered the late ones", lambda: _topic_count(b, "later") >= 40, timeout=60)
        time.sleep(3)  # a second delivery of the early ones would come now, at the latest
        assert _topic_count(b, "later") == 40
        keys = Counter(k for m in pull_all(b, "later", 1) for k in m.system_properties.keys)
        assert set(keys) == {k for k, _ in early + late} and set(keys.values()) == {1}
        wait_for(
            "b knows the open transaction",
            lambda: b.metric("tmq_transaction_half_pending") == 1,
            timeout=30,
        )


def _receive_and_ack(member: GroupMember, group: str, want: set[str], seconds: float) -> set[str]:
    """The keys ``group`` receives through ``member`` (each message acknowledged, the ack
    answered OK) until it has ``want`` or ``seconds`` pass."""
    stub = service_pb2_grpc.MessagingServiceStub(grpc.insecure_channel(member.endpoint))
    got: set[str] = set()
    deadline = time.monotonic() + seconds
    while not want <= got and time.monotonic() < deadline:
        request = s.ReceiveMessageRequest(
            group=d.Resource(name=group),
            message_queue=d.MessageQueue(topic=d.Resource(name=TOPIC)),
            filter_expression=d.FilterExpression(type=d.TAG, expression="*"),
            batch_size=32,
        )
        request.invisible_duration.FromSeconds(30)
        request.long_polling_timeout.FromSeconds(1)
        messages = [r.message for r in stub.ReceiveMessage(request, timeout=10) if r.message.body]
        if not messages:
            continue
        ack = s.AckMessageRequest(group=d.Resource(name=group), topic=d.Resource(name=TOPIC))
        for m in messages:
            ack.entries.add(
                message_id=m.system_properties.message_id,
                receipt_handle=m.system_properties.receipt_handle,
            )
        reply = stub.AckMessage(ack, timeout=10)
        assert reply.status.code == d.OK, reply
        got.update(k for m in messages for k in m.system_properties.keys)
    return got


def _receive_one(member: GroupMember, group: str) -> d.Message:
    """One message ``group`` receives through ``member``, invisible for 5 minutes, not
    acknowledged."""
    stub = service_pb2_grpc.MessagingServiceStub(grpc.insecure_channel(member.endpoint))
    request = s.ReceiveMessageRequest(
        group=d.Resource(name=group),
        message_queue=d.MessageQueue(topic=d.Resource(name=TOPIC)),
        filter_expression=d.FilterExpression(type=d.TAG, expression="*"),
        batch_size=1,
    )
    request.invisible_duration.FromSeconds(300)
    request.long_polling_timeout.FromSeconds(5)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        for r in stub.ReceiveMessage(request, timeout=10):
            if r.message.body:
                return r.message
    raise AssertionError(f"{group} received nothing through {member.name}")


def _etcd_sync_state_set(etcd: EtcdCluster) -> list[int]:
    client = EtcdClient(etcd.endpoints)
    states = [kv for kv in client.get_prefix(b"/tmq/ha/") if kv.key.endswith(b"/state")]
    return sorted(json.loads(states[0].value)["sync_state_set"]) if states else []


def test_a_master_elected_again_delivers_what_was_written_while_it_was_a_slave(
    tmp_path: Path,
) -> None:
    """A master that is deposed while alive (fenced, then a slave) and elected again forgets
    the pop state of its old term: its consumers' positions come from the replicated offsets,
    not from what it handed out before, and refuses the receipt handles it issued then. It used
    to keep both in memory: after its divergent tail was cut and the other member wrote new
    messages at those offsets it skipped them (a group never received messages every member held
    and the producer had acknowledged), and it took an old handle as an ack of whatever message
    its offset held now."""
    with two_members(tmp_path, "async", max_lag_ms=15_000) as (etcd, group):
        a, b = group.members[0], group.members[1]
        assert a.proc is not None and b.proc is not None
        wait_for("b is in sync", lambda: group.in_sync(2))
        assert {st.code for st in send(a.endpoint, 0, 12)} == {d.OK}
        wait_for("b caught up", lambda: caught_up(a, b))
        # b is elected below only from the SyncStateSet etcd holds (the metric above is the
        # master's live view, published at its next tick).
        wait_for("b is in the SyncStateSet", lambda: _etcd_sync_state_set(etcd) == [1, 2])
        sigstop(b.proc.pid)
        # a's tail: acknowledged by the ASYNC master alone, and consumed and acknowledged by
        # group g-term through a, which then hands out offsets past b's end.
        assert {st.code for st in send(a.endpoint, 12, 60)} == {d.OK}
        old = {f"key-{n}" for n in range(72)}
        assert _receive_and_ack(a, "g-term", old, seconds=60) == old
        # One more, received and held unacknowledged (invisible for 5 minutes).
        assert {st.code for st in send(a.endpoint, 72, 1)} == {d.OK}
        held = _receive_one(a, "g-term")
        assert list(held.system_properties.keys) == ["key-72"]
        sigstop(a.proc.pid)
        try:
            # What the kernel buffered for b (the tail, the group's offsets) dies with it.
            b.kill9()
            group.start(b)
            wait_for("b is elected", lambda: is_master(b), timeout=60)
        finally:
            os.kill(a.proc.pid, signal.SIGCONT)
        wait_for("a cut its tail", lambda: "diverged from the master's" in a.log_path.read_text())
        # New messages at the offsets a's cut tail had, acknowledged and replicated to a.
        assert {st.code for st in send(b.endpoint, 100, 12)} == {d.OK}
        wait_for("a caught up", lambda: caught_up(b, a))
        wait_for("a is in the SyncStateSet", lambda: _etcd_sync_state_set(etcd) == [1, 2])
        sigstop(b.proc.pid)
        try:
            wait_for("a is elected again", lambda: is_master(a), timeout=60)
        finally:
            os.kill(b.proc.pid, signal.SIGCONT)
        # The held handle is of a's old term: its message was in the cut tail, and its offset
        # may now hold one of the new messages. Refused, not taken as an ack of that one.
        stub = service_pb2_grpc.MessagingServiceStub(grpc.insecure_channel(a.endpoint))
        ack = s.AckMessageRequest(group=d.Resource(name="g-term"), topic=d.Resource(name=TOPIC))
        ack.entries.add(
            message_id=held.system_properties.message_id,
            receipt_handle=held.system_properties.receipt_handle,
        )
        (entry,) = stub.AckMessage(ack, timeout=10).entries
        assert entry.status.code == d.INVALID_RECEIPT_HANDLE, entry
        assert "not acknowledged, and the message will be delivered again" in entry.status.message
        new = {f"key-{n}" for n in range(100, 112)}
        got = _receive_and_ack(a, "g-term", new, seconds=30)
        assert new <= got, sorted(new - got)
