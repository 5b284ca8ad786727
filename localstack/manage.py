"""LocalStack S3 for tests and local use, without Docker.

    python localstack/manage.py setup     # localstack/.venv from a Python >= 3.12 on this machine
    python localstack/manage.py start     # S3 on 127.0.0.1:4566, returns once it answers
    python localstack/manage.py status
    python localstack/manage.py stop

LocalStack 4.14.0 is the last release that runs without an auth token; it needs Python 3.12 or
newer in its own virtualenv, with the pins below (DESIGN.md, environment facts). The ``runtime``
extra is needed to start it. The newest Python found is used: on 3.12.1 one of LocalStack's
dependencies imports ``warnings.deprecated``, which exists from 3.13 on (measured here).

The test suite uses these functions through the ``s3`` fixture in ``tests/conftest.py``.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
VENV = HERE / ".venv"
RUN_DIR = HERE / ".run"
PIDFILE = RUN_DIR / "localstack.pid"
LOGFILE = RUN_DIR / "localstack.log"
PINS = [
    "localstack-core[runtime]==4.14.0",
    "cbor2<5.7",
    "pyopenssl<24.3",
    "cryptography<44",
    "service_identity<24.3",
]
DEFAULT_PORT = 4566
MIN_PYTHON = (3, 12)


class LocalStackUnavailable(RuntimeError):
    """LocalStack cannot run here (no suitable Python, or it failed to start)."""


def _version(python: str) -> tuple[int, int] | None:
    try:
        out = subprocess.run(
            [python, "-c", "import sys; print(*sys.version_info[:2])"],
            capture_output=True,
            text=True,
            timeout=20,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    major, minor = out.split()
    return int(major), int(minor)


def find_python() -> str | None:
    """The newest Python >= 3.12 on this machine (``TMQ_LOCALSTACK_PYTHON`` wins)."""
    candidates: list[str] = []
    if os.environ.get("TMQ_LOCALSTACK_PYTHON"):
        candidates.append(os.environ["TMQ_LOCALSTACK_PYTHON"])
    for name in ("python3.14", "python3.13", "python3.12"):
        if found := shutil.which(name):
            candidates.append(found)
    pyenv = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv")) / "versions"
    if pyenv.is_dir():
        for version in pyenv.iterdir():
            if re.fullmatch(r"3\.\d+\.\d+", version.name):
                candidates.append(str(version / "bin" / "python"))
    usable = [(v, c) for c in candidates if (v := _version(c)) and v >= MIN_PYTHON]
    return max(usable)[1] if usable else None


def setup() -> Path:
    """Create (or reuse) ``localstack/.venv`` with the pinned packages; returns its python."""
    python = VENV / "bin" / "python"
    marker = VENV / ".tmq-pins"
    wanted = hashlib.sha256(json.dumps(PINS).encode()).hexdigest()
    if python.exists() and marker.exists() and marker.read_text() == wanted:
        return python
    base = find_python()
    if base is None:
        raise LocalStackUnavailable("no Python 3.12 or newer found (set TMQ_LOCALSTACK_PYTHON)")
    shutil.rmtree(VENV, ignore_errors=True)
    subprocess.run([base, "-m", "venv", str(VENV)], check=True)
    done = subprocess.run(
        [str(python), "-m", "pip", "install", "-q", *PINS], capture_output=True, text=True
    )
    if done.returncode != 0:
        raise LocalStackUnavailable(f"installing LocalStack failed: {done.stderr[-2000:]}")
    marker.write_text(wanted)
    return python


def endpoint(port: int = DEFAULT_PORT) -> str:
    return f"http://127.0.0.1:{port}"


def healthy(port: int = DEFAULT_PORT) -> bool:
    try:
        with urllib.request.urlopen(f"{endpoint(port)}/_localstack/health", timeout=2) as r:
            services = json.loads(r.read()).get("services", {})
    except (OSError, ValueError):
        return False
    return services.get("s3") in ("available", "running")


def start(port: int = DEFAULT_PORT, timeout: float = 120.0) -> bool:
    """Start LocalStack S3 unless it already answers; True if this call started it. Safe to
    call from several processes at once (parallel test workers): one starts it, the others wait
    for it and return False."""
    if healthy(port):
        return False
    RUN_DIR.mkdir(exist_ok=True)
    with (RUN_DIR / "start.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if healthy(port):
            return False
        return _start_locked(port, timeout)


def _start_locked(port: int, timeout: float) -> bool:
    python = setup()
    env = {
        **os.environ,
        "SERVICES": "s3",
        "GATEWAY_LISTEN": f"127.0.0.1:{port}",
        # Nothing to reach outside this machine: no DNS server, no certificate download.
        "DNS_ADDRESS": "0",
        "SKIP_SSL_CERT_DOWNLOAD": "1",
        "DISABLE_EVENTS": "1",
    }
    with LOGFILE.open("ab") as log:
        proc = subprocess.Popen(
            [str(python), "-m", "localstack.runtime.main"],
            cwd=RUN_DIR,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    PIDFILE.write_text(str(proc.pid))
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise LocalStackUnavailable(f"LocalStack exited ({proc.returncode}); see {LOGFILE}")
        if healthy(port):
            return True
        time.sleep(0.5)
    stop()
    raise LocalStackUnavailable(f"LocalStack did not answer within {timeout:.0f} s; see {LOGFILE}")


def stop() -> None:
    try:
        pid = int(PIDFILE.read_text())
    except (FileNotFoundError, ValueError):
        return
    try:
        os.killpg(pid, signal.SIGTERM)
        for _ in range(100):
            os.kill(pid, 0)
            time.sleep(0.1)
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    PIDFILE.unlink(missing_ok=True)


def main() -> None:
    command = sys.argv[1] if len(sys.argv) > 1 else "status"
    try:
        if command == "setup":
            print(setup())
        elif command == "start":
            start()
            print(f"LocalStack S3 at {endpoint()}")
        elif command == "stop":
            stop()
        elif command == "status":
            print("running" if healthy() else "not running")
        else:
            raise SystemExit(f"usage: {sys.argv[0]} setup|start|stop|status")
    except LocalStackUnavailable as e:
        raise SystemExit(f"error: {e}") from None


if __name__ == "__main__":
    main()
