"""vLLM's KV blocks as kvstrata pages: :class:`BlockViews` (no vLLM import; torch only).

vLLM (0.32 on, its RFC #42082) hands a connector one view per layer, ``[B, H, N, C]``: blocks, KV
heads, tokens of a block, and one token's content for one head (MHA: its K and its V, where its
backend puts them; MLA: the latent). Every attention backend gets the same logical view; the
backend's physical order (``KVCacheLayout``: which of L, B, H, N is outermost in memory) is in the
view's strides only, and with kernel blocks smaller than vLLM's block, ``B`` counts kernel blocks
and ``N`` their tokens.

Where K and V lie inside a block is the backend's own convention (:data:`KV_SPLITS`): most split
each cell ``C`` into K then V; vLLM's CPU backend splits each head's ``[N, C]`` into K then V, K
column-major in its vec kernels. A page is cut in **logical** order by its backend's split, so the
bytes a page holds do not depend on the backend, its physical layout or its kernel block size: MHA
pages are two planes (K, V), each ``[H, N, D]`` of the block (:data:`PAGE_LAYOUT`, part of the
keys), and MLA pages the block's ``[1, N, C]``. Pages go between vLLM's views and the host pool's
pages (:meth:`BlockViews.save`, :meth:`BlockViews.load`): on the CPU view to view; from a device
through a staging tensor on the device in the host pool's own page order, so each run of slots is
one contiguous transfer (pinned: an asynchronous DMA) instead of a pageable copy per layer.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence

import numpy as np
import torch

from kvstrata.impl.errors import ConfigError, MisuseError
from kvstrata.impl.pools.copy import joint_runs
from kvstrata.impl.pools.host import HostKVPool
from kvstrata.impl.pools.shape import KVShape
from kvstrata.model.keys import KVKind

__all__ = [
    "KV_SPLITS",
    "PAGE_LAYOUT",
    "STAGE_BYTES",
    "BlockViews",
    "kv_split",
    "page_geometry",
    "page_shape",
]

STAGE_BYTES = 64 << 20
"""The staging tensor a :class:`BlockViews` on a device gathers pages in (bytes, rounded down to
whole pages, at least one), allocated once on the views' device: outside vLLM's own memory
budget (its KV caches are allocated before the connector registers them), so it comes out of the
headroom ``gpu_memory_utilization`` leaves. A chunk of this size moves as one copy per run of
slots and per plane (the connector's ``page_first_direct`` pool; ``layer_first`` takes one per
layer and plane)."""

PAGE_LAYOUT = "hnd"
"""The order of an MHA page's bytes (``EngineShard.kv_layout``): K, then V, each heads x tokens x
head dim of vLLM's logical block. MLA pages (the block's bytes as they are) name none, so their
keys are those they always had."""


KV_SPLITS = {
    "FLASH_ATTN": "cell",
    "FLASHINFER": "cell",
    "FLEX_ATTENTION": "cell",
    "TRITON_ATTN": "cell",
    "TRITON_FLASH_ATTN": "cell",  # composites of two cell-split backends over one cache
    "TRITON_FLASHINFER": "cell",
    "CPU_ATTN:vec": "cpu_vec",
    "CPU_ATTN:vec16": "cpu_vec",
}
"""Where vLLM's attention backends (``get_name()``, with the CPU kernel's ``isa`` after a ``:``)
keep K and V in a ``[B, H, N, C]`` block. ``cell``: each token's ``C`` is its K then its V
(``split(head_size, dim=-1)``). ``cpu_vec``: each head's ``[N, C]`` is K then V (the CPU backend's
``view(B, H, 2N, D).chunk(2, dim=2)``), and its vec kernels store K column-major (``[D, N]``)
and V row-major (``[N, D]``). A backend not listed (the CPU backend's AMX, NEON and other kernels,
which pack K and V their own way; the ROCm-only backends; b12x) is refused for MHA: its split is
not known here. Triton on ROCm is listed (as ``TRITON_ATTN``); it ran on no ROCm machine here."""


def kv_split(backends: set[str], mla: bool, where: str) -> str:
    """The split (:data:`KV_SPLITS`) of the attention backends that run a model's layers, by
    name; ``""`` for MLA (one latent, nothing to split). :class:`ConfigError` for a backend whose
    split is not known, none at all, or backends that split differently."""
    if mla:
        return ""
    splits = {KV_SPLITS.get(name) for name in backends}
    if not backends or None in splits or len(splits) != 1:
        raise ConfigError(
            f"{where}: attention backends {sorted(backends) or 'unknown'}: kvstrata knows where K "
            f"and V lie in a block for {sorted(KV_SPLITS)} (one split for every layer)"
        )
    return str(splits.pop())


def page_geometry(spec: object, mla: bool, where: str) -> tuple[int, int]:
    """``(heads, head_size)`` of the ``[B, H, N, C]`` views of vLLM's attention ``spec`` (a
    ``FullAttentionSpec`` or ``MLAAttentionSpec``), checked against what a kvstrata page can hold:
    MHA content is a K and a V of one size, MLA content one latent, one state per token.
    :class:`ConfigError` for anything else (packed or compressed states, K and V of other sizes,
    a vLLM without these views)."""
    try:
        content = getattr(spec, "state_content_size_bytes", None)
        heads = getattr(spec, "num_heads", None)
    except NotImplementedError:  # a KVCacheSpec that is no attention spec (a group of specs)
        content = heads = None
    if not isinstance(content, int) or not isinstance(heads, int):
        raise ConfigError(f"{where}: needs vLLM's [B, H, N, C] KV cache views (vLLM >= 0.32)")
    if getattr(spec, "num_head_slots", None) is not None or getattr(
        spec, "state_content_bytes", None
    ) not in (None, content if mla else None):
        raise ConfigError(  # H is not the KV heads (K/V head slots), or C is packed
            f"{where}: a backend that repacks the KV block (head slots, packed states) is not "
            "supported"
        )
    head_size = int(spec.head_size)  # type: ignore[attr-defined]
    item = torch.empty((), dtype=spec.dtype).element_size()  # type: ignore[attr-defined]
    planes = 1 if mla else 2
    same_v = mla or int(getattr(spec, "head_size_v", head_size)) == head_size
    if (
        not same_v
        or content != planes * head_size * item
        or getattr(spec, "tokens_per_state", 1) != 1
    ):
        raise ConfigError(
            f"{where}: a KV cell of {content} bytes is not {'a latent' if mla else 'a K and a V'} "
            f"of {head_size} x {item} bytes (packed, compressed or unequal K/V states are not "
            "supported)"
        )
    return heads, head_size


def page_shape(spec: object, layers: int, mla: bool, where: str) -> tuple[KVShape, int, int]:
    """The kvstrata page shape of ``layers`` layers of vLLM's attention ``spec`` (one head of all
    KV heads' width), with :func:`page_geometry`'s ``(heads, head_size)``."""
    heads, head_size = page_geometry(spec, mla, where)
    shape = KVShape(
        KVKind.MLA if mla else KVKind.MHA,
        layers=layers,
        heads=1,
        head_dim=head_size * heads,
        dtype=spec.dtype,  # type: ignore[attr-defined]
        page_size=int(spec.block_size),  # type: ignore[attr-defined]
    )
    return shape, heads, head_size


class BlockViews:
    """vLLM's per-layer KV views, copied straight to and from a host pool's pages.

    Invariants: every view is vLLM's logical ``[B, H, N, C]`` of ``heads`` heads and
    ``shape.dtype``, a block of ``shape.page_size`` tokens (``ratio`` kernel blocks of ``N``
    tokens each), ``C`` of ``planes x head_size`` values; plane ``p`` of layer ``l`` of a page
    holds the block's K (``p = 0``) or V as ``[H, N, D]``, cut by the backend's ``split``
    (:data:`KV_SPLITS`), whatever the strides; :meth:`save` then :meth:`load` of the same pairs
    is the identity on the blocks; layers are in model order (by the numbers in their names).
    On the CPU copies go view to view: one strided copy per run of consecutive blocks and slots,
    a gather and a scatter per layer when runs are shorter than :attr:`gather_below`. On a device
    they go through :attr:`staging` (:attr:`stage_pages` at a time), in the host pool's native
    page order, so each run of slots is one contiguous copy per plane."""

    def __init__(
        self,
        caches: dict[str, torch.Tensor],
        num_blocks: int,
        shape: KVShape,
        heads: int,
        head_size: int,
        *,
        split: str,
        gather_below: int | None = None,
        stage_bytes: int | None = None,
    ) -> None:
        self.shape = shape
        self.num_blocks = num_blocks
        self.split = split
        devices = {tensor.device.type for tensor in caches.values()}
        self.gather_below = (
            (0 if devices <= {"cpu"} else 4) if gather_below is None else gather_below
        )
        """Pairs per run (on average) under which a copy gathers all pairs in one indexed copy per
        layer instead of one strided copy per run. Default: never on the CPU, where a strided copy
        per run measured faster even for single pages (docs/benchmarks.md, "vLLM connector
        copies"); 4 on a device, where it only applies with :attr:`stage_pages` 0 (the staged
        default gathers every chunk)."""
        budget = (0 if devices <= {"cpu"} else STAGE_BYTES) if stage_bytes is None else stage_bytes
        self.stage_pages = max(1, budget // shape.bytes_per_page) if budget > 0 else 0
        """Pages per transfer through :attr:`staging` (0: view to view, the CPU's default). On a
        device: as many as :data:`STAGE_BYTES` holds, at least one."""
        self.staging = torch.empty(
            self.stage_pages * shape.bytes_per_page // shape.dtype.itemsize,
            dtype=shape.dtype,
            device=next(iter(caches.values())).device if caches else torch.device("cpu"),
        )
        """Where a staged copy gathers its pages on the views' device, in the host pool's native
        page order; allocated once, at start (a device without room for it fails there)."""
        self.views: list[list[tuple[slice, torch.Tensor]]] = []  # per layer: (planes, view)
        for name in sorted(caches, key=_layer_order):
            _check_view(name, caches[name], num_blocks, shape, heads=heads, head_size=head_size)
            self.views.append(
                _planes(
                    name,
                    caches[name],
                    num_blocks=num_blocks,
                    planes=shape.planes,
                    head_size=head_size,
                    split=split,
                )
            )
        if len(self.views) != shape.layers:
            raise ConfigError(f"kvstrata: {len(self.views)} KV layers, expected {shape.layers}")

    def save(self, blocks: Sequence[int], host: HostKVPool, slots: Sequence[int]) -> None:
        """Copy ``blocks`` into the host pool's pages ``slots`` (each distinct and in range,
        paired in order; :class:`MisuseError` and no copy otherwise). Done when it returns."""
        windows = _windows(blocks, slots, self.num_blocks, host.num_pages, self.gather_below)
        if self.stage_pages:
            for gathers, runs, staged in self._chunks(blocks, slots, host):
                for rows, view in self._pairs(host, host.to_canonical(staged)):
                    for block, place in gathers:
                        rows[:, place] = view[:, block]
                native = host.native()  # each (outer, run of slots) is contiguous on both sides
                for at, first, count in runs:
                    for outer in range(native.shape[0]):
                        native[outer, first : first + count].copy_(
                            staged[outer, at : at + count], non_blocking=True
                        )
            self._settle()
            return
        for rows, view in self._pairs(host):
            for block, slot in windows:
                rows[:, slot] = view[:, _on(block, view)].to(rows.device)

    def load(self, host: HostKVPool, slots: Sequence[int], blocks: Sequence[int]) -> None:
        """Copy the host pool's pages ``slots`` into ``blocks`` (as :meth:`save`, the other way)."""
        windows = _windows(blocks, slots, self.num_blocks, host.num_pages, self.gather_below)
        if self.stage_pages:
            for gathers, runs, staged in self._chunks(blocks, slots, host):
                native = host.native()
                for at, first, count in runs:
                    for outer in range(native.shape[0]):
                        staged[outer, at : at + count].copy_(
                            native[outer, first : first + count], non_blocking=True
                        )
                for rows, view in self._pairs(host, host.to_canonical(staged)):
                    for block, place in gathers:
                        view[:, block] = rows[:, place]
            self._settle()
            return
        for rows, view in self._pairs(host):
            for block, slot in windows:
                view[:, _on(block, view)] = rows[:, slot].to(view.device)

    def _chunks(
        self, blocks: Sequence[int], slots: Sequence[int], host: HostKVPool
    ) -> Iterator[tuple[list[tuple[Window, Window]], list[tuple[int, int, int]], torch.Tensor]]:
        """The pairs in chunks of at most :attr:`stage_pages`. Per chunk: ``(blocks, positions)``
        windows between the views and :attr:`staging` (:func:`_windows`: a slice pair per run of
        consecutive blocks, or index tensors on the views' device when runs are shorter than
        :attr:`gather_below`), the runs of consecutive slots as ``(position, first slot,
        count)``, and :attr:`staging` as ``[outer, n, inner]`` pages in the host pool's native
        order (page ``position`` there is the chunk's pair ``position``)."""
        device = self.staging.device
        for start in range(0, len(blocks), self.stage_pages):
            chunk = [int(slot) for slot in slots[start : start + self.stage_pages]]
            gathers = [
                (_to(block, device), _to(place, device))
                for block, place in _windows(
                    blocks[start : start + self.stage_pages],
                    range(len(chunk)),
                    self.num_blocks,
                    len(chunk),
                    self.gather_below,
                )
            ]
            places, firsts, counts = joint_runs(np.arange(len(chunk)), np.asarray(chunk, np.int64))
            runs = list(zip(places.tolist(), firsts.tolist(), counts.tolist(), strict=True))
            size = len(chunk) * self.shape.bytes_per_page // self.shape.dtype.itemsize
            staged = self.staging[:size].view(host.block_shape(len(chunk)))
            yield gathers, runs, staged

    def _settle(self) -> None:
        """Wait for the transfers queued on the views' device (a staged copy is done, and its
        host pages hold their bytes, when :meth:`save` or :meth:`load` returns)."""
        if self.staging.device.type != "cpu":
            torch.accelerator.current_stream(self.staging.device).synchronize()

    def _pairs(
        self, host: HostKVPool, pages: torch.Tensor | None = None
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer and view of its blocks: the host pool's pages of the same planes,
        ``[p, P, H, r, Nk, D]`` (a view of the pool, or of ``pages``, the canonical view of a
        staged copy of its pages: a write lands in it), and the view. :class:`MisuseError` unless
        the pool holds this shape with a page's rows contiguous (``page_first_direct``,
        ``layer_first``, ``page_major``)."""
        if host.shape != self.shape:
            raise MisuseError(f"kvstrata: a host pool of {host.shape}, expected {self.shape}")
        pages = host.canonical() if pages is None else pages  # [planes, L, P, page, 1, X]
        try:  # view, never flatten or reshape: those copy where no view exists, and a copy
            # written into leaves the pool as it was
            return [
                (pages[planes, layer].view(view.shape[0], -1, *view.shape[2:]), view)
                for layer, views in enumerate(self.views)
                for planes, view in views
            ]
        except RuntimeError as error:  # a layout whose page rows are not contiguous
            raise MisuseError(
                f"kvstrata: a {host.layout.value} host pool does not keep a layer's page rows "
                "contiguous (use page_first_direct)"
            ) from error


Window = slice | torch.Tensor


def _on(index: Window, tensor: torch.Tensor) -> Window:
    return index if isinstance(index, slice) else index.to(tensor.device)


def _to(index: Window, device: torch.device) -> Window:
    """``index`` on ``device``: from CUDA, through pinned memory without waiting (a blocking
    upload would wait for everything queued on the stream)."""
    if isinstance(index, slice) or device.type == "cpu":
        return index
    if device.type == "cuda":
        return index.pin_memory().to(device, non_blocking=True)
    return index.to(device)


def _windows(
    blocks: Sequence[int],
    slots: Sequence[int],
    num_blocks: int,
    num_pages: int,
    gather_below: int,
) -> list[tuple[Window, Window]]:
    """``(blocks, slots)`` index pairs covering the pairs in order: a slice pair per run where both
    ascend by one (one strided copy each, no gather), or, when runs are shorter than
    ``gather_below`` pairs on average, one pair of index tensors for all."""
    blocks, slots = [int(b) for b in blocks], [int(s) for s in slots]
    for name, values, bound in (("blocks", blocks, num_blocks), ("slots", slots, num_pages)):
        if len(set(values)) != len(values) or any(not 0 <= v < bound for v in values):
            raise MisuseError(f"kvstrata: {name} must be distinct and in [0, {bound}): {values}")
    if len(blocks) != len(slots):
        raise MisuseError(f"kvstrata: {len(blocks)} blocks for {len(slots)} slots")
    if not blocks:
        return []
    firsts, starts, counts = joint_runs(np.asarray(blocks, np.int64), np.asarray(slots, np.int64))
    if len(counts) * gather_below > len(blocks):
        as_index = [torch.tensor(values, dtype=torch.int64) for values in (blocks, slots)]
        return [(as_index[0], as_index[1])]
    return [
        (slice(b, b + n), slice(s, s + n))
        for b, s, n in zip(firsts.tolist(), starts.tolist(), counts.tolist(), strict=True)
    ]


def _planes(
    name: str, tensor: torch.Tensor, *, num_blocks: int, planes: int, head_size: int, split: str
) -> list[tuple[slice, torch.Tensor]]:
    """A layer's ``[B * r, H, Nk, C]`` view as ``(planes, [p, B, H, r, Nk, D])`` pairs: which
    planes of a page (K, V) each view holds, found where the backend's ``split``
    (:data:`KV_SPLITS`) keeps them; both planes in one view where their strides allow (one copy
    for both). Views only (``view``, ``permute``, ``transpose``), never a copy, so a page written
    lands in vLLM's own tensor; :class:`ConfigError` where the strides allow no such view."""
    kernel_blocks, heads, tokens, _ = tensor.shape
    ratio = kernel_blocks // num_blocks  # kernel blocks per block, in token order
    try:
        if planes == 1 or split == "cell":  # [B, r, H, Nk, p, D]
            cells = tensor.view(num_blocks, ratio, heads, tokens, planes, head_size)
            return [(slice(0, planes), cells.permute(4, 0, 2, 1, 3, 5))]
        if split == "cpu_vec":  # a kernel block's head: K as [D, Nk], then V as [Nk, D]
            halves = tensor.view(num_blocks, ratio, heads, planes, tokens * head_size)
            k = halves[:, :, :, 0].view(num_blocks, ratio, heads, head_size, tokens)
            v = halves[:, :, :, 1].view(num_blocks, ratio, heads, tokens, head_size)
            return [
                (slice(0, 1), k.permute(0, 2, 1, 4, 3).unsqueeze(0)),
                (slice(1, 2), v.permute(0, 2, 1, 3, 4).unsqueeze(0)),
            ]
    except RuntimeError as error:
        raise ConfigError(
            f"kvstrata: layer {name}'s strides do not allow a {split} split"
        ) from error
    raise ConfigError(f"kvstrata: unknown K/V split {split!r}")


def _check_view(
    name: str, tensor: torch.Tensor, num_blocks: int, shape: KVShape, *, heads: int, head_size: int
) -> None:
    """:class:`ConfigError` unless ``tensor`` is vLLM's ``[B, H, N, C]`` view of ``num_blocks``
    blocks of ``shape.page_size`` tokens, ``heads`` heads and a page's planes per token and head."""
    dims = list(tensor.shape)
    content = head_size * shape.planes
    if (
        tensor.dtype != shape.dtype
        or len(dims) != 4
        or dims[0] % num_blocks
        or dims[1] != heads
        or dims[3] != content
        or dims[2] * (dims[0] // num_blocks) != shape.page_size
    ):
        raise ConfigError(
            f"kvstrata: layer {name} {dims} {tensor.dtype} is not vLLM's [B, H, N, C] "
            f"view of {num_blocks} blocks of {shape.page_size} tokens, {heads} heads "
            f"and {content} values per token and head (vLLM >= 0.32)"
        )


def _layer_order(name: str) -> tuple[int, ...]:
    return tuple(int(number) for number in re.findall(r"\d+", name)) or (0,)
