"""Producers' Telemetry streams, by topic: where the broker sends a transaction check-back.

A RocketMQ 5 producer opens one Telemetry stream per broker and names the topics it publishes in
its Settings; a producer that sends a transactional message is also recorded for that topic (by
its ``x-mq-client-id``), since the client may have started without naming any. A check-back goes
to one live stream of the topic, chosen in turn.

In a controller-run replica group a producer's stream may sit on any member, while only the
master checks back: the master hands a check it has no stream for to the other members
(broker/ha/check_relay.py, decision 1250), each of which offers it to its own registry.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Iterable

from rocketmq.grpc_protocol import definition_pb2 as d
from rocketmq.grpc_protocol import service_pb2 as s

from broker.protocol import to_proto_message
from tiered.record import StoredMessage

Outbox = Callable[[s.TelemetryCommand], None]


class ProducerRegistry:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._streams: dict[str, Outbox] = {}  # client id -> its stream's outbox
        self._topics: dict[str, set[str]] = {}  # topic -> client ids
        self._turn = itertools.count()

    def connect(self, client_id: str, outbox: Outbox, topics: list[str]) -> None:
        with self._lock:
            self._streams[client_id] = outbox
            for topic in topics:
                self._topics.setdefault(topic, set()).add(client_id)

    def publishes(self, client_id: str, topic: str) -> None:
        with self._lock:
            self._topics.setdefault(topic, set()).add(client_id)

    def disconnect(self, client_id: str, outbox: Outbox) -> None:
        with self._lock:
            if self._streams.get(client_id) is outbox:
                del self._streams[client_id]

    def send(self, topic: str, command: s.TelemetryCommand, client_ids: Iterable[str] = ()) -> bool:
        """Hand ``command`` to one connected producer of ``topic`` (or, among ``client_ids``,
        one that publishes it without having said so here); False when there is none."""
        with self._lock:
            known = self._topics.get(topic, set()).union(client_ids)
            live = sorted(c for c in known if c in self._streams)
            if not live:
                return False
            outbox = self._streams[live[next(self._turn) % len(live)]]
        outbox(command)
        return True

    def elsewhere(self, topic: str) -> list[str]:
        """Client ids seen publishing ``topic`` whose Telemetry stream is not held here (a
        replica group's member forwarded their sends)."""
        with self._lock:
            return sorted(c for c in self._topics.get(topic, ()) if c not in self._streams)

    @staticmethod
    def check_command(half: StoredMessage, topic: str, transaction_id: str) -> s.TelemetryCommand:
        """The ``RecoverOrphanedTransactionCommand`` that asks a producer to decide ``half``."""
        message = to_proto_message(half, topic, None, None, None)
        message.system_properties.message_type = d.TRANSACTION
        command = s.TelemetryCommand()
        command.recover_orphaned_transaction_command.message.CopyFrom(message)
        command.recover_orphaned_transaction_command.transaction_id = transaction_id
        return command

    def check_back(self, topic: str, half: StoredMessage, transaction_id: str) -> bool:
        """Ask a producer of ``topic`` connected here to decide a half message; False when none
        is connected."""
        return self.send(topic, self.check_command(half, topic, transaction_id))
