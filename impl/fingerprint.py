"""Keyed 128-bit page fingerprints: how the radix tree tells pages apart without storing token ids.

Design rationale
----------------
The tree must decide whether a page of a request equals a page it holds. Storing the token ids costs
4 bytes per token and a SHA-256 per page costs ~0.2 µs in C and ~0.5 µs through ``hashlib``, for
every page of every request on the scheduler thread; both are too much (docs/benchmarks.md). Instead
every page is named in the tree by a 16-byte **NH** fingerprint (the universal hash at the core of
UMAC), computed for a whole request in one call:

    lane_j(page) = sum_i ((t_{2i} + k_j[2i]) mod 2**32) * ((t_{2i+1} + k_j[2i+1]) mod 2**32)  (mod 2**64)

for ``j = 0, 1``, over the page's uint32 token ids ``t`` (an odd page gets one zero token appended),
with one secret uniform uint32 key per position and lane. It costs one 32x32->64-bit multiply per two
tokens and lane: ~16 ns per 64-token page in C (:mod:`kvstrata.impl.kernels`), where the earlier
multilinear hash over uint64 took two 64-bit multiplies per token.

Collision bound. NH with 32-bit words is 2**-32-almost-universal on inputs of equal length (Black,
Halevi, Krawczyk, Krovetz and Rogaway, "UMAC: fast and secure message authentication", CRYPTO 1999):
for two distinct pages, a uniform key makes one lane collide with probability at most 2**-32. In short:
take a pair position ``i`` where the pages differ, fix every key but that pair's; the pair's term is
``(a + k)(b + k')`` against ``(a' + k)(b' + k')``, and over the uniform ``(k, k')`` the difference of
the two terms hits any one value modulo 2**64 with probability at most 2**-32, because a nonzero
difference of the shifted words times a uniform 32-bit word lands on each multiple of its power of two
at most once. The two lanes have independent keys: a pair of distinct pages collides with
probability at most 2**-64. The tree only compares a page against the children of one node on one
path (and against the pages of one node when it matches inside it), so a request compares at most a
few thousand pairs: at 10**4 requests a second, a collision is expected once in tens of millions of
years.

The keys are drawn from ``os.urandom`` per cache instance unless a seed is configured (tests), so they
are secret to the process: an attacker cannot craft colliding pages offline, and a fingerprint means
nothing outside the process (it is never a store key; L3 keys use the SHA-256 page hashes, SPEC §4).

Alternatives: raw token bytes (exact, but 4 B/token); SHA-256 or BLAKE2 per page (exact enough, but
10x the work); Python's ``hash()`` of the page bytes (64 bits, per-page calls, and the seed is per
interpreter, not per cache); the multilinear hash this module used before (2**-66, twice the cost).
"""

from __future__ import annotations

import os

import numpy as np
import numpy.typing as npt

from kvstrata.impl.kernels import NATIVE, nh_fingerprints

__all__ = [
    "FINGERPRINT_BYTES",
    "Fingerprinter",
    "common_pages",
    "fingerprint_keys",
    "page_fingerprints",
]

FINGERPRINT_BYTES = 16
"""Bytes per page fingerprint (two 64-bit lanes, native byte order)."""

Keys = npt.NDArray[np.uint32]
Tokens = npt.NDArray[np.uint32]


def fingerprint_keys(page_size: int, seed: int | None = None) -> Keys:
    """The NH keys for pages of ``page_size`` tokens: ``2 * padded`` uniform uint32 (lane 0's, then
    lane 1's; ``padded`` is ``page_size`` rounded up to even). Secret (``os.urandom``) when ``seed``
    is None, reproducible from ``seed`` otherwise."""
    count = 2 * (page_size + (page_size & 1)) * 4
    raw = os.urandom(count) if seed is None else np.random.default_rng(seed).bytes(count)
    return np.frombuffer(raw, dtype=np.uint32).copy()


def page_fingerprints(tokens: Tokens, keys: Keys, page_size: int) -> bytes:
    """The fingerprints of every whole page of ``tokens`` (C-contiguous uint32), 16 bytes each,
    concatenated in page order; a trailing partial page is ignored. ``keys`` from
    :func:`fingerprint_keys` for the same ``page_size``."""
    return nh_fingerprints(tokens, keys, page_size)


def common_pages(stored: bytes, query: bytes, start: int) -> int:
    """How many leading fingerprints of ``stored`` equal those of ``query`` from byte ``start`` on
    (``start`` a multiple of :data:`FINGERPRINT_BYTES`). One ``startswith`` when all of them do, one
    numpy comparison otherwise; no loop over pages."""
    size = min(len(stored), len(query) - start)
    head = stored if size == len(stored) else memoryview(stored)[:size]
    if query.startswith(head, start):
        return size // FINGERPRINT_BYTES
    mine = np.frombuffer(stored, dtype=np.uint64, count=size // 8)
    theirs = np.frombuffer(query, dtype=np.uint64, count=size // 8, offset=start)
    return int(np.argmax(mine != theirs)) // 2  # two uint64 lanes per fingerprint


class Fingerprinter:
    """Page fingerprints under one key set.

    With the C kernel (:data:`kvstrata.impl.kernels.NATIVE`) every call fingerprints all pages: at
    ~16 ns a page that is cheaper than remembering anything. With the portable numpy kernel it
    remembers the last request's: a scheduler matches a request and then inserts the same tokens
    (or the same tokens extended by whole pages), and the insert then fingerprints only the pages it
    has not seen, after one byte comparison of the tokens. The memo is a pure cache of a pure
    function of the token bytes, so it can never change a result.
    """

    __slots__ = ("_keys", "_last_fingerprints", "_last_tokens", "_page_bytes", "_page_size")

    def __init__(self, keys: Keys, page_size: int) -> None:
        if len(keys) != 2 * (page_size + (page_size & 1)):
            raise ValueError(f"keys of {len(keys)} words do not fit pages of {page_size} tokens")
        self._keys = keys
        self._page_size = page_size
        self._page_bytes = 4 * page_size
        self._last_tokens = b""
        self._last_fingerprints = b""

    def __call__(self, tokens: Tokens) -> bytes:
        """Fingerprints of the whole pages of ``tokens`` (1-D native uint32)."""
        if NATIVE:
            return nh_fingerprints(tokens, self._keys, self._page_size)
        data = tokens.tobytes()
        last = self._last_tokens
        if data.startswith(last):
            known = len(last) // 4
            fingerprints = self._last_fingerprints
            if len(data) - len(last) >= self._page_bytes:
                fingerprints += page_fingerprints(tokens[known:], self._keys, self._page_size)
        else:
            fingerprints = page_fingerprints(tokens, self._keys, self._page_size)
        pages = len(fingerprints) // FINGERPRINT_BYTES
        self._last_tokens = data[: pages * self._page_bytes]
        self._last_fingerprints = fingerprints
        return fingerprints

    def forget(self) -> None:
        """Drop the memo (the cache was reset)."""
        self._last_tokens = self._last_fingerprints = b""
