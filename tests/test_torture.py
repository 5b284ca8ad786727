"""The torture run (bench/torture.py) as tests: producers with Apache's client, replays from
offset 0, a consumer group, the offloader with tiny segments, a TTL, ``verify --repair`` in a
loop, broker kill -9 and object-store faults from the fault proxy, all at once, against a real
broker and LocalStack. Afterwards nothing acknowledged is lost, duplicated or seen with a gap."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parent.parent


def torture(tmp_path: Path, s3: Any, *args: str, timeout: float) -> dict[str, Any]:
    if s3.kind != "localstack":
        pytest.skip("the torture run needs LocalStack")
    done = subprocess.run(
        [
            sys.executable,
            str(REPO / "bench" / "torture.py"),
            "--data",
            str(tmp_path),
            "--keep",
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
    )
    lines = done.stdout.strip().splitlines()
    assert lines, done.stderr[-3000:]
    result: dict[str, Any] = json.loads(lines[-1])
    assert done.returncode == 0, json.dumps(result, indent=1)
    return result


def assert_clean(result: dict[str, Any]) -> None:
    for key in (
        "lost",
        "duplicated",
        "gaps_seen_by_readers",
        "early_ends",
        "wrong_bodies_seen_by_readers",
        "read_twice_in_a_pass",
        "refused_in_range",
        "group_missing",
    ):
        assert result[key] == 0, (key, result)
    assert result["final_read_problems"] == [] and result["harness_errors"] == []
    assert result["verify"] == "OK"
    assert result["reader_passes"] > 0 and result["reader_messages"] > 0


def test_a_short_torture_run_loses_nothing_acknowledged(tmp_path: Path, s3: Any) -> None:
    """About a minute: one kill -9 and a few faults while everything else runs."""
    result = torture(
        tmp_path,
        s3,
        *("--seconds", "25", "--ttl", "600", "--kill-min", "10", "--kill-max", "14"),
        *("--fault-min", "3", "--fault-max", "6"),
        timeout=400,
    )
    assert_clean(result)
    assert result["kills"] >= 1 and sum(result["faults"].values()) >= 1
    assert result["acknowledged"] > 500


@pytest.mark.slow
def test_three_minutes_of_torture_with_expiry_lose_nothing_acknowledged(
    tmp_path: Path, s3: Any
) -> None:
    """Three minutes with a TTL that expires the oldest part of the topic while it runs."""
    result = torture(
        tmp_path,
        s3,
        *("--seconds", "180", "--ttl", "60", "--kill-min", "20", "--kill-max", "40"),
        timeout=900,
    )
    assert_clean(result)
    assert result["kills"] >= 3 and sum(result["faults"].values()) >= 5
    assert result["expired_by_ttl"] > 0, "retention removed the oldest part"
