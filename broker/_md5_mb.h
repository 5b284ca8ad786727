/* MD5 of many buffers at once, eight in the lanes of AVX2 registers (decision 640): the cold
 * worker's reply writer digests every body of a run, and MD5's steps depend each on the one
 * before, so one buffer at a time leaves most of a core's units idle. Eight buffers side by side
 * do eight MD5 steps per instruction; a lane whose buffer ends takes the next one. Without AVX2
 * (checked at run time) each buffer goes through the scalar tmq_md5. Checked against hashlib in
 * tests/test_cold_replies.py, lengths around every padding boundary. */
#ifndef TMQ_MD5_MB_H
#define TMQ_MD5_MB_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "_md5.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define TMQ_MD5_MB_X86 1
#include <immintrin.h>

#define TMQ_MB_LANES 8

#define TMQ_MB_ROTL(x, s) _mm256_or_si256(_mm256_slli_epi32((x), (s)), _mm256_srli_epi32((x), 32 - (s)))
#define TMQ_MB_F(x, y, z) _mm256_xor_si256((z), _mm256_and_si256((x), _mm256_xor_si256((y), (z))))
#define TMQ_MB_G(x, y, z) _mm256_xor_si256((y), _mm256_and_si256((z), _mm256_xor_si256((x), (y))))
#define TMQ_MB_H(x, y, z) _mm256_xor_si256(_mm256_xor_si256((x), (y)), (z))
#define TMQ_MB_I(x, y, z) _mm256_xor_si256((y), _mm256_or_si256((x), _mm256_xor_si256((z), ones)))
#define TMQ_MB_STEP(f, a, b, c, d, i, s)                                                        \
    do {                                                                                      \
        (a) = _mm256_add_epi32((a), _mm256_add_epi32(TMQ_MB_##f((b), (c), (d)),               \
                                                     _mm256_add_epi32(w[(i)], k[step])));    \
        (a) = _mm256_add_epi32(TMQ_MB_ROTL((a), (s)), (b));                                   \
        step++;                                                                               \
    } while (0)

/* One 64-byte block in each of eight lanes: state[4] holds a, b, c, d of the eight. */
__attribute__((target("avx2"))) static void tmq_md5_mb_block(__m256i state[4],
                                                             const unsigned char* const p[8]) {
    __m256i w[16], k[64], a = state[0], b = state[1], c = state[2], d = state[3];
    const __m256i ones = _mm256_set1_epi32(-1);
    int i, step = 0;
    uint32_t v[8];
    int lane;
    for (i = 0; i < 16; i++) {
        for (lane = 0; lane < 8; lane++) memcpy(&v[lane], p[lane] + 4 * i, 4); /* little-endian */
        w[i] = _mm256_loadu_si256((const __m256i*)v);
    }
    for (i = 0; i < 64; i++) k[i] = _mm256_set1_epi32((int)tmq_md5_k[i]);
    TMQ_MB_STEP(F, a, b, c, d, 0, 7);
    TMQ_MB_STEP(F, d, a, b, c, 1, 12);
    TMQ_MB_STEP(F, c, d, a, b, 2, 17);
    TMQ_MB_STEP(F, b, c, d, a, 3, 22);
    TMQ_MB_STEP(F, a, b, c, d, 4, 7);
    TMQ_MB_STEP(F, d, a, b, c, 5, 12);
    TMQ_MB_STEP(F, c, d, a, b, 6, 17);
    TMQ_MB_STEP(F, b, c, d, a, 7, 22);
    TMQ_MB_STEP(F, a, b, c, d, 8, 7);
    TMQ_MB_STEP(F, d, a, b, c, 9, 12);
    TMQ_MB_STEP(F, c, d, a, b, 10, 17);
    TMQ_MB_STEP(F, b, c, d, a, 11, 22);
    TMQ_MB_STEP(F, a, b, c, d, 12, 7);
    TMQ_MB_STEP(F, d, a, b, c, 13, 12);
    TMQ_MB_STEP(F, c, d, a, b, 14, 17);
    TMQ_MB_STEP(F, b, c, d, a, 15, 22);
    TMQ_MB_STEP(G, a, b, c, d, 1, 5);
    TMQ_MB_STEP(G, d, a, b, c, 6, 9);
    TMQ_MB_STEP(G, c, d, a, b, 11, 14);
    TMQ_MB_STEP(G, b, c, d, a, 0, 20);
    TMQ_MB_STEP(G, a, b, c, d, 5, 5);
    TMQ_MB_STEP(G, d, a, b, c, 10, 9);
    TMQ_MB_STEP(G, c, d, a, b, 15, 14);
    TMQ_MB_STEP(G, b, c, d, a, 4, 20);
    TMQ_MB_STEP(G, a, b, c, d, 9, 5);
    TMQ_MB_STEP(G, d, a, b, c, 14, 9);
    TMQ_MB_STEP(G, c, d, a, b, 3, 14);
    TMQ_MB_STEP(G, b, c, d, a, 8, 20);
    TMQ_MB_STEP(G, a, b, c, d, 13, 5);
    TMQ_MB_STEP(G, d, a, b, c, 2, 9);
    TMQ_MB_STEP(G, c, d, a, b, 7, 14);
    TMQ_MB_STEP(G, b, c, d, a, 12, 20);
    TMQ_MB_STEP(H, a, b, c, d, 5, 4);
    TMQ_MB_STEP(H, d, a, b, c, 8, 11);
    TMQ_MB_STEP(H, c, d, a, b, 11, 16);
    TMQ_MB_STEP(H, b, c, d, a, 14, 23);
    TMQ_MB_STEP(H, a, b, c, d, 1, 4);
    TMQ_MB_STEP(H, d, a, b, c, 4, 11);
    TMQ_MB_STEP(H, c, d, a, b, 7, 16);
    TMQ_MB_STEP(H, b, c, d, a, 10, 23);
    TMQ_MB_STEP(H, a, b, c, d, 13, 4);
    TMQ_MB_STEP(H, d, a, b, c, 0, 11);
    TMQ_MB_STEP(H, c, d, a, b, 3, 16);
    TMQ_MB_STEP(H, b, c, d, a, 6, 23);
    TMQ_MB_STEP(H, a, b, c, d, 9, 4);
    TMQ_MB_STEP(H, d, a, b, c, 12, 11);
    TMQ_MB_STEP(H, c, d, a, b, 15, 16);
    TMQ_MB_STEP(H, b, c, d, a, 2, 23);
    TMQ_MB_STEP(I, a, b, c, d, 0, 6);
    TMQ_MB_STEP(I, d, a, b, c, 7, 10);
    TMQ_MB_STEP(I, c, d, a, b, 14, 15);
    TMQ_MB_STEP(I, b, c, d, a, 5, 21);
    TMQ_MB_STEP(I, a, b, c, d, 12, 6);
    TMQ_MB_STEP(I, d, a, b, c, 3, 10);
    TMQ_MB_STEP(I, c, d, a, b, 10, 15);
    TMQ_MB_STEP(I, b, c, d, a, 1, 21);
    TMQ_MB_STEP(I, a, b, c, d, 8, 6);
    TMQ_MB_STEP(I, d, a, b, c, 15, 10);
    TMQ_MB_STEP(I, c, d, a, b, 6, 15);
    TMQ_MB_STEP(I, b, c, d, a, 13, 21);
    TMQ_MB_STEP(I, a, b, c, d, 4, 6);
    TMQ_MB_STEP(I, d, a, b, c, 11, 10);
    TMQ_MB_STEP(I, c, d, a, b, 2, 15);
    TMQ_MB_STEP(I, b, c, d, a, 9, 21);
    state[0] = _mm256_add_epi32(state[0], a);
    state[1] = _mm256_add_epi32(state[1], b);
    state[2] = _mm256_add_epi32(state[2], c);
    state[3] = _mm256_add_epi32(state[3], d);
}

/* One lane's buffer: its whole blocks read in place, its last one or two (the rest, 0x80, zeros
 * and the length in bits) from tail. */
typedef struct {
    const unsigned char* p;
    size_t full;   /* whole 64-byte blocks of the buffer */
    size_t total;  /* full plus the one or two padding blocks */
    size_t at;     /* the next block */
    size_t index;  /* which buffer: where its digest goes */
    unsigned char tail[128];
} tmq_md5_lane;

static void tmq_md5_lane_start(tmq_md5_lane* l, const unsigned char* p, size_t n, size_t index) {
    size_t rest, size;
    uint64_t bits = (uint64_t)n * 8;
    int j;
    l->p = p;
    l->full = n / 64;
    rest = n - l->full * 64;
    size = rest < 56 ? 64 : 128;
    if (rest) memcpy(l->tail, p + l->full * 64, rest);
    l->tail[rest] = 0x80;
    memset(l->tail + rest + 1, 0, size - rest - 1);
    for (j = 0; j < 8; j++) l->tail[size - 8 + j] = (unsigned char)(bits >> (8 * j));
    l->total = l->full + size / 64;
    l->at = 0;
    l->index = index;
}

__attribute__((target("avx2"))) static void tmq_md5_many_avx2(const unsigned char* const* ptrs,
                                                              const size_t* lens, size_t n,
                                                              unsigned char* out) {
    static const unsigned char idle[64] = {0};
    tmq_md5_lane lanes[TMQ_MB_LANES];
    int busy[TMQ_MB_LANES];
    const unsigned char* blocks[TMQ_MB_LANES];
    uint32_t h[4][TMQ_MB_LANES];
    __m256i state[4];
    size_t next = 0;
    int lane, active, j;
    for (lane = 0; lane < TMQ_MB_LANES; lane++) busy[lane] = 0;
    for (;;) {
        active = 0;
        for (lane = 0; lane < TMQ_MB_LANES; lane++) {
            if (!busy[lane] && next < n) {
                tmq_md5_lane_start(&lanes[lane], ptrs[next], lens[next], next);
                h[0][lane] = 0x67452301u;
                h[1][lane] = 0xefcdab89u;
                h[2][lane] = 0x98badcfeu;
                h[3][lane] = 0x10325476u;
                busy[lane] = 1;
                next++;
            }
            if (busy[lane]) {
                tmq_md5_lane* l = &lanes[lane];
                blocks[lane] = l->at < l->full ? l->p + 64 * l->at : l->tail + 64 * (l->at - l->full);
                active++;
            } else {
                blocks[lane] = idle;
            }
        }
        if (!active) break;
        for (j = 0; j < 4; j++) state[j] = _mm256_loadu_si256((const __m256i*)h[j]);
        tmq_md5_mb_block(state, blocks);
        for (j = 0; j < 4; j++) _mm256_storeu_si256((__m256i*)h[j], state[j]);
        for (lane = 0; lane < TMQ_MB_LANES; lane++) {
            if (busy[lane] && ++lanes[lane].at == lanes[lane].total) {
                unsigned char* o = out + 16 * lanes[lane].index;
                for (j = 0; j < 16; j++) o[j] = (unsigned char)(h[j >> 2][lane] >> (8 * (j & 3)));
                busy[lane] = 0;
            }
        }
    }
}
#endif

/* The MD5 of buffers[i] (lens[i] bytes) into out[16 * i .. 16 * i + 15], for i < n. */
static void tmq_md5_many(const unsigned char* const* ptrs, const size_t* lens, size_t n,
                         unsigned char* out) {
    size_t i;
#ifdef TMQ_MD5_MB_X86
    if (n > 1 && __builtin_cpu_supports("avx2")) {
        tmq_md5_many_avx2(ptrs, lens, n, out);
        return;
    }
#endif
    for (i = 0; i < n; i++) tmq_md5(ptrs[i], lens[i], out + 16 * i);
}

#endif
