/* The ASYNC batch ceiling of bench/store_append.py (decision 451, docs/performance.md): the same
 * work in C with no Python. Build and run from the repository root:
 *   gcc -O2 -o /tmp/append_ceiling bench/append_ceiling.c -Itiered $(python3-config --includes) -lpthread
 *   /tmp/append_ceiling MODE /tmp/some-new-file      (MODE 0-4 below; the file is removed after)
 * mode 0: pwrite of prebuilt records only (the kernel copy; what the store cannot beat)
 * mode 1: encode (header, body copy, CRC32C body 3 lanes, record CRC by combination) + pwritev
 *         skipping size fields + size stores through the mapping (what the store does natively)
 * mode 2: as 1, encode on a second thread, pipelined with the writer (double buffer)
 * mode 3: encode only (no write)
 * mode 4: encode + one pwrite with the size fields in place (what the store's encoder does for a
 *         batch of 16 KiB or more since decision 1040)
 */
#define _GNU_SOURCE
#include "_record_native.h"
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#define N 256
#define BODY 1024
#define FILESZ (1L << 30)
static unsigned char body[BODY];
static const char props[] = "UNIQ_KEY\x01" "0A000001000000000000000000000001\x02";
static const unsigned char topic[] = {0, 5, 'b', 'e', 'n', 'c', 'h'};
static int recsz;

static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }
static double cpu(void) { struct timespec t; clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t); return t.tv_sec + t.tv_nsec * 1e-9; }

static void encode(unsigned char *out, long phys, long qbase) {
    unsigned char *o = out;
    uint32_t op = tmq_crc32c_zeros_op(BODY);
    for (int i = 0; i < N; i++) {
        uint32_t crc = tmq_crc32c_extend3(0, body, BODY);
        tmq_put32(o, recsz); tmq_put32(o + 4, (uint32_t)-626843477); tmq_put32(o + 8, crc);
        tmq_put32(o + 12, i % 8); tmq_put32(o + 16, 0); tmq_put64(o + 20, qbase + i);
        tmq_put64(o + 28, phys + (long)i * recsz); tmq_put32(o + 36, 65536); tmq_put64(o + 40, 1);
        memset(o + 48, 0, 8); tmq_put64(o + 56, 2); memset(o + 64, 0, 8);
        tmq_put32(o + 72, 0); tmq_put64(o + 76, 0); tmq_put32(o + 84, BODY);
        unsigned char *p = o + 88; memcpy(p, body, BODY); p += BODY;
        unsigned char *tail = p;
        memcpy(p, topic, sizeof topic); p += sizeof topic;
        tmq_put16(p, sizeof props - 1 + 20); memcpy(p + 2, props, sizeof props - 1);
        uint32_t whole = tmq_crc32c_extend(0, o, 88);
        whole = tmq_crc32c_combine_op(whole, crc, op);
        whole = tmq_crc32c_extend(whole, tail, o + recsz - 20 - tail);
        tmq_put32(o + recsz - 20, whole); memset(o + recsz - 16, '0', 16);
        o += recsz;
    }
}

static int fd; static unsigned char *mm; static unsigned char zero4[4];
static void write_batch(unsigned char *buf, long pos) {
    struct iovec iov[2 * N];
    for (int i = 0; i < N; i++) {
        iov[2 * i].iov_base = zero4; iov[2 * i].iov_len = 4;
        iov[2 * i + 1].iov_base = buf + (long)i * recsz + 4; iov[2 * i + 1].iov_len = recsz - 4;
    }
    if (pwritev(fd, iov, 2 * N, pos) != (ssize_t)N * recsz) { perror("pwritev"); exit(1); }
    for (int i = 0; i < N; i++) memcpy(mm + pos + (long)i * recsz, buf + (long)i * recsz, 4);
}

static unsigned char *bufs[2]; static int batches;
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER; static pthread_cond_t cv = PTHREAD_COND_INITIALIZER;
static int encoded = 0, written = 0;
static void *encoder(void *arg) {
    (void)arg;
    for (int b = 0; b < batches; b++) {
        pthread_mutex_lock(&mu); while (encoded - written >= 2) pthread_cond_wait(&cv, &mu); pthread_mutex_unlock(&mu);
        encode(bufs[b & 1], (long)b * N * recsz, (long)b * N);
        pthread_mutex_lock(&mu); encoded++; pthread_cond_broadcast(&cv); pthread_mutex_unlock(&mu);
    }
    return NULL;
}

int main(int argc, char **argv) {
    int mode = atoi(argv[1]); const char *path = argv[2]; long msgs = 400000;
    tmq_crc32c_init();
    for (int i = 0; i < BODY; i++) body[i] = rand();
    recsz = 88 + BODY + sizeof topic + 2 + sizeof props - 1 + 20;
    batches = msgs / N;
    fd = open(path, O_RDWR | O_CREAT | O_EXCL, 0644);
    if (posix_fallocate(fd, 0, FILESZ)) { perror("fallocate"); return 1; }
    fsync(fd);
    mm = mmap(NULL, FILESZ, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    bufs[0] = malloc(N * recsz); bufs[1] = malloc(N * recsz);
    encode(bufs[0], 0, 0);
    double t0 = now(), c0 = cpu();
    if (mode == 2) {
        pthread_t th; pthread_create(&th, NULL, encoder, NULL);
        for (int b = 0; b < batches; b++) {
            pthread_mutex_lock(&mu); while (encoded <= b) pthread_cond_wait(&cv, &mu); pthread_mutex_unlock(&mu);
            write_batch(bufs[b & 1], (long)b * N * recsz);
            pthread_mutex_lock(&mu); written++; pthread_cond_broadcast(&cv); pthread_mutex_unlock(&mu);
        }
        pthread_join(th, NULL);
    } else {
        for (int b = 0; b < batches; b++) {
            if (mode != 0) encode(bufs[0], (long)b * N * recsz, (long)b * N);
            if (mode != 3) {
                if (mode == 0 || mode == 4) { if (pwrite(fd, bufs[0], (long)N * recsz, (long)b * N * recsz) < 0) return 1; }
                else write_batch(bufs[0], (long)b * N * recsz);
            }
        }
    }
    double t = now() - t0, c = cpu() - c0;
    long n = (long)batches * N;
    printf("{\"mode\": %d, \"msgs_per_s\": %.0f, \"mb_per_s\": %.1f, \"cpu_us_per_msg\": %.3f}\n",
           mode, n / t, n * (double)recsz / t / 1e6, c / n * 1e6);
    unlink(path);
    return 0;
}
