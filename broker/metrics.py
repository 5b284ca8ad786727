"""Prometheus metrics of a broker, on an HTTP port of their own (default 5557).

Pull model: a custom collector reads the broker's objects when Prometheus scrapes (store
offsets, the offloader's counters and cached manifests, the cold fetcher's counters), so the
append path pays for nothing it does not already do. The only hot-path cost is ``Traffic``: one
dict update under a lock per request batch (not per message) for the per-topic in/out counters.
Cold-read latencies arrive through the fetcher's ``observe`` callback, on its own threads.

Every metric name is documented in docs/operations.md ("Metrics"); keep the two in step.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from broker.ha.gate import ReplicationStatus
from broker.status import BrokerStatus
from remoting.security import TlsConfig

if TYPE_CHECKING:
    from wsgiref.simple_server import WSGIServer

    from broker.timer import TimerService
    from broker.transaction import TransactionService
    from offload.offloader import Offloader
    from tiered.cold.fetcher import ColdFetcher

log = logging.getLogger(__name__)

DEFAULT_METRICS_PORT = 5557
# A cold read is a ranged GET (or two) of up to 256 records: milliseconds on a local disk,
# tens to hundreds of milliseconds against S3.
_COLD_READ_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class Traffic:
    """Messages and body bytes produced and consumed, per topic, since the process started."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._in: dict[str, list[int]] = {}
        self._out: dict[str, list[int]] = {}

    @staticmethod
    def _add(table: dict[str, list[int]], topic: str, messages: int, nbytes: int) -> None:
        counts = table.get(topic)
        if counts is None:
            counts = table[topic] = [0, 0]
        counts[0] += messages
        counts[1] += nbytes

    def produced(self, topic: str, messages: int, nbytes: int) -> None:
        with self._lock:
            self._add(self._in, topic, messages, nbytes)

    def consumed(self, topic: str, messages: int, nbytes: int) -> None:
        if messages:
            with self._lock:
                self._add(self._out, topic, messages, nbytes)

    def snapshot(self) -> tuple[dict[str, tuple[int, int]], dict[str, tuple[int, int]]]:
        """(produced, consumed): topic -> (messages, bytes)."""
        with self._lock:
            return (
                {t: (c[0], c[1]) for t, c in self._in.items()},
                {t: (c[0], c[1]) for t, c in self._out.items()},
            )


@dataclass(slots=True)
class MetricSources:
    """What the collector reads; callables, so it always sees the broker's current objects."""

    traffic: Traffic
    status: Callable[[], BrokerStatus]
    offloader: Callable[[], Offloader | None]
    fetcher: Callable[[], ColdFetcher | None]
    released_files: Callable[[], int]
    offload_failures: Callable[[], int]
    transactions: Callable[[], TransactionService | None] = lambda: None
    timers: Callable[[], TimerService | None] = lambda: None
    # A replica group member's replication state; None for a single broker.
    replication: Callable[[], ReplicationStatus | None] = lambda: None


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=value)


class BrokerCollector(Collector):
    def __init__(self, sources: MetricSources) -> None:
        self.sources = sources

    def collect(self) -> Iterator[Metric]:
        yield from self._traffic()
        yield from self._storage(self.sources.status())
        yield from self._tier()
        yield from self._message_model()
        yield from self._replication()

    def _message_model(self) -> Iterator[Metric]:
        transactions = self.sources.transactions()
        if transactions is not None:
            yield _gauge(
                "tmq_transaction_half_pending",
                "Half messages waiting for COMMIT or ROLLBACK.",
                transactions.pending(),
            )
            for name, doc, value in (
                ("tmq_transaction_commits", "Transactions committed.", transactions.commits),
                ("tmq_transaction_rollbacks", "Transactions rolled back.", transactions.rollbacks),
                ("tmq_transaction_checks", "Check-backs sent to producers.", transactions.checks),
                (
                    "tmq_transaction_checks_relayed",
                    "Check-backs another member of the replica group handed to its producer.",
                    transactions.relayed,
                ),
            ):
                yield _counter(name, doc, value)
        timers = self.sources.timers()
        if timers is not None:
            stats = timers.stats()
            pending = GaugeMetricFamily(
                "tmq_timer_pending",
                "Delay messages not yet delivered, per topic.",
                labels=["topic"],
            )
            for topic, n in sorted(stats.pending_by_topic.items()):
                pending.add_metric([topic], n)
            yield pending
            yield _gauge(
                "tmq_timer_delivery_lag_seconds",
                "How late the oldest due, undelivered delay message is.",
                stats.lag_seconds,
            )
            yield _counter(
                "tmq_timer_delivered",
                "Delay messages delivered into their topics.",
                stats.delivered,
            )

    def _replication(self) -> Iterator[Metric]:
        status = self.sources.replication()
        if status is None:
            return
        yield _gauge("tmq_replication_epoch", "The replica group's current epoch.", status.epoch)
        yield _gauge(
            "tmq_replication_max_offset",
            "This node's CommitLog end (physical offset).",
            status.max_offset,
        )
        yield _gauge(
            "tmq_replication_confirmed_offset",
            "SYNC: the CommitLog offset below which min_in_sync_replicas hold every byte.",
            status.confirmed_offset,
        )
        lag = GaugeMetricFamily(
            "tmq_replication_lag_bytes",
            "CommitLog bytes a slave lacks (master: per slave; slave: its own).",
            labels=["broker_id"],
        )
        if status.role == "master":
            yield _gauge(
                "tmq_replication_sync_state_set_size",
                "Members of the SyncStateSet, the master included.",
                len(status.sync_state_set),
            )
            for slave in status.slaves:
                lag.add_metric([str(slave.broker_id)], slave.lag_bytes)
        else:
            yield _gauge(
                "tmq_replication_connected",
                "1 while this slave follows a master.",
                int(status.connected),
            )
            lag.add_metric([str(status.broker_id)], status.lag_bytes)
        yield lag
        yield _gauge(
            "tmq_replication_is_master",
            "1 while this node is the group's master.",
            int(status.role == "master"),
        )
        yield _gauge(
            "tmq_replication_fenced",
            "1 while this master is fenced (its controller lease lapsed or it was deposed).",
            int(status.fenced),
        )
        yield CounterMetricFamily(
            "tmq_replication_elections_won",
            "Elections this node won (controller mode).",
            value=status.elections_won,
        )
        yield CounterMetricFamily(
            "tmq_replication_fencings",
            "Times this node fenced itself as master (controller mode).",
            value=status.fencings,
        )
        yield CounterMetricFamily(
            "tmq_replication_role_changes",
            "Replication role switches (follow, promote, demote) by the controller.",
            value=status.role_changes,
        )
        yield CounterMetricFamily(
            "tmq_replication_keeper_restarts",
            "Lease keepers restarted because they were alive but not renewing (controller mode).",
            value=status.keeper_restarts,
        )

    def _traffic(self) -> Iterator[Metric]:
        produced, consumed = self.sources.traffic.snapshot()
        for name, doc, table, i in (
            ("tmq_messages_in", "Messages produced, per topic.", produced, 0),
            ("tmq_bytes_in", "Message body bytes produced, per topic.", produced, 1),
            ("tmq_messages_out", "Messages delivered to consumers, per topic.", consumed, 0),
            ("tmq_bytes_out", "Message body bytes delivered to consumers, per topic.", consumed, 1),
        ):
            family = CounterMetricFamily(name, doc, labels=["topic"])
            for topic, counts in sorted(table.items()):
                family.add_metric([topic], counts[i])
            yield family

    def _storage(self, status: BrokerStatus) -> Iterator[Metric]:
        store = GaugeMetricFamily(
            "tmq_store_bytes", "Bytes held per storage tier.", labels=["tier"]
        )
        store.add_metric(["hot"], status.hot_store_bytes)
        store.add_metric(["cold"], status.cold_store_bytes)
        yield store
        yield _gauge(
            "tmq_commitlog_files", "CommitLog files on local disk.", status.commitlog_files
        )
        yield _gauge(
            "tmq_dispatch_lag_bytes",
            "CommitLog bytes appended but not yet dispatched to ConsumeQueues (not readable).",
            status.dispatch_lag_bytes,
        )
        yield _counter(
            "tmq_commitlog_files_released",
            "CommitLog files deleted locally (uploaded or expired).",
            self.sources.released_files(),
        )
        yield _counter(
            "tmq_tier_upload_failures",
            "Periodic uploads or expiries of a queue that failed (tier unreachable? see the log).",
            self.sources.offload_failures(),
        )
        lag = {
            unit: GaugeMetricFamily(f"tmq_tier_upload_lag_{unit}", doc, labels=["topic", "queue"])
            for unit, doc in (
                ("messages", "Messages of a tiered queue not yet uploaded to the tier."),
                ("bytes", "Bytes of a tiered queue not yet uploaded to the tier."),
                ("seconds", "Age of the oldest message of a tiered queue not yet uploaded."),
            )
        }
        for q in status.tiered_queues:
            if q.lag is None:
                continue  # manifest not loaded yet: unknown, not zero
            labels = [q.topic, str(q.queue)]
            lag["messages"].add_metric(labels, q.lag.messages)
            lag["bytes"].add_metric(labels, q.lag.bytes)
            lag["seconds"].add_metric(labels, q.lag.seconds)
        yield from lag.values()
        freshness = GaugeMetricFamily(
            "tmq_lakehouse_export_freshness_seconds",
            "Seconds since the newest archived message visible in the topic's Delta table.",
            labels=["topic"],
        )
        for topic, seconds in sorted((status.export_freshness or {}).items()):
            freshness.add_metric([topic], seconds)
        yield freshness

    def _tier(self) -> Iterator[Metric]:
        offloader = self.sources.offloader()
        if offloader is not None:
            s = offloader.stats
            for name, doc, value in (
                (
                    "tmq_tier_upload_bytes",
                    "Segment bytes uploaded and committed.",
                    s.uploaded_bytes,
                ),
                (
                    "tmq_tier_upload_segments",
                    "Segments uploaded and committed.",
                    s.uploaded_segments,
                ),
                (
                    "tmq_tier_upload_messages",
                    "Messages uploaded and committed.",
                    s.uploaded_messages,
                ),
                (
                    "tmq_retention_deleted_segments",
                    "Segments removed from the archive by retention.",
                    s.retention_segments,
                ),
                (
                    "tmq_retention_deleted_messages",
                    "Messages removed from the archive by retention.",
                    s.retention_messages,
                ),
                (
                    "tmq_retention_deleted_bytes",
                    "Segment bytes removed from the archive by retention.",
                    s.retention_bytes,
                ),
                (
                    "tmq_tier_deleted_objects",
                    "Segment objects deleted from the tier (expired, and orphans swept).",
                    s.deleted_objects,
                ),
            ):
                yield _counter(name, doc, value)
            yield _gauge(
                "tmq_tier_fenced",
                "1 when a master of a higher epoch took this broker's tier prefix over (a "
                "deposed master: it uploads and releases nothing), else 0.",
                int(offloader.fenced),
            )
            # Decision 800: queues not checked against their archive yet, and queues whose
            # archive holds other messages at offsets this directory acknowledged. Both
            # families are always there (empty when none), so an alert needs no absent().
            pending = GaugeMetricFamily(
                "tmq_tier_check_pending",
                "1 for a tiered queue not checked against its archive yet (started while the "
                "object store did not answer): nothing of it is uploaded or released meanwhile.",
                labels=["topic", "queue"],
            )
            diverged = GaugeMetricFamily(
                "tmq_tier_diverged_offsets",
                "Offsets of a tiered queue that hold acknowledged messages locally and other "
                "ones in its archive (decision 750); kept locally until `tmq offload resolve`.",
                labels=["topic", "queue"],
            )
            divergence = offloader.divergence
            if divergence is not None:
                for (topic, queue_id), _base in sorted(divergence.pending.items()):
                    pending.add_metric([topic, str(queue_id)], 1)
                for (topic, queue_id), c in sorted(divergence.conflicts.items()):
                    diverged.add_metric([topic, str(queue_id)], c.archive_end - c.base)
            yield pending
            yield diverged
        fetcher = self.sources.fetcher()
        if fetcher is not None:
            yield _counter(
                "tmq_tier_download_bytes",
                "Record bytes read from the tier by the cold fetcher.",
                fetcher.bytes_fetched,
            )
            yield _counter(
                "tmq_cold_read_cache_hits",
                "Cold reads served from the read-ahead cache.",
                fetcher.hits,
            )
            yield _counter(
                "tmq_cold_read_cache_misses",
                "Cold reads that had to fetch from the tier.",
                fetcher.misses,
            )
            yield _gauge(
                "tmq_cold_read_cache_hit_ratio",
                "Share of cold reads served from the read-ahead cache since start (0 to 1).",
                fetcher.hit_ratio,
            )
            yield _counter(
                "tmq_cold_read_unavailable",
                "Cold reads refused: the tier did not answer in time, failed, or was too busy.",
                fetcher.unavailable,
            )


class BrokerMetrics:
    """The broker's registry: the collector above plus the cold-read latency histogram."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.traffic = Traffic()
        self.cold_read_seconds = Histogram(
            "tmq_cold_read_seconds",
            "Latency of one segment read from the tier (a batch of up to 256 records).",
            buckets=_COLD_READ_BUCKETS,
            registry=self.registry,
        )
        # Calls refused by authentication or authorization (remoting/auth.py), by kind; the
        # method and the user are in the log line of each refusal.
        self.auth_denied = Counter(
            "tmq_auth_denied",
            "Calls refused: kind unauthenticated (no, bad or stale signature) or forbidden (no "
            "grant allows it).",
            ["kind"],
            registry=self.registry,
        )
        for kind in ("unauthenticated", "forbidden"):
            self.auth_denied.labels(kind)  # exposed at 0 from the start, for rate() and alerts
        self._server: WSGIServer | None = None
        self._thread: threading.Thread | None = None

    def denied(self, method: str, kind: str) -> None:
        """The auth interceptor's ``on_denied`` callback."""
        self.auth_denied.labels(kind).inc()

    def observe_cold_read(self, seconds: float, nbytes: int) -> None:
        """The cold fetcher's ``observe`` callback."""
        self.cold_read_seconds.observe(seconds)

    def attach(self, sources: MetricSources) -> None:
        self.registry.register(BrokerCollector(sources))

    def serve(self, host: str, port: int, tls: TlsConfig | None = None) -> int:
        """Serve ``/metrics`` on ``host:port`` in a daemon thread, over HTTPS when ``tls`` has
        a certificate (and requiring a client certificate when it names a client CA); returns
        the bound port."""
        https: dict[str, Any] = {}
        if tls is not None and tls.enabled:
            https = {"certfile": tls.cert_file, "keyfile": tls.key_file}
            if tls.client_ca_file:
                https |= {"client_cafile": tls.client_ca_file, "client_auth_required": True}
        try:
            self._server, self._thread = start_http_server(port, host, self.registry, **https)
        except OSError as e:
            raise OSError(
                f"metrics: cannot listen on {host}:{port} ({e.strerror or e}); choose another "
                "metrics_port, or 0 to turn metrics off"
            ) from None
        bound = int(self._server.server_port)
        log.info("metrics on http://%s:%d/metrics", host, bound)
        return bound

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
