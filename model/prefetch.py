"""Prefetch (L3 -> L2) values and wait policies of the model (SPEC §3).

A prefetch op reserves host slots for exactly the pages the store reported as present, receives them in
order, and is then committed (arrived pages become host-only nodes) or aborted. Slots that a read may
still be writing are never freed before the I/O side confirms (:attr:`PrefetchState.CANCELLING` until
``drain``): freeing them earlier is a stale-offset bug (I5/I7).

With a ``TRAILING_PAGES`` side pool (a Mamba state) the op also reserves one L2 *state* slot. The state
is read only after the KV range is known (every reserved page arrived, or the store lost one): it is the
state of the last page that arrived, or, if that one is gone from the store, of the deepest arrived page
whose state is still there (the arrived pages after it are dropped: a prefix is usable only up to a
state, I6). The state slot follows the same rule as the page slots: held until commit takes it, or until
the op is ``DONE``.
"""

from __future__ import annotations

import enum

import attrs

from kvstrata.model.keys import Namespace, PageHash
from kvstrata.model.lifecycles import PrefetchState

__all__ = ["PrefetchOp", "PrefetchPolicy", "PrefetchTimeout", "wait_over"]


class PrefetchPolicy(enum.Enum):
    BEST_EFFORT = "best_effort"  # the scheduler takes whatever has arrived when it asks
    WAIT_COMPLETE = "wait_complete"  # the scheduler waits for every reserved page
    TIMEOUT = "timeout"  # waits up to base + per_1k * tokens / 1000 steps, capped


def wait_over(policy: PrefetchPolicy, *, loading: bool, waited: float, limit: float) -> bool:
    """Whether a scheduler waiting for a prefetch stops now: always once the op left ``LOADING``
    (``loading`` false) and under ``best_effort``; never before that under ``wait_complete``; under
    ``timeout`` once ``waited >= limit``. Pure: the model passes steps, the implementation seconds;
    this one function is the decision on both sides."""
    if not loading or policy is PrefetchPolicy.BEST_EFFORT:
        return True
    if policy is PrefetchPolicy.WAIT_COMPLETE:
        return False
    return waited >= limit


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
    state_slot: int | None = None  # the L2 state slot reserved for the trailing state, if any
    state_page: PageHash | None = None  # set once the state of that page was read into state_slot
    state_released: bool = False  # the state slot was taken by commit or freed

    @limit.default
    def _limit_default(self) -> int:
        return len(self.pages)

    @property
    def held_slots(self) -> tuple[int, ...]:
        return self.host_slots[self.released :]

    @property
    def held_state_slot(self) -> int | None:
        """The L2 state slot the op still holds (``None`` if it has none or gave it up)."""
        return None if self.state_released else self.state_slot
