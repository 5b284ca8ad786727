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
producers go away the next round expects only those that came back.

Batches are numbered, as RocketMQ's requests carry the offset they wait for: a writer notes the
number of the open batch and sleeps until the number of the last finished batch reaches it, on a
condition shared by every writer of its batch's parity (only the batch being fsynced and the open
one ever have writers, so a wake-up never reaches the other's). No object is made per batch or
per send (an ``Event`` per batch cost a condition, a lock and a waiter list each time; decision
321).

Invariant: a request joins a batch only after its bytes are appended (its append published
``wrote``), and the batch's fsync starts after the batch is closed, so that fsync covers every
request in it. A writer is woken with success only by an fsync that returned without error.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


class GroupCommitService:
    """Wakes SYNC writers once an fsync covers their bytes; one fsync per batch of writers.

    ``flush`` fsyncs everything appended so far and returns the flushed offset; it raises once
    an fsync has failed (and forever after: see ``DurabilityLostError``). ``flushed`` reads the
    flushed offset without flushing."""

    def __init__(
        self, flush: Callable[[], int], flushed: Callable[[], int], name: str = "tmq-group-commit"
    ) -> None:
        self._flush = flush
        self._flushed = flushed
        self._name = name
        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)  # the flusher waits here for requests
        # Writers wait for their batch on the condition of its parity: only the batch being
        # fsynced and the open one ever have writers, so a wake-up never reaches the other's.
        self._done = (threading.Condition(self._lock), threading.Condition(self._lock))
        self._open = 1  # the number of the batch requests join now
        self._finished = 0  # every batch up to this number has been fsynced (or failed)
        # Batches whose fsync failed: their error, and how many of their writers have yet to
        # read it (the entries go with the last one).
        self._errors: dict[int, BaseException] = {}
        self._unread: dict[int, int] = {}
        self._pending = 0  # requests in the open batch
        self._stopping = False
        self._thread: threading.Thread | None = None
        # Counters for benches and metrics: fsyncs run and the requests they covered.
        self.flushes = 0
        self.requests = 0

    def start(self) -> None:
        with self._lock:
            if self._thread is not None:
                return
            self._stopping = False
            self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
            self._thread.start()

    def stop(self) -> None:
        """Flush what is queued, wake its writers, and end the thread. Later waiters fsync
        for themselves."""
        with self._lock:
            thread, self._thread = self._thread, None
            self._stopping = True
            self._work.notify()
        if thread is not None:
            thread.join()

    def wait_flushed(self, offset: int) -> None:
        """Return once an fsync covers ``offset`` (a writer an earlier fsync covered does not
        wait at all); raise what that fsync raised. The exception object is shared by every
        writer of the batch: callers raise their own, chained to it."""
        with self._lock:
            if self._flushed() >= offset:
                return
            if self._thread is not None:
                batch = self._open
                self._pending += 1
                self._work.notify()
                done = self._done[batch & 1]
                while self._finished < batch:
                    done.wait()
                error = self._errors.get(batch)
                if error is None:
                    return
                self._unread[batch] -= 1
                if not self._unread[batch]:
                    del self._errors[batch], self._unread[batch]
                raise error
        self._flush()  # no flusher (stopped): this writer is the only one left

    def _run(self) -> None:
        population = 0  # writers the last round served: woken plus already queued again
        fsync_s = 0.0
        while True:
            with self._lock:
                while not self._pending and not self._stopping:
                    self._work.wait()
                if not self._pending:
                    return  # stopping, nothing queued
                deadline = time.monotonic() + fsync_s
                while self._pending < population and not self._stopping:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    self._work.wait(left)
                batch = self._open
                self._open += 1
                served = self._pending
                self.requests += served
                self._pending = 0
            # The fsync runs outside the lock: writers keep queueing into the next batch.
            started = time.monotonic()
            error: BaseException | None = None
            try:
                self._flush()
            except BaseException as e:  # whatever it is, never leave a writer waiting
                error = e
            fsync_s = time.monotonic() - started
            self.flushes += 1
            with self._lock:
                if error is not None:
                    self._errors[batch] = error
                    self._unread[batch] = served
                self._finished = batch
                population = served + self._pending
                self._done[batch & 1].notify_all()
