"""The broker process: the store, its metadata, the gRPC services, and its background duties.

Threads it owns, besides the store's (dispatcher, flusher) and gRPC's worker pool:
- ``tmq-registration``: registers with every NameServer every 30 s, and at once when topics change;
- ``tmq-maintenance``: revives expired pop deliveries (every second) and saves consumer offsets
  (every 5 s);
- the metrics HTTP server (``metrics_port``, default 5557): answers scrapes by reading the
  broker's state at that moment (broker/metrics.py).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import FIRST_COMPLETED, CancelledError, Future, wait
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import replace

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from rocketmq.grpc_protocol import service_pb2, service_pb2_grpc

from broker import acl_pb2, acl_pb2_grpc, admin_pb2, admin_pb2_grpc
from broker.admin import AdminServicer
from broker.authorization import AclServicer, BrokerPolicy
from broker.config import BrokerConfig
from broker.ha import relay_pb2, relay_pb2_grpc
from broker.ha.check_relay import CheckRelay, CheckRelayServicer
from broker.ha.controller import HaController
from broker.ha.forward import ForwardingHandler
from broker.ha.gate import FencedGate, ReplicationStatus, SendGate
from broker.ha.link import LinkSecurity
from broker.ha.master import ReplicationMaster
from broker.ha.role import RoleSnapshot, RoleState
from broker.ha.slave import ReplicationSlave
from broker.messaging import BrokerIdentity, MessagingServicer
from broker.metadata import BrokerMetadata, TopicConfig
from broker.metrics import BrokerMetrics, MetricSources
from broker.pop import PopService
from broker.producers import ProducerRegistry
from broker.reply import encode_pull_replies
from broker.status import BrokerStatus, ExportFreshness, broker_status
from broker.timer import TIMER_TOPIC, TimerService
from broker.transaction import HALF_TOPIC, OP_TOPIC, TransactionService
from lakehouse.runner import ContinuousExport
from offload.divergence import Divergence
from offload.leadership import Term
from offload.offloader import (
    ArchiveAheadError,
    DamagedEntryOffloadError,
    Offloader,
    OffloadError,
    RetentionResult,
)
from offload.release import release_predicate
from offload.resolve import Resumer, apply_floors
from offload.segment_upload import WORKER_PRELOAD, worker_threads
from remoting import namesrv_pb2 as nspb
from remoting.auth import Authenticator, AuthInterceptor
from remoting.grpc_server import listen, new_server
from remoting.namesrv_client import NameServerClient
from remoting.security import ChannelSecurity, server_credentials
from remoting.servicers import add_safely
from tiered import failpoints
from tiered.cold.fetcher import ColdFetcher
from tiered.cold.manifest import ManifestError, QueueManifest
from tiered.cold.storage import (
    ObjectStore,
    PermanentStorageError,
    RetryingObjectStore,
    StorageError,
    bounded_options,
    check_writable,
    open_store,
)
from tiered.cold.worker import ColdWorker
from tiered.epoch_file import EpochFile
from tiered.store import CommitLogFileInfo, MessageStore

log = logging.getLogger(__name__)

MESSAGING_SERVICE = "apache.rocketmq.v2.MessagingService"
ADMIN_SERVICE = "tmq.admin.v1.Admin"
ACL_SERVICE = "tmq.acl.v1.Acl"
# Each client holds one worker for its Telemetry stream and one per long poll.
_WORKERS = 128
# At most this many manifest loads of admin calls (a topic change's check, a description) are
# under way per broker; against a tier that does not answer each runs out its retries after the
# call has given up on it (decisions 785, 810).
_ADMIN_TIER_LOADS = 8
_MAX_MESSAGE_BYTES = 64 * 1024 * 1024


class TierUnusableError(ValueError):
    """The configured tier refuses this broker (missing bucket, permissions, credentials)."""


class Broker:
    def __init__(self, config: BrokerConfig, security: ChannelSecurity | None = None) -> None:
        """The composition root: every part of the broker is built here, in dependency order
        (metadata, tier -> cold fetcher -> store -> offloader, pop), and nothing rewires a
        part afterwards. ``security``: the admin credentials (the first admin, with ``[auth]``
        on) and TLS settings of the broker's own calls to the NameServers."""
        self.config = config
        self.security = security or ChannelSecurity()
        self.metrics = BrokerMetrics()
        self.metadata = BrokerMetadata(config.config_dir)
        self.tier: ObjectStore | None = None
        self.fetcher: ColdFetcher | None = None
        self.offloader: Offloader | None = None
        # The child process that builds and uploads segments and reads them back for cold
        # reads, off this process's GIL (tiered/cold/worker.py); started by start().
        self.cold_worker: ColdWorker | None = None
        # The tier as the admin calls' read loads use it (decision 920): every attempt gives
        # up after admin_tier_wait_ms of silence and none is retried past the load's own wait,
        # so a load an operator gave up on frees its slot within about twice that wait.
        self.admin_tier: RetryingObjectStore | None = None
        if config.tier_url:
            self.tier = open_store(config.tier_url, config.tier_options, config.retry)
            self.admin_tier = open_store(
                config.tier_url,
                bounded_options(
                    config.tier_url, config.tier_options, config.admin_tier_wait_ms / 1000
                ),
                config.retry,
            )
            self.cold_worker = ColdWorker(
                config.tier_url,
                config.tier_options,
                config.retry,
                threads=worker_threads(config.offload.parallel_uploads),
                max_inflight=max(16, 4 * config.offload.parallel_uploads),
                preload=WORKER_PRELOAD,
            )
            self.fetcher = ColdFetcher(
                self.tier,
                config.cluster,
                config.name,
                tiered_queues=self._tiered_queues,
                observe=self.metrics.observe_cold_read,
                runner=self.cold_worker,
                reply_encoder=encode_pull_replies,
                archive_starts=config.config_dir / "archive-starts.json",
            )
        self.store = MessageStore(config.store, cold=self.fetcher)
        # A standalone broker's record of tiered queues not checked against their archive
        # (decision 750); in a replica group the master's log decides offsets.
        self.divergence: Divergence | None = None
        if self.fetcher is not None and not config.ha.enabled:
            self.divergence = Divergence(config.store.data_dir)
        if self.tier is not None and self.fetcher is not None:
            self.offloader = Offloader(
                self.store,
                self.tier,
                config.cluster,
                config.name,
                config.offload,
                on_commit=self.fetcher.set_manifest,
                leadership=self._tier_term,
                upload_limit=self._upload_limit,
                runner=self.cold_worker,
                divergence=self.divergence,
            )
            self.fetcher.local_from = self._local_only_from
        # Finishes a resolve a crash interrupted, in the offload passes (decision 902).
        self._resumer: Resumer | None = None
        if self.divergence is not None and self.offloader is not None:
            self._resumer = Resumer(self.store, self.offloader, self.divergence)
        self._stop = threading.Event()
        self._register_now = threading.Event()
        # Held by a registration from its check of ``_stop`` to its last NameServer's answer,
        # and by stop()'s unregister: a heartbeat under way when stop() begins finishes before
        # the unregister, and none starts after it (decision 1260).
        self._registering = threading.Lock()
        self.pop = PopService(self.store, self.metadata, on_topic_created=self._register_now.set)
        self.namesrv = NameServerClient(config.namesrv, self.security) if config.namesrv else None
        self.producers = ProducerRegistry()
        # Both read the store's recovered state when started (start()).
        # Only a writable master checks back and delivers; a slave takes both over when it is
        # elected (or restarted as master).
        self.transactions = TransactionService(
            self.store,
            self.metadata,
            config.transactions,
            self.producers.check_back,
            leading=self._writable_master,
        )
        self.timers = TimerService(
            self.store,
            config.store.data_dir / "timer",
            lambda: list(self.metadata.topics),
            leading=self._writable_master,
        )
        # Whoever runs the lakehouse export may set this: topic -> seconds behind (metrics and
        # `tmq status` report it; None: not reported).
        self.export_freshness: ExportFreshness | None = None
        self._export: ContinuousExport | None = None
        self._freshness: dict[str, float] = {}
        self.released_files = 0
        self.offload_failures = 0  # periodic per-queue offload attempts that failed
        # A member of a replica group ([ha] enabled): streams its CommitLog to slaves, or
        # follows a master. None: a single broker.
        self.replication: ReplicationMaster | ReplicationSlave | None = None
        # This broker's role and epoch, for every part that must know (the send path, health,
        # registration, offload): a single broker is a master of epoch 0.
        self.role = RoleState("master" if not config.ha.enabled else config.ha.role, 0)
        self.role.add_listener(self._role_changed)
        # With [ha] etcd the group elects its master: the controller switches this broker
        # between replication master and slave (broker/ha/controller.py).
        self.controller: HaController | None = None
        self._registered_id: int | None = None
        self._forwarder: ForwardingHandler | None = None
        self.check_relay: CheckRelay | None = None
        # The replication link: TLS with [tls], both ends authenticated with [auth] (decision 220).
        link = (
            LinkSecurity(
                config.tls,
                self.metadata.acl if config.auth.enabled else None,
                self.security.access_key,
                self.security.secret_key,
            )
            if config.ha.enabled
            else None
        )
        if config.ha.enabled and config.ha.etcd:
            epochs = EpochFile(config.store.data_dir / "ha")
            self.controller = HaController(
                self.store,
                epochs,
                config.ha,
                config.cluster,
                config.name,
                lambda: f"{config.advertise_host}:{self.port}",
                self.role,
                make_master=lambda: ReplicationMaster(
                    self.store, epochs, config.ha, self.metadata, link
                ),
                make_slave=lambda cfg: ReplicationSlave(
                    self.store, epochs, cfg, self.metadata, self._register_now.set, link
                ),
                on_change=self._replication_changed,
                find_master=self._registered_master,
            )
            # Check-backs reach producers connected to any member (decision 1250).
            self.check_relay = CheckRelay(self.controller.peers, self.security, self.producers)
            self.transactions.relay = self.check_relay.relay
        elif config.ha.enabled:
            epochs = EpochFile(config.store.data_dir / "ha")
            if config.ha.role == "master":
                self.replication = ReplicationMaster(
                    self.store, epochs, config.ha, self.metadata, link
                )
            else:
                self.replication = ReplicationSlave(
                    self.store, epochs, config.ha, self.metadata, self._register_now.set, link
                )
        self.metrics.attach(
            MetricSources(
                traffic=self.metrics.traffic,
                status=self.status,
                offloader=lambda: self.offloader,
                fetcher=lambda: self.fetcher,
                released_files=lambda: self.released_files,
                offload_failures=lambda: self.offload_failures,
                transactions=lambda: self.transactions,
                timers=lambda: self.timers,
                replication=self._replication_status,
            )
        )
        self.port = 0
        self.metrics_port = 0
        self._server: grpc.Server | None = None
        self._health = health.HealthServicer()
        self._fence_reported = False
        self._put_topic_lock = threading.Lock()
        # The manifest loads of admin calls under way (``before_put_topic``, ``tier_manifests``),
        # bounded, and by queue: a second call for a queue whose load is under way waits on the
        # same load instead of starting one more (decision 810).
        self._archive_loads = threading.BoundedSemaphore(_ADMIN_TIER_LOADS)
        self._archive_running: dict[tuple[str, int, bool, bool], Future[QueueManifest]] = {}
        self._archive_lock = threading.Lock()
        self._threads: list[threading.Thread] = []

    def _continue_above_archives(self) -> None:
        """Start every queue whose archive ends above its local end at the archive's end
        (decision 720): a data directory restored from an older copy, or one that lost
        records the offloader had archived, would otherwise write its next messages at offsets
        the archive holds other messages at, and release would delete them as uploaded. The
        archived messages stay readable from the archive. Only a standalone broker: in a
        replica group the master's log decides the offsets. A prefix written from another data
        directory is decision 690's, left to its refusal.

        A queue whose manifest did not load (the object store does not answer) is recorded as
        unchecked, with its local end, before the broker serves (decision 750): its appends go
        on, and none of it from there is uploaded, released or read from the archive until the
        check has run. A queue that took messages unchecked at an earlier start keeps them at
        their offsets: it is checked (``Divergence.check``), never moved."""
        divergence = self.divergence
        if self.fetcher is None or divergence is None:
            return
        divergence.report()
        # A resolve that stopped after its commit point: its floor, before anything is read.
        apply_floors(self.store, divergence)
        unchecked: dict[tuple[str, int], int] = {}
        for topic, queue_id in sorted(set(self._tiered_queues()) | self.fetcher.starts.queues()):
            manifest = self.fetcher.cached(topic, queue_id)
            local = self.store.max_offset(topic, queue_id)
            if manifest is None:
                unchecked[(topic, queue_id)] = local
                continue
            if manifest.store and manifest.store != self.store.store_id:
                continue
            base = divergence.local_from(topic, queue_id)
            if base is not None and local > base:
                divergence.check(topic, queue_id, manifest, local)
                continue
            self._start_above_archive(topic, queue_id, manifest)
            if base is not None:
                divergence.resolved(topic, queue_id)  # nothing was appended unchecked
        if unchecked:
            divergence.pend(unchecked)
            log.warning(
                "%d tiered queue(s) not checked against their archive (the object store did "
                "not answer): they take messages, but none of them is uploaded, released or "
                "read from the archive at or above its current end until the check has run",
                len(unchecked),
            )

    def _start_above_archive(self, topic: str, queue_id: int, manifest: QueueManifest) -> bool:
        """Start the queue at ``manifest``'s end if its local end is below it (True: it was);
        ``_continue_above_archives``. Only before any append can reach the queue."""
        local = self.store.max_offset(topic, queue_id)
        if manifest.end_offset <= local:
            return False
        if manifest.store and manifest.store != self.store.store_id:
            return False
        if not self.store.start_queue_at(topic, queue_id, manifest.end_offset):
            return False
        log.error(
            "%s/%d: the local queue ends at %d, below its archive's end %d (a data "
            "directory restored from an older copy, or records lost after they were "
            "archived): it continues at %d; offsets below are read from the archive",
            topic,
            queue_id,
            local,
            manifest.end_offset,
            manifest.end_offset,
        )
        return True

    def before_put_topic(self, cfg: TopicConfig, existing: TopicConfig | None) -> None:
        """Before a topic is created or updated while the broker serves: every queue that
        becomes tiered by it (a new topic's, a new queue of a tiered one, every queue of a
        topic made tiered) is checked against its archive, as the start checks the queues it
        knows (decision 745). A data directory restored from a copy taken before the topic
        existed does not know it, and the topic created again would write its new messages at
        offsets the archive holds. A queue no message can reach yet (a new topic's or a new
        queue's) continues at the archive's end. A queue of an existing topic that ends below
        its archive is refused (``ArchiveAheadError``): messages may be reaching it, so it
        cannot be started elsewhere safely, and made tiered, its messages at archived offsets
        would be released as uploaded. A queue whose archive cannot be read (or does not answer
        within the check's deadline) is recorded as unchecked, with its local end, before the
        change is stored, as at a start while the tier is down (decision 750): it takes
        messages, but none of it from there is uploaded, released or read from the archive
        until the check has run."""
        if (
            not cfg.tiered
            or self.offloader is None
            or self.replication is not None
            or self.controller is not None
        ):
            return
        known = existing.queues if existing is not None else 0
        first = known if existing is not None and existing.tiered else 0
        with self._put_topic_lock:
            # Loaded together, with one deadline for them all (decision 785): one after the
            # other, each through the tier's retries and request timeouts, eight queues on a
            # black-holed tier held the call for minutes, long after the client gave up.
            # A queue past the 8 load slots waits for one within the same deadline
            # (``tier_manifests``), as for describes and verify (decision 885): taken at once
            # as not answered, a healthy tier's queues past the eighth were recorded unchecked
            # (decision 924).
            queues = [(cfg.name, q) for q in range(first, cfg.queues)]
            failed: dict[tuple[str, int], Exception] = {}
            found = self.tier_manifests(queues, refresh=True, failed=failed)
            unchecked: list[int] = []
            for (_, queue_id), manifest in sorted(found.items()):
                if manifest is None:
                    error = failed.get((cfg.name, queue_id))
                    if error is not None:
                        # As at a start while the tier is down (decision 720): not checked; the
                        # claim logs an archive ahead of the queue once the tier answers.
                        log.warning(
                            "%s/%d: its archive could not be read, so it is not checked "
                            "against the queue's end yet (%s)",
                            cfg.name,
                            queue_id,
                            error,
                        )
                    unchecked.append(queue_id)
                    continue
                if manifest.end_offset <= self.store.max_offset(cfg.name, queue_id):
                    continue
                if manifest.store and manifest.store != self.store.store_id:
                    continue  # decision 690's: the claim refuses it, release keeps its files
                if queue_id < known:
                    raise ArchiveAheadError(
                        f"{cfg.name}/{queue_id} ends at offset "
                        f"{self.store.max_offset(cfg.name, queue_id)}, below the end of "
                        f"its archive ({manifest.end_offset}, {manifest.prefix}), left by "
                        "an earlier tiered topic of this name: made tiered, its messages "
                        "at archived offsets would be deleted as uploaded. Move the old "
                        "archive out of the prefix first (docs/operations.md)"
                    )
                self._start_above_archive(cfg.name, queue_id, manifest)
            if unchecked:
                # Recorded before the change is stored, so before any of them is tiered: the
                # offloader, release and cold reads then hold off at their ends until the
                # check has run, as for a queue a start could not check (decision 750).
                if self.divergence is not None:
                    self.divergence.pend(
                        {(cfg.name, q): self.store.max_offset(cfg.name, q) for q in unchecked}
                    )
                log.warning(
                    "%s: queues %s are not checked against their archives: the cold tier did "
                    "not answer within %g s or could not be read. None of them is uploaded, "
                    "released or read from the archive at or above its current end until the "
                    "check has run (decision 750)",
                    cfg.name,
                    ",".join(map(str, unchecked)),
                    self.config.admin_tier_wait_ms / 1000,
                )

    def _load_archive(
        self, offloader: Offloader, topic: str, queue_id: int, *, refresh: bool, read: bool = False
    ) -> Future[QueueManifest]:
        """The queue's manifest, loaded from the tier in a daemon thread (a load the caller gave
        up on must not hold the process's exit). A load of the same queue already under way is
        shared, not started again: each describe of a topic during an outage would otherwise
        leave one more load running out its retries. With ``_ADMIN_TIER_LOADS`` under way (a
        tier that does not answer), none is started and the future never completes: the
        caller's deadline takes the queue as not answered. ``read``: loaded without the queue's
        lock and without filling the cache (``Offloader.read_manifest``)."""
        started = self._start_archive_load(offloader, topic, queue_id, refresh=refresh, read=read)
        return Future() if started is None else started

    def _start_archive_load(
        self, offloader: Offloader, topic: str, queue_id: int, *, refresh: bool, read: bool
    ) -> Future[QueueManifest] | None:
        """``_load_archive``'s, but None when no load could start (every slot taken)."""
        key = (topic, queue_id, refresh, read)
        with self._archive_lock:
            running = self._archive_running.get(key)
            if running is not None:
                return running
            future: Future[QueueManifest] = Future()
            if not self._archive_loads.acquire(blocking=False):
                return None
            self._archive_running[key] = future

        wait_s = self.config.admin_tier_wait_ms / 1000
        bounded = self.admin_tier

        def load() -> None:
            try:
                if future.set_running_or_notify_cancel():
                    future.set_result(
                        # A read load is what a caller waits admin_tier_wait_ms for and then
                        # gives up on; it fills no cache, so nothing is gained by running it
                        # out the tier's retries after that (decision 920).
                        offloader.read_manifest(
                            topic,
                            queue_id,
                            bounded.until(time.monotonic() + wait_s) if bounded else None,
                        )
                        if read
                        else offloader.manifest(topic, queue_id, refresh=refresh)
                    )
            except BaseException as e:
                future.set_exception(e)
            finally:
                with self._archive_lock:
                    if self._archive_running.get(key) is future:
                        del self._archive_running[key]
                self._archive_loads.release()

        threading.Thread(target=load, name="tmq-archive-load", daemon=True).start()
        return future

    def tier_manifests(
        self,
        queues: Iterable[tuple[str, int]],
        *,
        refresh: bool = False,
        read: bool = False,
        deadline: float | None = None,
        failed: dict[tuple[str, int], Exception] | None = None,
    ) -> dict[tuple[str, int], QueueManifest | None]:
        """The manifests of ``queues``, (topic, queue id) pairs: cached ones at once, the others
        loaded together under one deadline, ``admin_tier_wait_ms``. What topic descriptions
        report their tier watermarks from. None for a queue whose manifest did not come in time
        or could not be read: its watermark is reported unknown rather than 0 (decision 810).
        Loads given up on go on in their daemon threads and only fill the cache, so a later
        description has them at once. ``refresh``: every manifest is loaded from the tier, none
        taken from the cache (a check that the tier answers for them now). ``read``: loaded
        from the tier as ``refresh``, but without the queue's lock (an upload under way holds it
        for as long as it takes) and without filling the cache: what `tmq verify` judges
        (decision 885). ``deadline`` (``time.monotonic()``): the caller's, when earlier than
        ``admin_tier_wait_ms``. ``failed``: where given, the error of each queue whose load
        failed (rather than did not answer in time), including a ``ManifestError``."""
        offloader = self.offloader
        if offloader is None:
            return {}
        found: dict[tuple[str, int], QueueManifest | None] = {}
        loads: dict[tuple[str, int], Future[QueueManifest]] = {}
        waiting: list[tuple[str, int]] = []
        for topic, q in queues:
            cached = None if refresh or read else offloader.cached_manifest(topic, q)
            if cached is not None:
                found[(topic, q)] = cached
            else:
                waiting.append((topic, q))
        wait_until = time.monotonic() + self.config.admin_tier_wait_ms / 1000
        if deadline is not None:
            wait_until = min(wait_until, deadline)
        # At most _ADMIN_TIER_LOADS loads at once: a queue past them waits for a slot (a load
        # that ends) within the same deadline, so a healthy tier gives every queue's manifest.
        while waiting:
            while waiting:
                topic, q = waiting[0]
                load = self._start_archive_load(
                    offloader, topic, q, refresh=refresh or read, read=read
                )
                if load is None:
                    break
                loads[waiting.pop(0)] = load
            remaining = wait_until - time.monotonic()
            if not waiting or remaining <= 0:
                break
            mine = [f for f in loads.values() if not f.done()]
            if mine:
                wait(mine, timeout=remaining, return_when=FIRST_COMPLETED)
            else:
                time.sleep(min(0.05, remaining))  # the slots are other calls' loads
        for key in waiting:
            found[key] = None  # no slot came free in time
        for key, load in loads.items():
            try:
                found[key] = load.result(timeout=max(0.0, wait_until - time.monotonic()))
            except (FutureTimeout, CancelledError):
                found[key] = None
            except (OffloadError, StorageError, ManifestError) as e:
                if failed is None and isinstance(e, ManifestError):
                    raise
                found[key] = None
                if failed is not None:
                    failed[key] = e
        return found

    def _local_only_from(self, topic: str, queue_id: int) -> int | None:
        """From which offset no read of the queue is served from its archive (None: every
        offset the archive holds may be): the base of a queue not checked against its archive,
        or that diverged from it (decision 750), and 0 for a prefix another data directory
        wrote (decision 751: its archive is another log's, at the offsets of this one's).
        Answers from cached state: reads below the hot store call it."""
        if self.fetcher is not None and self.offloader is not None:
            manifest = self.fetcher.cached(topic, queue_id)
            if manifest is not None and self.offloader.foreign(manifest) is not None:
                return 0
        return self.divergence.local_from(topic, queue_id) if self.divergence else None

    def _tiered_queues(self) -> list[tuple[str, int]]:
        return [
            (t.name, q)
            for t in list(self.metadata.topics.values())
            if t.tiered
            for q in range(t.queues)
        ]

    def start(self) -> int:
        """Check the tier, open the store, serve, register; returns the bound port (``port =
        0``: any free)."""
        self._check_tier()
        self.store.start()
        if self.store.dispatcher is not None:
            # Nobody looks these up by key (a committed copy or a delivered timer is found in
            # its real topic): no IndexFile work per half message, decision or timer record.
            self.store.dispatcher.unindexed_topics = frozenset((HALF_TOPIC, OP_TOPIC, TIMER_TOPIC))
        try:
            if self.cold_worker is not None:
                self.cold_worker.start()
            self.metadata.load()
            if self.fetcher is not None:
                self.fetcher.prime()  # before serving: reads see the archive from the first
                self._continue_above_archives()  # before serving: no append reuses an offset
                self.fetcher.start()
            if self.replication is not None:
                self.replication.start()
            server = new_server(
                _WORKERS,
                "broker",
                [
                    ("grpc.max_receive_message_length", _MAX_MESSAGE_BYTES),
                    ("grpc.max_send_message_length", _MAX_MESSAGE_BYTES),
                ],
                self._interceptors(),
            )
            tls = self.config.tls
            self.port = listen(
                server,
                self.config.listen,
                self.config.port,
                "broker",
                server_credentials(tls) if tls.enabled else None,
            )
            identity = BrokerIdentity(
                self.config.cluster, self.config.name, self.config.advertise_host, self.port
            )
            messaging = MessagingServicer(
                self.store,
                self.metadata,
                self.pop,
                identity,
                self.namesrv,
                self.config.limits,
                auto_create_groups=self.config.auto_create_groups,
                traffic=self.metrics.traffic,
                producers=self.producers,
                transactions=self.transactions,
                timers=self.timers,
                max_delay_ms=self.config.timer_max_delay_ms,
                replication=self._send_gate(),
            )
            self.timers.start()
            self.transactions.start()
            if self.controller is not None:
                # Any member answers; what needs the master is forwarded to it (decision 134).
                controller = self.controller
                self._forwarder = ForwardingHandler(
                    lambda target: add_safely(
                        service_pb2_grpc.add_MessagingServiceServicer_to_server, messaging, target
                    ),
                    controller.forward_target,
                    self.security,
                )
                server.add_generic_rpc_handlers((self._forwarder,))
                add_safely(
                    relay_pb2_grpc.add_ReplicaGroupServicer_to_server,
                    CheckRelayServicer(self.producers),
                    server,
                )
            else:
                add_safely(
                    service_pb2_grpc.add_MessagingServiceServicer_to_server, messaging, server
                )
            add_safely(
                admin_pb2_grpc.add_AdminServicer_to_server,
                AdminServicer(
                    self.store,
                    self.metadata,
                    self.config.name,
                    self._register_now.set,
                    self.apply_retention if self.offloader is not None else None,
                    self.offloader,
                    status=lambda: self.status(hot_bytes=True),
                    cluster=self.config.cluster,
                    timers=self.timers.stats,
                    before_put_topic=self.before_put_topic,
                    transactions_pending=self.transactions.pending_by_topic,
                    tier_manifests=self.tier_manifests,
                    tier_wait_s=self.config.admin_tier_wait_ms / 1000,
                ),
                server,
            )
            add_safely(
                acl_pb2_grpc.add_AclServicer_to_server, AclServicer(self.metadata.acl), server
            )
            health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
            if self.config.metrics_port:
                self.metrics_port = self.metrics.serve(
                    self.config.listen, self.config.metrics_port, self.config.tls
                )
            server.start()
            for name in ("", MESSAGING_SERVICE, ADMIN_SERVICE, ACL_SERVICE):
                self._health.set(name, health_pb2.HealthCheckResponse.SERVING)
            self._server = server
            if self.controller is not None:
                self.controller.start()  # after the port is known: members publish it
        except BaseException:
            self.metrics.close()
            self.transactions.stop()
            self.timers.stop()
            if self.controller is not None:
                self.controller.stop()
            elif self.replication is not None:
                self.replication.stop()
            if self.cold_worker is not None:
                self.cold_worker.close()
            self.store.shutdown()
            raise
        self.register()
        for target, name in (
            (self._registration_loop, "tmq-registration"),
            (self._maintenance_loop, "tmq-maintenance"),
            (self._offload_loop, "tmq-offload"),
        ):
            thread = threading.Thread(target=target, name=name, daemon=True)
            thread.start()
            self._threads.append(thread)
        if self.config.lakehouse.enabled and self.config.tier_url:
            self._start_export(self.config.tier_url)
        log.info(
            "broker %s serving on %s:%d (advertised as %s)",
            self.config.name,
            self.config.listen,
            self.port,
            self.config.advertise_host,
        )
        return self.port

    def _tier_term(self) -> Term | None:
        """Who writes the tier (offload/leadership.py): the master in its epoch, a single
        broker in epoch 0, a slave never."""
        if isinstance(self.replication, ReplicationSlave):
            return None
        if self.controller is not None and not self.role.is_master():
            return None  # fenced by the controller, or not yet elected
        epoch = self.replication.epoch if self.replication is not None else 0
        return Term(epoch, f"{self.config.name}@{self.config.advertise_host}:{self.port}")

    def _upload_limit(self) -> int | None:
        """A master uploads only what every member of its SyncStateSet holds (Kafka's rule:
        remote copies stop at the high watermark), so the tier never archives a message that
        the next elected master lacks. A single broker: no limit."""
        if isinstance(self.replication, ReplicationMaster):
            return self.replication.in_sync_offset()
        return None

    def _fence_reason(self) -> str | None:
        offloader = self.offloader
        if offloader is None or not offloader.fenced or offloader.fenced_by is None:
            return None
        by = offloader.fenced_by
        return (
            f"this broker was deposed: {by.writer} leads epoch {by.epoch} of broker "
            f"{self.config.name}; it takes no sends and writes nothing to the tier"
        )

    def _send_gate(self) -> SendGate | None:
        # With a controller, it is the gate: it asks whichever replication role is current.
        inner = self.controller if self.controller is not None else self.replication
        if self.offloader is None:
            return inner
        return FencedGate(inner, self._fence_reason)

    def _interceptors(self) -> list[grpc.ServerInterceptor]:
        """With ``[auth]`` on: every call signed, and allowed by the ACLs (docs/security.md).
        The environment's admin is created or updated first; with none there and none
        stored, nobody could ever manage the broker, so it refuses to start."""
        auth = self.config.auth
        if not auth.enabled:
            return []
        acl = self.metadata.acl
        if self.security.signs:
            acl.ensure_admin(self.security.access_key, self.security.secret_key)
        elif not any(admin for _, admin in acl.users()):
            raise ValueError(
                "[auth] is enabled but there is no admin user: set TMQ_ADMIN_ACCESS_KEY and "
                "TMQ_ADMIN_SECRET_KEY for the first one"
            )
        return [
            AuthInterceptor(
                Authenticator(acl, auth.max_clock_skew_s),
                BrokerPolicy(acl),
                [
                    service_pb2.DESCRIPTOR,
                    admin_pb2.DESCRIPTOR,
                    acl_pb2.DESCRIPTOR,
                    relay_pb2.DESCRIPTOR,
                ],
                on_denied=self.metrics.denied,
            )
        ]

    def status(self, *, hot_bytes: bool = False) -> BrokerStatus:
        """A snapshot for metrics and ``tmq status`` (memory and local disk only)."""
        return broker_status(
            self.store, self.metadata, self.offloader, self.export_freshness, hot_bytes=hot_bytes
        )

    def registration(self) -> nspb.BrokerRegistration:
        """What the NameServers hear. A slave registers no topics: it is listed (``tmq
        status``) but routes lead clients to masters only, until slaves serve reads."""
        # A controller-run group routes clients to every member (each forwards to the master,
        # decision 134), so its slaves register their topics too.
        serves = self.role.is_master() or self.controller is not None
        return nspb.BrokerRegistration(
            cluster=self.config.cluster,
            broker_name=self.config.name,
            broker_id=self.broker_id,
            endpoint=nspb.Endpoint(host=self.config.advertise_host, port=self.port),
            topics=[
                nspb.TopicConfig(
                    topic=t.name, queues=t.queues, perm=t.perm, message_type=t.message_type
                )
                for t in list(self.metadata.topics.values())
                if serves
            ],
        )

    def _registered_master(self) -> str | None:
        """The endpoint the NameServers list as this group's master (broker id 0), if any."""
        if self.namesrv is None:
            return None
        for info in self.namesrv.cluster_info().brokers:
            b = info.broker
            if (b.cluster, b.broker_name, b.broker_id) == (
                self.config.cluster,
                self.config.name,
                0,
            ):
                return f"{b.endpoint.host}:{b.endpoint.port}"
        return None

    @property
    def broker_id(self) -> int:
        """0 for a master or a single broker, 1.. for slaves (RocketMQ's brokerId). An elected
        master is 0; it registers under its member id again once it is a slave."""
        if not self.config.ha.enabled:
            return 0
        if self.controller is not None:
            return 0 if self.role.is_master() else self.config.ha.broker_id
        return self.config.ha.broker_id

    def register(self) -> None:
        if self.namesrv is not None:
            registration = self.registration()
            failpoints.hit("register.before_send")
            previous, self._registered_id = self._registered_id, registration.broker_id
            if previous is not None and previous != registration.broker_id:
                # A promoted slave or a deposed master: its old entry must not route anyone.
                self.namesrv.unregister(
                    self.config.cluster, self.config.name, previous, registration.endpoint
                )
            self.namesrv.register(registration)

    def _replication_changed(self, current: ReplicationMaster | ReplicationSlave | None) -> None:
        # A new term of pop state (decision 860): a member elected again takes its groups'
        # positions from the replicated offsets, and a deposed one stops reviving deliveries
        # of a term that is over.
        self.pop.new_term()
        self.replication = current
        self._register_now.set()

    def _writable_master(self) -> bool:
        return self.role.get().is_writable_master

    def _role_changed(self, snapshot: RoleSnapshot) -> None:
        """A fenced master answers NOT_SERVING (load balancers and health checks move away);
        every other role serves. Registration follows at once (brokerId 0 or the member id)."""
        fenced = snapshot.role == "master" and snapshot.fenced
        status = (
            health_pb2.HealthCheckResponse.NOT_SERVING
            if fenced
            else health_pb2.HealthCheckResponse.SERVING
        )
        if self._server is not None:
            for name in ("", MESSAGING_SERVICE):
                self._health.set(name, status)
        self._register_now.set()

    def _replication_status(self) -> ReplicationStatus | None:
        status = self.replication.status() if self.replication is not None else None
        if status is None or self.controller is None:
            return status
        m = self.controller.metrics
        return replace(
            status,
            fenced=self.role.fenced,
            elections_won=m.elections_won,
            fencings=m.fenced,
            role_changes=m.role_changes,
            keeper_restarts=m.keeper_restarts,
        )

    def _registration_loop(self) -> None:
        while not self._stop.is_set():
            self._register_now.wait(self.config.heartbeat_interval_ms / 1000)
            if self._stop.is_set():
                return
            self._register_now.clear()
            with self._registering:
                if self._stop.is_set():
                    return  # stop() has unregistered, or is about to: no heartbeat after it
                try:
                    self.register()
                except Exception:
                    log.exception("registration with the NameServers failed")

    def _check_tier(self) -> None:
        """Refuse to start on a tier that cannot work (no such bucket, no permission to write,
        bad credentials): ``TierUnusableError`` with one line naming the bucket and the fix,
        instead of a broker that fails at its first upload. An unreachable tier only warns:
        the hot path never depends on the network, and uploads catch up once it is back."""
        if self.tier is None:
            return
        try:
            check_writable(self.tier, f"{self.config.cluster}/{self.config.name}")
        except PermanentStorageError as e:
            raise TierUnusableError(f"the cold tier cannot be used: {e}") from None
        except StorageError as e:
            log.warning("the cold tier is unreachable at start (uploads will retry): %s", e)

    def _maintenance_loop(self) -> None:
        """Revive expired pop deliveries every second and save consumer offsets every 5 s.
        Its own thread: an offload pass can take minutes (a backlog, a slow or dead tier), and
        offsets not saved meanwhile would rewind every group that far after a kill -9. Each
        step fails alone: a revive that raises must not keep offsets from being saved
        (decision 970)."""
        ticks = 0
        while not self._stop.wait(1.0):
            ticks += 1
            try:
                self.pop.revive_expired()
            except Exception:
                log.exception("reviving expired pop deliveries failed; retrying")
            if ticks % 5 == 0:
                try:
                    self.metadata.flush_offsets()
                except Exception:
                    log.exception("saving consumer offsets failed; retrying")

    def _offload_loop(self) -> None:
        """Offload, retention and release, every ``offload_interval_ms``."""
        while not self._stop.wait(max(1.0, self.config.offload_interval_ms / 1000)):
            try:
                self.offload_and_release()
            except Exception:
                log.exception("offload pass failed; retrying")

    def apply_retention(
        self, topic: str | None = None, dry_run: bool = False
    ) -> list[RetentionResult]:
        """Expire archived segments older than their topic's TTL, or beyond its byte limit
        (one topic, or all)."""
        results = []
        for cfg, queue_id in self._retained_queues(topic):
            r = self._expire(cfg, queue_id, dry_run)
            if r.segments:
                results.append(r)
        return results

    def _retained_queues(self, topic: str | None = None) -> list[tuple[TopicConfig, int]]:
        return [
            (cfg, queue_id)
            for cfg in list(self.metadata.topics.values())
            if (topic is None or cfg.name == topic)
            and cfg.tiered
            and (cfg.retention_ms or cfg.retention_bytes)
            for queue_id in range(cfg.queues)
        ]

    def _expire(self, cfg: TopicConfig, queue_id: int, dry_run: bool = False) -> RetentionResult:
        assert self.offloader is not None
        now = time.time_ns() // 1_000_000
        cutoff = now - cfg.retention_ms if cfg.retention_ms else 0
        return self.offloader.expire(
            cfg.name, queue_id, cutoff, max_bytes=cfg.retention_bytes, dry_run=dry_run
        )

    def offload_and_release(self) -> None:
        """Upload every tiered queue the offload policy says is due, expire what retention
        says, then release the CommitLog files that the release rule allows
        (offload/release.py).

        Each queue's upload and expiry is isolated: whatever one of them raises (an outage, a
        damaged manifest, a bug) is counted in ``offload_failures`` and logged, and the pass
        goes on with the other queues and with release, which keeps what it cannot prove safe
        to delete. Only the master uploads and applies retention: a slave reads the watermark
        its master committed and releases below it; a fenced (deposed) master does neither
        and keeps every tiered file (offload/release.py). A master the controller fenced
        (broker/ha/controller.py) does nothing until it is a slave."""
        slave = isinstance(self.replication, ReplicationSlave)
        if self.controller is not None and not slave and not self.role.is_master():
            return
        if slave and self.offloader is not None:
            self._refresh_watermarks(self.offloader)
        self._report_fence()
        if self.offloader is not None and not slave and not self.offloader.fenced:
            if self._resumer is not None:
                try:
                    self._resumer.run()
                except Exception:  # the store refused an append or a flush: the next pass
                    log.exception("finishing an interrupted resolve failed; retrying")
            now = time.time_ns() // 1_000_000
            due: list[tuple[str, int]] = []
            for topic in [t for t in list(self.metadata.topics.values()) if t.tiered]:
                for queue_id in range(topic.queues):
                    if self._stop.is_set():
                        return  # shutting down: a pass against a dead tier would delay it
                    try:
                        self.offloader.claim(topic.name, queue_id)  # fences a deposed master
                        reason = self.offloader.due(topic.name, queue_id, now)
                        if reason is None:
                            continue
                        log.debug("offload %s/%d: %s", topic.name, queue_id, reason)
                        due.append((topic.name, queue_id))
                    except Exception as e:
                        self._queue_failed("offload", topic.name, queue_id, e)
            committed = False
            # Several queues at once: their uploads share the cold worker's bounded queue.
            for (name, queue_id), outcome in zip(
                due, self.offloader.offload_queues(due), strict=True
            ):
                if isinstance(outcome, Exception):
                    self._queue_failed("offload", name, queue_id, outcome)
                elif isinstance(outcome, BaseException):
                    raise outcome
                elif outcome.segments:
                    committed = True
            for cfg, queue_id in self._retained_queues():
                if self._stop.is_set():
                    return
                try:
                    self._expire(cfg, queue_id)
                except Exception as e:
                    self._queue_failed("retention", cfg.name, queue_id, e)
            if committed:
                failpoints.hit("offload.before_release")
        topics = dict(self.metadata.topics)  # a snapshot: admin calls may change it meanwhile
        can_release = release_predicate(
            self.store,
            self.offloader,
            topics,
            pinned_topics=frozenset((TIMER_TOPIC, HALF_TOPIC, OP_TOPIC)),
        )
        pinned = self.pinned_offset()
        self.released_files += self.store.release_commitlog_files(
            lambda f: (pinned is None or f.end_offset <= pinned) and can_release(f)
        )
        if not slave and not (self.offloader is not None and self.offloader.fenced):
            self._roll_forward(can_release)  # an append: the serving master's alone

    def _roll_forward(self, can_release: Callable[[CommitLogFileInfo], bool]) -> None:
        """When the oldest CommitLog file could go but for a pending half message or timer in
        it, re-put those forward (RocketMQ's roll), so that the next pass releases it: a
        transaction left open for days, or a 3-day timer, no longer holds every file after it.
        Only a serving master rolls: a slave's records come from its master's CommitLog (the
        master's roll reaches it as ordinary records), and a fenced master appends nothing."""
        pinned = self.pinned_offset()
        files = self.store.commitlog_files()[:-1]  # never the file being written
        if pinned is None or not files or files[0].end_offset <= pinned:
            return
        oldest = files[0]
        if oldest.end_offset > self.store.dispatched_offset or not can_release(oldest):
            return
        self.transactions.roll_forward(oldest.end_offset)
        self.timers.roll_forward(oldest.end_offset)

    def _refresh_watermarks(self, offloader: Offloader) -> None:
        """A slave: reload each tiered queue's manifest (read only), so release trusts the
        watermark its master committed last, never one of its own."""
        for topic in [t for t in list(self.metadata.topics.values()) if t.tiered]:
            for queue_id in range(topic.queues):
                try:
                    offloader.manifest(topic.name, queue_id, refresh=True)
                except OffloadError as e:  # keeps the last one: release stays below it
                    log.warning(
                        "tier watermark of %s/%d not refreshed: %s", topic.name, queue_id, e
                    )

    def _report_fence(self) -> None:
        """Once fenced: NOT_SERVING on health, so that load balancers and operators see the
        deposed master (the log line and ``tmq_tier_fenced`` say why)."""
        reason = self._fence_reason()
        if reason is None or self._fence_reported:
            return
        self._fence_reported = True
        log.error("%s", reason)
        for name in ("", MESSAGING_SERVICE):
            self._health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)

    def pinned_offset(self) -> int | None:
        """The lowest CommitLog offset still needed by an undecided half message or an
        undelivered timer: no file from there on may be released, whatever its topics'
        retention says."""
        pins = (self.transactions.pinned_offset(), self.timers.pinned_offset())
        return min((p for p in pins if p is not None), default=None)

    def _queue_failed(self, step: str, topic: str, queue_id: int, e: Exception) -> None:
        self.offload_failures += 1
        if isinstance(e, DamagedEntryOffloadError):
            return  # the offloader logs a hold when it starts, then at a low rate (decision 755)
        if isinstance(e, OffloadError):
            log.error("%s of %s/%d failed: %s", step, topic, queue_id, e)
        else:  # not a storage failure the offloader knows: keep the traceback
            log.exception("%s of %s/%d failed: %s: %s", step, topic, queue_id, type(e).__name__, e)

    def _start_export(self, tier_url: str) -> None:
        """The continuous Delta export as a child process (lakehouse/runner.py), and a thread
        that measures its freshness for metrics and ``tmq status`` once per trigger, at least
        5 s apart (a scrape never reads the lake or the tier itself)."""
        lakehouse = self.config.lakehouse
        if not lakehouse.log_path:  # the child's log lives in the data dir, not the cwd
            log_path = self.config.store.data_dir / "lakehouse-export.log"
            lakehouse = replace(lakehouse, log_path=str(log_path))
        self._export = ContinuousExport(lakehouse, tier_url, self.config.tier_options)
        self._export.start()
        self.export_freshness = lambda: dict(self._freshness)

        def measure() -> None:
            from lakehouse.locations import Location
            from lakehouse.status import topic_status

            cfg = self.config.lakehouse
            while not self._stop.wait(max(5.0, cfg.trigger_seconds)):
                try:
                    rows = topic_status(
                        Location.of(cfg.lake_root),
                        cfg.topics or None,
                        Location.of(tier_url, self.config.tier_options),
                    )
                    self._freshness = {
                        r.topic: r.lag_seconds for r in rows if r.lag_seconds is not None
                    }
                except Exception as e:  # the export may not have made a table yet
                    log.info("export freshness not measured: %s", e)

        thread = threading.Thread(target=measure, name="tmq-export-freshness", daemon=True)
        thread.start()
        self._threads.append(thread)

    def stop(self, grace: float = 5.0) -> None:
        """Report NOT_SERVING, unregister, drain requests for up to ``grace`` seconds, save
        offsets, close the store."""
        # Health watchers and load balancers hear NOT_SERVING before the port closes.
        self._health.enter_graceful_shutdown()
        self._stop.set()
        self._register_now.set()
        if self.namesrv is not None:
            # After any heartbeat under way (a slow NameServer holds one up to 3 s each): one
            # that reached a NameServer after this unregister would list a stopped broker
            # there until its expiry, 120 s of clients routed to a closed port (decision 1260).
            with self._registering:
                self.namesrv.unregister(
                    self.config.cluster,
                    self.config.name,
                    self.broker_id,
                    nspb.Endpoint(host=self.config.advertise_host, port=self.port),
                )
        if self._server is not None:
            self._server.stop(grace).wait()
        for thread in self._threads:
            thread.join()
        if self._export is not None:
            self._export.stop()
        self.metrics.close()
        self.transactions.stop()
        if self.check_relay is not None:
            self.check_relay.close()
        self.timers.stop()
        self.metadata.flush_offsets(force=True)
        if self.controller is not None:
            self.controller.stop()
        elif self.replication is not None:
            self.replication.stop()
        self.metadata.close()
        if self.fetcher is not None:
            self.fetcher.close()
        if self.offloader is not None:
            self.offloader.close()
        if self.cold_worker is not None:
            self.cold_worker.close()
        self.store.shutdown()
        if self.namesrv is not None:
            self.namesrv.close()
