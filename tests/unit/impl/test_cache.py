"""Unit tests of the implementation's radix cache: the scheduler protocol on real pools, a real
worker thread, and typed errors that leave the cache unchanged."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch
from support.settle import settle_until

from kvstrata.impl.cache import HierarchicalRadixCache
from kvstrata.impl.config import RadixCacheConfig
from kvstrata.impl.errors import CapacityError, ConfigError, MisuseError
from kvstrata.impl.pools import DeviceKVPool, HostKVPool, HostLayout, KVShape
from kvstrata.impl.transfer import ManualExecutor, ThreadExecutor
from kvstrata.model.keys import KVKind, Namespace, chain_page_hashes
from kvstrata.model.lifecycles import Residency

SHAPE = KVShape(KVKind.MHA, layers=2, heads=2, head_dim=8, dtype=torch.bfloat16, page_size=4)


def kv_for(tokens: list[int]) -> torch.Tensor:
    pages = chain_page_hashes(tokens, SHAPE.page_size)
    out = []
    for page in pages:
        dims = SHAPE.canonical(1)
        count = int(np.prod(dims)) * SHAPE.itemsize
        raw = hashlib.shake_256(page.digest).digest(count)
        out.append(
            torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(SHAPE.dtype).reshape(dims)
        )
    return torch.cat(out, dim=2)


def build(executor: object = None, layout: HostLayout = HostLayout.PAGE_FIRST, **config: object):
    device = DeviceKVPool(SHAPE, 16, "cpu")
    host = HostKVPool(SHAPE, 32, layout)
    cache = HierarchicalRadixCache.build(
        RadixCacheConfig(page_size=4, **config),  # type: ignore[arg-type]
        device,
        host,
        executor=executor,  # type: ignore[arg-type]
    )
    return cache, device, host


def serve(cache: HierarchicalRadixCache, device: DeviceKVPool, tokens: list[int]) -> None:
    result = cache.match_prefix(tokens)
    total = len(tokens) // 4
    fresh = cache.alloc_device(total - result.device_pages)
    if len(fresh):
        device.write_pages(fresh, kv_for(tokens)[:, :, result.device_pages :])
    cache.insert(tokens, np.concatenate([result.device_indices, fresh]))


def wait_for_copies(cache: HierarchicalRadixCache) -> None:
    """Every copy applied, by events (``support.settle``): copies nothing will finish fail at once."""
    settle_until(cache, lambda: not cache.pending().write and not cache.pending().load, "copies")


@pytest.mark.parametrize("layout", list(HostLayout))
def test_round_trip_through_l2_on_a_worker_thread(layout: HostLayout) -> None:
    cache, device, _ = build(ThreadExecutor(), layout)
    tokens = list(range(1, 17))
    serve(cache, device, tokens)
    wait_for_copies(cache)
    assert cache.residency(tokens) == (Residency.BOTH,) * 4
    assert cache.evict(16) == 4
    assert cache.residency(tokens) == (Residency.HOST,) * 4
    result = cache.match_prefix(tokens)
    assert (result.device_pages, result.host_pages) == (0, 4)
    assert cache.load_back(result.host_node) is not None
    wait_for_copies(cache)
    again = cache.match_prefix(tokens)
    assert again.device_pages == 4
    got = device.read_pages(again.device_indices)
    assert torch.equal(got.view(torch.int16), kv_for(tokens).view(torch.int16))
    cache.close()


def test_duplicates_are_given_back_and_page_hashes_are_kept() -> None:
    cache, device, _ = build(ManualExecutor())
    tokens = list(range(8))
    serve(cache, device, tokens)
    free = cache.device_free
    fresh = cache.alloc_device(2)  # a second request computed the same pages
    device.write_pages(fresh, kv_for(tokens))
    result = cache.insert(tokens, fresh)
    assert result.duplicate_pages == 2 and cache.device_free == free
    assert cache.page_hashes(tokens) == chain_page_hashes(tokens, 4)


def test_bad_input_raises_typed_errors_and_changes_nothing() -> None:
    cache, device, _ = build(ManualExecutor())
    serve(cache, device, list(range(8)))
    node = cache.match_prefix(list(range(8))).device_node
    before = (cache.device_free, cache.host_free, cache.residency(list(range(8))), cache.clock)
    bad_calls = [
        lambda: cache.insert([[1, 2]], [0]),  # not 1-D
        lambda: cache.insert([1.5] * 4, [0]),  # not ints
        lambda: cache.insert("abcd", [0]),  # a string
        lambda: cache.insert([-1] * 4, [0]),  # out of range
        lambda: cache.insert(list(range(8)), [5]),  # wrong length
        lambda: cache.insert(list(range(100, 104)), [10**6]),  # a page nobody allocated
        lambda: cache.insert(list(range(100, 104)), [0]),  # a page the tree owns
        lambda: cache.unlock(node),  # never locked
        lambda: cache.evict(-1),
        lambda: cache.alloc_device(-1),
        lambda: cache.free_device([0]),
        lambda: cache.match_prefix([1, 2], extra_key=5),  # type: ignore[arg-type]
    ]
    for call in bad_calls:
        with pytest.raises(MisuseError):
            call()
    assert (
        cache.device_free,
        cache.host_free,
        cache.residency(list(range(8))),
        cache.clock,
    ) == before


def test_configuration_errors() -> None:
    with pytest.raises(ConfigError, match="write_policy"):
        RadixCacheConfig(page_size=4, write_policy="write_sometimes")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="page_size"):
        RadixCacheConfig(page_size=0)
    with pytest.raises(ConfigError):
        RadixCacheConfig(page_size=4, load_back_quota=0)
    assert (
        RadixCacheConfig(page_size=4, write_policy="write_back").write_policy.value == "write_back"
    )  # type: ignore[arg-type]
    with pytest.raises(ConfigError):
        HierarchicalRadixCache.build(RadixCacheConfig(page_size=8), DeviceKVPool(SHAPE, 4, "cpu"))


def test_capacity_error_when_everything_is_locked_and_reset() -> None:
    cache, device, _ = build(ManualExecutor(), write_policy="write_through_selective")
    serve(cache, device, list(range(64)))
    node = cache.match_prefix(list(range(64))).device_node
    cache.lock(node)
    with pytest.raises(CapacityError):
        cache.alloc_device(1)
    cache.unlock(node)
    cache.transfer.executor.run_all()  # type: ignore[union-attr]
    cache.check_events()
    cache.reset()
    assert cache.device_free == 16 and cache.host_free == 32
    assert cache.match_prefix(list(range(64))).device_pages == 0


def test_a_failed_copy_degrades_to_a_smaller_cache() -> None:
    executor = ManualExecutor()
    cache, device, _ = build(executor)
    tokens = list(range(8))
    serve(cache, device, tokens)
    transfer = cache.transfer
    assert transfer is not None

    def broken(*_args: object) -> int:
        raise RuntimeError("DMA error")

    transfer._copy = broken
    executor.run_all()
    (applied,) = cache.check_events()
    assert not applied.ok
    assert cache.residency(tokens) == (Residency.DEVICE,) * 2
    assert cache.host_free == 32
    assert cache.match_prefix(tokens).device_pages == 2


def test_a_failed_batch_frees_nothing_while_a_later_copy_is_in_flight() -> None:
    """A failed write-through batch fails every op of its direction, but only once the later
    batches came back: until then their destination pages stay theirs (no stale offset)."""
    executor = ManualExecutor()
    cache, device, _ = build(executor)
    first, second = list(range(8)), list(range(100, 108))
    serve(cache, device, first)
    serve(cache, device, second)
    transfer = cache.transfer
    assert transfer is not None and len(executor.jobs) == 2
    copy = transfer._copy

    def broken(*_args: object) -> int:
        raise RuntimeError("DMA error")

    transfer._copy = broken
    executor.run_next()  # the first batch fails; the second is still queued
    assert [event.op_ids for event in cache.check_events()] == [()]  # the failure waits
    assert cache.host_free == 32 - 4  # both batches' L2 pages are still held
    assert cache.pending().write == 2
    transfer._copy = copy
    executor.run_next()  # the second batch lands
    (applied,) = cache.check_events()
    assert not applied.ok and len(applied.op_ids) == 2  # now every op of the direction fails
    assert cache.host_free == 32 and cache.pending().write == 0
    assert cache.residency(first) == cache.residency(second) == (Residency.DEVICE,) * 2


def test_page_hashes_match_the_model_schema_in_every_namespace() -> None:
    cache, _, _ = build(ManualExecutor())
    tokens = list(range(12))
    for ns in (Namespace(), Namespace(extra_key="lora-7"), Namespace(extra_key="t", salt="s")):
        result = cache.match_prefix(tokens, ns)
        fresh = cache.alloc_device(3 - result.device_pages)
        cache.insert(tokens, fresh, ns)
        assert cache.page_hashes(tokens, ns) == chain_page_hashes(tokens, 4, ns)


def test_without_page_hashes_nothing_is_hashed_and_page_hashes_refuses() -> None:
    hashed, device_a, _ = build(ManualExecutor(), fingerprint_seed=5)
    plain, device_b, _ = build(ManualExecutor(), page_hashes=False, fingerprint_seed=5)
    for tokens in (list(range(12)), [*range(8), 9, 9, 9, 9], list(range(4))):
        serve(hashed, device_a, tokens)
        serve(plain, device_b, tokens)
        assert plain.residency(tokens) == hashed.residency(tokens)
    assert [n.id for n in plain.nodes()] == [n.id for n in hashed.nodes()]
    assert all(node.hashes == b"" for node in plain.nodes())
    assert all(len(node.hashes) == 32 * node.num_pages for node in hashed.nodes())
    with pytest.raises(MisuseError, match="page hashes are off"):
        plain.page_hashes(list(range(12)))


def test_nodes_hold_fingerprints_not_tokens() -> None:
    cache, device, _ = build(ManualExecutor(), fingerprint_seed=1)
    serve(cache, device, list(range(12)))
    serve(cache, device, [*range(8), 9, 9, 9, 9])  # splits the first node after two pages
    sizes = sorted((len(n.fps), len(n.hashes)) for n in cache.nodes())
    assert sizes == [(16, 32), (16, 32), (32, 64)]
    assert not hasattr(next(cache.nodes()), "key")


def test_new_config_fields_are_validated() -> None:
    with pytest.raises(ConfigError, match="page_hashes"):
        RadixCacheConfig(page_size=4, page_hashes=1)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="fingerprint_seed"):
        RadixCacheConfig(page_size=4, fingerprint_seed=-1)
    assert RadixCacheConfig(page_size=4).page_hashes is True


def test_an_impossible_alloc_is_refused_before_anything_is_evicted() -> None:
    """Issue 17: ``alloc_device(n)`` with n > free + evictable used to evict the whole L1 first."""
    cache, device, _ = build(ManualExecutor(), write_policy="write_through_selective")
    serve(cache, device, list(range(48)))  # 12 of 16 pages cached, unlocked
    with pytest.raises(CapacityError, match="evictable"):
        cache.alloc_device(17)
    assert cache.match_prefix(list(range(48))).device_pages == 12
    assert cache.device_free == 4
    assert len(cache.alloc_device(16)) == 16  # a possible ask still evicts what it needs


def test_every_mutating_verb_after_close_raises_and_close_is_idempotent() -> None:
    """Issue 17: a closed cache used to accept calls silently (pins leaked, prefetches hung)."""
    from kvstrata.impl.cache.protocol import MUTATING  # noqa: PLC0415
    from kvstrata.impl.errors import CacheClosed  # noqa: PLC0415

    cache, device, _ = build(ManualExecutor())
    serve(cache, device, list(range(16)))
    cache.close()
    cache.close()  # idempotent
    for verb in MUTATING:
        with pytest.raises(CacheClosed, match=verb):
            getattr(cache, verb)()  # refused before its arguments are even looked at
    assert cache.pending().load == 0  # queries still answer


def test_a_second_thread_is_refused_before_it_changes_anything() -> None:
    """Issue 17: calls from two threads corrupted the cache silently (wrong bytes, leaked pages)."""
    import threading  # noqa: PLC0415

    from kvstrata.impl.errors import WrongThread  # noqa: PLC0415

    cache, device, _ = build(ManualExecutor())
    seen: list[BaseException] = []

    def other() -> None:  # the first caller becomes the owner: this thread
        try:
            serve(cache, device, list(range(16)))
        except BaseException as error:  # pragma: no cover - reported below
            seen.append(error)

    worker = threading.Thread(target=other)
    worker.start()
    worker.join()
    assert not seen
    free = cache.device_free
    with pytest.raises(WrongThread):
        cache.alloc_device(1)
    with pytest.raises(WrongThread):
        cache.match_prefix(list(range(16)))
    assert cache.device_free == free
    cache.close()  # close is free to come from any thread


def test_page_counts_take_numpy_integers_never_a_bool_or_a_negative() -> None:
    """Schedulers compute counts with numpy; the model takes the same (``page_count``)."""
    cache, _device, _ = build(ManualExecutor())
    pages = cache.alloc_device(np.int64(3))
    assert len(pages) == 3
    cache.free_device(pages)
    assert cache.evict(np.int32(1)) == 0 and cache.evict_host(np.uint8(0)) == 0
    free = cache.device_free
    for bad in (True, -1, 1.0, "1", None, np.float64(1.0), np.bool_(True), torch.tensor(True)):
        for verb in (cache.alloc_device, cache.evict, cache.evict_host):
            with pytest.raises(MisuseError, match="pages must be an int"):
                verb(bad)  # type: ignore[arg-type]
    assert cache.device_free == free
