"""KV pages with side pools through every backend (``kvstrata.impl.storage.hybrid``, SPEC §5, I6).

One suite for the in-memory, the file and the real Mooncake backend (a ``mooncake_master`` on
loopback, started by the session fixture), each under key schema 1 (one object per side-pool
component) and 2 (one object per side-pool entry, issue 20). Pages are a chain of page hashes; the
KV host slots, the indexer entries and the Mamba state slots hold random bit patterns, and every
read is compared bit for bit. Side objects are evicted one by one as the store's own eviction would,
and ``exists`` and ``get`` must then report less, never a page whose side object is missing.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import attrs
import pytest
import torch

import kvstrata.impl.storage.hybrid as hybrid_module
from kvstrata.impl.errors import MisuseError
from kvstrata.impl.pools import HostKVPool, HostLayout, KVShape
from kvstrata.impl.pools.side import SideBuffer, indexer_spec, mamba_spec
from kvstrata.impl.storage.base import GetStatus, PutStatus, StorageBackend
from kvstrata.impl.storage.file import FileBackend
from kvstrata.impl.storage.hybrid import HybridStorage
from kvstrata.impl.storage.memory import MemoryBackend, MemoryStore
from kvstrata.impl.storage.mooncake import MooncakeBackend, MooncakeClient
from kvstrata.model.hybrid import side_components, side_page_keys
from kvstrata.model.keys import (
    KeySpace,
    KVKind,
    ModelIdentity,
    Namespace,
    RenderedKeys,
    Shard,
    StoreKey,
    chain_page_hashes,
    parse_store_key,
)

NS = Namespace(extra_key="lora-2", salt="hybrid")
SHAPE = KVShape(KVKind.MHA, layers=2, heads=1, head_dim=8, dtype=torch.float16, page_size=2)
SPACE = KeySpace(
    ModelIdentity(name="tiny-hybrid", dtype="float16", kind=KVKind.MHA, page_size=2),
    shard=Shard(tp_rank=0, tp_size=1),
    tag="green",
)
INDEXER = indexer_spec(layers=2, page_size=2, dim=4, dtype=torch.bfloat16)
MAMBA = mamba_spec(layers=1, conv=[(3, 4)], temporal=(2, 3), dtype=[torch.float16, torch.float32])
SLOTS = 8
STATES = 4
PAGES = list(chain_page_hashes(list(range(10, 22)), 2, NS))  # 6 pages


@attrs.define
class Node:
    """One instance's host side: KV pool, indexer and state buffers, and its hybrid storage."""

    host: HostKVPool
    indexer: SideBuffer
    mamba: SideBuffer
    storage: HybridStorage

    def fill(self, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        for tensor in (self.host.buffer, *self.indexer.tensors, *self.mamba.tensors):
            raw = torch.randint(0, 256, (tensor.numel() * tensor.element_size(),), generator=gen)
            tensor.view(-1).view(torch.uint8).copy_(raw.to(torch.uint8))


def kv_bits(host: HostKVPool, slot: int) -> bytes:
    return host.read_pages([slot]).contiguous().view(-1).view(torch.uint8).numpy().tobytes()


def entry_bits(buffer: SideBuffer, entry: int) -> bytes:
    return b"".join(
        t[entry].reshape(-1).view(torch.uint8).numpy().tobytes() for t in buffer.tensors
    )


@attrs.frozen
class Backends:
    name: str
    space: KeySpace
    new_store: Callable[[], object]
    #: a backend over a store, in a key space
    open: Callable[[object, KeySpace], StorageBackend]
    drop: Callable[[StorageBackend, Sequence[StoreKey]], int]
    #: the bytes the store holds under a key (``None``: no such object), read past kvstrata's movers
    raw: Callable[[StorageBackend, StoreKey, int], bytes | None]
    #: store these bytes under a key past kvstrata's movers (a foreign or broken writer)
    plant: Callable[[StorageBackend, StoreKey, bytes], None]

    def node(self, store: object, layout: HostLayout = HostLayout.PAGE_FIRST_DIRECT) -> Node:
        host = HostKVPool(SHAPE, SLOTS, layout, pin_memory=False)
        indexer = SideBuffer(INDEXER, SLOTS, host=True)
        mamba = SideBuffer(MAMBA, STATES, host=True)
        storage = HybridStorage(self.open(store, self.space), [indexer, mamba])
        storage.attach(host)
        return Node(host, indexer, mamba, storage)


def _drop_object(backend: StorageBackend, keys: Sequence[StoreKey]) -> int:
    assert isinstance(backend, MemoryBackend | FileBackend)
    return backend.drop(keys)


def _raw_object(backend: StorageBackend, key: StoreKey, size: int) -> bytes | None:
    assert isinstance(backend, MemoryBackend | FileBackend)
    loaded = backend._read([key], size)
    return None if isinstance(loaded, GetStatus) else bytes(loaded[0])


def _plant_object(backend: StorageBackend, key: StoreKey, data: bytes) -> None:
    assert isinstance(backend, MemoryBackend | FileBackend)
    assert backend._write([(key, data)], [key]) is PutStatus.STORED


@pytest.fixture(
    scope="module",
    params=[(name, schema) for name in ("memory", "file", "mooncake") for schema in (1, 2)],
    ids=lambda param: f"{param[0]}-schema{param[1]}",
)
def backends(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Backends]:
    name, schema = request.param
    space = attrs.evolve(SPACE, schema=schema)
    if name == "memory":
        yield Backends(
            "memory",
            space,
            MemoryStore,
            lambda s, k: MemoryBackend(k, store=s),  # type: ignore[arg-type]
            _drop_object,
            _raw_object,
            _plant_object,
        )
    elif name == "file":
        counter = itertools.count()
        yield Backends(
            "file",
            space,
            lambda: tmp_path_factory.mktemp(f"hybrid-{next(counter)}"),
            lambda s, k: FileBackend(k, s),  # type: ignore[arg-type]
            _drop_object,
            _raw_object,
            _plant_object,
        )
    else:
        client: MooncakeClient = request.getfixturevalue("mooncake_client")

        def new_store() -> object:
            assert client.remove_all(force=True) >= 0
            return client

        def drop(_backend: StorageBackend, keys: Sequence[StoreKey]) -> int:
            return sum(code == 0 for code in client.batch_remove(keys, force=True))

        def raw(_backend: StorageBackend, key: StoreKey, size: int) -> bytes | None:
            landing = torch.zeros(size + 64, dtype=torch.uint8)  # room to see an oversized object
            client.register_buffer(landing.data_ptr(), landing.numel())
            try:
                code = client.batch_get_into([key], [landing.data_ptr()], [landing.numel()])[0]
            finally:
                client.unregister_buffer(landing.data_ptr())
            return None if code < 0 else landing[:code].numpy().tobytes()

        def plant(_backend: StorageBackend, key: StoreKey, data: bytes) -> None:
            source = torch.frombuffer(bytearray(data), dtype=torch.uint8)
            client.register_buffer(source.data_ptr(), source.numel())
            try:
                assert client.batch_put_from([key], [source.data_ptr()], [source.numel()]) == [0]
            finally:
                client.unregister_buffer(source.data_ptr())

        yield Backends(
            "mooncake", space, new_store, lambda s, k: MooncakeBackend(client, k), drop, raw, plant
        )


def back_up(node: Node, states: dict[int, int] | None = None) -> None:
    """Put every page of PAGES from slots 0..5, with the states asked for (position -> slot)."""
    result = node.storage.put(NS, PAGES, list(range(len(PAGES))), {"mamba": states or {}})
    assert all(s is PutStatus.STORED for s in result.pages), result
    assert all(s is PutStatus.STORED for s in result.states["mamba"].values()), result


def test_round_trip_bit_for_bit_across_instances(backends: Backends) -> None:
    store = backends.new_store()
    writer = backends.node(store)
    writer.fill(seed=1)
    back_up(writer, {5: 2, 2: 0})
    reader = backends.node(store, HostLayout.PAGE_FIRST)
    reader.fill(seed=2)
    assert reader.storage.exists(NS, PAGES).usable == 6
    slots = [7, 6, 5, 4, 3, 2]
    got = reader.storage.get(NS, PAGES, slots, {"mamba": {5: 3, 2: 1}})
    assert got.pages == [GetStatus.LOADED] * 6 and got.usable == 6
    assert got.states == {"mamba": {5: GetStatus.LOADED, 2: GetStatus.LOADED}}
    for position, slot in enumerate(slots):
        assert kv_bits(reader.host, slot) == kv_bits(writer.host, position)
        assert entry_bits(reader.indexer, slot) == entry_bits(writer.indexer, position)
    assert entry_bits(reader.mamba, 3) == entry_bits(writer.mamba, 2)
    assert entry_bits(reader.mamba, 1) == entry_bits(writer.mamba, 0)
    # a second put writes nothing new (Mooncake: the master deduplicates it, the confirm says
    # STORED; issue 20)
    again = writer.storage.put(NS, PAGES, list(range(6)), {"mamba": {5: 2}})
    held = PutStatus.STORED if backends.name == "mooncake" else PutStatus.EXISTED
    assert again.pages == [held] * 6
    assert again.states == {"mamba": {5: held}}


def test_side_objects_hold_each_schemas_bytes(backends: Backends) -> None:
    """What the store holds for a side entry, read past kvstrata's movers: under schema 1 one
    object per component with exactly that component's bytes; under schema 2 one object per entry
    (component ``page``) with every component's bytes concatenated in component order."""
    store = backends.new_store()
    node = backends.node(store)
    node.fill(seed=11)
    back_up(node, {4: 3})
    backend = node.storage.backend
    for pool, buffer, position, entry in (
        (INDEXER.pool, node.indexer, 1, 1),
        (INDEXER.pool, node.indexer, 5, 5),
        (MAMBA.pool, node.mamba, 4, 3),
    ):
        keys = side_page_keys(backends.space, NS, pool, PAGES[position])
        components = side_components(backends.space, pool)
        assert [parse_store_key(key).component for key in keys] == list(components)
        if backends.space.schema == 1:
            expected = [
                tensor[entry].reshape(-1).view(torch.uint8).numpy().tobytes()
                for tensor in buffer.tensors
            ]
        else:
            assert components == ("page",)
            expected = [entry_bits(buffer, entry)]
        for key, bits in zip(keys, expected, strict=True):
            assert backends.raw(backend, key, len(bits)) == bits


def test_the_other_schemas_side_objects_are_never_seen(backends: Backends) -> None:
    """A writer under the other key schema stores the same pages' KV and side objects; this
    instance sees none of them (the version is part of every key), and reads none of its bytes."""
    store = backends.new_store()
    other = attrs.evolve(
        backends, space=attrs.evolve(backends.space, schema=3 - backends.space.schema)
    )
    stranger = other.node(store)
    stranger.fill(seed=12)
    back_up(stranger, {5: 1})
    assert stranger.storage.exists(NS, PAGES).usable == 6
    node = backends.node(store)
    node.fill(seed=13)
    before = entry_bits(node.mamba, 2)
    assert node.storage.exists(NS, PAGES) == hybrid_module.HybridHit(kv=0, usable=0)
    got = node.storage.get(NS, PAGES, list(range(6)), {"mamba": {5: 2}})
    assert got.usable == 0 and got.states["mamba"][5] is not GetStatus.LOADED
    assert entry_bits(node.mamba, 2) == before


@pytest.mark.parametrize("off_by", [-1, 1])
def test_a_wrong_sized_side_object_is_never_loaded(backends: Backends, off_by: int) -> None:
    """A foreign writer left a Mamba state object one byte short or long under the state's key (one
    component's object under schema 1, the whole entry under 2). ``exists`` may count it (Mooncake
    does not check sizes) but no read of it is ``LOADED``, the usable prefix stops before it, and
    the pages below keep their bytes."""
    store = backends.new_store()
    writer = backends.node(store)
    writer.fill(seed=21)
    back_up(writer, {5: 0, 2: 1})
    key = side_page_keys(backends.space, NS, MAMBA.pool, PAGES[5])[-1]
    whole = backends.space.schema == 2
    size = MAMBA.bytes_per_entry if whole else MAMBA.component_bytes()[-1]
    assert backends.raw(writer.storage.backend, key, size) is not None
    assert backends.drop(writer.storage.backend, [key]) == 1
    backends.plant(writer.storage.backend, key, b"\x5a" * (size + off_by))
    reader = backends.node(store)
    reader.fill(seed=22)
    got = reader.storage.get(NS, PAGES, list(range(6)), {"mamba": {5: 3, 2: 2}})
    assert got.pages == [GetStatus.LOADED] * 6
    assert got.states["mamba"][5] is not GetStatus.LOADED
    assert got.states["mamba"][2] is GetStatus.LOADED and got.usable == 3
    assert entry_bits(reader.mamba, 2) == entry_bits(writer.mamba, 1)
    for slot in range(6):
        assert kv_bits(reader.host, slot) == kv_bits(writer.host, slot)
    # Mooncake's batch_is_exist answers for the key whatever its size; the object stores check it
    assert reader.storage.exists(NS, PAGES).usable == (6 if backends.name == "mooncake" else 3)
    assert reader.storage.read_state(NS, PAGES, 6, 3) == 3  # the deepest state that reads whole


def test_missing_indexer_object_cuts_the_hit(backends: Backends) -> None:
    store = backends.new_store()
    node = backends.node(store)
    node.fill(seed=3)
    back_up(node, {5: 0, 1: 1})
    indexer_key = side_page_keys(backends.space, NS, INDEXER.pool, PAGES[3])
    assert backends.drop(node.storage.backend, indexer_key) == 1
    hit = node.storage.exists(NS, PAGES)
    # KV holds all 6 pages; the indexer only 0..2; the deepest state at or below 3 ends page 1
    assert (hit.kv, hit.usable) == (6, 2)
    got = node.storage.get(NS, PAGES, [7, 6, 5, 4, 3, 2], {"mamba": {1: 2}})
    assert got.pages[3] is GetStatus.MISSING
    assert got.usable == 2


def test_missing_state_reports_less_never_wrong(backends: Backends) -> None:
    store = backends.new_store()
    node = backends.node(store)
    node.fill(seed=4)
    back_up(node, {5: 0, 2: 1})
    assert node.storage.exists(NS, PAGES).usable == 6
    # any one object missing (one component under schema 1, the whole entry under 2) makes the
    # state missing
    for key in side_page_keys(backends.space, NS, MAMBA.pool, PAGES[5]):
        assert backends.drop(node.storage.backend, [key]) == 1
        assert node.storage.exists(NS, PAGES).usable == 3  # the state ending page 2
        node.storage.put(NS, PAGES, list(range(6)), {"mamba": {5: 0}})
        assert node.storage.exists(NS, PAGES).usable == 6
    got = node.storage.get(NS, PAGES, list(range(6)), {"mamba": {5: 3}})
    assert got.usable == 6
    node.storage.put(NS, PAGES[:1], [0])  # no state: nothing new
    drop_all = [
        key for p in (2, 5) for key in side_page_keys(backends.space, NS, MAMBA.pool, PAGES[p])
    ]
    backends.drop(node.storage.backend, drop_all)
    assert node.storage.exists(NS, PAGES) == hybrid_module.HybridHit(kv=6, usable=0)
    got = node.storage.get(NS, PAGES, list(range(6)), {"mamba": {5: 3}})
    assert got.states["mamba"][5] is GetStatus.MISSING and got.usable == 0


def test_exists_renders_each_side_key_once_and_never_past_the_kv_hit(
    backends: Backends, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every side key ``exists`` asks the store about is asked once, parses back (rendered by the
    schema, once), names a page below the KV hit and one of the objects the schema stores (on
    Mooncake: one batch of text for every side pool, issue 20)."""
    store = backends.new_store()
    node = backends.node(store)
    node.fill(seed=5)
    back_up(node, {3: 0})
    kv_key = backends.space.page_keys(NS, PAGES[4])[0]
    assert backends.drop(node.storage.backend, [kv_key]) == 1  # KV hit is 4 pages
    asked: list[str] = []
    backend = node.storage.backend
    if isinstance(backend, MooncakeBackend):
        is_exist = backend._is_exist

        def recording(keys: Sequence[StoreKey] | RenderedKeys) -> list[int]:
            asked.extend(keys.texts if isinstance(keys, RenderedKeys) else [k.text for k in keys])
            return is_exist(keys)

        monkeypatch.setattr(backend, "_is_exist", recording)
    else:
        assert isinstance(backend, MemoryBackend | FileBackend)
        present = backend._present

        def recording_present(keys: Sequence[StoreKey], nbytes: int) -> list[bool] | None:
            asked.extend(key.text for key in keys)
            return present(keys, nbytes)

        monkeypatch.setattr(backend, "_present", recording_present)
    hit = node.storage.exists(NS, PAGES)
    assert (hit.kv, hit.usable) == (4, 4)
    side = [key for key in asked if parse_store_key(key).pool != "kv"]
    objects = {
        pool.segment: side_components(backends.space, pool) for pool in (INDEXER.pool, MAMBA.pool)
    }
    assert len(side) == len(set(side)) == 4 * sum(len(names) for names in objects.values())
    for key in side:
        parts = parse_store_key(key)  # every key parses back: rendered once, by the schema
        assert parts.component in objects[parts.pool]
        assert parts.page_hash in PAGES[:4]  # never at or past the KV hit


def test_misuse_raises_and_stores_nothing(backends: Backends) -> None:
    store = backends.new_store()
    node = backends.node(store)
    for bad in (
        {"mamba": {6: 0}},  # position past the batch
        {"mamba": {0: STATES}},  # slot out of range
        {"indexer": {0: 0}},  # an ALL_PAGES pool has no states
        {"nope": {0: 0}},
    ):
        with pytest.raises(MisuseError):
            node.storage.put(NS, PAGES, list(range(6)), bad)
    assert node.storage.exists(NS, PAGES).kv == 0
    with pytest.raises(MisuseError):
        HybridStorage(backends.open(store, backends.space), [node.indexer, node.indexer])
    unattached = HybridStorage(backends.open(store, backends.space), [node.indexer])
    with pytest.raises(MisuseError):
        unattached.put(NS, PAGES[:1], [0])


def test_store_failures_are_statuses_not_exceptions() -> None:
    store = MemoryStore()
    backend = MemoryBackend(SPACE, store=store)
    host = HostKVPool(SHAPE, SLOTS, HostLayout.PAGE_FIRST_DIRECT, pin_memory=False)
    storage = HybridStorage(backend, [SideBuffer(INDEXER, SLOTS, host=True)])
    storage.attach(host)
    backend.down = True
    result = storage.put(NS, PAGES, list(range(6)))
    assert result.pages == [PutStatus.FAILED] * 6
    assert storage.exists(NS, PAGES).usable == 0
    backend.down = False
    storage.put(NS, PAGES, list(range(6)))
    backend.fail_next(1, op="get", after=3)  # the KV read serves 3 pages, fails the rest
    got = storage.get(NS, PAGES, list(range(6)))
    assert got.pages == [GetStatus.LOADED] * 3 + [GetStatus.FAILED] * 3 and got.usable == 3
    backend.fail_next(1, op="get", after=6)  # the KV read serves all 6 pages...
    backend.fail_next(1, op="get", after=2)  # ...the indexer read only 2
    got = storage.get(NS, PAGES, list(range(6)))
    assert got.pages == [GetStatus.LOADED] * 2 + [GetStatus.FAILED] * 4 and got.usable == 2
    assert storage.exists(NS, PAGES).usable == 6
    non_writer = HybridStorage(
        MemoryBackend(SPACE, store=store, writer=False), [SideBuffer(INDEXER, SLOTS, host=True)]
    )
    non_writer.attach(host)
    assert non_writer.put(NS, PAGES[:2], [0, 1]).pages == [PutStatus.SKIPPED] * 2


def test_side_objects_of_a_backend_dir(tmp_path: Path) -> None:
    """The file backend keeps side objects as files like any page object (one per component)."""
    backend = FileBackend(SPACE, tmp_path)
    host = HostKVPool(SHAPE, SLOTS, HostLayout.PAGE_FIRST_DIRECT, pin_memory=False)
    mamba = SideBuffer(MAMBA, STATES, host=True)
    storage = HybridStorage(backend, [mamba])
    storage.attach(host)
    storage.put(NS, PAGES[:2], [0, 1], {"mamba": {1: 3}})
    for key in side_page_keys(SPACE, NS, MAMBA.pool, PAGES[1]):
        assert backend.path_of(key).is_file()


@pytest.mark.parametrize("schema", [1, 2])
def test_a_side_put_no_reader_sees_is_failed_not_stored(schema: int) -> None:
    """A two-phase store that accepts a put and shows it later (or never): the side entries are
    FAILED like the KV pages, so their backup is retried (the review's find of 2026-11-28: the
    states and indexer keys answered STORED, unpinned, and were lost with the put)."""
    store = MemoryStore()
    space = attrs.evolve(SPACE, schema=schema)
    backend = MemoryBackend(space, store=store)
    host = HostKVPool(SHAPE, SLOTS, HostLayout.PAGE_FIRST_DIRECT, pin_memory=False)
    storage = HybridStorage(
        backend, [SideBuffer(INDEXER, SLOTS, host=True), SideBuffer(MAMBA, STATES, host=True)]
    )
    storage.attach(host)
    backend.hold_puts = True
    result = storage.put(NS, PAGES[:2], [0, 1], {"mamba": {1: 0}})
    assert result.pages == [PutStatus.FAILED, PutStatus.FAILED]
    assert result.states["mamba"] == {1: PutStatus.FAILED}
    assert storage.put_states(NS, PAGES[:2], [0, 1]) == [PutStatus.FAILED, PutStatus.FAILED]
    assert backend.counters.puts_unconfirmed >= 3
