"""``kvstrata replay --tp N``: one replay as N tensor-parallel ranks (SPEC §10, §11; issue 18).

Each rank is a process of its own (``spawn``), joined to a gloo process group on loopback; it
replays the whole trace through its own pools and its own shard of the key space (``tp{r}of{N}``),
its cache agreeing with the other ranks' at every ``check_events``
(:class:`~kvstrata.impl.tp.TorchTpGroup`). With the embedded Mooncake default, this process starts
one local cluster sized for every rank's shard and the ranks connect to it; the memory and file
backends give each rank its own store.

The ranks mirror one tree, so they must report the same hits: :func:`replay_tp` checks that every
rank's request, refusal and per-tier hit counts equal rank 0's (:class:`RanksDisagree` otherwise)
and returns rank 0's result. A rank that fails ends the run with its error; the others then fail
their next agreement within ``timeout_s`` (:class:`~kvstrata.impl.errors.TpAgreementError`), so the
run never hangs.
"""

from __future__ import annotations

import contextlib
import datetime
import multiprocessing
import os
import queue
import socket
import traceback
from collections.abc import Sequence
from typing import Any

import attrs

from kvstrata.impl.replay.config import L3Backend, ReplayConfig
from kvstrata.impl.replay.errors import ReplayError
from kvstrata.impl.replay.result import ReplayResult
from kvstrata.impl.replay.trace import Request

__all__ = ["RanksDisagree", "replay_tp"]


class RanksDisagree(ReplayError):
    """TP ranks reported different hits, or a rank failed: the message says which."""


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def _rank_main(  # noqa: PLR0917 (a process target: positional by nature)
    rank: int,
    size: int,
    port: int,
    config: ReplayConfig,
    requests: Sequence[Request],
    trace: str,
    limit: int | None,
    timeout_s: float,
    out: Any,
    agree: bool = True,
) -> None:
    """One rank: join the group, replay, send ``(rank, result, error)``."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch.distributed as dist  # noqa: PLC0415

    from kvstrata.impl.replay.runner import replay  # noqa: PLC0415
    from kvstrata.impl.tp import TorchTpGroup  # noqa: PLC0415
    from kvstrata.model.keys import Shard  # noqa: PLC0415

    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=size,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
        try:
            result = replay(
                config,
                requests,
                trace=trace,
                limit=limit,
                tp_group=TorchTpGroup(timeout_s=timeout_s) if agree else None,
                shard=Shard(tp_rank=rank, tp_size=size),
            )
        finally:
            dist.destroy_process_group()
    except BaseException as error:  # reported to the parent, which raises it
        out.put((rank, None, f"{type(error).__name__}: {error}\n{traceback.format_exc()}"))
        return
    out.put((rank, result, None))


def replay_tp(
    config: ReplayConfig,
    requests: Sequence[Request],
    *,
    trace: str = "",
    limit: int | None = None,
    timeout_s: float = 120.0,
    agree: bool = True,
) -> ReplayResult:
    """Replay ``requests`` as ``config.tp`` ranks; rank 0's result once every rank agrees.
    ``agree=False`` (the benchmark's baseline): the same processes, each cache on its own, with no
    agreement (their hits may then differ; rank 0's result is returned unchecked)."""
    size = config.tp
    context = multiprocessing.get_context("spawn")
    with contextlib.ExitStack() as stack:
        rank_config = config
        if config.has_l3 and config.l3_backend is L3Backend.MOONCAKE and config.master is None:
            from kvstrata.impl.replay.store import segment_bytes  # noqa: PLC0415
            from kvstrata.impl.storage.mooncake import LocalCluster  # noqa: PLC0415

            pages = config.tier_pages(requests).l3
            nbytes = config.page_size * config.shape.bytes_per_token
            cluster = stack.enter_context(
                LocalCluster(segment_size=size * segment_bytes(pages, nbytes))
            )
            rank_config = attrs.evolve(config, master=cluster.master_address)
        out = context.Queue()
        port = _free_port()
        ranks = [
            context.Process(
                target=_rank_main,
                args=(
                    rank,
                    size,
                    port,
                    rank_config,
                    list(requests),
                    trace,
                    limit,
                    timeout_s,
                    out,
                    agree,
                ),
                name=f"kvstrata-tp-rank-{rank}",
                daemon=True,
            )
            for rank in range(size)
        ]
        for process in ranks:
            process.start()
        stack.callback(_stop, ranks)
        results = _collect(out, ranks, config.wait_limit_s + 2 * timeout_s)
    main = _agreed(results, config) if agree else results[0]
    if rank_config is not config and main.tiers.get("l3"):  # the embedded cluster: per-rank size
        per_token = config.shape.bytes_per_token
        pages = config.tier_pages(requests).l3
        main.tiers["l3"].update(
            pages=pages, tokens=pages * config.page_size, bytes=pages * config.page_size * per_token
        )
    return main


def _stop(ranks: list[Any]) -> None:
    for process in ranks:
        process.join(timeout=10)
        if process.is_alive():
            process.kill()
            process.join()


def _collect(out: Any, ranks: list[Any], bound_s: float) -> dict[int, ReplayResult]:
    results: dict[int, ReplayResult] = {}
    errors: dict[int, str] = {}
    while len(results) + len(errors) < len(ranks):
        try:
            rank, result, error = out.get(timeout=bound_s)
        except queue.Empty:
            raise RanksDisagree(f"no answer from every rank within {bound_s:g} s") from None
        if error is not None:
            errors[rank] = error
        else:
            results[rank] = result
    if errors:
        first = min(errors)
        raise RanksDisagree(f"rank {first} failed ({len(errors)} of {len(ranks)}): {errors[first]}")
    return results


def _agreed(results: dict[int, ReplayResult], config: ReplayConfig) -> ReplayResult:
    main = results[0]

    def counts(result: ReplayResult) -> tuple[object, ...]:
        hits = result.hits
        return (result.requests, result.refused, hits.l1, hits.l2, hits.l3)

    for rank, result in sorted(results.items()):
        if counts(result) != counts(main):
            raise RanksDisagree(
                f"rank {rank} reported {counts(result)}, rank 0 {counts(main)} "
                "(requests, refused, L1/L2/L3 hit tokens)"
            )
    main.config = config.describe()  # the embedded cluster stays the embedded default
    return main
