"""IndexFile: the record engine's ``index_put`` writes the same bytes entry by entry (a few
entries), vectorised (the reference for more) and natively (decision 540)."""

from __future__ import annotations

import random
import struct
from pathlib import Path

import numpy as np
import pytest

from tiered import record
from tiered.hot import index_file
from tiered.hot.index_file import IndexFile

NATIVE = pytest.mark.skipif(record.NATIVE_ENGINE is None, reason="native engine not built")


def _fill(path: Path, runs: list[tuple[np.ndarray, np.ndarray, np.ndarray]]) -> bytes:
    f = IndexFile(path, slots=7, max_entries=400, create=True, begin_offset=100)
    try:
        # A slot pointing past the saved header (an entry written before a crash, whose header
        # was not saved) must be treated as empty by every path.
        struct.pack_into(">i", f.mm, index_file.HEADER_SIZE + 3 * 4, 10_000)
        for hashes, offsets, stamps in runs:
            f.put_many(hashes, offsets, stamps)
        return bytes(f.mm[:])
    finally:
        f.close()


def _runs(seed: int, most: int) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    rnd = random.Random(seed)
    runs = []
    offset = 100
    for _ in range(40):
        n = rnd.randint(1, most)
        # 7 slots: hashes collide with each other within a call and with earlier calls.
        hashes = np.array([rnd.randrange(0, 1 << 31) for _ in range(n)], np.int64)
        offsets = np.array([offset + 64 * i for i in range(n)], np.int64)
        offset += 64 * n
        # Times before the file's first (clipped to 0 seconds) and far after it.
        stamps = np.array([1_700_000_000_000 + rnd.randint(-5_000, 10**9) for _ in range(n)])
        runs.append((hashes, offsets, stamps))
    return runs


@pytest.mark.parametrize("most", [record._INDEX_SCALAR_MAX, 9])
def test_entry_by_entry_vectorised_and_native_write_the_same_bytes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, most: int
) -> None:
    runs = _runs(322 + most, most)
    monkeypatch.setattr(record, "_engine", record.PYTHON_ENGINE)
    each = _fill(tmp_path / "each", runs)
    monkeypatch.setattr(record, "_INDEX_SCALAR_MAX", 0)
    vectorised = _fill(tmp_path / "vectorised", runs)
    assert each == vectorised
    if record.NATIVE_ENGINE is not None:
        monkeypatch.setattr(record, "_engine", record.NATIVE_ENGINE)
        assert _fill(tmp_path / "native", runs) == each
    header = index_file._HEADER.unpack_from(each, 0)
    assert header[5] == 1 + sum(len(r[0]) for r in runs)  # next entry number
    assert 0 < header[4] <= 7  # used slots
    assert struct.unpack_from(">i", each, index_file.HEADER_SIZE + 3 * 4)[0] != 10_000


@NATIVE
def test_native_index_put_on_a_full_disk_raises_and_sets_no_slot(tmp_path: Path) -> None:
    f = IndexFile(tmp_path / "i", slots=7, max_entries=40, create=True, begin_offset=0)
    try:
        slots_before = bytes(f.mm[: index_file.HEADER_SIZE + 7 * 4])
        hashes = np.arange(5, dtype=np.int64)
        with pytest.raises(OSError):  # a closed descriptor: the pwrite fails as ENOSPC would
            record.NATIVE_ENGINE.index_put(
                f.mm, -1, 7, 1, 0, hashes, hashes * 100, np.full(5, 1000, np.int64)
            )
        assert bytes(f.mm[: index_file.HEADER_SIZE + 7 * 4]) == slots_before
    finally:
        f.close()


def test_a_record_indexed_again_in_the_next_file_is_found_in_both_without_damage(
    tmp_path: Path,
) -> None:
    """A record indexed in a file and again in the next one, which starts at it, so the older
    file names the next file's first offset. Seen in CI on the filling-disk test (decision
    680's), whose key queries then answered nothing: decision 757's chain-order check took it
    for damage. A dispatch pass retried from that record after its index write failed is the
    likely way there. Both files are right: the query finds the record once."""
    from tiered.formats import key_hash

    service = index_file.IndexService(tmp_path / "index", slots=7, max_entries=4)
    service.load()
    t = 1_700_000_000_000
    keys = ["a", "b", "c", "d"]
    hashes = np.array([key_hash("T", k) for k in keys], np.int64)
    first = service.new_file(100)
    service.files = [first]
    # Three entries of a record at 100, then the record at 200's first (the file is full).
    first.put_many(hashes[:3], np.array([100, 100, 100], np.int64), np.full(3, t))
    first.put_many(hashes[3:], np.array([200], np.int64), np.full(1, t))
    first.advance(264, t)
    # The pass is run again from 200: a new file starting there holds it again, and more.
    second = service.new_file(200)
    service.files = [first, second]
    second.put_many(hashes[3:], np.array([200], np.int64), np.full(1, t))
    second.put_many(hashes[:1], np.array([300], np.int64), np.full(1, t))
    second.advance(364, t)
    try:
        assert [o for o, _ in service.query("T", "d", t - 1000, t + 1000, 10)] == [200]
        assert [o for o, _ in service.query("T", "a", t - 1000, t + 1000, 10)] == [300, 100]
        assert not service.check_all()
    finally:
        service.close()
