"""The durable record of tiered queues not checked against their archive at start, and of the
ones that diverged from it (``offload/divergence.py``, decision 750). The broker-level behaviour
(real processes, LocalStack behind the fault proxy) is in tests/test_tier_restore.py."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import pytest
from test_archive_starts import fill

from offload.divergence import DIVERGENCE_FILE, Conflict, Divergence, DivergenceFileError
from tiered.cold.manifest import QueueManifest

pytest_plugins = ["tests.test_archive_starts"]  # the small_disk fixture


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


class _PowerCut(Exception):
    pass


@pytest.mark.parametrize(
    "write", ["pend", "clear", "conflict", "begin resolve", "commit resolve", "floor applied"]
)
@pytest.mark.parametrize("cut", ["before rename", "after rename", "after save"])
def test_a_power_loss_while_the_record_is_saved_keeps_the_queue_pending_or_resolved(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, write: str, cut: str
) -> None:
    """The power goes out (tests/powerloss_fs.py: only what was fsynced survives, unsynced
    pages land at random) while ``tier-divergence.json`` is written: a queue recorded pending
    at start, a late check that clears it, one that records a conflict; before the new file is
    renamed over the old, after the rename (its directory not yet fsynced), and after the save
    returned; and a resolve's three writes (decision 801: where its copies begin, its commit
    with the floor to raise, the floor's record dropped; decision 900, a guard too). The
    record read back is the old one or the new one, never neither: a queue whose
    local messages may overlap its archive is never forgotten, and a save that returned is
    never undone. Passed on main too (``write_file``: fsync, rename, fsync of the directory);
    kept as a guard (decision 792)."""
    from test_power_loss import PowerLossMount, _need_fuse

    import tiered.durable

    _need_fuse()
    durable, mountpoint = tmp_path / "durable", tmp_path / "mnt"
    (durable / "data").mkdir(parents=True)
    if write != "pend":  # the queue already pending, durably, before the power loss's mount
        Divergence(durable / "data").pend({("t", 0): 60})
    if write in ("begin resolve", "commit resolve", "floor applied"):
        resolving = Divergence(durable / "data")
        assert resolving.check("t", 0, ending_at(180), 200) == Conflict(60, 180)
        if write != "begin resolve":
            resolving.begin_resolve("t", 0, 200)
        if write == "floor applied":
            resolving.commit_resolve("t", 0)
    before = Divergence(durable / "data")
    mount = PowerLossMount(mountpoint, durable)
    rename, armed = tiered.durable.os.replace, [cut]

    def replacing(src: Path, dst: Path) -> None:
        if armed == ["before rename"]:
            armed.clear()
            mount.crash(f"{write}-{cut}")
            raise _PowerCut
        rename(src, dst)
        if armed == ["after rename"]:
            armed.clear()
            mount.crash(f"{write}-{cut}")
            raise _PowerCut

    monkeypatch.setattr(tiered.durable.os, "replace", replacing)
    try:
        d = Divergence(mountpoint / "data")
        with contextlib.suppress(_PowerCut):
            if write == "pend":
                d.pend({("t", 0): 60})
            elif write == "clear":
                assert d.check("t", 0, ending_at(40), 80) is None
            elif write == "conflict":
                assert d.check("t", 0, ending_at(180), 200) == Conflict(60, 180)
            elif write == "begin resolve":
                assert d.begin_resolve("t", 0, 200) == Conflict(60, 180, 200)
            elif write == "commit resolve":
                assert d.commit_resolve("t", 0) == 180
            else:
                d.floor_applied("t", 0)
            if armed == ["after save"]:
                mount.crash(f"{write}-{cut}")
    finally:
        mount.close()
    monkeypatch.undo()
    after = Divergence(durable / "data")
    got = (after.pending, after.conflicts, after.floors)
    new = {
        "pend": ({("t", 0): 60}, {}, {}),
        "clear": ({}, {}, {}),
        "conflict": ({}, {("t", 0): Conflict(60, 180)}, {}),
        "begin resolve": ({}, {("t", 0): Conflict(60, 180, 200)}, {}),
        "commit resolve": ({}, {}, {("t", 0): 180}),
        "floor applied": ({}, {}, {}),
    }[write]
    if cut == "after save":
        assert got == new, "a save that returned was undone"
    else:
        assert got in ((before.pending, before.conflicts, before.floors), new), got


def test_a_check_the_full_disk_refused_keeps_the_queue_pending_until_space_returns(
    small_disk: Path,
) -> None:
    """A real 1 MiB tmpfs, filled by another writer: the late check cannot save its verdict
    (a clear or a conflict). It raises, and the queue stays pending, in memory (release, uploads
    and archive reads keep holding) and on disk; once space returns the same process's next
    check saves it, without a restart. Passed on main too (``_save`` writes before it changes
    its memory); kept as a guard (decision 792)."""
    disk = small_disk
    d = Divergence(disk)
    d.pend({("t", 0): 60, ("t", 1): 40})
    filler = fill(disk)
    with pytest.raises(OSError, match="No space left"):
        d.check("t", 0, ending_at(180), 200)
    with pytest.raises(OSError, match="No space left"):
        d.check("t", 1, ending_at(40), 55)
    assert d.pending == {("t", 0): 60, ("t", 1): 40} and d.conflicts == {}
    assert d.local_from("t", 0) == 60 and d.local_from("t", 1) == 40
    assert Divergence(disk).pending == {("t", 0): 60, ("t", 1): 40}, "on disk"
    filler.unlink()
    assert d.check("t", 0, ending_at(180), 200) == Conflict(60, 180)
    assert d.check("t", 1, ending_at(40), 55) is None
    reread = Divergence(disk)
    assert reread.pending == {} and reread.conflicts == {("t", 0): Conflict(60, 180)}
