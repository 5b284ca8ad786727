"""Transaction check-backs across a controller-run replica group (decision 1250).

A producer's Telemetry stream is answered by whichever member its channel picked (the route
names every member, decision 134; Apache's Node.js client is routed at the member it asked,
decision 1171), but only the writable master checks transactions back (decision 135). The
master first offers a check to the producers whose stream it holds itself; the checks nobody
took there go, in one ``ReplicaGroup.RelayTransactionChecks`` call per member, to the other
live members etcd lists (``HaController.peers``), one member at a time, each offering them to
the producers it holds (``ProducerRegistry.send``) and saying which it handed on. The
producer's answer is an EndTransaction, which its member forwards to the master like any other
(broker/ha/forward.py), so the relay carries one direction only.

The call goes over the members' gRPC ports, as forwarding does, through the broker's own
``ChannelSecurity``: TLS with ``[tls]``, and signed as the environment's admin, the identity
the replication link authenticates as (decision 220); the service is for admins only under
``[auth]`` (broker/authorization.py refuses every non-MessagingService method to others).

Who waits: the master's ``tmq-transaction-check`` thread, at most ``_TIMEOUT_S`` per call. A
member that does not answer (gone, frozen, partitioned) costs one timeout a pass, is asked
last in the passes after, and its checks go on to the next member. That is the one way a check
reaches two producers in one pass: a member that relayed it but whose answer was lost. The
second decision is harmless: EndTransaction is idempotent, and a second decision that differs
from the first is refused (INVALID_TRANSACTION_ID) with the first kept.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator

import grpc
from google.protobuf.message import DecodeError
from rocketmq.grpc_protocol import service_pb2 as s

from broker.ha import relay_pb2 as pb
from broker.ha import relay_pb2_grpc as pb_grpc
from broker.producers import ProducerRegistry
from remoting.security import ChannelSecurity
from tiered.record import StoredMessage

log = logging.getLogger(__name__)

# How long the master waits for one member's answer. The member only queues the commands on
# its producers' streams, so a healthy member answers in milliseconds.
_TIMEOUT_S = 2.0
# One call carries at most this much (a pass checks up to transaction_check_batch halves, each
# up to the body limit); the members' servers take 64 MiB.
_MAX_CALL_BYTES = 8 << 20
# A member restarted on the same port is reachable again within seconds: gRPC's default
# reconnect back-off grows to 120 s, which would skip it for several check intervals.
_CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", 64 << 20),
    ("grpc.initial_reconnect_backoff_ms", 500),
    ("grpc.min_reconnect_backoff_ms", 500),
    ("grpc.max_reconnect_backoff_ms", 2000),
]


class CheckRelayServicer(pb_grpc.ReplicaGroupServicer):
    """The member's side: hand each check to a producer of its topic connected here."""

    def __init__(self, producers: ProducerRegistry) -> None:
        self.producers = producers

    def RelayTransactionChecks(
        self, request: pb.RelayChecksRequest, context: grpc.ServicerContext
    ) -> pb.RelayChecksResponse:
        commands = []
        for i, check in enumerate(request.checks):
            try:
                command = s.TelemetryCommand.FromString(check.command)
            except DecodeError:
                command = None
            if command is None or not command.HasField("recover_orphaned_transaction_command"):
                context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"check {i} of topic {check.topic!r} holds no "
                    "RecoverOrphanedTransactionCommand",
                )
            commands.append(command)
        relayed = [
            self.producers.send(check.topic, command, check.client_ids)
            for check, command in zip(request.checks, commands, strict=True)
        ]
        return pb.RelayChecksResponse(relayed=relayed)


class CheckRelay:
    """The master's side: ``relay(checks)`` says which checks a member handed to a producer.

    ``members()``: the gRPC endpoints of the group's other live members (etcd's view)."""

    def __init__(
        self,
        members: Callable[[], list[str]],
        security: ChannelSecurity,
        producers: ProducerRegistry,
        timeout_s: float = _TIMEOUT_S,
    ) -> None:
        self._members = members
        self._security = security
        self._producers = producers
        self._timeout_s = timeout_s
        self._lock = threading.Lock()
        self._channels: dict[str, grpc.Channel] = {}
        # Members whose last call failed: asked after the others.
        self._suspect: set[str] = set()

    def relay(self, checks: list[tuple[str, StoredMessage, str]]) -> list[bool]:
        """For each (topic, half message, transaction id): whether a member handed it to a
        producer (broker/transaction.py's ``CheckRelayer``)."""
        reached = [False] * len(checks)
        encoded = [
            pb.TransactionCheck(
                topic=topic,
                command=self._producers.check_command(half, topic, txn).SerializeToString(),
                client_ids=self._producers.elsewhere(topic),
            )
            for topic, half, txn in checks
        ]
        members = self._members()
        self._forget_channels(members)
        for endpoint in sorted(members, key=lambda e: (e in self._suspect, e)):
            waiting = [i for i, done in enumerate(reached) if not done]
            if not waiting:
                break
            try:
                for part in self._parts(waiting, encoded):
                    answer = self._stub(endpoint).RelayTransactionChecks(
                        pb.RelayChecksRequest(checks=[encoded[i] for i in part]),
                        timeout=self._timeout_s,
                    )
                    for i, relayed in zip(part, answer.relayed, strict=False):
                        reached[i] = reached[i] or relayed
            except grpc.RpcError as e:
                # What it did not answer goes to the next member; it may have relayed some of
                # it anyway (its answer lost): a second decision is harmless (module doc).
                self._suspect.add(endpoint)
                log.warning(
                    "transaction check-backs: member %s did not take %d check(s) (%s: %s); "
                    "asking the others",
                    endpoint,
                    len(waiting),
                    e.code().name,
                    e.details(),
                )
                continue
            self._suspect.discard(endpoint)
        return reached

    @staticmethod
    def _parts(waiting: list[int], encoded: list[pb.TransactionCheck]) -> Iterator[list[int]]:
        part: list[int] = []
        size = 0
        for i in waiting:
            n = encoded[i].ByteSize()
            if part and size + n > _MAX_CALL_BYTES:
                yield part
                part, size = [], 0
            part.append(i)
            size += n
        if part:
            yield part

    def _stub(self, endpoint: str) -> pb_grpc.ReplicaGroupStub:
        with self._lock:
            channel = self._channels.get(endpoint)
            if channel is None:
                channel = self._security.channel(endpoint, _CHANNEL_OPTIONS)
                self._channels[endpoint] = channel
        return pb_grpc.ReplicaGroupStub(channel)

    def _forget_channels(self, members: list[str]) -> None:
        """Close the channels of members etcd no longer lists."""
        with self._lock:
            for endpoint in [e for e in self._channels if e not in members]:
                self._channels.pop(endpoint).close()
                self._suspect.discard(endpoint)

    def close(self) -> None:
        with self._lock:
            for channel in self._channels.values():
                channel.close()
            self._channels.clear()
