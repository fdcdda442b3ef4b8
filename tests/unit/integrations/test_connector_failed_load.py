"""The connector's worker after a failed load: no page computed over it is saved, on any rank."""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future

import pytest
import torch

from kvstrata.impl.errors import MisuseError
from kvstrata.impl.pools.host import HostKVPool
from kvstrata.impl.pools.shape import KVShape
from kvstrata.impl.storage.base import GetStatus
from kvstrata.impl.storage.memory import MemoryBackend, MemoryStore
from kvstrata.integrations.connector import ConnectorIndex, Plan, Scheduled
from kvstrata.integrations.connector_worker import ConnectorWorker
from kvstrata.model.connector import ConnectorModel
from kvstrata.model.keys import KeySpace, KVKind, ModelIdentity, Namespace, PageHash, Shard

PAGE = 2
SHAPE = KVShape(KVKind.MHA, layers=1, heads=1, head_dim=2, dtype=torch.float32, page_size=PAGE)
NAMESPACE = Namespace(extra_key="test")
PAGES = [PageHash(hashlib.sha256(f"p{i}".encode()).digest()) for i in range(5)]


class Blocks:
    def __init__(self, value: float) -> None:
        self.kv = torch.full((2, 1, 16, PAGE, 1, 2), value)

    def read(self, blocks: Sequence[int]) -> torch.Tensor:
        return self.kv[:, :, list(blocks)].contiguous()

    def write(self, blocks: Sequence[int], kv: torch.Tensor) -> None:
        self.kv[:, :, list(blocks)] = kv


def _worker(rank: int, store: MemoryStore) -> ConnectorWorker:
    keys = KeySpace(ModelIdentity("t", "float32", KVKind.MHA, PAGE), shard=Shard(rank, 2))
    host = HostKVPool(SHAPE, 8, "page_first_direct")
    return ConnectorWorker(host, MemoryBackend(keys, store=store), NAMESPACE, Blocks(rank + 1.0))


def _index() -> ConnectorIndex:
    """4 L2 slots, 4 staging slots; every lookup answers that L3 holds the first 3 pages."""
    done: Future[int] = Future()
    done.set_result(3)
    return ConnectorIndex(capacity=4, staging=4, start_lookup=lambda pages: done)


def _worker_page_lost(lost: int) -> ConnectorWorker:
    """Rank 0's worker on a fresh store holding pages 0-2, less page ``lost``."""
    worker = _worker(0, MemoryStore())
    worker.host.write_pages([0, 1, 2], torch.full((2, 1, 3, PAGE, 1, 2), 10.0))
    worker.backend.put(NAMESPACE, PAGES[:3], [0, 1, 2])  # type: ignore[union-attr]
    worker.backend.evict(NAMESPACE, PAGES[lost])  # type: ignore[union-attr]
    return worker


def _plan(store: MemoryStore) -> Plan:
    """A request whose pages 0-2 come from L3 and whose pages 3-4 are computed in the step."""
    index = _index()
    index.new_request("a", PAGES)
    assert index.match("a", 0, 5) == 3
    index.alloc("a", 0, [0, 1, 2], 5)
    return index.plan([Scheduled("a", 5, (0, 1, 2, 3, 4))])


def _agreement(ranks: int) -> Callable[[list[int]], list[int]]:
    """The ranks' least value, each, as an all-reduce of the workers' threads would give."""
    barrier = threading.Barrier(ranks)
    shared: list[list[int]] = []

    def agree(values: list[int]) -> list[int]:
        shared.append(values)
        barrier.wait()
        least = [min(column) for column in zip(*shared, strict=True)]
        barrier.wait()
        return least

    return agree


def test_a_rank_whose_load_went_well_saves_nothing_computed_over_another_ranks_failure() -> None:
    store = MemoryStore()
    workers = [_worker(rank, store) for rank in range(2)]
    for rank, worker in enumerate(workers):  # pages 0-2 in the store, each rank's shard
        worker.host.write_pages([0, 1, 2], torch.full((2, 1, 3, PAGE, 1, 2), 10.0 + rank))
        worker.backend.put(NAMESPACE, PAGES[:3], [0, 1, 2])  # type: ignore[union-attr]
    workers[0].backend.evict(NAMESPACE, PAGES[1])  # type: ignore[union-attr]  # rank 0 only
    plan = _plan(store)
    agree = _agreement(2)
    failed: list[set[int]] = [set(), set()]

    def step(rank: int) -> None:
        failed[rank] = workers[rank].load(plan, agree)
        workers[rank].save(plan)

    threads = [threading.Thread(target=step, args=(rank,)) for rank in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    assert failed == [{1, 2}, {1, 2}]  # rank 1's load of pages 1-2 worked, yet it fails them too
    for worker in workers:
        assert worker.backend.exists(NAMESPACE, PAGES[3:]) == 0  # type: ignore[union-attr]
        assert not set(worker.written.values()) & set(PAGES[3:])


def test_one_rank_saves_nothing_of_the_step_after_its_own_failed_load() -> None:
    worker = _worker_page_lost(2)
    plan = _plan(MemoryStore())
    assert worker.load(plan) == {2}
    worker.save(plan)
    assert worker.backend.get(NAMESPACE, [PAGES[3]], [7]) == [GetStatus.MISSING]  # type: ignore[union-attr]


def test_a_request_over_blocks_another_request_failed_to_load_saves_nothing() -> None:
    """An engine's prefix cache lets request c use the blocks request a loads in the same step
    (a's load of page 1 fails): c's pages computed over them are not saved, and the index takes
    them back when the engine reports the blocks."""
    worker = _worker_page_lost(1)
    index = _index()
    index.new_request("a", PAGES[:3])
    assert index.match("a", 0, 3) == 3
    index.alloc("a", 0, [0, 1, 2], 3)
    index.new_request("c", PAGES)  # its first three pages: a's blocks, from the engine's cache
    assert index.match("c", 3, 5) == 0
    index.alloc("c", 3, [], 5)
    plan = index.plan([Scheduled("c", 5, (0, 1, 2, 8, 9))])
    assert [m.index for _r, moves in plan.saves for m in moves] == [3, 4]
    assert worker.load(plan) == {1, 2}
    worker.save(plan)
    assert worker.backend.exists(NAMESPACE, PAGES[3:]) == 0  # type: ignore[union-attr]
    assert not set(worker.written.values()) & set(PAGES[3:])
    index.load_failed("c", 1)  # the engine reported blocks 1 and 2: c shares them
    assert not set(index.l2) & set(PAGES[3:])
    again = index.plan([Scheduled("c", 5, (0, 1, 2, 8, 9))])  # recomputed: saved now
    assert [m.index for _r, moves in again.saves for m in moves] == [1, 2, 3, 4]


def test_a_plan_made_before_the_report_saves_nothing_over_the_failed_load() -> None:
    """Async scheduling: request a loads pages 0-2 (page 1 fails) and computes page 3; the engine
    builds the next plan, where a computes page 4 and request c (sharing a's blocks) computes
    its own pages, before it reports the failure. Neither saves anything over the bad KV; the
    report takes back both plans' saves, and the plan after it saves the recomputed pages."""
    worker = _worker_page_lost(1)
    index = _index()
    index.new_request("a", PAGES)
    assert index.match("a", 0, 5) == 3
    index.alloc("a", 0, [0, 1, 2], 5)
    first = index.plan([Scheduled("a", 4, (0, 1, 2, 3, 4))])
    assert (first.number, first.reported_through) == (1, 0)
    assert worker.load(first) == {1, 2}
    worker.save(first)
    index.new_request("c", PAGES)  # its first three pages: a's blocks, from the engine's cache
    assert index.match("c", 3, 5) == 1  # page 3, named by the index until the report: not taken
    index.alloc("c", 3, [], 5)
    second = index.plan([Scheduled("a", 5, (0, 1, 2, 3, 4)), Scheduled("c", 5, (0, 1, 2, 8, 9))])
    assert [m.index for _r, moves in second.saves for m in moves] == [4]  # c: a's pages in L2
    assert second.reported_through == 0  # made before the report
    assert worker.load(second) == set()
    worker.save(second)
    assert worker.backend.exists(NAMESPACE, PAGES[3:]) == 0  # type: ignore[union-attr]
    assert not set(worker.written.values()) & set(PAGES[3:])
    assert index.failed_plan({1, 2}) == 1  # the blocks name the first plan's load
    index.load_failures({"a": 1, "c": 1}, 1)
    assert not set(index.l2) & set(PAGES[1:])
    third = index.plan([Scheduled("a", 5, (0, 1, 2, 3, 4)), Scheduled("c", 5, (0, 1, 2, 8, 9))])
    assert third.reported_through == 1
    assert [m.index for _r, moves in third.saves for m in moves] == [1, 2, 3, 4]  # a's, recomputed
    worker.load(third)
    worker.blocks.write([1, 2, 3, 4], torch.full((2, 1, 4, PAGE, 1, 2), 1.0))  # the recompute
    worker.save(third)
    assert worker.backend.exists(NAMESPACE, PAGES[:5]) == 5  # type: ignore[union-attr]
    assert not worker.poisoned


def test_a_report_names_the_last_plan_or_the_one_before() -> None:
    done: Future[int] = Future()
    done.set_result(0)
    index = ConnectorIndex(capacity=4, staging=2, start_lookup=lambda pages: done)
    with pytest.raises(MisuseError):
        index.load_failures({}, 1)  # no plan yet
    for _ in range(3):
        index.plan([])
    with pytest.raises(MisuseError):
        index.load_failures({}, 1)
    index.load_failures({}, 2)
    assert index.plan([]).reported_through == 2


class _Both:
    """A ConnectorModel and a ConnectorIndex driven alike (no loads from L3), compared."""

    def __init__(self, capacity: int) -> None:
        done: Future[int] = Future()
        done.set_result(0)
        self.model = ConnectorModel(capacity, 2)
        self.index = ConnectorIndex(capacity, 2, start_lookup=lambda pages: done)
        self.blocks: dict[str, tuple[int, ...]] = {}

    def new(self, request_id: str, pages: list[PageHash], loads: int = 0) -> None:
        self.blocks[request_id] = tuple(range(10 * len(self.blocks), 10 * len(self.blocks) + 9))
        self.model.new_request(request_id, pages)
        self.model.answer(request_id)
        self.index.new_request(request_id, pages)
        assert self.index.match(request_id, 0, 9) == self.model.match(request_id, 0, 9)
        self.model.alloc(request_id, 0, loads, 9)
        self.index.alloc(request_id, 0, self.blocks[request_id][:loads], 9)

    def plan(self, scheduled: list[tuple[str, int]]) -> dict[str, tuple[int, ...]]:
        expected = self.model.plan(scheduled)
        plan = self.index.plan([Scheduled(r, d, self.blocks[r]) for r, d in scheduled])
        saves = {r: tuple(m.index for m in moves) for r, moves in plan.saves}
        assert saves == expected.saves and plan.number == expected.number
        return saves

    def report(
        self, failed: dict[str, int], plan: int, recompute: dict[str, int] | None = None
    ) -> None:
        self.model.load_failures(failed, plan, recompute)
        self.index.load_failures(failed, plan, recompute)
        assert list(self.index.l2) == self.model.l2

    def finish(self, request_id: str) -> None:
        self.model.finish(request_id)
        self.index.finish(request_id)


def test_the_index_takes_back_exactly_what_the_model_does() -> None:
    """The review's three cases, on both sides: a request the engine does not compute again keeps
    its mark; taking back a save leaves a later save of the same page; a failed read of an L2
    page (a save dropped before its request finished) takes the page out of L2."""
    both = _Both(capacity=2)
    both.new("a", PAGES[:2])
    both.new("e", PAGES[2:4])
    both.new("d", PAGES[1:2])
    both.plan([("a", 2)])
    both.plan([("e", 2), ("d", 1)])  # evicts a's pages; d saves page 1 again
    both.report({"a": 1}, 1)
    assert PAGES[1] in both.index.l2
    both = _Both(capacity=8)
    both.new("c", PAGES[:5])
    first = both.plan([("c", 5)])
    both.report({"c": 1}, 1, recompute={"c": 5})
    assert first["c"] == (0, 1, 2, 3, 4) and "c" not in both.plan([("c", 5)])
    both.finish("c")
    both.new("a", PAGES[:4])
    both.plan([("a", 4)])  # the worker dropped these saves; a finishes before the report
    both.finish("a")
    both.new("b", PAGES[:4], loads=2)
    both.plan([("b", 4)])
    both.report({"b": 0}, both.index.plans)  # its slot did not hold page 0
    assert PAGES[0] not in both.index.l2
    assert both.plan([("b", 4)]) == {"b": (0,)}
