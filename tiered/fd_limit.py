"""File descriptors: the store holds one per mapped file (every ConsumeQueue file of every
queue, the CommitLog's and the IndexFiles'), so a broker of a few hundred queues needs more
than a shell's default soft limit of 1024, and far more than a service manager's tighter one.

At start the soft limit is raised to the hard one, as the JVM does for RocketMQ's and Kafka's
brokers (HotSpot's ``MaxFDLimit``). When descriptors run out all the same, what the store says
names the limit and the fix instead of a bare ``[Errno 24]`` (decision 1003).
"""

from __future__ import annotations

import errno
import logging
import os
import resource

log = logging.getLogger(__name__)

# Not past this even when the hard limit is unlimited (the kernel refuses above fs.nr_open).
_CEILING = 1 << 20


def raise_soft_limit() -> tuple[int, int]:
    """Raise this process's soft RLIMIT_NOFILE to its hard limit; returns (soft, hard) after."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = _CEILING if hard == resource.RLIM_INFINITY else min(hard, _CEILING)
    if soft != resource.RLIM_INFINITY and soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
        except (ValueError, OSError) as e:
            log.info("could not raise the open-files limit from %d to %d: %s", soft, want, e)
        else:
            log.info("open-files limit raised from %d to %d (the hard limit)", soft, want)
            soft = want
    return soft, hard


def exhausted(e: BaseException) -> bool:
    """``e`` (or what caused it) says this process or the system has no descriptor left."""
    seen: set[int] = set()
    cur: BaseException | None = e
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        if isinstance(cur, OSError) and cur.errno in (errno.EMFILE, errno.ENFILE):
            return True
        cur = cur.__cause__ or cur.__context__
    return False


def describe() -> str:
    """The descriptors open and the limit, and how to raise it, for an error message."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        open_now = str(len(os.listdir("/proc/self/fd")))
    except OSError:
        open_now = "?"
    return (
        f"the broker has run out of file descriptors ({open_now} open; limit {soft}, hard limit "
        f"{hard}): the store holds one per mapped file (each ConsumeQueue file of each queue). "
        "Raise the limit (ulimit -n / LimitNOFILE= before start, or prlimit --nofile on the "
        "running process)"
    )
