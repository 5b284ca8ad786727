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

/* Extend ``crc`` (a finished CRC32C, 0 for none) over ``n`` bytes at ``p``. */
static inline uint32_t tmq_crc32c_extend(uint32_t crc, const unsigned char *p, size_t n) {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
    if (tmq_crc_hw) return ~tmq_crc32c_hw(~crc, p, n);
#endif
    return ~tmq_crc32c_sw(~crc, p, n);
}

#endif
