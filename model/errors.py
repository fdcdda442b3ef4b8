"""Errors raised by the reference model.

Every operation of the model either completes or raises one of these and leaves the model exactly as it
was (the stateful tests assert that). ``kvstrata.impl.errors`` builds its own hierarchy on top of these
so that a caller can catch the same error class from the model and from the implementation.
"""

from __future__ import annotations

import operator

__all__ = [
    "CapacityError",
    "DoubleRenderError",
    "IllegalTransition",
    "InvariantViolation",
    "KeyParseError",
    "KvStrataError",
    "MisuseError",
    "ModelError",
    "page_count",
]


class KvStrataError(Exception):
    """Root of every error kvstrata raises on purpose."""


class ModelError(KvStrataError):
    """Root of the errors raised by ``kvstrata.model``."""


class MisuseError(ModelError, ValueError):
    """The caller asked for something that is not allowed (bad argument, unknown handle, unlock of an
    unlocked node, ...). Nothing was changed."""


class CapacityError(ModelError):
    """Not enough free slots (after allowed eviction) to do what was asked. Nothing was changed."""


class IllegalTransition(ModelError):
    """A lifecycle was asked to take an event that its transition table does not allow in its current
    state. Nothing was changed."""

    def __init__(self, machine: str, state: object, event: object) -> None:
        super().__init__(f"{machine}: event {event!s} is not allowed in state {state!s}")
        self.machine = machine
        self.state = state
        self.event = event


class DoubleRenderError(ModelError, TypeError):
    """A store key was about to be rendered from something that is already a rendered key (the historic
    "tagged twice" bug: every lookup then misses while writes go on)."""


class KeyParseError(ModelError, ValueError):
    """A string is not a store key of a schema version this library knows."""


class InvariantViolation(ModelError, AssertionError):
    """One of the invariants of SPEC §7 does not hold. This is always a bug in kvstrata."""

    def __init__(self, invariant: str, detail: str) -> None:
        super().__init__(f"{invariant}: {detail}")
        self.invariant = invariant
        self.detail = detail


def whole_count(value: object, what: str, *, least: int = 0) -> int:
    """``value`` as a count of ``what`` (an ``int``, or any integer type with ``__index__``, such as
    a numpy integer, which schedulers compute with), :class:`MisuseError` for anything else, a
    ``bool`` or a count below ``least``. The one rule of the model and the implementation for the
    counts callers pass: pages, units, token counts, sizes."""
    if type(value) is int and value >= least:  # the common case, first (a scheduler's hot path)
        return value
    problem = f"{what} must be an int >= {least}, got {value!r}"
    if isinstance(value, bool) or "bool" in str(getattr(value, "dtype", "")):
        raise MisuseError(problem)  # a bool, or a numpy or torch boolean
    try:
        count = operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise MisuseError(problem) from None
    if count < least:
        raise MisuseError(problem)
    return count


def page_count(value: object) -> int:
    """``value`` as a count of pages (:func:`whole_count`, at least 0): the ``pages`` argument of
    the scheduler's verbs."""
    if type(value) is int and value >= 0:  # the common case, without a second call
        return value
    return whole_count(value, "pages")
