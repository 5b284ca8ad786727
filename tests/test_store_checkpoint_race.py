"""Checkpoints saved from two threads at once (the flusher, and a promotion's or truncation's
``truncate_to`` on the controller's thread) share one ``checkpoint.tmp``: unserialised, one
thread's rename found the file gone and the promotion died half-way (the new master stayed a
slave that etcd named master)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

from tiered.config import StoreConfig
from tiered.record import Message
from tiered.store import MessageStore


def test_checkpoints_saved_concurrently_do_not_collide(
    tmp_path: Path, start_store: Callable[[StoreConfig], MessageStore]
) -> None:
    store = start_store(StoreConfig(data_dir=tmp_path / "s", commitlog_file_size=1 << 20))
    store.put_messages([Message(topic="t", queue_id=0, body=b"x" * 100)] * 10)
    errors: list[BaseException] = []

    def save(flush: bool) -> None:
        try:
            for _ in range(150):
                if flush:
                    store.flush()
                else:
                    store.truncate_to(store.max_physical_offset)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=save, args=(flush,)) for flush in (True, False, True)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
