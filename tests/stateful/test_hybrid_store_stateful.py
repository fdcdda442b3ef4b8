"""Stateful test: hybrid_exists over a StoreModel against an oracle kept by the test (SPEC §5).

The machine keeps its own record of which objects are visible and which are in flight, for one
small page chain and three pools: KV (MHA: k, v), an ``indexer`` side pool (ALL_PAGES, ``idx``)
and a ``mamba`` side pool (TRAILING_PAGES, ``conv0`` + ``temporal``). Rules write objects
two-phase (sometimes leaving them in flight), complete or abort in-flight writes, evict single
component objects, and query ``hybrid_exists`` for every prefix of the chain. Checked after every
step: the store agrees with the record, the reported prefix equals the brute-force oracle built
from *visible* objects only (I2: in-flight objects never count) and is usable in every pool (I6).
"""

from __future__ import annotations

import attrs
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    rule,
)

from kvstrata.model.errors import InvariantViolation
from kvstrata.model.hybrid import HitPolicy, SidePool, check_usable, hybrid_exists
from kvstrata.model.keys import (
    DEFAULT_NAMESPACE,
    KeySpace,
    KVKind,
    ModelIdentity,
    Namespace,
    PageHash,
    StoreKey,
    chain_page_hashes,
    parse_store_key,
)
from kvstrata.model.store import StoreModel

MODEL = ModelIdentity(name="org/hybrid-model", dtype="bf16", kind=KVKind.MHA, page_size=2)
INDEXER = SidePool("indexer", HitPolicy.ALL_PAGES, ("idx",))
MAMBA = SidePool("mamba", HitPolicy.TRAILING_PAGES, ("conv0", "temporal"))
SIDE_POOLS = (INDEXER, MAMBA)
#: pool name -> component names, the anchor pool first.
POOLS: dict[str, tuple[str, ...]] = {
    "kv": MODEL.components,
    INDEXER.name: INDEXER.components,
    MAMBA.name: MAMBA.components,
}

#: One store object: (pool, component, page index).
Obj = tuple[str, str, int]


@attrs.frozen
class RecordingKeySpace(KeySpace):
    """A KeySpace that logs (pool, component, page hash) for every key it renders."""

    log: list[tuple[str, str, PageHash]] = attrs.field(factory=list, eq=False)

    def key(self, namespace: Namespace, pool: str, component: str, page_hash: PageHash) -> StoreKey:
        self.log.append((pool, component, page_hash))
        return super().key(namespace, pool, component, page_hash)

    def component_keys(
        self, namespace: Namespace, pool: str, components: tuple[str, ...], page_hash: PageHash
    ) -> tuple[StoreKey, ...]:
        """Every renderer of one key or of one entry's keys logs (side pools use this one)."""
        self.log.extend((pool, component, page_hash) for component in components)
        return super().component_keys(namespace, pool, components, page_hash)


class HybridStoreMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.store = StoreModel()
        self.keys = RecordingKeySpace(MODEL)
        self.namespace = DEFAULT_NAMESPACE
        self.hashes: tuple[PageHash, ...] = ()
        self.key_of: dict[Obj, StoreKey] = {}
        self.visible: set[Obj] = set()
        self.in_flight: set[Obj] = set()

    # -- setup ------------------------------------------------------------------------------

    @initialize(
        pages=st.integers(3, 6),
        tokens=st.lists(st.integers(0, 3), min_size=12, max_size=12),
        namespace=st.sampled_from([DEFAULT_NAMESPACE, Namespace(extra_key="lora-1")]),
    )
    def setup(self, pages: int, tokens: list[int], namespace: Namespace) -> None:
        self.namespace = namespace
        self.hashes = chain_page_hashes(
            tokens[: pages * MODEL.page_size], MODEL.page_size, namespace
        )
        assert len(self.hashes) == pages
        for pool, components in POOLS.items():
            for component in components:
                for page, page_hash in enumerate(self.hashes):
                    self.key_of[(pool, component, page)] = self.keys.key(
                        namespace, pool, component, page_hash
                    )
        assert len(set(self.key_of.values())) == len(self.key_of)  # no two objects share a key
        for (pool, component, page), key in self.key_of.items():  # I1: every key parses back
            parts = parse_store_key(key)
            assert (parts.pool, parts.component, parts.page_hash) == (
                pool,
                component,
                self.hashes[page],
            )

    @property
    def pages(self) -> int:
        return len(self.hashes)

    def objects(self) -> st.SearchStrategy[Obj]:
        return st.sampled_from(sorted(self.key_of))

    # -- the oracle ---------------------------------------------------------------------------

    def _page_present(self, pool: str, page: int, counted: set[Obj]) -> bool:
        return all((pool, component, page) in counted for component in POOLS[pool])

    def _kv_hit(self, prefix: int, counted: set[Obj]) -> int:
        kv_hit = 0
        while kv_hit < prefix and self._page_present("kv", kv_hit, counted):
            kv_hit += 1
        return kv_hit

    def _oracle(self, prefix: int, counted: set[Obj]) -> int:
        """Brute force: the largest n <= the KV hit usable in every pool, from ``counted`` only."""
        kv_hit = self._kv_hit(prefix, counted)

        def usable(n: int) -> bool:
            indexer_ok = all(self._page_present(INDEXER.name, i, counted) for i in range(n))
            mamba_ok = n == 0 or self._page_present(MAMBA.name, n - 1, counted)
            return indexer_ok and mamba_ok

        return max(n for n in range(kv_hit + 1) if usable(n))

    # -- rules --------------------------------------------------------------------------------

    def _begin(self, obj: Obj) -> bool:
        started = self.store.begin_put(self.key_of[obj])
        # exists-then-put-missing: a key visible or being written is not written again
        assert started == (obj not in self.visible and obj not in self.in_flight)
        if started:
            self.in_flight.add(obj)
        return started

    def _end(self, obj: Obj) -> None:
        self.store.end_put(self.key_of[obj], self.key_of[obj].text)
        self.in_flight.discard(obj)
        self.visible.add(obj)

    @rule(data=st.data(), complete=st.booleans())
    def put_object(self, data: st.DataObject, complete: bool) -> None:
        obj = data.draw(self.objects(), label="object")
        if self._begin(obj) and complete:
            self._end(obj)

    @rule(
        data=st.data(),
        pool=st.sampled_from(sorted(POOLS)),
        leave_one_in_flight=st.booleans(),
    )
    def put_pages(self, data: st.DataObject, pool: str, leave_one_in_flight: bool) -> None:
        """Write every component of a run of pages of one pool (the last one maybe left open)."""
        first = data.draw(st.integers(0, self.pages - 1), label="first")
        last = data.draw(st.integers(first, self.pages - 1), label="last")
        objs = [(pool, c, page) for page in range(first, last + 1) for c in POOLS[pool]]
        for index, obj in enumerate(objs):
            if self._begin(obj) and not (leave_one_in_flight and index == len(objs) - 1):
                self._end(obj)

    @rule(
        data=st.data(),
        with_indexer=st.booleans(),
        leave_last_in_flight=st.booleans(),
    )
    def back_up_node(
        self, data: st.DataObject, with_indexer: bool, leave_last_in_flight: bool
    ) -> None:
        """What a backup of one node writes: KV (and indexer) pages from the root to the node's end,
        and one Mamba state keyed by the node's last page; the very last object maybe still open."""
        end = data.draw(st.integers(1, self.pages), label="node end")
        pools = ["kv", INDEXER.name] if with_indexer else ["kv"]
        objs = [(pool, c, page) for page in range(end) for pool in pools for c in POOLS[pool]]
        objs += [(MAMBA.name, c, end - 1) for c in MAMBA.components]
        for index, obj in enumerate(objs):
            if self._begin(obj) and not (leave_last_in_flight and index == len(objs) - 1):
                self._end(obj)

    @rule(data=st.data(), commit=st.booleans())
    def settle_in_flight(self, data: st.DataObject, commit: bool) -> None:
        """The store acks (end_put) or fails (abort_put) one in-flight write."""
        if not self.in_flight:
            event("settle: nothing in flight")
            return
        obj = data.draw(st.sampled_from(sorted(self.in_flight)), label="in flight")
        if commit:
            self._end(obj)
        else:
            self.store.abort_put(self.key_of[obj])
            self.in_flight.discard(obj)

    @rule(data=st.data())
    def evict_object(self, data: st.DataObject) -> None:
        """The store drops one component object (a page's objects are evicted independently)."""
        pick_visible = data.draw(st.booleans(), label="pick a visible one")
        if pick_visible and self.visible:
            obj = data.draw(st.sampled_from(sorted(self.visible)), label="visible object")
        else:
            obj = data.draw(self.objects(), label="any object")
        assert self.store.evict(self.key_of[obj]) == (obj in self.visible)
        self.visible.discard(obj)
        assert (obj in self.in_flight) == (self.key_of[obj] in self.store.writing_keys())

    @rule(data=st.data())
    def misuse_end_without_begin(self, data: st.DataObject) -> None:
        obj = data.draw(self.objects(), label="object")
        if obj in self.in_flight:
            return
        before = (self.store.visible_items(), self.store.writing_keys())
        try:
            self.store.end_put(self.key_of[obj], "bogus")
        except InvariantViolation as exc:
            assert exc.invariant == "I2"
        else:
            raise AssertionError("end_put without begin_put was accepted")
        assert (self.store.visible_items(), self.store.writing_keys()) == before

    @rule(data=st.data())
    def query(self, data: st.DataObject) -> None:
        prefix = data.draw(st.integers(0, self.pages), label="prefix")
        self._check_query(prefix)

    # -- checks -------------------------------------------------------------------------------

    def _check_query(self, prefix: int) -> None:
        hashes = self.hashes[:prefix]
        self.keys.log.clear()
        result = hybrid_exists(self.store, self.keys, self.namespace, hashes, SIDE_POOLS)
        expected = self._oracle(prefix, self.visible)
        assert result == expected, (prefix, result, expected)
        # Side pools are never queried beyond the KV hit, and each side key is rendered once.
        kv_hit = self._kv_hit(prefix, self.visible)
        side = [entry for entry in self.keys.log if entry[0] != "kv"]
        assert side or kv_hit == 0, "a KV hit probes the side pools: their keys must be logged"
        assert len(side) == len(set(side))
        page_of = {page_hash: page for page, page_hash in enumerate(hashes)}
        assert all(page_of[page_hash] < kv_hit for _pool, _component, page_hash in side)
        assert all(page_of[h] <= kv_hit for pool, _c, h in self.keys.log if pool == "kv")
        check_usable(self.store, self.keys, self.namespace, hashes, SIDE_POOLS, prefix=result)
        if result < kv_hit:
            event("side pools cut the KV hit")
        if self._oracle(prefix, self.visible | self.in_flight) != expected:
            event("an in-flight object would have changed the answer")  # and it did not (I2)
        if result > 0:
            event("hybrid hit > 0")

    @invariant()
    def store_matches_the_record(self) -> None:
        assert {key for key, _content in self.store.visible_items()} == {
            self.key_of[obj] for obj in self.visible
        }
        assert self.store.writing_keys() == {self.key_of[obj] for obj in self.in_flight}
        assert not self.visible & self.in_flight

    @invariant()
    def full_chain_is_usable_and_exact(self) -> None:
        if self.hashes:
            self._check_query(self.pages)


TestHybridStore = HybridStoreMachine.TestCase
# 40 steps (SPEC §7: 30-100) keep the ci gate near 7 s; everything else comes from the profile.
TestHybridStore.settings = settings(stateful_step_count=40)
