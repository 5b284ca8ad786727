"""Tag-filtered hot reads: the cost of checking the entries a tag filter skips (decision 756).

One queue of 200,000 messages (200-byte bodies) with tags T0..T99 in turn, read whole through
``MessageStore.get_messages`` (32 a call) with a filter matching none (``NOPE``), 1 % (``T3``)
and 10 % (``T0||…||T9``) of them, and without one (every message decoded: the in-run reference,
``decode_us`` a message). Best of five each (two without a filter). ``skip_us`` is the time per
entry of the read that matches none: what a skipped entry costs.

For an A/B, run this file with each tree's venv from outside both trees (the venv's editable
install decides which code is measured; nothing here puts a tree on ``sys.path``):
``cd /tmp && /work/main/.venv/bin/python /path/to/bench/tag_filter_read.py``.
Prints one JSON object; about a minute.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import tiered
from broker.pop import TagFilter
from tiered.config import StoreConfig
from tiered.record import Message
from tiered.store import MessageStore

COUNT = 200_000
TAGS = 100


def read_all(store: MessageStore, expression: str | None) -> tuple[float, int]:
    code = TagFilter(expression).code_matches if expression else None
    offset, got = 0, 0
    end = store.max_offset("b", 0)
    started = time.perf_counter()
    while offset < end:
        result = store.get_messages("b", 0, offset, 32, tag_filter=code)
        got += len(result.messages)
        offset = result.next_offset
    return time.perf_counter() - started, got


def main() -> None:
    root = Path(tempfile.mkdtemp(prefix="tmq-tagbench-"))
    try:
        store = MessageStore(StoreConfig(data_dir=root, commitlog_file_size=64 << 20))
        store.start()
        try:
            for i in range(0, COUNT, 1000):
                store.put_messages(
                    [
                        Message("b", os.urandom(200), properties={"TAGS": f"T{n % TAGS}"})
                        for n in range(i, i + 1000)
                    ]
                )
            assert store.wait_dispatched()
            out: dict[str, object] = {"code": str(Path(tiered.__file__).parent.parent)}
            every = min(read_all(store, None)[0] for _ in range(2))
            out["unfiltered_s"] = round(every, 4)
            out["decode_us"] = round(every / COUNT * 1e6, 3)
            for name, expression in (
                ("none", "NOPE"),  # every entry skipped: the skip's own cost
                ("1pct", "T3"),
                ("10pct", "||".join(f"T{t}" for t in range(10))),
            ):
                best, _got = min(read_all(store, expression) for _ in range(5))
                out[f"filtered_{name}_s"] = round(best, 4)
                if name == "none":
                    out["skip_us"] = round(best / COUNT * 1e6, 3)
            out["load"] = os.getloadavg()[0]
        finally:
            store.shutdown()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
