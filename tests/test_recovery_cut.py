"""Where recovery cuts the CommitLog, every byte after the cut is zero on disk, including
stray bytes far into the file, past never-written (preallocated) space: the cut visits only
what the extent map says may hold data, and must still find them."""

from __future__ import annotations

import os
from collections.abc import Callable

from conftest import brute_force_scan, crash_after_writing

from tiered.config import StoreConfig
from tiered.record import Message
from tiered.store import MessageStore


def test_bytes_after_the_cut_are_zeroed_to_the_end_of_the_file(
    small_config: StoreConfig, start_store: Callable[[StoreConfig], MessageStore]
) -> None:
    crash_after_writing(small_config.data_dir, 120)
    msgs = brute_force_scan(small_config.commitlog_dir)
    last = msgs[-1]
    end = last.commitlog_offset + last.size
    size = small_config.commitlog_file_size
    path = small_config.commitlog_dir / f"{end - end % size:020d}"
    pos = end % size
    assert pos + 64 < size - 64, "the last record should leave room in its file"
    with path.open("r+b") as fh:  # garbage right after the end, and near the file's end
        fh.seek(pos)
        fh.write(os.urandom(24))
        fh.seek(size - 40)
        fh.write(os.urandom(40))
        os.fsync(fh.fileno())

    store = start_store(small_config)
    assert store.commitlog.max_offset == end
    tail = path.read_bytes()[pos:]
    assert tail.count(0) == len(tail), "stray bytes after the cut were left in place"
    result = store.put_message(Message(topic="after", queue_id=0, body=b"new"))
    assert result.commitlog_offset == end
    assert store.wait_dispatched(10)
    got = store.get_messages("after", 0, 0, 1).messages
    assert got and got[0].body == b"new"
