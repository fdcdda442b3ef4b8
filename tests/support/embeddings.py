"""Embeddings for the embedding cache's tests: deterministic per media hash, compared bit for bit."""

from __future__ import annotations

import torch

from kvstrata.model.keys import PageHash


def seeded_embedding(media: PageHash, tokens: int, dim: int, dtype: torch.dtype) -> torch.Tensor:
    """A ``[tokens, dim]`` tensor of ``dtype`` that only ``media`` names (seeded by its digest)."""
    gen = torch.Generator().manual_seed(int.from_bytes(media.digest[:8], "little"))
    return torch.randn((tokens, dim), generator=gen).to(dtype)


def same_bits(got: torch.Tensor | None, want: torch.Tensor) -> bool:
    """``got`` is a tensor with exactly ``want``'s bits (a 16-bit dtype)."""
    return got is not None and torch.equal(got.view(torch.int16), want.view(torch.int16))
