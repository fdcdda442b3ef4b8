"""Store faults: the real cache's store link against ``StoreLinkModel`` (issue 17, SPEC §9).

The implementation is a whole :class:`HierarchicalRadixCache` with an L3 store that can go down
(every call raises ``StoreUnavailable``), hang (a call its lane began and has not finished), and come
back empty (its contents lost). Its four lanes are stepped executors (a rule begins a lane's oldest
call and leaves it running; another finishes it) and its clock is a fake one the machine advances.

The model follows through two spies on the implementation's link: every ``submit`` the cache makes is
also made on the model at the same moment (their answers must agree: issued, or answered nothing /
deferred), and every ``poll`` (the cache's ``check_events``) polls the model too (their recoveries
must agree). The model decides health, probes, deadlines and the deferred queue on its own; after
every step the machine compares: health, each lane's calls (kind, op, pages, begun), the deferred
backups, the probe schedule and the counters.

Invariants on the implementation after every step:

- no request waits longer than its bound: a prefetch open for ``prefetch_deadline_s`` is ready;
- an abandoned read never becomes a stale offset: the host pages of a prefetch whose read may still
  be writing them are neither free in the host pool nor held by a tree node;
- the deferred queue holds at most its bound of pages;
- bytes: every page a prefetch delivers holds the KV its page hash names;
- after ``drain`` (the store up, every call finished, the store healthy), every page L2 holds is in
  the store, unless an empty restart went unnoticed (no call failed while it was down) or deferred
  backups were dropped to stay bounded (both are counted and labelled).
"""

from __future__ import annotations

from typing import Any

import hypothesis.strategies as st
import numpy as np
import torch
from hypothesis import event, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from support.differential import kv_for

from kvstrata.impl.cache import HierarchicalRadixCache
from kvstrata.impl.config import RadixCacheConfig, StorageConfig
from kvstrata.impl.errors import CapacityError, StoreUnavailable
from kvstrata.impl.pools import DeviceKVPool, HostKVPool, HostLayout, KVShape
from kvstrata.impl.storage.base import GetStatus, PutStatus
from kvstrata.impl.storage.link import Lanes, StoreLink
from kvstrata.impl.storage.memory import MemoryBackend, MemoryStore
from kvstrata.impl.transfer import ManualExecutor
from kvstrata.model.keys import (
    DEFAULT_NAMESPACE,
    KeySpace,
    KVKind,
    ModelIdentity,
    Namespace,
    PageHash,
    chain_page_hashes,
)
from kvstrata.model.l3.health import CallKind, HealthConfig, Lane, StoreLinkModel
from kvstrata.model.l3.policy import PrefetchPolicy
from kvstrata.model.lifecycles import HOST_VALID, Health, PrefetchState

PAGE = 2
SHAPE = KVShape(KVKind.MHA, layers=1, heads=1, head_dim=2, dtype=torch.float16, page_size=PAGE)
KEYS = KeySpace(
    ModelIdentity(name="health", dtype="float16", kind=KVKind.MHA, page_size=PAGE), tag="health"
)
DEADLINE = 1.0  # a request's L3 wait bound
SEQUENCES = [
    tuple(range(start, start + length))
    for start, length in ((0, 6), (0, 8), (100, 4), (200, 8), (300, 6), (400, 4))
]


class FaultyBackend(MemoryBackend):
    """A memory backend whose store can be down: every call then raises ``StoreUnavailable``."""

    down = False

    def _check(self) -> None:
        if self.down:
            raise StoreUnavailable("the test store is down")

    def exists(self, namespace: Namespace, pages: Any) -> int:
        self._check()
        return super().exists(namespace, pages)

    def put(self, namespace: Namespace, pages: Any, host_indices: Any) -> list[PutStatus]:
        self._check()
        return super().put(namespace, pages, host_indices)

    def get(self, namespace: Namespace, pages: Any, host_indices: Any) -> list[GetStatus]:
        self._check()
        return super().get(namespace, pages, host_indices)


class StoreHealthMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.ready = False

    @initialize(
        deferred=st.sampled_from([4, 64]),
        policy=st.sampled_from([PrefetchPolicy.WAIT_COMPLETE, PrefetchPolicy.TIMEOUT]),
    )
    def build(self, deferred: int, policy: PrefetchPolicy) -> None:
        self.now = 0.0
        config = StorageConfig(
            prefetch_threshold=PAGE,
            prefetch_policy=policy,
            prefetch_timeout_base_s=5.0,  # longer than the deadline: the deadline must bound it
            prefetch_timeout_cap_s=5.0,
            prefetch_deadline_s=DEADLINE,
            backup_retries=10**6,
            backup_backoff_s=0.0,
            call_deadline_s=2.0,
            probe_deadline_s=0.5,
            probe_backoff_s=0.1,
            probe_backoff_cap_s=0.4,
            backup_deferred_pages=deferred,
        )
        self.health = config.health()
        self.model = StoreLinkModel(config=self.health)
        self.store = MemoryStore()
        self.backend = FaultyBackend(KEYS, store=self.store)
        self.lanes = {lane: ManualExecutor() for lane in Lane}
        self.copies = ManualExecutor()
        self.device = DeviceKVPool(SHAPE, 16, "cpu")
        self.host = HostKVPool(SHAPE, 16, HostLayout.PAGE_FIRST_DIRECT)
        self.cache = HierarchicalRadixCache.build(
            RadixCacheConfig(page_size=PAGE),
            self.device,
            self.host,
            self.copies,
            storage=self.backend,
            storage_config=config,
            storage_executor=Lanes(
                self.lanes[Lane.READ],
                self.lanes[Lane.WRITE],
                self.lanes[Lane.PROBE],
                self.lanes[Lane.QUERY],
            ),
        )
        l3 = self.cache.l3
        assert l3 is not None
        l3._now = lambda: self.now
        self.l3 = l3
        self.spy(l3.link)
        self.open: dict[int, float] = {}  # prefetch op -> when it started
        self.known: list[tuple[int, ...]] = []
        self.loss_unseen = False  # the store came back empty and no probe has found it yet
        self.ready = True

    def spy(self, link: StoreLink) -> None:
        """Make the model follow the implementation's link call by call."""
        real_submit, real_poll = link.submit, link.poll
        model = self.model

        def submit(
            kind: CallKind, op_id: int, pages: int, body: Any, skip: Any, *, merge: Any = None
        ) -> bool:
            issued = real_submit(kind, op_id, pages, body, skip, merge=merge)
            op = self.l3.backup.ops.get(op_id) if kind is CallKind.BACKUP else None
            last = (op.namespace, PageHash(op.digests[-32:])) if op and op.digests else None
            assert issued == model.submit(kind, op_id, pages, self.now, last), (kind, issued)
            return issued

        def poll() -> Any:
            calls, recovery = real_poll()
            want = model.poll(self.now)
            assert recovery == want, (recovery, want)
            if want is not None:
                model.resume()
                if want.republish:
                    self.loss_unseen = False
                    event(
                        "a probe found the store empty: L2 re-published"
                        if want.lost
                        else "back from down: L2 checked against the store"
                    )
            return calls, recovery

        link.submit = submit  # type: ignore[method-assign]
        link.poll = poll  # type: ignore[method-assign]

    # ------------------------------------------------------------------ the scheduler's side
    def check_events(self) -> None:
        self.cache.check_events()

    @precondition(lambda self: self.ready)
    @rule(index=st.integers(0, len(SEQUENCES) - 1))
    def insert(self, index: int) -> None:
        """A request computes a sequence: L1 pages, write-through to L2 (copies run), backups."""
        tokens = SEQUENCES[index]
        pages = chain_page_hashes(tokens, PAGE)
        match = self.cache.match_prefix(tokens)
        try:
            fresh = self.cache.alloc_device(len(pages) - match.device_pages)
        except CapacityError:
            event("insert: L1 full of locked pages")
            return
        if len(fresh):
            kv = torch.cat([kv_for(SHAPE, p) for p in pages[match.device_pages :]], dim=2)
            self.device.write_pages(fresh, kv)
        self.cache.insert(tokens, np.concatenate([match.device_indices, fresh]))
        self.copies.run_all()
        self.check_events()
        if tokens not in self.known:
            self.known.append(tokens)

    @precondition(lambda self: self.ready)
    @rule()
    def evict_all(self) -> None:
        self.copies.run_all()
        self.check_events()
        self.cache.evict(10**6)
        self.cache.evict_host(10**6)

    @precondition(lambda self: self.ready and self.known)
    @rule(data=st.data(), evict=st.sampled_from([True, True, False]))
    def prefetch(self, data: st.DataObject, evict: bool) -> None:
        """A request for a known sequence, usually after L1 and L2 let it go (so L3 must serve)."""
        tokens = data.draw(st.sampled_from(self.known), label="prefetched sequence")
        if evict:
            self.evict_all()
        op = self.cache.prefetch(tokens)
        if op is not None:
            self.open[op] = self.now
            event("prefetch started")
        elif not self.model.serving:
            event("prefetch answered nothing: the store is down")

    @precondition(lambda self: self.ready and not self.backend.down)
    @rule(index=st.integers(0, len(SEQUENCES) - 1), hang=st.booleans())
    def round_trip(self, index: int, hang: bool) -> None:
        """Compute, back up, forget locally, prefetch from L3; with ``hang`` the read hangs past
        the request's bound, the request moves on, and the read stays running (abandoned)."""
        self.insert(index)
        while self.lane_busy(Lane.WRITE):
            self.finish_call(Lane.WRITE)
        self.evict_all()
        op_id = self.cache.prefetch(SEQUENCES[index])
        if op_id is None:
            return
        self.open[op_id] = self.now
        if self.lane_busy(Lane.QUERY):
            self.finish_call(Lane.QUERY)  # the query; its hit starts the fetch
        op = self.l3.prefetches.get(op_id)
        if op is None or op.state is not PrefetchState.LOADING or not self.lane_busy(Lane.READ):
            return
        if hang:
            self.begin_call(Lane.READ)
            self.advance(DEADLINE + 0.05)
            assert self.cache.prefetch_ready(op_id)
            self.cache.prefetch_commit(op_id)
            del self.open[op_id]
            event("a read hung past the request's bound: abandoned")
        else:
            self.finish_call(Lane.READ)
            self.finish_prefetch_op(op_id, commit=True)

    @precondition(lambda self: self.ready and self.known and not self.backend.down)
    @rule(empty=st.booleans(), data=st.data())
    def outage(self, empty: bool, data: st.DataObject) -> None:
        """The store goes down under load: a backup fails, the probe fails, the store is down;
        then it comes back (maybe empty) and time passes until a probe may run."""
        self.store_goes_down()
        self.insert(data.draw(st.integers(0, len(SEQUENCES) - 1), label="sequence"))
        for lane in (Lane.WRITE, Lane.PROBE, Lane.WRITE, Lane.PROBE):
            if self.model.lanes[lane]:
                self.finish_call(lane)
        self.store_comes_back(empty)
        self.advance(0.3)

    @precondition(lambda self: self.ready and self.open)
    @rule(data=st.data(), commit=st.booleans())
    def finish_prefetch(self, data: st.DataObject, commit: bool) -> None:
        self.finish_prefetch_op(
            data.draw(st.sampled_from(sorted(self.open)), label="prefetch op"), commit
        )

    def finish_prefetch_op(self, op_id: int, commit: bool) -> None:
        op = self.l3.prefetches[op_id]
        if commit:
            arrived = op.arrived if op.state is PrefetchState.COMPLETE else 0
            if arrived:
                self.check_bytes(op.host[:arrived], op.digests[: arrived * 32])
            self.cache.prefetch_commit(op_id)
            event("prefetch committed" + (" with pages" if arrived else ""))
        else:
            self.cache.prefetch_abort(op_id)
        if op.state is PrefetchState.CANCELLING:
            event("prefetch finished while its read was in flight")
        del self.open[op_id]

    def check_bytes(self, host: np.ndarray, digests: bytes) -> None:
        pages = [PageHash(digests[i : i + 32]) for i in range(0, len(digests), 32)]
        got = self.host.read_pages(host)
        want = torch.cat([kv_for(SHAPE, page) for page in pages], dim=2)
        assert torch.equal(got.view(torch.int16), want.view(torch.int16)), "L3 bytes differ"

    # ------------------------------------------------------------------ the store's side
    def lane_busy(self, lane: Lane) -> bool:
        """Whether the model has a call on ``lane``; then the implementation's lane must too."""
        if not self.model.lanes[lane]:
            return False
        assert self.lanes[lane].jobs, f"the model has a {lane.value} call the lane does not run"
        return True

    @precondition(lambda self: self.ready)
    @rule(lane=st.sampled_from(list(Lane)))
    def begin_call(self, lane: Lane) -> None:
        """A lane begins its oldest call, which then runs (hangs) until finished."""
        if self.lane_busy(lane):
            self.lanes[lane].begin_next()
            self.model.begin(lane, self.now)

    @precondition(lambda self: self.ready)
    @rule(lane=st.sampled_from(list(Lane)))
    def finish_call(self, lane: Lane) -> None:
        """A lane's oldest call returns (against the store as it is now)."""
        if not self.lane_busy(lane):
            return
        down = self.backend.down
        sentinel = self.model.sentinel
        lost = (
            lane is Lane.PROBE
            and not down
            and sentinel is not None
            and self.backend.exists(sentinel[0], [sentinel[1]]) == 0
        )
        self.lanes[lane].run_next()
        call = self.model.finish(lane, self.now, fault=down, lost=lost)
        if call.skipped:
            event("a call queued before the outage was skipped")
        event(f"a {lane.value} call returned" + (" against a down store" if down else ""))
        self.check_events()

    @precondition(lambda self: self.ready)
    @rule(lane=st.sampled_from([Lane.WRITE, Lane.READ]))
    def finish_merged_calls(self, lane: Lane) -> None:
        """The write (read) lane runs its oldest backup (fetch) together with the ones queued
        right behind it that merge with it: one store call (issue 20); the model's
        ``finish_merged``."""
        if len(self.lanes[lane].jobs) < 2 or not self.lane_busy(lane):
            return
        down = self.backend.down
        count = self.lanes[lane].run_merged()
        calls = self.model.finish_merged(lane, self.now, self.now, count, fault=down)
        if count > 1:
            event(f"{lane.value} calls returned as one" + (" against a down store" if down else ""))
        if any(call.skipped for call in calls):
            event("a call queued before the outage was skipped")
        self.check_events()

    @precondition(lambda self: self.ready)
    @rule(seconds=st.sampled_from([0.05, 0.3, 0.6, 2.5]))
    def advance(self, seconds: float) -> None:
        self.now += seconds
        self.check_events()

    @precondition(lambda self: self.ready and not self.backend.down)
    @rule()
    def store_goes_down(self) -> None:
        self.backend.down = True

    @precondition(lambda self: self.ready and self.backend.down)
    @rule(empty=st.booleans())
    def store_comes_back(self, empty: bool) -> None:
        self.backend.down = False
        if empty:
            self.store.drop(list(self.store.visible_keys()))
            self.loss_unseen = True
            event("the store came back empty")

    @precondition(lambda self: self.ready)
    @rule()
    def drain(self) -> None:
        """The store up for good: finish every prefetch, every call and every probe until the store
        is healthy and idle; then L2 is in L3 (unless a loss went unseen or backups were dropped)."""
        if self.backend.down:
            self.store_comes_back(empty=False)
        for op_id in sorted(self.open):
            self.cache.prefetch_commit(op_id)
        self.open.clear()
        for _ in range(200):
            self.copies.run_all()
            for lane in Lane:
                while self.lane_busy(lane):
                    self.finish_call(lane)
            settled = (
                self.l3.idle() and not self.l3.link.in_flight() and not self.l3.backup.deferred
            )
            if settled and self.model.state is Health.HEALTHY:
                break
            self.advance(0.5)
        else:
            raise AssertionError("the store link did not settle")
        if self.loss_unseen or self.model.dropped_pages:
            event("drained: L3 coverage check skipped (unseen loss or dropped backups)")
            return
        for node in self.cache.nodes():
            if node.state in HOST_VALID:
                pages = [node.page_hash(i) for i in range(node.num_pages)]
                assert self.backend.exists(node.namespace, pages) == len(pages), (
                    f"{node!r} is on L2 but not in L3 after the store came back"
                )
        event("drained: every L2 page is in L3")

    # ------------------------------------------------------------------ comparison
    @invariant()
    def agree(self) -> None:
        if not self.ready:
            return
        model, link = self.model, self.l3.link
        model.check()
        assert link.state is model.state, (link.state, model.state)
        for lane in Lane:
            got = [(c.kind, c.op_id, c.pages, c.started, c.skipped) for c in link.calls[lane]]
            want = [(c.kind, c.op_id, c.pages, c.started, c.skipped) for c in model.lanes[lane]]
            assert got == want, (lane, got, want)
        deferred = [(op.op_id, op.num_pages) for op in self.l3.backup.deferred]
        assert deferred == model.deferred, (deferred, model.deferred)
        assert link.probe_at == model.probe_at, (link.probe_at, model.probe_at)
        assert (link.faults, link.skipped, link.answered_nothing, link.recoveries, link.losses) == (
            model.faults,
            model.skipped,
            model.answered_nothing,
            model.recoveries,
            model.losses,
        )
        assert self.l3.counters.backup_dropped_pages == model.dropped_pages
        assert self.l3.worker.sentinel == model.sentinel, (self.l3.worker.sentinel, model.sentinel)

    @invariant()
    def waits_are_bounded(self) -> None:
        if not self.ready:
            return
        for op_id, started in self.open.items():
            if self.now - started >= DEADLINE:
                assert self.cache.prefetch_ready(op_id), f"prefetch {op_id} waits past its bound"

    @invariant()
    def abandoned_reads_hold_their_pages(self) -> None:
        """Pages a read may still write are neither free nor in the tree (no stale offset)."""
        if not self.ready:
            return
        tree_pages = {
            int(page) for node in self.cache.nodes() if node.host is not None for page in node.host
        }
        allocator = self.cache._tiers.host
        assert allocator is not None
        for op in self.l3.prefetches.values():
            if op.in_flight and op.state is not None:  # a fetch that may write all its pages
                held = {int(page) for page in op.host}
                assert not held & tree_pages, "a page an unfinished read writes is in the tree"
                assert all(allocator.is_allocated(page) for page in held), (
                    "a page an unfinished read writes is free"
                )
                if op.state is PrefetchState.CANCELLING:
                    event("an abandoned read still holds its pages")

    def teardown(self) -> None:
        if self.ready:
            for executor in self.lanes.values():
                executor.jobs.clear()
            self.cache.close()


TestStoreHealth = StoreHealthMachine.TestCase
TestStoreHealth.settings = settings(stateful_step_count=60)


def test_health_config_matches_storage_config() -> None:
    """The implementation's seconds and the model's bounds are one value."""
    config = StorageConfig(call_deadline_s=3.0, backup_deferred_pages=7)
    assert config.health() == HealthConfig(call_deadline=3.0, deferred_pages=7)
    assert Namespace() == DEFAULT_NAMESPACE
