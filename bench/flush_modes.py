"""How the CommitLog's SYNC flush could be done, measured alone on the store's own disk
(decision 775).

A round writes ``k`` records of 1,100 bytes (a 1 KiB message's record) at fresh offsets of a
64 MiB file and makes them durable, as one group commit round does (8 single senders share an
fsync about 7.5 ways). Ways compared, alternated round-robin so that the disk's swings land on
all of them:

- ``mmap``: stores through a shared mapping, then ``fdatasync`` (what the store does for small
  appends: after writeback every cleaned page takes a write-protect fault on its next store);
- ``pwrite``: one ``pwrite`` of the round's bytes, then ``fdatasync`` (RocketMQ's
  transientStorePool: write the buffer with ``FileChannel.write``, then force);
- ``odsync``: one ``pwrite`` on an ``O_DSYNC`` descriptor;

each into a file preallocated as the store does (``posix_fallocate``: unwritten extents, which
ext4 converts in its journal when a block is first written back) and into a file written with
zeros first (RocketMQ's ``warmMappedFile``). The limit is ``dd oflag=dsync bs=1K`` in the same
run, before each set. Reported per way: rounds a second (median of the sets), the wall time of
the durability step, and the thread's CPU for the write and for the sync per round.

``python bench/flush_modes.py [DIR]`` (default: a temporary directory beside the repo's, on the
disk the store uses).
"""

from __future__ import annotations

import json
import mmap
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RECORD = 1100
FILE = 64 << 20
ROUNDS = 300
SETS = 3
ROUND_RECORDS = (1, 8)
WAYS = ("mmap", "pwrite", "odsync")
PREALLOCATIONS = ("fallocate", "zeros")


def dd_dsync_1k(root: Path, count: int = 500) -> float:
    """``dd oflag=dsync bs=1K`` into ``root``: writes a second with one sync per 1 KiB write,
    the rate without group commit (also ``bench/sync_budget.py``'s limit)."""
    path = root / "dd"
    started = time.perf_counter()
    subprocess.run(
        ["dd", "if=/dev/zero", f"of={path}", "bs=1024", f"count={count}", "oflag=dsync"],
        check=True,
        capture_output=True,
    )
    seconds = time.perf_counter() - started
    path.unlink()
    return count / seconds


def one(root: Path, way: str, prealloc: str, k: int) -> dict[str, float]:
    path = root / f"{way}-{prealloc}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        if prealloc == "fallocate":
            os.posix_fallocate(fd, 0, FILE)
        else:
            zeros = bytes(1 << 20)
            for at in range(0, FILE, len(zeros)):
                os.pwrite(fd, zeros, at)
        os.fsync(fd)
        if way == "odsync":
            os.close(fd)
            fd = os.open(path, os.O_RDWR | os.O_DSYNC)
        mm = mmap.mmap(fd, FILE, mmap.MAP_SHARED) if way == "mmap" else None
        record = os.urandom(RECORD)
        chunk = record * k
        pos = 0
        write_cpu = sync_cpu = sync_wall = 0.0
        started = time.perf_counter()
        for _ in range(ROUNDS):
            c0 = time.thread_time()
            if mm is not None:
                for _ in range(k):
                    mm[pos : pos + RECORD] = record
                    pos += RECORD
            else:
                os.pwrite(fd, chunk, pos)
                pos += len(chunk)
            c1 = time.thread_time()
            w0 = time.perf_counter()
            if way != "odsync":
                os.fdatasync(fd)
            sync_wall += time.perf_counter() - w0
            sync_cpu += time.thread_time() - c1
            write_cpu += c1 - c0
        seconds = time.perf_counter() - started
        if mm is not None:
            mm.close()
    finally:
        os.close(fd)
        path.unlink()
    return {
        "rounds_per_s": round(ROUNDS / seconds),
        # odsync: the write is the durability step, so its wall and CPU count as the write's.
        "sync_wall_us": round(sync_wall / ROUNDS * 1e6, 1),
        "write_cpu_us": round(write_cpu / ROUNDS * 1e6, 2),
        "sync_cpu_us": round(sync_cpu / ROUNDS * 1e6, 2),
    }


def main() -> None:
    parent = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parent.parent
    root = Path(tempfile.mkdtemp(prefix="tmq-flush-modes-", dir=parent))
    runs: dict[str, list[dict[str, float]]] = {}
    limits: list[float] = []
    try:
        for _ in range(SETS):
            limits.append(dd_dsync_1k(root))
            for k in ROUND_RECORDS:
                for prealloc in PREALLOCATIONS:
                    for way in WAYS:
                        name = f"k{k}_{way}_{prealloc}"
                        runs.setdefault(name, []).append(one(root, way, prealloc, k))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    limit = statistics.median(limits)
    result: dict[str, object] = {
        "bench": "flush_modes",
        "record_bytes": RECORD,
        "rounds": ROUNDS,
        "dd_dsync_1k_writes_per_s": [round(x) for x in limits],
        "load": [round(x, 2) for x in os.getloadavg()],
    }
    for name, sets in runs.items():
        med = {key: statistics.median(s[key] for s in sets) for key in sets[0]}
        result[name] = {
            **med,
            "ratio_rounds_vs_dd": round(med["rounds_per_s"] / limit, 2),
            "sets_rounds_per_s": [s["rounds_per_s"] for s in sets],
        }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
