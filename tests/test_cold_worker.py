"""The cold worker: segment uploads and cold reads in a child process, bounded, restarted after a
crash, with every durability rule of the offloader kept (a kill -9 of the worker loses nothing)."""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from offload.offloader import Offloader, OffloadPolicy
from offload.verify import OK, verify_queue
from tiered.cold.fetcher import ColdFetcher
from tiered.cold.manifest import queue_prefix
from tiered.cold.segment import SegmentError
from tiered.cold.storage import ObjectStore, open_store
from tiered.cold.worker import (
    READ_HEDGE_S,
    READ_NICE,
    WORKER_NICE,
    ColdWorker,
    WorkerBusyError,
    run_job,
)
from tiered.config import StoreConfig
from tiered.record import Message
from tiered.store import MessageStore


def _sleep(tier: ObjectStore, seconds: float) -> float:
    """A job that only waits (run in the child: a module-level function)."""
    time.sleep(seconds)
    return seconds


def _priority(tier: ObjectStore) -> int:
    """The nice value of the job thread that runs this (Linux: a thread's own)."""
    return os.getpriority(os.PRIO_PROCESS, 0)


def _fail(tier: ObjectStore, key: str) -> None:
    raise SegmentError(f"{key}: damaged on purpose")


@pytest.fixture
def tier_url(s3: Any, bucket: str) -> str:
    return f"s3://{bucket}/tier"


@pytest.fixture
def worker(s3: Any, tier_url: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[ColdWorker]:
    # The child reads its failpoints from the environment it is spawned with: each upload
    # pauses 1.5 s after its PUT landed and before it is verified, the window a kill hits.
    monkeypatch.setenv("TMQ_FAILPOINTS", "offload.after_put=sleep:1.5")
    w = ColdWorker(tier_url, s3.storage_options(), threads=2, max_inflight=3)
    w.start()
    yield w
    w.close()


@pytest.fixture
def hot(tmp_path: Path, start_store: Callable[[StoreConfig], MessageStore]) -> MessageStore:
    return start_store(StoreConfig(data_dir=tmp_path / "hot", commitlog_file_size=256 << 10))


def fill(store: MessageStore, n: int) -> list[bytes]:
    rng = random.Random(5)
    bodies = [rng.randbytes(rng.randint(1, 600)) for _ in range(n)]
    for i, body in enumerate(bodies):
        store.put_message(Message(topic="t", queue_id=0, body=body, properties={"KEYS": f"k{i}"}))
    assert store.wait_dispatched(10)
    return bodies


def test_jobs_are_bounded_and_their_errors_come_back_as_raised(worker: ColdWorker) -> None:
    running = [worker.submit(_sleep, 1.0) for _ in range(3)]
    with pytest.raises(WorkerBusyError):
        worker.submit(_sleep, 0.0, block=False)
    assert [f.result(timeout=20) for f in running] == [1.0, 1.0, 1.0]
    with pytest.raises(SegmentError, match="damaged on purpose"):
        worker.submit(_fail, "seg-1").result(timeout=20)
    assert worker.submit(_sleep, 0.0, block=False).result(timeout=20) == 0.0


def test_kill_9_of_the_worker_mid_upload_loses_nothing(
    worker: ColdWorker, hot: MessageStore, tier_url: str, s3: Any
) -> None:
    bodies = fill(hot, 600)
    tier = open_store(tier_url, s3.storage_options())
    offloader = Offloader(
        hot, tier, "c", "b", OffloadPolicy(segment_max_messages=250), runner=worker
    )
    prefix = queue_prefix("c", "b", "t", 0)
    outcome: dict[str, Any] = {}
    thread = threading.Thread(target=lambda: outcome.update(r=offloader.offload_queue("t", 0)))
    thread.start()
    # Wait until a segment object is in the bucket while its upload is not finished (the worker
    # sleeps at the failpoint after its PUT), then kill the worker as the kernel would.
    deadline = time.monotonic() + 30
    while not tier.list(f"{prefix}segments/") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert tier.list(f"{prefix}segments/"), "no upload started"
    killed = worker.pid
    assert killed is not None
    os.kill(killed, signal.SIGKILL)
    thread.join(timeout=60)
    assert not thread.is_alive()

    result = outcome["r"]
    assert result.messages == 600 and result.watermark == 600
    assert worker.restarts == 1 and worker.pid != killed
    manifest = offloader.manifest("t", 0, refresh=True)
    # Redone under the same key: every object in the bucket is one the manifest names.
    assert sorted(o.key for o in tier.list(f"{prefix}segments/")) == sorted(
        s.key for s in manifest.segments
    )
    verdict = verify_queue(tier, "c", "b", "t", 0, lock=offloader.queue_lock("t", 0), deep=True)
    assert verdict.status == OK, verdict

    # Read back through the (restarted) worker: every body, in order.
    fetcher = ColdFetcher(tier, "c", "b", runner=worker)
    read: list[bytes] = []
    offset = 0
    while offset < 600:
        messages, offset = fetcher.get("t", 0, offset, 100)
        read += [m.body for m in messages]
    fetcher.close()
    assert read == bodies


def test_a_cold_read_cut_off_by_a_crash_is_served_by_the_next_worker(
    worker: ColdWorker, hot: MessageStore, tier_url: str, s3: Any
) -> None:
    bodies = fill(hot, 300)
    tier = open_store(tier_url, s3.storage_options())
    Offloader(hot, tier, "c", "b").offload_queue("t", 0)  # in-process: no failpoint pause
    before = ColdFetcher(tier, "c", "b", runner=worker, read_timeout_s=30)
    first, _ = before.get("t", 0, 0, 10)
    before.close()
    assert [m.body for m in first] == bodies[:10]
    pid = worker.pid
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    after = ColdFetcher(tier, "c", "b", runner=worker, read_timeout_s=30)  # an empty cache
    again, nxt = after.get("t", 0, 0, 300)
    after.close()
    assert [m.body for m in again] == bodies and nxt == 300
    assert worker.restarts == 1


def test_the_worker_runs_below_the_brokers_cpu_priority(tmp_path: Path) -> None:
    """Every job thread of the child, and of the child that replaces a crashed one, runs
    ``WORKER_NICE`` steps below the broker: a replay's CPU must not keep an append from a core."""
    assert WORKER_NICE > 0
    mine = os.getpriority(os.PRIO_PROCESS, 0)
    w = ColdWorker(f"file://{tmp_path}/tier", threads=3)
    w.start()
    try:
        futures = [w.submit(_sleep, 0.3) for _ in range(3)]  # keep all threads busy at once
        seen = {run_job(w, _priority) for _ in range(4)}
        assert seen == {min(19, mine + WORKER_NICE)}
        for f in futures:
            f.result()
        pid = w.pid
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while (w.pid == pid or w.restarts == 0) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert w.restarts == 1
        assert run_job(w, _priority) == min(19, mine + WORKER_NICE)
    finally:
        w.close()
    unniced = ColdWorker(f"file://{tmp_path}/tier", nice=0)
    unniced.start()
    try:
        assert run_job(unniced, _priority) == mine
    finally:
        unniced.close()


def _maps(pid: int | None) -> str:
    return Path(f"/proc/{pid}/maps").read_text()


def test_the_worker_imports_its_preload_modules_before_its_first_job(tmp_path: Path) -> None:
    """The upload job's modules (numpy, the record engine) are loaded at the worker's start,
    not by the first upload's unpickling in the loop that receives every job (decision 631);
    without ``preload`` they are not (the first job pays for them)."""
    from offload.segment_upload import WORKER_PRELOAD
    from tiered.cold.worker import warm_up

    numpy_core = "_multiarray_umath"
    for preload, loaded in ((WORKER_PRELOAD, True), ((), False)):
        w = ColdWorker(f"file://{tmp_path}/tier", preload=preload)
        w.start()
        try:
            run_job(w, warm_up)  # received after the preload: the child's loop runs it first
            assert (numpy_core in _maps(w.pid)) is loaded
        finally:
            w.close()


def _run_buffer_faults(tier: ObjectStore, rounds: int) -> list[int]:
    """Page faults of this job thread in each of ``rounds`` rounds that allocate, fill and free
    what a read-ahead run does (its GET, the writer's room, its replies: 4-6 MiB each, moving a
    little from run to run as the runs' record counts do)."""
    import resource

    faults = []
    for r in range(rounds):
        before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
        sizes = ((4 << 20) + r % 3 * (700 << 10), (5 << 20) + r * 7 % 5 * (300 << 10), 5 << 20)
        held = [bytearray(size) for size in sizes]
        for buffer in held:
            buffer[::4096] = b"\x01" * len(range(0, len(buffer), 4096))  # touch every page
        del held
        faults.append(resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before)
    return faults


def test_the_worker_reuses_the_memory_its_runs_free(tmp_path: Path) -> None:
    """A read-ahead run's buffers come from the heap the previous runs freed, not from fresh
    pages (decision 840): with glibc's defaults most runs of a replay took 1,000-3,000 page
    faults, a third of the reply writer's CPU."""
    pages = (4 + 5 + 5) * (1 << 20) / 4096
    w = ColdWorker(f"file://{tmp_path}/tier", threads=1)
    w.start()
    try:
        faults = run_job(w, _run_buffer_faults, 10)
    finally:
        w.close()
    assert faults[0] > pages * 0.9  # the first round's pages are new: the count sees them
    # Once the heap has grown to the runs' peak, none.
    assert max(faults[4:]) < pages * 0.05, faults


def test_cold_reads_run_below_the_workers_other_jobs(tmp_path: Path) -> None:
    """A cold read (``read=True``) runs on the child's read threads at ``READ_NICE`` below the
    broker, the lowest priority (decision 841); an upload keeps ``WORKER_NICE``, so an offload
    does not stall behind produce. The restarted child's read threads too."""
    assert READ_NICE > WORKER_NICE
    mine = os.getpriority(os.PRIO_PROCESS, 0)
    w = ColdWorker(f"file://{tmp_path}/tier", threads=2)
    w.start()
    try:
        busy = [w.submit(_sleep, 0.3, read=True) for _ in range(2)]  # both read threads at once
        assert {run_job(w, _priority, read=True) for _ in range(4)} == {min(19, mine + READ_NICE)}
        assert {run_job(w, _priority) for _ in range(4)} == {min(19, mine + WORKER_NICE)}
        for f in busy:
            f.result()
        pid = w.pid
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while (w.pid == pid or w.restarts == 0) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert run_job(w, _priority, read=True) == min(19, mine + READ_NICE)
    finally:
        w.close()


def _starved_at(tier: ObjectStore, nice: int, log: str, seconds: float) -> int:
    """A read that records each run in ``log`` and, on a thread at ``nice``, takes ``seconds``:
    what a nice-19 read thread's job takes when produce keeps both cores busy (measured: 2.7 s
    for a 4 MiB run, bench/cold_starve.py, decision 950). Returns its thread's nice."""
    mine = os.getpriority(os.PRIO_PROCESS, 0)  # Linux: the calling thread's
    with open(log, "a") as f:
        f.write(f"{mine}\n")
    if mine == nice:
        time.sleep(seconds)
    return mine


def test_a_starved_cold_read_runs_again_at_the_workers_nice_within_its_deadline(
    tmp_path: Path,
) -> None:
    """A read the nice-19 read threads have not answered within ``READ_HEDGE_S`` runs again on
    threads at ``WORKER_NICE``: it is answered well within the broker's read deadline (2.5 s),
    once; the starved copy's late answer is dropped, and a read answered in time runs once."""
    mine = os.getpriority(os.PRIO_PROCESS, 0)
    read_nice, worker_nice = min(19, mine + READ_NICE), min(19, mine + WORKER_NICE)
    assert READ_HEDGE_S < 2.5 / 2
    w = ColdWorker(f"file://{tmp_path}/tier", threads=2)
    w.start()
    try:
        run_job(w, _priority, read=True)  # started
        slow, fast = tmp_path / "slow.log", tmp_path / "fast.log"
        t0 = time.monotonic()
        starved = [w.submit(_starved_at, read_nice, str(slow), 3.0, read=True) for _ in range(3)]
        assert [f.result(timeout=10) for f in starved] == [worker_nice] * 3
        assert time.monotonic() - t0 < 2.0  # within the deadline, with room
        time.sleep(3.5)  # the starved copies ended; their answers were not sent twice
        assert run_job(w, _priority, read=True) == read_nice  # replies still in step
        assert run_job(w, _starved_at, -100, str(fast), 0.0, read=True) == read_nice
        runs = slow.read_text().split()
        # Two read threads took two of the three; the third was answered by its copy before
        # a read thread was free, and was then dropped there.
        assert runs.count(str(worker_nice)) == 3 and runs.count(str(read_nice)) == 2
        assert fast.read_text().split() == [str(read_nice)]
    finally:
        w.close()


def test_no_read_runs_again_when_read_hedging_is_off(tmp_path: Path) -> None:
    """``read_hedge_s=0``: a slow read is answered by its nice-19 copy alone (decision 841's
    behaviour, kept for who wants it)."""
    mine = os.getpriority(os.PRIO_PROCESS, 0)
    read_nice = min(19, mine + READ_NICE)
    w = ColdWorker(f"file://{tmp_path}/tier", threads=2, read_hedge_s=0)
    w.start()
    try:
        log = tmp_path / "slow.log"
        assert run_job(w, _starved_at, read_nice, str(log), 1.0, read=True) == read_nice
        assert log.read_text().split() == [str(read_nice)]
    finally:
        w.close()
