"""The embedding cache on a real Mooncake master.

On the session's LocalCluster: node A inserts in this process, node B (another process) prefetches
and gets the same tensors bit for bit; after the store loses an object A still holds, A's next
insert_batch pushes it again and B gets it again.

On a cluster of its own with a 16 MiB segment: a batch larger than the store gets -200 for the
objects that did not fit, and the cache completes it item by item (an item with any object refused
failed; the others are stored), with no wrong bytes anywhere; the next insert pushes the failed
items again."""

from __future__ import annotations

import json
import subprocess
import sys

import torch
from support.embeddings import same_bits, seeded_embedding

from kvstrata.impl.embedding import EmbeddingCache, EmbeddingPool, MooncakeEmbeddingStore, PoolShape
from kvstrata.impl.executors import ThreadExecutor
from kvstrata.impl.storage.mooncake import LocalCluster, MooncakeClient
from kvstrata.model.keys import KeySpace, KVKind, ModelIdentity, PageHash, Shard, content_hash
from kvstrata.model.lifecycles import EntryState

PEER = """
import json, sys
import torch
from kvstrata.impl.embedding import EmbeddingCache, EmbeddingPool, MooncakeEmbeddingStore, PoolShape
from kvstrata.impl.storage.mooncake import MooncakeClient, MooncakeConfig
from kvstrata.model.keys import KeySpace, KVKind, ModelIdentity, Shard, content_hash

DIM = 64
KEYSPACE = KeySpace(ModelIdentity(name="clip", dtype="fp16", kind=KVKind.EMBEDDING, dim=DIM),
                    shard=Shard.replicated())

def embedding(media, tokens):
    gen = torch.Generator().manual_seed(int.from_bytes(media.digest[:8], "little"))
    return torch.randn((tokens, DIM), generator=gen).to(torch.float16)

spec = json.loads(sys.argv[1])
media = [content_hash(name.encode()) for name in spec["names"]]
with MooncakeClient(MooncakeConfig(master=spec["master"], global_segment_size=0)) as client:
    for round_ in range(2):
        sys.stdin.readline()
        cache = EmbeddingCache(EmbeddingPool(PoolShape(32, 16, DIM, torch.float16)),
                               MooncakeEmbeddingStore(client), KEYSPACE)
        report = cache.prefetch(f"r{round_}", media, spec["tokens"])
        cache.wait(f"r{round_}")
        got = cache.get(media)
        ok = [g is not None and torch.equal(g.view(torch.int16),
              embedding(m, t).view(torch.int16)) for g, m, t in zip(got, media, spec["tokens"])]
        print(json.dumps({"loading": report.loading, "missing": report.missing, "bit_for_bit": ok}),
              flush=True)
        cache.close()
"""

DIM = 64
NAMES = ["cat.png", "dog.png", "clip.mp4"]
TOKENS = [40, 16, 70]


def test_two_processes_share_embeddings_and_a_lost_object_is_pushed_again(
    mooncake_store: MooncakeClient, mooncake_cluster: LocalCluster
) -> None:
    keyspace = KeySpace(
        ModelIdentity(name="clip", dtype="fp16", kind=KVKind.EMBEDDING, dim=DIM),
        shard=Shard.replicated(),
    )
    media = [content_hash(name.encode()) for name in NAMES]
    tensors = []
    for m, t in zip(media, TOKENS, strict=True):
        gen = torch.Generator().manual_seed(int.from_bytes(m.digest[:8], "little"))
        tensors.append(torch.randn((t, DIM), generator=gen).to(torch.float16))
    a = EmbeddingCache(
        EmbeddingPool(PoolShape(32, 16, DIM, torch.float16)),
        MooncakeEmbeddingStore(mooncake_store),
        keyspace,
    )
    spec = {"master": mooncake_cluster.master_address, "names": NAMES, "tokens": TOKENS}
    peer = subprocess.Popen(
        [sys.executable, "-c", PEER, json.dumps(spec)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert peer.stdin is not None and peer.stdout is not None
        first = a.insert_batch(media, tensors)
        assert (first.new, first.stored) == (3, 3)
        assert a.flush()
        assert a.counters.pushed == 3 and a.exists(media, TOKENS) == (True, True, True)
        peer.stdin.write("go\n")
        peer.stdin.flush()
        line = peer.stdout.readline()
        assert json.loads(line) == {"loading": 3, "missing": 0, "bit_for_bit": [True] * 3}, line

        # the store loses dog.png; A still holds it and pushes it again on its next insert
        assert all(
            rc == 0 for rc in mooncake_store.batch_remove(a.object_keys(media[1], 16), force=True)
        )
        assert a.exists(media, TOKENS) == (True, False, True)
        again = a.insert_batch(media, tensors)
        assert (again.new, again.re_pushed, again.stored, again.store_skipped) == (0, 3, 1, 2)
        a.close()
        assert a.exists(media, TOKENS) == (True, True, True)
        out, err = peer.communicate("go\n", timeout=60)
        assert json.loads(out) == {"loading": 3, "missing": 0, "bit_for_bit": [True] * 3}, err
        assert peer.returncode == 0, err
    finally:
        if peer.poll() is None:
            peer.kill()
            peer.wait()


def _same(got: torch.Tensor | None, want: torch.Tensor) -> bool:
    return got is not None and torch.equal(got.view(torch.int16), want.view(torch.int16))


def test_a_batch_larger_than_the_store_completes_item_by_item() -> None:
    dim, unit_tokens, tokens, count = 256, 1024, 3 * 1024, 12  # 3 objects of 512 KiB per item
    keyspace = KeySpace(
        ModelIdentity(name="clip", dtype="fp16", kind=KVKind.EMBEDDING, dim=dim),
        shard=Shard.replicated(),
    )
    media: list[PageHash] = [content_hash(f"frame-{i}".encode()) for i in range(count)]
    tensors = [
        torch.randn((tokens, dim), generator=torch.Generator().manual_seed(i)).to(torch.float16)
        for i in range(count)
    ]
    shape = PoolShape(3 * count, unit_tokens, dim, torch.float16)  # 18 MiB: more than the store
    with LocalCluster(segment_size="16mib") as cluster, MooncakeClient(cluster.config) as client:
        a = EmbeddingCache(EmbeddingPool(shape), MooncakeEmbeddingStore(client), keyspace)
        b = EmbeddingCache(EmbeddingPool(shape), MooncakeEmbeddingStore(client), keyspace)
        try:
            first = a.insert_batch(media, tensors)
            assert (first.new, first.stored) == (count, count)  # one batch put of 36 objects
            assert a.flush()
            counters = a.counters
            assert counters.pushed + counters.failed == count
            assert counters.store_full == counters.failed > 0 and counters.pushed > 0
            assert all(entry.state is EntryState.READY for entry in a.entries())
            assert all(_same(g, t) for g, t in zip(a.get(media), tensors, strict=True))
            visible = a.exists(media, [tokens] * count)
            assert 0 < sum(visible) <= counters.pushed  # a failed item is never visible

            fetched = b.prefetch("r1", media, [tokens] * count)
            assert fetched.loading == sum(visible)
            assert b.wait("r1")
            got = b.get(media)
            assert all(g is None or _same(g, t) for g, t in zip(got, tensors, strict=True))
            assert sum(g is not None for g in got) == b.counters.loaded > 0

            # room again: A's next insert pushes the failed items again, and B can load them
            failed = [m for m, seen in zip(media, visible, strict=True) if not seen]
            assert client.remove_all(force=True) >= 0
            again = a.insert_batch(failed, [tensors[media.index(m)] for m in failed])
            assert (again.new, again.re_pushed, again.stored) == (0, len(failed), len(failed))
            assert a.flush() and a.counters.pushed == counters.pushed + len(failed)
            fetched = b.prefetch("r2", failed, [tokens] * len(failed))
            assert fetched.loading == len(failed) and b.wait("r2")
            assert all(
                _same(g, tensors[media.index(m)])
                for m, g in zip(failed, b.get(failed), strict=True)
            )
        finally:
            a.close()
            b.close()


def test_in_place_insert_and_borrow_through_mooncake(
    mooncake_store: MooncakeClient, mooncake_cluster: LocalCluster
) -> None:
    """Issue 20 item 5 on a real master: a reservation written in place is pushed from the pool,
    another node borrows it in place after an unprobed prefetch, and a new entry whose objects
    the store already holds is pushed unasked (the master skips it: rc 0, nothing rewritten)."""
    keyspace = KeySpace(
        ModelIdentity(name="clip-inplace", dtype="fp16", kind=KVKind.EMBEDDING, dim=DIM),
        shard=Shard.replicated(),
    )
    media = [content_hash(f"inplace-{name}".encode()) for name in NAMES]
    want = {m: torch.randn((t, DIM)).to(torch.float16) for m, t in zip(media, TOKENS, strict=True)}
    caches = [
        EmbeddingCache(
            EmbeddingPool(PoolShape(32, 16, DIM, torch.float16)),
            MooncakeEmbeddingStore(mooncake_store),
            keyspace,
        )
        for _ in range(3)
    ]
    a, b, c = caches
    try:
        reservation = a.reserve(media, TOKENS)
        assert reservation.new == tuple(media)
        for m in media:
            view = reservation.views[m]
            assert view is not None  # an empty pool gives every entry adjacent units
            view.copy_(want[m])
        report = a.commit(reservation)
        assert (report.new, report.stored) == (3, 3) and a.flush()
        assert a.exists(media, TOKENS) == (True, True, True)

        fetched = b.prefetch("r", media, TOKENS, probe=False)
        assert (fetched.loading, fetched.missing) == (3, 0) and b.wait("r")
        with b.borrow(media) as loan:
            assert all(_same(got, want[m]) for got, m in zip(loan.tensors, media, strict=True))
            assert b.evict(32) == 0  # lent entries are not evicted
        assert b.evict(32) == sum(-(-t // 16) for t in TOKENS)

        # c computed the same items: pushed unasked, the master keeps the first bytes
        again = c.insert_batch(media, [torch.zeros_like(want[m]) for m in media])
        assert (again.new, again.stored, again.store_skipped) == (3, 3, 0) and c.flush()
        assert c.counters.failed == 0 and c.counters.pushed == 3
        assert b.prefetch("r2", media, TOKENS).loading == 3 and b.wait("r2")
        assert all(_same(got, want[m]) for got, m in zip(b.get(media), media, strict=True))
    finally:
        for cache in caches:
            cache.close()


def test_wait_true_through_a_real_mooncake_master(mooncake_store: MooncakeClient) -> None:
    """The put and the get made on the caller's thread against the session's master, bit for bit,
    with the worker never signalled."""
    keyspace = KeySpace(
        ModelIdentity(name="clip-wait-mooncake", dtype="fp16", kind=KVKind.EMBEDDING, dim=DIM),
        shard=Shard.replicated(),
    )
    media = [content_hash(f"wait-mooncake-{i}".encode()) for i in range(4)]
    tokens = [16, 9, 40, 16]
    shape = PoolShape(32, 16, DIM, torch.float16)
    io_a, io_b = ThreadExecutor("test-wait-a"), ThreadExecutor("test-wait-b")
    a = EmbeddingCache(
        EmbeddingPool(shape), MooncakeEmbeddingStore(mooncake_store), keyspace, executor=io_a
    )
    b = EmbeddingCache(
        EmbeddingPool(shape), MooncakeEmbeddingStore(mooncake_store), keyspace, executor=io_b
    )
    try:
        reservation = a.reserve(media, tokens)
        for m, t in zip(reservation.new, tokens, strict=True):
            view = reservation.views[m]
            assert view is not None
            view.copy_(seeded_embedding(m, t, DIM, torch.float16))
        report = a.commit(reservation, wait=True)
        assert report.stored == 4 and a.pending_ops() == () and a.counters.pushed == 4
        assert a.counters.failed == 0
        fetched = b.prefetch("r", media, tokens, probe=False, wait=True)
        assert fetched.loading == 4 and b.pending_ops() == ()
        with b.borrow(media) as loan:
            assert all(
                same_bits(g, seeded_embedding(m, t, DIM, torch.float16))
                for g, m, t in zip(loan.tensors, media, tokens, strict=True)
            )
        assert io_a.wake_ups == 0 and io_b.wake_ups == 0  # every store call ran on this thread
    finally:
        a.close()
        b.close()


def test_exists_of_one_unit_items_asks_one_rendered_batch_of_a_real_store(
    mooncake_store: MooncakeClient,
) -> None:
    """A batch of one-unit items is asked as one rendered batch (part 29): on a real master the
    answer is per item, a missing item reads as absent beside visible ones, and ``prefetch`` with
    its probe fetches exactly the visible ones, bit for bit."""
    keyspace = KeySpace(
        ModelIdentity(name="clip-exists-mooncake", dtype="fp16", kind=KVKind.EMBEDDING, dim=DIM),
        shard=Shard.replicated(),
    )
    media = [content_hash(f"exists-mooncake-{i}".encode()) for i in range(4)]
    tokens = [16, 9, 1, 16]  # every one of them one unit of 16 rows
    shape = PoolShape(32, 16, DIM, torch.float16)
    a = EmbeddingCache(EmbeddingPool(shape), MooncakeEmbeddingStore(mooncake_store), keyspace)
    b = EmbeddingCache(EmbeddingPool(shape), MooncakeEmbeddingStore(mooncake_store), keyspace)
    try:
        written = [media[0], media[2], media[3]]
        a.insert_batch(
            written,
            [
                seeded_embedding(m, t, DIM, torch.float16)
                for m, t in zip(written, [16, 1, 16], strict=True)
            ],
            wait=True,
        )
        assert a.counters.pushed == 3
        assert b.exists(media, tokens) == (True, False, True, True)
        fetched = b.prefetch("r", media, tokens, wait=True)
        assert (fetched.loading, fetched.missing) == (3, 1) and b.pending_ops() == ()
        got = b.get(media)
        assert got[1] is None
        assert all(
            g is not None and same_bits(g, seeded_embedding(m, t, DIM, torch.float16))
            for g, m, t in zip([got[0], got[2], got[3]], written, [16, 1, 16], strict=True)
        )
    finally:
        a.close()
        b.close()
