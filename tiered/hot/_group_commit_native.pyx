# cython: language_level=3, boundscheck=False, wraparound=False
"""The native twin of group commit's batch bookkeeping (``tiered.hot.group_commit``).

The pure-Python ``PythonBatchGate`` there is the reference; ``NativeBatchGate`` has the same
methods and the same numbering, but its writers sleep on a pthread condition variable with the
GIL released, and the flusher wakes a whole batch with one ``pthread_cond_broadcast`` made
without the GIL. A Python ``threading.Condition`` costs, per writer and per batch, a lock
allocated for the wait, a deque entry, one ``release`` in ``notify_all`` made holding the GIL,
and a second lock (the condition's) that every woken writer takes again in turn: on two busy
cores that churn, not the fsync, bounded single SYNC sends (decision 420).
"""

from libc.errno cimport ETIMEDOUT
from libc.stdint cimport int64_t

cdef extern from "<time.h>" nogil:
    ctypedef long time_t
    cdef struct timespec:
        time_t tv_sec
        long tv_nsec
    int CLOCK_MONOTONIC
    int clock_gettime(int clock, timespec* ts)

cdef extern from "<pthread.h>" nogil:
    ctypedef struct pthread_mutex_t:
        pass
    ctypedef struct pthread_cond_t:
        pass
    ctypedef struct pthread_condattr_t:
        pass
    int pthread_mutex_init(pthread_mutex_t* m, void* attr)
    int pthread_mutex_destroy(pthread_mutex_t* m)
    int pthread_mutex_lock(pthread_mutex_t* m)
    int pthread_mutex_unlock(pthread_mutex_t* m)
    int pthread_condattr_init(pthread_condattr_t* a)
    int pthread_condattr_setclock(pthread_condattr_t* a, int clock)
    int pthread_condattr_destroy(pthread_condattr_t* a)
    int pthread_cond_init(pthread_cond_t* c, pthread_condattr_t* a)
    int pthread_cond_destroy(pthread_cond_t* c)
    int pthread_cond_wait(pthread_cond_t* c, pthread_mutex_t* m)
    int pthread_cond_timedwait(pthread_cond_t* c, pthread_mutex_t* m, const timespec* t)
    int pthread_cond_signal(pthread_cond_t* c)
    int pthread_cond_broadcast(pthread_cond_t* c)

name = "native"


cdef class NativeBatchGate:
    """Numbered batches of writers waiting for one fsync each (see ``PythonBatchGate``)."""

    cdef pthread_mutex_t _mutex
    cdef pthread_cond_t _work  # the flusher waits here for requests
    cdef pthread_cond_t _done[2]  # writers of a batch, by the batch number's parity
    cdef int64_t _open  # the batch requests join now
    cdef int64_t _finished  # every batch up to this one has been fsynced (or failed)
    cdef int64_t _pending  # requests in the open batch
    cdef int64_t _population  # writers the last round served: the flusher waits for as many
    cdef int64_t _want  # > 0 while the flusher waits for that many requests
    cdef bint _idle  # the flusher waits for a first request
    cdef bint _stopping
    cdef bint _closed  # the flusher has ended: writers flush for themselves

    def __cinit__(self):
        cdef pthread_condattr_t attr
        pthread_mutex_init(&self._mutex, NULL)
        pthread_condattr_init(&attr)
        pthread_condattr_setclock(&attr, CLOCK_MONOTONIC)
        pthread_cond_init(&self._work, &attr)
        pthread_cond_init(&self._done[0], NULL)
        pthread_cond_init(&self._done[1], NULL)
        pthread_condattr_destroy(&attr)
        self._open = 1
        self._finished = 0
        self._closed = 1

    def __dealloc__(self):
        pthread_cond_destroy(&self._work)
        pthread_cond_destroy(&self._done[0])
        pthread_cond_destroy(&self._done[1])
        pthread_mutex_destroy(&self._mutex)

    def open(self):
        """A flusher runs from now on: requests queue for it."""
        with nogil:
            pthread_mutex_lock(&self._mutex)
            self._stopping = 0
            self._closed = 0
            self._population = 0
            pthread_mutex_unlock(&self._mutex)

    def stop(self):
        """Ask the flusher to serve what is queued and end (``take`` returns -1 then)."""
        with nogil:
            pthread_mutex_lock(&self._mutex)
            self._stopping = 1
            pthread_cond_signal(&self._work)
            pthread_mutex_unlock(&self._mutex)

    def join_and_wait(self):
        """Join the open batch and sleep until it is finished; returns its number, or -1 at
        once when no flusher runs (the caller flushes for itself)."""
        cdef int64_t batch = -1
        with nogil:
            pthread_mutex_lock(&self._mutex)
            if not self._closed:
                batch = self._open
                self._pending += 1
                # Wake the flusher only when it can act: a first request, or the number it is
                # waiting for reached; not once per writer.
                if self._idle or (self._want > 0 and self._pending >= self._want):
                    pthread_cond_signal(&self._work)
                while self._finished < batch:
                    pthread_cond_wait(&self._done[batch & 1], &self._mutex)
            pthread_mutex_unlock(&self._mutex)
        return batch

    def take(self, double max_wait):
        """The flusher closes the open batch: waits for a first request, then up to
        ``max_wait`` seconds for as many as the last round served. Returns ``(number, served)``,
        or -1 when stopping with nothing queued (no request can join after that)."""
        cdef int64_t batch = -1, served = 0
        cdef timespec deadline
        cdef long ns
        with nogil:
            pthread_mutex_lock(&self._mutex)
            while self._pending == 0 and not self._stopping:
                self._idle = 1
                pthread_cond_wait(&self._work, &self._mutex)
                self._idle = 0
            if self._pending == 0:
                self._closed = 1
            else:
                if self._pending < self._population and not self._stopping and max_wait > 0:
                    clock_gettime(CLOCK_MONOTONIC, &deadline)
                    ns = deadline.tv_nsec + <long>(max_wait * 1e9)
                    deadline.tv_sec += ns // 1000000000
                    deadline.tv_nsec = ns % 1000000000
                    self._want = self._population
                    while self._pending < self._want and not self._stopping:
                        if pthread_cond_timedwait(&self._work, &self._mutex, &deadline) == ETIMEDOUT:
                            break
                    self._want = 0
                batch = self._open
                self._open += 1
                served = self._pending
                self._pending = 0
            pthread_mutex_unlock(&self._mutex)
        if batch < 0:
            return -1
        return batch, served

    def finish(self, int64_t batch, int64_t served):
        """Batch ``batch`` is fsynced (or failed): wake its writers, all with one broadcast."""
        with nogil:
            pthread_mutex_lock(&self._mutex)
            self._finished = batch
            self._population = served + self._pending
            pthread_cond_broadcast(&self._done[batch & 1])
            pthread_mutex_unlock(&self._mutex)
