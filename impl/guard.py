"""One owner thread, and nothing after ``close()``: :func:`guarded`, the check around a cache's
mutating verbs (issue 17).

A cache (:class:`~kvstrata.impl.cache.HierarchicalRadixCache`,
:class:`~kvstrata.impl.embedding.EmbeddingCache`) is driven by one scheduler thread. Calls from two
threads corrupted a cache silently (wrong bytes served, L1 pages leaked), and calls after ``close()``
were accepted (pins leaked, a prefetch never became ready). :func:`guarded` wraps the verbs a class
names so that each call first checks, in one comparison on the fast path, that the cache is open
and that the caller is its **owner**: the first thread that called a guarded verb (so a cache may
be built on one thread and driven by another). Otherwise it raises :class:`CacheClosed` or
:class:`WrongThread` before anything changes. Read-only queries and ``close`` are not guarded.
docs/benchmarks.md measures the cost on the scheduler path.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from kvstrata.impl.errors import CacheClosed, WrongThread

__all__ = ["Guard", "guarded"]

C = TypeVar("C", bound=type)
_ident = threading.get_ident


class Guard:
    """The owner thread (``None`` until the first guarded call) and whether the cache is closed.
    Invariant: once set, ``owner`` never changes; once ``closed``, every guarded call raises."""

    __slots__ = ("closed", "owner", "what")

    def __init__(self, what: str) -> None:
        self.what = what
        self.owner: int | None = None
        self.closed = False

    def refuse(self, verb: str) -> None:
        """The slow path: adopt the first caller, or raise."""
        if self.closed:
            raise CacheClosed(f"{self.what}.{verb}: the cache is closed")
        caller = _ident()
        if self.owner is None:
            self.owner = caller
            return
        if self.owner != caller:
            raise WrongThread(
                f"{self.what}.{verb}: called from thread {caller}, but thread {self.owner} drives "
                "this cache (one scheduler thread per cache)"
            )


def guarded(*verbs: str) -> Callable[[C], C]:
    """A class decorator: each of ``verbs`` checks the instance's ``_guard`` (a :class:`Guard`)
    before it runs."""

    def wrap(cls: C) -> C:
        for verb in verbs:
            setattr(cls, verb, _checked(getattr(cls, verb), verb))
        return cls

    return wrap


def _checked(method: Callable[..., Any], verb: str) -> Callable[..., Any]:
    @functools.wraps(method)
    def checked(self: Any, *args: Any, **kwargs: Any) -> Any:
        guard = self._guard
        if guard.owner != _ident() or guard.closed:
            guard.refuse(verb)
        return method(self, *args, **kwargs)

    return checked
