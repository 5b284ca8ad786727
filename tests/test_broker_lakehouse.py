"""A standalone broker configured with ``[lakehouse] enabled = true`` runs the continuous export
beside itself: offloaded messages appear in Delta without anyone running an export, and the
broker reports how fresh the export is."""

from __future__ import annotations

import json
import time
from pathlib import Path

from broker_harness import Standalone, send_batches, tmq
from deltalake import DeltaTable


def test_the_broker_runs_the_export_and_reports_its_freshness(tmp_path: Path) -> None:
    node = Standalone(
        tmp_path / "data",
        extra=["--offload-interval", "1", "--upload-after", "1s", "--metrics-port", "0"],
        env={"TMQ_LAKEHOUSE_ENABLED": "true", "TMQ_LAKEHOUSE_TRIGGER_SECONDS": "2"},
    ).start()
    try:
        ns = node.namesrv
        assert (
            tmq("topic", "create", "lake-orders", "-n", ns, "-q", "2", "--tiered").returncode == 0
        )
        sent = send_batches(
            node.endpoint, "lake-orders", [(f"o{i}".encode(), f"k{i}", "t") for i in range(300)]
        )
        table = tmp_path / "data" / "lake" / "lake-orders"
        deadline = time.monotonic() + 240  # the child's Spark starts first
        rows = 0
        while rows < len(sent):
            assert time.monotonic() < deadline, f"{rows} of {len(sent)} rows exported"
            time.sleep(2)
            if (table / "_delta_log").is_dir():
                rows = DeltaTable(str(table)).to_pyarrow_table(columns=["msg_id"]).num_rows
        ids = DeltaTable(str(table)).to_pyarrow_table(columns=["msg_id"]).column(0).to_pylist()
        assert sorted(ids) == sorted(i for i, _ in sent), "each message once"

        # Measured once per trigger: the first figures may predate the last commit.
        deadline = time.monotonic() + 60
        seen = []
        while not seen or seen[-1] != 0.0:
            assert time.monotonic() < deadline, seen
            time.sleep(2)
            status = json.loads(tmq("status", "-n", ns, "--json").stdout)
            freshness = status["brokers"][0]["export_freshness_seconds"] or {}
            if "lake-orders" in freshness:
                seen.append(freshness["lake-orders"])
        assert all(s >= 0 for s in seen), "seconds behind: the export is caught up at 0"
        # The child's log lives in the broker's data dir, not in its working directory.
        assert (tmp_path / "data" / "lakehouse-export.log").is_file()
    finally:
        node.stop()
