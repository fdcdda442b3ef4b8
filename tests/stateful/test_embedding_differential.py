"""The embedding cache implementation driven side by side with its model, two nodes over one shared
store (SPEC §6, §7, §10).

Two :class:`EmbeddingCacheModel` nodes over one :class:`StoreModel`, and two :class:`EmbeddingCache`
nodes (each with its own pool, its own :class:`ManualJoinableExecutor` and its own
:class:`MemoryEmbeddingStore` adapter) over one :class:`MemoryStore`; both stores start warm with the
same objects (pushed by a node that is gone). Every rule picks a node and applies one operation to
that node on both sides: insert / re-insert, prefetch (also steered toward objects the other node
pushed), finish the node's oldest I/O (``finish_io``: ack or fail it as a whole; the implementation's
executor is FIFO), ``partial_io`` (the oldest op answers item by item: a chosen subset of its items
fails, and on the implementation side a chosen non-empty subset of each failed item's store objects
fails while every other object is served, each failed object answering FAILED, or FULL for a put /
MISSING for a get), the store dropping an object, local eviction, get, exists and bad input. An
insert, commit or prefetch may be made with ``wait=True``: the implementation then runs the node's
queued jobs itself up to its own op and applies their results before it returns, and the model
acks the same ops, oldest first (``settle``).

After every step, per node: the same media are cached in the same states with the same used units,
in the same LRU order (by stamp; part 29), the same ops pend, every request is ready on both sides
or neither, the counters agree with the model's (items new, re-pushed, pushed, loaded, failed,
evicted; and the failed put items the store refused for room are the ones ``partial_io`` failed with
FULL); and the store holds an embedding (every object of it) exactly when the model's store does.
Every ``get`` checks bytes: a hit on either side must be a hit on the other, and the tensor must
equal, bit for bit, the embedding its media hash names. This is what shows that what one node pushes
(or pushes again after the store lost it) the other can load.

Not driven here: a node inserting a media item whose push by the *other* node is still pending. The
model reserves the key when the first push starts (the second node's item is ``store_skipped``),
while an implementation node cannot see another node's put before its own put runs (with Mooncake
its put then answers 0 without writing, MOONCAKE.md §3.4). ``insert_batch`` leaves such items out of
the batch; the model's own machine (``test_embedding_stateful.py``) covers that interleaving.
"""

from __future__ import annotations

import attrs
import hypothesis.strategies as st
import pytest
import torch
from hypothesis import event, note, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvstrata.impl.embedding import (
    EmbeddingCache,
    EmbeddingPool,
    ExtentStatus,
    Loan,
    MemoryEmbeddingStore,
    PoolShape,
    Reservation,
)
from kvstrata.impl.errors import CapacityError, MisuseError
from kvstrata.impl.executors import ManualExecutor, ManualJoinableExecutor
from kvstrata.impl.storage.memory import MemoryStore
from kvstrata.model.embedding import EmbeddingCacheModel, Hold, OpHandle, OpKind, Unit
from kvstrata.model.keys import (
    KeySpace,
    KVKind,
    ModelIdentity,
    PageHash,
    Shard,
    StoreKey,
    content_hash,
)
from kvstrata.model.lifecycles import EntryState
from kvstrata.model.store import StoreModel

DIM = 4
UNIT_TOKENS = 2
KEYSPACE = KeySpace(
    ModelIdentity(name="clip", dtype="fp16", kind=KVKind.EMBEDDING, dim=DIM),
    shard=Shard.replicated(),
)
MEDIA = tuple(content_hash(f"media-{i}".encode()) for i in range(5))
NODES = 2

nodes = st.integers(0, NODES - 1)
waits = st.sampled_from([False, False, True])  # wait=True: the verb settles its own op
picks = st.lists(st.integers(0, len(MEDIA) - 1), min_size=1, max_size=3)


def embedding(media: PageHash, tokens: int) -> torch.Tensor:
    """The tensor every test puts under ``media``: a pure function of the hash."""
    gen = torch.Generator().manual_seed(int.from_bytes(media.digest[:8], "little"))
    return torch.randn((tokens, DIM), generator=gen).to(torch.float16)


@attrs.frozen
class Pending:
    """An op started on ``node``: the model's handle and the implementation's op id."""

    node: int
    handle: OpHandle
    op: int


class EmbeddingDifferential(RuleBasedStateMachine):
    @initialize(
        sizes=st.lists(st.integers(1, 3), min_size=len(MEDIA), max_size=len(MEDIA)),
        odd=st.lists(st.booleans(), min_size=len(MEDIA), max_size=len(MEDIA)),
        capacities=st.tuples(st.integers(4, 6), st.integers(4, 6)),
        warm=st.lists(st.booleans(), min_size=len(MEDIA), max_size=len(MEDIA)),
    )
    def setup(
        self, sizes: list[int], odd: list[bool], capacities: tuple[int, int], warm: list[bool]
    ) -> None:
        self.size = dict(zip(MEDIA, sizes, strict=True))
        # the last unit of an odd item is half full: object sizes differ from unit sizes
        self.tokens = {m: UNIT_TOKENS * s - o for m, s, o in zip(MEDIA, sizes, odd, strict=True)}
        self.model_store = StoreModel()
        self.objects = MemoryStore()
        self.models = tuple(
            EmbeddingCacheModel(name, capacity, KEYSPACE, self.model_store)
            for name, capacity in zip("ab", capacities, strict=True)
        )
        self.stores = tuple(MemoryEmbeddingStore(self.objects) for _ in range(NODES))
        self.executors = tuple(ManualJoinableExecutor() for _ in range(NODES))
        self.impls = tuple(
            EmbeddingCache(
                EmbeddingPool(PoolShape(capacity, UNIT_TOKENS, DIM, torch.float16)),
                store,
                KEYSPACE,
                executor=executor,
            )
            for capacity, store, executor in zip(
                capacities, self.stores, self.executors, strict=True
            )
        )
        seeder = EmbeddingCache(
            EmbeddingPool(PoolShape(3, UNIT_TOKENS, DIM, torch.float16)),
            MemoryEmbeddingStore(self.objects),
            KEYSPACE,
            executor=ManualExecutor(),
        )
        for media, present in zip(MEDIA, warm, strict=True):
            if present:  # pushed by a node that is gone
                key = self.models[0].key(media)
                self.model_store.begin_put(key)
                self.model_store.end_put(
                    key, tuple(Unit(media, i) for i in range(self.size[media]))
                )
                seeder.insert_batch([media], [embedding(media, self.tokens[media])])
                seeder.executor.run_all()
                seeder.poll()
                seeder.evict(3)
        seeder.close()
        self.pending: list[Pending] = []
        self.requests: dict[str, int] = {}
        self.pushed_by: dict[PageHash, int] = {}
        self.store_full = [0] * NODES  # put items partial_io failed with FULL, per node
        self.reservations: list[tuple[int, Hold, Reservation, tuple[PageHash, ...]]] = []
        self.loans: list[tuple[int, Hold, Loan, tuple[PageHash, ...]]] = []

    # ------------------------------------------------------------------------------ helpers

    def batch(self, chosen: list[int]) -> list[PageHash]:
        return [MEDIA[i] for i in chosen]

    def track(self, node: int, handle: OpHandle | None, op: int | None) -> None:
        assert (handle is None) == (op is None), (handle, op)
        if handle is not None and op is not None:
            self.pending.append(Pending(node, handle, op))

    def impl_keys(self, media: PageHash) -> tuple[StoreKey, ...]:
        return self.impls[0].object_keys(media, self.tokens[media])

    def busy_nodes(self) -> list[int]:
        return sorted({p.node for p in self.pending})

    def remote(self, node: int) -> list[PageHash]:
        """Media visible in the store that ``node`` does not hold."""
        model = self.models[node]
        return [
            m for m in MEDIA if self.model_store.contains(model.key(m)) and model.entry(m) is None
        ]

    def oldest(self, data: st.DataObject) -> Pending:
        """The oldest pending op of a node chosen by Hypothesis (each executor is FIFO)."""
        node = data.draw(st.sampled_from(self.busy_nodes()), label="node")
        op = next(p for p in self.pending if p.node == node)
        self.pending.remove(op)
        return op

    def settle(self, node: int, op: int | None) -> None:
        """After a ``wait=True`` verb whose op is ``op``: the implementation ran the node's queued
        jobs (its executor is FIFO) up to that op and applied their results; the model acks the
        same ops, oldest first, each answered by the store as it is (nothing injected)."""
        if op is None:  # no call was made: nothing ran, the older ops still pend
            return
        mine = [p for p in self.pending if p.node == node]
        assert mine and mine[-1].op == op, (mine, op)
        for pending in mine:
            self.pending.remove(pending)
            self.complete(pending, frozenset())
        assert not self.executors[node].jobs and op not in self.impls[node].pending_ops()
        event(f"wait=True: {len(mine)} op(s) settled by the caller")

    def complete(self, op: Pending, failed: frozenset[PageHash]) -> None:
        """Complete ``op`` on the model, item by item, after the implementation ran it."""
        model = self.models[op.node]
        media = model.op_media(op.handle)
        if op.handle.kind is OpKind.PUSH:
            model.ack_push(op.handle, failed)
            for m in set(media) - failed:
                self.pushed_by[m] = op.node
        else:
            model.ack_get(op.handle, failed)

    # ------------------------------------------------------------------------------ rules

    @rule(node=nodes, chosen=picks, wait=waits)
    def insert_batch(self, node: int, chosen: list[int], wait: bool) -> None:
        other = self.models[1 - node]
        racing = {e.media for e in other.entries() if e.state is EntryState.PUSHING}
        hashes = [m for m in self.batch(chosen) if m not in racing]  # see the module docstring
        if not hashes:
            return
        want = self.models[node].insert_batch(hashes, [self.size[m] for m in hashes])
        tensors = [embedding(m, self.tokens[m]) for m in hashes]
        got = self.impls[node].insert_batch(hashes, tensors, wait=wait)
        note(f"node {node} insert {hashes} wait={wait}: {want} / {got}")
        assert (got.new, got.re_pushed, got.stored, got.store_skipped, got.busy) == (
            want.new,
            want.re_pushed,
            want.stored,
            want.store_skipped,
            want.busy,
        )
        assert got.skipped_no_space == want.skipped_no_space
        if want.re_pushed and want.stored > want.new:
            event("insert: local hit pushed again (store had lost it)")
        if want.new and any(self.model_store.contains(self.models[node].key(m)) for m in hashes):
            event("insert: a new entry the store holds, pushed unasked")
        self.track(node, want.op, got.op)
        if wait:
            self.settle(node, got.op)

    @rule(node=nodes, chosen=picks, probe=st.booleans(), wait=waits)
    def prefetch(self, node: int, chosen: list[int], probe: bool, wait: bool) -> None:
        hashes = self.batch(chosen)
        request = f"r{len(self.requests)}"
        self.requests[request] = node
        sizes, tokens = [self.size[m] for m in hashes], [self.tokens[m] for m in hashes]
        want = self.models[node].prefetch(request, hashes, sizes, probe=probe)
        got = self.impls[node].prefetch(request, hashes, tokens, probe=probe, wait=wait)
        note(f"node {node} prefetch {request} {hashes} probe={probe} wait={wait}: {want} / {got}")
        assert (got.loading, got.local, got.missing, got.skipped_no_space) == (
            want.loading,
            want.local,
            want.missing,
            want.skipped_no_space,
        )
        if want.loading and any(self.pushed_by.get(m) == 1 - node for m in hashes):
            event("prefetch: loads what the other node pushed")
        self.track(node, want.op, got.op)
        if wait:
            self.settle(node, got.op)
            assert self.impls[node].is_ready(request)

    @precondition(lambda self: any(self.remote(node) for node in range(NODES)))
    @rule(data=st.data())
    def prefetch_remote(self, data: st.DataObject) -> None:
        """Steer toward GETs: prefetch, on a node that lacks them, objects the store holds."""
        node = data.draw(st.sampled_from([n for n in range(NODES) if self.remote(n)]), "node")
        chosen = data.draw(
            st.lists(st.sampled_from(self.remote(node)), min_size=1, max_size=3), label="media"
        )
        self.prefetch(
            node,
            [MEDIA.index(m) for m in chosen],
            data.draw(st.booleans(), "probe"),
            data.draw(waits, "wait"),
        )

    @precondition(lambda self: self.pending)
    @rule(data=st.data(), fail=st.booleans())
    def finish_io(self, data: st.DataObject, fail: bool) -> None:
        op = self.oldest(data)
        store = self.stores[op.node]
        if fail:
            store.fail_next = 1
            event(f"io: {op.handle.kind.value} failed")
        assert self.executors[op.node].run_next()
        store.fail_next = 0
        assert self.impls[op.node].poll() == 1
        self.complete(op, frozenset(self.models[op.node].op_media(op.handle) if fail else ()))

    def lacks_one(self, node: int, media: PageHash) -> bool:
        """Whether the store lacks at least one object of ``media``."""
        return not all(self.stores[node].exists(self.impl_keys(media)))

    @precondition(lambda self: self.pending)
    @rule(data=st.data())
    def partial_io(self, data: st.DataObject) -> None:
        """The oldest op of a node answers item by item: the chosen items (at least one; not all
        when there are several) fail, the others are served. On the implementation side a failed
        item fails through a non-empty subset of its store objects (for a push: objects the store
        does not hold yet, since a put of an existing key always succeeds), and each other object
        of the batch is served."""
        op = self.oldest(data)
        media = self.models[op.node].op_media(op.handle)
        # A pushed item fails through an object the store lacks: a pushed item the store holds
        # whole (a new entry pushed unasked) cannot fail.
        failable = [m for m in media if op.handle.kind is OpKind.GET or self.lacks_one(op.node, m)]
        if not failable:  # then it answers like a whole success
            assert self.executors[op.node].run_next() and self.impls[op.node].poll() == 1
            self.complete(op, frozenset())
            return
        # some but not all items (finish_io covers all or none); a single item fails
        most = max(1, min(len(failable), len(media) - 1))
        failed = frozenset(
            data.draw(st.sets(st.sampled_from(failable), min_size=1, max_size=most), "failed")
        )
        push = op.handle.kind is OpKind.PUSH
        how = data.draw(
            st.sampled_from(
                (ExtentStatus.FAILED, ExtentStatus.FULL if push else ExtentStatus.MISSING)
            ),
            label="answer",
        )
        keys: set[StoreKey] = set()
        for m in sorted(failed, key=lambda m: m.digest):
            candidates = self.impl_keys(m)
            if op.handle.kind is OpKind.PUSH:
                visible = self.stores[op.node].exists(candidates)
                candidates = tuple(k for k, v in zip(candidates, visible, strict=True) if not v)
            keys |= data.draw(st.sets(st.sampled_from(candidates), min_size=1), label="objects")
        store = self.stores[op.node]
        store.fail_keys, store.fail_as = keys, how
        assert self.executors[op.node].run_next()
        store.fail_keys, store.fail_as = set(), ExtentStatus.FAILED
        assert self.impls[op.node].poll() == 1
        self.complete(op, failed)
        if push and how is ExtentStatus.FULL:
            self.store_full[op.node] += len(failed)
        event(f"io: failed objects answer {how.value}")
        if failed and len(failed) < len(media):
            event(f"io: {op.handle.kind.value} partially failed")
        if any(len(self.impl_keys(m)) > 1 for m in failed):
            event("io: a multi-object item failed")

    @rule(index=st.integers(0, len(MEDIA) - 1))
    def store_drops(self, index: int) -> None:
        media = MEDIA[index]
        keys = self.impl_keys(media)
        whole = all(self.stores[0].exists(keys))
        dropped = self.model_store.evict(self.models[0].key(media))
        self.stores[0].drop(keys)
        assert whole == dropped
        if dropped and any(
            (e := model.entry(media)) is not None and e.state is EntryState.READY
            for model in self.models
        ):
            event("store dropped an object a node still holds")

    @rule(node=nodes, units=st.integers(0, 4))
    def evict(self, node: int, units: int) -> None:
        assert self.impls[node].evict(units) == self.models[node].evict(units)

    @rule(node=nodes, chosen=picks)
    def get(self, node: int, chosen: list[int]) -> None:
        hashes = self.batch(chosen)
        for media, want, got in zip(
            hashes, self.models[node].get(hashes), self.impls[node].get(hashes), strict=True
        ):
            assert (want is None) == (got is None), (node, media, want, got)
            if got is not None:
                assert torch.equal(
                    got.view(torch.int16), embedding(media, self.tokens[media]).view(torch.int16)
                ), f"node {node}: wrong bytes for {media}"
                event("get: hit, bytes checked")

    @rule(node=nodes, chosen=picks, in_place=st.booleans())
    def reserve(self, node: int, chosen: list[int], in_place: bool) -> None:
        """The first half of an insert: both sides allocate the same FILLING entries, and the
        implementation's are written in place (through the view, or ``write``)."""
        hashes = self.batch(chosen)
        want = self.models[node].reserve(hashes, [self.size[m] for m in hashes])
        got = self.impls[node].reserve(hashes, [self.tokens[m] for m in hashes])
        note(f"node {node} reserve {hashes}: {want} / {got.new}")
        assert (got.new, got.skipped_no_space) == (want.new, want.skipped_no_space)
        for media in got.new:
            view = got.views[media]
            if in_place and view is not None:
                view.copy_(embedding(media, self.tokens[media]))
                event("reserve: written through the view")
            else:
                got.write(media, embedding(media, self.tokens[media]))
        self.reservations.append((node, want.hold, got, tuple(hashes)))

    @precondition(lambda self: bool(self.reservations))
    @rule(data=st.data(), commit=st.booleans(), wait=waits)
    def finish_reservation(self, data: st.DataObject, commit: bool, wait: bool) -> None:
        held = data.draw(st.sampled_from(self.reservations), label="reservation")
        self.reservations.remove(held)
        node, hold, reservation, hashes = held
        other = self.models[1 - node]
        racing = any((e := other.entry(m)) and e.state is EntryState.PUSHING for m in hashes)
        if commit and not racing:  # see the module docstring on racing pushes
            want = self.models[node].commit(hold)
            got = self.impls[node].commit(reservation, wait=wait)
            note(f"node {node} commit wait={wait}: {want} / {got}")
            assert attrs.astuple(got)[1:] == attrs.astuple(want)[1:]
            self.track(node, want.op, got.op)
            if wait:
                self.settle(node, got.op)
            event("reservation committed")
        else:
            assert self.impls[node].abort(reservation) == self.models[node].abort(hold)
        with pytest.raises(MisuseError):
            self.impls[node].commit(reservation)

    @precondition(lambda self: bool(self.reservations or self.loans))
    @rule(data=st.data(), verb=st.sampled_from(["commit", "abort", "give_back"]))
    def hold_at_the_other_node(self, data: st.DataObject, verb: str) -> None:
        """A hold handed to the node that did not make it: both sides refuse it and change
        nothing (hold numbers start at 0 on every node, so the number alone is not enough)."""
        held = data.draw(st.sampled_from([*self.reservations, *self.loans]), label="hold")
        node, hold, handle, _hashes = held
        with pytest.raises(MisuseError):
            getattr(self.models[1 - node], verb)(hold)
        with pytest.raises(MisuseError):
            getattr(self.impls[1 - node], verb)(handle)
        event("a hold refused at the other node")

    @rule(node=nodes, chosen=picks)
    def borrow(self, node: int, chosen: list[int]) -> None:
        hashes = self.batch(chosen)
        hold, want = self.models[node].borrow(hashes)
        loan = self.impls[node].borrow(hashes)
        assert [w is None for w in want] == [g is None for g in loan.tensors]
        self.loans.append((node, hold, loan, tuple(hashes)))
        self.loans_read_their_bytes()
        if any(g is not None for g in loan.tensors):
            event("borrow: hit")

    @precondition(lambda self: bool(self.loans))
    @rule(data=st.data())
    def give_back(self, data: st.DataObject) -> None:
        held = data.draw(st.sampled_from(self.loans), label="loan")
        self.loans.remove(held)
        node, hold, loan, hashes = held
        lent = {m for m, t in zip(hashes, loan.tensors, strict=True) if t is not None}
        with loan:  # the end of the block gives it back
            pass
        assert self.models[node].give_back(hold) == len(lent)
        with pytest.raises(MisuseError):
            self.impls[node].give_back(loan)

    @invariant()
    def loans_read_their_bytes(self) -> None:
        """What a loan lends is read in place: its bytes stay the entry's own until given back
        (the entry is never evicted and its units never reused meanwhile)."""
        for node, _hold, loan, hashes in self.loans:
            for media, tensor in zip(hashes, loan.tensors, strict=True):
                if tensor is not None:
                    want = embedding(media, self.tokens[media]).view(torch.int16)
                    assert torch.equal(tensor.view(torch.int16), want), (node, media)

    @rule(node=nodes, chosen=picks)
    def exists(self, node: int, chosen: list[int]) -> None:
        hashes = self.batch(chosen)
        assert self.impls[node].exists(hashes, [self.tokens[m] for m in hashes]) == self.models[
            node
        ].exists(hashes)

    @rule(
        node=nodes,
        index=st.integers(0, len(MEDIA) - 1),
        bad=st.sampled_from(["lengths", "dtype", "dim", "too_big", "rows"]),
    )
    def bad_input(self, node: int, index: int, bad: str) -> None:
        media = MEDIA[index]
        tensor = embedding(media, self.tokens[media])
        hashes: list[PageHash] = [media]
        tensors = [tensor]
        error: type[Exception] = MisuseError
        if bad == "lengths":
            tensors = [tensor, tensor]
        elif bad == "dtype":
            tensors = [tensor.to(torch.float32)]
        elif bad == "dim":
            tensors = [torch.zeros((2, DIM + 1), dtype=torch.float16)]
        elif bad == "too_big":
            tensors = [torch.zeros((UNIT_TOKENS * 7, DIM), dtype=torch.float16)]
            error = CapacityError
        else:
            tensors = [torch.zeros((0, DIM), dtype=torch.float16)]
        before = self.snapshot()
        with pytest.raises(error):
            self.impls[node].insert_batch(hashes, tensors)
        assert self.snapshot() == before

    # ------------------------------------------------------------------------------ oracles

    def snapshot(self) -> tuple[object, ...]:
        return (
            tuple((i.entries(), i.pending_ops(), i.counters) for i in self.impls),
            self.objects.visible_keys(),
        )

    @invariant()
    def same_state(self) -> None:
        for node, (model, impl) in enumerate(zip(self.models, self.impls, strict=True)):
            want = {e.media: (e.state, e.size, e.readers) for e in model.entries()}
            got = {e.media: (e.state, len(e.units), e.readers) for e in impl.entries()}
            assert got == want, node
            # the LRU order itself, not only the victims it picks (part 29, from the review of
            # the native entry table: an order kept by another table must match the stamps')
            want_order = [e.media for e in sorted(model.entries(), key=lambda e: e.stamp)]
            got_order = [e.media for e in sorted(impl.entries(), key=lambda e: e.stamp)]
            assert got_order == want_order, (node, "LRU order")
            assert impl.used_units == model.used_units, node
            ours = [p for p in self.pending if p.node == node]
            assert impl.pending_ops() == tuple(p.op for p in ours), node
            assert model.pending_ops() == tuple(p.handle for p in ours), node
            holds = len([r for r in self.reservations if r[0] == node])
            holds += len([loan for loan in self.loans if loan[0] == node])
            assert len(impl.open_holds()) == holds, node
        for request, node in self.requests.items():
            assert self.impls[node].is_ready(request) == self.models[node].is_ready(request)

    @invariant()
    def same_counters(self) -> None:
        """Items counted alike: what the implementation counts and the model's stats (a result
        applied wrongly, e.g. a failed object taken as done, shows here even where the entry's
        state would be the same either way: a push acked or failed is READY again)."""
        for node, (model, impl) in enumerate(zip(self.models, self.impls, strict=True)):
            want, got = model.stats, impl.counters
            assert (got.new, got.re_pushed, got.pushed, got.loaded, got.evicted) == (
                want.new,
                want.re_pushed,
                want.pushed,
                want.loaded,
                want.evicted,
            ), (node, got, want)
            assert got.failed == want.push_failed + want.load_failed, (node, got, want)
            assert got.store_full == self.store_full[node], (node, got)

    @invariant()
    def same_store(self) -> None:
        for media in MEDIA:
            assert all(self.stores[0].exists(self.impl_keys(media))) == self.model_store.contains(
                self.models[0].key(media)
            )


EmbeddingDifferential.TestCase.settings = settings(settings(), stateful_step_count=100)
TestEmbeddingDifferential = EmbeddingDifferential.TestCase
