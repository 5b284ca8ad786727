"""Delivered delay messages in Delta: a broker delivers them, archives them to its tier, the
export (real Spark) writes them, and delta-rs reads back their original born time and their
delivery time (``deliver_ts``); messages that were never delayed read ``deliver_ts`` null. A
table created before ``deliver_ts`` existed gains the column and keeps its rows."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import grpc
import pyarrow as pa
from broker_harness import Standalone, send_batches
from deltalake import DeltaTable
from rocketmq.grpc_protocol import definition_pb2 as d
from rocketmq.grpc_protocol import service_pb2 as s
from rocketmq.grpc_protocol import service_pb2_grpc

from broker import admin_pb2 as apb
from lakehouse.export import Export, ExportConfig
from lakehouse.schema import DELIVER_COLUMN, PARTITION_COLUMN, TABLE_SCHEMA
from lakehouse.tables import TABLE_PROPERTIES

QUICK = ["--offload-interval", "1", "--upload-after", "1s"]


def now_ms() -> int:
    return time.time_ns() // 1_000_000


def archived(node: Standalone, topic: str, count: int) -> bool:
    described = node.admin().GetTopic(apb.GetTopicRequest(name=topic), timeout=10)
    return bool(sum(q.tier_watermark for q in described.queues) >= count)


def test_delivered_delay_messages_reach_delta_with_born_and_delivery_times(
    tmp_path: Path, spark: Any
) -> None:
    data = tmp_path / "data"
    lake = tmp_path / "lake"
    # A table of the row before deliver_ts: the export must add the column, not fail.
    old = TABLE_SCHEMA.remove(TABLE_SCHEMA.get_field_index(DELIVER_COLUMN))
    DeltaTable.create(
        str(lake / "lake-plain"),
        old,
        partition_by=[PARTITION_COLUMN],
        configuration=TABLE_PROPERTIES,
    )
    node = Standalone(data, extra=QUICK, env={"TMQ_BROKER_TIMER_MAX_DELAY_MS": "600000"}).start()
    try:
        for name, kind in (("lake-delay", "DELAY"), ("lake-plain", "NORMAL")):
            node.create_topic(name, queues=1, message_type=kind, tiered=True)
        stub = service_pb2_grpc.MessagingServiceStub(grpc.insecure_channel(node.endpoint))
        born = now_ms() - 5_000  # the producer's clock, well before the send and the delivery
        expected: dict[str, tuple[int, int]] = {}  # key -> (born ms, delivery ms)
        request = s.SendMessageRequest()
        for i in range(20):
            key, due = f"d{i}", now_ms() + 2_000 + 100 * i
            m = request.messages.add(topic=d.Resource(name="lake-delay"), body=key.encode())
            m.system_properties.message_id = os.urandom(16).hex().upper()
            m.system_properties.message_type = d.DELAY
            m.system_properties.keys.append(key)
            m.system_properties.born_timestamp.FromMilliseconds(born + i)
            m.system_properties.delivery_timestamp.FromMilliseconds(due)
            expected[key] = (born + i, due)
        reply = stub.SendMessage(request, timeout=30)
        assert reply.status.code == d.OK, reply.status
        send_batches(node.endpoint, "lake-plain", [(b"p", f"p{i}", "x") for i in range(5)])
        deadline = time.monotonic() + 60
        while not (archived(node, "lake-delay", 20) and archived(node, "lake-plain", 5)):
            assert time.monotonic() < deadline, "the delivered messages were never archived"
            time.sleep(0.5)
    finally:
        node.stop()
    config = ExportConfig(f"file://{data}/tier", str(lake))
    assert Export(spark, config).run(once=True, timeout=180).rows == 25

    rows = DeltaTable(str(lake / "lake-delay")).to_pyarrow_table().to_pylist()
    assert sorted(r["keys"][0] for r in rows) == sorted(expected)
    for r in rows:
        born_ms, due_ms = expected[r["keys"][0]]
        assert int(r["born_ts"].timestamp() * 1000) == born_ms, "the original born time"
        assert int(r[DELIVER_COLUMN].timestamp() * 1000) == due_ms, "the delivery time"
        assert int(r["store_ts"].timestamp() * 1000) >= due_ms, "stored when delivered"
    plain = DeltaTable(str(lake / "lake-plain"))
    assert plain.schema().to_arrow().field(DELIVER_COLUMN).type == pa.timestamp("us", tz="UTC")
    plain_rows = plain.to_pyarrow_table().to_pylist()
    assert len(plain_rows) == 5 and all(r[DELIVER_COLUMN] is None for r in plain_rows)
    # Spark reads the new column as a Spark timestamp (the file-list route).
    table = DeltaTable(str(lake / "lake-delay"))
    frame = spark.read.option("basePath", str(lake / "lake-delay")).parquet(*table.file_uris())
    assert frame.where(f"{DELIVER_COLUMN} >= store_ts - interval 1 second").count() == 20
