/* MD5 (RFC 1321) of one buffer, for the cold worker's reply writer (decision 481): the
 * PullMessage body digest computed in C with the GIL released, without a hashlib object per
 * message. Checked against hashlib in tests/test_cold_replies.py. */
#ifndef TMQ_MD5_H
#define TMQ_MD5_H

#include <stdint.h>
#include <string.h>

static const uint32_t tmq_md5_k[64] = {
    0xd76aa478u, 0xe8c7b756u, 0x242070dbu, 0xc1bdceeeu,
    0xf57c0fafu, 0x4787c62au, 0xa8304613u, 0xfd469501u,
    0x698098d8u, 0x8b44f7afu, 0xffff5bb1u, 0x895cd7beu,
    0x6b901122u, 0xfd987193u, 0xa679438eu, 0x49b40821u,
    0xf61e2562u, 0xc040b340u, 0x265e5a51u, 0xe9b6c7aau,
    0xd62f105du, 0x02441453u, 0xd8a1e681u, 0xe7d3fbc8u,
    0x21e1cde6u, 0xc33707d6u, 0xf4d50d87u, 0x455a14edu,
    0xa9e3e905u, 0xfcefa3f8u, 0x676f02d9u, 0x8d2a4c8au,
    0xfffa3942u, 0x8771f681u, 0x6d9d6122u, 0xfde5380cu,
    0xa4beea44u, 0x4bdecfa9u, 0xf6bb4b60u, 0xbebfbc70u,
    0x289b7ec6u, 0xeaa127fau, 0xd4ef3085u, 0x04881d05u,
    0xd9d4d039u, 0xe6db99e5u, 0x1fa27cf8u, 0xc4ac5665u,
    0xf4292244u, 0x432aff97u, 0xab9423a7u, 0xfc93a039u,
    0x655b59c3u, 0x8f0ccc92u, 0xffeff47du, 0x85845dd1u,
    0x6fa87e4fu, 0xfe2ce6e0u, 0xa3014314u, 0x4e0811a1u,
    0xf7537e82u, 0xbd3af235u, 0x2ad7d2bbu, 0xeb86d391u
};

#define TMQ_MD5_F(x, y, z) ((z) ^ ((x) & ((y) ^ (z))))
#define TMQ_MD5_G(x, y, z) ((y) ^ ((z) & ((x) ^ (y))))
#define TMQ_MD5_H(x, y, z) ((x) ^ (y) ^ (z))
#define TMQ_MD5_I(x, y, z) ((y) ^ ((x) | ~(z)))
#define TMQ_MD5_STEP(f, a, b, c, d, x, k, s)          \
    do {                                              \
        (a) += TMQ_MD5_##f((b), (c), (d)) + (x) + (k); \
        (a) = ((a) << (s)) | ((a) >> (32 - (s)));     \
        (a) += (b);                                   \
    } while (0)

/* One 64-byte block, the 64 steps written out (the rotations and message words constant). */
static void tmq_md5_block(uint32_t h[4], const unsigned char* p) {
    uint32_t w[16], a = h[0], b = h[1], c = h[2], d = h[3];
    int i;
    for (i = 0; i < 16; i++)
        w[i] = (uint32_t)p[4 * i] | ((uint32_t)p[4 * i + 1] << 8) | ((uint32_t)p[4 * i + 2] << 16) |
               ((uint32_t)p[4 * i + 3] << 24);
    TMQ_MD5_STEP(F, a, b, c, d, w[0], tmq_md5_k[0], 7);
    TMQ_MD5_STEP(F, d, a, b, c, w[1], tmq_md5_k[1], 12);
    TMQ_MD5_STEP(F, c, d, a, b, w[2], tmq_md5_k[2], 17);
    TMQ_MD5_STEP(F, b, c, d, a, w[3], tmq_md5_k[3], 22);
    TMQ_MD5_STEP(F, a, b, c, d, w[4], tmq_md5_k[4], 7);
    TMQ_MD5_STEP(F, d, a, b, c, w[5], tmq_md5_k[5], 12);
    TMQ_MD5_STEP(F, c, d, a, b, w[6], tmq_md5_k[6], 17);
    TMQ_MD5_STEP(F, b, c, d, a, w[7], tmq_md5_k[7], 22);
    TMQ_MD5_STEP(F, a, b, c, d, w[8], tmq_md5_k[8], 7);
    TMQ_MD5_STEP(F, d, a, b, c, w[9], tmq_md5_k[9], 12);
    TMQ_MD5_STEP(F, c, d, a, b, w[10], tmq_md5_k[10], 17);
    TMQ_MD5_STEP(F, b, c, d, a, w[11], tmq_md5_k[11], 22);
    TMQ_MD5_STEP(F, a, b, c, d, w[12], tmq_md5_k[12], 7);
    TMQ_MD5_STEP(F, d, a, b, c, w[13], tmq_md5_k[13], 12);
    TMQ_MD5_STEP(F, c, d, a, b, w[14], tmq_md5_k[14], 17);
    TMQ_MD5_STEP(F, b, c, d, a, w[15], tmq_md5_k[15], 22);
    TMQ_MD5_STEP(G, a, b, c, d, w[1], tmq_md5_k[16], 5);
    TMQ_MD5_STEP(G, d, a, b, c, w[6], tmq_md5_k[17], 9);
    TMQ_MD5_STEP(G, c, d, a, b, w[11], tmq_md5_k[18], 14);
    TMQ_MD5_STEP(G, b, c, d, a, w[0], tmq_md5_k[19], 20);
    TMQ_MD5_STEP(G, a, b, c, d, w[5], tmq_md5_k[20], 5);
    TMQ_MD5_STEP(G, d, a, b, c, w[10], tmq_md5_k[21], 9);
    TMQ_MD5_STEP(G, c, d, a, b, w[15], tmq_md5_k[22], 14);
    TMQ_MD5_STEP(G, b, c, d, a, w[4], tmq_md5_k[23], 20);
    TMQ_MD5_STEP(G, a, b, c, d, w[9], tmq_md5_k[24], 5);
    TMQ_MD5_STEP(G, d, a, b, c, w[14], tmq_md5_k[25], 9);
    TMQ_MD5_STEP(G, c, d, a, b, w[3], tmq_md5_k[26], 14);
    TMQ_MD5_STEP(G, b, c, d, a, w[8], tmq_md5_k[27], 20);
    TMQ_MD5_STEP(G, a, b, c, d, w[13], tmq_md5_k[28], 5);
    TMQ_MD5_STEP(G, d, a, b, c, w[2], tmq_md5_k[29], 9);
    TMQ_MD5_STEP(G, c, d, a, b, w[7], tmq_md5_k[30], 14);
    TMQ_MD5_STEP(G, b, c, d, a, w[12], tmq_md5_k[31], 20);
    TMQ_MD5_STEP(H, a, b, c, d, w[5], tmq_md5_k[32], 4);
    TMQ_MD5_STEP(H, d, a, b, c, w[8], tmq_md5_k[33], 11);
    TMQ_MD5_STEP(H, c, d, a, b, w[11], tmq_md5_k[34], 16);
    TMQ_MD5_STEP(H, b, c, d, a, w[14], tmq_md5_k[35], 23);
    TMQ_MD5_STEP(H, a, b, c, d, w[1], tmq_md5_k[36], 4);
    TMQ_MD5_STEP(H, d, a, b, c, w[4], tmq_md5_k[37], 11);
    TMQ_MD5_STEP(H, c, d, a, b, w[7], tmq_md5_k[38], 16);
    TMQ_MD5_STEP(H, b, c, d, a, w[10], tmq_md5_k[39], 23);
    TMQ_MD5_STEP(H, a, b, c, d, w[13], tmq_md5_k[40], 4);
    TMQ_MD5_STEP(H, d, a, b, c, w[0], tmq_md5_k[41], 11);
    TMQ_MD5_STEP(H, c, d, a, b, w[3], tmq_md5_k[42], 16);
    TMQ_MD5_STEP(H, b, c, d, a, w[6], tmq_md5_k[43], 23);
    TMQ_MD5_STEP(H, a, b, c, d, w[9], tmq_md5_k[44], 4);
    TMQ_MD5_STEP(H, d, a, b, c, w[12], tmq_md5_k[45], 11);
    TMQ_MD5_STEP(H, c, d, a, b, w[15], tmq_md5_k[46], 16);
    TMQ_MD5_STEP(H, b, c, d, a, w[2], tmq_md5_k[47], 23);
    TMQ_MD5_STEP(I, a, b, c, d, w[0], tmq_md5_k[48], 6);
    TMQ_MD5_STEP(I, d, a, b, c, w[7], tmq_md5_k[49], 10);
    TMQ_MD5_STEP(I, c, d, a, b, w[14], tmq_md5_k[50], 15);
    TMQ_MD5_STEP(I, b, c, d, a, w[5], tmq_md5_k[51], 21);
    TMQ_MD5_STEP(I, a, b, c, d, w[12], tmq_md5_k[52], 6);
    TMQ_MD5_STEP(I, d, a, b, c, w[3], tmq_md5_k[53], 10);
    TMQ_MD5_STEP(I, c, d, a, b, w[10], tmq_md5_k[54], 15);
    TMQ_MD5_STEP(I, b, c, d, a, w[1], tmq_md5_k[55], 21);
    TMQ_MD5_STEP(I, a, b, c, d, w[8], tmq_md5_k[56], 6);
    TMQ_MD5_STEP(I, d, a, b, c, w[15], tmq_md5_k[57], 10);
    TMQ_MD5_STEP(I, c, d, a, b, w[6], tmq_md5_k[58], 15);
    TMQ_MD5_STEP(I, b, c, d, a, w[13], tmq_md5_k[59], 21);
    TMQ_MD5_STEP(I, a, b, c, d, w[4], tmq_md5_k[60], 6);
    TMQ_MD5_STEP(I, d, a, b, c, w[11], tmq_md5_k[61], 10);
    TMQ_MD5_STEP(I, c, d, a, b, w[2], tmq_md5_k[62], 15);
    TMQ_MD5_STEP(I, b, c, d, a, w[9], tmq_md5_k[63], 21);
    h[0] += a;
    h[1] += b;
    h[2] += c;
    h[3] += d;
}

static void tmq_md5(const unsigned char* p, size_t n, unsigned char out[16]) {
    uint32_t h[4] = {0x67452301u, 0xefcdab89u, 0x98badcfeu, 0x10325476u};
    unsigned char tail[128];
    size_t i = 0, rest, size;
    uint64_t bits = (uint64_t)n * 8;
    int j;
    for (; i + 64 <= n; i += 64) tmq_md5_block(h, p + i);
    rest = n - i;
    memcpy(tail, p + i, rest);
    tail[rest] = 0x80;
    size = rest < 56 ? 64 : 128;
    memset(tail + rest + 1, 0, size - rest - 1);
    for (j = 0; j < 8; j++) tail[size - 8 + j] = (unsigned char)(bits >> (8 * j));
    tmq_md5_block(h, tail);
    if (size == 128) tmq_md5_block(h, tail + 64);
    for (j = 0; j < 16; j++) out[j] = (unsigned char)(h[j >> 2] >> (8 * (j & 3)));
}

#endif
