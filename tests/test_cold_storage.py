"""The cold tier's storage interface, on the local filesystem and on S3 (LocalStack)."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from tiered.cold.storage import ObjectInfo, ObjectNotFoundError, ObjectStore, open_store


@pytest.fixture(params=["file", "s3"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> ObjectStore:
    if request.param == "file":
        return open_store(f"file://{tmp_path}/tier")
    s3 = request.getfixturevalue("s3")
    bucket = request.getfixturevalue("bucket")
    return open_store(f"s3://{bucket}/tier", s3.storage_options())


def test_put_if_absent_writes_once_and_never_overwrites(store: ObjectStore) -> None:
    assert store.put_if_absent("c/b/orders/0/seg", b"first") is True
    assert store.put_if_absent("c/b/orders/0/seg", b"second") is False
    assert store.get("c/b/orders/0/seg") == b"first"


def test_only_one_of_many_racing_writers_wins(store: ObjectStore) -> None:
    results: list[bool] = []
    writers = [
        threading.Thread(
            target=lambda i=i: results.append(
                store.put_if_absent("race/obj", f"writer-{i}".encode())
            )
        )
        for i in range(8)
    ]
    for w in writers:
        w.start()
    for w in writers:
        w.join()
    assert sorted(results) == [False] * 7 + [True]
    assert store.get("race/obj").startswith(b"writer-")


def test_reads_ranges_sizes_lists_and_idempotent_deletes(store: ObjectStore) -> None:
    store.put_if_absent("t/0/a", bytes(range(200)))
    store.put("t/0/manifest", b"v1")
    store.put("t/0/manifest", b"v2")  # replace
    assert store.get_range("t/0/a", 10, 5) == bytes(range(10, 15))
    assert store.get_range("t/0/a", 195, 100) == bytes(range(195, 200))
    assert store.size("t/0/a") == 200 and store.size("t/0/none") is None
    assert store.get("t/0/manifest") == b"v2"
    assert store.list("t/0/") == [ObjectInfo("t/0/a", 200), ObjectInfo("t/0/manifest", 2)]
    assert store.list("nothing/") == []
    store.delete("t/0/a")
    store.delete("t/0/a")
    with pytest.raises(ObjectNotFoundError):
        store.get("t/0/a")
    with pytest.raises(ObjectNotFoundError):
        store.get_range("t/0/a", 0, 1)


@pytest.mark.parametrize("key", ["../x", "/abs", "a//b", "a/./b", "a/../../etc", ""])
def test_keys_cannot_leave_the_tier_root(tmp_path: Path, key: str) -> None:
    store = open_store(f"file://{tmp_path}/tier")
    with pytest.raises(ValueError, match="illegal object key"):
        store.put(key, b"x")
    with pytest.raises(ValueError, match="illegal object key"):
        store.put_if_absent(key, b"x")
    assert [p for p in tmp_path.rglob("*") if p.is_file()] == []
