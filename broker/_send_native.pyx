# cython: boundscheck=False, wraparound=False, cdivision=True
"""A SendMessageRequest's bytes walked natively into store ``Message`` objects (decision 310).

``scan(raw)`` walks the protobuf wire format of a whole ``apache.rocketmq.v2.SendMessageRequest``
once and keeps, per message, where its topic, body, message id, type, encoding, born time, born
host, tag, message group and delivery time lie in ``raw``, and how many user properties and
keys it has: fields it knows, each at most once (user properties and keys are repeated), with
the wire type protobuf expects, strings that are valid UTF-8, one topic. Anything else (GZIP,
an unknown or repeated field, a malformed length) makes it answer None, and the broker parses
the request with protobuf and takes the reference path (``broker.protocol.to_store_messages``),
which refuses exactly as the proxy does. ``SendBatch.messages`` then checks what depends on
the topic and the limits (type, sizes, names, the characters the reference refuses; decision
390) and builds the ``Message`` objects in C, with the slots set directly and the properties
in the reference's order: no protobuf object and no Python bytecode per message.
``SendBatch.spans`` makes the same checks and answers the batch as a ``tiered.record.RecordSpans``
instead (decision 700): per message a ``tmq_span`` (the body's place in ``raw``, the properties'
place in one buffer written in the order the ``Message``'s dict would hold them), which the record
encoder reads in place, with no ``Message``, dict or body copy per message. Every read of
``raw`` is bounded by the span it lies in (``_varint``, ``_span``), in ``scan`` and again when
``messages`` walks the user properties and keys a second time.
"""

from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from cpython.long cimport PyLong_FromLongLong, PyLong_FromSsize_t
from cpython.mem cimport PyMem_Free, PyMem_Malloc, PyMem_Realloc
from cpython.ref cimport Py_INCREF, Py_XDECREF, PyObject
from libc.stdint cimport int32_t, int64_t, uint64_t
from libc.string cimport memcmp, memcpy, memset

cdef extern from "Python.h":
    object PyUnicode_DecodeUTF8(const char* s, Py_ssize_t size, const char* errors)
    object PyUnicode_DecodeASCII(const char* s, Py_ssize_t size, const char* errors)
    const char* PyUnicode_AsUTF8AndSize(object unicode, Py_ssize_t* size) except NULL
    void PyErr_Clear()

cdef extern from "zlib.h":
    unsigned long crc32(unsigned long crc, const unsigned char* buf, unsigned int n) nogil

cdef extern from "_record_native.h":
    Py_ssize_t tmq_slot_offset(object descr) except? -2
    ctypedef struct tmq_span:
        int64_t body_at
        int64_t body_len
        int64_t props_at
        int64_t props_len
        int64_t born_timestamp
        int64_t queue_id
        int64_t host

cdef extern from "stdio.h":
    int snprintf(char* out, size_t n, const char* fmt, ...)

DEF MAX_ID = 128  # broker.protocol.to_store_messages: a plain message id is at most 128 chars
DEF GZIP = 2  # apache.rocketmq.v2.Encoding.GZIP
DEF LEN = 2
DEF VARINT = 0
# protobuf's Timestamp range (broker.protocol.TIMESTAMP_MIN_MS / TIMESTAMP_MAX_MS): a born or
# delivery time outside it is the reference's to ignore or refuse (decision 530).
cdef int64_t TS_MIN_S = -62135596800LL
cdef int64_t TS_MAX_S = 253402300799LL
cdef int64_t TS_MAX_MS = 253402300799999LL

cdef type Message = None
cdef object RecordSpans = None
cdef Py_ssize_t[9] _OFF
cdef tuple _FIELDS = ("topic", "body", "queue_id", "properties", "flag", "born_timestamp",
                      "born_host", "reconsume_times", "prepared_transaction_offset")
cdef str _UNIQ = "UNIQ_KEY"
cdef str _TAGS = "TAGS"
cdef str _TYPE = "__MESSAGE_TYPE"
cdef str _KEYS = "KEYS"
cdef str _GROUP = "__SHARDINGKEY"
cdef str _DELIVER = "__STARTDELIVERTIME"
cdef object _ZERO = 0


def bind(record_module):
    """Take ``tiered.record.Message`` and where its slots lie; False if they cannot be set."""
    global Message, RecordSpans
    Message = record_module.Message
    RecordSpans = record_module.RecordSpans
    if record_module.SPAN_STRUCT.size != sizeof(tmq_span):
        return False
    for i, field in enumerate(_FIELDS):
        _OFF[i] = tmq_slot_offset(Message.__dict__[field])
        if _OFF[i] < 0:
            return False
    return True


cdef struct Msg:
    const unsigned char* topic
    Py_ssize_t topic_n
    const unsigned char* body
    Py_ssize_t body_n
    const unsigned char* mid
    Py_ssize_t mid_n
    const unsigned char* host
    Py_ssize_t host_n
    const unsigned char* tag
    Py_ssize_t tag_n  # -1: no tag
    int32_t encoding
    int32_t mtype
    int64_t born_s
    int32_t born_ns
    # The message's and its system properties' spans, walked again in ``messages`` for the
    # user properties (field 2 of Message) and the keys (field 2 of SystemProperties).
    Py_ssize_t msg_start
    Py_ssize_t msg_end
    Py_ssize_t sys_start
    Py_ssize_t sys_end
    Py_ssize_t nprops
    Py_ssize_t nkeys
    const unsigned char* group
    Py_ssize_t group_n  # -1: no message group
    bint delivery  # a delivery timestamp is set
    int64_t delivery_s
    int32_t delivery_ns


cdef struct Prop:
    const unsigned char* key
    Py_ssize_t key_n
    const unsigned char* value
    Py_ssize_t value_n


cdef inline int _varint(const unsigned char* p, Py_ssize_t end, Py_ssize_t* pos,
                        uint64_t* out) noexcept nogil:
    """A base-128 varint at ``pos`` (-1: truncated, or longer than protobuf allows)."""
    cdef uint64_t v = 0
    cdef int shift = 0
    cdef unsigned char b
    while True:
        if pos[0] >= end or shift > 63:
            return -1
        b = p[pos[0]]
        pos[0] += 1
        if shift == 63 and b > 1:
            return -1
        v |= (<uint64_t>(b & 0x7F)) << shift
        if b < 0x80:
            out[0] = v
            return 0
        shift += 7


cdef inline int _tag(const unsigned char* p, Py_ssize_t end, Py_ssize_t* pos, int* field,
                     int* wire) noexcept nogil:
    cdef uint64_t t
    if _varint(p, end, pos, &t) < 0 or t >> 3 == 0 or t >> 3 > 536870911:
        return -1
    field[0] = <int>(t >> 3)
    wire[0] = <int>(t & 7)
    return 0


cdef inline int _span(const unsigned char* p, Py_ssize_t end, Py_ssize_t* pos,
                      Py_ssize_t* start, Py_ssize_t* n) noexcept nogil:
    """A length-delimited field's payload: ``start`` and ``n`` (-1 past ``end``)."""
    cdef uint64_t length
    if _varint(p, end, pos, &length) < 0 or length > <uint64_t>(end - pos[0]):
        return -1
    start[0] = pos[0]
    n[0] = <Py_ssize_t>length
    pos[0] += <Py_ssize_t>length
    return 0


cdef inline bint _ascii(const unsigned char* s, Py_ssize_t n) noexcept nogil:
    cdef Py_ssize_t i
    for i in range(n):
        if s[i] >= 0x80:
            return False
    return True


cdef bint _utf8(const unsigned char* s, Py_ssize_t n):
    """Valid UTF-8, as protobuf requires of a proto3 string (Python's strict decoder)."""
    if _ascii(s, n):
        return True
    try:
        PyUnicode_DecodeUTF8(<const char*>s, n, NULL)
    except UnicodeDecodeError:
        return False
    return True




cdef int _timestamp(const unsigned char* p, Py_ssize_t pos, Py_ssize_t end, int64_t* seconds,
                    int32_t* nanos):
    cdef int field, wire, seen = 0
    cdef uint64_t v
    while pos < end:
        if _tag(p, end, &pos, &field, &wire) < 0 or wire != VARINT or field > 2:
            return -1
        if seen & (1 << field) or _varint(p, end, &pos, &v) < 0:
            return -1
        seen |= 1 << field
        if field == 1:
            seconds[0] = <int64_t>v
        else:
            nanos[0] = <int32_t>v  # protobuf keeps an int32's low 32 bits
    return 0


cdef int _entry(const unsigned char* p, Py_ssize_t pos, Py_ssize_t end, Prop* out):
    """Two strings, fields 1 and 2 (a map<string, string> entry's key and value), each at most
    once, valid UTF-8; a missing one reads as empty, as protobuf reads it."""
    cdef int field, wire, seen = 0
    cdef Py_ssize_t start, n
    out.key = p + pos
    out.key_n = 0
    out.value = p + pos
    out.value_n = 0
    while pos < end:
        if _tag(p, end, &pos, &field, &wire) < 0 or wire != LEN or field > 2:
            return -1
        if seen & (1 << field) or _span(p, end, &pos, &start, &n) < 0:
            return -1
        seen |= 1 << field
        if not _utf8(p + start, n):
            return -1
        if field == 1:
            out.key = p + start
            out.key_n = n
        else:
            out.value = p + start
            out.value_n = n
    return 0


cdef int _resource(const unsigned char* p, Py_ssize_t pos, Py_ssize_t end, Msg* m):
    """A Resource: namespace (1) and name (2), strings, the shape of a map entry."""
    cdef Prop resource
    if _entry(p, pos, end, &resource) < 0:
        return -1
    m.topic = resource.value
    m.topic_n = resource.value_n
    return 0


cdef int _digest(const unsigned char* p, Py_ssize_t pos, Py_ssize_t end):
    cdef int field, wire, seen = 0
    cdef uint64_t v
    cdef Py_ssize_t start, n
    while pos < end:
        if _tag(p, end, &pos, &field, &wire) < 0 or field > 2 or seen & (1 << field):
            return -1
        seen |= 1 << field
        if field == 1:
            if wire != VARINT or _varint(p, end, &pos, &v) < 0:
                return -1
        elif wire != LEN or _span(p, end, &pos, &start, &n) < 0 or not _utf8(p + start, n):
            return -1
    return 0


cdef int _system(const unsigned char* p, Py_ssize_t pos, Py_ssize_t end, Msg* m):
    cdef int field, wire
    cdef int seen = 0
    cdef uint64_t v
    cdef Py_ssize_t start, n
    m.sys_start = pos
    m.sys_end = end
    while pos < end:
        if _tag(p, end, &pos, &field, &wire) < 0 or field >= 32:
            return -1
        if field == 2:  # keys, repeated: checked in ``messages``
            if wire != LEN or _span(p, end, &pos, &start, &n) < 0 or not _utf8(p + start, n):
                return -1
            m.nkeys += 1
            continue
        if seen & (1 << field):
            return -1
        seen |= 1 << field
        if (field == 1 or field == 3 or field == 4 or field == 7 or field == 8 or field == 11
                or field == 17):
            if wire != LEN or _span(p, end, &pos, &start, &n) < 0:
                return -1
            if field == 1 or field == 3 or field == 17:  # tag, id, group: see ``messages``
                if not _utf8(p + start, n):
                    return -1
                if field == 1:
                    m.tag = p + start
                    m.tag_n = n
                elif field == 3:
                    m.mid = p + start
                    m.mid_n = n
                else:
                    m.group = p + start
                    m.group_n = n
            elif field == 4:  # body_digest
                if _digest(p, start, start + n) < 0:
                    return -1
            elif field == 7:  # born_timestamp
                if _timestamp(p, start, start + n, &m.born_s, &m.born_ns) < 0:
                    return -1
            elif field == 11:  # delivery_timestamp
                if _timestamp(p, start, start + n, &m.delivery_s, &m.delivery_ns) < 0:
                    return -1
                m.delivery = True
            else:  # born_host
                if not _utf8(p + start, n):
                    return -1
                m.host = p + start
                m.host_n = n
        elif field == 5 or field == 6 or field == 13:
            if wire != VARINT or _varint(p, end, &pos, &v) < 0:
                return -1
            if field == 5:
                m.encoding = <int32_t>v
            elif field == 6:
                m.mtype = <int32_t>v
            # 13, queue_id: the broker chooses the queue
        else:
            return -1
    return 0


cdef int _message(const unsigned char* p, Py_ssize_t pos, Py_ssize_t end, Msg* m):
    cdef int field, wire, seen = 0
    cdef Py_ssize_t start, n
    cdef Prop prop
    m.msg_start = pos
    m.msg_end = end
    while pos < end:
        if _tag(p, end, &pos, &field, &wire) < 0 or wire != LEN or field > 4:
            return -1
        if field == 2:  # user_properties, repeated entries: checked in ``messages``
            if _span(p, end, &pos, &start, &n) < 0 or _entry(p, start, start + n, &prop) < 0:
                return -1
            m.nprops += 1
            continue
        if seen & (1 << field):
            return -1
        seen |= 1 << field
        if _span(p, end, &pos, &start, &n) < 0:
            return -1
        if field == 1:
            if _resource(p, start, start + n, m) < 0:
                return -1
        elif field == 3:
            if _system(p, start, start + n, m) < 0:
                return -1
        else:
            m.body = p + start
            m.body_n = n
    return 0


cdef inline bint _plain_id(const unsigned char* s, Py_ssize_t n) noexcept nogil:
    """Non-blank printable ASCII of at most 128 characters: what the plain path takes."""
    cdef Py_ssize_t i
    cdef bint blank = True
    if n == 0 or n > MAX_ID:
        return False
    for i in range(n):
        if s[i] < 0x20 or s[i] > 0x7E:
            return False
        if s[i] != 0x20:
            blank = False
    return not blank


cdef inline bint _plain_tag(const unsigned char* s, Py_ssize_t n) noexcept nogil:
    """Non-blank printable ASCII without '|': a tag ``to_store_message`` takes as it is."""
    cdef Py_ssize_t i
    cdef bint blank = True
    for i in range(n):
        if s[i] < 0x20 or s[i] > 0x7E or s[i] == 0x7C:
            return False
        if s[i] != 0x20:
            blank = False
    return not blank


cdef inline void _put(object o, Py_ssize_t offset, object v):
    cdef PyObject** slot = <PyObject**>((<char*><PyObject*>o) + offset)
    Py_INCREF(v)
    Py_XDECREF(slot[0])
    slot[0] = <PyObject*>v


cdef inline int _skip(const unsigned char* p, Py_ssize_t end, Py_ssize_t* pos,
                      int wire) noexcept nogil:
    """Step over a field ``scan`` already took (a varint or a length-delimited one)."""
    cdef uint64_t v
    cdef Py_ssize_t start, n
    if wire == VARINT:
        return _varint(p, end, pos, &v)
    if wire == LEN:
        return _span(p, end, pos, &start, &n)
    return -1


cdef inline bint _no_control(const unsigned char* s, Py_ssize_t n) noexcept nogil:
    """Valid UTF-8 ``s`` holds none of Java's ISO control characters (U+0000-U+001F,
    U+007F-U+009F): no byte below 0x20, no 0x7F, and no 0xC2 lead byte of U+0080-U+009F (in
    valid UTF-8, 0xC2 is only ever a lead byte)."""
    cdef Py_ssize_t i
    for i in range(n):
        if s[i] < 0x20 or s[i] == 0x7F:
            return False
        if s[i] == 0xC2 and i + 1 < n and s[i + 1] <= 0x9F:
            return False
    return True


cdef inline bint _plain_key(const unsigned char* s, Py_ssize_t n) noexcept nogil:
    """A message key ``to_store_message`` takes: non-empty printable ASCII without a space
    (non-ASCII keys, where Python's ``strip`` knows more blanks, take the reference path)."""
    cdef Py_ssize_t i
    if n == 0:
        return False
    for i in range(n):
        if s[i] <= 0x20 or s[i] > 0x7E:
            return False
    return True


cdef inline int _key_order(const Prop* a, const Prop* b) noexcept nogil:
    """Python's order of the keys as str: UTF-8 byte order is code point order."""
    cdef Py_ssize_t n = a.key_n if a.key_n < b.key_n else b.key_n
    cdef int c = memcmp(a.key, b.key, n) if n else 0
    if c:
        return c
    return (a.key_n > b.key_n) - (a.key_n < b.key_n)


cdef Py_ssize_t _user_properties(const unsigned char* p, const Msg* m, Prop* props) noexcept:
    """Collect ``m``'s user properties into ``props`` sorted by key, as the reference stores
    them (decision 390); their UTF-8 bytes, or -1 when one is off the plain path: an empty
    key, a key given twice (protobuf keeps the last), a control character."""
    cdef Py_ssize_t pos = m.msg_start, end = m.msg_end, start, n, count = 0, size = 0, j
    cdef int field, wire
    cdef Prop prop
    while pos < end:
        if _tag(p, end, &pos, &field, &wire) < 0:
            return -1
        if field != 2:
            if _skip(p, end, &pos, wire) < 0:
                return -1
            continue
        if (wire != LEN or count >= m.nprops or _span(p, end, &pos, &start, &n) < 0
                or _entry(p, start, start + n, &prop) < 0):
            return -1
        if (prop.key_n == 0 or not _no_control(prop.key, prop.key_n)
                or not _no_control(prop.value, prop.value_n)):
            return -1
        # insertion sort: a message has a few properties
        j = count
        while j > 0 and _key_order(&props[j - 1], &prop) > 0:
            props[j] = props[j - 1]
            j -= 1
        if j > 0 and _key_order(&props[j - 1], &prop) == 0:
            return -1
        props[j] = prop
        count += 1
        size += prop.key_n + prop.value_n
    if count != m.nprops:
        return -1
    return size


cdef object _keys(const unsigned char* p, const Msg* m, Py_ssize_t* size):
    """``m``'s keys joined by a space, as the reference stores them, with their bytes in
    ``size``; None when one is off the plain path."""
    cdef Py_ssize_t pos = m.sys_start, end = m.sys_end, start, n, total = 0, at = 0, count = 0
    cdef int field, wire, k
    cdef object joined
    cdef char* out = NULL
    for k in range(2):  # check and measure, then copy
        pos = m.sys_start
        while pos < end:
            if _tag(p, end, &pos, &field, &wire) < 0:
                return None
            if field != 2:
                if _skip(p, end, &pos, wire) < 0:
                    return None
                continue
            if wire != LEN or _span(p, end, &pos, &start, &n) < 0:
                return None
            if k == 0:
                if not _plain_key(p + start, n):
                    return None
                total += n
                count += 1
            else:
                if at + n + (1 if at else 0) > total:
                    return None
                if at:
                    out[at] = 0x20
                    at += 1
                memcpy(out + at, p + start, n)
                at += n
        if k == 0:
            if count == 0:
                return None
            size[0] = total
            total += count - 1  # the separators: one fewer than the keys
            joined = PyBytes_FromStringAndSize(NULL, total)
            out = PyBytes_AS_STRING(joined)
    if at != total:
        return None
    return PyUnicode_DecodeASCII(out, total, NULL)


cdef inline bint _plain_group(const unsigned char* s, Py_ssize_t n) noexcept nogil:
    """A message group the reference takes: non-blank printable ASCII shorter than 64 bytes
    (``MAX_MESSAGE_GROUP_BYTES``; a non-ASCII group takes the reference path)."""
    return n < 64 and _plain_id(s, n)


cdef struct Buf:
    char* data
    Py_ssize_t len
    Py_ssize_t cap


cdef int _grow(Buf* b, Py_ssize_t more) except -1:
    cdef Py_ssize_t cap
    cdef char* grown
    if b.len + more <= b.cap:
        return 0
    cap = b.cap * 2 if b.cap * 2 > b.len + more else b.len + more + 4096
    grown = <char*>PyMem_Realloc(b.data, cap)
    if grown == NULL:
        raise MemoryError()
    b.data = grown
    b.cap = cap
    return 0


cdef int _property(Buf* b, const char* k, Py_ssize_t kn, const char* v,
                   Py_ssize_t vn) except -1:
    """``name\\x01value\\x02``, as ``record.encode_properties`` writes each pair."""
    _grow(b, kn + vn + 2)
    memcpy(b.data + b.len, k, kn)
    b.data[b.len + kn] = 1
    memcpy(b.data + b.len + kn + 1, v, vn)
    b.data[b.len + kn + 1 + vn] = 2
    b.len += kn + vn + 2
    return 0


cdef int _str_property(Buf* b, str name, object value) except -1:
    cdef Py_ssize_t kn, vn
    cdef const char* k = PyUnicode_AsUTF8AndSize(name, &kn)
    cdef const char* v = PyUnicode_AsUTF8AndSize(value, &vn)
    return _property(b, k, kn, v, vn)


cdef class SendBatch:
    """A scanned request: ``topic`` and ``count``, and where each message's fields lie."""

    cdef readonly str topic
    cdef readonly Py_ssize_t count
    cdef bytes raw
    cdef Msg* msgs
    cdef Py_ssize_t max_props  # the most user properties of one message

    def __dealloc__(self):
        PyMem_Free(self.msgs)

    def messages(self, int32_t type_code, str type_name, Py_ssize_t max_body,
                 Py_ssize_t max_properties, Py_ssize_t max_properties_bytes,
                 Py_ssize_t first_queue, Py_ssize_t queues, str peer_host, ip_or,
                 reserved):
        """``(messages, message_ids, body_bytes)``: see ``_build``."""
        return self._build(False, type_code, type_name, max_body, max_properties,
                           max_properties_bytes, first_queue, queues, peer_host, ip_or, reserved)

    def spans(self, int32_t type_code, str type_name, Py_ssize_t max_body,
              Py_ssize_t max_properties, Py_ssize_t max_properties_bytes,
              Py_ssize_t first_queue, Py_ssize_t queues, str peer_host, ip_or, reserved):
        """``(record_spans, message_ids, body_bytes)``: what ``messages`` answers, with the
        batch as a ``tiered.record.RecordSpans`` instead of ``Message`` objects (decision 700):
        the bodies stay in the request's bytes, each message's properties are written as the
        record holds them, in the order its ``Message``'s dict would hold them; the same
        checks, so None exactly when ``messages`` answers None."""
        return self._build(True, type_code, type_name, max_body, max_properties,
                           max_properties_bytes, first_queue, queues, peer_host, ip_or, reserved)

    cdef _build(self, bint spans, int32_t type_code, str type_name, Py_ssize_t max_body,
                Py_ssize_t max_properties, Py_ssize_t max_properties_bytes,
                Py_ssize_t first_queue, Py_ssize_t queues, str peer_host, ip_or, reserved):
        """``(messages, message_ids, body_bytes)`` for a topic taking ``type_code`` messages
        of at most ``max_body`` bytes, at most ``max_properties`` user properties (none in
        ``reserved``) and ``max_properties_bytes`` of properties, tag and keys; message ``i``
        without a group to queue ``(first_queue + i) % queues``, one with a group to the
        group's CRC32 modulo ``queues``; born hosts through ``ip_or(host, peer_host)``. None
        when a message is off the plain path (the caller takes the reference path for the
        whole batch)."""
        cdef Py_ssize_t i, j, total = 0, size, keys_size
        cdef const unsigned char* p = <const unsigned char*>PyBytes_AS_STRING(self.raw)
        cdef Msg* m
        cdef Prop* props = NULL
        cdef list out = []
        cdef list ids = []
        cdef const unsigned char* last_host = NULL
        cdef Py_ssize_t last_host_n = -1
        cdef object host = None
        cdef object message, message_id, key, keys
        cdef dict d
        cdef const unsigned char* last_tag = NULL
        cdef Py_ssize_t last_tag_n = -1
        cdef object tag = None
        cdef int64_t ns, ms
        cdef Py_ssize_t queue
        if queues <= 0:
            return None
        for i in range(self.count):
            m = &self.msgs[i]
            if (m.body_n == 0 or m.body_n > max_body or m.mtype != type_code
                    or m.encoding == GZIP or not _plain_id(m.mid, m.mid_n)
                    or not _valid_timestamp(m.born_s, m.born_ns)
                    or m.nprops > max_properties):
                return None
            if m.tag_n >= 0 and not _plain_tag(m.tag, m.tag_n):
                return None
            if m.group_n >= 0 and not _plain_group(m.group, m.group_n):
                return None
            if m.delivery and (
                    m.delivery_s > TS_MAX_MS if m.delivery_s > 100000000000  # ms, see below
                    else not _valid_timestamp(m.delivery_s, m.delivery_ns)):
                return None
        if spans:
            return self._spans(p, type_name, max_properties_bytes, first_queue, queues,
                               peer_host, ip_or, reserved)
        if self.max_props:
            props = <Prop*>PyMem_Malloc(self.max_props * sizeof(Prop))
            if props == NULL:
                raise MemoryError()
        try:
            for i in range(self.count):
                m = &self.msgs[i]
                d = {}
                size = 0
                if m.nprops:
                    size = _user_properties(p, m, props)
                    if size < 0:
                        return None
                    for j in range(m.nprops):
                        key = PyUnicode_DecodeUTF8(<const char*>props[j].key, props[j].key_n,
                                                   NULL)
                        if key in reserved:
                            return None
                        d[key] = PyUnicode_DecodeUTF8(<const char*>props[j].value,
                                                      props[j].value_n, NULL)
                if m.tag_n >= 0:  # to_store_message's order: the tag before the id
                    if tag is None or m.tag_n != last_tag_n or memcmp(m.tag, last_tag, m.tag_n):
                        tag = PyUnicode_DecodeASCII(<const char*>m.tag, m.tag_n, NULL)
                        last_tag = m.tag
                        last_tag_n = m.tag_n
                    d[_TAGS] = tag
                    size += m.tag_n
                if m.nkeys:
                    keys_size = 0
                    keys = _keys(p, m, &keys_size)
                    if keys is None:
                        return None
                    d[_KEYS] = keys
                    size += keys_size
                if size > max_properties_bytes:
                    return None
                message_id = PyUnicode_DecodeASCII(<const char*>m.mid, m.mid_n, NULL)
                ids.append(message_id)
                d[_UNIQ] = message_id
                d[_TYPE] = type_name
                if m.group_n >= 0:
                    d[_GROUP] = PyUnicode_DecodeASCII(<const char*>m.group, m.group_n, NULL)
                    # the reference's zlib.crc32(group.encode()) % queues
                    queue = <Py_ssize_t>(crc32(0, m.group, <unsigned int>m.group_n)
                                         % <uint64_t>queues)
                else:
                    queue = (first_queue + i) % queues
                if m.delivery:
                    if m.delivery_s > 100000000000:  # the Python client's seconds, unconverted
                        d[_DELIVER] = str(PyLong_FromLongLong(m.delivery_s))
                    else:
                        d[_DELIVER] = str(PyLong_FromLongLong(
                            m.delivery_s * 1000 + _floor_ms(m.delivery_ns)))
                if host is None or m.host_n != last_host_n or (
                        m.host_n and memcmp(m.host, last_host, m.host_n) != 0):
                    host = (ip_or(PyUnicode_DecodeUTF8(<const char*>m.host, m.host_n, NULL),
                                  peer_host), _ZERO)
                    last_host = m.host
                    last_host_n = m.host_n
                message = Message.__new__(Message)
                _put(message, _OFF[0], self.topic)
                _put(message, _OFF[1], PyBytes_FromStringAndSize(<const char*>m.body, m.body_n))
                _put(message, _OFF[2], PyLong_FromSsize_t(queue))
                _put(message, _OFF[3], d)
                _put(message, _OFF[4], _ZERO)
                _put(message, _OFF[5], PyLong_FromLongLong(m.born_s * 1000
                                                           + _floor_ms(m.born_ns)))
                _put(message, _OFF[6], host)
                _put(message, _OFF[7], _ZERO)
                _put(message, _OFF[8], _ZERO)
                out.append(message)
                total += m.body_n
        finally:
            PyMem_Free(props)
        return out, ids, total


    cdef _spans(self, const unsigned char* p, str type_name, Py_ssize_t max_properties_bytes,
                Py_ssize_t first_queue, Py_ssize_t queues, str peer_host, ip_or, reserved):
        """``_build``'s second loop for ``spans``, once the first has checked every message:
        the same properties in the same order, written as bytes (decision 700)."""
        cdef Py_ssize_t i, j, total = 0, size, keys_size, queue
        cdef Msg* m
        cdef Prop* props = NULL
        cdef Buf b
        cdef bytes span_bytes = PyBytes_FromStringAndSize(
            NULL, self.count * <Py_ssize_t>sizeof(tmq_span))
        cdef tmq_span* sp = <tmq_span*>PyBytes_AS_STRING(span_bytes)
        cdef list hosts = [], tags = [], key_column = [], ids = [], names = []
        cdef const unsigned char* last_host = NULL
        cdef Py_ssize_t last_host_n = -1
        cdef const unsigned char* last_tag = NULL
        cdef Py_ssize_t last_tag_n = -1
        cdef object tag = None, keys, message_id, spans
        cdef bytes name
        cdef const char* type_p
        cdef Py_ssize_t type_n
        cdef char digits[32]
        cdef int nd
        cdef int64_t delivery
        type_p = PyUnicode_AsUTF8AndSize(type_name, &type_n)
        # The reserved names as UTF-8: a key is one of them when its bytes are (UTF-8 is 1:1).
        for word in reserved:
            names.append((<str>word).encode())
        b.data = NULL
        b.len = 0
        b.cap = 0
        if self.max_props:
            props = <Prop*>PyMem_Malloc(self.max_props * sizeof(Prop))
            if props == NULL:
                raise MemoryError()
        try:
            for i in range(self.count):
                m = &self.msgs[i]
                sp[i].props_at = b.len
                size = 0
                if m.nprops:
                    size = _user_properties(p, m, props)
                    if size < 0:
                        return None
                    for j in range(m.nprops):
                        for name in names:
                            if (PyBytes_GET_SIZE(name) == props[j].key_n and memcmp(
                                    PyBytes_AS_STRING(name), props[j].key, props[j].key_n) == 0):
                                return None
                        _property(&b, <const char*>props[j].key, props[j].key_n,
                                  <const char*>props[j].value, props[j].value_n)
                if m.tag_n >= 0:
                    if tag is None or m.tag_n != last_tag_n or memcmp(m.tag, last_tag, m.tag_n):
                        tag = PyUnicode_DecodeASCII(<const char*>m.tag, m.tag_n, NULL)
                        last_tag = m.tag
                        last_tag_n = m.tag_n
                    _property(&b, "TAGS", 4, <const char*>m.tag, m.tag_n)
                    size += m.tag_n
                    tags.append(tag)
                else:
                    tags.append(None)
                if m.nkeys:
                    keys_size = 0
                    keys = _keys(p, m, &keys_size)
                    if keys is None:
                        return None
                    _str_property(&b, _KEYS, keys)
                    size += keys_size
                    key_column.append(keys)
                else:
                    key_column.append(None)
                if size > max_properties_bytes:
                    return None
                message_id = PyUnicode_DecodeASCII(<const char*>m.mid, m.mid_n, NULL)
                ids.append(message_id)
                _property(&b, "UNIQ_KEY", 8, <const char*>m.mid, m.mid_n)
                _property(&b, "__MESSAGE_TYPE", 14, type_p, type_n)
                if m.group_n >= 0:
                    _property(&b, "__SHARDINGKEY", 13, <const char*>m.group, m.group_n)
                    queue = <Py_ssize_t>(crc32(0, m.group, <unsigned int>m.group_n)
                                         % <uint64_t>queues)
                else:
                    queue = (first_queue + i) % queues
                if m.delivery:
                    if m.delivery_s > 100000000000:  # the Python client's seconds, unconverted
                        delivery = m.delivery_s
                    else:
                        delivery = m.delivery_s * 1000 + _floor_ms(m.delivery_ns)
                    nd = snprintf(digits, 32, "%lld", <long long>delivery)
                    _property(&b, "__STARTDELIVERTIME", 18, digits, nd)
                if last_host_n < 0 or m.host_n != last_host_n or (
                        m.host_n and memcmp(m.host, last_host, m.host_n) != 0):
                    hosts.append(ip_or(PyUnicode_DecodeUTF8(<const char*>m.host, m.host_n, NULL),
                                       peer_host))
                    last_host = m.host
                    last_host_n = m.host_n
                sp[i].props_len = b.len - sp[i].props_at
                sp[i].body_at = m.body - p
                sp[i].body_len = m.body_n
                sp[i].born_timestamp = m.born_s * 1000 + _floor_ms(m.born_ns)
                sp[i].queue_id = queue
                sp[i].host = len(hosts) - 1
                total += m.body_n
            spans = RecordSpans(self.topic, self.raw, span_bytes,
                                PyBytes_FromStringAndSize(b.data, b.len), hosts, tags,
                                key_column, ids)
        finally:
            PyMem_Free(props)
            PyMem_Free(b.data)
        return spans, ids, total


cdef inline bint _valid_timestamp(int64_t seconds, int32_t nanos) noexcept nogil:
    """protobuf's ``Timestamps.isValid``."""
    return TS_MIN_S <= seconds <= TS_MAX_S and 0 <= nanos < 1000000000


cdef inline int64_t _floor_ms(int32_t nanos) noexcept nogil:
    """Python's ``nanos // 1_000_000`` (floor division, as the reference's)."""
    cdef int64_t ns = nanos
    cdef int64_t ms = ns // 1000000
    if ns % 1000000 != 0 and ns < 0:
        ms -= 1
    return ms


def scan(bytes raw):
    """A ``SendBatch`` for ``raw``, a serialized SendMessageRequest, or None when some part of
    it is not on the plain path or not well-formed (the caller parses it with protobuf)."""
    cdef const unsigned char* p = <const unsigned char*>PyBytes_AS_STRING(raw)
    cdef Py_ssize_t end = PyBytes_GET_SIZE(raw), pos = 0, start, n, count = 0, cap = 0
    cdef int field, wire
    cdef Msg* msgs = NULL
    cdef Msg* grown
    cdef Py_ssize_t i
    cdef SendBatch batch
    cdef Py_ssize_t max_props = 0
    if Message is None:
        return None
    try:
        while pos < end:
            if _tag(p, end, &pos, &field, &wire) < 0 or field != 1 or wire != LEN:
                return None
            if _span(p, end, &pos, &start, &n) < 0:
                return None
            if count == cap:
                cap = cap * 2 if cap else 128
                grown = <Msg*>PyMem_Malloc(cap * sizeof(Msg))
                if grown == NULL:
                    raise MemoryError()
                for i in range(count):
                    grown[i] = msgs[i]
                PyMem_Free(msgs)
                msgs = grown
            memset(&msgs[count], 0, sizeof(Msg))
            msgs[count].tag_n = -1
            msgs[count].group_n = -1
            if _message(p, start, start + n, &msgs[count]) < 0:
                return None
            if msgs[count].nprops > max_props:
                max_props = msgs[count].nprops
            # topic_n first: a message without a topic has a NULL pointer, not for memcmp.
            if count and (msgs[count].topic_n != msgs[0].topic_n or (msgs[0].topic_n and memcmp(
                    msgs[count].topic, msgs[0].topic, msgs[0].topic_n) != 0)):
                return None  # the reference answers a batch of several topics
            count += 1
        if count == 0 or msgs[0].topic_n == 0:
            return None
        batch = SendBatch.__new__(SendBatch)
        batch.raw = raw
        batch.count = count
        batch.topic = PyUnicode_DecodeUTF8(<const char*>msgs[0].topic, msgs[0].topic_n, NULL)
        batch.msgs = msgs
        batch.max_props = max_props
        msgs = NULL
        return batch
    finally:
        PyMem_Free(msgs)
