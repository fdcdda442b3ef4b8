"""N tensor-parallel ranks of the real cache in one process, each with its own pools, copy worker,
store worker and shard of one shared store, driven by Hypothesis with different background results
per rank (SPEC §10; issue 18).

Every rank runs on a thread of its own (``support.tp.InProcessTp``); the scheduler verbs go to
every rank and must answer the same. Each rank's copies run, land or fail in its own order, each
rank's store jobs run with their own faults (a put or a read failing, an object of its shard lost),
and ``check_events`` on every rank makes the agreement (one in-process MIN all-reduce per call).
Checked after every step:

* every rank's tree (node by node: pages, residency, locks, backup pins), free pages per tier,
  pending work and prefetch ops equal rank 0's (``tree_view``);
* every rank made the same collective calls in the same order (length and layout digest);
* bytes: every L1 page a match returns, and every page a prefetch commits, holds exactly that
  rank's shard of the page's KV (MLA, in half the examples: the replicated KV, written to the store
  by rank 0 alone, whose backups every rank then counts as stored, and read by every rank);
* the same ``prefetch`` op ids and ``prefetch_ready`` answers on every rank;
* ``idle()`` answers alike on every rank, and ``reset`` when it is true drops every page on every
  rank, with no job left reading them; at the end of each example (every job left run), every page
  of every inserted sequence that the shared store holds under a rank's keys holds that rank's
  shard of its KV;
* outages (issue 20): some ranks' store unreachable (every put and query raises), or the master
  restarted (every object gone), then back; every rank reads one clock the test moves. After a
  restart that a rank's link saw (it recovered since), the re-publish is agreed and done on every
  rank: once everything settled, every page a rank holds in L2 is in the store under that rank's
  keys (unless the store lost objects since).

With a background result that differs per rank, a rank applying its own count instead of the
agreed one diverges its tree; a rank that skips its collective leaves the others waiting
(``TpAgreementError``): both are catalogued mutants (``tests/mutants/``).
"""

from __future__ import annotations

import hashlib
from typing import Any

import hypothesis.strategies as st
import numpy as np
import torch
from hypothesis import event, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from support.differential import NAMESPACES, related_tokens
from support.tp import InProcessTp
from support.unreachable import UnreachableBackend

from kvstrata.impl.cache import HierarchicalRadixCache
from kvstrata.impl.config import RadixCacheConfig, StorageConfig
from kvstrata.impl.errors import CapacityError
from kvstrata.impl.pools import DeviceKVPool, HostKVPool, HostLayout, KVShape
from kvstrata.impl.storage.base import GetStatus
from kvstrata.impl.storage.memory import MemoryBackend, MemoryStore
from kvstrata.impl.transfer import Direction, ManualExecutor
from kvstrata.model.keys import (
    KeySpace,
    KVKind,
    ModelIdentity,
    Namespace,
    PageHash,
    Shard,
    chain_page_hashes,
)
from kvstrata.model.l3.health import Lane
from kvstrata.model.l3.policy import PrefetchPolicy
from kvstrata.model.lifecycles import HOST_VALID, Health


def shard_kv(shape: KVShape, page: PageHash, rank: int) -> torch.Tensor:
    """Rank ``rank``'s shard of one page's KV: bytes derived from the page hash and the rank
    (``rank`` -1: the replicated MLA KV, the same on every rank)."""
    dims = shape.canonical(1)
    count = int(np.prod(dims)) * shape.itemsize
    stream = hashlib.shake_256(page.digest + bytes([rank % 256])).digest(count)
    return torch.frombuffer(bytearray(stream), dtype=torch.uint8).view(shape.dtype).reshape(dims)


def tree_view(cache: HierarchicalRadixCache) -> tuple[object, ...]:
    """Everything about one rank's cache that agreement keeps equal on every rank."""
    nodes = tuple(
        (
            node.id,
            -1 if node.parent is None else node.parent.id,
            node.num_pages,
            None if node.state is None else node.state.value,
            node.lock_ref,
            node.backup_pins,
            None if node.device is None else node.device.tolist(),
            None if node.host is None else node.host.tolist(),
        )
        for node in cache.nodes()
    )
    l3 = cache.l3
    prefetches: tuple[object, ...] = ()
    if l3 is not None:
        prefetches = tuple(
            (op_id, None if op.state is None else op.state.value, op.arrived, op.reserved)
            for op_id, op in l3.prefetches.items()
        )
    pending = cache.pending()
    return (
        nodes,
        cache.device_free,
        cache.host_free,
        cache.held_pages().tolist(),
        # a backup op deferred while this rank's store is down is still pending: the deferral
        # is local (one rank's link may be down while the others' are not)
        (pending.write, pending.load, pending.backup + pending.deferred, pending.prefetch),
        prefetches,
        sorted(() if l3 is None else l3.backups),
    )


class TpDifferential(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.tp: InProcessTp | None = None
        self.known: list[tuple[int, ...]] = []
        self.inserted: list[tuple[tuple[int, ...], Namespace]] = []

    @initialize(
        data=st.data(),
        size=st.sampled_from([2, 3, 4]),
        page_size=st.integers(1, 2),
        device_pages=st.integers(4, 8),
        host_pages=st.integers(4, 10),
        mla=st.booleans(),
    )
    def setup(  # noqa: PLR0917 (Hypothesis passes rule arguments by keyword)
        self,
        data: st.DataObject,
        size: int,
        page_size: int,
        device_pages: int,
        host_pages: int,
        mla: bool,
    ) -> None:
        self.size = size
        self.page_size = page_size
        self.mla = mla
        self.tp = InProcessTp(size)
        kind = KVKind.MLA if mla else KVKind.MHA
        self.shape = KVShape(
            kind,
            layers=2,
            heads=1 if mla else 2,
            head_dim=4,
            dtype=torch.float16,
            page_size=page_size,
        )
        policy = data.draw(
            st.sampled_from([PrefetchPolicy.BEST_EFFORT, PrefetchPolicy.WAIT_COMPLETE]),
            label="prefetch_policy",
        )
        # a retry waits for its back-off (at most half a step of the clock) in half the examples
        backoff = data.draw(st.sampled_from([0.0, 0.25]), label="backup_backoff_s")
        self.store = MemoryStore()
        identity = ModelIdentity("tiny-llm", "float16", kind, page_size=page_size)
        self.device_pools = [DeviceKVPool(self.shape, device_pages, "cpu") for _ in range(size)]
        self.host_pools = [
            HostKVPool(self.shape, host_pages, HostLayout.PAGE_FIRST) for _ in range(size)
        ]
        self.copy_workers = [ManualExecutor() for _ in range(size)]
        self.store_workers = [ManualExecutor() for _ in range(size)]
        # MLA: the KV is replicated, one key space for every rank, rank 0 its single writer
        self.backends = [
            UnreachableBackend(
                KeySpace(
                    identity,
                    shard=Shard.replicated() if mla else Shard(tp_rank=rank, tp_size=size),
                ),
                store=self.store,
                writer=not mla or rank == 0,
            )
            for rank in range(size)
        ]
        tp = self.tp

        def build(rank: int) -> HierarchicalRadixCache:
            return HierarchicalRadixCache.build(
                RadixCacheConfig(
                    page_size=page_size, write_through_threshold=1, fingerprint_seed=0
                ),
                self.device_pools[rank],
                self.host_pools[rank],
                executor=self.copy_workers[rank],
                storage=self.backends[rank],
                storage_config=StorageConfig(
                    prefetch_threshold=page_size,
                    prefetch_policy=policy,
                    backup_retries=10**6,
                    backup_backoff_s=backoff,
                    backup_backoff_cap_s=max(backoff, 0.5),
                ),
                storage_executor=self.store_workers[rank],
                tp_group=tp.group(rank),
            )

        self.caches = tp.on_each(build)  # built on its scheduler thread, as in an engine
        self.clock = [0.0]  # one clock every rank reads, moved by the test
        self.ahead = [0.0] * size  # how far each rank's own clock runs ahead of it
        self.backoff = backoff
        for rank, cache in enumerate(self.caches):
            assert cache.l3 is not None
            cache.l3._now = lambda r=rank: self.clock[0] + self.ahead[r]
        self.restarted = False  # the master restarted and no check ran since
        self.fresh = 0  # sequences made up while the store was away
        self.lost_since_restart = False
        self.recoveries_at_restart = [0] * size
        self.failing_copies = [False] * size
        for rank, cache in enumerate(self.caches):
            transfer = cache.transfer
            assert transfer is not None
            real = transfer._copy

            def copy(direction: Direction, src: Any, dst: Any, r: int = rank, f: Any = real) -> int:
                if self.failing_copies[r]:
                    self.failing_copies[r] = False
                    raise RuntimeError(f"rank {r}: injected copy failure")
                result: int = f(direction, src, dst)
                return result

            transfer._copy = copy

    def teardown(self) -> None:
        if self.tp is not None:
            for rank in range(self.size):  # every job left runs, as a closing engine's would
                self.copy_workers[rank].run_all()
                self.store_workers[rank].run_all()
            self.tp.on_each(lambda rank: self.caches[rank].close())
            self.tp.close()
            self.store_holds_the_right_bytes()

    def store_holds_the_right_bytes(self) -> None:
        """Every page of every sequence inserted that the shared store holds under a rank's keys
        holds that rank's shard of the page's KV: no job put another page's bytes (a freed and
        reused host page) under its keys. Read back through a backend of the rank's key space
        into a pool of its own."""
        pages_of = {
            page: ns
            for tokens, ns in self.inserted
            for page in chain_page_hashes(tokens, self.page_size, ns)
        }
        if not pages_of:
            return
        for rank in range(self.size if not self.mla else 1):
            reader = MemoryBackend(self.backends[rank].keyspace, store=self.store)
            pool = HostKVPool(self.shape, 1, HostLayout.PAGE_FIRST)
            reader.attach(pool)
            for page, ns in pages_of.items():
                if reader.get(ns, [page], [0]) != [GetStatus.LOADED]:
                    continue
                want = shard_kv(self.shape, page, self.kv_rank(rank))
                got = pool.read_pages(torch.tensor([0]))
                same = torch.equal(got.view(torch.int16), want.view(torch.int16))
                assert same, f"rank {rank}: the store holds another page's bytes under its keys"
            reader.close()

    # ------------------------------------------------------------ helpers
    def each(self, verb: str, *args: Any) -> Any:
        """``verb`` on every rank, on its own thread; every rank must answer the same."""
        assert self.tp is not None
        results = self.tp.on_each(lambda rank: getattr(self.caches[rank], verb)(*args))
        return results

    def draw_tokens(self, data: st.DataObject) -> tuple[tuple[int, ...], Namespace]:
        if self.inserted and data.draw(st.booleans(), label="an inserted sequence"):
            return data.draw(st.sampled_from(self.inserted), label="inserted")
        tokens = data.draw(related_tokens(self.known), label="tokens")
        return tokens, data.draw(st.sampled_from(NAMESPACES), label="namespace")

    def ranks(self, data: st.DataObject) -> list[int]:
        every = list(range(self.size))
        if data.draw(st.booleans(), label="all ranks"):
            return every
        return data.draw(st.lists(st.sampled_from(every), min_size=1, unique=True), label="ranks")

    def kv_rank(self, rank: int) -> int:
        return -1 if self.mla else rank

    def check_l1(self, rank: int, tokens: tuple[int, ...], ns: Namespace, result: Any) -> None:
        pages = chain_page_hashes(tokens, self.page_size, ns)[: result.device_pages]
        if pages:
            want = torch.cat([shard_kv(self.shape, p, self.kv_rank(rank)) for p in pages], dim=2)
            got = self.device_pools[rank].read_pages(result.device_indices)
            assert torch.equal(got.view(torch.int16), want.view(torch.int16)), f"rank {rank}: L1"

    # ------------------------------------------------------------ scheduler verbs (every rank)
    @rule(data=st.data())
    def request(self, data: st.DataObject) -> None:
        self.request_on_every_rank(*self.draw_tokens(data))

    def request_on_every_rank(self, tokens: tuple[int, ...], ns: Namespace) -> None:
        pages = chain_page_hashes(tokens, self.page_size, ns)

        def one(rank: int) -> tuple[object, ...]:
            cache = self.caches[rank]
            result = cache.match_prefix(tokens, ns)
            self.check_l1(rank, tokens, ns, result)
            locked = not result.device_node.is_root
            if locked:
                cache.lock(result.device_node)
            try:
                fresh = cache.alloc_device(len(pages) - result.device_pages)
            except CapacityError:
                fresh = None
            if fresh is not None:
                if len(fresh):
                    kv = [
                        shard_kv(self.shape, p, self.kv_rank(rank))
                        for p in pages[result.device_pages :]
                    ]
                    self.device_pools[rank].write_pages(fresh, torch.cat(kv, dim=2))
                cache.insert(tokens, result.device_indices.tolist() + fresh.tolist(), ns)
            if locked:
                cache.unlock(result.device_node)
            return (result.device_pages, result.host_pages, fresh is None)

        outcomes = self.each_call(one)
        if outcomes[0][2]:
            event("request refused: L1 full")
        elif (tokens, ns) not in self.inserted:
            self.inserted.append((tokens, ns))
            self.known.append(tokens)

    def each_call(self, call: Any) -> list[Any]:
        assert self.tp is not None
        results = self.tp.on_each(call)
        assert all(r == results[0] for r in results), results
        return results

    @rule(pages=st.sampled_from([0, 1, 2, 32]), host=st.booleans())
    def evict(self, pages: int, host: bool) -> None:
        self.each_call(lambda rank: self.caches[rank].evict(pages))
        if host:
            self.each_call(lambda rank: self.caches[rank].evict_host(pages))

    @rule(data=st.data())
    def load_back(self, data: st.DataObject) -> None:
        tokens, ns = self.draw_tokens(data)

        def one(rank: int) -> object:
            cache = self.caches[rank]
            result = cache.match_prefix(tokens, ns)
            if not result.host_pages:
                return None
            return cache.load_back(result.host_node)

        if self.each_call(one)[0] is not None:
            event("load-back started")

    @rule(data=st.data())
    def prefetch(self, data: st.DataObject) -> None:
        tokens, ns = self.draw_tokens(data)
        if self.each_call(lambda rank: self.caches[rank].prefetch(tokens, ns))[0] is not None:
            event("prefetch started")

    def open_prefetches(self) -> list[int]:
        l3 = self.caches[0].l3
        assert l3 is not None
        return sorted(op_id for op_id, op in l3.prefetches.items() if not op.cancelled)

    @precondition(lambda self: self.tp is not None and self.open_prefetches())
    @rule(data=st.data(), commit=st.booleans())
    def prefetch_end(self, data: st.DataObject, commit: bool) -> None:
        op_id = data.draw(st.sampled_from(self.open_prefetches()), label="prefetch op")
        ready = self.each_call(lambda rank: self.caches[rank].prefetch_ready(op_id))[0]
        if not ready and not data.draw(st.booleans(), label="abort while waiting"):
            return
        self.prefetch_end_op(op_id, commit=commit)

    def prefetch_end_op(self, op_id: int, *, commit: bool) -> None:
        def one(rank: int) -> int | None:
            cache = self.caches[rank]
            l3 = cache.l3
            assert l3 is not None
            op = l3.prefetches[op_id]
            if not commit:
                cache.prefetch_abort(op_id)
                return None
            arrived, host = op.arrived, op.host[: op.arrived].copy()
            digests = op.digests
            added = cache.prefetch_commit(op_id)
            if arrived and op.state is not None:
                pages = [PageHash(digests[i * 32 : (i + 1) * 32]) for i in range(arrived)]
                kv = [shard_kv(self.shape, p, self.kv_rank(rank)) for p in pages]
                want = torch.cat(kv, dim=2)
                got = self.host_pools[rank].read_pages(host)
                assert torch.equal(got.view(torch.int16), want.view(torch.int16)), "prefetched"
            return added

        added = self.each_call(one)[0]
        if added:
            event("prefetch committed pages")

    # ------------------------------------------------------------ per-rank background work
    @rule(data=st.data())
    def copies_run(self, data: st.DataObject) -> None:
        for rank in self.ranks(data):
            if data.draw(st.integers(0, 5), label="copy fails") == 0:
                self.failing_copies[rank] = True
            self.copy_workers[rank].run_next()
            self.failing_copies[rank] = False

    @rule(data=st.data())
    def store_jobs_run(self, data: st.DataObject) -> None:
        for rank in self.ranks(data):
            fault = data.draw(st.sampled_from([None, None, None, "put", "get"]), label="fault")
            if fault is not None:
                self.backends[rank].fail_next(op=fault, after=data.draw(st.integers(0, 2)))
            self.store_workers[rank].run_next()
            self.backends[rank].clear_faults()
            if fault is not None:
                event(f"one rank's store {fault} failed")

    @rule(data=st.data())
    def store_loses(self, data: st.DataObject) -> None:
        """An object of one rank's shard disappears from the shared store."""
        keys = self.store.visible_keys()
        if keys:
            key = data.draw(st.sampled_from(sorted(keys, key=str)), label="lost key")
            self.store.drop([key])
            self.lost_since_restart = True
            event("the store lost an object of one shard")

    def settle(self, rounds: int) -> None:
        """``rounds`` times: every copy and store job runs, the clock moves past every back-off,
        every rank checks events."""
        for _ in range(rounds):
            self.clock[0] += 1.0
            for rank in range(self.size):
                self.copy_workers[rank].run_all()
                self.store_workers[rank].run_all()
            self.each("check_events")

    @rule(data=st.data(), restart=st.booleans(), settled=st.booleans())
    def outage(self, data: st.DataObject, restart: bool, settled: bool) -> None:
        """Some ranks' store becomes unreachable; with ``restart``, the master restarted: every
        object is gone (with ``settled``, after every backup so far was stored)."""
        if restart and settled:
            self.settle(6)
        for rank in self.ranks(data):
            self.backends[rank].unreachable = True
        if restart:
            self.store.drop(list(self.store.visible_keys()))
            self.restarted, self.lost_since_restart = True, False
            self.recoveries_at_restart = [self.link(rank).recoveries for rank in range(self.size)]
            event("the master restarted")

    @precondition(
        lambda self: (
            self.tp is not None and not self.restarted and any(b.unreachable for b in self.backends)
        )
    )
    @rule()
    def outage_ends(self) -> None:
        """Every rank's store is reachable again, and the probes' back-off has passed (a restart's
        outage ends in :meth:`republished_after_restart`)."""
        for backend in self.backends:
            backend.unreachable = False
        self.clock[0] += 1.0

    def link(self, rank: int) -> Any:
        l3 = self.caches[rank].l3
        assert l3 is not None
        return l3.link

    def l2_pages(self, rank: int) -> list[tuple[Namespace, PageHash]]:
        """Every page rank ``rank`` holds in L2, with its namespace."""
        out = []
        for node in self.caches[rank].nodes():
            if node.state in HOST_VALID and node.host is not None:
                digests = node.hashes
                out += [
                    (node.namespace, PageHash(digests[i * 32 : (i + 1) * 32]))
                    for i in range(node.num_pages)
                ]
        return out

    @precondition(lambda self: self.tp is not None and self.inserted)
    @rule(data=st.data())
    def master_restart(self, data: st.DataObject) -> None:
        """The master restarts once every backup so far was stored, some ranks lose it for a
        while, and the outage ends: :meth:`outage` and :meth:`republished_after_restart` in one
        step (the case where only the re-publish can bring L2's pages back). An outage still on
        ends first: otherwise the backups it deferred would store L2's pages after the restart
        anyway, and a lost re-publish would go unseen."""
        for backend in self.backends:
            backend.unreachable = False
        self.clock[0] += 1.0  # the probes' back-off is over
        self.settle(6)
        if self.store.visible_keys():
            event("a restart wipes pages only a re-publish can bring back")
        self.outage(data, restart=True, settled=False)
        self.republished_after_restart(data)

    @precondition(lambda self: self.tp is not None and self.restarted)
    @rule(data=st.data())
    def republished_after_restart(self, data: st.DataObject) -> None:
        """A new request while the store is away (its backups meet the outage), then the outage ends
        and everything settles. If a rank's link saw the restart (it recovered since), every page
        in any rank's L2 is in the store again under that rank's keys: the re-publish was agreed
        and done by every rank, also by ranks whose own link never noticed."""
        if any(backend.unreachable for backend in self.backends):
            self.fresh_request(data)  # its backups meet the outage
            self.settle(3)  # they fail, and so do the probes: the down ranks' links are down
            self.outage_ends()
        self.settle(12)
        self.restarted = False
        links = [self.link(rank) for rank in range(self.size)]
        assert all(link.state is Health.HEALTHY for link in links), [x.state for x in links]
        seen = any(
            link.recoveries > before
            for link, before in zip(links, self.recoveries_at_restart, strict=True)
        )
        if not seen:
            event("a restart no rank's link saw")
            return
        if self.lost_since_restart:
            return
        event("a restart seen: every rank's L2 is in the store again")
        for rank in range(self.size):
            for namespace, page in self.l2_pages(rank):
                found = self.backends[rank].exists(namespace, [page])
                assert found == 1, f"rank {rank}: an L2 page is not in the store after a restart"

    def agree_now(self) -> None:
        """Two ``check_events`` on every rank: the agreement the first starts, the second applies
        (agreements are pipelined)."""
        self.each("check_events")
        self.each("check_events")

    @precondition(lambda self: self.tp is not None and any(c.pending().write for c in self.caches))
    @rule(data=st.data())
    def one_rank_ahead(self, data: st.DataObject) -> None:
        """One rank's copy lands, the others' not yet, and every rank checks events: the step where
        only some ranks have something to report (every rank must still join the agreement)."""
        rank = data.draw(st.integers(0, self.size - 1), label="rank ahead")
        if self.copy_workers[rank].run_next():
            event("one rank ahead at an agreement")
        self.each("check_events")

    @rule(settle=st.booleans())
    def check_events(self, settle: bool) -> None:
        """Every rank's ``check_events``: one agreement (with ``settle``, every job runs first)."""
        rounds = 3 if settle else 1
        for _ in range(rounds):
            if settle:
                for rank in range(self.size):
                    self.copy_workers[rank].run_all()
                    self.store_workers[rank].run_all()
            events = self.each("check_events")
            if events[0]:
                event("an agreement applied copies")

    @precondition(lambda self: self.tp is not None)
    @rule()
    def reset_when_idle(self) -> None:
        """The scheduler resets once the cache is idle: ``idle()`` answers alike on every rank (it
        derives from agreed facts only: a backup parked because one rank's store is down keeps
        every rank busy while another rank's job of it runs or is due), and then ``reset`` on
        every rank drops every page. Requests after it reuse the freed host pages; a job still
        reading them would put their new bytes under the old pages' keys, which ``round_trip``
        reads back."""
        if not self.each_call(lambda rank: self.caches[rank].idle())[0]:
            return
        parked = any(cache.l3 is not None and cache.l3.backups for cache in self.caches)
        self.each_call(lambda rank: self.caches[rank].reset())
        self.nothing_waits_after_reset()
        event("reset on every rank (idle)")
        if parked:
            event("reset dropped a backup parked by an outage")

    def take_some_stores_down(self, data: st.DataObject) -> list[int]:
        """Everything settled, then the store of some ranks (not all) becomes unreachable."""
        self.settle(3)
        down = data.draw(
            st.lists(
                st.integers(0, self.size - 1), min_size=1, max_size=self.size - 1, unique=True
            ),
            label="ranks whose store goes down",
        )
        for rank in down:
            self.backends[rank].unreachable = True
        return down

    def nothing_waits_after_reset(self) -> None:
        """After ``reset`` no backup op is left anywhere: none deferred, none waiting to resume
        (an op left in the resume list would count pages that are gone)."""
        for rank, cache in enumerate(self.caches):
            assert cache.l3 is not None
            assert cache.l3.backup.deferred_pages() == 0, f"rank {rank}: pages still deferred"
            assert not cache.l3.backup.ready and not cache.l3.backup.ops, f"rank {rank}: ops left"

    def fresh_request(self, data: st.DataObject) -> None:
        """A sequence never seen before, with room made in L1 (L2 copies stay), its copies landed
        and agreed: its backups are queued, or deferred on a rank whose store is down."""
        self.fresh += 1
        tokens = tuple(range(10_000 * self.fresh, 10_000 * self.fresh + 2 * self.page_size))
        self.evict(32, host=False)
        self.request_on_every_rank(tokens, data.draw(st.sampled_from(NAMESPACES)))
        for rank in range(self.size):
            self.copy_workers[rank].run_all()
        self.agree_now()
        self.agree_now()

    def idle_means_no_job_due(self) -> bool:
        """Whether the cache is idle (alike on every rank); if so, no rank has a backup call in
        flight or a retry waiting for its back-off, and no rank whose store is healthy (so no
        probe is queued there) has a store job queued: each would read host pages that a
        ``reset`` now frees."""
        idle: bool = self.each_call(lambda rank: self.caches[rank].idle())[0]
        if idle:
            for rank in range(self.size):
                l3 = self.caches[rank].l3
                assert l3 is not None
                assert not l3.link.calls[Lane.WRITE], f"rank {rank}: idle, a backup call runs"
                assert not l3.backup._retry, f"rank {rank}: idle, a retry is due"
                healthy = l3.link.state is Health.HEALTHY
                assert not (healthy and self.store_workers[rank].jobs), f"rank {rank}: a job due"
        return idle

    @precondition(
        lambda self: (
            self.tp is not None
            and not self.restarted
            and not any(b.unreachable for b in self.backends)
        )
    )
    @rule(data=st.data(), back_first=st.booleans())
    def reset_after_an_outage(self, data: st.DataObject, back_first: bool) -> None:
        """Some ranks' store goes down; a new sequence's backup is deferred there (parked on every
        rank) while the other ranks' jobs of it have not run. No rank may answer idle while one of
        those jobs is due; once they ran (and, with ``back_first``, once the down ranks' stores came
        back during a ``check_events``: their deferred jobs must wait for the agreement, not start
        then), the scheduler resets on every rank and a newer sequence takes the freed host pages.
        Once everything settled, the store holds every page's own bytes (a job that read a freed
        page would have put the newer sequence's bytes under the older one's keys)."""
        down = self.take_some_stores_down(data)
        self.fresh_request(data)
        self.settle(2)  # the down ranks' links fail their calls and go down
        self.fresh_request(data)  # deferred on the down ranks, queued on the others
        self.idle_means_no_job_due()
        for rank in range(self.size):
            if rank not in down:
                self.store_workers[rank].run_all()
        self.agree_now()
        self.agree_now()
        if back_first:
            for rank in down:
                self.backends[rank].unreachable = False
            self.clock[0] += 1.0  # the probes' back-off is over
            self.each("check_events")  # the probes are issued
            for rank in down:
                self.store_workers[rank].run_all()
            self.each("check_events")  # their answers: the links are back
        if self.idle_means_no_job_due():
            self.each_call(lambda rank: self.caches[rank].reset())
            self.nothing_waits_after_reset()
            event("reset after an outage, a backup parked")
            self.fresh_request(data)  # takes the host pages the parked backup read
        for backend in self.backends:
            backend.unreachable = False
        self.clock[0] += 1.0
        self.settle(8)
        self.store_holds_the_right_bytes()

    @precondition(
        lambda self: (
            self.tp is not None
            and self.backoff > 0
            and not self.restarted
            and not any(b.unreachable for b in self.backends)
        )
    )
    @rule(data=st.data())
    def retry_waits_on_a_healthy_rank(self, data: st.DataObject) -> None:
        """Each rank on a clock of its own, as separate processes are: some ranks' store goes
        down under a new sequence's backup, and only their clocks move. The ranks agree to retry
        it; there the retry meets a link that is down and is deferred (the op parked), while on
        the other ranks it waits for its back-off, to start on their own clock with no agreement.
        The invariant then requires that the cache is not idle (the review's find: a retry
        counted as quiet let ``reset`` free the pages it would read)."""
        down = self.take_some_stores_down(data)
        self.fresh_request(data)
        for _ in range(4):
            for rank in down:
                self.ahead[rank] += 1.0
            for rank in range(self.size):
                self.store_workers[rank].run_all()
            self.each("check_events")
        healthy = [r for r in range(self.size) if r not in down]
        if any(self.caches[r].l3.backup._retry for r in healthy):  # type: ignore[union-attr]
            event("a retry waits on a healthy rank's clock")
        for backend in self.backends:
            backend.unreachable = False

    @precondition(lambda self: self.tp is not None and self.inserted)
    @rule(data=st.data())
    def round_trip(self, data: st.DataObject) -> None:
        """A sequence goes to L3 and comes back by prefetch, one rank's reads failing part-way
        (the ranks must agree on the shortest read)."""
        tokens, ns = data.draw(st.sampled_from(self.inserted), label="inserted")
        self.check_events(settle=True)
        self.evict(32, host=True)
        op_ids = self.each_call(lambda rank: self.caches[rank].prefetch(tokens, ns))
        if op_ids[0] is None:
            return
        self.agree_now()  # the query results (reads not run yet)
        for rank in range(self.size):
            self.store_workers[rank].run_all()  # queries
        self.agree_now()  # the agreed hit: reserve and fetch
        short = data.draw(st.integers(0, self.size - 1), label="short rank")
        self.backends[short].fail_next(op="get", after=data.draw(st.integers(0, 2), label="after"))
        for rank in range(self.size):
            self.store_workers[rank].run_all()
        self.backends[short].clear_faults()
        self.agree_now()
        if self.each_call(lambda rank: self.caches[rank].prefetch_ready(op_ids[0]))[0]:
            self.prefetch_end_op(op_ids[0], commit=True)

    # ------------------------------------------------------------ invariants
    @invariant()
    def idle_only_with_no_backup_due(self) -> None:
        if self.tp is not None:
            self.idle_means_no_job_due()

    @invariant()
    def deferred_pages_counted(self) -> None:
        """Each rank's deferred-page count is the pages of the ops it holds deferred or waiting
        to resume (a count left too high makes later deferrals overflow and drop backups)."""
        for rank, cache in enumerate(self.caches):
            backups = cache.l3.backup if cache.l3 is not None else None
            if backups is not None:
                held = sum(op.num_pages for op in [*backups.deferred, *backups.ready])
                assert backups.deferred_pages() == held, f"rank {rank}: deferred pages miscounted"

    @invariant()
    def ranks_identical(self) -> None:
        if self.tp is None:
            return
        first = tree_view(self.caches[0])
        for rank in range(1, self.size):
            assert tree_view(self.caches[rank]) == first, f"rank {rank}'s tree differs"
        reports = self.tp.reports
        assert all(log == reports[0] for log in reports[1:]), "different collective calls"
        agreements = {cache.agreement.agreements for cache in self.caches if cache.agreement}
        assert len(agreements) == 1


TestTpDifferential = TpDifferential.TestCase
TestTpDifferential.settings = settings(max_examples=100, stateful_step_count=40, deadline=None)
