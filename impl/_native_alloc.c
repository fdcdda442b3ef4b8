/* kvstrata.impl._native, part: the page allocator's loops (kvstrata.impl.pools.allocator) and the radix
 * cache's check of the pages a scheduler hands it, each one C loop where numpy took a dozen calls.
 * Plain C99 over caller-owned buffers; nothing changes unless a call's checks pass. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "_native.h"

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

PyMethodDef native_alloc_methods[] = {
    {"take_lowest", (PyCFunction)(void (*)(void))take_lowest, METH_FASTCALL, take_lowest_doc},
    {"give_back", (PyCFunction)(void (*)(void))give_back, METH_FASTCALL, give_back_doc},
    {"check_pages", (PyCFunction)(void (*)(void))check_pages, METH_FASTCALL, check_pages_doc},
    {NULL, NULL, 0, NULL},
};
