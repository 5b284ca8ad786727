"""Where a cold replay's time goes: a wall-clock and CPU budget per MB, per phase.

``bench/cold_replay_cpu.py`` counts CPU per MB; on this machine a replay's wall time is ten
times its CPU, so this asks where the rest goes. One process plays the broker (40,960 1 KiB
messages offloaded to LocalStack in 8 MiB segments, a cold worker, ``bench/cold_read.py``'s
fetcher settings) and replays the archive through ``get_replies`` while it times:

- in the cold worker, each fetch job's phases (``read_spans``' ranged GET, the record check,
  the reply writer, the cut), wall and thread CPU: wall minus CPU is the time the thread was
  ready but not running (nice 19 on a busy machine) or, for the GET, waiting on LocalStack;
- in the broker, each job from submit to result: what is not the worker's own time is the
  job's wait for a read thread, the pickling, the pipe and the reply thread's receive;
- the reader's own time: waiting for a batch (the read-ahead did not keep up) against taking
  its replies;
- the machine's: CPU per MB of the worker process, of LocalStack (its pid file) and of the whole
  machine, and the fraction of the machine's CPU time busy during the replay (decision 1111).

    python bench/cold_budget.py [--tree DIR] [--replays N]

Prints one JSON object; about half a minute.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any


def _args() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tree", default=str(Path(__file__).resolve().parent.parent))
    parser.add_argument("--replays", type=int, default=2)
    return parser.parse_known_args()[0]


# Also in the spawned worker, which imports this module as its ``__main__``.
sys.path.insert(0, _args().tree)

MESSAGES = 40_960
_LOG = os.environ.get("TMQ_COLD_BUDGET_LOG", "")


def timed_read_spans(store: Any, info: Any, first: int, entries: bytes, *rest: Any) -> Any:
    """``read_spans`` in the cold worker, each phase timed (wall and thread CPU) into the file
    ``TMQ_COLD_BUDGET_LOG`` names: a cold job, as the fetcher submits ``read_spans``."""
    import tiered.cold.segment as segment

    args = list(rest)
    if len(args) > 1 and args[1] is not None:
        args[1] = _timed_global("write_replies", args[1])
    return _timed_job(
        store, info, first, lambda s: segment.read_spans(s, info, first, entries, *args), "spans"
    )


def timed_read_segment(store: Any, info: Any, batch: int, *rest: Any) -> Any:
    """``read_segment`` (a whole segment with one GET, decision 1220), timed as
    ``timed_read_spans``: a cold job, as the fetcher submits ``read_segment``."""
    import tiered.cold.segment as segment

    args = list(rest)
    if args and args[0] is not None:
        args[0] = _timed_global("write_replies", args[0])
    read = lambda s: segment.read_segment(s, info, batch, *args)  # noqa: E731
    return _timed_job(store, info, 0, read, "segment")


def _timed_job(store: Any, info: Any, first: int, read: Any, kind: str) -> Any:
    """``read(store)`` in the cold worker, its GET, record check and reply writer timed (wall
    and thread CPU), the job logged into ``TMQ_COLD_BUDGET_LOG`` as ``[key, first]``."""
    import tiered.cold.segment as segment

    marks: dict[str, list[float]] = {}
    _TLS.marks = marks
    if not getattr(segment, "_budget_timed", False):  # once per worker: per thread below
        segment.check_span = _timed_global("check", segment.check_span)
        segment._budget_timed = True
    start_w, start_c = time.monotonic(), time.thread_time()
    result = read(_TimedStore(store, _timed_global("get", lambda *a: store.get_range(*a))))
    total_w, total_c = time.monotonic() - start_w, time.thread_time() - start_c
    spans = result[1] if isinstance(result, tuple) else result
    with open(_LOG, "a") as f:
        f.write(
            json.dumps(
                {
                    "job": [info.key, first],
                    "kind": kind,
                    "start": start_w,
                    "end": start_w + total_w,
                    "bytes": sum(s.size for s in spans),
                    "wall": total_w,
                    "cpu": total_c,
                    "phases": marks,
                }
            )
            + "\n"
        )
    return result


_TLS = threading.local()


def _timed_global(name: str, fn: Any) -> Any:
    """``fn`` timed into the calling thread's job's marks."""

    def inner(*a: Any, **k: Any) -> Any:
        w, c = time.monotonic(), time.thread_time()
        try:
            return fn(*a, **k)
        finally:
            m = _TLS.marks.setdefault(name, [0.0, 0.0])
            m[0] += time.monotonic() - w
            m[1] += time.thread_time() - c

    return inner


def _process_cpu(pid: int | None) -> float:
    """Seconds of CPU a process has used (user and system, clock ticks); 0 if unknown."""
    if pid is None:
        return 0.0
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _machine_cpu() -> tuple[float, float]:
    """Seconds of CPU used on the whole machine (all but idle and iowait), and in all."""
    with open("/proc/stat") as f:
        ticks = [int(x) for x in f.readline().split()[1:]]
    hz = os.sysconf("SC_CLK_TCK")
    return (sum(ticks) - ticks[3] - ticks[4]) / hz, sum(ticks) / hz


def _localstack_pid() -> int | None:
    """LocalStack's process: the one whose command line runs its runtime (whichever tree's
    ``localstack/manage.py`` started it: its pid file is in that tree)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if b"localstack.runtime.main" in cmdline:
            return int(entry.name)
    return None


class _TimedStore:
    def __init__(self, store: Any, get_range: Any) -> None:
        self._store = store
        self.get_range = get_range

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)


def main() -> None:
    args = _args()
    import tiered.cold.fetcher as fetcher_module
    from bench.cold_common import archive_mb, cold_archive, cold_fetcher, replay

    log_path = Path(tempfile.mkdtemp(prefix="tmq-cold-budget-")) / "jobs.jsonl"
    os.environ["TMQ_COLD_BUDGET_LOG"] = str(log_path)  # before the worker is spawned
    out: list[dict[str, Any]] = []
    try:
        with cold_archive("tmq-cold-budget-", MESSAGES, 8 << 20) as archive:
            tier, worker = archive.tier, archive.worker
            # The broker's side of every fetch job: submit to result.
            jobs: list[tuple[tuple[str, int], float, float]] = []
            jobs_lock = threading.Lock()
            real_run_job = fetcher_module.run_job

            timed_jobs = {
                fetcher_module.read_spans: timed_read_spans,
                getattr(fetcher_module, "read_segment", None): timed_read_segment,
            }

            def timed_run_job(runner: Any, fn: Any, *a: Any, **k: Any) -> Any:
                timed = timed_jobs.get(fn)
                t = time.monotonic()
                result = real_run_job(runner, timed or fn, *a, **k)
                if timed is not None:
                    first = a[1] if timed is timed_read_spans else 0
                    with jobs_lock:
                        jobs.append(((a[0].key, first), t, time.monotonic()))
                return result

            fetcher_module.run_job = timed_run_job  # type: ignore[assignment]
            for _ in range(args.replays):
                log_path.write_text("")
                jobs.clear()
                fetcher = cold_fetcher(tier, worker)
                real_wait = fetcher._wait
                waited = [0.0]

                def timed_wait(
                    what: str, future: Any, _w: Any = real_wait, waited: list[float] = waited
                ) -> Any:
                    t = time.monotonic()
                    try:
                        return _w(what, future)
                    finally:
                        waited[0] += time.monotonic() - t

                fetcher._wait = timed_wait  # type: ignore[method-assign]
                manifest = fetcher.manifest("cold", 1)
                mb = archive_mb(manifest)
                ls_pid = _localstack_pid()
                ls0, w0, m0 = _process_cpu(ls_pid), _process_cpu(worker.pid), _machine_cpu()
                c0, t0 = time.process_time(), time.monotonic()
                replay(fetcher, manifest.end_offset)
                wall = time.monotonic() - t0
                broker_cpu = time.process_time() - c0
                ls1, w1, m1 = _process_cpu(ls_pid), _process_cpu(worker.pid), _machine_cpu()
                fetcher.close()
                time.sleep(0.5)
                child = [json.loads(line) for line in log_path.read_text().splitlines()]
                by_job = {tuple(c["job"]): c for c in child}
                queue = transfer = 0.0
                for job, t_submit, t_result in jobs:
                    c = by_job.get(job)
                    if c is None:
                        continue
                    queue += max(0.0, c["start"] - t_submit)
                    transfer += max(0.0, t_result - c["end"])
                phases: dict[str, list[float]] = {}
                for c in child:
                    for name, (w, cpu) in c["phases"].items():
                        p = phases.setdefault(name, [0.0, 0.0])
                        p[0] += w
                        p[1] += cpu
                job_wall = sum(c["wall"] for c in child)
                job_cpu = sum(c["cpu"] for c in child)
                named_w = sum(w for w, _ in phases.values())
                named_c = sum(c for _, c in phases.values())
                per_mb = 1e3 / mb  # seconds in all -> ms per MB

                def r(x: float, per_mb: float = per_mb) -> float:
                    return round(x * per_mb, 2)

                out.append(
                    {
                        "mb": round(mb, 1),
                        "mb_per_s": round(mb / wall, 1),
                        "wall_ms_per_mb": r(wall),
                        "reader_waiting_for_batches_ms_per_mb": r(waited[0]),
                        "broker_cpu_ms_per_mb": r(broker_cpu),
                        # Decision 1111: the whole machine's CPU per MB, and who used it.
                        "worker_process_cpu_ms_per_mb": r(w1 - w0),
                        "localstack_cpu_ms_per_mb": r(ls1 - ls0) if ls_pid else None,
                        "machine_cpu_ms_per_mb": r(m1[0] - m0[0]),
                        "machine_busy_fraction": round(
                            (m1[0] - m0[0]) / max(1e-9, m1[1] - m0[1]), 2
                        ),
                        "fetch_jobs": len(child),
                        # Decision 1220: jobs that read a whole segment with one GET.
                        "whole_segment_jobs": sum(1 for c in child if c["kind"] == "segment"),
                        "jobs_in_parallel": round(job_wall / wall, 2),
                        # Summed over the jobs (they overlap): each phase's wall and thread CPU.
                        "worker_job_ms_per_mb": {"wall": r(job_wall), "cpu": r(job_cpu)},
                        "worker_phases_ms_per_mb": {
                            **{n: {"wall": r(w), "cpu": r(c)} for n, (w, c) in phases.items()},
                            "rest": {"wall": r(job_wall - named_w), "cpu": r(job_cpu - named_c)},
                        },
                        "job_queued_before_worker_ms_per_mb": r(queue),
                        "job_reply_to_broker_ms_per_mb": r(transfer),
                    }
                )
    finally:
        shutil.rmtree(log_path.parent, ignore_errors=True)
    print(
        json.dumps(
            {
                "bench": "cold_budget",
                "tree": args.tree,
                "replays": out,
                "load_average_1m": round(os.getloadavg()[0], 1),
                "utc": time.strftime("%H:%M:%S", time.gmtime()),
            }
        )
    )


if __name__ == "__main__":
    main()
