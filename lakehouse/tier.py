"""What the cold tier holds, as the export sees it: queues and their manifests.

The tier's layout is ``{cluster}/{broker}/{topic}/{queue}/`` (``tiered.cold.manifest``). The
export discovers it by listing one level at a time (one LIST each), never by listing every
segment object, so a months-long archive costs the same to discover as a fresh one.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
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


# Concurrent LISTs and manifest reads of one listing or planning pass: each is a round trip,
# and a pass over dozens of queues one after the other cost the export more than its commit.
LISTING_THREADS = 8


def discover(store: ObjectStore, topics: frozenset[str] | None) -> list[QueueRef]:
    """Every archived queue of ``topics`` (None: of every topic), across clusters and brokers.
    Named topics are listed directly (``{cluster}/{broker}/{topic}/``, concurrently), without
    listing every topic of the broker first."""
    brokers = [(c, b) for c in store.children("") for b in store.children(f"{c}/")]
    if topics is None:
        with ThreadPoolExecutor(LISTING_THREADS) as pool:
            names = pool.map(lambda cb: store.children(f"{cb[0]}/{cb[1]}/"), brokers)
            wanted = [(c, b, t) for (c, b), ts in zip(brokers, names, strict=True) for t in ts]
    else:
        wanted = [(c, b, t) for c, b in brokers for t in sorted(topics)]
    with ThreadPoolExecutor(LISTING_THREADS) as pool:
        listed = pool.map(lambda cbt: store.children(f"{cbt[0]}/{cbt[1]}/{cbt[2]}/"), wanted)
        found = [
            QueueRef(cluster, broker, topic, int(queue))
            for (cluster, broker, topic), queues in zip(wanted, listed, strict=True)
            for queue in queues
            if queue.isdigit()
        ]
    return sorted(found)


class ManifestCache:
    """The current manifest of each queue, re-read only when a newer version is listed."""

    def __init__(self, store: ObjectStore) -> None:
        self.store = store
        self._cached: dict[QueueRef, QueueManifest] = {}
        # queue -> how a newer manifest replaced its archive rather than continuing it (see
        # ``replaced_by``), until ``take_replaced`` hands it over
        self._replaced: dict[QueueRef, str] = {}

    def get(self, queue: QueueRef, *, refresh: bool = True, reload: bool = False) -> QueueManifest:
        """The queue's manifest: the cached one (``refresh=False``), the newest listed version
        (read only when it is not the cached one's), or, with ``reload``, the newest read again
        whatever its version: a re-created archive can reach the very version the cache holds,
        and only its content tells them apart (``replaced_by``)."""
        cached = self._cached.get(queue)
        if cached is not None and not refresh:
            return cached
        manifests = ManifestLog(self.store, queue.prefix)
        versions = manifests.versions()  # one LIST: cheap enough for every micro-batch
        if cached is not None and versions and max(versions) == cached.version and not reload:
            return cached
        try:
            manifest = manifests.load()
        except ManifestError as e:
            raise ManifestError(f"{queue.prefix}: {e}") from e
        if cached is not None:
            why = replaced_by(cached, manifest)
            if why is not None:
                self._replaced.setdefault(queue, why)
        self._cached[queue] = manifest
        return manifest

    def take_replaced(self) -> dict[QueueRef, str]:
        """The queues whose archive a newer manifest replaced since the last call, and how
        (``replaced_by``); an empty dict, without any request, when none was."""
        if not self._replaced:
            return {}
        taken, self._replaced = self._replaced, {}
        return taken

    def get_many(self, queues: list[QueueRef], *, refresh: bool = True) -> list[QueueManifest]:
        """``get`` of every queue, concurrently (one LIST, and a GET if it changed, each)."""
        if len(queues) <= 1:
            return [self.get(q, refresh=refresh) for q in queues]
        with ThreadPoolExecutor(min(LISTING_THREADS, len(queues))) as pool:
            return list(pool.map(lambda q: self.get(q, refresh=refresh), queues))


def replaced_by(old: QueueManifest, new: QueueManifest) -> str | None:
    """How ``new`` replaced the archive ``old`` described instead of continuing it, or None.

    A queue's manifests change only by appending segments that continue the archive
    (``with_segments``) and by dropping whole segments from its start (retention), each in a
    higher version; a segment keeps its object key, with its random suffix, from upload until
    it expires. So a newer manifest in which the version or the watermark went back, or in
    which an offset ``old`` held (or had expired) is held by another object, or whose archive id
    differs (``archive_changed``), is another archive: the topic deleted and re-created, or its
    prefix wiped and archived again. Costs nothing but memory: it compares two manifests
    already read, and only when the manifest changed."""
    if new.version < old.version:
        return f"its manifest went back from version {old.version} to {new.version}"
    if new.end_offset < old.end_offset:
        return f"the tier's archive ends at {new.end_offset}, it ended at {old.end_offset}"
    if new.start_offset < old.start_offset:
        return f"the tier's archive starts at {new.start_offset}, it began at {old.start_offset}"
    keys = {s.key for s in old.segments}
    for segment in new.segments:
        if segment.base_offset >= old.end_offset:
            break  # appended: the rest of the list is too
        if segment.key not in keys:
            was = old.find(segment.base_offset)
            held = "nothing" if was is None else was.key
            return (
                f"the tier holds {segment.key} for offset {segment.base_offset}, "
                f"where it held {held}"
            )
    # The only sign left when the new archive's retention already passed the old end (decision
    # 1240). ``old`` of version 0 is a prefix without a manifest yet: its first commit makes
    # the id.
    return archive_changed(old.archive, new.archive) if old.version else None


def archive_changed(was: str, now: str) -> str | None:
    """How the tier's archive id ``now`` shows another archive than the one of id ``was`` (""
    for an archive without an id), or None. Every version of an archive carries the id its
    first commit made; versions written before ids existed have none, and an archive without
    one never gains one (``tiered.cold.manifest``). So two ids that differ, or an id where
    there was none, are two archives. A tier without an id tells nothing: its versions are
    older than ids, or were rewritten by a broker that predates them."""
    if not now or now == was:
        return None
    if not was:
        return f"the tier's archive has the id {now}, the one exported had none"
    return f"the tier's archive has the id {now}, the one exported had {was}"
