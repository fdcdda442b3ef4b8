"""kvstrata's connector inside vLLM 0.33's real ``Scheduler`` (CPU; no model runs).

vLLM's scheduler loads the connector by module path and drives its scheduler side; the test plays
the worker: it builds the connector's worker side on KV views vLLM's own ``allocate_kv_cache`` makes, binds
each step's metadata, runs ``start_load_kv`` / ``wait_for_save``, and "computes" every other block
with bytes derived from the block's hash, so every loaded block can be checked byte for byte.
"""

from __future__ import annotations

import functools
import hashlib
import pickle
import threading
import time
from concurrent.futures import Future
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import attrs
import pytest
import torch
from support.engines import require
from support.stages import LocalStagePipes

require(
    "vllm", "run scripts/engines (it builds .venv-vllm) and use .venv-vllm/bin/python -m pytest"
)

from huggingface_hub import ResolvedRevision  # noqa: E402
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram  # noqa: E402
from transformers import LlamaConfig  # noqa: E402
from vllm.config import (  # noqa: E402
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorLogging  # noqa: E402
from vllm.platforms import current_platform  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.core.sched.async_scheduler import AsyncScheduler  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    KVCacheTensor,
    MLAAttentionSpec,
    compute_layout_strides,
)
from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: E402
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402
from vllm.v1.worker.utils import allocate_kv_cache  # noqa: E402

from kvstrata.impl.errors import ConfigError  # noqa: E402
from kvstrata.impl.executors import InlineExecutor, ThreadExecutor  # noqa: E402
from kvstrata.impl.storage.base import GetStatus, PutStatus  # noqa: E402
from kvstrata.integrations import vllm as vllm_connector  # noqa: E402
from kvstrata.integrations import vllm_groups  # noqa: E402
from kvstrata.integrations.connector_worker import WorkerStats  # noqa: E402
from kvstrata.integrations.vllm import KvstrataConnector  # noqa: E402
from kvstrata.integrations.vllm_config import platform_writer, report_lag  # noqa: E402
from kvstrata.integrations.vllm_stats import KvstrataConnectorStats  # noqa: E402
from kvstrata.model.engines import HashScheme, engine_page_hash  # noqa: E402
from kvstrata.model.keys import PageHash  # noqa: E402

BLOCK, HEADS, HEAD_DIM, NUM_BLOCKS = 16, 4, 8, 64  # no dimension of 2: K/V is in C


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny-llama")
    LlamaConfig(
        vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=HEADS, num_key_value_heads=HEADS, head_dim=HEAD_DIM,
    ).save_pretrained(path)  # fmt: skip
    return path


def kv_cache_config(dtype: torch.dtype = torch.float32) -> KVCacheConfig:
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD_DIM, dtype=dtype)
    return KVCacheConfig(
        num_blocks=NUM_BLOCKS,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["layers.0.attn"], spec)],
    )


def vllm_caches(
    spec: KVCacheSpec,
    layers: list[str],
    layout: KVCacheLayout = KVCacheLayout.LBNHC,
    kernel_block: int | None = None,
    num_blocks: int = NUM_BLOCKS,
) -> dict[str, torch.Tensor]:
    """The per-layer KV views vLLM's model runner hands a connector: ``[B, H, N, C]`` over one
    allocation in ``layout``'s physical order (``kernel_block``: the backend's kernel block)."""
    layer_stride, block_stride, *_ = compute_layout_strides(spec, num_blocks, len(layers), layout)
    tensor = KVCacheTensor(
        size=spec.page_size_bytes * num_blocks * len(layers),
        layers=layers,
        layer_stride=layer_stride,
        block_stride=block_stride,
    )
    config = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[tensor],
        kv_cache_groups=[KVCacheGroupSpec(layers, spec)],
    )
    kernels = None if kernel_block is None else [kernel_block]
    return allocate_kv_cache(config, torch.device("cpu"), layout, kernels)


def manager_block(view: torch.Tensor, block: int, num_blocks: int = NUM_BLOCKS) -> torch.Tensor:
    """vLLM's block ``block`` of a ``[B, H, N, C]`` view as ``[H, tokens, C]`` (its kernel blocks
    in token order)."""
    ratio = view.shape[0] // num_blocks
    kernels = view[block * ratio : (block + 1) * ratio]
    return kernels.permute(1, 0, 2, 3).reshape(view.shape[1], -1, view.shape[3])


class _Layer:
    """A stand-in for one of vLLM's attention layers in its forward context (no model is loaded
    here): what the connector asks of it."""

    def __init__(self, backend: str) -> None:
        name, _, isa = backend.partition(":")  # "CPU_ATTN:vec": the CPU kernel's isa too
        self.backend = SimpleNamespace(get_name=lambda: name)
        if isa:
            self.isa = isa

    def get_attn_backend(self) -> Any:
        return self.backend


def with_backend(config: VllmConfig, backend: str) -> VllmConfig:
    """``config`` with its model's layer run by ``backend`` (what vLLM's forward context holds in a
    worker whose model is loaded)."""
    config.compilation_config.static_forward_context["layers.0.attn"] = _Layer(backend)
    return config


def vllm_config(model_dir: Path, extra: dict[str, Any], budget: int = 1024) -> VllmConfig:
    return with_backend(_vllm_config(model_dir, extra, budget), "FLASH_ATTN")


def _vllm_config(model_dir: Path, extra: dict[str, Any], budget: int) -> VllmConfig:
    return VllmConfig(
        model_config=ModelConfig(model=str(model_dir), skip_tokenizer_init=True, dtype="float32"),
        scheduler_config=SchedulerConfig(
            max_num_seqs=8,
            max_num_batched_tokens=budget,
            max_model_len=512,
            disable_hybrid_kv_cache_manager=True,
            is_encoder_decoder=False,
        ),
        cache_config=CacheConfig(block_size=BLOCK, enable_prefix_caching=True),
        kv_transfer_config=KVTransferConfig(
            kv_connector="KvstrataConnector",
            kv_connector_module_path="kvstrata.integrations.vllm",
            kv_role="kv_both",
            kv_load_failure_policy="recompute",
            kv_connector_extra_config=extra,
        ),
        device_config=DeviceConfig("cpu"),
    )


class Rig:
    """vLLM's scheduler plus the connector's worker side on a CPU paged KV tensor."""

    def __init__(
        self,
        model_dir: Path,
        extra: dict[str, Any],
        scheduler: type[Scheduler] = Scheduler,
        budget: int = 1024,
        stages: int = 1,
    ) -> None:
        init_none_hash(sha256)
        self.config = vllm_config(model_dir, extra, budget)
        self.config.parallel_config.pipeline_parallel_size = stages
        self.config.cache_config.num_gpu_blocks = NUM_BLOCKS  # what the engine sets after profiling
        self.scheduler = scheduler(
            self.config,
            kv_cache_config=kv_cache_config(),
            structured_output_manager=StructuredOutputManager(self.config),
            block_size=BLOCK,
            log_stats=True,
        )
        self.kv = vllm_caches(
            kv_cache_config().kv_cache_groups[0].kv_cache_spec, ["layers.0.attn"]
        )["layers.0.attn"]
        self.worker = KvstrataConnector(self.config, KVConnectorRole.WORKER, kv_cache_config())
        self.worker.register_kv_caches({"layers.0.attn": self.kv})
        self.hasher = get_request_block_hasher(BLOCK, sha256)
        self.requests: dict[str, Request] = {}
        self.failed: set[int] = set()
        self.block_table: dict[str, list[int]] = {}
        self.stats: list[dict[str, Any]] = []  # the scheduler's connector stats, step by step

    @property
    def connector(self) -> KvstrataConnector:
        return self.scheduler.connector  # type: ignore[return-value]

    def add(self, request_id: str, tokens: list[int], max_tokens: int = 1) -> Request:
        sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        request = Request(request_id, tokens, sampling, None, None, block_hasher=self.hasher)
        self.requests[request_id] = request
        self.scheduler.add_request(request)
        return request

    def step(self) -> Any:
        """One step, synchronous: scheduled, run (the "model" computes every block of each
        scheduled request that the step does not load), its output taken."""
        out = self.scheduler.schedule()
        invalid, _chunks = self.run(out, every_block=True)
        self.report(out, invalid, set())
        return out

    def run(self, out: Any, every_block: bool = False) -> tuple[set[int], set[str]]:
        """The worker runs one scheduled step: loads, then the "model" computes the full blocks of
        the tokens scheduled in it (``every_block``: every block of each scheduled request), then
        saves. The blocks that failed to load, and the requests whose prefill goes on after
        this step."""
        meta = out.kv_connector_metadata
        self.worker.bind_connector_metadata(meta)
        self.worker.start_load_kv(None)
        self.after_load = self.kv.clone()
        invalid: set[int] = self.worker.get_block_ids_with_load_errors()  # as vLLM's runner
        self.failed |= invalid
        chunks = self.compute(out, self.kv, every_block)
        self.worker.wait_for_save()
        land_puts(self.worker)
        self.worker.clear_connector_metadata()
        return invalid, chunks

    def compute(
        self,
        out: Any,
        kv: torch.Tensor,
        every_block: bool = False,
        upstream: torch.Tensor | None = None,
    ) -> set[str]:
        """The "model" over ``kv``: the step's full blocks, each right only when the blocks before
        it are (and, on a later pipeline stage, when the stage before it, ``upstream``, computed
        it right); the requests whose prefill goes on after this step."""
        planned = {m.block for _r, moves in out.kv_connector_metadata.plan.loads for m in moves}
        starts = {new.req_id: new.num_computed_tokens for new in out.scheduled_new_reqs}
        cached = out.scheduled_cached_reqs
        starts.update(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
        chunks = set()
        for request_id, count in out.num_scheduled_tokens.items():
            request = self.requests[request_id]
            start, end = starts[request_id], starts[request_id] + count
            if end < request.num_prompt_tokens:
                chunks.add(request_id)
            blocks = self.scheduler.kv_cache_manager.get_block_ids(request_id)[0]
            self.block_table[request_id] = list(blocks)
            hashes = request.block_hashes
            first, last = (0, len(hashes)) if every_block else (start // BLOCK, end // BLOCK)
            for index in range(first, min(last, len(hashes), len(blocks))):
                if blocks[index] in planned:  # the forward takes every planned load as done
                    continue
                right = all(  # as in a transformer: over bad KV the block comes out wrong
                    torch.equal(kv[blocks[j]], content(hashes[j])) for j in range(index)
                )
                if upstream is not None:  # its input: the stage before's output of this block
                    right = right and torch.equal(upstream[blocks[index]], content(hashes[index]))
                kv[blocks[index]] = content(hashes[index]) + (0 if right else 1)
        return chunks

    def report(self, out: Any, invalid: set[int], chunks: set[str]) -> None:
        """vLLM's scheduler takes the step's output (a prefill chunk samples nothing), with the
        worker's connector stats as vLLM's model runner sends them; the scheduler's stats payload
        of the step is kept (``stats``)."""
        ids = list(out.num_scheduled_tokens)
        outputs = self.scheduler.update_from_output(
            out,
            ModelRunnerOutput(
                req_ids=ids,
                req_id_to_index={r: i for i, r in enumerate(ids)},
                sampled_token_ids=[[] if r in chunks else [7] for r in ids],
                kv_connector_output=KVConnectorOutput(
                    invalid_block_ids=invalid,
                    kv_connector_stats=self.worker.get_kv_connector_stats(),
                ),
            ),
        )
        for output in outputs.values():
            if output.scheduler_stats is not None and output.scheduler_stats.kv_connector_stats:
                self.stats.append(output.scheduler_stats.kv_connector_stats)


def land_puts(connector: KvstrataConnector) -> None:
    """The step's L3 puts land before the test looks at the store or asks a lookup (vLLM lets them
    land behind the next step: ``async_backup``, on by default; tests/stateful/
    test_connector_backup.py leaves them pending across steps, and the CPU engine tests run them
    behind real steps)."""
    assert connector.worker is not None
    connector.worker.flush()


def content(block_hash: bytes) -> torch.Tensor:
    """The KV a block holds, derived from its hash (what the model would have computed)."""
    seed = int.from_bytes(hashlib.sha256(bytes(block_hash)).digest()[:8], "little")
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(HEADS, BLOCK, 2 * HEAD_DIM, generator=generator)  # one block of [B, H, N, C]


def prompt(n: int, salt: int = 0) -> list[int]:
    return [(i * 7 + salt) % 500 + 1 for i in range(n)]


def landed_match(connector: KvstrataConnector, request: Request) -> int:
    """The tokens ``connector`` matches for ``request`` once its L3 lookup has landed."""
    for _ in range(60):
        tokens, _load_async = connector.get_num_new_matched_tokens(request, 0)
        if tokens is not None:
            return tokens
        time.sleep(0.05)
    raise AssertionError(f"{request.request_id}: the lookup never landed")


def lookup_landed(rig: Rig, request_id: str) -> None:
    """Wait until the connector's L3 lookup of the request has landed."""
    landed_match(rig.connector, rig.requests[request_id])


def lose_everything(root: Path) -> None:
    """The file store at ``root`` loses every object (between a lookup and its load)."""
    for path in sorted(root.rglob("*"), key=str):
        if path.is_file() and path.suffix != ".tmp":
            path.unlink()


def run_async(rig: Rig, pending: tuple[Any, tuple[set[int], set[str]]], steps: int = 20) -> None:
    """Async scheduling until no request is left: each step is scheduled before the previous
    step's output is taken (``pending``: a step run and not reported yet)."""
    for _ in range(steps):
        if not rig.scheduler.requests:
            break
        following = rig.scheduler.schedule()
        rig.report(pending[0], *pending[1])
        pending = (following, rig.run(following))
    rig.report(pending[0], *pending[1])
    assert not rig.scheduler.requests


def loaded_wrong(rig: Rig, request_id: str, tokens: list[int]) -> tuple[int, list[int]]:
    """A new request over ``tokens`` (vLLM's own prefix cache reset first), run until scheduled:
    how many of its tokens came from kvstrata, and which of those blocks hold wrong bytes."""
    rig.scheduler.reset_prefix_cache()
    rig.failed.clear()
    rig.add(request_id, tokens)
    for _ in range(40):
        out = rig.scheduler.schedule()
        rig.report(out, *rig.run(out))
        scheduled = next((new for new in out.scheduled_new_reqs if new.req_id == request_id), None)
        if scheduled is not None:
            hashes = rig.requests[request_id].block_hashes
            blocks = rig.block_table[request_id][: scheduled.num_computed_tokens // BLOCK]
            wrong = [
                i for i, b in enumerate(blocks) if not torch.equal(rig.kv[b], content(hashes[i]))
            ]
            return scheduled.num_computed_tokens, wrong
        time.sleep(0.05)
    raise AssertionError(f"{request_id} was never scheduled")


def stored_wrong(rig: Rig, request_id: str, stage: int = 0) -> list[int]:
    """The pages of the request the store holds with bytes other than its page's (pipeline stage
    ``stage``'s keys): each read back through that stage's backend into a spare host slot, then
    into a spare vLLM block of that stage."""
    connector = rig.worker if stage == 0 else rig.stages[stage]
    worker, kv = connector.worker, rig.kv if stage == 0 else rig.kvs[stage]
    assert worker is not None and worker.backend is not None
    slot, block = worker.host.num_pages - 1, NUM_BLOCKS - 1
    wrong = []
    for index, block_hash in enumerate(rig.requests[request_id].block_hashes):
        page = engine_page_hash(bytes(block_hash), HashScheme.VLLM)
        if worker.backend.get(worker.namespace, [page], [slot]) == [GetStatus.LOADED]:
            worker.blocks.load(worker.host, [slot], [block])
            if not torch.equal(kv[block], content(block_hash)):
                wrong.append(index)
    return wrong


def run_until_scheduled(rig: Rig, request_id: str, steps: int = 200) -> Any:
    for _ in range(steps):
        out = rig.step()
        for new in out.scheduled_new_reqs:
            if new.req_id == request_id:
                return new
        time.sleep(0.01)  # the connector's L3 lookup runs on its own thread
    raise AssertionError(f"{request_id} was never scheduled")


def test_a_repeated_prompt_is_loaded_through_the_connector(model_dir: Path, tmp_path: Path) -> None:
    rig = Rig(model_dir, {"store": "file", "path": str(tmp_path / "l3"), "l2_pages": 16})
    assert isinstance(rig.connector, KvstrataConnector)  # loaded by module path
    rig.add("a", prompt(66))
    run_until_scheduled(rig, "a")
    rig.step()  # a finishes
    assert rig.scheduler.reset_prefix_cache()
    rig.add("b", [*prompt(64), 3, 4])
    scheduled = run_until_scheduled(rig, "b")
    assert scheduled.num_computed_tokens == 64  # 4 blocks from kvstrata, none local
    blocks = rig.block_table["b"]
    for index in range(4):
        assert torch.equal(rig.kv[blocks[index]], content(rig.requests["b"].block_hashes[index]))
    assert rig.worker.loaded_pages == 4 and not rig.failed
    rig.step()
    assert (
        rig.scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == NUM_BLOCKS - 1
    )  # no leak


def test_the_workers_stats_reach_vllms_stats_logger_and_prometheus(
    model_dir: Path, tmp_path: Path
) -> None:
    """The worker's counts travel as vLLM sends them (model runner output, the scheduler's stats),
    and vLLM's stats logger and Prometheus metrics read them through the connector's classes."""
    rig = Rig(model_dir, {"store": "file", "path": str(tmp_path / "l3"), "l2_pages": 16})
    rig.add("a", prompt(66))
    run_until_scheduled(rig, "a")
    rig.step()
    assert rig.scheduler.reset_prefix_cache()
    rig.add("b", [*prompt(64), 3, 4])
    run_until_scheduled(rig, "b")
    rig.step()
    logging = KVConnectorLogging(rig.config.kv_transfer_config)
    for data in rig.stats:
        logging.observe(data)
    total = logging.transfer_stats_accumulator
    assert isinstance(total, KvstrataConnectorStats)
    summary = total.reduce()
    assert summary["loaded_l2_pages"] == 4 and summary["loaded_l3_pages"] == 0  # L2 held them
    assert summary["saved_pages"] == summary["backed_up_pages"] == 4  # a's four full pages
    assert summary["l3_written_bytes"] == 4 * rig.worker.worker.host.shape.bytes_per_page
    lines: list[str] = []
    logging.log(log_fn=lambda fmt, *args: lines.append(fmt % args))
    assert lines and "loaded_l2_pages=4" in lines[0]

    registry = CollectorRegistry()
    types = {
        kind: functools.partial(kind, registry=registry) for kind in (Counter, Gauge, Histogram)
    }
    prom = KvstrataConnector.build_prom_metrics(rig.config, types, ["engine"], {0: ["0"]})

    def sample(name: str, **labels: str) -> float | None:
        return registry.get_sample_value(f"vllm:kvstrata_{name}_total", {"engine": "0", **labels})

    assert sample("loaded_pages", source="l3") == 0  # every series is there from the start
    for data in rig.stats:
        prom.observe(data, 0)

    assert sample("loaded_pages", source="l2") == 4 and sample("loaded_pages", source="l3") == 0
    assert sample("backed_up_pages") == 4 and sample("failed_backup_pages") == 0
    assert sample("l3_bytes", direction="write") == summary["l3_written_bytes"]
    waited = summary["backup_wait_seconds"]  # the saves' waits for the store (rig: a flush each)
    assert waited >= 0 and sample("backup_wait_seconds") == pytest.approx(waited)


def test_two_workers_stats_are_summed_by_vllms_output_aggregator() -> None:
    """Across processes (a pickle round trip each) and tensor-parallel workers, as vLLM's
    executor merges them; a worker with nothing to say sends no stats at all."""
    rank_stats = [
        WorkerStats(loaded_l3_pages=2, l3_read_bytes=64, l3_read_seconds=0.5),
        WorkerStats(loaded_l3_pages=2, l3_read_bytes=64, l3_read_seconds=1.5, saved_pages=1),
    ]
    outputs = [
        pickle.loads(
            pickle.dumps(
                ModelRunnerOutput(
                    req_ids=[],
                    req_id_to_index={},
                    kv_connector_output=KVConnectorOutput(
                        kv_connector_stats=KvstrataConnectorStats(data=stats.as_dict())
                    ),
                )
            )
        )
        for stats in rank_stats
    ]
    merged = KVOutputAggregator(2).aggregate(outputs)
    assert merged is not None and merged.kv_connector_output is not None
    total = merged.kv_connector_output.kv_connector_stats
    assert isinstance(total, KvstrataConnectorStats)
    summary = total.reduce()
    assert (summary["loaded_l3_pages"], summary["saved_pages"], summary["l3_read_bytes"]) == (
        4,
        1,
        128,
    )
    assert summary["l3_read_gbps"] == round(128 / 2.0 / 1e9, 3)
    assert KvstrataConnector.build_kv_connector_stats(None).is_empty()


def test_a_request_waits_while_its_lookup_is_in_flight(model_dir: Path, tmp_path: Path) -> None:
    rig = Rig(model_dir, {"store": "file", "path": str(tmp_path / "l3")})
    rig.add("a", prompt(66))
    run_until_scheduled(rig, "a")
    rig.step()
    rig.scheduler.reset_prefix_cache()
    held: Future[int] = Future()
    assert rig.connector.index is not None
    real = rig.connector.index.start_lookup
    rig.connector.index.start_lookup = lambda pages: held
    rig.add("b", [*prompt(64), 9, 9])
    for _ in range(3):  # None: vLLM skips the request and asks again next step
        out = rig.step()
        assert "b" not in out.num_scheduled_tokens
        assert rig.connector.get_num_new_matched_tokens(rig.requests["b"], 0) == (None, False)
    held.set_result(real(rig.connector.index.requests["b"].pages).result())
    assert run_until_scheduled(rig, "b").num_computed_tokens == 64


def _prefix_in_l3_only(model_dir: Path, root: Path) -> Rig:
    """A rig on a file store at ``root`` with one L2 page: request "a" (four full blocks of
    ``prompt(66)``) computed, saved and finished, and vLLM's own prefix cache reset, so the
    prefix is in L3 (L2 holds only its last page)."""
    rig = Rig(model_dir, {"store": "file", "path": str(root), "l2_pages": 1})
    rig.add("a", prompt(66))
    run_until_scheduled(rig, "a")
    rig.step()
    rig.scheduler.reset_prefix_cache()
    return rig


def test_a_page_lost_before_its_load_is_reported_never_served(
    model_dir: Path, tmp_path: Path
) -> None:
    root = tmp_path / "l3"
    rig = _prefix_in_l3_only(model_dir, root)
    rig.add("b", [*prompt(64), 5, 5])
    for _ in range(20):  # let the lookup land (all 4 pages are in L3; L2 holds only the last)
        if rig.connector.get_num_new_matched_tokens(rig.requests["b"], 0)[0] is not None:
            break
        time.sleep(0.05)
    for path in sorted(root.rglob("*"), key=str)[:]:
        if path.is_file() and path.suffix != ".tmp":
            path.unlink()  # the store loses everything between the lookup and the load
    blocks_before = rig.kv.clone()
    out = rig.step()
    assert "b" in out.num_scheduled_tokens
    assert len(rig.failed) == 4 and rig.worker.loaded_pages == 0  # page 0 failed: so did 1..3
    for block in rig.failed:  # nothing was written into a block that failed to load
        assert torch.equal(rig.after_load[block], blocks_before[block])
    for _ in range(5):  # vLLM recomputes (kv_load_failure_policy: recompute) and finishes b
        rig.step()
    assert "b" not in rig.scheduler.requests
    assert rig.scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == NUM_BLOCKS - 1


def test_pages_computed_over_a_failed_load_reach_the_store_only_recomputed(
    model_dir: Path, tmp_path: Path
) -> None:
    """A request loads a shared prefix and computes two more blocks in the same step; the store
    lost the prefix between the lookup and the load. The two blocks are computed over bad KV
    (this rig's blocks depend on the blocks before them): they must not be saved then, and after
    vLLM's recompute they are saved with their right bytes (update_connector_output moves the
    request's saved mark back), so a third request loads all six right."""
    root = tmp_path / "l3"
    rig = _prefix_in_l3_only(model_dir, root)
    rig.add("b", [*prompt(64), *prompt(32, salt=3), 5, 5])
    for _ in range(40):  # let the lookup land: 4 pages in L3 (L2 holds only the last)
        if rig.connector.get_num_new_matched_tokens(rig.requests["b"], 0)[0] is not None:
            break
        time.sleep(0.05)
    for path in sorted(root.rglob("*"), key=str):
        if path.is_file() and path.suffix != ".tmp":
            path.unlink()  # the store loses the prefix between the lookup and the load
    out = rig.step()
    assert "b" in out.num_scheduled_tokens and len(rig.failed) == 4
    b_blocks = rig.block_table["b"]
    assert not torch.equal(rig.kv[b_blocks[4]], content(rig.requests["b"].block_hashes[4]))
    for _ in range(5):  # vLLM recomputes (kv_load_failure_policy: recompute) and finishes b
        rig.step()
    assert "b" not in rig.scheduler.requests
    rig.scheduler.reset_prefix_cache()
    rig.failed.clear()
    rig.add("c", [*prompt(64), *prompt(32, salt=3), 6, 6])
    scheduled = run_until_scheduled(rig, "c")
    assert scheduled.num_computed_tokens == 96 and not rig.failed  # all six from kvstrata
    hashes = rig.requests["c"].block_hashes
    for index, block in enumerate(rig.block_table["c"][:6]):
        assert torch.equal(rig.kv[block], content(hashes[index])), f"block {index} wrong"


def test_a_request_sharing_blocks_with_a_failed_load_saves_nothing_over_them(
    model_dir: Path, tmp_path: Path
) -> None:
    """Two requests in one step: b loads the prefix from L3 (the store lost it since the lookup),
    and c, allocated after b, gets a hit in vLLM's own prefix cache on b's just allocated blocks
    and computes its own two blocks over them in the same step. c saves nothing of that step
    (update_connector_output moves its saved mark back too), so a later request loads all six
    pages with their right bytes (a review's find: c's blocks reached L3 computed over the
    failed ones)."""
    root = tmp_path / "l3"
    rig = _prefix_in_l3_only(model_dir, root)
    for request_id, tail in (("b", [5, 5]), ("c", [*prompt(32, salt=3), 6, 6])):
        rig.add(request_id, [*prompt(64), *tail])
        for _ in range(60):  # let its lookup land
            if rig.connector.get_num_new_matched_tokens(rig.requests[request_id], 0)[0] is not None:
                break
            time.sleep(0.05)
    for path in sorted(root.rglob("*"), key=str):
        if path.is_file() and path.suffix != ".tmp":
            path.unlink()  # the store loses the prefix between the lookups and the load
    out = rig.step()
    assert {"b", "c"} <= set(out.num_scheduled_tokens) and rig.failed
    for _ in range(8):  # vLLM recomputes both and finishes them
        rig.step()
    assert not {"b", "c"} & set(rig.scheduler.requests)
    rig.scheduler.reset_prefix_cache()
    rig.failed.clear()
    rig.add("d", [*prompt(64), *prompt(32, salt=3), 7, 7])
    run_until_scheduled(rig, "d")
    hashes = rig.requests["d"].block_hashes
    wrong = [
        index
        for index, block in enumerate(rig.block_table["d"][:6])
        if not torch.equal(rig.kv[block], content(hashes[index]))
    ]
    assert not wrong, f"blocks {wrong} were served with bytes computed over a failed load"


LAYOUTS = [  # (physical layout, kernel block): every layout vLLM 0.33 names; kernel blocks where
    # vLLM allows them (layer-compact layouts)
    *[(layout, None) for layout in KVCacheLayout],
    (KVCacheLayout.LBNHC, BLOCK // 2),
    (KVCacheLayout.LBHNC, BLOCK // 4),
]
#: layouts whose blocks keep each head's [N, C] contiguous: what the CPU backend's split needs
HEAD_SPLIT_LAYOUTS = [
    (KVCacheLayout.LBHNC, None),
    (KVCacheLayout.BLHNC, None),
    (KVCacheLayout.LBHNC, BLOCK // 2),
]


def _filled(spec: KVCacheSpec, layout: KVCacheLayout, kernel: int | None) -> dict[str, Any]:
    caches = vllm_caches(spec, ["layers.1.attn", "layers.0.attn"], layout, kernel)  # not in order
    for number, view in enumerate(caches.values()):
        view.copy_(torch.randn(view.shape, generator=torch.Generator().manual_seed(number)))
    return caches


def backend_kv(view: torch.Tensor, block: int, split: str) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of vLLM's block ``block`` as ``[H, tokens, D]``, found the way the backend finds
    them: FlashAttention, FlashInfer, Triton (``cell``) split each token's cell at the head size;
    the CPU backend's vec kernels (``cpu_vec``) view each kernel block's head as ``[2N, D]``, take
    halves, and keep K column-major (``[D, N]``; tests/engines/vllm_cpu checks this against the
    real kernel)."""
    ratio = view.shape[0] // NUM_BLOCKS
    kernels = view[block * ratio : (block + 1) * ratio]  # [r, H, Nk, C]
    r, heads, tokens, _ = kernels.shape
    if split == "cell":
        k, v = kernels.split(HEAD_DIM, dim=-1)
    else:
        halves = kernels.reshape(r, heads, 2, tokens * HEAD_DIM)
        k = halves[:, :, 0].reshape(r, heads, HEAD_DIM, tokens).transpose(-1, -2)
        v = halves[:, :, 1].reshape(r, heads, tokens, HEAD_DIM)
    return k.permute(1, 0, 2, 3).reshape(heads, -1, HEAD_DIM), v.permute(1, 0, 2, 3).reshape(
        heads, -1, HEAD_DIM
    )


#: (blocks, slots, gather_below): one ascending run (a strided copy), scattered pairs (a strided
#: copy each, or one gather and one scatter per layer)
PAIRS = {
    "run": (list(range(3, 11)), list(range(2, 10)), 4),
    "scattered": ([5, 3, 12], [9, 0, 4], 0),
    "scattered-gathered": ([5, 3, 12], [9, 0, 4], 4),
}


def _block_views(
    spec: Any,
    caches: dict[str, torch.Tensor],
    mla: bool,
    gather_below: int | None = None,
    split: str = "cell",
) -> Any:
    from kvstrata.integrations.vllm_blocks import BlockViews, page_shape  # noqa: PLC0415

    shape, heads, size = page_shape(spec, len(caches), mla, "test")
    return BlockViews(
        caches, NUM_BLOCKS, shape, heads, size, split=split, gather_below=gather_below
    )


def _mha() -> FullAttentionSpec:
    return FullAttentionSpec(
        block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD_DIM, dtype=torch.float32
    )


@pytest.mark.parametrize("pairs", list(PAIRS))
@pytest.mark.parametrize(
    ("layout", "kernel"), LAYOUTS, ids=[f"{lay.name}-{k or BLOCK}" for lay, k in LAYOUTS]
)
def test_an_mla_page_is_its_block_in_every_vllm_layout_and_kernel_block(
    layout: KVCacheLayout, kernel: int | None, pairs: str
) -> None:
    """MLA: a page is the block's latents in logical order; saved from one layout and loaded into
    another, every block holds what it held."""
    from kvstrata.impl.pools import HostKVPool  # noqa: PLC0415

    spec = MLAAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=24, dtype=torch.float32)
    blocks, slots, gather_below = PAIRS[pairs]
    source = _filled(spec, KVCacheLayout.LBNHC, None)
    saver = _block_views(spec, source, True, gather_below)
    host = HostKVPool(saver.shape, 16, "page_first_direct")
    saver.save(blocks, host, slots)
    target = vllm_caches(spec, list(source), layout, kernel)
    _block_views(spec, target, True, gather_below).load(host, slots, blocks)
    for name in source:
        for block in range(NUM_BLOCKS):
            written = manager_block(target[name], block)
            if block in blocks:
                assert torch.equal(written, manager_block(source[name], block))
            else:
                assert not written.any()  # only the blocks asked for


SPLITS = [  # (source split, layout, kernel; target split, layout, kernel)
    *[("cell", KVCacheLayout.LBNHC, None, "cell", lay, k) for lay, k in LAYOUTS],
    *[("cpu_vec", lay, k, "cell", KVCacheLayout.LBNHC, None) for lay, k in HEAD_SPLIT_LAYOUTS],
    *[("cell", KVCacheLayout.LBNHC, None, "cpu_vec", lay, k) for lay, k in HEAD_SPLIT_LAYOUTS],
]


@pytest.mark.parametrize("pairs", list(PAIRS))
@pytest.mark.parametrize(
    "case",
    SPLITS,
    ids=[
        f"{a}-{la.name}-{ka or BLOCK}-to-{b}-{lb.name}-{kb or BLOCK}"
        for a, la, ka, b, lb, kb in SPLITS
    ],
)
def test_a_page_holds_k_then_v_whatever_the_backend_layout_or_kernel_block(
    case: tuple[Any, ...], pairs: str
) -> None:
    """vLLM lays a block out in the order its attention backend wants (``KVCacheLayout``, kernel
    blocks smaller than vLLM's block), behind one logical ``[B, H, N, C]`` view, and each backend
    finds K and V in it its own way (a cell's halves, or a CPU head's halves). A page saved from
    one backend holds the block's K then V, each ``[H, N, D]``, and loaded into another backend
    every block's K and V, as that backend finds them, are the ones saved: deployments on other
    backends share pages bit for bit."""
    from kvstrata.impl.pools import HostKVPool  # noqa: PLC0415

    from_split, from_layout, from_kernel, to_split, to_layout, to_kernel = case
    spec = _mha()
    blocks, slots, gather_below = PAIRS[pairs]
    source = _filled(spec, from_layout, from_kernel)
    saver = _block_views(spec, source, False, gather_below, from_split)
    host = HostKVPool(saver.shape, 16, "page_first_direct")
    saver.save(blocks, host, slots)
    pages = host.read_pages(slots)  # [planes, L, n, page, 1, X]
    target = vllm_caches(spec, list(source), to_layout, to_kernel)
    _block_views(spec, target, False, gather_below, to_split).load(host, slots, blocks)
    for layer, name in enumerate(("layers.0.attn", "layers.1.attn")):
        for page, block in enumerate(blocks):
            k, v = backend_kv(source[name], block, from_split)
            assert torch.equal(pages[0, layer, page].reshape(HEADS, BLOCK, HEAD_DIM), k)
            assert torch.equal(pages[1, layer, page].reshape(HEADS, BLOCK, HEAD_DIM), v)
            loaded = backend_kv(target[name], block, to_split)
            assert torch.equal(loaded[0], k) and torch.equal(loaded[1], v)
        others = [b for b in range(NUM_BLOCKS) if b not in blocks]
        assert not any(manager_block(target[name], b).any() for b in others)  # only those asked


def test_the_split_comes_from_the_backends_that_run_the_layers(model_dir: Path) -> None:
    """The worker finds each layer's backend in vLLM's forward context; a backend whose K/V split
    kvstrata does not know, none, or two that split differently, refuse to start."""
    from kvstrata.integrations.vllm_blocks import kv_split  # noqa: PLC0415
    from kvstrata.integrations.vllm_config import attention_backends  # noqa: PLC0415

    assert kv_split({"FLASH_ATTN", "TRITON_ATTN"}, False, "x") == "cell"
    assert kv_split({"CPU_ATTN:vec", "CPU_ATTN:vec16"}, False, "x") == "cpu_vec"
    assert kv_split({"ANY_MLA_BACKEND"}, True, "x") == ""  # a latent has no K/V to split
    refused = ({"ROCM_ATTN"}, set(), {"CPU_ATTN:vec", "FLASH_ATTN"}, {"CPU_ATTN:amx"}, {"CPU_ATTN"})
    for backends in refused:  # AMX packs K and V in tiles: not known here
        with pytest.raises(ConfigError, match="knows where K and V lie"):
            kv_split(backends, False, "x")
    config = vllm_config(model_dir, {"store": "file", "path": "/nonexistent"})
    assert attention_backends(config, ["layers.0.attn", "layers.9.attn"]) == {"FLASH_ATTN"}
    with_backend(config, "CPU_ATTN:vec16")  # the CPU kernel's isa, as vLLM sets it on the layer
    assert attention_backends(config, ["layers.0.attn"]) == {"CPU_ATTN:vec16"}
    with_backend(config, "ROCM_ATTN")
    worker = KvstrataConnector(config, KVConnectorRole.WORKER, kv_cache_config())
    spec = kv_cache_config().kv_cache_groups[0].kv_cache_spec
    with pytest.raises(ConfigError, match="ROCM_ATTN"):
        worker.register_kv_caches(vllm_caches(spec, ["layers.0.attn"]))
    with_backend(config, "CPU_ATTN:vec")  # needs each head's [N, C] contiguous: LBNHC has not
    with pytest.raises(ConfigError, match="cpu_vec split"):
        worker.register_kv_caches(vllm_caches(spec, ["layers.0.attn"]))
    with_backend(config, "FLASH_ATTN")  # a layer that reuses another's KV is no layer of its own
    caches = vllm_caches(spec, ["layers.0.attn"])
    worker.register_kv_caches({**caches, "layers.1.attn": caches["layers.0.attn"]})
    assert worker.worker is not None


def test_kv_cells_a_page_cannot_hold_are_refused(model_dir: Path) -> None:
    """A connector refuses, at start, KV cells it cannot cut into K and V pages (packed or unequal
    K/V), and views that are not vLLM's ``[B, H, N, C]``."""
    from kvstrata.integrations.vllm_blocks import page_geometry  # noqa: PLC0415

    def spec(**fields: Any) -> FullAttentionSpec:
        return FullAttentionSpec(
            block_size=BLOCK, num_kv_heads=HEADS, dtype=torch.float32, **fields
        )

    assert page_geometry(spec(head_size=HEAD_DIM), False, "x") == (HEADS, HEAD_DIM)
    with pytest.raises(ConfigError, match="unequal K/V"):
        page_geometry(spec(head_size=HEAD_DIM, head_size_v=2 * HEAD_DIM), False, "x")
    with pytest.raises(ConfigError, match="packed"):
        page_geometry(spec(head_size=HEAD_DIM, state_content_bytes=72), False, "x")
    with pytest.raises(ConfigError, match=r"vLLM >= 0\.32"):
        page_geometry(SimpleNamespace(head_size=HEAD_DIM, dtype=torch.float32), False, "x")
    config = vllm_config(model_dir, {"store": "file", "path": "/nonexistent"})
    worker = KvstrataConnector(config, KVConnectorRole.WORKER, kv_cache_config())
    # the page order is in the keys: pages an earlier version cut otherwise are never read
    assert worker._template.keyspace().model.dtype == "float32~hnd"
    old_style = {"layers.0.attn": torch.zeros(NUM_BLOCKS, 2, BLOCK, HEADS, HEAD_DIM)}
    with pytest.raises(ConfigError, match=r"not vLLM's \[B, H, N, C\] view"):
        worker.register_kv_caches(old_style)
    from kvstrata.impl.errors import MisuseError  # noqa: PLC0415
    from kvstrata.impl.pools import HostKVPool  # noqa: PLC0415

    real = kv_cache_config().kv_cache_groups[0].kv_cache_spec
    views = _block_views(real, vllm_caches(real, ["layers.0.attn"]), False)
    host = HostKVPool(views.shape, 4, "page_first_direct")
    host.canonical().fill_(7.0)
    for blocks, slots in (
        ([1, 1], [0, 1]),
        ([1, 2], [0, 0]),
        ([NUM_BLOCKS], [0]),
        ([1], [4]),
        ([1, 2], [0]),
    ):
        with pytest.raises(MisuseError):
            views.save(blocks, host, slots)
        with pytest.raises(MisuseError):
            views.load(host, slots, blocks)
    assert bool((host.canonical() == 7.0).all())  # nothing copied
    other = HostKVPool(attrs.evolve(views.shape, page_size=2 * BLOCK), 4, "page_first_direct")
    with pytest.raises(MisuseError, match="host pool"):
        views.save([1], other, [0])
    two_layers = _block_views(real, vllm_caches(real, ["layers.0.attn", "layers.1.attn"]), False)
    with pytest.raises(MisuseError, match="page_first"):  # a layer's page rows not contiguous
        two_layers.save([1], HostKVPool(two_layers.shape, 4, "page_first"), [0])


def test_async_scheduling_saves_nothing_over_a_failed_load_before_it_is_reported(
    model_dir: Path, tmp_path: Path
) -> None:
    """vLLM's ``AsyncScheduler`` builds step N+1 before it takes step N's output. A request loads
    a four-block prefix from L3 (the store lost it since the lookup) and prefills the rest in
    chunks of three blocks: the second chunk is scheduled, and computed over the same bad KV,
    before the failure is reported. Nothing computed over it reaches the store: once vLLM has
    recomputed, a later request loads all ten blocks with their right bytes."""
    root = tmp_path / "l3"
    _prefix_in_l3_only(model_dir, root).worker.shutdown()
    rig = Rig(model_dir, {"store": "file", "path": str(root), "l2_pages": 1}, AsyncScheduler, 48)
    tokens = [*prompt(64), *prompt(96, salt=3), 5, 5]
    rig.add("b", tokens)
    lookup_landed(rig, "b")  # the 4 prefix pages are in L3 only
    lose_everything(root)
    first = rig.scheduler.schedule()
    assert "b" in first.num_scheduled_tokens
    ran = rig.run(first)
    assert len(ran[0]) == 4  # the prefix failed to load
    second = rig.scheduler.schedule()  # before the first step's output: b's next chunk
    assert second.num_scheduled_tokens.get("b") == 48
    assert second.kv_connector_metadata.plan.saves  # it plans saves over the failed prefix
    rig.report(first, *ran)
    run_async(rig, (second, rig.run(second)))
    assert loaded_wrong(rig, "c", [*tokens[:-2], 6, 6]) == (160, [])  # all ten, right


def test_async_scheduling_a_request_sharing_the_failed_blocks_saves_nothing_over_them(
    model_dir: Path, tmp_path: Path
) -> None:
    """Async scheduling: b's load of a prefix fails in step 1; before that is reported, c
    arrives, hits b's (bad) blocks in vLLM's own prefix cache and prefills its next three blocks
    over them in step 2. vLLM keeps c's tokens as computed when it takes the report (the blocks
    are b's to recompute), so c's later chunks attend over bad KV too: the connector never saves
    a page of c again (the review's find: c's saved mark went back and a later step saved the
    three blocks)."""
    root = tmp_path / "l3"
    _prefix_in_l3_only(model_dir, root).worker.shutdown()
    extra = {"store": "file", "path": str(root), "l2_pages": 16}
    rig = Rig(model_dir, extra, AsyncScheduler, 48)
    rig.add("b", [*prompt(64), 5, 5])
    lookup_landed(rig, "b")
    lose_everything(root)
    first = rig.scheduler.schedule()
    ran = rig.run(first)
    assert len(ran[0]) == 4
    rig.add("c", [*prompt(64), *prompt(96, salt=5), 9])
    lookup_landed(rig, "c")
    second = rig.scheduler.schedule()
    assert second.num_scheduled_tokens.get("c") == 48  # over b's blocks, from vLLM's cache
    rig.report(first, *ran)
    run_async(rig, (second, rig.run(second)))
    assert not stored_wrong(rig, "c"), "the store holds pages computed over a failed load"
    assert stored_wrong(rig, "b") == []
    computed, wrong = loaded_wrong(rig, "d", [*prompt(64), *prompt(96, salt=5), 3, 3])
    assert (computed, wrong) == (64, [])  # b's recomputed prefix; none of c's pages


class PipelineRig(Rig):
    """Two pipeline stages: vLLM's scheduler (``pipeline_parallel_size`` 2) as in :class:`Rig`,
    and each stage's worker side on a paged KV of its own (its layers), keyed by its ``pp_rank``.
    One process has no PP group: vLLM's group lookup and the gloo pipe are stood in for by the
    stage number and in-process queues (the gloo pipe has its own test with two processes,
    tests/unit/integrations/test_connector_failed_load.py)."""

    def __init__(
        self,
        model_dir: Path,
        extra: dict[str, Any],
        monkeypatch: Any,
        scheduler: type[Scheduler] = Scheduler,
        budget: int = 1024,
    ) -> None:
        pipes, building = LocalStagePipes(2), [0]
        for module in (vllm_connector, vllm_groups):  # the name vllm.py imported, and its own
            monkeypatch.setattr(
                module,
                "process_group",
                lambda which: SimpleNamespace(
                    rank_in_group=building[0], cpu_group=None, ranks=[0, 1]
                ),
            )
        monkeypatch.setattr(
            vllm_connector, "TorchStagePipe", lambda group, ranks, stage: pipes.pipe(stage)
        )
        super().__init__(model_dir, extra, scheduler, budget, stages=2)  # stage 0's worker side
        building[0] = 1
        spec = kv_cache_config().kv_cache_groups[0].kv_cache_spec
        self.kvs = [self.kv, vllm_caches(spec, ["layers.0.attn"])["layers.0.attn"]]
        self.stages = [
            self.worker,
            KvstrataConnector(self.config, KVConnectorRole.WORKER, kv_cache_config()),
        ]
        self.stages[1].register_kv_caches({"layers.0.attn": self.kvs[1]})

    def run(self, out: Any, every_block: bool = False) -> tuple[set[int], set[str]]:
        """Each stage in turn loads, computes from the stage before it and saves (vLLM's
        pipeline); the engine reports every stage's failed blocks."""
        invalid: set[int] = set()
        chunks: set[str] = set()
        for stage, (worker, kv) in enumerate(zip(self.stages, self.kvs, strict=True)):
            worker.bind_connector_metadata(out.kv_connector_metadata)
            worker.start_load_kv(None)
            invalid |= worker.get_block_ids_with_load_errors()
            upstream = self.kvs[stage - 1] if stage else None
            chunks = self.compute(out, kv, every_block, upstream)
            worker.wait_for_save()
            land_puts(worker)
            worker.clear_connector_metadata()
        self.failed |= invalid
        return invalid, chunks


def test_a_later_stage_saves_nothing_over_an_earlier_stages_failed_load(
    model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Pipeline parallelism: request b loads a prefix both stages stored, and computes two more
    blocks in the same step; stage 0's store lost the prefix, stage 1's did not. Stage 1's own
    load works, but its blocks 4-5 are computed from stage 0's hidden states over bad KV: they
    must not reach stage 1's store (before the stages told each other, they did). After vLLM's
    recompute a third request loads all six blocks right on both stages."""
    rig = PipelineRig(
        model_dir, {"store": "file", "path": str(tmp_path / "l3"), "l2_pages": 1}, monkeypatch
    )
    rig.add("a", prompt(66))
    run_until_scheduled(rig, "a")
    rig.step()
    rig.scheduler.reset_prefix_cache()  # the prefix is in L3 (L2 holds only its last page)
    rig.add("b", [*prompt(64), *prompt(32, salt=3), 5, 5])
    lookup_landed(rig, "b")
    stage0 = rig.stages[0].worker
    assert stage0 is not None and stage0.backend is not None
    for block_hash in rig.requests["b"].block_hashes[:4]:  # lost on stage 0 only
        stage0.backend.evict(stage0.namespace, engine_page_hash(bytes(block_hash), HashScheme.VLLM))
    out = rig.step()
    assert "b" in out.num_scheduled_tokens and len(rig.failed) == 4
    assert stored_wrong(rig, "b", stage=1) == []
    for _ in range(5):  # vLLM recomputes (kv_load_failure_policy: recompute) and finishes b
        rig.step()
    assert "b" not in rig.scheduler.requests
    assert stored_wrong(rig, "b", stage=0) == [] and stored_wrong(rig, "b", stage=1) == []
    rig.scheduler.reset_prefix_cache()
    rig.failed.clear()
    rig.add("c", [*prompt(64), *prompt(32, salt=3), 6, 6])
    scheduled = run_until_scheduled(rig, "c")
    assert scheduled.num_computed_tokens == 96 and not rig.failed  # all six from kvstrata
    hashes = rig.requests["c"].block_hashes
    for kv in rig.kvs:
        for index, block in enumerate(rig.block_table["c"][:6]):
            assert torch.equal(kv[block], content(hashes[index])), f"block {index} wrong"


def _lose_on_stage_0(rig: PipelineRig, request_id: str, pages: int) -> None:
    """Stage 0's store loses the request's first ``pages`` pages; stage 1's keeps them."""
    stage0 = rig.stages[0].worker
    assert stage0 is not None and stage0.backend is not None
    for block_hash in rig.requests[request_id].block_hashes[:pages]:
        page = engine_page_hash(bytes(block_hash), HashScheme.VLLM)
        stage0.backend.evict(stage0.namespace, page)


def test_async_scheduling_a_later_stage_drops_the_next_plans_saves_too(
    model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Pipeline parallelism under vLLM's ``AsyncScheduler``: b's four-block prefix fails to load
    on stage 0 only, and b prefills the rest in chunks; the second chunk is scheduled before the
    failure is reported. Stage 1 learned of stage 0's failure when it saved the first step and
    drops the second chunk's saves too; after the recompute both stages' stores hold only right
    bytes and a later request loads all ten blocks right on both stages."""
    extra = {"store": "file", "path": str(tmp_path / "l3"), "l2_pages": 1}
    first_rig = PipelineRig(model_dir, extra, monkeypatch)
    first_rig.add("a", prompt(66))
    run_until_scheduled(first_rig, "a")
    first_rig.step()  # a's four pages in both stages' stores
    for connector in first_rig.stages:
        connector.shutdown()
    rig = PipelineRig(model_dir, extra, monkeypatch, AsyncScheduler, 48)
    tokens = [*prompt(64), *prompt(96, salt=3), 5, 5]
    rig.add("b", tokens)
    lookup_landed(rig, "b")
    _lose_on_stage_0(rig, "b", 4)
    first = rig.scheduler.schedule()
    ran = rig.run(first)
    assert len(ran[0]) == 4  # stage 0's load of the prefix failed
    second = rig.scheduler.schedule()  # before the first step's output: b's next chunk
    assert second.num_scheduled_tokens.get("b") == 48
    assert second.kv_connector_metadata.plan.saves  # it plans saves over the failed prefix
    rig.report(first, *ran)
    run_async(rig, (second, rig.run(second)))
    assert stored_wrong(rig, "b", stage=0) == [] and stored_wrong(rig, "b", stage=1) == []
    assert loaded_wrong(rig, "c", [*tokens[:-2], 6, 6]) == (160, [])  # all ten, stage 0 right
    hashes = rig.requests["c"].block_hashes
    for index, block in enumerate(rig.block_table["c"][:10]):
        assert torch.equal(rig.kvs[1][block], content(hashes[index])), f"stage 1 block {index}"


@pytest.mark.parametrize(
    ("stages", "asynchronous"), [(1, False), (1, True), (2, False), (3, False)]
)
def test_the_connector_takes_reports_as_late_as_vllms_batch_queue_gives_them(
    model_dir: Path, stages: int, asynchronous: bool
) -> None:
    """The scheduler side's ``lag`` is vLLM's ``max_concurrent_batches`` less one (at least 1):
    the plans its engine core builds after a step's plan before it takes that step's output."""
    config = vllm_config(model_dir, {"store": "memory"})
    config.parallel_config.pipeline_parallel_size = stages
    config.scheduler_config.async_scheduling = asynchronous
    connector = KvstrataConnector(config, KVConnectorRole.SCHEDULER, kv_cache_config())
    assert connector.lag == max(1, config.max_concurrent_batches - 1)
    assert (
        connector.lag
        == {(1, False): 1, (1, True): 1, (2, False): 1, (3, False): 2}[stages, asynchronous]
    )
    assert connector.index is not None and connector.index.lag == connector.lag
    connector.shutdown()
    older = SimpleNamespace(scheduler_config=SimpleNamespace(async_scheduling=True))  # no property
    assert report_lag(older, 2) == 2


def fp8_config(
    model_dir: Path,
    store: Path,
    cache_dtype: str,
    backend: str = "FLASH_ATTN",
    extra: dict[str, Any] | None = None,
    **model: Any,
) -> tuple[VllmConfig, KVCacheConfig]:
    """A deployment whose KV vLLM keeps as ``uint8`` (every fp8 cache dtype), on the file store at
    ``store``, its layer run by ``backend``; ``extra``: further connector options; ``model``:
    further ``ModelConfig`` fields."""
    options = {"store": "file", "path": str(store), **(extra or {})}
    config = with_backend(_vllm_config(model_dir, options, 1024), backend)
    config.cache_config.cache_dtype = cache_dtype
    for name, value in model.items():
        setattr(config.model_config, name, value)
    return config, kv_cache_config(torch.uint8)


def fp8_worker(
    model_dir: Path,
    store: Path,
    cache_dtype: str,
    backend: str = "FLASH_ATTN",
    extra: dict[str, Any] | None = None,
    **model: Any,
) -> KvstrataConnector:
    """The connector's worker side of :func:`fp8_config`'s deployment, its KV caches registered."""
    config, kv_config = fp8_config(model_dir, store, cache_dtype, backend, extra, **model)
    worker = KvstrataConnector(config, KVConnectorRole.WORKER, kv_config)
    spec = kv_config.kv_cache_groups[0].kv_cache_spec
    worker.register_kv_caches(vllm_caches(spec, ["layers.0.attn"]))
    return worker


def stored_page(worker: KvstrataConnector, page: PageHash) -> torch.Tensor:
    """Random bytes put in L3 as ``page`` by ``worker``'s side (host slot 0); what it holds."""
    side = worker.worker
    assert side is not None and side.backend is not None
    written = torch.randint(0, 256, side.host.read_pages([0]).shape, dtype=torch.uint8)
    side.host.write_pages([0], written)
    assert side.backend.put(side.namespace, [page], [0]) == [PutStatus.STORED]
    return written


def found_page(worker: KvstrataConnector, page: PageHash) -> torch.Tensor | None:
    """What ``worker``'s side gets for ``page`` from L3 (host slot 1), ``None`` on a miss."""
    side = worker.worker
    assert side is not None and side.backend is not None
    if side.backend.get(side.namespace, [page], [1]) != [GetStatus.LOADED]:
        return None
    return side.host.read_pages([1])


def test_fp8_formats_vllm_stores_as_bytes_never_read_each_others_pages(
    model_dir: Path, tmp_path: Path
) -> None:
    """vLLM keeps fp8_e4m3 and fp8_e5m2 KV alike as uint8 blocks of one size: the cache dtype, not
    the tensor's, says what the bytes are, so two deployments of one model that differ in it share
    no page (issue 20, part 19); ``fp8`` is e4m3 here and shares with ``fp8_e4m3``."""
    store = tmp_path / "l3"
    page = engine_page_hash(hashlib.sha256(b"block").digest(), HashScheme.VLLM)
    written = stored_page(fp8_worker(model_dir, store, "fp8_e4m3"), page)

    def found(worker: KvstrataConnector) -> torch.Tensor | None:
        return found_page(worker, page)

    e5m2 = fp8_worker(model_dir, store, "fp8_e5m2")
    assert found(e5m2) is None  # same size, other numbers: a miss, never the e4m3 bytes
    same = found(fp8_worker(model_dir, store, "fp8"))
    assert same is not None and torch.equal(same, written)
    assert found(fp8_worker(model_dir, store, "fp8", revision="another")) is None  # other weights
    assert found(fp8_worker(model_dir, store, "fp8", quantization="fp8")) is None  # online
    # vLLM resolves a Hub model's revision even when none was asked ("main"): that default is
    # not another model, and nodes that could not resolve it must agree with those that could
    resolved = ResolvedRevision("0" * 40, initial=None)
    assert torch.equal(found(fp8_worker(model_dir, store, "fp8", revision=resolved)), written)
    with pytest.raises(ConfigError, match="cache dtype is 'auto'"):
        fp8_worker(model_dir, store, "auto")


def test_fp8_pages_are_shared_only_by_deployments_on_the_backend_that_wrote_them(
    model_dir: Path, tmp_path: Path
) -> None:
    """vLLM's Triton backend writes an ``fp8_e5m2`` cache in the platform's e4m3 type, FlashInfer
    real e5m2, both under the cache dtype ``fp8_e5m2``: pages of a KV vLLM keeps as bytes are
    keyed by the backend that wrote them (issue 20, part 21), so neither reads the other's bytes
    as its own numbers; a KV kept in its own dtype names no backend and is shared by all."""
    store = tmp_path / "l3"
    page = engine_page_hash(hashlib.sha256(b"block").digest(), HashScheme.VLLM)

    triton = fp8_worker(model_dir, store, "fp8_e5m2", "TRITON_ATTN")
    written = stored_page(triton, page)
    assert found_page(fp8_worker(model_dir, store, "fp8_e5m2", "FLASHINFER"), page) is None
    again = found_page(fp8_worker(model_dir, store, "fp8_e5m2", "TRITON_ATTN"), page)
    assert again is not None and torch.equal(again, written)
    # Triton keeps every fp8 cache in the platform's e4m3 type (float8_e4m3fnuz on ROCm's MI300):
    # the platform's type is part of the writer
    fp8 = str(current_platform.fp8_dtype()).removeprefix("torch.")
    handshake = triton.get_handshake_metadata()
    assert handshake is not None and handshake.kv_backend == f"TRITON_ATTN on {fp8}"
    assert pickle.loads(pickle.dumps(handshake)) == handshake  # it crosses vLLM's RPC
    assert triton.worker is not None and triton.worker.backend is not None
    dtype = triton.worker.backend.keyspace.model.dtype
    assert dtype == f"uint8.float8_e5m2@triton_attn_on_{fp8}~hnd"
    # the same dtype kept as itself (float32 here): any backend's pages, one key
    plain = {"store": "file", "path": str(tmp_path / "plain")}
    for backend, layout in (
        ("FLASH_ATTN", KVCacheLayout.LBNHC),
        ("CPU_ATTN:vec16", KVCacheLayout.LBHNC),
    ):
        worker = KvstrataConnector(
            with_backend(_vllm_config(model_dir, plain, 1024), backend),
            KVConnectorRole.WORKER,
            kv_cache_config(),
        )
        spec = kv_cache_config().kv_cache_groups[0].kv_cache_spec
        worker.register_kv_caches(vllm_caches(spec, ["layers.0.attn"], layout))
        assert worker.get_handshake_metadata() is None  # nothing to tell (vLLM's default)
        assert worker.worker is not None and worker.worker.backend is not None
        assert worker.worker.backend.keyspace.model.dtype == "float32~hnd"
    with pytest.raises(ConfigError, match="set one attention backend"):
        config, kv_config = fp8_config(model_dir, store, "fp8")
        config.compilation_config.static_forward_context["layers.0.attn"] = _Layer("FLASHINFER")
        config.compilation_config.static_forward_context["layers.1.attn"] = _Layer("TRITON_ATTN")
        kv_config.kv_cache_groups[0].layer_names.append("layers.1.attn")
        KvstrataConnector(config, KVConnectorRole.WORKER, kv_config).register_kv_caches(
            vllm_caches(
                kv_config.kv_cache_groups[0].kv_cache_spec, ["layers.0.attn", "layers.1.attn"]
            )
        )


def test_the_scheduler_side_finds_byte_kv_pages_once_the_workers_said_who_writes_them(
    model_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The scheduler process renders the keys it looks up, but only a worker knows its attention
    backend: vLLM's connector handshake (after the workers registered their KV caches, before
    the first request) carries it. Before it, a byte-typed KV's lookups find nothing (and say so
    once); after it, they find the pages the workers wrote; workers that disagree are refused."""
    init_none_hash(sha256)
    store = tmp_path / "l3"
    config, kv_config = fp8_config(model_dir, store, "fp8_e4m3", "TRITON_ATTN")
    scheduler = KvstrataConnector(config, KVConnectorRole.SCHEDULER, kv_config)
    hasher = get_request_block_hasher(BLOCK, sha256)

    def request(request_id: str) -> Request:
        sampling = SamplingParams(max_tokens=1, ignore_eos=True)
        return Request(request_id, prompt(2 * BLOCK + 1), sampling, None, None, block_hasher=hasher)

    worker = fp8_worker(model_dir, store, "fp8_e4m3", "TRITON_ATTN")
    side = worker.worker
    assert side is not None and side.backend is not None
    pages = [engine_page_hash(bytes(h), HashScheme.VLLM) for h in request("r").block_hashes]
    assert side.backend.put(side.namespace, pages, [0, 1]) == [PutStatus.STORED] * 2

    def matched(request_id: str) -> int:
        return landed_match(scheduler, request(request_id))

    with caplog.at_level("WARNING", logger="kvstrata.integrations.vllm"):
        assert matched("before") == matched("before, again") == 0
    told = [r.message for r in caplog.records if r.name == "kvstrata.integrations.vllm"]
    assert len(told) == 1 and "handshake" in told[0], told  # said once, not per request
    other = SimpleNamespace(engine_id="a NIXL worker's report")  # another connector's: skipped
    scheduler.set_xfer_handshake_metadata_pp_aware(
        {(0, 0): worker.get_handshake_metadata(), (0, 1): other}
    )
    assert matched("after") == 2 * BLOCK
    with pytest.raises(ConfigError, match="other backends"):
        scheduler.set_xfer_handshake_metadata(
            {0: worker.get_handshake_metadata(), 1: vllm_connector.KvstrataHandshake("FLASHINFER")}
        )
    config, kv_config = fp8_config(model_dir, store, "fp8_e4m3", "FLASHINFER")
    elsewhere = KvstrataConnector(config, KVConnectorRole.SCHEDULER, kv_config)
    elsewhere.set_xfer_handshake_metadata(
        {0: vllm_connector.KvstrataHandshake(platform_writer("FLASHINFER"))}
    )
    scheduler = elsewhere  # a deployment on another backend: Triton's pages are not its own
    assert matched("elsewhere") == 0


def test_a_configured_writing_backend_needs_no_handshake(model_dir: Path, tmp_path: Path) -> None:
    """Under a ``MultiConnector`` vLLM hands the scheduler only the first sub-connector's
    handshake report, and another connector's (NIXL's) refuses any but its own: an operator
    names the backend (``kv_backend``) instead. The scheduler side then keys by it from the
    start, the workers check it against the backend they find and report nothing."""
    init_none_hash(sha256)
    store, named = tmp_path / "l3", {"kv_backend": "TRITON_ATTN"}
    worker = fp8_worker(model_dir, store, "fp8_e4m3", "TRITON_ATTN", named)
    assert worker.get_handshake_metadata() is None
    side = worker.worker
    assert side is not None and side.backend is not None
    hasher = get_request_block_hasher(BLOCK, sha256)
    sampling = SamplingParams(max_tokens=1, ignore_eos=True)
    request = Request("r", prompt(2 * BLOCK + 1), sampling, None, None, block_hasher=hasher)
    pages = [engine_page_hash(bytes(h), HashScheme.VLLM) for h in request.block_hashes]
    assert side.backend.put(side.namespace, pages, [0, 1]) == [PutStatus.STORED] * 2
    config, kv_config = fp8_config(model_dir, store, "fp8_e4m3", "TRITON_ATTN", named)
    scheduler = KvstrataConnector(config, KVConnectorRole.SCHEDULER, kv_config)
    assert scheduler.kv_backend == worker.kv_backend
    assert landed_match(scheduler, request) == 2 * BLOCK
    with pytest.raises(ConfigError, match=r"but \['TRITON_ATTN'\] writes the KV"):
        fp8_worker(model_dir, store, "fp8_e4m3", "TRITON_ATTN", {"kv_backend": "FLASHINFER"})
    with pytest.raises(ConfigError, match="kv_backend must be"):
        fp8_worker(model_dir, store, "fp8_e4m3", "TRITON_ATTN", {"kv_backend": " "})


def test_a_steps_backup_lands_behind_it_unless_async_backup_is_off(
    model_dir: Path, tmp_path: Path
) -> None:
    """``wait_for_save`` returns once the step's blocks are in L2: the put to L3 runs on the
    worker's own thread (here held back by a store that cannot answer yet) and lands later, when
    the next step needs its slots, a flush, or shutdown. ``async_backup: false`` waits for it, as
    before; anything but a bool is refused."""
    rig = Rig(model_dir, {"store": "file", "path": str(tmp_path / "l3"), "l2_pages": 16})
    side = rig.worker.worker
    assert side is not None and side.lane is not None and side.backend is not None
    assert isinstance(side.lane.executor, ThreadExecutor)
    gate, put = threading.Event(), side.backend.put

    def held_put(*args: Any) -> list[PutStatus]:
        assert gate.wait(10), "the test never let the store answer"
        return put(*args)

    side.lane.backend = SimpleNamespace(put=held_put, get=side.backend.get)  # type: ignore[assignment]
    request = rig.add("a", prompt(2 * BLOCK + 1))
    for _ in range(200):  # the lookup lands, then "a" is scheduled and its pages saved
        out = rig.scheduler.schedule()
        if out.scheduled_new_reqs:
            break
        rig.report(out, set(), set())
        time.sleep(0.01)
    rig.worker.bind_connector_metadata(out.kv_connector_metadata)
    rig.worker.start_load_kv(None)
    rig.compute(out, rig.kv, every_block=True)
    rig.worker.wait_for_save()  # returns with the put held in the store
    assert side.lane.pinned and side.backend.exists(side.namespace, [page_of(request, 0)]) == 0
    gate.set()
    side.flush()
    pages = [page_of(request, index) for index in range(2)]
    assert side.backend.exists(side.namespace, pages) == 2 and not side.lane.pinned
    rig.worker.shutdown()
    sync = Rig(model_dir, {"store": "file", "path": str(tmp_path / "l3b"), "async_backup": False})
    assert sync.worker.worker is not None and sync.worker.worker.lane is not None
    assert isinstance(sync.worker.worker.lane.executor, InlineExecutor)
    with pytest.raises(ConfigError, match="'async_backup' expects true or false"):
        Rig(model_dir, {"store": "file", "path": str(tmp_path / "l3c"), "async_backup": "yes"})


def page_of(request: Request, index: int) -> PageHash:
    """The kvstrata page of a request's block ``index``."""
    return engine_page_hash(bytes(request.block_hashes[index]), HashScheme.VLLM)
