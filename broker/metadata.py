"""The broker's own metadata: topic configs, subscription groups and consumer offsets.

Each is one JSON document under ``{data_dir}/config/``, like RocketMQ's ``topics.json``,
``subscriptionGroup.json`` and ``consumerOffset.json``, replaced atomically (temporary file,
fsync, rename, fsync of the directory) so a crash leaves the old or the new version. Topic changes
are saved at once; consumer offsets, which move constantly, are saved periodically and on shutdown
(a crash can replay what was consumed since the last save: at-least-once, as in RocketMQ).

Groups are created by clients on first use, so there may be thousands and one arrives with
every new consumer: rewriting ``groups.json`` for each cost 83 ms after 3,000 groups. A group
change is instead one fsynced line appended to ``groups.log``; ``groups.json`` is a snapshot,
rewritten (and the log emptied) once the log holds more lines than the snapshot has groups, so
the cost per group stays flat. Loading reads the snapshot, then replays the log; a torn last
line (a crash during its append, never acknowledged) is ignored.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from broker.acl import AclStore
from tiered.durable import append_whole, fsync_dir, make_dirs, settle_dir, write_file

# The name rule is the store's, defined once (tiered/names.py); the broker's modules import it
# from here.
from tiered.names import MAX_GROUP_LENGTH as MAX_GROUP_LENGTH
from tiered.names import MAX_TOPIC_LENGTH as MAX_TOPIC_LENGTH
from tiered.names import InvalidNameError as InvalidNameError
from tiered.names import check_group_name as check_group_name
from tiered.names import check_topic_name as check_topic_name

log = logging.getLogger(__name__)

MAX_QUEUES = 1024

PERM_READ = 4
PERM_WRITE = 2
PERM_READ_WRITE = PERM_READ | PERM_WRITE

MESSAGE_TYPES = ("NORMAL", "FIFO", "DELAY", "TRANSACTION")
SUPPORTED_MESSAGE_TYPES = MESSAGE_TYPES
RETRY_GROUP_PREFIX = "%RETRY%"
DEFAULT_MAX_DELIVERY_ATTEMPTS = 16  # RocketMQ 5's retryMaxTimes
DLQ_GROUP_PREFIX = "%DLQ%"


def retry_topic(group: str) -> str:
    return f"{RETRY_GROUP_PREFIX}{group}"


def dlq_topic(group: str) -> str:
    return f"{DLQ_GROUP_PREFIX}{group}"


@dataclass(slots=True)
class TopicConfig:
    name: str
    queues: int = 8
    perm: int = PERM_READ_WRITE
    message_type: str = "NORMAL"
    # Tiering attributes, used by the tiered-storage layer (issue 4).
    tiered: bool = False
    retention_ms: int | None = None
    local_retention_ms: int | None = None
    # Per queue: the archive's size limit; its oldest segments expire first (Kafka's
    # retention.bytes, applied to the tier).
    retention_bytes: int | None = None

    def __post_init__(self) -> None:
        if not self.name.startswith((RETRY_GROUP_PREFIX, DLQ_GROUP_PREFIX)):
            check_topic_name(self.name)  # retry/DLQ names embed a group name and may be longer
        if not 1 <= self.queues <= MAX_QUEUES:
            raise ValueError(f"topic {self.name}: queues must be 1..{MAX_QUEUES}")
        if self.perm & ~PERM_READ_WRITE:
            raise ValueError(f"topic {self.name}: perm must combine 4 (read) and 2 (write)")
        if self.message_type not in MESSAGE_TYPES:
            raise ValueError(f"topic {self.name}: message type must be one of {MESSAGE_TYPES}")
        if self.message_type not in SUPPORTED_MESSAGE_TYPES:
            # Refused rather than accepted and then delivered early or without a commit.
            raise ValueError(
                f"topic {self.name}: {self.message_type} topics are not supported "
                f"yet (supported: {', '.join(SUPPORTED_MESSAGE_TYPES)})"
            )


@dataclass(slots=True)
class GroupConfig:
    name: str
    # Deliveries before a message goes to the dead-letter queue.
    max_delivery_attempts: int = DEFAULT_MAX_DELIVERY_ATTEMPTS
    fifo: bool = False
    # Created by a client's first request rather than by an operator (counts against the cap).
    auto_created: bool = False


class GroupLimitError(RuntimeError):
    """The broker already holds as many auto-created groups as it is configured to allow."""


# The log is folded into the snapshot once it has this many lines or more than the snapshot has
# groups: amortised, every group is written a bounded number of times.
_MIN_COMPACT_LINES = 1024


def _save(path: Path, document: Any) -> None:
    make_dirs(path.parent)
    write_file(path, json.dumps(document, indent=1, sort_keys=True).encode())


def _load(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except json.JSONDecodeError as e:
        raise RuntimeError(f"{path} is damaged ({e}); restore it from a backup") from e


class BrokerMetadata:
    """Topics, groups and consumer offsets of one broker, thread-safe."""

    def __init__(self, config_dir: Path) -> None:
        self.dir = config_dir
        self._lock = threading.Lock()
        self.topics: dict[str, TopicConfig] = {}
        self.groups: dict[str, GroupConfig] = {}
        # (group, topic, queue) -> next queue offset to consume
        self._offsets: dict[tuple[str, str, int], int] = {}
        self._offsets_dirty = False
        # Held from a save's snapshot to its rename: saves from two threads (a slave's
        # replication applying its master's metadata, and the 5 s tick) otherwise could rename
        # the older snapshot last, and the file went back in time (decision 1180).
        self._offsets_save_lock = threading.Lock()
        self._group_log: int | None = None  # descriptor of groups.log, opened on first append
        self._group_log_lines = 0
        self.auto_created_groups = 0
        # Users and grants (broker/acl.py): saved on their own, replicated with the rest.
        self.acl = AclStore(config_dir)
        # Called after every change of what ``snapshot`` returns: a replication master pushes
        # it to its slaves at once (decision 223).
        self._listeners: list[Callable[[], None]] = []
        self.acl.on_change = self._changed

    def add_change_listener(self, listener: Callable[[], None]) -> None:
        self._listeners.append(listener)

    def remove_change_listener(self, listener: Callable[[], None]) -> None:
        with contextlib.suppress(ValueError):
            self._listeners.remove(listener)

    def _changed(self) -> None:
        for listener in list(self._listeners):
            listener()

    @property
    def _group_log_path(self) -> Path:
        return self.dir / "groups.log"

    def load(self) -> None:
        settle_dir(self.dir)
        for raw in _load(self.dir / "topics.json") or []:
            cfg = TopicConfig(**raw)
            self.topics[cfg.name] = cfg
        for raw in _load(self.dir / "groups.json") or []:
            g = GroupConfig(**raw)
            self.groups[g.name] = g
        self._replay_group_log()
        self.auto_created_groups = sum(g.auto_created for g in self.groups.values())
        for row in _load(self.dir / "consumer_offsets.json") or []:
            self._offsets[(row["group"], row["topic"], row["queue"])] = row["offset"]
        self.acl.load()

    # -- topics --------------------------------------------------------------------------------

    def put_topic(self, cfg: TopicConfig) -> None:
        with self._lock:
            # Saved before it is served (as a group is): a save the disk refused changes
            # nothing, where a topic changed in memory only was served, and tiered, until the
            # next restart forgot it (decision 793).
            topics = {**self.topics, cfg.name: cfg}
            _save(self.dir / "topics.json", [asdict(t) for t in topics.values()])
            self.topics[cfg.name] = cfg
        self._changed()

    def delete_topic(self, name: str) -> bool:
        with self._lock:
            gone = self.topics.pop(name, None)
            if gone is not None:
                _save(self.dir / "topics.json", [asdict(t) for t in self.topics.values()])
        if gone is not None:
            self._changed()
        return gone is not None

    def topic(self, name: str) -> TopicConfig | None:
        return self.topics.get(name)

    # -- groups --------------------------------------------------------------------------------

    def put_group(self, cfg: GroupConfig) -> None:
        """Create or replace a group; durable when this returns."""
        with self._lock:
            self._put_group(cfg)
        self._changed()

    def auto_create_group(self, name: str, limit: int) -> GroupConfig:
        """The group ``name``, created as a client's first request creates it, unless ``limit``
        auto-created groups exist already (``GroupLimitError``)."""
        with self._lock:
            existing = self.groups.get(name)
            if existing is not None:
                return existing
            if self.auto_created_groups >= limit:
                raise GroupLimitError(
                    f"consumer group {name} does not exist and this broker already auto-created "
                    f"{self.auto_created_groups} groups (limits.max_auto_created_groups = "
                    f"{limit}); create the group with the admin API or raise the limit"
                )
            cfg = GroupConfig(name=name, auto_created=True)
            self._put_group(cfg)
        self._changed()
        return cfg

    def _put_group(self, cfg: GroupConfig) -> None:
        old = self.groups.get(cfg.name)
        self._append_group(cfg)
        self.groups[cfg.name] = cfg
        self.auto_created_groups += int(cfg.auto_created) - int(bool(old and old.auto_created))
        if self._group_log_lines >= max(_MIN_COMPACT_LINES, len(self.groups)):
            self._compact_groups()

    def _append_group(self, cfg: GroupConfig) -> None:
        if self._group_log is None:
            make_dirs(self.dir)
            fresh = not self._group_log_path.exists()
            self._group_log = os.open(
                self._group_log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644
            )
            if fresh:
                fsync_dir(self.dir)
        # Whole or not at all: a fragment left by a full disk would join the next line.
        append_whole(self._group_log, (json.dumps(asdict(cfg), sort_keys=True) + "\n").encode())
        os.fdatasync(self._group_log)
        self._group_log_lines += 1

    def _compact_groups(self) -> None:
        """Fold the log into the snapshot: snapshot first, then an empty log. A crash between
        the two replays lines the snapshot already holds, which changes nothing."""
        _save(self.dir / "groups.json", [asdict(g) for g in self.groups.values()])
        if self._group_log is not None:
            os.close(self._group_log)
            self._group_log = None
        write_file(self._group_log_path, b"")
        self._group_log_lines = 0

    def _replay_group_log(self) -> None:
        try:
            raw = self._group_log_path.read_bytes()
        except FileNotFoundError:
            return
        lines = raw.split(b"\n")
        start = 0  # byte offset of line i
        for i, line in enumerate(lines):
            line_start, start = start, start + len(line) + 1
            if not line:
                continue
            try:
                g = GroupConfig(**json.loads(line))
            except (ValueError, TypeError) as e:
                # Only the last line can be unsynced (each append is fdatasynced before the
                # next), and a power loss lands its pages in any order: its newline may be on
                # disk while a sector before it is not. Never acknowledged: a torn append. It
                # is cut off, or the next group's line would be appended to the fragment and
                # the start after it would find a damaged line in the middle.
                if not any(lines[i + 1 :]):
                    log.warning("%s: cutting off a torn last line", self._group_log_path)
                    with self._group_log_path.open("r+b") as fh:
                        fh.truncate(line_start)
                        os.fsync(fh.fileno())
                    break
                raise RuntimeError(
                    f"{self._group_log_path} line {i + 1} is damaged ({e}); restore it from a "
                    "backup"
                ) from e
            self.groups[g.name] = g
            self._group_log_lines += 1

    def close(self) -> None:
        with self._lock:
            if self._group_log is not None:
                os.close(self._group_log)
                self._group_log = None

    def group(self, name: str) -> GroupConfig | None:
        return self.groups.get(name)

    # -- replication ---------------------------------------------------------------------------

    def snapshot(self) -> dict[str, Any]:
        """Topics, groups and consumer offsets as one JSON-able document (what a master sends
        its slaves; RocketMQ's SlaveSynchronize)."""
        with self._lock:
            return {
                "topics": [asdict(t) for t in self.topics.values()],
                "groups": [asdict(g) for g in self.groups.values()],
                "offsets": [
                    {"group": g, "topic": t, "queue": q, "offset": o}
                    for (g, t, q), o in sorted(self._offsets.items())
                ],
                "acl": self.acl.snapshot(),
            }

    def replace(self, snapshot: dict[str, Any]) -> None:
        """Become ``snapshot`` (a master's), durably: a slave's copy of its master's metadata."""
        topics = {t.name: t for t in (TopicConfig(**raw) for raw in snapshot["topics"])}
        groups = {g.name: g for g in (GroupConfig(**raw) for raw in snapshot["groups"])}
        offsets = {(r["group"], r["topic"], r["queue"]): r["offset"] for r in snapshot["offsets"]}
        with self._lock:
            # Only what changed is written: a master sends its whole document up to 20 times a
            # second while its consumers ack, and the replication thread applying it reads no
            # CommitLog data meanwhile: four fsyncs a document, three of them of files that had
            # not changed (decision 1182). What is on disk is what memory
            # holds, so an unchanged part needs no write; a part whose save fails stays
            # different in memory too, and the next document saves it again.
            if topics != self.topics:
                _save(self.dir / "topics.json", [asdict(t) for t in topics.values()])
            self.topics = topics
            if groups != self.groups:
                old = self.groups
                self.groups = groups
                try:
                    self._compact_groups()  # groups.json becomes the master's, groups.log empty
                except BaseException:
                    self.groups = old
                    raise
            self.auto_created_groups = sum(g.auto_created for g in self.groups.values())
            self._offsets = offsets
        self.flush_offsets(force=True)
        if "acl" in snapshot:  # a master from before users existed sends none
            self.acl.replace(snapshot["acl"])

    # -- consumer offsets ----------------------------------------------------------------------

    def offset(self, group: str, topic: str, queue: int) -> int | None:
        return self._offsets.get((group, topic, queue))

    def commit_offset(self, group: str, topic: str, queue: int, offset: int) -> None:
        with self._lock:
            if self._offsets.get((group, topic, queue)) == offset:
                return
            self._offsets[(group, topic, queue)] = offset
            self._offsets_dirty = True
        self._changed()

    def offsets_of(self, group: str) -> dict[tuple[str, int], int]:
        return {(t, q): o for (g, t, q), o in list(self._offsets.items()) if g == group}

    def flush_offsets(self, *, force: bool = False) -> None:
        with self._offsets_save_lock:
            with self._lock:
                if not (self._offsets_dirty or force):
                    return
                rows = [
                    {"group": g, "topic": t, "queue": q, "offset": o}
                    for (g, t, q), o in sorted(self._offsets.items())
                ]
                self._offsets_dirty = False
            try:
                _save(self.dir / "consumer_offsets.json", rows)
            except BaseException:
                # Still unsaved: the next tick tries again. Cleared for good, the offsets a
                # full disk refused stayed in memory only until some consumer moved one again,
                # and a kill -9 meanwhile rewound the groups to the last saved file (decision
                # 1000).
                with self._lock:
                    self._offsets_dirty = True
                raise


@dataclass(slots=True)
class Limits:
    """Request limits (RocketMQ proxy's defaults)."""

    max_body_bytes: int = 4 * 1024 * 1024
    max_properties: int = 128
    max_properties_bytes: int = 16 * 1024
    max_batch: int = 1024
    max_receive_batch: int = 32
    # Groups a client may create by naming them (RocketMQ's autoCreateSubscriptionGroup, with
    # a ceiling): each also brings a retry and a dead-letter topic when it is used.
    max_auto_created_groups: int = 10_000
