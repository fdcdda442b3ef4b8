/* kvstrata.impl._native: what its C files share. _native.c makes the module; _native_alloc.c (the
 * page allocator's and the insert's loops), _native_hasher.c (the hashing thread) and _native_keys.c
 * (store key texts) each give it their functions. */
#ifndef KVSTRATA_NATIVE_H
#define KVSTRATA_NATIVE_H

#include <Python.h>
#include <stddef.h>

#define DIGEST 32

/* _native.c: the SHA-256 chain of `pages` pages of `page_bytes` bytes at `data`, seeded by the
 * `seed_len` (0 or 32) bytes at `seed`, digests to `out` (32 bytes per page); and the check of a
 * page size (a positive multiple of 4; ValueError otherwise, -1 returned). */
void native_chain(const unsigned char *seed, size_t seed_len, const unsigned char *data,
                  Py_ssize_t pages, Py_ssize_t page_bytes, unsigned char *out);
int native_check_page_bytes(Py_ssize_t page_bytes);

/* _native_alloc.c: take_lowest, give_back and check_pages, added to the module at import. */
extern PyMethodDef native_alloc_methods[];

/* _native_hasher.c: adds the Hasher type to the module (and the fork handler it needs); -1 on error. */
int native_add_hasher(PyObject *module);

#endif
