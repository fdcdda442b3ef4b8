"""An engine's paged KV for connector tests: one canonical page per block, so a block is copied to
and from the host pool as its page (``ConnectorWorker``'s ``BlockIO``)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvstrata.impl.pools import HostKVPool


class CanonicalBlocks:
    """``kv``: ``[planes, L, blocks, page, H, D]``, block ``b`` at ``kv[:, :, b]``."""

    def __init__(self, kv: torch.Tensor) -> None:
        self.kv = kv

    def read(self, blocks: Sequence[int]) -> torch.Tensor:
        return self.kv[:, :, list(blocks)].contiguous()

    def write(self, blocks: Sequence[int], kv: torch.Tensor) -> None:
        self.kv[:, :, list(blocks)] = kv

    def save(self, blocks: Sequence[int], host: HostKVPool, slots: Sequence[int]) -> None:
        host.write_pages(slots, self.read(blocks))

    def load(self, host: HostKVPool, slots: Sequence[int], blocks: Sequence[int]) -> None:
        self.write(blocks, host.read_pages(slots))
