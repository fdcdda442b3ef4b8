"""The trace's theoretical maximum hit ratio: prefix reuse with unbounded capacity, computed from the
hash ids alone (never from the cache), page-aligned the way the cache is (SPEC §12).

A request of ``n = input_length // page_size`` full pages can reuse page ``p`` exactly when an earlier
request had the same hash ids up to the block in which page ``p`` ends and at least ``p + 1`` full pages
itself (a page's tokens depend only on the blocks it covers, and different blocks never share tokens:
see :mod:`kvstrata.impl.replay.trace`). Reusable pages always form a prefix: an earlier request that
has page ``p`` has every page before it.

The computation keeps, per distinct block prefix (interned to an int), the largest page count of any
request that had it (``reach``): page ``p``, ending in block ``b``, was seen iff
``reach[prefix up to b] >= p + 1``. Memory is one dict entry per distinct block prefix, not per page.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvstrata.impl.replay.trace import BLOCK_TOKENS, Request

__all__ = ["max_hit_pages"]


def max_hit_pages(requests: Sequence[Request], page_size: int) -> list[int]:
    """Per request, how many of its leading full pages an unbounded cache that has seen every earlier
    request holds. Invariant: ``0 <= result[i] <= requests[i].input_length // page_size``."""
    if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size < 1:
        raise ValueError(f"page_size must be an int >= 1, got {page_size!r}")
    interned: dict[tuple[int, int], int] = {}
    reach: dict[int, int] = {}
    out: list[int] = []
    for request in requests:
        pages = request.input_length // page_size
        prefixes: list[int] = []
        parent = 0
        for block in request.hash_ids[: request.blocks]:
            parent = interned.setdefault((parent, block), len(interned) + 1)
            prefixes.append(parent)
        hit = 0
        for index, prefix in enumerate(prefixes):
            ending = min(
                (index + 1) * BLOCK_TOKENS // page_size, pages
            )  # pages ending by block end
            seen = reach.get(prefix, 0)
            if seen < ending:
                hit = max(hit, seen)
                break
            hit = ending
        out.append(hit)
        for prefix in prefixes:
            if reach.get(prefix, 0) < pages:
                reach[prefix] = pages
    return out
