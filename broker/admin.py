"""tmq's admin gRPC service on the broker (``tmq.admin.v1.Admin``): topics, groups, stats."""

from __future__ import annotations

import errno
import logging
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Protocol

import grpc

from broker import admin_pb2 as pb
from broker import admin_pb2_grpc as pb_grpc
from broker.metadata import (
    DEFAULT_MAX_DELIVERY_ATTEMPTS,
    BrokerMetadata,
    GroupConfig,
    InvalidNameError,
    TopicConfig,
    check_group_name,
)
from broker.status import BrokerStatus
from broker.timer import TimerStats
from offload.divergence import Conflict
from offload.offloader import (
    ArchiveAheadError,
    Offloader,
    OffloadError,
    OffloadResult,
    RetentionResult,
)
from offload.resolve import ResolveRefusedError, TierUnavailableError
from offload.resolve import resolve as resolve_divergence
from offload.verify import FAILURE, WARNING, verify_queue, worst
from tiered.cold.fetcher import ColdTierUnavailableError
from tiered.cold.manifest import ManifestError, QueueManifest
from tiered.cold.storage import PermanentStorageError, StorageError, within
from tiered.store import MessageStore

log = logging.getLogger(__name__)

# Segment checks of `tmq verify` in flight at once (ranged GETs of footers, or whole objects).
VERIFY_WORKERS = 16

# Trailing metadata of a call refused because the cold tier did not answer (decision 921): the
# CLI tells it apart from a broker that does not answer (both UNAVAILABLE) and exits 4.
TIER_UNAVAILABLE = ("tmq-cold-tier", "unavailable")


def abort_tier_unavailable(context: grpc.ServicerContext, message: str) -> None:
    """Refuse the call (UNAVAILABLE) because the cold tier did not answer; raises."""
    context.set_trailing_metadata((TIER_UNAVAILABLE,))
    context.abort(grpc.StatusCode.UNAVAILABLE, message)


def _tier_failed(e: BaseException) -> bool:
    """Whether ``e`` (an offload's error) is the tier not answering, or answering errors a
    retry may cure (503s), rather than a refusal or damage."""
    cause = e.__cause__
    return isinstance(cause, StorageError) and not isinstance(cause, PermanentStorageError)


def topic_to_pb(cfg: TopicConfig) -> pb.Topic:
    return pb.Topic(
        name=cfg.name,
        queues=cfg.queues,
        perm=cfg.perm,
        message_type=cfg.message_type,
        tiered=cfg.tiered,
        retention_ms=cfg.retention_ms or 0,
        local_retention_ms=cfg.local_retention_ms or 0,
        retention_bytes=cfg.retention_bytes or 0,
    )


def topic_from_pb(t: pb.Topic) -> TopicConfig:
    return TopicConfig(
        name=t.name,
        queues=t.queues or 8,
        perm=t.perm or 6,
        message_type=t.message_type or "NORMAL",
        tiered=t.tiered,
        retention_ms=t.retention_ms or None,
        local_retention_ms=t.local_retention_ms or None,
        retention_bytes=t.retention_bytes or None,
    )


class TierManifests(Protocol):
    """``Broker.tier_manifests``: queues' manifests within the broker's admin_tier_wait_ms."""

    def __call__(
        self,
        queues: Iterable[tuple[str, int]],
        *,
        refresh: bool = False,
        read: bool = False,
        deadline: float | None = None,
        failed: dict[tuple[str, int], Exception] | None = None,
    ) -> dict[tuple[str, int], QueueManifest | None]: ...


class AdminServicer(pb_grpc.AdminServicer):
    def __init__(
        self,
        store: MessageStore,
        metadata: BrokerMetadata,
        broker_name: str,
        on_topics_changed: Callable[[], None],
        apply_retention: Callable[[str | None, bool], list[RetentionResult]] | None = None,
        offloader: Offloader | None = None,
        status: Callable[[], BrokerStatus] | None = None,
        cluster: str = "",
        timers: Callable[[], TimerStats | None] = lambda: None,
        transactions_pending: Callable[[], dict[str, int]] = dict,
        before_put_topic: Callable[[TopicConfig, TopicConfig | None], None] = lambda _c, _e: None,
        tier_manifests: TierManifests | None = None,
        tier_wait_s: float = 5.0,
    ) -> None:
        self.store = store
        self.metadata = metadata
        self.broker_name = broker_name
        self.on_topics_changed = on_topics_changed
        self.apply_retention = apply_retention
        self.offloader = offloader
        self.status = status
        self.cluster = cluster
        self.timers = timers
        self.transactions_pending = transactions_pending
        # The broker's check of the queues a topic change makes tiered against their archives
        # (decision 745): it raises to refuse the change.
        self.before_put_topic = before_put_topic
        # One topic change at a time, from reading the topic to storing it (decision 791): a
        # change that read the topic before another stored it would check, and move, queues
        # the other has already made tiered and messages may be reaching.
        self._put_topic_lock = threading.Lock()
        # Tiered queues' manifests within the broker's admin_tier_wait_ms, None where the tier
        # did not answer in time (decision 810); without it, loaded one by one with no deadline.
        self.tier_manifests = tier_manifests
        # The broker's admin_tier_wait_ms in seconds: how long `tmq offload` goes without news
        # of its upload before it asks whether the tier answers (decision 921).
        self.tier_wait_s = tier_wait_s

    def PutTopic(
        self, request: pb.PutTopicRequest, context: grpc.ServicerContext
    ) -> pb.PutTopicResponse:
        try:
            cfg = topic_from_pb(request.topic)
        except (InvalidNameError, ValueError) as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        with self._put_topic_lock:
            existing = self.metadata.topic(cfg.name)
            if existing is not None and not request.update:
                context.abort(grpc.StatusCode.ALREADY_EXISTS, f"topic {cfg.name} already exists")
            if existing is None and request.update:
                context.abort(grpc.StatusCode.NOT_FOUND, f"topic {cfg.name} does not exist")
            if existing is not None and cfg.queues < existing.queues:
                context.abort(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"topic {cfg.name} has {existing.queues} queues; shrinking would strand "
                    "their messages",
                )
            try:
                self.before_put_topic(cfg, existing)
                self.metadata.put_topic(cfg)
            except ArchiveAheadError as e:
                context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
            except OSError as e:
                # The topic or the record of its unchecked queues (decision 750) could not be
                # saved: nothing of the change was made (decision 793).
                context.abort(
                    grpc.StatusCode.RESOURCE_EXHAUSTED
                    if e.errno == errno.ENOSPC
                    else grpc.StatusCode.INTERNAL,
                    f"topic {cfg.name} not changed: the broker could not save it ({e})",
                )
        self.on_topics_changed()
        return pb.PutTopicResponse()

    def _min_offset(self, topic: str, queue_id: int) -> int:
        """The queue's first readable offset; -1 while a tiered queue's archive start is not
        known (the cold tier has been down since the broker started, decision 520)."""
        try:
            return self.store.min_offset(topic, queue_id)
        except StorageError:
            return -1

    def _divergence(self, topic: str, queue_id: int) -> tuple[int, Conflict | None] | None:
        """The queue's pending check or conflict with its archive (decisions 750, 800)."""
        divergence = self.offloader.divergence if self.offloader is not None else None
        return divergence.state(topic, queue_id) if divergence is not None else None

    def _manifests(self, cfgs: list[TopicConfig]) -> dict[tuple[str, int], QueueManifest | None]:
        """The manifests of the tiered queues of ``cfgs``, all under one deadline (decision
        810): loaded one after the other with no deadline, a description during an outage
        waited out the tier's retries for every queue whose manifest was not cached. A queue
        not checked against its archive yet is not loaded here (decision 800): its watermark
        comes from the cached manifest, or is unknown."""
        queues = [
            (c.name, q)
            for c in cfgs
            if c.tiered
            for q in range(c.queues)
            if (shown := self._divergence(c.name, q)) is None or shown[1] is not None
        ]
        if self.offloader is None or not queues:
            return {}
        if self.tier_manifests is not None:
            return self.tier_manifests(queues)
        offloader = self.offloader
        return {(t, q): offloader.manifest(t, q) for t, q in queues}

    def _describe(
        self, cfg: TopicConfig, manifests: dict[tuple[str, int], QueueManifest | None]
    ) -> pb.TopicDescription:
        def watermark(q: int) -> int | None:
            """The queue's tier watermark; None when its manifest is unknown (decision 810)."""
            if self.offloader is None or not cfg.tiered:
                return 0
            shown = self._divergence(cfg.name, q)
            if shown is not None and shown[1] is None:
                # Not checked against its archive: nothing of it at or past the recorded end is
                # trusted as archived until the check runs (decision 800), and without a cached
                # manifest the archive's end is unknown, not 0 (decision 810).
                cached = self.offloader.cached_manifest(cfg.name, q)
                return min(cached.end_offset, shown[0]) if cached is not None else None
            manifest = manifests.get((cfg.name, q))
            if manifest is None:
                return None
            # An archive another data directory wrote holds none of this broker's messages
            # (decision 690): its end is not this queue's watermark.
            return 0 if self.offloader.foreign(manifest) else manifest.end_offset

        def queue(q: int) -> pb.QueueStats:
            tier_watermark = watermark(q)
            stats = pb.QueueStats(
                queue=q,
                min_offset=self._min_offset(cfg.name, q),
                max_offset=self.store.max_offset(cfg.name, q),
                hot_min_offset=self.store.hot_min_offset(cfg.name, q),
                tier_watermark=-1 if tier_watermark is None else tier_watermark,
                tier_unknown=tier_watermark is None,
            )
            hold = self.offloader.held(cfg.name, q) if self.offloader and cfg.tiered else None
            if hold is not None:  # held at a damaged ConsumeQueue entry (decision 755)
                stats.offload_held = True
                stats.offload_held_offset = hold.offset
                stats.offload_held_reason = hold.reason
                stats.offload_held_since_ms = hold.since_ms
            shown = self._divergence(cfg.name, q) if cfg.tiered else None
            if shown is not None:  # not checked against its archive, or diverged (800)
                base, conflict = shown
                stats.tier_unchecked_from = base
                if conflict is None:
                    stats.tier_check_pending = True
                else:
                    stats.tier_diverged = True
                    stats.tier_archive_end = conflict.archive_end
                    stats.tier_resolve_copies_from = conflict.copies_from or 0
            return stats

        timers = self.timers() if cfg.message_type == "DELAY" else None
        return pb.TopicDescription(
            timers_pending=timers.pending_by_topic.get(cfg.name, 0) if timers else 0,
            timer_delivery_lag_seconds=timers.lag_seconds if timers else 0.0,
            transactions_pending=self.transactions_pending().get(cfg.name, 0)
            if cfg.message_type == "TRANSACTION"
            else 0,
            topic=topic_to_pb(cfg),
            queues=[queue(q) for q in range(cfg.queues)],
        )

    def GetTopic(
        self, request: pb.GetTopicRequest, context: grpc.ServicerContext
    ) -> pb.TopicDescription:
        cfg = self.metadata.topic(request.name)
        if cfg is None:
            context.abort(grpc.StatusCode.NOT_FOUND, f"topic {request.name} does not exist")
            raise AssertionError("abort raises")
        return self._describe(cfg, self._manifests([cfg]))

    def ListTopics(
        self, request: pb.ListTopicsRequest, context: grpc.ServicerContext
    ) -> pb.ListTopicsResponse:
        cfgs = sorted(self.metadata.topics.values(), key=lambda t: t.name)
        manifests = self._manifests(cfgs)
        return pb.ListTopicsResponse(topics=[self._describe(t, manifests) for t in cfgs])

    def PutGroup(
        self, request: pb.PutGroupRequest, context: grpc.ServicerContext
    ) -> pb.PutGroupResponse:
        g = request.group
        try:
            check_group_name(g.name)
        except InvalidNameError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        if g.max_delivery_attempts < 0:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "max_delivery_attempts must be >= 1")
        self.metadata.put_group(
            GroupConfig(
                name=g.name,
                fifo=g.fifo,
                max_delivery_attempts=g.max_delivery_attempts or DEFAULT_MAX_DELIVERY_ATTEMPTS,
            )
        )
        return pb.PutGroupResponse()

    def ListGroups(
        self, request: pb.ListGroupsRequest, context: grpc.ServicerContext
    ) -> pb.ListGroupsResponse:
        return pb.ListGroupsResponse(
            groups=[
                pb.Group(name=g.name, max_delivery_attempts=g.max_delivery_attempts, fifo=g.fifo)
                for g in sorted(self.metadata.groups.values(), key=lambda g: g.name)
            ]
        )

    def Stats(self, request: pb.StatsRequest, context: grpc.ServicerContext) -> pb.StatsResponse:
        commitlog = self.store.commitlog_stats()
        return pb.StatsResponse(
            broker_name=self.broker_name,
            commitlog_min_offset=commitlog.min_offset,
            commitlog_max_offset=commitlog.max_offset,
            dispatched_offset=self.store.dispatched_offset,
            topics=len(self.metadata.topics),
            groups=len(self.metadata.groups),
        )

    def Status(self, request: pb.StatusRequest, context: grpc.ServicerContext) -> pb.StatusResponse:
        if self.status is None:
            context.abort(grpc.StatusCode.UNIMPLEMENTED, "this broker reports no status")
            raise AssertionError("abort raises")
        st = self.status()
        return pb.StatusResponse(
            broker_name=self.broker_name,
            cluster=self.cluster,
            topics=len(self.metadata.topics),
            dispatch_lag_bytes=st.dispatch_lag_bytes,
            commitlog_files=st.commitlog_files,
            hot_store_bytes=st.hot_store_bytes,
            cold_store_bytes=st.cold_store_bytes,
            has_tier=st.has_tier,
            queues=[
                pb.TieredQueueStatus(
                    topic=q.topic,
                    queue=q.queue,
                    max_offset=q.max_offset,
                    known=q.lag is not None,
                    lag_messages=q.lag.messages if q.lag else 0,
                    lag_bytes=q.lag.bytes if q.lag else 0,
                    lag_seconds=q.lag.seconds if q.lag else 0.0,
                    archived_bytes=q.lag.archived_bytes if q.lag else 0,
                    hot_bytes=q.hot_bytes or 0,
                )
                for q in st.tiered_queues
            ],
            export_reported=st.export_freshness is not None,
            export_freshness_seconds=st.export_freshness or {},
        )

    def ApplyRetention(
        self, request: pb.ApplyRetentionRequest, context: grpc.ServicerContext
    ) -> pb.ApplyRetentionResponse:
        if request.topic and self.metadata.topic(request.topic) is None:
            context.abort(grpc.StatusCode.NOT_FOUND, f"topic {request.topic} does not exist")
        if self.apply_retention is None:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "this broker has no cold tier")
            raise AssertionError("abort raises")
        self._tier_answers_for_retention(request.topic, context)
        try:
            results = self.apply_retention(request.topic or None, request.dry_run)
        except OffloadError as e:
            if _tier_failed(e):
                abort_tier_unavailable(context, f"the cold tier did not answer: {e}")
            context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
            raise AssertionError("abort raises") from None
        return pb.ApplyRetentionResponse(
            outcomes=[
                pb.RetentionOutcome(
                    topic=r.topic,
                    queue=r.queue_id,
                    segments=r.segments,
                    messages=r.messages,
                    bytes=r.bytes,
                    new_start_offset=r.new_start_offset,
                    deleted_keys=r.deleted_keys,
                )
                for r in results
            ]
        )

    def _tier_answers_for_retention(self, topic: str, context: grpc.ServicerContext) -> None:
        """Refuse (UNAVAILABLE) at once unless the tier gives every queue's manifest that
        retention would reload within the broker's admin_tier_wait_ms (decision 810): against
        a black-holed tier, retention waited out the tier's retries (minutes per queue) long
        after the CLI had given up at its 10 s. The broker's offload passes apply retention
        anyway once the tier answers."""
        if self.tier_manifests is None:
            return
        queues = [
            (c.name, q)
            for c in self.metadata.topics.values()
            if (not topic or c.name == topic) and c.tiered and (c.retention_ms or c.retention_bytes)
            for q in range(c.queues)
        ]
        found = self.tier_manifests(queues, refresh=True)
        silent = sorted(k for k, m in found.items() if m is None)
        if silent:
            abort_tier_unavailable(
                context,
                f"the cold tier did not answer for {len(silent)} queue(s) in time ("
                + ", ".join(f"{t}/{q}" for t, q in silent)
                + "): retention not applied now; the broker applies it on its offload passes "
                "once the tier answers",
            )

    def _tiered(self, name: str, context: grpc.ServicerContext) -> tuple[TopicConfig, Offloader]:
        cfg = self.metadata.topic(name)
        if cfg is None:
            context.abort(grpc.StatusCode.NOT_FOUND, f"topic {name} does not exist")
            raise AssertionError("abort raises")
        if self.offloader is None:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "this broker has no cold tier")
            raise AssertionError("abort raises")
        if not cfg.tiered:
            context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"topic {name} is not tiered (tmq topic update {name} --tiered)",
            )
        return cfg, self.offloader

    def Offload(
        self, request: pb.OffloadRequest, context: grpc.ServicerContext
    ) -> pb.OffloadResponse:
        """Upload the topic's queues now and answer when done; or, when the cold tier does not
        answer, say so within about the broker's admin_tier_wait_ms (decision 921): at once if
        it does not answer before anything starts, else within about twice that wait of going
        silent. Against a black hole this took the tier's full retries (374 s measured)."""
        cfg, offloader = self._tiered(request.topic, context)
        if request.queue >= cfg.queues:
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"topic {cfg.name} has no queue {request.queue}"
            )
        queues = list(range(cfg.queues) if request.queue < 0 else [request.queue])
        self._tier_answers_for_offload(
            cfg.name,
            queues,
            context,
            "nothing was uploaded; the broker's offload passes upload the queues once it answers",
        )
        targets = []
        for q in queues:
            up_to = self.store.max_offset(cfg.name, q)
            if request.before_ms:
                up_to = min(up_to, self.store.offset_for_timestamp(cfg.name, q, request.before_ms))
            if request.keep_local_bytes:
                up_to = min(up_to, self._keep_local(cfg.name, q, request.keep_local_bytes))
            targets.append((q, up_to))
        # The upload runs in a thread of its own, so that this call can stop waiting for it
        # when the tier goes silent: the thread then goes on, bounded by the tier's retries, and
        # commits only segments uploaded and verified whole (``Offloader.offload_queue``).
        done: Future[list[OffloadResult]] = Future()

        def run() -> None:
            try:
                done.set_result([offloader.offload_queue(cfg.name, q, t) for q, t in targets])
            except BaseException as e:
                # Said to the caller, if it still waits; if not, only here.
                log.warning("%s: `tmq offload` ended with an error: %s", cfg.name, e)
                done.set_exception(e)

        threading.Thread(target=run, name="tmq-offload-admin", daemon=True).start()
        while True:
            try:
                results = done.result(timeout=self.tier_wait_s)
                break
            except FutureTimeout:
                pass
            except OffloadError as e:
                if _tier_failed(e):
                    abort_tier_unavailable(context, f"the cold tier did not answer: {e}")
                context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
            if not context.is_active():
                return pb.OffloadResponse()  # the client has gone; the upload goes on
            # No news for a while: a large upload, or a tier gone silent. Ask it.
            self._tier_answers_for_offload(
                cfg.name,
                queues,
                context,
                "committed so far: "
                + ", ".join(self._watermark_text(offloader, cfg.name, q) for q in queues)
                + ". Only segments uploaded and verified whole are committed; the upload "
                "goes on in the broker, and its offload passes resume once the tier answers",
                during=True,
            )
        return pb.OffloadResponse(
            queues=[
                pb.QueueOffload(
                    queue=r.queue_id,
                    segments=r.segments,
                    messages=r.messages,
                    bytes=r.bytes,
                    watermark=r.watermark,
                )
                for r in results
            ]
        )

    @staticmethod
    def _watermark_text(offloader: Offloader, topic: str, queue_id: int) -> str:
        manifest = offloader.cached_manifest(topic, queue_id)
        at = "unknown" if manifest is None else str(manifest.end_offset)
        return f"{topic}/{queue_id} tier watermark {at}"

    def _tier_answers_for_offload(
        self,
        topic: str,
        queues: list[int],
        context: grpc.ServicerContext,
        then: str,
        *,
        during: bool = False,
    ) -> None:
        """Refuse (UNAVAILABLE, marked as the tier's) unless the tier gives every queue's
        current manifest within admin_tier_wait_ms: read loads, which neither wait on an
        upload under way (it holds the queue's lock) nor fill the cache (decision 885), and
        give up soon after the wait (decision 920). ``then``: what the refusal adds."""
        if self.tier_manifests is None:
            return
        keys = [(topic, q) for q in queues]
        failed: dict[tuple[str, int], Exception] = {}
        started = time.monotonic()
        found = self.tier_manifests(keys, read=True, failed=failed)
        silent = sorted(k for k, m in found.items() if m is None)
        if not silent:
            return
        errors = sorted({str(e) for k, e in failed.items() if k in silent})
        abort_tier_unavailable(
            context,
            ("the cold tier stopped answering during the upload: " if during else "")
            + f"the cold tier did not answer for {len(silent)} queue(s) within "
            f"{time.monotonic() - started:.1f} s ("
            + ", ".join(f"{t}/{q}" for t, q in silent)
            + ")"
            + (f": {errors[0]}" if errors else "")
            + f"; {then}",
        )

    def _keep_local(self, topic: str, queue_id: int, keep_bytes: int) -> int:
        """The offset above which the queue's newest messages total at most ``keep_bytes``."""
        hot_min, end = (
            self.store.hot_min_offset(topic, queue_id),
            self.store.max_offset(topic, queue_id),
        )
        sizes = [
            entry[1]
            for _, entry in self.store.queue_entries(topic, queue_id, hot_min, end - hot_min)
        ]
        kept = 0
        offset = end
        for size in reversed(sizes):
            if kept + size > keep_bytes:
                break
            kept += size
            offset -= 1
        return offset

    def Verify(self, request: pb.VerifyRequest, context: grpc.ServicerContext) -> pb.VerifyResponse:
        if request.topic:
            cfgs = [self._tiered(request.topic, context)[0]]
        else:
            cfgs = [t for t in self.metadata.topics.values() if t.tiered]
        if self.offloader is None:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "this broker has no cold tier")
            raise AssertionError("abort raises")
        o = self.offloader
        if request.repair and (o.leadership() is None or o.fenced):
            # Only the writer of the prefix may delete: to anyone else, the master's upload in
            # flight looks like an orphan.
            context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                "only the master of the replica group repairs the tier; run it there",
            )
        # Answer before the caller's deadline, with what was checked by then (WARNING).
        remaining = context.time_remaining()
        deadline = None if remaining is None else time.monotonic() + max(0.5, remaining * 0.9 - 0.5)
        firsts = self._verify_manifests(cfgs, deadline, context)
        try:
            with ThreadPoolExecutor(VERIFY_WORKERS, thread_name_prefix="tmq-verify") as pool:
                verdicts = [
                    verify_queue(
                        within(o.tier, deadline),
                        o.cluster,
                        o.broker,
                        cfg.name,
                        q,
                        lock=o.queue_lock(cfg.name, q),
                        repair=request.repair,
                        deep=request.deep,
                        pool=pool,
                        deadline=deadline,
                        foreign=o.foreign,
                        first=firsts.get((cfg.name, q)),
                    )
                    for cfg in cfgs
                    for q in range(cfg.queues)
                ]
        except StorageError as e:
            context.abort(
                grpc.StatusCode.UNAVAILABLE,
                f"could not verify: the cold tier did not answer: {e}; nothing was judged, run "
                "it again once the tier answers",
            )
            raise AssertionError("abort raises") from None
        for v in verdicts:
            # The archive's objects may all be sound and still not be this queue's messages at
            # some offsets (decision 800): a conflict is damage found, a pending check a
            # queue not judged yet.
            shown = self._divergence(v.topic, v.queue_id)
            if shown is None:
                continue
            base, conflict = shown
            if conflict is None:
                v.status = worst([v.status, WARNING])
                v.notes.append(
                    f"not checked against its archive yet (the object store did not answer "
                    f"when it started taking messages at {base}): nothing from {base} on is "
                    "uploaded or released until the broker's next pass checks it"
                )
            else:
                v.status = FAILURE
                v.anomalies.append(
                    f"DIVERGED from its archive: offsets {base}..{conflict.archive_end - 1} "
                    "hold acknowledged messages locally and other, older ones in the archive; "
                    "resolve with `tmq offload resolve` (docs/operations.md)"
                )
        return pb.VerifyResponse(
            status=worst([v.status for v in verdicts]),
            queues=[
                pb.QueueVerdict(
                    topic=v.topic,
                    queue=v.queue_id,
                    status=v.status,
                    missing=v.missing,
                    damaged=v.damaged,
                    anomalies=v.anomalies + v.notes,
                    orphans=v.orphans,
                    repaired=v.repaired,
                )
                for v in verdicts
            ],
        )

    def _verify_manifests(
        self, cfgs: list[TopicConfig], deadline: float | None, context: grpc.ServicerContext
    ) -> dict[tuple[str, int], QueueManifest | ManifestError]:
        """Each queue's manifest as `verify` first judges it, loaded fresh from the tier
        together, within the broker's admin_tier_wait_ms or the call's deadline if earlier
        (decision 885); a ``ManifestError`` for a manifest the tier gave but that cannot be read
        (a FAILURE verdict). Refuses (UNAVAILABLE) at once if the tier did not answer, or
        failed, for any queue: ``verify_queue`` loaded these itself, through the tier's retries
        and read timeouts (minutes per queue under a black hole), long after the client had
        given up. Without the broker's hook (a servicer built alone) nothing is loaded here."""
        if self.tier_manifests is None:
            return {}
        queues = [(c.name, q) for c in cfgs for q in range(c.queues)]
        failed: dict[tuple[str, int], Exception] = {}
        started = time.monotonic()
        found = self.tier_manifests(queues, read=True, deadline=deadline, failed=failed)
        out: dict[tuple[str, int], QueueManifest | ManifestError] = {
            k: m for k, m in found.items() if m is not None
        }
        out.update({k: e for k, e in failed.items() if isinstance(e, ManifestError)})
        silent = sorted(k for k in queues if k not in out)
        if silent:
            errors = sorted({str(e) for k, e in failed.items() if k in silent})
            context.abort(
                grpc.StatusCode.UNAVAILABLE,
                f"could not verify: the cold tier did not answer for {len(silent)} queue(s) "
                f"within {time.monotonic() - started:.1f} s ("
                + ", ".join(f"{t}/{q}" for t, q in silent)
                + ")"
                + (f": {errors[0]}" if errors else "")
                + "; nothing was judged, run it again once the tier answers",
            )
        return out

    def ResolveDivergence(
        self, request: pb.ResolveDivergenceRequest, context: grpc.ServicerContext
    ) -> pb.ResolveDivergenceResponse:
        """`tmq offload resolve` (decision 801, ``offload/resolve.py``)."""
        cfg, offloader = self._tiered(request.topic, context)
        divergence = offloader.divergence
        if divergence is None:
            context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                "this broker keeps no divergence record (only a standalone broker with a cold "
                "tier does)",
            )
            raise AssertionError("abort raises")
        if request.queue >= 0:
            if request.queue >= cfg.queues:
                context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"{cfg.name} has {cfg.queues} queues; there is no queue {request.queue}",
                )
            targets = [request.queue]
        else:
            targets = sorted(q for t, q in divergence.conflicts if t == cfg.name)
            if not targets:
                context.abort(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"no queue of {cfg.name} has a conflict with its archive",
                )
        if request.discard_local and len(targets) != 1:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "discarding names one queue (--queue)")
        done = []
        for q in targets:
            try:
                r = resolve_divergence(
                    self.store,
                    offloader,
                    divergence,
                    cfg.name,
                    q,
                    discard_local=request.discard_count if request.discard_local else None,
                )
            except TierUnavailableError as e:
                context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
                raise AssertionError("abort raises") from None
            except ResolveRefusedError as e:
                context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
                raise AssertionError("abort raises") from None
            except (OSError, RuntimeError) as e:  # the store refused an append or a flush
                log.exception("%s/%d: resolve failed", cfg.name, q)
                context.abort(
                    grpc.StatusCode.INTERNAL,
                    f"{cfg.name}/{q}: the resolve failed ({e}); `tmq offload status` says "
                    "whether the conflict stands (then run it again)",
                )
                raise AssertionError("abort raises") from None
            done.append(
                pb.ResolvedQueue(
                    queue=q,
                    base=r.base,
                    archive_end=r.archive_end,
                    copied=r.copied,
                    copies_from=r.copies_from or 0,
                    copies_end=r.copies_end or 0,
                    discarded=r.copies_from is None,
                )
            )
        return pb.ResolveDivergenceResponse(queues=done)

    def QueryByKey(
        self, request: pb.QueryByKeyRequest, context: grpc.ServicerContext
    ) -> pb.QueryByKeyResponse:
        if self.metadata.topic(request.topic) is None:
            context.abort(grpc.StatusCode.NOT_FOUND, f"topic {request.topic} does not exist")
        if not request.key:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "a key is required")
        try:
            found = self.store.query_by_key(
                request.topic,
                request.key,
                request.begin_ms,
                request.end_ms or 2**62,
                min(request.max or 64, 1000),
                complete=True,
            )
        except ColdTierUnavailableError as e:
            # Part of the topic's archive cannot be asked: "not found" would hide it.
            abort_tier_unavailable(context, str(e))
        return pb.QueryByKeyResponse(
            messages=[
                pb.FoundMessage(
                    queue=m.queue_id,
                    queue_offset=m.queue_offset,
                    message_id=m.msg_id or "",
                    tag=m.tags or "",
                    keys=m.keys,
                    properties={
                        k: v
                        for k, v in m.properties.items()
                        if k not in ("KEYS", "TAGS", "UNIQ_KEY")
                    },
                    store_time_ms=m.store_timestamp,
                    body=m.body,
                )
                for m in found
            ]
        )
