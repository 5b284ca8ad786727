"""A slave applying its master's metadata document (decision 1182): only the parts that changed
are written, and a part whose save failed is saved again with the next document. Real files."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

from broker.metadata import BrokerMetadata


def _document(offset: int, topics: tuple[str, ...] = ("orders",)) -> dict[str, Any]:
    return {
        "topics": [{"name": t} for t in topics],
        "groups": [{"name": "billing"}],
        "offsets": [{"group": "billing", "topic": "orders", "queue": 0, "offset": offset}],
    }


def _inode(path: Path) -> int:
    return path.stat().st_ino


def test_a_document_whose_topics_and_groups_did_not_change_writes_only_the_offsets(
    tmp_path: Path,
) -> None:
    slave = BrokerMetadata(tmp_path)
    slave.replace(_document(1))
    before = {name: _inode(tmp_path / name) for name in ("topics.json", "groups.json")}
    offsets_before = _inode(tmp_path / "consumer_offsets.json")
    slave.replace(_document(2))
    assert {name: _inode(tmp_path / name) for name in before} == before
    assert _inode(tmp_path / "consumer_offsets.json") != offsets_before
    slave.replace(_document(3, topics=("orders", "refunds")))
    assert _inode(tmp_path / "topics.json") != before["topics.json"]
    reloaded = BrokerMetadata(tmp_path)
    reloaded.load()
    assert sorted(reloaded.topics) == ["orders", "refunds"]
    assert sorted(reloaded.groups) == ["billing"]
    assert reloaded.offset("billing", "orders", 0) == 3


def test_topics_a_failed_save_left_unsaved_are_saved_with_the_next_document(
    tmp_path: Path,
) -> None:
    slave = BrokerMetadata(tmp_path)
    slave.replace(_document(1))
    # The temporary file's name taken by a directory: the save fails as a refused write does.
    blocker = tmp_path / "topics.json.tmp"
    blocker.mkdir()
    with pytest.raises(OSError):
        slave.replace(_document(2, topics=("orders", "refunds")))
    shutil.rmtree(blocker)
    slave.replace(_document(3, topics=("orders", "refunds")))
    reloaded = BrokerMetadata(tmp_path)
    reloaded.load()
    assert sorted(reloaded.topics) == ["orders", "refunds"]
    assert reloaded.offset("billing", "orders", 0) == 3
