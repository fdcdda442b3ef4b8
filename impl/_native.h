/* kvstrata.impl._native: what its C files share. _native.c makes the module; _native_alloc.c (the
 * page allocator's and the insert's loops), _native_hasher.c (the hashing thread) and _native_keys.c
 * (store key texts) each give it their functions. */
#ifndef KVSTRATA_NATIVE_H
#define KVSTRATA_NATIVE_H

#include <Python.h>
#include <stddef.h>

#define DIGEST 32

/* Shared between this module's files only: kept out of the extension's exported symbols. */
#if defined(__GNUC__)
#define NATIVE_INTERNAL __attribute__((visibility("hidden")))
#else
#define NATIVE_INTERNAL
#endif

/* _native.c: the SHA-256 chain of `pages` pages of `page_bytes` bytes at `data`, seeded by the
 * `seed_len` (0 or 32) bytes at `seed`, digests to `out` (32 bytes per page); and the check of a
 * page size (a positive multiple of 4; ValueError otherwise, -1 returned). */
NATIVE_INTERNAL void native_chain(const unsigned char *seed, size_t seed_len, const unsigned char *data,
                  Py_ssize_t pages, Py_ssize_t page_bytes, unsigned char *out);
NATIVE_INTERNAL int native_check_page_bytes(Py_ssize_t page_bytes);

/* _native_alloc.c: take_lowest, give_back and check_pages, added to the module at import. */
extern NATIVE_INTERNAL PyMethodDef native_alloc_methods[];

/* _native_hasher.c: adds the Hasher type to the module (and the fork handler it needs); -1 on error. */
NATIVE_INTERNAL int native_add_hasher(PyObject *module);

#endif
