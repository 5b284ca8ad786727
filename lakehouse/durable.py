"""A local lake's durability: what delta-rs leaves in the page cache (decision 1270).

delta-rs 1.6 writes a local table through object_store's ``LocalFileSystem``, which never
fsyncs: a data file, a commit's ``_delta_log/N.json`` and the names of both stay in the page
cache until the kernel writes them back (object_store gained an opt-in fsync only in 2026,
arrow-rs-object-store #643, which this delta-rs does not expose). An export that reported its
rows and then lost power could come back without them, and, worse, with a commit whose name
reached the disk but whose bytes did not: a zero-length commit reads as an empty version, a
torn one (part of its JSON) makes delta-rs refuse the whole table, every version of it.

So on a local lake:

- the export's own Parquet files are fsynced by the task that writes them, in directories made
  durable, before the driver commits them (``sync_file``, ``make_dirs``): a commit never names
  a file that a power loss could take back;
- after every delta-rs write (the export's commit, the table's creation, a column added,
  compaction, a checkpoint) ``settle`` fsyncs what the new versions wrote (the files they add,
  their commit files, checkpoints, ``_last_checkpoint``) and then the directories, so the
  command that reported the write is not taken back by a power loss after it returned;
- a newest commit torn by a power loss inside delta-rs's own window (between its rename and
  ``settle``) is moved aside by the exporter before it opens the table (``set_aside_torn_head``):
  the table reads as it was before that commit, whose queues' exported offsets are then the
  previous ones, so the export writes those rows again, exactly once.

An S3 lake needs none of it: a PUT is durable when it is acknowledged.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from pathlib import Path
from urllib.parse import unquote

from lakehouse.locations import Location, is_local, local_path
from tiered.durable import fsync_dir, fsync_file, make_dirs, write_file

log = logging.getLogger(__name__)

LOG_DIR = "_delta_log"
QUARANTINE_DIR = "_tmq_quarantine"  # beside _delta_log; delta-rs and vacuum ignore "_" names


def _version_of(name: str) -> int | None:
    """The version a ``_delta_log`` entry belongs to (``N.json``, ``N.checkpoint.parquet``,
    ``N.checkpoint.K.M.parquet``), or None for anything else."""
    head = name.split(".", 1)[0]
    return int(head) if head.isdigit() and len(head) == 20 else None


def _added_paths(commit: Path) -> list[str]:
    """The relative paths of the files a commit adds (URI-encoded in the log)."""
    out = []
    with commit.open("rb") as f:
        for line in f:
            if not line.strip():
                continue
            add = json.loads(line).get("add")
            if add and "://" not in add["path"]:
                out.append(unquote(add["path"]))
    return out


def make_table_dir(location: Location) -> None:
    """Make a local table's directory with a durable name, and the lake's (its parent), before
    delta-rs creates the table in it: delta-rs makes its directories with ``mkdir -p`` and
    fsyncs none of them. The lake's directory may exist already without a durable name (the
    export's checkpoint directory is made in it first), so its parent is fsynced whether or not
    it was new."""
    if not is_local(location.url):
        return
    root = local_path(location.url)
    make_dirs(root)
    fsync_dir(root.parent.parent)


def settle(location: Location, since_version: int) -> None:
    """Make durable what delta-rs wrote to the local table at ``location`` in the versions
    after ``since_version`` (-1: the table was just created). Data files and log files first,
    their directories after, so no durable name points at bytes that are not. Nothing for a
    table on S3."""
    if not is_local(location.url):
        return
    root = local_path(location.url)
    log_dir = root / LOG_DIR
    dirs: set[Path] = {log_dir, root}
    written: list[Path] = []
    for found in os.scandir(log_dir):
        version = _version_of(found.name)
        if found.name == "_last_checkpoint" or (version is not None and version > since_version):
            written.append(Path(found.path))
    for entry in sorted(written):
        if entry.name.endswith(".json"):
            for relative in _added_paths(entry):
                data = root / relative
                try:
                    fsync_file(data)
                except FileNotFoundError:
                    continue  # removed by a later version and vacuumed (maintain): not needed
                parent = data.parent
                while parent != root and root in parent.parents:
                    dirs.add(parent)
                    parent = parent.parent
        fsync_file(entry)
    # Deepest first: a partition directory's own name is in its parent, fsynced after it.
    for directory in sorted(dirs, key=lambda d: len(d.parts), reverse=True):
        fsync_dir(directory)


ACTIONS_KEY = "tmq.actions"  # in an export commit's commitInfo: how many add and txn lines follow


def _torn(commit: Path) -> bool:
    """Whether a commit file lost part of what delta-rs wrote (a power loss cut it).

    delta-rs writes ``commitInfo`` as the first line of every commit and no newline after the
    last, so a cut that fell on a line's end still parses line by line: for the export's own
    commits ``commitInfo`` names how many ``add`` and ``txn`` lines follow (``ACTIONS_KEY``),
    which a cut cannot keep consistent; for delta-rs's others (compaction, a column added)
    whole JSON lines and a ``commitInfo`` are all there is to check. A zero-length commit is
    not torn: delta-rs reads it as an empty version."""
    data = commit.read_bytes()
    if not data:
        return False
    try:
        actions = [json.loads(line) for line in data.splitlines() if line.strip()]
    except ValueError:  # JSONDecodeError and UnicodeDecodeError both are
        return True
    info = actions[0].get("commitInfo") if actions and isinstance(actions[0], dict) else None
    if not isinstance(info, dict):
        return True
    expected = info.get(ACTIONS_KEY)
    if expected is None:
        return False
    found = sum(1 for a in actions if isinstance(a, dict) and ("add" in a or "txn" in a))
    return found != int(expected)


def set_aside_torn_head(location: Location) -> Path | None:
    """Move a torn newest commit of the local table at ``location`` into ``_tmq_quarantine/``
    (durably, before its name leaves ``_delta_log``); return where it went, or None when the
    newest commit is whole (or the table is on S3, or has no log). Only the newest: a torn
    commit under a later one is damage this cannot explain, and stays for delta-rs to report."""
    if not is_local(location.url):
        return None
    root = local_path(location.url)
    log_dir = root / LOG_DIR
    commits = []
    with contextlib.suppress(FileNotFoundError):
        commits = [
            (v, Path(e.path))
            for e in os.scandir(log_dir)
            if e.name.endswith(".json") and (v := _version_of(e.name)) is not None
        ]
    if not commits:
        return None
    version, head = max(commits)
    if not _torn(head):
        return None
    quarantine = root / QUARANTINE_DIR
    make_dirs(quarantine)
    target = quarantine / f"{head.name}.{time.time_ns()}"
    write_file(target, head.read_bytes())  # durable, name and all, before the head goes
    head.unlink()
    fsync_dir(log_dir)
    log.warning(
        "table %s: its newest commit (version %d) was cut by a crash before it was durable; "
        "moved to %s. The table reads as of version %d, and the export writes that commit's "
        "rows again",
        location.url,
        version,
        target,
        version - 1,
    )
    return target
