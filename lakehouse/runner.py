"""Running the continuous export beside a standalone broker (``[lakehouse] enabled = true``).

The export runs as a child process (``tmq lakehouse export --continuous``), never inside the
broker: Spark's JVM and Python workers must not share the broker's GIL or memory, and a crashed
export must not take the broker down. ``ContinuousExport`` starts it, restarts it with backoff
if it dies, and stops it (SIGTERM, then SIGKILL) with the broker. The child needs no state of
its own: its progress is in the Delta tables, so a restart resumes exactly where it stopped.

Secrets in ``tier_options`` (key, secret) reach the child through the standard AWS environment
variables, never its command line.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lakehouse import PROJECT_ROOT
from lakehouse.locations import normalize_url

log = logging.getLogger(__name__)


@dataclass(slots=True)
class LakehouseConfig:
    """The broker config's ``[lakehouse]`` section.

    ```toml
    [lakehouse]
    enabled = true
    lake_root = "./tmq-data/lake"      # or s3://bucket/lake
    topics = []                        # empty: every archived topic
    trigger_seconds = 10
    compact_every_seconds = 300        # compact small files this often (0: never)
    master = "local[2]"
    ```

    Relative paths are resolved against the broker's working directory when the child starts.
    """

    enabled: bool = False
    lake_root: str = "./tmq-data/lake"
    topics: list[str] = field(default_factory=list)
    trigger_seconds: float = 10.0  # the export's default trigger
    compact_every_seconds: float = 300.0
    master: str = "local[2]"
    checkpoint_dir: str | None = None
    # Extra Spark settings for the child (spark-submit's --conf), e.g. driver memory.
    spark_conf: dict[str, str] = field(default_factory=dict)
    # Where the child's output goes (the broker's default: {data_dir}/lakehouse-export.log).
    log_path: str | None = None


def child_env(tier_options: dict[str, Any], base: dict[str, str] | None = None) -> dict[str, str]:
    """The child's environment: the parent's, plus tier options as standard AWS variables."""
    env = dict(os.environ if base is None else base)
    mapping = {
        "endpoint_url": "AWS_ENDPOINT_URL",
        "key": "AWS_ACCESS_KEY_ID",
        "secret": "AWS_SECRET_ACCESS_KEY",
        "token": "AWS_SESSION_TOKEN",
    }
    for option, variable in mapping.items():
        if tier_options.get(option):
            env[variable] = str(tier_options[option])
    region = (tier_options.get("client_kwargs") or {}).get("region_name")
    if region:
        env["AWS_REGION"] = str(region)
    path = env.get("PYTHONPATH", "")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(PROJECT_ROOT), path) if p)
    return env


def export_command(config: LakehouseConfig, tier_url: str) -> list[str]:
    command = [
        sys.executable,
        "-m",
        "cli.app",
        "lakehouse",
        "export",
        *config.topics,
        "--tier-url",
        normalize_url(tier_url),  # the child runs in the project root, not our directory
        "--lake-root",
        normalize_url(config.lake_root),
        "--continuous",
        "--trigger",
        f"{config.trigger_seconds:g}s",
        "--compact-every",
        f"{int(config.compact_every_seconds * 1000)}ms",
        "--master",
        config.master,
    ]
    if config.checkpoint_dir:
        command += ["--checkpoint", str(Path(config.checkpoint_dir).resolve())]
    for key, value in sorted(config.spark_conf.items()):
        command += ["--conf", f"{key}={value}"]
    return command


class ContinuousExport:
    """The export child process of one broker: ``start()``, ``stop()``, restarted on exit."""

    def __init__(
        self,
        config: LakehouseConfig,
        tier_url: str,
        tier_options: dict[str, Any] | None = None,
        *,
        restart_delay_s: float = 5.0,
        max_restart_delay_s: float = 120.0,
    ) -> None:
        self.config = config
        self.tier_url = tier_url
        self.tier_options = dict(tier_options or {})
        self.restart_delay_s = restart_delay_s
        self.max_restart_delay_s = max_restart_delay_s
        self.restarts = 0
        self._proc: subprocess.Popen[bytes] | None = None
        self._stopping = threading.Event()
        self._monitor: threading.Thread | None = None
        self._lock = threading.Lock()

    @property
    def log_path(self) -> Path:
        if self.config.log_path:
            return Path(self.config.log_path).resolve()
        return (Path("tmq-data") / "lakehouse-export.log").resolve()

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self) -> None:
        """Start the child and a thread that restarts it whenever it exits unasked."""
        with self._lock:
            if self._monitor is not None:
                return
            self._stopping.clear()
            self._spawn()
            self._monitor = threading.Thread(
                target=self._watch, name="lakehouse-export-monitor", daemon=True
            )
            self._monitor.start()

    def _spawn(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as out:
            # Its own session: stop() signals the child and its Spark JVM together.
            self._proc = subprocess.Popen(
                export_command(self.config, self.tier_url),
                stdout=out,
                stderr=subprocess.STDOUT,
                env=child_env(self.tier_options),
                cwd=PROJECT_ROOT,
                start_new_session=True,
            )
        log.info("lakehouse export started (pid %d, log %s)", self._proc.pid, self.log_path)

    def _watch(self) -> None:
        delay = self.restart_delay_s
        while not self._stopping.is_set():
            proc = self._proc
            if proc is None:
                return
            started = time.monotonic()
            code = proc.wait()
            if self._stopping.is_set():
                return
            if time.monotonic() - started > 10 * self.max_restart_delay_s:
                delay = self.restart_delay_s  # it ran for a long while: not a crash loop
            log.warning(
                "lakehouse export exited with code %s; restarting in %.0f s (see %s)",
                code,
                delay,
                self.log_path,
            )
            if self._stopping.wait(delay):
                return
            with self._lock:
                if self._stopping.is_set():
                    return
                self._spawn()
                self.restarts += 1
            delay = min(delay * 2, self.max_restart_delay_s)

    def stop(self, timeout: float = 30.0) -> None:
        """Stop the child: SIGTERM (it finishes the current batch's commit), then SIGKILL."""
        self._stopping.set()
        with self._lock:
            proc = self._proc
        if proc is not None and proc.poll() is None:
            _signal_group(proc, signal.SIGTERM)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                _signal_group(proc, signal.SIGKILL)
                proc.wait()
        if self._monitor is not None:
            self._monitor.join(timeout=5)
            self._monitor = None


def _signal_group(proc: subprocess.Popen[bytes], sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, sig)  # the group we created for this child (start_new_session)
