"""The durable record of tiered queues not checked against their archive at start, and of the
ones that diverged from it (``offload/divergence.py``, decision 750). The broker-level behaviour
(real processes, LocalStack behind the fault proxy) is in tests/test_tier_restore.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from offload.divergence import DIVERGENCE_FILE, Conflict, Divergence, DivergenceFileError
from tiered.cold.manifest import QueueManifest


def ending_at(end: int) -> QueueManifest:
    """A manifest whose archive ends at ``end`` (a queue-offset range, nothing else read)."""
    return QueueManifest(prefix="c/b/t/0/", log_start_offset=end)


def test_a_pending_queue_keeps_its_first_base_across_restarts(tmp_path: Path) -> None:
    d = Divergence(tmp_path)
    d.pend({("t", 0): 60, ("t", 1): 0})
    d.pend({("t", 0): 180})  # a second start in the outage: the queue took 120 since
    again = Divergence(tmp_path)  # durable: read back as a restart reads it
    assert again.pending == {("t", 0): 60, ("t", 1): 0}
    assert again.local_from("t", 0) == 60 and again.local_from("t", 2) is None


def test_the_check_clears_a_queue_its_archive_does_not_pass_and_records_one_it_does(
    tmp_path: Path,
) -> None:
    d = Divergence(tmp_path)
    d.pend({("t", 0): 60, ("t", 1): 40})
    assert d.check("t", 1, ending_at(40), 55) is None
    assert d.local_from("t", 1) is None, "nothing at an archived offset: forgotten"
    assert d.check("t", 0, ending_at(180), 200) == Conflict(60, 180)
    assert d.check("t", 0, ending_at(180), 200) is None, "checked once"
    reread = Divergence(tmp_path)
    assert reread.pending == {} and reread.conflicts == {("t", 0): Conflict(60, 180)}
    assert reread.local_from("t", 0) == 60
    reread.pend({("t", 0): 200})  # a later start in another outage: still the conflict's
    assert Divergence(tmp_path).pending == {}
    reread.resolved("t", 0)
    assert json.loads((tmp_path / DIVERGENCE_FILE).read_text()) == {
        "pending": [],
        "conflicts": [],
    }


def test_an_unreadable_record_refuses_the_start(tmp_path: Path) -> None:
    (tmp_path / DIVERGENCE_FILE).write_text('{"pending": [["t", 0]]')
    with pytest.raises(DivergenceFileError, match=r"tier-divergence\.json is unreadable"):
        Divergence(tmp_path)


def test_a_resolve_records_its_start_and_commits_the_floor_in_one_write(tmp_path: Path) -> None:
    """Decision 801: where the copies begin is recorded before any; the commit removes the
    conflict and records the floor in one write; both survive a restart's read."""
    d = Divergence(tmp_path)
    d.pend({("t", 0): 60})
    d.check("t", 0, ending_at(180), 200)
    assert d.begin_resolve("t", 0, 200) == Conflict(60, 180, 200)
    assert d.begin_resolve("t", 0, 264) == Conflict(60, 180, 200), "a second run keeps it"
    again = Divergence(tmp_path)
    assert again.conflicts == {("t", 0): Conflict(60, 180, 200)}
    assert again.local_from("t", 0) == 60, "still in conflict until the commit"
    assert again.commit_resolve("t", 0) == 180
    reread = Divergence(tmp_path)
    assert reread.conflicts == {} and reread.floors == {("t", 0): 180}
    assert reread.local_from("t", 0) is None
    reread.floor_applied("t", 0)
    assert json.loads((tmp_path / DIVERGENCE_FILE).read_text()) == {
        "pending": [],
        "conflicts": [],
    }
