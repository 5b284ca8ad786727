# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""The native twin of the record engine's inner loops (decision 150).

``tiered/record.py`` holds the reference implementation of every function here, with the same
name and a ``_py`` suffix, and ``tests/test_record_engine.py`` checks that both give the same
bytes on random and adversarial records. Each function reads the Python objects it needs while
it holds the GIL, then does the byte work (header packing, copies, CRC32C, scans) in C with the
GIL released, so an append, a dispatch pass and a segment build on other threads run in parallel.
The append path keeps the GIL for a few records, where a release costs more than the work it
frees (decision 421).

Build: ``pip install -e .`` compiles this module (setup.py); without it ``tiered.record`` uses
the reference implementation. ``TMQ_PURE_PYTHON=1`` forces the reference even when it is built.
"""

from cpython.buffer cimport PyBUF_WRITABLE, PyBuffer_Release, PyObject_GetBuffer
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from cpython.dict cimport PyDict_GetItem, PyDict_GetItemWithError, PyDict_Next
from cpython.list cimport PyList_Append
from cpython.long cimport PyLong_CheckExact
from cpython cimport array as carray
from cpython.ref cimport PyObject
from libc.stdint cimport int32_t, int64_t, uint8_t, uint16_t, uint32_t, uint64_t
from libc.stdlib cimport calloc, free, malloc, realloc
from libc.string cimport memchr, memcmp, memcpy, memmove

from tiered._protowire cimport varint_len, write_varint

import array
import struct

import numpy as np

# An empty ``array('q')``: what the dispatch's integer columns are cloned from (decision 600).
cdef carray.array _I64 = array.array("q")

cdef extern from "Python.h":
    const char* PyUnicode_AsUTF8AndSize(object unicode, Py_ssize_t* size) except NULL
    object PyUnicode_DecodeUTF8(const char* s, Py_ssize_t size, const char* errors)
    bint PyUnicode_Check(object o)
    bint PyUnicode_CheckExact(object o)
    bint PyBytes_CheckExact(object o)
    bint PyDict_CheckExact(object o)

cdef extern from "_record_native.h" nogil:
    void tmq_crc32c_init()
    uint32_t tmq_crc32c_extend(uint32_t crc, const unsigned char* p, size_t n)
    uint32_t tmq_crc32c_extend3(uint32_t crc, const unsigned char* p, size_t n)
    uint32_t tmq_crc32c_zeros_op(uint64_t n)
    uint32_t tmq_crc32c_combine_op(uint32_t a, uint32_t b, uint32_t op)
    uint32_t tmq_multmodp(uint32_t a, uint32_t b)
    uint16_t tmq_be16(const unsigned char* p)
    uint32_t tmq_be32(const unsigned char* p)
    uint64_t tmq_be64(const unsigned char* p)
    void tmq_put16(unsigned char* p, uint16_t v)
    void tmq_put32(unsigned char* p, uint32_t v)
    void tmq_put64(unsigned char* p, uint64_t v)

cdef extern from "_record_native.h":
    ctypedef struct tmq_span:
        int64_t body_at
        int64_t body_len
        int64_t props_at
        int64_t props_len
        int64_t born_timestamp
        int64_t queue_id
        int64_t host
    Py_ssize_t tmq_slot_offset(object descr) except? -2
    object tmq_slot(object obj, Py_ssize_t offset, object name)

tmq_crc32c_init()

name = "native"

DEF MAGIC_V2 = -626843477
DEF BLANK = 8
DEF V4_HEAD = 88
DEF SYSFLAG_BORN_V6 = 16
DEF SYSFLAG_STORE_V6 = 32
DEF SYSFLAG_RECORD_CRC = 65536
DEF SYSFLAG_KNOWN = SYSFLAG_BORN_V6 | SYSFLAG_STORE_V6 | SYSFLAG_RECORD_CRC  # decision 870
DEF SYSFLAG_BIT16_BYTE = 37
DEF CRC_PAIR = 20  # record.CRC_TRAILER_SIZE: ``__CRC32#\x01``, ten digits, ``\x02``
DEF MAX_TOPIC = 0xFFFF
DEF MAX_PROPS = 0x7FFF - CRC_PAIR
# Encoding fewer bytes than this keeps the GIL: for one or a few records the work is a
# microsecond or two, and releasing the GIL lets another thread take it for up to the switch
# interval; with 8 single-send SYNC producers every release was a hand-off (decision 421).
DEF _NOGIL_MIN = 16384
DEF QUEUE_SLOTS = 32  # queues of one batch tracked without the dict (encode_batch)

# Filled in by tiered.record when it loads this module (it imports us, not the reverse).
cdef object RecordError = ValueError
cdef object CorruptRecordError = ValueError
cdef object RecordCrcError = ValueError
cdef object SegmentTables = None
cdef object EncodedBatch = None
cdef object encode_properties = None
cdef type Message = None
cdef type RecordSpans = None
# Where each field of a ``record.Message`` lives in its instances: the append path reads the
# slots directly instead of through attribute lookups (the largest per-message cost).
cdef Py_ssize_t[9] _OFF
cdef tuple _FIELDS = ("topic", "body", "queue_id", "properties", "flag", "born_timestamp",
                      "born_host", "reconsume_times", "prepared_transaction_offset")
cdef bint _slots_ok = False

cdef str _TAGS = "TAGS"
cdef str _KEYS = "KEYS"
cdef str _UNIQ = "UNIQ_KEY"


def bind(record_module):
    """Take the record module's error classes and types (called once by ``tiered.record``)."""
    global RecordError, CorruptRecordError, RecordCrcError
    global SegmentTables, EncodedBatch, encode_properties
    global Message, RecordSpans, _slots_ok
    RecordError = record_module.RecordError
    CorruptRecordError = record_module.CorruptRecordError
    RecordCrcError = record_module.RecordCrcError
    SegmentTables = record_module.SegmentTables
    EncodedBatch = record_module.EncodedBatch
    encode_properties = record_module.encode_properties
    Message = record_module.Message
    RecordSpans = record_module.RecordSpans
    if record_module.SPAN_STRUCT.size != sizeof(tmq_span):
        raise ImportError("record.SPAN_STRUCT does not match tmq_span")
    _slots_ok = True
    for i, field in enumerate(_FIELDS):
        _OFF[i] = tmq_slot_offset(Message.__dict__[field])
        _slots_ok = _slots_ok and _OFF[i] >= 0


cdef inline object _field(object m, bint fast, int i):
    return tmq_slot(m, _OFF[i], _FIELDS[i]) if fast else getattr(m, _FIELDS[i])


def crc32c(data):
    """CRC32C of ``data`` (anything with the buffer protocol), unsigned."""
    cdef const unsigned char[::1] v = _view(data)
    cdef uint32_t c
    cdef size_t n = v.shape[0]
    if n == 0:
        return 0
    with nogil:
        # Three lanes at once (a segment object's CRC: 16 MiB and more): three times one chain's
        # rate, faster than google-crc32c here (decision 561).
        c = tmq_crc32c_extend3(0, &v[0], n)
    return c


cdef inline object _view(object data):
    """A flat byte view of anything with the buffer protocol (bytes, mmap, memoryview...)."""
    view = memoryview(data)
    if not view.c_contiguous:
        view = memoryview(bytes(view))
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


cdef inline void _put_crc_pair(unsigned char* o, uint32_t crc) noexcept nogil:
    """``record.crc_trailer``: the pair of ``crc``'s low 31 bits, least significant digit
    first, at ``o`` (20 bytes)."""
    cdef int i
    crc &= 0x7FFFFFFF
    memcpy(o, b"__CRC32#\x01", 9)
    for i in range(10):
        o[9 + i] = <unsigned char>(48 + crc % 10)
        crc //= 10
    o[19] = 2


cdef inline bint _record_crc_ok(const unsigned char* rec, int64_t total) noexcept nogil:
    """``record.record_crc_matches`` for the record of ``total`` bytes at ``rec``."""
    cdef unsigned char pair[CRC_PAIR]
    _put_crc_pair(pair, tmq_crc32c_extend3(0, rec, total - CRC_PAIR))
    return memcmp(pair, rec + total - CRC_PAIR, CRC_PAIR) == 0


cdef inline bint _record_crc_flag_lost(const unsigned char* rec, int64_t total) noexcept nogil:
    """``record.record_crc_flag_lost``: a record without SYSFLAG bit 16 that ends with the pair
    it would carry had the bit been set (its flag byte damaged, decision 870)."""
    cdef unsigned char pair[CRC_PAIR]
    cdef unsigned char flag_byte
    cdef uint32_t crc
    if total < V4_HEAD + CRC_PAIR or memcmp(rec + total - CRC_PAIR, b"__CRC32#\x01", 9) != 0:
        return False
    flag_byte = rec[SYSFLAG_BIT16_BYTE] | 1
    crc = tmq_crc32c_extend(0, rec, SYSFLAG_BIT16_BYTE)
    crc = tmq_crc32c_extend(crc, &flag_byte, 1)
    crc = tmq_crc32c_extend3(crc, rec + SYSFLAG_BIT16_BYTE + 1,
                             total - CRC_PAIR - SYSFLAG_BIT16_BYTE - 1)
    _put_crc_pair(pair, crc)
    return memcmp(pair, rec + total - CRC_PAIR, CRC_PAIR) == 0


# -- encode ---------------------------------------------------------------------------------------

cdef struct Rec:
    int32_t size
    int32_t queue_id
    int32_t flag
    int64_t queue_offset
    int64_t physical_offset
    int64_t born_timestamp
    const unsigned char* born_ip
    int32_t born_v6
    int32_t born_port
    int32_t reconsume
    int64_t prepared
    const unsigned char* body
    Py_ssize_t body_len
    const unsigned char* topic_part
    Py_ssize_t topic_part_len
    Py_ssize_t props_at  # in the scratch buffer
    Py_ssize_t props_len


cdef struct Scratch:
    unsigned char* data
    Py_ssize_t len
    Py_ssize_t cap


cdef int _reserve(Scratch* s, Py_ssize_t more) except -1:
    cdef Py_ssize_t cap
    cdef unsigned char* grown
    if s.len + more <= s.cap:
        return 0
    cap = max(s.cap * 2, s.len + more, 4096)
    grown = <unsigned char*>realloc(s.data, cap)
    if grown == NULL:
        raise MemoryError()
    s.data = grown
    s.cap = cap
    return 0


cdef int _append(Scratch* s, const char* p, Py_ssize_t n) except -1:
    _reserve(s, n)
    memcpy(s.data + s.len, p, n)
    s.len += n
    return 0


cdef int32_t _i32(object v) except? -1:
    cdef long long x = v
    if x < -2147483648 or x > 2147483647:
        raise struct.error("'i' format requires -2147483648 <= number <= 2147483647")
    return <int32_t>x


cdef Py_ssize_t _encode_properties(dict props, Scratch* s, PyObject** found=NULL) except -1:
    """``name\\x01value\\x02`` for each pair into ``s``; returns the length added. With
    ``found`` (four slots, NULL on entry), the values of ``TAGS``, ``KEYS`` and ``UNIQ_KEY``
    are left in the first three as borrowed references, found by their names' bytes in the
    same walk: what three lookups by name would find, since a dict holds each name once. The
    fourth is set when a name is a ``str`` subclass (a lookup might then find another key)."""
    cdef Py_ssize_t pos = 0, start = s.len, kn, vn
    cdef PyObject* k
    cdef PyObject* v
    cdef const char* kp
    cdef const char* vp
    cdef Py_ssize_t item = 0
    while PyDict_Next(props, &pos, &k, &v):
        if not PyUnicode_Check(<object>k) or not PyUnicode_Check(<object>v):
            bad = <object>k if not PyUnicode_Check(<object>k) else <object>v
            raise TypeError(
                f"sequence item {item}: expected str instance, {type(bad).__name__} found"
            )
        kp = PyUnicode_AsUTF8AndSize(<object>k, &kn)
        vp = PyUnicode_AsUTF8AndSize(<object>v, &vn)
        if (memchr(kp, 1, kn) != NULL or memchr(kp, 2, kn) != NULL
                or memchr(vp, 1, vn) != NULL or memchr(vp, 2, vn) != NULL):
            raise RecordError("property names and values may not contain \\x01 or \\x02")
        if found != NULL:
            if not PyUnicode_CheckExact(<object>k):
                found[3] = k  # a str subclass may hash or compare its own way: look up by name
            elif kn == 4 and memcmp(kp, b"TAGS", 4) == 0:
                found[0] = v
            elif kn == 4 and memcmp(kp, b"KEYS", 4) == 0:
                found[1] = v
            elif kn == 8 and memcmp(kp, b"UNIQ_KEY", 8) == 0:
                found[2] = v
        _reserve(s, kn + vn + 2)
        memcpy(s.data + s.len, kp, kn)
        s.data[s.len + kn] = 1
        memcpy(s.data + s.len + kn + 1, vp, vn)
        s.data[s.len + kn + 1 + vn] = 2
        s.len += kn + vn + 2
        item += 1
    return s.len - start


cdef inline unsigned char* _put_host(unsigned char* o, const unsigned char* ip, bint v6,
                                     int32_t port) noexcept nogil:
    cdef int w = 16 if v6 else 4
    memcpy(o, ip, w)
    tmq_put32(o + w, <uint32_t>port)
    return o + w + 4


cdef void _write_records(unsigned char* out, Rec* recs, Py_ssize_t n, const unsigned char* props,
                         const unsigned char* store_ip, bint store_v6, int32_t store_port,
                         int64_t store_ts) noexcept nogil:
    cdef Py_ssize_t i, head
    cdef Rec* r
    cdef unsigned char* o = out
    cdef unsigned char* p
    cdef unsigned char* tail
    cdef uint32_t crc, whole
    cdef Py_ssize_t op_len = -1
    cdef uint32_t op = 0
    for i in range(n):
        r = &recs[i]
        # The body is read once: its CRC is BODYCRC and joins the record CRC by combination
        # (decision 320), three lanes at a time where it is long enough.
        if r.body_len >= 768:
            crc = tmq_crc32c_extend3(0, r.body, r.body_len)
        else:
            crc = tmq_crc32c_extend(0, r.body, r.body_len) if r.body_len else 0
        tmq_put32(o, <uint32_t>r.size)
        tmq_put32(o + 4, <uint32_t><int32_t>MAGIC_V2)
        tmq_put32(o + 8, crc)
        tmq_put32(o + 12, <uint32_t>r.queue_id)
        tmq_put32(o + 16, <uint32_t>r.flag)
        tmq_put64(o + 20, <uint64_t>r.queue_offset)
        tmq_put64(o + 28, <uint64_t>r.physical_offset)
        tmq_put32(o + 36, (SYSFLAG_BORN_V6 if r.born_v6 else 0)
                  | (SYSFLAG_STORE_V6 if store_v6 else 0) | SYSFLAG_RECORD_CRC)
        tmq_put64(o + 40, <uint64_t>r.born_timestamp)
        p = _put_host(o + 48, r.born_ip, r.born_v6, r.born_port)
        tmq_put64(p, <uint64_t>store_ts)
        p = _put_host(p + 8, store_ip, store_v6, store_port)
        tmq_put32(p, <uint32_t>r.reconsume)
        tmq_put64(p + 4, <uint64_t>r.prepared)
        tmq_put32(p + 12, <uint32_t>r.body_len)
        p += 16
        head = p - o
        memcpy(p, r.body, r.body_len)
        p += r.body_len
        tail = p
        memcpy(p, r.topic_part, r.topic_part_len)
        p += r.topic_part_len
        tmq_put16(p, <uint16_t>(r.props_len + CRC_PAIR))
        if r.props_len:  # props is NULL when no record of the batch has properties
            memcpy(p + 2, props + r.props_at, r.props_len)
        # Last: the record CRC covers every byte before its pair, offsets and times included:
        # the header's CRC, joined with the body's, extended over topic and properties.
        whole = tmq_crc32c_extend(0, o, head)
        if r.body_len:
            if r.body_len != op_len:
                op_len = r.body_len
                op = tmq_crc32c_zeros_op(<uint64_t>op_len)
            whole = tmq_crc32c_combine_op(whole, crc, op)
        whole = tmq_crc32c_extend(whole, tail, o + r.size - CRC_PAIR - tail)
        _put_crc_pair(o + r.size - CRC_PAIR, whole)
        o += r.size


cdef object _queue_key(dict cache, object topic, object queue_id, bint* cached):
    """The ``(topic, queue_id)`` tuple, allocated once per queue and kept in ``cache``;
    ``cached`` says whether it is the kept one (the same object at every call)."""
    cdef PyObject* found = PyDict_GetItemWithError(cache, topic)
    cdef dict by_id
    if found == NULL:
        by_id = {}
        if len(cache) < 100_000:
            cache[topic] = by_id
    else:
        by_id = <dict>found
    found = PyDict_GetItemWithError(by_id, queue_id)
    if found != NULL:
        cached[0] = True
        return <object>found
    key = (topic, queue_id)
    cached[0] = len(by_id) < 65_536 and topic in cache
    if cached[0]:
        by_id[queue_id] = key
    return key


cdef inline int _queue_slot(PyObject** keys, int count, PyObject* key) noexcept:
    """The slot of ``key`` (a cached key: compared by identity) among ``keys[:count]``, or
    ``count``."""
    cdef int j
    for j in range(count):
        if keys[j] == key:
            return j
    return count


cdef int _put_column(object out, str name, carray.array column) except -1:
    """``out.<name>`` becomes ``column`` when it holds nothing yet (the append path's fresh
    ``EncodedBatch``); else ``column`` is added to what it holds."""
    held = getattr(out, name)
    if len(held):
        held.extend(column)
    else:
        setattr(out, name, column)
    return 0


cdef inline Py_ssize_t _key_entries(k) except -1:
    """The IndexFile entries a record's ``KEYS`` value makes: ``index_entry_count``'s split."""
    cdef Py_ssize_t count = 0, kn, at = 0, end
    cdef const char* kp
    cdef const char* hit
    if k is None or not k:
        return 0
    kp = PyUnicode_AsUTF8AndSize(k, &kn)
    while at < kn:
        hit = <const char*>memchr(kp + at, 32, kn - at)
        end = (hit - kp) if hit != NULL else kn
        if end > at:
            count += 1
        at = end + 1
    return count


cdef inline Py_ssize_t _rec_sized(Rec* r, bint born_v6, const unsigned char* body,
                                  Py_ssize_t body_len, object tpart, bint store_v6) noexcept:
    """A record's born host kind, body and topic set (its properties already are), and its
    size in the CommitLog: the part ``encode_batch`` and ``_encode_spans`` write before
    checking that the record fits."""
    r.born_v6 = 1 if born_v6 else 0
    r.body = body
    r.body_len = body_len
    r.topic_part = <const unsigned char*>PyBytes_AS_STRING(tpart)
    r.topic_part_len = PyBytes_GET_SIZE(tpart)
    return (V4_HEAD + (12 if r.born_v6 else 0) + (12 if store_v6 else 0) + r.body_len
            + r.topic_part_len + 2 + r.props_len + CRC_PAIR)


cdef inline void _rec_head(Rec* r, Py_ssize_t size, const unsigned char* born_ip,
                           int32_t born_port, int32_t flag, int64_t born_timestamp,
                           int32_t reconsume, int64_t prepared, int32_t queue_id) noexcept:
    """The rest of a record's header fields, once it fits (its offsets come last)."""
    r.size = <int32_t>size
    r.born_ip = born_ip
    r.born_port = born_port
    r.flag = flag
    r.born_timestamp = born_timestamp
    r.reconsume = reconsume
    r.prepared = prepared
    r.queue_id = queue_id


cdef inline int64_t _first_offset(dict next_offsets, dict base_offsets, key) except? -1:
    """The next queue offset of ``key``'s queue as this call starts: ``next_offsets``', else
    ``base_offsets``' (0 for a queue neither holds)."""
    cdef PyObject* found = PyDict_GetItemWithError(next_offsets, key)
    if found == NULL:
        return base_offsets.get(key, 0)
    return <object>found


def encode_batch(encoder, messages, Py_ssize_t start, int64_t physical_offset, int64_t space,
                 dict next_offsets, dict base_offsets, out, sink=None):
    """``RecordEncoder.encode_batch``: the records go to ``out.parts`` as one bytes object.

    With ``sink`` (``MappedFile.append_sink``: descriptor, mapping, position, failpoint or
    None), a batch that fits whole and is large enough to be written without the GIL is written
    into the file instead, by one ``pwrite`` with its size fields in place (decision 1040), in
    the same release of the GIL as its encoding (decision 452); ``out.written`` is then set and ``out.parts`` stays empty."""
    cdef Py_ssize_t count = len(messages)
    cdef Py_ssize_t i = start, n = 0, used = 0, size
    cdef Rec* recs
    cdef Rec* r
    cdef Scratch scratch
    cdef bint store_v6 = encoder._store_v6
    cdef dict topic_parts = encoder._topic_parts
    cdef dict born_cache = encoder._born_cache
    cdef dict queue_keys = encoder._queue_keys
    cdef list queues = out.queues, tags = out.tags, keys = out.keys, uniqs = out.uniq_keys
    cdef list hold = []
    cdef PyObject* found
    cdef int64_t q
    cdef bint fast
    # Counted for the append path's room check (decision 735): IndexFile entries, and queue
    # offsets that start a ConsumeQueue file.
    cdef int64_t per_file = encoder._cq_per_file
    cdef Py_ssize_t entries = 0, starts = 0
    # The batch's queues and their next offsets (decision 450): a queue is found by the identity
    # of its cached key, so a message costs no tuple hash, dict store or int object for its
    # offset; ``next_offsets`` gets one store per queue at the end.
    cdef PyObject* slot_key[QUEUE_SLOTS]
    cdef int64_t slot_next[QUEUE_SLOTS]
    # Each slot's topic object and queue id (decision 960): a message whose topic is that same
    # object and whose queue id an exact int of that value takes the slot's key without the
    # two dict lookups of ``_queue_key`` (which would give that very key).
    cdef PyObject* slot_topic[QUEUE_SLOTS]
    cdef int64_t slot_qid[QUEUE_SLOTS]
    cdef int64_t qid = 0
    cdef bint exact_qid
    cdef int slots = 0, j
    cdef bint cached = False
    # A batch's messages mostly share their topic and born host objects: the last ones looked
    # up are kept, and a message with the same object (compared by identity; both are
    # immutable) skips the dict lookups. ``hold`` keeps them alive for the comparison.
    cdef PyObject* last_topic = NULL
    cdef PyObject* last_host = NULL
    cdef object last_tpart = None, last_born = None
    cdef int32_t last_port = 0
    cdef int32_t port
    cdef bint same_host
    cdef PyObject* named[4]
    cdef object tag_v, keys_v, uniq_v
    if type(messages) is RecordSpans:
        return _encode_spans(encoder, messages, start, physical_offset, space, next_offsets,
                             base_offsets, out, sink)
    if count <= start:
        return start, 0
    recs = <Rec*>malloc(sizeof(Rec) * (count - start))
    if recs == NULL:
        raise MemoryError()
    scratch.data = NULL
    scratch.len = 0
    scratch.cap = 0
    try:
        while i < count:
            m = messages[i]
            fast = _slots_ok and type(m) is Message
            r = &recs[n]
            topic = _field(m, fast, 0)
            if <PyObject*>topic == last_topic:
                tpart = last_tpart
            else:
                found = PyDict_GetItemWithError(topic_parts, topic)
                tpart = <object>found if found != NULL else encoder._topic_part(topic)
                hold.append(topic)
                last_topic = <PyObject*>topic
                last_tpart = tpart
            props = _field(m, fast, 3)
            r.props_at = scratch.len
            named[0] = named[1] = named[2] = named[3] = NULL
            if props:
                if PyDict_CheckExact(props):
                    r.props_len = _encode_properties(<dict>props, &scratch, named)
                    if named[3] != NULL:
                        # Each value owned before the next lookup: a lookup may compare with a
                        # ``str`` subclass name, whose ``__eq__`` is Python code that can drop
                        # a value found before from the dict (decision 982: a use after free).
                        found = PyDict_GetItemWithError(props, _TAGS)
                        tag_v = <object>found if found != NULL else None
                        found = PyDict_GetItemWithError(props, _KEYS)
                        keys_v = <object>found if found != NULL else None
                        found = PyDict_GetItemWithError(props, _UNIQ)
                        uniq_v = <object>found if found != NULL else None
                    else:
                        # Owned now: Python code below (a body's ``__bytes__``) could change
                        # the dict. Nothing ran Python since the walk found them.
                        tag_v = <object>named[0] if named[0] != NULL else None
                        keys_v = <object>named[1] if named[1] != NULL else None
                        uniq_v = <object>named[2] if named[2] != NULL else None
                else:
                    raw = encode_properties(props)
                    _append(&scratch, raw, len(raw))
                    r.props_len = len(raw)
                if r.props_len > MAX_PROPS:
                    raise RecordError(
                        f"properties are {r.props_len} bytes; the format allows {MAX_PROPS}"
                    )
            else:
                r.props_len = 0
            body = _field(m, fast, 1)
            if not PyBytes_CheckExact(body):
                body = bytes(body)
            host = _field(m, fast, 6)
            same_host = <PyObject*>host == last_host
            if same_host:
                born = last_born
            else:
                address = host[0]
                found = PyDict_GetItemWithError(born_cache, address)
                born = <object>found if found != NULL else encoder._born(address)
            born_ip = born[0]
            size = _rec_sized(r, born[1], <const unsigned char*>PyBytes_AS_STRING(body),
                              PyBytes_GET_SIZE(body), tpart, store_v6)
            if used + size + BLANK > space:
                scratch.len = r.props_at
                break
            queue_id = _field(m, fast, 2)
            if same_host:
                port = last_port
            else:
                port = _i32(host[1])
                hold.append(host)
                last_host = <PyObject*>host
                last_born = born
                last_port = port
            _rec_head(r, size, <const unsigned char*>PyBytes_AS_STRING(born_ip), port,
                      _i32(_field(m, fast, 4)), _field(m, fast, 5), _i32(_field(m, fast, 7)),
                      _field(m, fast, 8), _i32(queue_id))
            # ``_i32`` above took the queue id: an exact int here fits in 32 bits.
            exact_qid = PyLong_CheckExact(queue_id)
            j = slots
            if exact_qid:
                qid = <int64_t>queue_id
                j = 0
                while j < slots and (slot_topic[j] != <PyObject*>topic or slot_qid[j] != qid):
                    j += 1
            if j < slots:
                key = <object>slot_key[j]
                q = slot_next[j]
                slot_next[j] = q + 1
            else:
                key = _queue_key(queue_keys, topic, queue_id, &cached)
                # A key the cache could not keep is a new object at every call: the dict path.
                j = _queue_slot(slot_key, slots, <PyObject*>key) if cached else QUEUE_SLOTS
                if j < slots:  # QUEUE_SLOTS when uncached, never below slots then
                    q = slot_next[j]
                    slot_next[j] = q + 1
                else:
                    q = _first_offset(next_offsets, base_offsets, key)
                    if cached and slots < QUEUE_SLOTS:
                        hold.append(key)  # the slot borrows it
                        # The topic is held: it is the last one looked up (``hold`` has it).
                        slot_key[slots] = <PyObject*>key
                        slot_topic[slots] = <PyObject*>topic if exact_qid else NULL
                        slot_qid[slots] = qid
                        slot_next[slots] = q + 1
                        slots += 1
                    else:  # more queues than slots in one batch: the dict keeps the rest
                        next_offsets[key] = q + 1
            r.queue_offset = q
            r.physical_offset = physical_offset + used
            if q % per_file == 0:
                starts += 1
            hold.append(body)
            hold.append(born_ip)
            hold.append(tpart)
            PyList_Append(queues, key)
            if props and PyDict_CheckExact(props):
                # Found while the properties were encoded (values are str: None is absent).
                PyList_Append(tags, tag_v)
                PyList_Append(keys, keys_v)
                if keys_v is not None:
                    entries += _key_entries(keys_v)
                PyList_Append(uniqs, uniq_v)
                if uniq_v is not None and uniq_v:
                    entries += 1
            elif props:
                tags.append(props.get(_TAGS))
                kv = props.get(_KEYS)
                keys.append(kv)
                entries += _key_entries(kv)
                uv = props.get(_UNIQ)
                uniqs.append(uv)
                if uv:
                    entries += 1
            else:
                PyList_Append(tags, None)
                PyList_Append(keys, None)
                PyList_Append(uniqs, None)
            used += size
            n += 1
            i += 1
        for j in range(slots):
            next_offsets[<object>slot_key[j]] = slot_next[j]
        out.index_entries += entries
        out.cq_starts += starts
        _emit(recs, n, scratch.data, encoder, out, sink if i == count else None, used,
              physical_offset)
    finally:
        free(recs)
        free(scratch.data)
    return i, used


cdef int _emit(Rec* recs, Py_ssize_t n, const unsigned char* props, encoder, out, sink,
               Py_ssize_t used, int64_t physical_offset) except -1:
    """The end of an encode call: the integer columns, then the ``n`` records written through
    ``sink`` (a batch that fits whole, see ``encode_batch``) or into ``out.parts``."""
    cdef carray.array col_offsets, col_sizes, col_qoffs
    cdef bytes store_ip = encoder._store_ip
    cdef int32_t store_port = encoder._store_port
    cdef bint store_v6 = encoder._store_v6
    cdef int64_t store_ts = out.store_timestamp
    cdef bytes buf
    cdef unsigned char* dest
    cdef const unsigned char* store_ip_p = <const unsigned char*>PyBytes_AS_STRING(store_ip)
    cdef Py_ssize_t j
    # The integer columns dispatch and the send results read: packed int64 arrays filled
    # from ``recs``, no int object or list append per record (decision 600).
    col_offsets = carray.clone(_I64, n, False)
    col_sizes = carray.clone(_I64, n, False)
    col_qoffs = carray.clone(_I64, n, False)
    for j in range(n):
        col_offsets.data.as_longlongs[j] = recs[j].physical_offset
        col_sizes.data.as_longlongs[j] = recs[j].size
        col_qoffs.data.as_longlongs[j] = recs[j].queue_offset
    _put_column(out, "offsets", col_offsets)
    _put_column(out, "sizes", col_sizes)
    _put_column(out, "queue_offsets", col_qoffs)
    if n and sink is not None and used >= _NOGIL_MIN:
        _encode_into(sink, recs, n, props, store_ip_p, store_v6, store_port, store_ts, used,
                     physical_offset)
        out.written = True
    elif n:
        buf = PyBytes_FromStringAndSize(NULL, used)
        dest = <unsigned char*>PyBytes_AS_STRING(buf)
        if used >= _NOGIL_MIN:
            with nogil:
                _write_records(dest, recs, n, props, store_ip_p, store_v6, store_port, store_ts)
        else:  # a few records: see _NOGIL_MIN
            _write_records(dest, recs, n, props, store_ip_p, store_v6, store_port, store_ts)
        out.parts.append(buf)
    return 0


cdef _encode_spans(encoder, spans, Py_ssize_t start, int64_t physical_offset, int64_t space,
                   dict next_offsets, dict base_offsets, out, sink):
    """``encode_batch`` of a ``RecordSpans`` batch (decision 700): each record's body and
    properties are read where they lie, in ``spans.raw`` and ``spans.props``; per record no
    Python object is read or made but the queue key and the dispatch columns' entries (the
    walker's tag, keys and id strings). The same records, columns and queue offsets as
    ``encode_batch`` of ``spans.messages()``."""
    cdef bytes raw = spans.raw
    cdef bytes span_bytes = spans.spans
    cdef bytes props = spans.props
    cdef list hosts = spans.hosts
    cdef list tags_in = spans.tags, keys_in = spans.keys, ids_in = spans.ids
    cdef Py_ssize_t count = PyBytes_GET_SIZE(span_bytes) // sizeof(tmq_span)
    cdef const tmq_span* sp = <const tmq_span*>PyBytes_AS_STRING(span_bytes)
    cdef const tmq_span* s
    cdef const unsigned char* raw_p = <const unsigned char*>PyBytes_AS_STRING(raw)
    cdef Py_ssize_t raw_n = PyBytes_GET_SIZE(raw), props_n = PyBytes_GET_SIZE(props)
    cdef Py_ssize_t i = start, n = 0, used = 0, size, h
    cdef bint store_v6 = encoder._store_v6
    cdef dict queue_keys = encoder._queue_keys
    cdef dict born_cache = encoder._born_cache
    cdef list queues = out.queues, tags = out.tags, keys = out.keys, uniqs = out.uniq_keys
    cdef list born_ips = []  # by host index, resolved once per call
    cdef list born_v6 = []
    cdef list hold = []
    cdef Rec* recs
    cdef Rec* r
    cdef PyObject* found
    cdef object topic = spans.topic
    cdef object tpart, key
    cdef int64_t q, qid
    cdef int64_t slot_qid[QUEUE_SLOTS]
    cdef PyObject* slot_key[QUEUE_SLOTS]
    cdef int64_t slot_next[QUEUE_SLOTS]
    cdef int slots = 0, j
    cdef bint cached = False
    cdef int64_t per_file = encoder._cq_per_file
    cdef Py_ssize_t entries = 0, starts = 0
    if len(ids_in) != count or len(tags_in) != count or len(keys_in) != count:
        raise RecordError(f"{count} spans but {len(ids_in)} ids, {len(tags_in)} tags and "
                          f"{len(keys_in)} keys")
    if count <= start:
        return start, 0
    found = PyDict_GetItemWithError(encoder._topic_parts, topic)
    tpart = <object>found if found != NULL else encoder._topic_part(topic)
    for address in hosts:
        found = PyDict_GetItemWithError(born_cache, address)
        born = <object>found if found != NULL else encoder._born(address)
        born_ips.append(born[0])
        born_v6.append(born[1])
    recs = <Rec*>malloc(sizeof(Rec) * (count - start))
    if recs == NULL:
        raise MemoryError()
    try:
        while i < count:
            s = &sp[i]
            r = &recs[n]
            # The walker's spans, checked anyway: a bad one must not read outside the buffers.
            if (s.body_at < 0 or s.body_len < 0 or s.body_at > raw_n - s.body_len
                    or s.props_at < 0 or s.props_len < 0 or s.props_at > props_n - s.props_len
                    or s.host < 0 or s.host >= len(hosts)):
                raise RecordError(f"span {i} lies outside its batch")
            if s.props_len > MAX_PROPS:
                raise RecordError(
                    f"properties are {s.props_len} bytes; the format allows {MAX_PROPS}"
                )
            h = <Py_ssize_t>s.host
            r.props_at = s.props_at
            r.props_len = s.props_len
            size = _rec_sized(r, born_v6[h], raw_p + s.body_at, s.body_len, tpart, store_v6)
            if used + size + BLANK > space:
                break
            if s.queue_id < -2147483648 or s.queue_id > 2147483647:
                raise struct.error("'i' format requires -2147483648 <= number <= 2147483647")
            qid = s.queue_id
            _rec_head(r, size, <const unsigned char*>PyBytes_AS_STRING(<bytes>born_ips[h]), 0, 0,
                      s.born_timestamp, 0, 0, <int32_t>qid)
            # The batch's queues by their id (one topic): a queue's key and next offset are
            # looked up once per call, as ``encode_batch`` does by the key's identity.
            j = 0
            while j < slots and slot_qid[j] != qid:
                j += 1
            if j < slots:
                key = <object>slot_key[j]
                q = slot_next[j]
                slot_next[j] = q + 1
            else:
                key = _queue_key(queue_keys, topic, qid, &cached)
                q = _first_offset(next_offsets, base_offsets, key)
                if slots < QUEUE_SLOTS:
                    hold.append(key)  # the slot borrows it
                    slot_qid[slots] = qid
                    slot_key[slots] = <PyObject*>key
                    slot_next[slots] = q + 1
                    slots += 1
                else:  # more queues than slots in one batch: the dict keeps the rest
                    next_offsets[key] = q + 1
            r.queue_offset = q
            r.physical_offset = physical_offset + used
            if q % per_file == 0:
                starts += 1
            PyList_Append(queues, key)
            PyList_Append(tags, tags_in[i])
            kv = keys_in[i]
            PyList_Append(keys, kv)
            entries += _key_entries(kv)
            uv = ids_in[i]
            PyList_Append(uniqs, uv)
            if uv:
                entries += 1
            used += size
            n += 1
            i += 1
        for j in range(slots):
            next_offsets[<object>slot_key[j]] = slot_next[j]
        out.index_entries += entries
        out.cq_starts += starts
        _emit(recs, n, <const unsigned char*>PyBytes_AS_STRING(props), encoder, out,
              sink if i == count else None, used, physical_offset)
    finally:
        free(recs)
    return i, used


def first_unchecked(messages, Py_ssize_t start, set topics, Py_ssize_t max_queue_id,
                    Py_ssize_t max_body):
    """``record.first_unchecked_py``."""
    cdef Py_ssize_t count = len(messages), i
    cdef bint fast
    # The last topic found in ``topics`` (decision 960): a batch's messages mostly share one
    # topic object, which then costs a pointer comparison, not a set lookup. Held here.
    cdef object checked = None
    for i in range(start, count):
        m = messages[i]
        fast = _slots_ok and type(m) is Message
        topic = _field(m, fast, 0)
        if topic is not checked:
            if not PyUnicode_Check(topic) or topic not in topics:
                return i
            if PyUnicode_CheckExact(topic):  # a subclass may hash or compare its own way
                checked = topic
        queue_id = _field(m, fast, 2)
        if type(queue_id) is not int or not 0 <= queue_id <= max_queue_id:
            return i
        body = _field(m, fast, 1)
        if not PyBytes_CheckExact(body) or PyBytes_GET_SIZE(body) > max_body:
            return i
    return count


# -- scans ----------------------------------------------------------------------------------------

cdef struct CrcShift:
    # The scan's record CRC joins the body's CRC instead of reading the body again (decision
    # 650): shifting a CRC over ``length`` bytes is a linear map, applied with four lookups in
    # ``table``, built for one body length at a time once ``SHIFT_AFTER`` records in a row had it.
    int64_t length  # what ``table`` shifts over; -1: none yet
    int64_t seen_length  # the last body length seen, and how many records in a row had it
    int64_t seen
    uint32_t table[4][256]


DEF SHIFT_AFTER = 8


cdef inline void _shift_init(CrcShift* s) noexcept nogil:
    s.length = -1
    s.seen_length = -1
    s.seen = 0


cdef void _shift_build(CrcShift* s, int64_t length) noexcept nogil:
    """``table[k][v]`` = ``v << 8k`` shifted over ``length`` zero bytes: eight products a row,
    the rest by linearity (about 2,000 operations, a few records' CRC)."""
    cdef uint32_t op = tmq_crc32c_zeros_op(<uint64_t>length)
    cdef int k, i
    cdef uint32_t v
    for k in range(4):
        s.table[k][0] = 0
        for i in range(8):
            s.table[k][1 << i] = tmq_multmodp(op, (<uint32_t>1 << i) << (8 * k))
        for v in range(3, 256):
            if v & (v - 1):
                s.table[k][v] = s.table[k][v & (v - 1)] ^ s.table[k][v & (~v + 1)]
    s.length = length


cdef inline bint _shift_ready(CrcShift* s, int64_t length) noexcept nogil:
    """Whether ``s`` shifts over ``length`` bytes, building it when enough records in a row had
    that length (records of one size are the common case; mixed sizes keep the second read)."""
    if s.length == length:
        return True
    if s.seen_length != length:
        s.seen_length = length
        s.seen = 0
    s.seen += 1
    if s.seen < SHIFT_AFTER:
        return False
    _shift_build(s, length)
    return True


cdef inline bint _record_crc_joined(const unsigned char* b, Py_ssize_t pos, int64_t total,
                                    Py_ssize_t body_at, int64_t body_len, uint32_t body_crc,
                                    CrcShift* s) noexcept nogil:
    """``_record_crc_ok`` from the body's CRC: the header's CRC shifted over the body and
    joined with it, extended over topic and properties (as the encoder computes it)."""
    cdef uint32_t whole = tmq_crc32c_extend(0, b + pos, body_at - pos)
    cdef unsigned char pair[CRC_PAIR]
    cdef Py_ssize_t tail = body_at + body_len
    whole = (s.table[0][whole & 0xFF] ^ s.table[1][(whole >> 8) & 0xFF]
             ^ s.table[2][(whole >> 16) & 0xFF] ^ s.table[3][whole >> 24]) ^ body_crc
    whole = tmq_crc32c_extend(whole, b + tail, pos + total - CRC_PAIR - tail)
    _put_crc_pair(pair, whole)
    return memcmp(pair, b + pos + total - CRC_PAIR, CRC_PAIR) == 0


cdef inline int64_t _check(const unsigned char* b, Py_ssize_t n, Py_ssize_t pos, int64_t phys,
                           bint check_phys, bint check_crc) noexcept nogil:
    """``record.validate``: the record's total size, -1 if malformed, -2 if its body fails its
    CRC, -3 if the record fails its record CRC."""
    return _check_shift(b, n, pos, phys, check_phys, check_crc, NULL)


cdef inline int64_t _check_shift(const unsigned char* b, Py_ssize_t n, Py_ssize_t pos,
                                 int64_t phys, bint check_phys, bint check_crc,
                                 CrcShift* shift) noexcept nogil:
    """``_check``; with ``shift``, the record CRC of a run of same-sized bodies reads each
    body once (the scans)."""
    cdef int64_t total, body_len, p, topic_len, props_len, body_at
    cdef int32_t sys_flag
    cdef uint32_t body_crc = 0
    if pos < 0 or pos > n - 48:  # not ``pos + 48 > n``: it overflows near 2**63 (decision 765)
        return -1
    if <int32_t>tmq_be32(b + pos + 4) != MAGIC_V2:
        return -1
    total = <int32_t>tmq_be32(b + pos)
    if total < V4_HEAD + 4 or pos + total > n:
        return -1
    if check_phys and <int64_t>tmq_be64(b + pos + 28) != phys:
        return -1
    sys_flag = <int32_t>tmq_be32(b + pos + 36)
    body_at = pos + 48 + (20 if sys_flag & SYSFLAG_BORN_V6 else 8) + 8 \
        + (20 if sys_flag & SYSFLAG_STORE_V6 else 8) + 16
    if body_at > n:
        return -1
    body_len = <int32_t>tmq_be32(b + body_at - 4)
    if body_len < 0:
        return -1
    p = body_at + body_len
    if p + 2 > n:
        return -1
    topic_len = tmq_be16(b + p)
    if p + 4 + topic_len > n:
        return -1
    props_len = tmq_be16(b + p + 2 + topic_len)
    if p + 4 + topic_len + props_len - pos != total:
        return -1
    if check_crc:
        body_crc = tmq_crc32c_extend3(0, b + body_at, body_len)
        if body_crc != tmq_be32(b + pos + 8):
            return -2
    if sys_flag & ~SYSFLAG_KNOWN:
        return -1
    if sys_flag & SYSFLAG_RECORD_CRC:
        if props_len < CRC_PAIR:
            return -1
        if check_crc:
            if shift != NULL and _shift_ready(shift, body_len):
                if not _record_crc_joined(b, pos, total, body_at, body_len, body_crc, shift):
                    return -3
            elif not _record_crc_ok(b + pos, total):
                return -3
    elif check_crc and _record_crc_flag_lost(b + pos, total):
        return -3
    return total


def scan_records(buf, Py_ssize_t pos, Py_ssize_t limit, int64_t physical_offset, bint check_crc):
    """``record.scan_records_py``: the crash-recovery scan, with the GIL released."""
    cdef const unsigned char[::1] v = _view(buf)
    cdef Py_ssize_t n = v.shape[0], count = 0
    cdef int64_t total
    cdef int32_t magic
    cdef const unsigned char* b = &v[0] if n else NULL
    cdef CrcShift shift
    _shift_init(&shift)
    if limit > n:
        limit = n
    if pos < 0:
        raise ValueError(f"position {pos} is before the buffer")
    with nogil:
        while limit - pos >= BLANK:
            total = <int32_t>tmq_be32(b + pos)
            magic = <int32_t>tmq_be32(b + pos + 4)
            if magic != MAGIC_V2 or not (0 < total <= limit - pos - BLANK):
                break
            if _check_shift(b, n, pos, physical_offset, True, check_crc, &shift) < 0:
                break
            pos += total
            physical_offset += total
            count += 1
    return pos, count


def gather(src, positions, sizes, out, Py_ssize_t at):
    """``record.gather_py``: copy records out of a CommitLog file, with the GIL released."""
    cdef const unsigned char[::1] v = _view(src)
    cdef unsigned char[::1] o = out
    cdef Py_ssize_t n = v.shape[0], room = o.shape[0], i
    at_array = np.ascontiguousarray(positions, np.int64)
    size_array = np.ascontiguousarray(sizes, np.int64)
    cdef const int64_t[::1] p = at_array, sz = size_array
    cdef Py_ssize_t count = p.shape[0]
    cdef int64_t bad = -1
    if sz.shape[0] != count:
        raise ValueError("one size per position")
    with nogil:
        for i in range(count):
            # No ``p + sz > n``: a hostile position or ``at`` near 2**63 overflows it.
            if p[i] < 0 or sz[i] <= 0 or p[i] > n - sz[i] or at < 0 or at > room - sz[i]:
                bad = i
                break
            memcpy(&o[0] + at, &v[0] + p[i], sz[i])
            at += sz[i]
    if bad >= 0:
        raise ValueError(f"record {bad} ({p[bad]}+{sz[bad]}) is outside the source or the output")
    return at


def check_span(buf, positions, sizes, int64_t first_queue_offset):
    """``record.check_span_py``: the cold read's check of a span, with the GIL released."""
    cdef const unsigned char[::1] v = _view(buf)
    cdef Py_ssize_t n = v.shape[0], i
    cdef const unsigned char* b = &v[0] if n else NULL
    at_array = np.ascontiguousarray(positions, np.int64)
    size_array = np.ascontiguousarray(sizes, np.int64)
    cdef const int64_t[::1] at = at_array, sz = size_array
    cdef Py_ssize_t count = at.shape[0]
    cdef int64_t r = 0, bad = -1, pos
    if sz.shape[0] != count:
        raise ValueError("one size per position")
    with nogil:
        for i in range(count):
            pos = at[i]
            if pos < 0 or pos > n - 48:
                r = -1
            else:
                r = _check(b, n, pos, 0, False, True)
            # ``r < 0`` first: a damaged table's size of -1 must not match "not a record" (765)
            if r < 0 or r != sz[i] or <int64_t>tmq_be64(b + pos + 20) != first_queue_offset + i:
                bad = i
                break
    if bad < 0:
        return -1, 0
    return bad, (r if r == -2 or r == -3 else -1)


cdef inline const unsigned char* _prop_value(const unsigned char* p, Py_ssize_t n,
                                             const char* name, Py_ssize_t name_len,
                                             Py_ssize_t* value_len) noexcept nogil:
    """``record._property`` without objects: the value of the first pair named ``name`` (``name``
    includes its \\x01), its length in ``value_len``; NULL when absent."""
    cdef Py_ssize_t at = 0, end
    cdef const unsigned char* hit
    while at <= n:
        hit = <const unsigned char*>memchr(p + at, 2, n - at) if at < n else NULL
        end = (hit - p) if hit != NULL else n
        if end - at >= name_len and memcmp(p + at, name, name_len) == 0:
            hit = <const unsigned char*>memchr(p + at + name_len, 2, n - at - name_len)
            value_len[0] = ((hit - p) if hit != NULL else n) - at - name_len
            return p + at + name_len
        at = end + 1
    return NULL


cdef inline object _find_property(const unsigned char* p, Py_ssize_t n, const char* name,
                                  Py_ssize_t name_len):
    """``record._property``: the first pair named ``name`` (``name`` includes its \\x01)."""
    cdef Py_ssize_t value_len = 0
    cdef const unsigned char* value = _prop_value(p, n, name, name_len, &value_len)
    return None if value == NULL else _utf8_replace(value, value_len)


cdef inline object _utf8_replace(const unsigned char* p, Py_ssize_t n):
    """A property's bytes as ``bytes.decode("utf-8", "replace")`` reads them (decision 660)."""
    return PyUnicode_DecodeUTF8(<const char*>p, n, "replace")


cdef inline object _utf8(const unsigned char* p, Py_ssize_t n):
    try:
        return PyUnicode_DecodeUTF8(<const char*>p, n, NULL)
    except UnicodeDecodeError as e:
        raise RecordError(f"not UTF-8: {e}") from None


cdef dict _topics = {}


def read_dispatch_run(buf, Py_ssize_t pos, Py_ssize_t limit, int64_t base_offset, out,
                      list stamps):
    """``record.read_dispatch_run_py``: the dispatch scan."""
    cdef const unsigned char[::1] v = _view(buf)
    cdef Py_ssize_t n = v.shape[0]
    cdef const unsigned char* b = &v[0] if n else NULL
    cdef list offsets = out.offsets, sizes = out.sizes, qoffs = out.queue_offsets
    cdef list queues = out.queues, tags = out.tags, keys = out.keys, uniqs = out.uniq_keys
    cdef int64_t total, body_len, p, topic_len, props_len, tail, store_ts
    cdef int32_t sys_flag, queue_id
    cdef const unsigned char* prev_raw = NULL
    cdef Py_ssize_t prev_len = -1
    cdef object topic = None
    while pos < limit:
        if pos < 0 or pos > n - 8:
            raise RecordError(f"record at {pos}: runs past the data")
        if <int32_t>tmq_be32(b + pos + 4) != MAGIC_V2:
            break
        if pos > n - 48:
            raise RecordError(f"record at {pos}: runs past the data")
        total = <int32_t>tmq_be32(b + pos)
        queue_id = <int32_t>tmq_be32(b + pos + 12)
        sys_flag = <int32_t>tmq_be32(b + pos + 36)
        tail = pos + 48 + (20 if sys_flag & SYSFLAG_BORN_V6 else 8)
        if tail + 8 + (20 if sys_flag & SYSFLAG_STORE_V6 else 8) + 16 > n:
            raise RecordError(f"record at {pos}: runs past the data")
        store_ts = <int64_t>tmq_be64(b + tail)
        tail += 8 + (20 if sys_flag & SYSFLAG_STORE_V6 else 8) + 16
        body_len = <int32_t>tmq_be32(b + tail - 4)
        p = tail + body_len
        if total <= 0 or body_len < 0 or p + 2 > n:
            raise RecordError(f"record at {pos}: fields run past the data")
        topic_len = tmq_be16(b + p)
        if p + 4 + topic_len > n:
            raise RecordError(f"record at {pos}: runs past the data")
        if prev_raw == NULL or topic_len != prev_len or memcmp(prev_raw, b + p + 2, topic_len):
            raw_topic = PyBytes_FromStringAndSize(<const char*>b + p + 2, topic_len)
            topic = _topics.get(raw_topic)
            if topic is None:
                topic = _utf8(b + p + 2, topic_len)
                if len(_topics) < 100_000:
                    _topics[raw_topic] = topic
            prev_raw = b + p + 2
            prev_len = topic_len
        p += 2 + topic_len
        props_len = tmq_be16(b + p)
        if p + 2 + props_len > n:
            raise RecordError(f"record at {pos}: runs past the data")
        if props_len:
            tags.append(_find_property(b + p + 2, props_len, b"TAGS\x01", 5))
            keys.append(_find_property(b + p + 2, props_len, b"KEYS\x01", 5))
            uniqs.append(_find_property(b + p + 2, props_len, b"UNIQ_KEY\x01", 9))
        else:
            PyList_Append(tags, None)
            PyList_Append(keys, None)
            PyList_Append(uniqs, None)
        PyList_Append(offsets, base_offset + pos)
        PyList_Append(sizes, total)
        PyList_Append(qoffs, <int64_t>tmq_be64(b + pos + 20))
        PyList_Append(queues, (topic, queue_id))
        PyList_Append(stamps, store_ts)
        pos += total
    return pos


# -- hashes -------------------------------------------------------------------------------------

cdef inline uint32_t _str_crc(uint32_t crc, object s) except? 0xFFFFFFFF:
    cdef Py_ssize_t n
    cdef const char* p = PyUnicode_AsUTF8AndSize(s, &n)
    return tmq_crc32c_extend(crc, <const unsigned char*>p, n) if n else crc


def tag_hashes(tags):
    """``record.tag_hashes_py``."""
    cdef Py_ssize_t n = len(tags), i
    result = np.zeros(n, np.int64)
    cdef int64_t[::1] out = result
    for i in range(n):
        t = tags[i]
        if t:
            out[i] = _str_crc(0, t)
    return result


cdef struct Pairs:
    int64_t* hashes
    int64_t* numbers
    Py_ssize_t len
    Py_ssize_t cap


cdef int _pair(Pairs* s, int64_t h, int64_t number) except -1:
    cdef Py_ssize_t cap
    if s.len == s.cap:
        cap = max(1024, s.cap * 2)
        s.hashes = <int64_t*>realloc(s.hashes, cap * sizeof(int64_t))
        s.numbers = <int64_t*>realloc(s.numbers, cap * sizeof(int64_t))
        if s.hashes == NULL or s.numbers == NULL:
            raise MemoryError()
        s.cap = cap
    s.hashes[s.len] = h
    s.numbers[s.len] = number
    s.len += 1
    return 0


cdef int _index_pairs(list queues, list keys, list uniq_keys, Pairs* out,
                      const int64_t* fields=NULL, const int* qnum=NULL, const char* skipq=NULL,
                      int64_t index_from=0) except -1:
    """The pairs of ``index_keys``; with ``fields`` (``CqPass.fields``), only those of records at
    or past ``index_from`` whose queue (``qnum``) ``skipq`` does not mark."""
    cdef Py_ssize_t n = len(queues), i, kn, at, end
    cdef uint32_t base
    cdef const char* kp
    cdef const char* hit
    cdef PyObject* last_topic = NULL
    for i in range(n):
        uniq = uniq_keys[i]
        k = keys[i]
        if not uniq and not k:
            continue
        if fields != NULL and (fields[4 * i] < index_from or skipq[qnum[i]]):
            continue
        topic = (<tuple>queues[i])[0]
        if <PyObject*>topic != last_topic:  # a pass's records mostly share their topic
            base = _str_crc(0, topic)
            base = tmq_crc32c_extend(base, <const unsigned char*>b"#", 1)
            last_topic = <PyObject*>topic
        if uniq:
            _pair(out, _str_crc(base, uniq) & 0x7FFFFFFF, i)
        if k:
            kp = PyUnicode_AsUTF8AndSize(k, &kn)
            at = 0
            while at < kn:
                hit = <const char*>memchr(kp + at, 32, kn - at)
                end = (hit - kp) if hit != NULL else kn
                if end > at:
                    _pair(out, tmq_crc32c_extend(
                        base, <const unsigned char*>kp + at, end - at) & 0x7FFFFFFF, i)
                at = end + 1
    return 0


def index_entry_count(keys, uniq_keys):
    """``record.index_entry_count_py``: the keys of ``KEYS`` counted as ``_index_pairs`` splits
    them, without hashing or allocating."""
    cdef list ks = keys if type(keys) is list else list(keys)
    cdef list us = uniq_keys if type(uniq_keys) is list else list(uniq_keys)
    cdef Py_ssize_t count = 0, kn, at, end, i
    cdef const char* kp
    cdef const char* hit
    for i in range(len(us)):
        if us[i]:
            count += 1
    for i in range(len(ks)):
        k = ks[i]
        if not k:
            continue
        kp = PyUnicode_AsUTF8AndSize(k, &kn)
        at = 0
        while at < kn:
            hit = <const char*>memchr(kp + at, 32, kn - at)
            end = (hit - kp) if hit != NULL else kn
            if end > at:
                count += 1
            at = end + 1
    return count


def index_keys(queues, keys, uniq_keys):
    """``record.index_keys_py``."""
    cdef Pairs pairs
    pairs.hashes = NULL
    pairs.numbers = NULL
    pairs.len = 0
    pairs.cap = 0
    try:
        _index_pairs(list(queues), list(keys), list(uniq_keys), &pairs)
        hashes = np.empty(pairs.len, np.int64)
        numbers = np.empty(pairs.len, np.int64)
        if pairs.len:
            memcpy(<void*><size_t>hashes.ctypes.data, pairs.hashes, pairs.len * 8)
            memcpy(<void*><size_t>numbers.ctypes.data, pairs.numbers, pairs.len * 8)
    finally:
        free(pairs.hashes)
        free(pairs.numbers)
    return hashes, numbers


# -- segment build ------------------------------------------------------------------------------

def segment_tables(records, int64_t base_offset):
    """``record.segment_tables_py``: checks and tables of a segment object. The columns (tag
    hash, key hashes, store time) come from ``dispatch_columns``, in C from the bytes; a run it
    does not take whole (text that is not UTF-8, bytes that are not a record) goes the way
    that names the problem, ``_segment_tables_checked``."""
    cdef const unsigned char[::1] v = _view(records)
    cdef Py_ssize_t n = v.shape[0], count, i
    cdef const unsigned char* b = &v[0] if n else NULL
    cdef int64_t r = 0
    end, status, columns = dispatch_columns(records, 0, n, 0, False, False, n // 90 + 1)
    count = len(columns[0])
    if status != 0 or end != n or count == 0:
        return _segment_tables_checked(records, base_offset)
    positions, sizes, qoffs, _, tags, times, hashes, numbers, _ = columns
    cdef int64_t[::1] at = positions
    with nogil:
        for i in range(count):
            r = _check(b, n, at[i], <int64_t>tmq_be64(b + at[i] + 28), True, True)
            if r < 0:
                break
    expected = np.arange(base_offset, base_offset + count, dtype=np.int64)
    if r < 0 or not np.array_equal(qoffs, expected):
        return _segment_tables_checked(records, base_offset)  # raises, naming the record
    return _tables(count, positions, sizes, tags, hashes, numbers, times)


def _tables(Py_ssize_t count, positions, sizes, tags, hashes, numbers, times):
    """The segment's offset table, time table and key index (sorted by hash, then record) from
    its columns."""
    table = np.empty(count, [("offset", ">i8"), ("size", ">i4"), ("tag", ">i8")])
    table["offset"] = positions
    table["size"] = sizes
    table["tag"] = tags
    packed = np.sort((hashes.astype(np.uint64) << np.uint64(32)) | numbers.astype(np.uint64))
    return SegmentTables(
        count=count,
        offset_table=table.tobytes(),
        time_table=times.astype(">i8").tobytes(),
        key_index=packed.astype(">u8").tobytes(),
        key_count=len(packed),
        min_store_timestamp=int(times.min()),
        max_store_timestamp=int(times.max()),
    )


def _segment_tables_checked(records, int64_t base_offset):
    """``segment_tables`` record by record through ``read_dispatch_run``: the same tables, and
    for a run that is not whole and clean, the error that names the record."""
    cdef const unsigned char[::1] v = _view(records)
    cdef Py_ssize_t n = v.shape[0], count, i, end
    cdef const unsigned char* b = &v[0] if n else NULL
    cdef int64_t r, bad = -1, bad_kind = 0, pos, size
    fields = EncodedBatch()
    cdef list stamps = []
    end = read_dispatch_run(records, 0, n, 0, fields, stamps)
    count = len(fields.offsets)
    if count == 0:
        raise RecordError("a segment needs at least one record")
    if end != n:
        raise RecordError(f"bytes at {end} are not a record")
    positions = np.asarray(fields.offsets, np.int64)
    sizes = np.asarray(fields.sizes, np.int64)
    qoffs = np.asarray(fields.queue_offsets, np.int64)
    cdef int64_t[::1] at = positions, sz = sizes, qo = qoffs
    with nogil:
        for i in range(count):
            r = _check(b, n, at[i], <int64_t>tmq_be64(b + at[i] + 28), True, True)
            if r < 0:
                bad = i
                bad_kind = r
                break
    if bad >= 0:
        pos = at[bad]
        if bad_kind == -2:
            raise CorruptRecordError(
                f"record at physical offset {<int64_t>tmq_be64(b + pos + 28)}: body CRC mismatch"
            )
        if bad_kind == -3:
            raise RecordCrcError(
                f"record at physical offset {<int64_t>tmq_be64(b + pos + 28)}: record CRC mismatch"
            )
        raise RecordError(f"record at {pos}: fields do not add up to its total size")
    for i in range(count):
        if qo[i] != base_offset + i:
            raise RecordError(f"record has queue offset {qo[i]}, expected {base_offset + i}")
    hashes, numbers = index_keys(fields.queues, fields.keys, fields.uniq_keys)
    return _tables(
        count, positions, sizes, tag_hashes(fields.tags), hashes, numbers,
        np.asarray(stamps, np.int64),
    )


# -- decode a run into Arrow --------------------------------------------------------------------

class Anomaly(ValueError):
    """A record ``record.decode`` may refuse: the caller lets ``decode`` say what."""


DEF MAX_COLUMN = 2147483647  # int32 offsets of binary/string columns

cdef struct Spans:
    int64_t body_at
    int64_t body_len
    int64_t topic_at
    int64_t topic_len
    int64_t props_at
    int64_t props_len
    int64_t born_at
    int64_t store_at


cdef int64_t _locate(const unsigned char* b, Py_ssize_t length, int64_t pos, bint check_crc,
                     Spans* s) noexcept nogil:
    """Where each part of the record at ``pos`` is; 0, or -1 for an anomaly."""
    cdef int64_t total, end, born_at, store_ts_at, reconsume_at, body_len_at, p
    cdef int32_t sys_flag
    if pos < 0 or pos > length - V4_HEAD:  # not ``pos + V4_HEAD``: overflow (decision 765)
        return -1
    total = <int32_t>tmq_be32(b + pos)
    if <int32_t>tmq_be32(b + pos + 4) != MAGIC_V2:
        return -1
    if total < V4_HEAD + 4 or pos + total > length:
        return -1
    end = pos + total
    sys_flag = <int32_t>tmq_be32(b + pos + 36)
    born_at = pos + 48
    store_ts_at = born_at + (20 if sys_flag & SYSFLAG_BORN_V6 else 8)
    reconsume_at = store_ts_at + 8 + (20 if sys_flag & SYSFLAG_STORE_V6 else 8)
    body_len_at = reconsume_at + 12
    s.body_at = body_len_at + 4
    if s.body_at > end:
        return -1
    s.body_len = <int32_t>tmq_be32(b + body_len_at)
    p = s.body_at + s.body_len
    if s.body_len < 0 or p + 2 > end:
        return -1
    s.topic_len = tmq_be16(b + p)
    s.topic_at = p + 2
    p = s.topic_at + s.topic_len
    if p + 2 > end:
        return -1
    s.props_len = tmq_be16(b + p)
    s.props_at = p + 2
    if s.props_at + s.props_len != end:
        return -1
    s.born_at = born_at
    s.store_at = store_ts_at + 8
    if check_crc and tmq_crc32c_extend(0, b + s.body_at, s.body_len) != tmq_be32(b + pos + 8):
        return -1
    if sys_flag & ~SYSFLAG_KNOWN:
        return -1
    if sys_flag & SYSFLAG_RECORD_CRC:
        # The record CRC pair ends the properties; no decoded field holds it.
        if s.props_len < CRC_PAIR:
            return -1
        if check_crc and not _record_crc_ok(b + pos, total):
            return -1
        s.props_len -= CRC_PAIR
    elif check_crc and _record_crc_flag_lost(b + pos, total):
        return -1
    return 0


cdef object _binary_array(object pa, Py_ssize_t n, object offsets, object values):
    return pa.Array.from_buffers(
        pa.binary(), n, [None, pa.py_buffer(offsets), pa.py_buffer(values)]
    )


cdef object _host(const unsigned char* p, bint v6, dict names, object host_string):
    """``ip:port`` of the host at ``p``, formatted once per distinct host."""
    cdef int w = 16 if v6 else 4
    key = PyBytes_FromStringAndSize(<const char*>p, w + 4)
    name = names.get(key)
    if name is None:
        import socket
        address = socket.inet_ntop(socket.AF_INET6 if v6 else socket.AF_INET, key[:w])
        name = host_string(address, <int32_t>tmq_be32(p + w))
        names[key] = name
    return name


def decode_run(buf, positions, bint check_crc):
    """``columnar.decode_run``: the records at ``positions`` (a non-empty int64 array) as one
    ``columnar.RECORD_SCHEMA`` batch. Raises ``Anomaly`` for a record ``record.decode`` would
    refuse (the caller asks ``decode`` for the error)."""
    import pyarrow as pa
    from tiered.columnar import RECORD_SCHEMA, host_string

    cdef const unsigned char[::1] v = _view(buf)
    cdef Py_ssize_t length = v.shape[0]
    cdef const unsigned char* b = &v[0] if length else NULL
    at_array = np.ascontiguousarray(positions, np.int64)
    cdef const int64_t[::1] at = at_array
    cdef Py_ssize_t n = at.shape[0], i, k
    cdef Spans* spans = <Spans*>malloc(sizeof(Spans) * max(n, 1))
    if spans == NULL:
        raise MemoryError()
    size_a = np.empty(n, np.int32)
    crc_a = np.empty(n, np.int64)
    qid_a = np.empty(n, np.int32)
    flag_a = np.empty(n, np.int32)
    qoff_a = np.empty(n, np.int64)
    phys_a = np.empty(n, np.int64)
    sys_a = np.empty(n, np.int32)
    born_ts_a = np.empty(n, np.int64)
    store_ts_a = np.empty(n, np.int64)
    recon_a = np.empty(n, np.int32)
    prep_a = np.empty(n, np.int64)
    body_off_a = np.empty(n + 1, np.int32)
    topic_off_a = np.empty(n + 1, np.int32)
    cdef int32_t[::1] size_v = size_a, qid_v = qid_a, flag_v = flag_a, sys_v = sys_a
    cdef int32_t[::1] recon_v = recon_a, body_off = body_off_a, topic_off = topic_off_a
    cdef int64_t[::1] crc_v = crc_a, qoff_v = qoff_a, phys_v = phys_a, born_ts_v = born_ts_a
    cdef int64_t[::1] store_ts_v = store_ts_a, prep_v = prep_a
    cdef int64_t bad = -1, pos, body_total = 0, topic_total = 0, props_total = 0, pairs = 0
    cdef Spans* s
    try:
        with nogil:
            for i in range(n):
                pos = at[i]
                s = &spans[i]
                if _locate(b, length, pos, check_crc, s) < 0:
                    bad = i
                    break
                size_v[i] = <int32_t>tmq_be32(b + pos)
                crc_v[i] = tmq_be32(b + pos + 8)
                qid_v[i] = <int32_t>tmq_be32(b + pos + 12)
                flag_v[i] = <int32_t>tmq_be32(b + pos + 16)
                qoff_v[i] = <int64_t>tmq_be64(b + pos + 20)
                phys_v[i] = <int64_t>tmq_be64(b + pos + 28)
                sys_v[i] = <int32_t>tmq_be32(b + pos + 36)
                born_ts_v[i] = <int64_t>tmq_be64(b + pos + 40)
                store_ts_v[i] = <int64_t>tmq_be64(b + s.store_at - 8)
                k = s.store_at + (20 if sys_v[i] & SYSFLAG_STORE_V6 else 8)
                recon_v[i] = <int32_t>tmq_be32(b + k)
                prep_v[i] = <int64_t>tmq_be64(b + k + 4)
                body_total += s.body_len
                topic_total += s.topic_len
                props_total += s.props_len
                # Upper bound of pairs: one per separator, plus an unterminated last one.
                pairs += s.props_len // 2 + 1
        if bad >= 0:
            raise Anomaly(f"record at {at[bad]} is not one decode accepts")
        if max(body_total, topic_total, props_total) > MAX_COLUMN:
            raise ValueError("a run of more than 2 GiB of one column: decode it in smaller runs")
        body_values = np.empty(body_total, np.uint8)
        topic_values = np.empty(topic_total, np.uint8)
        name_values = np.empty(props_total, np.uint8)
        value_values = np.empty(props_total, np.uint8)
        map_off_a = np.empty(n + 1, np.int32)
        name_off_a = np.empty(pairs + 1, np.int32)
        value_off_a = np.empty(pairs + 1, np.int32)
        repeats = np.zeros(n, np.uint8)
        count = _fill(b, spans, n, body_values, body_off_a, topic_values, topic_off_a,
                      name_values, name_off_a, value_values, value_off_a, map_off_a, repeats)
        # A replaced value is not in the columns, whose UTF-8 check comes below: decode refuses
        # a record whose properties are not UTF-8 as a whole, so check those records here.
        for i in np.flatnonzero(repeats).tolist():
            try:
                PyUnicode_DecodeUTF8(<const char*>b + spans[i].props_at, spans[i].props_len, NULL)
            except UnicodeDecodeError as e:
                raise Anomaly(str(e)) from None
        born_names: dict = {}
        store_names: dict = {}
        born_hosts = [
            _host(b + spans[i].born_at, sys_v[i] & SYSFLAG_BORN_V6, born_names, host_string)
            for i in range(n)
        ]
        store_hosts = [
            _host(b + spans[i].store_at, sys_v[i] & SYSFLAG_STORE_V6, store_names, host_string)
            for i in range(n)
        ]
    finally:
        free(spans)
    try:
        topic = _binary_array(pa, n, topic_off_a, topic_values).cast(pa.string())
        names = _binary_array(pa, count, name_off_a[: count + 1], name_values).cast(pa.string())
        values = _binary_array(pa, count, value_off_a[: count + 1], value_values).cast(pa.string())
    except pa.ArrowInvalid as e:  # invalid UTF-8
        raise Anomaly(str(e)) from None
    return pa.RecordBatch.from_arrays(
        [
            pa.array(size_a),
            pa.array(crc_a),
            pa.array(qid_a),
            pa.array(flag_a),
            pa.array(qoff_a),
            pa.array(phys_a),
            pa.array(sys_a),
            pa.array(born_ts_a),
            pa.array(born_hosts, pa.string()),
            pa.array(store_ts_a),
            pa.array(store_hosts, pa.string()),
            pa.array(recon_a),
            pa.array(prep_a),
            _binary_array(pa, n, body_off_a, body_values),
            topic,
            pa.MapArray.from_arrays(pa.array(map_off_a), names, values),
        ],
        schema=RECORD_SCHEMA,
    )


cdef Py_ssize_t _fill(const unsigned char* b, Spans* spans, Py_ssize_t n,
                      unsigned char[::1] body, int32_t[::1] body_off,
                      unsigned char[::1] topic, int32_t[::1] topic_off,
                      unsigned char[::1] names, int32_t[::1] name_off,
                      unsigned char[::1] values, int32_t[::1] value_off,
                      int32_t[::1] map_off, uint8_t[::1] repeats):
    """Copy bodies and topics into their columns, and split properties into map entries with
    ``record.decode_properties``'s rules: empty pairs are skipped, a pair without ``\\x01`` is a
    name with an empty value, a value runs to the pair's end, and a repeated name keeps its first
    position and its last value. Returns the number of map entries."""
    cdef Py_ssize_t i, count = 0, first, j
    cdef int64_t bo = 0, to = 0, no = 0, vo = 0, at, end, pair_end, name_end, nlen, vlen
    cdef const unsigned char* p
    cdef const unsigned char* hit
    cdef unsigned char* nb = &names[0] if names.shape[0] else NULL
    cdef unsigned char* vb = &values[0] if values.shape[0] else NULL
    cdef int64_t* vstart = NULL
    cdef int64_t* vend = NULL
    cdef Spans* s
    body_off[0] = 0
    topic_off[0] = 0
    name_off[0] = 0
    value_off[0] = 0
    map_off[0] = 0
    with nogil:
        for i in range(n):
            s = &spans[i]
            if s.body_len:
                memcpy(&body[bo], b + s.body_at, s.body_len)
            bo += s.body_len
            body_off[i + 1] = <int32_t>bo
            if s.topic_len:
                memcpy(&topic[to], b + s.topic_at, s.topic_len)
            to += s.topic_len
            topic_off[i + 1] = <int32_t>to
            first = count
            p = b + s.props_at
            at = 0
            while at < s.props_len:
                hit = <const unsigned char*>memchr(p + at, 2, s.props_len - at)
                pair_end = (hit - p) if hit != NULL else s.props_len
                if pair_end > at:
                    hit = <const unsigned char*>memchr(p + at, 1, pair_end - at)
                    name_end = (hit - p) if hit != NULL else pair_end
                    nlen = name_end - at
                    vlen = pair_end - name_end - 1 if hit != NULL else 0
                    # A name seen earlier in this record: its value is replaced in place.
                    j = first
                    while j < count:
                        if (name_off[j + 1] - name_off[j] == nlen
                                and memcmp(nb + name_off[j], p + at, nlen) == 0):
                            break
                        j += 1
                    if j < count:
                        repeats[i] = 1
                        _replace_value(vb, value_off, j, count, p + name_end + 1, vlen)
                        vo = value_off[count]
                    else:
                        if nlen:
                            memcpy(nb + no, p + at, nlen)
                        no += nlen
                        name_off[count + 1] = <int32_t>no
                        if vlen:
                            memcpy(vb + vo, p + name_end + 1, vlen)
                        vo += vlen
                        value_off[count + 1] = <int32_t>vo
                        count += 1
                at = pair_end + 1
            map_off[i + 1] = <int32_t>count
    return count


cdef void _replace_value(unsigned char* vb, int32_t[::1] value_off, Py_ssize_t j,
                         Py_ssize_t count, const unsigned char* value,
                         int64_t vlen) noexcept nogil:
    """Replace entry ``j``'s value (entries ``j+1 .. count-1`` follow it) by ``value``: the
    later entries' bytes move by the difference in length. Repeated names are rare."""
    cdef int64_t old_start = value_off[j], old_end = value_off[j + 1]
    cdef int64_t tail = value_off[count] - old_end
    cdef int64_t delta = vlen - (old_end - old_start)
    cdef Py_ssize_t k
    if delta != 0 and tail:
        memmove(vb + old_end + delta, vb + old_end, tail)
    if vlen:
        memcpy(vb + old_start, value, vlen)
    for k in range(j + 1, count + 1):
        value_off[k] = <int32_t>(value_off[k] + delta)


# -- decode a run into StoredMessage objects ---------------------------------------------------

cdef object StoredMessage = None
cdef object decode_properties = None
cdef object decode_one = None


def bind_decode(record_module):
    """Take the record module's decoder and message type (called once by ``tiered.record``)."""
    global StoredMessage, decode_properties, decode_one
    StoredMessage = record_module.StoredMessage
    decode_properties = record_module.decode_properties
    decode_one = record_module.decode


cdef object _host_tuple(const unsigned char* p, bint v6, dict cache):
    cdef int w = 16 if v6 else 4
    key = PyBytes_FromStringAndSize(<const char*>p, w + 4)
    host = cache.get(key)
    if host is None:
        import socket
        address = socket.inet_ntop(socket.AF_INET6 if v6 else socket.AF_INET, key[:w])
        host = (address, <int32_t>tmq_be32(p + w))
        cache[key] = host
    return host


cdef dict _properties(const unsigned char* p, Py_ssize_t n):
    """``record.decode_properties`` of ``n`` bytes at ``p``: ``name\\x01value`` pairs separated
    by ``\\x02``, empty pairs skipped, a pair without ``\\x01`` a name with an empty value, a
    later name replacing an earlier one, bytes that are not UTF-8 read as U+FFFD. Both
    separators are ASCII, so decoding each part on its own replaces exactly what the
    reference's decode of the whole replaces."""
    cdef dict props = {}
    cdef Py_ssize_t at = 0, end, eq
    while at < n:
        end = at
        while end < n and p[end] != 2:
            end += 1
        if end > at:
            eq = at
            while eq < end and p[eq] != 1:
                eq += 1
            name = PyUnicode_DecodeUTF8(<const char*>p + at, eq - at, "replace")
            if eq < end:
                props[name] = PyUnicode_DecodeUTF8(<const char*>p + eq + 1, end - eq - 1,
                                                   "replace")
            else:
                props[name] = ""
        at = end + 1
    return props


def decode_many(buf, positions, bint check_crc):
    """``record.decode_many_py``: ``decode`` of the record at each position. A record the
    reference refuses is handed to ``record.decode``, which raises its error."""
    cdef const unsigned char[::1] v = _view(buf)
    cdef Py_ssize_t length = v.shape[0], i, n = len(positions)
    cdef const unsigned char* b = &v[0] if length else NULL
    cdef Spans s
    cdef int64_t pos, k
    cdef int32_t sys_flag
    cdef dict hosts = {}
    cdef list out = []
    for i in range(n):
        pos = positions[i]
        if _locate(b, length, pos, check_crc, &s) < 0:
            out.append(decode_one(buf, pos, check_crc=check_crc))  # raises its own error
            continue
        try:
            topic = PyUnicode_DecodeUTF8(<const char*>b + s.topic_at, s.topic_len, NULL)
            properties = _properties(b + s.props_at, s.props_len) if s.props_len else {}
        except UnicodeDecodeError:
            out.append(decode_one(buf, pos, check_crc=check_crc))
            continue
        sys_flag = <int32_t>tmq_be32(b + pos + 36)
        k = s.store_at + (20 if sys_flag & SYSFLAG_STORE_V6 else 8)
        out.append(StoredMessage(
            topic,
            <int32_t>tmq_be32(b + pos + 12),
            <int64_t>tmq_be64(b + pos + 20),
            <int64_t>tmq_be64(b + pos + 28),
            <int32_t>tmq_be32(b + pos),
            PyBytes_FromStringAndSize(<const char*>b + s.body_at, s.body_len),
            tmq_be32(b + pos + 8),
            <int32_t>tmq_be32(b + pos + 16),
            sys_flag,
            <int64_t>tmq_be64(b + pos + 40),
            _host_tuple(b + s.born_at, sys_flag & SYSFLAG_BORN_V6, hosts),
            <int64_t>tmq_be64(b + s.store_at - 8),
            _host_tuple(b + s.store_at, sys_flag & SYSFLAG_STORE_V6, hosts),
            <int32_t>tmq_be32(b + k),
            <int64_t>tmq_be64(b + k + 4),
            properties,
        ))
    return out


# -- dispatch columns (restart) -------------------------------------------------------------------
#
# ``record.dispatch_columns_py``: one pass over a run of records that emits what dispatch needs
# as flat columns (offset, size, queue offset, queue number, tag hash, store timestamp, and the
# IndexFile key hashes with their record numbers), with the GIL released for the whole run. With
# ``validate`` it is also the recovery scan (``scan_records``), so a restart reads each byte once.

from libc.string cimport memset

DEF COL_MAX_TOPICS = 256
DEF COL_TOPIC_SLOTS = 512
DEF COL_MAX_QUEUES = 4096
DEF COL_QUEUE_SLOTS = 8192

cdef struct ColBuf:
    int64_t* offset
    int64_t* size
    int64_t* qoff
    int64_t* qidx
    int64_t* tag
    int64_t* stamp
    Py_ssize_t len
    Py_ssize_t cap
    int64_t* khash
    int64_t* knum
    Py_ssize_t klen
    Py_ssize_t kcap
    # distinct topics of the run: where their bytes are in the buffer
    const unsigned char* topic_p[COL_MAX_TOPICS]
    Py_ssize_t topic_n[COL_MAX_TOPICS]
    uint32_t topic_crc[COL_MAX_TOPICS]  # CRC32C of ``topic#``, the start of every key hash
    int32_t topic_slot[COL_TOPIC_SLOTS]  # open addressing: topic number + 1, 0 empty
    Py_ssize_t topics
    int32_t last_topic  # the previous record's topic number: checked before hashing
    # distinct (topic number, queue id) pairs
    int64_t queue_key[COL_MAX_QUEUES]
    int64_t queue_slot_key[COL_QUEUE_SLOTS]
    int32_t queue_slot[COL_QUEUE_SLOTS]  # queue number + 1, 0 empty
    Py_ssize_t queues
    CrcShift shift  # the validating scan's record CRC (decision 650)


cdef inline bint _col_key(ColBuf* c, int64_t h, int64_t number) noexcept nogil:
    c.khash[c.klen] = h  # room was checked for the whole record (``_col_record``)
    c.knum[c.klen] = number
    c.klen += 1
    return True


cdef bint _utf8_ok(const unsigned char* s, Py_ssize_t n) noexcept nogil:
    """Whether ``s`` is what Python's strict UTF-8 decoder accepts (no overlong forms, no
    surrogates, nothing past U+10FFFF)."""
    cdef Py_ssize_t i = 0
    cdef unsigned int c, c1
    cdef uint64_t w
    while i + 8 <= n:  # ASCII eight bytes at a time (keys and tags mostly are)
        memcpy(&w, s + i, 8)
        if w & <uint64_t>0x8080808080808080:
            break
        i += 8
    while i < n:
        c = s[i]
        if c < 0x80:
            i += 1
            continue
        if c < 0xC2 or c > 0xF4:
            return False
        if c < 0xE0:
            if i + 1 >= n or (s[i + 1] & 0xC0) != 0x80:
                return False
            i += 2
            continue
        if c < 0xF0:
            if i + 2 >= n:
                return False
            c1 = s[i + 1]
            if (c1 & 0xC0) != 0x80 or (s[i + 2] & 0xC0) != 0x80:
                return False
            if (c == 0xE0 and c1 < 0xA0) or (c == 0xED and c1 >= 0xA0):
                return False
            i += 3
            continue
        if i + 3 >= n:
            return False
        c1 = s[i + 1]
        if (c1 & 0xC0) != 0x80 or (s[i + 2] & 0xC0) != 0x80 or (s[i + 3] & 0xC0) != 0x80:
            return False
        if (c == 0xF0 and c1 < 0x90) or (c == 0xF4 and c1 >= 0x90):
            return False
        i += 4
    return True


cdef int _col_topic(ColBuf* c, const unsigned char* p, Py_ssize_t n, uint32_t h,
                    Py_ssize_t* slot_out) noexcept nogil:
    """The topic's number in this run, or -1 with ``slot_out`` where it would go."""
    cdef Py_ssize_t slot = h & (COL_TOPIC_SLOTS - 1)
    cdef int32_t t
    while True:
        t = c.topic_slot[slot]
        if t == 0:
            slot_out[0] = slot
            return -1
        t -= 1
        if c.topic_n[t] == n and memcmp(c.topic_p[t], p, n) == 0:
            return t
        slot = (slot + 1) & (COL_TOPIC_SLOTS - 1)


cdef int64_t _col_queue(ColBuf* c, int64_t key, Py_ssize_t* slot_out) noexcept nogil:
    """The (topic number, queue id) pair's number in this run, or -1 with ``slot_out``."""
    cdef uint64_t mixed = <uint64_t>key * <uint64_t>0x9E3779B97F4A7C15
    cdef Py_ssize_t slot = <Py_ssize_t>(mixed >> 51) & (COL_QUEUE_SLOTS - 1)
    cdef int32_t q
    while True:
        q = c.queue_slot[slot]
        if q == 0:
            slot_out[0] = slot
            return -1
        if c.queue_slot_key[slot] == key:
            return q - 1
        slot = (slot + 1) & (COL_QUEUE_SLOTS - 1)


cdef inline void _col_props(const unsigned char* p, Py_ssize_t n,
                            const unsigned char** tags, Py_ssize_t* tags_n,
                            const unsigned char** uniq, Py_ssize_t* uniq_n,
                            const unsigned char** keys, Py_ssize_t* keys_n) noexcept nogil:
    """``_prop_value`` for TAGS, UNIQ_KEY and KEYS in one pass over the pairs: the first pair
    of each name (a name includes its \\x01)."""
    cdef Py_ssize_t at = 0, end, m
    cdef const unsigned char* hit
    while at <= n:
        hit = <const unsigned char*>memchr(p + at, 2, n - at) if at < n else NULL
        end = (hit - p) if hit != NULL else n
        m = end - at
        if m >= 5 and keys[0] == NULL and memcmp(p + at, b"KEYS\x01", 5) == 0:
            keys[0] = p + at + 5
            keys_n[0] = m - 5
        elif m >= 5 and tags[0] == NULL and memcmp(p + at, b"TAGS\x01", 5) == 0:
            tags[0] = p + at + 5
            tags_n[0] = m - 5
        elif m >= 9 and uniq[0] == NULL and memcmp(p + at, b"UNIQ_KEY\x01", 9) == 0:
            uniq[0] = p + at + 9
            uniq_n[0] = m - 9
        at = end + 1


cdef int _col_record(ColBuf* c, const unsigned char* b, Py_ssize_t n, Py_ssize_t pos,
                     int64_t base_offset) noexcept nogil:
    """Append the record at ``pos`` to the columns: 0 done, 1 a table is full (nothing
    taken), 2 the record cannot be taken (fields past the data, or text that is not UTF-8;
    nothing taken), 3 out of memory."""
    cdef int64_t total, body_len, p, topic_len, props_len, tail, number, queue, key
    cdef int32_t sys_flag, topic
    cdef const unsigned char* tp
    cdef const unsigned char* tags = NULL
    cdef const unsigned char* uniq = NULL
    cdef const unsigned char* keys = NULL
    cdef Py_ssize_t tags_n = 0, uniq_n = 0, keys_n = 0, at, end, topic_at = 0, queue_at = 0
    cdef Py_ssize_t need
    cdef uint32_t h, base
    if pos + 48 > n:
        return 2
    total = <int32_t>tmq_be32(b + pos)
    sys_flag = <int32_t>tmq_be32(b + pos + 36)
    tail = pos + 48 + (20 if sys_flag & SYSFLAG_BORN_V6 else 8)
    if tail + 8 + (20 if sys_flag & SYSFLAG_STORE_V6 else 8) + 16 > n:
        return 2
    body_len = <int32_t>tmq_be32(b + tail + 8 + (20 if sys_flag & SYSFLAG_STORE_V6 else 8) + 12)
    p = tail + 8 + (20 if sys_flag & SYSFLAG_STORE_V6 else 8) + 16 + body_len
    if total <= 0 or body_len < 0 or p + 2 > n:
        return 2
    topic_len = tmq_be16(b + p)
    if p + 4 + topic_len > n:
        return 2
    tp = b + p + 2
    props_len = tmq_be16(b + p + 2 + topic_len)
    if p + 4 + topic_len + props_len > n:
        return 2
    # Everything that can refuse the record is checked before anything is taken.
    h = 0
    topic = c.last_topic
    if topic < 0 or c.topic_n[topic] != topic_len or memcmp(c.topic_p[topic], tp, topic_len):
        h = tmq_crc32c_extend(0, tp, topic_len) if topic_len else 0
        topic = _col_topic(c, tp, topic_len, h, &topic_at)
    if topic < 0:
        if c.topics == COL_MAX_TOPICS:
            return 1
        if not _utf8_ok(tp, topic_len):
            return 2
        key = (<int64_t>c.topics << 32) | <uint32_t>tmq_be32(b + pos + 12)
        queue = -1
    else:
        key = (<int64_t>topic << 32) | <uint32_t>tmq_be32(b + pos + 12)
        queue = _col_queue(c, key, &queue_at)
    if queue < 0 and c.queues == COL_MAX_QUEUES:
        return 1
    if props_len:
        p += 4 + topic_len
        _col_props(b + p, props_len, &tags, &tags_n, &uniq, &uniq_n, &keys, &keys_n)
        if ((tags != NULL and not _utf8_ok(tags, tags_n))
                or (uniq != NULL and not _utf8_ok(uniq, uniq_n))
                or (keys != NULL and not _utf8_ok(keys, keys_n))):
            return 2
    need = 1 if uniq_n else 0
    at = 0
    while at < keys_n:
        end = at
        while end < keys_n and keys[end] != 32:
            end += 1
        need += end > at
        at = end + 1
    if c.len == c.cap or c.klen + need > c.kcap:
        return 1  # the arrays are full: the caller takes the rest in another call
    if topic < 0:
        topic = <int32_t>c.topics
        c.topics += 1
        c.topic_p[topic] = tp
        c.topic_n[topic] = topic_len
        c.topic_crc[topic] = tmq_crc32c_extend(h, <const unsigned char*>b"#", 1)
        c.topic_slot[topic_at] = topic + 1
        queue = _col_queue(c, key, &queue_at)
    if queue < 0:
        queue = c.queues
        c.queues += 1
        c.queue_key[queue] = key
        c.queue_slot_key[queue_at] = key
        c.queue_slot[queue_at] = <int32_t>queue + 1
    number = c.len
    c.offset[number] = base_offset + pos
    c.size[number] = total
    c.qoff[number] = <int64_t>tmq_be64(b + pos + 20)
    c.qidx[number] = queue
    c.stamp[number] = <int64_t>tmq_be64(b + tail)
    c.tag[number] = tmq_crc32c_extend(0, tags, tags_n) if tags_n else 0
    base = c.topic_crc[topic]
    if uniq_n and not _col_key(c, tmq_crc32c_extend(base, uniq, uniq_n) & 0x7FFFFFFF, number):
        return 3
    at = 0
    while at < keys_n:
        end = at
        while end < keys_n and keys[end] != 32:
            end += 1
        if end > at and not _col_key(
                c, tmq_crc32c_extend(base, keys + at, end - at) & 0x7FFFFFFF, number):
            return 3
        at = end + 1
    c.len += 1
    c.last_topic = topic
    return 0


def dispatch_columns(buf, Py_ssize_t pos, Py_ssize_t limit, int64_t base_offset, bint validate,
                     bint check_crc, Py_ssize_t max_records):
    """``record.dispatch_columns_py``."""
    cdef const unsigned char[::1] v = _view(buf)
    cdef Py_ssize_t n = v.shape[0], count = 0, i
    cdef const unsigned char* b = &v[0] if n else NULL
    cdef int64_t total
    cdef int32_t magic
    cdef int status = 0
    cdef ColBuf* c
    if limit > n:
        limit = n
    if pos < 0:
        raise ValueError(f"position {pos} is before the buffer")
    c = <ColBuf*>malloc(sizeof(ColBuf))
    if c == NULL:
        raise MemoryError()
    memset(c, 0, sizeof(ColBuf))
    _shift_init(&c.shift)
    c.last_topic = -1
    # The columns are written straight into numpy arrays (untouched pages cost nothing); when
    # they are full the call returns early (status 1). A record is at least 90 bytes, and its
    # properties hold at most 32,769 keys: the encoder writes 32 KiB of them, but the length
    # field allows 65,535 bytes (a record from a master or an object store), one-byte keys
    # and their separators, and UNIQ_KEY. Room for that one record is what keeps status 1
    # from answering "nothing taken" at the same place forever (decision 431).
    c.cap = max(1, min(max_records, (limit - pos) // 90 + 1))
    c.kcap = 2 * c.cap + 32_769
    cdef list arrays = [np.empty(c.cap, np.int64) for i in range(6)]
    cdef list key_arrays = [np.empty(c.kcap, np.int64) for i in range(2)]
    cdef int64_t[::1] a_offset = arrays[0], a_size = arrays[1], a_qoff = arrays[2]
    cdef int64_t[::1] a_qidx = arrays[3], a_tag = arrays[4], a_stamp = arrays[5]
    cdef int64_t[::1] a_khash = key_arrays[0], a_knum = key_arrays[1]
    c.offset = &a_offset[0]
    c.size = &a_size[0]
    c.qoff = &a_qoff[0]
    c.qidx = &a_qidx[0]
    c.tag = &a_tag[0]
    c.stamp = &a_stamp[0]
    c.khash = &a_khash[0]
    c.knum = &a_knum[0]
    try:
        with nogil:
            if validate:
                while limit - pos >= BLANK:
                    total = <int32_t>tmq_be32(b + pos)
                    magic = <int32_t>tmq_be32(b + pos + 4)
                    if magic != MAGIC_V2 or not (0 < total <= limit - pos - BLANK):
                        break
                    if _check_shift(b, n, pos, base_offset + pos, True, check_crc,
                                    &c.shift) < 0:
                        break
                    if c.len == max_records:
                        status = 1
                        break
                    status = _col_record(c, b, n, pos, base_offset)
                    if status:
                        break
                    pos += total
            else:
                while pos < limit:
                    if pos + 8 > n or <int32_t>tmq_be32(b + pos + 4) != MAGIC_V2:
                        status = 2 if pos + 8 > n else 0
                        break
                    if c.len == max_records:
                        status = 1
                        break
                    status = _col_record(c, b, n, pos, base_offset)
                    if status:
                        break
                    pos += <int32_t>tmq_be32(b + pos)
        topics = [_utf8(c.topic_p[i], c.topic_n[i]) for i in range(c.topics)]
        queues = [(topics[c.queue_key[i] >> 32], <int32_t><uint32_t>c.queue_key[i])
                  for i in range(c.queues)]
        count = c.len
        columns = (*[a[:count] for a in arrays], *[a[:c.klen] for a in key_arrays], queues)
    finally:
        free(c)
    return pos, status, columns


# -- the gRPC SendMessage answer ---------------------------------------------------------------

cdef inline unsigned char* _bytes_field(unsigned char* o, unsigned char tag, const char* p,
                                        Py_ssize_t n) noexcept nogil:
    """A length-delimited protobuf field: tag, varint length, bytes."""
    o[0] = tag
    o = write_varint(o + 1, n)
    memcpy(o, p, n)
    return o + n


cdef inline Py_ssize_t _entry_len(Py_ssize_t st_len, Py_ssize_t id_len, uint64_t off) noexcept nogil:
    return (1 + varint_len(st_len) + st_len + 2 * (1 + varint_len(id_len) + id_len)
            + 1 + varint_len(off))


def send_results(bytes status, list message_ids, list offsets):
    """``broker.protocol.send_results_py``: a serialized ``SendMessageResponse`` whose status
    and every entry's status is ``status`` (a serialized ``Status``), entry ``i`` carrying
    ``message_ids[i]`` as message and transaction id and ``offsets[i]``; one call per batch
    instead of a protobuf ``add`` per message."""
    cdef Py_ssize_t k = len(message_ids), i, total, st_len = len(status), id_len, entry
    cdef const char* idp
    cdef const char* stp = status
    cdef unsigned char* o
    cdef uint64_t off
    cdef bytes out
    if len(offsets) != k:
        raise ValueError(f"{k} message ids but {len(offsets)} offsets")
    total = 1 + varint_len(st_len) + st_len
    for i in range(k):
        PyUnicode_AsUTF8AndSize(message_ids[i], &id_len)
        entry = _entry_len(st_len, id_len, <uint64_t><int64_t>offsets[i])
        total += 1 + varint_len(entry) + entry
    out = PyBytes_FromStringAndSize(NULL, total)
    o = _bytes_field(<unsigned char*>PyBytes_AS_STRING(out), 0x0A, stp, st_len)
    for i in range(k):
        idp = PyUnicode_AsUTF8AndSize(message_ids[i], &id_len)
        off = <uint64_t><int64_t>offsets[i]
        o[0] = 0x12
        o = write_varint(o + 1, _entry_len(st_len, id_len, off))
        o = _bytes_field(o, 0x0A, stp, st_len)
        o = _bytes_field(o, 0x12, idp, id_len)
        o = _bytes_field(o, 0x1A, idp, id_len)
        o[0] = 0x20
        o = write_varint(o + 1, off)
    return out


# -- writing a batch into a CommitLog file ------------------------------------------------------

cdef extern from "sys/uio.h" nogil:
    cdef struct iovec:
        void* iov_base
        size_t iov_len
    ssize_t pwritev(int fd, const iovec* iov, int iovcnt, int64_t offset)

cdef extern from "errno.h" nogil:
    int errno
    int EINTR

cdef extern from "Python.h":
    object PyErr_SetFromErrno(object exc)

DEF IOV_BATCH = 1024  # Linux's IOV_MAX
cdef unsigned char _ZERO_SIZE[4]  # static: zero


cdef int _pwrite_all(int fd, iovec* iov, int count, int64_t at) noexcept nogil:
    """Write every byte of ``iov`` at ``at`` (short writes resumed); -1 with errno on failure."""
    cdef ssize_t done
    cdef int first = 0, step
    while first < count:
        step = count - first if count - first < IOV_BATCH else IOV_BATCH
        done = pwritev(fd, iov + first, step, at)
        if done < 0:
            if errno == EINTR:
                continue
            return -1
        at += done
        while first < count and <size_t>done >= iov[first].iov_len:
            done -= iov[first].iov_len
            first += 1
        if done > 0:
            iov[first].iov_base = <unsigned char*>iov[first].iov_base + done
            iov[first].iov_len -= done
    return 0


def append_records(int fd, mm, Py_ssize_t pos, data, offsets, int64_t base,
                   Py_ssize_t pwrite_min, between):
    """``MappedFile.append_records_py`` without the copies: ``data`` (whole records; record ``i``
    starts at ``offsets[i] - base``) goes to the file at ``pos`` with every record's 4-byte size
    field written as zero, by one ``pwritev`` that skips the fields (a store through the mapping
    below ``pwrite_min`` bytes); ``between()`` is called (the failpoint), then the size fields
    are stored through the mapping ``mm`` record by record, front to back. ``data`` is not
    modified, so it may be ``bytes``."""
    cdef const unsigned char[::1] d = _view(data)
    cdef unsigned char[::1] m = mm
    cdef Py_ssize_t n = d.shape[0], k = len(offsets), i, s, e, prev = -1
    cdef Py_ssize_t* starts
    cdef iovec* iov
    cdef int used = 0, failed = 0
    if n == 0:
        return
    if pos < 0 or pos + n > m.shape[0]:
        raise ValueError(f"{n} bytes at {pos} do not fit in a {m.shape[0]}-byte file")
    starts = <Py_ssize_t*>malloc(sizeof(Py_ssize_t) * (k + 1))
    iov = <iovec*>malloc(sizeof(iovec) * (2 * k + 1))
    if starts == NULL or iov == NULL:
        free(starts)
        free(iov)
        raise MemoryError()
    try:
        for i in range(k):
            s = <Py_ssize_t>(<int64_t>offsets[i] - base)
            if s <= prev or s + 4 > n:
                raise ValueError(f"record {i} starts at {s}: outside the data or out of order")
            starts[i] = prev = s
        starts[k] = n
        if k == 0 or starts[0] > 0:
            iov[0].iov_base = <void*>&d[0]
            iov[0].iov_len = starts[0] if k else n
            used = 1
        for i in range(k):
            s, e = starts[i], starts[i + 1]
            iov[used].iov_base = <void*>_ZERO_SIZE
            iov[used].iov_len = 4
            iov[used + 1].iov_base = <void*>&d[s + 4]
            iov[used + 1].iov_len = e - s - 4
            used += 2
        if n < pwrite_min:
            # A small store through the mapping keeps the GIL (see _NOGIL_MIN).
            s = pos
            for i in range(used):
                memcpy(&m[s], iov[i].iov_base, iov[i].iov_len)
                s += iov[i].iov_len
        else:
            with nogil:
                if _pwrite_all(fd, iov, used, pos) < 0:
                    failed = 1
        _set_sizes(failed, between, &m[0], pos, &d[0], starts, k)
    finally:
        free(starts)
        free(iov)


cdef int _encode_into(tuple sink, Rec* recs, Py_ssize_t n, const unsigned char* props,
                      const unsigned char* store_ip, bint store_v6, int32_t store_port,
                      int64_t store_ts, Py_ssize_t used, int64_t base) except -1:
    """``encode_batch``'s records encoded into a buffer and written, size fields in place, by one
    ``pwrite`` in the same release of the GIL (decision 1040): every record carries the record
    CRC (decision 210), so a write cut short by ``kill -9`` (a prefix of the batch, ending at a
    file page) leaves whole records, at most one torn record that fails its CRC, and zeros,
    which recovery ends the log at. ``append_records``'s size-field guard (decision 260) is not
    needed here; it stays there for bytes this encoder did not write. ``cut``, when given (the
    ``commitlog.mid_write`` failpoint), is called between two halves of the write split at the
    first file page past the batch's middle, as the kernel cuts a ``pwrite`` on a fatal
    signal."""
    fd_obj, mm, pos_obj, cut = sink
    cdef int fd = fd_obj
    cdef Py_ssize_t pos = pos_obj, split = used
    cdef unsigned char[::1] m = mm
    cdef unsigned char* buf
    cdef iovec iov
    cdef int failed = 0
    if pos < 0 or pos + used > m.shape[0]:
        raise ValueError(f"{used} bytes at {pos} do not fit in a {m.shape[0]}-byte file")
    buf = <unsigned char*>malloc(used)
    if buf == NULL:
        raise MemoryError()
    if cut is not None:
        split = ((pos + used // 2) // 4096 + 1) * 4096 - pos
        if split >= used:
            split = used // 2
    try:
        with nogil:
            _write_records(buf, recs, n, props, store_ip, store_v6, store_port, store_ts)
            iov.iov_base = <void*>buf
            iov.iov_len = split
            if _pwrite_all(fd, &iov, 1, pos) < 0:
                failed = 1
        if failed:
            PyErr_SetFromErrno(OSError)
            return -1
        if split < used:
            cut()
            iov.iov_base = <void*>(buf + split)
            iov.iov_len = used - split
            with nogil:
                if _pwrite_all(fd, &iov, 1, pos + split) < 0:
                    failed = 1
            if failed:
                PyErr_SetFromErrno(OSError)
                return -1
    finally:
        free(buf)
    return 0


cdef int _set_sizes(int failed, object between, unsigned char* m, Py_ssize_t pos,
                    const unsigned char* d, const Py_ssize_t* starts, Py_ssize_t k) except -1:
    """After the ``pwritev`` that left every size field zero: raise its error, else call the
    failpoint, then store the size fields (``d``'s, record ``i`` at ``starts[i]``) through the
    mapping ``m`` at ``pos``, front to back."""
    cdef Py_ssize_t i
    if failed:
        PyErr_SetFromErrno(OSError)
        return -1
    if between is not None:
        between()
    for i in range(k):
        memcpy(m + pos + starts[i], d + starts[i], 4)
    return 0


# -- the dispatch's ConsumeQueue and IndexFile entries (decision 540) ---------------------------

DEF CQ_ENTRY_BYTES = 20
DEF KEY_CACHE = 64  # queue keys of a pass remembered by address (``cq_blocks``)


cdef struct CqRun:
    Py_ssize_t record  # the run's first record
    int64_t first_q
    Py_ssize_t count
    Py_ssize_t at
    int64_t end


cdef struct CqPass:
    int64_t* fields  # offset, size, queue offset, tag code per record
    int* qnum  # each record's queue number in this pass (first appearance)
    Py_ssize_t* order  # records grouped by queue, in record order within each
    Py_ssize_t* starts
    CqRun* runs
    Py_ssize_t n  # records
    Py_ssize_t k  # queues
    Py_ssize_t r  # runs


cdef void _cq_free(CqPass* p) noexcept:
    free(p.fields)
    free(p.qnum)
    free(p.order)
    free(p.runs)
    free(p.starts)
    p.fields = NULL
    p.qnum = NULL
    p.order = NULL
    p.runs = NULL
    p.starts = NULL


cdef object _cq_build(offsets, sizes, queue_offsets, list keys, list tag_list, dict tag_codes,
                      list queue_keys, CqPass* p):
    """``cq_blocks``' work: numbers the queues (their keys appended to ``queue_keys`` in order
    of first appearance), packs every entry into the returned bytes, queue by queue, and cuts
    the runs into ``p`` (the caller frees ``p`` with ``_cq_free``, also on error)."""
    # The encoder's columns are int64 arrays (decision 600), read in place; lists are copied.
    cdef bint packed = (type(offsets) is array.array and type(sizes) is array.array
                        and type(queue_offsets) is array.array and offsets.typecode == "q"
                        and sizes.typecode == "q" and queue_offsets.typecode == "q")
    cdef const int64_t[::1] v_off, v_size, v_q
    cdef list offs = None, szs = None, qoffs = None
    if packed:
        v_off = offsets
        v_size = sizes
        v_q = queue_offsets
    else:
        offs = list(offsets)
        szs = list(sizes)
        qoffs = list(queue_offsets)
    cdef Py_ssize_t n = len(offsets), i, j, k = 0, at, r = 0
    if not len(sizes) == len(queue_offsets) == len(keys) == len(tag_list) == n:
        raise ValueError("cq_blocks: the field lists differ in length")
    cdef dict numbers = {}  # queue key -> its number in this pass (first appearance)
    cdef PyObject* cache_key[KEY_CACHE]
    cdef int cache_num[KEY_CACHE]
    cdef PyObject* last_tag = NULL
    cdef int64_t last_code = 0
    cdef size_t h
    cdef int64_t* fields
    cdef int* qnum
    cdef Py_ssize_t* starts
    cdef Py_ssize_t* order
    cdef CqRun* runs
    cdef unsigned char* o
    cdef int64_t q, prev_q
    cdef int num, prev_num
    for j in range(KEY_CACHE):
        cache_key[j] = NULL
    p.n = n
    out = PyBytes_FromStringAndSize(NULL, n * CQ_ENTRY_BYTES)
    p.fields = fields = <int64_t*>malloc((n * 4 + 1) * sizeof(int64_t))
    p.qnum = qnum = <int*>malloc((n + 1) * sizeof(int))
    p.order = order = <Py_ssize_t*>malloc((n + 1) * sizeof(Py_ssize_t))
    p.runs = runs = <CqRun*>malloc((n + 1) * sizeof(CqRun))
    if fields == NULL or qnum == NULL or order == NULL or runs == NULL:
        raise MemoryError()
    for i in range(n):
        if packed:
            fields[4 * i] = v_off[i]
            fields[4 * i + 1] = <int32_t>v_size[i]
            fields[4 * i + 2] = v_q[i]
        else:
            fields[4 * i] = offs[i]
            fields[4 * i + 1] = <int32_t>szs[i]
            fields[4 * i + 2] = qoffs[i]
        t = tag_list[i]
        if <PyObject*>t != last_tag:
            found = tag_codes.get(t)
            if found is None:
                found = _str_crc(0, t) if t else 0
                tag_codes[t] = found
            last_tag = <PyObject*>t
            last_code = found
        fields[4 * i + 3] = last_code
        key = keys[i]
        h = (<size_t><PyObject*>key >> 4) % KEY_CACHE
        if cache_key[h] == <PyObject*>key:
            qnum[i] = cache_num[h]
            continue
        found = numbers.get(key)
        if found is None:
            found = numbers[key] = k
            queue_keys.append(key)
            k += 1
        qnum[i] = found
        cache_key[h] = <PyObject*>key  # alive in ``keys`` for the whole call
        cache_num[h] = found
    p.k = k
    p.starts = starts = <Py_ssize_t*>calloc(k + 1, sizeof(Py_ssize_t))
    if starts == NULL:
        raise MemoryError()
    o = <unsigned char*>PyBytes_AS_STRING(out)
    with nogil:
        # A counting sort by queue number: each queue's records together, in record order.
        for i in range(n):
            starts[qnum[i] + 1] += 1
        for j in range(k):
            starts[j + 1] += starts[j]
        for i in range(n):
            order[starts[qnum[i]]] = i
            starts[qnum[i]] += 1
        prev_num = -1
        prev_q = -2
        for at in range(n):
            i = order[at]
            num = qnum[i]
            q = fields[4 * i + 2]
            tmq_put64(o + at * CQ_ENTRY_BYTES, <uint64_t>fields[4 * i])
            tmq_put32(o + at * CQ_ENTRY_BYTES + 8, <uint32_t>fields[4 * i + 1])
            tmq_put64(o + at * CQ_ENTRY_BYTES + 12, <uint64_t>fields[4 * i + 3])
            if num == prev_num and q == prev_q + 1:
                runs[r - 1].count += 1
                runs[r - 1].end = fields[4 * i] + fields[4 * i + 1]
            else:
                runs[r].record = i
                runs[r].first_q = q
                runs[r].count = 1
                runs[r].at = at * CQ_ENTRY_BYTES
                runs[r].end = fields[4 * i] + fields[4 * i + 1]
                r += 1
            prev_num = num
            prev_q = q
    p.r = r
    return out


def cq_blocks(offsets, sizes, queue_offsets, queues, tags, dict tag_codes):
    """``record.cq_blocks_py``: the fields are read with the GIL (a tag's code from
    ``tag_codes``, a queue's number found by the key's address, else by equality), then the
    entries are sorted by queue, packed and cut into runs without it."""
    cdef CqPass p
    cdef Py_ssize_t j
    cdef list keys = list(queues)
    p.fields = NULL
    p.qnum = NULL
    p.order = NULL
    p.runs = NULL
    p.starts = NULL
    try:
        out = _cq_build(offsets, sizes, queue_offsets, keys, list(tags), tag_codes, [], &p)
        result = [
            (keys[p.runs[j].record], p.runs[j].first_q, p.runs[j].count, p.runs[j].at,
             p.runs[j].end)
            for j in range(p.r)
        ]
    finally:
        _cq_free(&p)
    return out, result


DEF INDEX_HEADER = 40
DEF INDEX_ENTRY = 20


cdef inline int64_t _slot_find(int64_t* table, Py_ssize_t mask, int64_t slot) noexcept nogil:
    """The position of ``slot`` in the open-addressing ``table`` (pairs: slot, newest entry
    number; a free pair's slot is -1), or of the free pair where it goes."""
    cdef Py_ssize_t p = <Py_ssize_t>((<uint64_t>slot * 0x9E3779B97F4A7C15ULL) >> 32) & mask
    while table[2 * p] != -1 and table[2 * p] != slot:
        p = (p + 1) & mask
    return p


cdef int64_t _index_put_raw(unsigned char* slots, int fd, Py_ssize_t slot_count, int64_t first,
                            int64_t begin_timestamp, const int64_t* hv, const int64_t* ov,
                            const int64_t* tv, Py_ssize_t n, unsigned char* buf, int64_t* table,
                            Py_ssize_t mask, int* failed) noexcept nogil:
    """``index_put``'s work without the GIL: the entries built in ``buf`` and written by
    ``pwrite``, then the slots stored at ``slots`` (the mapping's slot table); ``table`` holds
    ``2 * (mask + 1)`` int64. Returns how many slots were empty; ``failed`` (errno set) when the
    ``pwrite`` failed, and then no slot is stored."""
    cdef Py_ssize_t i, p
    cdef int64_t slot, prev, held, seconds, empty = 0
    cdef iovec iov
    for p in range(mask + 1):
        table[2 * p] = -1
    for i in range(n):
        slot = hv[i] % slot_count
        if slot < 0:
            slot += slot_count
        p = _slot_find(table, mask, slot)
        if table[2 * p] == slot:
            prev = table[2 * p + 1]
        else:
            held = <int32_t>tmq_be32(slots + slot * 4)
            prev = 0 if held < 0 or held >= first else held  # ahead of the saved header
            if prev == 0:
                empty += 1
            table[2 * p] = slot
        table[2 * p + 1] = first + i
        seconds = tv[i] - begin_timestamp
        seconds = 0 if seconds < 0 else seconds // 1000
        if seconds > 0x7FFFFFFF:
            seconds = 0x7FFFFFFF
        tmq_put32(buf + i * INDEX_ENTRY, <uint32_t>hv[i])
        tmq_put64(buf + i * INDEX_ENTRY + 4, <uint64_t>ov[i])
        tmq_put32(buf + i * INDEX_ENTRY + 12, <uint32_t>seconds)
        tmq_put32(buf + i * INDEX_ENTRY + 16, <uint32_t>prev)
    iov.iov_base = buf
    iov.iov_len = n * INDEX_ENTRY
    failed[0] = _pwrite_all(fd, &iov, 1, INDEX_HEADER + slot_count * 4 + first * INDEX_ENTRY) != 0
    if not failed[0]:
        for p in range(mask + 1):
            if table[2 * p] != -1:
                tmq_put32(slots + table[2 * p] * 4, <uint32_t>table[2 * p + 1])
    return empty


cdef inline Py_ssize_t _index_mask(Py_ssize_t n) noexcept nogil:
    cdef Py_ssize_t mask = 15
    while mask + 1 < 2 * n:
        mask = mask * 2 + 1
    return mask


def index_put(mm, int fd, Py_ssize_t slot_count, int64_t first, int64_t begin_timestamp,
              hashes, offsets, timestamps):
    """``record.index_put_py`` in one release of the GIL: the entries are built and written by
    ``pwrite``, then the slots are stored through the mapping."""
    cdef unsigned char[::1] m = mm
    cdef const int64_t[::1] hv = np.ascontiguousarray(hashes, np.int64)
    cdef const int64_t[::1] ov = np.ascontiguousarray(offsets, np.int64)
    cdef const int64_t[::1] tv = np.ascontiguousarray(timestamps, np.int64)
    cdef Py_ssize_t n = hv.shape[0], mask
    cdef int64_t empty = 0
    cdef unsigned char* buf = NULL
    cdef int64_t* table = NULL
    cdef int failed = 0
    if ov.shape[0] != n or tv.shape[0] != n:
        raise ValueError("index_put: hashes, offsets and timestamps differ in length")
    if slot_count <= 0 or INDEX_HEADER + slot_count * 4 > m.shape[0]:
        raise ValueError(f"index_put: {slot_count} slots do not fit the mapping")
    if n == 0:
        return 0
    mask = _index_mask(n)
    try:
        buf = <unsigned char*>malloc(n * INDEX_ENTRY)
        table = <int64_t*>malloc((mask + 1) * 2 * sizeof(int64_t))
        if buf == NULL or table == NULL:
            raise MemoryError()
        with nogil:
            empty = _index_put_raw(&m[0] + INDEX_HEADER, fd, slot_count, first, begin_timestamp,
                                   &hv[0], &ov[0], &tv[0], n, buf, table, mask, &failed)
        if failed:
            PyErr_SetFromErrno(OSError)
    finally:
        free(buf)
        free(table)
    return empty


DEF INDEX_CHECK_STEP = 1 << 20  # record.INDEX_CHECK_STEP
DEF _PREFETCH_AHEAD = 16

cdef extern from *:
    void __builtin_prefetch(const void* p) noexcept nogil


cdef inline int64_t _floor_mod(int64_t a, int64_t m) noexcept nogil:
    """Python's ``a % m`` for ``m > 0`` (numpy's too): never negative."""
    cdef int64_t r = a % m
    return r + m if r < 0 else r


cdef int _index_check_raw(const unsigned char* b, int64_t slot_count, int64_t n,
                          int64_t begin_offset, bint full, int64_t* where) noexcept nogil:
    """``record.index_check_py`` over the file's bytes ``b`` (its checks, in its order)."""
    cdef const unsigned char* slots = b + INDEX_HEADER
    cdef const unsigned char* entries = slots + slot_count * 4
    cdef const unsigned char* e
    cdef int64_t s, head, ahead, i, lo, hi, last, offset, prev, h, wrong = -1
    # One pass over the slots: a slot out of range anywhere is reported before a slot naming
    # an entry of another slot (the reference checks all of the first before the second).
    for s in range(slot_count):
        if full and s + _PREFETCH_AHEAD < slot_count:
            # The slots' entries lie all over the file: ask for one a few slots ahead, so the
            # cache misses overlap instead of following one another.
            ahead = <int32_t>tmq_be32(slots + (s + _PREFETCH_AHEAD) * 4)
            if 0 < ahead < n:
                __builtin_prefetch(entries + ahead * INDEX_ENTRY)
        head = <int32_t>tmq_be32(slots + s * 4)
        if head < 0 or head >= n:
            where[0] = s
            return 1
        if full and head != 0 and wrong < 0:
            if _floor_mod(<int32_t>tmq_be32(entries + head * INDEX_ENTRY), slot_count) != s:
                wrong = s
    if not full:
        return 0
    if wrong >= 0:
        where[0] = wrong
        return 2
    last = begin_offset
    lo = 1
    while lo < n:
        hi = min(n, lo + INDEX_CHECK_STEP)
        for i in range(lo, hi):
            e = entries + i * INDEX_ENTRY
            h = <int32_t>tmq_be32(e)
            offset = <int64_t>tmq_be64(e + 4)
            prev = <int32_t>tmq_be32(e + 16)
            if (h < 0 or prev < 0 or prev >= i or offset < last
                    or <int32_t>tmq_be32(e + 12) < 0):
                where[0] = i
                return 3
            last = offset
        for i in range(lo, hi):
            e = entries + i * INDEX_ENTRY
            prev = <int32_t>tmq_be32(e + 16)
            if prev > 0:
                h = <int32_t>tmq_be32(e)
                if (_floor_mod(<int32_t>tmq_be32(entries + prev * INDEX_ENTRY), slot_count)
                        != _floor_mod(h, slot_count)):
                    where[0] = i
                    return 3
        lo = hi
    return 0


def index_check(mm, Py_ssize_t slot_count, Py_ssize_t n, int64_t begin_offset, bint full):
    """``record.index_check_py`` in one release of the GIL: ``(kind, slot or entry number)``."""
    cdef const unsigned char[::1] m = mm
    cdef int64_t where = 0
    cdef int kind
    if slot_count <= 0 or n < 1 or INDEX_HEADER + slot_count * 4 + n * INDEX_ENTRY > m.shape[0]:
        raise ValueError(f"index_check: {slot_count} slots and {n} entries do not fit the mapping")
    with nogil:
        kind = _index_check_raw(&m[0], slot_count, n, begin_offset, full, &where)
    return kind, where


# -- a whole dispatch pass in one call (decision 695) -------------------------------------------

cdef struct CqQueue:
    int64_t max_off
    int64_t min_off
    int64_t phys_end
    int64_t tail_from
    int64_t tail_size
    int64_t wrote
    unsigned char* base  # the tail file's mapping (held as a buffer export), NULL for none
    bint slow  # every run of this queue goes through ``ConsumeQueue.put_block``
    bint touched


cdef int _write_index_header(int fd, object h) except -1:
    """``IndexFile._write_header``: the header's six fields, big-endian, by ``pwrite``."""
    cdef unsigned char b[INDEX_HEADER]
    cdef iovec iov
    tmq_put64(b, <uint64_t><int64_t>h.begin_timestamp)
    tmq_put64(b + 8, <uint64_t><int64_t>h.end_timestamp)
    tmq_put64(b + 16, <uint64_t><int64_t>h.begin_offset)
    tmq_put64(b + 24, <uint64_t><int64_t>h.end_offset)
    tmq_put32(b + 32, <uint32_t><int32_t>h.used_slots)
    tmq_put32(b + 36, <uint32_t><int32_t>h.next_entry)
    iov.iov_base = b
    iov.iov_len = INDEX_HEADER
    if _pwrite_all(fd, &iov, 1, 0) != 0:
        PyErr_SetFromErrno(OSError)
        return -1
    return 0


def dispatch_pass(offsets, sizes, queue_offsets, queues, tags, keys, uniq_keys, stamps,
                  int64_t store_ts, dict tag_codes, cq_table, int64_t index_from, unindexed,
                  index, put_index):
    """``record.dispatch_pass_py``: a pass's ConsumeQueue entries and IndexFile entries in one
    call, with Python only where a file must be created or an entry is not the next one.

    ConsumeQueue: every entry is packed as ``cq_blocks`` packs it; a queue whose runs all
    continue its last entry inside its tail file (``ConsumeQueue._tail``) has them copied into
    that file's mapping, then its ``max_offset``, ``min_offset``, ``max_physical_end`` and the
    file's ``wrote`` set, as ``put_block`` sets them. Any other queue (no tail yet, a run that
    crosses the file's end, a gap, a re-dispatch) has all its runs given to ``put_block``, in
    order. IndexFile: the entries (``index_keys``, less those below ``index_from`` and those of
    ``unindexed`` topics) go to the newest file by ``_index_put_raw`` without the GIL, and its
    header is updated and written as ``IndexFile.put_many`` and ``advance`` do, when they are in
    CommitLog order and fit it; else ``put_index`` (``Dispatcher._put_index_entries``) takes
    them. The ConsumeQueues are done first: if one fails (a full disk on a roll), no IndexFile
    entry of the pass is written, so a retried pass indexes each record once."""
    cdef CqPass p
    cdef list qkeys = list(queues), queue_keys = [], cqs = [], tails = []
    cdef list key_list, uniq_list
    cdef CqQueue* qs = NULL
    cdef CqQueue* st
    cdef Py_buffer* bufs = NULL
    cdef char* held = NULL
    cdef char* skipq = NULL
    cdef Pairs pairs
    cdef int64_t* io = NULL
    cdef int64_t* it = NULL
    cdef unsigned char* ibuf = NULL
    cdef int64_t* table = NULL
    cdef Py_buffer ib
    cdef bint ib_held = False
    cdef Py_ssize_t j, i, c, m, mask, num
    cdef int64_t q, pos, end, begin, tmax, space, first, empty = 0, bt
    cdef bint any_slow = False, ordered = True
    cdef int failed = 0, fd
    cdef Py_ssize_t slot_count
    cdef const int64_t[::1] v_stamps
    cdef bint packed_stamps = False
    cdef unsigned char* o
    p.fields = NULL
    p.qnum = NULL
    p.order = NULL
    p.runs = NULL
    p.starts = NULL
    pairs.hashes = NULL
    pairs.numbers = NULL
    pairs.len = 0
    pairs.cap = 0
    try:
        out = _cq_build(offsets, sizes, queue_offsets, qkeys, list(tags), tag_codes, queue_keys,
                        &p)
        if p.n == 0:
            return None
        qs = <CqQueue*>calloc(p.k, sizeof(CqQueue))
        bufs = <Py_buffer*>calloc(p.k, sizeof(Py_buffer))
        held = <char*>calloc(p.k, 1)
        skipq = <char*>calloc(p.k, 1)
        if qs == NULL or bufs == NULL or held == NULL or skipq == NULL:
            raise MemoryError()
        # -- ConsumeQueues: each queue's state, read once ---------------------------------------
        table_of = cq_table.queues
        for j in range(p.k):
            key = queue_keys[j]
            cq = table_of.get(key)
            if cq is None:
                cq = cq_table.get_or_create(key[0], key[1])
            cqs.append(cq)
            st = &qs[j]
            st.max_off = cq.max_offset
            st.min_off = cq.min_offset
            st.phys_end = cq.max_physical_end
            tail = cq._tail
            tails.append(tail)
            if tail is None:
                st.slow = True
                continue
            st.tail_from = tail.from_offset
            st.tail_size = tail.size
            st.wrote = tail.wrote
            # A buffer export: the mapping cannot be closed under the copy below.
            PyObject_GetBuffer(tail.mm, &bufs[j], PyBUF_WRITABLE)
            held[j] = 1
            if bufs[j].len < st.tail_size:
                st.slow = True
                continue
            st.base = <unsigned char*>bufs[j].buf
        # Each run, in order, as ``put_block`` would take it: only the next entries of a queue,
        # inside its tail file, are copied here.
        for j in range(p.r):
            st = &qs[p.qnum[p.runs[j].record]]
            if st.slow:
                continue
            q = p.runs[j].first_q
            c = p.runs[j].count
            pos = q * CQ_ENTRY_BYTES
            if (q < st.max_off or (q > st.max_off and st.max_off != st.min_off)
                    or pos < st.tail_from or pos + c * CQ_ENTRY_BYTES > st.tail_from + st.tail_size):
                st.slow = True
                continue
            if st.max_off == st.min_off:
                st.min_off = q
            st.max_off = q + c
            st.phys_end = p.runs[j].end
            st.wrote = pos + c * CQ_ENTRY_BYTES - st.tail_from
            st.touched = True
        # A pass's entries are a few KB: copied with the GIL held (a release would cost more).
        o = <unsigned char*>PyBytes_AS_STRING(out)
        for j in range(p.r):
            st = &qs[p.qnum[p.runs[j].record]]
            if st.slow:
                any_slow = True
                continue
            memcpy(st.base + p.runs[j].first_q * CQ_ENTRY_BYTES - st.tail_from,
                   o + p.runs[j].at, p.runs[j].count * CQ_ENTRY_BYTES)
        for j in range(p.k):
            if held[j]:
                PyBuffer_Release(&bufs[j])
                held[j] = 0
        # Published once the bytes are in place: a reader never sees an entry before it.
        for j in range(p.k):
            st = &qs[j]
            if st.slow or not st.touched:
                continue
            cq = cqs[j]
            cq.min_offset = st.min_off
            cq.max_offset = st.max_off
            cq.max_physical_end = st.phys_end
            (<object>tails[j]).wrote = st.wrote
        if any_slow:
            view = memoryview(out)
            for j in range(p.r):
                num = p.qnum[p.runs[j].record]
                if qs[num].slow:
                    (<object>cqs[num]).put_block(
                        p.runs[j].first_q,
                        view[p.runs[j].at:p.runs[j].at + p.runs[j].count * CQ_ENTRY_BYTES],
                        p.runs[j].end)
            view.release()
        # -- IndexFile --------------------------------------------------------------------------
        i = p.n - 1
        end = p.fields[4 * i] + p.fields[4 * i + 1]
        if end <= index_from:
            return None
        if unindexed:
            for j in range(p.k):
                skipq[j] = (<tuple>queue_keys[j])[0] in unindexed
        key_list = list(keys)
        uniq_list = list(uniq_keys)
        if not len(key_list) == len(uniq_list) == p.n:
            raise ValueError("dispatch_pass: the key lists differ in length from the records")
        _index_pairs(qkeys, key_list, uniq_list, &pairs, p.fields, p.qnum, skipq, index_from)
        m = pairs.len
        if type(stamps) is array.array and stamps.typecode == "q" and len(stamps):
            v_stamps = stamps
            packed_stamps = True
            if v_stamps.shape[0] != p.n:
                raise ValueError("dispatch_pass: the timestamps differ in length from the records")
        elif stamps:
            stamps = array.array("q", stamps)
            v_stamps = stamps
            packed_stamps = True
            if v_stamps.shape[0] != p.n:
                raise ValueError("dispatch_pass: the timestamps differ in length from the records")
        io = <int64_t*>malloc((m + 1) * sizeof(int64_t))
        it = <int64_t*>malloc((m + 1) * sizeof(int64_t))
        if io == NULL or it == NULL:
            raise MemoryError()
        tmax = store_ts
        for j in range(m):
            i = pairs.numbers[j]
            io[j] = p.fields[4 * i]
            it[j] = v_stamps[i] if packed_stamps else store_ts
            if j == 0 or it[j] > tmax:
                tmax = it[j]
            if j and io[j] < io[j - 1]:
                ordered = False
        begin = p.fields[0] if p.fields[0] > index_from else index_from
        writer = None
        if ordered:
            files = index.files
            if files:
                writer = files[len(files) - 1]  # (wraparound is off in this module)
                if writer.max_entries + 1 - writer.header.next_entry < 1:
                    writer = None
            if writer is None:
                writer = index.writer_at(begin, 1)
            if writer.max_entries + 1 - writer.header.next_entry < m:
                writer = None  # the file rolls inside this pass
        if writer is None:
            hashes = np.empty(m, np.int64)
            at = np.empty(m, np.int64)
            times = np.empty(m, np.int64)
            if m:
                memcpy(<void*><size_t>hashes.ctypes.data, pairs.hashes, m * 8)
                memcpy(<void*><size_t>at.ctypes.data, io, m * 8)
                memcpy(<void*><size_t>times.ctypes.data, it, m * 8)
            put_index(hashes, at, times, store_ts, begin, end)
            return None
        h = writer.header
        if m:
            # ``IndexFile.put_many``: the entries and slots, then the header.
            if h.begin_timestamp == 0:
                h.begin_timestamp = it[0]
            bt = h.begin_timestamp
            first = h.next_entry
            slot_count = writer.slots
            fd = writer._fd
            PyObject_GetBuffer(writer.mm, &ib, PyBUF_WRITABLE)
            ib_held = True
            if slot_count <= 0 or INDEX_HEADER + slot_count * 4 > ib.len:
                raise ValueError(f"dispatch_pass: {slot_count} slots do not fit the mapping")
            mask = _index_mask(m)
            ibuf = <unsigned char*>malloc(m * INDEX_ENTRY)
            table = <int64_t*>malloc((mask + 1) * 2 * sizeof(int64_t))
            if ibuf == NULL or table == NULL:
                raise MemoryError()
            with nogil:
                empty = _index_put_raw(<unsigned char*>ib.buf + INDEX_HEADER, fd, slot_count,
                                       first, bt, pairs.hashes, io, it, m, ibuf, table, mask,
                                       &failed)
            if failed:
                PyErr_SetFromErrno(OSError)
            PyBuffer_Release(&ib)
            ib_held = False
            h.used_slots += empty
            h.next_entry = first + m
            if tmax > h.end_timestamp:
                h.end_timestamp = tmax
            _write_index_header(fd, h)
        # ``IndexFile.advance``.
        h.end_offset = end
        if tmax > h.end_timestamp:
            h.end_timestamp = tmax
            if h.begin_timestamp == 0:
                h.begin_timestamp = tmax
    finally:
        if held != NULL:
            for j in range(p.k):
                if held[j]:
                    PyBuffer_Release(&bufs[j])
        if ib_held:
            PyBuffer_Release(&ib)
        _cq_free(&p)
        free(qs)
        free(bufs)
        free(held)
        free(skipq)
        free(pairs.hashes)
        free(pairs.numbers)
        free(io)
        free(it)
        free(ibuf)
        free(table)
    return None
