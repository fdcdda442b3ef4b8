"""Waiting for the cache's background work without spinning.

The cache runs copies (L1 <-> L2) and store I/O (L2 <-> L3) on worker threads and learns of their
results only when the scheduler calls ``check_events()``. A scheduler that must wait for a result (a
prefetch under ``wait_complete``, a load-back it needs now) would otherwise poll in a loop. Here each
worker is a :class:`SignallingExecutor`: a single thread running jobs in submission order (as the
cache's own ``ThreadExecutor``) that bumps a shared :class:`Progress` counter after every job, so
:meth:`Progress.wait` sleeps until *something* finished and the scheduler then drains it with
``check_events()``.

Design note: the alternative, a fixed short sleep between polls, either burns a core (short sleeps on a
2-core machine) or adds its whole period to every wait (long sleeps).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable

__all__ = ["Progress", "SignallingExecutor"]

log = logging.getLogger("kvstrata.replay")


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


class SignallingExecutor:
    """One worker thread running jobs in submission order; :meth:`Progress.bump` after each job
    (also after one that raised, which is logged: the cache's jobs report their own failures)."""

    def __init__(self, progress: Progress, name: str) -> None:
        self._progress = progress
        self._jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            try:
                job()
            except Exception:  # the cache's jobs report failures themselves; keep the worker alive
                log.exception("background job raised")
            self._progress.bump()

    def submit(self, job: Callable[[], None]) -> None:
        self._jobs.put(job)

    def close(self) -> None:
        """Finish every submitted job, then stop the worker."""
        if self._thread.is_alive():
            self._jobs.put(None)
            self._thread.join()
