"""Prefetch (L3 -> L2) values and wait policies of the model (SPEC §3).

A prefetch op reserves host slots for exactly the pages the store reported as present, receives them in
order, and is then committed (arrived pages become host-only nodes) or aborted. Slots that a read may
still be writing are never freed before the I/O side confirms (:attr:`PrefetchState.CANCELLING` until
``drain``): freeing them earlier is a stale-offset bug (I5/I7).
"""

from __future__ import annotations

import enum

import attrs

from kvstrata.model.keys import Namespace, PageHash
from kvstrata.model.lifecycles import PrefetchState

__all__ = ["PrefetchOp", "PrefetchPolicy", "PrefetchTimeout"]


class PrefetchPolicy(enum.Enum):
    BEST_EFFORT = "best_effort"  # the scheduler takes whatever has arrived when it asks
    WAIT_COMPLETE = "wait_complete"  # the scheduler waits for every reserved page
    TIMEOUT = "timeout"  # waits up to base + per_1k * tokens / 1000 steps, capped


@attrs.frozen
class PrefetchTimeout:
    """Timeout policy in model steps (the implementation uses seconds)."""

    base: int = 4
    per_1k_tokens: int = 2
    cap: int = 16

    def limit(self, tokens: int) -> int:
        return min(self.base + self.per_1k_tokens * tokens // 1000, self.cap)


@attrs.define
class PrefetchOp:
    """One L3 -> L2 read. ``host_slots[i]`` receives page ``i``; pages ``< arrived`` are complete;
    pages ``>= limit`` will never arrive (the store lost one of them)."""

    op_id: int
    namespace: Namespace
    anchor_id: int
    prefix_tokens: tuple[int, ...]
    page_tokens: tuple[tuple[int, ...], ...]
    pages: tuple[PageHash, ...]
    host_slots: tuple[int, ...]
    started: int
    state: PrefetchState = PrefetchState.LOADING
    arrived: int = 0
    limit: int = attrs.field()
    released: int = 0  # slots [released:] are still held by the op

    @limit.default
    def _limit_default(self) -> int:
        return len(self.pages)

    @property
    def held_slots(self) -> tuple[int, ...]:
        return self.host_slots[self.released :]
