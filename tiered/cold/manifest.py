"""Per-queue manifests: which segment objects make up a (topic, queue)'s archive.

Object layout under the tier root (DESIGN.md, "Cold tier keys"):

    {cluster}/{broker}/{topic}/{queue}/segments/{base offset:020d}-{unique}.seg
    {cluster}/{broker}/{topic}/{queue}/manifests/{version:020d}.json

A manifest version is an immutable object written with ``put_if_absent``, as Delta Lake writes
its log: committing version N+1 either creates that object or finds it already there, in which
case another writer got there first and this commit is refused (``ManifestConflictError``). A
crash at any point leaves the previous version current, or the new one; a segment object
written but never committed is an orphan that ``verify`` reports. The current version is the
highest one listed; old versions are pruned after a commit, newest kept.

Fencing (replica groups, docs/ha.md): every version records the ``epoch`` and ``writer`` (the
broker) that committed it. A commit that loses the race for its version to a writer of a higher
epoch, or whose version is no longer the newest once written (it landed in a slot that pruning had
freed), is refused with ``ManifestFencedError`` when the current manifest's epoch is higher: the
writer was deposed and must stop writing this prefix.

Identity (decision 1240): every version carries the ``archive`` id, a random number made at the
queue's first commit (the version after an empty prefix) and copied into every later version,
whoever commits it (uploads, retention, a new master's claim). A topic deleted and re-created,
or a prefix wiped and archived again, starts a new archive with a new id, which the lakehouse
export compares with the one its table was exported from. Versions written before the id have
none (``""``), and an archive without one never gains one: only a first commit makes an id, so
an id appearing where there was none is another archive too.

Anyone holding the bucket can rebuild the state: manifests name their segments, and every
segment's footer describes it (``segment.read_footer``).
"""

from __future__ import annotations

import json
import re
import secrets
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field

from google_crc32c import value as crc32c

from tiered.cold.storage import ObjectNotFoundError, ObjectStore
from tiered.formats import SegmentInfo
from tiered.names import is_valid_name

FORMAT = "tmq-queue-manifest/1"
KEEP_VERSIONS = 10
# An archive id: 16 lowercase hex digits of a number in [1, 2**63), so that it fits the signed
# 64-bit version of a Delta app transaction, where the lakehouse records it (0 there: no id).
ARCHIVE_ID = re.compile(r"[0-7][0-9a-f]{15}")


class ManifestConflictError(Exception):
    """Another writer committed this manifest version first."""


class ManifestFencedError(ManifestConflictError):
    """The current manifest was committed in a higher epoch than this commit's: its writer was
    deposed (a newer master took the prefix over) and must not write here again."""

    def __init__(self, message: str, current: QueueManifest) -> None:
        super().__init__(message)
        self.current = current


class ManifestError(Exception):
    """A manifest that cannot be read (damaged, or of an unknown format)."""


def queue_prefix(cluster: str, broker: str, topic: str, queue_id: int) -> str:
    for name, value in (("cluster", cluster), ("broker", broker), ("topic", topic)):
        if not is_valid_name(value):
            raise ValueError(f"illegal {name} name {value!r} for an object key")
    if queue_id < 0:
        raise ValueError(f"illegal queue id {queue_id}")
    return f"{cluster}/{broker}/{topic}/{queue_id}/"


def new_archive_id() -> str:
    """A fresh archive id (``ARCHIVE_ID``): 63 random bits, never 0."""
    return f"{secrets.randbelow(2**63 - 1) + 1:016x}"


def segment_key(prefix: str, base_offset: int) -> str:
    """A fresh key: named by base offset, with a unique suffix so that a retried upload never
    replaces a different object."""
    return f"{prefix}segments/{base_offset:020d}-{uuid.uuid4().hex[:12]}.seg"


@dataclass(slots=True)
class QueueManifest:
    prefix: str
    version: int = 0
    segments: list[SegmentInfo] = field(default_factory=list)
    # Queue offsets below this were removed by retention (the first segment starts here).
    log_start_offset: int = 0
    # The replica-group epoch of the master that committed this version, and who it was (0 and
    # the broker name for a single broker); the offloader stamps both at commit.
    epoch: int = 0
    writer: str = ""
    # The identity of the data directory whose broker committed this version
    # (``MessageStore.store_id``; "" before decision 690): a broker of the same epoch on another
    # directory (a wiped disk, a second broker of the same name) does not own this prefix.
    store: str = ""
    # Which archive of the queue this is (module docstring, decision 1240): made at its first
    # commit, carried by every later version; "" in versions written before it existed.
    archive: str = ""

    @property
    def end_offset(self) -> int:
        """The tier watermark: every queue offset below it is in the tier (or expired)."""
        return self.segments[-1].end_offset if self.segments else self.log_start_offset

    @property
    def start_offset(self) -> int:
        return self.segments[0].base_offset if self.segments else self.log_start_offset

    def find(self, queue_offset: int) -> SegmentInfo | None:
        """The segment holding ``queue_offset`` (bisection over the in-memory list)."""
        lo, hi = 0, len(self.segments)
        while lo < hi:
            mid = (lo + hi) // 2
            if self.segments[mid].end_offset <= queue_offset:
                lo = mid + 1
            else:
                hi = mid
        if lo < len(self.segments) and self.segments[lo].base_offset <= queue_offset:
            return self.segments[lo]
        return None

    def with_segment(self, info: SegmentInfo) -> QueueManifest:
        """The next version, with ``info`` appended (it must continue the archive exactly)."""
        return self.with_segments([info])

    def with_segments(self, infos: Sequence[SegmentInfo]) -> QueueManifest:
        """The next version (one more, however many segments: the version is the commit's
        slot), with ``infos`` appended in order, each continuing the archive exactly."""
        end = self.end_offset
        for info in infos:
            if info.base_offset != end:
                raise ValueError(
                    f"{info.key} starts at {info.base_offset}, the archive ends at {end}"
                )
            end = info.end_offset
        return QueueManifest(
            self.prefix,
            self.version + 1,
            [*self.segments, *infos],
            self.log_start_offset,
            self.epoch,
            self.writer,
            self.store,
            self._next_archive(),
        )

    def _next_archive(self) -> str:
        """The next version's archive id: this one's, or a new one for the first commit of an
        empty prefix (version 0: no manifest in the tier). Never made for an archive that has
        versions without one (written before ids existed): the export takes an id appearing
        in an archive that had none as another archive."""
        return self.archive if self.version else new_archive_id()

    def without_segments_before(self, queue_offset: int) -> QueueManifest:
        """The next version without the segments wholly below ``queue_offset`` (retention)."""
        kept = [s for s in self.segments if s.end_offset > queue_offset]
        start = kept[0].base_offset if kept else max(self.end_offset, self.log_start_offset)
        return QueueManifest(
            self.prefix,
            self.version + 1,
            kept,
            start,
            self.epoch,
            self.writer,
            self.store,
            self._next_archive(),
        )

    def next_version(self) -> QueueManifest:
        """The next version with the same archive (a new master's first commit: it claims the
        prefix for its epoch before it uploads anything)."""
        return self.without_segments_before(self.start_offset)

    def encode(self) -> bytes:
        body = json.dumps(
            {
                "format": FORMAT,
                "prefix": self.prefix,
                "version": self.version,
                "log_start_offset": self.log_start_offset,
                "epoch": self.epoch,
                "writer": self.writer,
                **({"store": self.store} if self.store else {}),
                **({"archive": self.archive} if self.archive else {}),
                "segments": [s.to_dict() for s in self.segments],
            },
            sort_keys=True,
            separators=(",", ":"),
        )
        return json.dumps(
            {"manifest": json.loads(body), "crc32c": int(crc32c(body.encode()))}
        ).encode()

    @classmethod
    def decode(cls, raw: bytes) -> QueueManifest:
        try:
            outer = json.loads(raw)
            inner = outer["manifest"]
            body = json.dumps(inner, sort_keys=True, separators=(",", ":"))
            if int(crc32c(body.encode())) != outer["crc32c"] or inner["format"] != FORMAT:
                raise ManifestError("checksum or format mismatch")
            archive = inner.get("archive", "")  # versions written before decision 1240: ""
            if archive and not ARCHIVE_ID.fullmatch(archive):
                raise ManifestError(f"archive id {archive!r} is not 16 hex digits below 2**63")
            return cls(
                inner["prefix"],
                inner["version"],
                [SegmentInfo(**s) for s in inner["segments"]],
                inner["log_start_offset"],
                inner.get("epoch", 0),  # versions written before replica groups: epoch 0
                inner.get("writer", ""),
                inner.get("store", ""),
                archive,
            )
        except (ValueError, KeyError, TypeError) as e:
            raise ManifestError(f"unreadable manifest: {e}") from e


class ManifestLog:
    """One queue's manifests in the tier: the versions, newest current; reads and commits them.
    (Only ``MessageStore`` is called a store; decision 107.)"""

    def __init__(self, store: ObjectStore, prefix: str) -> None:
        self.store = store
        self.prefix = prefix

    def _key(self, version: int) -> str:
        return f"{self.prefix}manifests/{version:020d}.json"

    def versions(self) -> list[int]:
        return [
            int(o.key.rsplit("/", 1)[1].split(".")[0])
            for o in self.store.list(f"{self.prefix}manifests/")
            if o.key.endswith(".json")
        ]

    def load(self) -> QueueManifest:
        """The current manifest (an empty version 0 when there is none)."""
        for _attempt in range(5):
            versions = self.versions()
            if not versions:
                return QueueManifest(self.prefix)
            latest = max(versions)
            try:
                return QueueManifest.decode(self.store.get(self._key(latest)))
            except ObjectNotFoundError:  # pruned between LIST and GET: a newer one exists
                continue
        raise ManifestError(
            f"{self.prefix}manifests/: version {latest} is listed but cannot be read"
        )

    def commit(self, manifest: QueueManifest) -> None:
        """Make ``manifest`` current, atomically; ``ManifestConflictError`` if its version
        was committed by someone else first, or is no longer the newest once written (its
        slot had been pruned: a writer far behind); ``ManifestFencedError`` when that other
        version was committed in a higher epoch. Safe to retry after a timeout: a retry that
        finds its own bytes already there counts as done."""
        key = self._key(manifest.version)
        data = manifest.encode()
        if not self.store.put_if_absent(key, data):
            existing = self.store.get(key)
            if existing == data:
                return  # our own earlier attempt landed
            raise self._refusal(key, manifest, QueueManifest.decode(existing))
        versions = self.versions()
        if max(versions) > manifest.version:
            # A stale writer's put into a pruned slot: never current (the highest version is),
            # and not to be mistaken for a commit. Take it back.
            self.store.delete(key)
            raise self._refusal(key, manifest, self.load())
        self.prune(manifest.version, versions)

    @staticmethod
    def _refusal(key: str, ours: QueueManifest, current: QueueManifest) -> ManifestConflictError:
        if current.epoch > ours.epoch:
            return ManifestFencedError(
                f"{key}: refused: {current.writer or 'another writer'} committed version "
                f"{current.version} in epoch {current.epoch}; this writer's epoch {ours.epoch} "
                "is deposed",
                current,
            )
        return ManifestConflictError(
            f"{key} was committed by another writer "
            f"({current.writer or 'unknown'}, epoch {current.epoch}; current version "
            f"{current.version})"
        )

    def prune(self, current: int, versions: list[int] | None = None) -> None:
        listed = self.versions() if versions is None else versions
        for version in sorted(v for v in listed if v <= current - KEEP_VERSIONS):
            self.store.delete(self._key(version))
