"""The engine connector's saves: a step that waits for its L3 puts against one that lets them land
behind it (issue 20 part 22, the vLLM connector's ``async_backup``).

A :class:`~kvstrata.impl.storage.mooncake.LocalCluster` (master plus a storage node owning the
segment, loopback TCP) and a :class:`~kvstrata.integrations.connector_worker.ConnectorWorker` over a
:class:`~kvstrata.impl.storage.mooncake.MooncakeBackend` with the library's default key schema, as
the vLLM connector opens it. Each **step** is what an engine's worker does with the connector:

1. the forward: ``--forward-ms`` of waiting (a GPU's forward as the CPU sees it: the host thread
   waits for the device), or of CPU work with ``--cpu-forward`` (an engine that computes on the
   CPU, as vLLM's CPU backend does);
2. ``save``: the step's ``--pages`` new full blocks copied into L2 slots (from a CPU tensor
   standing for the engine's blocks), then their put to L3.

**sync**: the worker's store calls on an ``InlineExecutor`` (every save waits for its puts: the
connector before this part, ``async_backup: false``). **async**: on a ``ThreadExecutor`` (the
default now: the puts land while the next forward runs). Both sides save fresh pages every step
into the same cycle of L2 slots (``--l2-steps`` steps' worth, so a slot is reused that many steps
later and waits for its put only if the store is that far behind); each repetition runs
``--steps`` steps of one side, the sides alternating, and ends with a flush (every put landed:
the time of the async side's last puts is counted). Bytes are checked in a warm-up repetition:
every page the store holds afterwards is read back and compared.

Prints per side the median over repetitions of the time per step and of the save call (what
``wait_for_save`` costs the engine), and ``async ÷ sync`` of both.

Exit status: 0 when everything ran; 2 when the cluster cannot be started here.

Usage: python benchmarks/connector_save.py [--page-kib 1024] [--pages 32] [--forward-ms 20]
    [--steps 8] [--repeats 7] [--cpu-forward] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import l3_throughput as l3  # the sibling benchmark: cluster, cells, pages

from kvstrata.impl.executors import Executor, InlineExecutor, ThreadExecutor
from kvstrata.impl.pools import HostKVPool, HostLayout
from kvstrata.impl.storage.base import GetStatus
from kvstrata.impl.storage.mooncake import MooncakeBackend
from kvstrata.integrations.connector import PageMove, Plan
from kvstrata.integrations.connector_worker import ConnectorWorker
from kvstrata.model.keys import KeySpace, PageHash

KIB, MIB = 1 << 10, 1 << 20
SIDES = ("sync", "async")


class EngineBlocks:
    """The engine's blocks: ``[2, L, blocks, tokens, H, D]``, block ``b`` at ``kv[:, :, b]``."""

    def __init__(self, kv: torch.Tensor) -> None:
        self.kv = kv

    def save(self, blocks: Sequence[int], host: HostKVPool, slots: Sequence[int]) -> None:
        host.write_pages(slots, self.kv[:, :, list(blocks)])

    def load(self, host: HostKVPool, slots: Sequence[int], blocks: Sequence[int]) -> None:
        self.kv[:, :, list(blocks)] = host.read_pages(slots)


def forward(seconds: float, cpu: bool) -> None:
    """The step's forward: waiting (a device computes) or CPU work for ``seconds``."""
    if not cpu:
        time.sleep(seconds)
        return
    end = time.perf_counter() + seconds
    a = torch.randn(256, 256)
    while time.perf_counter() < end:
        a = torch.tanh(a @ a)


class Side:
    """One worker (sync or async) with its own host pool and step counter."""

    def __init__(
        self, name: str, backend: MooncakeBackend, blocks: EngineBlocks, args: argparse.Namespace
    ) -> None:
        self.name, self.args = name, args
        shape = l3.shape_of(l3.Cell(args.page_kib * KIB, 1, args.page_kib * KIB))
        host = HostKVPool(shape, args.pages * args.l2_steps, HostLayout.PAGE_FIRST_DIRECT)
        executor: Executor = InlineExecutor() if name == "sync" else ThreadExecutor("bench-l3")
        self.worker = ConnectorWorker(host, backend, l3.NAMESPACE, blocks, executor)
        self.steps = 0

    def step(self, label: str) -> tuple[float, float, list[PageHash]]:
        """One step; its seconds, the save call's seconds, and the pages it saved."""
        args = self.args
        pages = l3.fresh_pages(f"{label}/{self.name}/{self.steps}", args.pages)
        first = (self.steps % args.l2_steps) * args.pages
        moves = tuple(PageMove(k, page, first + k, k % args.blocks) for k, page in enumerate(pages))
        self.steps += 1
        plan = Plan(saves=(("r", moves),), number=self.steps, reported_through=self.steps - 1)
        start = time.perf_counter()
        forward(args.forward_ms / 1e3, args.cpu_forward)
        saving = time.perf_counter()
        self.worker.save(plan)
        end = time.perf_counter()
        return end - start, end - saving, pages

    def run(self, label: str) -> tuple[float, float, list[PageHash]]:
        """``--steps`` steps and a flush: seconds per step, median save seconds, the pages."""
        start = time.perf_counter()
        saves, pages = [], []
        for _ in range(self.args.steps):
            _step, save, saved = self.step(label)
            saves.append(save)
            pages.extend(saved)
        self.worker.flush()
        per_step = (time.perf_counter() - start) / self.args.steps
        taken = self.worker.take_stats()
        if taken.failed_backup_pages:
            print(f"  {self.name}: {taken.failed_backup_pages} puts failed", file=sys.stderr)
        return per_step, statistics.median(saves), pages


def run(args: argparse.Namespace) -> dict[str, object]:
    cell = l3.Cell(args.page_kib * KIB, 1, args.page_kib * KIB)
    shape = l3.shape_of(cell)
    keyspace = KeySpace(model=l3.model_of(cell), tag="bench-connector-save")
    per_rep = len(SIDES) * args.pages * args.steps * args.page_kib * KIB  # cleared after each
    segment = max(256 * MIB, per_rep + per_rep // 4)
    kv = torch.randn(2, shape.layers, args.blocks, shape.page_size, shape.heads, shape.head_dim)
    blocks = EngineBlocks(kv.to(shape.dtype))
    results: dict[str, dict[str, list[float]]] = {side: {"step": [], "save": []} for side in SIDES}
    with l3.bench_store(segment) as (client, _raw):
        backends = {name: MooncakeBackend(client, keyspace) for name in SIDES}  # one a pool
        sides = {name: Side(name, backends[name], blocks, args) for name in SIDES}
        try:
            for rep in range(-1, args.repeats):  # -1: warm-up, bytes checked
                order = SIDES if rep % 2 else SIDES[::-1]
                for name in order:
                    per_step, save, pages = sides[name].run(f"r{rep}")
                    if rep < 0:
                        verify(backends[name], sides[name].worker, blocks, pages, args)
                        continue
                    results[name]["step"].append(per_step)
                    results[name]["save"].append(save)
                l3.clear(client, _raw)
        finally:
            for side in sides.values():
                side.worker.close()
    return {
        "args": vars(args),
        "median_ms": {
            side: {what: statistics.median(v) * 1e3 for what, v in values.items()}
            for side, values in results.items()
        },
        "per_repetition_s": results,
    }


def verify(
    backend: MooncakeBackend,
    worker: ConnectorWorker,
    blocks: EngineBlocks,
    pages: list[PageHash],
    args: argparse.Namespace,
) -> None:
    """The last L2 cycle's pages read back from the store into a spare slot: each equals the
    engine block it was saved from (page ``k`` of a step came from block ``k % blocks``)."""
    host = worker.host
    spare = HostKVPool(host.shape, 1, HostLayout.PAGE_FIRST_DIRECT)
    probe = MooncakeBackend(backend.client, backend.keyspace)
    probe.attach(spare)
    try:
        for index, page in enumerate(pages):
            if probe.get(l3.NAMESPACE, [page], [0]) != [GetStatus.LOADED]:
                raise SystemExit(f"page {index} of the warm-up is not in the store")
            want = blocks.kv[:, :, [(index % args.pages) % args.blocks]]
            if not torch.equal(spare.read_pages([0]), want):
                raise SystemExit(f"page {index} of the warm-up has other bytes in the store")
    finally:
        probe.close()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--page-kib", type=int, default=1024, help="bytes per page, KiB")
    parser.add_argument("--pages", type=int, default=32, help="new full blocks saved per step")
    parser.add_argument("--forward-ms", type=float, default=20.0, help="the forward of a step")
    parser.add_argument("--cpu-forward", action="store_true", help="a forward of CPU work")
    parser.add_argument("--steps", type=int, default=8, help="steps per repetition")
    parser.add_argument("--repeats", type=int, default=7, help="repetitions per side")
    parser.add_argument("--l2-steps", type=int, default=4, help="L2 slots, in steps' saves")
    parser.add_argument("--blocks", type=int, default=64, help="the engine's blocks")
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    args = parser.parse_args(argv)
    try:
        out = run(args)
    except l3.SetupError as error:
        print(f"skipped: {error}", file=sys.stderr)
        return 2
    med = out["median_ms"]
    assert isinstance(med, dict)
    kind = "CPU work" if args.cpu_forward else "waiting"
    print(
        f"{args.pages} pages of {args.page_kib} KiB saved per step, forward {args.forward_ms} ms "
        f"of {kind}, {args.steps} steps x {args.repeats} repetitions a side (medians)"
    )
    print("| side | ms per step | ms in save |")
    print("|---|---:|---:|")
    for side in SIDES:
        print(f"| {side} | {med[side]['step']:.1f} | {med[side]['save']:.2f} |")
    step_ratio = med["async"]["step"] / med["sync"]["step"]
    save_ratio = med["async"]["save"] / med["sync"]["save"]
    print(f"async ÷ sync: step {step_ratio:.2f}, save call {save_ratio:.3f}")
    if args.json is not None:
        args.json.write_text(json.dumps(out, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
