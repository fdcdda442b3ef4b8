"""The store link: lanes, deadlines and the store's health (issue 17; model:
``kvstrata.model.l3.health``, table ``STORE_HEALTH``).

Every store call of one cache goes through one :class:`StoreLink`. It runs on four lanes, each its
own executor (a worker thread by default): ``QUERY`` (prefetch queries), ``READ`` (prefetch
fetches), ``WRITE`` (backups) and ``PROBE`` (health probes), so a prefetch never queues behind a
backup and a query never behind a fetch. The link keeps a
record per call (when its lane began it, when it returned, whether it showed a sign of an outage) and
judges each call once, on the scheduler thread, in :meth:`StoreLink.poll`: a returned call by its
outcome and duration, a running call as soon as it is past its deadline. The judgements advance the
health table:

- ``HEALTHY`` / ``SUSPECT`` (``SERVING``): calls are issued. The first fault makes the store
  ``SUSPECT`` and issues a probe at once; the probe (or a second fault) decides.
- ``DOWN`` / ``PROBING``: :meth:`StoreLink.submit` refuses: the caller answers a read "nothing" at
  once and defers a backup (``Backups`` keeps the bounded queue). Probes back off (doubling, capped).
- ``PROBE_OK`` returns a :class:`~kvstrata.model.l3.health.Recovery` from :meth:`poll`; ``lost``
  when the probe found that the store no longer holds the *sentinel* (the last page a backup
  confirmed while the store was healthy: the store restarted empty), ``was_down`` when the outage
  reached ``DOWN``; either way the caller checks L2 against the store again (``republish``).

Abandoned calls: a call past its deadline is judged and the request that waited for it moves on
(``wait_over``'s deadline), but the call itself cannot be cancelled (the native client has no
cancel); its result is still delivered and applied when it returns, and the host pages it writes stay
reserved by its op until then (``CANCELLING``), never reused meanwhile.

Logs: one warning when the store goes down and one line when it is back (with how many calls
failed, for how long), never one per call.

Thread model: ``submit`` and ``poll`` run on the scheduler thread only; a lane thread touches only
its call's record (``started``, ``returned``, ``fault``) and the finished queue.
"""

from __future__ import annotations

import logging
import queue
import time
from collections.abc import Callable, Mapping
from typing import Any

import attrs

from kvstrata.impl.transfer import Executor, ThreadExecutor, drain
from kvstrata.model.l3.health import LANE_OF, CallKind, HealthConfig, Lane, Recovery
from kvstrata.model.lifecycles import PROBED, SERVING, STORE_HEALTH, Health, HealthEvent

__all__ = ["Body", "Lanes", "LinkCall", "Merge", "Skip", "StoreLink"]

log = logging.getLogger("kvstrata.storage")


@attrs.define(eq=False)
class LinkCall:
    """One store call's record (see the model's ``Call``). ``outcome`` is what the call's body
    returned (a storage result, or for a probe whether the sentinel was lost)."""

    call_id: int
    kind: CallKind
    op_id: int
    pages: int
    started: float | None = None
    returned: float | None = None
    fault: bool = False
    judged: bool = False
    skipped: bool = False  # begun while the store was not serving: the body did not run
    healthy_ok: bool = False  # judged OK while HEALTHY (a backup's pages may become the sentinel)
    outcome: Any = None


#: A call's body: runs on its lane; returns (outcome, fault).
Body = Callable[[], "tuple[Any, bool]"]
#: What a skipped call returns instead (no store call): its outcome.
Skip = Callable[[], Any]


@attrs.frozen
class Merge:
    """How a call may share one store call with the calls queued right behind it on its lane
    (issue 20: a write or read lane with a backlog makes fewer, larger calls). Calls join while their
    ``key`` is equal and their ``pages`` sum to at most the first's ``limit``; ``run`` takes the
    ``part`` of every member that is not skipped, in order, and returns one outcome per part (each
    what that call alone would have returned) and whether the shared call faulted."""

    key: object
    pages: int
    limit: int
    part: Any
    run: Callable[[list[Any]], tuple[list[Any], bool]]


class _Job:
    """What a lane's executor runs: ``begin`` marks the call started (a stepped test executor
    calls it alone to leave a call hanging) and decides whether it is skipped (the store is not
    serving: ``serving()`` is read on the lane thread, a plain attribute read); calling it runs the
    body (or the skip) and queues the record."""

    def __init__(
        self,
        call: LinkCall,
        body: Body,
        skip: Skip | None,
        link: StoreLink,
        merge: Merge | None = None,
    ) -> None:
        self.call, self._body, self._skip, self._link = call, body, skip, link
        self.merge = merge
        # the executors' Mergeable protocol (a key of None is never merged)
        self.merge_key = None if merge is None else merge.key
        self.merge_pages = 0 if merge is None else merge.pages
        self.merge_limit = 0 if merge is None else merge.limit

    def begin(self) -> None:
        call = self.call
        if call.started is None:
            call.started = self._link.now()
            call.skipped = self._skip is not None and not self._link.serving

    def __call__(self) -> None:
        self.begin()
        call = self.call
        try:
            if call.skipped:
                assert self._skip is not None
                outcome, fault = self._skip(), False
            else:
                outcome, fault = self._body()
        except Exception:  # a body reports its own failures; this is a bug, counted as a fault
            log.exception("kvstrata: store call %s raised", call.kind.value)
            outcome, fault = None, True
        call.outcome, call.fault = outcome, fault
        call.returned = call.started if call.skipped else self._link.now()
        self._link.finished(call)

    def run_merged(self, others: list[_Job]) -> None:
        """This call and ``others`` (queued right behind it, same merge key) as one store call,
        judged once. This call begins now (or began earlier) and carries the shared call's start,
        deadline and fault; the others are decided now (skipped, as alone, when the store is not
        serving) but begin only when the shared call returns, so they are never overdue and never
        fault (their ops get their own statuses, failed ones included, and retry as usual). If
        this call was skipped, the first member that is not carries the call instead. The members
        that are not skipped share one ``Merge.run``; every record is handed over, in queue order,
        even if another member's hand-over raised."""
        self.begin()
        began = self._link.now()
        serving = self._link.serving
        for job in others:
            job.call.skipped = job._skip is not None and not serving
        jobs = [self, *others]
        live = [job for job in jobs if not job.call.skipped]
        outcomes: list[Any] = [None] * len(live)
        fault = True
        if live:
            assert self.merge is not None
            try:
                outcomes, fault = self.merge.run([job.merge.part for job in live if job.merge])
            except Exception:  # as in __call__: a bug, counted as the call's fault
                log.exception("kvstrata: merged store call %s raised", self.call.kind.value)
            if len(outcomes) != len(live):
                log.error("kvstrata: a merged store call gave %d outcomes", len(outcomes))
                outcomes, fault = [None] * len(live), True
        results = iter(outcomes)
        now = self._link.now()
        carrier = True  # the first member that is not skipped carries the call's fault
        for job in jobs:
            call = job.call
            try:
                if call.started is None:
                    call.started = began if carrier and not call.skipped else now
                if call.skipped:
                    assert job._skip is not None
                    call.outcome, call.fault, call.returned = job._skip(), False, call.started
                else:
                    call.outcome, call.returned = next(results), now
                    call.fault, carrier = fault and carrier, False
            except Exception:
                log.exception("kvstrata: a merged store call's member could not be reported")
                call.outcome, call.fault, call.returned = None, True, now
            finally:
                self._link.finished(call)


@attrs.frozen
class Lanes:
    """One executor per lane (tests pass stepped executors; one executor may serve several).
    ``query`` left out: the read lane's executor runs the queries too (each lane keeps its own
    order; a query may then wait behind a fetch)."""

    read: Executor
    write: Executor
    probe: Executor
    query: Executor | None = None

    @classmethod
    def threads(cls) -> Lanes:
        return cls(
            ThreadExecutor("kvstrata-l3-read", merge=True),  # a backlog of fetches merges
            ThreadExecutor("kvstrata-l3-write", merge=True),  # a backlog of backups merges
            ThreadExecutor("kvstrata-l3-probe"),
            ThreadExecutor("kvstrata-l3-query"),
        )

    @classmethod
    def shared(cls, executor: Executor) -> Lanes:
        return cls(executor, executor, executor, executor)

    def of(self, lane: Lane) -> Executor:
        if lane is Lane.QUERY:
            return self.read if self.query is None else self.query
        return {Lane.READ: self.read, Lane.WRITE: self.write, Lane.PROBE: self.probe}[lane]

    def executors(self) -> list[Executor]:
        """Every distinct executor, each once, in lane order."""
        found: list[Executor] = []
        for lane in Lane:
            executor = self.of(lane)
            if all(executor is not seen for seen in found):
                found.append(executor)
        return found

    def close(self) -> None:
        for executor in self.executors():
            executor.close()


class StoreLink:
    """Lanes, call records and the health machine of one cache's store (scheduler thread)."""

    def __init__(
        self,
        lanes: Lanes,
        probe: Callable[[], Body],
        config: HealthConfig,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.lanes = lanes
        self.config = config
        self._probe = probe
        self._clock = clock
        self.state: Health = STORE_HEALTH.initial
        self.calls: dict[Lane, list[LinkCall]] = {lane: [] for lane in Lane}
        self._done: queue.SimpleQueue[LinkCall] = queue.SimpleQueue()
        self._next_call = 0
        self.probe_failures = 0
        self.probe_at: float | None = None
        self.faults = 0
        self.skipped = 0
        self.answered_nothing = 0
        self.recoveries = 0
        self.losses = 0
        self._down_since: float | None = None
        self._faults_at_down = 0
        self.healthy_since: float = clock()  # when the store last became HEALTHY

    @property
    def serving(self) -> bool:
        return self.state in SERVING

    def now(self) -> float:
        return self._clock()

    def finished(self, call: LinkCall) -> None:
        """A lane thread hands a returned call over (judged at the next :meth:`poll`)."""
        self._done.put(call)

    def submit(
        self,
        kind: CallKind,
        op_id: int,
        pages: int,
        body: Body,
        skip: Skip,
        *,
        merge: Merge | None = None,
    ) -> bool:
        """Issue ``body`` on ``kind``'s lane; ``False`` (nothing issued) unless the store is
        serving: the caller answers a read "nothing" or defers a backup. If the store stops serving
        before the lane begins the call, ``skip()`` gives its outcome instead of the body. With
        ``merge``, a lane executor that merges may run the call within one store call shared with
        the calls queued right behind it (:class:`Merge`)."""
        if self.state not in SERVING:
            if kind is not CallKind.BACKUP:
                self.answered_nothing += 1
            return False
        self._issue(kind, op_id, pages, body, skip, merge=merge)
        return True

    def _issue(
        self,
        kind: CallKind,
        op_id: int,
        pages: int,
        body: Body,
        skip: Skip | None = None,
        *,
        merge: Merge | None = None,
    ) -> None:
        self._next_call += 1
        call = LinkCall(self._next_call, kind, op_id, pages)
        lane = LANE_OF[kind]
        self.calls[lane].append(call)
        self.lanes.of(lane).submit(_Job(call, body, skip, self, merge))

    def poll(self) -> tuple[list[LinkCall], Recovery | None]:
        """Judge what returned (in return order) and what overran, issue a due probe. Returns the
        returned non-probe calls (their outcomes are the caller's to apply, judged late or not)
        and the last recovery, if any."""
        now = self._clock()
        recovery: Recovery | None = None
        returned: list[LinkCall] = []
        for call in drain(self._done):
            self.calls[LANE_OF[call.kind]].remove(call)
            if not call.judged:
                assert call.started is not None and call.returned is not None
                overran = call.returned - call.started > self.config.deadline(call.kind)
                recovery = self._judge(call, call.fault or overran, now) or recovery
            if call.kind is not CallKind.PROBE:
                returned.append(call)
        for calls in self.calls.values():
            for call in calls:
                started = call.started
                if (
                    started is not None
                    and not call.judged
                    and now - started > self.config.deadline(call.kind)
                ):
                    recovery = self._judge(call, True, now) or recovery
        if self.state is Health.SUSPECT and not self.calls[Lane.PROBE]:
            self._issue(CallKind.PROBE, 0, 0, self._probe())
        if (
            self.state is Health.DOWN
            and not self.calls[Lane.PROBE]
            and self.probe_at is not None
            and now >= self.probe_at
        ):
            self._advance(HealthEvent.PROBE_DUE, now)
        return returned, recovery

    def _judge(self, call: LinkCall, fault: bool, now: float) -> Recovery | None:
        call.judged = True
        if call.skipped:
            self.skipped += 1
            return None
        if fault:
            self.faults += 1
        if call.kind is CallKind.PROBE:
            if self.state not in PROBED:
                self._advance(HealthEvent.LATE, now)
                return None
            if fault:
                self.probe_failures += 1
                self._advance(HealthEvent.PROBE_FAIL, now)
                return None
            lost, was_down = call.outcome is True, self.state is Health.PROBING
            self._advance(HealthEvent.PROBE_OK, now)
            self.recoveries += 1
            self.losses += lost
            return Recovery(lost, was_down)
        if self.state not in SERVING:
            self._advance(HealthEvent.LATE, now)
            return None
        call.healthy_ok = not fault and self.state is Health.HEALTHY
        self._advance(HealthEvent.FAULT if fault else HealthEvent.OK, now)
        return None

    def _advance(self, event: HealthEvent, now: float) -> None:
        before = self.state
        self.state = STORE_HEALTH.next(before, event)
        if self.state is before:
            return
        if self.state is Health.SUSPECT and not self.calls[Lane.PROBE]:
            self._issue(CallKind.PROBE, 0, 0, self._probe())
        elif self.state is Health.DOWN:
            self.probe_failures = max(self.probe_failures, 1)
            self.probe_at = now + self.config.backoff(self.probe_failures)
            if before in SERVING:
                self._down_since, self._faults_at_down = now, self.faults
                log.warning(
                    "kvstrata: L3 store down (%d failed or overdue calls); prefetches answer "
                    "nothing and backups wait (at most %d pages) until a probe succeeds",
                    self.faults,
                    self.config.deferred_pages,
                )
        elif self.state is Health.PROBING:
            self.probe_at = None
            self._issue(CallKind.PROBE, 0, 0, self._probe())
        elif self.state is Health.HEALTHY:
            self.probe_failures = 0
            self.probe_at = None
            self.healthy_since = now
            if self._down_since is not None:
                log.warning(
                    "kvstrata: L3 store back after %.1f s down (%d calls failed meanwhile)",
                    now - self._down_since,
                    self.faults - self._faults_at_down,
                )
                self._down_since = None

    def in_flight(self) -> int:
        """Calls issued and not yet returned (queued or running), probes included."""
        return sum(len(calls) for calls in self.calls.values())

    def describe(self) -> Mapping[str, Any]:
        return {
            "state": self.state.value,
            "faults": self.faults,
            "skipped": self.skipped,
            "answered_nothing": self.answered_nothing,
            "recoveries": self.recoveries,
            "losses": self.losses,
        }

    def close(self) -> None:
        """Let every issued call return (a hung native call ends at its own timeout), then stop
        the lanes."""
        self.lanes.close()
