"""The epoch file and the consistent point two replicas compute from theirs."""

from __future__ import annotations

from pathlib import Path

import pytest

from tiered.epoch_file import EpochEntry, EpochFile, consistent_point

E = EpochEntry


def test_epoch_file_survives_a_reload_and_only_grows(tmp_path: Path) -> None:
    epochs = EpochFile(tmp_path / "ha")
    epochs.load()
    assert epochs.entries == [] and epochs.last_epoch == -1
    epochs.append(1, 0)
    epochs.append(2, 4096)
    with pytest.raises(ValueError):
        epochs.append(2, 8192)  # an epoch never repeats
    with pytest.raises(ValueError):
        epochs.append(3, 100)  # nor starts before the last one
    epochs.set_confirmed(5000)
    epochs.set_confirmed(10)  # only grows
    again = EpochFile(tmp_path / "ha")
    again.load()
    assert again.entries == [E(1, 0), E(2, 4096)]
    assert again.confirmed_offset == 5000


def test_epoch_at_names_the_term_that_wrote_an_offset(tmp_path: Path) -> None:
    epochs = EpochFile(tmp_path)
    epochs.load()
    for epoch, start in ((1, 100), (2, 500), (3, 500), (4, 900)):
        epochs.append(epoch, start)
    assert epochs.epoch_at(0) == (0, 100)  # history from before replication
    assert epochs.epoch_at(100) == (1, 500)
    assert epochs.epoch_at(499) == (1, 500)
    assert epochs.epoch_at(500) == (3, 900)  # epoch 2 is empty: it wrote nothing
    assert epochs.epoch_at(10_000) == (4, None)
    epochs.truncate_from(900)
    assert epochs.entries == [E(1, 100), E(2, 500), E(3, 500)]


def test_consistent_point_is_the_end_of_the_newest_shared_epoch() -> None:
    # The old master wrote on in epoch 1 after its slave left; the slave then led epoch 2.
    old_master = [E(1, 0)]
    new_master = [E(1, 0), E(2, 3000)]
    assert consistent_point(old_master, 5000, new_master, 9000) == 3000
    # A slave merely behind agrees up to its own end.
    assert consistent_point([E(1, 0), E(2, 3000)], 4000, new_master, 9000) == 4000
    # Same epoch number with another start: not the same term's bytes.
    assert consistent_point([E(1, 0), E(2, 3500)], 4000, new_master, 9000) == 3000
    # Nothing shared.
    assert consistent_point([E(5, 0)], 100, new_master, 9000) is None
    assert consistent_point([], 0, new_master, 9000) is None


def test_a_confirmed_offset_being_written_does_not_hold_up_epoch_at(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The confirmed file's write (two fsyncs) ran under the lock every replicated frame's
    ``epoch_at`` takes: each write stalled every SYNC send for as long as the disk took."""
    import threading

    import tiered.epoch_file as epoch_file

    epochs = EpochFile(tmp_path)
    epochs.load()
    epochs.append(1, 0)
    writing, release = threading.Event(), threading.Event()
    real_write = epoch_file.write_file

    def slow_write(path: Path, data: bytes) -> None:
        writing.set()
        release.wait(10)
        real_write(path, data)

    monkeypatch.setattr(epoch_file, "write_file", slow_write)
    writer = threading.Thread(target=epochs.set_confirmed, args=(4096,))
    writer.start()
    try:
        assert writing.wait(5)
        answered: list[tuple[int, int | None]] = []
        reader = threading.Thread(target=lambda: answered.append(epochs.epoch_at(100)))
        reader.start()
        reader.join(2)
        assert answered == [(1, None)], "epoch_at waited for the confirmed offset's fsyncs"
        assert epochs.confirmed_offset == 4096  # the truncation guard sees it at once
    finally:
        release.set()
        writer.join(10)
    again = EpochFile(tmp_path)
    again.load()
    assert again.confirmed_offset == 4096
