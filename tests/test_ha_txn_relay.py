"""Transaction check-backs reach a producer connected to any member of a replica group
(decision 1250): the master relays the checks it has no producer for to the other members,
which hand them to the producers whose Telemetry stream they hold; the producer's answer is an
EndTransaction its member forwards to the master.

Real processes: a 3-node etcd, a NameServer, members elected through it, and Apache's Python
client whose channel sits on a slave (its address sorts first in the route, and gRPC's
pick-first keeps the first that answers, decision 1151). The relay client's timeouts are
tested against real gRPC servers in this process, one of which never answers."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import Counter
from collections.abc import Iterator
from concurrent import futures
from dataclasses import replace
from pathlib import Path
from typing import Any

import grpc
from rocketmq import (
    ClientConfiguration,
    Credentials,
    Message,
    Producer,
    TransactionResolution,
)
from rocketmq.grpc_protocol import definition_pb2 as d
from rocketmq.grpc_protocol import service_pb2 as s

from broker import admin_pb2 as apb
from broker import admin_pb2_grpc as apb_grpc
from broker.ha import relay_pb2 as rpb
from broker.ha import relay_pb2_grpc as rpb_grpc
from broker.ha.check_relay import CheckRelay, CheckRelayServicer
from broker.producers import ProducerRegistry
from remoting.security import ChannelSecurity
from tests.broker_harness import free_port, pull_all, terminate
from tests.etcd_harness import EtcdCluster
from tests.ha_failover import Group, is_master, start_namesrv, wait_for
from tests.node_harness import ensure_node_client, node
from tests.test_ha import GroupMember, caught_up, send
from tests.test_transactions import Checker  # answers from a table a test may change
from tests.tls_harness import make_ca
from tiered.record import LOCALHOST, StoredMessage

TXN = "txn-relay"
QUEUES = 2
COMMIT = TransactionResolution.COMMIT
ROLLBACK = TransactionResolution.ROLLBACK
UNKNOWN = TransactionResolution.TRANSACTION_RESOLUTION_UNSPECIFIED
ADMIN_KEY, ADMIN_SECRET = "relay-admin", "relay-admin-secret-0123456789abcdef"
ADMIN = {"TMQ_ADMIN_ACCESS_KEY": ADMIN_KEY, "TMQ_ADMIN_SECRET_KEY": ADMIN_SECRET}


def checks_every_second(check_max: int) -> dict[str, str]:
    """The first check-back a second after the half message, then every second."""
    return {
        "TMQ_BROKER_TRANSACTION_TIMEOUT_MS": "1000",
        "TMQ_BROKER_TRANSACTION_CHECK_INTERVAL_MS": "1000",
        "TMQ_BROKER_TRANSACTION_CHECK_MAX": str(check_max),
    }


def message(key: str) -> Message:
    m = Message()
    m.topic = TXN
    m.body = f"body of {key}".encode()
    m.keys = key
    return m


def producer(member: GroupMember, checker: Checker, credentials: Credentials) -> Producer:
    """Apache's producer with ``member`` as its only access point."""
    config = ClientConfiguration(member.endpoint, credentials, request_timeout=10)
    p = Producer(config, topics=[TXN], checker=checker)
    p.startup()
    return p


def send_undecided(p: Producer, key: str) -> Any:
    """A half message whose local transaction answers UNKNOWN (EndTransaction with no
    resolution: the broker is to ask later); its receipt."""
    sent = message(key)
    receipt = p.send(sent, p.begin_transaction())
    ended = p.end_transaction(
        receipt.message_queue.endpoints, sent, receipt.transaction_id, UNKNOWN, d.SOURCE_CLIENT
    )
    assert ended.status.code == d.OK, ended
    return receipt


def keys_in(member: GroupMember, topic: str = TXN) -> Counter[str]:
    """Every message key of ``topic`` on ``member``, with how many copies it has."""
    messages = pull_all(member, topic, QUEUES, member.channel())
    return Counter(k for m in messages for k in m.system_properties.keys)


def metric(member: GroupMember, name: str) -> float:
    return member.metric(name) or 0.0


def has_txn_topic(member: GroupMember) -> bool:
    stub = apb_grpc.AdminStub(member.channel())
    listed = stub.ListTopics(apb.ListTopicsRequest(), timeout=10).topics
    return TXN in [t.topic.name for t in listed]


@contextlib.contextmanager
def relay_group(
    root: Path,
    size: int,
    env: dict[str, str],
    producer_on: int,
    auth: bool = False,
    tls: bool = False,
) -> Iterator[Group]:
    """Members 1..``size`` of a controller-run SYNC group, member 1 elected master, the
    transactional topic on every member; member ``producer_on`` (0-based) has the gRPC address
    that sorts first, so that a client's channel over the route's addresses picks it."""
    etcd = EtcdCluster(root).start()
    namesrv, namesrv_address = start_namesrv(root)
    group = Group(root, etcd, namesrv_address, "sync", env={**env, **(ADMIN if auth else {})})
    members = group.members[:size]
    chosen = members[producer_on]
    first = min(members, key=lambda m: m.endpoint)
    chosen.grpc_port, first.grpc_port = first.grpc_port, chosen.grpc_port
    ca = make_ca(root) if tls else None
    for m in members:
        if auth:
            m.extra_toml = "\n[auth]\nenabled = true\n"
            m.security = ChannelSecurity(ADMIN_KEY, ADMIN_SECRET)
        if ca is not None:
            m.extra_toml += (
                f'\n[tls]\ncert_file = "{ca[1]}"\nkey_file = "{ca[2]}"\nca_file = "{ca[0]}"\n'
            )
            m.security = replace(m.security, ca_file=str(ca[0]))
    try:
        group.start(members[0])
        wait_for("member 1 is elected", lambda: is_master(members[0]))
        for m in members[1:]:
            group.start(m)
        apb_grpc.AdminStub(members[0].channel()).PutTopic(
            apb.PutTopicRequest(
                topic=apb.Topic(name=TXN, queues=QUEUES, perm=6, message_type="TRANSACTION")
            ),
            timeout=10,
        )
        for m in members:
            wait_for(f"{m.name} has the topic", lambda m=m: has_txn_topic(m))
        wait_for("every member is in sync", lambda: group.in_sync(size), timeout=60)
        yield group
    finally:
        group.kill_all()
        terminate(namesrv, 10)
        etcd.stop()


def test_a_check_back_reaches_a_producer_on_a_slave_and_commits_or_rolls_back(
    tmp_path: Path,
) -> None:
    """Two members under [auth]; the producer's channel is on the slave. Each transaction is
    left UNKNOWN by the producer's local check; the master's check-back reaches the producer
    through the slave, and its answer (forwarded to the master) commits one and rolls the other
    back: the committed message is stored once, the rolled-back one never, and neither is
    checked again. On main the producer was never asked: every pass counted "no producer
    connected" and the last one rolled both back."""
    with relay_group(tmp_path, 2, checks_every_second(10), producer_on=1, auth=True) as group:
        a, b = group.members[:2]
        checker = Checker({"k-commit": COMMIT, "k-rollback": ROLLBACK})
        p = producer(b, checker, Credentials(ADMIN_KEY, ADMIN_SECRET))
        try:
            for key in ("k-commit", "k-rollback"):
                send_undecided(p, key)
            assert metric(a, "tmq_transaction_half_pending") == 2
            wait_for(
                "the producer on the slave is asked about both",
                lambda: {"k-commit", "k-rollback"} <= set(checker.asked),
                timeout=30,
            )
            wait_for(
                "the master decided both",
                lambda: metric(a, "tmq_transaction_half_pending") == 0,
                timeout=30,
            )
            asked = len(checker.asked)
            time.sleep(3)  # three check intervals: a decided transaction is not checked again
            assert len(checker.asked) == asked, checker.asked
        finally:
            p.shutdown()
        assert metric(a, "tmq_transaction_commits_total") == 1
        assert metric(a, "tmq_transaction_rollbacks_total") == 1
        assert metric(a, "tmq_transaction_checks_relayed_total") >= 2
        assert metric(b, "tmq_transaction_checks_relayed_total") == 0  # a slave checks nothing
        assert keys_in(a) == Counter({"k-commit": 1})
        wait_for("b caught up", lambda: caught_up(a, b))
        assert keys_in(b) == Counter({"k-commit": 1})
        # The relay service is for members (admins): an unsigned caller is refused.
        stub = rpb_grpc.ReplicaGroupStub(grpc.insecure_channel(b.endpoint))
        try:
            stub.RelayTransactionChecks(rpb.RelayChecksRequest(), timeout=10)
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.UNAUTHENTICATED, e
        else:
            raise AssertionError("an unsigned relay call was accepted")


def test_a_slave_of_a_tls_group_forwards_sends_to_the_master_over_tls(tmp_path: Path) -> None:
    """[tls] and [auth] on every member: a slave forwards what needs the master (sends, acks,
    EndTransaction) to the master's gRPC port, which speaks TLS only. The forwarder opened
    plaintext channels, so every send a client made through a slave of a TLS group failed
    (decision 1271)."""
    with relay_group(tmp_path, 2, {}, producer_on=1, auth=True, tls=True) as group:
        a, b = group.members[:2]
        apb_grpc.AdminStub(a.channel()).PutTopic(
            apb.PutTopicRequest(topic=apb.Topic(name="tls-forward", queues=QUEUES, perm=6)),
            timeout=10,
        )
        wait_for("b has the topic", lambda: "tls-forward" in topics_of(b))
        statuses = send(b.endpoint, 0, 40, topic="tls-forward", channel=b.channel())
        assert {st.code for st in statuses} == {d.OK}, statuses
        assert sum(keys_in(a, "tls-forward").values()) == 40


def topics_of(member: GroupMember) -> list[str]:
    listed = apb_grpc.AdminStub(member.channel()).ListTopics(apb.ListTopicsRequest(), timeout=10)
    return [t.topic.name for t in listed.topics]


def check_for(key: str, receipt: Any) -> rpb.TransactionCheck:
    """What a master relays for the half message ``receipt`` names (built as it builds it)."""
    command = ProducerRegistry.check_command(
        half_message(key, receipt.message_id), TXN, receipt.transaction_id
    )
    return rpb.TransactionCheck(topic=TXN, command=command.SerializeToString())


def half_message(key: str, message_id: str) -> StoredMessage:
    """A half message as the master reads it back from its CommitLog."""
    return StoredMessage(
        topic="RMQ_SYS_TRANS_HALF_TOPIC",
        queue_id=0,
        queue_offset=0,
        commitlog_offset=0,
        size=0,
        body=f"body of {key}".encode(),
        body_crc=0,
        flag=0,
        sys_flag=0,
        born_timestamp=0,
        born_host=LOCALHOST,
        store_timestamp=0,
        store_host=LOCALHOST,
        reconsume_times=0,
        prepared_transaction_offset=0,
        properties={"KEYS": key, "UNIQ_KEY": message_id},
    )


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def test_a_check_relayed_twice_is_decided_once(tmp_path: Path) -> None:
    """A check can reach two producers in one pass when a member relayed it but its answer to
    the master was lost (the master then asks the next member). The second answer is harmless:
    the same decision again changes nothing, and a different one is refused with the first
    kept. The test plays the master and relays each check twice through the slave."""
    slow = {"TMQ_BROKER_TRANSACTION_TIMEOUT_MS": "600000"}  # the master itself never checks
    with relay_group(tmp_path, 2, slow, producer_on=1) as group:
        a, b = group.members[:2]
        checker = Checker({"k-twice": COMMIT, "k-conflict": COMMIT})
        p = producer(b, checker, Credentials())
        stub = rpb_grpc.ReplicaGroupStub(b.channel())
        # The client logs an EndTransaction the broker refused (and nothing for one it took).
        refusals = _Records()
        client_log = logging.getLogger("rocketmq-python-client")
        client_log.addHandler(refusals)
        ids: dict[str, str] = {}
        try:
            for n, key in enumerate(("k-twice", "k-conflict"), start=1):
                receipt = send_undecided(p, key)
                ids[key] = receipt.message_id
                check = check_for(key, receipt)
                relayed = wait_for(
                    f"{key}: the slave hands the check to the producer",
                    lambda c=check: (
                        list(
                            stub.RelayTransactionChecks(
                                rpb.RelayChecksRequest(checks=[c]), timeout=10
                            ).relayed
                        )
                        == [True]
                    ),
                )
                assert relayed
                wait_for(
                    f"{key}: committed",
                    lambda n=n: metric(a, "tmq_transaction_commits_total") == n,
                    timeout=30,
                )
                if key == "k-conflict":
                    checker.answers[key] = ROLLBACK
                answer = stub.RelayTransactionChecks(
                    rpb.RelayChecksRequest(checks=[check]), timeout=10
                )
                assert list(answer.relayed) == [True]
                wait_for(f"{key}: asked twice", lambda k=key: checker.asked.count(k) == 2)
            wait_for(
                "the second, different decision is refused",
                lambda: any(f"rollback message: {ids['k-conflict']}" in r for r in refusals.lines),
            )
            time.sleep(1)
        finally:
            client_log.removeHandler(refusals)
            p.shutdown()
        assert not any(ids["k-twice"] in r for r in refusals.lines), refusals.lines
        assert metric(a, "tmq_transaction_commits_total") == 2
        assert metric(a, "tmq_transaction_rollbacks_total") == 0
        assert metric(a, "tmq_transaction_half_pending") == 0
        assert keys_in(a) == Counter({"k-twice": 1, "k-conflict": 1})


def test_check_backs_reach_a_producer_on_a_slave_after_a_failover(tmp_path: Path) -> None:
    """Three members; the producer's channel is on member 3. A transaction left UNKNOWN
    before the master (member 1) is killed, and one opened after member 2 is elected, are both
    checked back through member 3 by the new master and committed, each stored once; the dead
    member is no obstacle."""
    with relay_group(tmp_path, 3, checks_every_second(60), producer_on=2) as group:
        a, b, c = group.members
        checker = Checker()  # UNKNOWN until the test decides
        p = producer(c, checker, Credentials())
        try:
            send_undecided(p, "k-before")
            wait_for("the producer on c is asked", lambda: "k-before" in checker.asked)
            wait_for("b and c caught up", lambda: caught_up(a, b, c))
            a.kill9()
            wait_for("a new master", lambda: is_master(b) or is_master(c), timeout=60)
            assert is_master(b), "member 2 (lowest id at an equal end) is elected"
            # SYNC, min_in_sync_replicas 2: sends wait for c to follow b.
            wait_for("c follows b", lambda: group.in_sync(2), timeout=60)
            send_undecided(p, "k-after")
            mark = len(checker.asked)
            wait_for(
                "the new master checks both back through c",
                lambda: {"k-before", "k-after"} <= set(checker.asked[mark:]),
                timeout=60,
            )
            checker.answers.update({"k-before": COMMIT, "k-after": COMMIT})
            wait_for(
                "the new master committed both",
                lambda: metric(b, "tmq_transaction_half_pending") == 0,
                timeout=30,
            )
        finally:
            p.shutdown()
        assert metric(b, "tmq_transaction_commits_total") == 2
        assert metric(b, "tmq_transaction_rollbacks_total") == 0
        assert metric(b, "tmq_transaction_checks_relayed_total") >= 2
        assert keys_in(b) == Counter({"k-before": 1, "k-after": 1})


def test_check_backs_reach_the_node_client_routed_at_a_slave(tmp_path: Path) -> None:
    """Apache's Node.js client, given the slave as its access point, is routed at it
    (decision 1171): two transactions it leaves to the check-back are decided by its checker
    through the slave, one committed and stored once, the other rolled back. On main it was
    never asked."""
    ensure_node_client()
    with relay_group(tmp_path, 2, checks_every_second(10), producer_on=1) as group:
        a, b = group.members[:2]
        result = node(
            {
                "cmd": "transact",
                "endpoint": b.endpoint,
                "topic": TXN,
                "seconds": 8,
                "answers": {"k-commit": "COMMIT", "k-rollback": "ROLLBACK"},
                "messages": [
                    {"body": "body of k-commit", "keys": ["k-commit"]},
                    {"body": "body of k-rollback", "keys": ["k-rollback"]},
                ],
            },
            timeout=120,
        )
        assert {"k-commit", "k-rollback"} <= set(result["asked"]), result
        wait_for("the master decided both", lambda: metric(a, "tmq_transaction_half_pending") == 0)
        assert metric(a, "tmq_transaction_commits_total") == 1
        assert metric(a, "tmq_transaction_rollbacks_total") == 1
        assert metric(a, "tmq_transaction_checks_relayed_total") >= 2
        assert keys_in(a) == Counter({"k-commit": 1})


# -- the relay client against real gRPC servers --------------------------------------------------


class _Frozen(rpb_grpc.ReplicaGroupServicer):
    """A member that takes the call and never answers (a SIGSTOPped or wedged process)."""

    def __init__(self) -> None:
        self.calls = 0
        self.release = threading.Event()

    def RelayTransactionChecks(self, request: Any, context: Any) -> rpb.RelayChecksResponse:
        self.calls += 1
        self.release.wait(30)
        return rpb.RelayChecksResponse(relayed=[False] * len(request.checks))


class _Outbox:
    def __init__(self) -> None:
        self.commands: list[s.TelemetryCommand] = []

    def __call__(self, command: s.TelemetryCommand) -> None:
        self.commands.append(command)


def _serve(servicer: rpb_grpc.ReplicaGroupServicer) -> tuple[grpc.Server, str]:
    server = grpc.server(futures.ThreadPoolExecutor(4))
    rpb_grpc.add_ReplicaGroupServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, f"127.0.0.1:{port}"


def test_a_member_that_does_not_answer_costs_one_timeout_and_is_asked_last_after() -> None:
    """Members listed: one whose port is closed (gone), one that never answers (frozen), one
    holding the producer. The first pass reaches the producer after one timeout, the next
    asks the frozen member last and returns at once; a check no member holds is reported not
    reached."""
    frozen = _Frozen()
    frozen_server, frozen_at = _serve(frozen)
    registry = ProducerRegistry()
    outbox = _Outbox()
    registry.connect("client-1", outbox, [TXN])
    live_server, live_at = _serve(CheckRelayServicer(registry))
    gone_at = f"127.0.0.1:{free_port()}"
    members = [gone_at, frozen_at, live_at]
    relay = CheckRelay(lambda: members, ChannelSecurity(), ProducerRegistry(), timeout_s=1.0)
    try:
        # The frozen member sorts first on the first pass, whatever the ports.
        relay._suspect.add(live_at)
        relay._suspect.add(gone_at)
        started = time.monotonic()
        assert relay.relay(
            [
                (TXN, half_message("k-1", "id-1"), "1-0"),
                ("elsewhere", half_message("k-2", "id-2"), "2-0"),
            ]
        ) == [
            True,
            False,
        ]
        first = time.monotonic() - started
        assert 1.0 <= first < 5.0, first
        assert frozen.calls == 1
        (command,) = outbox.commands
        assert command.recover_orphaned_transaction_command.transaction_id == "1-0"
        assert list(
            command.recover_orphaned_transaction_command.message.system_properties.keys
        ) == ["k-1"]
        started = time.monotonic()
        assert relay.relay([(TXN, half_message("k-3", "id-3"), "3-0")]) == [True]
        assert time.monotonic() - started < 0.9  # the live member answered first
        assert frozen.calls == 1
    finally:
        frozen.release.set()
        relay.close()
        frozen_server.stop(0)
        live_server.stop(0)
