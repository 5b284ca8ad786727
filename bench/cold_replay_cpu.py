"""CPU per MB of a cold replay, in the broker's process and in the cold worker's.

On this machine (two cores, other sessions' work beside it) a replay's MB/s moves 2-3x between
runs of one build; its CPU per MB does not, so that is what an A/B of the cold read path
compares (decision 550's method, scripted here; decision 770). One process plays the broker:
it fills 40,960 1 KiB messages, offloads them to LocalStack in 8 MiB segments and replays the
48.4 MB three times through ``get_replies`` with ``bench/cold_read.py``'s fetcher settings,
measuring its own ``process_time`` and the worker's CPU (``/proc``, clock ticks: 10 ms, about
0.2 ms per MB here) around each replay.

    python bench/cold_replay_cpu.py [--tree DIR] [--get-batches N]

``--tree``: import tmq from another checkout (main's, for an A/B in one venv); ``--get-batches``:
the fetcher's ``GET_BATCHES`` (consecutive 1 MiB batches per ranged GET). Prints one JSON
object; about half a minute.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any


def _args() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tree", default=str(Path(__file__).resolve().parent.parent))
    parser.add_argument("--get-batches", type=int, default=0)
    parser.add_argument("--replays", type=int, default=3)
    return parser.parse_known_args()[0]


# At import, also in the spawned worker (it imports this module as its ``__main__``): the same
# tree on both sides.
sys.path.insert(0, _args().tree)

MESSAGES = 40_960
TICK = os.sysconf("SC_CLK_TCK")


def process_cpu(pid: int) -> float:
    """User and system CPU seconds of process ``pid`` (all its threads)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def main() -> None:
    args = _args()
    import tiered.cold.fetcher as fetcher_module
    from bench.cold_common import archive_mb, cold_archive, cold_fetcher, replay

    if args.get_batches:
        fetcher_module.GET_BATCHES = args.get_batches
    replays: list[dict[str, Any]] = []
    with cold_archive("tmq-cold-cpu-", MESSAGES, 8 << 20) as archive:
        worker = archive.worker
        assert worker.pid is not None
        for _ in range(args.replays):
            fetcher = cold_fetcher(archive.tier, worker)
            manifest = fetcher.manifest("cold", 1)
            mb = archive_mb(manifest)
            w0, b0, t0 = process_cpu(worker.pid), time.process_time(), time.perf_counter()
            replay(fetcher, manifest.end_offset)
            wall = time.perf_counter() - t0
            broker_s, worker_s = time.process_time() - b0, process_cpu(worker.pid) - w0
            fetcher.close()
            replays.append(
                {
                    "mb": round(mb, 1),
                    "broker_ms_per_mb": round(broker_s * 1e3 / mb, 2),
                    "worker_ms_per_mb": round(worker_s * 1e3 / mb, 2),
                    "mb_per_s": round(mb / wall, 1),
                }
            )
    print(
        json.dumps(
            {
                "bench": "cold_replay_cpu",
                "tree": args.tree,
                "get_batches": fetcher_module.GET_BATCHES,
                "replays": replays,
                "load_average_1m": round(os.getloadavg()[0], 1),
                "utc": time.strftime("%H:%M:%S", time.gmtime()),
            }
        )
    )


if __name__ == "__main__":
    main()
