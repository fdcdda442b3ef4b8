"""What only the in-memory backend does (``kvstrata.impl.storage.memory``): its byte capacity with LRU
eviction of whole objects, its fault-injection hooks (down, full, fail_next, two-phase puts), a store
shared by several clients, and thread safety. The contract it shares with every backend is in
``test_backend_contract.py``.
"""

from __future__ import annotations

import random
import threading

import pytest
import torch

from kvstrata.impl.errors import ConfigError, MisuseError
from kvstrata.impl.pools import HostKVPool, KVShape
from kvstrata.impl.storage.base import GetStatus, PutStatus
from kvstrata.impl.storage.counters import BackendCounters
from kvstrata.impl.storage.memory import MemoryBackend, MemoryStore
from kvstrata.impl.storage.objects import Op
from kvstrata.model.keys import (
    KeySpace,
    KVKind,
    ModelIdentity,
    Namespace,
    PageHash,
    Shard,
    chain_page_hashes,
)

NS = Namespace(extra_key="lora-1")
MHA = KVShape(kind=KVKind.MHA, layers=2, heads=2, head_dim=4, dtype=torch.float16, page_size=4)
MLA = KVShape(kind=KVKind.MLA, layers=3, heads=1, head_dim=8, dtype=torch.bfloat16, page_size=2)
SLOTS = 8


def space(shape: KVShape) -> KeySpace:
    model = ModelIdentity(
        "tiny", str(shape.dtype).removeprefix("torch."), shape.kind, shape.page_size
    )
    shard = Shard.replicated() if shape.kind is KVKind.MLA else Shard(tp_rank=0, tp_size=2)
    return KeySpace(model=model, shard=shard, tag="t1")


def object_bytes(shape: KVShape) -> int:
    return shape.bytes_per_page // shape.planes


def pages(shape: KVShape, count: int) -> list[PageHash]:
    return list(chain_page_hashes(list(range(count * shape.page_size)), shape.page_size, NS))


def make_host(shape: KVShape) -> HostKVPool:
    host = HostKVPool(shape, SLOTS, "page_first_direct", pin_memory=False)
    for slot in range(SLOTS):
        generator = torch.Generator().manual_seed(slot)
        raw = torch.randint(0, 256, (shape.nbytes(1),), dtype=torch.uint8, generator=generator)
        host.write_pages([slot], raw.view(shape.dtype).reshape(shape.canonical(1)))
    return host


def slot_bits(host: HostKVPool, slot: int) -> bytes:
    return host.read_pages([slot]).reshape(-1).view(torch.uint8).numpy().tobytes()


def backend(
    shape: KVShape,
    store: MemoryStore | None = None,
    host: HostKVPool | None = None,
    **kwargs: object,
) -> MemoryBackend:
    made = MemoryBackend(space(shape), store=store, **kwargs)  # type: ignore[arg-type]
    made.attach(make_host(shape) if host is None else host)
    return made


# ------------------------------------------------------------------------------------------ capacity
def test_capacity_evicts_least_recently_used_objects() -> None:
    size = object_bytes(MLA)
    b = backend(MLA, MemoryStore(capacity_bytes=3 * size))
    p = pages(MLA, 5)
    assert b.put(NS, p[:3], [0, 1, 2]) == [PutStatus.STORED] * 3
    assert b.get(NS, p[:1], [5]) == [GetStatus.LOADED]  # p0 is now the most recently used
    assert b.exists(NS, p[1:2]) == 1  # probing is not using: p1 stays least recently used

    assert b.put(NS, p[3:4], [3]) == [PutStatus.STORED]
    assert [b.exists(NS, [page]) for page in p[:4]] == [1, 0, 1, 1]
    assert b.store.visible_keys() == tuple(b.keyspace.page_keys(NS, p[i])[0] for i in (2, 0, 3))
    assert b.store.used_bytes == 3 * size
    assert b.counters.objects_evicted == 1


def test_capacity_evicts_components_independently() -> None:
    size = object_bytes(MHA)
    b = backend(MHA, MemoryStore(capacity_bytes=3 * size))
    p = pages(MHA, 2)
    b.put(NS, p[:1], [0])
    assert b.put(NS, p[1:], [1]) == [PutStatus.STORED]  # room for 2 objects: p0's k goes
    assert b.exists(NS, p[:1]) == 0
    assert b.exists(NS, p[1:]) == 1
    assert b.get(NS, p, [4, 5]) == [GetStatus.MISSING, GetStatus.LOADED]
    k0, v0 = b.keyspace.page_keys(NS, p[0])
    stored = b.store.visible_keys()
    assert k0 not in stored and v0 in stored


def test_a_page_that_cannot_fit_is_full_and_evicts_nothing() -> None:
    size = object_bytes(MHA)
    b = backend(MHA, MemoryStore(capacity_bytes=size))  # one object, a page needs two
    p = pages(MHA, 1)
    assert b.put(NS, p, [0]) == [PutStatus.FULL]
    assert len(b.store) == 0 and b.store.used_bytes == 0
    assert b.counters.snapshot() == BackendCounters(puts_full=1)

    roomy = backend(MHA, MemoryStore(capacity_bytes=3 * size))
    roomy.hold_puts = True
    roomy.put(NS, p, [0])  # two objects reserved: held objects are never evicted
    roomy.hold_puts = False
    assert roomy.put(NS, pages(MHA, 2)[1:], [1]) == [PutStatus.FULL]
    assert roomy.store.used_bytes == 2 * size


def test_capacity_accepts_size_strings_and_refuses_nonsense() -> None:
    assert MemoryStore("1KiB").capacity_bytes == 1024
    assert MemoryStore().capacity_bytes is None
    with pytest.raises(ConfigError):
        MemoryStore("lots")
    with pytest.raises(ConfigError):
        MemoryStore(0)


# ------------------------------------------------------------------------------------- fault hooks
def test_down_fails_every_call_without_raising() -> None:
    b = backend(MHA)
    p = pages(MHA, 2)
    b.put(NS, p[:1], [0])
    b.down = True
    assert b.exists(NS, p) == 0
    assert b.put(NS, p, [0, 1]) == [PutStatus.FAILED] * 2
    assert b.get(NS, p[:1], [4]) == [GetStatus.FAILED]
    follower = backend(MHA, b.store, writer=False)
    follower.down = True
    assert follower.put(NS, p, [0, 1]) == [PutStatus.SKIPPED] * 2  # never talks to the store

    b.down = False
    assert b.exists(NS, p) == 1
    assert b.counters.snapshot() == BackendCounters(
        puts_stored=1,
        puts_failed=2,
        gets_failed=1,
        bytes_written=MHA.bytes_per_page,
    )


def test_full_refuses_missing_pages_only() -> None:
    b = backend(MHA)
    p = pages(MHA, 2)
    b.put(NS, p[:1], [0])
    b.full = True
    assert b.put(NS, p, [0, 1]) == [PutStatus.EXISTED, PutStatus.FULL]
    assert b.exists(NS, p) == 1
    b.clear_faults()
    assert b.put(NS, p, [0, 1]) == [PutStatus.EXISTED, PutStatus.STORED]


def test_fail_next_serves_a_prefix_then_fails_the_rest() -> None:
    b = backend(MLA)
    p = pages(MLA, 3)
    b.fail_next(op="put", after=1)
    assert b.exists(NS, p) == 0  # not a put: the fault waits
    assert b.put(NS, p, [0, 1, 2]) == [PutStatus.STORED, PutStatus.FAILED, PutStatus.FAILED]
    assert b.exists(NS, p) == 1
    assert b.put(NS, p, [0, 1, 2]) == [PutStatus.EXISTED, PutStatus.STORED, PutStatus.STORED]

    b.fail_next(op=Op.GET, after=2)
    assert b.get(NS, p, [4, 5, 6]) == [GetStatus.LOADED, GetStatus.LOADED, GetStatus.FAILED]
    b.fail_next(op=Op.EXISTS, after=2)
    assert b.exists(NS, p) == 2
    assert b.exists(NS, p) == 3


def test_fail_next_counts_calls_with_pages() -> None:
    b = backend(MLA)
    p = pages(MLA, 2)
    b.fail_next(2, status=PutStatus.FULL)
    assert b.put(NS, [], []) == []  # an empty call consumes nothing
    assert b.exists(NS, p) == 0
    assert b.put(NS, p, [0, 1]) == [PutStatus.FULL] * 2
    assert b.put(NS, p, [0, 1]) == [PutStatus.STORED] * 2
    b.fail_next(3)
    b.clear_faults()
    assert b.exists(NS, p) == 2


@pytest.mark.parametrize(
    "kwargs",
    [
        {"n": 0},
        {"n": True},
        {"after": -1},
        {"status": PutStatus.STORED},
        {"status": GetStatus.FAILED},
        {"op": "delete"},
    ],
)
def test_fail_next_refuses_nonsense(kwargs: dict[str, object]) -> None:
    with pytest.raises(MisuseError):
        backend(MLA).fail_next(**kwargs)  # type: ignore[arg-type]


# ------------------------------------------------------------------------------- two-phase puts
def test_held_puts_are_invisible_until_released() -> None:
    store = MemoryStore()
    writer, reader = backend(MHA, store), backend(MHA, store)
    p = pages(MHA, 1)
    writer.hold_puts = True
    # the store accepted the write, but the confirm step sees nothing: never STORED
    assert writer.put(NS, p, [0]) == [PutStatus.FAILED]
    assert writer.counters.snapshot() == BackendCounters(puts_failed=1, puts_unconfirmed=1)
    assert store.pending_keys() == frozenset(writer.keyspace.page_keys(NS, p[0]))
    assert writer.exists(NS, p) == 0 and reader.exists(NS, p) == 0
    assert reader.get(NS, p, [4]) == [GetStatus.MISSING]
    assert reader.put(NS, p, [1]) == [PutStatus.FAILED]  # another writer is mid-put
    assert writer.put(NS, p, [0]) == [PutStatus.FAILED]  # its own retry, too, until published

    assert writer.release_puts() == 2
    assert reader.get(NS, p, [4]) == [GetStatus.LOADED]
    assert slot_bits(host_of(reader), 4) == slot_bits(host_of(writer), 0)
    writer.hold_puts = False
    assert writer.put(NS, p, [0]) == [PutStatus.EXISTED]


def test_held_puts_are_published_or_lost_key_by_key() -> None:
    store = MemoryStore()
    writer = backend(MHA, store)
    p = pages(MHA, 2)
    writer.hold_puts = True
    assert writer.put(NS, p, [0, 1]) == [PutStatus.FAILED] * 2
    first, second = writer.keyspace.page_keys(NS, p[0]), writer.keyspace.page_keys(NS, p[1])
    assert writer.release_puts(first) == 2  # the first page becomes visible
    assert writer.abort_puts(second[:1]) == 1  # one object of the second page is lost
    assert writer.exists(NS, p) == 1
    assert store.pending_keys() == frozenset(second[1:])
    writer.hold_puts = False
    # the lost object is written again at once; the held one still blocks the page
    assert writer.put(NS, p, [0, 1]) == [PutStatus.EXISTED, PutStatus.FAILED]
    assert store.pending_keys() == frozenset(second[1:]) and writer.exists(NS, p) == 1
    assert writer.release_puts() == 1
    assert writer.put(NS, p, [0, 1]) == [PutStatus.EXISTED, PutStatus.EXISTED]
    assert writer.exists(NS, p) == 2


def host_of(b: MemoryBackend) -> HostKVPool:
    assert b.host is not None
    return b.host


def test_aborted_or_closed_puts_vanish_and_free_their_room() -> None:
    size = object_bytes(MHA)
    store = MemoryStore(capacity_bytes=2 * size)
    writer, other = backend(MHA, store), backend(MHA, store)
    p = pages(MHA, 1)
    writer.hold_puts = True
    writer.put(NS, p, [0])
    assert store.used_bytes == 2 * size
    assert writer.abort_puts() == 2
    assert store.used_bytes == 0 and store.pending_keys() == frozenset()

    writer.put(NS, p, [0])
    writer.close()  # a client that goes away mid-put leaves nothing behind
    assert store.pending_keys() == frozenset()
    assert other.put(NS, p, [1]) == [PutStatus.STORED]


# ------------------------------------------------------------------------------------ sharing
def test_clients_share_exactly_their_store() -> None:
    store = MemoryStore()
    a, b, alone = backend(MLA, store), backend(MLA, store), backend(MLA)
    p = pages(MLA, 2)
    a.put(NS, p, [0, 1])
    assert b.exists(NS, p) == 2
    assert alone.exists(NS, p) == 0
    assert b.evict(NS, p[0]) == 1  # eviction is the store's: every client sees it
    assert a.exists(NS, p) == 0


def test_constructor_refuses_conflicting_arguments() -> None:
    with pytest.raises(ConfigError):
        MemoryBackend(space(MLA), store=MemoryStore(), capacity_bytes=1024)
    with pytest.raises(MisuseError):
        MemoryBackend(space(MLA), store={})  # type: ignore[arg-type]
    with pytest.raises(ConfigError):
        MemoryBackend(space(MLA), writer=1)  # type: ignore[arg-type]
    with pytest.raises(MisuseError):
        MemoryBackend("keyspace")  # type: ignore[arg-type]
    embedding = ModelIdentity("tiny", "bf16", KVKind.EMBEDDING, dim=16)
    with pytest.raises(ConfigError):
        MemoryBackend(KeySpace(model=embedding))
    with pytest.raises(MisuseError):
        backend(MLA).evict(NS, pages(MLA, 1)[0], "k")  # MLA pages have a latent only


# ------------------------------------------------------------------------------ stronger than contract
def test_a_miss_leaves_its_slot_untouched() -> None:
    b = backend(MHA)
    host = host_of(b)
    p = pages(MHA, 1)
    b.put(NS, p, [0])
    b.evict(NS, p[0], "v")
    before = slot_bits(host, 5)
    assert b.get(NS, p, [5]) == [GetStatus.MISSING]
    assert slot_bits(host, 5) == before


def test_an_object_of_the_wrong_size_is_never_a_hit() -> None:
    store = MemoryStore()
    wide = backend(MHA, store)
    narrow_shape = KVShape(
        kind=KVKind.MHA, layers=2, heads=1, head_dim=4, dtype=torch.float16, page_size=4
    )
    narrow = backend(narrow_shape, store)  # same key space, smaller objects: a misconfiguration
    p = pages(MHA, 1)
    wide.put(NS, p, [0])
    assert narrow.exists(NS, p) == 0
    assert narrow.get(NS, p, [4]) == [GetStatus.FAILED]
    assert narrow.put(NS, p, [0]) == [PutStatus.STORED]  # replaces the unusable objects
    assert narrow.get(NS, p, [4]) == [GetStatus.LOADED]
    assert wide.exists(NS, p) == 0


# ------------------------------------------------------------------------------------ threads
def test_concurrent_clients_keep_the_store_consistent() -> None:
    size = object_bytes(MHA)
    store = MemoryStore(capacity_bytes=6 * size)  # small: puts keep evicting each other's objects
    p = pages(MHA, 4)
    expected = [slot_bits(make_host(MHA), slot) for slot in range(4)]
    clients = [backend(MHA, store) for _ in range(4)]
    barrier = threading.Barrier(len(clients))
    errors: list[BaseException] = []

    def work(client: MemoryBackend, seed: int) -> None:
        rng = random.Random(seed)
        host = host_of(client)
        try:
            barrier.wait()
            for _ in range(150):
                first = rng.randrange(4)
                chosen = p[first : first + rng.randrange(1, 3)]
                slots = list(range(first, first + len(chosen)))
                action = rng.randrange(4)
                if action == 0:
                    client.put(NS, chosen, slots)
                elif action == 1:
                    client.exists(NS, chosen)
                elif action == 2:
                    client.evict(NS, chosen[0], rng.choice([None, "k", "v"]))
                else:
                    targets = [4 + i for i in range(len(chosen))]
                    for status, slot, target in zip(
                        client.get(NS, chosen, targets), slots, targets, strict=True
                    ):
                        if status is GetStatus.LOADED:
                            assert slot_bits(host, target) == expected[slot]
        except BaseException as error:  # reported by the main thread
            errors.append(error)

    threads = [threading.Thread(target=work, args=(c, i)) for i, c in enumerate(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert store.used_bytes == len(store) * size <= 6 * size
    assert store.pending_keys() == frozenset()


@pytest.mark.parametrize("shape", [MHA, MLA], ids=["mha", "mla"])
def test_an_engines_own_host_buffer_round_trips_through_l3_in_place(shape: KVShape) -> None:
    """Two engines' host buffers (``page_first_direct`` and ``page_first``), each wrapped zero-copy:
    what one backs up from its own memory, the other reads into its own memory, bit for bit."""
    writer_pool = make_host(shape)  # kvstrata-made, only to fill an engine-like buffer
    engine_a = writer_pool.buffer.clone()
    engine_b = torch.zeros(
        (shape.planes, SLOTS * shape.page_size, shape.layers, shape.heads, shape.head_dim),
        dtype=shape.dtype,
    )
    host_a = HostKVPool.wrap(engine_a, shape, "page_first_direct")
    host_b = HostKVPool.wrap(engine_b, shape, "page_first")
    store = MemoryStore()
    a, b = backend(shape, store, host_a), backend(shape, store, host_b)
    names = pages(shape, 3)
    assert all(status.ok for status in a.put(NS, names, [5, 1, 6]))
    assert b.get(NS, names, [0, 2, 7]) == [GetStatus.LOADED] * 3
    for source, target in ((5, 0), (1, 2), (6, 7)):
        assert slot_bits(host_b, target) == slot_bits(writer_pool, source)
    assert host_b.buffer.data_ptr() == engine_b.data_ptr()
    assert bool(engine_b.view(torch.uint8).any())  # the bytes are in the engine's buffer itself
