"""Tensor parallelism for real (SPEC §10; issue 18): 2 and 4 rank processes joined by gloo on
loopback, each with its own pools and its own shard of one real Mooncake cluster (the session's
``LocalCluster``), replay a slice of the sample trace in lockstep through the reference scheduler.

Faults differ per rank: one rank's store fails some puts, another's fails the tail of every read.
Every rank must end with the same tree (node by node), the same hits, and every page it served
byte-exact for its own shard (each rank's synthetic KV is salted with its rank; the scheduler checks
every page it serves). A rank killed mid-run makes every other rank raise ``TpAgreementError``
within the group's timeout: no hang.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvstrata.impl.storage.mooncake import LocalCluster

RANK = r'''
import hashlib, json, os, sys, datetime
import numpy as np
import torch
import torch.distributed as dist
from kvstrata.impl.cache import HierarchicalRadixCache
from kvstrata.impl.config import RadixCacheConfig, StorageConfig
from kvstrata.impl.errors import TpAgreementError
from kvstrata.impl.l3 import Lanes
from kvstrata.impl.pools import DeviceKVPool, HostKVPool, HostLayout, KVShape
from kvstrata.impl.replay import sample_trace
from kvstrata.impl.replay.background import Progress, signalling_executor
from kvstrata.impl.replay.kv import KVSynth
from kvstrata.impl.replay.scheduler import ReferenceScheduler
from kvstrata.impl.replay.trace import read_trace, request_tokens
from kvstrata.impl.storage.base import GetStatus, PutStatus
from kvstrata.impl.storage.mooncake import MooncakeBackend, MooncakeClient, MooncakeConfig
from kvstrata.impl.tp import TorchTpGroup
from kvstrata.model.keys import KeySpace, KVKind, ModelIdentity, Shard

spec = json.loads(sys.argv[1])
rank, size = spec["rank"], spec["size"]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{spec['port']}", rank=rank,
                        world_size=size, timeout=datetime.timedelta(seconds=spec["timeout"]))
PAGE = 64


class Faulty(MooncakeBackend):
    """Rank-specific faults: rank 0 fails every 3rd put, rank 1 the second half of every read of
    more than one page (so its reads always come back short: the agreed minimum is its count)."""
    calls = {"put": 0, "get": 0}

    def put(self, namespace, pages, host_indices):
        self.calls["put"] += 1
        if rank == 0 and self.calls["put"] % 3 == 0:
            return [PutStatus.FAILED] * len(pages)
        return super().put(namespace, pages, host_indices)

    def get(self, namespace, pages, host_indices):
        self.calls["get"] += 1
        if rank == 1 and len(pages) > 1:
            head = len(pages) // 2
            return super().get(namespace, pages[:head], host_indices[:head]) + [
                GetStatus.FAILED] * (len(pages) - head)
        return super().get(namespace, pages, host_indices)


shape = KVShape(KVKind.MHA, layers=2, heads=1, head_dim=4, dtype=torch.float16, page_size=PAGE)
identity = ModelIdentity("tp-test", "float16", KVKind.MHA, page_size=PAGE)
client = MooncakeClient(MooncakeConfig(master=spec["master"], global_segment_size=0))
client.setup()
backend = Faulty(client, KeySpace(identity, shard=Shard(tp_rank=rank, tp_size=size), tag=spec["tag"]))
device = DeviceKVPool(shape, 512)
host = HostKVPool(shape, 1024, HostLayout.PAGE_FIRST_DIRECT)
progress = Progress()
cache = HierarchicalRadixCache.build(
    RadixCacheConfig(page_size=PAGE),
    device,
    host,
    signalling_executor(progress, "copy"),
    storage=backend,
    storage_config=StorageConfig(
        prefetch_threshold=PAGE, prefetch_policy="wait_complete", backup_backoff_s=0.0
    ),
    storage_executor=Lanes(*(signalling_executor(progress, n) for n in ("read", "write", "probe", "query"))),
    tp_group=TorchTpGroup(timeout_s=spec["timeout"]),
)
kv = KVSynth(shape, seed=1000 + rank)  # each rank's shard of the KV differs
scheduler = ReferenceScheduler(cache, device, kv, progress, verify=True, settle=spec["settle"],
                               wait_limit_s=60.0)
hits = [0, 0, 0]
outcome = "ok"
try:
    for index, request in enumerate(read_trace(sample_trace(), spec["requests"])):
        if index == spec.get("die_at", -1) and rank == 1:
            os._exit(3)  # killed mid-run: no goodbye to the group
        if index == spec.get("evict_at", -1):  # everything backed up, then only L3 holds it
            scheduler.drain()
            cache.evict(10**6)
            cache.evict_host(10**6)
        served = scheduler.serve(request_tokens(request), index)
        hits[0] += served.l1_pages
        hits[1] += served.l2_pages
        hits[2] += served.l3_pages
    scheduler.drain()
except TpAgreementError as error:
    outcome = f"TpAgreementError: {error}"
tree = [
    (n.id, -1 if n.parent is None else n.parent.id, n.num_pages, n.state.value, n.lock_ref,
     n.backup_pins, None if n.host is None else n.host.tolist())
    for n in cache.nodes()
] if outcome == "ok" else []
digest = hashlib.sha256(json.dumps(tree).encode()).hexdigest()
counters = cache.l3.counters
print(json.dumps({
    "rank": rank, "outcome": outcome, "hits": hits, "tree": digest, "nodes": len(tree),
    "verified": scheduler.pages_verified, "agreements": cache.agreement.agreements,
    "prefetch_failed": counters.prefetch_pages.get("failed", 0),
    "backup_failed": counters.backup_pages.get("failed", 0),
}), flush=True)
if outcome == "ok":
    cache.close()
    dist.destroy_process_group()
'''


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def _run_ranks(
    cluster: LocalCluster, tmp_path: Path, size: int, timeout: float, **spec: object
) -> tuple[list[dict[str, object]], list[int], float]:
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    port = _free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    started = time.monotonic()
    ranks = [
        subprocess.Popen(
            [
                sys.executable,
                str(script),
                json.dumps(
                    {
                        "rank": rank,
                        "size": size,
                        "port": port,
                        "master": cluster.master_address,
                        "timeout": timeout,
                        "tag": f"tp{size}-{port}",
                        **spec,
                    }
                ),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for rank in range(size)
    ]
    reports: list[dict[str, object]] = []
    codes: list[int] = []
    for process in ranks:
        out, err = process.communicate(timeout=240)
        codes.append(process.returncode)
        lines = [line for line in out.splitlines() if line.startswith("{")]
        if lines:
            reports.append(json.loads(lines[-1]))
        elif process.returncode != 3:
            raise AssertionError(f"a rank printed nothing (rc {process.returncode}): {err[-3000:]}")
    return reports, codes, time.monotonic() - started


@pytest.mark.parametrize("size", [2, 4])
def test_ranks_with_different_faults_end_with_one_tree_and_exact_bytes(
    mooncake_cluster: LocalCluster, tmp_path: Path, size: int
) -> None:
    reports, codes, _ = _run_ranks(
        mooncake_cluster, tmp_path, size, 60.0, requests=60, settle=False, evict_at=30
    )
    assert codes == [0] * size, codes
    assert [r["outcome"] for r in reports] == ["ok"] * size
    first = reports[0]
    for report in reports[1:]:
        for field in ("hits", "tree", "nodes", "agreements"):
            assert report[field] == first[field], (field, report, first)
    assert isinstance(first["hits"], list) and first["hits"][2] > 0, first  # L3 served pages
    assert all(isinstance(r["verified"], int) and r["verified"] > 0 for r in reports)
    by_rank = {r["rank"]: r for r in reports}
    assert by_rank[0]["backup_failed"], "rank 0's puts were meant to fail"
    assert by_rank[1]["prefetch_failed"], "rank 1's reads were meant to come back short"


def test_a_killed_rank_makes_the_others_raise_within_the_timeout(
    mooncake_cluster: LocalCluster, tmp_path: Path
) -> None:
    timeout = 8.0
    reports, codes, elapsed = _run_ranks(
        mooncake_cluster, tmp_path, 3, timeout, requests=40, settle=False, die_at=10
    )
    assert codes[1] == 3
    survivors = [r for r in reports if r["rank"] != 1]
    assert len(survivors) == 2
    for report in survivors:
        assert str(report["outcome"]).startswith("TpAgreementError"), report
    assert elapsed < 120, elapsed
