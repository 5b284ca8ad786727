"""The replication link under [tls] and [auth] (broker/ha/link.py, decision 220): a replica
group whose members run TLS and authentication replicates and fails over; a plaintext peer, an
unauthenticated one and one with a wrong secret are refused by the master; a slave refuses a
master that cannot prove who it is. Real broker processes; the hostile peers are raw sockets."""

from __future__ import annotations

import os
import socket
import ssl
import threading
from pathlib import Path

from rocketmq.grpc_protocol import definition_pb2 as d

from broker.ha import wire
from remoting.security import ChannelSecurity
from tests.broker_harness import free_port
from tests.test_ha import GroupMember, assert_same_replica, send, wait_until
from tests.tls_harness import make_ca

pytest_plugins = ["tests.test_ha"]  # the group fixture

ADMIN_KEY, ADMIN_SECRET = "ha-admin", "ha-admin-secret-0123456789abcdef"
ADMIN = {"TMQ_ADMIN_ACCESS_KEY": ADMIN_KEY, "TMQ_ADMIN_SECRET_KEY": ADMIN_SECRET}


def secure(member: GroupMember, ca: Path, cert: Path, key: Path) -> GroupMember:
    member.extra_toml = (
        f'\n[auth]\nenabled = true\n\n[tls]\ncert_file = "{cert}"\nkey_file = "{key}"\n'
        f'ca_file = "{ca}"\n'
    )
    member.security = ChannelSecurity(ADMIN_KEY, ADMIN_SECRET, ca_file=str(ca))
    return member


def hello() -> bytes:
    return wire.encode_hello(wire.Hello(7, 1 << 20, 0, 0, []))


def answer(sock: socket.socket | ssl.SSLSocket) -> str:
    """What the master says to a peer that just sent its first frames: the ERROR's reason, or
    how the connection ended."""
    sock.settimeout(10)
    try:
        kind, _ = wire.read_frame(sock)
    except wire.ProtocolError as e:
        return str(e)
    except (ConnectionError, ssl.SSLError) as e:
        return f"closed: {e}"
    return f"{kind.name} frame"


def test_a_tls_and_auth_group_replicates_refuses_strangers_and_fails_over(
    group, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    ca, cert, key = make_ca(tmp_path)
    a = secure(group("a"), ca, cert, key)
    b = secure(group("b"), ca, cert, key)
    a.start("master", 0, mode="sync", min_in_sync_replicas=2, env=ADMIN)
    b.start("slave", 1, master=a, env=ADMIN)
    a.create_topic()
    wait_until("b is in sync", lambda: a.metric("tmq_replication_sync_state_set_size") == 2)
    statuses = send(a.endpoint, 0, 200, channel=a.channel())
    assert {st.code for st in statuses} == {d.OK}

    # Strangers at a's replication port: each is refused before it learns anything.
    with socket.create_connection(("127.0.0.1", a.ha_port)) as plain:
        plain.sendall(hello())
        assert answer(plain).startswith("closed")  # no WELCOME: the port speaks TLS only
    trusting = ssl.create_default_context(cafile=str(ca))
    with (
        socket.create_connection(("127.0.0.1", a.ha_port)) as raw,
        trusting.wrap_socket(raw, server_hostname="127.0.0.1") as anonymous,
    ):
        anonymous.sendall(hello())
        assert "without authenticating" in answer(anonymous)
    with (
        socket.create_connection(("127.0.0.1", a.ha_port)) as raw,
        trusting.wrap_socket(raw, server_hostname="127.0.0.1") as impostor,
    ):
        impostor.sendall(wire.encode_auth(wire.Auth(ADMIN_KEY, os.urandom(32))))
        kind, body = wire.read_frame(impostor)
        challenge = wire.decode_auth(body)
        # The master proves itself first, but reveals nothing a stranger could reuse...
        assert kind is wire.FrameType.AUTH and len(challenge.proof) == 32
        # ...and a proof made without the admin's secret is refused.
        impostor.sendall(wire.encode_auth(wire.Auth(proof=os.urandom(32))))
        assert "authentication failed" in answer(impostor)
    log = a.log_path.read_text()
    assert log.count("refused the connection from 127.0.0.1") >= 3
    assert "TLS handshake failed" in log
    assert f"authentication failed for access key '{ADMIN_KEY}'" in log
    assert ADMIN_SECRET not in log
    assert a.metric("tmq_replication_sync_state_set_size") == 2  # b never noticed

    # Failover: a dies, b takes over as master, a rejoins as its slave over the same link.
    a.kill9()
    b.stop()
    b.start("master", 0, mode="sync", min_in_sync_replicas=2, env=ADMIN)
    a.start("slave", 1, master=b, env=ADMIN)
    wait_until("a is in sync", lambda: b.metric("tmq_replication_sync_state_set_size") == 2)
    statuses = send(b.endpoint, 200, 100, channel=b.channel())
    assert {st.code for st in statuses} == {d.OK}
    a.stop()
    b.stop()
    assert assert_same_replica(b.data_dir, a.data_dir) == 300


def test_a_slave_refuses_a_master_that_cannot_prove_it_is_one(group) -> None:  # type: ignore[no-untyped-def]
    """Authentication without TLS: whoever listens at the master's address must still prove it
    holds an admin's secret before the slave says a word about its log."""
    port = free_port()
    listener = socket.create_server(("127.0.0.1", port))
    heard: list[str] = []

    def pose_as_master() -> None:
        conn, _ = listener.accept()
        with conn:
            conn.settimeout(30)
            kind, _ = wire.read_frame(conn)
            heard.append(kind.name)
            conn.sendall(wire.encode_auth(wire.Auth(ADMIN_KEY, os.urandom(32), os.urandom(32))))
            heard.append(answer(conn))

    thread = threading.Thread(target=pose_as_master, daemon=True)
    thread.start()
    slave = group("slave")
    slave.extra_toml = "\n[auth]\nenabled = true\n"
    slave.security = ChannelSecurity(ADMIN_KEY, ADMIN_SECRET)
    fake = GroupMember(slave.root, "fake", port)
    slave.start("slave", 1, master=fake, env=ADMIN)
    thread.join(30)
    listener.close()
    # It authenticated first (AUTH, not HELLO), then refused the bogus proof.
    assert heard == ["AUTH", "peer: refused: the master failed authentication"]
    wait_until(
        "the slave logged why",
        lambda: "the master failed authentication as 'ha-admin'" in slave.log_path.read_text(),
        timeout=10,
    )
    assert slave.metric("tmq_replication_connected") == 0
    assert ADMIN_SECRET not in slave.log_path.read_text()
