# Protobuf's base-128 varint, written natively: one writer for the record engine's SendMessage
# answer (tiered/_record_native.pyx) and the cold worker's pull replies
# (broker/_reply_native.pyx). Inline functions only, so a module that cimports them links to
# nothing at run time.

from libc.stdint cimport uint64_t


cdef inline unsigned char* write_varint(unsigned char* o, uint64_t v) noexcept nogil:
    """Writes ``v`` at ``o`` (at most 10 bytes: the caller has the room) and returns the byte
    after it."""
    while v >= 0x80:
        o[0] = <unsigned char>(v | 0x80)
        v >>= 7
        o += 1
    o[0] = <unsigned char>v
    return o + 1


cdef inline Py_ssize_t varint_len(uint64_t v) noexcept nogil:
    """How many bytes ``write_varint`` writes for ``v``."""
    cdef Py_ssize_t n = 1
    while v >= 0x80:
        v >>= 7
        n += 1
    return n
