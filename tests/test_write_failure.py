"""A CommitLog write that fails (EIO from the device) loses durability as a failed fsync does:
the page cache's state for those bytes is unknown, so nothing written after it may be
acknowledged until a restart has recovered from what the disk holds (PostgreSQL's fsyncgate)."""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Literal

import pytest
from conftest import SMALL

from tiered.config import StoreConfig
from tiered.hot import mapped_file
from tiered.record import Message
from tiered.store import DiskFullError, DurabilityLostError, MessageStore

BIG = b"x" * 8192  # written with pwrite (MappedFile.write_at), not a store through the mapping


def _failing_pwrite(code: int) -> object:
    def pwrite(fd: int, data: object, pos: int) -> int:
        raise OSError(code, os.strerror(code))

    return pwrite


@pytest.mark.parametrize("flush", ["sync", "async"])
def test_after_a_failed_commitlog_write_nothing_more_is_acknowledged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, flush: Literal["sync", "async"]
) -> None:
    config = StoreConfig(data_dir=tmp_path / "store", flush=flush, **SMALL)
    store = MessageStore(config)
    store.start()
    try:
        before = store.put_messages([Message("t", b"before")])
        assert store.wait_dispatched()
        # The reference writer calls os.pwrite; the native one calls pwritev(2) from C.
        monkeypatch.setattr(mapped_file, "_NATIVE", None)
        monkeypatch.setattr(os, "pwrite", _failing_pwrite(errno.EIO))
        with pytest.raises(DurabilityLostError, match="write or fsync failed"):
            store.put_messages([Message("t", BIG)])
        monkeypatch.undo()  # the device answers again: that proves nothing about what it lost
        for body in (b"small", BIG):
            with pytest.raises(DurabilityLostError, match="restart"):
                store.put_messages([Message("t", body)])
        assert store.max_offset("t", 0) == 1
        assert store.commitlog_stats().max_offset == before.end_offset
    finally:
        store.shutdown()
    # A restart recovers from what the disk holds and takes writes again.
    store = MessageStore(config)
    report = store.start()
    try:
        assert not report.clean_exit, "a store that lost durability does not exit cleanly"
        after = store.put_messages([Message("t", b"after")])
        assert after[0].queue_offset == 1
        assert store.wait_dispatched()
        assert [m.body for m in store.get_messages("t", 0, 0, 10).messages] == [b"before", b"after"]
    finally:
        store.shutdown()


def test_a_write_the_full_disk_refuses_leaves_the_store_writable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ENOSPC stores nothing (the size fields come last): the batch is refused as a full disk,
    and the store takes the next one once there is room, as after a refused roll."""
    store = MessageStore(StoreConfig(data_dir=tmp_path / "store", flush="sync", **SMALL))
    store.start()
    try:
        monkeypatch.setattr(mapped_file, "_NATIVE", None)
        monkeypatch.setattr(os, "pwrite", _failing_pwrite(errno.ENOSPC))
        with pytest.raises(DiskFullError):
            store.put_messages([Message("t", BIG)])
        monkeypatch.undo()
        assert store.put_messages([Message("t", BIG)])[0].queue_offset == 0
        assert store.wait_dispatched()
        assert [m.body for m in store.get_messages("t", 0, 0, 10).messages] == [BIG]
    finally:
        store.shutdown()
