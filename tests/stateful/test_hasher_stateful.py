"""The page-hashing thread (kvstrata.impl.hashing.BackgroundHasher) against the reference model's
chain (SPEC §4), driven by Hypothesis.

A tiny arena (a few pages) makes every submit wrap around or wait for room, and the C thread starts
paused in half the runs, so jobs stay in flight while others are queued behind them. Rules: submit a
chain from the namespace seed or from the tail of an earlier chain, pending or not (the child reads
its parent's digest from the arena when it runs), with the caller's tokens copied (and overwritten
right after the submit) or frozen and read in place; split a pending view; let the thread run a few
jobs, pause it, resume it; resolve any view. Oracles that do not trust the hasher:

* bytes: every view resolves to :func:`kvstrata.model.keys.chain_page_hashes` of its tokens from its
  parent's last model digest, sliced like the view;
* arena: after every step, the regions of queued token copies are in submission order, pairwise
  disjoint and inside the arena (``BackgroundHasher.check``).

The stale-offset lesson in small: a region recycled while its job is still queued, or tokens read in
place that the caller then overwrites, poison a chain, which the bytes oracle sees on its next
resolve (mutants ``impl_hasher_region_reused``, ``impl_hasher_uncopied_tokens``).
"""

from __future__ import annotations

import attrs
import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import note
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    initialize,
    invariant,
    multiple,
    precondition,
    rule,
)

from kvstrata.impl import kernels
from kvstrata.impl.hashing import (
    BackgroundHasher,
    Digests,
    digests_tail,
    resolve,
    split_digests,
)
from kvstrata.model.keys import PageHash, chain_page_hashes

pytestmark = pytest.mark.skipif(not kernels.NATIVE, reason="the C kernels are not built")

PAGE = 2  # tokens per page
PAGE_BYTES = 4 * PAGE


@attrs.frozen
class Chain:
    """A view the hasher returned and the model digests it must resolve to."""

    digests: Digests
    expected: bytes

    @property
    def pages(self) -> int:
        return len(self.expected) // kernels.DIGEST_BYTES


class HasherMachine(RuleBasedStateMachine):
    chains = Bundle("chains")

    def __init__(self) -> None:
        super().__init__()
        self.hasher: BackgroundHasher | None = None
        self.all: list[Chain] = []

    @initialize(arena_pages=st.integers(1, 10), paused=st.booleans())
    def start(self, arena_pages: int, paused: bool) -> None:
        """An arena of a few pages of token copies: chains of up to 5 pages wrap around it, wait
        for room, or (longer than the arena) are hashed inline."""
        self.hasher = BackgroundHasher(PAGE_BYTES, arena_bytes=arena_pages * PAGE_BYTES)
        if paused:
            self.hasher.pause()

    def _hasher(self) -> BackgroundHasher:
        assert self.hasher is not None
        return self.hasher

    def _keep(self, chain: Chain) -> Chain:
        self.all.append(chain)
        return chain

    @rule(
        target=chains,
        tokens=st.lists(st.integers(0, 2**32 - 1), min_size=PAGE, max_size=5 * PAGE),
        parent=st.none() | chains,
        frozen=st.booleans(),
    )
    def submit(self, tokens: list[int], parent: Chain | None, frozen: bool) -> Chain:
        pages = len(tokens) // PAGE
        tokens = tokens[: pages * PAGE]
        array = np.asarray(tokens, dtype="<u4")
        if frozen:
            array.flags.writeable = False
        if parent is None:
            seed: Digests = b""
            model = chain_page_hashes(tokens, PAGE)
        else:
            seed = digests_tail(parent.digests)
            model = chain_page_hashes(tokens, PAGE, parent=PageHash(parent.expected[-32:]))
        got = self._hasher().submit(seed, array, pages, frozen=frozen)
        if not frozen:
            array[:] = 0  # the caller reuses its buffer: the job must have its own copy
        note(f"submit {pages} pages, parent={parent is not None}, frozen={frozen}")
        return self._keep(Chain(got, b"".join(h.digest for h in model)))

    @precondition(lambda self: any(chain.pages > 1 for chain in self.all))
    @rule(target=chains, data=st.data())
    def split(self, data: st.DataObject) -> object:
        chain = data.draw(st.sampled_from([c for c in self.all if c.pages > 1]))
        cut = data.draw(st.integers(1, chain.pages - 1))
        first, rest = split_digests(chain.digests, cut)
        at = cut * kernels.DIGEST_BYTES
        return multiple(
            self._keep(Chain(first, chain.expected[:at])),
            self._keep(Chain(rest, chain.expected[at:])),
        )

    @rule(jobs=st.integers(1, 2))
    def step(self, jobs: int) -> None:
        """Let the next jobs run (waiting for them); the thread stays paused after them."""
        self._hasher().pause()
        self._hasher().step(jobs)

    @rule(paused=st.booleans())
    def pause_or_resume(self, paused: bool) -> None:
        if paused:
            self._hasher().pause()
        else:
            self._hasher().resume()

    @rule(chain=chains)
    def read(self, chain: Chain) -> None:
        assert resolve(chain.digests) == chain.expected

    @invariant()
    def arena_bookkeeping(self) -> None:
        if self.hasher is not None:
            self.hasher.check()

    def teardown(self) -> None:
        if self.hasher is None:
            return
        self.hasher.resume()
        try:
            for chain in self.all:
                assert resolve(chain.digests) == chain.expected
            self.hasher.drain()
            self.hasher.check()
            assert self.hasher.pending == 0
        finally:
            self.hasher.close()


TestHasher = HasherMachine.TestCase
