"""IndexFile: a few entries at a time are written entry by entry, the same bytes as the
vectorised path."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest

from tiered.hot import index_file
from tiered.hot.index_file import IndexFile


def _fill(path: Path, runs: list[tuple[np.ndarray, np.ndarray, np.ndarray]]) -> bytes:
    f = IndexFile(path, slots=7, max_entries=400, create=True, begin_offset=100)
    try:
        # A slot pointing past the saved header (an entry written before a crash, whose header
        # was not saved) must be treated as empty by both paths.
        assert f._slots is not None
        f._slots[3] = 10_000
        for hashes, offsets, stamps in runs:
            f.put_many(hashes, offsets, stamps)
        return bytes(f.mm[:])
    finally:
        f.close()


def test_a_few_entries_are_written_as_the_vectorised_path_writes_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    rnd = random.Random(322)
    runs = []
    offset = 100
    for _ in range(40):
        n = rnd.randint(1, index_file._SCALAR_MAX)
        # 7 slots: hashes collide with each other within a call and with earlier calls.
        hashes = np.array([rnd.randrange(0, 1 << 31) for _ in range(n)], np.int64)
        offsets = np.array([offset + 64 * i for i in range(n)], np.int64)
        offset += 64 * n
        # Times before the file's first (clipped to 0 seconds) and far after it.
        stamps = np.array([1_700_000_000_000 + rnd.randint(-5_000, 10**9) for _ in range(n)])
        runs.append((hashes, offsets, stamps))
    each = _fill(tmp_path / "each", runs)
    monkeypatch.setattr(index_file, "_SCALAR_MAX", 0)
    vectorised = _fill(tmp_path / "vectorised", runs)
    assert each == vectorised
    header = index_file._HEADER.unpack_from(each, 0)
    assert header[5] == 1 + sum(len(r[0]) for r in runs)  # next entry number
    assert 0 < header[4] <= 7  # used slots
