/* kvstrata.impl._native: the two per-page kernels of the scheduler path, in C.
 *
 * 1. Chained SHA-256 page hashes (SPEC section 4): digest_i = SHA-256(digest_{i-1} || page_i), where
 *    page_i is the page's token ids as 4-byte little-endian bytes and digest_{-1} is the seed. The
 *    SHA-256 itself is OpenSSL's (libcrypto); this file only loops over the pages, so one Python call
 *    hashes a whole run of pages. The loop runs with the GIL released: a worker thread hashes while
 *    the scheduler thread goes on.
 *
 * 2. NH page fingerprints (kvstrata.impl.fingerprint has the definition and the collision bound): two
 *    64-bit lanes per page, lane = sum over token pairs of ((a + k) mod 2^32) * ((b + k') mod 2^32)
 *    mod 2^64, with one secret uint32 key per token position and lane.
 *
 * 3. Store key texts for a batch of pages (_native_keys.c).
 *
 * All must give byte for byte what the portable Python versions give (tests/unit/impl/test_kernels.py).
 * Everything is plain C99 over caller-owned buffers; there is no global mutable state.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <limits.h>
#include <openssl/sha.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "_native_keys.h"

#define DIGEST 32

/* One chain: `pages` pages of `page_bytes` bytes at `data`, seeded by the `seed_len` (0 or 32) bytes
 * at `seed` (the default namespace's seed is empty), digests to `out`. */
static void chain(const unsigned char *seed, size_t seed_len, const unsigned char *data,
                  Py_ssize_t pages, Py_ssize_t page_bytes, unsigned char *out) {
    const unsigned char *previous = seed;
    size_t previous_len = seed_len;
    for (Py_ssize_t i = 0; i < pages; i++) {
        SHA256_CTX ctx;
        SHA256_Init(&ctx);
        if (previous_len) SHA256_Update(&ctx, previous, previous_len);
        SHA256_Update(&ctx, data + i * page_bytes, (size_t)page_bytes);
        SHA256_Final(out + i * DIGEST, &ctx);
        previous = out + i * DIGEST;
        previous_len = DIGEST;
    }
}

static int check_page_bytes(Py_ssize_t page_bytes) {
    if (page_bytes <= 0 || page_bytes % 4) {
        PyErr_Format(PyExc_ValueError, "page_bytes must be a positive multiple of 4, got %zd",
                     page_bytes);
        return -1;
    }
    return 0;
}

PyDoc_STRVAR(sha256_chain_doc,
"sha256_chain(seed, data, page_bytes, /) -> bytes\n\n"
"The SHA-256 chain of the whole pages of `data` (page_bytes each; a trailing partial page is\n"
"ignored) continuing from `seed` (32 bytes, or empty: the default namespace's chain): 32 bytes per\n"
"page. The GIL is released while hashing.");

static PyObject *sha256_chain(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "sha256_chain(seed, data, page_bytes) takes 3 arguments");
        return NULL;
    }
    Py_ssize_t page_bytes = PyLong_AsSsize_t(args[2]);
    if (page_bytes == -1 && PyErr_Occurred()) return NULL;
    if (check_page_bytes(page_bytes) < 0) return NULL;
    Py_buffer seed, data;
    if (PyObject_GetBuffer(args[0], &seed, PyBUF_SIMPLE) < 0) return NULL;
    if (seed.len != DIGEST && seed.len != 0) {
        PyBuffer_Release(&seed);
        PyErr_Format(PyExc_ValueError, "seed must be 32 bytes or empty, got %zd", seed.len);
        return NULL;
    }
    if (PyObject_GetBuffer(args[1], &data, PyBUF_C_CONTIGUOUS) < 0) {
        PyBuffer_Release(&seed);
        return NULL;
    }
    Py_ssize_t pages = data.len / page_bytes;
    PyObject *out = PyBytes_FromStringAndSize(NULL, pages * DIGEST);
    if (out != NULL && pages) {
        unsigned char *target = (unsigned char *)PyBytes_AS_STRING(out);
        Py_BEGIN_ALLOW_THREADS
        chain(seed.buf, (size_t)seed.len, data.buf, pages, page_bytes, target);
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&data);
    PyBuffer_Release(&seed);
    return out;
}

/* NH of `pages` pages of `page` tokens at `ids` under the lane keys k0, k1 (each `page` rounded up to
 * even): two uint64 lanes per page to `target`. The portable loop, and an AVX2 one (8 tokens per
 * step: the pair products of one lane are one _mm256_mul_epu32) picked at import when the CPU has it;
 * both give the same bytes (tests/unit/impl/test_fingerprint.py compares them with NH written out). */
static void nh_scalar(const uint32_t *ids, const uint32_t *k0, const uint32_t *k1, Py_ssize_t pages,
                      Py_ssize_t page, char *target) {
    uint64_t lanes[2];
    for (Py_ssize_t p = 0; p < pages; p++) {
        const uint32_t *m = ids + p * page;
        uint64_t a = 0, b = 0;
        Py_ssize_t i = 0;
        for (; i + 1 < page; i += 2) {
            a += (uint64_t)(uint32_t)(m[i] + k0[i]) * (uint32_t)(m[i + 1] + k0[i + 1]);
            b += (uint64_t)(uint32_t)(m[i] + k1[i]) * (uint32_t)(m[i + 1] + k1[i + 1]);
        }
        if (i < page) { /* odd page: the last token pairs with a zero token */
            a += (uint64_t)(uint32_t)(m[i] + k0[i]) * k0[i + 1];
            b += (uint64_t)(uint32_t)(m[i] + k1[i]) * k1[i + 1];
        }
        lanes[0] = a;
        lanes[1] = b;
        memcpy(target + p * 16, lanes, 16);
    }
}

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define HAVE_NH_AVX2 1
__attribute__((target("avx2"))) static void nh_avx2(const uint32_t *ids, const uint32_t *k0,
                                                    const uint32_t *k1, Py_ssize_t pages,
                                                    Py_ssize_t page, char *target) {
    uint64_t lanes[2], sums[4];
    for (Py_ssize_t p = 0; p < pages; p++) {
        const uint32_t *m = ids + p * page;
        __m256i acc0 = _mm256_setzero_si256(), acc1 = _mm256_setzero_si256();
        Py_ssize_t i = 0;
        for (; i + 8 <= page; i += 8) {
            __m256i t = _mm256_loadu_si256((const __m256i *)(m + i));
            __m256i a = _mm256_add_epi32(t, _mm256_loadu_si256((const __m256i *)(k0 + i)));
            __m256i b = _mm256_add_epi32(t, _mm256_loadu_si256((const __m256i *)(k1 + i)));
            acc0 = _mm256_add_epi64(acc0, _mm256_mul_epu32(a, _mm256_srli_epi64(a, 32)));
            acc1 = _mm256_add_epi64(acc1, _mm256_mul_epu32(b, _mm256_srli_epi64(b, 32)));
        }
        _mm256_storeu_si256((__m256i *)sums, acc0);
        uint64_t a = sums[0] + sums[1] + sums[2] + sums[3];
        _mm256_storeu_si256((__m256i *)sums, acc1);
        uint64_t b = sums[0] + sums[1] + sums[2] + sums[3];
        for (; i + 1 < page; i += 2) {
            a += (uint64_t)(uint32_t)(m[i] + k0[i]) * (uint32_t)(m[i + 1] + k0[i + 1]);
            b += (uint64_t)(uint32_t)(m[i] + k1[i]) * (uint32_t)(m[i + 1] + k1[i + 1]);
        }
        if (i < page) {
            a += (uint64_t)(uint32_t)(m[i] + k0[i]) * k0[i + 1];
            b += (uint64_t)(uint32_t)(m[i] + k1[i]) * k1[i + 1];
        }
        lanes[0] = a;
        lanes[1] = b;
        memcpy(target + p * 16, lanes, 16);
    }
}
#endif

typedef void (*nh_kernel)(const uint32_t *, const uint32_t *, const uint32_t *, Py_ssize_t,
                          Py_ssize_t, char *);
static nh_kernel nh_pages = nh_scalar; /* the CPU's best loop, chosen once at import */

PyDoc_STRVAR(nh_fingerprints_doc,
"nh_fingerprints(tokens, keys, page_size, /) -> bytes\n\n"
"The 16-byte NH fingerprint of each whole page of `tokens` (C-contiguous uint32 ids; a trailing\n"
"partial page is ignored) under `keys` (uint32, 2 * padded page size: lane 0's keys, then lane\n"
"1's; an odd page is padded with one zero token). Two native-endian uint64 lanes per page.");

static PyObject *nh_with(nh_kernel kernel, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError,
                        "nh_fingerprints(tokens, keys, page_size) takes 3 arguments");
        return NULL;
    }
    Py_ssize_t page = PyLong_AsSsize_t(args[2]);
    if (page == -1 && PyErr_Occurred()) return NULL;
    if (page <= 0) {
        PyErr_Format(PyExc_ValueError, "page_size must be positive, got %zd", page);
        return NULL;
    }
    Py_ssize_t padded = page + (page & 1);
    Py_buffer tokens, keys;
    if (PyObject_GetBuffer(args[0], &tokens, PyBUF_C_CONTIGUOUS) < 0) return NULL;
    if (PyObject_GetBuffer(args[1], &keys, PyBUF_C_CONTIGUOUS) < 0) {
        PyBuffer_Release(&tokens);
        return NULL;
    }
    PyObject *out = NULL;
    if (tokens.len % 4) {
        PyErr_Format(PyExc_ValueError, "tokens must be uint32 ids, got %zd bytes", tokens.len);
    } else if (keys.len != (Py_ssize_t)(2 * padded * sizeof(uint32_t))) {
        PyErr_Format(PyExc_ValueError, "keys must hold %zd uint32, got %zd bytes", 2 * padded,
                     keys.len);
    } else {
        Py_ssize_t pages = tokens.len / 4 / page;
        out = PyBytes_FromStringAndSize(NULL, pages * 16);
        if (out != NULL) {
            const uint32_t *k0 = keys.buf, *k1 = (const uint32_t *)keys.buf + padded;
            kernel(tokens.buf, k0, k1, pages, page, PyBytes_AS_STRING(out));
        }
    }
    PyBuffer_Release(&keys);
    PyBuffer_Release(&tokens);
    return out;
}

static PyObject *nh_fingerprints(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    return nh_with(nh_pages, args, nargs);
}

/* ------------------------------------------------------------------------------------------------
 * Page-allocator kernels (kvstrata.impl.pools.allocator): a free-mask of one byte per page (1: free)
 * and a count of free pages per block of 2**shift pages, both caller-owned numpy buffers. Each
 * replaces a dozen numpy calls on the scheduler path with one loop.
 */
typedef struct {
    Py_buffer mask, counts, pages;
} AllocBuffers;

static void release_alloc(AllocBuffers *b) {
    if (b->mask.obj) PyBuffer_Release(&b->mask);
    if (b->counts.obj) PyBuffer_Release(&b->counts);
    if (b->pages.obj) PyBuffer_Release(&b->pages);
}

static int get_alloc(PyObject *const *args, AllocBuffers *b, int pages_writable) {
    memset(b, 0, sizeof(*b));
    if (PyObject_GetBuffer(args[0], &b->mask, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0 ||
        PyObject_GetBuffer(args[1], &b->counts, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0 ||
        PyObject_GetBuffer(args[2], &b->pages,
                           (pages_writable ? PyBUF_WRITABLE : 0) | PyBUF_C_CONTIGUOUS) < 0) {
        release_alloc(b);
        return -1;
    }
    if (b->counts.len % 8 || b->pages.len % 8) {
        PyErr_SetString(PyExc_ValueError, "counts and pages must be int64 buffers");
        release_alloc(b);
        return -1;
    }
    return 0;
}

PyDoc_STRVAR(take_lowest_doc,
"take_lowest(mask, counts, out, shift, first, /) -> int\n\n"
"Clear the len(out) lowest set bytes of `mask` (uint8, 1 = free) from block `first` on, write their\n"
"indices ascending to `out` (int64) and lower `counts` (int64 per block of 2**shift pages). Returns\n"
"the lowest block that still holds a free page (or the last block). ValueError, with nothing\n"
"changed, if fewer pages are free.");

static PyObject *take_lowest(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "take_lowest(mask, counts, out, shift, first) takes 5");
        return NULL;
    }
    Py_ssize_t shift = PyLong_AsSsize_t(args[3]), first = PyLong_AsSsize_t(args[4]);
    if (PyErr_Occurred()) return NULL;
    AllocBuffers b;
    if (get_alloc(args, &b, 1) < 0) return NULL;
    unsigned char *mask = b.mask.buf;
    int64_t *counts = b.counts.buf, *out = b.pages.buf;
    Py_ssize_t blocks = b.counts.len / 8, want = b.pages.len / 8, block_size = (Py_ssize_t)1 << shift;
    if (shift < 0 || shift > 30 || blocks * block_size != b.mask.len || first < 0 ||
        first >= blocks) {
        release_alloc(&b);
        PyErr_SetString(PyExc_ValueError, "take_lowest: mask, counts, shift and first disagree");
        return NULL;
    }
    int64_t available = 0;
    for (Py_ssize_t block = first; block < blocks && available < want; block++)
        available += counts[block];
    if (available < want) {
        release_alloc(&b);
        PyErr_Format(PyExc_ValueError, "take_lowest: %zd pages asked, fewer free", want);
        return NULL;
    }
    Py_ssize_t taken = 0;
    for (Py_ssize_t block = first; block < blocks && taken < want; block++) {
        Py_ssize_t page = block << shift, end = page + block_size;
        while (taken < want && counts[block] > 0) {
            const unsigned char *next = memchr(mask + page, 1, (size_t)(end - page));
            if (next == NULL) break; /* (counts say otherwise: caught below) */
            page = next - mask;
            mask[page] = 0;
            counts[block]--;
            out[taken++] = page++;
        }
    }
    Py_ssize_t low = first;
    while (low + 1 < blocks && counts[low] == 0) low++;
    release_alloc(&b);
    if (taken < want) {
        PyErr_SetString(PyExc_RuntimeError, "take_lowest: block counts disagree with the mask");
        return NULL;
    }
    return PyLong_FromSsize_t(low);
}

PyDoc_STRVAR(give_back_doc,
"give_back(mask, counts, pages, shift, num_pages, /) -> int\n\n"
"Set `mask` (uint8) at every index of `pages` (int64) and raise `counts` (int64 per block of\n"
"2**shift pages); returns the lowest page given. ValueError, with nothing changed, if a page is\n"
"out of range [0, num_pages), given twice, or already free (its message names the page).");

static PyObject *give_back(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "give_back(mask, counts, pages, shift, num_pages)");
        return NULL;
    }
    Py_ssize_t shift = PyLong_AsSsize_t(args[3]), num_pages = PyLong_AsSsize_t(args[4]);
    if (PyErr_Occurred()) return NULL;
    AllocBuffers b;
    if (get_alloc(args, &b, 0) < 0) return NULL;
    unsigned char *mask = b.mask.buf;
    int64_t *counts = b.counts.buf;
    const int64_t *pages = b.pages.buf;
    Py_ssize_t count = b.pages.len / 8;
    if (shift < 0 || shift > 30 || num_pages > b.mask.len ||
        (b.counts.len / 8) << shift != b.mask.len) {
        release_alloc(&b);
        PyErr_SetString(PyExc_ValueError, "give_back: mask, counts and shift disagree");
        return NULL;
    }
    int64_t lowest = num_pages;
    Py_ssize_t i = 0;
    const char *problem = NULL;
    for (; i < count; i++) { /* check, marking each page 2 so a repeat is seen */
        int64_t page = pages[i];
        if (page < 0 || page >= num_pages) { problem = "out of range"; break; }
        if (mask[page] == 2) { problem = "given more than once"; break; }
        if (mask[page]) { problem = "not allocated (double free?)"; break; }
        mask[page] = 2;
        if (page < lowest) lowest = page;
    }
    if (problem != NULL) {
        int64_t bad = pages[i];
        for (Py_ssize_t j = 0; j < i; j++) mask[pages[j]] = 0; /* pages before i were all 0 */
        release_alloc(&b);
        PyErr_Format(PyExc_ValueError, "page %lld is %s", (long long)bad, problem);
        return NULL;
    }
    for (i = 0; i < count; i++) {
        mask[pages[i]] = 1;
        counts[pages[i] >> shift]++;
    }
    release_alloc(&b);
    return PyLong_FromLongLong(lowest);
}

/* ------------------------------------------------------------------------------------------------
 * The radix cache's check of the L1 pages a scheduler hands to insert / free_device: one loop instead
 * of a dozen numpy calls. Nothing is changed unless every check passes.
 */
PyDoc_STRVAR(check_pages_doc,
"check_pages(pages, held, stamp, generation, own, spare, release, /) -> int\n\n"
"Check `pages` (int64): every page in [0, len(held)), none twice (`stamp`, uint32 per page, marks\n"
"the pages seen with `generation`, which the caller changes on every call), and every page either\n"
"held by the scheduler (`held`, bool per page) or, at a position i < len(own), equal to own[i] (the\n"
"tree's own page there). Writes the pages at positions i < len(own) that differ from own[i] to\n"
"`spare` (int64, len(own)) and returns how many; with `release`, clears `held` at every page.\n"
"ValueError naming the page and position otherwise, with `held` unchanged.");

static PyObject *check_pages(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (nargs != 7) {
        PyErr_SetString(PyExc_TypeError,
                        "check_pages(pages, held, stamp, generation, own, spare, release)");
        return NULL;
    }
    unsigned long generation = PyLong_AsUnsignedLong(args[3]);
    int release = PyObject_IsTrue(args[6]);
    if (PyErr_Occurred() || release < 0) return NULL;
    Py_buffer pages, held, stamp, own, spare;
    pages.obj = held.obj = stamp.obj = own.obj = spare.obj = NULL;
    PyObject *result = NULL;
    if (PyObject_GetBuffer(args[0], &pages, PyBUF_C_CONTIGUOUS) < 0 ||
        PyObject_GetBuffer(args[1], &held, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0 ||
        PyObject_GetBuffer(args[2], &stamp, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0 ||
        PyObject_GetBuffer(args[4], &own, PyBUF_C_CONTIGUOUS) < 0 ||
        PyObject_GetBuffer(args[5], &spare, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0)
        goto done;
    Py_ssize_t n = pages.len / 8, m = own.len / 8, limit = held.len;
    if (pages.len % 8 || own.len % 8 || spare.len < own.len || stamp.len != 4 * held.len ||
        m > n) {
        PyErr_SetString(PyExc_ValueError, "check_pages: buffer sizes disagree");
        goto done;
    }
    const int64_t *page = pages.buf, *mine = own.buf;
    unsigned char *is_held = held.buf;
    uint32_t *seen = stamp.buf;
    int64_t *out = spare.buf;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (page[i] < 0 || page[i] >= limit) {
            PyErr_Format(PyExc_ValueError, "out of range [0, %zd): page %lld at position %zd",
                         limit, (long long)page[i], i);
            goto done;
        }
        if (seen[page[i]] == (uint32_t)generation) {
            PyErr_Format(PyExc_ValueError, "holds a page twice: page %lld at position %zd",
                         (long long)page[i], i);
            goto done;
        }
        seen[page[i]] = (uint32_t)generation;
    }
    Py_ssize_t spares = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        int theirs = i < m && mine[i] == page[i];
        if (!theirs && !is_held[page[i]]) {
            PyErr_Format(PyExc_ValueError, "L1 page %lld for page %zd is not the scheduler's",
                         (long long)page[i], i);
            goto done;
        }
        if (i < m && !theirs) out[spares++] = page[i];
    }
    if (release)
        for (Py_ssize_t i = 0; i < n; i++) is_held[page[i]] = 0;
    result = PyLong_FromSsize_t(spares);
done:
    if (pages.obj) PyBuffer_Release(&pages);
    if (held.obj) PyBuffer_Release(&held);
    if (stamp.obj) PyBuffer_Release(&stamp);
    if (own.obj) PyBuffer_Release(&own);
    if (spare.obj) PyBuffer_Release(&spare);
    return result;
}

/* ------------------------------------------------------------------------------------------------
 * Hasher: a C worker thread that hashes chains queued by submit(), never touching Python objects, so
 * the scheduler thread never waits on the GIL for it. Jobs finish in submission order; done() counts
 * them. A job reads its tokens from the arena (a writable buffer held from construction to dealloc;
 * submit copies them there) or in place, reads its seed from its own copy or from an earlier job's
 * output, and writes its digests to an output buffer. A job holds a reference to every object it
 * reads or writes outside the arena until it finished (released by the next call that holds the
 * GIL); the owner (kvstrata.impl.hashing.BackgroundHasher) reuses an arena region only after the job
 * in it finished.
 */
typedef struct HashTask {
    struct HashTask *next;
    Py_ssize_t data, pages;      /* arena offset of the copied tokens (or -1: `source`) */
    const unsigned char *source; /* the caller's tokens when not copied */
    unsigned char *out;          /* the caller's output buffer, 32 bytes per page */
    const unsigned char *seed_at; /* a 32-byte seed in an earlier job's output, or NULL: `seed` */
    size_t seed_len;
    unsigned char seed[DIGEST];
    PyObject *keep[3]; /* out, in-place tokens, the seed's buffer: alive until released */
} HashTask;

typedef struct {
    PyObject_HEAD
    Py_buffer arena;
    Py_ssize_t page_bytes;
    pthread_mutex_t lock;
    pthread_cond_t work; /* signalled on submit, resume and close */
    pthread_cond_t progress; /* signalled when a job finishes and when the thread exits */
    HashTask *head, *tail;
    HashTask *finished; /* done, references not yet released (that needs the GIL) */
    long long submitted, done, busy_ns;
    long long limit; /* jobs with seq < limit may run (LLONG_MAX unless paused by a test) */
    int running, closing, initialised;
    int sleeping; /* the thread waits on `work` (not polling): submit must signal it */
    unsigned long forks; /* `fork_count` when the thread state was last valid in this process */
} Hasher;

/* Forks of this process so far, bumped in the child by a pthread_atfork handler (installed once at
 * import). A child inherits a Hasher whose thread did not survive the fork and whose lock may be
 * held by it: the first call in the child sees the count changed and starts afresh (new lock,
 * conditions and thread; the queued jobs and their buffers were copied with the process). */
static unsigned long fork_count = 0;

static void count_fork_in_child(void) { fork_count++; }

/* Idle, the thread first polls the queue every POLL_NS for POLL_ROUNDS rounds, then sleeps on
 * `work` for up to a second and exits. While it polls, submit does not signal: waking a sleeping
 * thread on another CPU costs the submitting thread a futex call and, in a VM, an inter-processor
 * interrupt (measured: ~15 us per submit, a quarter of the whole scheduler path). */
#define POLL_NS 100000L
#define POLL_ROUNDS 2000

static void *hasher_main(void *arg) {
    Hasher *self = arg;
    unsigned char *arena = self->arena.buf;
    int polls = 0;
    pthread_mutex_lock(&self->lock);
    for (;;) {
        while ((self->head == NULL || self->done >= self->limit) && !self->closing) {
            if (polls < POLL_ROUNDS) {
                struct timespec pause = {0, POLL_NS};
                polls++;
                pthread_mutex_unlock(&self->lock);
                nanosleep(&pause, NULL);
                pthread_mutex_lock(&self->lock);
                continue;
            }
            struct timespec until;
            clock_gettime(CLOCK_REALTIME, &until);
            until.tv_sec += 1;
            self->sleeping = 1;
            int waited = pthread_cond_timedwait(&self->work, &self->lock, &until);
            self->sleeping = 0;
            if (waited == ETIMEDOUT && self->head == NULL)
                goto out; /* idle for a second: exit; the next submit starts a new thread */
        }
        polls = 0;
        if (self->head == NULL) goto out;
        HashTask *task = self->head;
        pthread_mutex_unlock(&self->lock);
        const unsigned char *seed = task->seed_at != NULL ? task->seed_at : task->seed;
        size_t seed_len = task->seed_at != NULL ? DIGEST : task->seed_len;
        struct timespec started, finished;
        clock_gettime(CLOCK_THREAD_CPUTIME_ID, &started);
        chain(seed, seed_len, task->source != NULL ? task->source : arena + task->data, task->pages,
              self->page_bytes, task->out);
        clock_gettime(CLOCK_THREAD_CPUTIME_ID, &finished);
        pthread_mutex_lock(&self->lock);
        self->busy_ns += (finished.tv_sec - started.tv_sec) * 1000000000LL +
                         (finished.tv_nsec - started.tv_nsec);
        self->head = task->next;
        if (self->head == NULL) self->tail = NULL;
        task->next = self->finished;
        self->finished = task;
        self->done++;
        pthread_cond_broadcast(&self->progress);
    }
out:
    self->running = 0;
    pthread_cond_broadcast(&self->progress);
    pthread_mutex_unlock(&self->lock);
    return NULL;
}

static int hasher_start(Hasher *self) { /* lock held */
    pthread_attr_t attr;
    pthread_t thread;
    if (pthread_attr_init(&attr)) return -1;
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    int failed = pthread_create(&thread, &attr, hasher_main, self);
    pthread_attr_destroy(&attr);
    if (failed) return -1;
    self->running = 1;
    return 0;
}

static int Hasher_init(Hasher *self, PyObject *args, PyObject *kwds) {
    static char *names[] = {"arena", "page_bytes", NULL};
    PyObject *arena;
    Py_ssize_t page_bytes;
    if (self->initialised) {
        PyErr_SetString(PyExc_RuntimeError, "Hasher is already initialised");
        return -1;
    }
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "On", names, &arena, &page_bytes)) return -1;
    if (check_page_bytes(page_bytes) < 0) return -1;
    if (PyObject_GetBuffer(arena, &self->arena, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0)
        return -1;
    self->page_bytes = page_bytes;
    pthread_mutex_init(&self->lock, NULL);
    pthread_cond_init(&self->work, NULL);
    pthread_cond_init(&self->progress, NULL);
    self->limit = LLONG_MAX;
    self->forks = fork_count;
    self->initialised = 1;
    return 0;
}

static int hasher_ready(Hasher *self) {
    if (!self->initialised) {
        PyErr_SetString(PyExc_RuntimeError, "Hasher is not initialised");
        return -1;
    }
    if (self->forks != fork_count) { /* the first call in a forked child (see fork_count) */
        pthread_mutex_init(&self->lock, NULL);
        pthread_cond_init(&self->work, NULL);
        pthread_cond_init(&self->progress, NULL);
        self->running = 0;
        self->sleeping = 0;
        self->forks = fork_count;
    }
    return 0;
}

static void release_tasks(HashTask *task) { /* GIL held */
    while (task != NULL) {
        HashTask *next = task->next;
        for (int i = 0; i < 3; i++) Py_XDECREF(task->keep[i]);
        free(task);
        task = next;
    }
}

/* Drop the references finished jobs held (GIL held). */
static void release_finished(Hasher *self) {
    pthread_mutex_lock(&self->lock);
    HashTask *finished = self->finished;
    self->finished = NULL;
    pthread_mutex_unlock(&self->lock);
    release_tasks(finished);
}

/* Stop accepting work, finish the queue, wait for the thread (GIL released). */
static void hasher_close(Hasher *self) {
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&self->lock);
    self->closing = 1;
    self->limit = LLONG_MAX;
    pthread_cond_broadcast(&self->work);
    while (self->running) pthread_cond_wait(&self->progress, &self->lock);
    pthread_mutex_unlock(&self->lock);
    Py_END_ALLOW_THREADS
}

static void Hasher_dealloc(Hasher *self) {
    if (self->initialised) {
        (void)hasher_ready(self); /* in a forked child: a fresh lock first */
        hasher_close(self);
        release_finished(self);
        release_tasks(self->head); /* only left if the thread could not start */
        self->head = self->tail = NULL;
        PyBuffer_Release(&self->arena);
        pthread_cond_destroy(&self->progress);
        pthread_cond_destroy(&self->work);
        pthread_mutex_destroy(&self->lock);
    }
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int in_arena(Hasher *self, Py_ssize_t at, Py_ssize_t size, const char *what) {
    if (at < 0 || size < 0 || at > self->arena.len - size) {
        PyErr_Format(PyExc_ValueError, "%s [%zd, %zd) lies outside the arena of %zd bytes", what,
                     at, at + size, self->arena.len);
        return -1;
    }
    return 0;
}

static PyObject *Hasher_submit(Hasher *self, PyObject *const *args, Py_ssize_t nargs) {
    if (hasher_ready(self) < 0) return NULL;
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError,
                        "submit(seed, tokens, pages, data, out) takes 5 arguments");
        return NULL;
    }
    release_finished(self);
    HashTask *task = calloc(1, sizeof(HashTask));
    if (task == NULL) return PyErr_NoMemory();
    task->pages = PyLong_AsSsize_t(args[2]);
    task->data = args[3] == Py_None ? -1 : PyLong_AsSsize_t(args[3]);
    if (PyErr_Occurred()) goto fail;
    if (task->pages < 0) {
        PyErr_SetString(PyExc_ValueError, "pages must be >= 0");
        goto fail;
    }
    Py_buffer view;
    if (PyTuple_Check(args[0])) { /* (output buffer of an earlier job, byte offset) */
        Py_ssize_t at = -1;
        if (PyTuple_GET_SIZE(args[0]) == 2) at = PyLong_AsSsize_t(PyTuple_GET_ITEM(args[0], 1));
        if (at == -1 && PyErr_Occurred()) goto fail;
        if (PyObject_GetBuffer(PyTuple_GET_ITEM(args[0], 0), &view, PyBUF_SIMPLE) < 0) goto fail;
        int inside = at >= 0 && at <= view.len - DIGEST;
        task->seed_at = (const unsigned char *)view.buf + (inside ? at : 0);
        PyBuffer_Release(&view); /* the owner keeps that buffer alive until this job finished */
        if (!inside) {
            PyErr_SetString(PyExc_ValueError, "a seed reference is (buffer, offset of 32 bytes)");
            goto fail;
        }
    } else {
        if (PyObject_GetBuffer(args[0], &view, PyBUF_SIMPLE) < 0) goto fail;
        if (view.len != DIGEST && view.len != 0) {
            PyBuffer_Release(&view);
            PyErr_Format(PyExc_ValueError, "seed must be 32 bytes or empty, got %zd", view.len);
            goto fail;
        }
        memcpy(task->seed, view.buf, (size_t)view.len);
        task->seed_len = (size_t)view.len;
        PyBuffer_Release(&view);
    }
    if (PyObject_GetBuffer(args[4], &view, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) goto fail;
    task->out = view.buf;
    Py_ssize_t out_len = view.len;
    PyBuffer_Release(&view); /* the owner keeps it alive until this job finished */
    if (out_len < task->pages * DIGEST) {
        PyErr_Format(PyExc_ValueError, "out holds %zd bytes, %zd pages need %zd", out_len,
                     task->pages, task->pages * DIGEST);
        goto fail;
    }
    if (task->data >= 0 && in_arena(self, task->data, task->pages * self->page_bytes, "data") < 0)
        goto fail;
    if (PyObject_GetBuffer(args[1], &view, PyBUF_C_CONTIGUOUS) < 0) goto fail;
    if (view.len != task->pages * self->page_bytes) {
        PyErr_Format(PyExc_ValueError, "tokens hold %zd bytes, %zd pages need %zd", view.len,
                     task->pages, task->pages * self->page_bytes);
        PyBuffer_Release(&view);
        goto fail;
    }
    if (task->data >= 0) /* the job's own copy: the caller may change its tokens after submit */
        memcpy((unsigned char *)self->arena.buf + task->data, view.buf, (size_t)view.len);
    else /* read in place: the owner keeps `tokens` alive and unchanged until the job finished */
        task->source = view.buf;
    PyBuffer_Release(&view);
    /* what the thread reads or writes outside the arena stays alive until the job is released */
    task->keep[0] = Py_NewRef(args[4]);
    task->keep[1] = task->data < 0 ? Py_NewRef(args[1]) : NULL;
    task->keep[2] = PyTuple_Check(args[0]) ? Py_NewRef(PyTuple_GET_ITEM(args[0], 0)) : NULL;
    pthread_mutex_lock(&self->lock);
    if (self->closing) {
        pthread_mutex_unlock(&self->lock);
        PyErr_SetString(PyExc_RuntimeError, "Hasher is closed");
        release_tasks(task);
        return NULL;
    }
    if (self->tail != NULL) self->tail->next = task;
    else self->head = task;
    self->tail = task;
    long long seq = self->submitted++;
    if (self->running && self->sleeping) pthread_cond_signal(&self->work);
    if (!self->running && hasher_start(self) < 0) {
        /* leave the task queued: a later submit retries the thread; report the failure now */
        pthread_mutex_unlock(&self->lock);
        PyErr_SetString(PyExc_OSError, "could not start the hashing thread");
        return NULL;
    }
    pthread_mutex_unlock(&self->lock);
    return PyLong_FromLongLong(seq);
fail:
    free(task);
    return NULL;
}

static PyObject *Hasher_done(Hasher *self, PyObject *unused) {
    (void)unused;
    if (hasher_ready(self) < 0) return NULL;
    release_finished(self);
    pthread_mutex_lock(&self->lock);
    long long done = self->done;
    pthread_mutex_unlock(&self->lock);
    return PyLong_FromLongLong(done);
}

static PyObject *Hasher_wait(Hasher *self, PyObject *arg) {
    if (hasher_ready(self) < 0) return NULL;
    long long seq = PyLong_AsLongLong(arg);
    if (seq == -1 && PyErr_Occurred()) return NULL;
    int stuck = 0;
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&self->lock);
    if (seq >= self->submitted) {
        stuck = 2;
    } else if (self->done <= seq) {
        if (self->limit <= seq) self->limit = seq + 1; /* a paused hasher runs what is waited on */
        pthread_cond_broadcast(&self->work);
        while (self->done <= seq) {
            if (!self->running && hasher_start(self) < 0) {
                stuck = 1;
                break;
            }
            pthread_cond_wait(&self->progress, &self->lock);
        }
    }
    pthread_mutex_unlock(&self->lock);
    Py_END_ALLOW_THREADS
    if (stuck == 1) return PyErr_Format(PyExc_OSError, "could not start the hashing thread");
    if (stuck == 2) return PyErr_Format(PyExc_ValueError, "job %lld was never submitted", seq);
    release_finished(self);
    Py_RETURN_NONE;
}

static PyObject *Hasher_pause(Hasher *self, PyObject *unused) {
    (void)unused;
    if (hasher_ready(self) < 0) return NULL;
    pthread_mutex_lock(&self->lock);
    if (!self->closing) self->limit = self->done;
    pthread_mutex_unlock(&self->lock);
    Py_RETURN_NONE;
}

static PyObject *hasher_allow(Hasher *self, long long limit) {
    pthread_mutex_lock(&self->lock);
    if (limit > self->limit) self->limit = limit;
    if (!self->running && self->head != NULL && hasher_start(self) < 0) {
        pthread_mutex_unlock(&self->lock);
        return PyErr_Format(PyExc_OSError, "could not start the hashing thread");
    }
    pthread_cond_broadcast(&self->work);
    pthread_mutex_unlock(&self->lock);
    Py_RETURN_NONE;
}

static PyObject *Hasher_resume(Hasher *self, PyObject *unused) {
    (void)unused;
    if (hasher_ready(self) < 0) return NULL;
    return hasher_allow(self, LLONG_MAX);
}

static PyObject *Hasher_step(Hasher *self, PyObject *arg) {
    if (hasher_ready(self) < 0) return NULL;
    long long jobs = PyLong_AsLongLong(arg);
    if (jobs == -1 && PyErr_Occurred()) return NULL;
    if (jobs < 0) return PyErr_Format(PyExc_ValueError, "step takes jobs >= 0, got %lld", jobs);
    pthread_mutex_lock(&self->lock);
    long long limit = self->limit == LLONG_MAX ? LLONG_MAX : self->limit + jobs;
    pthread_mutex_unlock(&self->lock);
    return hasher_allow(self, limit);
}

static PyObject *Hasher_close(Hasher *self, PyObject *unused) {
    (void)unused;
    if (hasher_ready(self) < 0) return NULL;
    hasher_close(self);
    release_finished(self);
    Py_RETURN_NONE;
}

static PyObject *Hasher_running(Hasher *self, void *closure) {
    (void)closure;
    if (hasher_ready(self) < 0) return NULL;
    pthread_mutex_lock(&self->lock);
    int running = self->running;
    pthread_mutex_unlock(&self->lock);
    return PyBool_FromLong(running);
}

static PyMethodDef hasher_methods[] = {
    {"submit", (PyCFunction)(void (*)(void))Hasher_submit, METH_FASTCALL,
     "submit(seed, tokens, pages, data, out, /) -> int: copy `tokens` (exactly `pages` pages) to\n"
     "arena offset `data` (None: read them in place when the job runs) and queue their chain, its\n"
     "digests written to the writable buffer `out`. `seed` is bytes (32 or empty) or a pair\n"
     "(buffer, offset): the 32 bytes there, read when the job runs (an earlier job's output). The\n"
     "caller keeps `out`, the seed buffer and in-place tokens alive and unchanged until the job\n"
     "finished. Returns the job's sequence number."},
    {"done", (PyCFunction)Hasher_done, METH_NOARGS,
     "done() -> int: how many jobs finished (jobs finish in submission order)."},
    {"wait", (PyCFunction)Hasher_wait, METH_O,
     "wait(seq, /): block (GIL released) until job `seq` finished; on a paused hasher the jobs up\n"
     "to `seq` run first."},
    {"pause", (PyCFunction)Hasher_pause, METH_NOARGS,
     "pause(): the thread starts no new job until resume(), step() or a wait() needs it (tests:\n"
     "hold jobs in flight)."},
    {"resume", (PyCFunction)Hasher_resume, METH_NOARGS, "resume(): undo pause()."},
    {"step", (PyCFunction)Hasher_step, METH_O,
     "step(jobs, /): on a paused hasher, let `jobs` more jobs run."},
    {"close", (PyCFunction)Hasher_close, METH_NOARGS,
     "close(): finish every queued job and stop the thread; later submits fail."},
    {NULL, NULL, 0, NULL},
};

static PyObject *Hasher_busy_ns(Hasher *self, void *closure) {
    (void)closure;
    if (hasher_ready(self) < 0) return NULL;
    pthread_mutex_lock(&self->lock);
    long long busy = self->busy_ns;
    pthread_mutex_unlock(&self->lock);
    return PyLong_FromLongLong(busy);
}

static PyGetSetDef hasher_getset[] = {
    {"busy_ns", (getter)Hasher_busy_ns, NULL, "CPU time the thread spent hashing (ns).", NULL},
    {"running", (getter)Hasher_running, NULL, "Whether the worker thread is alive.", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject HasherType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvstrata.impl._native.Hasher",
    .tp_basicsize = sizeof(Hasher),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Hasher(arena, page_bytes): chained SHA-256 on a C thread over one arena buffer.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Hasher_init,
    .tp_dealloc = (destructor)Hasher_dealloc,
    .tp_methods = hasher_methods,
    .tp_getset = hasher_getset,
};

static PyObject *nh_variant(PyObject *module, PyObject *unused) {
    (void)module;
    (void)unused;
    return PyUnicode_FromString(nh_pages == nh_scalar ? "scalar" : "avx2");
}

static PyObject *nh_scalar_fingerprints(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    return nh_with(nh_scalar, args, nargs);
}

static PyMethodDef methods[] = {
    {"sha256_chain", (PyCFunction)(void (*)(void))sha256_chain, METH_FASTCALL, sha256_chain_doc},
    {"nh_fingerprints", (PyCFunction)(void (*)(void))nh_fingerprints, METH_FASTCALL,
     nh_fingerprints_doc},
    {"take_lowest", (PyCFunction)(void (*)(void))take_lowest, METH_FASTCALL, take_lowest_doc},
    {"give_back", (PyCFunction)(void (*)(void))give_back, METH_FASTCALL, give_back_doc},
    {"check_pages", (PyCFunction)(void (*)(void))check_pages, METH_FASTCALL, check_pages_doc},
    {"join_keys", (PyCFunction)(void (*)(void))join_keys, METH_FASTCALL, JOIN_KEYS_DOC},
    {"nh_variant", (PyCFunction)nh_variant, METH_NOARGS,
     "nh_variant() -> str: which NH loop this CPU runs ('avx2' or 'scalar')."},
    {"nh_scalar_fingerprints", (PyCFunction)(void (*)(void))nh_scalar_fingerprints, METH_FASTCALL,
     "nh_fingerprints over the portable C loop (tests compare it with the AVX2 one)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT,
    "kvstrata.impl._native",
    "C kernels of the scheduler path: chained SHA-256 page hashes (OpenSSL) and NH page "
    "fingerprints.",
    0,
    methods,
    NULL,
    NULL,
    NULL,
    NULL,
};

PyMODINIT_FUNC PyInit__native(void) {
    pthread_atfork(NULL, NULL, count_fork_in_child);
#ifdef HAVE_NH_AVX2
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2")) nh_pages = nh_avx2;
#endif
    if (PyType_Ready(&HasherType) < 0) return NULL;
    PyObject *module = PyModule_Create(&module_def);
    if (module == NULL) return NULL;
    Py_INCREF(&HasherType);
    if (PyModule_AddObject(module, "Hasher", (PyObject *)&HasherType) < 0) {
        Py_DECREF(&HasherType);
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
