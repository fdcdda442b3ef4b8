"""L2 <-> L3 throughput through kvstrata against the raw Mooncake client, in one run (issue 4).

Setup. One process starts a :class:`~kvstrata.impl.storage.mooncake.LocalCluster` (a ``mooncake_master``
plus a storage node that owns the only segment) and opens two clients on it, neither with a segment of
its own, so every byte crosses TCP loopback to the storage node on both sides of the comparison:

- **raw**: ``mooncake.store.MooncakeDistributedStore`` called directly (``batch_put_from`` /
  ``batch_get_into`` / ``batch_is_exist``) with key strings computed before the clock starts;
- **kvstrata**: :class:`~kvstrata.impl.storage.mooncake.MooncakeClient` under
  :class:`~kvstrata.impl.storage.mooncake.MooncakeBackend`, and
  :class:`~kvstrata.impl.cache.HierarchicalRadixCache` instances on top of such backends.

Page size means the bytes of one whole KV page, every plane included. The model is fixed (MHA, 32
layers, 2 KV heads, head dim 128, bfloat16: 32 KiB per token) and the page size in tokens varies: 2, 8,
32 and 128 tokens give 64 KiB, 256 KiB, 1 MiB and 4 MiB pages. A page is two store objects (K and V,
half a page each) for kvstrata and for the raw client alike, and both use the same key strings (the
raw client gets kvstrata's rendered keys, made before timing). A cell moves ``total`` bytes in store
calls of ``batch`` pages: 64 KiB: 64 pages x 16 calls = 64 MiB; 256 KiB: 64 x 8 = 128 MiB; 1 MiB:
32 x 8 = 256 MiB; 4 MiB: 8 x 8 = 256 MiB (``--quick``: an eighth of the bytes in 2 calls per
cell and 2 repetitions, a CI smoke run of about 20 s).

Rows of the throughput table (per cell; ``time.perf_counter`` around the store calls only):

1. ``raw``: ``batch_put_from`` of each batch from the page slabs of a ``page_first_direct`` host pool
   (exactly the pointers and sizes kvstrata's zero-copy path hands Mooncake), then ``batch_get_into``
   back into them, on the native instance inside kvstrata's own client (the one its backends call):
   every ratio is against it. ``raw_second``: the same raw calls on the benchmark's second native
   client, for scale. A native client's past calls change its speed (``client_history.py``: one
   batch of 4 MiB objects made later puts of 128 KiB objects 1.2-1.8x slower), and two clients
   of one run drift apart as their calls differ (1.31x at 1 MiB pages in one run of 2026-12-02),
   so a baseline on another instance measures that instance's history as well as kvstrata's code
   (issue 20, part 23; before it the headline was the second client and this row ``raw_same``);
2. ``direct``: ``MooncakeBackend.put`` then ``get`` of the same pages on that ``page_first_direct`` pool
   (zero-copy). This includes everything kvstrata does per call: rendering the keys from page hashes,
   the put, ``batch_is_exist`` after it (the confirm), argument checks and status accounting;
   ``exists_first``: the same with ``exists_before_put=True`` (``batch_is_exist`` before the put
   too, then only the missing objects: the backend before issue 20);
3. ``direct_twin``: a second ``MooncakeBackend`` like ``direct`` on the same client and pool: the same
   code measured twice in one run, so the gap between the two rows is the run's own spread on the
   kvstrata side (``raw_second`` shows it on the raw side). It replaced a what-if that cached key
   prefixes: since ``KeySpace.rendered`` the backend renders a batch's keys that way itself;
4. ``staged``: ``MooncakeBackend`` on a ``page_first`` pool, whose objects pass through the registered
   staging buffer (a gather/transpose copy before each put, a scatter after each get);
5. ``cache`` (informative): *backup* is the time from the first ``insert`` of ``total / batch``
   new requests of ``batch`` pages each into cache A until ``check_events`` has applied every backup
   (it includes the L1 -> L2 write-through copy, which runs on the copy thread pipelined with the
   store I/O on the storage thread, and polling every 0.5 ms; one store call per backup op, as
   the raw calls it is compared with: ``backup_merge_pages=0``);
   *prefetch* is cache B (own host pool,
   own backend on the same client) calling ``prefetch`` for the same requests (``wait_complete``)
   until every op is ready and committed (an ``exists`` query plus a ``get`` per request). Its ratio
   is against a raw put/get of the same bytes, as the same store objects (two a page for key
   schema 1, one for ``--cache-schema 2``), run in the same repetition (raw, ``cache`` and
   ``cache_l2`` in an order that rotates from repetition to repetition: the ``cache_raw`` row), the
   host pool written just before it (untimed), as the cache's write-through writes it before the
   backups;
6. ``cache_l2`` (informative): the same, except that cache A's write lane holds its backups until
   every write-through copy has landed on L2, and *backup* is timed from then: the cache's store
   path alone. On a CPU-only machine the L1 -> L2 copy is a memcpy of the same bytes on the same
   cores as the store's TCP transfer, so the ``cache`` row's backup shares the CPU with it (a GPU's
   copy engine would not); *prefetch* is measured again as in ``cache``.

Method. Rows 1-4 (with ``exists_first``) are interleaved call by call: for each batch the paths
issue their call in an order that rotates from batch to batch, so that a burst of load from other
processes on this shared machine falls on all of them alike; first every put, then every get, then
``remove_all(force=True)`` and one 4 KiB primer put (both untimed: the first put after
``remove_all`` was measured about 25 ms slower, which would otherwise land on whichever path goes
first). Puts always use fresh keys (a re-put of an existing key is a master-side no-op). One
unrecorded warm-up repetition per cell runs each path on its own and checks bytes: sampled host
slots are zeroed before the get and must come back bit for bit. The storage node's segment is
written once before the first cell, so first-touch page faults land on no path. Reported per row:
median GB/s (``bytes / median seconds``, 1 GB = 1e9 bytes) over ``--repeats`` repetitions, and
kvstrata / raw as the median over repetitions of that repetition's ``raw seconds / kvstrata
seconds`` (both sides ran under the same load; goal: >= 0.9). The JSON also has the ratio of the
medians and every sample.

Exists latency: 1024 pages of the first cell's size are stored, then ``MooncakeBackend.exists`` of the
first 1, 64 and 1024 pages (2, 128 and 2048 keys) against the raw ``batch_is_exist`` of the same key
strings on three native instances of one master (the benchmark's raw client, a second raw client set
up like it, and the instance inside kvstrata's client: two instances set up alike differed by up to a
third per small call, so the headline ratio is against the instance ``exists`` itself calls) and
against ``MooncakeClient.batch_is_exist`` of them (the call ``exists`` makes), interleaved with each
path first in turn, for stored pages (hits; each grants a lease) and for pages never stored
(misses): median microseconds, with the time ``KeySpace.rendered`` takes for those pages in Python
(without the C kernel ``exists`` uses) and the ``exists`` of a second backend like the first
(``twin``: the same code again).

Exit status: 0 when everything ran; 1 when a store call failed, bytes came back wrong or a cache op did
not complete (one line on stderr, no traceback); 2 when the cluster cannot be started here.

Usage: python benchmarks/l3_throughput.py [--quick] [--repeats N] [--sizes 64,256,1024,4096]
       [--segment-mib M] [--threads 1] [--skip-cache] [--skip-exists] [--cache-schema 1|2]
       [--query-on-read-lane] [--json PATH]
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt
import torch

from kvstrata.impl.cache import HierarchicalRadixCache
from kvstrata.impl.config import RadixCacheConfig, StorageConfig
from kvstrata.impl.errors import KvStrataError, StoreUnavailable
from kvstrata.impl.pools import DeviceKVPool, HostKVPool, HostLayout, KVShape
from kvstrata.impl.storage.base import GetStatus, PutStatus
from kvstrata.impl.storage.link import Lanes
from kvstrata.impl.storage.mooncake import LocalCluster, MooncakeBackend, MooncakeClient
from kvstrata.impl.transfer import Executor, ThreadExecutor
from kvstrata.model.keys import KeySpace, KVKind, ModelIdentity, Namespace, PageHash

KIB = 1 << 10
MIB = 1 << 20
LAYERS, HEADS, HEAD_DIM = 32, 2, 128
DTYPE = torch.bfloat16
BYTES_PER_TOKEN = 2 * LAYERS * HEADS * HEAD_DIM * DTYPE.itemsize  # K and V: 32 KiB
GOAL = 0.9
POLL_S = 0.0005
CACHE_TIMEOUT_S = 120.0
NAMESPACE = Namespace()
EXISTS_SIZES = (1, 64, 1024)
PRIMER_BYTES = 4 * KIB
INTERLEAVED = (
    "raw",
    "raw_second",
    "direct",
    "exists_first",
    "direct_twin",
    "staged",
    "raw_one_object",
    "direct_one_object",
    "one_object_parts",
)
ONE_OBJECT = ("direct_one_object", "one_object_parts")
PATH_NAMES = {
    "raw": "raw `batch_put_from` / `batch_get_into` (on kvstrata's own native instance)",
    "raw_second": "the same raw calls on a second native client (for scale)",
    "raw_one_object": "raw, one object per page (page_major slabs)",
    "direct_one_object": "backend, key schema 2, page_major (one object per page, zero-copy)",
    "one_object_parts": "backend, key schema 2, page_first_direct (K and V runs as one object)",
    "direct": "backend, page_first_direct (zero-copy)",
    "exists_first": "direct with `exists_before_put` (before issue 20)",
    "direct_twin": "backend, page_first_direct, a second instance (the same code as direct)",
    "staged": "backend, page_first (staged)",
    "cache_raw": "raw, run in each cache repetition",
    "cache": "cache backup / prefetch",
    "cache_l2": "cache backup once on L2 (write-through landed first) / prefetch",
}


class BenchError(Exception):
    """A failure the benchmark reports in one line (exit status 1)."""


class SetupError(Exception):
    """The cluster could not be started here (exit status 2)."""


@dataclass(frozen=True)
class Cell:
    """One page size: ``total`` bytes moved in store calls of ``batch`` pages."""

    page_bytes: int
    batch: int
    total: int

    @property
    def tokens(self) -> int:
        return self.page_bytes // BYTES_PER_TOKEN

    @property
    def pages(self) -> int:
        return self.total // self.page_bytes

    @property
    def calls(self) -> int:
        return self.pages // self.batch

    @property
    def label(self) -> str:
        size = self.page_bytes
        return f"{size // MIB} MiB" if size >= MIB else f"{size // KIB} KiB"


FULL = {
    64: Cell(64 * KIB, 64, 64 * MIB),
    256: Cell(256 * KIB, 64, 128 * MIB),
    1024: Cell(1 * MIB, 32, 256 * MIB),
    4096: Cell(4 * MIB, 8, 256 * MIB),
}
QUICK = {
    64: Cell(64 * KIB, 64, 8 * MIB),
    256: Cell(256 * KIB, 32, 16 * MIB),
    1024: Cell(1 * MIB, 16, 32 * MIB),
    4096: Cell(4 * MIB, 4, 32 * MIB),
}


@dataclass
class Samples:
    """Seconds per repetition of one path's puts (or backups) and gets (or prefetches)."""

    put: list[float] = field(default_factory=list)
    get: list[float] = field(default_factory=list)


# ---------------------------------------------------------------------------------------- the raw client
class RawStore:
    """The native client, set up like kvstrata's (no segment, the same local buffer, P2PHANDSHAKE,
    TCP). Never called unless set up (a native call before setup or after close segfaults)."""

    def __init__(self, master: str, local_buffer: int) -> None:
        try:
            from mooncake.store import (  # type: ignore[import-untyped]  # noqa: PLC0415
                MooncakeDistributedStore,
            )
        except ImportError as error:
            raise StoreUnavailable(f"the mooncake client is not installed ({error})") from None
        native = MooncakeDistributedStore()
        rc = native.setup("127.0.0.1", "P2PHANDSHAKE", 0, local_buffer, "tcp", "", master)
        if rc != 0:
            raise StoreUnavailable(f"raw mooncake client: setup against {master} returned {rc}")
        self.native: Any = native
        self.registered: set[int] = set()
        self.primer = torch.ones(PRIMER_BYTES, dtype=torch.uint8)
        self.primes = 0
        self.register(self.primer.data_ptr(), PRIMER_BYTES)

    def prime(self) -> None:
        """Put one small object. The first put after ``remove_all`` is measured to be slower (about
        55 ms instead of 30 for 8 x 4 MiB pages); this absorbs that outside every timed path."""
        self.primes += 1
        key = f"bench-primer/{self.primes}"
        codes = self.native.batch_put_from([key], [self.primer.data_ptr()], [PRIMER_BYTES])
        if list(codes) != [0]:
            raise BenchError(f"raw batch_put_from of the primer object returned {list(codes)}")

    def register(self, ptr: int, size: int) -> None:
        rc = int(self.native.register_buffer(ptr, size))
        if rc != 0:
            raise BenchError(f"raw register_buffer({size} bytes) returned {rc}")
        self.registered.add(ptr)

    def unregister(self, ptr: int) -> None:
        if ptr in self.registered:
            self.registered.discard(ptr)
            self.native.unregister_buffer(ptr)

    def close(self) -> None:
        if self.native is not None:
            for ptr in list(self.registered):
                self.unregister(ptr)
            self.native.close()
            self.native = None


# -------------------------------------------------------------------------------------------- helpers
def fresh_pages(label: str, count: int) -> list[PageHash]:
    """``count`` page hashes no other call returns (``label`` makes them unique)."""
    return [PageHash(hashlib.sha256(f"{label}/{i}".encode()).digest()) for i in range(count)]


def batches(items: Sequence[Any], size: int) -> list[Sequence[Any]]:
    return [items[i : i + size] for i in range(0, len(items), size)]


def fill(pool: HostKVPool | DeviceKVPool, start: int) -> None:
    """Touch every byte of the pool with distinct 8-byte values (fast; every page differs)."""
    flat = pool.buffer.view(-1).view(torch.int64)
    torch.arange(start, start + flat.numel(), dtype=torch.int64, out=flat)


def shape_of(cell: Cell) -> KVShape:
    return KVShape(KVKind.MHA, LAYERS, HEADS, HEAD_DIM, DTYPE, cell.tokens)


def model_of(cell: Cell) -> ModelIdentity:
    return ModelIdentity(name="bench-l3", dtype="bfloat16", kind=KVKind.MHA, page_size=cell.tokens)


def keyspace_of(cell: Cell, schema: int = 1) -> KeySpace:
    return KeySpace(model=model_of(cell), tag="bench", schema=schema)


def key_texts(keyspace: KeySpace, pages: Sequence[PageHash]) -> list[str]:
    """The exact strings kvstrata uses for these pages (page-major, K then V)."""
    return [key.text for page in pages for key in keyspace.page_keys(NAMESPACE, page)]


def clear(client: MooncakeClient, raw: RawStore) -> None:
    """Empty the store (leases notwithstanding), then put the primer object (see ``prime``)."""
    removed = client.remove_all(force=True)
    if removed < 0:
        raise BenchError(f"remove_all(force=True) returned {removed}")
    raw.prime()


def gbps(nbytes: int, seconds: list[float]) -> float:
    return nbytes / statistics.median(seconds) / 1e9


def median_us(seconds: list[float]) -> float:
    return statistics.median(seconds) * 1e6


@contextmanager
def registered(raw: RawStore | SameInstance, host: HostKVPool) -> Iterator[None]:
    ptr = host.buffer.data_ptr()
    raw.register(ptr, host.buffer.numel() * host.buffer.element_size())
    try:
        yield
    finally:
        raw.unregister(ptr)


class Snapshot:
    """Sampled host slots saved before a get, zeroed, and compared after it (warm-up only)."""

    def __init__(self, host: HostKVPool, pages: int) -> None:
        self.host = host
        self.indices = sorted({0, pages // 3, pages // 2, pages - 1})
        self.saved = [
            host.page_slab(plane, index).clone()
            for index in self.indices
            for plane in range(host.shape.planes)
        ]

    def zero(self) -> None:
        for index in self.indices:
            for plane in range(self.host.shape.planes):
                self.host.page_slab(plane, index).zero_()

    def check(self, what: str) -> None:
        planes = self.host.shape.planes
        for n, index in enumerate(self.indices):
            for plane in range(planes):
                got = self.host.page_slab(plane, index).view(torch.uint8)
                if not torch.equal(got, self.saved[n * planes + plane].view(torch.uint8)):
                    raise BenchError(f"{what}: host page {index} plane {plane} came back different")


# ------------------------------------------------------------------------------------- timed paths
class MovePath(Protocol):
    """One way of moving a cell's pages: ``begin`` picks fresh keys, then one store call per batch."""

    host: HostKVPool

    def begin(self, label: str) -> None: ...
    def put(self, call: int) -> list[Any]: ...
    def get(self, call: int) -> list[Any]: ...
    def check_put(self, results: list[list[Any]]) -> None: ...
    def check_get(self, results: list[list[Any]]) -> None: ...


class RawPath:
    """Raw batches over the direct pool's page slabs (K and V of each page, in key order), or, for
    a key space of schema 2 over a ``page_major`` pool, over its whole pages (one object each)."""

    def __init__(
        self, raw: RawStore | SameInstance, host: HostKVPool, cell: Cell, keyspace: KeySpace
    ) -> None:
        self.raw, self.host, self.cell, self.keyspace = raw, host, cell, keyspace
        width = len(keyspace.components)
        self.size = host.shape.bytes_per_page // width
        ptrs = [
            host.page_slab(plane, page).data_ptr()
            for page in range(cell.pages)
            for plane in range(width)
        ]
        if width == 1 and host.shape.planes > 1 and host.layout is not HostLayout.PAGE_MAJOR:
            raise BenchError("one raw object per page needs a page_major pool")
        self.ptrs = batches(ptrs, width * cell.batch)
        self.sizes = [[self.size] * len(chunk) for chunk in self.ptrs]
        self.keys: list[Sequence[str]] = []

    def begin(self, label: str) -> None:
        texts = key_texts(self.keyspace, fresh_pages(label, self.cell.pages))
        self.keys = batches(texts, len(self.keyspace.components) * self.cell.batch)

    def put(self, call: int) -> list[int]:
        codes: list[int] = self.raw.native.batch_put_from(
            self.keys[call], self.ptrs[call], self.sizes[call]
        )
        return codes

    def get(self, call: int) -> list[int]:
        codes: list[int] = self.raw.native.batch_get_into(
            self.keys[call], self.ptrs[call], self.sizes[call]
        )
        return codes

    def check_put(self, results: list[list[int]]) -> None:
        bad = [code for codes in results for code in codes if code != 0]
        if bad:
            raise BenchError(f"raw batch_put_from: {len(bad)} objects failed (first code {bad[0]})")

    def check_get(self, results: list[list[int]]) -> None:
        bad = [code for codes in results for code in codes if code != self.size]
        if bad:
            raise BenchError(f"raw batch_get_into: {len(bad)} objects failed (first code {bad[0]})")


class SameInstance:
    """Raw calls on the native instance inside kvstrata's own :class:`MooncakeClient`: the raw
    baseline of every ratio (``client_history.py`` says why). Its memory is registered through the
    client (:meth:`register`: counted references, so a range a backend's ``attach`` registered too
    stays registered until both let go); a range used here must be held by :meth:`register` (or
    :func:`registered`) for as long as it is used, since closing the backends that registered it
    drops their references."""

    def __init__(self, client: MooncakeClient) -> None:
        self.client = client
        self.native: Any = client.native_store

    def register(self, ptr: int, size: int) -> None:
        self.client.register_buffer(ptr, size)

    def unregister(self, ptr: int) -> None:
        self.client.unregister_buffer(ptr)


class BackendPath:
    """``MooncakeBackend.put`` / ``get`` of whole pages of one host pool, ``batch`` pages a call."""

    def __init__(self, backend: MooncakeBackend, host: HostKVPool, cell: Cell) -> None:
        self.backend, self.host, self.cell = backend, host, cell
        self.indices = batches(list(range(cell.pages)), cell.batch)
        self.pages: list[Sequence[PageHash]] = []

    def begin(self, label: str) -> None:
        self.pages = batches(fresh_pages(label, self.cell.pages), self.cell.batch)

    def put(self, call: int) -> list[PutStatus]:
        return self.backend.put(NAMESPACE, self.pages[call], self.indices[call])

    def get(self, call: int) -> list[GetStatus]:
        return self.backend.get(NAMESPACE, self.pages[call], self.indices[call])

    def check_put(self, results: list[list[PutStatus]]) -> None:
        bad = [
            status for statuses in results for status in statuses if status is not PutStatus.STORED
        ]
        if bad:
            raise BenchError(f"MooncakeBackend.put: {len(bad)} pages not stored ({bad[0].value})")

    def check_get(self, results: list[list[GetStatus]]) -> None:
        bad = [
            status for statuses in results for status in statuses if status is not GetStatus.LOADED
        ]
        if bad:
            raise BenchError(f"MooncakeBackend.get: {len(bad)} pages not loaded ({bad[0].value})")


def run_alone(
    path: MovePath, name: str, label: str, calls: int, verify: bool
) -> tuple[float, float]:
    """Every put then every get of one path; with ``verify``, sampled slots must round-trip."""
    snapshot = Snapshot(path.host, path.host.num_pages) if verify else None
    path.begin(label)
    start = time.perf_counter()
    puts = [path.put(call) for call in range(calls)]
    put_s = time.perf_counter() - start
    path.check_put(puts)
    if snapshot is not None:
        snapshot.zero()
    start = time.perf_counter()
    gets = [path.get(call) for call in range(calls)]
    get_s = time.perf_counter() - start
    path.check_get(gets)
    if snapshot is not None:
        snapshot.check(name)
    return put_s, get_s


def run_interleaved(
    paths: dict[str, MovePath], label: str, calls: int, offset: int
) -> dict[str, tuple[float, float]]:
    """Call ``i`` of every path, in an order that rotates with ``i + offset``; puts first, then
    gets."""
    names = list(paths)
    for name, path in paths.items():
        path.begin(f"{label}/{name}")
    seconds = {name: [0.0, 0.0] for name in names}
    for phase in (0, 1):
        results: dict[str, list[list[Any]]] = {name: [] for name in names}
        for call in range(calls):
            shift = (call + offset) % len(names)
            for name in names[shift:] + names[:shift]:
                path = paths[name]
                start = time.perf_counter()
                out = path.put(call) if phase == 0 else path.get(call)
                seconds[name][phase] += time.perf_counter() - start
                results[name].append(out)
        for name, path in paths.items():
            (path.check_put if phase == 0 else path.check_get)(results[name])
    return {name: (put_s, get_s) for name, (put_s, get_s) in seconds.items()}


# --------------------------------------------------------------------------------------- cache path
def poll_pause() -> None:
    """What the scheduler thread does between two ``check_events`` calls: sleep ``POLL_S``."""
    time.sleep(POLL_S)


def settle(
    cache: HierarchicalRadixCache,
    done: Callable[[], bool],
    what: str,
    pause: Callable[[], None] = poll_pause,
) -> None:
    deadline = time.monotonic() + CACHE_TIMEOUT_S
    while True:
        cache.check_events()
        if done():
            return
        if time.monotonic() > deadline:
            raise BenchError(f"{what} did not finish within {CACHE_TIMEOUT_S:.0f} s")
        pause()


class Gate:
    """An executor that holds its jobs while ``holding`` and hands them to ``inner`` in order when
    :meth:`release` runs (cache A's write lane in the ``cache_l2`` row). A held store call has not
    begun, so no deadline runs for it."""

    def __init__(self, inner: Executor) -> None:
        self.inner = inner
        self.held: list[Callable[[], None]] = []
        self.holding = False

    def submit(self, job: Callable[[], None]) -> None:
        if self.holding:
            self.held.append(job)
        else:
            self.inner.submit(job)

    def release(self) -> None:
        self.holding = False
        held, self.held = self.held, []
        for job in held:
            self.inner.submit(job)

    def close(self) -> None:
        self.release()
        self.inner.close()


class CachePath:
    """Cache A (a device pool, the direct host pool and its backend) backs up; cache B (its own direct
    host pool, its own backend on the same client) prefetches what A backed up."""

    def __init__(
        self,
        client: MooncakeClient,
        cell: Cell,
        host_a: HostKVPool,
        backend_a: MooncakeBackend,
        query_lane: bool = True,
        *,
        merge_pages: int = 0,
    ) -> None:
        shape, schema = shape_of(cell), backend_a.keyspace.schema
        self.cell = cell
        #: Between two ``check_events`` while waiting (``gil_convoy.py`` makes it busy).
        self.pause: Callable[[], None] = poll_pause
        self.device = DeviceKVPool(shape, cell.pages, "cpu")
        fill(self.device, 7 << 40)
        config = RadixCacheConfig(page_size=cell.tokens)
        # one store call per backup (prefetch) op unless merge_pages (rows compared with raw
        # calls of `batch` pages keep that shape; gil_convoy.py measures merged calls)
        self.gate = Gate(ThreadExecutor("bench-l3-write", merge=merge_pages > 0))
        self.a = HierarchicalRadixCache.build(
            config,
            self.device,
            host_a,
            storage=backend_a,
            storage_config=StorageConfig(
                prefetch_threshold=cell.tokens,
                backup_batch_pages=cell.batch,
                backup_merge_pages=merge_pages,
            ),
            storage_executor=Lanes(
                ThreadExecutor("bench-l3-read"),
                self.gate,
                ThreadExecutor("bench-l3-probe"),
                ThreadExecutor("bench-l3-query"),
            ),
        )
        layout = HostLayout.PAGE_MAJOR if schema == 2 else HostLayout.PAGE_FIRST_DIRECT
        self.host_b = HostKVPool(shape, cell.pages, layout, pin_memory=False)
        fill(self.host_b, 9 << 40)
        self.b = HierarchicalRadixCache.build(
            config,
            DeviceKVPool(shape, 1, "cpu"),
            self.host_b,
            storage=MooncakeBackend(client, keyspace_of(cell, schema)),
            storage_config=StorageConfig(
                prefetch_threshold=cell.tokens,
                prefetch_policy="wait_complete",
                prefetch_reserve_fraction=1.0,
                prefetch_merge_pages=merge_pages,
            ),
            storage_executor=Lanes(
                ThreadExecutor("bench-l3-read", merge=merge_pages > 0),
                ThreadExecutor("bench-l3-write"),
                ThreadExecutor("bench-l3-probe"),
                ThreadExecutor("bench-l3-query") if query_lane else None,
            ),
        )
        self.next_token = 1
        self.query_waits: list[float] = []  # query_behind_fetches, one per run

    def _requests(self) -> list[npt.NDArray[np.uint32]]:
        """Token ids no earlier request used: fresh page hashes, so fresh keys."""
        span = self.cell.batch * self.cell.tokens
        out = []
        for _ in range(self.cell.calls):
            out.append(np.arange(self.next_token, self.next_token + span, dtype=np.uint32))
            self.next_token += span
        return out

    def run(self, from_l2: bool = False) -> tuple[float, float, int]:
        """Seconds of the backup and of the prefetch of one cell's bytes, and backup retries.
        ``from_l2``: the backups wait until every write-through copy landed, and are timed from
        then (the ``cache_l2`` row)."""
        a, b, cell = self.a, self.b, self.cell
        tier_a, tier_b = a.l3, b.l3
        assert tier_a is not None and tier_b is not None
        requests = self._requests()
        counters = tier_a.counters
        stored, retries = counters.backup_pages["stored"], counters.backup_retries
        self.gate.holding = from_l2
        start = time.perf_counter()
        for tokens in requests:
            a.insert(tokens, a.alloc_device(cell.batch))
        if from_l2:  # one backup op per request (backup_batch_pages = batch)
            settle(
                a, lambda: len(self.gate.held) == cell.calls, "the write-through copies", self.pause
            )
            start = time.perf_counter()
            self.gate.release()
        settle(a, a.idle, "cache backup", self.pause)
        backup_s = time.perf_counter() - start
        stored = counters.backup_pages["stored"] - stored
        if stored != cell.pages or counters.backup_abandoned_pages:
            raise BenchError(
                f"cache backup: {stored} of {cell.pages} pages stored, "
                f"{counters.backup_abandoned_pages} abandoned"
            )

        start = time.perf_counter()
        ops = []
        for tokens in requests:
            op = b.prefetch(tokens)
            if op is None:
                raise BenchError("cache prefetch: prefetch() declined a request")
            ops.append(op)
        settle(b, lambda: all(b.prefetch_ready(op) for op in ops), "cache prefetch", self.pause)
        added = sum(b.prefetch_commit(op) for op in ops)
        prefetch_s = time.perf_counter() - start
        if added != cell.pages:
            raise BenchError(f"cache prefetch: {added} of {cell.pages} pages committed")
        settle(b, tier_b.idle, "cache prefetch drain")
        b.reset()
        self.query_waits.append(self.query_behind_fetches(requests))
        a.reset()
        b.reset()
        return backup_s, prefetch_s, counters.backup_retries - retries

    def query_behind_fetches(self, requests: list[npt.NDArray[np.uint32]]) -> float:
        """Seconds until a new request's prefetch query is answered while the fetches of every
        other request are queued or running (cache B, its tree empty, the store holding them)."""
        b = self.b
        tier = b.l3
        assert tier is not None
        ops: list[int] = []
        for tokens in requests[:-1]:
            op = b.prefetch(tokens)
            if op is None:
                raise BenchError("query wait: prefetch() declined a request")
            ops.append(op)
        settle(b, lambda: all(tier.prefetches[op].state is not None for op in ops), "queries")
        start = time.perf_counter()
        last = b.prefetch(requests[-1])
        if last is None:
            raise BenchError("query wait: prefetch() declined the last request")
        settle(b, lambda: tier.prefetches[last].state is not None, "the last query")
        waited = time.perf_counter() - start
        settle(b, lambda: all(b.prefetch_ready(op) for op in [*ops, last]), "query wait fetches")
        for op in [*ops, last]:
            b.prefetch_commit(op)
        settle(b, tier.idle, "query wait drain")
        return waited

    def close(self) -> None:
        self.b.close()
        self.a.close()


# ---------------------------------------------------------------------------------------------- cells
def run_cell(
    cell: Cell,
    client: MooncakeClient,
    raw: RawStore,
    repeats: int,
    with_cache: bool,
    *,
    cache_schema: int = 1,
    query_lane: bool = True,
) -> dict[str, Any]:
    """Every row of one cell (see the module docstring)."""
    started = time.perf_counter()
    shape, keyspace = shape_of(cell), keyspace_of(cell)
    one_object = keyspace_of(cell, schema=2)
    direct = HostKVPool(shape, cell.pages, HostLayout.PAGE_FIRST_DIRECT, pin_memory=False)
    staged = HostKVPool(shape, cell.pages, HostLayout.PAGE_FIRST, pin_memory=False)
    major = HostKVPool(shape, cell.pages, HostLayout.PAGE_MAJOR, pin_memory=False)
    fill(direct, 1 << 40)
    fill(staged, 3 << 40)
    fill(major, 5 << 40)
    backends = {
        "direct": MooncakeBackend(client, keyspace),
        "exists_first": MooncakeBackend(client, keyspace, exists_before_put=True),
        "direct_twin": MooncakeBackend(client, keyspace),
        "staged": MooncakeBackend(client, keyspace),
        "direct_one_object": MooncakeBackend(client, one_object),
        "one_object_parts": MooncakeBackend(client, one_object),
    }
    samples = {name: Samples() for name in (*INTERLEAVED, "cache_raw", "cache", "cache_l2")}
    query_waits: list[float] = []
    retries = 0
    try:
        backends["direct"].attach(direct)
        backends["exists_first"].attach(direct)  # the same registration, counted again
        backends["direct_twin"].attach(direct)
        backends["staged"].attach(staged)
        backends["direct_one_object"].attach(major)
        backends["one_object_parts"].attach(direct)
        same = SameInstance(client)
        # the raw rows' memory stays registered with kvstrata's instance for the whole cell, also
        # once the backends that registered it are closed (the cache rows run after that)
        with registered(raw, direct), registered(same, direct), registered(same, major):
            raw_path = RawPath(same, direct, cell, keyspace)
            raw_one = RawPath(same, major, cell, one_object)
            cache_raw_path = raw_one if cache_schema == 2 else raw_path
            paths: dict[str, MovePath] = {
                "raw": raw_path,
                "raw_second": RawPath(raw, direct, cell, keyspace),
                "direct": BackendPath(backends["direct"], direct, cell),
                "exists_first": BackendPath(backends["exists_first"], direct, cell),
                "direct_twin": BackendPath(backends["direct_twin"], direct, cell),
                "staged": BackendPath(backends["staged"], staged, cell),
                "raw_one_object": raw_one,
                "direct_one_object": BackendPath(backends["direct_one_object"], major, cell),
                "one_object_parts": BackendPath(backends["one_object_parts"], direct, cell),
            }
            for name, path in paths.items():  # warm-up, bytes checked, not recorded
                run_alone(path, name, f"{cell.page_bytes}/warm/{name}", cell.calls, verify=True)
                clear(client, raw)
            for rep in range(repeats):
                times = run_interleaved(paths, f"{cell.page_bytes}/{rep}", cell.calls, rep)
                clear(client, raw)
                for name, (put_s, get_s) in times.items():
                    samples[name].put.append(put_s)
                    samples[name].get.append(get_s)
            cached = "direct_one_object" if cache_schema == 2 else "direct"
            for name in ("direct_twin", "staged", "exists_first", *ONE_OBJECT):
                if name != cached:
                    backends[name].close()
            if with_cache:
                retries = run_cache(
                    cell,
                    client=client,
                    raw=raw,
                    # raw Mooncake moving the objects the cache moves: two a page for schema 1,
                    # one a page for schema 2 (against two a page, schema 2 would gain the
                    # store's own one-object advantage, 1.0-1.45x by page size)
                    raw_path=cache_raw_path,
                    direct=major if cache_schema == 2 else direct,
                    backend=backends[cached],
                    repeats=repeats,
                    samples=samples,
                    query_waits=query_waits,
                    query_lane=query_lane,
                )
    finally:
        for backend in backends.values():
            backend.close()
        clear(client, raw)
    rows = []
    for name, got in samples.items():
        if not got.put:
            continue
        base = samples["cache_raw" if name.startswith("cache") else "raw"]
        row: dict[str, Any] = {"path": name}
        for what in ("put", "get"):
            mine, theirs = getattr(got, what), getattr(base, what)
            row[f"{what}_gbps"] = gbps(cell.total, mine)
            # each repetition ran both sides under the same load: the median of per-repetition
            # ratios is the headline; the ratio of the medians is kept for reference
            row[f"{what}_ratio"] = statistics.median(
                r / k for r, k in zip(theirs, mine, strict=True)
            )
            row[f"{what}_ratio_of_medians"] = statistics.median(theirs) / statistics.median(mine)
            row[f"{what}_s"] = mine
            if name in ONE_OBJECT:  # against raw Mooncake moving the same one object per page
                one = getattr(samples["raw_one_object"], what)
                row[f"{what}_ratio_one_object"] = statistics.median(
                    r / k for r, k in zip(one, mine, strict=True)
                )
        rows.append(row)
    return {
        "page_bytes": cell.page_bytes,
        "page_tokens": cell.tokens,
        "batch_pages": cell.batch,
        "calls": cell.calls,
        "total_bytes": cell.total,
        "object_bytes": cell.page_bytes // shape.planes,
        "cache_backup_retries": retries,
        "cache_raw_objects_per_page": len(cache_raw_path.keyspace.components) if with_cache else 0,
        "query_wait_us": [wait * 1e6 for wait in query_waits],
        "seconds": time.perf_counter() - started,
        "rows": rows,
    }


def run_cache(
    cell: Cell,
    *,
    client: MooncakeClient,
    raw: RawStore,
    raw_path: RawPath,
    direct: HostKVPool,
    backend: MooncakeBackend,
    repeats: int,
    samples: dict[str, Samples],
    query_waits: list[float],
    query_lane: bool = True,
) -> int:
    """Cache rows: each repetition runs the raw put/get of the same bytes that their ratios are
    taken against, the cache, and the cache from L2, in an order that rotates from repetition to
    repetition. Returns backup retries seen."""
    cache = CachePath(client, cell, direct, backend, query_lane)
    waits = cache.query_waits
    retries = 0
    try:
        paths = ("raw", "cache", "cache_l2")
        for rep in range(-1, repeats):  # -1: warm-up, not recorded
            order = paths[rep % 3 :] + paths[: rep % 3]
            for what in order:
                if what == "raw":
                    # the pages written just before their puts, untimed, as the cache's backups
                    # put what its write-through just wrote: a put of memory written just before
                    # it is slower than one of memory written long ago (docs/benchmarks.md)
                    fill(raw_path.host, 1 << 40)
                    put_s, get_s = run_alone(
                        raw_path, "raw", f"{cell.page_bytes}/c{rep}", cell.calls, False
                    )
                    into = samples["cache_raw"]
                else:
                    put_s, get_s, retried = cache.run(from_l2=what == "cache_l2")
                    retries += retried if rep >= 0 else 0
                    into = samples[what]
                clear(client, raw)
                if rep >= 0:
                    into.put.append(put_s)
                    into.get.append(get_s)
    finally:
        cache.close()  # closes the direct backend and cache B's backend too
    del waits[:2]  # the warm-up repetition's two runs
    query_waits.extend(waits)
    return retries


# --------------------------------------------------------------------------------------------- exists
def exists_paths(
    native: Any,
    client: MooncakeClient,
    backends: tuple[MooncakeBackend, MooncakeBackend],
    texts: list[str],
    pages: Sequence[PageHash],
    *,
    spare: RawStore,
) -> dict[str, Callable[[], object]]:
    """The timed calls of one exists row, by name: ``backends`` are kvstrata's and its twin's
    (``keys``: what ``exists`` renders, issue 20). Raw runs on three native instances of the same
    master: the benchmark's raw client (``native``), kvstrata's own (``raw_same``: the baseline
    of the headline ratio, the same instance ``exists`` calls) and a second raw client set up
    like the first (``raw_second``), which shows how far two instances differ on their own."""
    backend, twin = backends
    keyspace = backend.keyspace
    rendered = keyspace.rendered(NAMESPACE, pages)
    same, second = SameInstance(client).native, spare.native
    return {
        "raw": lambda: native.batch_is_exist(texts),
        "raw_same": lambda: same.batch_is_exist(texts),
        "raw_second": lambda: second.batch_is_exist(texts),
        "client": lambda: client.batch_is_exist(rendered),
        "kvstrata": lambda: backend.exists(NAMESPACE, pages),
        "twin": lambda: twin.exists(NAMESPACE, pages),
        "keys": lambda: keyspace.rendered(NAMESPACE, pages),
    }


def run_exists(
    cell: Cell, client: MooncakeClient, raw: RawStore, quick: bool
) -> list[dict[str, Any]]:
    """Latency of ``exists`` (kvstrata, twice: two backends alike) and of the raw ``batch_is_exist`` on
    the same keys."""
    count = max(EXISTS_SIZES)
    keyspace = keyspace_of(cell)
    host = HostKVPool(shape_of(cell), count, HostLayout.PAGE_FIRST_DIRECT, pin_memory=False)
    fill(host, 5 << 40)
    backend = MooncakeBackend(client, keyspace)
    twin = MooncakeBackend(client, keyspace)
    spare = RawStore(client.config.master, client.config.local_buffer_size)
    rows = []
    try:
        backend.attach(host)
        twin.attach(host)
        stored = fresh_pages("exists/stored", count)
        for chunk in batches(list(range(count)), 256):
            statuses = backend.put(NAMESPACE, [stored[i] for i in chunk], list(chunk))
            if any(status is not PutStatus.STORED for status in statuses):
                raise BenchError("exists: could not store the pages to query")
        absent = fresh_pages("exists/absent", count)
        native = raw.native
        for n in EXISTS_SIZES:
            reps = (20 if n < 1024 else 5) if quick else (200 if n < 1024 else 40)
            for kind, pages in (("hit", stored[:n]), ("miss", absent[:n])):
                texts = key_texts(keyspace, pages)
                want_raw = [1 if kind == "hit" else 0] * len(texts)
                want = n if kind == "hit" else 0
                calls = exists_paths(native, client, (backend, twin), texts, pages, spare=spare)
                times: dict[str, list[float]] = {name: [] for name in calls}
                order = list(calls)
                for rep in range(reps):
                    answers: dict[str, object] = {}
                    turn = rep % len(order)  # each path first in turn: no path always follows raw
                    for name in order[turn:] + order[:turn]:
                        start = time.perf_counter()
                        answers[name] = calls[name]()
                        times[name].append(time.perf_counter() - start)
                    codes = list(answers["raw"])  # type: ignore[call-overload]
                    if any(
                        list(answers[name]) != want_raw  # type: ignore[call-overload]
                        for name in ("raw_same", "raw_second")
                    ):
                        raise BenchError(f"exists of {n} pages ({kind}): the raw instances differ")
                    found, found_twin = answers["kvstrata"], answers["twin"]
                    if (
                        codes != want_raw
                        or answers["client"] != want_raw
                        or found != want
                        or found_twin != want
                    ):
                        raise BenchError(
                            f"exists of {n} pages ({kind}): raw {sorted(set(codes))}, "
                            f"kvstrata {found}, twin {found_twin}"
                        )
                rows.append(
                    {
                        "pages": n,
                        "keys": len(texts),
                        "kind": kind,
                        "repeats": reps,
                        "raw_us": median_us(times["raw"]),
                        "raw_same_us": median_us(times["raw_same"]),
                        "raw_second_us": median_us(times["raw_second"]),
                        "client_us": median_us(times["client"]),
                        "kvstrata_us": median_us(times["kvstrata"]),
                        "twin_us": median_us(times["twin"]),
                        "key_render_us": median_us(times["keys"]),
                    }
                )
    finally:
        spare.close()
        twin.close()
        backend.close()
        clear(client, raw)
    return rows


def prefault(raw: RawStore | SameInstance, segment: int) -> None:
    """Write about 85% of the segment once through ``raw``, so the storage node's memory is
    committed before anything is timed (a store that fills up earlier just ends this early). The
    objects stay: the caller empties the store (:func:`clear`)."""
    size, per_call = 4 * MIB, 16
    buffer = torch.ones(size * per_call, dtype=torch.uint8)
    ptr = buffer.data_ptr()
    raw.register(ptr, buffer.numel())
    try:
        written, call = 0, 0
        while written < segment * 0.85:
            keys = [f"bench-prefault/{call}/{i}" for i in range(per_call)]
            ptrs = [ptr + i * size for i in range(per_call)]
            codes = raw.native.batch_put_from(keys, ptrs, [size] * per_call)
            call += 1
            written += size * sum(1 for code in codes if code == 0)
            if any(code != 0 for code in codes):
                break
    finally:
        raw.unregister(ptr)


@contextmanager
def bench_store(segment_bytes: int) -> Iterator[tuple[MooncakeClient, RawStore]]:
    """A started :class:`LocalCluster` whose storage node owns ``segment_bytes`` (written once, so
    no timed path pays its first-touch page faults), a kvstrata client and a raw client on it; all
    three are stopped on exit. :class:`SetupError` when the cluster cannot start here.

    The segment is written through a third native client, closed before the raw one is set up: a
    client that has put large objects stays slower at putting small ones (``client_history.py``:
    1.2-1.8x for 128 KiB objects after one batch of 4 MiB objects), so the prefault's client must
    be neither of the two that are timed. Both start fresh; a benchmark that runs small cells after
    large ones gives both the same history by interleaving their calls."""
    try:
        cluster = LocalCluster(segment_size=segment_bytes).start()
    except KvStrataError as error:
        reason = str(error).splitlines()[0]
        raise SetupError(f"cannot start the local Mooncake cluster: {reason}") from None
    client: MooncakeClient | None = None
    raw: RawStore | None = None
    try:
        client = MooncakeClient(cluster.config).setup()
        writer = RawStore(cluster.master_address, cluster.config.local_buffer_size)
        try:
            prefault(writer, segment_bytes)
        finally:
            writer.close()
        raw = RawStore(cluster.master_address, cluster.config.local_buffer_size)
        clear(client, raw)
        yield client, raw
    finally:
        if raw is not None:
            raw.close()
        if client is not None:
            client.close()
        cluster.stop()


# ----------------------------------------------------------------------------------------------- main
def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="an eighth of the bytes (CI smoke)")
    parser.add_argument(
        "--repeats", type=int, default=None, help="recorded repetitions (7; 2 quick)"
    )
    parser.add_argument(
        "--sizes", default="64,256,1024,4096", help="page sizes in KiB (of 64,256,1024,4096)"
    )
    parser.add_argument("--segment-mib", type=int, default=None, help="storage node segment")
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    parser.add_argument("--skip-cache", action="store_true", help="no cache backup/prefetch rows")
    parser.add_argument(
        "--cache-schema",
        type=int,
        choices=(1, 2),
        default=1,
        help="the cache rows' key schema: 1 (page_first_direct pools) or 2 (page_major pools)",
    )
    parser.add_argument("--skip-exists", action="store_true", help="no exists latency table")
    parser.add_argument(
        "--query-on-read-lane",
        action="store_true",
        help="cache B's prefetch queries share the fetches' lane (as before issue 20's query lane)",
    )
    parser.add_argument("--json", type=Path, default=None, help="write every number here")
    args = parser.parse_args(argv)
    table = QUICK if args.quick else FULL
    try:
        args.cells = [table[int(size)] for size in args.sizes.split(",")]
    except (KeyError, ValueError):
        parser.error(f"--sizes: expected a comma list of {sorted(table)}, got {args.sizes!r}")
    if args.repeats is None:
        args.repeats = 2 if args.quick else 7
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    if args.segment_mib is None:  # every path's objects at once, under the 90% eviction watermark
        largest = max(cell.total for cell in args.cells) // MIB
        args.segment_mib = max(512, (len(INTERLEAVED) + 1) * largest + 128)
    return args


def _mooncake_version() -> str:
    from importlib.metadata import PackageNotFoundError, version  # noqa: PLC0415

    for name in ("mooncake-transfer-engine-non-cuda", "mooncake-transfer-engine"):
        try:
            return f"{name} {version(name)}"
        except PackageNotFoundError:
            continue
    return "unknown"


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    started = time.perf_counter()
    load_start = os.getloadavg()
    result: dict[str, Any] = {
        "config": {
            "model": {
                "kind": "mha",
                "layers": LAYERS,
                "heads": HEADS,
                "head_dim": HEAD_DIM,
                "dtype": "bfloat16",
                "bytes_per_token": BYTES_PER_TOKEN,
            },
            "repeats": args.repeats,
            "quick": args.quick,
            "segment_bytes": args.segment_mib * MIB,
            "threads": args.threads,
            "cache_schema": args.cache_schema,
            "query_on_read_lane": args.query_on_read_lane,
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "mooncake": _mooncake_version(),
            "date": time.strftime("%Y-%m-%d"),
        },
        "cells": [],
        "exists": [],
    }
    with bench_store(args.segment_mib * MIB) as (client, raw):
        for cell in args.cells:
            print(
                f"cell {cell.label}: {cell.batch} pages x {cell.calls} calls ...",
                file=sys.stderr,
                flush=True,
            )
            result["cells"].append(
                run_cell(
                    cell,
                    client,
                    raw,
                    args.repeats,
                    not args.skip_cache,
                    cache_schema=args.cache_schema,
                    query_lane=not args.query_on_read_lane,
                )
            )
            gc.collect()
        if not args.skip_exists:
            print("exists latency ...", file=sys.stderr, flush=True)
            result["exists"] = run_exists(args.cells[0], client, raw, args.quick)
    result["seconds"] = time.perf_counter() - started
    result["loadavg"] = {"start": load_start, "end": os.getloadavg()}
    return result


def print_tables(result: dict[str, Any]) -> None:
    config = result["config"]
    print(
        f"MHA {LAYERS} layers x {HEADS} heads x {HEAD_DIM}, bf16 ({BYTES_PER_TOKEN // KIB} KiB/token); "
        f"median of {config['repeats']}; {result['seconds']:.0f} s; 1-min load average "
        f"{result['loadavg']['start'][0]:.2f} -> {result['loadavg']['end'][0]:.2f}"
    )
    print()
    print("| page (tokens) | batch x calls | path | put GB/s | put ÷ raw | get GB/s | get ÷ raw |")
    print("|---|---|---|---:|---:|---:|---:|")
    for cell in result["cells"]:
        size = cell["page_bytes"]
        label = f"{size // MIB} MiB" if size >= MIB else f"{size // KIB} KiB"
        for n, row in enumerate(cell["rows"]):
            head = f"| {label} ({cell['page_tokens']}) | {cell['batch_pages']} x {cell['calls']} "
            print(
                f"{head if n == 0 else '| | '}| {PATH_NAMES[row['path']]} | {row['put_gbps']:.2f} "
                f"| {row['put_ratio']:.2f} | {row['get_gbps']:.2f} | {row['get_ratio']:.2f} |"
            )
    if result["exists"]:
        print()
        print(
            "| pages (keys) | lookup | raw µs: benchmark's client / second client / kvstrata's "
            "instance | kvstrata's client µs | kvstrata `exists` µs | **÷ raw, same instance** "
            "| ÷ raw, benchmark's client | ÷ client | key rendering µs | a second backend's `exists` µs |"
        )
        print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|")
        for row in result["exists"]:
            print(
                f"| {row['pages']} ({row['keys']}) | {row['kind']} | {row['raw_us']:.0f} / "
                f"{row['raw_second_us']:.0f} / {row['raw_same_us']:.0f} | "
                f"{row['client_us']:.0f} | {row['kvstrata_us']:.0f} | "
                f"**{row['kvstrata_us'] / row['raw_same_us']:.2f}** | "
                f"{row['kvstrata_us'] / row['raw_us']:.2f} | "
                f"{row['kvstrata_us'] / row['client_us']:.2f} | "
                f"{row['key_render_us']:.0f} | {row['twin_us']:.0f} |"
            )
    print()
    for cell in result["cells"]:
        second = next(row for row in cell["rows"] if row["path"] == "raw_second")
        drift(f"{cell['page_bytes'] // KIB} KiB", second["put_ratio"], second["get_ratio"])
        for row in cell["rows"]:
            if row["path"] in ("raw", "raw_second", "cache_raw", "raw_one_object"):
                continue
            verdict = ", ".join(
                f"{what} {row[f'{what}_ratio']:.2f} (ratio of medians "
                f"{row[f'{what}_ratio_of_medians']:.2f}) "
                f"{'meets' if row[f'{what}_ratio'] >= GOAL else 'misses'} {GOAL}"
                for what in ("put", "get")
            )
            if row["path"] in ONE_OBJECT:
                verdict += ", ÷ raw one object: " + ", ".join(
                    f"{what} {row[f'{what}_ratio_one_object']:.2f}" for what in ("put", "get")
                )
            print(f"{cell['page_bytes'] // KIB} KiB {row['path']}: {verdict}")
        if cell["query_wait_us"]:
            waits = cell["query_wait_us"]
            print(
                f"{cell['page_bytes'] // KIB} KiB query behind fetches: median "
                f"{statistics.median(waits):.0f} µs, max {max(waits):.0f} µs ({len(waits)} runs)"
            )
        if cell["cache_backup_retries"]:
            print(f"{cell['page_bytes'] // KIB} KiB cache: {cell['cache_backup_retries']} retries")


DRIFT = 0.15
"""How far the second native client may lie from kvstrata's instance before a run says so."""


def drift(where: str, put_ratio: float, get_ratio: float) -> None:
    """One line when the second native client's raw calls (``put_ratio``, ``get_ratio``: raw
    seconds on kvstrata's instance over the second client's) differ from the baseline's by more than
    :data:`DRIFT`: the two instances drifted apart in this run (``client_history.py``), which the
    baseline on kvstrata's own instance keeps out of the ratios."""
    if max(abs(put_ratio - 1), abs(get_ratio - 1)) > DRIFT:
        print(
            f"{where}: the second native client ran at {put_ratio:.2f} (put) / {get_ratio:.2f} "
            "(get) of kvstrata's instance: the instances drifted apart in this run"
        )


def report(
    name: str,
    run: Callable[[], dict[str, Any]],
    print_table: Callable[[dict[str, Any]], None],
    json_path: Path | None,
) -> int:
    """A benchmark's ``run``, then its table on stdout and every number in ``json_path``. The exit
    status: 0; 2 when the cluster cannot be started here; 1 on a failure (one line on stderr, no
    traceback). Shared by the benchmarks that import this one."""
    try:
        result = run()
    except SetupError as error:
        print(f"{name}: {error}", file=sys.stderr)
        return 2
    except (BenchError, KvStrataError, OSError) as error:
        print(f"{name}: failed: {str(error).splitlines()[0]}", file=sys.stderr)
        return 1
    print_table(result)
    if json_path is not None:
        json_path.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    return report("l3_throughput", lambda: run(args), print_tables, args.json)


if __name__ == "__main__":
    sys.exit(main())
