"""Every bench in bench/, one after the other, and one JSON summary line (docs/performance.md).

    python bench/all.py                  # short parameters: a few minutes on a 2-core machine
    python bench/all.py --runs 3         # each bench three times; medians reported
    python bench/all.py --full           # each bench's own (long) parameters, three runs
    python bench/all.py offload cold_read   # only these

Each bench runs in its own process (as ``python bench/NAME.py`` would), its output kept in
``--out`` (a directory; a temporary one by default). In short mode the bench's module-level sizes
are set smaller before its ``main()`` runs (``SHORT`` below says which); a bench whose constant
is gone is run with its own and says so in ``short_overrides_missing``. Of several runs, every
number of the bench's JSON is the median of the runs (``statistics.median``; the middle one of
three), so one lucky run moves nothing. The summary names the machine and the date, and each
bench's ratio to its limit stays under the bench's own field names.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
BENCHES = sorted(p.stem for p in (REPO / "bench").glob("*.py") if p.stem not in ("all", "__init__"))

# Short mode: module constants set before main(), and command-line arguments. Sized so that the
# whole set runs in a few minutes on this 2-core machine.
SHORT: dict[str, tuple[dict[str, Any], list[str]]] = {
    "cold_read": ({"BASE": 5_000}, []),
    "dispatch_pass": ({"ROUNDS": 3}, []),
    "export": ({"MESSAGES": 8_000, "RUNS": 1, "FRESHNESS_PROFILES": ["low"]}, []),
    "offload": ({"MESSAGES": 60_000}, []),
    "produce_grpc": ({"SECONDS": 3.0}, []),
    # recovery: its own size (1 GiB; about a minute): its writer is a child process that
    # imports the module afresh, so a constant set here would not reach it.
    "replication": ({"SECONDS": 2.0}, []),
    "store_append": (
        {"ASYNC_MESSAGES": 100_000, "SINGLE_MESSAGES": 20_000, "SYNC_SECONDS": 2.0},
        [],
    ),
    "timer": ({}, ["8000", "8"]),
    "torture": ({}, ["--seconds", "45"]),
    "transaction": ({"ROUNDS": 2}, []),
}
# A bench that has not finished by then is stopped and reported as failed.
TIMEOUT_S = {"short": 600, "full": 3600}


def machine() -> dict[str, Any]:
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / (1 << 30)
    return {
        "cpus": os.cpu_count(),
        "cpu_model": model,
        "memory_gib": round(mem_gib, 1),
        "os": platform.platform(),
        "python": platform.python_version(),
    }


def launcher(name: str, overrides: dict[str, Any]) -> str:
    """Python source that runs bench ``name`` with ``overrides`` set on its module first, and
    reports the names it did not find on stderr (the bench changed; the run goes on)."""
    return (
        "import importlib, json, sys\n"
        f"sys.path.insert(0, {str(REPO)!r})\n"
        f"module = importlib.import_module('bench.{name}')\n"
        f"overrides = json.loads({json.dumps(json.dumps(overrides))})\n"
        "missing = [k for k in overrides if not hasattr(module, k)]\n"
        "for k, v in overrides.items():\n"
        "    setattr(module, k, v)\n"
        "print('TMQ_BENCH_MISSING ' + json.dumps(missing), file=sys.stderr, flush=True)\n"
        "module.main()\n"
    )


def stop_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM to the bench's process group (its servers too), SIGKILL 10 s later."""
    for sig, wait in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(wait)
            return
        except subprocess.TimeoutExpired:
            continue


def run_one(name: str, full: bool, out: Path, run: int) -> dict[str, Any]:
    """One run of one bench: its last JSON line, or why there is none."""
    overrides, args = ({}, []) if full else SHORT.get(name, ({}, []))
    stdout = out / f"{name}.{run}.out"
    stderr = out / f"{name}.{run}.err"
    started = time.monotonic()
    with stdout.open("w") as so, stderr.open("w") as se:
        proc = subprocess.Popen(
            [sys.executable, "-c", launcher(name, overrides), *args],
            cwd=REPO,
            stdout=so,
            stderr=se,
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # its brokers and proxies are stopped with it
        )
        try:
            code: int | None = proc.wait(timeout=TIMEOUT_S["full" if full else "short"])
        except BaseException:  # timed out, or this run was interrupted: stop the bench whole
            stop_group(proc)
            code = None
            if not isinstance(sys.exc_info()[1], subprocess.TimeoutExpired):
                raise
    seconds = round(time.monotonic() - started, 1)
    missing: list[str] = []
    for line in stderr.read_text(errors="replace").splitlines():
        if line.startswith("TMQ_BENCH_MISSING "):
            missing = json.loads(line.split(" ", 1)[1])
    result: dict[str, Any] | None = None
    for line in reversed(stdout.read_text(errors="replace").splitlines()):
        if line.startswith("{"):
            try:
                result = json.loads(line)
                break
            except json.JSONDecodeError:
                continue
    if code != 0 or result is None:
        why = "timed out" if code is None else f"exit code {code}"
        return {"error": f"{why}; see {stderr}", "wall_seconds": seconds}
    result["wall_seconds"] = seconds
    if missing:
        result["short_overrides_missing"] = missing
    return result


def median_of(runs: list[dict[str, Any]]) -> Any:
    """Field by field: the median of numbers, the first run's value of anything else (nested
    objects field by field too)."""
    first = runs[0]
    out: dict[str, Any] = {}
    for key, value in first.items():
        values = [r.get(key) for r in runs]
        if isinstance(value, bool) or value is None:
            out[key] = value
        elif isinstance(value, int | float) and all(
            isinstance(v, int | float) and not isinstance(v, bool) for v in values
        ):
            m = statistics.median(values)
            out[key] = round(m, 3) if isinstance(m, float) else m
        elif isinstance(value, dict) and all(isinstance(v, dict) for v in values):
            out[key] = median_of(values)
        else:
            out[key] = value
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("benches", nargs="*", help=f"which (default: all of {', '.join(BENCHES)})")
    p.add_argument("--full", action="store_true", help="each bench's own parameters, 3 runs")
    p.add_argument("--runs", type=int, help="runs per bench (default 1; 3 with --full)")
    p.add_argument("--out", type=Path, help="where each run's output is kept")
    args = p.parse_args(argv)
    unknown = [b for b in args.benches if b not in BENCHES]
    if unknown:
        p.error(f"no such bench: {', '.join(unknown)}")
    runs = args.runs or (3 if args.full else 1)
    out = args.out or Path(tempfile.mkdtemp(prefix="tmq-bench-all-"))
    out.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {}
    failed: list[str] = []
    for name in args.benches or BENCHES:
        done = []
        for run in range(runs):
            r = run_one(name, args.full, out, run)
            print(f"{name} run {run + 1}/{runs}: {json.dumps(r)}", file=sys.stderr, flush=True)
            if "error" in r:
                failed.append(name)
                results[name] = r
                break
            done.append(r)
        else:
            results[name] = {**median_of(done), "runs": runs}
    print(
        json.dumps(
            {
                "bench": "all",
                "mode": "full" if args.full else "short",
                "runs_per_bench": runs,
                "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                "machine": machine(),
                "failed": failed,
                "results": results,
            }
        )
    )


if __name__ == "__main__":
    main()
