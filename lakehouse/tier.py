"""What the cold tier holds, as the export sees it: queues and their manifests.

The tier's layout is ``{cluster}/{broker}/{topic}/{queue}/`` (``tiered.cold.manifest``). The
export discovers it by listing one level at a time (one LIST each), never by listing every
segment object, so a months-long archive costs the same to discover as a fresh one.
"""

from __future__ import annotations

from dataclasses import dataclass

from tiered.cold.manifest import ManifestError, ManifestLog, QueueManifest, queue_prefix
from tiered.cold.storage import ObjectStore


@dataclass(slots=True, frozen=True, order=True)
class QueueRef:
    """One archived queue: the unit of export progress."""

    cluster: str
    broker: str
    topic: str
    queue_id: int

    @property
    def key(self) -> str:
        """The queue's name in streaming offsets: ``cluster/broker/topic/queue``."""
        return f"{self.cluster}/{self.broker}/{self.topic}/{self.queue_id}"

    @property
    def prefix(self) -> str:
        return queue_prefix(self.cluster, self.broker, self.topic, self.queue_id)

    @classmethod
    def parse(cls, key: str) -> QueueRef:
        cluster, broker, topic, queue = key.split("/")
        return cls(cluster, broker, topic, int(queue))


def discover(store: ObjectStore, topics: frozenset[str] | None) -> list[QueueRef]:
    """Every archived queue of ``topics`` (None: of every topic), across clusters and brokers."""
    found = []
    for cluster in store.children(""):
        for broker in store.children(f"{cluster}/"):
            names = store.children(f"{cluster}/{broker}/")
            for topic in names if topics is None else sorted(topics & set(names)):
                for queue in store.children(f"{cluster}/{broker}/{topic}/"):
                    if queue.isdigit():
                        found.append(QueueRef(cluster, broker, topic, int(queue)))
    return sorted(found)


class ManifestCache:
    """The current manifest of each queue, re-read only when a newer version is listed."""

    def __init__(self, store: ObjectStore) -> None:
        self.store = store
        self._cached: dict[QueueRef, QueueManifest] = {}

    def get(self, queue: QueueRef, *, refresh: bool = True) -> QueueManifest:
        cached = self._cached.get(queue)
        if cached is not None and not refresh:
            return cached
        manifests = ManifestLog(self.store, queue.prefix)
        versions = manifests.versions()  # one LIST: cheap enough for every micro-batch
        if cached is not None and versions and max(versions) == cached.version:
            return cached
        try:
            manifest = manifests.load()
        except ManifestError as e:
            raise ManifestError(f"{queue.prefix}: {e}") from e
        self._cached[queue] = manifest
        return manifest
