"""TLS on every port (docs/security.md), with auth on as well: a throwaway CA made here, a real
``tmq standalone``, Apache's Python and Node.js clients with their TLS switches and credentials."""

from __future__ import annotations

import json
import os
import ssl
import subprocess
import sys
import textwrap
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from broker_harness import REPO, Standalone, free_port, tmq
from grpc_health.v1 import health_pb2, health_pb2_grpc
from node_harness import ensure_node_client, node
from tls_harness import make_ca

ADMIN_KEY, ADMIN_SECRET = "tls-admin", "tls-admin-secret-0123456789"
ADMIN = {"TMQ_ADMIN_ACCESS_KEY": ADMIN_KEY, "TMQ_ADMIN_SECRET_KEY": ADMIN_SECRET}


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Standalone]:
    root = tmp_path_factory.mktemp("tls")
    ca, cert, key = make_ca(root)
    config = root / "tmq.toml"
    config.write_text(
        f'[auth]\nenabled = true\n\n[tls]\ncert_file = "{cert}"\nkey_file = "{key}"\n'
        f'ca_file = "{ca}"\n'
    )
    n = Standalone(
        root / "data",
        extra=["--config", str(config)],
        env=ADMIN,
        metrics_port=free_port(),
        ca_file=ca,
    ).start()
    try:
        env = {**ADMIN, "TMQ_TLS_CA_FILE": str(ca)}
        done = tmq("topic", "create", "secure", "--queues", "2", "--namesrv", n.namesrv, env=env)
        assert done.returncode == 0, done.stderr
        yield n
    finally:
        n.stop()


def test_a_plaintext_client_is_refused_by_every_tls_port(secured: Standalone) -> None:
    for target in (secured.endpoint, secured.namesrv):
        plain = health_pb2_grpc.HealthStub(grpc.insecure_channel(target))
        with pytest.raises(grpc.RpcError) as refused:
            plain.Check(health_pb2.HealthCheckRequest(), timeout=3)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        tls = health_pb2_grpc.HealthStub(secured.channel(target))
        assert tls.Check(health_pb2.HealthCheckRequest(), timeout=5).status == 1
    # The CLI without the CA cannot reach the NameServer; with it, it can.
    assert tmq("topic", "list", "--namesrv", secured.namesrv, env=ADMIN).returncode == 1
    env = {**ADMIN, "TMQ_TLS_CA_FILE": str(secured.ca_file)}
    listed = tmq("topic", "list", "--namesrv", secured.namesrv, "--json", env=env)
    assert listed.returncode == 0 and "secure" in listed.stdout


def test_metrics_are_served_over_https_only(secured: Standalone) -> None:
    assert secured.ca_file is not None
    context = ssl.create_default_context(cafile=str(secured.ca_file))
    url = f"https://127.0.0.1:{secured.metrics_port}/metrics"
    with urllib.request.urlopen(url, context=context, timeout=10) as r:
        assert b"tmq_" in r.read()
    with pytest.raises((urllib.error.URLError, ConnectionError)):
        urllib.request.urlopen(f"http://127.0.0.1:{secured.metrics_port}/metrics", timeout=5)


def test_the_python_client_produces_and_consumes_over_tls_with_credentials(
    secured: Standalone,
) -> None:
    """Apache's Python client with ``tls_enable=True``: it trusts gRPC's default roots, which
    GRPC_DEFAULT_SSL_ROOTS_FILE_PATH points at the test CA (its own process: gRPC reads the
    roots once)."""
    script = textwrap.dedent(
        f"""
        import json
        from rocketmq import (ClientConfiguration, Credentials, FilterExpression, Message,
                              Producer, SimpleConsumer)
        cfg = ClientConfiguration({secured.endpoint!r}, Credentials({ADMIN_KEY!r},
                                  {ADMIN_SECRET!r}), request_timeout=10)
        p = Producer(cfg, topics=["secure"], tls_enable=True)
        p.startup()
        m = Message(); m.topic = "secure"; m.body = b"over tls"
        sent = p.send(m).message_id
        p.shutdown()
        c = SimpleConsumer(cfg, "tls-group", {{"secure": FilterExpression("*")}},
                           await_duration=2, tls_enable=True)
        c.startup()
        got = []
        for _ in range(10):
            for r in c.receive(16, 30):
                c.ack(r)
                got.append([r.message_id, r.body.decode()])
            if got:
                break
        c.shutdown()
        print(json.dumps({{"sent": sent, "got": got}}))
        """
    )
    assert secured.ca_file is not None
    done = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
        env={**os.environ, "GRPC_DEFAULT_SSL_ROOTS_FILE_PATH": str(secured.ca_file)},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["got"] == [[result["sent"], "over tls"]]


def test_the_node_client_produces_and_consumes_over_tls_with_credentials(
    secured: Standalone,
) -> None:
    """Apache's Node.js client with ``sslEnabled`` and ``sessionCredentials`` (it signs with
    an upper-case hex signature and a UTC date-time)."""
    ensure_node_client()
    assert secured.ca_file is not None
    env = {"GRPC_DEFAULT_SSL_ROOTS_FILE_PATH": str(secured.ca_file)}
    creds = {"ssl": True, "accessKey": ADMIN_KEY, "secretKey": ADMIN_SECRET}
    sent = node(
        {
            "cmd": "produce",
            "endpoint": secured.endpoint,
            "topic": "secure",
            "messages": [{"body": "from node", "keys": ["n1"]}],
            **creds,
        },
        env=env,
    )
    assert "messageId" in sent[0], sent
    got = node(
        {
            "cmd": "simple",
            "endpoint": secured.endpoint,
            "topic": "secure",
            "group": "node-tls",
            "want": 1,
            "seconds": 30,
            **creds,
        },
        env=env,
    )
    assert "from node" in [m["body"] for m in got]  # a new group starts at the beginning
    # The same client with a wrong secret is refused.
    refused = node(
        {
            "cmd": "produce",
            "endpoint": secured.endpoint,
            "topic": "secure",
            "messages": [{"body": "x"}],
            **creds,
            "secretKey": "wrong-secret",
        },
        env=env,
    )
    assert "error" in refused[0] and "messageId" not in refused[0], refused


def test_mtls_a_nameserver_admits_only_clients_with_a_certificate_from_its_ca(
    tmp_path: Path,
) -> None:
    """``client_ca_file``: the broker's own certificate doubles as its client certificate
    (ChannelSecurity.for_server); a client that trusts the CA but has no certificate is
    refused at the handshake."""
    from namesrv import server as namesrv_server
    from remoting.namesrv_client import NameServerClient
    from remoting.security import ChannelSecurity, TlsConfig

    ca, cert, key = make_ca(tmp_path)
    tls = TlsConfig(str(cert), str(key), str(ca), client_ca_file=str(ca))
    server, port = namesrv_server.start("127.0.0.1", 0, tls=tls)
    try:
        broker_side = NameServerClient([f"127.0.0.1:{port}"], ChannelSecurity.for_server(tls, {}))
        assert broker_side.cluster_info().brokers is not None
        broker_side.close()
        anonymous = NameServerClient([f"127.0.0.1:{port}"], ChannelSecurity(ca_file=str(ca)))
        with pytest.raises(grpc.RpcError) as refused:
            anonymous.cluster_info()
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        anonymous.close()
    finally:
        server.stop(None)


def test_the_cli_produces_and_consumes_over_tls_signed_with_the_admin_key(
    secured: Standalone,
) -> None:
    env = {**ADMIN, "TMQ_TLS_CA_FILE": str(secured.ca_file)}
    sent = tmq(
        "produce", "secure", "--body", "from the cli", "--json", "--namesrv", secured.namesrv,
        env=env,
    )  # fmt: skip
    assert sent.returncode == 0, sent.stderr
    message_id = json.loads(sent.stdout)["message_id"]
    got = tmq(
        "consume", "secure", "--group", "cli-tls", "--wait", "5", "--json",
        "--namesrv", secured.namesrv, env=env,
    )  # fmt: skip
    assert got.returncode == 0, got.stderr
    assert message_id in [json.loads(line)["message_id"] for line in got.stdout.splitlines()]
    assert ADMIN_SECRET not in got.stdout + got.stderr + sent.stdout + sent.stderr
