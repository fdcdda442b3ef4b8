"""The shape of one model's KV cache and the host-pool layouts (SPEC §2).

A :class:`KVShape` fixes everything that decides how many bytes a token and a page take: the KV kind
(MHA: a K plane and a V plane; MLA: one latent plane), layers, heads, head dim, dtype and page size.

Every pool speaks one **canonical** page tensor shape, ``[planes, layers, n, page_size, heads,
head_dim]`` (:meth:`KVShape.canonical`): ``read_pages`` returns it and ``write_pages`` takes it, whatever
the pool stores internally, so every layout round-trips to identical bytes.

Host layouts (the physical order of a host pool's buffer; ``N = pages * page_size`` tokens, ``P`` pages):

======================  ==================================  =============================================
layout                  buffer                              what is contiguous
======================  ==================================  =============================================
``layer_first``         ``[planes, L, N, H, D]``            one layer's run of pages (same as the device
                                                            pool)
``page_first``          ``[planes, N, L, H, D]``            one page of one plane, all layers (one store
                                                            object per K page and per V page)
``page_first_direct``   ``[planes, P, L, page, H, D]``      one page of one plane, all layers, each layer's
                                                            tokens together
``page_major``          ``[P, planes, L, page, H, D]``      one whole page, every plane: the one store
                                                            object of key schema 2 (issue 20)
======================  ==================================  =============================================
"""

from __future__ import annotations

import enum
import math

import attrs
import torch

from kvstrata.impl.errors import ConfigError
from kvstrata.model.keys import KVKind

__all__ = ["POOL_KINDS", "HostLayout", "KVShape"]

POOL_KINDS: frozenset[KVKind] = frozenset({KVKind.MHA, KVKind.MLA})
"""The KV kinds a page pool holds (embeddings live in their own cache, SPEC §6)."""


def _positive_int(instance: object, attribute: attrs.Attribute[int], value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(
            f"{type(instance).__name__}.{attribute.name}: expected a positive int, got {value!r}"
        )


def _pool_kind(instance: object, attribute: attrs.Attribute[KVKind], value: KVKind) -> None:
    if value not in POOL_KINDS:
        raise ConfigError(
            f"{type(instance).__name__}.{attribute.name}: expected KVKind.MHA or KVKind.MLA, "
            f"got {value!r}"
        )


def _kv_dtype(
    instance: object, attribute: attrs.Attribute[torch.dtype], value: torch.dtype
) -> None:
    if not isinstance(value, torch.dtype) or value.is_complex or value == torch.bool:
        raise ConfigError(
            f"{type(instance).__name__}.{attribute.name}: expected a real torch.dtype "
            f"(e.g. torch.bfloat16), got {value!r}"
        )


@attrs.frozen
class KVShape:
    """What one token and one page of a model's KV cache hold.

    Invariants (checked on construction, :class:`ConfigError` naming the field otherwise): ``kind`` is
    MHA or MLA; ``layers``, ``heads``, ``head_dim`` and ``page_size`` are positive ints; MLA has exactly
    one head (its latent is ``head_dim`` wide); ``dtype`` is a real torch dtype.
    """

    kind: KVKind = attrs.field(validator=_pool_kind)
    layers: int = attrs.field(validator=_positive_int)
    heads: int = attrs.field(validator=_positive_int)
    head_dim: int = attrs.field(validator=_positive_int)
    dtype: torch.dtype = attrs.field(validator=_kv_dtype)
    page_size: int = attrs.field(validator=_positive_int)

    def __attrs_post_init__(self) -> None:
        if self.kind is KVKind.MLA and self.heads != 1:
            raise ConfigError(
                f"KVShape.heads: MLA has one latent plane with heads == 1, got heads={self.heads}"
            )

    @property
    def planes(self) -> int:
        """2 for MHA (K, V), 1 for MLA (the latent)."""
        return 2 if self.kind is KVKind.MHA else 1

    @property
    def itemsize(self) -> int:
        """Bytes of one element of ``dtype``."""
        return self.dtype.itemsize

    @property
    def bytes_per_token(self) -> int:
        """``planes * layers * heads * head_dim * itemsize``."""
        return self.planes * self.layers * self.heads * self.head_dim * self.itemsize

    @property
    def bytes_per_page(self) -> int:
        """``bytes_per_token * page_size``: what one page of a pool occupies and what a copy moves."""
        return self.bytes_per_token * self.page_size

    def canonical(self, pages: int) -> tuple[int, int, int, int, int, int]:
        """The canonical shape of ``pages`` pages: ``(planes, layers, pages, page_size, heads,
        head_dim)``."""
        return (self.planes, self.layers, pages, self.page_size, self.heads, self.head_dim)

    def nbytes(self, pages: int) -> int:
        """Bytes of ``pages`` pages."""
        return math.prod(self.canonical(pages)) * self.itemsize


class HostLayout(enum.Enum):
    """The physical order of a host pool's buffer (see the module docstring)."""

    LAYER_FIRST = "layer_first"
    PAGE_FIRST = "page_first"
    PAGE_FIRST_DIRECT = "page_first_direct"
    PAGE_MAJOR = "page_major"

    @classmethod
    def parse(cls, value: str | HostLayout) -> HostLayout:
        """The layout named ``value`` (case-insensitive, ``-`` or ``_``); :class:`ConfigError` if no
        layout has that name."""
        if isinstance(value, HostLayout):
            return value
        if isinstance(value, str):
            name = value.strip().lower().replace("-", "_")
            for layout in cls:
                if layout.value == name:
                    return layout
        known = ", ".join(layout.value for layout in cls)
        raise ConfigError(f"host layout: expected one of {known}, got {value!r}")
