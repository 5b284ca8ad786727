"""The NameServer's only state: which brokers are alive and which topics each serves.

A broker is alive while it keeps registering (every 30 s by default); one that has been silent
for ``expiry_ms`` (120 s, RocketMQ's default) is forgotten the next time anyone looks. Nothing is
persisted: a restarted NameServer learns everything again from the next round of heartbeats.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from remoting import namesrv_pb2 as pb

log = logging.getLogger(__name__)

HEARTBEAT_INTERVAL_MS = 30_000
EXPIRY_MS = 120_000

BrokerKey = tuple[str, str, int]  # cluster, broker name, broker id


@dataclass(slots=True)
class LiveBroker:
    registration: pb.BrokerRegistration
    last_heartbeat_ms: int


def _now_ms() -> int:
    return time.monotonic_ns() // 1_000_000


class BrokerRegistry:
    def __init__(self, expiry_ms: int = EXPIRY_MS, clock: Callable[[], int] = _now_ms) -> None:
        self.expiry_ms = expiry_ms
        self._clock = clock
        self._brokers: dict[BrokerKey, LiveBroker] = {}
        self._lock = threading.Lock()

    def register(self, registration: pb.BrokerRegistration) -> None:
        key = (registration.cluster, registration.broker_name, registration.broker_id)
        with self._lock:
            known = key in self._brokers
            self._brokers[key] = LiveBroker(registration, self._clock())
        if not known:
            log.info(
                "broker %s/%s (id %d) registered at %s:%d with %d topics",
                *key,
                registration.endpoint.host,
                registration.endpoint.port,
                len(registration.topics),
            )

    def unregister(
        self, cluster: str, broker_name: str, broker_id: int, endpoint: pb.Endpoint
    ) -> bool:
        """Forget the entry (cluster, broker_name, broker_id) if it still names ``endpoint``.

        The key alone does not say who sent the unregister: after a failover the new master holds
        broker id 0, and the deposed master's unregister of id 0 (it steps down to its member id,
        or shuts down) can arrive after the new master registered. Removing by key would drop the
        group's only master route until the new master's next heartbeat; RocketMQ's
        unregisterBroker likewise carries the broker's address. Returns whether it removed one.
        """
        key = (cluster, broker_name, broker_id)
        with self._lock:
            entry = self._brokers.get(key)
            held = entry.registration.endpoint if entry is not None else None
            mine = held is not None and (held.host, held.port) == (endpoint.host, endpoint.port)
            if mine:
                del self._brokers[key]
        if mine:
            log.info("broker %s/%s (id %d) unregistered", *key)
        elif held is not None:
            log.info(
                "unregister of broker %s/%s (id %d) from %s:%d ignored: %s:%d holds that id now",
                *key,
                endpoint.host,
                endpoint.port,
                held.host,
                held.port,
            )
        return mine

    def live(self) -> list[LiveBroker]:
        """The brokers heard from within the expiry window (expired ones are dropped)."""
        now = self._clock()
        with self._lock:
            expired = [
                k for k, b in self._brokers.items() if now - b.last_heartbeat_ms > self.expiry_ms
            ]
            for key in expired:
                del self._brokers[key]
            alive = list(self._brokers.values())
        for key in expired:
            log.warning(
                "broker %s/%s (id %d) expired: no heartbeat for %d ms", *key, self.expiry_ms
            )
        return alive

    def route(self, topic: str) -> pb.TopicRoute:
        route = pb.TopicRoute(topic=topic)
        for broker in sorted(
            self.live(), key=lambda b: (b.registration.broker_name, b.registration.broker_id)
        ):
            reg = broker.registration
            for cfg in reg.topics:
                if cfg.topic == topic:
                    route.brokers.append(
                        pb.BrokerQueues(
                            cluster=reg.cluster,
                            broker_name=reg.broker_name,
                            broker_id=reg.broker_id,
                            endpoint=reg.endpoint,
                            queues=cfg.queues,
                            perm=cfg.perm,
                            message_type=cfg.message_type,
                        )
                    )
        return route

    def cluster_info(self) -> pb.ClusterInfo:
        return pb.ClusterInfo(
            brokers=[
                pb.BrokerInfo(broker=b.registration, last_heartbeat_ms=b.last_heartbeat_ms)
                for b in self.live()
            ]
        )
