"""A local lake through a power loss (decision 1270), with real Spark and delta-rs.

delta-rs writes a local table without a single fsync, so an export that reported its rows could
come back from a power loss without them, and a commit cut by one (a torn ``_delta_log`` file)
made delta-rs refuse the whole table, or, cut at a line's end, dropped the commit's exported
offsets while keeping some of its files: the next export wrote those rows again. The lake here
sits on the power-loss filesystem (tests/powerloss_fs.py), which keeps only what was fsynced,
or is a real table whose newest commit is cut as a power loss cuts it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from conftest import S3Endpoint
from deltalake import DeltaTable
from test_lakehouse_bad_days import TOPIC, A, first_archive, table_rows
from test_power_loss import PowerLossMount, _need_fuse

from lakehouse.durable import QUARANTINE_DIR
from lakehouse.export import Export, ExportConfig
from lakehouse.tables import app_id


def test_an_export_that_returned_survives_a_power_loss(
    s3: S3Endpoint, bucket: str, spark: Any, tmp_path: Path
) -> None:
    """The lake on the power-loss filesystem: once ``run`` has returned its rows, the power
    goes out. The table must hold every row it reported, once, and its exported offset; on the
    old code nothing of it was durable (not the Parquet files, not the log, not the names)."""
    _need_fuse()
    tier_url, options = f"s3://{bucket}/tier", s3.storage_options()
    old = first_archive(tmp_path, tier_url, options)
    durable, mountpoint = tmp_path / "durable", tmp_path / "mnt"
    durable.mkdir()
    fs = PowerLossMount(mountpoint, durable)
    try:
        config = ExportConfig(tier_url, str(mountpoint / "lake"), [TOPIC], tier_options=options)
        assert Export(spark, config).run(once=True, timeout=300).rows == 200
        fs.crash()
    finally:
        fs.close()
    assert table_rows(durable / "lake") == old, "rows the export reported lost with the power"
    assert DeltaTable(str(durable / "lake" / TOPIC)).transaction_version(app_id(A)) == 200


def _cut_after_add(commit: Path) -> None:
    """Cut a commit as a power loss can, at a line's end: its ``commitInfo`` and ``add`` lines
    kept, its ``txn`` (the exported offset) lost."""
    lines = commit.read_bytes().split(b"\n")
    kinds = [next(iter(json.loads(line))) for line in lines]
    assert kinds[0] == "commitInfo" and "add" in kinds and kinds[-1] == "txn", kinds
    commit.write_bytes(b"\n".join(lines[: kinds.index("txn")]))


def _cut_mid_line(commit: Path) -> None:
    """Cut a commit at a 512-byte sector inside a line: part of its JSON."""
    data = commit.read_bytes()
    commit.write_bytes(data[: max(512, len(data) // 512 * 512) - 100])


@pytest.mark.parametrize("cut", [_cut_after_add, _cut_mid_line], ids=["at_a_line", "mid_line"])
def test_a_newest_commit_cut_by_a_power_loss_is_set_aside_and_its_rows_exported_once(
    s3: S3Endpoint, bucket: str, spark: Any, tmp_path: Path, cut: Any
) -> None:
    """The window fsync cannot close: delta-rs renames a commit into ``_delta_log`` before the
    export can fsync it, and a power loss in between may keep the name with part of the bytes.
    Cut mid-line, delta-rs refused every read of the table; cut at a line's end, the table read
    the commit's file without its exported offset, and the next export wrote its rows again.
    The export must set the torn commit aside (kept in ``_tmq_quarantine``) and export its rows
    once more, exactly once."""
    tier_url, options = f"s3://{bucket}/tier", s3.storage_options()
    old = first_archive(tmp_path, tier_url, options)
    lake = tmp_path / "lake"
    config = ExportConfig(tier_url, str(lake), [TOPIC], tier_options=options)
    assert Export(spark, config).run(once=True, timeout=300).rows == 200
    log_dir = lake / TOPIC / "_delta_log"
    head = max(log_dir.glob("*.json"))
    whole = head.read_bytes()
    cut(head)

    report = Export(spark, config).run(once=True, timeout=300)
    assert report.stopped == {} and report.rows == 200
    assert table_rows(lake) == old, "each row once"
    assert DeltaTable(str(lake / TOPIC)).transaction_version(app_id(A)) == 200
    kept = list((lake / TOPIC / QUARANTINE_DIR).iterdir())
    assert len(kept) == 1 and kept[0].name.startswith(head.name)
    assert whole.startswith(kept[0].read_bytes()), "the torn commit kept as it was found"


def test_a_whole_commit_and_an_empty_one_are_left_alone(
    s3: S3Endpoint, bucket: str, spark: Any, tmp_path: Path
) -> None:
    """Only a torn commit is set aside: a whole one stays (no second export of its rows), and a
    zero-length one (a power loss that kept the name and none of the bytes), which delta-rs
    reads as an empty version, stays too: the export writes its rows again on top of it."""
    tier_url, options = f"s3://{bucket}/tier", s3.storage_options()
    old = first_archive(tmp_path, tier_url, options)
    lake = tmp_path / "lake"
    config = ExportConfig(tier_url, str(lake), [TOPIC], tier_options=options)
    assert Export(spark, config).run(once=True, timeout=300).rows == 200
    assert Export(spark, config).run(once=True, timeout=300).rows == 0
    head = max((lake / TOPIC / "_delta_log").glob("*.json"))
    head.write_bytes(b"")
    assert Export(spark, config).run(once=True, timeout=300).rows == 200
    assert table_rows(lake) == old
    assert not (lake / TOPIC / QUARANTINE_DIR).exists()
