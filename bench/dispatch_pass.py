"""The dispatcher's pass (``Dispatcher.apply``) alone: CPU per pass and per record.

Appends 1 KiB messages (8 queues, a UNIQ_KEY each, batches of 128: the broker's gRPC produce
shape, decision 675) to a real store with its dispatcher stopped, then applies the appended
chunks, merged into passes of ``records`` records as the dispatcher's loop merges them, to
empty ConsumeQueue and IndexFile directories with the store's default geometry. Each pass is
timed with ``time.thread_time`` (the dispatcher thread's CPU); every pass size is repeated over
``ROUNDS`` fresh directories (after ``WARMUP`` records) and the median pass is reported. The
fixed cost of a pass is the intercept of a least-squares line through (records a pass, CPU a
pass).

The limit beside it is the bytes a pass writes (20 per ConsumeQueue entry, 20 per IndexFile
entry and 4 per slot) copied with one ``memcpy``-like numpy copy of the same size, in the same
run: what a pass would cost if it were nothing but its writes into the page cache.

``python bench/dispatch_pass.py [--repo PATH]`` (``--repo``: import tmq from another checkout,
for A/B runs against main). Prints one JSON object on its last line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

PASS_SIZES = (128, 256, 512, 1024)
ROUNDS = 5
PASSES = 40  # timed, per pass size and round
# Records applied untimed first, in passes of 1024: the IndexFile's slot table (20 MB, keys
# land on random pages) is then faulted in, as in a broker that has run for a while.
WARMUP = 32768


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repo", default=str(Path(__file__).resolve().parent.parent))
    args = parser.parse_args()
    sys.path.insert(0, args.repo)
    import numpy as np

    from tiered.config import StoreConfig
    from tiered.hot.consume_queue import ConsumeQueueTable
    from tiered.hot.dispatcher import Dispatcher
    from tiered.hot.index_file import IndexService
    from tiered.record import ENGINE_NAME, Message
    from tiered.store import MessageStore

    body = b"x" * 1024
    total = WARMUP + max(PASS_SIZES) * PASSES
    with tempfile.TemporaryDirectory(prefix="tmq-dispatch-pass-") as tmp:
        root = Path(tmp)
        config = StoreConfig(data_dir=root / "store", flush="async", max_dispatch_lag_bytes=1 << 40)
        store = MessageStore(config)
        store.start()
        try:
            assert store.dispatcher is not None
            store.dispatcher.stop()
            for b in range(total // 128):
                store.put_messages(
                    [
                        Message(
                            topic="bench",
                            queue_id=i % 8,
                            body=body,
                            properties={"UNIQ_KEY": f"0A000001{b * 128 + i:024X}"},
                        )
                        for i in range(128)
                    ]
                )
            chunks = list(store.dispatcher._pending)
            end = store.commitlog.max_offset
            per_size: dict[int, float] = {}
            for records in PASS_SIZES:
                rounds = []
                for r in range(ROUNDS):
                    d_root = root / f"d{records}-{r}"
                    queues = ConsumeQueueTable(d_root / "cq", config.consumequeue_entries_per_file)
                    index = IndexService(
                        d_root / "index", config.index_hash_slots, config.index_max_entries
                    )
                    d = Dispatcher(store.commitlog, queues, index, reput_offset=0, index_from=0)
                    for c in chunks:
                        d.submit(c)
                    # Merged passes of ``records`` records, as the dispatcher's loop takes them.
                    times = []
                    applied = 0
                    while d._pending:
                        step = records if applied >= WARMUP else 1024
                        stop_at = d._pending[0].offsets[0]
                        taken = 0
                        for c in d._pending:
                            taken += len(c.offsets)
                            stop_at = c.end_offset
                            if taken >= step:
                                break
                        merged = d._take_consecutive(min(stop_at, end))
                        t0 = time.thread_time()
                        d.apply(merged)
                        if applied >= WARMUP:
                            times.append(time.thread_time() - t0)
                        applied += len(merged.offsets)
                    rounds.append(statistics.median(times) * 1e6)
                    index.close()
                    queues.close()
                per_size[records] = statistics.median(rounds)
            # The limit: the pass's bytes written by one copy.
            limit = {}
            for records in PASS_SIZES:
                src = np.ones(records * 44, np.uint8)
                dst = np.zeros(records * 44, np.uint8)
                best = float("inf")
                for _ in range(5):
                    t0 = time.perf_counter()
                    for _ in range(1000):
                        dst[:] = src
                    best = min(best, (time.perf_counter() - t0) / 1000 * 1e6)
                limit[records] = best
        finally:
            store.shutdown()
    xs = np.array(PASS_SIZES, float)
    ys = np.array([per_size[s] for s in PASS_SIZES])
    slope, intercept = np.polyfit(xs, ys, 1)
    out: dict[str, Any] = {
        "bench": "dispatch_pass",
        "engine": ENGINE_NAME,
        "repo": args.repo,
        "load": os.getloadavg()[0],
        "cpu_us_per_pass": {str(k): round(v, 1) for k, v in per_size.items()},
        "cpu_us_per_record": {str(k): round(v / k, 3) for k, v in per_size.items()},
        "fixed_us_per_pass": round(float(intercept), 1),
        "us_per_record_slope": round(float(slope), 3),
        "copy_limit_us_per_pass": {str(k): round(v, 2) for k, v in limit.items()},
        "ratio_to_limit_at_256": round(limit[256] / per_size[256], 4),
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
