"""Apache's RocketMQ 5 Node.js client (npm ``rocketmq-client-nodejs``, pinned in
``tests/node/package.json`` and its lock) for the tests: installed with ``npm ci`` when
``node_modules`` is missing or the lock changed, driven through ``tests/node/driver.js``."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

NODE_DIR = Path(__file__).resolve().parent / "node"
_STAMP = NODE_DIR / "node_modules" / ".tmq-lock-sha256"


def ensure_node_client() -> None:
    """Install the pinned client once per lock file. Without node or npm the Node tests skip
    on a developer's machine and fail loudly in CI, where they must run."""
    missing = [tool for tool in ("node", "npm") if shutil.which(tool) is None]
    if missing:
        reason = f"{' and '.join(missing)} not found: the Node.js client tests need Node 20 and npm"
        if os.environ.get("CI") == "true":
            pytest.fail(reason, pytrace=False)
        pytest.skip(reason)
    lock = (NODE_DIR / "package-lock.json").read_bytes()
    digest = hashlib.sha256(lock).hexdigest()
    with (NODE_DIR / ".install.lock").open("w") as guard:
        fcntl.flock(guard, fcntl.LOCK_EX)  # two test workers never run npm ci at once
        if _STAMP.exists() and _STAMP.read_text() == digest:
            return
        done = subprocess.run(
            ["npm", "ci", "--no-audit", "--no-fund"],
            cwd=NODE_DIR,
            capture_output=True,
            text=True,
            timeout=600,
        )
        if done.returncode != 0:
            pytest.fail(f"npm ci failed:\n{done.stderr[-3000:]}", pytrace=False)
        _STAMP.write_text(digest)


def node(command: dict[str, Any], timeout: float = 120, env: dict[str, str] | None = None) -> Any:
    """Run one driver command; returns its JSON result (raises with the driver's stderr).
    ``env``: more environment (the CA a TLS test trusts)."""
    done = subprocess.run(
        ["node", str(NODE_DIR / "driver.js"), json.dumps(command)],
        cwd=NODE_DIR,
        capture_output=True,
        text=True,
        timeout=timeout,
        # The client's default logger writes under $HOME/logs; keep it in the test's tree.
        env={**os.environ, **(env or {}), "HOME": str(NODE_DIR)},
    )
    lines = done.stdout.strip().splitlines()
    result = json.loads(lines[-1]) if lines else None
    if done.returncode != 0 or result is None or (isinstance(result, dict) and "fatal" in result):
        raise AssertionError(f"node driver failed ({done.returncode}): {result}\n{done.stderr}")
    return result
