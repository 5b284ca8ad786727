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
``fallback`` (the reference). A time outside protobuf's Timestamp range is left out and a
delivery attempt clamped to int32, as the reference does (decision 530).
"""

from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from libc.stdint cimport int32_t, int64_t, uint32_t, uint64_t
from libc.stdlib cimport free, malloc, realloc
from libc.string cimport memcmp, memcpy

from tiered._protowire cimport varint_len, write_varint

cdef extern from "Python.h":
    const char* PyUnicode_AsUTF8AndSize(object s, Py_ssize_t* size) except NULL

cdef extern from "_md5.h":
    void tmq_md5(const unsigned char* p, size_t n, unsigned char* out) noexcept nogil

cdef extern from "_md5_mb.h":
    void tmq_md5_many(
        const unsigned char** ptrs, const size_t* lens, size_t n, unsigned char* out
    ) noexcept nogil

import hashlib

cdef object _md5 = hashlib.md5

DEF VARINT = 0
DEF LEN = 2


# A growing output buffer. Its writers run without the GIL (``encode_records``): a failed
# allocation sets ``oom`` and later writes are skipped; the caller raises MemoryError.
cdef struct Buf:
    unsigned char* p
    Py_ssize_t n
    Py_ssize_t cap
    bint oom


cdef int _reserve(Buf* b, Py_ssize_t more) noexcept nogil:
    cdef Py_ssize_t cap
    cdef void* p
    if b.oom:
        return -1
    if b.n + more <= b.cap:
        return 0
    cap = b.cap * 2
    if cap < b.n + more:
        cap = b.n + more
    if cap < 4096:
        cap = 4096
    p = realloc(b.p, cap)
    if p == NULL:
        b.oom = True
        return -1
    b.p = <unsigned char*>p
    b.cap = cap
    return 0


cdef int _varint(Buf* b, uint64_t v) noexcept nogil:
    if _reserve(b, 10):
        return -1
    b.n = write_varint(b.p + b.n, v) - b.p
    return 0


cdef inline int _tag(Buf* b, int field, int wire) noexcept nogil:
    return _varint(b, <uint64_t>((field << 3) | wire))


cdef int _raw(Buf* b, const char* p, Py_ssize_t n) noexcept nogil:
    if _reserve(b, n):
        return -1
    memcpy(b.p + b.n, p, n)
    b.n += n
    return 0


cdef int _bytes_field(Buf* b, int field, const char* p, Py_ssize_t n) noexcept nogil:
    _tag(b, field, LEN)
    _varint(b, <uint64_t>n)
    return _raw(b, p, n)


cdef int _str_field(Buf* b, int field, object s) except -1:
    cdef Py_ssize_t n
    cdef const char* p = PyUnicode_AsUTF8AndSize(s, &n)
    return _bytes_field(b, field, p, n)


cdef int _int_field(Buf* b, int field, int64_t v) noexcept nogil:
    # int32 and int64 alike: a negative value is its 64-bit two's complement (10 bytes).
    _tag(b, field, VARINT)
    return _varint(b, <uint64_t>v)


cdef int64_t TS_MIN_MS = -62135596800000LL  # broker.protocol.TIMESTAMP_MIN_MS
cdef int64_t TS_MAX_MS = 253402300799999LL
cdef int64_t INT32_MAX = 2147483647


cdef int _timestamp(Buf* b, int field, int64_t ms) noexcept nogil:
    """``Timestamp.FromMilliseconds(ms)`` (floor division, as Python's) as field ``field``;
    nothing outside Timestamp's range, which the reference leaves out (decision 530)."""
    if ms < TS_MIN_MS or ms > TS_MAX_MS:
        return 0
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


cdef inline int64_t _attempt(int64_t reconsume_times) noexcept nogil:
    """delivery_attempt from a record's reconsume times: broker.protocol.delivery_attempt."""
    if reconsume_times < 0:
        return 1
    return INT32_MAX if reconsume_times >= INT32_MAX else reconsume_times + 1


cdef int _nested(Buf* out, int field, Buf* inner) noexcept nogil:
    _tag(out, field, LEN)
    _varint(out, <uint64_t>inner.n)
    return _raw(out, <const char*>inner.p, inner.n)


cdef void _digest(Buf* sp, const unsigned char* dp) noexcept nogil:
    """body_digest (field 4): Digest{type: MD5, checksum: the 16 bytes in uppercase hex}."""
    cdef unsigned char hexbuf[32]
    cdef int j
    for j in range(16):
        hexbuf[2 * j] = b"0123456789ABCDEF"[dp[j] >> 4]
        hexbuf[2 * j + 1] = b"0123456789ABCDEF"[dp[j] & 15]
    _tag(sp, 4, LEN)
    _varint(sp, 36)
    _int_field(sp, 1, 2)  # Digest.type = MD5
    _bytes_field(sp, 2, <const char*>hexbuf, 32)


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
    cdef int j
    out.p = msg.p = sp.p = NULL
    out.n = msg.n = sp.n = 0
    out.cap = msg.cap = sp.cap = 0
    out.oom = msg.oom = sp.oom = False
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
            _digest(&sp, <const unsigned char*>PyBytes_AS_STRING(digest_bytes))
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
            _int_field(&sp, 16, _attempt(m.reconsume_times))
            value = props.get("__SHARDINGKEY")
            if value:
                _str_field(&sp, 17, value)

            msg.n = 0
            # topic: Resource{name} (no namespace)
            size = 0
            dp = <const unsigned char*>PyUnicode_AsUTF8AndSize(m.topic, &size)
            _topic(&msg, dp, size)
            for key in user:
                _user_property(&msg, key, props[key])
            _nested(&msg, 3, &sp)
            if PyBytes_GET_SIZE(body):
                _bytes_field(&msg, 4, PyBytes_AS_STRING(body), PyBytes_GET_SIZE(body))
            _nested(&out, 2, &msg)  # PullMessageResponse.message
            ends.append(out.n)
            bodies.append(PyBytes_GET_SIZE(body))
        if out.oom or msg.oom or sp.oom:
            raise MemoryError()
        return PyBytes_FromStringAndSize(<const char*>out.p, out.n), ends, bodies
    finally:
        free(out.p)
        free(msg.p)
        free(sp.p)


cdef int _user_property(Buf* b, str key, str value) except -1:
    cdef Py_ssize_t kn, vn
    cdef const char* kp = PyUnicode_AsUTF8AndSize(key, &kn)
    cdef const char* vp = PyUnicode_AsUTF8AndSize(value, &vn)
    return _map_entry(b, kp, kn, vp, vn)


cdef int _map_entry(
    Buf* b, const char* kp, Py_ssize_t kn, const char* vp, Py_ssize_t vn
) noexcept nogil:
    """One map entry: {1: key, 2: value}, both always written (as protobuf writes map entries)."""
    _tag(b, 2, LEN)
    _varint(b, <uint64_t>(2 + varint_len(<uint64_t>kn) + kn + varint_len(<uint64_t>vn) + vn))
    _bytes_field(b, 1, kp, kn)
    _bytes_field(b, 2, vp, vn)
    return 0


# -- replies written straight from the record bytes (decision 481) --------------------------------

DEF HEAD = 88  # every byte before the body when both hosts are IPv4
DEF SYSFLAG_V6 = (1 << 4) | (1 << 5)  # either host IPv6
DEF SYSFLAG_RECORD_CRC = 1 << 16
DEF CRC_TRAILER = 20  # the record CRC's property pair at the end of the properties
DEF MAX_PAIRS = 64


cdef struct Names:
    # The property names hidden from a client (user properties are the rest), and the message
    # type names with their protobuf values.
    const char** hidden
    Py_ssize_t* hidden_n
    Py_ssize_t n_hidden
    const char** types
    Py_ssize_t* types_n
    int* type_values
    Py_ssize_t n_types
    int default_type


cdef struct Pair:
    const unsigned char* k
    Py_ssize_t kn
    const unsigned char* v
    Py_ssize_t vn


cdef inline uint32_t _u32(const unsigned char* p) noexcept nogil:
    return (<uint32_t>p[0] << 24) | (<uint32_t>p[1] << 16) | (<uint32_t>p[2] << 8) | p[3]


cdef inline int64_t _i64(const unsigned char* p) noexcept nogil:
    return <int64_t>((<uint64_t>_u32(p) << 32) | _u32(p + 4))


cdef inline bint _is(const unsigned char* p, Py_ssize_t n, const char* name, Py_ssize_t m) noexcept nogil:
    return n == m and memcmp(p, name, m) == 0


cdef bint _utf8(const unsigned char* p, Py_ssize_t n) noexcept nogil:
    """Whether ``p[:n]`` is UTF-8 as Python's strict decoder takes it (no overlong forms, no
    surrogates, nothing past U+10FFFF): then a name or value written as it is is what the
    reference writes from its ``str``."""
    cdef Py_ssize_t i = 0, need, k
    cdef unsigned char c, c1
    while i < n:
        c = p[i]
        if c < 0x80:
            i += 1
            continue
        if c < 0xC2:
            return False
        elif c < 0xE0:
            need = 1
        elif c < 0xF0:
            need = 2
        elif c < 0xF5:
            need = 3
        else:
            return False
        if i + need >= n:
            return False
        c1 = p[i + 1]
        if (c == 0xE0 and c1 < 0xA0) or (c == 0xED and c1 >= 0xA0):
            return False
        if (c == 0xF0 and c1 < 0x90) or (c == 0xF4 and c1 >= 0x90):
            return False
        for k in range(1, need + 1):
            if (p[i + k] & 0xC0) != 0x80:
                return False
        i += need + 1
    return True


cdef Py_ssize_t _decimal(unsigned char* out, int64_t v) noexcept nogil:
    """``v`` in decimal (as ``str(v)``) at ``out`` (at least 20 bytes); its length."""
    cdef unsigned char tmp[20]
    cdef Py_ssize_t n = 0, k = 0
    cdef uint64_t u = <uint64_t>v
    if v < 0:
        out[k] = b"-"
        k += 1
        u = <uint64_t>0 - u
    while True:
        tmp[n] = <unsigned char>(48 + u % 10)
        n += 1
        u //= 10
        if u == 0:
            break
    while n:
        n -= 1
        out[k] = tmp[n]
        k += 1
    return k


cdef Py_ssize_t _ipv4(unsigned char* out, const unsigned char* ip) noexcept nogil:
    """An IPv4 address in dotted decimal (``inet_ntop``) at ``out`` (16 bytes); its length."""
    cdef Py_ssize_t k = 0
    cdef int j
    for j in range(4):
        if j:
            out[k] = b"."
            k += 1
        k += _decimal(out + k, ip[j])
    return k


cdef int _record(
    Buf* out, Buf* msg, Buf* sp, const unsigned char* data, Py_ssize_t length, int64_t pos,
    Names* names, Py_ssize_t* body_size, const unsigned char* body_md5
) noexcept nogil:
    """The reply of the record at ``pos``, written from its bytes: 0. 1 when the record is one
    this writer does not take as it is (an IPv6 host, properties that are not UTF-8 or name a
    property twice, a delivery time that is not plain digits, anything malformed): the
    caller's fallback writes it then, or raises what the decode raises. ``body_md5``: the
    body's MD5 computed already (``_body_digests``), or NULL to compute it here."""
    cdef const unsigned char* r
    cdef const unsigned char* body
    cdef const unsigned char* topic
    cdef const unsigned char* props
    cdef int64_t total, body_len, topic_len, props_len, q, i, j, k, deliver = 0, physical
    cdef uint32_t sysflag
    cdef Pair pairs[MAX_PAIRS]
    cdef Py_ssize_t npairs = 0, h
    cdef Pair* tags = NULL
    cdef Pair* keys = NULL
    cdef Pair* uniq = NULL
    cdef Pair* deliver_at = NULL
    cdef Pair* mtype = NULL
    cdef Pair* shard = NULL
    cdef Pair* pair
    cdef unsigned char text[40]
    cdef unsigned char digest[16]
    cdef int type_value
    cdef bint hidden
    if pos < 0 or pos > length - HEAD:  # not ``pos + HEAD``: overflow near 2**63
        return 1
    r = data + pos
    total = <int32_t>_u32(r)
    if total < HEAD + 4 or pos + total > length:
        return 1
    sysflag = _u32(r + 36)
    if sysflag & SYSFLAG_V6:
        return 1
    body_len = <int32_t>_u32(r + 84)
    if body_len < 0 or HEAD + body_len + 2 > total:
        return 1
    body = r + HEAD
    q = HEAD + body_len
    topic_len = (r[q] << 8) | r[q + 1]
    topic = r + q + 2
    q += 2 + topic_len
    if q + 2 > total:
        return 1
    props_len = (r[q] << 8) | r[q + 1]
    props = r + q + 2
    q += 2 + props_len
    if q != total:
        return 1
    if sysflag & SYSFLAG_RECORD_CRC:
        if props_len < CRC_TRAILER:
            return 1
        props_len -= CRC_TRAILER
    if not _utf8(topic, topic_len) or not _utf8(props, props_len):
        return 1
    # The pairs, as ``decode_properties`` splits them: on \x02, empty pairs skipped, the name
    # up to the first \x01.
    i = 0
    while i < props_len:
        j = i
        while j < props_len and props[j] != 2:
            j += 1
        if j > i:
            if npairs == MAX_PAIRS:
                return 1
            k = i
            while k < j and props[k] != 1:
                k += 1
            pair = &pairs[npairs]
            pair.k = props + i
            pair.kn = k - i
            pair.v = props + k + 1 if k < j else props + j
            pair.vn = j - k - 1 if k < j else 0
            for h in range(npairs):
                if _is(pairs[h].k, pairs[h].kn, <const char*>pair.k, pair.kn):
                    return 1  # a name twice: the dict keeps the first place, the last value
            if _is(pair.k, pair.kn, "TAGS", 4):
                tags = pair
            elif _is(pair.k, pair.kn, "KEYS", 4):
                keys = pair
            elif _is(pair.k, pair.kn, "UNIQ_KEY", 8):
                uniq = pair
            elif _is(pair.k, pair.kn, "__STARTDELIVERTIME", 18):
                deliver_at = pair
            elif _is(pair.k, pair.kn, "__MESSAGE_TYPE", 14):
                mtype = pair
            elif _is(pair.k, pair.kn, "__SHARDINGKEY", 13):
                shard = pair
            npairs += 1
        i = j + 1
    if deliver_at != NULL and deliver_at.vn:
        if deliver_at.vn > 18:
            return 1
        for k in range(deliver_at.vn):
            if deliver_at.v[k] < 48 or deliver_at.v[k] > 57:
                return 1
            deliver = deliver * 10 + (deliver_at.v[k] - 48)
    physical = _i64(r + 28)
    if (uniq == NULL or uniq.vn == 0) and physical < 0:
        return 1

    sp.n = 0
    if tags != NULL and tags.vn:
        _bytes_field(sp, 1, <const char*>tags.v, tags.vn)
    if keys != NULL:
        i = 0
        while i < keys.vn:
            j = i
            while j < keys.vn and keys.v[j] != 32:
                j += 1
            if j > i:
                _bytes_field(sp, 2, <const char*>keys.v + i, j - i)
            i = j + 1
    if uniq != NULL and uniq.vn:
        _bytes_field(sp, 3, <const char*>uniq.v, uniq.vn)
    else:
        for k in range(32):  # f"{commitlog_offset:032X}"
            text[31 - k] = b"0123456789ABCDEF"[(<uint64_t>physical >> (4 * k)) & 15] if k < 16 else 48
        _bytes_field(sp, 3, <const char*>text, 32)
    if body_md5 == NULL:
        tmq_md5(body, body_len, digest)
        body_md5 = digest
    _digest(sp, body_md5)
    _int_field(sp, 5, 1)  # body_encoding = IDENTITY
    type_value = names.default_type
    for h in range(names.n_types):
        if (mtype == NULL and _is(<const unsigned char*>"NORMAL", 6, names.types[h], names.types_n[h])) or (
            mtype != NULL and _is(mtype.v, mtype.vn, names.types[h], names.types_n[h])
        ):
            type_value = names.type_values[h]
            break
    if type_value != 0:
        _int_field(sp, 6, type_value)
    _timestamp(sp, 7, _i64(r + 40))
    _bytes_field(sp, 8, <const char*>text, _ipv4(text, r + 48))
    _timestamp(sp, 9, _i64(r + 56))
    k = _ipv4(text, r + 64)
    text[k] = b":"
    k += 1 + _decimal(text + k + 1, <int32_t>_u32(r + 68))
    _bytes_field(sp, 10, <const char*>text, k)
    if deliver_at != NULL and deliver_at.vn:
        _timestamp(sp, 11, deliver)
    if <int32_t>_u32(r + 12) != 0:
        _int_field(sp, 13, <int32_t>_u32(r + 12))
    _int_field(sp, 14, _i64(r + 20))
    _int_field(sp, 16, _attempt(<int32_t>_u32(r + 72)))
    if shard != NULL and shard.vn:
        _bytes_field(sp, 17, <const char*>shard.v, shard.vn)

    msg.n = 0
    _topic(msg, topic, topic_len)
    for h in range(npairs):
        pair = &pairs[h]
        hidden = False
        for k in range(names.n_hidden):
            if _is(pair.k, pair.kn, names.hidden[k], names.hidden_n[k]):
                hidden = True
                break
        if not hidden:
            _map_entry(msg, <const char*>pair.k, pair.kn, <const char*>pair.v, pair.vn)
    _nested(msg, 3, sp)
    if body_len:
        _bytes_field(msg, 4, <const char*>body, body_len)
    _nested(out, 2, msg)  # PullMessageResponse.message
    body_size[0] = body_len
    return 0


cdef int _topic(Buf* msg, const unsigned char* p, Py_ssize_t size) noexcept nogil:
    """Message.topic: Resource{name} (no namespace)."""
    _tag(msg, 1, LEN)
    if size:
        _varint(msg, <uint64_t>(1 + varint_len(<uint64_t>size) + size))
        return _bytes_field(msg, 2, <const char*>p, size)
    return _varint(msg, 0)


cdef void _body_digests(
    const unsigned char* data, Py_ssize_t length, const int64_t* pos, Py_ssize_t n,
    const unsigned char** ptrs, size_t* lens, unsigned char* out
) noexcept nogil:
    """The MD5 of the body of each record at ``pos[i]`` into ``out[16 * i:]``, all of them at
    once (``tmq_md5_many``: eight bodies side by side, decision 640). A record whose bounds do
    not hold gets the empty body's digest, unused: ``_record`` hands it to the fallback."""
    cdef Py_ssize_t i
    cdef int64_t p, total, body_len
    for i in range(n):
        p = pos[i]
        ptrs[i] = <const unsigned char*>""
        lens[i] = 0
        if p >= 0 and p <= length - HEAD:
            total = <int32_t>_u32(data + p)
            body_len = <int32_t>_u32(data + p + 84)
            if total >= HEAD + 4 and p + total <= length and 0 <= body_len and HEAD + body_len + 2 <= total:
                ptrs[i] = data + p + HEAD
                lens[i] = <size_t>body_len
    tmq_md5_many(ptrs, lens, <size_t>n, out)


def encode_records(data, list positions, tuple hidden, tuple types, int default_type, fallback):
    """The replies of the records at ``positions`` of ``data`` (checked already), back to back:
    (bytes, ends, body sizes), written from the record bytes with the GIL released: no object
    per message. ``hidden``: the property names a client does not see, as bytes; ``types``:
    (message type name as bytes, its value) pairs. A record the writer does not take as it is
    goes to ``fallback(data, position)``, which returns its reply and its body's size."""
    cdef const unsigned char[::1] view = data
    cdef Py_ssize_t n = len(positions), i = 0, length = view.shape[0], body = 0, h
    cdef const unsigned char* base = &view[0] if length else NULL
    cdef Buf out, msg, sp
    cdef Names names
    cdef int64_t* pos_c = NULL
    cdef Py_ssize_t* ends_c = NULL
    cdef Py_ssize_t* bodies_c = NULL
    cdef unsigned char* digests = NULL
    cdef const unsigned char** body_ptrs = NULL
    cdef size_t* body_lens = NULL
    cdef object reply
    out.p = msg.p = sp.p = NULL
    out.n = msg.n = sp.n = 0
    out.cap = msg.cap = sp.cap = 0
    out.oom = msg.oom = sp.oom = False
    names.n_hidden = len(hidden)
    names.n_types = len(types)
    names.default_type = default_type
    names.hidden = <const char**>malloc(sizeof(char*) * (names.n_hidden + 1))
    names.hidden_n = <Py_ssize_t*>malloc(sizeof(Py_ssize_t) * (names.n_hidden + 1))
    names.types = <const char**>malloc(sizeof(char*) * (names.n_types + 1))
    names.types_n = <Py_ssize_t*>malloc(sizeof(Py_ssize_t) * (names.n_types + 1))
    names.type_values = <int*>malloc(sizeof(int) * (names.n_types + 1))
    pos_c = <int64_t*>malloc(sizeof(int64_t) * (n + 1))
    ends_c = <Py_ssize_t*>malloc(sizeof(Py_ssize_t) * (n + 1))
    bodies_c = <Py_ssize_t*>malloc(sizeof(Py_ssize_t) * (n + 1))
    digests = <unsigned char*>malloc(16 * (n + 1))
    body_ptrs = <const unsigned char**>malloc(sizeof(unsigned char*) * (n + 1))
    body_lens = <size_t*>malloc(sizeof(size_t) * (n + 1))
    try:
        if (names.hidden == NULL or names.hidden_n == NULL or names.types == NULL
                or names.types_n == NULL or names.type_values == NULL or pos_c == NULL
                or ends_c == NULL or bodies_c == NULL or digests == NULL or body_ptrs == NULL
                or body_lens == NULL):
            raise MemoryError()
        for h in range(names.n_hidden):  # the tuple keeps these bytes alive
            names.hidden[h] = PyBytes_AS_STRING(hidden[h])
            names.hidden_n[h] = PyBytes_GET_SIZE(hidden[h])
        for h in range(names.n_types):
            names.types[h] = PyBytes_AS_STRING(types[h][0])
            names.types_n[h] = PyBytes_GET_SIZE(types[h][0])
            names.type_values[h] = types[h][1]
        for i in range(n):
            pos_c[i] = positions[i]
        # A reply is its record re-encoded plus about a hundred bytes (ids, digest, times, hosts):
        # room for all of them at once, so the buffer is not copied again and again as it grows
        # (four doublings of a 4 MiB run copied as many bytes as the run itself, decision 550).
        _reserve(&out, length + n * 128)
        with nogil:
            _body_digests(base, length, pos_c, n, body_ptrs, body_lens, digests)
        i = 0
        while i < n:
            with nogil:
                while i < n:
                    if _record(
                        &out, &msg, &sp, base, length, pos_c[i], &names, &body, digests + 16 * i
                    ):
                        break
                    ends_c[i] = out.n
                    bodies_c[i] = body
                    i += 1
            if i < n:
                reply, body = fallback(data, pos_c[i])
                _raw(&out, PyBytes_AS_STRING(reply), PyBytes_GET_SIZE(reply))
                ends_c[i] = out.n
                bodies_c[i] = body
                i += 1
        if out.oom or msg.oom or sp.oom:
            raise MemoryError()
        return (
            PyBytes_FromStringAndSize(<const char*>out.p, out.n),
            [ends_c[h] for h in range(n)],
            [bodies_c[h] for h in range(n)],
        )
    finally:
        free(out.p)
        free(msg.p)
        free(sp.p)
        free(names.hidden)
        free(names.hidden_n)
        free(names.types)
        free(names.types_n)
        free(names.type_values)
        free(pos_c)
        free(ends_c)
        free(bodies_c)
        free(digests)
        free(body_ptrs)
        free(body_lens)


def md5_many(list buffers):
    """The MD5 digests of ``buffers`` (bytes) as the reply writer computes a run's bodies, eight
    side by side (compared with hashlib by the tests)."""
    cdef Py_ssize_t n = len(buffers), i
    cdef const unsigned char** ptrs = <const unsigned char**>malloc(sizeof(unsigned char*) * (n + 1))
    cdef size_t* lens = <size_t*>malloc(sizeof(size_t) * (n + 1))
    cdef unsigned char* out = <unsigned char*>malloc(16 * (n + 1))
    try:
        for i in range(n):
            if type(buffers[i]) is not bytes:
                raise TypeError(f"md5_many takes bytes, not {type(buffers[i]).__name__}")
        if ptrs == NULL or lens == NULL or out == NULL:
            raise MemoryError()
        for i in range(n):
            ptrs[i] = <const unsigned char*>PyBytes_AS_STRING(buffers[i])
            lens[i] = <size_t>PyBytes_GET_SIZE(buffers[i])
        with nogil:
            tmq_md5_many(ptrs, lens, <size_t>n, out)
        return [PyBytes_FromStringAndSize(<const char*>out + 16 * i, 16) for i in range(n)]
    finally:
        free(ptrs)
        free(lens)
        free(out)


def md5(const unsigned char[::1] data):
    """The MD5 digest of ``data`` by the writer's own MD5 (compared with hashlib by the tests)."""
    cdef unsigned char out[16]
    cdef const unsigned char* p = &data[0] if data.shape[0] else <const unsigned char*>""
    tmq_md5(p, data.shape[0], out)
    return PyBytes_FromStringAndSize(<const char*>out, 16)
