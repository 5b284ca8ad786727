"""Failover with a real 3-node etcd as the controller: a replica group of three broker processes
elects its master, Apache's Python client produces through repeated ``kill -9`` of the master,
and nothing acknowledged is lost (tests/ha_failover.py runs the scenario; bench/replication.py
runs it with ten kills)."""

from __future__ import annotations

import json
import time
from pathlib import Path

from broker.ha.etcd import Compare, EtcdClient, put_op
from tests.etcd_harness import EtcdCluster
from tests.ha_failover import run_failover


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
