"""N tensor-parallel ranks in one process, for the TP tests (issue 18).

:class:`InProcessTp` gives each rank a thread of its own (its cache's scheduler thread) and a
:class:`RankGroup` whose ``start_min`` deposits the rank's report for its n-th reduction and whose
``wait`` is the rendezvous: the minimum once every rank sent its n-th report,
:class:`TpAgreementError` for every waiting rank when one does not come within ``timeout_s`` or the
reports' lengths differ (what gloo does when a rank skipped its
collective or sent a different layout). Results do not depend on thread timing: every rank gets
the same minimum, and every rank's reports are logged (``reports``) so a test can check that all
ranks made the same calls in the same order.
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable
from typing import TypeVar

import numpy as np
import numpy.typing as npt

from kvstrata.impl.errors import TpAgreementError

T = TypeVar("T")
Report = npt.NDArray[np.int64]


class InProcessTp:
    def __init__(self, size: int, *, timeout_s: float = 5.0) -> None:
        self.size = size
        self.timeout_s = timeout_s
        self._cond = threading.Condition()
        self._calls = [0] * size  # reductions each rank started
        self._deposits: dict[int, dict[int, Report]] = {}
        self._results: dict[int, Report | TpAgreementError] = {}
        self.reports: list[list[tuple[int, int]]] = [[] for _ in range(size)]  # (length, digest)
        self._threads = [
            concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"tp-rank-{rank}")
            for rank in range(size)
        ]

    def group(self, rank: int) -> RankGroup:
        return RankGroup(self, rank)

    def start_min(self, rank: int, report: Report) -> Pending:
        """Deposit this rank's report for its next reduction (the n-th call of every rank forms
        the n-th reduction); the result comes from :meth:`Pending.wait`."""
        with self._cond:
            generation = self._calls[rank]
            self._calls[rank] += 1
            self._deposits.setdefault(generation, {})[rank] = report.copy()
            digest = int(report[2]) if len(report) > 2 else 0
            self.reports[rank].append((len(report), digest))
            deposits = self._deposits[generation]
            if len(deposits) == self.size:
                lengths = {len(r) for r in deposits.values()}
                if len(lengths) != 1:
                    self._results[generation] = TpAgreementError(
                        f"reports of lengths {sorted(lengths)}: the ranks' layouts differ"
                    )
                else:
                    self._results[generation] = np.minimum.reduce(list(deposits.values()))
                del self._deposits[generation]
                self._cond.notify_all()
        return Pending(self, rank, generation)

    def wait(self, rank: int, generation: int) -> Report:
        with self._cond:
            if not self._cond.wait_for(lambda: generation in self._results, timeout=self.timeout_s):
                raise TpAgreementError(
                    f"rank {rank}: no answer from the other ranks in {self.timeout_s} s"
                )
            result = self._results[generation]
        if isinstance(result, TpAgreementError):
            raise result
        return result.copy()

    def on_each(self, call: Callable[[int], T]) -> list[T]:
        """``call(rank)`` on every rank's thread at once; the results in rank order (the first
        error, by rank, is raised once every rank finished)."""
        futures = [pool.submit(call, rank) for rank, pool in enumerate(self._threads)]
        concurrent.futures.wait(futures)
        return [future.result() for future in futures]

    def on_rank(self, rank: int, call: Callable[[], T]) -> T:
        return self._threads[rank].submit(call).result()

    def close(self) -> None:
        for pool in self._threads:
            pool.shutdown(wait=True)


class RankGroup:
    """One rank's view of an :class:`InProcessTp` (a ``kvstrata.impl.tp.TpGroup``)."""

    def __init__(self, cluster: InProcessTp, rank: int) -> None:
        self._cluster = cluster
        self._rank = rank

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def size(self) -> int:
        return self._cluster.size

    def start_min(self, report: Report) -> Pending:
        return self._cluster.start_min(self._rank, report)


class Pending:
    def __init__(self, cluster: InProcessTp, rank: int, generation: int) -> None:
        self._cluster, self._rank, self._generation = cluster, rank, generation

    def wait(self) -> Report:
        return self._cluster.wait(self._rank, self._generation)
