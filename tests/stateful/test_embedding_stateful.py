"""Two embedding-cache nodes over one shared store, driven by Hypothesis (SPEC §6, §7).

The store may start warm (objects pushed by a node that is gone). Rules: insert_batch / prefetch on
either node, ack or fail a pending op chosen by Hypothesis (a GET may race the store dropping one of
its objects), local eviction, the store dropping an object, reads, and misuse that must raise a typed
error and change nothing. After every step the model's own invariants are checked, and so are
oracles that do not trust the model:

* bytes: everything ``get`` returns, and every visible store object, is exactly the embedding its
  media hash names (the sizes are fixed here, per media item);
* pins: a node's LOADING / PUSHING entries are exactly the media of the ops the test still holds for
  it, and the store is writing exactly the keys of the pending pushes;
* accounting: a node's used units are the sizes of its entries, never above its capacity;
* ``is_ready`` is true exactly when the request's GET is no longer pending here.
"""

from __future__ import annotations

import copy
from typing import TypeVar

import attrs
import hypothesis.strategies as st
from hypothesis import event, note, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvstrata.model.embedding import EmbeddingCacheModel, Hold, HoldKind, OpHandle, OpKind, Unit
from kvstrata.model.errors import CapacityError, MisuseError
from kvstrata.model.keys import (
    DEFAULT_NAMESPACE,
    KeySpace,
    KVKind,
    ModelIdentity,
    PageHash,
    Shard,
    StoreKey,
    content_hash,
    parse_store_key,
)
from kvstrata.model.lifecycles import EntryState
from kvstrata.model.slots import UNWRITTEN
from kvstrata.model.store import StoreModel

T = TypeVar("T")

KEYSPACE = KeySpace(
    ModelIdentity(name="clip", dtype="fp16", kind=KVKind.EMBEDDING, dim=8), shard=Shard.replicated()
)
MEDIA = tuple(content_hash(f"media-{i}".encode()) for i in range(5))
PINNED = frozenset({EntryState.LOADING, EntryState.PUSHING})

nodes = st.integers(0, 1)
picks = st.lists(st.integers(0, len(MEDIA) - 1), min_size=1, max_size=3)


def expected(media: PageHash, size: int) -> tuple[Unit, ...]:
    return tuple(Unit(media=media, index=i) for i in range(size))


def store_key(media: PageHash) -> StoreKey:
    return KEYSPACE.key(DEFAULT_NAMESPACE, "emb", "emb", media)


def frozen_copy(value: T) -> T:
    return copy.deepcopy(value, {id(UNWRITTEN): UNWRITTEN})


@attrs.define
class Pending:
    """An op the test has not completed yet, and the media it covered when it was started."""

    node: int
    handle: OpHandle
    media: tuple[PageHash, ...]
    began: frozenset[PageHash] = frozenset()
    """A push's items whose key the store neither held nor was writing when it started."""


class EmbeddingMachine(RuleBasedStateMachine):
    @initialize(
        n_media=st.integers(3, len(MEDIA)),
        sizes=st.lists(st.integers(1, 3), min_size=len(MEDIA), max_size=len(MEDIA)),
        capacities=st.tuples(st.integers(4, 6), st.integers(4, 6)),
        warm=st.lists(st.booleans(), min_size=len(MEDIA), max_size=len(MEDIA)),
    )
    def setup(
        self, n_media: int, sizes: list[int], capacities: tuple[int, int], warm: list[bool]
    ) -> None:
        self.store = StoreModel()
        self.media = MEDIA[:n_media]
        self.size = dict(zip(self.media, sizes, strict=False))
        for media, present in zip(self.media, warm, strict=False):
            if present:  # pushed earlier by a node that is gone: the shared store starts warm
                self.store.begin_put(store_key(media))
                self.store.end_put(store_key(media), expected(media, self.size[media]))
        self.nodes = tuple(
            EmbeddingCacheModel(name, capacity, KEYSPACE, self.store)
            for name, capacity in zip("ab", capacities, strict=True)
        )
        self.pending: list[Pending] = []
        self.completed: list[tuple[int, OpHandle]] = []
        self.requests: dict[str, tuple[int, OpHandle | None]] = {}
        self.reservations: list[tuple[int, Hold, tuple[PageHash, ...]]] = []
        self.loans: list[tuple[int, Hold, dict[PageHash, int]]] = []
        self.closed_holds: list[tuple[int, Hold]] = []

    # ------------------------------------------------------------------------------ helpers

    def batch(self, chosen: list[int]) -> list[PageHash]:
        return [self.media[i % len(self.media)] for i in chosen]

    def pinned(self, node: int) -> set[PageHash]:
        return {e.media for e in self.nodes[node].entries() if e.state in PINNED}

    def remote(self, node: int) -> list[PageHash]:
        """Media visible in the store that ``node`` does not hold."""
        cache = self.nodes[node]
        return [
            m for m in self.media if self.store.contains(store_key(m)) and cache.entry(m) is None
        ]

    def gets(self) -> list[Pending]:
        return [op for op in self.pending if op.handle.kind is OpKind.GET]

    def track(
        self, node: int, handle: OpHandle | None, began: frozenset[PageHash] = frozenset()
    ) -> None:
        if handle is not None:
            self.pending.append(Pending(node, handle, self.nodes[node].op_media(handle), began))

    # ------------------------------------------------------------------------------ rules

    @rule(node=nodes, chosen=picks)
    def insert_batch(self, node: int, chosen: list[int]) -> None:
        cache = self.nodes[node]
        hashes = self.batch(chosen)
        before = {e.media: e for e in cache.entries()}
        peer_pushing = {
            e.media for e in self.nodes[1 - node].entries() if e.state is EntryState.PUSHING
        }
        known = {m for m in hashes if self.store_knows(store_key(m))}
        report = cache.insert_batch(hashes, [self.size[m] for m in hashes])
        note(f"node {node} insert {hashes}: {report}")
        pushing = set(cache.op_media(report.op)) if report.op is not None else set()
        # Every pushed key the store neither held nor was writing is being written now.
        assert {store_key(m) for m in pushing - known} <= self.store.writing_keys()
        if pushing & known:
            event("insert: a new entry the store holds pushed unasked (writes nothing)")
        unique = set(hashes)
        assert report.new + report.re_pushed + report.busy + report.skipped_no_space == len(unique)
        assert report.stored + report.store_skipped == report.new + report.re_pushed
        if set(before) - {e.media for e in cache.entries()}:
            event("insert: batch evicted an LRU entry")
        if report.re_pushed and report.stored > report.new:
            event("insert: local hit pushed again (store had lost it)")
        if report.store_skipped and unique & peer_pushing:
            event("insert: store skipped a key the other node is writing")
        if report.busy:
            event("insert: local entry busy (loading or pushing)")
        if report.skipped_no_space:
            event("insert: no space (pinned entries)")
        self.track(node, report.op, frozenset(pushing - known))

    @rule(node=nodes, chosen=picks, probe=st.booleans())
    def prefetch(self, node: int, chosen: list[int], probe: bool) -> None:
        cache = self.nodes[node]
        hashes = self.batch(chosen)
        request = f"r{len(self.requests)}"
        report = cache.prefetch(request, hashes, [self.size[m] for m in hashes], probe=probe)
        note(f"node {node} prefetch {request} {hashes} probe={probe}: {report}")
        if report.loading:
            event("prefetch: GET from the shared store")
        media = cache.op_media(report.op) if report.op is not None else ()
        if not probe and any(not self.store.contains(store_key(m)) for m in media):
            event("prefetch: unprobed GET of an object the store lacks")
        if report.skipped_no_space:
            event("prefetch: no space")
        self.requests[request] = (node, report.op)
        self.track(node, report.op)

    @precondition(lambda self: any(self.remote(node) for node in range(2)))
    @rule(data=st.data())
    def prefetch_from_store(self, data: st.DataObject) -> None:
        """Steer toward GETs: prefetch, on a node that lacks them, objects the store holds."""
        node = data.draw(st.sampled_from([n for n in range(2) if self.remote(n)]), label="node")
        chosen = data.draw(
            st.lists(st.sampled_from(self.remote(node)), min_size=1, max_size=3), label="media"
        )
        probe = data.draw(st.booleans(), label="probe")
        self.prefetch(node, [self.media.index(m) for m in chosen], probe)

    def take(self, data: st.DataObject, kind: OpKind) -> Pending:
        """Remove a pending op of ``kind`` chosen by Hypothesis (any node, any age)."""
        ops = [op for op in self.pending if op.handle.kind is kind]
        op = data.draw(st.sampled_from(ops), label="op")
        self.pending.remove(op)
        self.completed.append((op.node, op.handle))
        note(f"node {op.node} completes {op.handle}")
        return op

    @precondition(lambda self: len(self.gets()) < len(self.pending))
    @rule(data=st.data(), succeed=st.booleans())
    def complete_push(self, data: st.DataObject, succeed: bool) -> None:
        op = self.take(data, OpKind.PUSH)
        cache = self.nodes[op.node]
        if self.pinned(op.node) - set(op.media) or cache.used_units == cache.capacity:
            event("push completes while the pool is under pressure")
        done = cache.ack_push(op.handle) if succeed else cache.fail_push(op.handle)
        assert done == len(op.media)
        for media in op.media:
            entry = cache.entry(media)
            assert entry is not None and entry.state is EntryState.READY
            if media in op.began:  # the others wrote nothing: the store holds what it held
                assert self.store.contains(store_key(media)) is succeed
        event(f"push {'acked' if succeed else 'failed'}")

    @precondition(lambda self: bool(self.gets()))
    @rule(data=st.data(), outcome=st.sampled_from(["ack", "ack after a store drop", "fail"]))
    def complete_get(self, data: st.DataObject, outcome: str) -> None:
        op = self.take(data, OpKind.GET)
        cache = self.nodes[op.node]
        if outcome == "ack after a store drop":  # the race: the store drops what a GET is loading
            dropped = data.draw(st.sampled_from(op.media), label="dropped")
            if self.store.evict(store_key(dropped)):
                event("GET completes after the store dropped an object")
        lost = {m for m in op.media if not self.store.contains(store_key(m))}
        if outcome == "fail":
            assert cache.fail_get(op.handle) == len(op.media)
            lost = set(op.media)
        else:
            assert cache.ack_get(op.handle) == len(op.media) - len(lost)
        for media in op.media:
            entry = cache.entry(media)
            if media in lost:  # a failed GET frees and forgets its entry
                assert entry is None
            else:
                assert entry is not None and entry.state is EntryState.READY
        event(f"get: {outcome}")

    @precondition(lambda self: bool(self.pending))
    @rule(data=st.data())
    def complete_partial(self, data: st.DataObject) -> None:
        """A batch call answers item by item (one code per key): a chosen subset of a pending op's
        items fails, the others complete normally."""
        kinds = sorted({op.handle.kind for op in self.pending}, key=lambda kind: kind.value)
        kind = data.draw(st.sampled_from(kinds), label="kind")
        op = self.take(data, kind)
        cache = self.nodes[op.node]
        failed = data.draw(st.sets(st.sampled_from(op.media)), label="failed")
        if kind is OpKind.PUSH:
            assert cache.ack_push(op.handle, failed) == len(op.media) - len(failed)
            for media in op.media:  # a failed push item is READY again, its write aborted
                entry = cache.entry(media)
                assert entry is not None and entry.state is EntryState.READY
                if media in op.began:
                    assert self.store.contains(store_key(media)) is (media not in failed)
        else:
            lost = failed | {m for m in op.media if not self.store.contains(store_key(m))}
            assert cache.ack_get(op.handle, failed) == len(op.media) - len(lost)
            for media in op.media:  # a failed get item is freed and forgotten
                state = None if (entry := cache.entry(media)) is None else entry.state
                assert state is (None if media in lost else EntryState.READY), (media, state)
        if failed and len(failed) < len(op.media):
            event(f"{kind.value}: partial result (some items failed)")

    @rule(node=nodes, n_units=st.integers(0, 6))
    def evict(self, node: int, n_units: int) -> None:
        cache = self.nodes[node]
        pinned = self.pinned(node)
        pushing = {e.media for e in cache.entries() if e.state is EntryState.PUSHING}
        freed = cache.evict(n_units)
        if pushing and n_units:
            event("evict pressure while a push is in flight")
        if pinned and freed < n_units:
            event("evict stopped short at pinned entries")
        assert pinned <= {e.media for e in cache.entries()}

    @rule(chosen=st.integers(0, len(MEDIA) - 1))
    def store_evict(self, chosen: int) -> None:
        media = self.media[chosen % len(self.media)]
        if self.store.evict(store_key(media)):
            local = [c.entry(media) for c in self.nodes]
            if any(e is not None and e.state is EntryState.READY for e in local):
                event("store dropped an object a node still holds")

    @rule(node=nodes, chosen=picks)
    def reserve(self, node: int, chosen: list[int]) -> None:
        """The first half of an insert: the new entries are FILLING (held, neither readable nor
        evictable) until the reservation is committed or aborted."""
        cache = self.nodes[node]
        hashes = self.batch(chosen)
        result = cache.reserve(hashes, [self.size[m] for m in hashes])
        note(f"node {node} reserve {hashes}: {result}")
        for media in result.new:
            entry = cache.entry(media)
            assert entry is not None and entry.state is EntryState.FILLING
        assert cache.get(result.new) == (None,) * len(result.new)
        self.reservations.append((node, result.hold, result.new))

    @precondition(lambda self: bool(self.reservations))
    @rule(data=st.data(), commit=st.booleans())
    def finish_reservation(self, data: st.DataObject, commit: bool) -> None:
        held = data.draw(st.sampled_from(self.reservations), label="reservation")
        self.reservations.remove(held)
        node, hold, new = held
        cache = self.nodes[node]
        if commit:
            report = cache.commit(hold)
            note(f"node {node} commit {hold}: {report}")
            assert report.new == len(new)
            for media in new:
                entry = cache.entry(media)
                assert entry is not None and entry.state in (EntryState.READY, EntryState.PUSHING)
            self.track(node, report.op)  # the begin check is the insert rule's
            event("reservation committed")
        else:
            assert cache.abort(hold) == len(new)
            assert all(cache.entry(media) is None for media in new)
            event("reservation aborted")
        self.closed_holds.append((node, hold))

    @rule(node=nodes, chosen=picks)
    def borrow(self, node: int, chosen: list[int]) -> None:
        """``get`` in place: every READY entry's content, lent until given back."""
        cache = self.nodes[node]
        hashes = self.batch(chosen)
        ready = {m for m in hashes if (e := cache.entry(m)) and e.state is EntryState.READY}
        hold, got = cache.borrow(hashes)
        for media, content in zip(hashes, got, strict=True):
            assert content == (expected(media, self.size[media]) if media in ready else None)
        lent = {m: e.generation for m in ready if (e := cache.entry(m)) is not None}
        self.loans.append((node, hold, lent))
        if ready:
            event("borrow: hit")

    @precondition(lambda self: bool(self.loans))
    @rule(data=st.data())
    def give_back(self, data: st.DataObject) -> None:
        held = data.draw(st.sampled_from(self.loans), label="loan")
        self.loans.remove(held)
        node, hold, lent = held
        assert self.nodes[node].give_back(hold) == len(lent)
        self.closed_holds.append((node, hold))

    @invariant()
    def loans_keep_their_entries(self) -> None:
        """A lent entry is never evicted or reallocated while the loan is open: what the caller
        reads in place stays the entry's own bytes."""
        for node, _hold, lent in self.loans:
            for media, generation in lent.items():
                entry = self.nodes[node].entry(media)
                assert entry is not None and entry.generation == generation, (media, entry)

    @rule(node=nodes, chosen=picks)
    def get(self, node: int, chosen: list[int]) -> None:
        cache = self.nodes[node]
        hashes = self.batch(chosen)
        ready = {m for m in hashes if (e := cache.entry(m)) and e.state is EntryState.READY}
        got = cache.get(hashes)
        for media, content in zip(hashes, got, strict=True):
            if media in ready:
                assert content == expected(media, self.size[media])
            else:
                assert content is None
        if ready:
            event("get: hit")

    @rule(
        node=nodes,
        misuse=st.sampled_from(
            [
                "length mismatch",
                "size zero",
                "size too large",
                "conflicting sizes",
                "wrong size for a local entry",
                "completed op",
                "wrong op kind",
                "request id reused",
                "evict negative",
                "unknown request",
                "closed hold",
                "loan committed",
            ]
        ),
    )
    def misuse(self, node: int, misuse: str) -> None:
        cache = self.nodes[node]
        media = self.media[0]
        size = self.size[media]
        local = cache.entries()
        ours = [op for op in self.pending if op.node == node]
        done = [handle for n, handle in self.completed if n == node]
        requests = [request for request, (n, _op) in self.requests.items() if n == node]
        closed = [hold for n, hold in self.closed_holds if n == node]
        loans = [hold for n, hold, _lent in self.loans if n == node]
        calls = {
            "length mismatch": lambda: cache.insert_batch([media, media], [size]),
            "size zero": lambda: cache.prefetch("bad", [media], [0]),
            "size too large": lambda: cache.insert_batch([media], [cache.capacity + 1]),
            "conflicting sizes": lambda: cache.insert_batch([media, media], [size, size + 1]),
            "wrong size for a local entry": lambda: cache.insert_batch(
                [local[0].media], [local[0].size + 1]
            ),
            "completed op": lambda: (
                cache.ack_push if done[0].kind is OpKind.PUSH else cache.ack_get
            )(done[0]),
            "wrong op kind": lambda: (
                cache.ack_get if ours[0].handle.kind is OpKind.PUSH else cache.fail_push
            )(ours[0].handle),
            "request id reused": lambda: cache.prefetch(requests[0], [media], [size]),
            "evict negative": lambda: cache.evict(-1),
            "unknown request": lambda: cache.is_ready("no such request"),
            "closed hold": lambda: (
                cache.give_back if closed[0].kind is HoldKind.LOAN else cache.commit
            )(closed[0]),
            "loan committed": lambda: cache.commit(loans[0]),
        }
        applicable = {
            "wrong size for a local entry": bool(local),
            "completed op": bool(done),
            "wrong op kind": bool(ours),
            "request id reused": bool(requests),
            "closed hold": bool(closed),
            "loan committed": bool(loans),
        }
        if not applicable.get(misuse, True):
            return
        error = CapacityError if misuse == "size too large" else MisuseError
        before = frozen_copy((self.nodes, self.store))
        try:
            calls[misuse]()
        except error:
            pass
        else:
            raise AssertionError(f"{misuse}: no {error.__name__}")
        assert (self.nodes, self.store) == before, f"{misuse} changed the model"
        event(f"misuse: {misuse}")

    # ------------------------------------------------------------------------------ oracles

    def store_knows(self, key: StoreKey) -> bool:
        """The store holds ``key`` or is writing it (a put of it would begin nothing)."""
        return self.store.contains(key) or key in self.store.writing_keys()

    @invariant()
    def model_invariants(self) -> None:
        for cache in self.nodes:
            cache.check_invariants()

    @invariant()
    def store_holds_exactly_what_keys_name(self) -> None:
        for key, content in self.store.visible_items():
            media = parse_store_key(key).page_hash
            assert content == expected(media, self.size[media]), f"{key} holds {content!r}"

    @invariant()
    def pins_match_pending_ops(self) -> None:
        writing: set[StoreKey] = set()
        for node, cache in enumerate(self.nodes):
            held = {m for op in self.pending if op.node == node for m in op.media}
            assert self.pinned(node) == held, f"node {node}: pinned {self.pinned(node)} != {held}"
            for op in self.pending:
                if op.node == node and op.handle.kind is OpKind.PUSH:
                    writing |= {store_key(m) for m in op.media}
            assert set(cache.pending_ops()) == {op.handle for op in self.pending if op.node == node}
        # A push of a key the store held (or was writing) begins nothing, so the store may write
        # fewer keys than the pushes name, never another one (the insert rule checks the others).
        assert self.store.writing_keys() <= writing

    @invariant()
    def ready_exactly_when_the_get_is_done(self) -> None:
        for request, (node, handle) in self.requests.items():
            pending = any(op.node == node and op.handle == handle for op in self.pending)
            assert self.nodes[node].is_ready(request) is not pending, request

    @invariant()
    def accounting(self) -> None:
        for cache in self.nodes:
            entries = cache.entries()
            assert all(e.size == self.size[e.media] for e in entries)
            assert cache.used_units == sum(e.size for e in entries) <= cache.capacity


EmbeddingMachine.TestCase.settings = settings(settings(), stateful_step_count=50)
TestEmbeddingCache = EmbeddingMachine.TestCase
