"""The master's etcd lease, renewed by a child process that shares no GIL with the broker
(decision 910).

In the broker process a keepalive is an HTTP request through ``urllib``: dozens of points where
its thread gives the GIL up and must win it back. With the broker busy (send handlers, dispatch,
replication: Python threads that want the GIL all the time), each of those waits behind them, and
on a loaded machine behind a GIL holder the kernel has descheduled. Measured (a probe on a 3-node
etcd, a keepalive every 0.5 s): alone, p99 142 ms; with two CPU-bound Python threads in the same
process, p99 0.5-1.9 s and gaps between renewals past the 1.33 s fence deadline.

``LeaseKeeper`` (the broker side) starts ``python -m broker.ha.lease_keeper``, which imports
nothing but the stdlib and broker/ha/etcd.py. They share 128 bytes of anonymous memory (an
unlinked file, its descriptor inherited), each half written by one side under a sequence lock:

- the broker's half: the lease to renew (0: none) and a pulse, the broker's ``time.monotonic()``
  written by its lease watchdog every 50 ms;
- the keeper's half: the last lease it renewed, the ``time.monotonic()`` at which that keepalive
  was sent (CLOCK_MONOTONIC is one clock for every process on the host), and the last lease etcd
  said was gone.

The keeper renews only while the pulse is fresh (``pulse_limit_s``): a broker that is frozen
(SIGSTOP), deadlocked or starved for that long loses its lease as if it renewed it itself, so the
group elects another. It reads its stdin, a pipe from the broker: end of file means the broker
died (kill -9 included), and it revokes the lease at once and exits, so a crashed master is
replaced without waiting for its TTL. Fencing is unchanged: the broker, not the keeper, decides
whether it may acknowledge, from the time the last successful keepalive was sent.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import mmap
import os
import select
import struct
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass

from broker.ha.etcd import EtcdClient, EtcdUnavailableError

SIZE = 128
# Broker half: seq (even when stable), lease, pulse.
_BROKER = struct.Struct("<Qqd")
_BROKER_AT = 0
# Keeper half: seq, renewed lease, when its keepalive was sent, lease etcd said was gone,
# renewals, renewals skipped because the pulse was stale, the last and the longest keepalive.
_KEEPER = struct.Struct("<Qqdqqqdd")
_KEEPER_AT = 64
# Keepalives at once (each on its own thread) while etcd is slow to answer: one TTL's worth at
# the controller's interval (TTL/8), so that one answer waited for up to the timeout does not
# hold the next sends back (decision 990).
_MAX_IN_FLIGHT = 8
# How long a read of a half waits for a writer that is between its two count updates. A writer
# holds it for microseconds, or for as long as the kernel deschedules it mid-write on a loaded
# machine; a writer killed mid-write never finishes, and the read then gives up (decision 991).
_READ_LIMIT_S = 0.2


def keeper_timeout(ttl_s: int) -> float:
    """Seconds each keepalive waits for one etcd endpoint: never less than the broker's own
    client (2 s), and three quarters of the TTL for longer leases. A keepalive answered late
    still counts from the time it was sent (renewals overlap), so waiting costs nothing, while
    giving up after 1 s (as before decision 990) threw away every answer of an etcd that, at
    load 55, took up to 3.2 s: a keeper that never renewed."""
    return max(2.0, ttl_s * 3 / 4)


def _write(buf: mmap.mmap, at: int, layout: struct.Struct, *values: float) -> None:
    """A sequence lock: odd while the half is being written; readers retry. One writer at a
    time per half (the caller's lock)."""
    (seq,) = struct.unpack_from("<Q", buf, at)
    struct.pack_into("<Q", buf, at, seq + 1)
    struct.pack_into(layout.format, buf, at, seq + 1, *values)
    struct.pack_into("<Q", buf, at, seq + 2)


def _read(
    buf: mmap.mmap, at: int, layout: struct.Struct, limit_s: float = _READ_LIMIT_S
) -> tuple[float, ...] | None:
    """The half's values, or None when no stable copy came within ``limit_s`` (its writer is
    descheduled mid-write, or died there and left the count odd for good)."""
    deadline = time.monotonic() + limit_s
    tries = 0
    while True:
        values = layout.unpack_from(buf, at)
        (seq,) = struct.unpack_from("<Q", buf, at)
        if values[0] % 2 == 0 and seq == values[0]:
            return tuple(values[1:])
        tries += 1
        if time.monotonic() >= deadline:
            return None
        time.sleep(0 if tries < 100 else 0.001)


def _reset(buf: mmap.mmap, at: int, layout: struct.Struct) -> None:
    """Zero a half, its count included: only while its writer is known dead (decision 991)."""
    buf[at : at + layout.size] = bytes(layout.size)


@dataclass(slots=True, frozen=True)
class KeeperState:
    # The lease last renewed, and when (time.monotonic()) that keepalive was sent.
    lease: int
    sent_at: float
    # The last lease etcd said was gone.
    gone: int
    renewals: int
    # Renewals skipped because the broker's pulse was stale.
    skipped: int
    last_latency_s: float
    max_latency_s: float


def _shared_file() -> int:
    """A descriptor of SIZE bytes of memory to share with the keeper: an unlinked file in
    /dev/shm, or in the temporary directory when /dev/shm has no room. Its pages are allocated
    here: a file only truncated to SIZE on a full tmpfs mapped fine, and the first store into
    it killed the broker with SIGBUS, no line logged (decision 1005)."""
    dirs = ["/dev/shm"] if os.path.isdir("/dev/shm") else []
    errors = []
    for directory in [*dirs, None]:
        fd = -1
        try:
            fd, path = tempfile.mkstemp(prefix="tmq-lease-", dir=directory)
            os.unlink(path)
            os.ftruncate(fd, SIZE)
            os.posix_fallocate(fd, 0, SIZE)
        except OSError as e:
            if fd >= 0:
                os.close(fd)
            if e.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
            errors.append(f"{directory or tempfile.gettempdir()}: {e.strerror}")
            continue
        return fd
    raise OSError(
        errno.ENOSPC,
        "no room for the lease keeper's shared memory (" + "; ".join(errors) + ")",
    )


class LeaseKeeper:
    """The broker's handle on its keeper process."""

    def __init__(
        self,
        endpoints: list[str],
        ttl_s: int,
        interval_s: float,
        pulse_limit_s: float,
        timeout_s: float | None = None,
    ) -> None:
        self.endpoints = endpoints
        self.ttl_s = ttl_s
        self.interval_s = interval_s
        self.pulse_limit_s = pulse_limit_s
        self.timeout_s = keeper_timeout(ttl_s) if timeout_s is None else timeout_s
        self._fd = _shared_file()
        fd = self._fd
        self._buf = mmap.mmap(fd, SIZE)
        self._lease = 0
        # The controller's tick (set_lease) and the watchdog (pulse) both write the broker's
        # half: the sequence lock has one writer at a time, or two interleaved writes can leave
        # its count odd for good and the keeper waits on it forever (seen in CI: a member never
        # elected).
        self._write_lock = threading.Lock()
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0
        # When the running keeper was started (time.monotonic()).
        self.started_at = 0.0
        # The last stable read of the keeper's half: what renewed() says while a read gives up.
        self._last = KeeperState(0, 0.0, 0, 0, 0, 0.0, 0.0)

    def ensure_running(self) -> None:
        """Start the keeper, or start it again if it died (its renewals stop meanwhile, and the
        broker's deadline fences it if that lasts)."""
        if self.proc is not None and self.proc.poll() is None:
            return
        self._reap()
        if self._fd < 0:
            raise RuntimeError("the lease keeper was stopped: make a new one")
        # The keeper's half starts blank: a keeper killed mid-write left its count odd, and every
        # later write keeps that parity, so no renewal of the next keeper could ever be read
        # (decision 991). Its writer is dead, so nobody writes it meanwhile.
        _reset(self._buf, _KEEPER_AT, _KEEPER)
        self._last = KeeperState(0, 0.0, 0, 0, 0, 0.0, 0.0)
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "broker.ha.lease_keeper",
                "--fd",
                str(self._fd),
                "--interval",
                str(self.interval_s),
                "--pulse-limit",
                str(self.pulse_limit_s),
                "--timeout",
                str(self.timeout_s),
                *self.endpoints,
            ],
            stdin=subprocess.PIPE,
            pass_fds=(self._fd,),
            close_fds=True,
        )
        self.starts += 1
        self.started_at = time.monotonic()

    def restart(self) -> None:
        """Kill the keeper (alive but not renewing: hung in a call, stopped) and start another.
        Killed, it does not revoke: the broker still holds, and renews, its lease."""
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()
        # Waited for: a SIGKILL is not instant, and ``ensure_running`` leaves a keeper it still
        # sees running alone (half the restarts then waited for the next tick; decision 1061).
        self._reap()
        self.ensure_running()

    def _reap(self) -> None:
        proc = self.proc
        if proc is not None:
            proc.wait()
            if proc.stdin is not None:
                with contextlib.suppress(OSError):
                    proc.stdin.close()
        self.proc = None

    @property
    def lease(self) -> int:
        """The lease the broker's half names."""
        return self._lease

    def set_lease(self, lease: int) -> None:
        with self._write_lock:
            self._lease = lease
            if not self._buf.closed:
                _write(self._buf, _BROKER_AT, _BROKER, lease, time.monotonic())

    def pulse(self) -> None:
        # The watchdog may outlive the controller's join of it and pulse after stop().
        with self._write_lock:
            if not self._buf.closed:
                _write(self._buf, _BROKER_AT, _BROKER, self._lease, time.monotonic())

    def renewed(self) -> KeeperState:
        """The keeper's half; the last stable copy if none comes within the read's bound (a
        keeper that died mid-write: no renewal since, which is the truth)."""
        try:
            values = _read(self._buf, _KEEPER_AT, _KEEPER)
        except ValueError:  # stop() closed the mapping (the watchdog outlived its join)
            return self._last
        if values is not None:
            lease, at, gone, count, stale, last, longest = values
            self._last = KeeperState(
                int(lease), at, int(gone), int(count), int(stale), last, longest
            )
        return self._last

    def stop(self) -> None:
        """Stop the keeper without revoking (the broker revokes, or hands over, itself), and
        give back the shared memory: its descriptor and the mapping (with its own duplicate of
        the descriptor). A controller makes a new ``LeaseKeeper`` on every start, so a broker
        whose HA role restarts leaked a descriptor each time (decision 1090). Idempotent;
        after it, writes are dropped and ``renewed`` answers the last state read."""
        self.set_lease(0)
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()
        self._reap()
        with self._write_lock:
            if not self._buf.closed:
                self._buf.close()
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1


class _Renewals:
    """The keeper's half, shared by its renewal threads."""

    def __init__(self, buf: mmap.mmap) -> None:
        self.buf = buf
        self.lock = threading.Lock()
        self.renewed = self.gone = self.count = self.stale = 0
        self.renewed_at = 0.0
        self.last_latency = self.max_latency = 0.0
        self.in_flight = 0

    def publish(self) -> None:
        _write(
            self.buf,
            _KEEPER_AT,
            _KEEPER,
            self.renewed,
            self.renewed_at,
            self.gone,
            self.count,
            self.stale,
            self.last_latency,
            self.max_latency,
        )

    def renew(self, client: EtcdClient, lease: int, started: float) -> None:
        try:
            ttl: int | None = client.keepalive(lease)
        except EtcdUnavailableError:
            ttl = None
        except Exception:  # e.g. http.client.IncompleteRead, which is not an OSError
            # A renewal thread that died here would keep its in-flight slot for good, and four
            # such deaths would end every renewal: count it as no answer instead.
            ttl = None
        latency = time.monotonic() - started
        with self.lock:
            self.in_flight -= 1
            self.last_latency = latency
            self.max_latency = max(self.max_latency, latency)
            if ttl is not None and ttl > 0:
                # Renewals overlap: the newest send that succeeded is what the deadline counts.
                if lease != self.renewed or started > self.renewed_at:
                    self.renewed, self.renewed_at = lease, started
                self.count += 1
            elif ttl is not None:
                self.gone = lease
            self.publish()


def _run(
    fd: int, endpoints: list[str], interval: float, pulse_limit: float, timeout: float
) -> None:
    buf = mmap.mmap(fd, SIZE)
    os.close(fd)
    client = EtcdClient(endpoints, timeout=timeout)
    state = _Renewals(buf)
    parent = os.getppid()
    stdin = sys.stdin.buffer.fileno()
    # The broker's half as last read whole: a broker killed mid-write leaves it unreadable, and
    # its death must still revoke the lease it named (decision 991).
    lease, pulse = 0, 0.0
    while True:
        ready, _, _ = select.select([stdin], [], [], interval)
        broker = _read(buf, _BROKER_AT, _BROKER)
        if broker is not None:
            lease, pulse = int(broker[0]), broker[1]
        if (ready and not os.read(stdin, 4096)) or os.getppid() != parent:
            # The broker died: nothing can be acknowledged under its lease any more (the last
            # one it named, even if this loop never got to renew it).
            if lease:
                with contextlib.suppress(EtcdUnavailableError):
                    client.revoke(lease)
            return
        if not lease:
            continue
        with state.lock:
            if time.monotonic() - pulse > pulse_limit:
                state.stale += 1
                state.publish()
                continue
            if state.in_flight >= _MAX_IN_FLIGHT:
                continue
            state.in_flight += 1
        # A keepalive of its own every interval, not after the last one answered: one slow
        # answer (etcd busy, a connect that waits) does not hold the next renewal back.
        threading.Thread(
            target=state.renew, args=(client, lease, time.monotonic()), daemon=True
        ).start()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--fd", type=int, required=True)
    parser.add_argument("--interval", type=float, required=True)
    parser.add_argument("--pulse-limit", type=float, required=True)
    parser.add_argument("--timeout", type=float, required=True)
    parser.add_argument("endpoints", nargs="+")
    args = parser.parse_args()
    with contextlib.suppress(KeyboardInterrupt):
        _run(args.fd, args.endpoints, args.interval, args.pulse_limit, args.timeout)


if __name__ == "__main__":
    main()
