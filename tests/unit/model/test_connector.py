"""The connector model's staging slots and failed loads (the review's finds of 2026-11-28)."""

from __future__ import annotations

import hashlib

import pytest

from kvstrata.model.connector import ConnectorModel, PageSource
from kvstrata.model.errors import MisuseError
from kvstrata.model.keys import PageHash

PAGES = [PageHash(hashlib.sha256(f"p{i}".encode()).digest()) for i in range(8)]


def _stored(model: ConnectorModel, pages: int) -> None:
    """A request over the first ``pages`` pages computed and saved, then finished."""
    model.new_request("warm", PAGES[:pages])
    model.answer("warm")
    model.alloc("warm", 0, 0, pages)
    model.plan([("warm", pages)])
    model.finish("warm")


def _loading_from_l3(stored: int = 3, pages: int = 6, lag: int = 1) -> ConnectorModel:
    """8 L2 slots, 4 staging slots; pages ``0 .. stored - 1`` in L3 only, and request "a" (its
    first ``pages`` pages) with its load of them planned."""
    model = ConnectorModel(capacity=8, staging=4, lag=lag)
    _stored(model, stored)
    model.l2.clear()
    model.new_request("a", PAGES[:pages])
    model.answer("a")
    model.alloc("a", 0, stored, pages)
    return model


def test_match_serves_no_more_l3_pages_than_free_staging_slots() -> None:
    model = ConnectorModel(capacity=1, staging=3)
    _stored(model, 6)  # L2 keeps the last page; pages 0-4 are in L3 only
    model.new_request("a", PAGES[:6])
    model.answer("a")
    assert model.match("a", 0, 6) == 3  # three staging slots: the hit stops at the fourth L3 page
    model.alloc("a", 0, 3, 6)
    model.new_request("b", PAGES[:6])
    model.answer("b")
    assert model.match("b", 0, 6) == 0  # a's load holds every slot until two plans after it
    model.plan([])
    model.plan([])
    assert model.match("b", 0, 6) == 0
    model.plan([])
    assert model.match("b", 0, 6) == 3
    model.check()


def test_finish_before_the_plan_frees_the_reserved_slots() -> None:
    model = ConnectorModel(capacity=1, staging=2)
    _stored(model, 4)
    model.new_request("a", PAGES[:4])
    model.answer("a")
    model.alloc("a", 0, 2, 4)
    assert model.staging_free == 0
    model.finish("a")
    assert model.staging_free == 2
    model.check()


def test_a_failed_load_takes_back_the_saves_of_its_step() -> None:
    model = _loading_from_l3()
    plan = model.plan([("a", 6)])
    assert plan.loads["a"] == ((0, PageSource.L3), (1, PageSource.L3), (2, PageSource.L3))
    assert plan.saves["a"] == (3, 4, 5)
    model.load_failed("a", 1)  # pages 3-5 were computed over page 1's bad KV
    assert not set(PAGES[3:6]) & (set(model.l2) | model.l3)
    assert set(PAGES[:3]) <= model.l3  # what was stored before stays
    assert model.plan([("a", 6)]).saves["a"] == (1, 2, 3, 4, 5)  # recomputed, saved now
    model.check()


def test_a_failed_load_is_reported_for_a_running_request_and_one_of_its_pages() -> None:
    model = _loading_from_l3(stored=2, pages=4)
    with pytest.raises(MisuseError):
        model.load_failed("a", 0)  # not planned yet
    model.plan([("a", 4)])
    with pytest.raises(MisuseError):
        model.load_failed("a", 4)  # no such page
    model.load_failed("a", 3)  # a page it computed over a block shared with a failed load
    assert PAGES[3] not in model.l2 and PAGES[2] in model.l2


def test_a_failed_backup_is_put_again_by_the_next_step_while_l2_holds_it() -> None:
    model = ConnectorModel(capacity=3, staging=2)
    model.new_request("a", PAGES[:4])
    model.answer("a")
    model.alloc("a", 0, 0, 4)
    model.plan([("a", 4)])  # page 0 is evicted from L2 by page 3 within the step
    model.backup_failed(PAGES[:4])  # the store was down
    assert not model.l3 & set(PAGES[:4])
    assert model.unbacked == PAGES[1:4]  # page 0 left L2: nothing can put it again
    plan = model.plan([])
    assert plan.retried == tuple(PAGES[1:4])
    assert set(PAGES[1:4]) <= model.l3 and not model.unbacked
    model.check()


def test_a_report_one_plan_behind_takes_back_both_plans_saves_over_the_failure() -> None:
    """Async scheduling: plan 2 is made before plan 1's failed load is reported; the report
    takes back the saves of both plans from the failed page on, and no earlier save."""
    model = _loading_from_l3()
    first = model.plan([("a", 4)])
    assert (first.number, first.reported_through, first.saves["a"]) == (2, 0, (3,))
    second = model.plan([("a", 6)])
    assert (second.number, second.reported_through, second.saves["a"]) == (3, 0, (4, 5))
    model.load_failures({"a": 1}, first.number)
    assert not set(PAGES[3:6]) & (set(model.l2) | model.l3)
    assert set(PAGES[:3]) <= model.l3
    third = model.plan([("a", 6)])
    assert (third.reported_through, third.saves["a"]) == (2, (1, 2, 3, 4, 5))
    with pytest.raises(MisuseError):
        model.load_failures({}, first.number)  # two plans back: an engine plans one step ahead
    model.check()


def test_a_report_of_the_last_plan_keeps_the_saves_of_the_plan_before() -> None:
    model = ConnectorModel(capacity=8, staging=4)
    model.new_request("a", PAGES[:6])
    model.answer("a")
    model.alloc("a", 0, 0, 6)
    model.plan([("a", 3)])  # pages 0-2 computed and saved
    last = model.plan([("a", 6)])
    model.load_failures({"a": 1}, last.number)  # a block it shares failed in the last step
    assert set(PAGES[:3]) <= set(model.l2) and set(PAGES[:3]) <= model.l3
    assert not set(PAGES[3:6]) & model.l3
    assert model.plan([("a", 6)]).saves["a"] == (3, 4, 5)


def test_a_request_the_engine_does_not_compute_again_never_saves_the_pages_over_the_failure() -> (
    None
):
    """A request that shares a failed block (vLLM's async scheduling keeps it computed): its saved
    mark goes back only to where the engine computes it again, so the pages between, computed
    over bad KV, are never saved by it."""
    model = ConnectorModel(capacity=8, staging=4)
    model.new_request("c", PAGES[:6])
    model.answer("c")
    model.alloc("c", 0, 0, 6)
    first = model.plan([("c", 6)])
    model.load_failures({"c": 1}, first.number, recompute={"c": 6})
    assert not set(PAGES[1:6]) & (set(model.l2) | model.l3)
    assert "c" not in model.plan([("c", 6)]).saves


def test_taking_back_a_save_leaves_a_later_save_of_the_same_page() -> None:
    """Page p saved by a (plan 1, over a failure reported later), evicted in plan 2 and saved
    again there by d (its own, good): the report of plan 1 takes back a's save only."""
    model = ConnectorModel(capacity=2, staging=0)
    pages = {"a": [PAGES[0], PAGES[1]], "e": [PAGES[2], PAGES[3]], "d": [PAGES[1]]}
    for request_id, chain in pages.items():
        model.new_request(request_id, chain)
        model.answer(request_id)
        model.alloc(request_id, 0, 0, 9)
    first = model.plan([("a", 2)])
    model.plan([("e", 2), ("d", 1)])
    model.load_failures({"a": 1}, first.number)
    assert model.l2 == [PAGES[3], PAGES[1]] and PAGES[1] in model.l3


def test_a_failed_read_of_an_l2_page_takes_it_out_of_l2() -> None:
    """An L2 page whose slot the worker never wrote (its save was dropped over a failure and its
    request finished before the report) fails the next load that reads it: the report takes
    the page out of L2, so the request saves it again instead of hitting it forever."""
    model = ConnectorModel(capacity=8, staging=2)
    model.new_request("a", PAGES[:4])
    model.answer("a")
    model.alloc("a", 0, 0, 4)
    model.plan([("a", 4)])  # the worker dropped these saves; a finishes before the report
    model.finish("a")
    model.new_request("b", PAGES[:4])
    model.answer("b")
    assert model.match("b", 0, 4) == 4
    model.alloc("b", 0, 2, 4)
    plan = model.plan([("b", 4)])
    assert plan.loads["b"] == ((0, PageSource.L2), (1, PageSource.L2))
    model.load_failures({"b": 0}, plan.number)  # slot 0 did not hold page 0
    assert PAGES[0] not in model.l2 and PAGES[1] in model.l2
    assert model.plan([("b", 4)]).saves["b"] == (0,)


def test_a_report_lag_plans_behind_takes_back_every_plan_since() -> None:
    """A pipeline's batch queue (``lag`` 2): plans 2 and 3 are made before plan 1's failed load
    is reported; the report takes back all three plans' saves over the failure, and staging
    slots stay held for three plans. A report three plans behind is misuse."""
    model = _loading_from_l3(pages=7, lag=2)
    assert model.staging_free == 1
    first = model.plan([("a", 4)])
    second = model.plan([("a", 5)])
    assert model.staging_free == 1  # the load's three slots are held by the plan that took them
    third = model.plan([("a", 7)])
    assert model.staging_free == 1  # still held: the first plan's slots come back with the fourth
    assert [p.saves["a"] for p in (first, second, third)] == [(3,), (4,), (5, 6)]
    model.load_failures({"a": 1}, first.number)
    assert not set(PAGES[3:7]) & (set(model.l2) | model.l3)
    fourth = model.plan([("a", 7)])
    assert model.staging_free == 4
    assert (fourth.reported_through, fourth.saves["a"]) == (first.number, (1, 2, 3, 4, 5, 6))
    model.plan([])
    model.plan([])
    with pytest.raises(MisuseError):
        model.load_failures({}, fourth.number - 1)  # three plans back
    model.check()
    for lag in (0, -1, True, 1.5):
        with pytest.raises(MisuseError):
            ConnectorModel(capacity=8, lag=lag)  # type: ignore[arg-type]
