"""Hybrid-model side pools (SPEC §5): sparse-attention indexer keys and Mamba states next to the KV
anchor pool, on the device (L1) and on the host (L2).

A side pool holds *entries*, each made of one buffer per component of its
:class:`~kvstrata.model.hybrid.SidePool` (the model's value naming the pool, its hit policy and its
component names in store-key order):

- an **indexer** pool (``ALL_PAGES``, one component ``key``) has one entry per KV page and *shares the
  KV pool's page indices*: entry ``i`` belongs to KV page ``i``, so it has no allocator of its own and
  is always exactly as large as its anchor pool;
- a **state** pool (``TRAILING_PAGES``, components ``conv_0 .. conv_{N-1}`` and ``temporal``) has one
  entry per *node end* (a Mamba state after the node's last token), in slots handed out by its own
  :class:`~kvstrata.impl.pools.allocator.PageAllocator`.

Memory layout: component ``c`` of every entry is one contiguous tensor ``[entries, *shape_c]``, so one
entry of one component is one contiguous run of bytes, moved zero-copy: under key schema 1 the store
object for that (entry, component) is that run; under schema 2 the entry's one object is its runs of
every component in order. :meth:`SideBuffer.describe` gives, for each entry, the ``(pointer, bytes)``
regions of its components **in the pool's component order** (the order
:func:`kvstrata.model.hybrid.side_page_keys` renders keys in under schema 1, and the order of the
bytes of the one object under schema 2), which is the one fact a store needs.

Layers: attention layers (KV, indexer) and state layers (Mamba) are different subsets of a model's
layers. :class:`LayerMap` records both; a per-layer transfer walks their union (:meth:`LayerMap.steps`).

Layout in the key: :func:`side_layout` names an entry's byte layout (components, shapes, dtypes) with a
short digest, and :class:`SideSpec` puts it in its pool (:attr:`SidePool.layout
<kvstrata.model.hybrid.SidePool.layout>`), so the pool's store keys differ whenever its entries are laid
out differently, even at the same size (a Mamba SSM state in bfloat16 on one deployment and float16 on
another). Such deployments miss each other's side objects instead of reading wrong bytes.

Invariants: a buffer never changes identity or size; ``read``/``write``/``copy_entries`` validate every
index before touching memory (:class:`MisuseError`, nothing written); entries' bytes are unspecified
until written (the cache owns which entries are valid).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence

import attrs
import numpy as np
import numpy.typing as npt
import torch

from kvstrata.impl.errors import ConfigError, MisuseError
from kvstrata.impl.pools.allocator import PageAllocator, PageIndices, as_page_array
from kvstrata.impl.pools.device import resolve_device
from kvstrata.impl.pools.sizes import check_host_fits
from kvstrata.model.hybrid import HitPolicy, SidePool

__all__ = [
    "LayerMap",
    "LayerStep",
    "Region",
    "SideBuffer",
    "SideSpec",
    "copy_entries",
    "indexer_spec",
    "mamba_spec",
    "side_layout",
]

_LAYOUT_DOMAIN = b"kvstrata.side-layout.v1\0"
_LAYOUT_HEX_DIGITS = 16


@attrs.frozen
class Region:
    """One store object's bytes in a pool buffer: ``nbytes`` contiguous bytes from ``ptr``."""

    ptr: int
    nbytes: int


def _shape(value: object) -> tuple[int, ...]:
    if isinstance(value, int | str | bytes) or not isinstance(value, Sequence):
        raise ConfigError(f"a component shape is a sequence of positive ints, got {value!r}")
    dims = tuple(value)
    if not dims or any(isinstance(d, bool) or not isinstance(d, int) or d < 1 for d in dims):
        raise ConfigError(f"a component shape is a sequence of positive ints, got {value!r}")
    return dims


def _shapes(value: Sequence[Sequence[int]]) -> tuple[tuple[int, ...], ...]:
    if isinstance(value, str) or not isinstance(value, Sequence):
        raise ConfigError(f"SideSpec.shapes: expected a sequence of shapes, got {value!r}")
    return tuple(_shape(shape) for shape in value)


def _dtypes(value: torch.dtype | Sequence[torch.dtype]) -> tuple[torch.dtype, ...]:
    items = (value,) if isinstance(value, torch.dtype) else tuple(value)
    for dtype in items:
        if not isinstance(dtype, torch.dtype) or dtype.is_complex or dtype == torch.bool:
            raise ConfigError(f"SideSpec.dtypes: expected real torch dtypes, got {dtype!r}")
    return items


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def side_layout(
    components: Sequence[str],
    shapes: Sequence[Sequence[int]],
    dtypes: Sequence[torch.dtype],
    detail: str = "",
) -> str:
    """The layout token of a side pool's entry: 16 hex digits of SHA-256 over a domain tag, each
    component's name, dtype and shape in order, and ``detail`` (what else the bytes depend on, for
    a pool known only as flat bytes: the engine's dtypes). Equal for equal layouts on every node;
    different layouts differ but by a 2**-64 chance. Not a security boundary: tenants are kept apart
    by the namespace, not by this token."""
    if len(components) != len(shapes) or len(components) != len(dtypes):
        raise ConfigError(
            f"side_layout: {len(components)} components, {len(shapes)} shapes, {len(dtypes)} dtypes"
        )
    text = ";".join(
        f"{name}:{_dtype_name(dtype)}:{'x'.join(str(d) for d in shape)}"
        for name, shape, dtype in zip(components, shapes, dtypes, strict=True)
    )
    digest = hashlib.sha256(_LAYOUT_DOMAIN + text.encode() + b"\0" + detail.encode()).hexdigest()
    return digest[:_LAYOUT_HEX_DIGITS]


@attrs.frozen
class SideSpec:
    """What one entry of a side pool holds: one shape and dtype per component of ``pool``.

    Invariants (:class:`ConfigError` otherwise): one shape per component, each of positive ints; one
    dtype for all components or one per component. ``shapes[c]`` is the shape of component
    ``pool.components[c]`` for one entry, layers included. ``pool.layout`` is
    :func:`side_layout` of the components, shapes, dtypes and ``detail``: a pool given without a
    layout gets it here (``spec.pool`` is what a cache's config lists; a config may also list the
    pool without it), a pool given with another is refused. So is ``attrs.evolve(spec, dtypes=...)``
    (the pool keeps the old layout): make the new spec from ``attrs.evolve(spec.pool, layout="")``.
    """

    pool: SidePool = attrs.field(validator=attrs.validators.instance_of(SidePool))
    shapes: tuple[tuple[int, ...], ...] = attrs.field(converter=_shapes)
    dtypes: tuple[torch.dtype, ...] = attrs.field(converter=_dtypes)
    detail: str = attrs.field(default="", kw_only=True, validator=attrs.validators.instance_of(str))

    def __attrs_post_init__(self) -> None:
        count = len(self.pool.components)
        if len(self.shapes) != count:
            raise ConfigError(
                f"SideSpec.shapes: pool {self.pool.name!r} has {count} components "
                f"{self.pool.components}, got {len(self.shapes)} shapes"
            )
        if len(self.dtypes) == 1 and count > 1:
            object.__setattr__(self, "dtypes", self.dtypes * count)
        elif len(self.dtypes) != count:
            raise ConfigError(
                f"SideSpec.dtypes: expected 1 or {count} dtypes, got {len(self.dtypes)}"
            )
        layout = side_layout(self.pool.components, self.shapes, self.dtypes, self.detail)
        if not self.pool.layout:
            object.__setattr__(self, "pool", attrs.evolve(self.pool, layout=layout))
        elif self.pool.layout != layout:
            raise ConfigError(
                f"SideSpec: pool {self.pool.name!r} has layout {self.pool.layout!r}, but its "
                f"components, shapes and dtypes give {layout!r} (leave the pool's layout empty "
                f"to have it filled in)"
            )

    @property
    def name(self) -> str:
        return self.pool.name

    @property
    def policy(self) -> HitPolicy:
        return self.pool.policy

    @property
    def components(self) -> tuple[str, ...]:
        return self.pool.components

    def component_bytes(self) -> tuple[int, ...]:
        """Bytes of one entry of each component (the size of each store object under key schema 1;
        under schema 2 an entry's one object is their sum, :attr:`bytes_per_entry`)."""
        return tuple(
            math.prod(shape) * dtype.itemsize
            for shape, dtype in zip(self.shapes, self.dtypes, strict=True)
        )

    @property
    def bytes_per_entry(self) -> int:
        return sum(self.component_bytes())


def indexer_spec(
    *, layers: int, page_size: int, dim: int, dtype: torch.dtype, name: str = "indexer"
) -> SideSpec:
    """A sparse-attention indexer pool: per KV page, ``[layers, page_size, dim]`` index keys in one
    component ``key`` (``ALL_PAGES``)."""
    return SideSpec(
        SidePool(name, HitPolicy.ALL_PAGES, ("key",)), [(layers, page_size, dim)], dtype
    )


def mamba_spec(
    *,
    layers: int,
    conv: Sequence[Sequence[int]],
    temporal: Sequence[int],
    dtype: torch.dtype | Sequence[torch.dtype],
    name: str = "mamba",
) -> SideSpec:
    """A Mamba state pool: per state, ``len(conv)`` conv buffers ``[layers, *conv[i]]`` (components
    ``conv_0 ..``) and one temporal (SSM) buffer ``[layers, *temporal]`` (component ``temporal``),
    ``TRAILING_PAGES``. ``dtype`` is one dtype or one per component (conv buffers first)."""
    if isinstance(conv, str) or not isinstance(conv, Sequence) or not conv:
        raise ConfigError(f"mamba_spec.conv: expected a non-empty sequence of shapes, got {conv!r}")
    components = (*(f"conv_{i}" for i in range(len(conv))), "temporal")
    shapes = [(layers, *_shape(c)) for c in conv] + [(layers, *_shape(temporal))]
    return SideSpec(SidePool(name, HitPolicy.TRAILING_PAGES, components), shapes, dtype)


@attrs.frozen
class LayerStep:
    """One layer of a per-layer transfer: the model layer and its index in each pool (or None)."""

    layer: int
    attention: int | None
    state: int | None


def _layers(value: Sequence[int]) -> tuple[int, ...]:
    out = tuple(value)
    if any(isinstance(x, bool) or not isinstance(x, int) or x < 0 for x in out):
        raise ConfigError(f"LayerMap: layers are ints >= 0, got {value!r}")
    if len(set(out)) != len(out) or list(out) != sorted(out):
        raise ConfigError(f"LayerMap: layers must be distinct and ascending, got {value!r}")
    return out


@attrs.frozen
class LayerMap:
    """Which of a hybrid model's layers hold attention KV (and indexer keys) and which hold state.

    Invariants: both tuples ascending and distinct. The KV and indexer pools have
    ``len(attention)`` layers (pool layer ``i`` is model layer ``attention[i]``); the state pool
    has ``len(state)``.
    """

    attention: tuple[int, ...] = attrs.field(converter=_layers)
    state: tuple[int, ...] = attrs.field(converter=_layers)

    def steps(self) -> tuple[LayerStep, ...]:
        """The union of both layer sets in model order, each with its pool indices: the order a
        layer-by-layer transfer (overlapping the forward pass) moves them in."""
        attention = {layer: i for i, layer in enumerate(self.attention)}
        state = {layer: i for i, layer in enumerate(self.state)}
        return tuple(
            LayerStep(layer, attention.get(layer), state.get(layer))
            for layer in sorted(attention.keys() | state.keys())
        )


class SideBuffer:
    """``entries`` entries of ``spec`` on ``device`` (L1) or in host memory (L2).

    ``allocator`` is ``None`` for an ``ALL_PAGES`` pool (its entries are indexed by the anchor's KV
    pages) and a :class:`PageAllocator` of its own for a ``TRAILING_PAGES`` pool (state slots).
    """

    spec: SideSpec
    entries: int
    tensors: tuple[torch.Tensor, ...]
    allocator: PageAllocator | None

    def __init__(
        self,
        spec: SideSpec,
        entries: int,
        *,
        host: bool = False,
        device: torch.device | str | None = None,
        pin_memory: bool | None = None,
        available: int | None = None,
    ) -> None:
        if not isinstance(spec, SideSpec):
            raise MisuseError(f"SideBuffer: expected a SideSpec, got {spec!r}")
        if isinstance(entries, bool) or not isinstance(entries, int) or entries < 1:
            raise ConfigError(f"SideBuffer.entries: expected a positive int, got {entries!r}")
        if host:
            check_host_fits(
                spec.bytes_per_entry * entries,
                what=f"host side pool {spec.name!r} of {entries} entries",
                available=available,
            )
            target = torch.device("cpu")
            pin = torch.cuda.is_available() if pin_memory is None else bool(pin_memory)
            if pin and not torch.cuda.is_available():
                raise ConfigError("SideBuffer.pin_memory: True requested but CUDA is not available")
        else:
            target = resolve_device(device)
            pin = False
        self.spec = spec
        self.entries = entries
        self.pinned = pin
        try:
            self.tensors = tuple(
                torch.zeros((entries, *shape), dtype=dtype, device=target, pin_memory=pin)
                for shape, dtype in zip(spec.shapes, spec.dtypes, strict=True)
            )
        except RuntimeError as error:
            raise ConfigError(
                f"SideBuffer {spec.name!r}: cannot allocate {spec.bytes_per_entry * entries} "
                f"bytes on {target}: {error}"
            ) from error
        self.allocator = (
            PageAllocator(entries, name=f"{spec.name} states")
            if spec.policy is HitPolicy.TRAILING_PAGES
            else None
        )

    # ------------------------------------------------------------------------------------ queries
    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def device(self) -> torch.device:
        return self.tensors[0].device

    @property
    def nbytes(self) -> int:
        return self.spec.bytes_per_entry * self.entries

    def indices(self, entries: PageIndices, what: str) -> npt.NDArray[np.int64]:
        """``entries`` as an int64 array after checking each is an entry of this buffer."""
        return as_page_array(entries, self.entries, what=f"{self.name}: {what}").astype(np.int64)

    def describe(self, entries: PageIndices) -> list[tuple[Region, ...]]:
        """For each entry, its components' regions in component-key order (CPU buffers only: a
        store reads and writes host memory)."""
        if self.device.type != "cpu":
            raise MisuseError(f"{self.name}: only a host buffer can be described to a store")
        array = self.indices(entries, "describe")
        sizes = self.spec.component_bytes()
        bases = [t.data_ptr() for t in self.tensors]
        return [
            tuple(
                Region(base + int(entry) * size, size)
                for base, size in zip(bases, sizes, strict=True)
            )
            for entry in array
        ]

    def buffers(self) -> list[Region]:
        """Each component tensor as one region (what a store registers once)."""
        return [Region(t.data_ptr(), t.numel() * t.element_size()) for t in self.tensors]

    # ---------------------------------------------------------------------------------- data moves
    def read(self, entries: PageIndices) -> tuple[torch.Tensor, ...]:
        """Copies of ``entries`` of every component, ``[n, *shape_c]`` each."""
        index = torch.from_numpy(self.indices(entries, "read")).to(self.device)
        return tuple(t.index_select(0, index) for t in self.tensors)

    def write(self, entries: PageIndices, values: Sequence[torch.Tensor]) -> None:
        """Write ``values[c]`` (``[n, *shape_c]`` of the component's dtype) into ``entries``."""
        array = self.indices(entries, "write")
        if len(values) != len(self.tensors):
            raise MisuseError(
                f"{self.name}: write expects {len(self.tensors)} component tensors, "
                f"got {len(values)}"
            )
        for value, tensor in zip(values, self.tensors, strict=True):
            expected = (len(array), *tensor.shape[1:])
            if not isinstance(value, torch.Tensor) or tuple(value.shape) != expected:
                got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value)
                raise MisuseError(f"{self.name}: write expects shape {expected}, got {got}")
            if value.dtype != tensor.dtype:
                raise MisuseError(
                    f"{self.name}: write expects dtype {tensor.dtype}, got {value.dtype}"
                )
        index = torch.from_numpy(array).to(self.device)
        for value, tensor in zip(values, self.tensors, strict=True):
            tensor.index_copy_(0, index, value.to(tensor.device))


def copy_entries(
    src: SideBuffer, src_entries: PageIndices, dst: SideBuffer, dst_entries: PageIndices
) -> None:
    """Copy entries between two buffers of the same spec (L1 <-> L2), one vectorised
    ``index_select`` + ``index_copy_`` per component; every index is checked first."""
    if src.spec != dst.spec:
        raise MisuseError(f"copy_entries: {src.name!r} and {dst.name!r} have different specs")
    source = src.indices(src_entries, "copy from")
    target = dst.indices(dst_entries, "copy to")
    if len(source) != len(target):
        raise MisuseError(f"copy_entries: {len(source)} source but {len(target)} target entries")
    if not len(source):
        return
    src_index = torch.from_numpy(source).to(src.device)
    dst_index = torch.from_numpy(target).to(dst.device)
    for s, d in zip(src.tensors, dst.tensors, strict=True):
        d.index_copy_(0, dst_index, s.index_select(0, src_index).to(d.device, non_blocking=True))
