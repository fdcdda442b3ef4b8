"""Page-hash chains computed off the scheduler thread, resolved when someone reads them.

The radix tree keeps the SHA-256 page hashes of SPEC §4 for every cached page (L3 needs them for its
store keys), but nothing on the scheduler path reads them: only L3 backup and prefetch, and queries
such as ``page_hashes()``. So ``insert`` does not hash. It hands the new pages' tokens to a
:class:`PageHasher` and stores what comes back in the node:

- :class:`InlineHasher` hashes at once and returns the digests (``bytes``);
- :class:`BackgroundHasher` queues a job for a C thread (``kvstrata.impl._native.Hasher``) and
  returns a :class:`PendingDigests` view of it. The thread never touches a Python object, so the
  scheduler thread never waits for the GIL because of it (a Python worker thread did: every time it
  took the GIL back, the scheduler thread's next numpy call waited for it, which cost more than
  hashing inline).

A pending view is exact, not approximate: reading it (:meth:`PendingDigests.resolve`) waits for its
job, and the bytes are the ones :func:`kvstrata.impl.kernels.sha256_chain` gives. Invariants:

- jobs run in submission order. A job writes its digests into its own ``bytearray`` (``out``),
  never recycled. A chain queued while its parent's job is still pending reads its seed from the
  parent's ``out`` when it runs. The C job holds a reference to every object it reads or writes
  outside the arena (``out``, in-place tokens, the parent's ``out``) until it finished, so no job
  touches freed or reused memory, even when the node that asked for it is gone;
- a job's tokens are *frozen* (nobody writes them again: read in place) or copied into the arena,
  one buffer used as a ring in submission order; a region is reused only after its job finished (the
  stale-offset lesson, in the hasher's own memory);
- splitting a node splits its view (:meth:`PendingDigests.split`), never the job: both halves read
  the same ``out``, so a split before the hashes exist loses nothing (the lost-split lesson);
- a submit that finds no arena room waits for the oldest jobs; a chain larger than the arena, or any
  chain after ``close()``, is hashed inline.
"""

from __future__ import annotations

import itertools
from collections import deque
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from kvstrata.impl.errors import HashingError
from kvstrata.impl.kernels import DIGEST_BYTES, native_module, sha256_chain

_NATIVE = native_module()
_NativeHasher: Any = None if _NATIVE is None else _NATIVE.Hasher

__all__ = [
    "BackgroundHasher",
    "Digests",
    "InlineHasher",
    "PageHasher",
    "PendingDigests",
    "digests_tail",
    "resolve",
    "seed_bytes",
    "split_digests",
]

Tokens = npt.NDArray[np.uint32]


class PendingDigests:
    """Pages ``[start, stop)`` of the digests job ``seq`` of ``hasher`` writes to ``out``, before or
    after the job ran."""

    __slots__ = ("hasher", "out", "seq", "start", "stop")

    def __init__(
        self, hasher: BackgroundHasher, seq: int, out: bytearray, start: int, stop: int
    ) -> None:
        self.hasher = hasher
        self.seq = seq
        self.out = out
        self.start = start
        self.stop = stop

    @property
    def pages(self) -> int:
        return self.stop - self.start

    @property
    def finished(self) -> bool:
        return self.seq < self.hasher.finished

    def resolve(self) -> bytes:
        """The digests (32 bytes per page), waiting for the job if it has not run yet."""
        if self.seq >= self.hasher.finished:
            self.hasher.wait(self.seq)
        return bytes(memoryview(self.out)[self.start * DIGEST_BYTES : self.stop * DIGEST_BYTES])

    def split(self, pages: int) -> tuple[PendingDigests, PendingDigests]:
        """The first ``pages`` pages and the rest, as views of the same job."""
        cut = self.start + pages
        return (
            PendingDigests(self.hasher, self.seq, self.out, self.start, cut),
            PendingDigests(self.hasher, self.seq, self.out, cut, self.stop),
        )

    def tail(self) -> PendingDigests:
        """The last page's digest."""
        return PendingDigests(self.hasher, self.seq, self.out, self.stop - 1, self.stop)

    def __repr__(self) -> str:
        state = "hashed" if self.finished else "pending"
        return f"PendingDigests(job {self.seq}, pages {self.start}..{self.stop}, {state})"


Digests = bytes | PendingDigests
"""A node's page hashes: the bytes, or a view of a job that makes them."""


def resolve(digests: Digests) -> bytes:
    """The bytes of ``digests`` (waiting for a pending job)."""
    return digests if type(digests) is bytes else digests.resolve()  # type: ignore[union-attr]


def split_digests(digests: Digests, pages: int) -> tuple[Digests, Digests]:
    """``digests`` cut after ``pages`` pages; a pending view stays pending."""
    if type(digests) is bytes:
        cut = pages * DIGEST_BYTES
        return digests[:cut], digests[cut:]
    assert isinstance(digests, PendingDigests)
    return digests.split(pages)


def digests_tail(digests: Digests) -> Digests:
    """The last page's digest (``digests`` non-empty)."""
    if type(digests) is bytes:
        return digests[-DIGEST_BYTES:]
    assert isinstance(digests, PendingDigests)
    return digests.tail()


def seed_bytes(seed: Digests) -> bytes:
    """The seed ``seed`` stands for (see :class:`PageHasher`), waiting if it is pending."""
    return seed if type(seed) is bytes else resolve(seed)[-DIGEST_BYTES:]


class PageHasher(Protocol):
    """Hashes the chain of the ``pages`` whole pages of ``tokens`` (C-contiguous little-endian
    uint32, exactly those pages). ``seed``: bytes are the seed itself (empty for the default
    namespace, else 32 bytes); a :class:`PendingDigests` view seeds from its last page (the parent
    node's chain, still pending). Unless ``frozen`` (nobody will ever write to those tokens again: a
    read-only array over read-only memory, or an array the cache made itself), the caller may change
    ``tokens`` once ``submit`` returns: a hasher that hashes later keeps a copy."""

    def submit(
        self, seed: Digests, tokens: Tokens, pages: int, *, frozen: bool = False
    ) -> Digests: ...

    def close(self) -> None: ...


class InlineHasher:
    """Hashes on the caller's thread: ``submit`` returns the digests."""

    __slots__ = ("_page_bytes",)

    def __init__(self, page_bytes: int) -> None:
        self._page_bytes = page_bytes

    def submit(self, seed: Digests, tokens: Tokens, pages: int, *, frozen: bool = False) -> Digests:
        return sha256_chain(seed_bytes(seed), tokens, self._page_bytes)

    def close(self) -> None:
        return None


class BackgroundHasher:
    """Hashes on a C thread (``kvstrata.impl._native.Hasher``, which needs the C kernels);
    ``submit`` returns a :class:`PendingDigests`. See the module docstring for the invariants.

    The arena (token copies) is one ``arena_bytes`` buffer used as a ring in submission order, so
    queued copies cost no allocation (a fresh ``bytes`` of tens of KiB per request measurably slowed
    the scheduler thread). The thread starts with a ``submit`` and exits after a second without work.
    ``submit``, ``pause``, ``step``, ``resume`` and ``close`` belong to one thread (the scheduler's);
    ``wait`` and ``resolve`` may be called from any thread (L3 workers read page hashes too).
    """

    def __init__(self, page_bytes: int, *, arena_bytes: int = 16 << 20) -> None:
        if _NativeHasher is None:
            raise HashingError("BackgroundHasher needs the C kernels (kvstrata.impl._native)")
        if page_bytes <= 0 or page_bytes % 4:
            raise ValueError(f"page_bytes must be a positive multiple of 4, got {page_bytes}")
        if arena_bytes < page_bytes:
            raise ValueError(f"arena_bytes must hold a page ({page_bytes}), got {arena_bytes}")
        self._page_bytes = page_bytes
        self._arena_bytes = arena_bytes
        self._arena = np.empty(arena_bytes, dtype=np.uint8)  # untouched pages cost no memory
        self._native: Any = _NativeHasher(self._arena, page_bytes)
        self._held: deque[tuple[int, int, int]] = deque()  # (seq, start, end) of arena copies
        self._closed = False
        self._submitted = 0
        self.inline_chains = 0  # chains hashed inline (too large for the arena, or after close)

    @property
    def finished(self) -> int:
        """How many jobs finished (jobs finish in submission order)."""
        return int(self._native.done())

    @property
    def busy_ns(self) -> int:
        """CPU time the C thread spent hashing."""
        return int(self._native.busy_ns)

    @property
    def arena_nbytes(self) -> int:
        return int(self._arena.nbytes)

    @property
    def pending(self) -> int:
        """Jobs submitted and not finished."""
        return self._submitted - self.finished

    # ------------------------------------------------------------------------------ scheduler side
    def submit(self, seed: Digests, tokens: Tokens, pages: int, *, frozen: bool = False) -> Digests:
        if not pages:
            return b""
        size = 0 if frozen else tokens.nbytes  # frozen tokens are read in place, not copied
        if self._closed or size > self._arena_bytes:
            self.inline_chains += 1
            return sha256_chain(seed_bytes(seed), tokens, self._page_bytes)
        seed_arg: bytes | tuple[bytearray, int]
        if type(seed) is bytes:
            seed_arg = seed
        elif seed.hasher is self:  # type: ignore[union-attr]
            # read from the parent's output when this job runs: the parent ran before it (FIFO)
            seed_arg = (seed.out, (seed.stop - 1) * DIGEST_BYTES)  # type: ignore[union-attr]
        else:
            seed_arg = seed_bytes(seed)
        out = bytearray(pages * DIGEST_BYTES)
        if size:
            start = self._place(size)
            seq = self._native.submit(seed_arg, tokens, pages, start, out)
            self._held.append((seq, start, start + size))
        else:
            seq = self._native.submit(seed_arg, tokens, pages, None, out)
        self._submitted = seq + 1
        return PendingDigests(self, seq, out, 0, pages)

    def _place(self, need: int) -> int:
        """Where ``need`` bytes of tokens go in the arena: after the newest held region, or at 0
        when that leaves too little before the end; releases the regions of finished jobs, and
        waits for the oldest job, until one of those fits."""
        held = self._held
        capacity = self._arena_bytes
        released = False
        while True:
            if not held:
                return 0
            first, head = held[0][1], held[-1][2]
            if held[-1][1] >= first:  # not wrapped: [first, head) is taken
                if need <= capacity - head:
                    return head
                if need <= first:
                    return 0
            elif need <= first - head:  # wrapped: [head, first) is free
                return head
            if not released:
                done = self._native.done()
                while held and held[0][0] < done:
                    held.popleft()
                released = True
                continue
            self.wait(held[0][0])  # the oldest region's job is still pending
            released = False

    def drain(self) -> None:
        """Wait until every submitted job finished."""
        if self._submitted:
            self.wait(self._submitted - 1)

    def pause(self) -> None:
        """Tests: the thread starts no job until :meth:`resume` or :meth:`step`, or until a
        ``wait`` (a resolve, or a submit short of arena room) needs one: jobs stay pending."""
        self._native.pause()

    def step(self, jobs: int = 1) -> None:
        """Tests, on a paused hasher: let the next ``jobs`` jobs run, and wait for them."""
        self._native.step(jobs)
        target = min(self.finished + jobs, self._submitted) - 1
        if target >= 0:
            self.wait(target)

    def resume(self) -> None:
        self._native.resume()

    def check(self) -> None:
        """Tests: ``AssertionError`` unless the arena regions of queued copies are in submission
        order, pairwise disjoint and inside the arena, and the counts agree."""
        held = list(self._held)
        assert all(a[0] < b[0] for a, b in itertools.pairwise(held)), "held out of order"
        spans = sorted((start, end) for _, start, end in held)
        assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans)), "regions overlap"
        assert all(0 <= a < b <= self._arena_bytes for a, b in spans), "outside the arena"
        assert 0 <= self.finished <= self._submitted

    def close(self) -> None:
        """Finish the queued jobs and stop the thread. Later ``submit`` calls hash inline."""
        self._closed = True
        self._native.close()
        self._held.clear()

    # -------------------------------------------------------------------------------- any thread
    def wait(self, seq: int) -> None:
        """Block until job ``seq`` finished. :class:`HashingError` if it cannot (the thread could
        not start)."""
        try:
            self._native.wait(seq)  # the GIL is released while waiting
        except OSError as error:
            raise HashingError(f"page-hash job {seq}: {error}") from error
