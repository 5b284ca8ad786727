"""The ``tmq`` PySpark data source: the cold tier as a batch or streaming table.

    spark.readStream.format("tmq")
        .option("tier_url", "s3://bucket/tier")
        .option("topics", "orders,payments")
        .load()

It reads manifests and segment objects straight from the object store and never calls a broker.

Offsets. A streaming offset is the next queue offset of every archived queue, keyed
``cluster/broker/topic/queue`` (``tier.QueueRef.key``): ``{"c1/broker-a/orders/0": 1200, …}``.
Segments have no gaps, so ``[start, end)`` of a queue is exactly ``end - start`` messages.

Partitions. A slice is part of one segment object (``SegmentSlice``): its offset-table entries
and records are read with ranged GETs (``SegmentReader``) and decoded as one columnar run
(``tiered/columnar.py``) into Arrow record batches. Slices are cut to about
``bytesPerPartition``, so a 64 MiB segment spreads over several cores, and small consecutive
slices are packed into one task of about that size (``SlicePack``), so a batch of a hundred
one-second segments costs one task, not a hundred.

Admission control. pyspark 4.0's ``latestOffset()`` takes no arguments, so the reader keeps
its own position (the end of the last planned batch) and admits whole segments, oldest first
across queues, until ``maxBytesPerTrigger`` or ``maxSegmentsPerTrigger`` is reached (always at
least one). A months-long backfill therefore runs as a sequence of bounded micro-batches.

Options:

======================  =====================================================================
 tier_url                the tier root (``file://…`` or ``s3://bucket/prefix``); required
 tier_options            JSON fsspec options (endpoint_url, …); default: from AWS_* env
 topics                  comma-separated topics; default: every archived topic
 startingOffsets         ``earliest`` (default) or JSON ``{queue key: offset}``; used by a new
                         query only (a restarted one resumes from its checkpoint). Queues it
                         does not name start at their earliest retained offset.
 endingOffsets           ``latest`` (default) or JSON ``{queue key: offset}``: never read past
 maxBytesPerTrigger      bytes of segment data per micro-batch (default 256 MiB)
 maxSegmentsPerTrigger   segments per micro-batch (default: no limit)
 bytesPerPartition       target bytes per Spark task (default 32 MiB)
======================  =====================================================================
"""

from __future__ import annotations

import heapq
import itertools
import json
import logging
import os
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlparse

import botocore.session
import numpy as np
import pyarrow as pa
from botocore.config import Config
from pyspark.sql.datasource import (
    DataSource,
    DataSourceReader,
    DataSourceStreamReader,
    InputPartition,
)
from pyspark.sql.types import StructType

from lakehouse import schema
from lakehouse.locations import Location
from lakehouse.tier import ManifestCache, QueueRef, discover
from tiered.cold.manifest import QueueManifest
from tiered.cold.segment import SegmentError, SegmentInfo, SegmentReader
from tiered.cold.storage import ObjectStore, open_store
from tiered.columnar import decode_run
from tiered.record import RecordError

log = logging.getLogger(__name__)

NAME = "tmq"
DEFAULT_MAX_BYTES_PER_TRIGGER = 256 << 20
DEFAULT_BYTES_PER_PARTITION = 32 << 20
# An export batch spreads over every core, but not in packs smaller than this.
MIN_PACK_BYTES = 4 << 20
# Bytes of records fetched per ranged GET inside a task, one span decoded while the next is
# fetched: bounds a task's memory (two spans), and small enough that most of a segment's GETs
# overlap its decoding.
READ_SPAN_BYTES = 4 << 20
# Spans fetched ahead of the decode, each GET on a thread of its own: one GET in flight left
# a task waiting on S3 for about a third of its time (LocalStack, 2 cores); two still left the
# task at a third of what four parallel GETs fetch (decision 341).
FETCH_AHEAD = 4
# fsspec options the direct S3 reader understands; a tier with any other option is read
# through its store (s3fs) alone.
_S3_OPTIONS = frozenset({"endpoint_url", "key", "secret", "token", "client_kwargs"})


class SourceOptionError(ValueError):
    """An option of the ``tmq`` source is missing or malformed."""


def _offsets(name: str, raw: str | None, default: str) -> dict[str, int] | None:
    """Parse startingOffsets/endingOffsets; None means the default (earliest / latest)."""
    if raw is None or raw.strip() == default:
        return None
    try:
        parsed = json.loads(raw)
        if not isinstance(parsed, dict):
            raise TypeError("not an object")
        out = {str(k): int(v) for k, v in parsed.items()}
        for key in out:
            QueueRef.parse(key)
    except (ValueError, TypeError) as e:
        raise SourceOptionError(
            f'{name}: expected {default!r} or JSON {{"cluster/broker/topic/queue": offset}}: {e}'
        ) from None
    return out


def _positive(options: Mapping[str, str], name: str, default: int | None) -> int | None:
    raw = options.get(name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise SourceOptionError(f"{name}: {raw!r} is not a whole number") from None
    if value <= 0:
        raise SourceOptionError(f"{name}: must be positive, got {value}")
    return value


@dataclass(slots=True, frozen=True)
class SourceOptions:
    tier: Location
    topics: frozenset[str] | None
    starting: dict[str, int] | None
    ending: dict[str, int] | None
    max_bytes_per_trigger: int | None
    max_segments_per_trigger: int | None
    bytes_per_partition: int

    @classmethod
    def parse(cls, options: Mapping[str, str]) -> SourceOptions:
        url = options.get("tier_url")
        if not url:
            raise SourceOptionError("option tier_url is required (file://… or s3://bucket/prefix)")
        try:
            extra = json.loads(options.get("tier_options") or "{}")
        except ValueError as e:
            raise SourceOptionError(f"tier_options: not JSON: {e}") from None
        topics_raw = options.get("topics")
        topics = (
            frozenset(t.strip() for t in topics_raw.split(",") if t.strip()) if topics_raw else None
        )
        return cls(
            tier=Location.of(url, extra),
            topics=topics or None,
            starting=_offsets("startingOffsets", options.get("startingOffsets"), "earliest"),
            ending=_offsets("endingOffsets", options.get("endingOffsets"), "latest"),
            max_bytes_per_trigger=_positive(
                options, "maxBytesPerTrigger", DEFAULT_MAX_BYTES_PER_TRIGGER
            ),
            max_segments_per_trigger=_positive(options, "maxSegmentsPerTrigger", None),
            bytes_per_partition=_positive(options, "bytesPerPartition", DEFAULT_BYTES_PER_PARTITION)
            or DEFAULT_BYTES_PER_PARTITION,
        )


class SegmentSlice(InputPartition):
    """One Spark task: queue offsets ``[first, end)`` of one segment object."""

    def __init__(self, queue_key: str, segment: dict[str, Any], first: int, end: int) -> None:
        super().__init__((queue_key, segment["key"], first, end))
        self.queue_key = queue_key
        self.segment = segment
        self.first = first
        self.end = end

    @property
    def bytes(self) -> int:
        """About how many bytes of the segment object the slice covers."""
        info = self.segment
        return int(info["size"]) * (self.end - self.first) // max(1, int(info["count"]))


class SlicePack(InputPartition):
    """One Spark task: consecutive slices, together about ``bytesPerPartition``. Packing keeps
    a micro-batch of many small segments (a low-latency offload makes one per queue every
    second) to a task or two, instead of paying a task's fixed cost per segment."""

    def __init__(self, slices: list[SegmentSlice]) -> None:
        super().__init__([s.value for s in slices])
        self.slices = slices


def pack(slices: list[SegmentSlice], target_bytes: int) -> list[SlicePack]:
    packs: list[SlicePack] = []
    current: list[SegmentSlice] = []
    size = 0
    for s in slices:
        estimate = s.bytes
        if current and size + estimate > target_bytes:
            packs.append(SlicePack(current))
            current, size = [], 0
        current.append(s)
        size += estimate
    if current:
        packs.append(SlicePack(current))
    return packs


def balanced_packs(slices: list[SegmentSlice], cores: int) -> list[SlicePack]:
    """The packs of one export batch, one Spark task each: one pack per core, of equal bytes
    (fewer when the batch is below ``MIN_PACK_BYTES`` a core), so that every core works until
    the batch ends and no core waits for Spark to hand it a second task (on this machine the
    hand-over between two tasks of one worker took seconds, as long as a task's own work). A
    slice is cut at the offset where its pack is full (slices are offset ranges, so any cut is
    exact)."""
    cores = max(1, cores)
    total = sum(s.bytes for s in slices)
    count = max(1, min(cores, total // MIN_PACK_BYTES))
    target = -(-total // count)
    packs: list[SlicePack] = []
    current: list[SegmentSlice] = []
    room = target
    for part in slices:
        rest: SegmentSlice | None = part
        while rest is not None:
            per_offset = max(1, int(rest.segment["size"])) / max(1, int(rest.segment["count"]))
            fit = int(room // per_offset)
            if fit >= rest.end - rest.first or len(packs) == count - 1:
                current.append(rest)
                room -= rest.bytes
                rest = None
                continue
            take = max(fit, 0 if current else 1)
            if take:
                cut = rest.first + take
                current.append(SegmentSlice(rest.queue_key, rest.segment, rest.first, cut))
                rest = SegmentSlice(rest.queue_key, rest.segment, cut, rest.end)
            packs.append(SlicePack(current))
            current, room = [], target
    if current:
        packs.append(SlicePack(current))
    return packs


_STORES: dict[str, ObjectStore] = {}


def tier_store(tier: Location) -> ObjectStore:
    """The tier's store, one per worker process: creating an S3 client loads botocore's service
    models and TLS contexts, a fixed cost a reused Python worker should pay once, not per task."""
    key = json.dumps([tier.url, tier.options], sort_keys=True, default=str)
    store = _STORES.get(key)
    if store is None:
        store = _STORES[key] = open_store(tier.url, tier.options)
    return store


_FETCHER: tuple[int, ThreadPoolExecutor] | None = None


def fetcher() -> ThreadPoolExecutor:
    """This process's thread for ranged GETs ahead of the decode. Made on first use, never in
    the worker daemon before it forks (a forked child has none of its parent's threads)."""
    global _FETCHER
    if _FETCHER is None or _FETCHER[0] != os.getpid():
        _FETCHER = (
            os.getpid(),
            ThreadPoolExecutor(FETCH_AHEAD, thread_name_prefix="tmq-fetch"),
        )
    return _FETCHER[1]


class RangeReader:
    """Ranged GETs of segment objects with botocore, for the export's span reads (botocore is
    what boto3 wraps; s3fs brings it, boto3 itself is not a dependency). s3fs serves
    each GET through its event loop thread (a hand-over per request, and aiohttp's chunked
    reads): on LocalStack it fetched at a third of what the same GETs got from boto3 on the
    same threads (decision 341). Any failure is left to the store's own read (its retry policy
    and error classes), so a missing or damaged object reads exactly as before."""

    def __init__(self, tier: Location) -> None:
        parsed = urlparse(tier.url)
        self.bucket = parsed.netloc
        self.prefix = parsed.path.strip("/")
        options = dict(tier.options)
        kwargs = dict(options.get("client_kwargs") or {})
        if "endpoint_url" in options:
            kwargs["endpoint_url"] = options["endpoint_url"]
        if "key" in options:
            kwargs["aws_access_key_id"] = options["key"]
            kwargs["aws_secret_access_key"] = options.get("secret")
            kwargs["aws_session_token"] = options.get("token")
        config = Config(max_pool_connections=2 * FETCH_AHEAD, retries={"max_attempts": 1})
        self.client = _session().create_client("s3", config=config, **kwargs)

    @staticmethod
    def usable(tier: Location) -> bool:
        return tier.url.startswith(("s3://", "s3a://")) and set(tier.options) <= _S3_OPTIONS

    def get(self, key: str, start: int, length: int) -> bytes:
        name = f"{self.prefix}/{key}" if self.prefix else key
        answer = self.client.get_object(
            Bucket=self.bucket, Key=name, Range=f"bytes={start}-{start + length - 1}"
        )
        data: bytes = answer["Body"].read()
        return data


_SESSION: botocore.session.Session | None = None


def _session() -> botocore.session.Session:
    """This process's botocore session: it keeps the S3 model and endpoint data it has parsed,
    so a second client costs milliseconds, not the tenth of a second the first one does."""
    global _SESSION
    if _SESSION is None:
        _SESSION = botocore.session.get_session()
    return _SESSION


def warm_clients() -> None:
    """Parse botocore's S3 data into this process's session without a request or a credential
    lookup: the worker daemon does it once before it forks, so a new worker's first client
    (``RangeReader``) is cheap."""
    _session().create_client(
        "s3",
        region_name="us-east-1",
        endpoint_url="http://127.0.0.1:9",
        aws_access_key_id="warm",
        aws_secret_access_key="warm",
    )


_RANGE_READERS: dict[str, tuple[int, RangeReader | None]] = {}


def range_reader(tier: Location) -> RangeReader | None:
    """This process's direct S3 reader of ``tier`` (None where the store reads alone). Made
    on first use in each process: a botocore client does not survive the worker daemon's fork."""
    if not RangeReader.usable(tier):
        return None
    key = json.dumps([tier.url, tier.options], sort_keys=True, default=str)
    made = _RANGE_READERS.get(key)
    if made is None or made[0] != os.getpid():
        try:
            reader: RangeReader | None = RangeReader(tier)
        except Exception as e:  # no usable client here: the store reads alone
            log.warning("%s: reading through the store only: %s", tier.url, e)
            reader = None
        made = _RANGE_READERS[key] = (os.getpid(), reader)
    return made[1]


class _SlicePlan:
    """One slice's spans, once its offset-table entries are read: entry ranges ``[i, j)`` of
    about ``READ_SPAN_BYTES``, each one GET."""

    def __init__(self, part: SegmentSlice, entries: np.ndarray) -> None:
        self.part = part
        self.info = SegmentInfo(**part.segment)
        self.positions = entries["offset"].astype(np.int64)
        self.sizes = entries["size"].astype(np.int64)
        self.ends = self.positions + self.sizes
        self.spans: list[tuple[int, int]] = []
        i = 0
        while i < len(entries):
            stop = int(self.positions[i]) + READ_SPAN_BYTES
            j = max(i + 1, int(np.searchsorted(self.ends, stop, "right")))
            self.spans.append((i, j))
            i = j

    def fetch(self, tier: Location, k: int) -> bytes:
        """The bytes of span ``k``: a direct ranged GET, else (or when it fails) the store's
        read, whose retry policy and error classes decide."""
        i, j = self.spans[k]
        start = int(self.positions[i])
        length = int(self.ends[j - 1]) - start
        direct = range_reader(tier)
        if direct is not None:
            try:
                data = direct.get(self.info.key, start, length)
                if len(data) == length:
                    return data
            except Exception:  # the store's read below retries and classifies it
                pass
        return SegmentReader(tier_store(tier), self.info)._range(start, length)

    def decode(self, k: int, data: bytes, broker: str) -> pa.RecordBatch:
        i, j = self.spans[k]
        try:
            records = decode_run(data, self.positions[i:j] - int(self.positions[i]), check_crc=True)
        except RecordError as e:
            raise SegmentError(f"{self.info.key}: {e}") from None
        if not np.array_equal(np.asarray(records.column("size")), self.sizes[i:j]):
            raise SegmentError(
                f"{self.info.key}: a record is not where its offset-table entry says"
            )
        return schema.rows(records, broker, self.info.key)


def check_entries(info: SegmentInfo, index: int, entries: np.ndarray) -> None:
    """Raise ``SegmentError`` naming the object unless ``entries`` (its offset-table entries
    ``index``, ``index + 1``, ...) lay records out as a build does: each size positive, each
    record inside the object's record area (before its tables), each starting where the one
    before ends, the first record at byte 0 and the last ending at the tables. A ranged GET
    carries no checksum and an object can be damaged: without this, a bad entry surfaced as
    whatever the reads it steered hit ("short read (0 of -100 bytes)", an illegal magic code
    at a negative position). No sum here can overflow (decision 765): a start is compared
    with the record area's length less the size, and a sum is taken only of entries that
    passed that."""
    starts = entries["offset"].astype(np.int64)
    sizes = entries["size"].astype(np.int64)
    limit = int(info.offsets_at)
    bad = (sizes <= 0) | (starts < 0) | (starts > limit - sizes)
    if not bad.any():
        bad[1:] = starts[1:] != starts[:-1] + sizes[:-1]
        if index == 0:
            bad[0] = starts[0] != 0
        if not bad.any() and index + len(entries) == info.count:
            bad[-1] = starts[-1] + sizes[-1] != limit
    if bad.any():
        k = int(np.argmax(bad))
        raise SegmentError(
            f"{info.key}: its offset table does not describe its records: the entry of queue "
            f"offset {info.base_offset + index + k} says {int(sizes[k])} bytes at byte "
            f"{int(starts[k])} (the records take bytes 0 to {limit})"
        )


def _plan_slice(tier: Location, part: SegmentSlice) -> _SlicePlan:
    info = SegmentInfo(**part.segment)
    entries = SegmentReader(tier_store(tier), info).entries(part.first, part.end - part.first)
    check_entries(info, part.first - info.base_offset, entries)
    return _SlicePlan(part, entries)


def read_slices(
    tier: Location,
    parts: Sequence[SegmentSlice],
    skip: Callable[[SegmentSlice], bool] = lambda part: False,
) -> Iterator[tuple[SegmentSlice, pa.RecordBatch | SegmentError]]:
    """Decode the records of ``parts`` in order into source rows (on an executor), as
    ``(slice, rows)`` pairs, or ``(slice, SegmentError)`` once for a slice that cannot be read
    (missing, short, or a record that fails its checks), after which that slice yields
    nothing more. A slice for which ``skip`` is true when its turn comes (a queue that failed
    earlier) is not read.

    One pipeline for all the slices: every slice's offset-table entries are fetched at once
    (one small GET each), and ``FETCH_AHEAD`` span GETs stay in flight across slice
    boundaries while the current span is decoded. Reading slice by slice drained the
    pipeline at each boundary (an entries GET, then the first span's GET, before any
    decoding): a segment's slice is two or three spans, so most of a task waited on S3."""
    pool = fetcher()
    plans = [pool.submit(_plan_slice, tier, part) for part in parts]

    def spans() -> Iterator[tuple[int, int, _SlicePlan | SegmentError]]:
        for n, (part, planned) in enumerate(zip(parts, plans, strict=True)):
            if skip(part):
                continue
            try:
                plan = planned.result()
            except SegmentError as e:
                yield n, -1, e
                continue
            for k in range(len(plan.spans)):
                yield n, k, plan

    def submit(job: tuple[int, int, _SlicePlan | SegmentError]) -> tuple[Any, ...]:
        n, k, plan = job
        if isinstance(plan, SegmentError) or skip(parts[n]):
            return job, None
        return job, pool.submit(plan.fetch, tier, k)

    jobs = spans()
    pending = deque(submit(job) for job in itertools.islice(jobs, FETCH_AHEAD))
    failed: set[int] = set()  # slices that yielded their error
    try:
        while pending:
            (n, k, plan), fetching = pending.popleft()
            following = next(jobs, None)
            if following is not None:
                pending.append(submit(following))
            part = parts[n]
            if n in failed or skip(part):
                continue
            if isinstance(plan, SegmentError):
                failed.add(n)
                yield part, plan
                continue
            try:
                rows = plan.decode(k, fetching.result(), QueueRef.parse(part.queue_key).broker)
            except SegmentError as e:
                failed.add(n)
                yield part, e
                continue
            yield part, rows
    finally:
        for _, fetching in pending:
            if fetching is not None:
                fetching.cancel()
        for planned in plans:
            planned.cancel()


def read_slice(tier: Location, part: SegmentSlice) -> Iterator[pa.RecordBatch]:
    """The source rows of one slice (``read_slices`` of one); raises ``SegmentError`` naming
    the object for anything unreadable."""
    return _raising(read_slices(tier, [part]))


def _raising(
    pairs: Iterator[tuple[SegmentSlice, pa.RecordBatch | SegmentError]],
) -> Iterator[pa.RecordBatch]:
    for _, rows in pairs:
        if isinstance(rows, SegmentError):
            raise rows
        yield rows


def read_partition(tier: Location, partition: InputPartition) -> Iterator[pa.RecordBatch]:
    """The rows of one task's slices."""
    # When partitions() returns none, Spark still runs one task with a partition of its own.
    if not isinstance(partition, SlicePack):
        return
    yield from _raising(read_slices(tier, partition.slices))


@dataclass(slots=True, frozen=True)
class _Span:
    """Part of a segment admitted into a batch (planning only)."""

    queue: QueueRef
    segment: SegmentInfo
    first: int
    end: int

    @property
    def bytes(self) -> int:
        return self.segment.size * (self.end - self.first) // max(1, self.segment.count)


class Planner:
    """Driver-side planning shared by the batch and the streaming reader: which queues exist,
    where each starts and ends, and how a range becomes slices of segments."""

    def __init__(self, options: SourceOptions, manifests: ManifestCache | None = None) -> None:
        self.options = options
        self._manifests = manifests
        # The tier's queues as last listed (``relist``); None: list them on every call.
        self.listed: list[QueueRef] | None = None

    @property
    def manifests(self) -> ManifestCache:
        # Opened lazily: Spark constructs readers in processes that only pickle them.
        if self._manifests is None:
            self._manifests = ManifestCache(
                open_store(self.options.tier.url, self.options.tier.options)
            )
        return self._manifests

    def queues(self) -> list[QueueRef]:
        if self.listed is not None:
            return self.listed
        return discover(self.manifests.store, self.options.topics)

    def relist(self, queues: list[QueueRef] | None = None) -> list[QueueRef]:
        """List the tier's queues now (or take ``queues``, just listed by the caller) and plan
        with that listing until the next ``relist``: an export lists once per run or trigger
        interval, not once per batch."""
        if queues is None:
            queues = discover(self.manifests.store, self.options.topics)
        self.listed = queues
        return queues

    def start_of(self, queue: QueueRef, manifest: QueueManifest) -> int:
        start = (self.options.starting or {}).get(queue.key, manifest.start_offset)
        return max(start, manifest.start_offset)

    def limit_of(self, queue: QueueRef, manifest: QueueManifest) -> int:
        limit = manifest.end_offset
        if self.options.ending is not None and queue.key in self.options.ending:
            limit = min(limit, self.options.ending[queue.key])
        return limit

    def initial(self, *, refresh: bool = True) -> dict[str, int]:
        queues = self.queues()
        manifests = self.manifests.get_many(queues, refresh=refresh)
        return {q.key: self.start_of(q, m) for q, m in zip(queues, manifests, strict=True)}

    def _pending(self, queue: QueueRef, manifest: QueueManifest, position: int) -> list[_Span]:
        if position < manifest.start_offset:
            log.warning(
                "%s: offsets %d..%d expired from the tier before they were exported; "
                "continuing at %d",
                queue.key,
                position,
                manifest.start_offset - 1,
                manifest.start_offset,
            )
            position = manifest.start_offset
        limit = self.limit_of(queue, manifest)
        return [
            _Span(queue, s, max(position, s.base_offset), min(limit, s.end_offset))
            for s in manifest.segments
            if s.end_offset > position and s.base_offset < limit
        ]

    def latest(self, position: Mapping[str, int], *, refresh: bool = True) -> dict[str, int]:
        """The end of the next micro-batch from ``position``: whole segments, oldest first
        across queues, within the per-trigger caps. ``refresh``: look for newer manifests
        first (one LIST per queue, concurrently); without it, plan on the cached ones."""
        end = dict(position)
        pending: list[tuple[int, str, int, list[_Span]]] = []
        queues = self.queues()
        for queue, manifest in zip(
            queues, self.manifests.get_many(queues, refresh=refresh), strict=True
        ):
            at = position.get(queue.key, self.start_of(queue, manifest))
            end[queue.key] = max(at, manifest.start_offset) if manifest.segments else at
            spans = self._pending(queue, manifest, at)
            if spans:
                pending.append((spans[0].segment.min_store_timestamp, queue.key, 0, spans))
        heapq.heapify(pending)
        admitted_bytes = admitted = 0
        max_bytes = self.options.max_bytes_per_trigger
        max_segments = self.options.max_segments_per_trigger
        while pending:
            if admitted and (
                (max_bytes is not None and admitted_bytes >= max_bytes)
                or (max_segments is not None and admitted >= max_segments)
            ):
                break
            _, key, i, spans = heapq.heappop(pending)
            span = spans[i]
            end[key] = span.end
            admitted += 1
            admitted_bytes += span.bytes
            if i + 1 < len(spans):
                heapq.heappush(
                    pending, (spans[i + 1].segment.min_store_timestamp, key, i + 1, spans)
                )
        return end

    def slices(self, start: Mapping[str, int], end: Mapping[str, int]) -> list[SegmentSlice]:
        out: list[SegmentSlice] = []
        for key, stop in sorted(end.items()):
            queue = QueueRef.parse(key)
            manifest = self.manifests.get(queue, refresh=False)
            first = start.get(key)
            if first is None:
                first = self.start_of(queue, manifest)
            if stop <= first:
                continue
            if stop > manifest.end_offset:  # a newer manifest than the cached one
                manifest = self.manifests.get(queue)
            for span in self._pending(queue, manifest, first):
                span_end = min(span.end, stop)
                per_slice = max(
                    1,
                    self.options.bytes_per_partition
                    * span.segment.count
                    // max(1, span.segment.size),
                )
                for lo in range(span.first, span_end, per_slice):
                    hi = min(span_end, lo + per_slice)
                    out.append(SegmentSlice(key, span.segment.to_dict(), lo, hi))
        return out


class TmqStreamReader(DataSourceStreamReader):
    def __init__(self, options: SourceOptions) -> None:
        self.options = options
        self.planner = Planner(options)
        # The end of the last batch Spark planned: where the next one starts. latestOffset()
        # has no ``start`` argument in pyspark 4.0; a restarted query's first position is
        # initialOffset(), which the export job sets from the Delta table (at or past the
        # checkpoint's last committed batch).
        self._position: dict[str, int] | None = None

    def initialOffset(self) -> dict[str, int]:
        return self.planner.initial()

    def latestOffset(self) -> dict[str, int]:
        if self._position is None:
            self._position = self.planner.initial()
        return self.planner.latest(self._position)

    def partitions(self, start: dict[str, int], end: dict[str, int]) -> Sequence[InputPartition]:
        self._position = {**(self._position or {}), **end}
        return pack(self.planner.slices(start, end), self.options.bytes_per_partition)

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        return read_partition(self.options.tier, partition)

    def commit(self, end: dict[str, int]) -> None:
        # Nothing to release: progress lives in the checkpoint and in the Delta table.
        pass


class TmqBatchReader(DataSourceReader):
    def __init__(self, options: SourceOptions) -> None:
        self.options = options

    def partitions(self) -> Sequence[InputPartition]:
        planner = Planner(self.options)
        start = planner.initial()
        end = {
            q.key: planner.limit_of(q, planner.manifests.get(q, refresh=False))
            for q in planner.queues()
        }
        return pack(planner.slices(start, end), self.options.bytes_per_partition)

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        return read_partition(self.options.tier, partition)


class TmqDataSource(DataSource):
    """``format("tmq")``: archived messages of the cold tier, one row per message."""

    @classmethod
    def name(cls) -> str:
        return NAME

    def schema(self) -> str:
        return schema.SOURCE_DDL

    def reader(self, schema: StructType) -> DataSourceReader:
        return TmqBatchReader(SourceOptions.parse(self.options))

    def streamReader(self, schema: StructType) -> DataSourceStreamReader:
        return TmqStreamReader(SourceOptions.parse(self.options))
