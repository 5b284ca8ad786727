"""``apache.rocketmq.v2.MessagingService``: what Apache's RocketMQ 5 clients talk to.

Errors are answered in each response's ``status`` with the protocol's codes (the clients read
nothing else); an unexpected exception becomes INTERNAL_ERROR and is logged, never a crash.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

import grpc
from rocketmq.grpc_protocol import definition_pb2 as d
from rocketmq.grpc_protocol import service_pb2 as s
from rocketmq.grpc_protocol import service_pb2_grpc

from broker.ha.gate import (
    NotEnoughReplicasError,
    NotMasterError,
    ReplicationError,
    ReplicationTimeoutError,
    SendGate,
)
from broker.ha.routes import group_queues
from broker.metadata import (
    DEFAULT_MAX_DELIVERY_ATTEMPTS,
    PERM_READ,
    PERM_WRITE,
    BrokerMetadata,
    GroupConfig,
    GroupLimitError,
    InvalidNameError,
    Limits,
    TopicConfig,
    check_group_name,
    check_topic_name,
)
from broker.metrics import Traffic
from broker.pop import (
    InvalidReceiptHandleError,
    MessageFilter,
    PopService,
    Received,
    TagFilter,
)
from broker.producers import ProducerRegistry
from broker.protocol import (
    CLIENT_RECEIVE_LIMIT,
    DELIVERY_ENVELOPE_RESERVE,
    PROPERTY_DELIVER_TIME,
    ProtocolError,
    duration,
    duration_ms,
    message_queue,
    scan_send_request,
    scanned_batch,
    send_response_bytes,
    status,
    to_proto_message,
    to_store_messages,
    transaction_recovery_ms,
)
from broker.sql92 import SqlFilter
from broker.timer import DEFAULT_MAX_DELAY_MS, TimerService, as_timer_message
from broker.transaction import TransactionError, TransactionService
from remoting.namesrv_client import NameServerClient
from remoting.servicers import decode_request, takes_bytes
from tiered.cold.fetcher import ColdTierUnavailableError
from tiered.cold.segment import SegmentError
from tiered.cold.storage import StorageError
from tiered.log_every import LogEvery
from tiered.record import CorruptRecordError, Message, RecordSpans
from tiered.store import (
    GetStatus,
    InvalidMessageError,
    MessageStore,
    StoreUnwritableError,
)

log = logging.getLogger(__name__)

R = TypeVar("R")

DEFAULT_INVISIBLE_MS = 30_000
# The proxy's defaults for what Telemetry's Settings tell clients (ProxyConfig and
# CustomizedRetryPolicy): producers retry a failed send 3 times, 10 ms doubling up to 1 s;
# consumers back off 1s 5s 10s 30s 1m 2m ... 2h before each redelivery.
PRODUCER_MAX_ATTEMPTS = 3
PRODUCER_BACKOFF_INITIAL_MS = 10
PRODUCER_BACKOFF_MAX_MS = 1000
PRODUCER_BACKOFF_MULTIPLIER = 2.0
CONSUMER_BACKOFF_MS = tuple(
    s * 1000 for s in (1, 5, 10, 30, *(60 * m for m in range(1, 11)), 1200, 1800, 3600, 7200)
)
MIN_INVISIBLE_MS = 1_000
MAX_INVISIBLE_MS = 12 * 3600 * 1000
MAX_LONG_POLLING_MS = 20_000
# Answer a long poll this long before the client's own deadline would cut it.
_LONG_POLL_MARGIN_MS = 500


def _replication_code(e: ReplicationError) -> int:
    """Apache's proxy's codes: SLAVE_NOT_AVAILABLE and IN_SYNC_REPLICAS_NOT_ENOUGH answer
    HA_NOT_AVAILABLE, FLUSH_SLAVE_TIMEOUT answers SLAVE_PERSISTENCE_TIMEOUT."""
    if isinstance(e, ReplicationTimeoutError):
        return int(d.SLAVE_PERSISTENCE_TIMEOUT)
    if isinstance(e, NotEnoughReplicasError | NotMasterError):
        return int(d.HA_NOT_AVAILABLE)
    return int(d.INTERNAL_ERROR)


class BrokerIdentity:
    def __init__(self, cluster: str, name: str, advertise_host: str, port: int) -> None:
        self.cluster = cluster
        self.name = name
        self.host = advertise_host
        self.port = port


class MessagingServicer(service_pb2_grpc.MessagingServiceServicer):
    def __init__(
        self,
        store: MessageStore,
        metadata: BrokerMetadata,
        pop: PopService,
        identity: BrokerIdentity,
        namesrv: NameServerClient | None,
        limits: Limits,
        *,
        auto_create_groups: bool = True,
        traffic: Traffic | None = None,
        transactions: TransactionService | None = None,
        producers: ProducerRegistry | None = None,
        timers: TimerService | None = None,
        max_delay_ms: int = DEFAULT_MAX_DELAY_MS,
        replication: SendGate | None = None,
    ) -> None:
        self.store = store
        self.replication = replication
        self.metadata = metadata
        self.pop = pop
        self.identity = identity
        self.namesrv = namesrv
        self.limits = limits
        self.auto_create_groups = auto_create_groups
        self.traffic = traffic or Traffic()
        self.transactions = transactions
        self.producers = producers or ProducerRegistry()
        self.timers = timers
        self.max_delay_ms = max_delay_ms
        self._round_robin: dict[str, int] = {}
        # Client id (the x-mq-client-id header) -> ClientType, from each client's Settings.
        self._client_types: dict[str, int] = {}
        self._client_streams: dict[str, int] = {}  # open Telemetry streams per client id
        self._clients_lock = threading.Lock()
        self._rr_lock = threading.Lock()

    # -- helpers -------------------------------------------------------------------------------

    def _guard(self, make: Callable[[d.Status], R], work: Callable[[], R]) -> R:
        try:
            return work()
        except ProtocolError as e:
            return make(status(e.code, e.message))
        except InvalidNameError as e:
            return make(status(d.BAD_REQUEST, str(e)))
        except ColdTierUnavailableError as e:
            # Where a tiered queue's archive starts is not known yet (QueryOffset, UpdateOffset
            # after a restart during an outage): a retry, never the hot store's first offset.
            log.warning("%s", e)
            return make(status(d.PROXY_TIMEOUT, str(e)))
        except Exception:
            log.exception("request failed")
            return make(status(d.INTERNAL_ERROR, "internal error; see the broker log"))

    def _topic(self, name: str, *, need: int) -> TopicConfig:
        try:
            check_topic_name(name)
        except InvalidNameError as e:
            raise ProtocolError(d.ILLEGAL_TOPIC, str(e)) from None
        cfg = self.metadata.topic(name)
        if cfg is None:
            raise ProtocolError(d.TOPIC_NOT_FOUND, f"topic {name} does not exist on this broker")
        if not cfg.perm & need:
            verb = "write to" if need == PERM_WRITE else "read from"
            raise ProtocolError(d.FORBIDDEN, f"topic {name}: permission denies {verb} it")
        return cfg

    def _group(self, name: str) -> GroupConfig:
        try:
            check_group_name(name)
        except InvalidNameError as e:
            raise ProtocolError(d.ILLEGAL_CONSUMER_GROUP, str(e)) from None
        cfg = self.metadata.group(name)
        if cfg is None:
            if not self.auto_create_groups:
                raise ProtocolError(
                    d.CONSUMER_GROUP_NOT_FOUND, f"consumer group {name} does not exist"
                )
            try:
                cfg = self.metadata.auto_create_group(name, self.limits.max_auto_created_groups)
            except GroupLimitError as e:
                raise ProtocolError(d.CONSUMER_GROUP_NOT_FOUND, str(e)) from None
        return cfg

    def _route_queues(
        self, topic: str, namespace: str, one_address: bool = False
    ) -> list[d.MessageQueue]:
        """Every queue of ``topic`` across the cluster, from the NameServers (falling back to
        this broker's own table when no NameServer answers). A name no topic can have is
        ILLEGAL_TOPIC before any lookup, as the proxy's ``validateTopic`` says it: asked of the
        NameServers it came back TOPIC_NOT_FOUND, "is not served", to a client that can never
        create it."""
        try:
            check_topic_name(topic)
        except InvalidNameError as e:
            raise ProtocolError(d.ILLEGAL_TOPIC, str(e)) from None
        route = None
        if self.namesrv is not None:
            try:
                route = self.namesrv.route(topic)
            except grpc.RpcError as e:
                log.warning(
                    "no NameServer answered (%s); routing %s from this broker only",
                    e.code().name,
                    topic,
                )
                route = None
            else:
                if route is None:
                    raise ProtocolError(d.TOPIC_NOT_FOUND, f"topic {topic} is not served")
        if route is not None:
            # Slaves take no sends: a replica group is reached at its master, or at any member
            # when members forward to it (broker/ha/routes.py).
            here = (self.identity.host, self.identity.port) if one_address else None
            return group_queues(route, topic, namespace, here)
        cfg = self._topic(topic, need=0)
        return [
            message_queue(
                topic,
                q,
                cfg.perm,
                cfg.message_type,
                self.identity.name,
                self.identity.host,
                self.identity.port,
                namespace,
            )
            for q in range(cfg.queues)
        ]

    @staticmethod
    def _queue(topic: TopicConfig, queue_id: int) -> int:
        if not 0 <= queue_id < topic.queues:
            raise ProtocolError(d.BAD_REQUEST, f"topic {topic.name} has no queue {queue_id}")
        return queue_id

    def _reserve_queues(self, topic: TopicConfig, n: int) -> int:
        """The round-robin position of the first of ``n`` messages; the next ``n - 1`` are
        taken too (a message with a group does not use its turn)."""
        with self._rr_lock:
            first = self._round_robin.get(topic.name, 0)
            self._round_robin[topic.name] = first + n
        return first

    # -- routing, heartbeat, settings ----------------------------------------------------------

    def QueryRoute(self, request: s.QueryRouteRequest, context: grpc.ServicerContext) -> Any:
        def work() -> s.QueryRouteResponse:
            queues = self._route_queues(
                request.topic.name,
                request.topic.resource_namespace,
                one_address=_one_address_client(context),
            )
            return s.QueryRouteResponse(status=status(), message_queues=queues)

        return self._guard(lambda st: s.QueryRouteResponse(status=st), work)

    def QueryAssignment(
        self, request: s.QueryAssignmentRequest, context: grpc.ServicerContext
    ) -> Any:
        def work() -> s.QueryAssignmentResponse:
            self._group(request.group.name)
            queues = self._route_queues(
                request.topic.name,
                request.topic.resource_namespace,
                one_address=_one_address_client(context),
            )
            readable = [q for q in queues if q.permission in (d.READ, d.READ_WRITE)]
            return s.QueryAssignmentResponse(
                status=status(), assignments=[d.Assignment(message_queue=q) for q in readable]
            )

        return self._guard(lambda st: s.QueryAssignmentResponse(status=st), work)

    def Heartbeat(self, request: s.HeartbeatRequest, context: grpc.ServicerContext) -> Any:
        def work() -> s.HeartbeatResponse:
            if request.group.name:
                self._group(request.group.name)
            return s.HeartbeatResponse(status=status())

        return self._guard(lambda st: s.HeartbeatResponse(status=st), work)

    def Telemetry(
        self, request_iterator: Iterable[s.TelemetryCommand], context: grpc.ServicerContext
    ) -> Iterator[s.TelemetryCommand]:
        """Answer every Settings the client sends with the settings the proxy would give it,
        and carry the broker's own commands (transaction check-backs) to a producer. A reader
        thread takes the client's side of the stream; this one writes, for as long as the
        client keeps the stream."""
        outbox: queue.SimpleQueue[s.TelemetryCommand | None] = queue.SimpleQueue()
        client_id = _client_id(context)
        with self._clients_lock:
            self._client_streams[client_id] = self._client_streams.get(client_id, 0) + 1

        def read() -> None:
            try:
                for command in request_iterator:
                    if not command.HasField("settings"):
                        continue  # results of commands the broker sent
                    with self._clients_lock:
                        self._client_types[client_id] = command.settings.client_type
                    outbox.put(
                        s.TelemetryCommand(
                            status=status(), settings=self._settings(command.settings)
                        )
                    )
                    if command.settings.HasField("publishing") and client_id:
                        topics = [t.name for t in command.settings.publishing.topics]
                        self.producers.connect(client_id, outbox.put, topics)
            except Exception as e:  # the client went away; gRPC says how
                log.debug("telemetry stream of %s ended: %s", client_id or "a client", e)
            finally:
                outbox.put(None)

        threading.Thread(target=read, name="tmq-telemetry-reader", daemon=True).start()
        try:
            while (reply := outbox.get()) is not None:
                yield reply
        finally:
            if client_id:
                self.producers.disconnect(client_id, outbox.put)
            # A client keeps one stream per endpoint and reopens them: forget its type only
            # when its last stream closes.
            with self._clients_lock:
                self._client_streams[client_id] -= 1
                if not self._client_streams[client_id]:
                    del self._client_streams[client_id]
                    self._client_types.pop(client_id, None)

    def _settings(self, given: d.Settings) -> d.Settings:
        """GrpcClientSettingsManager's merge with the proxy's defaults: producers get the
        proxy's send retry policy and the body limit, consumers their group's FIFO flag,
        attempts and the customized backoff, everybody metrics off."""
        settings = d.Settings()
        settings.CopyFrom(given)
        if given.HasField("publishing"):
            settings.publishing.max_body_size = min(
                self.limits.max_body_bytes, CLIENT_RECEIVE_LIMIT - DELIVERY_ENVELOPE_RESERVE
            )
            settings.publishing.validate_message_type = True
            policy = settings.backoff_policy
            policy.Clear()
            policy.max_attempts = PRODUCER_MAX_ATTEMPTS
            policy.exponential_backoff.initial.CopyFrom(duration(PRODUCER_BACKOFF_INITIAL_MS))
            policy.exponential_backoff.max.CopyFrom(duration(PRODUCER_BACKOFF_MAX_MS))
            policy.exponential_backoff.multiplier = PRODUCER_BACKOFF_MULTIPLIER
        elif given.HasField("subscription"):
            sub = settings.subscription
            group = self.metadata.group(sub.group.name)
            sub.fifo = bool(group and group.fifo)
            sub.receive_batch_size = self.limits.max_receive_batch
            sub.long_polling_timeout.CopyFrom(duration(MAX_LONG_POLLING_MS))
            policy = settings.backoff_policy
            policy.Clear()
            policy.max_attempts = (
                group.max_delivery_attempts if group else DEFAULT_MAX_DELIVERY_ATTEMPTS
            )
            for ms in CONSUMER_BACKOFF_MS:
                policy.customized_backoff.next.append(duration(ms))
        settings.metric.Clear()
        settings.metric.on = False
        return settings

    def NotifyClientTermination(
        self, request: s.NotifyClientTerminationRequest, context: grpc.ServicerContext
    ) -> Any:
        client_id = _client_id(context)
        with self._clients_lock:
            self._client_types.pop(client_id, None)
        return s.NotifyClientTerminationResponse(status=status())

    def _client_type(self, context: grpc.ServicerContext) -> int:
        with self._clients_lock:
            return self._client_types.get(_client_id(context), int(d.CLIENT_TYPE_UNSPECIFIED))

    # -- produce -------------------------------------------------------------------------------

    @takes_bytes
    def SendMessage(
        self, request: s.SendMessageRequest | bytes, context: grpc.ServicerContext
    ) -> Any:
        # The request arrives as its bytes (remoting/servicers.py) unless an interceptor
        # decoded it already: a plain batch is walked natively (decision 310), anything else
        # parsed by protobuf and converted by the reference path.
        scanned = None
        if isinstance(request, bytes):
            scanned = scan_send_request(request)
            if scanned is None:
                request = decode_request(s.SendMessageRequest.FromString, request, context)

        # The answer is a SendMessageResponse or, for a stored batch, its bytes (decision 391).
        def work() -> s.SendMessageResponse | bytes:
            if scanned is not None and isinstance(request, bytes):
                return self._send_scanned(request, scanned, context)
            assert isinstance(request, s.SendMessageRequest)
            return self._send(request, context)

        return self._guard(lambda st: s.SendMessageResponse(status=st), work)

    def _send_scanned(
        self, raw: bytes, scanned: Any, context: grpc.ServicerContext
    ) -> s.SendMessageResponse | bytes:
        """A batch the native walker took: the reference path's checks, in its order, and the
        reference conversion for a batch the walker hands back (decision 310)."""
        if scanned.count > self.limits.max_batch:
            return self._send(s.SendMessageRequest.FromString(raw), context)
        topic = self._topic(scanned.topic, need=PERM_WRITE)
        first_queue = self._reserve_queues(topic, scanned.count)
        if topic.message_type in _SPAN_TYPES:
            # Stored as they are: the encoder reads the batch's spans, no Message objects
            # (decision 700).
            spans: tuple[RecordSpans, list[str], int] | None = scanned_batch(
                scanned.spans, topic, first_queue, self.limits, _peer_host(context), len(raw)
            )
            if spans is None:
                return self._convert(
                    s.SendMessageRequest.FromString(raw), topic, first_queue, context
                )
            return self._store_plain(topic, *spans)
        made: tuple[list[Message], list[str], int] | None = scanned_batch(
            scanned.messages, topic, first_queue, self.limits, _peer_host(context), len(raw)
        )
        if made is None:
            return self._convert(s.SendMessageRequest.FromString(raw), topic, first_queue, context)
        batch, ids, body_bytes = made
        if topic.message_type == "TRANSACTION":
            # The walker refuses an orphaned-transaction recovery duration (protobuf reads it,
            # on the reference path): every half message here takes the default check time.
            return self._send_half(topic, batch, ids, [None] * len(batch), context)
        if topic.message_type == "DELAY":
            batch = [self._schedule(m) for m in batch]
        return self._store_plain(topic, batch, ids, body_bytes)

    def _send(self, request: s.SendMessageRequest, context: grpc.ServicerContext) -> Any:
        if not request.messages:
            raise ProtocolError(d.MESSAGE_CORRUPTED, "no message to send")
        if len(request.messages) > self.limits.max_batch:
            raise ProtocolError(
                d.BAD_REQUEST,
                f"{len(request.messages)} messages in one "
                f"request; the limit is {self.limits.max_batch}",
            )
        names = {m.topic.name for m in request.messages}
        if len(names) != 1:
            raise ProtocolError(d.MESSAGE_CORRUPTED, "topic in message is not same")
        topic = self._topic(names.pop(), need=PERM_WRITE)
        first_queue = self._reserve_queues(topic, len(request.messages))
        return self._convert(request, topic, first_queue, context)

    def _convert(
        self,
        request: s.SendMessageRequest,
        topic: TopicConfig,
        first_queue: int,
        context: grpc.ServicerContext,
    ) -> s.SendMessageResponse | bytes:
        ids = [pm.system_properties.message_id for pm in request.messages]
        batch = to_store_messages(
            request.messages,
            topic,
            first_queue,
            self.limits,
            _peer_host(context),
            request.ByteSize(),
            ids,
        )
        if topic.message_type == "TRANSACTION":
            immunity = [transaction_recovery_ms(pm.system_properties) for pm in request.messages]
            return self._send_half(topic, batch, ids, immunity, context)
        if topic.message_type == "DELAY":
            batch = [self._schedule(m) for m in batch]
        return self._store_plain(topic, batch, ids, sum(map(len, (m.body for m in batch))))

    def _store_plain(
        self,
        topic: TopicConfig,
        batch: list[Message] | RecordSpans,
        ids: list[str],
        body_bytes: int,
    ) -> bytes:
        offsets = self._replicated(
            lambda: _appended(lambda: self.store.put_messages(batch)).queue_offsets
        )
        self.traffic.produced(topic.name, len(batch), body_bytes)
        if topic.message_type == "DELAY" and self.timers is not None:
            self.timers.wakeup()
        return send_response_bytes(ids, offsets)

    def _replicated(self, store: Callable[[], R]) -> R:
        """Run ``store`` (an append) as the replica group allows: refused before anything is
        stored when this broker may not take sends, and answered only once the group holds
        every byte written so far (SYNC); a ``ReplicationError`` becomes the proxy's code.
        Plain, delay and half messages and transaction decisions all come through here."""
        try:
            if self.replication is not None:
                self.replication.check_writable()
            result = store()
            if self.replication is not None:
                self.replication.wait_replicated(self.store.max_physical_offset)
        except ReplicationError as e:
            raise ProtocolError(_replication_code(e), str(e)) from None
        return result

    def _schedule(self, msg: Message) -> Message:
        """A delay message due in the future as a timer record; one already due as itself."""
        if self.timers is None:
            raise ProtocolError(d.UNSUPPORTED, "delay messages are not enabled")
        due = msg.properties.get(PROPERTY_DELIVER_TIME)
        if due is None:
            raise ProtocolError(d.ILLEGAL_DELIVERY_TIME, "a delay message needs a delivery time")
        now = time.time_ns() // 1_000_000
        if int(due) - now > self.max_delay_ms:
            raise ProtocolError(
                d.ILLEGAL_DELIVERY_TIME,
                f"delivery time is {(int(due) - now) / 1000:.0f} s away; the limit is "
                f"{self.max_delay_ms // 1000} s",
            )
        return as_timer_message(msg) if int(due) > now else msg

    def _send_half(
        self,
        topic: TopicConfig,
        batch: list[Message],
        ids: list[str],
        immunity: list[int | None],
        context: grpc.ServicerContext,
    ) -> s.SendMessageResponse:
        """Store transactional messages as half messages; consumers see them after COMMIT.
        ``immunity``: per message, its orphaned-transaction recovery duration (ms) or None."""
        transactions = self.transactions
        if transactions is None:
            raise ProtocolError(d.UNSUPPORTED, "transactional messages are not enabled")
        client_id = _client_id(context)
        if client_id:
            self.producers.publishes(client_id, topic.name)
        prepared = self._replicated(
            lambda: _appended(lambda: transactions.prepare(batch, immunity))
        )
        self.traffic.produced(topic.name, len(batch), sum(len(m.body) for m in batch))
        entries = [
            s.SendResultEntry(
                status=status(),
                message_id=message_id,
                transaction_id=p.transaction_id,
                offset=p.half_offset,
            )
            for message_id, p in zip(ids, prepared, strict=True)
        ]
        return s.SendMessageResponse(status=status(), entries=entries)

    def EndTransaction(
        self, request: s.EndTransactionRequest, context: grpc.ServicerContext
    ) -> Any:
        def work() -> s.EndTransactionResponse:
            if self.transactions is None:
                raise ProtocolError(d.UNSUPPORTED, "transactional messages are not enabled")
            self._topic(request.topic.name, need=PERM_WRITE)
            if request.resolution == d.TRANSACTION_RESOLUTION_UNSPECIFIED:
                # The producer does not know yet (a checker's UNKNOWN): ask again later.
                return s.EndTransactionResponse(status=status())
            transactions = self.transactions
            try:
                self._replicated(
                    lambda: transactions.end(
                        request.topic.name,
                        request.message_id,
                        request.transaction_id,
                        commit=request.resolution == d.COMMIT,
                    )
                )
            except TransactionError as e:
                raise ProtocolError(d.INVALID_TRANSACTION_ID, str(e)) from None
            return s.EndTransactionResponse(status=status())

        return self._guard(lambda st: s.EndTransactionResponse(status=st), work)

    # -- pop consumption -----------------------------------------------------------------------

    def ReceiveMessage(
        self, request: s.ReceiveMessageRequest, context: grpc.ServicerContext
    ) -> Iterator[s.ReceiveMessageResponse]:
        try:
            group = self._group(request.group.name)
            topic = self._topic(request.message_queue.topic.name, need=PERM_READ)
            tag_filter = message_filter(request.filter_expression)
            batch = max(1, min(request.batch_size or 1, self.limits.max_receive_batch))
            invisible = (
                duration_ms(request.invisible_duration)
                if request.HasField("invisible_duration")
                else DEFAULT_INVISIBLE_MS
            )
            if not MIN_INVISIBLE_MS <= invisible <= MAX_INVISIBLE_MS:
                raise ProtocolError(
                    d.ILLEGAL_INVISIBLE_TIME,
                    f"invisible duration must be {MIN_INVISIBLE_MS // 1000} s "
                    f"to {MAX_INVISIBLE_MS // 3_600_000} h",
                )
            poll = (
                duration_ms(request.long_polling_timeout)
                if request.HasField("long_polling_timeout")
                else 0
            )
            if poll < 0:
                raise ProtocolError(d.ILLEGAL_POLLING_TIME, "long polling timeout is negative")
            deadline = (
                time.monotonic()
                + max(0, min(poll, MAX_LONG_POLLING_MS) - _LONG_POLL_MARGIN_MS) / 1000
            )
            received: list[Received] = []
            # A consumer gone during its long poll (closed, killed, timed out) takes nothing:
            # checked before every pop, and again after it, since it may go during the pop.
            while context.is_active():
                received = self.pop.receive(group, topic, tag_filter, batch, invisible)
                if received or time.monotonic() >= deadline:
                    break
                self._wait_for_messages(deadline)
            if received and not context.is_active():
                self._release(request.group.name, received, 0)
                return
        except ProtocolError as e:
            yield s.ReceiveMessageResponse(status=status(e.code, e.message))
            return
        except CorruptRecordError as e:
            log.error("%s", e)
            yield s.ReceiveMessageResponse(status=status(d.MESSAGE_CORRUPTED, str(e)))
            return
        except ColdTierUnavailableError as e:
            log.warning("%s", e)
            yield s.ReceiveMessageResponse(status=status(d.PROXY_TIMEOUT, str(e)))
            return
        except (SegmentError, StorageError) as e:
            log.error("archive read failed: %s", e)
            yield s.ReceiveMessageResponse(
                status=status(d.INTERNAL_SERVER_ERROR, f"archive read failed: {e}")
            )
            return
        except Exception:
            log.exception("ReceiveMessage failed")
            yield s.ReceiveMessageResponse(status=status(d.INTERNAL_ERROR, "internal error"))
            return
        if not received:
            yield s.ReceiveMessageResponse(status=status(d.MESSAGE_NOT_FOUND, "no new message"))
            return
        ns = request.group.resource_namespace
        sent = 0
        try:
            yield s.ReceiveMessageResponse(status=status())
            now = s.ReceiveMessageResponse()
            now.delivery_timestamp.GetCurrentTime()
            yield now
            for r in received:
                yield s.ReceiveMessageResponse(message=self._delivered(r, invisible, ns))
                sent += 1
        finally:
            if sent < len(received):
                # gRPC stops iterating (and closes this generator) once the stream is gone.
                # Apache's clients drop a batch whose stream ends in an error (the Python
                # client gathers the whole stream first), so none of it reached the consumer,
                # written or not: released rather than left invisible for their whole duration
                # and counted as attempts (decision 1001). A client that did use one and
                # cancelled gets it again (at least once).
                self._release(request.group.name, received, 0)
        self.traffic.consumed(topic.name, sent, sum(len(r.message.body) for r in received))

    def _release(self, group: str, received: list[Received], start: int) -> None:
        handles = [r.receipt_handle for r in received[start:]]
        n = self.pop.release(group, handles)
        log.info(
            "group %s: the consumer left before %d message(s) reached it; visible again", group, n
        )

    def _delivered(self, r: Received, invisible_ms: int, namespace: str) -> d.Message:
        return to_proto_message(
            r.message, r.original_topic, r.receipt_handle, r.attempt, invisible_ms, namespace
        )

    def _wait_for_messages(self, deadline: float) -> None:
        """Sleep until something new is dispatched, at most 1 s (expired deliveries are revived
        on the next pass), or the deadline."""
        dispatcher = self.store.dispatcher
        assert dispatcher is not None
        left = min(1.0, deadline - time.monotonic())
        if left > 0:
            dispatcher.wait_for(dispatcher.reput_offset + 1, left)

    def AckMessage(self, request: s.AckMessageRequest, context: grpc.ServicerContext) -> Any:
        def work() -> s.AckMessageResponse:
            self._group(request.group.name)
            entries = []
            for entry in request.entries:
                try:
                    self.pop.ack(request.group.name, entry.receipt_handle)
                    st = status()
                except InvalidReceiptHandleError as e:
                    st = status(d.INVALID_RECEIPT_HANDLE, str(e))
                entries.append(
                    s.AckMessageResultEntry(
                        message_id=entry.message_id, receipt_handle=entry.receipt_handle, status=st
                    )
                )
            return s.AckMessageResponse(status=_overall(entries), entries=entries)

        return self._guard(lambda st: s.AckMessageResponse(status=st), work)

    def ChangeInvisibleDuration(
        self, request: s.ChangeInvisibleDurationRequest, context: grpc.ServicerContext
    ) -> Any:
        def work() -> s.ChangeInvisibleDurationResponse:
            self._group(request.group.name)
            invisible = duration_ms(request.invisible_duration)
            if not 0 <= invisible <= MAX_INVISIBLE_MS:
                raise ProtocolError(d.ILLEGAL_INVISIBLE_TIME, "invisible duration out of range")
            # A push consumer changes a message's invisibility only to nack it. Apache's Node
            # client ignores the customized backoff it was given and nacks with 0 ms, which
            # would spin a failing message through its attempts in a second: hold a push
            # consumer's nack to the backoff its Settings announced (Java and Python clients
            # ask for exactly that already).
            floor = consumer_backoff_ms if self._client_type(context) == d.PUSH_CONSUMER else None
            try:
                handle = self.pop.change_invisible_duration(
                    request.group.name, request.receipt_handle, invisible, floor
                )
            except InvalidReceiptHandleError as e:
                return s.ChangeInvisibleDurationResponse(
                    status=status(d.INVALID_RECEIPT_HANDLE, str(e)),
                    receipt_handle=request.receipt_handle,
                )
            return s.ChangeInvisibleDurationResponse(status=status(), receipt_handle=handle)

        return self._guard(
            lambda st: s.ChangeInvisibleDurationResponse(
                status=st, receipt_handle=request.receipt_handle
            ),
            work,
        )

    def ForwardMessageToDeadLetterQueue(
        self, request: s.ForwardMessageToDeadLetterQueueRequest, context: grpc.ServicerContext
    ) -> Any:
        def work() -> s.ForwardMessageToDeadLetterQueueResponse:
            self._group(request.group.name)
            try:
                self.pop.forward_to_dlq(request.group.name, request.receipt_handle)
            except InvalidReceiptHandleError as e:
                raise ProtocolError(d.INVALID_RECEIPT_HANDLE, str(e)) from None
            return s.ForwardMessageToDeadLetterQueueResponse(status=status())

        return self._guard(lambda st: s.ForwardMessageToDeadLetterQueueResponse(status=st), work)

    # -- offset-based pull (replays) -----------------------------------------------------------

    def PullMessage(
        self, request: s.PullMessageRequest, context: grpc.ServicerContext
    ) -> Iterator[s.PullMessageResponse | bytes]:
        try:
            self._group(request.group.name)
            topic = self._topic(request.message_queue.topic.name, need=PERM_READ)
            queue = self._queue(topic, request.message_queue.id)
            tag_filter = message_filter(request.filter_expression)
            # A pull that takes every message is answered, from the archive, with the replies
            # the cold worker serialized: no object per message in the broker (decision 400).
            everything = isinstance(tag_filter, TagFilter) and tag_filter.tags is None
            batch = max(1, min(request.batch_size or 32, 1024))
            poll = min(duration_ms(request.long_polling_timeout), MAX_LONG_POLLING_MS)
            deadline = time.monotonic() + max(0, poll - _LONG_POLL_MARGIN_MS) / 1000
            while True:
                result = self.store.get_messages(
                    topic.name,
                    queue,
                    request.offset,
                    batch,
                    tag_filter=None if everything else tag_filter.code_matches,
                    replies=everything,
                )
                if result.status in (GetStatus.OFFSET_TOO_SMALL, GetStatus.OFFSET_OVERFLOW_BADLY):
                    raise ProtocolError(
                        d.ILLEGAL_OFFSET,
                        f"offset {request.offset} is outside {topic.name}/{queue}'s range "
                        f"[{result.min_offset}, {result.max_offset}]",
                    )
                waiting = result.status in (
                    GetStatus.OFFSET_OVERFLOW_ONE,
                    GetStatus.NO_MESSAGE_IN_QUEUE,
                    GetStatus.NO_MATCHED_LOGIC_QUEUE,
                )
                if not waiting or time.monotonic() >= deadline or not context.is_active():
                    break
                self._wait_for_messages(deadline)
        except ProtocolError as e:
            yield s.PullMessageResponse(status=status(e.code, e.message))
            return
        except ColdTierUnavailableError as e:
            # The v2 protocol's "a backend did not answer in time" (HTTP 504): retry later.
            log.warning("%s", e)
            yield s.PullMessageResponse(status=status(d.PROXY_TIMEOUT, str(e)))
            return
        except (SegmentError, StorageError, CorruptRecordError) as e:
            log.error("pull failed: %s", e)
            yield s.PullMessageResponse(status=status(d.INTERNAL_SERVER_ERROR, f"read failed: {e}"))
            return
        except Exception:
            log.exception("PullMessage failed")
            yield s.PullMessageResponse(status=status(d.INTERNAL_ERROR, "internal error"))
            return
        if result.replies is not None:
            self.traffic.consumed(topic.name, len(result.replies), result.body_bytes)
            found = bool(result.replies)
            code = d.OK if found else d.MESSAGE_NOT_FOUND
            yield s.PullMessageResponse(status=status(code, "OK" if found else "no new message"))
            yield from result.replies  # PullMessageResponse(message=...), serialized
        else:
            messages = [m for m in result.messages if tag_filter.matches(m)]
            self.traffic.consumed(topic.name, len(messages), sum(len(m.body) for m in messages))
            code = d.OK if messages else d.MESSAGE_NOT_FOUND
            yield s.PullMessageResponse(status=status(code, "OK" if messages else "no new message"))
            for m in messages:
                yield s.PullMessageResponse(
                    message=to_proto_message(m, topic.name, None, None, None)
                )
        yield s.PullMessageResponse(
            next_offset=max(result.next_offset, request.offset)
            if result.status is not GetStatus.NO_MATCHED_LOGIC_QUEUE
            else request.offset
        )

    def QueryOffset(self, request: s.QueryOffsetRequest, context: grpc.ServicerContext) -> Any:
        def work() -> s.QueryOffsetResponse:
            topic = self._topic(request.message_queue.topic.name, need=PERM_READ)
            queue = self._queue(topic, request.message_queue.id)
            policy = request.query_offset_policy
            if policy == d.BEGINNING:
                offset = self.store.min_offset(topic.name, queue)
            elif policy == d.END:
                offset = self.store.max_offset(topic.name, queue)
            elif policy == d.TIMESTAMP:
                ts = request.timestamp.seconds * 1000 + request.timestamp.nanos // 1_000_000
                offset = self.store.offset_for_timestamp(topic.name, queue, ts)
            else:
                raise ProtocolError(d.BAD_REQUEST, f"unknown query offset policy {policy}")
            return s.QueryOffsetResponse(status=status(), offset=offset)

        return self._guard(lambda st: s.QueryOffsetResponse(status=st), work)

    def UpdateOffset(self, request: s.UpdateOffsetRequest, context: grpc.ServicerContext) -> Any:
        def work() -> s.UpdateOffsetResponse:
            group = self._group(request.group.name)
            topic = self._topic(request.message_queue.topic.name, need=PERM_READ)
            queue = self._queue(topic, request.message_queue.id)
            # Only an offset below the hot store needs the archive's start (decision 520).
            lo = self.store.hot_min_offset(topic.name, queue)
            if request.offset < lo:
                lo = self.store.min_offset(topic.name, queue)
            hi = self.store.max_offset(topic.name, queue)
            if not lo <= request.offset <= hi:
                raise ProtocolError(
                    d.ILLEGAL_OFFSET,
                    f"offset {request.offset} is outside {topic.name}/{queue}'s range [{lo}, {hi}]",
                )
            self.pop.reset(group.name, topic.name, queue, request.offset)
            return s.UpdateOffsetResponse(status=status())

        return self._guard(lambda st: s.UpdateOffsetResponse(status=st), work)

    def GetOffset(self, request: s.GetOffsetRequest, context: grpc.ServicerContext) -> Any:
        def work() -> s.GetOffsetResponse:
            group = self._group(request.group.name)
            topic = self._topic(request.message_queue.topic.name, need=PERM_READ)
            queue = self._queue(topic, request.message_queue.id)
            offset = self.metadata.offset(group.name, topic.name, queue)
            if offset is None:
                raise ProtocolError(
                    d.OFFSET_NOT_FOUND,
                    f"group {group.name} has no offset for {topic.name}/{request.message_queue.id}",
                )
            return s.GetOffsetResponse(status=status(), offset=offset)

        return self._guard(lambda st: s.GetOffsetResponse(status=st), work)


# The topic types whose scanned batches are stored as RecordSpans: delay and transactional
# messages are rewritten (timer records, half messages) and take Message objects (decision 700).
_SPAN_TYPES = frozenset(("NORMAL", "FIFO"))


def _overall(entries: list[s.AckMessageResultEntry]) -> d.Status:
    codes = {e.status.code for e in entries}
    if codes == {d.OK} or not codes:
        return status()
    if len(entries) == 1:
        return d.Status(code=entries[0].status.code, message=entries[0].status.message)
    return status(d.MULTIPLE_RESULTS, "some entries failed; see entries")


def message_filter(expression: d.FilterExpression) -> MessageFilter:
    """The subscription's filter (TAG or SQL92); a malformed expression is refused with
    ILLEGAL_FILTER_EXPRESSION, as the proxy's FilterAPI.build does."""
    try:
        if expression.type == d.SQL:
            return SqlFilter(expression.expression)
        return TagFilter(expression.expression)
    except ValueError as e:
        raise ProtocolError(d.ILLEGAL_FILTER_EXPRESSION, str(e)) from None


def consumer_backoff_ms(attempt: int) -> int:
    """The backoff before redelivering a message whose ``attempt``-th delivery failed: the
    customized policy's step, as Apache's Java client reads it (the last step repeats)."""
    return CONSUMER_BACKOFF_MS[min(max(attempt, 1), len(CONSUMER_BACKOFF_MS)) - 1]


_REFUSALS_LOGGED = LogEvery(60.0)


def _appended(append: Callable[[], R]) -> R:
    """Run a store append, answering the store's refusals as the proxy does."""
    try:
        return append()
    except InvalidMessageError as e:
        raise ProtocolError(d.BAD_REQUEST, str(e)) from None
    except StoreUnwritableError as e:
        # Apache's proxy answers a broker's SERVICE_NOT_AVAILABLE ("the disk is full") with
        # INTERNAL_SERVER_ERROR and the broker's reason; nothing was stored. One line a
        # minute for each kind of refusal: a producer retrying as fast as it is refused wrote
        # one a send, to a log that usually shares the full disk (decision 1181).
        quiet = _REFUSALS_LOGGED.due(type(e).__name__)
        if quiet is not None:
            more = f" ({quiet} more refused for this since the last line)" if quiet else ""
            log.error("send refused: %s%s", e, more)
        raise ProtocolError(d.INTERNAL_SERVER_ERROR, str(e)) from None


def _client_id(context: grpc.ServicerContext) -> str:
    for key, value in context.invocation_metadata() or ():
        if key == "x-mq-client-id":
            return str(value)
    return ""


def _one_address_client(context: grpc.ServicerContext) -> bool:
    """Apache's Node.js client (it says ``x-mq-language: HTTP``, having no language code of its
    own) makes an ``Endpoints`` with several addresses one gRPC target, ``a:p,b:q``, that DNS
    resolution refuses: it must be routed at one address per broker (decision 1171)."""
    return any(
        key == "x-mq-language" and value == "HTTP"
        for key, value in context.invocation_metadata() or ()
    )


def _peer_host(context: grpc.ServicerContext) -> str:
    peer = context.peer() or ""  # "ipv4:127.0.0.1:54321" or "ipv6:[::1]:54321"
    _, _, rest = peer.partition(":")
    host = rest.rsplit(":", 1)[0]
    return host.strip("[]") or "0.0.0.0"
