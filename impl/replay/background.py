"""Waiting for the cache's background work without spinning.

The cache runs copies (L1 <-> L2) and store I/O (L2 <-> L3) on worker threads and learns of their
results only when the scheduler calls ``check_events()``. A scheduler that must wait for a result (a
prefetch under ``wait_complete``, a load-back it needs now) would otherwise poll in a loop. Here each
worker is the cache's own ``ThreadExecutor`` (:func:`signalling_executor`) bumping a shared
:class:`Progress` counter after every job, so
:meth:`Progress.wait` sleeps until *something* finished and the scheduler then drains it with
``check_events()``.

Design note: the alternative, a fixed short sleep between polls, either burns a core (short sleeps on a
2-core machine) or adds its whole period to every wait (long sleeps).
"""

from __future__ import annotations

import threading
import time

from kvstrata.impl.transfer import ThreadExecutor

__all__ = ["Progress", "signalling_executor"]


class Progress:
    """A counter of finished background jobs that threads can wait on."""

    def __init__(self) -> None:
        self._done = 0
        self._changed = threading.Condition()

    @property
    def done(self) -> int:
        with self._changed:
            return self._done

    def bump(self) -> None:
        with self._changed:
            self._done += 1
            self._changed.notify_all()

    def wait(self, seen: int, timeout: float) -> int:
        """Block until more than ``seen`` jobs finished or ``timeout`` seconds passed; returns the
        current count."""
        deadline = time.monotonic() + max(timeout, 0.0)
        with self._changed:
            while self._done <= seen:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._changed.wait(left)
            return self._done


def signalling_executor(progress: Progress, name: str) -> ThreadExecutor:
    """A :class:`ThreadExecutor` that calls :meth:`Progress.bump` after each job, so waiters wake
    up when background work moved on."""
    return ThreadExecutor(name, after_job=progress.bump)
