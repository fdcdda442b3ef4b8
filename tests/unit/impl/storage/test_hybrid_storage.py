"""KV pages with side pools through every backend (``kvstrata.impl.storage.hybrid``, SPEC §5, I6).

One suite for the in-memory, the file and the real Mooncake backend (a ``mooncake_master`` on
loopback, started by the session fixture). Pages are a chain of page hashes; the KV host slots, the
indexer entries and the Mamba state slots hold random bit patterns, and every read is compared bit
for bit. Side objects are evicted one by one as the store's own eviction would, and ``exists`` and
``get`` must then report less, never a page whose side object is missing.
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
from kvstrata.model.hybrid import side_page_keys
from kvstrata.model.keys import (
    KeySpace,
    KVKind,
    ModelIdentity,
    Namespace,
    PageHash,
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
    new_store: Callable[[], object]
    open: Callable[[object], StorageBackend]
    drop: Callable[[StorageBackend, Sequence[StoreKey]], int]

    def node(self, store: object, layout: HostLayout = HostLayout.PAGE_FIRST_DIRECT) -> Node:
        host = HostKVPool(SHAPE, SLOTS, layout, pin_memory=False)
        indexer = SideBuffer(INDEXER, SLOTS, host=True)
        mamba = SideBuffer(MAMBA, STATES, host=True)
        storage = HybridStorage(self.open(store), [indexer, mamba])
        storage.attach(host)
        return Node(host, indexer, mamba, storage)


def _drop_object(backend: StorageBackend, keys: Sequence[StoreKey]) -> int:
    assert isinstance(backend, MemoryBackend | FileBackend)
    return backend.drop(keys)


@pytest.fixture(scope="module", params=["memory", "file", "mooncake"])
def backends(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Backends]:
    if request.param == "memory":
        yield Backends("memory", MemoryStore, lambda s: MemoryBackend(SPACE, store=s), _drop_object)  # type: ignore[arg-type]
    elif request.param == "file":
        counter = itertools.count()
        yield Backends(
            "file",
            lambda: tmp_path_factory.mktemp(f"hybrid-{next(counter)}"),
            lambda s: FileBackend(SPACE, s),  # type: ignore[arg-type]
            _drop_object,
        )
    else:
        client: MooncakeClient = request.getfixturevalue("mooncake_client")

        def new_store() -> object:
            assert client.remove_all(force=True) >= 0
            return client

        def drop(_backend: StorageBackend, keys: Sequence[StoreKey]) -> int:
            return sum(code == 0 for code in client.batch_remove(keys, force=True))

        yield Backends("mooncake", new_store, lambda s: MooncakeBackend(client, SPACE), drop)


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


def test_missing_indexer_object_cuts_the_hit(backends: Backends) -> None:
    store = backends.new_store()
    node = backends.node(store)
    node.fill(seed=3)
    back_up(node, {5: 0, 1: 1})
    indexer_key = side_page_keys(SPACE, NS, INDEXER.pool, PAGES[3])
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
    for component in MAMBA.components:  # any one component missing makes the state missing
        key = next(
            k
            for k in side_page_keys(SPACE, NS, MAMBA.pool, PAGES[5])
            if parse_store_key(k).component == component
        )
        assert backends.drop(node.storage.backend, [key]) == 1
        assert node.storage.exists(NS, PAGES).usable == 3  # the state ending page 2
        node.storage.put(NS, PAGES, list(range(6)), {"mamba": {5: 0}})
        assert node.storage.exists(NS, PAGES).usable == 6
    got = node.storage.get(NS, PAGES, list(range(6)), {"mamba": {5: 3}})
    assert got.usable == 6
    node.storage.put(NS, PAGES[:1], [0])  # no state: nothing new
    drop_all = [key for p in (2, 5) for key in side_page_keys(SPACE, NS, MAMBA.pool, PAGES[p])]
    backends.drop(node.storage.backend, drop_all)
    assert node.storage.exists(NS, PAGES) == hybrid_module.HybridHit(kv=6, usable=0)
    got = node.storage.get(NS, PAGES, list(range(6)), {"mamba": {5: 3}})
    assert got.states["mamba"][5] is GetStatus.MISSING and got.usable == 0


def test_exists_renders_each_side_key_once_and_never_past_the_kv_hit(
    backends: Backends, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = backends.new_store()
    node = backends.node(store)
    node.fill(seed=5)
    back_up(node, {3: 0})
    kv_key = SPACE.page_keys(NS, PAGES[4])[0]
    assert backends.drop(node.storage.backend, [kv_key]) == 1  # KV hit is 4 pages
    rendered: list[tuple[str, PageHash]] = []

    def counting(keys: KeySpace, ns: Namespace, pool: object, page: PageHash) -> object:
        rendered.append((pool.name, page))  # type: ignore[attr-defined]
        return side_page_keys(keys, ns, pool, page)  # type: ignore[arg-type]

    asked: list[StoreKey] = []
    present_all = hybrid_module.present_all

    def recording(asks: list[tuple[object, list[tuple[StoreKey, ...]]]]) -> list[list[bool]]:
        asked.extend(key for _io, keys in asks for entry in keys for key in entry)
        return present_all(asks)  # type: ignore[arg-type]

    monkeypatch.setattr(hybrid_module, "present_all", recording)
    monkeypatch.setattr(hybrid_module, "side_page_keys", counting)
    hit = node.storage.exists(NS, PAGES)
    assert (hit.kv, hit.usable) == (4, 4)
    assert len(rendered) == len(set(rendered))  # every (pool, page) rendered once
    assert {page for _, page in rendered} <= set(PAGES[:4])  # never at or past the KV hit
    assert len(asked) == len(set(asked)) == 4 * (1 + len(MAMBA.components))
    for key in asked:
        parts = parse_store_key(key)  # every key parses back: rendered once, by the schema
        assert parts.pool in ("indexer", "mamba")
        assert parts.page_hash in PAGES[:4]


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
        HybridStorage(backends.open(store), [node.indexer, node.indexer])
    unattached = HybridStorage(backends.open(store), [node.indexer])
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
