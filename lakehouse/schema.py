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
 keys                  array<string>          ``KEYS`` split at spaces (RocketMQ keeps one string)
 tags                  string                 ``TAGS``, or null
 properties            map<string,string>     every property, system ones included
 body                  binary                 the body, byte for byte
 body_size             int                    len(body)
 born_ts               timestamp (UTC)        producer's clock; null when the producer set none
 store_ts              timestamp (UTC)        broker's clock at append
 born_host             string                 ``ip:port``
 store_host            string                 ``ip:port``
 reconsume_times       int                    delivery attempts before it was stored (retries)
 segment               string                 the segment object's key in the tier (lineage)
 deliver_ts            timestamp (UTC)        a delay message's delivery time; null otherwise
 export_ts             timestamp (UTC)        when the export batch that wrote the row began
 store_date            date                   partition column: the UTC date of ``store_ts``
====================  =====================  ===================================================

Timestamps carry a time zone (``timestamp`` in Delta, not ``timestamp_ntz``): Spark refuses
delta-rs tables with the NTZ feature (delta-rs issue #2882), and every reader agrees on UTC.
The row is built from the columnar decode of a run of records (``tiered/columnar.py``, checked
against the reference codec), column by column: no Python object per row.

``deliver_ts`` (issue 15, delay messages) was added to version 2 as a nullable column: a table
created before it gains the column on the next export (``tables.LakeTable``), its older rows
read it as null, and nothing else changes.

Version 2 of the row (``keys`` as an array, null ``born_ts``) replaced version 1 (``keys`` one
string, ``born_ts`` 1970-01-01 when unset); see ``tables.LakeTable`` for tables of version 1.
"""

from __future__ import annotations

import datetime as dt

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from tiered.record import KEY_SEPARATOR, PROPERTY_KEYS, PROPERTY_TAGS, PROPERTY_UNIQ_KEY

# RocketMQ's delivery time of a delay message (ms since the epoch), kept by the delivered copy.
PROPERTY_DELIVER_TIME = "__STARTDELIVERTIME"
DELIVER_COLUMN = "deliver_ts"

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
        pa.field("keys", pa.list_(pa.string()), nullable=False),
        pa.field("tags", pa.string()),
        pa.field("properties", pa.map_(pa.string(), pa.string())),
        pa.field("body", pa.binary(), nullable=False),
        pa.field("body_size", pa.int32(), nullable=False),
        pa.field("born_ts", _TS),
        pa.field("store_ts", _TS, nullable=False),
        pa.field("born_host", pa.string(), nullable=False),
        pa.field("store_host", pa.string(), nullable=False),
        pa.field("reconsume_times", pa.int32(), nullable=False),
        pa.field("segment", pa.string(), nullable=False),
        pa.field(DELIVER_COLUMN, _TS),
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
    "keys array<string> not null, tags string, properties map<string,string>, "
    "body binary not null, body_size int not null, born_ts timestamp, store_ts timestamp not null, "
    "born_host string not null, store_host string not null, reconsume_times int not null, "
    "segment string not null, deliver_ts timestamp, store_date date not null"
)


def store_date(store_timestamp_ms: int) -> dt.date:
    """The partition a message belongs to: the UTC date of its store timestamp."""
    return _EPOCH + dt.timedelta(days=store_timestamp_ms // _MS_PER_DAY)


def split_keys(keys: pa.Array) -> pa.Array:
    """``KEYS`` strings as lists, as ``tiered.record.split_keys`` splits them: at single spaces,
    empty pieces dropped; a message without keys has an empty list."""
    pieces = pc.split_pattern(keys.fill_null(""), KEY_SEPARATOR)
    values = pieces.flatten()
    nonempty = pc.greater(pc.binary_length(values), 0)
    parents = np.asarray(pc.list_parent_indices(pieces))
    counts = np.bincount(parents[np.asarray(nonempty)], minlength=len(keys))
    offsets = np.zeros(len(keys) + 1, np.int32)
    np.cumsum(counts, out=offsets[1:])
    return pa.ListArray.from_arrays(pa.array(offsets), values.filter(nonempty))


def lookup(props: pa.MapArray, name: str) -> pa.Array:
    """Each row's value of property ``name``, or null: ``pc.map_lookup(props, name, "first")``
    for maps whose names are unique within a row (the decode keeps one entry per name), in
    one comparison over all the names instead of a search per row."""
    offsets = np.asarray(props.offsets)
    hits = np.flatnonzero(pc.equal(props.keys, name).to_numpy(zero_copy_only=False))
    hits = hits[(hits >= offsets[0]) & (hits < offsets[-1])]
    index = np.full(len(props), -1, np.int64)
    index[np.searchsorted(offsets, hits, "right") - 1] = hits
    return props.items.take(pa.array(index, mask=index < 0))


def _micros(ms: pa.Array) -> pa.Array:
    return pc.multiply(ms, 1000).cast(_TS)


def rows(records: pa.RecordBatch, broker: str, segment: str) -> pa.RecordBatch:
    """The source rows of ``records`` (``tiered.columnar.RECORD_SCHEMA``, decoded from one
    segment object of ``broker``), built column by column."""
    n = records.num_rows
    props = records.column("properties")
    body = records.column("body")
    born = records.column("born_timestamp")
    store_ms = records.column("store_timestamp")
    return pa.RecordBatch.from_arrays(
        [
            records.column("topic"),
            pa.repeat(pa.scalar(broker), n),
            records.column("queue_id"),
            records.column("queue_offset"),
            records.column("commitlog_offset"),
            lookup(props, PROPERTY_UNIQ_KEY),
            split_keys(lookup(props, PROPERTY_KEYS)),
            lookup(props, PROPERTY_TAGS),
            props,
            body,
            pc.binary_length(body),
            # 0 is what a producer that sets no born time leaves: unknown, so null.
            _micros(pc.if_else(pc.equal(born, 0), pa.scalar(None, pa.int64()), born)),
            _micros(store_ms),
            records.column("born_host"),
            records.column("store_host"),
            records.column("reconsume_times"),
            pa.repeat(pa.scalar(segment), n),
            _micros(lookup(props, PROPERTY_DELIVER_TIME).cast(pa.int64())),
            pc.divide(store_ms, _MS_PER_DAY).cast(pa.int32()).cast(pa.date32()),
        ],
        schema=SOURCE_SCHEMA,
    )
