# cython: language_level=3, boundscheck=False, wraparound=False
"""The native twin of group commit's batch bookkeeping (``tiered.hot.group_commit``).

The pure-Python ``PythonBatchGate`` there is the reference; ``NativeBatchGate`` has the same
methods and the same numbering, but its writers sleep on a futex word with the GIL released,
and the flusher wakes a whole batch with one ``FUTEX_WAKE`` made without the GIL and without
the gate's mutex (decision 610). A Python ``threading.Condition`` costs, per writer and per batch, a lock
allocated for the wait, a deque entry, one ``release`` in ``notify_all`` made holding the GIL,
and a second lock (the condition's) that every woken writer takes again in turn: on two busy
cores that churn, not the fsync, bounded single SYNC sends (decision 420).
"""

from libc.errno cimport EINTR, ETIMEDOUT, errno
from libc.stdint cimport int64_t
from libc.string cimport memcpy, memset
from posix.fcntl cimport F_DUPFD_CLOEXEC, fcntl
from posix.unistd cimport close

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
    int pthread_mutex_trylock(pthread_mutex_t* m)
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

cdef extern from "<unistd.h>" nogil:
    int fdatasync(int fd)

# A batch's writers sleep on a futex word of their own (one per parity of the batch number) and
# check the finished batch number with an atomic load: woken, they return without taking the
# gate's mutex again. ``pthread_cond_wait`` re-takes it, so one broadcast to a batch of N
# writers made them queue on that mutex one after another, each unlock waking the next: about
# a third of the process's futex calls (decision 610).
cdef extern from *:
    """
    #include <limits.h>
    #include <linux/futex.h>
    #include <stdint.h>
    #include <sys/syscall.h>
    #include <unistd.h>

    static inline int64_t tmq_load64(const int64_t *p) {
        return __atomic_load_n(p, __ATOMIC_SEQ_CST);
    }
    static inline void tmq_store64(int64_t *p, int64_t v) {
        __atomic_store_n(p, v, __ATOMIC_SEQ_CST);
    }
    static inline uint32_t tmq_load32(const uint32_t *p) {
        return __atomic_load_n(p, __ATOMIC_SEQ_CST);
    }
    /* Sleep while *word == expected (returns at once if it differs; spurious returns too). */
    static inline void tmq_futex_wait(uint32_t *word, uint32_t expected) {
        syscall(SYS_futex, word, FUTEX_WAIT_PRIVATE, expected, NULL, NULL, 0);
    }
    static inline void tmq_bump32(uint32_t *word) {
        __atomic_add_fetch(word, 1, __ATOMIC_SEQ_CST);
    }
    /* Wake every thread sleeping on the word (after it changed). */
    static inline void tmq_futex_wake_all(uint32_t *word) {
        syscall(SYS_futex, word, FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0);
    }
    """
    int64_t tmq_load64(const int64_t* p) noexcept nogil
    void tmq_store64(int64_t* p, int64_t v) noexcept nogil
    unsigned int tmq_load32(const unsigned int* p) noexcept nogil
    void tmq_futex_wait(unsigned int* word, unsigned int expected) noexcept nogil
    void tmq_bump32(unsigned int* word) noexcept nogil
    void tmq_futex_wake_all(unsigned int* word) noexcept nogil

name = "native"


cdef class NativeWakeup:
    """``threading.Event``'s ``set``/``wait``/``clear``/``is_set`` on a pthread condition: a
    wait sleeps with the GIL released, and a group commit flusher sets it without the GIL.
    ``sets`` counts the calls of ``set`` (the flusher's included)."""

    cdef pthread_mutex_t _mutex
    cdef pthread_cond_t _cond
    cdef bint _flag
    cdef public int64_t sets

    def __cinit__(self):
        cdef pthread_condattr_t attr
        pthread_mutex_init(&self._mutex, NULL)
        pthread_condattr_init(&attr)
        pthread_condattr_setclock(&attr, CLOCK_MONOTONIC)
        pthread_cond_init(&self._cond, &attr)
        pthread_condattr_destroy(&attr)

    def __dealloc__(self):
        pthread_cond_destroy(&self._cond)
        pthread_mutex_destroy(&self._mutex)

    cdef void fire(self) noexcept nogil:
        pthread_mutex_lock(&self._mutex)
        self.sets += 1
        if not self._flag:
            self._flag = 1
            pthread_cond_broadcast(&self._cond)
        pthread_mutex_unlock(&self._mutex)

    def set(self):
        # Holding the GIL: the mutex is only ever held for a few instructions, and releasing
        # the GIL here would let another thread take it (a producer's ``wakeup`` per send).
        self.fire()

    def clear(self):
        self._flag = 0

    def is_set(self):
        return bool(self._flag)

    def wait(self, timeout=None):
        """Sleep until set (or ``timeout`` seconds); returns whether it is set."""
        cdef timespec deadline
        cdef long ns
        cdef bint forever = timeout is None
        cdef double seconds = 0 if forever else timeout
        cdef bint flag
        with nogil:
            pthread_mutex_lock(&self._mutex)
            if not forever:
                clock_gettime(CLOCK_MONOTONIC, &deadline)
                ns = deadline.tv_nsec + <long>(seconds * 1e9)
                deadline.tv_sec += ns // 1000000000
                deadline.tv_nsec = ns % 1000000000
            while not self._flag:
                if forever:
                    pthread_cond_wait(&self._cond, &self._mutex)
                elif pthread_cond_timedwait(&self._cond, &self._mutex, &deadline) == ETIMEDOUT:
                    break
            flag = self._flag
            pthread_mutex_unlock(&self._mutex)
        return flag


cdef class NativeFlushLock:
    """The CommitLog's flush lock: every ``fdatasync`` of it, the native flusher's and Python's,
    runs holding this, so a failure one of them sees is known before the other starts (an
    error is reported once per open file, and the flusher's descriptor shares the file's)."""

    cdef pthread_mutex_t _mutex
    # Times taken (bumped once held): a fsync of the CommitLog runs holding the flush lock, so
    # a page stored to while this number stayed the same has not been cleaned by one of ours
    # (the native send's copy keeps the GIL for such a page, decision 940).
    cdef unsigned int _takes

    def __cinit__(self):
        pthread_mutex_init(&self._mutex, NULL)

    def __dealloc__(self):
        pthread_mutex_destroy(&self._mutex)

    def __enter__(self):
        # Uncontended, no release of the GIL (the CommitLog's put lock is one of these too).
        if pthread_mutex_trylock(&self._mutex) != 0:
            with nogil:
                pthread_mutex_lock(&self._mutex)
        tmq_bump32(&self._takes)
        return self

    def __exit__(self, *exc):
        pthread_mutex_unlock(&self._mutex)
        return False


# The flusher waits at least this long for the writers of its last round to come back, even
# when its fsync took less (a page-cache-only or battery-backed disk): each fsync also costs a
# dispatch pass and a wake-up of every writer, which a batch of 4 instead of 60 pays 15 times.
DEF _MIN_WAIT_S = 0.0002

# What ``serve`` returns (with the batch and how many writers it holds).
cdef enum:
    _STOPPED = 0  # stopping, nothing queued: the flusher ends
    _IN_PYTHON = 1  # the batch is closed but not fsynced: Python flushes, then ``finish``
    _FAILED = 2  # the batch's fdatasync failed (errno given): Python fails it, then ``finish``

SERVE_STOPPED = _STOPPED
SERVE_IN_PYTHON = _IN_PYTHON
SERVE_FAILED = _FAILED


cdef class NativeBatchGate:
    """Numbered batches of writers waiting for one fsync each (see ``PythonBatchGate``)."""

    cdef pthread_mutex_t _mutex
    cdef pthread_cond_t _work  # the flusher waits here for requests
    # Writers of a batch sleep on the futex word of its number's parity; the flusher bumps it
    # after raising ``_finished`` (only the batch being fsynced and the open one have writers).
    cdef unsigned int _done[2]
    cdef int64_t _open  # the batch requests join now
    # Every batch up to this one has been fsynced (or failed). Written under ``_mutex`` with
    # atomic stores; a woken writer reads it with an atomic load, without ``_mutex``.
    cdef int64_t _finished
    cdef int64_t _pending  # requests in the open batch
    cdef int64_t _population  # writers the last round served: the flusher waits for as many
    cdef int64_t _want  # > 0 while the flusher waits for that many requests
    cdef bint _idle  # the flusher waits for a first request
    cdef bint _stopping
    cdef bint _closed  # the flusher has ended: writers flush for themselves
    # The native flusher's view of the CommitLog (decision 580), all under ``_mutex``.
    cdef int64_t _appended  # the largest end offset a request has joined with
    cdef int64_t _flushed  # every byte below this is durable
    cdef int _fd  # our own dup of the descriptor of the file appends go to, or -1
    cdef int64_t _file_from  # that file's first offset
    cdef int64_t _file_end  # just past its last byte
    cdef int _retired_fd  # a replaced descriptor the flusher still syncs: it closes it
    cdef bint _syncing  # the flusher is inside fdatasync on ``_fd``
    cdef bint _failed  # the store has failed: only Python may answer writers now
    cdef double _fsync_s  # how long the last fsync took
    cdef NativeFlushLock _flush_lock
    cdef NativeWakeup _wake  # set after every fsync (the dispatcher's), or None
    # The native send's last store (decision 940), under the put lock: the address of the last
    # page it stored to (>> 12) and the flush lock's ``_takes`` read before that store.
    cdef Py_ssize_t _last_page
    cdef unsigned int _last_takes
    cdef public int64_t gil_copies  # native sends whose copy kept the GIL (a dirty page)
    cdef public int64_t native_flushes  # fsyncs run by ``serve`` itself
    cdef public int64_t native_requests  # the requests they covered
    cdef public double native_fsync_seconds  # the time spent in those fsyncs

    def __cinit__(self):
        cdef pthread_condattr_t attr
        pthread_mutex_init(&self._mutex, NULL)
        pthread_condattr_init(&attr)
        pthread_condattr_setclock(&attr, CLOCK_MONOTONIC)
        pthread_cond_init(&self._work, &attr)
        pthread_condattr_destroy(&attr)
        self._open = 1
        self._finished = 0
        self._closed = 1
        self._fd = -1
        self._retired_fd = -1
        self._flush_lock = NativeFlushLock()

    def __dealloc__(self):
        if self._fd >= 0:
            close(self._fd)
        if self._retired_fd >= 0:
            close(self._retired_fd)
        pthread_cond_destroy(&self._work)
        pthread_mutex_destroy(&self._mutex)

    @property
    def flush_lock(self):
        return self._flush_lock

    @property
    def flushed(self):
        return self._flushed

    def publish_flushed(self, int64_t offset):
        """Everything below ``offset`` is durable (a flush made in Python)."""
        with nogil:
            pthread_mutex_lock(&self._mutex)
            if offset > self._flushed:
                self._flushed = offset
            pthread_mutex_unlock(&self._mutex)

    def reset_flushed(self, int64_t offset):
        """The flushed offset is ``offset`` (recovery, a truncation), lower or not."""
        with nogil:
            pthread_mutex_lock(&self._mutex)
            self._flushed = offset
            if self._appended > offset:
                self._appended = offset
            pthread_mutex_unlock(&self._mutex)

    def mark_failed(self):
        """The store has failed: ``serve`` syncs nothing more itself."""
        with nogil:
            pthread_mutex_lock(&self._mutex)
            self._failed = 1
            pthread_mutex_unlock(&self._mutex)

    def wake_after_flush(self, NativeWakeup wake):
        """Set ``wake`` after every fsync ``serve`` runs (None: nothing). ``serve`` sets it
        holding ``_mutex``, so the one replaced here is never in use when it goes."""
        with nogil:
            pthread_mutex_lock(&self._mutex)
        old, self._wake = self._wake, wake  # no holder of ``_mutex`` ever waits for the GIL
        pthread_mutex_unlock(&self._mutex)
        del old

    def track_file(self, int fd, int64_t from_offset, int64_t size):
        """Appends go to the file ``fd`` (a dup is kept) from ``from_offset``; -1: none."""
        cdef int mine = -1
        if fd >= 0:
            mine = fcntl(fd, F_DUPFD_CLOEXEC, 0)  # not inherited by a child, as Python's own
            if mine < 0:
                raise OSError(errno, "dup of the CommitLog file's descriptor failed")
        self._last_page = 0  # another file: its pages are not known to be dirty
        with nogil:
            pthread_mutex_lock(&self._mutex)
            if self._fd >= 0:
                if self._syncing:
                    if self._retired_fd >= 0:
                        close(self._retired_fd)
                    self._retired_fd = self._fd
                else:
                    close(self._fd)
            self._fd = mine
            self._file_from = from_offset
            self._file_end = from_offset + size if mine >= 0 else from_offset
            pthread_mutex_unlock(&self._mutex)

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

    def join_and_wait(self, int64_t end=0):
        """Join the open batch with bytes up to ``end`` appended, and sleep until the batch is
        finished; returns its number, 0 when an earlier flush covered ``end`` already, or -1
        at once when no flusher runs (the caller flushes for itself)."""
        cdef int64_t batch
        with nogil:
            batch = self._join_wait(end)
        return batch

    cdef int64_t _join_wait(self, int64_t end) noexcept nogil:
        """``join_and_wait`` without the GIL (``_mutex`` not held)."""
        cdef int64_t batch = -1
        cdef unsigned int* word
        cdef unsigned int seen
        pthread_mutex_lock(&self._mutex)
        if 0 < end <= self._flushed:
            batch = 0
        elif not self._closed:
            batch = self._open
            self._pending += 1
            if end > self._appended:
                self._appended = end
            # Wake the flusher only when it can act: a first request, or the number it is
            # waiting for reached; not once per writer.
            if self._idle or (self._want > 0 and self._pending >= self._want):
                pthread_cond_signal(&self._work)
        pthread_mutex_unlock(&self._mutex)
        if batch > 0:
            word = &self._done[batch & 1]
            while True:
                # The word is read before ``_finished``: a finish after that read changes
                # the word first, so the wait returns at once (no lost wake-up).
                seen = tmq_load32(word)
                if tmq_load64(&self._finished) >= batch:
                    break
                tmq_futex_wait(word, seen)
        return batch

    def send_one(self, NativeFlushLock put_lock, commitlog, list one, batch, clock,
                 Py_ssize_t pwrite_min, between):
        """The native single SYNC send (decision 820): append ``one`` (a list of one message)
        to the CommitLog's open file and join the group commit, in one call that gives the
        GIL up once, from the write of the record's bytes to the end of the wait.

        Under the put lock (``put_lock``, the CommitLog's): stamp ``batch`` (an empty
        ``EncodedBatch``) with ``clock()``, the store timestamp in ms, taken there as
        ``CommitLog.append`` takes it (a stamp taken before the wait for the lock would be older
        than the sends stored meanwhile: a queue's timestamps must not fall along its offsets),
        encode the message into it with the CommitLog's encoder, take its charge of the room
        check inline (decision 735), store the record through the open file's mapping with
        its size field zero, call ``between`` (the failpoint), store the size field, then
        publish as ``CommitLog.append`` does (``wrote``, the queue offsets, ``on_append``).
        Then, without the GIL: let go of the put lock, join the open batch and sleep until it
        is finished. Returns the batch's number as ``join_and_wait`` does, or None when it
        declined before anything was published (no open file, a roll needed, a record of
        ``pwrite_min`` bytes or more, a stale room measurement, the store failed, a message
        the encoder refuses): ``CommitLog.append`` then does the whole send, and raises
        what it raises."""
        cdef pthread_mutex_t* pm = &put_lock._mutex
        cdef int64_t end, nb
        if pthread_mutex_trylock(pm) != 0:
            with nogil:
                pthread_mutex_lock(pm)
        try:
            end = _append_one(self, commitlog, one, batch, clock, pwrite_min, between)
        except BaseException:
            pthread_mutex_unlock(pm)
            raise
        if end == 0:
            pthread_mutex_unlock(pm)
            return None
        with nogil:
            pthread_mutex_unlock(pm)
            nb = self._join_wait(end)
        return nb

    cdef int64_t _take(self, double max_wait) noexcept nogil:
        """Close the open batch (``_mutex`` held): wait for a first request, then up to
        ``max_wait`` seconds for as many as the last round served. Returns the batch's number
        (its size left in ``_pending``'s old value, see ``take``), or -1 when stopping with
        nothing queued (no request can join after that)."""
        cdef timespec deadline
        cdef long ns
        while self._pending == 0 and not self._stopping:
            self._idle = 1
            pthread_cond_wait(&self._work, &self._mutex)
            self._idle = 0
        if self._pending == 0:
            self._closed = 1
            return -1
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
        self._open += 1
        return self._open - 1

    cdef void _finish(self, int64_t batch, int64_t served) noexcept nogil:
        """Mark ``batch`` finished (``_mutex`` held); the caller wakes its writers with
        ``_wake_batch`` once it has let go of ``_mutex``, so that joining writers do not queue
        on it behind the wake-up's system call."""
        tmq_store64(&self._finished, batch)
        self._population = served + self._pending
        tmq_bump32(&self._done[batch & 1])

    cdef void _wake_batch(self, int64_t batch) noexcept nogil:
        tmq_futex_wake_all(&self._done[batch & 1])

    def take(self, double max_wait):
        """The flusher closes the open batch: waits for a first request, then up to
        ``max_wait`` seconds for as many as the last round served. Returns ``(number, served)``,
        or -1 when stopping with nothing queued (no request can join after that)."""
        cdef int64_t batch, served = 0
        with nogil:
            pthread_mutex_lock(&self._mutex)
            batch = self._take(max_wait)
            if batch >= 0:
                served = self._pending
                self._pending = 0
            pthread_mutex_unlock(&self._mutex)
        if batch < 0:
            return -1
        return batch, served

    def finish(self, int64_t batch, int64_t served):
        """Batch ``batch`` is fsynced (or failed): wake its writers, all with one wake-up."""
        with nogil:
            pthread_mutex_lock(&self._mutex)
            self._finish(batch, served)
            pthread_mutex_unlock(&self._mutex)
            self._wake_batch(batch)

    def serve(self):
        """The flusher's loop, without the GIL: close a batch, ``fdatasync`` the file its bytes
        are in, publish the flushed offset, wake the batch and ``wake_after_flush``'s event;
        again. Returns ``(SERVE_STOPPED, 0, 0, 0)``, or ``(code, batch, served, errno)`` for a
        closed batch it leaves to Python (see the SERVE_ constants)."""
        cdef int64_t batch = 0, served = 0, target, flushed
        cdef int code = _STOPPED, fd, rc, err = 0
        cdef timespec t0, t1
        with nogil:
            while True:
                pthread_mutex_lock(&self._mutex)
                batch = self._take(self._fsync_s if self._fsync_s > _MIN_WAIT_S else _MIN_WAIT_S)
                if batch < 0:
                    pthread_mutex_unlock(&self._mutex)
                    code = _STOPPED
                    break
                served = self._pending
                self._pending = 0
                target = self._appended
                flushed = self._flushed
                fd = self._fd
                # Only when every byte not yet durable lies in the tracked file.
                if self._failed or fd < 0 or flushed < self._file_from or target > self._file_end:
                    pthread_mutex_unlock(&self._mutex)
                    code = _IN_PYTHON
                    break
                self._syncing = 1
                pthread_mutex_unlock(&self._mutex)
                # Requests keep queueing into the next batch meanwhile.
                pthread_mutex_lock(&self._flush_lock._mutex)
                tmq_bump32(&self._flush_lock._takes)
                rc = 0
                if target > flushed:
                    if self._failed:
                        rc = -2
                    else:
                        clock_gettime(CLOCK_MONOTONIC, &t0)
                        rc = fdatasync(fd)
                        while rc != 0 and errno == EINTR:
                            rc = fdatasync(fd)
                        if rc != 0:
                            err = errno
                            self._failed = 1
                        clock_gettime(CLOCK_MONOTONIC, &t1)
                        self._fsync_s = (t1.tv_sec - t0.tv_sec) + (t1.tv_nsec - t0.tv_nsec) * 1e-9
                        self.native_fsync_seconds += self._fsync_s
                pthread_mutex_unlock(&self._flush_lock._mutex)
                pthread_mutex_lock(&self._mutex)
                self._syncing = 0
                if self._retired_fd >= 0:
                    close(self._retired_fd)
                    self._retired_fd = -1
                if rc != 0:
                    pthread_mutex_unlock(&self._mutex)
                    code = _IN_PYTHON if rc == -2 else _FAILED
                    break
                if target > self._flushed:
                    self._flushed = target
                self.native_flushes += 1
                self.native_requests += served
                self._finish(batch, served)
                if self._wake is not None:
                    self._wake.fire()
                pthread_mutex_unlock(&self._mutex)
                self._wake_batch(batch)
        return code, batch, served, err


cdef int64_t _append_one(NativeBatchGate gate, commitlog, list one, batch, clock,
                         Py_ssize_t pwrite_min, between) except -1:
    """``NativeBatchGate.send_one``'s append, the put lock held: the end offset of the record
    appended, or 0 when declined with nothing published."""
    cdef int64_t file_from, wrote, size, end, charge, store_ts, appended = 0
    cdef Py_ssize_t n, pos
    cdef unsigned char[::1] m
    cdef const unsigned char* d
    cdef unsigned char* at
    cdef Py_ssize_t first_page, last_page
    cdef unsigned int takes
    cdef bytes data
    if commitlog.failed is not None:
        return 0
    store_ts = clock()
    batch.store_timestamp = store_ts
    files = commitlog.files.files
    if not files:
        return 0
    last = files[len(files) - 1]  # no negative index: this module is built without wraparound
    file_from = last.from_offset
    wrote = last.wrote
    size = commitlog.files.file_size
    next_offsets = {}
    try:
        # The record engine's own function (``RecordEncoder.encode_batch`` without its Python
        # frame, decision 1020).
        done, used = commitlog.engine_encode(
            commitlog._encoder, one, 0, file_from + wrote, size - wrote, next_offsets,
            commitlog.queue_offsets, batch
        )
    except Exception:
        return 0  # the Python path raises it, wrapped as it wraps it
    if done != 1:
        return 0  # a roll: the Python path pads the file and rolls
    parts = batch.parts
    # One buffer from the native engine, a record's pieces from the reference one.
    data = parts[0] if len(parts) == 1 else b"".join(parts)
    n = len(data)
    if n >= pwrite_min or n < 8 or n != batch.sizes[0]:
        return 0
    m = last.mm
    pos = wrote
    if pos < 0 or pos + n > m.shape[0]:
        return 0
    room = commitlog.room
    charge = batch.cq_starts * room.cq_file_cost + batch.index_entries * room.entry_cost
    end = file_from + wrote + n
    if charge:
        appended = room.appended + charge
        if not (store_ts < room.fresh_until and appended <= room.limit):
            return 0  # a measurement is due: ``room.take`` in the Python path
        room.appended = appended
        room.open_end = end
        if appended >= room.next_mark:
            room.close_mark()
    d = <const unsigned char*>data
    at = &m[pos]
    # The store may fault (a page an fsync cleaned, a page not yet stored to): then it is made
    # without the GIL, so the fault does not stall the other senders. The size field stays
    # zero until every other byte is in (``MappedFile.append_records``). A record that lies in
    # the page this send stored to last, with no fsync of ours started since (the flush lock
    # not taken since), finds its page dirty and writable: no fault, and no hand-over of the
    # GIL to another sender that this one would then wait to get back (decision 940).
    takes = tmq_load32(&gate._flush_lock._takes)
    first_page = (<Py_ssize_t>at) >> 12
    last_page = (<Py_ssize_t>(at + n - 1)) >> 12
    if first_page == last_page and first_page == gate._last_page and takes == gate._last_takes:
        memset(at, 0, 4)
        memcpy(at + 4, d + 4, n - 4)
        gate.gil_copies += 1
    else:
        with nogil:
            memset(at, 0, 4)
            memcpy(at + 4, d + 4, n - 4)
    gate._last_page = last_page
    gate._last_takes = takes
    if between is not None:
        between()
    memcpy(at, d, 4)
    batch.parts = []
    last.wrote = wrote + n
    commitlog.queue_offsets.update(next_offsets)
    on_append = commitlog.on_append
    if on_append is not None:
        on_append(batch)
    if last is not commitlog._tracked:
        commitlog._track(last)
    commitlog.last_store_timestamp = store_ts
    return end
