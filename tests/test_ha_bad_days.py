"""A frozen master and a master cut from etcd, with real processes, real etcd and Apache's
client (tests/ha_bad_days.py): no acknowledged message lost, no split brain, a new master in
bounded time, and the old master back as a slave by itself. A 2 s lease, as the other HA tests
(their waits are sized for it); bench/ha_bad_days.py measures the default 8 s."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.ha_bad_days import run_bad_day

pytestmark = pytest.mark.slow


def test_a_frozen_master_is_replaced_and_rejoins_without_losing_an_ack(tmp_path: Path) -> None:
    result = run_bad_day(tmp_path, "freeze", rounds=1, lease_ttl_ms=2000, resume_after_s=3.0)
    (r,) = result.rounds
    assert result.acked_lost == [], result.summary()
    # The keeper stops renewing once the pulse is a TTL/2 old; etcd expires the lease a TTL
    # after the last renewal; the election settles in 0.6 s: about 3.6 s, bounded well above.
    assert r.elected_s < 12, result.summary()
    assert result.duplicated_in_queues == 0


def test_a_master_cut_from_etcd_fences_before_the_election_and_forwards_after_it(
    tmp_path: Path,
) -> None:
    """The master reaches its slaves, its clients and the NameServer, but not etcd. It must
    fence before another member is elected, lose no acknowledged message, and, still cut off,
    forward what it is sent to the new master: Apache's client keeps one channel over every
    member and stays on the first that answers, so a client on the old master would otherwise
    be refused for as long as the partition lasts (decision 1151)."""
    result = run_bad_day(tmp_path, "partition", rounds=1, lease_ttl_ms=2000, resume_after_s=6.0)
    (r,) = result.rounds
    assert result.acked_lost == [], result.summary()
    assert r.fenced_s is not None and r.fenced_s < r.elected_s, result.summary()
    assert r.elected_s < 12, result.summary()
    assert r.probe_acked_cut > 0, result.summary()
    assert result.duplicated_in_queues == 0
