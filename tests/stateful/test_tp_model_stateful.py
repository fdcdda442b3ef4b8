"""N tensor-parallel ranks of the cache model (``kvstrata.model.cluster.TpModel``), driven by
Hypothesis with different background results per rank (SPEC §10; issue 18).

Every rank has its own store (its shard of the key space). Scheduler verbs go to every rank; each
rank's copies land or fail, its backups store or fail, its prefetch reads deliver what its own store
holds (a rule evicts objects from one rank's store only), all in its own order; an agreement applies
the minimum. Checked after every agreement (``TpModel.check``): every rank's tree, slots, locks and
pending ops equal rank 0's. Oracles that do not trust the model:

* bytes: every L1 slot a match returns holds the page hash of exactly that prefix, on every rank;
* a prefetch read never delivers more pages on any rank than that rank's store held (the model
  reads every page it delivers from each rank's own store, and checks its content);
* a scheduler verb answers the same on every rank (``TpModel.each``).
"""

from __future__ import annotations

import attrs
import hypothesis.strategies as st
from hypothesis import event, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvstrata.model.cache import CacheConfig, CacheModel, WritePolicy
from kvstrata.model.cluster import TpModel
from kvstrata.model.errors import CapacityError
from kvstrata.model.keys import (
    DEFAULT_NAMESPACE,
    KeySpace,
    KVKind,
    ModelIdentity,
    Namespace,
    Shard,
    chain_page_hashes,
    parse_store_key,
)
from kvstrata.model.lifecycles import BackupState, PrefetchState
from kvstrata.model.store import StoreModel

NAMESPACES = (DEFAULT_NAMESPACE, Namespace(extra_key="lora-1"))


@st.composite
def related_tokens(draw: st.DrawFn, known: list[tuple[int, ...]]) -> tuple[int, ...]:
    if known and draw(st.booleans()):
        base = draw(st.sampled_from(known))
        cut = draw(st.integers(0, len(base)))
        tail = draw(st.lists(st.integers(1, 3), max_size=3))
        return (*base[:cut], *tail)[:8]
    return tuple(draw(st.lists(st.integers(1, 3), max_size=6)))


class TpModelMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.known: list[tuple[int, ...]] = []
        self.inserted: list[tuple[tuple[int, ...], Namespace]] = []

    @initialize(
        data=st.data(),
        size=st.sampled_from([2, 3, 4]),
        page_size=st.integers(1, 2),
        device_pages=st.integers(4, 8),
        host_pages=st.integers(4, 10),
    )
    def setup(
        self, data: st.DataObject, size: int, page_size: int, device_pages: int, host_pages: int
    ) -> None:
        identity = ModelIdentity("tiny", "bf16", KVKind.MHA, page_size=page_size)
        base = CacheConfig(
            page_size=page_size,
            device_pages=device_pages,
            host_pages=host_pages,
            write_policy=data.draw(
                st.sampled_from([WritePolicy.WRITE_THROUGH, WritePolicy.WRITE_THROUGH_SELECTIVE]),
                label="policy",
            ),
            write_through_threshold=1,
            prefetch_threshold=page_size,
            keys=KeySpace(identity),
        )
        ranks = [
            CacheModel(
                attrs.evolve(base, keys=KeySpace(identity, shard=Shard(tp_rank=r, tp_size=size))),
                StoreModel(),
            )
            for r in range(size)
        ]
        self.tp = TpModel(ranks)
        self.page_size = page_size
        self.host_pages = host_pages

    def draw_tokens(self, data: st.DataObject) -> tuple[tuple[int, ...], Namespace]:
        tokens = data.draw(related_tokens(self.known), label="tokens")
        return tokens, data.draw(st.sampled_from(NAMESPACES), label="namespace")

    def rank(self, data: st.DataObject) -> int:
        return data.draw(st.integers(0, self.tp.size - 1), label="rank")

    # ------------------------------------------------------------ scheduler verbs (every rank)
    @rule(data=st.data())
    def insert(self, data: st.DataObject) -> None:
        self.insert_tokens(*self.draw_tokens(data))

    def insert_tokens(self, tokens: tuple[int, ...], ns: Namespace) -> None:
        tp = self.tp
        result = tp.each("match_prefix", tokens, ns)
        pages = chain_page_hashes(tokens, self.page_size, ns)
        for rank in tp.ranks:
            assert rank.device_content(result.device_slots) == pages[: result.device_pages]
        locked = not tp.ranks[0].tree.nodes[result.device_node].is_root
        if locked:
            tp.each("lock", result.device_node)
        try:
            fresh = tp.each("alloc_device", len(pages) - result.device_pages)
        except CapacityError:
            event("request refused: L1 full")
            fresh = None
        if fresh is not None:
            for rank in tp.ranks:
                for slot, page in zip(fresh, pages[result.device_pages :], strict=True):
                    rank.write_device(slot, page)
            tp.each("insert", tokens, ns, result.device_slots + fresh)
        if locked:
            tp.each("unlock", result.device_node)
        if fresh is None:
            return
        if tokens not in self.known:
            self.known.append(tokens)
        if (tokens, ns) not in self.inserted:
            self.inserted.append((tokens, ns))

    @rule(pages=st.sampled_from([0, 1, 2, 4, 32]), host=st.booleans())
    def evict(self, pages: int, host: bool) -> None:
        if host:
            self.tp.each("evict", pages)  # an L1 leaf with a host copy becomes host-only first
        self.tp.each("evict_host" if host else "evict", pages)

    @rule(data=st.data())
    def load_back(self, data: st.DataObject) -> None:
        result = self.tp.each("match_prefix", *self.draw_tokens(data))
        if result.host_pages and self.tp.each("load_back", result.host_node) is not None:
            event("load-back started")

    @precondition(
        lambda self: any(op.state is BackupState.QUEUED for op in self.tp.ranks[0].backup_ops)
    )
    @rule()
    def start_backup(self) -> None:
        self.tp.each("start_backup")

    @rule(data=st.data())
    def prefetch(self, data: st.DataObject) -> None:
        tokens, ns = self.draw_tokens(data)
        fits = self.fetchable()
        if fits and data.draw(st.booleans(), label="an inserted sequence"):
            tokens, ns = data.draw(st.sampled_from(fits), label="inserted")
            if data.draw(st.booleans(), label="cold: settled, then out of L1 and L2"):
                self.everything_lands()  # in every rank's store (unless a store lost it)
                self.evict(1 << 10, host=True)  # what no lock or pin keeps
        if self.tp.prefetch(tokens, ns) is not None:
            event("prefetch started")
        else:
            event("prefetch: nothing to fetch, or no room")

    def fetchable(self) -> list[tuple[tuple[int, ...], Namespace]]:
        """The inserted sequences a prefetch may fetch whole (it reserves at most half of L2)."""
        return [
            (t, n) for t, n in self.inserted if len(t) // self.page_size <= self.host_pages // 2
        ]

    @precondition(lambda self: self.fetchable())
    @rule(data=st.data())
    def read_then_lose(self, data: st.DataObject) -> None:
        """A settled sequence leaves L1 and L2 and is prefetched; one rank's read returns and its
        store then loses the first page it read; the other ranks' reads return and the ranks
        agree: each applies the bytes its own read got (the fuzz run's find of 2026-11-28; the
        generic rules reach this in under 2% of the examples)."""
        tokens, ns = data.draw(st.sampled_from(self.fetchable()), label="inserted")
        self.everything_lands()
        self.evict(1 << 10, host=True)
        tp = self.tp
        op_id = tp.prefetch(tokens, ns)
        if op_id is None:
            return
        first = self.rank(data)
        tp.read_done(first, op_id)
        self.lose_read_page(first, op_id)
        for rank in range(tp.size):
            if rank != first:
                tp.read_done(rank, op_id)
        self.agree(settle=False)

    @precondition(lambda self: self.tp.ranks[0].prefetch_ops)
    @rule(data=st.data(), commit=st.booleans())
    def prefetch_end(self, data: st.DataObject, commit: bool) -> None:
        ops = self.tp.ranks[0].prefetch_ops
        op_id = data.draw(st.sampled_from(sorted(ops)), label="prefetch op")
        state = ops[op_id].state
        if state is PrefetchState.CANCELLING:
            self.tp.each("prefetch_drain", op_id)
        elif commit and state is PrefetchState.COMPLETE:
            self.tp.each("prefetch_commit", op_id)
        elif state in (PrefetchState.LOADING, PrefetchState.COMPLETE):
            self.tp.each("prefetch_abort", op_id)

    # ------------------------------------------------------------ per-rank background results
    def ranks(self, data: st.DataObject) -> list[int]:
        """The ranks whose job finishes now: usually all of them, else a subset."""
        every = list(range(self.tp.size))
        if data.draw(st.booleans(), label="all ranks"):
            return every
        return data.draw(st.lists(st.sampled_from(every), min_size=1, unique=True), label="ranks")

    @precondition(lambda self: self.tp.ranks[0].write_ops or self.tp.ranks[0].load_ops)
    @rule(data=st.data())
    def copy_done(self, data: st.DataObject) -> None:
        model = self.tp.ranks[0]
        write = bool(model.write_ops) and (not model.load_ops or data.draw(st.booleans()))
        ops = model.write_ops if write else model.load_ops
        for rank in self.ranks(data):
            if all(op.op_id in self.tp.reports[rank].copies for op in ops):
                continue
            landed = data.draw(st.sampled_from([True, True, True, False]), label="landed")
            self.tp.copy_done(rank, write=write, landed=landed)
            if not landed:
                event("one rank's copy failed")

    @precondition(
        lambda self: any(op.state is BackupState.IN_FLIGHT for op in self.tp.ranks[0].backup_ops)
    )
    @rule(data=st.data())
    def backup_done(self, data: st.DataObject) -> None:
        ops = [op for op in self.tp.ranks[0].backup_ops if op.state is BackupState.IN_FLIGHT]
        op = data.draw(st.sampled_from(ops), label="backup op")
        for rank in self.ranks(data):
            stored = data.draw(st.sampled_from([True, True, False]), label="stored")
            self.tp.backup_done(rank, op.op_id, stored=stored)

    @precondition(
        lambda self: any(
            op.state is PrefetchState.LOADING for op in self.tp.ranks[0].prefetch_ops.values()
        )
    )
    @rule(data=st.data())
    def read_done(self, data: st.DataObject) -> None:
        ops = self.tp.ranks[0].prefetch_ops
        loading = sorted(i for i, op in ops.items() if op.state is PrefetchState.LOADING)
        op_id = data.draw(st.sampled_from(loading), label="prefetch op")
        for rank in self.ranks(data):
            if self.tp.read_done(rank, op_id) < ops[op_id].limit - ops[op_id].arrived:
                event("one rank's read came back short")
            if data.draw(st.booleans(), label="then its store loses a page it read"):
                self.lose_read_page(rank, op_id)

    def lose_read_page(self, rank_index: int, op_id: int) -> None:
        """Rank ``rank_index``'s store drops an object of a page its read of ``op_id`` delivered,
        before the ranks agree on that read: the agreed pages are the bytes each rank read (the
        fuzz run's find: a read applied from the store as it was then ended the op per rank)."""
        rank = self.tp.ranks[rank_index]
        op = rank.prefetch_ops[op_id]
        if not self.tp.reports[rank_index].reads[op_id]:
            return
        first = op.pages[op.arrived]  # every page the ranks may agree on comes after it
        items = [item for item in rank.store.visible_items() if item[1][0] == first]
        if items:
            rank.store_evict(items[0][0])
            event("one rank's store lost an object of a page its read delivered, before agreeing")

    @rule(data=st.data())
    def store_loses(self, data: st.DataObject) -> None:
        """One rank's store drops one of its objects (its shard only)."""
        rank = self.tp.ranks[self.rank(data)]
        items = rank.store.visible_items()
        if not items:
            return
        key, _ = data.draw(st.sampled_from(items), label="lost key")
        rank.store_evict(key)
        event(f"one rank's store lost a {parse_store_key(key).pool} object")

    @rule(data=st.data())
    def store_loses_in_flight(self, data: st.DataObject) -> None:
        """One rank's store drops an object of a page whose backup is in flight (one stored
        before, which that backup does not put again). Each rank's job checked the store when it
        returned, so an agreed ``stored`` must end the op alike on every rank (the fuzz run's find:
        an ack that looked at the store again ended it per rank). A no-op when nothing fits, not
        a precondition (a rule set that swarm testing leaves with only failed preconditions
        aborts the example)."""
        pages = {
            page
            for op in self.tp.ranks[0].backup_ops
            if op.state is BackupState.IN_FLIGHT
            for page in op.pages
        }
        rank = self.tp.ranks[self.rank(data)]
        items = [item for item in rank.store.visible_items() if item[1][0] in pages]
        if not items:
            return
        key, _ = data.draw(st.sampled_from(items), label="lost key")
        rank.store_evict(key)
        event("one rank's store lost an object of a page whose backup is in flight")

    @precondition(lambda self: self.inserted)
    @rule(data=st.data())
    def recompute_under_backup(self, data: st.DataObject) -> None:
        """A sequence whose pages every store holds leaves L1 and L2 and is computed again: the
        backup of its new node covers pages the stores hold already (not put again); every rank's
        job returns stored, then (``store_loses_in_flight``) one rank's store loses an object of
        such a page before the agreement, which must end the op alike on every rank (the fuzz
        run's find of 2026-11-27; the generic rules reach this in about 1% of the examples)."""
        tokens, ns = data.draw(st.sampled_from(self.inserted), label="inserted")
        self.everything_lands()
        self.evict(1 << 10, host=True)
        self.insert_tokens(tokens, ns)
        tp, model = self.tp, self.tp.ranks[0]
        for rank in range(tp.size):  # the write-through lands: the backup is queued
            for op in (*model.write_ops, *model.load_ops):
                tp.reports[rank].copies.setdefault(op.op_id, True)
        tp.agree()
        while any(op.state is BackupState.QUEUED for op in model.backup_ops):
            tp.each("start_backup")
        for rank in range(tp.size):
            for backup in model.backup_ops:
                if backup.state is BackupState.IN_FLIGHT:
                    tp.reports[rank].backups.setdefault(backup.op_id, True)
        self.store_loses_in_flight(data)
        self.agree(settle=False)

    def everything_lands(self) -> None:
        """Every rank finishes every job it has, successfully, and the ranks agree (twice: the
        backups of the acked write-throughs, then their results)."""
        tp = self.tp
        for _ in range(3):
            model = tp.ranks[0]
            while any(op.state is BackupState.QUEUED for op in model.backup_ops):
                tp.each("start_backup")
            for rank in range(tp.size):
                for op in (*model.write_ops, *model.load_ops):
                    tp.reports[rank].copies.setdefault(op.op_id, True)
                for backup in model.backup_ops:
                    tp.reports[rank].backups.setdefault(backup.op_id, True)
                for op_id, op in model.prefetch_ops.items():
                    if op.state is PrefetchState.LOADING and op_id not in tp.reports[rank].reads:
                        tp.read_done(rank, op_id)
            tp.agree()

    @rule(settle=st.booleans())
    def agree(self, settle: bool) -> None:
        """The ranks agree on what they reported; with ``settle`` every job lands first."""
        if settle:
            self.everything_lands()
        before = [len(r.write_ops) + len(r.load_ops) + len(r.backup_ops) for r in self.tp.ranks]
        self.tp.agree()
        after = [len(r.write_ops) + len(r.load_ops) + len(r.backup_ops) for r in self.tp.ranks]
        if after != before:
            event("an agreement changed the trees")

    @invariant()
    def ranks_identical(self) -> None:
        if hasattr(self, "tp"):
            self.tp.check()


TestTpModel = TpModelMachine.TestCase
TestTpModel.settings = settings(max_examples=150, stateful_step_count=50, deadline=None)
