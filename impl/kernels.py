"""The scheduler path's per-page kernels, native when built, portable otherwise.

Two kernels run once per page of every request, so their per-call cost decides the scheduler-path
time (docs/benchmarks.md):

- :func:`sha256_chain`: the chained SHA-256 page hashes of SPEC §4
  (``digest_i = SHA-256(digest_{i-1} || page_i)``, token ids as 4-byte little-endian bytes);
- :func:`nh_fingerprints`: the NH page fingerprints the radix tree matches by
  (:mod:`kvstrata.impl.fingerprint` defines them and bounds their collisions).

One more runs once per store key of every L3 call: :data:`join_keys`, the texts
:meth:`~kvstrata.model.keys.KeySpace.rendered` makes for a batch of pages (issue 20), made in C.

``kvstrata.impl._native`` (``impl/_native.c``, built by ``pip install`` where a C compiler and the
OpenSSL headers are present) loops over the pages in C, hashing with OpenSSL's SHA-256 and with the GIL
released, so a worker thread can hash while the scheduler thread runs (:mod:`kvstrata.impl.hashing`).
The portable versions here (``hashlib``, numpy) give the same bytes; :data:`NATIVE` says which ones
this process uses, and ``tests/unit/impl/test_kernels.py`` holds the two to each other.
"""

from __future__ import annotations

import hashlib
import importlib
import sys
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

import numpy as np
import numpy.typing as npt

from kvstrata.model.keys import KeyJoin, PageHash

__all__ = [
    "DIGEST_BYTES",
    "NATIVE",
    "check_pages",
    "check_pages_portable",
    "give_back",
    "join_keys",
    "take_lowest",
    "native_module",
    "nh_fingerprints",
    "nh_fingerprints_portable",
    "sha256_chain",
    "sha256_chain_portable",
]

DIGEST_BYTES = 32

ChainData = bytes | bytearray | memoryview | npt.NDArray[Any]
"""Token bytes to hash: anything C-contiguous with the buffer protocol (a uint32 array included)."""


def _load_native() -> ModuleType | None:
    try:
        return importlib.import_module("kvstrata.impl._native")
    except ImportError:
        return None


_NATIVE_MODULE = _load_native() if sys.byteorder == "little" else None
NATIVE: bool = _NATIVE_MODULE is not None
"""Whether the C kernels are in use (built, importable, and the host is little-endian: the C code
hashes token buffers as they lie in memory, which SPEC §4 fixes as little-endian)."""


def native_module() -> ModuleType | None:
    """``kvstrata.impl._native`` when the C kernels are in use (for tests and diagnostics)."""
    return _NATIVE_MODULE


def sha256_chain_portable(seed: bytes, data: ChainData, page_bytes: int) -> bytes:
    """The SHA-256 chain of the whole pages of ``data`` (``page_bytes`` each) from ``seed`` (32
    bytes, or empty: the default namespace's chain): 32 bytes per page, one ``hashlib`` call each."""
    _check_chain_args(seed, page_bytes)
    out = bytearray()
    previous = bytes(seed)
    sha256 = hashlib.sha256
    view = memoryview(data).cast("B")  # type: ignore[arg-type]  # bytes, whatever the item type
    for start in range(0, len(view) - page_bytes + 1, page_bytes):
        previous = sha256(previous + view[start : start + page_bytes]).digest()
        out += previous
    return bytes(out)


def nh_fingerprints_portable(
    tokens: npt.NDArray[np.uint32], keys: npt.NDArray[np.uint32], page_size: int
) -> bytes:
    """NH fingerprints (:mod:`kvstrata.impl.fingerprint`) of the whole pages of ``tokens`` in numpy:
    two uint64 lanes per page, native byte order."""
    padded = page_size + (page_size & 1)
    if len(keys) != 2 * padded:
        raise ValueError(f"keys must hold {2 * padded} uint32, got {len(keys)}")
    pages = len(tokens) // page_size
    if not pages:
        return b""
    matrix = np.ascontiguousarray(tokens[: pages * page_size], dtype=np.uint32).reshape(
        pages, page_size
    )
    if padded != page_size:
        matrix = np.concatenate((matrix, np.zeros((pages, 1), dtype=np.uint32)), axis=1)
    out = np.empty((pages, 2), dtype=np.uint64)
    for lane in range(2):
        summed = matrix + keys[lane * padded : (lane + 1) * padded]  # uint32: wraps mod 2**32
        products = summed[:, 0::2].astype(np.uint64) * summed[:, 1::2].astype(np.uint64)
        out[:, lane] = products.sum(axis=1, dtype=np.uint64)  # wraps mod 2**64
    return out.tobytes()


def _check_chain_args(seed: bytes, page_bytes: int) -> None:
    if page_bytes <= 0 or page_bytes % 4:
        raise ValueError(f"page_bytes must be a positive multiple of 4, got {page_bytes}")
    if len(seed) not in (0, DIGEST_BYTES):
        raise ValueError(f"seed must be 32 bytes or empty, got {len(seed)}")


def check_pages_portable(  # noqa: PLR0917 (the C kernel's positional signature)
    pages: npt.NDArray[np.int64],
    held: npt.NDArray[np.bool_],
    stamp: npt.NDArray[np.uint32],
    generation: int,
    own: npt.NDArray[np.int64],
    spare: npt.NDArray[np.int64],
    release: bool,
) -> int:
    """The radix cache's check of L1 pages a scheduler hands in, in numpy (the C ``check_pages``
    has the contract; ``stamp`` and ``generation`` only serve the C loop's repeat check): every page
    in range, none twice, each held by the scheduler or the tree's own page at that position of
    ``own``. The differing pages of the first ``len(own)`` positions go to ``spare``; returns their
    count. ValueError (nothing changed) otherwise; with ``release`` clears ``held`` at every page."""
    del stamp, generation
    count, mine, limit = len(pages), len(own), len(held)
    if not count:
        return 0
    outside = (pages < 0) | (pages >= limit)
    if outside.any():
        index = int(np.argmax(outside))
        raise ValueError(f"out of range [0, {limit}): page {int(pages[index])} at position {index}")
    _, first = np.unique(pages, return_index=True)
    if len(first) != count:
        later = np.setdiff1d(np.arange(count), first)
        index = int(later[0])
        raise ValueError(f"holds a page twice: page {int(pages[index])} at position {index}")
    theirs = np.zeros(count, dtype=np.bool_)
    theirs[:mine] = own == pages[:mine]
    foreign = ~theirs & ~held[pages]
    if foreign.any():
        index = int(np.argmax(foreign))
        raise ValueError(f"L1 page {int(pages[index])} for page {index} is not the scheduler's")
    differing = pages[:mine][~theirs[:mine]]
    spare[: len(differing)] = differing
    if release:
        held[pages] = False
    return len(differing)


take_lowest: Callable[..., int] | None = (
    None if _NATIVE_MODULE is None else _NATIVE_MODULE.take_lowest
)
"""The page allocator's C loop for ``alloc`` (None without the C kernels: numpy does it)."""
give_back: Callable[..., int] | None = None if _NATIVE_MODULE is None else _NATIVE_MODULE.give_back
"""The page allocator's C loop for ``free`` (None without the C kernels: numpy does it)."""

check_pages: Callable[..., int] = (
    check_pages_portable if _NATIVE_MODULE is None else _NATIVE_MODULE.check_pages
)

if _NATIVE_MODULE is not None:
    sha256_chain: Callable[[bytes, ChainData, int], bytes] = _NATIVE_MODULE.sha256_chain
    nh_fingerprints: Callable[[npt.NDArray[np.uint32], npt.NDArray[np.uint32], int], bytes] = (
        _NATIVE_MODULE.nh_fingerprints
    )
else:
    sha256_chain = sha256_chain_portable
    nh_fingerprints = nh_fingerprints_portable


def _join_native(prefixes: tuple[str, ...], pages: Sequence[PageHash]) -> list[str] | None:
    assert _NATIVE_MODULE is not None
    texts: list[str] | None = _NATIVE_MODULE.join_keys(prefixes, pages, PageHash)
    return texts


join_keys: KeyJoin | None = None if _NATIVE_MODULE is None else _join_native
"""The C loop :meth:`~kvstrata.model.keys.KeySpace.rendered` may make a batch's key texts with
(``rendered(..., join=join_keys)``: the same strings; None where the key space must decide); None
without the C kernels (the key space renders them in Python)."""
