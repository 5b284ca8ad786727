"""The Delta row: one archived message as analysts see it (DESIGN.md, "Formats").

====================  =====================  ===================================================
 column                type                   meaning
====================  =====================  ===================================================
 topic                 string                 the topic (constant per table; kept for UNIONs)
 broker                string                 broker name: whose CommitLog the message was in
 queue_id              int                    queue within the topic
 queue_offset          bigint                 logical offset in (broker, topic, queue_id)
 commitlog_offset      bigint                 PHYSICALOFFSET; unique per broker
 msg_id                string                 the client's message id (``UNIQ_KEY``), or null
 keys                  string                 ``KEYS``: space-separated, as RocketMQ keeps them
 tags                  string                 ``TAGS``, or null
 properties            map<string,string>     every property, system ones included
 body                  binary                 the body, byte for byte
 body_size             int                    len(body)
 born_ts               timestamp (UTC)        producer's clock
 store_ts              timestamp (UTC)        broker's clock at append
 born_host             string                 ``ip:port``
 store_host            string                 ``ip:port``
 reconsume_times       int                    delivery attempts before it was stored (retries)
 segment               string                 the segment object's key in the tier (lineage)
 export_ts             timestamp (UTC)        when the export batch that wrote the row began
 store_date            date                   partition column: the UTC date of ``store_ts``
====================  =====================  ===================================================

Timestamps carry a time zone (``timestamp`` in Delta, not ``timestamp_ntz``): Spark refuses
delta-rs tables with the NTZ feature (delta-rs issue #2882), and every reader agrees on UTC.
The row is built from ``tiered.record.StoredMessage``, so the one record codec decides every
value.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence

import pyarrow as pa

from tiered.record import StoredMessage

PARTITION_COLUMN = "store_date"
_TS = pa.timestamp("us", tz="UTC")
_MS_PER_DAY = 86_400_000
_EPOCH = dt.date(1970, 1, 1)

# What the ``tmq`` data source returns: every column but export_ts, which the sink stamps.
SOURCE_SCHEMA = pa.schema(
    [
        pa.field("topic", pa.string(), nullable=False),
        pa.field("broker", pa.string(), nullable=False),
        pa.field("queue_id", pa.int32(), nullable=False),
        pa.field("queue_offset", pa.int64(), nullable=False),
        pa.field("commitlog_offset", pa.int64(), nullable=False),
        pa.field("msg_id", pa.string()),
        pa.field("keys", pa.string()),
        pa.field("tags", pa.string()),
        pa.field("properties", pa.map_(pa.string(), pa.string())),
        pa.field("body", pa.binary(), nullable=False),
        pa.field("body_size", pa.int32(), nullable=False),
        pa.field("born_ts", _TS, nullable=False),
        pa.field("store_ts", _TS, nullable=False),
        pa.field("born_host", pa.string(), nullable=False),
        pa.field("store_host", pa.string(), nullable=False),
        pa.field("reconsume_times", pa.int32(), nullable=False),
        pa.field("segment", pa.string(), nullable=False),
        pa.field(PARTITION_COLUMN, pa.date32(), nullable=False),
    ]
)
# The Delta table: the source row plus export_ts (partition column last, as Spark lays it out).
TABLE_SCHEMA = pa.schema(
    [
        *[f for f in SOURCE_SCHEMA if f.name != PARTITION_COLUMN],
        pa.field("export_ts", _TS, nullable=False),
        SOURCE_SCHEMA.field(PARTITION_COLUMN),
    ]
)
# What a Parquet data file holds: Delta keeps partition values in the log and the path only.
FILE_SCHEMA = TABLE_SCHEMA.remove(TABLE_SCHEMA.get_field_index(PARTITION_COLUMN))

# The same row as a Spark DDL string, for DataSource.schema(); must match SOURCE_SCHEMA.
SOURCE_DDL = (
    "topic string not null, broker string not null, queue_id int not null, "
    "queue_offset bigint not null, commitlog_offset bigint not null, msg_id string, "
    "keys string, tags string, properties map<string,string>, body binary not null, "
    "body_size int not null, born_ts timestamp not null, store_ts timestamp not null, "
    "born_host string not null, store_host string not null, reconsume_times int not null, "
    "segment string not null, store_date date not null"
)


def _host(host: tuple[str, int]) -> str:
    address, port = host
    return f"[{address}]:{port}" if ":" in address else f"{address}:{port}"


def store_date(store_timestamp_ms: int) -> dt.date:
    """The partition a message belongs to: the UTC date of its store timestamp."""
    return _EPOCH + dt.timedelta(days=store_timestamp_ms // _MS_PER_DAY)


def rows(messages: Sequence[StoredMessage], broker: str, segment: str) -> pa.RecordBatch:
    """The source rows of ``messages`` (decoded from one segment object of ``broker``)."""
    return pa.RecordBatch.from_pydict(
        {
            "topic": [m.topic for m in messages],
            "broker": [broker] * len(messages),
            "queue_id": [m.queue_id for m in messages],
            "queue_offset": [m.queue_offset for m in messages],
            "commitlog_offset": [m.commitlog_offset for m in messages],
            "msg_id": [m.msg_id for m in messages],
            "keys": [m.properties.get("KEYS") for m in messages],
            "tags": [m.tags for m in messages],
            "properties": [list(m.properties.items()) for m in messages],
            "body": [m.body for m in messages],
            "body_size": [len(m.body) for m in messages],
            # Milliseconds to microseconds: the Delta/Spark timestamp unit.
            "born_ts": [m.born_timestamp * 1000 for m in messages],
            "store_ts": [m.store_timestamp * 1000 for m in messages],
            "born_host": [_host(m.born_host) for m in messages],
            "store_host": [_host(m.store_host) for m in messages],
            "reconsume_times": [m.reconsume_times for m in messages],
            "segment": [segment] * len(messages),
            PARTITION_COLUMN: [m.store_timestamp // _MS_PER_DAY for m in messages],
        },
        schema=SOURCE_SCHEMA,
    )
