"""The store link: call lanes, deadlines and the store's health (SPEC §9; issue 17).

Pure: time is a number the caller passes (seconds, from the implementation's clock or a test's fake
clock); nothing here sleeps, reads a clock or does I/O. The implementation
(:class:`kvstrata.impl.storage.link.StoreLink`) runs the same :data:`STORE_HEALTH` table over real
threads; ``tests/stateful/test_store_health_differential.py`` holds the two together.

Lanes
    Every store call runs on one of four lanes (:data:`LANE_OF`): ``QUERY`` (prefetch queries),
    ``READ`` (prefetch fetches), ``WRITE`` (backups), ``PROBE`` (health probes). A lane runs its
    calls one at a time in submission order; lanes are independent, so a read never queues behind a
    backup, a probe never queues behind any other call, and a query never queues behind a fetch: a
    new request learns its L3 hit while earlier fetches still run, and the first fetch of a burst
    of prefetches starts when its own query returns, not after every query of the burst. Backups
    queued on the write lane may return as one store call (:meth:`StoreLinkModel.finish_merged`,
    issue 20), and so may fetches queued on the read lane: such a call is judged once.

Skipping
    A call a lane begins while the store is not serving (queued before the outage) is *skipped*: it
    returns at once without touching the store (a backup then waits deferred, a read finds
    nothing), so a dead store costs one call per lane, not one per queued call. A skipped call proves
    nothing: it is judged without a health event. Probes are never skipped.

Judging
    Every call is judged exactly once, by the first of: it returns (``FAULT`` if it showed a sign of
    an outage or ran longer than its deadline, else ``OK``), or its deadline passes while it runs
    (``FAULT``, found by :meth:`StoreLinkModel.poll`). A returned call is judged at the next poll, in
    the order calls returned. A call judged outside :data:`SERVING` is ``LATE`` (it proves nothing);
    a probe judged in :data:`PROBED` is ``PROBE_OK`` / ``PROBE_FAIL``.

What each state allows
    In :data:`SERVING` (``HEALTHY``, ``SUSPECT``) reads and backups are issued. Elsewhere a read is
    answered "nothing" at once (never issued), and a backup is deferred into a queue bounded in
    pages: when it would overflow, the oldest deferred backups are dropped and counted (their host
    pages are unpinned), so an outage never holds more than ``deferred_pages`` pages. Entering
    ``SUSPECT`` issues one probe at once; entering ``DOWN`` schedules the next probe after a back-off
    that doubles with every failed probe (capped). ``PROBE_OK`` brings the store back: the deferred
    backups are issued again in order, and the caller backs up again what L2 still holds
    (exists-then-put: a check of what the store kept) when the outage reached ``DOWN`` or when the
    probe found the *sentinel* gone: the page the last backup judged healthy confirmed (a restart
    that came back empty). The sentinel is an opaque identity the caller passes with a backup.

Invariants (checked by :meth:`StoreLinkModel.check`):

* a call is on exactly one lane and is judged at most once; at most one probe is queued or running;
* deferred backups exist only outside :data:`SERVING` and never exceed ``deferred_pages`` pages;
* a probe is due (``probe_at``) only in ``DOWN``.
"""

from __future__ import annotations

import enum

import attrs

from kvstrata.model.errors import MisuseError
from kvstrata.model.lifecycles import PROBED, SERVING, STORE_HEALTH, Health, HealthEvent

__all__ = [
    "Call",
    "CallKind",
    "HealthConfig",
    "LANE_OF",
    "Lane",
    "Recovery",
    "StoreLinkModel",
]


class Lane(enum.Enum):
    QUERY = "query"
    READ = "read"
    WRITE = "write"
    PROBE = "probe"


class CallKind(enum.Enum):
    QUERY = "query"  # a prefetch's exists
    FETCH = "fetch"  # a prefetch's read into reserved host pages
    BACKUP = "backup"  # an L2 -> L3 put
    PROBE = "probe"  # is the store back, and does it still hold what it held?


LANE_OF: dict[CallKind, Lane] = {
    CallKind.QUERY: Lane.QUERY,
    CallKind.FETCH: Lane.READ,
    CallKind.BACKUP: Lane.WRITE,
    CallKind.PROBE: Lane.PROBE,
}


@attrs.frozen
class HealthConfig:
    """Deadlines and bounds, in the caller's time unit (seconds in the implementation)."""

    call_deadline: float = 2.0
    probe_deadline: float = 0.5
    probe_backoff: float = 0.05
    probe_backoff_cap: float = 0.5
    deferred_pages: int = 1024

    def deadline(self, kind: CallKind) -> float:
        return self.probe_deadline if kind is CallKind.PROBE else self.call_deadline

    def backoff(self, failures: int) -> float:
        """Delay before the next probe after ``failures`` failed ones (>= 1)."""
        return min(self.probe_backoff * 2.0 ** max(failures - 1, 0), self.probe_backoff_cap)


@attrs.define
class Call:
    """One store call. ``started`` is set when its lane begins it; ``returned`` when it returned
    (``fault``: it showed a sign of an outage); ``judged`` once it counted for health."""

    call_id: int
    kind: CallKind
    op_id: int
    pages: int
    started: float | None = None
    returned: float | None = None
    fault: bool = False
    lost: bool = False  # a probe: the store no longer holds the sentinel page
    judged: bool = False
    skipped: bool = False  # begun while the store was not serving: returned without a store call
    sentinel: object = None  # a backup: the identity of its last page (becomes the sentinel)


@attrs.frozen
class Recovery:
    """``PROBE_OK`` happened: ``lost`` when the store came back without the sentinel page;
    ``was_down`` when the outage had reached ``DOWN``. Either way L2 is checked against the store
    again (:attr:`republish`)."""

    lost: bool
    was_down: bool = False

    @property
    def republish(self) -> bool:
        return self.lost or self.was_down


@attrs.define
class StoreLinkModel:
    """The link's state: health, lanes, deferred backups, probe schedule and counters."""

    config: HealthConfig = attrs.field(factory=HealthConfig)
    state: Health = STORE_HEALTH.initial
    lanes: dict[Lane, list[Call]] = attrs.field(factory=lambda: {lane: [] for lane in Lane})
    returned: list[Call] = attrs.field(factory=list)  # returned, not yet seen by a poll
    deferred: list[tuple[int, int]] = attrs.field(factory=list)  # (op id, pages), oldest first
    probe_failures: int = 0
    probe_at: float | None = None
    next_call: int = 0
    faults: int = 0
    skipped: int = 0
    answered_nothing: int = 0
    dropped_pages: int = 0
    recoveries: int = 0
    losses: int = 0
    sentinel: object = None  # the last page a backup judged OK while HEALTHY confirmed

    # ------------------------------------------------------------------ submissions
    @property
    def serving(self) -> bool:
        return self.state in SERVING

    def submit(
        self, kind: CallKind, op_id: int, pages: int, now: float, sentinel: object = None
    ) -> bool:
        """Issue a read or a backup (``sentinel``: its last page's identity): ``True`` if it is on
        its lane; ``False`` if it was answered "nothing" (a read) or deferred (a backup; the oldest
        deferred ones are dropped to fit)."""
        if kind is CallKind.PROBE:
            raise MisuseError("probes are issued by the link itself")
        if self.serving:
            self._enqueue(kind, op_id, pages).sentinel = sentinel
            return True
        if kind is not CallKind.BACKUP:
            self.answered_nothing += 1
            return False
        self.deferred.append((op_id, pages))
        held = self.deferred_pages()
        while self.deferred and held > self.config.deferred_pages:
            _, dropped = self.deferred.pop(0)
            held -= dropped
            self.dropped_pages += dropped
        return False

    def resume(self) -> list[tuple[int, int]]:
        """After a recovery: the deferred backups, oldest first, to be issued again."""
        if not self.serving:
            raise MisuseError("deferred backups resume only once the store serves again")
        resumed, self.deferred = self.deferred, []
        return resumed

    def _enqueue(self, kind: CallKind, op_id: int, pages: int) -> Call:
        self.next_call += 1
        call = Call(self.next_call, kind, op_id, pages)
        self.lanes[LANE_OF[kind]].append(call)
        return call

    # ------------------------------------------------------------------ the lanes
    def begin(self, lane: Lane, now: float) -> Call:
        """``lane`` begins its oldest call (which may then run for a long time)."""
        call = self._head(lane)
        if call.started is None:
            call.started = now
            call.skipped = call.kind is not CallKind.PROBE and not self.serving
        return call

    def finish(self, lane: Lane, now: float, *, fault: bool, lost: bool = False) -> Call:
        """``lane``'s oldest call returns (begun now if it was not yet); a probe says whether it
        found the sentinel gone (``lost``)."""
        call = self.begin(lane, now)
        self.lanes[lane].pop(0)
        call.returned, call.fault, call.lost = now, fault and not call.skipped, lost
        if call.skipped:
            call.returned = call.started  # it returned at once
        self.returned.append(call)
        return call

    def finish_merged(
        self, lane: Lane, began: float, now: float, count: int, *, fault: bool
    ) -> list[Call]:
        """``lane``'s ``count`` oldest calls, all backups or all fetches, return as one store
        call (issue 20: a write or read lane with a backlog), judged once: the first begins at
        ``began`` (unless it began earlier) and carries the shared call's start, deadline and
        ``fault``; the others are decided at ``began`` (skipped, as alone, when the store is not
        serving) but begin when the call returns at ``now``, so they are never overdue and never
        fault. If the first was skipped, the first member that is not carries the call. All
        return at ``now``, in queue order. One call is :meth:`finish`."""
        calls = self.lanes[lane][:count]
        if count < 1 or len(calls) < count:
            raise MisuseError(f"the {lane.value} lane has fewer than {count} calls")
        kinds = {call.kind for call in calls}
        if count > 1 and (len(kinds) > 1 or not kinds <= {CallKind.BACKUP, CallKind.FETCH}):
            raise MisuseError("only backups, or only fetches, share a store call")
        self.begin(lane, began)  # the first: begun at ``began`` unless it began earlier
        for call in calls[1:]:
            call.skipped = not self.serving
        carrier = True  # the first member that is not skipped carries the call
        for call in calls:
            self.lanes[lane].pop(0)
            if call.started is None:
                call.started = began if carrier and not call.skipped else now
            call.returned = call.started if call.skipped else now
            call.fault = fault and carrier and not call.skipped
            carrier = carrier and call.skipped
            self.returned.append(call)
        return calls

    def _head(self, lane: Lane) -> Call:
        if not self.lanes[lane]:
            raise MisuseError(f"the {lane.value} lane has no call")
        return self.lanes[lane][0]

    # ------------------------------------------------------------------ judging
    def poll(self, now: float) -> Recovery | None:
        """Judge the calls that returned (in return order), then the running calls past their
        deadline, then issue a due probe. The last recovery among them, if any."""
        recovery: Recovery | None = None
        returned, self.returned = self.returned, []
        for call in returned:
            if not call.judged:
                assert call.started is not None and call.returned is not None
                late = call.returned - call.started > self.config.deadline(call.kind)
                recovery = self._judge(call, call.fault or late, now) or recovery
        for lane in Lane:
            for call in self.lanes[lane]:
                if (
                    call.started is not None
                    and not call.judged
                    and now - call.started > self.config.deadline(call.kind)
                ):
                    recovery = self._judge(call, True, now) or recovery
        if self.state is Health.SUSPECT and not self.lanes[Lane.PROBE]:
            self._enqueue(CallKind.PROBE, 0, 0)  # a suspect store always has a probe coming
        if (
            self.state is Health.DOWN
            and not self.lanes[Lane.PROBE]
            and self.probe_at is not None
            and now >= self.probe_at
        ):
            self._advance(HealthEvent.PROBE_DUE, now)
        return recovery

    def _judge(self, call: Call, fault: bool, now: float) -> Recovery | None:
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
            lost, was_down = call.lost, self.state is Health.PROBING
            self._advance(HealthEvent.PROBE_OK, now)
            self.recoveries += 1
            self.losses += lost
            if lost:
                self.sentinel = None
            return Recovery(lost, was_down)
        if not self.serving:
            self._advance(HealthEvent.LATE, now)
            return None
        was_healthy = self.state is Health.HEALTHY
        self._advance(HealthEvent.FAULT if fault else HealthEvent.OK, now)
        if not fault and was_healthy and call.sentinel is not None:
            self.sentinel = call.sentinel
        return None

    def _advance(self, event: HealthEvent, now: float) -> None:
        before = self.state
        self.state = STORE_HEALTH.next(before, event)
        if self.state is before:
            return
        if self.state is Health.SUSPECT and not self.lanes[Lane.PROBE]:
            self._enqueue(CallKind.PROBE, 0, 0)
        elif self.state is Health.DOWN:
            self.probe_failures = max(self.probe_failures, 1)
            self.probe_at = now + self.config.backoff(self.probe_failures)
        elif self.state is Health.PROBING:
            self.probe_at = None
            self._enqueue(CallKind.PROBE, 0, 0)
        elif self.state is Health.HEALTHY:
            self.probe_failures = 0
            self.probe_at = None

    # ------------------------------------------------------------------ checks
    def deferred_pages(self) -> int:
        return sum(pages for _, pages in self.deferred)

    def check(self) -> None:
        """The invariants of the module docstring (``AssertionError`` naming the broken one)."""
        ids = [call.call_id for lane in Lane for call in self.lanes[lane]]
        assert len(ids) == len(set(ids)), "a call is on two lanes"
        for lane in Lane:
            assert all(LANE_OF[c.kind] is lane for c in self.lanes[lane]), "a call on a wrong lane"
        assert len(self.lanes[Lane.PROBE]) <= 1, "more than one probe queued"
        assert not self.deferred or not self.serving, "backups deferred while serving"
        assert self.deferred_pages() <= self.config.deferred_pages, "deferred queue over its bound"
        assert self.probe_at is None or self.state is Health.DOWN, "a probe due outside DOWN"
