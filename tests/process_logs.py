"""The logs of the server processes a test started (brokers, NameServers, etcd), so that a
failing test's report ends with what each of them logged last (conftest's
``pytest_runtest_makereport``). A failure seen once under load is otherwise unexplained: the
logs live in the test's tmp_path, which pytest deletes three runs later and CI never keeps.

The tails shown go through the scrubber the broker's own log handler uses
(``tiered.cold.credentials``), with the secret values of the test process's environment and of
the environment each server was given: a traceback or a warning a server printed to stderr
without its logging (faulthandler, Python's own warnings) is scrubbed too."""

from __future__ import annotations

import os
import sys
import types
from dataclasses import dataclass, field
from pathlib import Path

from tiered.cold.credentials import scrub, secret_values

TAIL_LINES = 200


@dataclass
class TrackedLog:
    name: str
    path: Path
    secrets: set[str] = field(default_factory=set)


# One registry per process however this module was imported: ``process_logs`` (tests/ on the
# path, as conftest and most tests import) and ``tests.process_logs`` (from the repository root,
# as tests/test_ha.py imports the harness) are two module objects, and both must fill the list
# conftest reads.
_NAME = "tmq_test_process_logs"
_REGISTRY = sys.modules.setdefault(_NAME, types.ModuleType(_NAME))
if not hasattr(_REGISTRY, "logs"):
    _REGISTRY.logs = []


def _logs() -> list[TrackedLog]:
    logs: list[TrackedLog] = _REGISTRY.logs
    return logs


def track(name: str, path: Path, env: dict[str, str] | None = None) -> None:
    """Show ``path`` (the log of server ``name``) if the running test fails; ``env``: the
    variables the server was given besides the test's own (their secrets are scrubbed)."""
    secrets = secret_values(env=env or {})
    for tracked in _logs():
        if tracked.path == path:  # the same server restarted
            tracked.secrets |= secrets
            return
    _logs().append(TrackedLog(name, path, secrets))


def clear() -> None:
    """A new test begins: forget the previous one's servers."""
    _logs().clear()


def tails(lines: int = TAIL_LINES) -> list[tuple[str, str]]:
    """(title, text) per tracked log: its last ``lines`` lines, secrets scrubbed."""
    common = secret_values(env=dict(os.environ))
    out = []
    for tracked in _logs():
        try:
            text = tracked.path.read_text(errors="replace")
        except OSError as e:
            text = f"(no log: {e})"
        kept = text.splitlines()[-lines:]
        body = scrub("\n".join(kept), common | tracked.secrets) or "(empty log)"
        title = f"{tracked.name} log, last {len(kept)} lines ({tracked.path})"
        out.append((title, body))
    return out
