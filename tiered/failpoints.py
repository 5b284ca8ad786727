"""Named crash points, armed from the environment, for tests that kill a real process at an
exact step (as FoundationDB's and TiKV's failpoints do).

``TMQ_FAILPOINTS=offload.before_commit`` makes the process SIGKILL itself the first time it
reaches that point: no cleanup handler, no flush, no ``finally`` runs, exactly as ``kill -9``.
``TMQ_FAILPOINTS=release.mid_switch=sleep:1.5`` instead pauses there for 1.5 s every time, to
widen a race window a test wants to hit. Unarmed (the default), ``hit`` costs one dict lookup.

Points:
- ``offload.before_commit``: a segment object is written and verified; its manifest is not
  committed.
- ``offload.after_put``: in the cold worker, a segment object is written; it is not verified
  yet (the worker reads ``TMQ_FAILPOINTS`` from the environment it was spawned with).
- ``offload.before_release``: the manifest is committed; no local CommitLog file is released.
- ``durable.after_rename``: ``tiered.durable.replace`` has renamed a fsynced file into place;
  its directory is not fsynced yet (the new name is not durable).
- ``tier.after_link``: a file:// tier's create-if-absent has linked the object's name into
  place; its directory is not fsynced yet (the name is not durable).
- ``retention.before_delete``: expired segments have left the manifest; their objects remain.
- ``release.mid_switch``: between the two steps of releasing CommitLog files (readers are
  routed past them / the files are deleted).
- ``commitlog.before_sizes``: a batch's bytes are in the CommitLog file with every record's
  size field still zero (they are set next, record by record). Only ``append_records`` has
  this step; the encoder's direct write of a batch (decision 1040) has none.
- ``commitlog.mid_write``: the encoder's direct write of a batch is cut at the first file page
  past its middle, as the kernel cuts a ``pwrite`` on SIGKILL: whole records, one torn across
  the page unless a record starts there, then what was in the file before (zeros).
- ``dispatch.before_pass``: the dispatcher thread has records to dispatch; its pass has not
  started (``sleep:`` keeps dispatch behind the appends, decision 680).
- ``store.after_cq_repair``: at start, zeroed ConsumeQueue entries are rebuilt in the page
  cache; nothing of the repair is fsynced yet.
- ``resolve.mid_copy``: a divergence resolve (decision 801) has appended its first batch of
  copies (64 messages); the rest are not appended.
- ``resolve.before_commit``: a resolve's copies are all appended, fsynced and read back; its
  commit (``tier-divergence.json`` without the conflict) is not written.
- ``resolve.before_floor``: a resolve's commit is written; the queue's floor is not raised.
- ``resolve.after_floor``: the queue's floor is raised and saved (``queue-floors.json``); the
  record of the floor to raise is not dropped from ``tier-divergence.json``.
- ``register.before_send``: a broker's registration is built; no NameServer has it yet
  (``sleep:`` holds a heartbeat under way while the broker is stopped, decision 1260).
- ``transaction.before_commit_op``: a COMMIT's real message is in the CommitLog; the commit op
  recording the decision is not (a torn commit batch).
"""

from __future__ import annotations

import logging
import os
import signal
import time

log = logging.getLogger(__name__)


def _parse(spec: str) -> dict[str, float | None]:
    """``name`` (kill) or ``name=sleep:SECONDS``, comma-separated."""
    armed: dict[str, float | None] = {}
    for item in (p.strip() for p in spec.split(",")):
        if not item:
            continue
        name, _, action = item.partition("=")
        armed[name] = float(action.removeprefix("sleep:")) if action.startswith("sleep:") else None
    return armed


_ARMED = _parse(os.environ.get("TMQ_FAILPOINTS", ""))


def armed(name: str) -> bool:
    return name in _ARMED


def hit(name: str) -> None:
    if name not in _ARMED:
        return
    pause = _ARMED[name]
    if pause is not None:
        log.warning("failpoint %s: pausing %.2fs", name, pause)
        time.sleep(pause)
        return
    log.critical("failpoint %s: killing this process (SIGKILL)", name)
    for handler in logging.getLogger().handlers:
        handler.flush()
    os.kill(os.getpid(), signal.SIGKILL)
