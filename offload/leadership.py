"""Who may write a broker's tier prefix: the offloader's one question about replica groups.

The offloader uploads, commits manifests and applies retention only while it leads: its
``Leadership`` callable answers with a ``Term`` (the master's epoch and who it is), or None on
a slave. The broker wires it to its replication role (``broker/server.py``); a single broker
leads forever in epoch 0. Every manifest commit carries the term, and a commit in a lower
epoch than the current manifest's is refused (``tiered/cold/manifest.py``): that is the fence.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(slots=True, frozen=True)
class Term:
    """A master's tenure: its replica-group epoch and its identity (for the manifest and for
    the operator reading a fence)."""

    epoch: int
    writer: str


# Asked before every upload, commit and expiry (cheap: no I/O). None: this broker must not write
# the tier (a slave); a higher epoch than the one before: a new term (the offloader claims each
# queue's manifest for it before writing there).
Leadership = Callable[[], Term | None]


def single_broker(writer: str) -> Leadership:
    """The leadership of a broker outside any replica group: always the writer, epoch 0."""
    term = Term(0, writer)
    return lambda: term
