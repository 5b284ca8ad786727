"""The cold worker: a child process that does the cold tier's heavy work off the broker's GIL.

Building and uploading segment objects, and fetching and checking the spans of records a cold
read returns, are per-record Python loops and object-store I/O. In the broker's process they
share one interpreter lock with every append; a heavy replay or a large upload made produce
latency jump. ``ColdWorker`` runs them in one child process (``multiprocessing`` with the
``spawn`` start method: no forked copy of the broker's threads and locks) with its own object
store, fed through a pipe:

- a job is a module-level function ``fn(tier, *args)`` and its arguments, pickled by reference;
  the child runs up to ``threads`` of them at once and sends back the result or the exception;
- at most ``max_inflight`` jobs are outstanding. ``submit(block=True)`` waits for room (the
  offloader's back-pressure: its own thread waits, never an append); ``block=False`` refuses
  with ``WorkerBusyError`` (a cold read answers "busy" rather than queue without bound);
- a child that dies (kill -9, out of memory) fails every job it held with
  ``WorkerCrashedError`` and is restarted at once. Its jobs are safe to run again: every job
  is idempotent (a segment upload reuses its key and ``put_if_absent``; a read is a read), so
  the caller resubmits them;
- the broker's hot path never calls ``submit``; nothing here holds the interpreter lock while
  it waits for the child.

The child exits when the pipe closes (the broker stopped or died): it never outlives its
parent's work.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import importlib
import itertools
import logging
import multiprocessing
import multiprocessing.connection
import os
import pickle
import signal
import socket
import struct
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Protocol, TypeVar

from tiered.cold.storage import ObjectStore, RetryPolicy, StorageError, open_store

log = logging.getLogger(__name__)

T = TypeVar("T")

# A job: a module-level function of the child's object store and picklable arguments.
Job = Callable[..., T]


class WorkerCrashedError(StorageError):
    """The cold worker died while it held the job; it has been restarted. The job is idempotent:
    submit it again."""


class WorkerBusyError(StorageError):
    """``max_inflight`` jobs are already outstanding (``submit(block=False)``)."""


class _RemoteError(Exception):
    """An exception of the child that could not be pickled, as its type name and message."""


def _portable(e: BaseException) -> BaseException:
    """``e`` if the parent can unpickle it, else its type and message as ``_RemoteError``: a
    reply the parent cannot read would leave its job waiting forever."""
    try:
        pickle.loads(pickle.dumps(e))
        return e
    except Exception:
        return _RemoteError(f"{type(e).__name__}: {e}")


def warm_up(tier: ObjectStore) -> None:
    """A HEAD of a key nobody writes: sets up the object store's session and connections. The
    child runs it first; a bench submits it too, to time the worker's jobs and not its start."""
    try:
        tier.size(".tmq-cold-worker-warm-up")
    except Exception as e:  # an outage now is met again by the first real job
        log.info("cold worker: the object store did not answer yet: %s", e)


# glibc's ``mallopt`` parameters (malloc.h) and the cold worker's values (decision 840).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# Below this a buffer comes from the heap, not a fresh ``mmap`` of its own: a read-ahead run
# (its GET, its replies, the writer's room: 4-6 MiB each) is. glibc's largest allowed value.
WORKER_MMAP_THRESHOLD = 32 << 20
# Free heap memory the worker keeps rather than hands back to the kernel.
WORKER_TRIM_THRESHOLD = 256 << 20


def _keep_freed_memory() -> bool:
    """Keep the child's freed run buffers mapped, for the next run to reuse (decision 840).

    Every read-ahead run allocates three buffers of 4-6 MiB and frees them once its reply is
    sent. With glibc's defaults each is a fresh ``mmap`` or is trimmed from its thread's heap on
    ``free``, so the next run touches new pages: about 1,500 page faults a run, which cost the
    reply writer a third of its CPU in a replay. With these thresholds the runs reuse the heap
    the previous ones freed. Buffers past 32 MiB (a segment build's) are still mapped and
    unmapped on their own, and the kept memory is bounded by the jobs' peak (a few runs per
    job thread). False where the C library has no ``mallopt`` (not glibc): nothing changes."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    return bool(
        mallopt(_M_MMAP_THRESHOLD, WORKER_MMAP_THRESHOLD)
        and mallopt(_M_TRIM_THRESHOLD, WORKER_TRIM_THRESHOLD)
    )


def _lower_priority(steps: int) -> None:
    """Lower the calling thread's CPU priority by ``steps`` of nice (a cold-read thread's start)."""
    if steps:
        with contextlib.suppress(OSError):
            os.nice(steps)


def _preload(modules: Sequence[str]) -> None:
    """Import the modules the jobs to come are defined in (and what they import): the first
    job's unpickling would import them otherwise, in the loop that receives every job."""
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception as e:  # the first job that needs it meets the same error, named
            log.warning("cold worker: %s could not be imported: %s", name, e)


def _child_main(
    conn: multiprocessing.connection.Connection,
    tier_url: str,
    tier_options: dict[str, Any],
    retry: RetryPolicy,
    threads: int,
    nice: int = 0,
    preload: Sequence[str] = (),
    read_nice: int = 0,
    read_hedge_s: float = 0.0,
) -> None:
    """The child: receive jobs, run them on ``threads`` threads, send back each outcome, at
    ``nice`` steps below the broker's CPU priority; cold reads on ``threads`` threads of their
    own at ``read_nice`` steps below it (decision 841), run again on the other threads when
    not answered within ``read_hedge_s`` (decision 950). ``preload``: modules imported at the
    start, beside the warm-up (decision 631)."""
    # Before any thread starts: on Linux a thread's priority is its own, inherited by the
    # threads it creates, so every job thread runs at this priority (decision 480).
    if nice:
        with contextlib.suppress(OSError):
            os.nice(nice)
    _keep_freed_memory()
    # Ctrl-C and a SIGTERM to the broker's process group are the broker's to act on: it closes
    # the pipe, and the child ends on that (also when the broker is killed outright).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s tmq-cold-worker %(message)s")
    tier = open_store(tier_url, tier_options, retry)
    pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="tmq-cold-worker")
    # A thread's nice value is its own (Linux): these threads lower theirs further at their
    # start. Lowering one's priority needs no privilege.
    reads = ThreadPoolExecutor(
        max_workers=threads,
        thread_name_prefix="tmq-cold-reader",
        initializer=_lower_priority,
        initargs=(max(0, read_nice - nice),),
    )
    # The object store's first call sets up its session and connections (seconds with s3fs):
    # made now, with a HEAD of a key nobody writes, rather than by the first upload.
    pool.submit(warm_up, tier)
    # Here, before the first job is received: a job sent meanwhile waits in the pipe (its
    # unpickling would have imported the same modules), and one received after this finds
    # them loaded.
    _preload(preload)
    send_lock = threading.Lock()
    # Reads run again (``_Hedges``) on threads of their own at the worker's nice (threads take
    # the nice of the thread that starts them: here, the hedging thread's), never queued
    # behind an upload.
    hedge_pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="tmq-cold-hedge")
    hedges = _Hedges(hedge_pool, read_hedge_s)

    def run(job_id: int, fn: Job[Any], args: tuple[Any, ...]) -> None:
        if not hedges.start(job_id):
            return  # a read whose other copy answered already
        try:
            reply: tuple[int, bool, Any] = (job_id, True, fn(tier, *args))
        except BaseException as e:  # every failure goes back to the caller, named
            reply = (job_id, False, _portable(e))
        if not hedges.finish(job_id):
            return  # the other copy of this read answered first
        buffers: list[pickle.PickleBuffer] = []
        try:
            payload = pickle.dumps(reply, protocol=5, buffer_callback=buffers.append)
        except Exception as e:  # a result that cannot travel fails its job, named
            buffers = []
            payload = pickle.dumps((job_id, False, _portable(e)), protocol=5)
        with send_lock, contextlib.suppress(OSError):  # OSError: the parent is gone
            conn.send_bytes(_COUNT.pack(len(buffers)) + payload)
            for buffer in buffers:
                conn.send_bytes(buffer.raw())

    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            break
        if message is None:
            break
        job_id, fn, args, read = message
        if read:
            hedges.watch(job_id, run, fn, args)
        (reads if read else pool).submit(run, job_id, fn, args)
    hedges.close()
    hedge_pool.shutdown(wait=False, cancel_futures=True)
    pool.shutdown(wait=False, cancel_futures=True)
    reads.shutdown(wait=False, cancel_futures=True)


class _Read:
    """A cold read the child received (``_Hedges``): when its copy is due, its job, and how
    many of its copies are queued or running."""

    __slots__ = ("answered", "args", "copies", "due", "fn", "hedged", "run")

    def __init__(
        self, due: float, run: Callable[..., None], fn: Job[Any], args: tuple[Any, ...]
    ) -> None:
        self.due = due
        self.run = run
        self.fn = fn
        self.args = args
        self.copies = 1
        self.answered = False
        self.hedged = False


class _Hedges:
    """Cold reads that the nice-19 read threads have not answered within ``after_s`` run again
    on the worker's other threads, at its own nice (decision 950): the read threads' minimum
    share of a core. While produce keeps both cores busy, a nice-19 thread gets about 1.5 % of
    one, and a 4 MiB run's few milliseconds of CPU took 2.7 s there, past a cold read's
    deadline (2.5 s); a read is idempotent, so the copy that answers first is sent and the other
    is dropped (a copy that has not started yet does not run). Below ``after_s`` nothing is
    repeated: a replay on a machine whose cores are not saturated stays at nice 19, as the
    producers' p99 needs (decision 841). ``after_s`` 0 or less: no hedging."""

    def __init__(self, pool: ThreadPoolExecutor, after_s: float) -> None:
        self.pool = pool
        self.after_s = after_s
        self.hedged = 0  # reads run again (for tests and logs)
        # Reads not answered yet, or with a copy still queued or running.
        self._reads: dict[int, _Read] = {}
        self._cond = threading.Condition()
        self._closed = False
        self._thread: threading.Thread | None = None
        if after_s > 0:
            # Started by the child's main thread, before any read thread: at the worker's nice.
            self._thread = threading.Thread(
                target=self._loop, name="tmq-cold-read-hedges", daemon=True
            )
            self._thread.start()

    def watch(
        self, job_id: int, run: Callable[..., None], fn: Job[Any], args: tuple[Any, ...]
    ) -> None:
        """``job_id`` is a read submitted to the read threads now."""
        if self._thread is None:
            return
        with self._cond:
            self._reads[job_id] = _Read(time.monotonic() + self.after_s, run, fn, args)
            self._cond.notify()

    def start(self, job_id: int) -> bool:
        """A copy of ``job_id`` is about to run: False if the job was answered already (the
        copy is dropped)."""
        with self._cond:
            read = self._reads.get(job_id)
            if read is None or not read.answered:
                return True
            self._done(job_id, read)
            return False

    def finish(self, job_id: int) -> bool:
        """A copy of ``job_id`` has its outcome: True if it is the first (it sends it)."""
        with self._cond:
            read = self._reads.get(job_id)
            if read is None:
                return True
            first = not read.answered
            read.answered = True
            self._done(job_id, read)
            return first

    def _done(self, job_id: int, read: _Read) -> None:
        """One copy of ``read`` ran or was dropped (under ``_cond``)."""
        read.copies -= 1
        if read.copies <= 0:
            del self._reads[job_id]

    def _loop(self) -> None:
        with self._cond:
            while not self._closed:
                now = time.monotonic()
                for job_id, read in self._reads.items():
                    if read.answered or read.hedged or read.due > now:
                        continue
                    read.hedged = True
                    read.copies += 1
                    self.hedged += 1
                    try:
                        self.pool.submit(read.run, job_id, read.fn, read.args)
                    except RuntimeError:  # the pool is shut down: the child is ending
                        return
                waiting = [r.due for r in self._reads.values() if not (r.hedged or r.answered)]
                self._cond.wait(max(0.01, min(waiting, default=now + 1.0) - now))

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()


class ColdWorker:
    """One supervised child process that runs the cold tier's jobs (see the module's text).

    Lifecycle: ``start()`` spawns it (and its object store: ``tier_url``, ``tier_options`` and
    ``retry`` are the broker's own, so it sees the same bucket with the same retry policy);
    ``close()`` stops it. ``restarts`` counts the children restarted after a crash.

    ``nice``: how far below the broker's CPU priority the child runs (``WORKER_NICE``). Its
    work is throughput (a replay, an upload) and the broker's is latency (an append waits for
    a core): when the cores are short, the scheduler gives them to the broker first.
    ``read_nice``: how far below it the cold reads run (``READ_NICE``, jobs submitted with
    ``read=True``), on threads of their own: lower still, since a replay is what a producer
    waits behind (decision 841), while uploads keep ``nice``: an offload that stalled behind
    produce would fill the disk.

    ``read_hedge_s``: a read not answered within it runs again at ``nice`` (``READ_HEDGE_S``;
    0: never), so that reads starved by a saturating load still meet their deadline (decision
    950).

    ``preload``: modules the child imports at its start, beside the object store's warm-up:
    those the jobs it will run are defined in, so that the first job does not import them in
    the loop that receives every job (0.3-0.7 s for the offloader's on a loaded machine)."""

    def __init__(
        self,
        tier_url: str,
        tier_options: dict[str, Any] | None = None,
        retry: RetryPolicy | None = None,
        *,
        threads: int = 4,
        max_inflight: int = 16,
        nice: int | None = None,
        preload: Sequence[str] = (),
        read_nice: int | None = None,
        read_hedge_s: float | None = None,
    ) -> None:
        self.tier_url = tier_url
        self.preload = tuple(preload)
        self.nice = WORKER_NICE if nice is None else nice
        self.read_nice = max(self.nice, READ_NICE if read_nice is None else read_nice)
        self.read_hedge_s = READ_HEDGE_S if read_hedge_s is None else read_hedge_s
        self.tier_options = dict(tier_options or {})
        self.retry = retry or RetryPolicy()
        self.threads = threads
        self.max_inflight = max_inflight
        self.restarts = 0
        self._ctx = multiprocessing.get_context("spawn")
        self._room = threading.BoundedSemaphore(max_inflight)
        self._lock = threading.Lock()  # guards the process, the pipe and ``_pending``
        self._send_lock = threading.Lock()
        self._pending: dict[int, Future[Any]] = {}
        self._ids = itertools.count()
        self._process: multiprocessing.process.BaseProcess | None = None
        self._conn: multiprocessing.connection.Connection | None = None
        self._closed = False

    @property
    def pid(self) -> int | None:
        """The child's process id (None before ``start``)."""
        return self._process.pid if self._process is not None else None

    def start(self) -> None:
        with self._lock:
            self._spawn()

    def _spawn(self) -> None:
        """A new child and its pipe, and the thread that reads its replies (under ``_lock``)."""
        parent, child = self._ctx.Pipe(duplex=True)
        for end in (parent, child):
            _widen(end)
        process = self._ctx.Process(
            target=_child_main,
            args=(
                child,
                self.tier_url,
                self.tier_options,
                self.retry,
                self.threads,
                self.nice,
                self.preload,
                self.read_nice,
                self.read_hedge_s,
            ),
            name="tmq-cold-worker",
            daemon=True,
        )
        process.start()
        child.close()
        self._process, self._conn = process, parent
        reader = threading.Thread(
            target=self._read_replies,
            args=(process, parent),
            name=f"tmq-cold-worker-replies-{process.pid}",
            daemon=True,
        )
        reader.start()

    def submit(self, fn: Job[T], *args: Any, block: bool = True, read: bool = False) -> Future[T]:
        """Run ``fn(tier, *args)`` in the child. ``block``: wait for room when ``max_inflight``
        jobs are outstanding; otherwise raise ``WorkerBusyError``. ``read``: a cold read, run on
        the child's read threads, at ``read_nice``."""
        if not self._room.acquire(blocking=block):
            raise WorkerBusyError(f"the cold worker has {self.max_inflight} jobs outstanding")
        future: Future[T] = Future()
        future.add_done_callback(lambda _: self._room.release())
        with self._lock:
            if self._closed or self._conn is None:
                future.set_exception(StorageError("the cold worker is not running"))
                return future
            job_id = next(self._ids)
            self._pending[job_id] = future
            conn = self._conn
        try:
            with self._send_lock:
                conn.send((job_id, fn, args, read))
        except (OSError, ValueError):
            # The child died under us: its reply thread fails the job and restarts it.
            pass
        return future

    def _read_replies(
        self,
        process: multiprocessing.process.BaseProcess,
        conn: multiprocessing.connection.Connection,
    ) -> None:
        sock = socket.socket(fileno=os.dup(conn.fileno()))
        try:
            self._read_replies_from(process, sock)
        finally:
            sock.close()

    def _read_replies_from(
        self, process: multiprocessing.process.BaseProcess, sock: socket.socket
    ) -> None:
        while True:
            try:
                header = _frame(sock)
                (count,) = _COUNT.unpack_from(header)
                buffers = [_frame(sock) for _ in range(count)]
            except (EOFError, OSError):
                break
            try:
                job_id, ok, value = pickle.loads(memoryview(header)[_COUNT.size :], buffers=buffers)
            except Exception:
                # A reply that cannot be read leaves a job nobody can answer: treat it as a
                # crash (every job of this child fails over to its successor).
                log.exception("cold worker (pid %s): unreadable reply; restarting", process.pid)
                process.kill()
                continue
            with self._lock:
                future = self._pending.pop(job_id, None)
            if future is None:
                continue
            if ok:
                future.set_result(value)
            else:
                future.set_exception(value)
        process.join(timeout=5)
        with self._lock:
            if self._process is not process:
                return  # closed, or already replaced
            lost, self._pending = self._pending, {}
            closing = self._closed
            if not closing:
                self.restarts += 1
                log.error(
                    "cold worker (pid %s) died (exit code %s) with %d job(s); restarting it",
                    process.pid,
                    process.exitcode,
                    len(lost),
                )
                self._spawn()
        for future in lost.values():
            future.set_exception(
                WorkerCrashedError(f"the cold worker (pid {process.pid}) died during the job")
            )

    def close(self, timeout: float = 5.0) -> None:
        """Stop the child: jobs not finished are failed. Idempotent."""
        with self._lock:
            self._closed = True
            process, conn = self._process, self._conn
            self._process = self._conn = None
            lost, self._pending = self._pending, {}
        if conn is not None:
            try:
                with self._send_lock:
                    conn.send(None)
            except (OSError, ValueError):
                pass
            conn.close()
        if process is not None:
            process.join(timeout)
            if process.is_alive():
                process.kill()
                process.join(timeout)
        for future in lost.values():
            future.set_exception(StorageError("the cold worker was stopped"))


# How many steps of ``nice`` below the broker the cold worker runs (decision 480). CFS weighs a
# nice-5 task at a third of a nice-0 one: on an idle core the worker runs at full speed, but a
# producing thread that wakes up is given a core before it, and while both want the two cores the
# broker gets three quarters of the time.
WORKER_NICE = 5
# How many steps of nice below the broker the cold reads run, on their own threads (decision
# 841): the lowest. Under EEVDF a nice-19 thread weighs 15 against a producer's 1024, so a
# producer that wakes is given the core at once; alone on a core the read runs at full speed.
# Alternated with nice 5 in 13 pairs (load 12-24): a producer's p99 during a replay 0.42 ms
# against 1.10 (median), the replay's rate the same within the noise.
READ_NICE = 19
# A cold read the read threads have not answered in this long runs again at ``WORKER_NICE``
# (decision 950): their minimum share when produce keeps both cores busy. A fifth of the
# broker's read deadline (2.5 s), so the copy has four fifths of it; far above a 4 MiB run's
# time on a core the read threads can have (tens of ms), so a replay on a machine whose cores
# are not saturated runs no copy.
READ_HEDGE_S = 0.5


# Socket buffers of the pipe (a Unix socket pair): a reply of a 1 MiB span crosses in one or two
# reads instead of sixteen. Each read is a wait for the GIL, up to the switch interval (5 ms)
# while a thread decodes, so small buffers made a replay's fetches ten times slower.
_PIPE_BUFFER = 4 << 20


# A reply is a frame of ``_COUNT`` (how many buffer frames follow) and the pickled reply, then
# its out-of-band buffers (pickle protocol 5: a span's records), each a frame of its own, framed
# as ``Connection.send_bytes`` frames them. The parent reads every frame with one blocking
# ``recv`` that fills a new bytes object with the GIL released, and the span's records become
# that object, uncopied: ``Connection.recv`` would copy a 1 MiB reply twice holding the GIL.
_COUNT = struct.Struct("!I")
_SIZE = struct.Struct("!i")
_LONG_SIZE = struct.Struct("!Q")


def _frame(sock: socket.socket) -> bytes:
    """One ``send_bytes`` frame's payload; ``EOFError`` when the child closed the pipe."""
    (size,) = _SIZE.unpack(_exactly(sock, _SIZE.size))
    if size == -1:
        (size,) = _LONG_SIZE.unpack(_exactly(sock, _LONG_SIZE.size))
    return _exactly(sock, size)


def _exactly(sock: socket.socket, n: int) -> bytes:
    if n == 0:
        return b""
    data = sock.recv(n, socket.MSG_WAITALL)
    if len(data) == n:
        return data
    parts, got = [data], len(data)
    while got < n:  # a signal cut the wait short, or the pipe closed
        if not parts[-1]:
            raise EOFError("the cold worker closed its pipe")
        parts.append(sock.recv(n - got, socket.MSG_WAITALL))
        got += len(parts[-1])
    return b"".join(parts)


def _widen(conn: multiprocessing.connection.Connection) -> None:
    with socket.fromfd(conn.fileno(), socket.AF_UNIX, socket.SOCK_STREAM) as sock:  # a dup
        for option in (socket.SO_SNDBUF, socket.SO_RCVBUF):
            sock.setsockopt(socket.SOL_SOCKET, option, _PIPE_BUFFER)


class LocalRunner:
    """The same ``submit`` as ``ColdWorker``, on threads of this process against ``tier``: for
    tools that run once (``tmq offload`` without a broker) and for stores that exist only in
    this process (the fault-injecting wrapper of tests). Same bound, same back-pressure."""

    def __init__(self, tier: ObjectStore, *, threads: int = 4, max_inflight: int = 16) -> None:
        self.tier = tier
        self.max_inflight = max_inflight
        self._room = threading.BoundedSemaphore(max_inflight)
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="tmq-cold-local")

    def submit(self, fn: Job[T], *args: Any, block: bool = True, read: bool = False) -> Future[T]:
        if not self._room.acquire(blocking=block):
            raise WorkerBusyError(f"{self.max_inflight} cold jobs are outstanding")
        future = self._pool.submit(fn, self.tier, *args)
        future.add_done_callback(lambda _: self._room.release())
        return future

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class JobRunner(Protocol):
    """Where cold jobs run: ``ColdWorker`` (a child process) or ``LocalRunner`` (threads)."""

    def submit(
        self, fn: Job[T], *args: Any, block: bool = True, read: bool = False
    ) -> Future[T]: ...

    def close(self) -> None: ...


def run_job(runner: JobRunner, fn: Job[T], *args: Any, attempts: int = 3, read: bool = False) -> T:
    """Run ``fn(tier, *args)`` and wait for it; a job cut off by a crash of the worker runs
    again on its successor (at most ``attempts`` times in all). ``read``: a cold read (see
    ``ColdWorker.submit``)."""
    for attempt in range(1, attempts + 1):
        try:
            return runner.submit(fn, *args, read=read).result()
        except WorkerCrashedError:
            if attempt == attempts:
                raise
            log.warning("the cold worker crashed under %s; running it again", fn.__name__)
    raise AssertionError("unreachable")
