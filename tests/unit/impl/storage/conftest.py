"""Shared fixtures of the storage tests.

Mooncake: one real cluster per session (:class:`LocalCluster`: a ``mooncake_master`` on a free
loopback port plus a storage node that owns 128 MiB of segment), one scheduler-side client on it (a
client's ``close()`` costs up to 2 s, so clients live as long as the session), and ``mooncake_store``,
which empties the store (``remove_all(force=True)``, leases notwithstanding) before each test.

Pages: ``page_kit`` builds host pools and key spaces, fills host slots with a bit pattern that is a pure
function of (page hash, plane) and checks slots against it, so any process that knows the page hashes
can verify bytes it never saw written (``page_kit_source`` is that code, for a subprocess).
"""

from __future__ import annotations

import inspect
import random
from collections.abc import Iterator, Sequence

import numpy
import pytest
import torch

from kvstrata.impl.pools import HostKVPool, HostLayout, KVShape
from kvstrata.impl.storage.mooncake import LocalCluster, MooncakeClient
from kvstrata.model.keys import (
    KeySpace,
    KVKind,
    ModelIdentity,
    Namespace,
    PageHash,
    Shard,
    chain_page_hashes,
)


# ------------------------------------------------------------------------------------ page patterns
def pattern(page: PageHash, plane: int, nbytes: int) -> bytes:
    """The bytes every storage test puts in ``plane`` of the page named ``page``."""
    return random.Random(page.digest + bytes([plane])).randbytes(nbytes)


def fill_pages(host: HostKVPool, indices: Sequence[int], pages: Sequence[PageHash]) -> None:
    """Write each page's pattern into its host slot, every plane."""
    for index, page in zip(indices, pages, strict=True):
        for plane in range(host.shape.planes):
            slab = host.page_slab(plane, index).view(torch.uint8).numpy()
            slab[:] = numpy.frombuffer(pattern(page, plane, slab.size), dtype=numpy.uint8)


def pages_hold(host: HostKVPool, indices: Sequence[int], pages: Sequence[PageHash]) -> bool:
    """Whether each host slot holds exactly its page's pattern, bit for bit."""
    for index, page in zip(indices, pages, strict=True):
        for plane in range(host.shape.planes):
            slab = host.page_slab(plane, index).view(torch.uint8)
            if slab.numpy().tobytes() != pattern(page, plane, slab.numel()):
                return False
    return True


class PageKit:
    """Small MHA and MLA page shapes, their key spaces, host pools and page hashes."""

    MHA = KVShape(KVKind.MHA, layers=2, heads=2, head_dim=16, dtype=torch.bfloat16, page_size=4)
    MLA = KVShape(KVKind.MLA, layers=3, heads=1, head_dim=32, dtype=torch.float16, page_size=2)
    NS = Namespace(extra_key="lora-3", salt="tenant-x")
    TAG = "blue-1"

    fill = staticmethod(fill_pages)
    holds = staticmethod(pages_hold)

    def shape(self, kind: KVKind) -> KVShape:
        return self.MHA if kind is KVKind.MHA else self.MLA

    def host(
        self, kind: KVKind, pages: int = 8, layout: HostLayout = HostLayout.PAGE_FIRST
    ) -> HostKVPool:
        return HostKVPool(self.shape(kind), pages, layout, pin_memory=False)

    def model(self, kind: KVKind, name: str = "tiny-llama") -> ModelIdentity:
        shape = self.shape(kind)
        dtype = str(shape.dtype).removeprefix("torch.")
        return ModelIdentity(name=name, dtype=dtype, kind=kind, page_size=shape.page_size)

    def keyspace(
        self,
        kind: KVKind,
        *,
        name: str = "tiny-llama",
        shard: Shard | None = None,
        tag: str | None = TAG,
        schema: int = 1,
    ) -> KeySpace:
        if shard is None:
            shard = Shard(tp_rank=0, tp_size=2) if kind is KVKind.MHA else Shard.replicated()
        return KeySpace(model=self.model(kind, name), shard=shard, tag=tag, schema=schema)

    def pages(
        self, kind: KVKind, count: int, first_token: int = 0, namespace: Namespace = NS
    ) -> list[PageHash]:
        size = self.shape(kind).page_size
        tokens = list(range(first_token, first_token + count * size))
        return list(chain_page_hashes(tokens, size, namespace))


@pytest.fixture(scope="session")
def page_kit() -> PageKit:
    return PageKit()


@pytest.fixture(scope="session")
def page_kit_source() -> str:
    """The page helpers of this module as source, for scripts that run in another process (they
    need this module's imports)."""
    return "\n\n".join(
        inspect.getsource(item) for item in (pattern, fill_pages, pages_hold, PageKit)
    )


# ---------------------------------------------------------------------------------------- mooncake
@pytest.fixture(scope="session")
def mooncake_cluster() -> Iterator[LocalCluster]:
    """A real master and storage node for the whole session."""
    with LocalCluster(segment_size="128mib") as cluster:
        yield cluster


@pytest.fixture(scope="session")
def mooncake_client(mooncake_cluster: LocalCluster) -> Iterator[MooncakeClient]:
    """A scheduler-side client (no segment of its own) of :func:`mooncake_cluster`."""
    with MooncakeClient(mooncake_cluster.config) as client:
        yield client


@pytest.fixture
def mooncake_store(mooncake_client: MooncakeClient) -> MooncakeClient:
    """:func:`mooncake_client` on an empty store."""
    assert mooncake_client.remove_all(force=True) >= 0
    return mooncake_client
