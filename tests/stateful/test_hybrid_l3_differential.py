"""Hybrid L3, model against implementation (SPEC §5, §7; issue 6).

The model is :func:`kvstrata.model.hybrid.hybrid_exists` over a :class:`StoreModel`; the
implementation is :class:`kvstrata.impl.storage.hybrid.HybridStorage` over a real backend (the
in-memory store, and in a smaller run a real Mooncake master and storage node), with a KV host pool,
an indexer pool (``ALL_PAGES``) and a Mamba state pool (``TRAILING_PAGES``, two components) grouped
in a :class:`~kvstrata.impl.pools.group.PoolGroup` per instance, under a drawn key schema (1: one
store object per side-pool component; 2: one per side-pool entry). Two instances share the store: a
*writer* backs pages up, a *reader* prefetches them.

Rules: back up a prefix of a page chain with states at chosen positions (host slots and state slots
from the writer's group, freed after the put), the store evicting one object of any pool, ``exists``
of a prefix, a prefetch into the reader (an atomic group allocation of the hit's pages plus one state
slot, read KV + indexer, then the state of the last usable page), and holding / releasing reader
capacity so allocations run short. After every step: every object the model holds is visible in the
implementation's store and vice versa. Every ``exists`` equals the model's, and every prefetched page
and state is compared bit for bit with the bytes its page hash names. The reader group's free counts
always equal the test's own accounting (a refused allocation takes nothing).
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence

import attrs
import pytest
import torch
from hypothesis import event, note, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvstrata.impl.errors import CapacityError
from kvstrata.impl.pools import HostKVPool, HostLayout, KVShape
from kvstrata.impl.pools.group import GroupAllocation, PoolGroup
from kvstrata.impl.pools.side import SideBuffer, SideSpec, indexer_spec, mamba_spec
from kvstrata.impl.storage.base import PutStatus, StorageBackend
from kvstrata.impl.storage.hybrid import HybridStorage
from kvstrata.impl.storage.memory import MemoryBackend, MemoryStore
from kvstrata.impl.storage.mooncake import LocalCluster, MooncakeBackend, MooncakeClient
from kvstrata.model.hybrid import KV_POOL, hybrid_exists, side_page_keys
from kvstrata.model.keys import (
    DEFAULT_NAMESPACE,
    SCHEMA_VERSIONS,
    KeySpace,
    KVKind,
    ModelIdentity,
    Namespace,
    PageHash,
    Shard,
    StoreKey,
    chain_page_hashes,
)
from kvstrata.model.store import StoreModel

SHAPE = KVShape(KVKind.MHA, layers=1, heads=1, head_dim=4, dtype=torch.float16, page_size=2)
SPACE = KeySpace(
    ModelIdentity(name="hybrid-tiny", dtype="float16", kind=KVKind.MHA, page_size=2),
    shard=Shard(tp_rank=0, tp_size=1),
)
INDEXER = indexer_spec(layers=1, page_size=2, dim=2, dtype=torch.bfloat16)
MAMBA = mamba_spec(layers=1, conv=[(2, 2)], temporal=(3,), dtype=[torch.float16, torch.float32])
SPECS = {spec.name: spec for spec in (INDEXER, MAMBA)}
SIDE = (INDEXER.pool, MAMBA.pool)
# another deployment of the same model: its side entries have the same sizes, other dtypes
STRANGE_INDEXER = indexer_spec(layers=1, page_size=2, dim=2, dtype=torch.float16)
STRANGE_MAMBA = mamba_spec(
    layers=1, conv=[(2, 2)], temporal=(3,), dtype=[torch.bfloat16, torch.float32]
)
HOST_PAGES = 6
STATE_SLOTS = 2
NAMESPACES = (DEFAULT_NAMESPACE, Namespace(extra_key="lora-9"))


def pattern(page: PageHash, pool: str, component: int, nbytes: int) -> bytes:
    """The bytes of one object: a pure function of its page hash, pool (:func:`label`: the same
    entry in other dtypes is other bytes) and component."""
    return random.Random(page.digest + f"{pool}/{component}".encode()).randbytes(nbytes)


def label(spec: SideSpec) -> str:
    """A side pool's name and dtypes: what its entries' bytes depend on here. Not its key segment,
    so a key that lost the layout still shows up as other bytes."""
    return f"{spec.name}:{','.join(str(dtype) for dtype in spec.dtypes)}"


def write_entry(tensors: Sequence[torch.Tensor], entry: int, page: PageHash, pool: str) -> None:
    for component, tensor in enumerate(tensors):
        raw = tensor[entry].reshape(-1).view(torch.uint8)
        raw.copy_(
            torch.frombuffer(
                bytearray(pattern(page, pool, component, raw.numel())), dtype=torch.uint8
            )
        )


def entry_holds(tensors: Sequence[torch.Tensor], entry: int, page: PageHash, pool: str) -> bool:
    return all(
        tensor[entry].reshape(-1).view(torch.uint8).numpy().tobytes()
        == pattern(page, pool, component, tensor[entry].numel() * tensor.element_size())
        for component, tensor in enumerate(tensors)
    )


def kv_object(host: HostKVPool, slot: int, plane: int) -> torch.Tensor:
    """The bytes of one plane of one host slot: with ``page_first_direct`` that is exactly the
    canonical store object (a writable uint8 view)."""
    return host.page_slab(plane, slot).view(torch.uint8)


class Instance:
    """One cache instance's host side: KV pool, side buffers, their group and hybrid storage."""

    def __init__(
        self, backend: StorageBackend, indexer: SideSpec = INDEXER, mamba: SideSpec = MAMBA
    ) -> None:
        self.host = HostKVPool(SHAPE, HOST_PAGES, HostLayout.PAGE_FIRST_DIRECT, pin_memory=False)
        self.indexer = SideBuffer(indexer, HOST_PAGES, host=True)
        self.mamba = SideBuffer(mamba, STATE_SLOTS, host=True)
        self.group = PoolGroup(self.host, [self.indexer, self.mamba])
        self.storage = HybridStorage(backend, [self.indexer, self.mamba])
        self.storage.attach(self.host)

    def fill_page(self, slot: int, page: PageHash) -> None:
        for plane in range(SHAPE.planes):
            raw = kv_object(self.host, slot, plane)
            data = pattern(page, KV_POOL, plane, raw.numel())
            raw.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        write_entry(self.indexer.tensors, slot, page, label(self.indexer.spec))

    def page_holds(self, slot: int, page: PageHash) -> bool:
        for plane in range(SHAPE.planes):
            raw = kv_object(self.host, slot, plane).numpy().tobytes()
            if raw != pattern(page, KV_POOL, plane, len(raw)):
                return False
        return entry_holds(self.indexer.tensors, slot, page, label(self.indexer.spec))


class HybridL3Differential(RuleBasedStateMachine):
    """See the module docstring; subclasses choose the store (:meth:`new_backend`, :meth:`drop`)."""

    def __init__(self) -> None:
        super().__init__()
        self.model = StoreModel()
        self.store = MemoryStore()
        self.chains: dict[tuple[Namespace, int], tuple[PageHash, ...]] = {}
        self.held: list[GroupAllocation] = []

    # ---------------------------------------------------------------- store access (overridable)
    def new_backend(self) -> StorageBackend:
        return MemoryBackend(self.space, store=self.store)

    def drop(self, key: StoreKey) -> int:
        return self.store.drop([key])

    def visible(self, keys: Sequence[StoreKey]) -> set[StoreKey]:
        visible = set(self.store.visible_keys())
        return {key for key in keys if key in visible}

    def reset_store(self) -> None:
        """Start from an empty store (each example makes a new in-memory one)."""

    # -------------------------------------------------------------------------------- setup
    @initialize(
        tokens=st.lists(st.integers(1, 2), min_size=12, max_size=12),
        namespace=st.sampled_from(NAMESPACES),
        schema=st.sampled_from(SCHEMA_VERSIONS),
    )
    def setup(self, tokens: list[int], namespace: Namespace, schema: int) -> None:
        """Key schema 1 stores a side entry as one object per component, 2 as one object."""
        self.reset_store()
        self.namespace = namespace
        self.space = attrs.evolve(SPACE, schema=schema)
        self.writer = Instance(self.new_backend())
        self.reader = Instance(self.new_backend())
        # two chains that share their first pages (so backups and evictions interact)
        self.chains[(namespace, 0)] = chain_page_hashes(tokens[:12], 2, namespace)
        fork = [*tokens[:4], 3, *tokens[5:12]]
        self.chains[(namespace, 1)] = chain_page_hashes(fork, 2, namespace)

    chain_ids = st.sampled_from([0, 1])

    def pages_of(self, chain: int) -> tuple[PageHash, ...]:
        return self.chains[(self.namespace, chain)]

    def all_keys(self) -> list[StoreKey]:
        keys: dict[str, StoreKey] = {}
        for pages in self.chains.values():
            for page in pages:
                for key in self.space.page_keys(self.namespace, page):
                    keys[key.text] = key
                for pool in SIDE:
                    for key in side_page_keys(self.space, self.namespace, pool, page):
                        keys[key.text] = key
        return [keys[text] for text in sorted(keys)]

    def put(
        self, instance: Instance, chain: int, count: int, states: set[int]
    ) -> tuple[tuple[PageHash, ...], list[int]]:
        """``instance`` backs up the first ``count`` pages of ``chain`` with states at ``states``
        (host and state slots from its group, freed after the put); the pages and state positions."""
        pages = self.pages_of(chain)[:count]
        positions = sorted(p for p in states if p < count)
        allocation = instance.group.alloc(count, {"mamba": len(positions)})
        slots = [int(s) for s in allocation.pages]
        state_slots = {
            p: int(s) for p, s in zip(positions, allocation.states["mamba"], strict=True)
        }
        for slot, page in zip(slots, pages, strict=True):
            instance.fill_page(slot, page)
        for position, slot in state_slots.items():
            write_entry(instance.mamba.tensors, slot, pages[position], label(instance.mamba.spec))
        result = instance.storage.put(self.namespace, pages, slots, {"mamba": state_slots})
        instance.group.free_allocation(allocation)
        assert all(s in (PutStatus.STORED, PutStatus.EXISTED) for s in result.pages), result
        assert all(s.ok for s in result.states["mamba"].values()), result
        return pages, positions

    # -------------------------------------------------------------------------------- rules
    @rule(
        chain=chain_ids,
        count=st.integers(1, HOST_PAGES),
        states=st.sets(st.integers(0, 5), max_size=2),
    )
    def back_up(self, chain: int, count: int, states: set[int]) -> None:
        pages, positions = self.put(self.writer, chain, count, states)
        for page in pages:  # the model: KV and indexer objects of every page
            for key in (
                *self.space.page_keys(self.namespace, page),
                *side_page_keys(self.space, self.namespace, INDEXER.pool, page),
            ):
                if self.model.begin_put(key):
                    self.model.end_put(key, key.text)
        for position in positions:
            for key in side_page_keys(self.space, self.namespace, MAMBA.pool, pages[position]):
                if self.model.begin_put(key):
                    self.model.end_put(key, key.text)
        if positions:
            event("backed up states")

    @precondition(lambda self: len(self.model) > 0)
    @rule(data=st.data())
    def store_evicts(self, data: st.DataObject) -> None:
        key = data.draw(st.sampled_from([k for k, _ in self.model.visible_items()]))
        note(f"store evicts {key.text}")
        assert self.model.evict(key)
        assert self.drop(key) == 1
        event(f"store evicts a {key.text.split('/')[-3]} object")

    @rule(chain=chain_ids, count=st.integers(0, HOST_PAGES))
    def exists(self, chain: int, count: int) -> None:
        pages = self.pages_of(chain)[:count]
        expected = hybrid_exists(self.model, self.space, self.namespace, pages, SIDE)
        hit = self.reader.storage.exists(self.namespace, pages)
        kv = self.model.exists_pages(self.space.page_keys(self.namespace, p) for p in pages)
        assert (hit.kv, hit.usable) == (kv, expected)
        if expected < kv:
            event("exists: side pools cut the KV hit")

    @rule(chain=chain_ids, count=st.integers(1, HOST_PAGES))
    def prefetch(self, chain: int, count: int) -> None:
        pages = self.pages_of(chain)[:count]
        hit = self.reader.storage.exists(self.namespace, pages)
        expected = hybrid_exists(self.model, self.space, self.namespace, pages, SIDE)
        assert hit.usable == expected
        if not hit.usable:
            return
        before = self.reader.group.free_counts()
        try:
            allocation = self.reader.group.alloc(hit.usable, {"mamba": 1})
        except CapacityError:
            assert self.reader.group.free_counts() == before  # nothing taken
            event("prefetch: the reader's group is short")
            return
        slots = [int(s) for s in allocation.pages]
        state = int(allocation.states["mamba"][0])
        got = self.reader.storage.get(
            self.namespace, pages[: hit.usable], slots, {"mamba": {hit.usable - 1: state}}
        )
        assert got.usable == hit.usable, got  # nothing changed between exists and get
        for slot, page in zip(slots, pages[: hit.usable], strict=True):
            assert self.reader.page_holds(slot, page)
        assert entry_holds(self.reader.mamba.tensors, state, pages[hit.usable - 1], label(MAMBA))
        self.reader.group.free_allocation(allocation)
        event("prefetch: bytes checked")

    @rule(pages=st.integers(0, HOST_PAGES), states=st.integers(0, STATE_SLOTS))
    def hold(self, pages: int, states: int) -> None:
        before = self.reader.group.free_counts()
        try:
            self.held.append(self.reader.group.alloc(pages, {"mamba": states}))
        except CapacityError:
            assert self.reader.group.free_counts() == before
            event("hold: refused, nothing taken")

    @precondition(lambda self: bool(self.held))
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        allocation = self.held.pop(data.draw(st.integers(0, len(self.held) - 1)))
        self.reader.group.free_allocation(allocation)

    def teardown(self) -> None:
        for instance in (getattr(self, "writer", None), getattr(self, "reader", None)):
            if instance is not None:
                instance.storage.close()

    # ---------------------------------------------------------------------------- invariants
    @invariant()
    def stores_agree(self) -> None:
        if not self.chains:
            return
        keys = self.all_keys()
        model = {key.text for key in keys if self.model.contains(key)}
        impl = {key.text for key in self.visible(keys)}
        assert impl == model

    @invariant()
    def reader_accounting(self) -> None:
        if not self.chains:
            return
        held_pages = sum(len(a.pages) for a in self.held)
        held_states = sum(len(a.states.get("mamba", ())) for a in self.held)
        assert self.reader.group.free_counts() == {
            "kv": HOST_PAGES - held_pages,
            "mamba": STATE_SLOTS - held_states,
        }


STEPS = settings(stateful_step_count=40)
TestHybridL3 = HybridL3Differential.TestCase
TestHybridL3.settings = settings(STEPS, max_examples=max(10, settings().max_examples // 2))


class HybridL3WithStranger(HybridL3Differential):
    """The same machine with a *stranger*: another deployment of the same model (the same key space
    and namespace, so the same KV objects) whose indexer keys and Mamba conv state have the same
    sizes but other dtypes, so the same entry is other bytes. It backs up the same pages into the
    same store. Its KV objects are this instance's (the model gains them); its side objects never
    are: ``stores_agree`` (this instance's keys, model against store), every ``exists`` and every
    prefetched byte must come out as if it had written none (issue 20, part 18: the side pool's
    layout is in its keys; a stranger writing first used to leave this instance its bytes)."""

    @rule(
        chain=HybridL3Differential.chain_ids,
        count=st.integers(1, HOST_PAGES),
        states=st.sets(st.integers(0, 5), max_size=2),
    )
    def stranger_backs_up(self, chain: int, count: int, states: set[int]) -> None:
        if not hasattr(self, "stranger"):
            self.stranger = Instance(self.new_backend(), STRANGE_INDEXER, STRANGE_MAMBA)
        pages, positions = self.put(self.stranger, chain, count, states)
        for page in pages:  # the shared KV: the same bytes under the same keys
            for key in self.space.page_keys(self.namespace, page):
                if self.model.begin_put(key):
                    self.model.end_put(key, key.text)
        theirs = [
            key
            for page in pages
            for pool in (STRANGE_INDEXER.pool, STRANGE_MAMBA.pool)
            for key in side_page_keys(self.space, self.namespace, pool, page)
        ]
        assert not set(theirs) & set(self.all_keys())
        event("a stranger backed up states" if positions else "a stranger backed up pages")

    def teardown(self) -> None:
        if hasattr(self, "stranger"):
            self.stranger.storage.close()
        super().teardown()


TestHybridL3WithStranger = HybridL3WithStranger.TestCase
TestHybridL3WithStranger.settings = TestHybridL3.settings


# -------------------------------------------------------------------------- on a real Mooncake
class MooncakeHybridL3(HybridL3Differential):
    """The same machine on a real Mooncake master and storage node (a smaller run)."""

    client: MooncakeClient | None = None

    def _client(self) -> MooncakeClient:
        assert MooncakeHybridL3.client is not None
        return MooncakeHybridL3.client

    def new_backend(self) -> StorageBackend:
        return MooncakeBackend(self._client(), self.space)

    def drop(self, key: StoreKey) -> int:
        return sum(code == 0 for code in self._client().batch_remove([key], force=True))

    def visible(self, keys: Sequence[StoreKey]) -> set[StoreKey]:
        found = self._client().batch_is_exist(keys)
        return {key for key, code in zip(keys, found, strict=True) if code == 1}

    def reset_store(self) -> None:
        assert self._client().remove_all(force=True) >= 0


@pytest.fixture(scope="module")
def mooncake_for_hybrid() -> Iterator[None]:
    with LocalCluster(segment_size="64mib") as cluster, MooncakeClient(cluster.config) as client:
        MooncakeHybridL3.client = client
        try:
            yield
        finally:
            MooncakeHybridL3.client = None


class TestMooncakeHybridL3(MooncakeHybridL3.TestCase):  # type: ignore[name-defined,misc]
    settings = settings(STEPS, max_examples=max(5, settings().max_examples // 15), deadline=None)

    @pytest.fixture(autouse=True)
    def _cluster(self, mooncake_for_hybrid: None) -> None:
        """Start the real store for this test class."""
