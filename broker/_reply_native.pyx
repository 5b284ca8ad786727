# cython: boundscheck=False, wraparound=False, cdivision=True
"""Stored messages written natively as the PullMessageResponse bytes a client receives
(decision 400): the native twin of ``broker.reply.encode_pull_replies_py``.

``encode(messages, ...)`` writes, for each ``StoredMessage``, the protobuf wire bytes of
``PullMessageResponse(message=to_proto_message(m, m.topic, None, None, None))``, field by field
in field-number order as protobuf serializes them, all into one buffer: no protobuf object per
message. The bytes are the reference's, but for the order of the user properties: a map's
entries have no order in protobuf, and protobuf writes them in its hash table's order, which
differs from process to process; this writer keeps the record's order. A message whose fields
it does not take as they are (a delivery time that is not plain ASCII digits) is handed to
``fallback`` (the reference).
"""

from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from cpython.mem cimport PyMem_Free, PyMem_Realloc
from libc.stdint cimport int64_t, uint64_t
from libc.string cimport memcpy

from tiered._protowire cimport varint_len, write_varint

cdef extern from "Python.h":
    const char* PyUnicode_AsUTF8AndSize(object s, Py_ssize_t* size) except NULL

import hashlib

cdef object _md5 = hashlib.md5

DEF VARINT = 0
DEF LEN = 2


cdef struct Buf:
    unsigned char* p
    Py_ssize_t n
    Py_ssize_t cap


cdef int _reserve(Buf* b, Py_ssize_t more) except -1:
    cdef Py_ssize_t cap
    cdef void* p
    if b.n + more <= b.cap:
        return 0
    cap = b.cap * 2
    if cap < b.n + more:
        cap = b.n + more
    if cap < 4096:
        cap = 4096
    p = PyMem_Realloc(b.p, cap)
    if p == NULL:
        raise MemoryError()
    b.p = <unsigned char*>p
    b.cap = cap
    return 0


cdef int _varint(Buf* b, uint64_t v) except -1:
    _reserve(b, 10)
    b.n = write_varint(b.p + b.n, v) - b.p
    return 0


cdef inline int _tag(Buf* b, int field, int wire) except -1:
    return _varint(b, <uint64_t>((field << 3) | wire))


cdef int _raw(Buf* b, const char* p, Py_ssize_t n) except -1:
    _reserve(b, n)
    memcpy(b.p + b.n, p, n)
    b.n += n
    return 0


cdef int _bytes_field(Buf* b, int field, const char* p, Py_ssize_t n) except -1:
    _tag(b, field, LEN)
    _varint(b, <uint64_t>n)
    return _raw(b, p, n)


cdef int _str_field(Buf* b, int field, object s) except -1:
    cdef Py_ssize_t n
    cdef const char* p = PyUnicode_AsUTF8AndSize(s, &n)
    return _bytes_field(b, field, p, n)


cdef int _int_field(Buf* b, int field, int64_t v) except -1:
    # int32 and int64 alike: a negative value is its 64-bit two's complement (10 bytes).
    _tag(b, field, VARINT)
    return _varint(b, <uint64_t>v)


cdef int _timestamp(Buf* b, int field, int64_t ms) except -1:
    """``Timestamp.FromMilliseconds(ms)`` (floor division, as Python's) as field ``field``."""
    cdef int64_t seconds = ms // 1000
    cdef int64_t rest = ms % 1000
    if rest < 0:
        seconds -= 1
        rest += 1000
    cdef int64_t nanos = rest * 1000000
    cdef int size = 0
    if seconds != 0:
        size += 1 + varint_len(<uint64_t>seconds)
    if nanos != 0:
        size += 1 + varint_len(<uint64_t>nanos)
    _tag(b, field, LEN)
    _varint(b, <uint64_t>size)
    if seconds != 0:
        _int_field(b, 1, seconds)
    if nanos != 0:
        _int_field(b, 2, nanos)
    return 0


cdef int _nested(Buf* out, int field, Buf* inner) except -1:
    _tag(out, field, LEN)
    _varint(out, <uint64_t>inner.n)
    return _raw(out, <const char*>inner.p, inner.n)


cdef bint _plain_digits(str s):
    cdef Py_UCS4 c
    if len(s) == 0 or len(s) > 18:  # 18 digits always fit an int64
        return False
    for c in s:
        if c < u'0' or c > u'9':
            return False
    return True


def encode(list messages, frozenset hidden, dict type_values, int default_type, fallback):
    """The replies of ``messages``, back to back: (bytes, ends, body sizes)."""
    cdef Buf out, msg, sp
    cdef Py_ssize_t i, n = len(messages), size
    cdef list ends = [], bodies = []
    cdef dict props
    cdef object m, body, value, deliver, key, digest_bytes
    cdef str digest
    cdef list user
    cdef const unsigned char* dp
    cdef unsigned char hexbuf[32]
    cdef int j
    out.p = msg.p = sp.p = NULL
    out.n = msg.n = sp.n = 0
    out.cap = msg.cap = sp.cap = 0
    try:
        for i in range(n):
            m = messages[i]
            props = m.properties
            body = m.body
            deliver = props.get("__STARTDELIVERTIME")
            user = [key for key in props if key not in hidden]
            if deliver and not _plain_digits(deliver):
                value = fallback(m)
                _raw(&out, PyBytes_AS_STRING(value), PyBytes_GET_SIZE(value))
                ends.append(out.n)
                bodies.append(PyBytes_GET_SIZE(body))
                continue
            sp.n = 0
            value = props.get("TAGS")
            if value:
                _str_field(&sp, 1, value)
            value = props.get("KEYS")
            if value:
                for key in value.split(" "):
                    if key:
                        _str_field(&sp, 2, key)
            value = props.get("UNIQ_KEY") or f"{m.commitlog_offset:032X}"
            if value:
                _str_field(&sp, 3, value)
            # body_digest: MD5 in uppercase hex (broker.protocol.to_proto_message).
            digest_bytes = _md5(body).digest()
            dp = <const unsigned char*>PyBytes_AS_STRING(digest_bytes)
            for j in range(16):
                hexbuf[2 * j] = b"0123456789ABCDEF"[dp[j] >> 4]
                hexbuf[2 * j + 1] = b"0123456789ABCDEF"[dp[j] & 15]
            _tag(&sp, 4, LEN)
            _varint(&sp, 36)
            _int_field(&sp, 1, 2)  # Digest.type = MD5
            _bytes_field(&sp, 2, <const char*>hexbuf, 32)
            _int_field(&sp, 5, 1)  # body_encoding = IDENTITY
            j = type_values.get(props.get("__MESSAGE_TYPE", "NORMAL"), default_type)
            if j != 0:
                _int_field(&sp, 6, j)
            _timestamp(&sp, 7, m.born_timestamp)
            value = m.born_host[0]
            if value:
                _str_field(&sp, 8, value)
            _timestamp(&sp, 9, m.store_timestamp)
            value = m.store_host
            _str_field(&sp, 10, f"{value[0]}:{value[1]}")
            if deliver:
                _timestamp(&sp, 11, int(deliver))
            if m.queue_id != 0:
                _int_field(&sp, 13, m.queue_id)
            _int_field(&sp, 14, m.queue_offset)
            _int_field(&sp, 16, m.reconsume_times + 1)
            value = props.get("__SHARDINGKEY")
            if value:
                _str_field(&sp, 17, value)

            msg.n = 0
            # topic: Resource{name} (no namespace)
            value = m.topic
            size = 0
            dp = <const unsigned char*>PyUnicode_AsUTF8AndSize(value, &size)
            _tag(&msg, 1, LEN)
            if size:
                _varint(&msg, <uint64_t>(1 + varint_len(<uint64_t>size) + size))
                _bytes_field(&msg, 2, <const char*>dp, size)
            else:
                _varint(&msg, 0)
            for key in user:
                _user_property(&msg, key, props[key])
            _nested(&msg, 3, &sp)
            if PyBytes_GET_SIZE(body):
                _bytes_field(&msg, 4, PyBytes_AS_STRING(body), PyBytes_GET_SIZE(body))
            _nested(&out, 2, &msg)  # PullMessageResponse.message
            ends.append(out.n)
            bodies.append(PyBytes_GET_SIZE(body))
        return PyBytes_FromStringAndSize(<const char*>out.p, out.n), ends, bodies
    finally:
        PyMem_Free(out.p)
        PyMem_Free(msg.p)
        PyMem_Free(sp.p)


cdef int _user_property(Buf* b, str key, str value) except -1:
    """One map entry: {1: key, 2: value}, both always written (as protobuf writes map entries)."""
    cdef Py_ssize_t kn, vn
    cdef const char* kp = PyUnicode_AsUTF8AndSize(key, &kn)
    cdef const char* vp = PyUnicode_AsUTF8AndSize(value, &vn)
    _tag(b, 2, LEN)
    _varint(b, <uint64_t>(2 + varint_len(<uint64_t>kn) + kn + varint_len(<uint64_t>vn) + vn))
    _bytes_field(b, 1, kp, kn)
    _bytes_field(b, 2, vp, vn)
    return 0
