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
 * This file makes the module and holds 1 and 2; _native_alloc.c holds the page allocator's and the
 * insert's loops and _native_hasher.c the hashing thread (the Hasher type); _native.h is what they
 * share.
 *
 * All must give byte for byte what the portable Python versions give (tests/unit/impl/test_kernels.py).
 * Everything is plain C99 over caller-owned buffers. The only globals: the NH loop chosen once at
 * import, and the count of forks kept by the hashing thread's fork handler (_native_hasher.c).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <openssl/sha.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "_native.h"
#include "_native_keys.h"

/* One chain: `pages` pages of `page_bytes` bytes at `data`, seeded by the `seed_len` (0 or 32) bytes
 * at `seed` (the default namespace's seed is empty), digests to `out`. */
void native_chain(const unsigned char *seed, size_t seed_len, const unsigned char *data,
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

int native_check_page_bytes(Py_ssize_t page_bytes) {
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
    if (native_check_page_bytes(page_bytes) < 0) return NULL;
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
        native_chain(seed.buf, (size_t)seed.len, data.buf, pages, page_bytes, target);
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
#ifdef HAVE_NH_AVX2
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2")) nh_pages = nh_avx2;
#endif
    PyObject *module = PyModule_Create(&module_def);
    if (module == NULL) return NULL;
    if (PyModule_AddFunctions(module, native_alloc_methods) < 0 || native_add_hasher(module) < 0) {
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
