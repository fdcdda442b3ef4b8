"""Side pools (indexer, Mamba state) and the pool group: shapes, store descriptions in key order,
atomic multi-pool allocation with rollback, exactly-once free, copies, layer maps (SPEC §5)."""

from __future__ import annotations

import ctypes

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kvstrata.impl.errors import CapacityError, ConfigError, MisuseError
from kvstrata.impl.pools import HostKVPool, HostLayout, KVShape
from kvstrata.impl.pools.group import PoolGroup
from kvstrata.impl.pools.side import (
    LayerMap,
    LayerStep,
    SideBuffer,
    SideSpec,
    copy_entries,
    indexer_spec,
    mamba_spec,
    side_layout,
)
from kvstrata.model.hybrid import HitPolicy, SidePool, side_page_keys
from kvstrata.model.keys import (
    DEFAULT_NAMESPACE,
    KeySpace,
    KVKind,
    ModelIdentity,
    Shard,
    chain_page_hashes,
    parse_store_key,
)

SHAPE = KVShape(KVKind.MHA, layers=2, heads=2, head_dim=4, dtype=torch.float16, page_size=2)
INDEXER = indexer_spec(layers=2, page_size=2, dim=3, dtype=torch.bfloat16)
MAMBA = mamba_spec(
    layers=3,
    conv=[(4, 2), (2, 2)],
    temporal=(2, 5),
    dtype=[torch.float16, torch.float16, torch.float32],
)


def group(kv_pages: int = 6, states: int = 3) -> PoolGroup:
    host = HostKVPool(SHAPE, kv_pages, HostLayout.PAGE_FIRST_DIRECT, pin_memory=False)
    return PoolGroup(
        host,
        [SideBuffer(INDEXER, kv_pages, host=True), SideBuffer(MAMBA, states, host=True)],
    )


def random_fill(buffer: SideBuffer, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for tensor in buffer.tensors:
        raw = torch.randint(0, 256, (tensor.numel() * tensor.element_size(),), generator=gen)
        tensor.view(-1).view(torch.uint8).copy_(raw.to(torch.uint8))


# ------------------------------------------------------------------------------------------ specs
def test_specs_name_components_in_key_order() -> None:
    assert INDEXER.policy is HitPolicy.ALL_PAGES and INDEXER.components == ("key",)
    assert MAMBA.policy is HitPolicy.TRAILING_PAGES
    assert MAMBA.components == ("conv_0", "conv_1", "temporal")
    assert MAMBA.component_bytes() == (3 * 4 * 2 * 2, 3 * 2 * 2 * 2, 3 * 2 * 5 * 4)
    assert INDEXER.bytes_per_entry == 2 * 2 * 3 * 2


@pytest.mark.parametrize(
    ("shapes", "dtypes"),
    [
        ([(1, 2)], torch.float16),  # one shape for three components
        ([(1, 2), (1, 0), (1, 1)], torch.float16),  # a zero dimension
        ([(1, 2), (1, 2), (1, 2)], [torch.float16, torch.float32]),  # two dtypes for three
        ([(1, 2), (1, 2), "ab"], torch.float16),
        ([(1, 2), (1, 2), (1, 2)], torch.complex64),
    ],
)
def test_bad_spec_is_a_config_error(shapes: object, dtypes: object) -> None:
    pool = SidePool("mamba", HitPolicy.TRAILING_PAGES, ("conv_0", "conv_1", "temporal"))
    with pytest.raises(ConfigError):
        SideSpec(pool, shapes, dtypes)  # type: ignore[arg-type]


def test_a_spec_puts_its_layout_in_its_pool() -> None:
    """The layout token names components, shapes and dtypes: equal specs on any node agree, and a
    change of any of them (a dtype of the same size included) changes the pool's key segment."""
    same = mamba_spec(
        layers=3,
        conv=[(4, 2), (2, 2)],
        temporal=(2, 5),
        dtype=[torch.float16, torch.float16, torch.float32],
    )
    assert same.pool == MAMBA.pool and len(MAMBA.pool.layout) == 16
    assert MAMBA.pool.segment == f"mamba.{MAMBA.pool.layout}"
    fp16, fp32 = torch.float16, torch.float32

    def spec(
        conv: list[tuple[int, int]], conv_0: torch.dtype = fp16, name: str = "mamba"
    ) -> SideSpec:
        return mamba_spec(
            layers=3, conv=conv, temporal=(2, 5), dtype=[conv_0, fp16, fp32], name=name
        )

    variants = [
        spec([(4, 2), (2, 2)], conv_0=torch.bfloat16),  # a dtype of the same size
        spec([(2, 4), (2, 2)]),  # the same bytes per component, a shape transposed
        spec([(2, 2), (4, 2)]),  # the same bytes per entry, split another way
        spec([(4, 2), (2, 2)], name="linear"),  # another name: its own key segment
    ]
    layouts = {v.pool.layout for v in variants[:3]}
    assert MAMBA.pool.layout not in layouts and len(layouts) == 3
    assert all(v.bytes_per_entry == MAMBA.bytes_per_entry for v in variants)
    assert variants[3].pool.layout == MAMBA.pool.layout  # the name is its own key segment
    assert side_layout(("key",), [(2, 2, 3)], [torch.bfloat16]) == INDEXER.pool.layout
    assert side_layout(("key",), [(2, 2, 3)], [torch.bfloat16], "x") != INDEXER.pool.layout


def test_a_pool_given_another_layout_is_refused() -> None:
    pool = SidePool("indexer", HitPolicy.ALL_PAGES, ("key",))
    spec = SideSpec(pool, [(2, 2, 3)], torch.bfloat16)
    assert spec.pool == INDEXER.pool != pool  # filled in
    assert SideSpec(INDEXER.pool, [(2, 2, 3)], torch.bfloat16) == INDEXER  # given: kept
    with pytest.raises(ConfigError, match="layout"):
        SideSpec(INDEXER.pool, [(2, 2, 3)], torch.float16)
    with pytest.raises(ConfigError, match="3 components, 2 shapes"):
        side_layout(("a", "b", "c"), [(1,), (1,)], [torch.float16] * 3)


def test_bad_buffer_sizes() -> None:
    with pytest.raises(ConfigError):
        SideBuffer(INDEXER, 0, host=True)
    with pytest.raises(ConfigError, match="do not fit"):
        SideBuffer(MAMBA, 1000, host=True, available=1000)
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="CUDA"):
            SideBuffer(INDEXER, 2, host=True, pin_memory=True)


# --------------------------------------------------------------------------------- descriptions
def test_describe_regions_follow_component_key_order() -> None:
    """Region ``c`` of an entry is component ``c``'s bytes of that entry, and component ``c`` is the
    ``c``-th key ``side_page_keys`` renders: pointer order equals key order for every pool kind."""
    keys = KeySpace(
        ModelIdentity(name="hybrid", dtype="float16", kind=KVKind.MHA, page_size=2),
        shard=Shard(tp_rank=0, tp_size=1),
    )
    page = chain_page_hashes([1, 2], 2, DEFAULT_NAMESPACE)[0]
    for spec, entries in ((INDEXER, 4), (MAMBA, 3)):
        buffer = SideBuffer(spec, entries, host=True)
        random_fill(buffer, seed=entries)
        rendered = side_page_keys(keys, DEFAULT_NAMESPACE, spec.pool, page)
        for entry, regions in zip([2, 0], buffer.describe([2, 0]), strict=True):
            assert len(regions) == len(rendered) == len(spec.components)
            for component, (region, key) in enumerate(zip(regions, rendered, strict=True)):
                assert parse_store_key(key).component == spec.components[component]
                expected = buffer.tensors[component][entry].reshape(-1).view(torch.uint8)
                assert region.nbytes == spec.component_bytes()[component]
                assert ctypes.string_at(region.ptr, region.nbytes) == expected.numpy().tobytes()


def test_describe_rejects_out_of_range_and_device_buffers() -> None:
    buffer = SideBuffer(MAMBA, 3, host=True)
    with pytest.raises(MisuseError):
        buffer.describe([3])
    with pytest.raises(MisuseError):
        buffer.describe([-1])


# ----------------------------------------------------------------------------------- allocation
def test_group_checks_its_pools() -> None:
    host = HostKVPool(SHAPE, 6, HostLayout.PAGE_FIRST, pin_memory=False)
    with pytest.raises(ConfigError, match="one entry per KV page"):
        PoolGroup(host, [SideBuffer(INDEXER, 5, host=True)])
    with pytest.raises(ConfigError, match="taken"):
        PoolGroup(host, [SideBuffer(MAMBA, 2, host=True), SideBuffer(MAMBA, 2, host=True)])
    with pytest.raises(MisuseError):
        PoolGroup(host, ["mamba"])  # type: ignore[list-item]


def test_alloc_is_all_or_nothing() -> None:
    pools = group(kv_pages=6, states=3)
    first = pools.alloc(4, 2)
    assert len(first.pages) == 4 and len(first.states["mamba"]) == 2
    before = pools.free_counts()
    assert before == {"kv": 2, "mamba": 1}
    with pytest.raises(CapacityError, match="mamba states"):
        pools.alloc(2, 2)  # the KV pages fit, the states do not: the pages go back
    assert pools.free_counts() == before
    with pytest.raises(CapacityError, match="host"):
        pools.alloc(3, 1)  # the KV pool is short first: nothing taken
    assert pools.free_counts() == before
    with pytest.raises(MisuseError):
        pools.alloc(1, {"indexer": 1})  # the indexer shares KV pages: no slots to ask for
    with pytest.raises(MisuseError):
        pools.alloc(-1)
    assert pools.free_counts() == before
    last = pools.alloc(2, 1)
    assert pools.free_counts() == {"kv": 0, "mamba": 0}
    pools.free_allocation(last)
    pools.free_allocation(first)
    assert pools.free_counts() == {"kv": 6, "mamba": 3}


def test_free_is_exactly_once_and_all_or_nothing() -> None:
    pools = group()
    taken = pools.alloc(3, 2)
    pools.free(taken.pages[:1])
    before = pools.free_counts()
    with pytest.raises(MisuseError, match="double free"):
        # the state slots are fine, KV page 0 was freed already: nothing is freed anywhere
        pools.free(taken.pages, {"mamba": taken.states["mamba"]})
    assert pools.free_counts() == before
    with pytest.raises(MisuseError, match="more than once"):
        pools.free(taken.pages[1:2].repeat(2))
    with pytest.raises(MisuseError):
        pools.free(taken.pages[1:], {"indexer": [0]})
    assert pools.free_counts() == before
    pools.free(taken.pages[1:], {"mamba": taken.states["mamba"]})
    with pytest.raises(MisuseError):
        pools.free([], {"mamba": taken.states["mamba"][:1]})
    assert pools.free_counts() == {"kv": 6, "mamba": 3}


@given(st.lists(st.tuples(st.booleans(), st.integers(0, 4), st.integers(0, 3)), max_size=30))
def test_group_accounting_matches_a_set_model(ops: list[tuple[bool, int, int]]) -> None:
    """Random alloc/free sequences: the group's free counts always equal a plain set model, and a
    refused alloc changes nothing."""
    pools = group(kv_pages=6, states=3)
    live: list[tuple[list[int], list[int]]] = []
    for is_alloc, pages, states in ops:
        if is_alloc or not live:
            fits = pages <= pools.free_counts()["kv"] and states <= pools.free_counts()["mamba"]
            before = pools.free_counts()
            try:
                got = pools.alloc(pages, states)
            except CapacityError:
                assert not fits
                assert pools.free_counts() == before
                continue
            assert fits
            live.append((got.pages.tolist(), got.states["mamba"].tolist()))
        else:
            kv, slots = live.pop(pages % len(live))
            pools.free(kv, {"mamba": slots})
        used_kv = sum(len(kv) for kv, _ in live)
        used_states = sum(len(s) for _, s in live)
        assert pools.free_counts() == {"kv": 6 - used_kv, "mamba": 3 - used_states}
        every = [p for kv, _ in live for p in kv]
        assert len(set(every)) == len(every)


# ----------------------------------------------------------------------------------- data moves
def test_copies_round_trip_bit_for_bit() -> None:
    device = SideBuffer(MAMBA, 4)
    host = SideBuffer(MAMBA, 3, host=True)
    random_fill(device, seed=7)
    copy_entries(device, [3, 1], host, [0, 2])
    copy_entries(host, [2, 0], device, [0, 2])
    for source, target in ((1, 0), (3, 2)):
        for tensor in device.tensors:
            assert torch.equal(
                tensor[source].view(-1).view(torch.uint8), tensor[target].view(-1).view(torch.uint8)
            )
    with pytest.raises(MisuseError):
        copy_entries(device, [0], host, [3])
    with pytest.raises(MisuseError):
        copy_entries(device, [0, 1], host, [0])
    with pytest.raises(MisuseError):
        copy_entries(SideBuffer(INDEXER, 2), [0], host, [0])


def test_read_and_write_check_shapes_and_dtypes() -> None:
    buffer = SideBuffer(INDEXER, 4)
    values = (torch.arange(2 * 2 * 2 * 3, dtype=torch.bfloat16).reshape(2, 2, 2, 3),)
    buffer.write([1, 3], values)
    assert torch.equal(buffer.read([3, 1])[0], values[0].flip(0))
    before = buffer.read([0, 1, 2, 3])[0].clone()
    with pytest.raises(MisuseError, match="dtype"):
        buffer.write([0, 2], (values[0].float(),))
    with pytest.raises(MisuseError, match="shape"):
        buffer.write([0], values)
    with pytest.raises(MisuseError):
        buffer.write([4, 0], values)
    assert torch.equal(buffer.read([0, 1, 2, 3])[0], before)


# ----------------------------------------------------------------------------------- layer maps
def test_layer_map_walks_the_union() -> None:
    layers = LayerMap(attention=(0, 2, 4), state=(1, 2, 3))
    assert layers.steps() == (
        LayerStep(0, 0, None),
        LayerStep(1, None, 0),
        LayerStep(2, 1, 1),
        LayerStep(3, None, 2),
        LayerStep(4, 2, None),
    )
    with pytest.raises(ConfigError):
        LayerMap(attention=(2, 1), state=())
    with pytest.raises(ConfigError):
        LayerMap(attention=(1, 1), state=())


# ------------------------------------------------------------------- transfers across tiers (L1 <-> L2)
def _device_group(pages: int = 6, states: int = 3) -> PoolGroup:
    from kvstrata.impl.pools import DeviceKVPool  # noqa: PLC0415

    return PoolGroup(
        DeviceKVPool(SHAPE, pages, "cpu"),
        [SideBuffer(INDEXER, pages), SideBuffer(MAMBA, states)],
    )


def _fill_group(pools: PoolGroup, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for tensor in (pools.kv.buffer, *(t for b in pools.side.values() for t in b.tensors)):
        raw = torch.randint(0, 256, (tensor.numel() * tensor.element_size(),), generator=gen)
        tensor.view(-1).view(torch.uint8).copy_(raw.to(torch.uint8))


def _bits(tensor: torch.Tensor) -> bytes:
    return tensor.contiguous().view(-1).view(torch.uint8).numpy().tobytes()


def test_copy_between_moves_every_pool_bit_for_bit() -> None:
    from kvstrata.impl.pools.group import copy_between  # noqa: PLC0415

    device, host = _device_group(), group()
    _fill_group(device, seed=11)
    moved = copy_between(device, host, [4, 1], [0, 5], {"mamba": ([2], [1])})
    assert moved == 2 * (SHAPE.bytes_per_page + INDEXER.bytes_per_entry) + MAMBA.bytes_per_entry
    for s, d in ((4, 0), (1, 5)):
        assert _bits(device.kv.read_pages([s])) == _bits(host.kv.read_pages([d]))
        assert _bits(device.side["indexer"].read([s])[0]) == _bits(
            host.side["indexer"].read([d])[0]
        )
    for s_t, d_t in zip(device.side["mamba"].read([2]), host.side["mamba"].read([1]), strict=True):
        assert _bits(s_t) == _bits(d_t)
    with pytest.raises(MisuseError):
        copy_between(device, host, [0], [0], {"indexer": ([0], [0])})
    with pytest.raises(MisuseError):
        copy_between(device, PoolGroup(host.kv), [0], [0])


def test_transfer_controller_carries_side_pools_in_one_batch() -> None:
    """Two ops with side transfers merge into one batch per direction; the batch is acked once
    every pool is copied, and a side copy that raises fails the whole batch."""
    from kvstrata.impl.pools.group import copy_between  # noqa: PLC0415
    from kvstrata.impl.transfer import (  # noqa: PLC0415
        Direction,
        ManualExecutor,
        PoolTransfer,
        TransferController,
    )

    device, host = _device_group(), group()
    _fill_group(device, seed=12)
    calls: list[tuple[str, list[int]]] = []

    def copy(direction: Direction, src: object, dst: object) -> int:
        a, b = (device, host) if direction is Direction.WRITE else (host, device)
        return copy_between(a, b, src, dst)  # type: ignore[arg-type]

    def side_copy(direction: Direction, transfer: PoolTransfer) -> int:
        calls.append((transfer.pool, transfer.src.tolist()))
        a, b = (device, host) if direction is Direction.WRITE else (host, device)
        return copy_between(a, b, [], [], {transfer.pool: (transfer.src, transfer.dst)})

    executor = ManualExecutor()
    controller = TransferController(copy, executor, side_copy)
    controller.enqueue(Direction.WRITE, 1, [0, 1], [2, 3], (PoolTransfer("mamba", [0], [2]),))
    controller.enqueue(Direction.WRITE, 2, [5], [4], (PoolTransfer("mamba", [1], [0]),))
    assert controller.flush() == 1
    assert not controller.completed()
    executor.run_all()
    (done,) = controller.completed()
    assert done.ok and done.op_ids == (1, 2)
    assert calls == [("mamba", [0, 1])]  # merged per pool, in enqueue order
    for s_t, d_t in zip(
        device.side["mamba"].read([0, 1]), host.side["mamba"].read([2, 0]), strict=True
    ):
        assert _bits(s_t) == _bits(d_t)
    controller.enqueue(Direction.LOAD, 3, [2], [0], (PoolTransfer("mamba", [2], [9]),))
    controller.flush()
    executor.run_all()
    (failed,) = controller.completed()
    assert not failed.ok and failed.op_ids == (3,)  # slot 9 is out of range: the batch fails
    plain = TransferController(copy, ManualExecutor())
    with pytest.raises(ValueError, match="side_copy"):
        plain.enqueue(Direction.WRITE, 4, [0], [0], (PoolTransfer("mamba", [0], [0]),))
    with pytest.raises(ValueError):
        PoolTransfer("mamba", [0, 1], [0])
