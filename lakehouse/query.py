"""``tmq lakehouse query "SQL"``: SQL over the lake with delta-rs (DataFusion), no Spark.

Every table under the lake root is registered under its topic's name, so analysts write
``select tags, count(*) from orders group by tags``. Topic names with ``-`` or ``%`` need
double quotes in SQL (``from "order-events"``).
"""

from __future__ import annotations

import pyarrow as pa
from deltalake import DeltaTable, QueryBuilder

from lakehouse.locations import Location
from lakehouse.status import lake_topics
from lakehouse.tables import LakeTable


class QueryError(ValueError):
    """The SQL could not be run; the message says why (DataFusion's own words)."""


def run_query(lake: Location, sql: str) -> pa.Table:
    """Run ``sql`` over the latest snapshot of every topic table; the result as Arrow."""
    builder = QueryBuilder()
    for topic in lake_topics(lake):
        table = LakeTable(lake, topic)
        builder.register(
            topic, DeltaTable(table.uri, storage_options=table.location.delta_options() or None)
        )
    try:
        return pa.RecordBatchReader.from_stream(builder.execute(sql)).read_all()
    except Exception as e:  # DataFusion raises plain Exceptions for SQL and planning errors
        message = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise QueryError(message) from None
