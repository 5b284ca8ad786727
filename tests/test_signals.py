"""A server stops on SIGTERM whichever of its threads the kernel hands the signal to."""

from __future__ import annotations

import ctypes
import os
import signal
from pathlib import Path

from broker_harness import free_port, start_namesrv, wait_healthy

SYS_TGKILL = 234  # x86_64


def test_a_sigterm_delivered_to_a_grpc_thread_stops_the_name_server(tmp_path: Path) -> None:
    port = free_port()
    log = tmp_path / "namesrv.log"
    proc = start_namesrv(port, log)
    try:
        wait_healthy(proc, f"127.0.0.1:{port}", log, "NameServer")
        others = [int(t) for t in os.listdir(f"/proc/{proc.pid}/task") if int(t) != proc.pid]
        assert others, "the server runs no thread besides the main one"
        # What the kernel may do with a process-directed signal: pick a thread that is not
        # the main one. tgkill makes that choice deterministic.
        libc = ctypes.CDLL(None, use_errno=True)
        assert libc.syscall(SYS_TGKILL, proc.pid, others[-1], signal.SIGTERM) == 0
        assert proc.wait(15) == 0, log.read_text()[-2000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
