"""A frozen master and a master cut from etcd, with real processes, real etcd and Apache's
client (tests/ha_bad_days.py): no acknowledged message lost, no split brain, a new master in
bounded time, and the old master back as a slave by itself. The freeze runs a 2 s lease, as the
other HA tests; the partition the default 8 s, where its defect showed. bench/ha_bad_days.py
measures both at 8 s over several rounds."""

from __future__ import annotations

import re
import time
import urllib.request
from pathlib import Path

import pytest

from tests.broker_harness import terminate
from tests.etcd_harness import EtcdCluster
from tests.ha_bad_days import run_bad_day
from tests.ha_failover import Group, is_master, start_namesrv, wait_for


@pytest.mark.slow
def test_a_frozen_master_is_replaced_and_rejoins_without_losing_an_ack(tmp_path: Path) -> None:
    result = run_bad_day(tmp_path, "freeze", rounds=1, lease_ttl_ms=2000, resume_after_s=3.0)
    (r,) = result.rounds
    assert result.acked_lost == [], result.summary()
    # The keeper stops renewing once the pulse is a TTL/2 old; etcd expires the lease a TTL
    # after the last renewal; the election settles in 0.6 s: about 3.6 s, bounded well above.
    assert r.elected_s < 12, result.summary()
    assert result.duplicated_in_queues == 0


@pytest.mark.slow
def test_a_master_cut_from_etcd_fences_before_the_election_and_forwards_after_it(
    tmp_path: Path,
) -> None:
    """The master reaches its slaves, its clients and the NameServer, but not etcd. It must
    fence before another member is elected, lose no acknowledged message, and, still cut off,
    forward what it is sent to the new master: Apache's client keeps one channel over every
    member and stays on the first that answers, so a client on the old master would otherwise
    be refused for as long as the partition lasts (decision 1151). At the default 8 s lease: its
    tick is then stuck in etcd's timeouts (2 s an endpoint), which a lookup made only when a tick
    failed waited out past the heal."""
    result = run_bad_day(tmp_path, "partition", rounds=1, lease_ttl_ms=8000, resume_after_s=3.0)
    (r,) = result.rounds
    assert result.acked_lost == [], result.summary()
    assert r.fenced_s is not None and r.fenced_s < r.elected_s, result.summary()
    # The fence at 6 s, etcd's expiry a TTL after the last renewal, 0.6 s to settle.
    assert r.elected_s < 20, result.summary()
    assert r.probe_acked_cut > 0, result.summary()
    assert result.duplicated_in_queues == 0


def etcd_proposals(endpoints: list[str]) -> int:
    """Raft proposals the etcd cluster committed (the most any member counts)."""
    counts = []
    for endpoint in endpoints:
        with urllib.request.urlopen(f"{endpoint}/metrics", timeout=10) as r:
            text = r.read().decode()
        m = re.search(r"^etcd_server_proposals_committed_total (\S+)$", text, re.MULTILINE)
        assert m, f"no proposals metric at {endpoint}"
        counts.append(int(float(m.group(1))))
    return max(counts)


def test_an_idle_group_does_not_write_to_etcd_at_every_tick(tmp_path: Path) -> None:
    """Each member's tick (every 0.2 s) wrote its member document through raft whether or not
    it changed: 5 writes a second per member on an idle group, load on an etcd the machine
    already starves, and a raft round trip ahead of every SyncStateSet publish (decision 1152).
    Idle, a member writes only what changed."""
    etcd = EtcdCluster(tmp_path).start()
    namesrv, address = start_namesrv(tmp_path)
    group = Group(tmp_path, etcd, address, "sync")
    try:
        a, b = group.members[:2]
        group.start(a)
        wait_for("a is elected master", lambda: is_master(a))
        group.start(b)
        a.create_topic()
        wait_for("b is in sync", lambda: group.in_sync(2), timeout=60)
        time.sleep(2)
        before = etcd_proposals(etcd.endpoints)
        time.sleep(5)
        written = etcd_proposals(etcd.endpoints) - before
        # Two members, 25 ticks each: 50 writes before; lease grants and the odd change after.
        assert written < 10, f"{written} raft proposals in 5 s of an idle group"
    finally:
        group.kill_all()
        terminate(namesrv, 10)
        etcd.stop()
