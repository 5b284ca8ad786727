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


def test_check_finds_garbled_entries_in_an_older_index_file_rebuilds_it_and_exits_3(
    small_config,
) -> None:
    """A start checks only the newest IndexFile's entries (decision 687): garbage over an older
    file's entries passed ``tmq store check`` with exit 0 and kept losing keys. The check
    checks every file in full, names the damaged one, rebuilds it and exits 3; every key is
    found afterwards, and the next check is clean (decision 734)."""
    import random

    from conftest import brute_force_scan

    from tiered.store import MessageStore

    crash_after_writing(small_config.data_dir, 2500)  # kill -9: 3 IndexFiles
    msgs = brute_force_scan(small_config.commitlog_dir)
    files = sorted(
        (p for p in small_config.index_dir.iterdir() if not p.name.startswith(".")),
        key=lambda p: p.name.split("-")[1],
    )
    assert len(files) >= 3
    victim = files[1]
    with open(victim, "r+b") as f:  # entries 900-915 of a middle file
        f.seek(40 + small_config.index_hash_slots * 4 + 900 * 20)
        f.write(random.Random(734).randbytes(300))

    done = tmq("store", "check", "-d", str(small_config.data_dir), "--json")
    assert done.returncode == 3, done.stderr
    report = json.loads(done.stdout)
    assert len(report["index_files_damaged"]) == 1
    assert victim.name in report["index_files_damaged"][0]
    assert report["index_files_still_damaged"] == []
    assert not victim.exists(), "removed and rebuilt"

    again = tmq("store", "check", "-d", str(small_config.data_dir))
    assert again.returncode == 0, again.stderr
    assert "DAMAGED" not in again.stderr
    store = MessageStore(small_config)
    store.start()
    try:
        lost = [
            m.msg_id
            for m in msgs
            if [x.commitlog_offset for x in store.query_by_key(m.topic, f"key-{m.msg_id}")]
            != [m.commitlog_offset]
        ]
        assert not lost, f"{len(lost)} keys not found"
    finally:
        store.shutdown()
