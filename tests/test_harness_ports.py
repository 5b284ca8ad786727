"""The test harness's ports and readiness checks (tests/broker_harness.py): a port is handed to one
child only, and a child counts as started only when it serves its port itself. Both broke a CI run:
a replica-group member was given the port the NameServer had just been given, failed to bind it,
and its start was taken as healthy because the NameServer answered there (decision 440)."""

from __future__ import annotations

import os
import select
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.broker_harness import _RESERVED_MAX, REPO, free_port, listens_on, wait_healthy


def test_a_port_is_handed_out_once_across_test_processes() -> None:
    """free_port never repeats a port it handed out, in this process or in another one running
    at the same time (the other xdist worker): ``bind(0)`` alone repeats a port about once in
    800 calls within the next ten on this kernel."""
    count = min(1000, _RESERVED_MAX)  # none of these is let go while the test runs
    mine = [free_port() for _ in range(count)]
    assert len(set(mine)) == count
    child = subprocess.run(
        [
            sys.executable,
            "-c",
            "from tests.broker_harness import free_port; print(*(free_port() for _ in range(500)))",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert child.returncode == 0, child.stderr
    theirs = {int(p) for p in child.stdout.split()}
    assert len(theirs) == 500
    assert not theirs & set(mine)


def test_a_start_is_not_healthy_on_another_servers_answer(tmp_path: Path) -> None:
    """A second server given a port the first one serves fails to bind it and exits; waiting
    for it raises with its own error, rather than taking the first server's SERVING answer as
    its own (what let a dead member pass for started)."""
    from tests.ha_failover import start_namesrv

    log = tmp_path / "namesrv.log"
    first, address = start_namesrv(tmp_path)
    port = int(address.rsplit(":", 1)[1])
    second: subprocess.Popen[bytes] | None = None
    try:
        wait_healthy(first, address, log, "first")
        assert listens_on(first.pid, port) is True
        second, _ = start_namesrv(tmp_path, port)
        with pytest.raises(RuntimeError, match=r"(?s)second exited with 1: .*already in use"):
            wait_healthy(second, address, log, "second")
        assert second.poll() not in (None, 0)
        assert listens_on(second.pid, port) is False
    finally:
        for proc in (first, second):
            if proc is not None and proc.poll() is None:
                proc.kill()
            if proc is not None:
                proc.wait(30)


def test_listens_on_names_the_process_holding_the_listening_socket() -> None:
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        assert listens_on(os.getpid(), port) is True
        with socket.socket() as unbound:
            unbound.bind(("127.0.0.1", 0))  # bound, not listening
            assert listens_on(os.getpid(), unbound.getsockname()[1]) is False


def test_a_replica_group_wait_that_times_out_shows_each_members_state_and_log(
    tmp_path: Path,
) -> None:
    """The message of a timed-out wait in the HA tests names the last error the condition
    raised, and for each member its process state and the end of its log: the CI run that
    waited 60 s for a member that had exited at start said only "timed out"."""
    from tests.ha_failover import wait_for
    from tests.test_ha import GroupMember

    dead, alive = GroupMember(tmp_path, "dead", free_port()), GroupMember(tmp_path, "alive", 0)
    dead.log_path.write_text("".join(f"line {n}\n" for n in range(100)) + "error: port in use\n")
    dead.proc = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    alive.proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        dead.proc.wait(30)

        def refused() -> bool:
            raise ConnectionRefusedError("nobody on the port")

        with pytest.raises(AssertionError) as timed_out:
            wait_for("the dead one serves", refused, timeout=0.3)
        message = str(timed_out.value)
        assert "nobody on the port" in message
        assert f"dead (gRPC {dead.endpoint}, HA port {dead.ha_port}): exited with 3" in message
        assert "error: port in use" in message and "line 61" in message
        assert "line 60\n" not in message  # the last 40 lines only
        assert f"alive (gRPC {alive.endpoint}, HA port 0): alive (pid {alive.proc.pid})" in message
        assert "(no log:" in message  # alive wrote none
    finally:
        alive.proc.kill()
        alive.proc.wait(30)


_ECHO_CHILD = """
import socket, sys, threading
conn = socket.create_connection(("127.0.0.1", int(sys.argv[1])))
def echo():
    while data := conn.recv(64):
        conn.sendall(data)
threading.Thread(target=echo, daemon=True).start()
for _ in range(4):  # idle threads besides, as a broker has
    threading.Thread(target=threading.Event().wait, daemon=True).start()
threading.Event().wait()
"""


def test_a_stopped_child_answers_nothing_sent_after_sigstop_returns() -> None:
    """A child whose thread echoes what it reads from a socket (as a slave acknowledges the
    bytes its master streams) is stopped with ``sigstop``, then sent a byte: it must not answer
    until SIGCONT. With a bare ``os.kill`` it answered in most tries on this loaded machine:
    the kernel stops the other threads only once the one that takes the signal runs."""
    from tests.broker_harness import sigstop

    with socket.create_server(("127.0.0.1", 0)) as listener:
        child = subprocess.Popen(
            [sys.executable, "-c", _ECHO_CHILD, str(listener.getsockname()[1])]
        )
        try:
            listener.settimeout(60)
            conn, _ = listener.accept()
            with conn:
                conn.settimeout(30)
                for n in range(15):
                    sigstop(child.pid)
                    conn.sendall(bytes([n]))
                    # poll, not select: a process with many descriptors open (a whole test
                    # session's) can hand this socket a number past select's FD_SETSIZE.
                    poller = select.poll()
                    poller.register(conn, select.POLLIN)
                    ready = poller.poll(300)
                    assert not ready, f"try {n}: the stopped child answered"
                    os.kill(child.pid, signal.SIGCONT)
                    assert conn.recv(64) == bytes([n]), "it answers once continued"
        finally:
            child.kill()
            child.wait()


_FAILING_WITH_LOGS = """
import process_logs

SECRET = "NotARealKeyButLongEnough0123456789"


def test_fails(tmp_path):
    log = tmp_path / "broker-x.log"
    log.write_text("".join(f"line {n}\\n" for n in range(300)) + f"raw stderr quoting {SECRET}\\n")
    process_logs.track("broker-x", log, {"AWS_SECRET_ACCESS_KEY": SECRET})
    assert False, "the test's own failure"


def test_passes(tmp_path):
    log = tmp_path / "broker-y.log"
    log.write_text("nothing to see\\n")
    process_logs.track("broker-y", log)
"""


def test_a_failed_tests_report_ends_with_its_servers_log_tails(tmp_path: Path) -> None:
    """Decision 740: the report of a test that failed carries the last 200 lines of each server
    log it tracked, with the secrets of the server's environment scrubbed; a test that passed
    shows none, and the next test does not inherit the previous one's servers."""
    (tmp_path / "test_inner.py").write_text(_FAILING_WITH_LOGS)
    command = ["-m", "pytest", "-p", "conftest", "-p", "no:cacheprovider", "-o", "addopts="]
    done = subprocess.run(
        [sys.executable, *command, "-q", "test_inner.py"],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": f"{REPO / 'tests'}:{REPO}"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    out = done.stdout
    assert done.returncode == 1 and "1 failed, 1 passed" in out, out[-3000:]
    assert "broker-x log, last 200 lines" in out, out[-3000:]
    assert "line 299" in out and "line 100\n" not in out  # the tail, not the whole log
    assert "raw stderr quoting ***" in out
    assert "NotARealKeyButLongEnough0123456789" not in out.replace(
        'SECRET = "NotARealKeyButLongEnough0123456789"', ""
    )
    assert "broker-y" not in out
