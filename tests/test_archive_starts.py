"""The local record of where each queue's archive starts (``archive-starts.json``,
``ArchiveStarts``, decision 520) on a real disk that fills and frees: a save the full disk
refused is retried at the next manifest pass, not only at the queue's next change."""

from __future__ import annotations

import errno
import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tiered.cold.fetcher import ArchiveStarts
from tiered.cold.manifest import QueueManifest
from tiered.formats import SegmentInfo


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 1 MiB tmpfs (root only)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mnt = tmp_path / "small"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)]).returncode:
        pytest.skip("mount -t tmpfs is refused here")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def fill(directory: Path) -> Path:
    """Take every free byte of ``directory``'s filesystem, as another writer does."""
    filler = directory / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        while True:
            os.write(fd, bytes(4096))
    except OSError as e:
        assert e.errno == errno.ENOSPC, e
    finally:
        os.close(fd)
    return filler


def archive(prefix: str, base: int, count: int) -> QueueManifest:
    segment = SegmentInfo(f"{prefix}/seg-{base}", base, count, 1, 0, 0, 0, 0, 0, 0, 0)
    return QueueManifest(prefix, 1, [segment], log_start_offset=base)


def test_a_save_the_full_disk_refused_is_retried_at_the_next_pass(small_disk: Path) -> None:
    """The first commit of queue "gone"/0's archive is noted while the disk is full: the save
    fails. That queue's archive start then never changes (its topic was un-tiered: nothing is
    offloaded or expired any more), so a save retried only on a change never comes, and after
    a restart the file does not name the queue: the broker, whose topics no longer list it,
    takes it for a queue with no archive and answers its hot store's first offset, hiding
    every archived message. The refresher notes every tiered queue each pass, changed or not;
    once space is back, that pass must save the file."""
    path = small_disk / "config" / "archive-starts.json"
    starts = ArchiveStarts(path)
    starts.note("kept", 0, archive("p/kept", 0, 100))
    filler = fill(small_disk)
    manifest = archive("p/gone", 0, 500)
    starts.note("gone", 0, manifest)  # the full disk refuses this save
    assert json.loads(path.read_text())["queues"] == [["kept", 0, 0]]
    assert starts.get("gone", 0) == 0  # known in memory while this process runs

    starts.note("gone", 0, manifest)  # the next pass, still full: no harm, still refused
    filler.unlink()
    starts.note("kept", 0, archive("p/kept", 0, 100))  # the next pass, with room: unchanged
    assert json.loads(path.read_text())["queues"] == [["gone", 0, 0], ["kept", 0, 0]]
    restarted = ArchiveStarts(path)
    assert restarted.queues() == {("gone", 0), ("kept", 0)}
    assert restarted.get("gone", 0) == 0
