"""Restart time after ``kill -9`` with 1 GiB of CommitLog past the checkpoint.

A child process appends about 1 GiB of 1 KiB messages with the checkpoint held back (the flusher
interval is longer than the run), reports, and is killed with SIGKILL. The parent then times
``MessageStore.start()``: the CRC-checked scan from the checkpoint, and re-dispatching every record
to the ConsumeQueues and IndexFiles. The physical limit beside it is reading the same bytes
sequentially (page cache, as for the restart), timed right after the restart. Three rounds;
the medians are reported beside every round's figures. Prints one JSON object on its last line.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tiered.config import GiB, StoreConfig
from tiered.record import Message
from tiered.store import MessageStore

TARGET_BYTES = 1 * GiB
MSG = 1024
BATCH = 512
ROUNDS = 3


def config(data_dir: Path) -> StoreConfig:
    # Two 1 GiB files' worth of room; no periodic flush, so the checkpoint stays at the start.
    return StoreConfig(data_dir=data_dir, flush_interval_ms=3_600_000)


def child(data_dir: Path) -> None:
    store = MessageStore(config(data_dir))
    store.start()
    body = os.urandom(MSG)
    batch = [
        Message(
            topic=f"recovery-{i % 4}",
            queue_id=i % 8,
            body=body,
            properties={"UNIQ_KEY": f"0A000001{i:024X}", "KEYS": f"k{i}"},
        )
        for i in range(BATCH)
    ]
    while store.commitlog.max_offset < TARGET_BYTES:
        store.put_messages(batch)
    store.wait_dispatched(600)
    print(store.commitlog.max_offset, flush=True)
    time.sleep(3600)  # wait for SIGKILL


def sequential_read_seconds(directory: Path, nbytes: int) -> float:
    started = time.perf_counter()
    left = nbytes
    for path in sorted(directory.iterdir()):
        with path.open("rb", buffering=0) as fh:
            while left > 0 and (chunk := fh.read(min(8 << 20, left))):
                left -= len(chunk)
    return time.perf_counter() - started


def one_round(root: Path) -> dict[str, float]:
    data_dir = root / "store"
    try:
        with (root / "child.out").open("w") as out:
            proc = subprocess.Popen(
                [sys.executable, __file__, "--child", str(data_dir)], stdout=out
            )
            try:
                while not (line := (root / "child.out").read_text()).endswith("\n"):
                    if proc.poll() is not None:
                        raise RuntimeError(f"the writer exited with {proc.returncode}")
                    time.sleep(0.2)
                written = int(line)
            finally:
                proc.send_signal(signal.SIGKILL)
                proc.wait()
        store = MessageStore(config(data_dir))
        started = time.perf_counter()
        report = store.start()
        restart = time.perf_counter() - started
        messages = sum(store.max_offset(t, q) for t in store.topics() for q in store.queue_ids(t))
        store.shutdown()
        read = sequential_read_seconds(
            data_dir / "commitlog", report.commitlog.end_offset - report.commitlog.scanned_from
        )
    finally:
        shutil.rmtree(data_dir, ignore_errors=True)
    past = report.commitlog.end_offset - report.commitlog.scanned_from
    return {
        "commitlog_bytes": written,
        "bytes_past_checkpoint": past,
        "messages": messages,
        "clean_exit": report.clean_exit,
        "records_scanned": report.commitlog.records_scanned,
        "redispatched_bytes": report.redispatched_bytes,
        "restart_seconds": round(restart, 2),
        "sequential_read_seconds": round(read, 3),
        "restart_mb_per_s": round(past / restart / 1e6, 1),
        "ratio_restart_vs_sequential_read": round(restart / read, 1),
    }


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        child(Path(sys.argv[2]))
        return
    root = Path(tempfile.mkdtemp(prefix="tmq-recovery-"))
    try:
        rounds = [one_round(root) for _ in range(ROUNDS)]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    median = {
        key: statistics.median(float(r[key]) for r in rounds)
        for key in (
            "restart_seconds",
            "sequential_read_seconds",
            "restart_mb_per_s",
            "ratio_restart_vs_sequential_read",
        )
    }
    print(json.dumps({"bench": "recovery", **rounds[0], **median, "rounds": rounds}))


if __name__ == "__main__":
    main()
