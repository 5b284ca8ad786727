"""``tmq store check``, run as an operator runs it: a subprocess with its exit code and output."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from conftest import crash_after_writing, run_child

TMQ = [sys.executable, "-m", "cli.app"]


def tmq(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*TMQ, *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).resolve().parent.parent,
    )


def test_check_reports_a_crash_recovery_as_json(small_config) -> None:
    crash_after_writing(small_config.data_dir, 200)
    done = tmq("store", "check", "--data-dir", str(small_config.data_dir), "--json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["last_exit_clean"] is False
    assert sum(q["max_offset"] for q in report["queues"]) == 200
    assert report["recovery"]["corrupt_records"] == []
    again = json.loads(tmq("store", "check", "-d", str(small_config.data_dir), "--json").stdout)
    assert again["last_exit_clean"] is True, "check shuts the store down cleanly"


def test_check_on_a_locked_store_is_one_line_and_exit_1(small_config) -> None:
    holder = run_child(small_config.data_dir, "hold", "async")
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "ready"
        done = tmq("store", "check", "-d", str(small_config.data_dir))
    finally:
        holder.kill()
        holder.wait()
    assert done.returncode == 1
    assert done.stderr.count("\n") == 1 and "in use by another tmq process" in done.stderr
    assert "Traceback" not in done.stderr


def test_check_on_a_directory_without_a_store_is_exit_2(tmp_path) -> None:
    done = tmq("store", "check", "-d", str(tmp_path))
    assert done.returncode == 2 and "holds no tmq store" in done.stderr
