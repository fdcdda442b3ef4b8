"""Keyed 128-bit page fingerprints: how the radix tree tells pages apart without storing token ids.

Design rationale
----------------
The tree must decide whether a page of a request equals a page it holds. Storing the token ids costs
4 bytes per token and SHA-256 costs ~1.3 µs per page on the scheduler thread; both are too much
(docs/benchmarks.md). Instead every page is named in the tree by a 16-byte fingerprint, computed for a
whole request in one vectorised numpy pass:

    lane_j(page) = sum_i keys[i, j] * token_i   (mod 2**64),   j = 0, 1

over the page's ``page_size`` uint32 token ids, with two independent lanes of uniform random 64-bit
keys (a multilinear hash). numpy integer arithmetic wraps modulo 2**64, so the matrix product of the
pages (as uint64) with the ``(page_size, 2)`` key matrix is exactly this sum.

Collision bound. Take two distinct pages and ``d_i`` the differences of their tokens: ``|d_i| < 2**32``
and some ``d_i != 0``. In one lane the fingerprints collide iff ``sum_i k_i d_i == 0 (mod 2**64)``.
Fix every key but ``k_m`` for one ``m`` with ``d_m != 0``; write ``d_m = 2**t * u`` with ``u`` odd and
``t <= 31``. As ``k_m`` runs over all 64-bit values, ``k_m d_m`` is uniform over the multiples of
``2**t`` (``u`` is invertible modulo ``2**64``), so the lane collides with probability
``2**t / 2**64 <= 2**-33``. The lanes have independent keys: a pair of distinct pages collides with
probability at most ``2**-66``. The tree only compares a page against the children of one node on one
path (and against the pages of one node when it matches inside it), so a request compares at most a few
thousand pairs.

The keys are drawn from ``os.urandom`` per cache instance unless a seed is configured (tests), so they
are secret to the process: an attacker cannot craft colliding pages offline, and a fingerprint means
nothing outside the process (it is never a store key; L3 keys use the SHA-256 page hashes, SPEC §4).

Alternatives: raw token bytes (exact, but 4 B/token); SHA-256 or BLAKE2 per page (exact enough, but one
Python-level call per page); Python's ``hash()`` of the page bytes (64 bits, per-page calls, and the
seed is per interpreter, not per cache).
"""

from __future__ import annotations

import os

import numpy as np
import numpy.typing as npt

__all__ = [
    "FINGERPRINT_BYTES",
    "Fingerprinter",
    "common_pages",
    "fingerprint_keys",
    "page_fingerprints",
]

FINGERPRINT_BYTES = 16
"""Bytes per page fingerprint (two 64-bit lanes, native byte order)."""

Keys = npt.NDArray[np.uint64]
Tokens = npt.NDArray[np.uint32]


def fingerprint_keys(page_size: int, seed: int | None = None) -> Keys:
    """A ``(page_size, 2)`` matrix of uniform 64-bit keys: secret (``os.urandom``) when ``seed`` is
    None, reproducible from ``seed`` otherwise."""
    count = 2 * page_size * 8
    raw = os.urandom(count) if seed is None else np.random.default_rng(seed).bytes(count)
    return np.frombuffer(raw, dtype=np.uint64).reshape(page_size, 2).copy()


def page_fingerprints(tokens: Tokens, keys: Keys) -> bytes:
    """The fingerprints of every whole page of ``tokens`` (uint32), 16 bytes each, concatenated in page
    order; a trailing partial page is ignored."""
    page_size = len(keys)
    pages = len(tokens) // page_size
    if not pages:
        return b""
    matrix = tokens[: pages * page_size].reshape(pages, page_size).astype(np.uint64)
    fingerprints: bytes = np.dot(matrix, keys).tobytes()  # uint64 arithmetic wraps mod 2**64
    return fingerprints


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
    """Page fingerprints under one key matrix, remembering the last request's.

    A scheduler matches a request and then inserts the same tokens (or the same tokens extended by
    whole pages): the insert then fingerprints only the pages it has not seen, after one byte
    comparison of the tokens. The memo is a pure cache of a pure function of the token bytes, so it
    can never change a result.
    """

    __slots__ = ("_keys", "_last_fingerprints", "_last_tokens", "_page_bytes")

    def __init__(self, keys: Keys) -> None:
        self._keys = keys
        self._page_bytes = 4 * len(keys)
        self._last_tokens = b""
        self._last_fingerprints = b""

    def __call__(self, tokens: Tokens) -> bytes:
        """Fingerprints of the whole pages of ``tokens`` (1-D native uint32)."""
        data = tokens.tobytes()
        last = self._last_tokens
        if data.startswith(last):
            known = len(last) // 4
            fingerprints = self._last_fingerprints
            if len(data) - len(last) >= self._page_bytes:
                fingerprints += page_fingerprints(tokens[known:], self._keys)
        else:
            fingerprints = page_fingerprints(tokens, self._keys)
        pages = len(fingerprints) // FINGERPRINT_BYTES
        self._last_tokens = data[: pages * self._page_bytes]
        self._last_fingerprints = fingerprints
        return fingerprints

    def forget(self) -> None:
        """Drop the memo (the cache was reset)."""
        self._last_tokens = self._last_fingerprints = b""
