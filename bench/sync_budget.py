"""Where a single SYNC send's CPU goes: the per-message budget by thread (decision 940).

Runs ``threads`` senders, each sending one 1 KiB message per ``put_message`` call under SYNC
flush, for ``SECONDS``, and reads every thread's CPU from ``/proc/self/task/*/schedstat``
before and after (the senders waiting at a barrier, then finished and alive): the senders',
the group commit flusher's (``tmq-group-commit``), the dispatcher's and the rest. Printed per
message (µs), with the context switches a message of every thread (voluntary: a sleep, on
the batch's futex or for the GIL; involuntary: preempted), the group commit round's wall time
and the part of it spent in ``fdatasync`` (decision 1100: the rest is the round's writers
coming back), the rate, and its ratio to ``dd oflag=dsync bs=1K`` measured right before
(issue 14's goal is 4x; on a quiet disk that leaves about 36 µs of CPU a message).

``python bench/sync_budget.py [--commitlog-mib=N] [THREADS ...]`` (default 1 8 64), in a
temporary directory under ``$TMPDIR`` (``TMPDIR=/dev/shm`` takes the disk out: what is left is
the CPU). ``--commitlog-mib`` makes the CommitLog files smaller than the store's 1 GiB, for a
disk short of room. Each sender sends ``WARMUP`` messages before the clock starts: a new
store's first sends create its files and are not what is measured.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.flush_modes import dd_dsync_1k
from tiered.config import StoreConfig
from tiered.hot.group_commit import GATE_NAME
from tiered.record import ENGINE_NAME, Message
from tiered.store import MessageStore

MSG = 1024
SECONDS = 3.0
WARMUP = 50


def _threads() -> dict[int, tuple[float, int, int]]:
    """CPU seconds and voluntary and involuntary context switches of every thread of this
    process. The CPU is the scheduler's own count in ns (``schedstat``): ``stat``'s is in
    ticks of 10 ms, and 64 senders of a 3 s run use a few ticks each."""
    out: dict[int, tuple[float, int, int]] = {}
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/schedstat") as f:
                ran_ns = int(f.read().split()[0])
            with open(f"/proc/self/task/{task}/status") as f:
                sw = dict(line.split(":", 1) for line in f if "ctxt_switches" in line)
        except FileNotFoundError:
            continue
        out[int(task)] = (
            ran_ns / 1e9,
            int(sw["voluntary_ctxt_switches"]),
            int(sw["nonvoluntary_ctxt_switches"]),
        )
    return out


def run(root: Path, threads: int, file_bytes: int | None) -> dict[str, object]:
    limit = dd_dsync_1k(root)
    sizes = {} if file_bytes is None else {"commitlog_file_size": file_bytes}
    store = MessageStore(StoreConfig(data_dir=root / f"s{threads}", flush="sync", **sizes))
    store.start()
    group = store.commitlog.group_commit
    body = os.urandom(MSG)
    counts = [0] * threads
    sender_ids: set[int] = set()
    go = threading.Barrier(threads + 1)
    done = threading.Barrier(threads + 1)
    stopping = threading.Event()
    finished: list[int] = []

    errors: list[BaseException] = []

    def sender(i: int) -> None:
        sender_ids.add(threading.get_native_id())
        m = Message(topic="bench", queue_id=i % 8, body=body, properties={"UNIQ_KEY": f"{i:032X}"})
        try:
            for _ in range(WARMUP):  # the store's first sends (files, queues) are not measured
                store.put_message(m)
            go.wait()
            n = 0
            while not stopping.is_set():
                store.put_message(m)
                n += 1
        except BaseException as e:  # a full disk, say: end the run instead of hanging it
            errors.append(e)
            go.abort()
            done.abort()
            finished.append(i)
            return
        counts[i] = n
        finished.append(i)
        with contextlib.suppress(threading.BrokenBarrierError):
            done.wait()  # alive until the main thread has read every thread's CPU

    workers = [threading.Thread(target=sender, args=(i,)) for i in range(threads)]
    for w in workers:
        w.start()
    names = {t.native_id: t.name for t in threading.enumerate()}
    # Every sender warmed up and waiting (using no CPU) before the first reading: read while
    # 64 senders run, the reading itself waits for the GIL for most of the run.
    while go.n_waiting < threads and not errors:
        time.sleep(0.01)
    before = _threads()
    fsyncs0, fsync_s0 = group.flushes, group.fsync_seconds
    try:
        go.wait()
    except threading.BrokenBarrierError:
        stopping.set()
    started = time.perf_counter()
    time.sleep(SECONDS)
    stopping.set()
    while len(finished) < threads:
        time.sleep(0.001)
    seconds = time.perf_counter() - started
    after = _threads()
    rounds, fsync_s = group.flushes - fsyncs0, group.fsync_seconds - fsync_s0
    with contextlib.suppress(threading.BrokenBarrierError):
        done.wait()
    for w in workers:
        w.join()
    if errors:
        store.shutdown()
        raise errors[0]
    fsyncs, requests = group.flushes, group.requests
    store.shutdown()
    n = max(1, sum(counts))
    by_role: dict[str, float] = {"senders": 0.0, "flusher": 0.0, "dispatcher": 0.0, "other": 0.0}
    switches = [0, 0]
    for tid, (cpu, vol, invol) in after.items():
        was = before.get(tid, (0.0, 0, 0))
        used = cpu - was[0]
        switches[0] += vol - was[1]
        switches[1] += invol - was[2]
        name = names.get(tid, "")
        if tid in sender_ids:
            role = "senders"
        elif name.startswith("tmq-group-commit"):
            role = "flusher"
        elif name == "tmq-dispatcher":
            role = "dispatcher"
        else:
            role = "other"
        by_role[role] += used
    return {
        "threads": threads,
        "msgs_per_s": round(n / seconds),
        "dd_dsync_1k_writes_per_s": round(limit),
        "ratio": round(n / seconds / limit, 2),
        "msgs_per_fsync": round(requests / max(1, fsyncs), 1),
        # A group commit round's wall time, and the part of it the flusher spent in fdatasync
        # (the rest it waited for the round's writers to come back and append).
        "round_us": round(seconds / max(1, rounds) * 1e6, 1),
        "fsync_us_per_round": round(fsync_s / max(1, rounds) * 1e6, 1),
        "cpu_us_per_msg": {k: round(v / n * 1e6, 1) for k, v in by_role.items()},
        "cpu_us_per_msg_total": round(sum(by_role.values()) / n * 1e6, 1),
        # Voluntary (a sleep: the futex wait, a GIL wait) and involuntary, per message.
        "switches_per_msg": [round(switches[0] / n, 2), round(switches[1] / n, 2)],
    }


def main() -> None:
    mib = [int(a.split("=", 1)[1]) for a in sys.argv[1:] if a.startswith("--commitlog-mib=")]
    file_bytes = mib[0] << 20 if mib else None
    counts = [int(a) for a in sys.argv[1:] if not a.startswith("--")] or [1, 8, 64]
    root = Path(tempfile.mkdtemp(prefix="tmq-sync-budget-"))
    try:
        runs = [run(root, t, file_bytes) for t in counts]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(
        json.dumps(
            {
                "bench": "sync_budget",
                "dir": str(root.parent),
                "engine": ENGINE_NAME,
                "gate": GATE_NAME,
                "commitlog_file_bytes": file_bytes,
                "load": [round(x, 2) for x in os.getloadavg()],
                "runs": runs,
            }
        )
    )


if __name__ == "__main__":
    main()
