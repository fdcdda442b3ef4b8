"""Tests of kvstrata.impl.pools: shapes and layouts, the page allocator, the device and host pools,
page copies between them and host-pool sizing (SPEC §2, §9).

Bytes are compared bit for bit: KV is made from random integer bit patterns (NaNs and infinities
included) and tensors are compared through an integer view of the same width.
"""

from __future__ import annotations

import contextlib
import zlib
from collections.abc import Iterator
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstrata.impl.errors import CapacityError, ConfigError, KvStrataError, MisuseError
from kvstrata.impl.pools import (
    DeviceKVPool,
    HostKVPool,
    HostLayout,
    KVShape,
    PageAllocator,
    available_host_memory,
    check_host_fits,
    copy_pages,
    gather_pages,
    host_pages_for,
    parse_size,
)
from kvstrata.impl.pools import allocator as allocator_module
from kvstrata.impl.pools import copy as copy_module
from kvstrata.impl.pools import sizes as sizes_module
from kvstrata.impl.pools.copy import joint_runs
from kvstrata.model.keys import KVKind

DTYPES = [torch.float16, torch.bfloat16, torch.float32]
KINDS = [KVKind.MHA, KVKind.MLA]
LAYOUTS = list(HostLayout)
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
GIB = 1 << 30


def small_shape(kind: KVKind = KVKind.MHA, dtype: torch.dtype = torch.float16) -> KVShape:
    return KVShape(
        kind=kind,
        layers=3,
        heads=2 if kind is KVKind.MHA else 1,
        head_dim=8,
        dtype=dtype,
        page_size=4,
    )


def bits(tensor: torch.Tensor) -> torch.Tensor:
    """The same bytes as integers of the same width (NaN == NaN, -0.0 != 0.0)."""
    return tensor.contiguous().view(_BITS[tensor.dtype.itemsize])


def bit_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(bits(a), bits(b))


def random_kv(shape: KVShape, pages: int, seed: int) -> torch.Tensor:
    """Random bit patterns of ``shape.dtype`` in the canonical shape (every pattern, NaNs included)."""
    generator = torch.Generator().manual_seed(seed)
    width = _BITS[shape.itemsize]
    info = torch.iinfo(width)
    raw = torch.randint(
        info.min, info.max, shape.canonical(pages), generator=generator, dtype=torch.int64
    )
    return raw.to(width).view(shape.dtype)


@pytest.fixture(params=["auto", "runs", "dst_runs", "scatter", "scatter_chunked"])
def copy_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """Force same-device copies down one path (a path that does not apply to a pair of pools falls
    back to ``scatter``); ``scatter_chunked`` scatters one page per chunk."""
    if request.param != "auto":
        path = request.param.removesuffix("_chunked")
        monkeypatch.setattr(copy_module, "_choose_path", lambda *_: path)
    if request.param == "scatter_chunked":
        monkeypatch.setattr(copy_module, "SCRATCH_BYTES", 1)
    yield request.param


# ----------------------------------------------------------------------------------------------
# KVShape and HostLayout


def test_shape_sizes_for_mha_and_mla() -> None:
    mha = KVShape(KVKind.MHA, layers=32, heads=8, head_dim=128, dtype=torch.bfloat16, page_size=64)
    assert mha.planes == 2
    assert mha.bytes_per_token == 2 * 32 * 8 * 128 * 2
    assert mha.bytes_per_page == mha.bytes_per_token * 64
    assert mha.canonical(5) == (2, 32, 5, 64, 8, 128)
    assert mha.nbytes(5) == 5 * mha.bytes_per_page
    mla = KVShape(KVKind.MLA, layers=61, heads=1, head_dim=576, dtype=torch.float32, page_size=1)
    assert mla.planes == 1
    assert mla.bytes_per_token == 61 * 576 * 4
    assert mla.bytes_per_page == mla.bytes_per_token


@pytest.mark.parametrize(
    ("field", "value", "expected"),
    [
        ("kind", KVKind.EMBEDDING, "KVKind.MHA or KVKind.MLA"),
        ("kind", "mha", "KVKind.MHA or KVKind.MLA"),
        ("layers", 0, "positive int"),
        ("heads", -1, "positive int"),
        ("head_dim", 2.0, "positive int"),
        ("page_size", True, "positive int"),
        ("dtype", "float16", "torch.dtype"),
        ("dtype", torch.complex64, "torch.dtype"),
        ("dtype", torch.bool, "torch.dtype"),
    ],
)
def test_shape_validation_names_field_expected_and_received(
    field: str, value: object, expected: str
) -> None:
    fields: dict[str, object] = {
        "kind": KVKind.MHA,
        "layers": 2,
        "heads": 2,
        "head_dim": 4,
        "dtype": torch.float16,
        "page_size": 2,
    }
    fields[field] = value
    with pytest.raises(ConfigError) as caught:
        KVShape(**fields)  # type: ignore[arg-type]
    message = str(caught.value)
    assert f"KVShape.{field}" in message and expected in message and repr(value) in message


def test_mla_requires_one_head() -> None:
    with pytest.raises(ConfigError, match=r"KVShape\.heads.*heads == 1.*heads=4"):
        KVShape(KVKind.MLA, layers=2, heads=4, head_dim=8, dtype=torch.float16, page_size=2)


def test_shape_is_frozen_and_hashable() -> None:
    shape = small_shape()
    with pytest.raises(AttributeError):
        shape.layers = 4  # type: ignore[misc]
    assert {shape: 1}[small_shape()] == 1


@pytest.mark.parametrize(
    ("text", "layout"),
    [
        ("layer_first", HostLayout.LAYER_FIRST),
        ("page_first", HostLayout.PAGE_FIRST),
        ("page_first_direct", HostLayout.PAGE_FIRST_DIRECT),
        (" Page-First ", HostLayout.PAGE_FIRST),
        (HostLayout.PAGE_FIRST_DIRECT, HostLayout.PAGE_FIRST_DIRECT),
        ("page-major", HostLayout.PAGE_MAJOR),
    ],
)
def test_host_layout_parse(text: str | HostLayout, layout: HostLayout) -> None:
    assert HostLayout.parse(text) is layout


@pytest.mark.parametrize("text", ["", "layer-last", "pagefirst", 3, None])
def test_host_layout_parse_refuses_unknown_names(text: object) -> None:
    with pytest.raises(ConfigError, match="layer_first, page_first, page_first_direct"):
        HostLayout.parse(text)  # type: ignore[arg-type]


# ----------------------------------------------------------------------------------------------
# PageAllocator


def _state(allocator: PageAllocator) -> tuple[int, int, frozenset[int]]:
    return allocator.free_count, allocator.used_count, allocator.allocated()


KERNELS = pytest.mark.parametrize("kernels", ["c", "numpy"])
"""Run an allocator test over the C loops (kvstrata.impl._native) and over the numpy fallback."""


@contextlib.contextmanager
def _kernels(kind: str) -> Iterator[None]:
    """The allocator with the C loops (``"c"``) or forced onto its numpy path (``"numpy"``)."""
    if kind == "c":
        if allocator_module.take_lowest is None:
            pytest.skip("the C kernels are not built")
        yield
        return
    with mock.patch.multiple(allocator_module, take_lowest=None, give_back=None):
        yield


@KERNELS
def test_allocator_hands_out_lowest_pages_first(kernels: str) -> None:
    with _kernels(kernels):
        _test_allocator_hands_out_lowest_pages_first()


def _test_allocator_hands_out_lowest_pages_first() -> None:
    allocator = PageAllocator(10, "t")
    first = allocator.alloc(3)
    assert first.dtype == np.int64 and first.tolist() == [0, 1, 2]
    assert allocator.alloc(2).tolist() == [3, 4]
    allocator.free([1, 3])
    assert allocator.alloc(3).tolist() == [1, 3, 5]
    assert allocator.alloc(0).tolist() == []
    assert (allocator.free_count, allocator.used_count) == (4, 6)
    assert allocator.allocated() == frozenset({0, 1, 2, 3, 4, 5})
    assert allocator.is_allocated(5) and not allocator.is_allocated(6)
    allocator.check()


@KERNELS
def test_allocator_across_blocks(kernels: str) -> None:
    with _kernels(kernels):
        _test_allocator_across_blocks()


def _test_allocator_across_blocks() -> None:
    allocator = PageAllocator(3000, "t")  # three blocks of 1024, the last one partial
    pages = allocator.alloc(2500)
    assert pages.tolist() == list(range(2500))
    allocator.free(np.arange(0, 2500, 2))
    assert allocator.alloc(5).tolist() == [0, 2, 4, 6, 8]
    got = allocator.alloc(1500).tolist()
    assert got[:2] == [10, 12] and got[1244] == 2498 and got[-3:] == [2752, 2753, 2754]
    assert allocator.free_count == 3000 - 2500 + 1250 - 1505
    allocator.check()
    allocator.reset()
    assert allocator.free_count == 3000 and allocator.allocated() == frozenset()
    allocator.check()


def test_alloc_short_raises_capacity_error_and_changes_nothing() -> None:
    allocator = PageAllocator(4, "host")
    allocator.alloc(3)
    before = _state(allocator)
    with pytest.raises(CapacityError, match=r"host: cannot allocate 2 pages, 1 of 4"):
        allocator.alloc(2)
    assert _state(allocator) == before
    allocator.check()


@pytest.mark.parametrize(
    ("pages", "message"),
    [
        ([1, 1], "more than once"),
        ([2], "not allocated"),
        ([0, 2], "not allocated"),
        ([4], "out of range"),
        ([-1], "out of range"),
        (np.array([0.0]), "integer"),
        ([[0]], "1-D"),
        (torch.tensor([0.5]), "integer"),
    ],
)
@KERNELS
def test_bad_free_raises_misuse_and_changes_nothing(
    pages: object, message: str, kernels: str
) -> None:
    with _kernels(kernels):
        allocator = PageAllocator(4, "t")
        allocator.alloc(2)  # 0, 1 allocated
        before = _state(allocator)
        with pytest.raises(MisuseError, match=message):
            allocator.free(pages)  # type: ignore[arg-type]
        assert _state(allocator) == before
        allocator.check()


def test_free_accepts_numpy_torch_and_empty() -> None:
    allocator = PageAllocator(8, "t")
    allocator.alloc(6)
    allocator.free(np.array([0, 1], dtype=np.int32))
    allocator.free(torch.tensor([2, 3]))
    allocator.free([])
    allocator.free(np.array([], dtype=np.int64))
    assert allocator.allocated() == frozenset({4, 5})


@pytest.mark.parametrize("bad", [-1, 1.0, True, "2"])
def test_bad_alloc_count_is_misuse(bad: object) -> None:
    allocator = PageAllocator(4, "t")
    with pytest.raises(MisuseError):
        allocator.alloc(bad)  # type: ignore[arg-type]
    assert allocator.free_count == 4


@pytest.mark.parametrize("bad", [-1, 4, True, 1.0])
def test_is_allocated_refuses_non_pages(bad: object) -> None:
    with pytest.raises(MisuseError):
        PageAllocator(4, "t").is_allocated(bad)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("num_pages", "name"), [(0, "t"), (-3, "t"), (2.0, "t"), (True, "t"), (4, "")]
)
def test_allocator_config_errors(num_pages: object, name: str) -> None:
    with pytest.raises(ConfigError, match="PageAllocator"):
        PageAllocator(num_pages, name)  # type: ignore[arg-type]


_OPS = st.lists(
    st.one_of(
        st.tuples(st.just("alloc"), st.integers(0, 40)),
        st.tuples(st.just("alloc"), st.integers(0, 1500)),  # across blocks
        st.tuples(st.just("free"), st.lists(st.integers(-2, 1100), max_size=6)),
        st.tuples(st.just("free_some"), st.integers(0, 10**6)),
        st.tuples(st.just("free_many"), st.integers(0, 10**6)),
    ),
    max_size=40,
)


@KERNELS
@given(num_pages=st.sampled_from([1, 7, 64, 1030, 2100]), ops=_OPS)
def test_allocator_matches_a_set_model(
    kernels: str, num_pages: int, ops: list[tuple[str, object]]
) -> None:
    """Random alloc/free sequences against a set model: lowest-first results, exact counts, and
    failed calls leave everything unchanged (over the C loops and over numpy)."""
    with _kernels(kernels):
        _allocator_matches_a_set_model(num_pages, ops)


def _allocator_matches_a_set_model(num_pages: int, ops: list[tuple[str, object]]) -> None:
    allocator = PageAllocator(num_pages, "prop")
    used: set[int] = set()
    for op, arg in ops:
        before = _state(allocator)
        if op == "alloc":
            assert isinstance(arg, int)
            if arg > num_pages - len(used):
                with pytest.raises(CapacityError):
                    allocator.alloc(arg)
                assert _state(allocator) == before
                continue
            got = allocator.alloc(arg).tolist()
            assert got == sorted(set(range(num_pages)) - used)[:arg]
            used.update(got)
        else:
            if op in ("free_some", "free_many"):
                assert isinstance(arg, int)
                ordered = sorted(used)
                count = 5 if op == "free_some" else 700
                pages = ordered[arg % (len(ordered) + 1) :][::2][:count] if ordered else []
            else:
                assert isinstance(arg, list)
                pages = arg
            valid = (
                len(set(pages)) == len(pages)
                and all(0 <= p < num_pages for p in pages)
                and set(pages) <= used
            )
            if valid:
                allocator.free(pages)
                used.difference_update(pages)
            else:
                with pytest.raises(MisuseError):
                    allocator.free(pages)
                assert _state(allocator) == before
        assert allocator.allocated() == used
        allocator.check()  # counters, the first-free hint and the free run agree with the mask
        assert allocator.used_count == len(used)
        assert allocator.free_count + allocator.used_count == num_pages
        allocator.check()


# ----------------------------------------------------------------------------------------------
# Pools: construction


def test_device_pool_defaults_to_cpu_without_cuda() -> None:
    pool = DeviceKVPool(small_shape(), 6)
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert pool.device.type == expected
    assert tuple(pool.buffer.shape) == (2, 3, 6, 4, 2, 8)
    assert pool.allocator.num_pages == 6 and pool.allocator.name == "device"
    assert pool.nbytes == 6 * small_shape().bytes_per_page
    assert "DeviceKVPool" in repr(pool)


@pytest.mark.parametrize("device", ["nonsense", 3.5])
def test_device_pool_refuses_unknown_devices(device: object) -> None:
    with pytest.raises(ConfigError, match="device"):
        DeviceKVPool(small_shape(), 2, device)  # type: ignore[arg-type]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only refusal")
def test_device_pool_refuses_cuda_without_cuda() -> None:
    with pytest.raises(ConfigError, match=r"cuda.*is_available\(\) is False"):
        DeviceKVPool(small_shape(), 2, "cuda")


def test_layer_view_maps_token_slots() -> None:
    shape = small_shape()
    pool = DeviceKVPool(shape, 5, "cpu")
    kv = random_kv(shape, 1, seed=1)
    pool.write_pages([3], kv)
    view = pool.layer_view(1, 2)
    assert tuple(view.shape) == (5 * 4, 2, 8)
    assert bit_equal(view[3 * 4 : 4 * 4], kv[1, 2, 0])
    with pytest.raises(MisuseError):
        pool.layer_view(2, 0)
    with pytest.raises(MisuseError):
        pool.layer_view(0, 3)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_host_pool_is_not_pinned_on_cpu(layout: HostLayout) -> None:
    pool = HostKVPool(small_shape(), 4, layout.value)
    assert pool.layout is layout
    assert pool.pinned is torch.cuda.is_available()
    assert pool.buffer.is_pinned() is pool.pinned
    assert pool.device.type == "cpu" and pool.allocator.name == "host"
    unpinned = HostKVPool(small_shape(), 4, layout, pin_memory=False)
    assert not unpinned.pinned and not unpinned.buffer.is_pinned()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only refusal")
def test_pinning_without_cuda_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="pin_memory"):
        HostKVPool(small_shape(), 4, HostLayout.PAGE_FIRST, pin_memory=True)


def test_host_pool_config_errors() -> None:
    with pytest.raises(ConfigError, match="pin_memory"):
        HostKVPool(small_shape(), 4, "layer_first", pin_memory=1)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="host layout"):
        HostKVPool(small_shape(), 4, "diagonal")
    with pytest.raises(ConfigError, match="num_pages"):
        HostKVPool(small_shape(), 0, "layer_first")
    with pytest.raises(MisuseError, match="KVShape"):
        HostKVPool("shape", 4, "layer_first")  # type: ignore[arg-type]


def test_host_pool_refuses_a_size_the_machine_cannot_hold() -> None:
    shape = small_shape()
    pages = 10**15 // shape.bytes_per_page
    with pytest.raises(ConfigError, match="do not fit in host memory"):
        HostKVPool(shape, pages, "page_first")
    with pytest.raises(ConfigError, match="do not fit"):
        HostKVPool(shape, 16, "page_first", available=GIB, reserve=GIB)


@pytest.mark.parametrize(
    ("layout", "physical"),
    [
        # [planes, L, N, H, D], [planes, N, L, H, D], [planes, P, L, page, H, D]
        (HostLayout.LAYER_FIRST, (2, 3, 6 * 4, 2, 8)),
        (HostLayout.PAGE_FIRST, (2, 6 * 4, 3, 2, 8)),
        (HostLayout.PAGE_FIRST_DIRECT, (2, 6, 3, 4, 2, 8)),
        (HostLayout.PAGE_MAJOR, (6, 2, 3, 4, 2, 8)),
    ],
)
def test_host_layouts_place_bytes_as_specified(
    layout: HostLayout, physical: tuple[int, ...]
) -> None:
    shape = small_shape()
    pool = HostKVPool(shape, 6, layout)
    assert tuple(pool.buffer.shape) == physical
    kv = random_kv(shape, 2, seed=7)
    pool.write_pages([4, 1], kv)
    buf = pool.buffer
    for i, page in enumerate([4, 1]):
        for plane in range(2):
            for layer in range(3):
                for t in range(4):
                    token = page * 4 + t
                    if layout is HostLayout.LAYER_FIRST:
                        stored = buf[plane, layer, token]
                    elif layout is HostLayout.PAGE_FIRST:
                        stored = buf[plane, token, layer]
                    elif layout is HostLayout.PAGE_MAJOR:
                        stored = buf[page, plane, layer, t]
                    else:
                        stored = buf[plane, page, layer, t]
                    assert bit_equal(stored, kv[plane, layer, i, t])
    if layout is HostLayout.LAYER_FIRST:
        with pytest.raises(MisuseError, match="not contiguous"):
            pool.page_slab(0, 1)
    else:
        slab = pool.page_slab(1, 4)
        assert slab.is_contiguous() and slab.numel() == 3 * 4 * 2 * 8
        expected = (
            kv[1, :, 0].permute(1, 0, 2, 3) if layout is HostLayout.PAGE_FIRST else kv[1, :, 0]
        )
        assert bit_equal(slab, expected.reshape(-1))
        with pytest.raises(MisuseError):
            pool.page_slab(2, 0)
    if layout is HostLayout.PAGE_MAJOR:  # a whole page, K then V, is one run of bytes
        whole = buf[4].reshape(-1)
        assert bit_equal(whole, kv[:, :, 0].reshape(-1))
        assert pool.page_slab(0, 4).data_ptr() == whole.data_ptr()


# ----------------------------------------------------------------------------------------------
# Round trips


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.value)
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda layout: layout.value)
def test_round_trip_device_host_device_is_bit_exact(
    layout: HostLayout, kind: KVKind, dtype: torch.dtype, copy_path: str
) -> None:
    shape = small_shape(kind, dtype)
    device = DeviceKVPool(shape, 12, "cpu")
    host = HostKVPool(shape, 16, layout)
    kv = random_kv(shape, 6, seed=zlib.crc32(f"{layout.value}/{kind.value}/{dtype}".encode()))
    src = device.allocator.alloc(6)
    device.write_pages(src, kv)
    assert bit_equal(device.read_pages(src), kv)

    host.write_pages(np.arange(16), random_kv(shape, 16, seed=99))  # junk everywhere
    host_before = host.read_pages(np.arange(16))
    host_pages = [9, 2, 10, 11, 3, 15]  # runs and gaps
    assert copy_pages(device, src, host, host_pages) == 6 * shape.bytes_per_page
    assert bit_equal(host.read_pages(host_pages), kv)
    untouched = sorted(set(range(16)) - set(host_pages))
    assert bit_equal(host.read_pages(untouched), host_before[:, :, untouched])

    back = [11, 6, 7, 8, 0, 1]  # different pages from the source
    device_before = device.read_pages(np.arange(12))
    assert copy_pages(host, host_pages, device, back) == 6 * shape.bytes_per_page
    assert bit_equal(device.read_pages(back), kv)
    assert bit_equal(gather_pages(device, back), kv)
    others = sorted(set(range(12)) - set(back))
    assert bit_equal(device.read_pages(others), device_before[:, :, others])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.value)
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda layout: layout.value)
def test_round_trip_through_a_gpu_is_bit_exact(
    layout: HostLayout, kind: KVKind, dtype: torch.dtype
) -> None:
    shape = small_shape(kind, dtype)
    device = DeviceKVPool(shape, 12)
    host = HostKVPool(shape, 16, layout)
    assert device.device.type == "cuda" and host.pinned and host.buffer.is_pinned()
    kv = random_kv(shape, 6, seed=21)
    device.write_pages([0, 1, 2, 7, 8, 5], kv)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        copy_pages(device, [0, 1, 2, 7, 8, 5], host, [9, 2, 10, 11, 3, 15])
    assert bit_equal(host.read_pages([9, 2, 10, 11, 3, 15]), kv)
    with torch.cuda.stream(stream):
        copy_pages(host, [9, 2, 10, 11, 3, 15], device, [11, 6, 4, 3, 10, 9])
    stream.synchronize()
    assert bit_equal(gather_pages(device, [11, 6, 4, 3, 10, 9]), kv)


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda layout: layout.value)
def test_copy_between_host_layouts(layout: HostLayout, copy_path: str) -> None:
    shape = small_shape(KVKind.MHA, torch.bfloat16)
    first = HostKVPool(shape, 8, layout)
    kv = random_kv(shape, 5, seed=5)
    first.write_pages([0, 1, 2, 5, 6], kv)
    for other in LAYOUTS:
        second = HostKVPool(shape, 8, other)
        copy_pages(first, [0, 1, 2, 5, 6], second, [7, 3, 4, 5, 0])
        assert bit_equal(second.read_pages([7, 3, 4, 5, 0]), kv)


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda layout: layout.value)
def test_copy_within_one_pool_handles_overlap(layout: HostLayout, copy_path: str) -> None:
    shape = small_shape()
    pool = HostKVPool(shape, 6, layout)
    kv = random_kv(shape, 6, seed=3)
    pool.write_pages(np.arange(6), kv)
    copy_pages(pool, [0, 1, 2, 3], pool, [1, 2, 3, 4])
    assert bit_equal(pool.read_pages([1, 2, 3, 4]), kv[:, :, 0:4])
    assert bit_equal(pool.read_pages([0, 5]), kv[:, :, [0, 5]])


@settings(max_examples=40)
@given(
    layout=st.sampled_from(LAYOUTS),
    kind=st.sampled_from(KINDS),
    data=st.data(),
)
def test_copy_matches_a_reference_for_any_page_mapping(
    layout: HostLayout, kind: KVKind, data: st.DataObject
) -> None:
    shape = small_shape(kind, torch.float16)
    device = DeviceKVPool(shape, 10, "cpu")
    host = HostKVPool(shape, 10, layout)
    device_kv = random_kv(shape, 10, seed=11)
    device.write_pages(np.arange(10), device_kv)
    host.write_pages(np.arange(10), random_kv(shape, 10, seed=12))
    n = data.draw(st.integers(0, 10))
    src = data.draw(st.lists(st.integers(0, 9), min_size=n, max_size=n))
    dst = data.draw(st.permutations(range(10)))[:n]
    expected = host.read_pages(np.arange(10))
    for i, d in enumerate(dst):
        expected[:, :, d] = device_kv[:, :, src[i]]
    assert copy_pages(device, src, host, dst) == n * shape.bytes_per_page
    assert bit_equal(host.read_pages(np.arange(10)), expected)


def test_page_indices_may_be_numpy_torch_or_lists() -> None:
    shape = small_shape()
    device = DeviceKVPool(shape, 4, "cpu")
    host = HostKVPool(shape, 4, "page_first")
    kv = random_kv(shape, 2, seed=2)
    device.write_pages(torch.tensor([1, 3]), kv)
    copy_pages(device, np.array([1, 3], dtype=np.int32), host, [0, 2])
    assert bit_equal(host.read_pages(torch.tensor([0, 2], dtype=torch.int32)), kv)
    assert copy_pages(device, [], host, np.array([], dtype=np.int64)) == 0


def test_joint_runs() -> None:
    src = np.array([0, 1, 2, 7, 8, 3], dtype=np.int64)
    dst = np.array([5, 6, 9, 10, 11, 0], dtype=np.int64)
    starts_src, starts_dst, lengths = joint_runs(src, dst)
    assert starts_src.tolist() == [0, 2, 7, 3]
    assert starts_dst.tolist() == [5, 9, 10, 0]
    assert lengths.tolist() == [2, 1, 2, 1]


# ----------------------------------------------------------------------------------------------
# Bad input changes nothing


def _snapshot(*pools: DeviceKVPool | HostKVPool) -> list[torch.Tensor]:
    return [pool.buffer.clone() for pool in pools]


def _unchanged(before: list[torch.Tensor], *pools: DeviceKVPool | HostKVPool) -> bool:
    return all(bit_equal(b, pool.buffer) for b, pool in zip(before, pools, strict=True))


@pytest.mark.parametrize(
    ("pages", "kv_change", "message"),
    [
        ([0, 4], None, "out of range"),
        ([-1, 0], None, "out of range"),
        ([1, 1], None, "more than once"),
        ([0.0, 1.0], None, "integer"),
        ([0, 1], "dtype", "dtype"),
        ([0, 1], "pages", "shape"),
        ([0, 1], "layers", "shape"),
        ([0, 1], "not a tensor", "torch.Tensor"),
    ],
)
@pytest.mark.parametrize("layout", [*LAYOUTS, None], ids=lambda x: x.value if x else "device")
def test_bad_writes_raise_misuse_and_change_nothing(
    layout: HostLayout | None, pages: list[float], kv_change: str | None, message: str
) -> None:
    shape = small_shape()
    pool = DeviceKVPool(shape, 4, "cpu") if layout is None else HostKVPool(shape, 4, layout)
    pool.write_pages(np.arange(4), random_kv(shape, 4, seed=1))
    kv: object = random_kv(shape, 2, seed=2)
    if kv_change == "dtype":
        kv = random_kv(small_shape(dtype=torch.bfloat16), 2, seed=2)
    elif kv_change == "pages":
        kv = random_kv(shape, 3, seed=2)
    elif kv_change == "layers":
        kv = torch.zeros(2, 2, 2, 4, 2, 8, dtype=shape.dtype)
    elif kv_change == "not a tensor":
        kv = np.zeros(shape.canonical(2))
    before = _snapshot(pool)
    with pytest.raises(MisuseError, match=message):
        pool.write_pages(pages, kv)  # type: ignore[arg-type]
    assert _unchanged(before, pool)
    assert pool.allocator.free_count == 4


def test_bad_reads_raise_misuse() -> None:
    pool = HostKVPool(small_shape(), 4, "page_first_direct")
    with pytest.raises(MisuseError, match="out of range"):
        pool.read_pages([4])
    with pytest.raises(MisuseError, match="1-D"):
        pool.read_pages([[0, 1]])  # type: ignore[list-item]
    assert pool.read_pages([2, 2]).shape == small_shape().canonical(2)  # repeats are fine


@pytest.mark.parametrize(
    ("src", "dst", "message"),
    [
        ([0, 1], [0], "2 source pages but 1 destination"),
        ([0, 4], [0, 1], "out of range"),
        ([0, 1], [0, 8], "out of range"),
        ([0, 1], [3, 3], "more than once"),
        ([0, 1.5], [0, 1], "integer"),
    ],
)
def test_bad_copies_raise_misuse_and_change_nothing(
    src: list[float], dst: list[int], message: str
) -> None:
    shape = small_shape()
    device = DeviceKVPool(shape, 4, "cpu")
    host = HostKVPool(shape, 8, "page_first")
    device.write_pages(np.arange(4), random_kv(shape, 4, seed=1))
    host.write_pages(np.arange(8), random_kv(shape, 8, seed=2))
    before = _snapshot(device, host)
    with pytest.raises(MisuseError, match=message):
        copy_pages(device, src, host, dst)  # type: ignore[arg-type]
    assert _unchanged(before, device, host)


def test_copy_between_different_shapes_is_refused() -> None:
    device = DeviceKVPool(small_shape(), 4, "cpu")
    host = HostKVPool(small_shape(dtype=torch.float32), 4, "layer_first")
    before = _snapshot(host)
    with pytest.raises(MisuseError, match="shapes differ"):
        copy_pages(device, [0], host, [0])
    with pytest.raises(MisuseError, match="two KV pools"):
        copy_pages(device, [0], host.buffer, [0])  # type: ignore[arg-type]
    assert _unchanged(before, host)


def test_every_error_is_a_kvstrata_error() -> None:
    assert issubclass(ConfigError, MisuseError)
    assert issubclass(MisuseError, KvStrataError) and issubclass(CapacityError, KvStrataError)


# ----------------------------------------------------------------------------------------------
# Sizes


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("4gb", 4_000_000_000),
        ("4GB", 4_000_000_000),
        ("512MiB", 512 * 2**20),
        ("1.5G", 1_500_000_000),
        ("1.5gib", 3 * 2**29),
        ("1024", 1024),
        (1024, 1024),
        (" 10 kb ", 10_000),
        ("2KiB", 2048),
        ("2ki", 2048),
        ("7b", 7),
        (".5k", 500),
        ("1.3gib", int(1.3 * 2**30)),  # rounded down to whole bytes
        ("1tb", 10**12),
        ("1TiB", 2**40),
    ],
)
def test_parse_size(text: int | str, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize(
    "bad", ["", "abc", "4 zb", "-1", "1..5gb", "gb", "4gbb", 0, -5, "0", "0.1b", True, 1.5, None]
)
def test_parse_size_refuses(bad: object) -> None:
    with pytest.raises(ConfigError, match="cache_size"):
        parse_size(bad, what="cache_size")  # type: ignore[arg-type]


def test_host_pages_for_ratio_and_size() -> None:
    shape = small_shape()  # 768 bytes per page
    assert shape.bytes_per_page == 768
    assert host_pages_for(shape, 100, ratio=2.0) == 200
    assert host_pages_for(shape, 100, ratio=0.5) == 50
    assert host_pages_for(shape, 3, ratio=1.5) == 4
    assert host_pages_for(shape, 100, size="1MiB") == 2**20 // 768
    assert host_pages_for(shape, 100, size=768 * 5 + 767) == 5


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({}, "exactly one of ratio and size"),
        ({"ratio": 1.0, "size": "1gb"}, "exactly one of ratio and size"),
        ({"ratio": 0}, "ratio"),
        ({"ratio": -1.0}, "ratio"),
        ({"ratio": float("nan")}, "ratio"),
        ({"ratio": float("inf")}, "ratio"),
        ({"ratio": True}, "ratio"),
        ({"ratio": 0.001}, "less than one page"),
        ({"size": 767}, "less than one page"),
        ({"size": 0}, "at least 1 byte"),
        ({"size": "-3gb"}, "size"),
        ({"size": 10**15}, "do not fit in host memory"),
        ({"size": "1pb"}, "do not fit in host memory"),
    ],
)
def test_host_pages_for_refuses(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        host_pages_for(small_shape(), 100, **kwargs)  # type: ignore[arg-type]


def test_host_pages_for_checks_memory_with_a_reserve() -> None:
    shape = small_shape()
    fits = (GIB - 1) // shape.bytes_per_page
    assert host_pages_for(shape, 10, size=GIB - 1, available=2 * GIB, reserve=GIB) == fits
    with pytest.raises(ConfigError, match=r"2\.00 GiB available, 1\.00 GiB kept in reserve"):
        host_pages_for(shape, 10, size=GIB + 768, available=2 * GIB, reserve="1gib")
    # default reserve: max(256 MiB, 10 %)
    with pytest.raises(ConfigError, match=r"kept in reserve"):
        host_pages_for(shape, 10, size="9.5gib", available=10 * GIB)
    assert host_pages_for(shape, 10, size="8.9gib", available=10 * GIB) > 0
    with pytest.raises(ConfigError, match=r"0\.25 GiB kept in reserve"):
        host_pages_for(shape, 10, size="800mib", available=GIB)
    assert host_pages_for(shape, 10, size="700mib", available=GIB) > 0
    with pytest.raises(ConfigError, match="device_pages"):
        host_pages_for(shape, 0, ratio=1.0)
    with pytest.raises(ConfigError, match="shape"):
        host_pages_for("shape", 1, ratio=1.0)  # type: ignore[arg-type]


def test_available_host_memory_and_check() -> None:
    available = available_host_memory()
    assert available is None or available > 0
    check_host_fits(1, available=2 * GIB)
    with pytest.raises(ConfigError, match="host pool"):
        check_host_fits(2 * GIB, available=2 * GIB, reserve=0 + 1)
    check_host_fits(2 * GIB - 1, available=2 * GIB, reserve=1)


def test_cgroup_limits_count_for_available_memory(tmp_path: Path) -> None:
    root = tmp_path / "cgroup"
    v2 = root / "kube" / "pod"
    v2.mkdir(parents=True)
    (root / "kube" / "memory.max").write_text(f"{8 * GIB}\n")
    (root / "kube" / "memory.current").write_text(f"{GIB}\n")
    (v2 / "memory.max").write_text("max\n")
    (v2 / "memory.current").write_text(f"{GIB}\n")
    v1 = root / "memory" / "job"
    v1.mkdir(parents=True)
    (v1 / "memory.limit_in_bytes").write_text(f"{12 * GIB}\n")
    (v1 / "memory.usage_in_bytes").write_text(f"{2 * GIB}\n")
    self_cgroup = tmp_path / "self"
    self_cgroup.write_text("0::/kube/pod\n")
    assert sizes_module._cgroup_headroom(root, self_cgroup) == 7 * GIB
    self_cgroup.write_text("4:memory:/job\n1:cpu:/\n")
    assert sizes_module._cgroup_headroom(root, self_cgroup) == 10 * GIB
    self_cgroup.write_text("4:memory:/job\n0::/kube/pod\n")
    assert sizes_module._cgroup_headroom(root, self_cgroup) == 7 * GIB
    self_cgroup.write_text("0::/\n")
    assert sizes_module._cgroup_headroom(root, self_cgroup) is None
    assert sizes_module._cgroup_headroom(root, tmp_path / "missing") is None


# ---------------------------------------------------------------------------------------- wrap
WRAP_MHA = KVShape(KVKind.MHA, layers=3, heads=2, head_dim=4, dtype=torch.float16, page_size=2)
WRAP_MLA = KVShape(KVKind.MLA, layers=3, heads=1, head_dim=6, dtype=torch.bfloat16, page_size=4)


def engine_buffer(
    shape: KVShape, layout: HostLayout, pages: int, planes: bool = True
) -> torch.Tensor:
    """A buffer as an engine holds it (sglang's host ``kv_buffer`` shapes), filled with a pattern."""
    tokens = pages * shape.page_size
    dims: tuple[int, ...]
    if layout is HostLayout.LAYER_FIRST:
        dims = (shape.planes, shape.layers, tokens, shape.heads, shape.head_dim)
    elif layout is HostLayout.PAGE_FIRST:
        dims = (shape.planes, tokens, shape.layers, shape.heads, shape.head_dim)
    elif layout is HostLayout.PAGE_MAJOR:
        dims = (pages, shape.planes, shape.layers, shape.page_size, shape.heads, shape.head_dim)
    else:
        dims = (shape.planes, pages, shape.layers, shape.page_size, shape.heads, shape.head_dim)
    if not planes:
        plane_dim = 1 if layout is HostLayout.PAGE_MAJOR else 0
        dims = dims[:plane_dim] + dims[plane_dim + 1 :]
    count = int(np.prod(dims))
    return torch.arange(count, dtype=torch.float32).remainder(251).to(shape.dtype).reshape(dims)


@pytest.mark.parametrize("layout", list(HostLayout))
@pytest.mark.parametrize("shape", [WRAP_MHA, WRAP_MLA], ids=["mha", "mla"])
def test_wrap_adopts_an_engine_buffer_without_a_copy(shape: KVShape, layout: HostLayout) -> None:
    buffer = engine_buffer(shape, layout, pages=5)
    owned = HostKVPool(shape, 5, layout, pin_memory=False)
    owned.buffer.copy_(buffer)  # the same bytes in a pool kvstrata allocated itself
    pool = HostKVPool.wrap(buffer, shape, layout)
    assert pool.num_pages == 5 and pool.layout is layout and pool.allocator.free_count == 5
    assert pool.buffer.data_ptr() == buffer.data_ptr()  # zero-copy
    assert torch.equal(pool.read_pages([4, 0, 2]), owned.read_pages([4, 0, 2]))
    fresh = torch.full(shape.canonical(1), 7, dtype=shape.dtype)
    pool.write_pages([3], fresh)  # lands in the engine's own memory
    owned.write_pages([3], fresh)
    assert torch.equal(buffer.reshape(-1), owned.buffer.reshape(-1))
    if layout is not HostLayout.LAYER_FIRST:
        slab = pool.page_slab(0, 1)
        assert slab.data_ptr() == owned.page_slab(0, 1).data_ptr() - owned.buffer.data_ptr() + (
            buffer.data_ptr()
        )


@pytest.mark.parametrize("layout", list(HostLayout))
def test_wrap_takes_an_mla_buffer_without_its_plane_dimension(layout: HostLayout) -> None:
    buffer = engine_buffer(WRAP_MLA, layout, pages=3, planes=False)
    pool = HostKVPool.wrap(buffer, WRAP_MLA, layout)
    assert pool.num_pages == 3 and pool.buffer.data_ptr() == buffer.data_ptr()
    full = HostKVPool.wrap(
        buffer.unsqueeze(1 if layout is HostLayout.PAGE_MAJOR else 0), WRAP_MLA, layout
    )
    assert torch.equal(pool.read_pages([0, 1, 2]), full.read_pages([0, 1, 2]))


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: np.zeros((2, 3, 4, 2, 4), dtype=np.float16), "must be a torch.Tensor"),
        (
            lambda: engine_buffer(WRAP_MHA, HostLayout.LAYER_FIRST, 2).to(torch.float32),
            "dtype must be torch.float16",
        ),
        (
            lambda: engine_buffer(WRAP_MHA, HostLayout.LAYER_FIRST, 2).transpose(0, 1),
            "shape must be|contiguous",
        ),
        (lambda: torch.zeros((2, 3, 5, 2, 4), dtype=torch.float16), "multiple of page_size"),
        (lambda: torch.zeros((2, 3, 4, 3, 4), dtype=torch.float16), "shape must be"),
        (lambda: torch.zeros((3, 4, 2, 4), dtype=torch.float16), "shape must be"),
        (lambda: torch.zeros((2, 3, 0, 2, 4), dtype=torch.float16), "positive multiple"),
        (
            lambda: engine_buffer(WRAP_MHA, HostLayout.LAYER_FIRST, 2)[:, :, ::2],
            "contiguous",
        ),
    ],
    ids=["numpy", "dtype", "transposed", "partial-page", "heads", "rank", "empty", "strided"],
)
def test_wrap_refuses_a_buffer_that_does_not_fit(make: object, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        HostKVPool.wrap(make(), WRAP_MHA, HostLayout.LAYER_FIRST)  # type: ignore[operator]


def test_wrap_checks_the_layout_it_is_told() -> None:
    page_first = engine_buffer(WRAP_MHA, HostLayout.PAGE_FIRST, 2)
    with pytest.raises(ConfigError, match="page_first_direct"):
        HostKVPool.wrap(page_first, WRAP_MHA, HostLayout.PAGE_FIRST_DIRECT)
    assert HostKVPool.wrap(page_first, WRAP_MHA, "page_first").num_pages == 2


def test_a_device_pool_that_cannot_fit_is_refused_before_anything_is_allocated() -> None:
    """Issue 17: ``--l1 10T`` allocated 146 GiB of allocator state and died in numpy."""
    with pytest.raises(ConfigError, match="do not fit"):
        DeviceKVPool(KVShape(KVKind.MHA, 32, 8, 128, torch.float16, 16), 10**10, "cpu")
