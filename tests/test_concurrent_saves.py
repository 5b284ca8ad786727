"""Two threads saving one file at once (decision 1180).

A slave's replication thread applies each metadata document its master sends, saving consumer
offsets, while the broker's 5 s tick saves them too. Both went through ``write_file`` with one
temporary name: the live file could be rewritten in place, keep a longer document's tail after
a shorter one (a damaged file that stops the next start), or go back to an older snapshot.
Real threads and real files; each check reads what is on disk while the saves run.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from pathlib import Path

from broker.metadata import BrokerMetadata
from tiered.durable import write_file

SECONDS = 2.0


def _race(workers: list[Callable[[], None]], check: Callable[[], None]) -> list[str]:
    """Run each worker in a loop on its own thread and ``check`` in this one for SECONDS; the
    errors the workers raised (each keeps going after one)."""
    stop = threading.Event()
    errors: list[str] = []

    def loop(work: Callable[[], None]) -> None:
        while not stop.is_set():
            try:
                work()
            except Exception as e:
                errors.append(repr(e))

    threads = [threading.Thread(target=loop, args=(w,)) for w in workers]
    for t in threads:
        t.start()
    try:
        deadline = time.monotonic() + SECONDS
        while time.monotonic() < deadline:
            check()
    finally:
        stop.set()
        for t in threads:
            t.join()
    return errors


def test_two_threads_replacing_one_file_leave_one_whole_document(tmp_path: Path) -> None:
    path = tmp_path / "state.json"
    long_doc = json.dumps({"rows": list(range(2000))}).encode()
    short_doc = json.dumps({"rows": [1]}).encode()
    write_file(path, long_doc)
    seen: list[bytes] = []

    def check() -> None:
        raw = path.read_bytes()
        if raw not in (long_doc, short_doc):
            seen.append(raw)

    errors = _race([lambda: write_file(path, long_doc), lambda: write_file(path, short_doc)], check)
    assert not errors, f"{len(errors)} saves failed, e.g. {errors[0]}"
    assert not seen, f"{len(seen)} reads were neither document, e.g. ...{seen[0][-60:]!r}"
    assert path.read_bytes() in (long_doc, short_doc)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state.json"]


def test_consumer_offsets_on_disk_never_go_back(tmp_path: Path) -> None:
    metadata = BrokerMetadata(tmp_path)
    counter = iter(range(1, 10**9))
    damaged: list[str] = []
    backwards: list[tuple[int, int]] = []
    last = 0

    def consume() -> None:
        metadata.commit_offset("g", "t", 0, next(counter))

    def check() -> None:
        nonlocal last
        try:
            rows = json.loads((tmp_path / "consumer_offsets.json").read_bytes())
        except FileNotFoundError:
            return
        except ValueError as e:
            damaged.append(str(e))
            return
        offset = rows[0]["offset"]
        if offset < last:
            backwards.append((last, offset))
        last = max(last, offset)

    def save() -> None:
        metadata.flush_offsets(force=True)  # as a slave applying its master's document does

    errors = _race([consume, save, save], check)
    assert not errors, f"{len(errors)} saves failed, e.g. {errors[0]}"
    assert not damaged, f"{len(damaged)} reads found a damaged file: {damaged[0]}"
    assert not backwards, f"the saved offset went back {len(backwards)} times, e.g. {backwards[0]}"
    assert last > 0
    metadata.flush_offsets(force=True)
    reloaded = BrokerMetadata(tmp_path)
    reloaded.load()
    assert reloaded.offset("g", "t", 0) == metadata.offset("g", "t", 0)
