/* C helpers of the native record engine (tiered/_record_native.pyx): big-endian field access
 * and CRC32C. No GIL, no Python objects.
 *
 * CRC32C (Castagnoli) is computed as google-crc32c computes it: with the SSE4.2 crc32
 * instruction where the CPU has it (chosen once at run time), else with a slicing-by-8 table. */
#ifndef TMQ_RECORD_NATIVE_H
#define TMQ_RECORD_NATIVE_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include <Python.h>
#include <structmember.h>

/* The offset of a __slots__ member inside its instances (a dataclass(slots=True) field), or -1
 * when ``descr`` is not a member descriptor of an object slot. */
static Py_ssize_t tmq_slot_offset(PyObject *descr) {
    if (!Py_IS_TYPE(descr, &PyMemberDescr_Type)) return -1;
    PyMemberDef *def = ((PyMemberDescrObject *)descr)->d_member;
    if (def->type != T_OBJECT_EX || (def->flags & READONLY)) return -1;
    return def->offset;
}

/* The value in the slot at ``offset`` of ``obj`` (a new reference), or NULL with AttributeError
 * when the slot is empty. */
static inline PyObject *tmq_slot(PyObject *obj, Py_ssize_t offset, PyObject *name) {
    PyObject *v = *(PyObject **)((char *)obj + offset);
    if (v == NULL) {
        PyErr_SetObject(PyExc_AttributeError, name);
        return NULL;
    }
    Py_INCREF(v);
    return v;
}

static inline uint16_t tmq_be16(const unsigned char *p) { return (uint16_t)((p[0] << 8) | p[1]); }
static inline uint32_t tmq_be32(const unsigned char *p) {
    uint32_t v;
    memcpy(&v, p, 4);
    return __builtin_bswap32(v);
}
static inline uint64_t tmq_be64(const unsigned char *p) {
    uint64_t v;
    memcpy(&v, p, 8);
    return __builtin_bswap64(v);
}
static inline void tmq_put16(unsigned char *p, uint16_t v) {
    p[0] = (unsigned char)(v >> 8);
    p[1] = (unsigned char)v;
}
static inline void tmq_put32(unsigned char *p, uint32_t v) {
    v = __builtin_bswap32(v);
    memcpy(p, &v, 4);
}
static inline void tmq_put64(unsigned char *p, uint64_t v) {
    v = __builtin_bswap64(v);
    memcpy(p, &v, 8);
}

static uint32_t tmq_crc_table[8][256];
static int tmq_crc_ready = 0;
static int tmq_crc_hw = 0;

static void tmq_x2n_init(void);
static void tmq_lane_shift_init(void);

static void tmq_crc32c_init(void) {
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++) c = (c & 1) ? (c >> 1) ^ 0x82F63B78u : c >> 1;
        tmq_crc_table[0][i] = c;
    }
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = tmq_crc_table[0][i];
        for (int t = 1; t < 8; t++) {
            c = tmq_crc_table[0][c & 0xFF] ^ (c >> 8);
            tmq_crc_table[t][i] = c;
        }
    }
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
    __builtin_cpu_init();
    tmq_crc_hw = __builtin_cpu_supports("sse4.2");
#endif
    tmq_x2n_init();
    tmq_lane_shift_init();
    tmq_crc_ready = 1;
}

static uint32_t tmq_crc32c_sw(uint32_t crc, const unsigned char *p, size_t n) {
    while (n && ((uintptr_t)p & 7)) {
        crc = tmq_crc_table[0][(crc ^ *p++) & 0xFF] ^ (crc >> 8);
        n--;
    }
    while (n >= 8) {
        uint64_t w;
        memcpy(&w, p, 8);
        w ^= crc;
        crc = tmq_crc_table[7][w & 0xFF] ^ tmq_crc_table[6][(w >> 8) & 0xFF] ^
              tmq_crc_table[5][(w >> 16) & 0xFF] ^ tmq_crc_table[4][(w >> 24) & 0xFF] ^
              tmq_crc_table[3][(w >> 32) & 0xFF] ^ tmq_crc_table[2][(w >> 40) & 0xFF] ^
              tmq_crc_table[1][(w >> 48) & 0xFF] ^ tmq_crc_table[0][w >> 56];
        p += 8;
        n -= 8;
    }
    while (n--) crc = tmq_crc_table[0][(crc ^ *p++) & 0xFF] ^ (crc >> 8);
    return crc;
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
__attribute__((target("sse4.2"))) static uint32_t tmq_crc32c_hw(uint32_t crc,
                                                                 const unsigned char *p,
                                                                 size_t n) {
    uint64_t c = crc;
    while (n && ((uintptr_t)p & 7)) {
        c = __builtin_ia32_crc32qi((uint32_t)c, *p++);
        n--;
    }
    while (n >= 8) {
        uint64_t w;
        memcpy(&w, p, 8);
        c = __builtin_ia32_crc32di(c, w);
        p += 8;
        n -= 8;
    }
    while (n--) c = __builtin_ia32_crc32qi((uint32_t)c, *p++);
    return (uint32_t)c;
}
#endif

/* GF(2) polynomial arithmetic modulo CRC32C's polynomial (reflected), as zlib's crc32_combine
 * does it for CRC32: ``tmq_crc32c_combine(a, b, n)`` is the CRC32C of A followed by B, given
 * the CRC32C ``a`` of A and ``b`` of the ``n`` bytes of B. The append path uses it so that the
 * body is read once for both BODYCRC and the record CRC (decision 320). */
static uint32_t tmq_x2n_table[32];

static uint32_t tmq_multmodp(uint32_t a, uint32_t b) {
    uint32_t m = (uint32_t)1 << 31, p = 0;
    for (;;) {
        if (a & m) {
            p ^= b;
            if ((a & (m - 1)) == 0) break;
        }
        m >>= 1;
        b = b & 1 ? (b >> 1) ^ 0x82F63B78u : b >> 1;
    }
    return p;
}

static void tmq_x2n_init(void) {
    uint32_t p = (uint32_t)1 << 30; /* x^1 */
    tmq_x2n_table[0] = p;
    for (int n = 1; n < 32; n++) tmq_x2n_table[n] = p = tmq_multmodp(p, p);
}

/* x^(8n) modulo the polynomial: the operator that appends ``n`` zero bytes to a CRC. */
static uint32_t tmq_crc32c_zeros_op(uint64_t n) {
    uint32_t p = (uint32_t)1 << 31; /* x^0 */
    unsigned k = 3;
    while (n) {
        if (n & 1) p = tmq_multmodp(tmq_x2n_table[k & 31], p);
        n >>= 1;
        k++;
    }
    return p;
}

/* The CRC32C of A then B from ``a`` = CRC32C(A) and ``b`` = CRC32C(B), with ``op`` =
 * ``tmq_crc32c_zeros_op(len(B))``. */
static inline uint32_t tmq_crc32c_combine_op(uint32_t a, uint32_t b, uint32_t op) {
    return tmq_multmodp(op, a) ^ b;
}

/* Extend ``crc`` (a finished CRC32C, 0 for none) over ``n`` bytes at ``p``. */
static inline uint32_t tmq_crc32c_extend(uint32_t crc, const unsigned char *p, size_t n) {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
    if (tmq_crc_hw) return ~tmq_crc32c_hw(~crc, p, n);
#endif
    return ~tmq_crc32c_sw(~crc, p, n);
}

/* Three lanes of TMQ_LANE bytes are CRCed at once: the crc32 instruction has a latency of three
 * cycles and a throughput of one, so one chain uses a third of it (google-crc32c and RocketMQ's
 * Crc32C interleave the same way). The lanes are joined by shifting a lane's register over
 * TMQ_LANE zero bytes, a linear map applied with four table lookups (Mark Adler's crc32c.c). */
#define TMQ_LANE 256
static uint32_t tmq_lane_shift[4][256];

static void tmq_lane_shift_init(void) {
    uint32_t op = tmq_crc32c_zeros_op(TMQ_LANE);
    for (int k = 0; k < 4; k++)
        for (uint32_t v = 0; v < 256; v++) tmq_lane_shift[k][v] = tmq_multmodp(op, v << (8 * k));
}

static inline uint32_t tmq_shift_lane(uint32_t crc) {
    return tmq_lane_shift[0][crc & 0xFF] ^ tmq_lane_shift[1][(crc >> 8) & 0xFF] ^
           tmq_lane_shift[2][(crc >> 16) & 0xFF] ^ tmq_lane_shift[3][crc >> 24];
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
__attribute__((target("sse4.2"))) static uint32_t tmq_crc32c_hw3(uint32_t crc,
                                                                  const unsigned char *p,
                                                                  size_t n) {
    /* ``crc`` is a raw register (pre-inverted), as in tmq_crc32c_hw. */
    while (n >= 3 * TMQ_LANE) {
        uint64_t c0 = crc, c1 = 0, c2 = 0;
        const unsigned char *end = p + TMQ_LANE;
        do {
            uint64_t w0, w1, w2;
            memcpy(&w0, p, 8);
            memcpy(&w1, p + TMQ_LANE, 8);
            memcpy(&w2, p + 2 * TMQ_LANE, 8);
            c0 = __builtin_ia32_crc32di(c0, w0);
            c1 = __builtin_ia32_crc32di(c1, w1);
            c2 = __builtin_ia32_crc32di(c2, w2);
            p += 8;
        } while (p < end);
        /* A raw register over data D from 0 is the linear part of D's CRC; shifting the
         * earlier lanes over the later ones' length and xoring joins them. */
        crc = tmq_shift_lane(tmq_shift_lane((uint32_t)c0) ^ (uint32_t)c1) ^ (uint32_t)c2;
        p += 2 * TMQ_LANE;
        n -= 3 * TMQ_LANE;
    }
    return tmq_crc32c_hw(crc, p, n);
}
#endif

/* ``tmq_crc32c_extend`` with the lanes interleaved: for runs of 768 bytes and more. */
static inline uint32_t tmq_crc32c_extend3(uint32_t crc, const unsigned char *p, size_t n) {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
    if (tmq_crc_hw) return ~tmq_crc32c_hw3(~crc, p, n);
#endif
    return ~tmq_crc32c_sw(~crc, p, n);
}

/* One message of a ``record.RecordSpans`` batch (decision 700): where its body lies in the
 * batch's ``raw`` buffer and its encoded properties in ``props``, with the fields the record
 * header takes from it. Seven int64 in native byte order, ``record.SPAN_STRUCT``: the SendMessage
 * walker (broker/_send_native.pyx) writes them, the encoder reads them in place. */
typedef struct {
    int64_t body_at;
    int64_t body_len;
    int64_t props_at;
    int64_t props_len;
    int64_t born_timestamp;
    int64_t queue_id;
    int64_t host; /* index into ``RecordSpans.hosts`` */
} tmq_span;

#endif
