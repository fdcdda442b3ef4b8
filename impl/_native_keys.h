/* kvstrata.impl._native: the store key kernel (_native_keys.c), registered by _native.c. */
#ifndef KVSTRATA_NATIVE_KEYS_H
#define KVSTRATA_NATIVE_KEYS_H

#include "_native.h"

#define JOIN_KEYS_DOC                                                                            \
    "join_keys(prefixes, pages, page_type, /) -> list[str] | None\n\n"                        \
    "For each page (page-major) and each prefix, prefix + the page's digest as 64 lowercase hex\n" \
    "digits: KeySpace.rendered's texts. None where Python must decide: pages not a list or a\n"  \
    "tuple, a page not a page_type, a digest not 32 bytes, a prefix not an ASCII str."

NATIVE_INTERNAL PyObject *join_keys(PyObject *module, PyObject *const *args, Py_ssize_t nargs);

#endif
