"""MooncakeBackend against the session's real master and storage node: round trips bit for bit (MHA and
MLA, both page-first layouts, a deployment tag and a non-default namespace), key-space isolation,
writer roles, exists-then-put-missing, partial pages, misuse, and sharing with another process."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable, Iterator

import attrs
import pytest
import torch

from kvstrata.impl.errors import ConfigError, MisuseError, StoreUnavailable
from kvstrata.impl.pools import HostKVPool, HostLayout
from kvstrata.impl.storage.base import GetStatus, PutStatus, StorageBackend
from kvstrata.impl.storage.counters import BackendCounters
from kvstrata.impl.storage.mooncake import LocalCluster, MooncakeBackend, MooncakeClient
from kvstrata.model.keys import DEFAULT_NAMESPACE, KVKind, Namespace, Shard

KINDS = [KVKind.MHA, KVKind.MLA]
LAYOUTS = [HostLayout.PAGE_FIRST, HostLayout.PAGE_FIRST_DIRECT]


@pytest.fixture
def backends(mooncake_store: MooncakeClient) -> Iterator[list[MooncakeBackend]]:
    """Backends a test makes (closed after it: their buffer registrations end)."""
    made: list[MooncakeBackend] = []
    yield made
    for backend in made:
        backend.close()


MakeBackend = Callable[..., MooncakeBackend]


@pytest.fixture
def make(mooncake_store: MooncakeClient, backends: list[MooncakeBackend], page_kit) -> MakeBackend:
    """``make(kind, host=None, writer=True, staging_bytes=..., exists_before_put=False,
    **keyspace_fields)``: a backend on the session client."""

    def make(
        kind: KVKind,
        host: HostKVPool | None = None,
        *,
        writer: bool = True,
        staging_bytes: int = 64 << 20,
        exists_before_put: bool = False,
        **keyspace: object,
    ) -> MooncakeBackend:
        backend = MooncakeBackend(
            mooncake_store,
            page_kit.keyspace(kind, **keyspace),
            writer=writer,
            staging_bytes=staging_bytes,
            exists_before_put=exists_before_put,
        )
        backends.append(backend)
        if host is not None:
            backend.attach(host)
        return backend

    return make


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda layout: layout.value)
@pytest.mark.parametrize("kind", KINDS, ids=lambda kind: kind.value)
def test_round_trip_bit_for_bit(
    make: MakeBackend, page_kit, kind: KVKind, layout: HostLayout
) -> None:
    host = page_kit.host(kind, layout=layout)
    backend = make(kind, host)
    assert isinstance(backend, StorageBackend)
    ns = page_kit.NS
    pages = page_kit.pages(kind, 3)
    page_kit.fill(host, [5, 0, 3], pages)

    assert backend.exists(ns, pages) == 0
    assert backend.put(ns, pages, [5, 0, 3]) == [PutStatus.STORED] * 3
    assert backend.exists(ns, pages) == 3
    # no exists before a put: the master deduplicates the re-put, the confirm says STORED
    assert backend.put(ns, pages, [5, 0, 3]) == [PutStatus.STORED] * 3
    assert backend.get(ns, pages, [1, 2, 7]) == [GetStatus.LOADED] * 3
    assert page_kit.holds(host, [1, 2, 7], pages)

    nbytes = 3 * host.shape.bytes_per_page
    assert backend.counters.snapshot() == BackendCounters(
        puts_stored=6, gets_loaded=3, bytes_written=2 * nbytes, bytes_read=nbytes
    )
    assert backend.errors.total == 0


@pytest.mark.parametrize("kind", KINDS, ids=lambda kind: kind.value)
def test_host_layouts_share_objects_and_staging_moves_in_chunks(
    make: MakeBackend, page_kit, kind: KVKind
) -> None:
    # objects are canonical [L, page, H, D] whatever the layout: page_first stages (here one page per
    # chunk), page_first_direct is zero-copy, and each reads what the other wrote, bit for bit
    ns = page_kit.NS
    staged_host = page_kit.host(kind, pages=10, layout=HostLayout.PAGE_FIRST)
    direct_host = page_kit.host(kind, pages=10, layout=HostLayout.PAGE_FIRST_DIRECT)
    staged = make(kind, staged_host, staging_bytes=staged_host.shape.bytes_per_page)
    direct = make(kind, direct_host)
    first, second = page_kit.pages(kind, 5), page_kit.pages(kind, 5, first_token=500)
    page_kit.fill(staged_host, range(5), first)
    page_kit.fill(direct_host, range(5), second)

    assert staged.put(ns, first, list(range(5))) == [PutStatus.STORED] * 5
    assert direct.put(ns, second, list(range(5))) == [PutStatus.STORED] * 5
    assert direct.get(ns, first, [9, 8, 7, 6, 5]) == [GetStatus.LOADED] * 5
    assert staged.get(ns, second, [5, 6, 7, 8, 9]) == [GetStatus.LOADED] * 5

    def canonical_bits(host: HostKVPool, slots: list[int]) -> bytes:
        return host.read_pages(slots).contiguous().view(-1).view(torch.uint8).numpy().tobytes()

    assert canonical_bits(direct_host, [9, 8, 7, 6, 5]) == canonical_bits(
        staged_host, [0, 1, 2, 3, 4]
    )
    assert canonical_bits(staged_host, [5, 6, 7, 8, 9]) == canonical_bits(
        direct_host, [0, 1, 2, 3, 4]
    )


def test_keys_are_the_schema_keys(
    make: MakeBackend, page_kit, mooncake_store: MooncakeClient
) -> None:
    host = page_kit.host(KVKind.MHA)
    backend = make(KVKind.MHA, host)
    pages = page_kit.pages(KVKind.MHA, 1)
    backend.put(page_kit.NS, pages, [0])
    keys = backend.keyspace.page_keys(page_kit.NS, pages[0])
    assert [key.text.split("/")[1] for key in keys] == [page_kit.TAG] * 2
    assert mooncake_store.batch_is_exist(keys) == [1, 1]


@pytest.mark.parametrize("kind", KINDS, ids=lambda kind: kind.value)
def test_another_key_space_or_namespace_sees_nothing(
    make: MakeBackend, page_kit, kind: KVKind
) -> None:
    host = page_kit.host(kind)
    ns = page_kit.NS
    pages = page_kit.pages(kind, 2)
    page_kit.fill(host, [0, 1], pages)
    assert make(kind, host).put(ns, pages, [0, 1]) == [PutStatus.STORED] * 2

    shards = {KVKind.MHA: Shard(tp_rank=0, tp_size=4), KVKind.MLA: Shard.replicated(pp_size=2)}
    strangers = [
        make(kind, page_kit.host(kind), name="other-model"),
        make(kind, page_kit.host(kind), shard=shards[kind]),
        make(kind, page_kit.host(kind), tag="green-2"),
        make(kind, page_kit.host(kind), tag=None),
    ]
    for stranger in strangers:
        assert stranger.exists(ns, pages) == 0
        assert stranger.get(ns, pages, [4, 5]) == [GetStatus.MISSING] * 2
    same = make(kind, page_kit.host(kind))
    for other in (DEFAULT_NAMESPACE, Namespace(extra_key="lora-3", salt="tenant-y")):
        assert same.exists(other, pages) == 0
        assert same.get(other, pages, [4, 5]) == [GetStatus.MISSING] * 2
    assert same.exists(ns, pages) == 2


def test_a_non_writer_skips_without_a_store_call(make: MakeBackend, page_kit) -> None:
    host = page_kit.host(KVKind.MLA)
    pages = page_kit.pages(KVKind.MLA, 2)
    page_kit.fill(host, [0, 1], pages)
    follower = make(KVKind.MLA, host, writer=False)
    assert follower.put(page_kit.NS, pages, [0, 1]) == [PutStatus.SKIPPED] * 2
    assert follower.counters.snapshot() == BackendCounters(puts_skipped=2)
    assert follower.exists(page_kit.NS, pages) == 0

    leader = make(KVKind.MLA, host)  # the same host pool and client: one registration, shared
    assert leader.put(page_kit.NS, pages, [0, 1]) == [PutStatus.STORED] * 2
    assert follower.exists(page_kit.NS, pages) == 2
    assert follower.get(page_kit.NS, pages, [6, 7]) == [GetStatus.LOADED] * 2
    assert page_kit.holds(host, [6, 7], pages)


def test_sharded_kv_is_written_by_every_rank(make: MakeBackend, page_kit) -> None:
    pages = page_kit.pages(KVKind.MHA, 1)
    ranks = [make(KVKind.MHA, page_kit.host(KVKind.MHA), shard=Shard(r, 2)) for r in (0, 1)]
    for rank in ranks:
        assert rank.put(page_kit.NS, pages, [0]) == [PutStatus.STORED]  # each its own shard


def test_exists_counts_consecutive_pages_and_a_partial_page_is_a_miss(
    make: MakeBackend, page_kit, mooncake_store: MooncakeClient
) -> None:
    host = page_kit.host(KVKind.MHA)
    backend = make(KVKind.MHA, host, exists_before_put=True)
    ns = page_kit.NS
    pages = page_kit.pages(KVKind.MHA, 4)
    page_kit.fill(host, [0, 1, 2, 3], pages)
    backend.put(ns, [pages[0], pages[1], pages[3]], [0, 1, 3])
    assert backend.exists(ns, pages) == 2
    assert backend.exists(ns, pages[3:]) == 1

    _, v_key = backend.keyspace.page_keys(ns, pages[1])
    assert mooncake_store.batch_remove([v_key], force=True) == [0]  # as eviction would
    assert backend.exists(ns, pages) == 1
    assert backend.get(ns, pages[:2], [4, 5]) == [GetStatus.LOADED, GetStatus.MISSING]
    assert page_kit.holds(host, [4], pages[:1])
    assert backend.put(ns, pages, [0, 1, 2, 3]) == [
        PutStatus.EXISTED,
        PutStatus.STORED,  # only the missing v object was written
        PutStatus.STORED,
        PutStatus.EXISTED,
    ]
    objects = 3 * 2 + 1 + 2  # the first put, the v of page 1, both objects of page 2
    assert backend.counters.bytes_written == objects * host.shape.bytes_per_page // 2


@pytest.mark.parametrize("exists_before_put", [False, True])
def test_put_keeps_the_first_bytes_and_writes_a_repeated_page_once(
    make: MakeBackend, page_kit, exists_before_put: bool
) -> None:
    host = page_kit.host(KVKind.MLA)
    backend = make(KVKind.MLA, host, exists_before_put=exists_before_put)
    ns = page_kit.NS
    pages = page_kit.pages(KVKind.MLA, 2)
    page_kit.fill(host, [0, 1], pages)
    assert backend.put(ns, [pages[0], pages[0], pages[1]], [0, 2, 1]) == [
        PutStatus.STORED,
        PutStatus.EXISTED,
        PutStatus.STORED,
    ]
    page_kit.fill(host, [0], pages[1:])  # slot 0 now holds other bytes
    again = PutStatus.EXISTED if exists_before_put else PutStatus.STORED
    assert backend.put(ns, pages[:1], [0]) == [again]
    assert backend.get(ns, pages, [4, 5]) == [GetStatus.LOADED] * 2
    assert page_kit.holds(host, [4, 5], pages)


def test_empty_batches_and_misuse(make: MakeBackend, page_kit) -> None:
    host = page_kit.host(KVKind.MHA)
    unattached = make(KVKind.MHA)
    pages = page_kit.pages(KVKind.MHA, 2)
    with pytest.raises(MisuseError, match="not attached"):
        unattached.exists(page_kit.NS, pages)
    with pytest.raises(ConfigError, match="layer_first"):
        unattached.attach(HostKVPool(host.shape, 4, HostLayout.LAYER_FIRST, pin_memory=False))
    with pytest.raises(ConfigError, match="key space names"):
        unattached.attach(page_kit.host(KVKind.MLA))
    backend = make(KVKind.MHA, host)
    backend.attach(host)  # the same pool again
    with pytest.raises(MisuseError, match="another host pool"):
        backend.attach(page_kit.host(KVKind.MHA))
    assert backend.exists(page_kit.NS, []) == 0
    assert backend.put(page_kit.NS, [], []) == []
    assert backend.get(page_kit.NS, [], []) == []
    for call in (
        lambda: backend.put(page_kit.NS, pages, [0]),
        lambda: backend.get(page_kit.NS, pages, [0, host.num_pages]),
        lambda: backend.put(page_kit.NS, [pages[0].hex()], [0]),
        lambda: backend.exists("default", pages),
        lambda: backend.put(page_kit.NS, (page for page in pages), [0, 1]),
    ):
        with pytest.raises(MisuseError):
            call()
    assert backend.exists(page_kit.NS, pages) == 0
    assert backend.counters.snapshot() == BackendCounters()


def test_after_close_the_backend_refuses_and_the_objects_stay(make: MakeBackend, page_kit) -> None:
    host = page_kit.host(KVKind.MLA)
    backend = make(KVKind.MLA, host)
    pages = page_kit.pages(KVKind.MLA, 1)
    backend.put(page_kit.NS, pages, [0])
    backend.close()
    backend.close()
    with pytest.raises(MisuseError, match="closed"):
        backend.exists(page_kit.NS, pages)
    with pytest.raises(MisuseError, match="closed"):
        backend.attach(host)
    assert make(KVKind.MLA, host).exists(page_kit.NS, pages) == 1


def test_a_backend_needs_a_ready_client(page_kit, mooncake_cluster: LocalCluster) -> None:
    keyspace = page_kit.keyspace(KVKind.MHA)
    with pytest.raises(StoreUnavailable, match="new"):
        MooncakeBackend(MooncakeClient(mooncake_cluster.config), keyspace)
    with pytest.raises(MisuseError):
        MooncakeBackend(mooncake_cluster.master_address, keyspace)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------- another process
@attrs.frozen
class PeerSpec:
    """What the peer process needs to build the same pages (as JSON)."""

    master: str
    first: int  # the peer puts the pages of the tokens from here on
    second: int  # ...and gets the pages of the tokens from here on, which this test puts


PEER_MAIN = """
def main(spec):
    kit = PageKit()
    kind = KVKind.MHA
    host = kit.host(kind)
    ns = kit.NS
    mine, yours = kit.pages(kind, 3, spec["first"]), kit.pages(kind, 3, spec["second"])
    with MooncakeClient(MooncakeConfig(master=spec["master"])) as client:
        backend = MooncakeBackend(client, kit.keyspace(kind))
        backend.attach(host)
        fill_pages(host, [0, 1, 2], mine)
        put = backend.put(ns, mine, [0, 1, 2])
        print(json.dumps({"put": [s.value for s in put]}), flush=True)
        sys.stdin.readline()  # the test has put its pages
        got = backend.get(ns, yours, [5, 6, 7])
        ok = pages_hold(host, [5, 6, 7], yours)
        print(json.dumps({"get": [s.value for s in got], "bit_for_bit": ok}), flush=True)
        backend.close()


main(json.loads(sys.argv[1]))
"""

PEER_IMPORTS = """
from __future__ import annotations

import json, random, sys
from collections.abc import Sequence

import numpy
import torch

from kvstrata.impl.pools import HostKVPool, HostLayout, KVShape
from kvstrata.impl.storage.mooncake import MooncakeBackend, MooncakeClient, MooncakeConfig
from kvstrata.model.keys import (
    KeySpace, KVKind, ModelIdentity, Namespace, PageHash, Shard, chain_page_hashes,
)
"""


def test_pages_put_in_one_process_are_read_bit_for_bit_in_another(
    make: MakeBackend, page_kit, page_kit_source: str, mooncake_cluster: LocalCluster
) -> None:
    spec = PeerSpec(master=mooncake_cluster.master_address, first=0, second=1000)
    script = PEER_IMPORTS + page_kit_source + PEER_MAIN
    peer = subprocess.Popen(
        [sys.executable, "-c", script, json.dumps(attrs.asdict(spec))],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert peer.stdout is not None and peer.stdin is not None
        line = peer.stdout.readline()
        assert line, peer.communicate(timeout=60)
        assert json.loads(line) == {"put": ["stored"] * 3}

        kind, ns = KVKind.MHA, page_kit.NS
        theirs = page_kit.pages(kind, 3, spec.first)  # hashed here, independently
        mine = page_kit.pages(kind, 3, spec.second)
        host = page_kit.host(kind)
        backend = make(kind, host)
        assert backend.exists(ns, theirs) == 3
        assert backend.get(ns, theirs, [2, 3, 4]) == [GetStatus.LOADED] * 3
        assert page_kit.holds(host, [2, 3, 4], theirs)

        page_kit.fill(host, [0, 1, 5], mine)
        assert backend.put(ns, mine, [0, 1, 5]) == [PutStatus.STORED] * 3
        out, err = peer.communicate("go\n", timeout=60)
        assert json.loads(out) == {"get": ["loaded"] * 3, "bit_for_bit": True}, err
        assert peer.returncode == 0, err
    finally:
        if peer.poll() is None:
            peer.kill()
            peer.wait()


@pytest.mark.parametrize(("exists_before_put", "queries"), [(False, 1), (True, 2)])
def test_a_put_asks_exists_only_to_confirm_unless_told_to_ask_first(
    make: MakeBackend,
    page_kit,
    monkeypatch: pytest.MonkeyPatch,
    exists_before_put: bool,
    queries: int,
) -> None:
    """Issue 20: no ``batch_is_exist`` before a put (the master deduplicates a re-put); the confirm
    after it stays. With ``exists_before_put`` the old exists-then-put-missing."""
    host = page_kit.host(KVKind.MHA)
    backend = make(KVKind.MHA, host, exists_before_put=exists_before_put)
    ns = page_kit.NS
    pages = page_kit.pages(KVKind.MHA, 3)
    page_kit.fill(host, [0, 1, 2], pages)
    calls: list[int] = []
    real = backend.client.batch_is_exist

    def spy(keys: list[str]) -> list[int]:
        calls.append(len(keys))
        return real(keys)

    monkeypatch.setattr(backend.client, "batch_is_exist", spy)
    assert backend.put(ns, pages, [0, 1, 2]) == [PutStatus.STORED] * 3
    assert len(calls) == queries and calls[-1] == 3 * 2  # the confirm asks for every object
    assert backend.get(ns, pages, [4, 5, 6]) == [GetStatus.LOADED] * 3
    assert page_kit.holds(host, [4, 5, 6], pages)


@pytest.mark.parametrize(
    ("layout", "native"),
    [
        (HostLayout.PAGE_MAJOR, "batch_put_from"),
        (HostLayout.PAGE_FIRST_DIRECT, "batch_put_parts"),
        (HostLayout.PAGE_FIRST, "batch_put_from"),
    ],
    ids=lambda value: getattr(value, "value", value),
)
def test_schema_two_stores_a_page_as_one_object_of_canonical_bytes(  # noqa: PLR0917
    make: MakeBackend,
    page_kit,
    mooncake_store: MooncakeClient,
    monkeypatch: pytest.MonkeyPatch,
    layout: HostLayout,
    native: str,
) -> None:
    """Issue 20: under key schema 2 a page is one store object holding K then V in canonical order
    (read back here with a plain ``batch_get_into`` of the key), put in one native call: one range
    per page for ``page_major`` (and the staging buffer of ``page_first``), K and V runs as one
    object for ``page_first_direct``; every layout reads what another wrote."""
    host = page_kit.host(KVKind.MHA, layout=layout)
    backend = make(KVKind.MHA, host, schema=2)
    ns, pages = page_kit.NS, page_kit.pages(KVKind.MHA, 3)
    page_kit.fill(host, [0, 1, 2], pages)
    calls: list[tuple[str, int]] = []
    for name in ("batch_put_from", "batch_put_parts"):
        real = getattr(backend.client, name)

        def spy(keys: object, *args: object, _name: str = name, _real: object = real) -> object:
            calls.append((_name, len(keys)))  # type: ignore[arg-type]
            return _real(keys, *args)  # type: ignore[operator]

        monkeypatch.setattr(backend.client, name, spy)
    assert backend.put(ns, pages, [0, 1, 2]) == [PutStatus.STORED] * 3
    assert calls == [(native, 3)]
    monkeypatch.undo()

    keys = [backend.keyspace.page_keys(ns, page) for page in pages]
    assert all(len(page_keys) == 1 and page_keys[0].text.startswith("kvs2/") for page_keys in keys)
    size = host.shape.bytes_per_page
    scratch = torch.zeros(3 * size, dtype=torch.uint8)
    mooncake_store.register_buffer(scratch.data_ptr(), scratch.numel())
    try:
        codes = mooncake_store.batch_get_into(
            [page_keys[0] for page_keys in keys],
            [scratch.data_ptr() + i * size for i in range(3)],
            [size] * 3,
        )
    finally:
        mooncake_store.unregister_buffer(scratch.data_ptr())
    assert codes == [size] * 3
    canonical = host.read_pages([0, 1, 2]).transpose(0, 2).contiguous()  # [page, L, planes, ...]
    want = canonical.transpose(1, 2).contiguous().view(-1).view(torch.uint8)  # [page, planes, L..]
    assert torch.equal(scratch, want)

    for other in (HostLayout.PAGE_MAJOR, HostLayout.PAGE_FIRST_DIRECT, HostLayout.PAGE_FIRST):
        reader_host = page_kit.host(KVKind.MHA, layout=other)
        reader = make(KVKind.MHA, reader_host, schema=2)
        assert reader.get(ns, pages, [5, 6, 7]) == [GetStatus.LOADED] * 3
        assert torch.equal(
            reader_host.read_pages([5, 6, 7]).view(torch.uint8),
            host.read_pages([0, 1, 2]).view(torch.uint8),
        )
    v1 = make(KVKind.MHA, page_kit.host(KVKind.MHA, layout=layout))
    assert v1.exists(ns, pages) == 0  # the other schema's objects answer nothing
