"""vLLM's KV blocks as kvstrata pages: :class:`BlockViews` (no vLLM import; torch only).

vLLM (0.32 on, its RFC #42082) hands a connector one view per layer, ``[B, H, N, C]``: blocks,
KV heads, tokens of a block, and one token's content for one head (MHA: its K then its V; MLA:
the latent). Every attention backend gets the same logical view; the backend's physical order
(``KVCacheLayout``: which of L, B, H, N is outermost in memory) is in the view's strides only, and
with kernel blocks smaller than vLLM's block, ``B`` counts kernel blocks and ``N`` their tokens.

A page is read in **logical** order, so the bytes a page holds do not depend on the backend, its
physical layout or its kernel block size: MHA pages are two planes (K, V), each ``[H, N, D]`` of
the block (:data:`PAGE_LAYOUT`, part of the keys), and MLA pages the block's ``[1, N, C]``.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import torch

from kvstrata.impl.errors import ConfigError
from kvstrata.impl.pools.shape import KVShape
from kvstrata.model.keys import KVKind

__all__ = ["PAGE_LAYOUT", "BlockViews", "page_geometry", "page_shape"]

PAGE_LAYOUT = "hnd"
"""The order of an MHA page's bytes (``EngineShard.kv_layout``): K, then V, each heads x tokens x
head dim of vLLM's logical block. MLA pages (the block's bytes as they are) name none, so their
keys are those they always had."""


def page_geometry(spec: object, mla: bool, where: str) -> tuple[int, int]:
    """``(heads, head_size)`` of the ``[B, H, N, C]`` views of vLLM's attention ``spec`` (a
    ``FullAttentionSpec`` or ``MLAAttentionSpec``), checked against what a kvstrata page can hold:
    MHA content is a K and a V of one size, MLA content one latent, one state per token.
    :class:`ConfigError` for anything else (packed or compressed states, K and V of other sizes,
    a vLLM without these views)."""
    content = getattr(spec, "state_content_size_bytes", None)
    heads = getattr(spec, "num_heads", None)
    if not isinstance(content, int) or not isinstance(heads, int):
        raise ConfigError(f"{where}: needs vLLM's [B, H, N, C] KV cache views (vLLM >= 0.32)")
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
    """vLLM's per-layer KV views seen as pages ``[planes, layers, pages, page_size, 1, X]``.

    Invariants: every view is vLLM's logical ``[B, H, N, C]`` of ``heads`` heads, a block of
    ``shape.page_size`` tokens (``ratio`` kernel blocks of ``N`` tokens each), ``C`` of
    ``planes x head_size`` values; :meth:`read` then :meth:`write` of the same blocks is the identity on
    every layer's logical view, whatever the strides; layers are in model order (by the numbers
    in their names)."""

    def __init__(
        self,
        caches: dict[str, torch.Tensor],
        num_blocks: int,
        shape: KVShape,
        heads: int,
        head_size: int,
    ) -> None:
        self.shape = shape
        self.views: list[torch.Tensor] = []
        content = head_size * shape.planes
        for name in sorted(caches, key=_layer_order):
            tensor = caches[name]
            dims = list(tensor.shape)
            if (
                len(dims) != 4
                or dims[0] % num_blocks
                or dims[1] != heads
                or dims[3] != content
                or dims[2] * (dims[0] // num_blocks) != shape.page_size
            ):
                raise ConfigError(
                    f"kvstrata: layer {name} {dims} is not vLLM's [B, H, N, C] view of {num_blocks} "
                    f"blocks of {shape.page_size} tokens, {heads} heads and {content} values per "
                    "token and head (vLLM >= 0.32)"
                )
            ratio = dims[0] // num_blocks  # kernel blocks per block, in token order
            blocks = tensor.view(num_blocks, ratio, *dims[1:]).movedim(1, 2)  # [B, H, r, Nk, C]
            # views, never copies: a page written must land in vLLM's own tensor
            view = blocks.view(*blocks.shape[:-1], shape.planes, head_size).movedim(-2, 1)
            self.views.append(view)  # [B, planes, H, r, Nk, D]
        if len(self.views) != shape.layers:
            raise ConfigError(f"kvstrata: {len(self.views)} KV layers, expected {shape.layers}")

    def read(self, blocks: Sequence[int]) -> torch.Tensor:
        """The pages of ``blocks``, contiguous on the CPU."""
        index = torch.tensor(list(blocks), dtype=torch.int64)
        s = self.shape
        layers = [
            view.index_select(0, index.to(view.device)).reshape(
                len(index), s.planes, s.page_size, 1, s.head_dim
            )
            for view in self.views
        ]
        return torch.stack(layers).permute(2, 0, 1, 3, 4, 5).cpu().contiguous()

    def write(self, blocks: Sequence[int], kv: torch.Tensor) -> None:
        """Write pages (as :meth:`read` returns them) into ``blocks``."""
        index = torch.tensor(list(blocks), dtype=torch.int64)
        for layer, view in enumerate(self.views):
            data = kv[:, layer].permute(1, 0, 2, 3, 4).reshape(len(index), *view.shape[1:])
            view[index.to(view.device)] = data.to(view.device, view.dtype)


def _layer_order(name: str) -> tuple[int, ...]:
    return tuple(int(number) for number in re.findall(r"\d+", name)) or (0,)
