"""Group commit: concurrent SYNC writers share one fsync (RocketMQ's GroupCommitService).

A writer that has appended its records asks to be woken once they are on disk. Requests queue
up in the open *batch*; one thread, ``tmq-group-commit``, takes the whole batch, fsyncs once and
wakes every writer in it. Requests that arrive during that fsync form the next batch.

Why a thread of its own: with a leader/follower lock held across the fsync, a writer whose
bytes the leader's fsync had already covered still queued on that lock behind the *next* fsync,
and the waiters woke one at a time; 8 threads got about 2 messages per fsync.

Why the flusher may wait before an fsync: producers are closed loops (a client sends its next
message when the last is acknowledged). Starting the next fsync the moment a batch is woken
splits the producers into two alternating halves, one fsyncing while the other comes back,
so 8 producers never share an fsync by more than 4. Before closing a batch the flusher waits
for as many writers as the previous round served (the batch it woke plus those already
queued), but never longer than the last fsync took: waiting longer would cost more than the
second fsync it saves. A lone writer never waits (the round's population is itself), and when
producers go away the next round expects only those that came back. A request wakes the
flusher only when the flusher can act on it (the first request of a batch, or the one that
completes the number it waits for), not once per writer (decision 420).

Batches are numbered, as RocketMQ's requests carry the offset they wait for: a writer notes the
number of the open batch and sleeps until the number of the last finished batch reaches it, on a
condition shared by every writer of its batch's parity (only the batch being fsynced and the open
one ever have writers, so a wake-up never reaches the other's). No object is made per batch or
per send (decision 321). The bookkeeping is a *batch gate* with two implementations of one
interface: ``PythonBatchGate`` (the reference, on ``threading.Condition``) and the native
``NativeBatchGate`` (``tiered/hot/_group_commit_native.pyx``), whose writers sleep with the GIL
released and are woken by one broadcast made without it (decision 420), on a futex word they
leave without taking the gate's mutex again (decision 610). ``TMQ_PURE_PYTHON=1``
picks the reference, as it does for the record engine.

The native gate also runs the flusher's loop itself (``serve``, decision 580): writers join with
the offset their bytes end at, the CommitLog tells it the file appends go to (``track_file``),
and for a batch whose unflushed bytes all lie in that file it runs ``fdatasync``, publishes the
flushed offset, wakes the batch's writers and the dispatcher (``wake_after_flush``), with no
Python and no GIL per fsync. Anything else (a roll left bytes in the previous file, the store
failed, an fsync failed, the stop) comes back here, to ``flush`` and ``fail``.

Invariant: a request joins a batch only after its bytes are appended (its append published
``wrote``), and the batch's fsync starts after the batch is closed, so that fsync covers every
request in it. A writer is woken with success only by an fsync that returned without error.
Every fsync of the CommitLog, native or Python, runs under one flush lock, and none runs once
the store has failed (an error is reported once per open file: a retry would "succeed").
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, Protocol


class Wakeup(Protocol):
    """What the flusher sets after each fsync (``threading.Event``'s shape; ``sets`` counts
    the calls of ``set``)."""

    sets: int

    def set(self) -> None: ...
    def clear(self) -> None: ...
    def is_set(self) -> bool: ...
    def wait(self, timeout: float | None = None) -> bool: ...


class BatchGate(Protocol):
    """The numbered batches of writers of one ``GroupCommitService``, and the flushed offset.

    Writers ``join_and_wait``; the flusher loops ``take`` (close the open batch), fsync,
    ``finish`` (wake its writers). ``stop`` makes ``take`` return -1 once nothing is queued;
    from then on ``join_and_wait`` returns -1 at once, until ``open``."""

    @property
    def flushed(self) -> int: ...
    @property
    def flush_lock(self) -> AbstractContextManager[Any]: ...
    def publish_flushed(self, offset: int) -> None: ...
    def reset_flushed(self, offset: int) -> None: ...
    def mark_failed(self) -> None: ...
    def open(self) -> None: ...
    def stop(self) -> None: ...
    def join_and_wait(self, end: int = 0) -> int: ...
    def take(self, max_wait: float) -> tuple[int, int] | int: ...
    def finish(self, batch: int, served: int) -> None: ...


class PythonBatchGate:
    """The reference batch gate, on ``threading.Condition``s sharing one lock."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)  # the flusher waits here for requests
        # Writers wait for their batch on the condition of its parity.
        self._done = (threading.Condition(self._lock), threading.Condition(self._lock))
        self._open = 1  # the number of the batch requests join now
        self._finished = 0  # every batch up to this number has been fsynced (or failed)
        self._pending = 0  # requests in the open batch
        self._population = 0  # writers the last round served
        self._want = 0  # > 0 while the flusher waits for that many requests
        self._idle = False  # the flusher waits for a first request
        self._stopping = False
        self._closed = True
        self._flushed = 0
        self.flush_lock = threading.Lock()

    @property
    def flushed(self) -> int:
        return self._flushed

    def publish_flushed(self, offset: int) -> None:
        with self._lock:
            self._flushed = max(self._flushed, offset)

    def reset_flushed(self, offset: int) -> None:
        with self._lock:
            self._flushed = offset

    def mark_failed(self) -> None:
        """Nothing to do: the reference flusher always flushes through Python."""

    def open(self) -> None:
        with self._lock:
            self._stopping = self._closed = False
            self._population = 0

    def stop(self) -> None:
        with self._lock:
            self._stopping = True
            self._work.notify()

    def join_and_wait(self, end: int = 0) -> int:
        with self._lock:
            if 0 < end <= self._flushed:
                return 0
            if self._closed:
                return -1
            batch = self._open
            self._pending += 1
            if self._idle or 0 < self._want <= self._pending:
                self._work.notify()
            done = self._done[batch & 1]
            while self._finished < batch:
                done.wait()
            return batch

    def take(self, max_wait: float) -> tuple[int, int] | int:
        with self._lock:
            while not self._pending and not self._stopping:
                self._idle = True
                self._work.wait()
                self._idle = False
            if not self._pending:
                self._closed = True
                return -1
            if self._pending < self._population and not self._stopping and max_wait > 0:
                deadline = time.monotonic() + max_wait
                self._want = self._population
                while self._pending < self._want and not self._stopping:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    self._work.wait(left)
                self._want = 0
            batch = self._open
            self._open += 1
            served, self._pending = self._pending, 0
            return batch, served

    def finish(self, batch: int, served: int) -> None:
        with self._lock:
            self._finished = batch
            self._population = served + self._pending
            self._done[batch & 1].notify_all()


def _native_module() -> Any:
    if os.environ.get("TMQ_PURE_PYTHON", "") not in ("", "0"):
        return None
    try:
        from tiered.hot import _group_commit_native  # type: ignore[attr-defined]
    except ImportError:
        return None
    return _group_commit_native


_NATIVE = _native_module()
GATE_NAME = "native" if _NATIVE is not None else "python"


def new_gate() -> BatchGate:
    """The native batch gate when it is built (and not disabled), else the reference."""
    return _NATIVE.NativeBatchGate() if _NATIVE is not None else PythonBatchGate()


class CountedEvent(threading.Event):
    """The reference wake-up: a ``threading.Event`` that counts its ``set`` calls, as the
    native one does."""

    def __init__(self) -> None:
        super().__init__()
        self.sets = 0

    def set(self) -> None:
        self.sets += 1
        super().set()


def new_put_lock() -> AbstractContextManager[Any]:
    """The CommitLog's put lock: a native mutex the native single send (decision 820) lets go
    of without the GIL, else a ``threading.Lock``."""
    return _NATIVE.NativeFlushLock() if _NATIVE is not None else threading.Lock()


def new_wakeup() -> Wakeup:
    """An event a native flusher sets without the GIL (a ``CountedEvent`` without it)."""
    return _NATIVE.NativeWakeup() if _NATIVE is not None else CountedEvent()


class GroupCommitService:
    """Wakes SYNC writers once an fsync covers their bytes; one fsync per batch of writers.

    ``flush`` fsyncs everything appended so far and returns the flushed offset; it raises once
    an fsync has failed (and forever after: see ``DurabilityLostError``). The gate keeps the
    flushed offset (``flushed``). ``fail`` turns a failed ``fdatasync`` of the native
    flusher into what its writers raise (and fails the store)."""

    def __init__(
        self,
        flush: Callable[[], int],
        name: str = "tmq-group-commit",
        gate: BatchGate | None = None,
        fail: Callable[[OSError], BaseException] | None = None,
    ) -> None:
        self._flush = flush
        self._fail = fail
        self._name = name
        self._gate = gate if gate is not None else new_gate()
        self._lock = threading.Lock()  # start/stop, and the errors below
        # Batches whose fsync failed: their error, and how many of their writers have yet to
        # read it (the entries go with the last one). Written before the batch is finished.
        self._errors: dict[int, BaseException] = {}
        self._unread: dict[int, int] = {}
        self._thread: threading.Thread | None = None
        # Set once per fsync that moved the flushed offset, after its writers are woken: the
        # store's dispatcher under SYNC, once per batch instead of once per send.
        self._wake: Wakeup | None = None
        # Fsyncs run and requests served in Python (the native loop counts its own).
        self._flushes = 0
        self._requests = 0

    @property
    def gate(self) -> BatchGate:
        return self._gate

    @property
    def flushes(self) -> int:
        """Fsyncs run for writers (a counter for benches and metrics)."""
        return self._flushes + getattr(self._gate, "native_flushes", 0)

    @property
    def requests(self) -> int:
        """Writers those fsyncs covered."""
        return self._requests + getattr(self._gate, "native_requests", 0)

    @property
    def fsync_seconds(self) -> float:
        """Time spent in the native flusher's fsyncs (0 with the reference gate)."""
        return float(getattr(self._gate, "native_fsync_seconds", 0.0))

    @property
    def flushed(self) -> int:
        """Every byte below this offset is durable (as far as this service knows)."""
        return self._gate.flushed

    @property
    def flush_lock(self) -> AbstractContextManager[Any]:
        """Held across every fsync of the flushed stream, the native flusher's included."""
        return self._gate.flush_lock

    def publish_flushed(self, offset: int) -> None:
        self._gate.publish_flushed(offset)

    def reset_flushed(self, offset: int) -> None:
        self._gate.reset_flushed(offset)

    def mark_failed(self) -> None:
        """The stream has failed: from now on only ``flush`` (which raises) answers writers."""
        self._gate.mark_failed()

    def track_file(self, fd: int, from_offset: int, size: int) -> None:
        """Appends go to file ``fd`` from ``from_offset`` on: the native flusher may fdatasync
        it alone while every unflushed byte lies there. ``fd`` -1: no such file."""
        track = getattr(self._gate, "track_file", None)
        if track is not None:
            track(fd, from_offset, size)

    def wake_after_flush(self, wake: Wakeup | None) -> None:
        """Set ``wake`` after every fsync that served writers (None: nothing); a native
        wake-up is set by the native flusher without the GIL."""
        self._wake = wake
        native = getattr(self._gate, "wake_after_flush", None)
        if native is not None:
            native(wake if _NATIVE is not None and isinstance(wake, _NATIVE.NativeWakeup) else None)

    def start(self) -> None:
        with self._lock:
            if self._thread is not None:
                return
            self._gate.open()
            self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
            self._thread.start()

    def stop(self) -> None:
        """Flush what is queued, wake its writers, and end the thread. Later waiters fsync
        for themselves."""
        with self._lock:
            thread, self._thread = self._thread, None
            self._gate.stop()
        if thread is not None:
            thread.join()

    def wait_flushed(self, offset: int) -> None:
        """Return once an fsync covers ``offset`` (a writer an earlier fsync covered does not
        wait at all); raise what that fsync raised. The exception object is shared by every
        writer of the batch: callers raise their own, chained to it."""
        self.settle(self._gate.join_and_wait(offset))

    def settle(self, batch: int) -> None:
        """What ``wait_flushed`` does once its writer's wait returned ``batch`` (the gate's
        ``join_and_wait``, or the native send's join, decision 820): flush alone when no
        flusher runs, raise the error of a batch whose fsync failed."""
        if batch == 0:
            return  # covered by a flush that ended while this writer joined
        if batch < 0:
            self._gate.publish_flushed(self._flush())  # no flusher (stopped): the only one left
            self._woken()
            return
        if not self._errors:
            return
        with self._lock:
            error = self._errors.get(batch)
            if error is None:
                return
            self._unread[batch] -= 1
            if not self._unread[batch]:
                del self._errors[batch], self._unread[batch]
        raise error

    def _woken(self) -> None:
        wake = self._wake
        if wake is not None:
            wake.set()

    def _run(self) -> None:
        serve = getattr(self._gate, "serve", None)
        if serve is None:
            self._run_python()
            return
        while True:
            # Returns only for what the native loop leaves to Python: see its docstring.
            code, batch, served, err = serve()
            if code == _NATIVE.SERVE_STOPPED:
                return
            if code == _NATIVE.SERVE_FAILED:
                error = OSError(err, os.strerror(err))
                self._serve_in_python(
                    batch,
                    served,
                    lambda: self._raise(error),  # noqa: B023 (called at once)
                )
            else:
                self._serve_in_python(batch, served, self._flush)

    def _raise(self, error: OSError) -> int:
        raise self._fail(error) if self._fail is not None else error

    def _run_python(self) -> None:
        fsync_s = 0.0
        gate = self._gate
        while True:
            taken = gate.take(fsync_s)
            if isinstance(taken, int):
                return  # stopping, nothing queued
            # Writers keep queueing into the next batch during the fsync.
            started = time.monotonic()
            self._serve_in_python(*taken, self._flush)
            fsync_s = time.monotonic() - started

    def _serve_in_python(self, batch: int, served: int, flush: Callable[[], int]) -> None:
        """Flush for a closed batch and wake its writers."""
        self._requests += served
        try:
            self._gate.publish_flushed(flush())
        except BaseException as e:  # whatever it is, never leave a writer waiting
            with self._lock:
                self._errors[batch] = e
                self._unread[batch] = served
        self._flushes += 1
        self._gate.finish(batch, served)
        self._woken()
