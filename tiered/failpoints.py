"""Named crash points, armed from the environment, for tests that kill a real process at an
exact step (as FoundationDB's and TiKV's failpoints do).

``TMQ_FAILPOINTS=offload.before_commit`` makes the process SIGKILL itself the first time it
reaches that point: no cleanup handler, no flush, no ``finally`` runs, exactly as ``kill -9``.
Unarmed (the default), ``hit`` costs one set lookup.

Points:
- ``offload.before_commit``: a segment object is written and verified; its manifest is not
  committed.
- ``offload.before_release``: the manifest is committed; no local CommitLog file is released.
- ``retention.before_delete``: expired segments have left the manifest; their objects remain.
- ``transaction.before_commit_op``: a COMMIT's real message is in the CommitLog; the commit op
  recording the decision is not (a torn commit batch).
"""

from __future__ import annotations

import logging
import os
import signal

log = logging.getLogger(__name__)

_ARMED = frozenset(p.strip() for p in os.environ.get("TMQ_FAILPOINTS", "").split(",") if p.strip())


def armed(name: str) -> bool:
    return name in _ARMED


def hit(name: str) -> None:
    if name in _ARMED:
        log.critical("failpoint %s: killing this process (SIGKILL)", name)
        for handler in logging.getLogger().handlers:
            handler.flush()
        os.kill(os.getpid(), signal.SIGKILL)
