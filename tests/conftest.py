from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tiered.config import StoreConfig
from tiered.record import BLANK_MAGIC_CODE, StoredMessage, decode, read_total_and_magic
from tiered.store import MessageStore

TESTS = Path(__file__).resolve().parent
SMALL = json.loads((TESTS / "store_sizes.json").read_text())
CHILD = TESTS / "store_child.py"


@pytest.fixture
def small_config(tmp_path: Path) -> StoreConfig:
    """A store with tiny files, so a few hundred messages roll many of them."""
    return StoreConfig(data_dir=tmp_path / "store", **SMALL)


@pytest.fixture
def open_store() -> Iterator[Callable[[StoreConfig], MessageStore]]:
    """Start stores and shut every one down at the end of the test, whatever happens."""
    opened: list[MessageStore] = []

    def _open(config: StoreConfig) -> MessageStore:
        store = MessageStore(config)
        store.start()
        opened.append(store)
        return store

    yield _open
    for store in opened:
        store.shutdown()


def run_child(data_dir: Path, mode: str, flush: str, *args: object) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, str(CHILD), str(data_dir), mode, flush, *map(str, args)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def crash_after_writing(data_dir: Path, count: int, flush: str = "async", seed: int = 7) -> None:
    """Write ``count`` messages in a child that then dies without shutting down."""
    child = run_child(data_dir, "write-and-crash", flush, count, seed)
    out, err = child.communicate(timeout=120)
    assert child.returncode == 0 and "done" in out, err


def brute_force_scan(commitlog_dir: Path) -> list[StoredMessage]:
    """Every record in the CommitLog files, read straight from disk with the codec alone."""
    out: list[StoredMessage] = []
    for path in sorted(commitlog_dir.iterdir()):
        data = path.read_bytes()
        pos = 0
        while pos + 8 <= len(data):
            total, magic = read_total_and_magic(data, pos)
            if magic == BLANK_MAGIC_CODE or total == 0:
                break
            msg = decode(data, pos)
            assert msg.commitlog_offset == int(path.name) + pos
            out.append(msg)
            pos += total
    return out
