"""Authentication and authorization (docs/security.md): a real ``tmq standalone --auth`` and
Apache's Python client, signing as applications do."""

from __future__ import annotations

import contextlib
import json
import random
import stat
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from broker_harness import Standalone, drain, free_port, metric_sample, tmq
from conftest import mounted_tmpfs
from node_harness import ensure_node_client
from node_harness import node as node_client
from rocketmq.grpc_protocol import definition_pb2 as d
from rocketmq.grpc_protocol import service_pb2 as s
from rocketmq.grpc_protocol import service_pb2_grpc

from broker import acl_pb2, acl_pb2_grpc
from broker import admin_pb2 as apb
from broker import admin_pb2_grpc as apb_grpc
from remoting import namesrv_pb2 as nspb
from remoting import namesrv_pb2_grpc as nspb_grpc
from remoting.auth import (
    AuthenticationError,
    Authenticator,
    StaticUsers,
    sign,
    signing_metadata,
)

ADMIN_KEY, ADMIN_SECRET = "tmq-admin", "admin-secret-0123456789"
ADMIN = {"TMQ_ADMIN_ACCESS_KEY": ADMIN_KEY, "TMQ_ADMIN_SECRET_KEY": ADMIN_SECRET}


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Standalone]:
    n = Standalone(
        tmp_path_factory.mktemp("auth") / "data",
        extra=["--auth"],
        env=ADMIN,
        metrics_port=free_port(),
    ).start()
    try:
        for topic in ("topic-a", "topic-b"):
            done = tmq("topic", "create", topic, "--queues", "2", "--namesrv", n.namesrv, env=ADMIN)
            assert done.returncode == 0, done.stderr
            wait_routed(n, topic)
        yield n
    finally:
        n.stop()


def wait_routed(node: Standalone, topic: str) -> None:
    stub = service_pb2_grpc.MessagingServiceStub(grpc.insecure_channel(node.endpoint))
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        reply = stub.QueryRoute(
            s.QueryRouteRequest(topic=d.Resource(name=topic)),
            metadata=signing_metadata(ADMIN_KEY, ADMIN_SECRET),
            timeout=5,
        )
        if reply.status.code == d.OK:
            return
        time.sleep(0.1)
    raise AssertionError(f"{topic} never routed")


def messaging(node: Standalone) -> Any:
    return service_pb2_grpc.MessagingServiceStub(grpc.insecure_channel(node.endpoint))


def new_user(node: Standalone, name: str, *grants: tuple[str, str]) -> str:
    """Create ``name`` with the CLI, grant it (resource, actions) pairs; returns its secret."""
    done = tmq("user", "create", name, "--namesrv", node.namesrv, "--json", env=ADMIN)
    assert done.returncode == 0, done.stderr
    secret: str = json.loads(done.stdout)["secret_key"]
    for resource, actions in grants:
        done = tmq(
            "acl", "grant", name, "--resource", resource, "--actions", actions,
            "--namesrv", node.namesrv, env=ADMIN,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
    return secret


def client_config(node: Standalone, access_key: str = "", secret_key: str = "") -> Any:
    from rocketmq import ClientConfiguration, Credentials

    credentials = Credentials(access_key, secret_key) if access_key else Credentials()
    return ClientConfiguration(node.endpoint, credentials, request_timeout=5)


def produce(config: Any, topic: str, body: bytes = b"x") -> str:
    """Send one message with Apache's Producer; returns its message id (raises if refused)."""
    from rocketmq import Message, Producer

    producer = Producer(config, topics=[topic])
    try:
        producer.startup()
        m = Message()
        m.topic, m.body = topic, body
        return str(producer.send(m).message_id)
    finally:
        producer.shutdown()


def receive(config: Any, group: str, topic: str, want: int = 1, seconds: float = 15) -> list[Any]:
    from rocketmq import FilterExpression, SimpleConsumer

    consumer = SimpleConsumer(config, group, {topic: FilterExpression("*")}, await_duration=2)
    try:
        consumer.startup()
        return drain(consumer, want, seconds=seconds, invisible=30, batch=16)
    finally:
        consumer.shutdown()


# -- the signature itself ------------------------------------------------------------------------


def test_the_signature_apache_python_client_sends_is_accepted_and_a_wrong_one_is_not() -> None:
    """Apache's Python client's own Signature.metadata, checked by the server's Authenticator:
    the formats match exactly; a flipped signature bit, an unknown key, a stale date, a
    missing header are each refused."""
    from rocketmq import ClientConfiguration, Credentials
    from rocketmq.v5.util.signature import Signature

    config = ClientConfiguration("127.0.0.1:1", Credentials("alice", "alice-secret"))
    sent = Signature.metadata(config, "client-1")
    users = StaticUsers({"alice": ("alice-secret", False)})
    # The client stamps local time labelled Z: on this UTC machine that is UTC.
    principal = Authenticator(users).authenticate(sent)
    assert (principal.name, principal.admin) == ("alice", False)

    headers = dict(sent)
    good = headers["authorization"]
    flipped = good[:-1] + ("0" if good[-1] != "0" else "1")
    for bad in (
        {**headers, "authorization": flipped},
        {**headers, "authorization": good.replace("alice", "mallory")},
        {k: v for k, v in headers.items() if k != "authorization"},
        {k: v for k, v in headers.items() if k != "x-mq-date-time"},
    ):
        with pytest.raises(AuthenticationError):
            Authenticator(users).authenticate(bad.items())
    stale = Authenticator(users, max_skew_s=900, clock=lambda: time.time() + 901)
    with pytest.raises(AuthenticationError, match="from the server's clock"):
        stale.authenticate(sent)
    assert sign("alice-secret", headers["x-mq-date-time"]) in good


def test_the_interceptor_wraps_each_served_handler_once() -> None:
    """A call reuses the wrapper built for its method's handler (building one per call was
    most of an allowed call's own cost); a handler served anew gets a wrapper of its own, and
    the reused wrapper still refuses an unsigned call."""
    from remoting.auth import AuthInterceptor, admin_only

    interceptor = AuthInterceptor(Authenticator(StaticUsers({})), admin_only, [s.DESCRIPTOR])
    served = grpc.unary_unary_rpc_method_handler(lambda request, context: s.SendMessageResponse())

    class Call:  # what gRPC hands an interceptor: the method's full name
        method = "/apache.rocketmq.v2.MessagingService/SendMessage"

    call: Any = Call()
    first = interceptor.intercept_service(lambda _: served, call)
    assert first is not served
    assert interceptor.intercept_service(lambda _: served, call) is first
    other = grpc.unary_unary_rpc_method_handler(lambda request, context: None)
    assert interceptor.intercept_service(lambda _: other, call) not in (first, other)

    class Context:
        def invocation_metadata(self) -> list[tuple[str, str]]:
            return []

        def peer(self) -> str:
            return "ipv4:127.0.0.1:1"

    assert first is not None
    answer = first.unary_unary(s.SendMessageRequest().SerializeToString(), Context())
    assert answer.status.code == 40100


def test_every_hostile_header_is_an_authentication_error_and_nothing_else() -> None:
    """20,000 random and near-valid headers through the parser in process: each is refused
    with AuthenticationError (which the interceptor turns into 40100), never another exception
    (which would reach the client as an internal error)."""
    rng = random.Random(1722)
    users = StaticUsers({"k": ("secret", True)})
    auth = Authenticator(users)
    good = dict(signing_metadata("k", "secret"))
    pieces = ["MQv2-HMAC-SHA1", "Credential=", "Signature=", ",", "=", " ", "/", "k", "²", "0f"]
    for i in range(20_000):
        header = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 12)))
        date = good["x-mq-date-time"] if i % 2 else header[:16]
        if i % 3 == 0:
            header = "".join(chr(rng.randint(0, 0x2FF)) for _ in range(rng.randint(0, 64)))
        with pytest.raises(AuthenticationError):
            auth.authenticate([("authorization", header), ("x-mq-date-time", date)])


# -- refusals ------------------------------------------------------------------------------------


def test_without_credentials_every_rpc_is_refused(
    node: Standalone, caplog: pytest.LogCaptureFixture
) -> None:
    stub = messaging(node)
    route = stub.QueryRoute(s.QueryRouteRequest(topic=d.Resource(name="topic-a")), timeout=5)
    assert route.status.code == d.UNAUTHORIZED and not route.message_queues
    send = stub.SendMessage(s.SendMessageRequest(), timeout=5)
    assert send.status.code == d.UNAUTHORIZED
    received = list(
        stub.ReceiveMessage(
            s.ReceiveMessageRequest(
                group=d.Resource(name="g"),
                message_queue=d.MessageQueue(topic=d.Resource(name="topic-a")),
            ),
            timeout=5,
        )
    )
    assert [r.status.code for r in received] == [d.UNAUTHORIZED]
    channel = grpc.insecure_channel(node.endpoint)
    for call, request in (
        (apb_grpc.AdminStub(channel).ListTopics, apb.ListTopicsRequest()),
        (apb_grpc.AdminStub(channel).Status, apb.StatusRequest()),
        (acl_pb2_grpc.AclStub(channel).ListUsers, acl_pb2.ListUsersRequest()),
        (
            nspb_grpc.NameServerStub(grpc.insecure_channel(node.namesrv)).GetClusterInfo,
            nspb.GetClusterInfoRequest(),
        ),
    ):
        with pytest.raises(grpc.RpcError) as refused:
            call(request, timeout=5)
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    # Apache's client without credentials: its route lookup is refused with the proxy's code,
    # so the send fails.
    with pytest.raises(Exception, match="route"):
        produce(client_config(node), "topic-a")
    assert "40100" in caplog.text
    # The CLI without the admin's keys, in one line.
    done = tmq("topic", "list", "--namesrv", node.namesrv)
    assert done.returncode == 1 and "UNAUTHENTICATED" in done.stderr
    assert (
        metric_sample(
            node,
            'tmq_auth_denied_total{kind="unauthenticated"}',
        )
        or 0
    ) >= 1


def test_a_wrong_signature_or_a_stale_date_is_refused(node: Standalone) -> None:
    stub = messaging(node)
    request = s.QueryRouteRequest(topic=d.Resource(name="topic-a"))
    for metadata in (
        signing_metadata(ADMIN_KEY, "not-the-secret"),
        signing_metadata("nobody", ADMIN_SECRET),
        signing_metadata(ADMIN_KEY, ADMIN_SECRET, now=time.time() - 3600),
        signing_metadata(ADMIN_KEY, ADMIN_SECRET, now=time.time() + 3600),
    ):
        reply = stub.QueryRoute(request, metadata=metadata, timeout=5)
        assert reply.status.code == d.UNAUTHORIZED, metadata
    ok = stub.QueryRoute(request, metadata=signing_metadata(ADMIN_KEY, ADMIN_SECRET), timeout=5)
    assert ok.status.code == d.OK and ok.message_queues


def test_a_sub_only_user_cannot_produce_consume_another_topic_or_administer(
    node: Standalone,
) -> None:
    secret = new_user(node, "reader", ("topic:topic-a", "SUB"), ("group:readers", "SUB"))
    reader = client_config(node, "reader", secret)
    admin = client_config(node, ADMIN_KEY, ADMIN_SECRET)
    sent = produce(admin, "topic-a", b"for the reader")

    with pytest.raises(Exception, match="40300"):
        produce(reader, "topic-a")
    got = receive(reader, "readers", "topic-a")
    assert [m.message_id for m in got] == [sent]
    # Its route to topic-b is refused (no PUB or SUB there), so the consumer cannot start.
    with pytest.raises(Exception, match=r"40300|topic-b route"):
        receive(reader, "readers", "topic-b", seconds=3)
    refused = messaging(node).ReceiveMessage(
        s.ReceiveMessageRequest(
            group=d.Resource(name="readers"),
            message_queue=d.MessageQueue(topic=d.Resource(name="topic-b")),
        ),
        metadata=signing_metadata("reader", secret),
        timeout=5,
    )
    assert [r.status.code for r in refused] == [d.FORBIDDEN]
    channel = grpc.insecure_channel(node.endpoint)
    signed = signing_metadata("reader", secret)
    for call, request in (
        (apb_grpc.AdminStub(channel).ListTopics, apb.ListTopicsRequest()),
        (
            apb_grpc.AdminStub(channel).PutTopic,
            apb.PutTopicRequest(topic=apb.Topic(name="evil", queues=1)),
        ),
        (acl_pb2_grpc.AclStub(channel).ListUsers, acl_pb2.ListUsersRequest()),
        (
            acl_pb2_grpc.AclStub(channel).CreateUser,
            acl_pb2.CreateUserRequest(name="reader2", admin=True),
        ),
    ):
        with pytest.raises(grpc.RpcError) as refused:
            call(request, metadata=signed, timeout=5)
        assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
    # The admin may do all of it.
    topics = apb_grpc.AdminStub(channel).ListTopics(
        apb.ListTopicsRequest(), metadata=signing_metadata(ADMIN_KEY, ADMIN_SECRET), timeout=5
    )
    assert {"topic-a", "topic-b"} <= {t.topic.name for t in topics.topics}
    assert "evil" not in {t.topic.name for t in topics.topics}
    produce(admin, "topic-b")
    assert (
        metric_sample(
            node,
            'tmq_auth_denied_total{kind="forbidden"}',
        )
        or 0
    ) >= 1


def test_a_revoked_grant_stops_working_without_a_restart(node: Standalone) -> None:
    from rocketmq import Message, Producer

    secret = new_user(node, "revokee", ("topic:topic-a", "PUB"), ("topic:topic-b", "ALL"))
    producer = Producer(client_config(node, "revokee", secret), topics=["topic-a", "topic-b"])
    producer.startup()

    def send(topic: str) -> None:
        m = Message()
        m.topic, m.body = topic, b"x"
        producer.send(m)

    try:
        send("topic-a")  # the same producer, its routes cached, before and after
        done = tmq(
            "acl", "revoke", "revokee", "--resource", "topic:topic-a",
            "--namesrv", node.namesrv, env=ADMIN,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        with pytest.raises(Exception, match="40300"):
            send("topic-a")
        send("topic-b")  # its other grant still holds
        # A DENY beats an ALLOW on an equally specific resource.
        done = tmq(
            "acl", "grant", "revokee", "--resource", "topic:topic-b", "--actions", "PUB",
            "--deny", "--namesrv", node.namesrv, env=ADMIN,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        with pytest.raises(Exception, match="40300"):
            send("topic-b")
    finally:
        producer.shutdown()
    # Deleting the user: its signature no longer identifies anyone.
    assert tmq("user", "delete", "revokee", "--namesrv", node.namesrv, env=ADMIN).returncode == 0
    reply = messaging(node).QueryRoute(
        s.QueryRouteRequest(topic=d.Resource(name="topic-b")),
        metadata=signing_metadata("revokee", secret),
        timeout=5,
    )
    assert reply.status.code == d.UNAUTHORIZED


def test_hostile_authorization_headers_leave_the_server_up_and_answering(
    node: Standalone,
) -> None:
    rng = random.Random(17)
    stamp = signing_metadata(ADMIN_KEY, ADMIN_SECRET)[0][1]
    alphabet = "".join(map(chr, range(0x20, 0x7F)))  # every byte a header value may hold

    def hostile(i: int) -> list[tuple[str, str]]:
        kind = i % 6
        junk = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 300))).strip()
        header = {
            0: junk,
            1: f"MQv2-HMAC-SHA1 {junk}",
            2: f"MQv2-HMAC-SHA1 Credential={junk}, SignedHeaders=x-mq-date-time, Signature=zz",
            3: f"MQv2-HMAC-SHA1 Credential={ADMIN_KEY}, Signature={junk.encode().hex()}",
            4: "MQv2-HMAC-SHA1 " + ",".join(["Credential=a=b"] * rng.randint(1, 400)),
            5: f"MQv2-HMAC-SHA1 Credential={ADMIN_KEY}, Signature=" + "a" * rng.randint(0, 5000),
        }[kind]
        date = stamp if i % 2 else junk[:40]
        return [("authorization", header or "x"), ("x-mq-date-time", date or "x")]

    stub = messaging(node)
    request = s.QueryRouteRequest(topic=d.Resource(name="topic-a"))
    for start in range(0, 5000, 250):
        calls = [
            stub.QueryRoute.future(request, metadata=hostile(i), timeout=30)
            for i in range(start, start + 250)
        ]
        for c in calls:
            assert c.result().status.code == d.UNAUTHORIZED
    ok = stub.QueryRoute(request, metadata=signing_metadata(ADMIN_KEY, ADMIN_SECRET), timeout=5)
    assert ok.status.code == d.OK
    assert node.proc is not None and node.proc.poll() is None


def test_users_persist_encrypted_and_secrets_stay_out_of_logs_and_json(node: Standalone) -> None:
    secret = new_user(node, "persisted", ("topic:topic-a", "PUB"))
    acl = node.data_dir / "config" / "acl.json"
    key = node.data_dir / "auth.key"
    assert secret not in acl.read_text() and ADMIN_SECRET not in acl.read_text()
    assert stat.S_IMODE(key.stat().st_mode) == 0o600
    listing = tmq("user", "list", "--namesrv", node.namesrv, "--json", env=ADMIN)
    grants = tmq("acl", "list", "--namesrv", node.namesrv, "--json", env=ADMIN)
    for text in (listing.stdout, listing.stderr, grants.stdout, node.log_path.read_text()):
        assert secret not in text and ADMIN_SECRET not in text
    assert '"user": "persisted"' in listing.stdout
    # A failing command names no secret either.
    done = tmq("user", "create", "persisted", "--namesrv", node.namesrv, env=ADMIN)
    assert done.returncode == 1 and "exists" in done.stderr and ADMIN_SECRET not in done.stderr


def test_users_and_grants_survive_a_restart(tmp_path: Path) -> None:
    node = Standalone(tmp_path / "data", extra=["--auth"], env=ADMIN).start()
    try:
        assert tmq("topic", "create", "kept", "--namesrv", node.namesrv, env=ADMIN).returncode == 0
        secret = new_user(node, "keeper", ("topic:kept", "PUB"))
    finally:
        assert node.stop() == 0
    node.start()
    try:
        wait_routed(node, "kept")
        produce(client_config(node, "keeper", secret), "kept")
        with pytest.raises(Exception, match="route"):
            produce(client_config(node, "keeper", "old-or-wrong-secret"), "kept")
    finally:
        node.stop()


def test_auth_on_without_any_admin_refuses_to_start(tmp_path: Path) -> None:
    env = {"TMQ_ADMIN_ACCESS_KEY": "", "TMQ_ADMIN_SECRET_KEY": ""}
    done = tmq(
        "standalone", "--auth", "--data-dir", str(tmp_path / "d"), "--grpc-port", str(free_port()),
        "--namesrv-port", str(free_port()), "--metrics-port", "0",
        env=env,
    )  # fmt: skip
    assert done.returncode == 2
    assert "TMQ_ADMIN_ACCESS_KEY" in done.stderr


# -- the store of users and grants ------------------------------------------------------------


def test_a_full_disk_at_the_first_user_leaves_no_empty_key_file(tmp_path: Path) -> None:
    """The first user's save makes the secrets' key file. On a full disk (a real tmpfs) the
    key file used to be created, then its write failed: the empty file stayed, and every later
    save and every start failed ("is not a 32-byte key") after the disk had room again, until
    someone deleted the file; and the refused user was served from memory all the same (until
    a restart forgot it), so a retry was told it existed. Now nothing is left, on disk or in
    memory, and the save made once there is room is read back by the next start."""
    import os

    from broker.acl import AclStore

    with mounted_tmpfs(tmp_path / "small", "64k") as mnt:
        (mnt / "data" / "config").mkdir(parents=True)
        filler = os.open(mnt / "filler", os.O_WRONLY | os.O_CREAT, 0o644)
        with contextlib.suppress(OSError):  # ENOSPC: full
            while True:
                os.write(filler, b"\0" * 4096)
        os.close(filler)
        acl = AclStore(mnt / "data" / "config")
        with pytest.raises(OSError, match="No space left"):
            acl.create_user("alice")
        assert acl.lookup("alice") is None, "refused, so not served either"
        assert not (mnt / "data" / "auth.key").exists()
        assert sorted(p.name for p in (mnt / "data").iterdir()) == ["config"]
        os.unlink(mnt / "filler")
        secret = acl.create_user("alice")  # raised "is not a 32-byte key" on main
        again = AclStore(mnt / "data" / "config")
        again.load()
        assert again.lookup("alice") == (secret, False)


def test_the_most_specific_grant_decides_and_deny_wins_a_tie(tmp_path: Path) -> None:
    from broker.acl import PUB, SUB, AclStore, Grant

    acl = AclStore(tmp_path / "config")
    acl.create_user("u", secret="s" * 16)
    for resource, actions, deny in (
        ("topic:*", "ALL", False),
        ("topic:orders-*", "PUB", True),
        ("topic:orders-eu", "PUB", False),
        ("group:g", "SUB", False),
        ("group:g", "SUB", True),  # replaces the ALLOW on the same resource
    ):
        acl.grant(Grant.of("u", resource, [actions], deny))
    assert acl.allows("u", "topic", "anything", (PUB,))
    assert not acl.allows("u", "topic", "orders-us", (PUB,))  # the prefix DENY beats topic:*
    assert acl.allows("u", "topic", "orders-us", (SUB,))  # the DENY is for PUB only
    assert acl.allows("u", "topic", "orders-eu", (PUB,))  # the literal beats the prefix
    assert not acl.allows("u", "group", "g", (SUB,))
    assert not acl.allows("u", "group", "other", (SUB,))  # nothing matches: refused
    assert not acl.allows("nobody", "topic", "anything", (PUB, SUB))
    assert acl.revoke("u", "topic:*") == 1
    assert not acl.allows("u", "topic", "anything", (PUB,))
    # Reloaded from disk: the same decisions, the secret decrypted.
    again = AclStore(tmp_path / "config")
    again.load()
    assert again.lookup("u") == ("s" * 16, False)
    assert again.allows("u", "topic", "orders-eu", (PUB,))
    assert not again.allows("u", "topic", "orders-us", (PUB,))


def test_users_replicate_with_the_metadata_under_each_replicas_own_key(tmp_path: Path) -> None:
    from broker.metadata import BrokerMetadata

    master = BrokerMetadata(tmp_path / "master" / "config")
    master.load()
    master.acl.create_user("app", secret="app-secret-123456")
    slave = BrokerMetadata(tmp_path / "slave" / "config")
    slave.load()
    slave.replace(json.loads(json.dumps(master.snapshot())))  # as the HA link carries it
    assert slave.acl.lookup("app") == ("app-secret-123456", False)
    master_key = (tmp_path / "master" / "auth.key").read_bytes()
    assert (tmp_path / "slave" / "auth.key").read_bytes() != master_key
    reloaded = BrokerMetadata(tmp_path / "slave" / "config")
    reloaded.load()
    assert reloaded.acl.lookup("app") == ("app-secret-123456", False)
    assert "app-secret-123456" not in (tmp_path / "slave" / "config" / "acl.json").read_text()


def test_a_user_created_on_the_master_reaches_the_slave_over_replication(tmp_path: Path) -> None:
    """Real master and slave processes (tests/test_ha.py's harness): users and grants travel
    with the metadata snapshot, and the slave stores the secret encrypted under its own key."""
    from test_ha import GroupMember

    master = GroupMember(tmp_path, "master", free_port())
    slave = GroupMember(tmp_path, "slave", free_port())
    try:
        master.start("master", 0, mode="async")
        slave.start("slave", 1, master=master, mode="async")
        acl = acl_pb2_grpc.AclStub(grpc.insecure_channel(master.endpoint))
        acl.CreateUser(
            acl_pb2.CreateUserRequest(name="replicated", secret_key="replicated-secret-1"),
            timeout=10,
        )
        acl.Grant(
            acl_pb2.GrantRequest(
                grant=acl_pb2.Grant(user="replicated", resource="topic:t", actions=["PUB"])
            ),
            timeout=10,
        )
        on_slave = acl_pb2_grpc.AclStub(grpc.insecure_channel(slave.endpoint))
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            grants = on_slave.ListGrants(acl_pb2.ListGrantsRequest(user="replicated"), timeout=5)
            if grants.grants:
                break
            time.sleep(0.3)
        assert [(g.resource, list(g.actions)) for g in grants.grants] == [("topic:t", ["PUB"])]
        stored = (slave.data_dir / "config" / "acl.json").read_text()
        assert '"replicated"' in stored and "replicated-secret-1" not in stored
        assert (slave.data_dir / "auth.key").read_bytes() != (
            master.data_dir / "auth.key"
        ).read_bytes()
    finally:
        slave.stop()
        master.stop()


def test_the_node_client_signs_and_is_held_to_its_grants(node: Standalone) -> None:
    """Apache's Node.js client with ``sessionCredentials`` (upper-case hex, UTC date-time): a
    PUB-only user produces to its topic and is refused on another and when consuming."""
    ensure_node_client()
    secret = new_user(node, "node-app", ("topic:topic-a", "PUB"))
    creds = {"accessKey": "node-app", "secretKey": secret}
    sent = node_client(
        {
            "cmd": "produce",
            "endpoint": node.endpoint,
            "topic": "topic-a",
            "messages": [{"body": "from node"}],
            **creds,
        }
    )
    assert "messageId" in sent[0], sent
    refused = node_client(
        {
            "cmd": "produce",
            "endpoint": node.endpoint,
            "topic": "topic-b",
            "messages": [{"body": "not allowed"}],
            **creds,
        }
    )
    assert refused[0].get("code") == 40300 and "messageId" not in refused[0], refused
    with pytest.raises(AssertionError, match=r"ForbiddenException.*no SUB on group node-readers"):
        node_client(
            {
                "cmd": "simple",
                "endpoint": node.endpoint,
                "topic": "topic-a",
                "group": "node-readers",
                "want": 1,
                "seconds": 5,
                **creds,
            }
        )
