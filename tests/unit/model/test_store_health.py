"""The store-health model (``kvstrata.model.l3.health``): judging, probes, back-off, the deferred
queue's bound, and the wait deadline every prefetch policy obeys (issue 17)."""

from __future__ import annotations

import pytest

from kvstrata.model.errors import IllegalTransition, MisuseError
from kvstrata.model.l3.health import CallKind, HealthConfig, Lane, Recovery, StoreLinkModel
from kvstrata.model.l3.policy import PrefetchPolicy, wait_over
from kvstrata.model.lifecycles import PROBED, SERVING, STORE_HEALTH, Health, HealthEvent

CONFIG = HealthConfig(
    call_deadline=2.0,
    probe_deadline=0.5,
    probe_backoff=0.1,
    probe_backoff_cap=0.4,
    deferred_pages=8,
)


def test_guard_sets_come_from_the_table() -> None:
    assert {Health.HEALTHY, Health.SUSPECT} == SERVING
    assert {Health.SUSPECT, Health.PROBING} == PROBED
    with pytest.raises(IllegalTransition):
        STORE_HEALTH.next(Health.DOWN, HealthEvent.OK)  # a down store only listens to probes


def test_a_fault_makes_the_store_suspect_and_a_probe_decides() -> None:
    link = StoreLinkModel(CONFIG)
    assert link.submit(CallKind.BACKUP, 1, 4, now=0.0)
    link.finish(Lane.WRITE, 0.1, fault=True)
    assert link.poll(0.1) is None
    assert link.state is Health.SUSPECT and len(link.lanes[Lane.PROBE]) == 1
    assert link.submit(CallKind.QUERY, 2, 4, now=0.1)  # a suspect store still serves
    link.finish(Lane.PROBE, 0.2, fault=False)
    recovery = link.poll(0.2)
    assert recovery == Recovery(lost=False) and not recovery.republish
    assert link.state is Health.HEALTHY and link.recoveries == 1


def test_down_answers_reads_at_once_defers_backups_and_backs_off() -> None:
    link = StoreLinkModel(CONFIG)
    link.submit(CallKind.BACKUP, 1, 2, now=0.0)
    link.finish(Lane.WRITE, 0.0, fault=True)
    link.poll(0.0)
    link.finish(Lane.PROBE, 0.0, fault=True)
    link.poll(0.0)
    assert link.state is Health.DOWN and link.probe_at == pytest.approx(0.1)
    assert not link.submit(CallKind.QUERY, 2, 4, now=0.0)
    assert link.answered_nothing == 1 and not link.lanes[Lane.QUERY]
    assert not link.submit(CallKind.BACKUP, 3, 5, now=0.0)
    assert not link.submit(CallKind.BACKUP, 4, 5, now=0.0)  # 10 pages > 8: the oldest is dropped
    assert link.deferred == [(4, 5)] and link.dropped_pages == 5
    link.poll(0.05)
    assert link.state is Health.DOWN  # not due yet
    link.poll(0.1)
    assert link.state is Health.PROBING and len(link.lanes[Lane.PROBE]) == 1
    link.finish(Lane.PROBE, 0.1, fault=True)
    link.poll(0.1)
    assert link.state is Health.DOWN and link.probe_at == pytest.approx(0.1 + 0.2)  # doubled
    link.poll(0.31)
    link.finish(Lane.PROBE, 0.31, fault=False)
    assert link.poll(0.31) == Recovery(lost=False, was_down=True)
    assert link.resume() == [(4, 5)] and link.deferred == []
    link.check()


def test_a_hung_call_is_judged_once_at_its_deadline() -> None:
    link = StoreLinkModel(CONFIG)
    link.submit(CallKind.FETCH, 1, 4, now=0.0)
    link.begin(Lane.READ, 0.0)
    link.poll(1.9)
    assert link.state is Health.HEALTHY
    link.poll(2.1)  # overran: a fault, and a probe goes out on its own lane
    assert link.state is Health.SUSPECT and link.faults == 1
    link.finish(Lane.READ, 5.0, fault=False)  # it returns much later: judged already
    link.poll(5.0)
    assert link.faults == 1 and link.state is Health.SUSPECT


def test_a_slow_return_is_a_fault_even_when_it_succeeded() -> None:
    link = StoreLinkModel(CONFIG)
    link.submit(CallKind.QUERY, 1, 1, now=0.0)
    link.begin(Lane.QUERY, 0.0)
    link.finish(Lane.QUERY, 3.0, fault=False)
    link.poll(3.0)
    assert link.state is Health.SUSPECT


def test_a_probe_finds_the_store_came_back_empty() -> None:
    link = StoreLinkModel(CONFIG)
    link.submit(CallKind.BACKUP, 1, 2, now=0.0, sentinel="page-2")
    link.finish(Lane.WRITE, 0.0, fault=False)
    link.poll(0.0)
    assert link.sentinel == "page-2"
    link.submit(CallKind.BACKUP, 2, 2, now=0.0, sentinel="page-4")
    link.finish(Lane.WRITE, 0.0, fault=True)
    link.poll(0.0)
    assert link.sentinel == "page-2"  # a failed backup confirms nothing
    link.finish(Lane.PROBE, 0.0, fault=False, lost=True)
    recovery = link.poll(0.0)
    assert recovery == Recovery(lost=True, was_down=False) and recovery.republish
    assert link.losses == 1 and link.sentinel is None


def test_back_from_down_always_checks_l2_again() -> None:
    link = StoreLinkModel(CONFIG)
    link.submit(CallKind.BACKUP, 1, 2, now=0.0)
    link.finish(Lane.WRITE, 0.0, fault=True)
    link.poll(0.0)
    link.finish(Lane.PROBE, 0.0, fault=True)
    link.poll(0.0)
    link.poll(1.0)
    link.finish(Lane.PROBE, 1.0, fault=False)
    recovery = link.poll(1.0)
    assert recovery == Recovery(lost=False, was_down=True) and recovery.republish


def test_misuse_is_refused() -> None:
    link = StoreLinkModel(CONFIG)
    with pytest.raises(MisuseError):
        link.submit(CallKind.PROBE, 1, 0, now=0.0)
    with pytest.raises(MisuseError):
        link.finish(Lane.READ, 0.0, fault=False)
    link.submit(CallKind.BACKUP, 1, 1, now=0.0)
    link.finish(Lane.WRITE, 0.0, fault=True)
    link.poll(0.0)
    link.finish(Lane.PROBE, 0.0, fault=True)
    link.poll(0.0)
    with pytest.raises(MisuseError):
        link.resume()


@pytest.mark.parametrize("policy", list(PrefetchPolicy))
def test_every_policy_stops_waiting_at_the_deadline(policy: PrefetchPolicy) -> None:
    assert wait_over(policy, loading=True, waited=1.0, limit=5.0, deadline=1.0)
    assert not wait_over(policy, loading=True, waited=0.5, limit=5.0, deadline=1.0) or (
        policy is PrefetchPolicy.BEST_EFFORT
    )
    assert wait_over(policy, loading=False, waited=0.0, limit=5.0, deadline=1.0)
    unbounded = wait_over(policy, loading=True, waited=100.0, limit=5.0)
    assert unbounded is (policy is not PrefetchPolicy.WAIT_COMPLETE)


def test_a_query_does_not_queue_behind_a_fetch() -> None:
    """Queries have their own lane: a new request's query runs while an earlier fetch still does."""
    link = StoreLinkModel(CONFIG)
    assert link.submit(CallKind.FETCH, 1, 64, now=0.0)
    link.begin(Lane.READ, 0.0)
    assert link.submit(CallKind.QUERY, 2, 64, now=0.1)
    assert [call.op_id for call in link.lanes[Lane.QUERY]] == [2]
    link.begin(Lane.QUERY, 0.1)
    link.finish(Lane.QUERY, 0.2, fault=False)
    link.poll(0.2)
    assert [call.op_id for call in link.lanes[Lane.READ]] == [1]
    assert link.state is Health.HEALTHY
    link.check()


def test_backups_returning_as_one_store_call_are_judged_one_by_one() -> None:
    link = StoreLinkModel(CONFIG)
    for op_id in (1, 2, 3):
        assert link.submit(CallKind.BACKUP, op_id, 2, now=0.0)
    link.begin(Lane.WRITE, 0.0)  # the first began on its own, earlier
    calls = link.finish_merged(Lane.WRITE, 1.0, 2.5, 2, fault=False)
    assert [call.op_id for call in calls] == [1, 2] and len(link.lanes[Lane.WRITE]) == 1
    # the first carries the call (begun at 0.0); the second begins as the call returns
    assert [(call.started, call.returned) for call in calls] == [(0.0, 2.5), (2.5, 2.5)]
    link.poll(2.5)
    # the call ran 2.5 s, past the 2 s deadline: one fault, on the first
    assert link.faults == 1 and link.state is Health.SUSPECT  # the probe decides
    (last,) = link.finish_merged(Lane.WRITE, 2.5, 2.5, 1, fault=True)
    assert last.op_id == 3 and last.fault


def test_a_shared_call_is_judged_once() -> None:
    link = StoreLinkModel(CONFIG)
    for op_id in (1, 2, 3):
        link.submit(CallKind.BACKUP, op_id, 1, now=0.0)
    calls = link.finish_merged(Lane.WRITE, 0.0, 0.1, 3, fault=True)
    assert [call.fault for call in calls] == [True, False, False]
    link.poll(0.1)
    assert link.faults == 1 and link.state is Health.SUSPECT  # one failed call: a probe decides
    link.submit(CallKind.BACKUP, 4, 1, now=0.1)
    link.submit(CallKind.BACKUP, 5, 1, now=0.1)
    link.begin(Lane.WRITE, 0.1)
    link.poll(2.2)  # the shared call is overdue: only the member that began is judged
    assert link.faults == 2 and link.lanes[Lane.WRITE][1].started is None


def test_queued_fetches_share_a_call_judged_once() -> None:
    """Issue 20: a read lane with a backlog returns its fetches as one get, judged as one call."""
    link = StoreLinkModel(CONFIG)
    for op_id in (1, 2, 3):
        assert link.submit(CallKind.FETCH, op_id, 2, now=0.0)
    calls = link.finish_merged(Lane.READ, 0.0, 0.1, 3, fault=True)
    assert [call.op_id for call in calls] == [1, 2, 3] and not link.lanes[Lane.READ]
    assert [call.fault for call in calls] == [True, False, False]
    link.poll(0.1)
    assert link.faults == 1 and link.state is Health.SUSPECT  # one failed get: a probe decides
    link.check()


def test_only_queued_backups_or_fetches_share_a_call() -> None:
    link = StoreLinkModel(CONFIG)
    link.submit(CallKind.QUERY, 1, 1, now=0.0)
    link.submit(CallKind.BACKUP, 2, 1, now=0.0)
    with pytest.raises(MisuseError):
        link.finish_merged(Lane.WRITE, 0.0, 0.0, 2, fault=False)  # one call on the lane
    link.submit(CallKind.QUERY, 3, 1, now=0.0)
    with pytest.raises(MisuseError):
        link.finish_merged(Lane.QUERY, 0.0, 0.0, 2, fault=False)  # queries never share
    with pytest.raises(MisuseError):
        link.finish_merged(Lane.WRITE, 0.0, 0.0, 0, fault=False)
    assert len(link.lanes[Lane.WRITE]) == 1 and len(link.lanes[Lane.QUERY]) == 2
