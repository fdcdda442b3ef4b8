"""The embedding cache on a real Mooncake master (the session's LocalCluster): node A inserts in
this process, node B (another process) prefetches and gets the same tensors bit for bit; after the
store loses an object A still holds, A's next insert_batch pushes it again and B gets it again."""

from __future__ import annotations

import json
import subprocess
import sys

import torch

from kvstrata.impl.embedding import EmbeddingCache, EmbeddingPool, MooncakeEmbeddingStore, PoolShape
from kvstrata.impl.storage.mooncake import LocalCluster, MooncakeClient
from kvstrata.model.keys import KeySpace, KVKind, ModelIdentity, Shard, content_hash

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
