"""The etcd lease keeper (broker/ha/lease_keeper.py, decision 910) against a real 3-node etcd:
it renews only while its broker pulses, and revokes the lease the moment its broker dies; and,
slow, a group under load keeps its master."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from broker.ha.etcd import EtcdClient
from broker.ha.lease_keeper import _BROKER, _BROKER_AT, LeaseKeeper, _read
from tests.broker_harness import REPO
from tests.etcd_harness import EtcdCluster

KEY = b"/tmq/test/leased"


def wait_gone(client: EtcdClient, key: bytes, timeout: float) -> float:
    """Seconds until ``key`` is gone; fails past ``timeout``."""
    start = time.monotonic()
    while client.get(key) is not None:
        assert time.monotonic() - start < timeout, f"{key!r} still there after {timeout} s"
        time.sleep(0.05)
    return time.monotonic() - start


def test_the_controller_and_the_watchdog_writing_at_once_leave_the_broker_half_readable() -> None:
    """The controller's tick (``set_lease``) and the watchdog (``pulse``) write the broker's half
    from two threads. Without one writer at a time, two interleaved writes could leave the
    sequence count odd for good, so that the keeper's read of the half waited forever (no
    renewal again: a member never elected, seen in a CI run), or a pulse could write back the
    lease it read before the tick changed it. Three rounds in which both write flat out with
    the interpreter switching threads as often as it can; after each the half must read at
    once, with the last lease set."""
    keeper = LeaseKeeper(["http://127.0.0.1:9"], 2, interval_s=0.25, pulse_limit_s=1.0)
    leases = iter(range(1, 1 << 62))
    last = [0]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        for _ in range(3):
            stop = time.monotonic() + 1.0

            def set_leases(stop: float = stop) -> None:
                while time.monotonic() < stop:
                    last[0] = next(leases)
                    keeper.set_lease(last[0])

            def pulses(stop: float = stop) -> None:
                while time.monotonic() < stop:
                    keeper.pulse()

            threads = [threading.Thread(target=set_leases), threading.Thread(target=pulses)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            (seq,) = struct.unpack_from("<Q", keeper._buf, _BROKER_AT)
            assert seq % 2 == 0, f"sequence count {seq} left odd: the keeper would wait forever"
            result: list[tuple[float, ...]] = []
            reader = threading.Thread(
                target=lambda out=result: out.append(_read(keeper._buf, _BROKER_AT, _BROKER)),
                daemon=True,
            )
            reader.start()
            reader.join(2.0)
            assert result, "the keeper's read of the broker's half did not return"
            assert int(result[0][0]) == last[0], "a pulse wrote back a lease the tick had replaced"
    finally:
        sys.setswitchinterval(interval)


def test_the_keeper_renews_while_its_broker_pulses_and_stops_when_it_does_not(
    tmp_path: Path,
) -> None:
    """A 2 s lease outlives its TTL threefold while the broker side pulses; once the pulses stop
    (a frozen or starved broker) the keeper stops renewing, and the key goes within the pulse
    limit plus the TTL (and etcd's expiry pass)."""
    etcd = EtcdCluster(tmp_path).start()
    client = EtcdClient(etcd.endpoints)
    keeper = LeaseKeeper(etcd.endpoints, 2, interval_s=0.5, pulse_limit_s=1.0)
    try:
        lease = client.grant(2)
        client.put(KEY, b"x", lease)
        keeper.ensure_running()
        keeper.set_lease(lease)
        until = time.monotonic() + 6
        while time.monotonic() < until:
            keeper.pulse()
            time.sleep(0.05)
        assert client.get(KEY) is not None
        state = keeper.renewed()
        assert state.lease == lease and state.renewals >= 6
        assert time.monotonic() - state.sent_at < 1.5
        stopped = time.monotonic()
        wait_gone(client, KEY, timeout=10)
        assert keeper.renewed().skipped > 0  # it skipped renewals: the pulse was stale
        assert keeper.proc is not None and keeper.proc.poll() is None
        # The last renewal it sent was within the pulse limit of the last pulse.
        assert keeper.renewed().sent_at - stopped < 1.0 + 0.5
    finally:
        keeper.stop()
        etcd.stop()


PARENT = textwrap.dedent(
    """
    import sys, time
    from broker.ha.etcd import EtcdClient
    from broker.ha.lease_keeper import LeaseKeeper
    endpoints = sys.argv[1:]
    client = EtcdClient(endpoints)
    lease = client.grant(30)
    client.put(b"/tmq/test/leased", b"x", lease)
    keeper = LeaseKeeper(endpoints, 30, interval_s=0.5, pulse_limit_s=15)
    keeper.ensure_running()
    keeper.set_lease(lease)
    print(keeper.proc.pid, flush=True)
    while True:
        keeper.pulse()
        time.sleep(0.05)
    """
)


def test_the_keeper_revokes_the_lease_when_its_broker_is_killed(tmp_path: Path) -> None:
    """kill -9 of the process that holds a 30 s lease: its keeper sees the pipe close, revokes
    the lease and exits, so the leased key goes within seconds, not 30."""
    etcd = EtcdCluster(tmp_path).start()
    client = EtcdClient(etcd.endpoints)
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, *etcd.endpoints], cwd=REPO, stdout=subprocess.PIPE
    )
    try:
        assert parent.stdout is not None
        keeper_pid = int(parent.stdout.readline())
        assert client.get(KEY) is not None
        parent.kill()
        parent.wait()
        assert wait_gone(client, KEY, timeout=10) < 10
        deadline = time.monotonic() + 10
        while Path(f"/proc/{keeper_pid}").exists():
            stat = Path(f"/proc/{keeper_pid}/stat").read_text(errors="replace")
            if stat.split(")")[-1].split()[0] == "Z":
                break  # exited; a zombie until init reaps it
            assert time.monotonic() < deadline, "the keeper outlived its broker"
            time.sleep(0.05)
    finally:
        parent.kill()
        parent.wait()
        etcd.stop()


@pytest.mark.slow
def test_a_group_under_load_keeps_its_master() -> None:
    """Heavy produce to the master and three CPU hogs for 90 s, nothing killed: no election
    (bench/lease_stability.py). On main, with renewals in the broker's process, this load gave
    elections every run (decision 910)."""
    out = subprocess.run(
        [sys.executable, "bench/lease_stability.py", "--seconds", "90"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["elections"] == 0, result
    assert result["fenced"] == 0, result
