"""Prefetch wait policies (SPEC §3): how long a scheduler waits for an L3 -> L2 read. Pure values and
one pure decision, :func:`wait_over`, that the model (in steps) and the implementation (in seconds)
both call; nothing here knows the cache.
"""

from __future__ import annotations

import enum

import attrs

__all__ = ["PrefetchPolicy", "PrefetchTimeout", "wait_over"]


class PrefetchPolicy(enum.Enum):
    BEST_EFFORT = "best_effort"  # the scheduler takes whatever has arrived when it asks
    WAIT_COMPLETE = "wait_complete"  # the scheduler waits for every reserved page
    TIMEOUT = "timeout"  # waits up to base + per_1k * tokens / 1000 steps, capped


def wait_over(
    policy: PrefetchPolicy,
    *,
    loading: bool,
    waited: float,
    limit: float,
    deadline: float | None = None,
) -> bool:
    """Whether a scheduler waiting for a prefetch stops now: always once the op left ``LOADING``
    (``loading`` false) and under ``best_effort``; under every policy once ``waited >= deadline``
    (the bound on any request's L3 wait; ``None``: unbounded, the model's abstract default);
    otherwise never under ``wait_complete`` and under ``timeout`` once ``waited >= limit``. Pure:
    the model passes steps, the implementation seconds; this one function is the decision on both
    sides. A request that stops waiting commits what arrived; the rest lands later in slots the op
    still holds (``CANCELLING``) and is discarded on drain."""
    if not loading or policy is PrefetchPolicy.BEST_EFFORT:
        return True
    if deadline is not None and waited >= deadline:
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
    deadline: int | None = None  # steps any policy waits at most (None: unbounded)

    def limit(self, tokens: int) -> int:
        return min(self.base + self.per_1k_tokens * tokens // 1000, self.cap)
