"""The L3 backend contract (``kvstrata.impl.storage.base``, SPEC §4), one suite for every backend.

Every test takes ``backend_factory`` (one param per backend kind) and a ``case`` (MHA or MLA pages in a
page-first host layout). Pages are named by chained page hashes in a non-default namespace, under key
spaces with a deployment tag; host slots hold deterministic random bit patterns (NaNs included) and are
compared bit for bit through their canonical bytes, so a layout mix-up or a short copy shows.
The last test checks random operation sequences against ``model.store.StoreModel``.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from pathlib import Path

import attrs
import pytest
import torch
from hypothesis import event, given, settings
from hypothesis import strategies as st

from kvstrata.impl.errors import ConfigError, MisuseError
from kvstrata.impl.pools import HostKVPool, HostLayout, KVShape
from kvstrata.impl.storage.base import GetStatus, PutStatus, StorageBackend
from kvstrata.impl.storage.counters import BackendCounters
from kvstrata.impl.storage.file import FileBackend
from kvstrata.impl.storage.memory import MemoryBackend, MemoryStore
from kvstrata.impl.storage.mooncake import MooncakeBackend, MooncakeClient
from kvstrata.model.keys import (
    DEFAULT_NAMESPACE,
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

NS = Namespace(extra_key="lora-7", salt="tenant-a")
TAG = "blue-7"
SLOTS = 8


# ------------------------------------------------------------------------------------------ the cases
@attrs.frozen
class Case:
    """One kind of page (shape and the key space naming it) in one host layout."""

    shape: KVShape
    space: KeySpace
    layout: HostLayout

    def host(self) -> HostKVPool:
        host = HostKVPool(self.shape, SLOTS, self.layout, pin_memory=False)
        for slot in range(SLOTS):
            fill(host, slot, seed=1000 + slot)
        return host

    def pages(self, count: int, namespace: Namespace = NS, first_token: int = 0) -> list[PageHash]:
        tokens = range(first_token, first_token + count * self.shape.page_size)
        return list(chain_page_hashes(list(tokens), self.shape.page_size, namespace))

    @property
    def components(self) -> tuple[str, ...]:
        return self.space.components

    def object_bits(self, host: HostKVPool, slot: int, number: int) -> bytes:
        """The canonical bytes store object ``number`` of a page in ``slot`` holds: one plane
        under key schema 1, the whole page under schema 2."""
        whole = len(self.components) == 1
        return slot_bits(host, slot, None if whole else number)


def _space(shape: KVShape, shard: Shard, schema: int = 1) -> KeySpace:
    model = ModelIdentity(
        name="tiny/model-β",
        dtype=str(shape.dtype).removeprefix("torch."),
        kind=shape.kind,
        page_size=shape.page_size,
    )
    return KeySpace(model=model, shard=shard, tag=TAG, schema=schema)


MHA = KVShape(kind=KVKind.MHA, layers=2, heads=2, head_dim=4, dtype=torch.float16, page_size=4)
MLA = KVShape(kind=KVKind.MLA, layers=3, heads=1, head_dim=8, dtype=torch.bfloat16, page_size=2)
CASES = [
    Case(shape, _space(shape, shard), layout)
    for shape, shard in ((MHA, Shard(tp_rank=1, tp_size=2)), (MLA, Shard.replicated()))
    for layout in (HostLayout.PAGE_FIRST, HostLayout.PAGE_FIRST_DIRECT)
] + [  # issue 20: one object per page (key schema 2) in every page-first layout, and page_major
    Case(MHA, _space(MHA, Shard(tp_rank=1, tp_size=2), schema), layout)
    for schema, layout in (
        (2, HostLayout.PAGE_FIRST),
        (2, HostLayout.PAGE_FIRST_DIRECT),
        (2, HostLayout.PAGE_MAJOR),
        (1, HostLayout.PAGE_MAJOR),
    )
]


def fill(host: HostKVPool, slot: int, seed: int) -> None:
    """Write a deterministic random bit pattern into one host slot (through the canonical view)."""
    generator = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (host.shape.nbytes(1),), dtype=torch.uint8, generator=generator)
    host.write_pages([slot], raw.view(host.shape.dtype).reshape(host.shape.canonical(1)))


def slot_bits(host: HostKVPool, slot: int, plane: int | None = None) -> bytes:
    """The canonical bytes of one slot (of one plane when given)."""
    page = host.read_pages([slot])
    if plane is not None:
        page = page[plane]
    return page.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


# ------------------------------------------------------------------------------------- the backends
@attrs.frozen
class BackendFactory:
    """How the suite makes backends of one kind.

    ``new_store()`` makes a fresh, empty store; ``open(store, space, writer)`` a client of it (clients
    of one store share its objects); ``evict(backend, namespace, page, component)`` drops objects as
    the store's own eviction would."""

    name: str
    new_store: Callable[[], object]
    open: Callable[[object, KeySpace, bool], StorageBackend]
    evict: Callable[[StorageBackend, Namespace, PageHash, str | None], int]
    #: what a put of a page the store holds whole answers: EXISTED where the backend asks first
    #: (memory, file), STORED where the store deduplicates the re-put (Mooncake, issue 20)
    again: PutStatus = PutStatus.EXISTED

    def make(
        self,
        case: Case,
        host: HostKVPool | None = None,
        *,
        store: object = None,
        space: KeySpace | None = None,
        writer: bool = True,
    ) -> StorageBackend:
        backend = self.open(
            self.new_store() if store is None else store, space or case.space, writer
        )
        if host is not None:
            backend.attach(host)
        return backend


def _evict(backend: StorageBackend, ns: Namespace, page: PageHash, component: str | None) -> int:
    assert isinstance(backend, MemoryBackend | FileBackend)
    return backend.evict(ns, page, component)


def _open_memory(store: object, space: KeySpace, writer: bool) -> StorageBackend:
    assert isinstance(store, MemoryStore)
    return MemoryBackend(space, store=store, writer=writer)


def _open_file(store: object, space: KeySpace, writer: bool) -> StorageBackend:
    assert isinstance(store, Path)
    return FileBackend(space, store, writer=writer)


BACKENDS = ["memory", "file", "mooncake"]


def _mooncake_factory(client: MooncakeClient) -> BackendFactory:
    """Clients of one real master (the session's LocalCluster): a "store" is the emptied cluster,
    every backend shares the scheduler-side client, eviction removes objects by key."""

    def new_store() -> object:
        assert client.remove_all(force=True) >= 0
        return client

    def open_(store: object, space: KeySpace, writer: bool) -> StorageBackend:
        assert store is client
        return MooncakeBackend(client, space, writer=writer)

    def evict(backend: StorageBackend, ns: Namespace, page: PageHash, component: str | None) -> int:
        keys = [
            key
            for name, key in zip(
                backend.keyspace.components,
                backend.keyspace.page_keys(ns, page),
                strict=True,
            )
            if component in (None, name)
        ]
        codes = client.batch_remove(keys, force=True)
        return sum(1 for code in codes if code == 0)

    return BackendFactory("mooncake", new_store, open_, evict, again=PutStatus.STORED)


@pytest.fixture(scope="module", params=BACKENDS)
def backend_factory(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> BackendFactory:
    if request.param == "memory":
        return BackendFactory("memory", MemoryStore, _open_memory, _evict)
    if request.param == "file":
        counter = itertools.count()
        return BackendFactory(
            "file",
            lambda: tmp_path_factory.mktemp(f"l3-{next(counter)}"),
            _open_file,
            _evict,
        )
    if request.param == "mooncake":
        return _mooncake_factory(request.getfixturevalue("mooncake_client"))
    raise AssertionError(request.param)


@pytest.fixture(
    params=CASES,
    ids=lambda case: f"{case.shape.kind.value}-{case.layout.value}-v{case.space.schema}",
)
def case(request: pytest.FixtureRequest) -> Case:
    return request.param  # type: ignore[no-any-return]


@pytest.fixture
def host(case: Case) -> HostKVPool:
    return case.host()


def counters_of(backend: StorageBackend) -> BackendCounters:
    """A snapshot of the backend's counters (every backend keeps :class:`BackendCounters`)."""
    counters = getattr(backend, "counters", None)
    assert isinstance(counters, BackendCounters)
    return counters.snapshot()


def _all_slots(host: HostKVPool) -> list[bytes]:
    return [slot_bits(host, slot) for slot in range(SLOTS)]


# ------------------------------------------------------------------------------------- round trips
def test_round_trip_bit_for_bit(
    backend_factory: BackendFactory, case: Case, host: HostKVPool
) -> None:
    backend = backend_factory.make(case, host)
    pages = case.pages(3)
    expected = [slot_bits(host, slot) for slot in (5, 0, 3)]

    assert backend.put(NS, pages, [5, 0, 3]) == [PutStatus.STORED] * 3
    assert backend.exists(NS, pages) == 3
    assert backend.get(NS, pages, [1, 2, 7]) == [GetStatus.LOADED] * 3

    assert [slot_bits(host, slot) for slot in (1, 2, 7)] == expected
    nbytes = 3 * case.shape.bytes_per_page
    assert counters_of(backend) == BackendCounters(
        puts_stored=3, gets_loaded=3, bytes_written=nbytes, bytes_read=nbytes
    )


def test_another_client_of_the_store_reads_the_pages(
    backend_factory: BackendFactory, case: Case, host: HostKVPool
) -> None:
    store = backend_factory.new_store()
    writer = backend_factory.make(case, host, store=store)
    pages = case.pages(2)
    assert writer.put(NS, pages, [0, 1]) == [PutStatus.STORED] * 2

    other_host = HostKVPool(case.shape, SLOTS, case.layout, pin_memory=False)
    reader = backend_factory.make(case, other_host, store=store)
    assert reader.exists(NS, pages) == 2
    assert reader.get(NS, pages, [6, 7]) == [GetStatus.LOADED] * 2
    assert [slot_bits(other_host, slot) for slot in (6, 7)] == [
        slot_bits(host, slot) for slot in (0, 1)
    ]


def test_instances_with_other_host_layouts_share_pages_bit_for_bit(
    backend_factory: BackendFactory, case: Case, host: HostKVPool
) -> None:
    # objects carry canonical bytes: the host layout is no part of the key, so it must not matter
    store = backend_factory.new_store()
    writer = backend_factory.make(case, host, store=store)
    pages = case.pages(2)
    writer.put(NS, pages, [2, 3])
    for layout in (HostLayout.PAGE_FIRST, HostLayout.PAGE_FIRST_DIRECT, HostLayout.PAGE_MAJOR):
        other_host = HostKVPool(case.shape, SLOTS, layout, pin_memory=False)
        reader = backend_factory.make(case, other_host, store=store)
        assert reader.get(NS, pages, [0, 1]) == [GetStatus.LOADED] * 2
        assert [slot_bits(other_host, 0), slot_bits(other_host, 1)] == [
            slot_bits(host, 2),
            slot_bits(host, 3),
        ]


def test_empty_batches(backend_factory: BackendFactory, case: Case, host: HostKVPool) -> None:
    backend = backend_factory.make(case, host)
    assert backend.exists(NS, []) == 0
    assert backend.put(NS, [], []) == []
    assert backend.get(NS, [], []) == []


# --------------------------------------------------------------------------------------- exists
def test_exists_counts_consecutive_pages_from_the_start(
    backend_factory: BackendFactory, case: Case, host: HostKVPool
) -> None:
    backend = backend_factory.make(case, host)
    pages = case.pages(4)
    backend.put(NS, [pages[0], pages[1], pages[3]], [0, 1, 3])

    assert backend.exists(NS, pages) == 2  # the gap at page 2 ends the run
    assert backend.exists(NS, pages[2:]) == 0
    assert backend.exists(NS, pages[3:]) == 1
    assert backend.exists(NS, [pages[1], pages[0]]) == 2  # order is the caller's


# ------------------------------------------------------------------------------ put-missing, writers
def test_put_writes_only_what_is_missing(
    backend_factory: BackendFactory, case: Case, host: HostKVPool
) -> None:
    backend = backend_factory.make(case, host)
    pages = case.pages(3)
    first = [slot_bits(host, slot) for slot in (0, 1)]
    assert backend.put(NS, pages[:2], [0, 1]) == [PutStatus.STORED] * 2

    fill(host, 0, seed=1)  # the slots now hold other bytes: the store keeps the first ones
    fill(host, 1, seed=2)
    again = backend_factory.again
    assert backend.put(NS, pages, [0, 1, 2]) == [again, again, PutStatus.STORED]
    assert backend.get(NS, pages[:2], [4, 5]) == [GetStatus.LOADED] * 2
    assert [slot_bits(host, slot) for slot in (4, 5)] == first


def test_a_page_twice_in_one_batch_is_written_once(
    backend_factory: BackendFactory, case: Case, host: HostKVPool
) -> None:
    backend = backend_factory.make(case, host)
    page = case.pages(1)[0]
    assert backend.put(NS, [page, page], [2, 3]) == [PutStatus.STORED, PutStatus.EXISTED]
    assert backend.get(NS, [page], [6]) == [GetStatus.LOADED]
    assert slot_bits(host, 6) == slot_bits(host, 2)


def test_non_writer_skips_and_stores_nothing(
    backend_factory: BackendFactory, case: Case, host: HostKVPool
) -> None:
    store = backend_factory.new_store()
    follower = backend_factory.make(case, host, store=store, writer=False)
    pages = case.pages(2)
    assert follower.put(NS, pages, [0, 1]) == [PutStatus.SKIPPED] * 2
    assert counters_of(follower) == BackendCounters(puts_skipped=2)

    leader = backend_factory.make(case, host, store=store)
    assert leader.exists(NS, pages) == 0
    assert leader.put(NS, pages, [0, 1]) == [PutStatus.STORED] * 2
    assert follower.exists(NS, pages) == 2  # a non-writer reads what the writer stored
    assert follower.get(NS, pages, [4, 5]) == [GetStatus.LOADED] * 2


# ---------------------------------------------------------------------------------------- eviction
def test_a_page_missing_one_component_is_a_miss(
    backend_factory: BackendFactory, case: Case, host: HostKVPool
) -> None:
    pages = case.pages(3)
    for component in case.components:
        backend = backend_factory.make(case, host)
        backend.put(NS, pages, [0, 1, 2])
        assert backend_factory.evict(backend, NS, pages[1], component) == 1

        assert backend.exists(NS, pages) == 1
        assert backend.exists(NS, pages[1:]) == 0
        assert backend.exists(NS, pages[2:]) == 1
        statuses = backend.get(NS, pages, [4, 5, 6])
        assert statuses == [GetStatus.LOADED, GetStatus.MISSING, GetStatus.LOADED]
        assert [slot_bits(host, 4), slot_bits(host, 6)] == [slot_bits(host, 0), slot_bits(host, 2)]

        # the page is written again: only its missing component, and then it is whole
        again = backend_factory.again
        assert backend.put(NS, pages, [0, 1, 2]) == [again, PutStatus.STORED, again]
        assert backend.exists(NS, pages) == 3
        assert backend.get(NS, pages[1:2], [7]) == [GetStatus.LOADED]
        assert slot_bits(host, 7) == slot_bits(host, 1)


def test_evicting_a_whole_page(
    backend_factory: BackendFactory, case: Case, host: HostKVPool
) -> None:
    backend = backend_factory.make(case, host)
    pages = case.pages(2)
    backend.put(NS, pages, [0, 1])
    assert backend_factory.evict(backend, NS, pages[0], None) == len(case.components)
    assert backend_factory.evict(backend, NS, pages[0], None) == 0
    assert backend.exists(NS, pages) == 0
    assert backend.get(NS, pages, [4, 5]) == [GetStatus.MISSING, GetStatus.LOADED]


# ------------------------------------------------------------------------------------------ isolation
def _variant(case: Case, what: str) -> KeySpace:
    space = case.space
    if what == "model":
        return attrs.evolve(space, model=attrs.evolve(space.model, name="tiny/model-other"))
    if what == "dtype":
        return attrs.evolve(space, model=attrs.evolve(space.model, dtype="fp8"))
    if what == "tp_size":
        shard = space.shard
        other = Shard(tp_rank=0, tp_size=1) if shard.tp_rank is None else Shard(1, tp_size=4)
        return attrs.evolve(space, shard=other)
    if what == "tag":
        return attrs.evolve(space, tag="green-7")
    if what == "no_tag":
        return attrs.evolve(space, tag=None)
    if what == "schema":  # issue 20: objects of two key schemas never answer each other
        return attrs.evolve(space, schema=3 - space.schema)
    raise AssertionError(what)


@pytest.mark.parametrize("what", ["model", "dtype", "tp_size", "tag", "no_tag", "schema"])
def test_another_key_space_sees_nothing(
    backend_factory: BackendFactory, case: Case, host: HostKVPool, what: str
) -> None:
    store = backend_factory.new_store()
    writer = backend_factory.make(case, host, store=store)
    pages = case.pages(2)
    writer.put(NS, pages, [0, 1])

    stranger = backend_factory.make(case, host, store=store, space=_variant(case, what))
    assert stranger.exists(NS, pages) == 0
    assert stranger.get(NS, pages, [4, 5]) == [GetStatus.MISSING] * 2
    assert stranger.put(NS, pages, [2, 3]) == [PutStatus.STORED] * 2  # its own objects
    assert writer.get(NS, pages, [6, 7]) == [GetStatus.LOADED] * 2
    assert [slot_bits(host, 6), slot_bits(host, 7)] == [slot_bits(host, 0), slot_bits(host, 1)]


def test_another_namespace_sees_nothing(
    backend_factory: BackendFactory, case: Case, host: HostKVPool
) -> None:
    backend = backend_factory.make(case, host)
    pages = case.pages(2)
    backend.put(NS, pages, [0, 1])
    for other in (DEFAULT_NAMESPACE, Namespace(extra_key="lora-7", salt="tenant-b")):
        assert backend.exists(other, pages) == 0  # the same page hashes under another namespace
        assert backend.get(other, pages, [4, 5]) == [GetStatus.MISSING] * 2
        assert backend.exists(other, case.pages(2, namespace=other)) == 0


# --------------------------------------------------------------------------------------- misuse
Call = Callable[[StorageBackend, list[PageHash]], object]
MISUSES: dict[str, Call] = {
    "put-lengths": lambda b, p: b.put(NS, p, [0]),
    "get-lengths": lambda b, p: b.get(NS, p[:1], [0, 1]),
    "put-index-high": lambda b, p: b.put(NS, p, [0, SLOTS]),
    "put-index-negative": lambda b, p: b.put(NS, p, [0, -1]),
    "put-index-bool": lambda b, p: b.put(NS, p, [0, True]),
    "get-index-high": lambda b, p: b.get(NS, p, [SLOTS, 0]),
    "put-index-float": lambda b, p: b.put(NS, p, [0, 1.0]),  # type: ignore[list-item]
    "put-store-key": lambda b, p: b.put(NS, [b.keyspace.page_keys(NS, p[0])[0]], [0]),  # type: ignore[list-item]
    "put-digest": lambda b, p: b.put(NS, [p[0], p[1].digest], [0, 1]),  # type: ignore[list-item]
    "put-hex": lambda b, p: b.put(NS, [p[0].hex()], [0]),  # type: ignore[list-item]
    "exists-hex": lambda b, p: b.exists(NS, [p[0], p[1].hex()]),  # type: ignore[list-item]
    "get-digest": lambda b, p: b.get(NS, [p[0].digest], [0]),  # type: ignore[list-item]
    "put-namespace": lambda b, p: b.put(None, p, [0, 1]),  # type: ignore[arg-type]
    "exists-namespace": lambda b, p: b.exists("default", p),  # type: ignore[arg-type]
    "put-generator": lambda b, p: b.put(NS, (page for page in p), [0, 1]),  # type: ignore[arg-type]
}


@pytest.mark.parametrize("misuse", MISUSES)
def test_misuse_raises_typed_and_stores_nothing(
    backend_factory: BackendFactory, case: Case, host: HostKVPool, misuse: str
) -> None:
    backend = backend_factory.make(case, host)
    pages = case.pages(2)
    with pytest.raises(MisuseError):
        MISUSES[misuse](backend, pages)
    assert backend.exists(NS, pages) == 0
    assert backend.exists(NS, pages[1:]) == 0
    assert counters_of(backend) == BackendCounters()


def test_calls_before_attach_are_misuse(backend_factory: BackendFactory, case: Case) -> None:
    backend = backend_factory.make(case)
    pages = case.pages(1)
    for call in (
        lambda: backend.exists(NS, pages),
        lambda: backend.put(NS, pages, [0]),
        lambda: backend.get(NS, pages, [0]),
    ):
        with pytest.raises(MisuseError, match="not attached"):
            call()


def test_attach_refuses_a_layer_first_or_foreign_pool(
    backend_factory: BackendFactory, case: Case, host: HostKVPool
) -> None:
    backend = backend_factory.make(case)
    with pytest.raises(ConfigError, match="layer_first"):
        backend.attach(HostKVPool(case.shape, SLOTS, HostLayout.LAYER_FIRST, pin_memory=False))
    other_kind = MLA if case.shape.kind is KVKind.MHA else MHA
    with pytest.raises(ConfigError):
        backend.attach(HostKVPool(other_kind, SLOTS, case.layout, pin_memory=False))
    with pytest.raises(MisuseError):
        backend.attach("host")  # type: ignore[arg-type]
    with pytest.raises(MisuseError, match="not attached"):
        backend.put(NS, case.pages(1), [0])

    backend.attach(host)
    backend.attach(host)  # the same pool again is fine
    with pytest.raises(MisuseError, match="another host pool"):
        backend.attach(case.host())
    assert backend.put(NS, case.pages(1), [0]) == [PutStatus.STORED]


def test_calls_after_close_are_misuse(
    backend_factory: BackendFactory, case: Case, host: HostKVPool
) -> None:
    store = backend_factory.new_store()
    backend = backend_factory.make(case, host, store=store)
    pages = case.pages(1)
    backend.put(NS, pages, [0])
    backend.close()
    backend.close()  # idempotent
    with pytest.raises(MisuseError, match="closed"):
        backend.exists(NS, pages)
    with pytest.raises(MisuseError, match="closed"):
        backend.attach(host)
    assert backend_factory.make(case, host, store=store).exists(NS, pages) == 1  # objects stay


# ---------------------------------------------------------------------------------- slot hygiene
def test_get_leaves_other_slots_untouched(
    backend_factory: BackendFactory, case: Case, host: HostKVPool
) -> None:
    backend = backend_factory.make(case, host)
    pages = case.pages(3)
    backend.put(NS, pages[:2], [0, 1])
    before = _all_slots(host)

    assert backend.get(NS, pages, [6, 3, 7]) == [
        GetStatus.LOADED,
        GetStatus.LOADED,
        GetStatus.MISSING,
    ]
    after = _all_slots(host)
    assert after[6] == before[0]
    assert after[3] == before[1]
    for slot in set(range(SLOTS)) - {3, 6, 7}:  # slot 7 (a miss) is unspecified by the contract
        assert after[slot] == before[slot], slot


def test_put_does_not_change_the_host_pool(
    backend_factory: BackendFactory, case: Case, host: HostKVPool
) -> None:
    backend = backend_factory.make(case, host)
    before = _all_slots(host)
    backend.put(NS, case.pages(4), [3, 2, 1, 0])
    assert _all_slots(host) == before


# ------------------------------------------------------------------------- agreement with the model
_PAGES = 3  # a tiny alphabet: the same pages keep being put, evicted and read
_PAGE = st.integers(0, _PAGES - 1)
_EVICT = st.tuples(st.just("evict"), _PAGE, st.sampled_from([None, 0, 1]))
_OPS = st.lists(
    st.one_of(
        st.tuples(st.just("put"), _PAGE, st.integers(1, _PAGES)),
        _EVICT,
        _EVICT,  # twice as likely: partial pages are what the contract is about
        st.tuples(st.just("scribble"), _PAGE, st.integers(0, 3)),
        st.tuples(st.just("exists"), _PAGE, st.just(0)),
        st.tuples(st.just("get"), _PAGE, st.integers(1, _PAGES)),
    ),
    min_size=4,
    max_size=40,
)


def _partial(model: StoreModel, keys: Sequence[StoreKey]) -> bool:
    present = [model.contains(key) for key in keys]
    return any(present) and not all(present)


def _replay(
    backend: StorageBackend,
    factory: BackendFactory,
    case: Case,
    host: HostKVPool,
    ops: Sequence[tuple[str, int, int | None]],
) -> None:
    """Apply ``ops`` to ``backend`` and to a :class:`StoreModel`, asserting they agree after every
    step. Page ``i`` comes from slot ``i``; gets land in the slots after the pages'."""
    model = StoreModel()
    pages = case.pages(_PAGES)
    keys = [case.space.page_keys(NS, page) for page in pages]
    for op, first, arg in ops:
        if op == "put":
            chosen = range(first, min(_PAGES, first + (arg or 1)))
            expected = []
            for index in chosen:
                if _partial(model, keys[index]):
                    event("put of a page missing one component")
                missing = [key for key in keys[index] if not model.contains(key)]
                for key in missing:
                    assert model.begin_put(key)
                    model.end_put(key, case.object_bits(host, index, keys[index].index(key)))
                expected.append(PutStatus.STORED if missing else factory.again)
            assert backend.put(NS, [pages[i] for i in chosen], list(chosen)) == expected
        elif op == "evict":
            component = None if arg is None else case.components[arg % len(case.components)]
            dropped = [
                key
                for key, name in zip(keys[first], case.components, strict=True)
                if component in (None, name) and model.evict(key)
            ]
            assert factory.evict(backend, NS, pages[first], component) == len(dropped)
        elif op == "scribble":
            fill(host, first, seed=7 * first + (arg or 0))
        elif op == "exists":
            counted = model.exists_pages(keys[first:])
            if first + counted < _PAGES and _partial(model, keys[first + counted]):
                event("exists stopped at a page missing one component")
            assert backend.exists(NS, pages[first:]) == model.exists_pages(keys[first:])
        else:
            chosen = range(first, min(_PAGES, first + (arg or 1)))
            targets = [_PAGES + offset for offset in range(len(chosen))]
            statuses = backend.get(NS, [pages[i] for i in chosen], targets)
            for index, target, status in zip(chosen, targets, statuses, strict=True):
                whole = all(model.contains(key) for key in keys[index])
                if _partial(model, keys[index]):
                    event("get of a page missing one component")
                assert status is (GetStatus.LOADED if whole else GetStatus.MISSING)
                if whole:
                    for number, key in enumerate(keys[index]):
                        assert case.object_bits(host, target, number) == model.get(key)
    assert backend.exists(NS, pages) == model.exists_pages(keys)


@settings(max_examples=max(10, settings.default.max_examples // 4))
@given(case=st.sampled_from([c for c in CASES if len(c.components) > 1]), ops=_OPS)
def test_random_sequences_agree_with_the_store_model(
    backend_factory: BackendFactory, case: Case, ops: list[tuple[str, int, int | None]]
) -> None:
    host = case.host()
    backend = backend_factory.make(case, host)
    # start from a full store, so that every single-component eviction makes a partial page
    _replay(backend, backend_factory, case, host, [("put", 0, _PAGES), *ops])
