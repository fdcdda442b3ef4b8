"""The connector's worker after a failed load: no page computed over it is saved, on any rank."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import socket
import subprocess
import sys
import threading
import types
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path

import pytest
import torch
from support.blocks import CanonicalBlocks
from support.stages import LocalStagePipes

from kvstrata.impl.errors import MisuseError
from kvstrata.impl.pools.host import HostKVPool
from kvstrata.impl.pools.shape import KVShape
from kvstrata.impl.storage.base import GetStatus
from kvstrata.impl.storage.memory import MemoryBackend, MemoryStore
from kvstrata.integrations.connector import NO_FAILURE, ConnectorIndex, Plan, Scheduled
from kvstrata.integrations.connector_worker import ConnectorWorker, TorchStagePipe
from kvstrata.model.connector import ConnectorModel
from kvstrata.model.keys import KeySpace, KVKind, ModelIdentity, Namespace, PageHash, Shard

PAGE = 2
SHAPE = KVShape(KVKind.MHA, layers=1, heads=1, head_dim=2, dtype=torch.float32, page_size=PAGE)
NAMESPACE = Namespace(extra_key="test")
PAGES = [PageHash(hashlib.sha256(f"p{i}".encode()).digest()) for i in range(5)]


class Blocks(CanonicalBlocks):
    def __init__(self, value: float) -> None:
        super().__init__(torch.full((2, 1, 16, PAGE, 1, 2), value))


def _worker(rank: int, store: MemoryStore) -> ConnectorWorker:
    keys = KeySpace(ModelIdentity("t", "float32", KVKind.MHA, PAGE), shard=Shard(rank, 2))
    host = HostKVPool(SHAPE, 8, "page_first_direct")
    return ConnectorWorker(host, MemoryBackend(keys, store=store), NAMESPACE, Blocks(rank + 1.0))


def _index() -> ConnectorIndex:
    """4 L2 slots, 4 staging slots; every lookup answers that L3 holds the first 3 pages."""
    done: Future[int] = Future()
    done.set_result(3)
    return ConnectorIndex(capacity=4, staging=4, start_lookup=lambda pages: done)


def _stage(store_holds: list[int]) -> ConnectorWorker:
    """Rank 0's worker (or one pipeline stage's) on a store of its own that holds pages
    ``store_holds`` of the first three."""
    worker = _worker(0, MemoryStore())
    worker.host.write_pages([0, 1, 2], torch.full((2, 1, 3, PAGE, 1, 2), 10.0))
    worker.backend.put(NAMESPACE, [PAGES[k] for k in store_holds], store_holds)  # type: ignore[union-attr]
    return worker


def _worker_page_lost(lost: int) -> ConnectorWorker:
    """Rank 0's worker on a fresh store holding pages 0-2, less page ``lost``."""
    return _stage([k for k in range(3) if k != lost])


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


# ------------------------------------------------------------------------------ pipeline stages
def test_a_later_stage_saves_nothing_computed_over_an_earlier_stages_failed_load() -> None:
    """Stage 0's store lost page 1, stage 1's holds it: stage 1's load works, but its layers of
    pages 3-4 were computed from stage 0's hidden states over the bad KV, so it saves neither;
    the other way round, stage 0's pages do not depend on stage 1's layers and are kept."""
    pipes = LocalStagePipes(2)
    stages = [_stage([0, 2]), _stage([0, 1, 2])]
    plan = _plan(MemoryStore())
    assert [stages[k].load(plan, pipe=pipes.pipe(k)) for k in range(2)] == [{1, 2}, set()]
    for k in range(2):
        stages[k].save(plan, pipes.pipe(k))
    assert pipes.empty() and pipes.sent == 1
    for stage in stages:
        assert stage.backend.exists(NAMESPACE, PAGES[3:]) == 0  # type: ignore[union-attr]
        assert not set(stage.written.values()) & set(PAGES[3:])
    pipes = LocalStagePipes(2)
    stages = [_stage([0, 1, 2]), _stage([0, 2])]
    assert [stages[k].load(plan, pipe=pipes.pipe(k)) for k in range(2)] == [set(), {1, 2}]
    for k in range(2):
        stages[k].save(plan, pipes.pipe(k))
    assert stages[0].backend.get(NAMESPACE, PAGES[3:], [5, 6]) == [GetStatus.LOADED] * 2  # type: ignore[union-attr]
    assert stages[1].backend.exists(NAMESPACE, PAGES[3:]) == 0  # type: ignore[union-attr]


def test_with_three_stages_each_drops_from_the_first_failure_at_or_before_it() -> None:
    """Three stages: a middle stage both takes and sends. Stage 1's store lost page 2 and stage
    0's page 1: stage 0 keeps its pages 3-4, stage 1 and stage 2 drop theirs (the least of the
    failures before them: page 1), and stage 2 takes a message from each earlier stage."""
    pipes = LocalStagePipes(3)
    stages = [_stage([0, 2]), _stage([0, 1]), _stage([0, 1, 2])]
    plan = _plan(MemoryStore())
    failed = [stages[k].load(plan, pipe=pipes.pipe(k)) for k in range(3)]
    assert failed == [{1, 2}, {2}, set()]
    for k in range(3):
        stages[k].save(plan, pipes.pipe(k))
    assert pipes.empty() and pipes.sent == 3
    assert stages[0].backend.exists(NAMESPACE, PAGES[3:]) == 0  # type: ignore[union-attr]
    assert [cuts for _n, _b, cuts in stages[1].poisoned] == [{"a": 2}, {"a": 1}]  # own, stage 0's
    assert [cuts for _n, _b, cuts in stages[2].poisoned] == [{"a": 1}]  # the least before it
    for stage in stages[1:]:
        assert stage.backend.exists(NAMESPACE, PAGES[3:]) == 0  # type: ignore[union-attr]
    pipes = LocalStagePipes(3)
    stages = [_stage([0, 1, 2]), _stage([0, 2]), _stage([0, 1, 2])]
    assert [stages[k].load(plan, pipe=pipes.pipe(k)) for k in range(3)] == [set(), {1, 2}, set()]
    for k in range(3):
        stages[k].save(plan, pipes.pipe(k))
    assert stages[0].backend.get(NAMESPACE, PAGES[3:], [5, 6]) == [GetStatus.LOADED] * 2  # type: ignore[union-attr]
    for stage in stages[1:]:
        assert stage.backend.exists(NAMESPACE, PAGES[3:]) == 0  # type: ignore[union-attr]


def test_a_later_stage_drops_the_next_plans_saves_until_the_report() -> None:
    """Async scheduling under pipeline parallelism: the plan after stage 0's failed load is made
    before the report; stage 1 learned of the failure when it saved the first plan and drops
    the second plan's saves over it too, then forgets it once a plan says it was reported."""
    pipes = LocalStagePipes(2)
    stages = [_stage([0, 2]), _stage([0, 1, 2])]
    index = _index()
    index.new_request("a", PAGES)
    assert index.match("a", 0, 5) == 3
    index.alloc("a", 0, [0, 1, 2], 5)
    first = index.plan([Scheduled("a", 4, (0, 1, 2, 3, 4))])
    second = index.plan([Scheduled("a", 5, (0, 1, 2, 3, 4))])
    for plan in (first, second):
        for k, stage in enumerate(stages):
            stage.load(plan, pipe=pipes.pipe(k))
            stage.save(plan, pipes.pipe(k))
    assert stages[1].backend.exists(NAMESPACE, PAGES[3:]) == 0  # type: ignore[union-attr]
    assert [number for number, _blocks, _from in stages[1].poisoned] == [1]
    index.load_failures({"a": 1}, 1)
    third = index.plan([Scheduled("a", 5, (0, 1, 2, 3, 4))])
    assert [m.index for _r, moves in third.saves for m in moves] == [1, 2, 3, 4]
    for k, stage in enumerate(stages):
        stage.load(third, pipe=pipes.pipe(k))  # nothing to load: nothing sent
        stage.save(third, pipes.pipe(k))
        assert not stage.poisoned
    assert pipes.empty() and pipes.sent == 1  # only the first plan loads
    assert stages[1].backend.exists(NAMESPACE, PAGES[:5]) == 5  # type: ignore[union-attr]


STAGE = r"""
import datetime, json, sys
import torch
import torch.distributed as dist
sys.path[:0] = sys.argv[2:4]  # this test's folder, and tests/ (its support package)
import test_connector_failed_load as t
from kvstrata.impl.errors import InvariantViolation
from kvstrata.integrations.connector import NO_FAILURE
from kvstrata.integrations.connector_worker import TorchStagePipe

spec = json.loads(sys.argv[1])
rank = spec["rank"]  # global ranks 0 and 2 are the two stages; rank 1 stands by (another TP rank)
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{spec['port']}", rank=rank,
                        world_size=3, timeout=datetime.timedelta(seconds=60))
group = dist.new_group([0, 2], backend="gloo")  # the PP group: group ranks are not global ones
if rank == 1:
    dist.barrier()
    print(json.dumps({"rank": 1}), flush=True)
    dist.destroy_process_group()
    sys.exit(0)
stage = rank // 2
pipe = TorchStagePipe(group, [0, 2], stage)
chains = [[t.PageHash(bytes([k, i]) * 16) for i in range(5)] for k in range(3)]
keys = t.KeySpace(t.ModelIdentity("t", "float32", t.KVKind.MHA, t.PAGE))
host = t.HostKVPool(t.SHAPE, 20, "page_first_direct")  # 8 L2 slots, 12 staging slots
backend = t.MemoryBackend(keys, store=t.MemoryStore())  # this stage's own store:
worker = t.ConnectorWorker(host, backend, t.NAMESPACE, t.Blocks(1.0 + stage))
for chain in chains:  # pages 0-2 of each chain, less page 1 on stage 0
    worker.host.write_pages([0, 1, 2], torch.full((2, 1, 3, t.PAGE, 1, 2), 10.0))
    held = [0, 2] if stage == 0 else [0, 1, 2]
    worker.backend.put(t.NAMESPACE, [chain[i] for i in held], held)
done = t.Future()
done.set_result(3)
index = t.ConnectorIndex(capacity=8, staging=12, start_lookup=lambda pages: done)
plans = []  # the scheduler's plans reach every stage alike
for k, chain in enumerate(chains):  # three requests, each loading pages 0-2 from L3
    index.new_request(f"r{k}", chain)
    assert index.match(f"r{k}", 0, 5) == 3
    index.alloc(f"r{k}", 0, [5 * k, 5 * k + 1, 5 * k + 2], 5)
    plans.append(index.plan([t.Scheduled(f"r{k}", 5, tuple(range(5 * k, 5 * k + 5)))]))
if stage == 0:  # all three plans loaded (and sent) before stage 1 takes any: no wait
    failed = [sorted(worker.load(plan, pipe=pipe)) for plan in plans]
    for plan in plans:
        worker.save(plan, pipe)
    dist.send(torch.tensor([7]), dst=2, group=group)  # the engine's own traffic, tag 0
    pipe.send(99, [NO_FAILURE])  # a plan the later stage does not run next
    mismatch = None
else:
    got = torch.zeros(1, dtype=torch.int64)
    dist.recv(got, src=0, group=group)  # sent after the pipe's messages: not taken in their place
    failed = []
    for plan in plans:
        failed.append(sorted(worker.load(plan, pipe=pipe)))
        worker.save(plan, pipe)
    assert int(got) == 7
    try:
        pipe.receive(100, 1)
        mismatch = "accepted"
    except InvariantViolation as error:
        mismatch = str(error)
saved = [worker.backend.exists(t.NAMESPACE, chain) for chain in chains]
print(json.dumps({"stage": stage, "failed": failed, "saved": saved, "mismatch": mismatch,
                  "poisoned": [p[0] for p in worker.poisoned]}), flush=True)
dist.barrier()
dist.destroy_process_group()
"""


def test_the_torch_pipe_carries_each_plans_failures_to_the_later_stage(tmp_path: Path) -> None:
    """Two stage processes (global ranks 0 and 2 of three: a PP group's ranks are not its group
    ranks) joined by gloo: stage 0 loads (and sends) three plans before stage 1 takes any, and
    sends a tag-0 message of its own after them; stage 1 gets that message first, then each
    plan's failed loads in order, and saves nothing over them. A message of another plan than
    the one asked for is an invariant violation, never applied."""
    script = tmp_path / "stage.py"
    script.write_text(STAGE)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    here = Path(__file__).resolve().parent
    paths = [str(here), str(here.parents[1])]  # this test's folder, and tests/ (its support)
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), json.dumps({"rank": k, "port": port}), *paths],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for k in range(3)
    ]
    reports = []
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err[-3000:]
        reports.append(json.loads(out.splitlines()[-1]))
    reports = [reports[0], reports[2]]  # the two stages
    assert "got plan 99's loads for 100" in reports[1]["mismatch"]
    assert reports[0]["failed"] == [[1, 2], [6, 7], [11, 12]]
    assert reports[1]["failed"] == [[], [], []]  # its own loads worked
    assert reports[1]["saved"] == [3, 3, 3]  # its store's pages 0-2; 3-4 never saved
    assert reports[0]["saved"] == [1, 1, 1]
    assert reports[1]["poisoned"] == [1, 2, 3]


def test_a_report_two_plans_late_is_matched_to_its_plan_and_no_save_over_it_is_kept() -> None:
    """vLLM's batch queue of three steps (two pipeline stages under async scheduling; the
    review's case): a's load fails in plan 1 and b's in plan 2; plan 1's report comes when three
    plans were made, plan 2's when four were. Each report is matched to its own plan, so the
    worker keeps b's failure until plan 2 is reported and saves none of b's pages computed over
    it (with the index of two plans, plan 1's report was taken as plan 3's and b's pages 5-6
    reached the store in plan 4)."""
    chains = [[PageHash(bytes([k, i]) * 16) for i in range(7)] for k in range(2)]
    keys = KeySpace(ModelIdentity("t", "float32", KVKind.MHA, PAGE))
    worker = ConnectorWorker(
        HostKVPool(SHAPE, 20, "page_first_direct"),
        MemoryBackend(keys, store=MemoryStore()),
        NAMESPACE,
        Blocks(1.0),
    )
    for chain in chains:  # the store holds pages 0 and 2 of each chain: page 1 was lost
        worker.host.write_pages([0, 2], torch.full((2, 1, 2, PAGE, 1, 2), 10.0))
        worker.backend.put(NAMESPACE, [chain[0], chain[2]], [0, 2])  # type: ignore[union-attr]
    done: Future[int] = Future()
    done.set_result(3)  # the lookups ran before the store lost page 1
    index = ConnectorIndex(capacity=8, staging=12, start_lookup=lambda pages: done, lag=2)
    a_blocks, b_blocks = (0, 1, 2, 3, 4), (5, 6, 7, 8, 9, 10, 11)
    for request_id, chain in (("a", chains[0][:5]), ("b", chains[1])):
        index.new_request(request_id, chain)
        assert index.match(request_id, 0, len(chain)) == 3
    index.alloc("a", 0, a_blocks[:3], 5)
    plans = [index.plan([Scheduled("a", 5, a_blocks)])]
    index.alloc("b", 0, b_blocks[:3], 7)
    plans.append(index.plan([Scheduled("b", 4, b_blocks)]))
    plans.append(index.plan([Scheduled("b", 5, b_blocks)]))
    failed = [worker.load(plan) for plan in plans]
    for plan in plans:
        worker.save(plan)
    assert failed[:2] == [{1, 2}, {6, 7}]
    assert index.failed_plan(failed[0]) == 1  # three plans made: the oldest is still known
    index.load_failures({"a": 1}, 1)
    plans.append(index.plan([Scheduled("b", 7, b_blocks)]))  # b's pages 5-6, over its failure
    assert plans[-1].reported_through == 1
    worker.load(plans[-1])
    worker.save(plans[-1])
    assert worker.backend.exists(NAMESPACE, chains[1]) == 1  # type: ignore[union-attr]
    assert not set(worker.written.values()) & set(chains[1][1:])
    assert index.failed_plan(failed[1]) == 2
    index.load_failures({"b": 1}, 2)
    assert [
        m.index for _r, moves in index.plan([Scheduled("b", 7, b_blocks)]).saves for m in moves
    ] == [1, 2, 3, 4, 5, 6]
    with pytest.raises(MisuseError):
        ConnectorIndex(capacity=8, staging=1, start_lookup=lambda pages: done, lag=0)


def test_the_torch_pipe_warns_once_when_a_later_stage_takes_nothing(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A later stage that never runs ``wait_for_save`` (vLLM's V1 runner with speculative
    decoding, middle stages) leaves every send pending: the buffers are kept (a send in flight
    reads them) and one warning says so."""
    pending = types.SimpleNamespace(is_completed=lambda: False)
    monkeypatch.setattr(torch.distributed, "isend", lambda *args, **kwargs: pending)
    pipe = TorchStagePipe(None, [0, 1], 0)
    with caplog.at_level(logging.WARNING, "kvstrata.integrations.connector_worker"):
        for plan in range(1, 2 * TorchStagePipe.PENDING_WARNING):
            pipe.send(plan, [NO_FAILURE])
    assert len(caplog.records) == 1 and "not taken by a later stage" in caplog.text
    assert len(pipe._sending) == 2 * TorchStagePipe.PENDING_WARNING - 1
    with pytest.raises(MisuseError):
        TorchStagePipe(None, [0, 1], 2)


def test_the_worker_counts_what_it_moved_and_starts_again_when_taken() -> None:
    """``WorkerStats``: pages loaded by source, failed loads (each failed page and every later page
    of its request), pages saved into L2, backed up or whose put failed, and the store's bytes."""
    page_bytes = SHAPE.bytes_per_page
    worker = _stage([0, 1, 2])  # the store holds pages 0-2
    plan = _plan(MemoryStore())  # pages 0-2 from L3, pages 3-4 computed and saved
    assert worker.load(plan) == set()
    worker.save(plan)
    stats = worker.take_stats()
    assert (stats.loaded_l3_pages, stats.loaded_l2_pages, stats.failed_load_pages) == (3, 0, 0)
    assert (stats.saved_pages, stats.backed_up_pages, stats.failed_backup_pages) == (2, 2, 0)
    assert (stats.l3_read_bytes, stats.l3_written_bytes) == (3 * page_bytes, 2 * page_bytes)
    assert stats.l3_read_seconds > 0 and stats.l3_write_seconds > 0
    assert worker.take_stats().as_dict() == dict.fromkeys(stats.as_dict(), 0)  # counted again

    lost = _worker_page_lost(1)  # page 1 is gone: pages 1 and 2 fail, page 0 loads
    assert lost.load(plan) == {1, 2}
    stats = lost.take_stats()
    assert (stats.loaded_l3_pages, stats.failed_load_pages) == (1, 2)
    assert stats.l3_read_bytes == 2 * page_bytes  # pages 0 and 2 came; 2 is behind the hole

    # a page L2 holds is loaded from there; a put the store refuses is counted as failed
    index = _index()
    backend = MemoryBackend(KeySpace(ModelIdentity("t", "float32", KVKind.MHA, PAGE)))
    backend.fail_next(1, op="put", after=1)  # the store takes the first page of the next put
    full = ConnectorWorker(
        HostKVPool(SHAPE, 8, "page_first_direct"), backend, NAMESPACE, Blocks(3.0)
    )
    index.new_request("a", PAGES[3:])
    assert index.match("a", 0, 2) is not None
    index.alloc("a", 0, [], 2)  # computed, not loaded
    full.save(index.plan([Scheduled("a", 2, (5, 6))]))
    stats = full.take_stats()
    assert (stats.saved_pages, stats.backed_up_pages, stats.failed_backup_pages) == (2, 1, 1)
    index.finish("a")
    index.new_request("b", PAGES[3:])
    assert index.match("b", 0, 2) == 2
    index.alloc("b", 0, [7, 8], 2)
    assert full.load(index.plan([Scheduled("b", 2, (7, 8))])) == set()
    stats = full.take_stats()
    assert (stats.loaded_l2_pages, stats.loaded_l3_pages, stats.l3_read_bytes) == (2, 0, 0)

    # replicated (MLA) KV: a rank that does not write still counts its copy, moving no bytes
    follower = ConnectorWorker(
        HostKVPool(SHAPE, 8, "page_first_direct"),
        MemoryBackend(KeySpace(ModelIdentity("t", "float32", KVKind.MHA, PAGE)), writer=False),
        NAMESPACE,
        Blocks(4.0),
    )
    follower.save(plan)
    stats = follower.take_stats()
    assert (stats.saved_pages, stats.backed_up_pages, stats.l3_written_bytes) == (2, 2, 0)
