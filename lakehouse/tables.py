"""The lake: one Delta table per topic at ``{lake_root}/{topic}``, and its export progress.

Progress is kept in the table itself, as Delta app transactions (``txn`` actions), one per
archived queue: ``app_id = "tmq-export:{cluster}/{broker}/{topic}/{queue}"`` and
``version = the next queue offset to export`` (every offset below it is in the table, exactly
once). They are committed in the same transaction as the data files (kafka-delta-ingest's
pattern), so the table alone says how far the export got: a lost Spark checkpoint costs nothing.

Beside each, the archive those rows came from (decision 1240): ``app_id =
"tmq-export-archive:{cluster}/{broker}/{topic}/{queue}"`` and ``version`` = the manifest's
archive id as a number (``tiered.cold.manifest.ARCHIVE_ID``), 0 for an archive without one; set
in the same commit as the offset, so the two always describe the same rows. Tables exported
before it have none until their next commit of the queue. (Delta leaves a version's meaning to
the writer; only this exporter reads these.)

Table features: only what delta-rs, polars, DuckDB and Spark all read. Protocol (1, 2) with
``delta.appendOnly``; no deletion vectors, column mapping, timestamp_ntz or liquid clustering.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable

import pyarrow as pa
from deltalake import DeltaTable, QueryBuilder
from deltalake.exceptions import TableNotFoundError

from lakehouse.durable import make_table_dir, set_aside_torn_head, settle
from lakehouse.locations import Location
from lakehouse.schema import DELIVER_COLUMN, PARTITION_COLUMN, TABLE_SCHEMA
from lakehouse.tier import QueueRef

APP_ID_PREFIX = "tmq-export:"
ARCHIVE_APP_ID_PREFIX = "tmq-export-archive:"
TABLE_PROPERTIES = {
    # The export only appends; compaction (maintain) rewrites with data_change=false.
    "delta.appendOnly": "true",
    # Longer than any outage a replay may need to cover (kafka-delta-ingest's advice).
    "delta.logRetentionDuration": "interval 30 days",
    "delta.checkpointInterval": "100",
}


class TableVersionError(RuntimeError):
    """The table was written by an older tmq with a row format this export cannot append to."""


def app_id(queue: QueueRef) -> str:
    return APP_ID_PREFIX + queue.key


def archive_app_id(queue: QueueRef) -> str:
    return ARCHIVE_APP_ID_PREFIX + queue.key


def archive_version(archive: str) -> int:
    """An archive id (16 hex digits, below 2**63) as the version of its app transaction; 0 for
    an archive without one."""
    return int(archive, 16) if archive else 0


class LakeTable:
    """The Delta table of one topic."""

    def __init__(self, lake: Location, topic: str) -> None:
        self.topic = topic
        self.location = lake.child(topic)

    @property
    def uri(self) -> str:
        return self.location.delta_uri()

    def open(self) -> DeltaTable | None:
        """The table's latest snapshot, or None if it was never created."""
        try:
            return DeltaTable(self.uri, storage_options=self.location.delta_options() or None)
        except TableNotFoundError:
            return None

    def open_for_export(self) -> DeltaTable | None:
        """``open`` for the exporter, the table's writer: a newest commit a power loss tore is
        moved aside first (lakehouse/durable.py), so the table opens as of the commit before
        it and the export writes the torn commit's rows again."""
        set_aside_torn_head(self.location)
        return self.open()

    def open_or_create(self) -> DeltaTable:
        table = self.open_for_export()
        if table is not None:
            self.check_row_version(table)
            self.add_deliver_column(table)
            return table
        make_table_dir(self.location)
        # mode="ignore": if a concurrent exporter created it first, this is a no-op.
        created = DeltaTable.create(
            self.uri,
            TABLE_SCHEMA,
            mode="ignore",
            partition_by=[PARTITION_COLUMN],
            name=self.topic,
            description=f"tmq topic {self.topic}, exported from the cold tier",
            configuration=TABLE_PROPERTIES,
            storage_options=self.location.delta_options() or None,
        )
        settle(self.location, -1)
        return created

    def check_row_version(self, table: DeltaTable) -> None:
        """Refuse to append to a table of row version 1 (``keys`` one string, ``born_ts`` never
        null): Delta cannot change a column's type in place, and mixing the two would break
        every reader. The table is derived data: move it aside and export again."""
        fields = {f["name"]: f for f in json.loads(table.schema().to_json())["fields"]}
        keys = fields.get("keys", {}).get("type")
        if keys == "string":
            raise TableVersionError(
                f"table {self.topic} ({self.location.url}) has the row format of an older tmq "
                "(keys as one string); move it aside (e.g. rename it to "
                f"{self.topic}_v1) and run the export again: it rebuilds the table from the "
                "tier, from the oldest message the tier still retains"
            )

    def add_deliver_column(self, table: DeltaTable) -> None:
        """A table created before ``deliver_ts`` existed gains it (nullable, so its older rows
        read null): appending the same column twice is refused by Delta, so a concurrent
        exporter that added it first is no error."""
        if DELIVER_COLUMN in table.schema().to_arrow().names:
            return
        from deltalake.schema import Field, PrimitiveType

        before = table.version()
        try:
            table.alter.add_columns(
                Field(DELIVER_COLUMN, PrimitiveType("timestamp"), nullable=True)
            )
            settle(self.location, before)
        except Exception:
            table.update_incremental()
            if DELIVER_COLUMN not in table.schema().to_arrow().names:
                raise


def _versions(
    table: DeltaTable | None, queues: Iterable[QueueRef], name: Callable[[QueueRef], str]
) -> dict[str, int]:
    """The version of each queue's app transaction ``name(queue)``, where the table has one."""
    if table is None:
        return {}
    out = {}
    for queue in queues:
        version = table.transaction_version(name(queue))
        if version is not None:
            out[queue.key] = version
    return out


def exported_offsets(table: DeltaTable | None, queues: Iterable[QueueRef]) -> dict[str, int]:
    """The next offset to export of each queue that the table has app transactions for."""
    return _versions(table, queues, app_id)


def exported_archives(table: DeltaTable | None, queues: Iterable[QueueRef]) -> dict[str, str]:
    """The archive id each queue's exported rows came from ("" for an archive without one), for
    the queues whose table recorded one: a table exported before decision 1240 has none."""
    recorded = _versions(table, queues, archive_app_id)
    return {key: f"{version:016x}" if version else "" for key, version in recorded.items()}


def exported_segment(table: DeltaTable, queue: QueueRef, offset: int) -> str | None:
    """The ``segment`` (the tier object's key) the table's row of ``queue`` at ``offset`` was
    exported from, or None if the table has no such row. DataFusion skips the files whose
    statistics exclude the offset, so this reads one file or a few."""
    sql = (
        "select segment from t where broker = '{broker}' and queue_id = {queue_id} "
        "and queue_offset = {offset} limit 1"
    ).format(broker=queue.broker.replace("'", "''"), queue_id=int(queue.queue_id), offset=offset)
    result = pa.RecordBatchReader.from_stream(
        QueryBuilder().register("t", table).execute(sql)
    ).read_all()
    return None if result.num_rows == 0 else str(result.column("segment")[0].as_py())
