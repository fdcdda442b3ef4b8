"""The engine connector's two halves against the model (model/connector.py), with real bytes.

A fake engine admits requests over shared prompt chains, asks the connector's scheduler side
(:class:`ConnectorIndex`) how much it can load, allocates blocks, and runs steps: the worker side
(:class:`ConnectorWorker`) loads planned pages from L2 host slots or from a real in-memory L3 into the
engine's blocks, the engine computes the rest, and the worker saves new full pages to L2 and backs
them up to L3. The store's own eviction and the L3 lookups' landing are rules of their own.

Compared after every step: every ``match`` (including ``None`` while a lookup is in flight), the
lookup's answer, each step's plan (per request, the loaded page indices with their tier and the saved
page indices), the L2 index in LRU order, and L3's contents for every page the model says is there.
Bytes: every page a load reports good is compared with the KV its page hash names, and so is every
page the model says L3 holds (read back from the store after every step) and every L2 slot the
worker says it wrote; a failed load must report the page and every later page of its request. Small
L2 (4 pages) and staging (3 slots)
keep eviction, slot reuse within one plan and staging exhaustion frequent. The workers' puts queue
(a :class:`ManualJoinableExecutor`) until the step's end, or until a run of the same save
overwrites a slot one of them reads; ``test_connector_backup.py`` leaves them pending across
steps.

:class:`PipelineConnectorDifferential` runs the same with two pipeline stages, each with its own
engine blocks, worker and store, joined by in-process stage pipes: a stage computes a page right
only when the stage before it did, the store may lose a page on one stage only, and no stage may
store a page computed over any stage's failed load.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from concurrent.futures import Future

import hypothesis.strategies as st
import torch
from hypothesis import event, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from support.blocks import CanonicalBlocks
from support.stages import LocalStagePipes

from kvstrata.impl.executors import ManualJoinableExecutor
from kvstrata.impl.pools.host import HostKVPool
from kvstrata.impl.pools.shape import KVShape
from kvstrata.impl.storage.base import GetStatus
from kvstrata.impl.storage.memory import MemoryBackend, MemoryStore
from kvstrata.integrations.connector import ConnectorIndex, Plan, Scheduled
from kvstrata.integrations.connector_worker import ConnectorWorker, StagePipe
from kvstrata.model.connector import ConnectorModel, PageSource
from kvstrata.model.keys import KeySpace, KVKind, ModelIdentity, Namespace, PageHash

PAGE, CAPACITY, STAGING, BLOCKS = 2, 4, 3, 96
SHAPE = KVShape(KVKind.MHA, layers=2, heads=1, head_dim=2, dtype=torch.float32, page_size=PAGE)
KEYS = KeySpace(ModelIdentity("connector_test", "float32", KVKind.MHA, PAGE))
NAMESPACE = Namespace(extra_key="vllm-block")
CHAINS = [
    [PageHash(hashlib.sha256(f"{c}/{i}".encode()).digest()) for i in range(6)] for c in range(3)
]
CHAINS.append(CHAINS[0][:3] + CHAINS[1][3:])  # shares a prefix with chain 0


def kv_of(pages: Sequence[PageHash]) -> torch.Tensor:
    """The canonical KV a page hash names: ``[2, L, n, page, H, D]``, bytes derived from the hash."""
    one = [
        torch.frombuffer(bytearray(p.digest), dtype=torch.int16).float()[: 2 * SHAPE.layers * PAGE]
        for p in pages
    ]
    return (
        torch.stack(one)
        .reshape(len(pages), 2, SHAPE.layers, PAGE, 1, 1)
        .expand(len(pages), 2, SHAPE.layers, PAGE, 1, SHAPE.head_dim)
        .permute(1, 2, 0, 3, 4, 5)
        .contiguous()
    )


class EngineBlocks(CanonicalBlocks):
    """The engine's paged KV: one canonical page per block."""

    def __init__(self) -> None:
        super().__init__(torch.zeros(2, SHAPE.layers, BLOCKS, PAGE, 1, SHAPE.head_dim))

    def compute(
        self,
        pages: Sequence[PageHash],
        blocks: Sequence[int],
        todo: Sequence[int],
        upstream: EngineBlocks | None = None,
    ) -> None:
        """The forward pass over pages ``todo`` (in order) of a request: as in a transformer, a
        page's KV is right only when every page before it in the request's blocks is, and, on a
        later pipeline stage, when the stage before it (``upstream``, which ran the step first)
        computed that page right; over bad KV (a failed load the step took as good) it comes out
        wrong (its page's KV plus one)."""
        for k in sorted(todo):
            right = all(torch.equal(self.read([blocks[j]]), kv_of([pages[j]])) for j in range(k))
            if upstream is not None:
                right = right and torch.equal(upstream.read([blocks[k]]), kv_of([pages[k]]))
            self.write([blocks[k]], kv_of([pages[k]]) + (0 if right else 1))


class ConnectorDifferential(RuleBasedStateMachine):
    STAGES = 1
    """Pipeline stages: each its own engine blocks (its layers), worker and store (its keys)."""
    LAG = 1
    """Plans the engine builds after a plan before it reports that plan's failed loads."""

    def __init__(self) -> None:
        super().__init__()
        self.model = ConnectorModel(CAPACITY, STAGING, lag=self.LAG)
        self.lookups: dict[str, Future[int]] = {}
        self.probe_host = HostKVPool(SHAPE, 1, "page_first_direct")
        self.probes = [MemoryBackend(KEYS, store=MemoryStore()) for _ in range(self.STAGES)]
        for probe in self.probes:
            probe.attach(self.probe_host)
        self.index = ConnectorIndex(CAPACITY, STAGING, self._start_lookup, lag=self.LAG)
        self.engines = [EngineBlocks() for _ in range(self.STAGES)]
        self.workers = [
            ConnectorWorker(
                HostKVPool(SHAPE, CAPACITY + STAGING, "page_first_direct"),
                MemoryBackend(KEYS, store=probe.store),
                NAMESPACE,
                engine,
                ManualJoinableExecutor(),  # puts queue until the step's end or a slot reuse
            )
            for probe, engine in zip(self.probes, self.engines, strict=True)
        ]
        self.worker = self.workers[-1]  # the last stage drops a save when any stage does
        self.pipes = LocalStagePipes(self.STAGES) if self.STAGES > 1 else None
        self.free_blocks = list(range(BLOCKS))
        self.pages: dict[str, list[PageHash]] = {}
        self.blocks: dict[str, list[int]] = {}
        self.admitted: set[str] = set()
        self.counter = 0
        self._pending_id = ""

    def _start_lookup(self, pages: Sequence[PageHash]) -> Future[int]:
        future: Future[int] = Future()
        self.lookups[self._pending_id] = future
        return future

    def _in_store(self, pages: Sequence[PageHash]) -> int:
        """The lookup's answer: the consecutive pages every stage's store holds. With stages, the
        model's L3 (one set) may trail the stores, never lead them: a page one stage's store
        lost while another kept it, then stored again by the stage that lost it (over a later
        stage's failed load, which takes the save back in the model), is held by every store
        while the model took it out. Such pages are added to the model's L3 first; a page the
        model holds and a store lacks is still a failure. The single-stage machine checks the
        model's own L3 against the lookup."""
        if self.STAGES > 1:
            held = {
                page
                for chain in CHAINS
                for page in chain
                if all(probe.exists(NAMESPACE, [page]) for probe in self.probes)
            }
            assert self.model.l3 <= held, "a page the model backed up is missing from a store"
            if held - self.model.l3:
                event("a page every stage's store holds, taken back in the model")
            self.model.l3 |= held
        return min(probe.exists(NAMESPACE, pages) for probe in self.probes)

    def _lose(self, page: PageHash, data: st.DataObject | None = None) -> None:
        """The store loses ``page``: on every stage, or (pipeline, ``data`` given) on one stage
        drawn, or on all; either way the lookup no longer finds it."""
        stages = range(self.STAGES)
        if data is not None and self.STAGES > 1:
            one = data.draw(st.sampled_from([None, *stages]), label="stage that lost it")
            stages = range(self.STAGES) if one is None else range(one, one + 1)
        for stage in stages:
            self.probes[stage].evict(NAMESPACE, page)
        self.model.evict_l3(page)

    def _pipe(self, stage: int) -> StagePipe | None:
        return None if self.pipes is None else self.pipes.pipe(stage)

    def _store_down(self, down: bool) -> None:
        for worker in self.workers:
            backend = worker.backend
            assert isinstance(backend, MemoryBackend)
            backend.down = down

    # ---------------------------------------------------------------------------------- requests
    @rule(chain=st.integers(0, len(CHAINS) - 1), length=st.integers(1, 6))
    def new_request(self, chain: int, length: int) -> None:
        self.counter += 1
        rid = f"r{self.counter}"
        self._pending_id = rid
        pages = CHAINS[chain][:length]
        self.model.new_request(rid, pages)
        self.index.new_request(rid, pages)
        self.pages[rid] = list(pages)

    def _looking_up(self) -> list[str]:
        return [rid for rid, f in self.lookups.items() if not f.done() and rid in self.pages]

    @precondition(lambda self: self._looking_up())
    @rule(data=st.data())
    def answer(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(self._looking_up()))
        assert self.index.match(rid, 0, len(self.pages[rid])) is None  # ask again, no guess
        assert self.model.match(rid, 0, len(self.pages[rid])) is None
        self.lookups[rid].set_result(self._in_store(self.pages[rid]))
        assert self.model.answer(rid) == self.lookups[rid].result()

    def _waiting(self) -> list[str]:
        done = {rid for rid, f in self.lookups.items() if f.done()}
        return [rid for rid in self.pages if rid in done and rid not in self.admitted]

    @precondition(lambda self: self._waiting() and len(self.free_blocks) >= 6)
    @rule(data=st.data())
    def admit(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(self._waiting()))
        limit = len(self.pages[rid])
        hit = self.index.match(rid, 0, limit)
        assert hit == self.model.match(rid, 0, limit)
        assert hit is not None
        # mostly the whole hit; the engine may also allocate fewer (or none)
        take = data.draw(st.one_of(st.just(hit), st.just(hit), st.integers(0, hit)))
        blocks = [self.free_blocks.pop() for _ in self.pages[rid]]
        self.blocks[rid] = blocks
        self.model.alloc(rid, 0, take, limit)
        self.index.alloc(rid, 0, blocks[:take], limit)
        self.admitted.add(rid)
        event(f"admitted with {take} of {hit} pages external")

    @precondition(lambda self: self.admitted)
    @rule(data=st.data())
    def step(self, data: st.DataObject) -> None:
        running = sorted(self.admitted)
        self._run_step(data.draw(st.lists(st.sampled_from(running), unique=True, max_size=3)))

    def _loading_more(self) -> list[str]:
        """Requests whose planned load has an L3 page and that compute pages after the load."""
        return sorted(
            rid
            for rid, request in self.model.requests.items()
            if request.state.value == "load_planned"
            and PageSource.L3 in request.load
            and request.first + len(request.load) < len(request.pages)
        )

    @precondition(lambda self: self._loading_more())
    @rule(data=st.data())
    def load_fails_under_new_pages(self, data: st.DataObject) -> None:
        """A request loads from L3 and computes the pages after its hit in the same step; the
        store loses one of its planned pages first. The pages it computes then attend over bad
        KV (this engine's pages depend on the pages before them): none may reach L2 or L3, and
        after the recompute a later step saves them right."""
        rid = data.draw(st.sampled_from(self._loading_more()))
        request = self.model.requests[rid]
        lost = data.draw(
            st.sampled_from(
                [request.first + k for k, src in enumerate(request.load) if src is PageSource.L3]
            )
        )
        self._lose(request.pages[lost], data)
        others = sorted(self.admitted - {rid})
        self._run_step(
            [rid, *data.draw(st.lists(st.sampled_from(others), unique=True, max_size=2))]
            if others
            else [rid]
        )
        self._run_step([rid])

    def _admit_whole(self, chain: int) -> str:
        """A new request over the whole chain, its lookup answered, all its hit allocated."""
        self.new_request(chain, 6)
        rid = f"r{self.counter}"
        self.lookups[rid].set_result(self._in_store(self.pages[rid]))
        self.model.answer(rid)
        hit = self.index.match(rid, 0, 6)
        assert hit is not None and hit == self.model.match(rid, 0, 6)
        self.blocks[rid] = [self.free_blocks.pop() for _ in range(6)]
        self.model.alloc(rid, 0, hit, 6)
        self.index.alloc(rid, 0, self.blocks[rid][:hit], 6)
        self.admitted.add(rid)
        return rid

    @precondition(lambda self: len(self.free_blocks) >= 12)
    @rule(data=st.data())
    def shared_prefix_lost_under_a_load(self, data: st.DataObject) -> None:
        """Chain 0 is computed and saved whole (its first pages leave the small L2 for L3 only);
        then chain 3, which shares its first three pages, loads them and computes the rest in the
        same step, after the store lost a page it planned to read from L3."""
        second, _lost = self._chain_3_over_a_lost_page(data)
        self._run_step([second])
        self._run_step([second])

    def _chain_3_over_a_lost_page(self, data: st.DataObject) -> tuple[str, bool]:
        """Chain 0 computed, saved whole and finished; then a request over chain 3 admitted with
        its whole hit, and the store loses one of the pages its load reads from L3 (if any).
        The request, and whether a page was lost."""
        first = self._admit_whole(0)
        self._run_step([first])
        self.finish_request(first)
        rid = self._admit_whole(3)
        request = self.model.requests[rid]
        remote = [request.first + k for k, src in enumerate(request.load) if src is PageSource.L3]
        if not remote:
            return rid, False
        lost = data.draw(st.sampled_from(remote), label="L3 page lost")
        self._lose(request.pages[lost], data)
        return rid, True

    def _run_step(self, chosen: list[str]) -> None:
        """One step of every request in ``chosen`` to its end, its failed loads reported before
        the next plan (synchronous scheduling), and recomputed."""
        plan = self._plan([(rid, len(self.pages[rid])) for rid in chosen])
        failed = self._load_and_compute(plan, {rid: (0, len(self.pages[rid])) for rid in chosen})
        self._save(plan)
        self._report(plan, failed)

    def _plan(self, scheduled: list[tuple[str, int]]) -> Plan:
        """The model's and the connector's plan of one step (request, full pages computed once it
        ran), compared."""
        expected = self.model.plan(scheduled)
        plan = self.index.plan(
            [Scheduled(rid, done, tuple(self.blocks[rid])) for rid, done in scheduled]
        )
        got_loads = {rid: tuple((m.index, m.source) for m in moves) for rid, moves in plan.loads}
        got_saves = {rid: tuple(m.index for m in moves) for rid, moves in plan.saves}
        assert got_loads == expected.loads
        assert got_saves == expected.saves
        assert (plan.number, plan.reported_through) == (expected.number, expected.reported_through)
        if expected.retried:
            event("a failed backup was put again")
        return plan

    def _load_and_compute(self, plan: Plan, pages: dict[str, tuple[int, int]]) -> dict[str, int]:
        """The worker's loads (every good one exactly its page's KV; a failure ends its load),
        then the forward: each request in ``pages`` computes its pages in that range the plan
        does not load, taking every planned load as done. Each failed request's first failed
        page."""
        first_failed: dict[str, int] = {}
        failures = []
        for stage, (worker, engine) in enumerate(zip(self.workers, self.engines, strict=True)):
            failed = worker.load(plan, pipe=self._pipe(stage))
            failures.append(bool(failed))
            for rid, moves in plan.loads:
                bad = [m for m in moves if m.block in failed]
                good = [m for m in moves if m.block not in failed]
                assert all(m.index > g.index for m in bad for g in good), "a failure ends a load"
                if good:
                    assert torch.equal(
                        engine.read([m.block for m in good]), kv_of([m.page for m in good])
                    )
                if bad:  # the engine reports every stage's failed blocks
                    first_failed[rid] = min(
                        first_failed.get(rid, len(self.pages[rid])), bad[0].index
                    )
                    event("a load failed and was reported")
            upstream = self.engines[stage - 1] if stage else None
            for rid, (start, end) in pages.items():
                planned = {m.block for _r, moves in plan.loads if _r == rid for m in moves}
                blocks = self.blocks[rid]
                todo = [k for k in range(start, end) if blocks[k] not in planned]
                engine.compute(self.pages[rid], self.blocks[rid], todo, upstream)
        if len(set(failures)) > 1:
            event(f"only stage {failures.index(True)} of {self.STAGES} failed its load")
        return first_failed

    def _save(self, plan: Plan) -> None:
        for stage, worker in enumerate(self.workers):
            worker.save(plan, self._pipe(stage))
            worker.flush()  # the step's puts land (they queue while its runs reuse slots: C4)
        if self.pipes is not None:
            assert self.pipes.empty(), "a stage sent a plan's loads that no later stage took"
        if self.worker.failed_puts:
            event("a backup put failed")
        self.model.backup_failed(self.worker.failed_puts)

    def _report(
        self, plan: Plan, first_failed: dict[str, int], kept: frozenset[str] = frozenset()
    ) -> None:
        """The engine reports plan ``plan``'s failed loads (the index finds the plan by their
        blocks) and computes each failed request again from its first failed page, except the
        requests in ``kept``: it keeps what they computed (as vLLM's async scheduling does for a
        request that shares the failed blocks), so none of their pages may be saved again."""
        if not first_failed:
            return
        blocks = {self.blocks[rid][index] for rid, index in first_failed.items()}
        assert self.index.failed_plan(blocks) == plan.number
        recompute = {rid: len(self.pages[rid]) for rid in kept & first_failed.keys()}
        self.model.load_failures(first_failed, plan.number, recompute)
        self.index.load_failures(first_failed, plan.number, recompute)
        for rid, index in first_failed.items():
            pages = self.pages[rid]
            resume = recompute.get(rid, index)
            for stage, engine in enumerate(self.engines):
                upstream = self.engines[stage - 1] if stage else None
                engine.compute(pages, self.blocks[rid], range(resume, len(pages)), upstream)
            if any(rid == r for r, _moves in plan.saves):
                event("a request's saves were dropped after its load failed")

    @precondition(lambda self: len(self.free_blocks) >= 12)
    @rule(data=st.data())
    def load_fails_with_the_next_plan_made(self, data: st.DataObject) -> None:
        """Async scheduling: chain 0 is saved whole (its first pages leave the small L2 for L3
        only); chain 3, which shares its first three pages, loads them (the store lost one) and
        computes part of the rest; the engine builds the next plans (up to ``LAG``), where it
        computes the rest, before it reports the failed load. The pages of every one of these
        steps attend over bad KV: no plan's saves of them may reach L2 or L3; after the report
        the recomputed pages are saved right."""
        rid, lost = self._chain_3_over_a_lost_page(data)
        if not lost:
            return
        request = self.model.requests[rid]
        total = len(self.pages[rid])
        mid = data.draw(st.integers(request.first + len(request.load), total), label="first step")
        ends = [mid, total]
        if self.LAG > 1:  # plans built before the first one's report: up to LAG
            ahead = data.draw(st.integers(1, self.LAG), label="plans built before the report")
            more = st.lists(st.integers(mid, total), min_size=ahead - 1, max_size=ahead - 1)
            ends = [mid, *sorted(data.draw(more, label="later steps' ends")), total]
        plans, failures = [], []
        for start, end in zip([0, *ends[:-1]], ends, strict=True):  # each before any report
            plans.append(self._plan([(rid, end)]))
            failures.append(self._load_and_compute(plans[-1], {rid: (start, end)}))
            self._save(plans[-1])
        kept = frozenset([rid]) if data.draw(st.booleans(), label="computed tokens kept") else None
        self._report(plans[0], failures[0], kept or frozenset())
        for later, failed_later in zip(plans[1:], failures[1:], strict=True):
            self._report(later, failed_later)
        failed = failures[0]
        if failed and any(rid == r for plan in plans[1:] for r, _moves in plan.saves):
            event("a plan made before the report saved over the failed load")
        if len(plans) > 2:
            event(f"{len(plans) - 1} plans made before the report")
        if kept and failed:
            event("the engine kept the pages computed over the failure")
        self._run_step([rid])  # the model and the index agree on its saves (none if kept)

    @precondition(lambda self: self.admitted)
    @rule(data=st.data())
    def store_down_for_a_step(self, data: st.DataObject) -> None:
        """The store is unreachable for one step: its puts fail (saves and retries alike); the
        pages stay in L2 and the next steps put them again while L2 holds them."""
        self._store_down(True)
        try:
            self.step(data)
        finally:
            self._store_down(False)

    @precondition(lambda self: len(self.free_blocks) >= 6)
    @rule(chain=st.integers(0, len(CHAINS) - 1), steps_down=st.integers(1, 2))
    def store_down_under_saves(self, chain: int, steps_down: int) -> None:
        """A whole chain computed while the store is down: every put of its saves fails, and the
        steps after the store is back put them again (those L2 still holds)."""
        rid = self._admit_whole(chain)
        self._store_down(True)
        try:
            for _ in range(steps_down):
                self._run_step([rid])
        finally:
            self._store_down(False)
        self._run_step([rid])
        assert not any(worker.failed_puts for worker in self.workers)

    @precondition(lambda self: self.pages)
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        self.finish_request(data.draw(st.sampled_from(sorted(self.pages))))

    def finish_request(self, rid: str) -> None:
        self.model.finish(rid)
        self.index.finish(rid)
        self.free_blocks.extend(self.blocks.pop(rid, []))
        self.admitted.discard(rid)
        del self.pages[rid]

    @rule(chain=st.integers(0, len(CHAINS) - 1), index=st.integers(0, 5))
    def evict_l3(self, chain: int, index: int) -> None:
        self._lose(CHAINS[chain][index])

    def _planned_l3(self) -> list[PageHash]:
        return [
            request.pages[request.first + k]
            for request in self.model.requests.values()
            for k, source in enumerate(request.load)
            if source is PageSource.L3 and request.state.value == "load_planned"
        ]

    @precondition(lambda self: self._planned_l3())
    @rule(data=st.data())
    def evict_planned_l3(self, data: st.DataObject) -> None:
        """The store drops a page between the lookup and the load: the load must fail, reported."""
        self._lose(data.draw(st.sampled_from(self._planned_l3())), data)

    # ---------------------------------------------------------------------------------- compared
    @invariant()
    def same_state(self) -> None:
        self.model.check()
        assert list(self.index.l2) == self.model.l2
        assert list(self.worker.unbacked.values()) == self.model.unbacked
        reserved = sum(len(r.staging) for r in self.index.requests.values())
        assert reserved == sum(r.staging for r in self.model.requests.values())
        assert len(self.index.staging_free) == self.model.staging_free
        assert len(set(self.index.l2.values())) == len(self.index.l2)
        for probe in self.probes:  # every stage's store holds each page the model says it does
            for page in self.model.l3:
                got = probe.get(NAMESPACE, [page], [0])
                assert got == [GetStatus.LOADED], "a page the model backed up is missing"
            for page in {page for chain in CHAINS for page in chain}:  # and never wrong bytes
                if probe.get(NAMESPACE, [page], [0]) == [GetStatus.LOADED]:
                    got_kv = self.probe_host.read_pages([0])
                    assert torch.equal(got_kv, kv_of([page])), "L3 has wrong bytes"
        for rid, pages in self.pages.items():
            if rid in self.admitted:
                continue
            assert self.index.match(rid, 0, len(pages)) == self.model.match(rid, 0, len(pages))
        for worker in self.workers:  # L2 bytes are what the slot claims, on every stage
            for slot, page in worker.written.items():
                assert torch.equal(worker.host.read_pages([slot]), kv_of([page]))


TestConnectorDifferential = ConnectorDifferential.TestCase
TestConnectorDifferential.settings = settings(stateful_step_count=40)


class PipelineConnectorDifferential(ConnectorDifferential):
    """The same with two pipeline stages (vLLM's ``pipeline_parallel_size`` 2): a page a stage
    computes is right only when the stage before it computed it right, the store may lose a page
    on one stage only, and each stage tells the later one of its failed loads (``StagePipe``): no
    stage may save a page computed over any stage's failed load. The last stage is compared with
    the model; an earlier stage keeps the pages a later stage's failure did not touch. Reports may
    come two plans late (``LAG``), as vLLM's batch queue of three steps gives."""

    STAGES = 2
    LAG = 2  # vLLM's batch queue with two stages under async scheduling (its V2 runner)

    @rule(data=st.data())
    def evict_l3_on_one_stage(self, data: st.DataObject) -> None:
        chain = data.draw(st.integers(0, len(CHAINS) - 1), label="chain")
        self._lose(CHAINS[chain][data.draw(st.integers(0, 5), label="page")], data)


TestPipelineConnectorDifferential = PipelineConnectorDifferential.TestCase
TestPipelineConnectorDifferential.settings = settings(stateful_step_count=40)
