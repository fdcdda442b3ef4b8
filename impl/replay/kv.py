"""Synthetic KV for the replay: the bytes of a page are a pure function of its page hash (and a seed),
so any page served from any tier can be checked bit for bit (SPEC §7, §11).

:class:`KVSynth` is the replay's stand-in for the model's forward pass and its own oracle:

- :meth:`KVSynth.page_hashes` computes the SHA-256 page-hash chain of a request's tokens (SPEC §4:
  ``sha256(previous digest + the page's tokens as 4-byte little-endian)``, default namespace)
  independently of the cache;
- :meth:`KVSynth.kv` gives the KV of pages from their hashes: ``shake_256(seed + hash)`` stretched to
  one page, laid out page-major as ``[planes, layers, page_size, heads, head_dim]`` (the same derivation
  as the differential tests' ``kv_for``, plus the seed);
- :meth:`KVSynth.first_mismatch` reads pages of a pool and compares every byte with what :meth:`kv`
  gives for their hashes.

Cost: one ``hashlib`` call per page for each of hashing, generating and checking (about 1-3 µs each for
the default 1 KiB pages), outside the timed scheduler path.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt
import torch

from kvstrata.impl.pools import KVPool, KVShape

__all__ = ["KVSynth"]


class KVSynth:
    """Deterministic KV of ``shape`` pages. Invariant: ``kv(hashes)`` depends only on the hashes, the
    shape and ``seed``; equal inputs give equal bytes in every process."""

    def __init__(self, shape: KVShape, seed: int = 0) -> None:
        self.shape = shape
        self.page_nbytes = shape.bytes_per_page
        self._salt = int(seed).to_bytes(8, "little", signed=True)
        self._page_dims = (shape.planes, shape.layers, shape.page_size, shape.heads, shape.head_dim)

    def page_hashes(self, tokens: npt.NDArray[np.uint32]) -> list[bytes]:
        """The 32-byte chain digest of every full page of ``tokens`` (default namespace)."""
        data = np.ascontiguousarray(tokens, dtype="<u4").tobytes()
        step = 4 * self.shape.page_size
        out: list[bytes] = []
        previous = b""
        sha256 = hashlib.sha256
        for start in range(0, len(data) - step + 1, step):
            previous = sha256(previous + data[start : start + step]).digest()
            out.append(previous)
        return out

    def page_bytes(self, hashes: Sequence[bytes]) -> bytes:
        """The raw bytes of the pages named by ``hashes``, page after page."""
        shake = hashlib.shake_256
        salt, size = self._salt, self.page_nbytes
        return b"".join(shake(salt + digest).digest(size) for digest in hashes)

    def kv(self, hashes: Sequence[bytes]) -> torch.Tensor:
        """The KV of the pages named by ``hashes`` in the pools' canonical shape
        ``[planes, layers, n, page_size, heads, head_dim]`` (a view of fresh memory)."""
        raw = torch.frombuffer(bytearray(self.page_bytes(hashes)), dtype=torch.uint8)
        pages = raw.view(self.shape.dtype).view(len(hashes), *self._page_dims)
        return pages.permute(1, 2, 0, 3, 4, 5)

    def write(self, pool: KVPool, indices: npt.NDArray[np.int64], hashes: Sequence[bytes]) -> None:
        """Write the KV of ``hashes`` into pages ``indices`` of ``pool``."""
        if len(indices):
            pool.write_pages(indices, self.kv(hashes))

    def first_mismatch(
        self, pool: KVPool, indices: npt.NDArray[np.int64], hashes: Sequence[bytes]
    ) -> int | None:
        """The position (in ``indices``) of the first page whose bytes in ``pool`` differ from the KV
        of its hash, or ``None`` when every byte matches."""
        if not len(indices):
            return None
        got = pool.read_pages(indices).permute(2, 0, 1, 3, 4, 5).contiguous()
        got_bytes = got.view(torch.uint8).reshape(len(indices), self.page_nbytes)
        want = torch.frombuffer(bytearray(self.page_bytes(hashes)), dtype=torch.uint8)
        want = want.view(len(indices), self.page_nbytes)
        if torch.equal(got_bytes, want):
            return None
        same = (got_bytes == want).all(dim=1)
        return int(torch.argmin(same.to(torch.uint8)).item())
