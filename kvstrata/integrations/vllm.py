"""kvstrata as a vLLM KV connector: :class:`KvstrataConnector` (vLLM 0.33, ``KVConnectorBase_V1``).

Turn it on with::

    --kv-transfer-config '{"kv_connector":"KvstrataConnector",
        "kv_connector_module_path":"kvstrata.integrations.vllm", "kv_role":"kv_both",
        "kv_load_failure_policy":"recompute",
        "kv_connector_extra_config":{"master":"10.0.0.5:50051","l2_pages":4096}}'

vLLM's blocks are L1 (its own prefix cache decides what is local); kvstrata's host pool is L2 and the
store (Mooncake by default) L3. This module converts vLLM's types; :mod:`kvstrata.integrations.connector`
holds the behaviour (scheduler side: :class:`ConnectorIndex`; worker side: :class:`ConnectorWorker`),
:mod:`kvstrata.model.connector` its reference model and :mod:`kvstrata.model.engines` the keys.

- Scheduler side: a new request's L3 lookup starts in ``on_new_request`` (a background thread asks
  the store, for every tensor-parallel rank's keys); ``get_num_new_matched_tokens`` is ``None`` until
  it lands, then L2 hits plus the L3 pages after them, without side effects, always leaving one token
  to compute. Loads are synchronous (done before the forward that needs them).
- Worker side: ``start_load_kv`` reads the step's planned pages (L3 into staging slots, L2 slots
  checked against what they hold) into vLLM's blocks; ``wait_for_save`` copies newly computed full
  blocks into L2 and queues their backup to L3, which lands behind the step on a thread of the
  worker's own (a slot is written again only once the put reading it landed; the L3 reads of a
  later load run behind the puts). A page that fails to load is reported through
  ``get_block_ids_with_load_errors`` with every later page of its request, never served: run vLLM
  with ``kv_load_failure_policy: recompute``. No worker saves a page its request computed in the
  step of a failed load (it attends over bad KV); with tensor parallelism the workers first agree
  on each load's first failed page (an all-reduce over vLLM's TP group's CPU group, on every step
  that loads), since a rank whose own load went well still computes from the failed rank's hidden
  states. ``update_connector_output`` (called after vLLM rolled its requests back) tells the
  scheduler side (``ConnectorIndex.load_failures``) where vLLM computes each request again, so
  those pages are saved by a later step; vLLM builds up to ``max_concurrent_batches - 1`` plans
  before it reports a step (async scheduling, the pipeline's batch queue: the index's ``lag``), and
  the workers keep dropping saves over the failure until a plan made after the report. With
  pipeline parallelism each stage sends its loads' first failed pages to every later stage over
  vLLM's PP group's CPU group (a tag of its own), and a stage drops the saves over an earlier
  stage's failure too (``TorchStagePipe``).
- Pages: vLLM's per-layer ``[B, H, N, C]`` views, read in logical order whatever the attention
  backend's physical layout or kernel block size (:mod:`kvstrata.integrations.vllm_blocks`).
- Keys: each worker writes under its tensor-parallel rank and its pipeline stage (a stage holds its
  own layers); the scheduler side's lookup asks for every rank's keys of every stage. The model's
  revision and weight quantization, when set, are part of its identity, and so is the cache dtype
  of a KV that vLLM keeps as bytes (every fp8 variant is ``uint8`` to vLLM:
  :data:`~kvstrata.model.engines.BYTE_DTYPES`) with the attention backend that writes it (the
  workers report it through vLLM's connector handshake, or ``kv_backend`` names it), and the page
  order (MHA).

Extra config: the store options of :mod:`kvstrata.integrations.store`, plus ``l2_pages`` (host pool
pages for L2, default 1024), ``staging_pages`` (L3 read slots, default 256), ``kv_backend`` and
``async_backup`` (default true; false: each ``wait_for_save`` waits for its puts).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import attrs
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
)

from kvstrata.impl.errors import ConfigError
from kvstrata.impl.pools.host import HostKVPool
from kvstrata.impl.storage.base import StorageBackend
from kvstrata.integrations.connector import ConnectorIndex, Plan, Scheduled
from kvstrata.integrations.connector_backup import lane_executor
from kvstrata.integrations.connector_worker import ConnectorWorker, TorchStagePipe
from kvstrata.integrations.store import StoreOptions, open_backend
from kvstrata.integrations.vllm_blocks import PAGE_LAYOUT, BlockViews, kv_split, page_shape
from kvstrata.integrations.vllm_config import (
    agreed_backend,
    attention_backends,
    backend_option,
    count_option,
    flag_option,
    kv_format,
    model_weights,
    platform_writer,
    report_lag,
    writing_backend,
)
from kvstrata.integrations.vllm_groups import agree_least, group_rank, process_group
from kvstrata.integrations.vllm_stats import KvstrataConnectorStats, KvstrataPromMetrics
from kvstrata.model.engines import EngineShard, HashScheme, engine_page_hash, holds_bytes
from kvstrata.model.keys import PageHash
from kvstrata.model.lifecycles import RequestState

__all__ = ["KvstrataConnector", "KvstrataConnectorMetadata", "KvstrataHandshake"]

_log = logging.getLogger(__name__)

_OWN = frozenset({"l2_pages", "staging_pages", "kv_backend", "async_backup"})
_WHERE = "kvstrata vLLM connector"  # how errors name this connector


class KvstrataConnectorMetadata(KVConnectorMetadata):  # type: ignore[misc]
    """One step's plan, sent from the scheduler side to every worker."""

    def __init__(self, plan: Plan) -> None:
        self.plan = plan


@attrs.frozen
class KvstrataHandshake(KVConnectorHandshakeMetadata):  # type: ignore[misc]
    """What a worker tells the scheduler side once its KV caches are registered (vLLM's connector
    handshake, before the first request), for a KV vLLM keeps as bytes when no ``kv_backend`` is
    configured: the backend that writes it on this platform (:attr:`EngineShard.kv_backend`)."""

    kv_backend: str


class KvstrataConnector(KVConnectorBase_V1):  # type: ignore[misc]
    """vLLM's KV connector on kvstrata's L2 host pool and L3 store."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        self.options = StoreOptions.parse(extra, where=_WHERE, own=_OWN)
        self.l2_pages = count_option(extra, "l2_pages", 1024)
        self.staging_pages = count_option(extra, "staging_pages", 256)
        self.async_backup = flag_option(extra, "async_backup", True, _WHERE)
        groups = kv_cache_config.kv_cache_groups
        if len(groups) != 1:
            raise ConfigError(
                f"{_WHERE}: one KV cache group expected (hybrid models are not supported yet)"
            )
        spec = groups[0].kv_cache_spec
        self.block_size = int(spec.block_size)
        self.num_blocks = int(kv_cache_config.num_blocks)
        mla = bool(vllm_config.model_config.use_mla)
        self.layer_names = list(groups[0].layer_names)
        self.shape, self.heads, self.head_size = page_shape(
            spec, len(groups[0].layer_names), mla, _WHERE
        )
        parallel = vllm_config.parallel_config
        self.tp_size = int(parallel.tensor_parallel_size)
        self.pp_size = int(parallel.pipeline_parallel_size)
        self.lag = report_lag(vllm_config, self.pp_size)
        self._configured = backend_option(extra, _WHERE)
        self._template = EngineShard(
            HashScheme.VLLM,
            model_name=str(vllm_config.model_config.model),
            dtype=str(spec.dtype),
            mla=mla,
            page_size=self.block_size,
            tp_size=self.tp_size,
            pp_size=self.pp_size,
            tag=self.options.tag,
            tenant=self.options.tenant,
            key_schema=self.options.key_schema,
            kv_format=kv_format(spec.dtype, vllm_config.cache_config.cache_dtype, _WHERE),
            weights=model_weights(vllm_config.model_config),
            kv_layout="" if mla else PAGE_LAYOUT,
            # a KV kept as bytes is keyed by its writing backend: configured, or workers report it
            kv_backend=platform_writer(self._configured) if holds_bytes(spec.dtype) else "",
        )
        self.index: ConnectorIndex | None = None
        self.worker: ConnectorWorker | None = None
        self._pipe: TorchStagePipe | None = None  # the worker's, with pipeline parallelism
        self._failed: set[int] = set()
        self._computed: dict[str, int] = {}
        self._blocks: dict[str, list[int]] = {}
        self._requests: dict[str, Any] = {}  # vLLM's own request objects, by id
        self._prefix: dict[str, int] = {}  # pages a request had when admitted (cached or loaded)
        self._handshake: KvstrataHandshake | None = None  # the worker's, once it registered
        self._backend_unknown = holds_bytes(spec.dtype) and self._configured is None
        self._unknown_told = False
        self._probes: list[tuple[EngineShard, StorageBackend | None]] = []
        if role == KVConnectorRole.SCHEDULER:
            self._probes = [] if self._backend_unknown else self._open_probes()
            self._lookups = ThreadPoolExecutor(1, thread_name_prefix="kvstrata-lookup")
            self.index = ConnectorIndex(
                self.l2_pages, self.staging_pages, self._lookup, lag=self.lag
            )

    def _shard(self, tp_rank: int, pp_rank: int = 0) -> EngineShard:
        return attrs.evolve(self._template, tp_rank=tp_rank, pp_rank=pp_rank)

    def _open_probes(self) -> list[tuple[EngineShard, StorageBackend | None]]:
        """A reader per key space the scheduler side's lookups ask: every tensor-parallel rank
        (one for MLA) of every pipeline stage."""
        mla = self._template.mla
        return [
            self._probe(tp_rank, pp_rank)
            for pp_rank in range(self.pp_size)
            for tp_rank in range(1 if mla else self.tp_size)
        ]

    def _probe(self, tp_rank: int, pp_rank: int) -> tuple[EngineShard, StorageBackend | None]:
        shard = self._shard(tp_rank, pp_rank)
        backend = open_backend(self.options, shard.keyspace(), writer=False)
        if backend is not None:
            backend.attach(HostKVPool(self.shape, 1, "page_first_direct"))
        return shard, backend

    def _lookup(self, pages: Sequence[PageHash]) -> Future[int]:
        def ask() -> int:
            if self._backend_unknown:  # no worker has said which backend writes the bytes
                if not self._unknown_told:
                    self._unknown_told = True
                    _log.warning(
                        "kvstrata vLLM connector: no worker reported the attention backend that "
                        "writes this KV (vLLM's connector handshake): nothing is loaded from L3"
                    )
                return 0
            hits = [len(pages)]
            for shard, backend in self._probes:
                hits.append(0 if backend is None else int(backend.exists(shard.namespace(), pages)))
            return min(hits)

        return self._lookups.submit(ask)

    # ------------------------------------------------------------------------------ scheduler side
    def _pages(self, request: Any) -> list[PageHash]:
        return [engine_page_hash(bytes(h), HashScheme.VLLM) for h in request.block_hashes]

    def on_new_request(self, request: Any) -> None:
        self._requests[request.request_id] = request
        if self.index is not None and request.request_id not in self.index.requests:
            self.index.new_request(request.request_id, self._pages(request))

    def _limit(self, request: Any) -> int:
        return max(0, (int(request.num_tokens) - 1) // self.block_size)  # one token to compute

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        assert self.index is not None
        self.on_new_request(request)  # a request vLLM did not announce (no-op otherwise)
        computed = num_computed_tokens // self.block_size
        pages = self.index.match(request.request_id, computed, self._limit(request))
        if pages is None:
            return None, False
        self._computed[request.request_id] = computed
        return pages * self.block_size, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        assert self.index is not None
        computed = self._computed.get(request.request_id, 0)
        pages = num_external_tokens // self.block_size
        block_ids = list(blocks.get_block_ids()[0]) if pages else []
        self._prefix[request.request_id] = computed + pages
        self.index.alloc(
            request.request_id,
            computed,
            block_ids[computed : computed + pages],
            self._limit(request),
        )

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        assert self.index is not None
        scheduled = []
        for new in scheduler_output.scheduled_new_reqs:
            self._blocks[new.req_id] = list(new.block_ids[0])
            tokens = new.num_computed_tokens + scheduler_output.num_scheduled_tokens[new.req_id]
            scheduled.append((new.req_id, tokens))
        cached = scheduler_output.scheduled_cached_reqs
        for k, req_id in enumerate(cached.req_ids):
            added = cached.new_block_ids[k]
            if req_id in cached.resumed_req_ids:
                self._blocks[req_id] = list(added[0]) if added else []
            elif added:
                self._blocks.setdefault(req_id, []).extend(added[0])
            tokens = cached.num_computed_tokens[k] + scheduler_output.num_scheduled_tokens[req_id]
            scheduled.append((req_id, tokens))
        plan = self.index.plan(
            [
                Scheduled(req_id, tokens // self.block_size, tuple(self._blocks.get(req_id, ())))
                for req_id, tokens in scheduled
                if req_id in self.index.requests
            ]
        )
        return KvstrataConnectorMetadata(plan)

    def update_connector_output(self, connector_output: Any) -> None:
        """The workers' report of a step: blocks whose load failed (on any rank) go back to the
        index as each request's first failed page, so that its recomputed pages are saved. With
        async scheduling the report comes after the next plan was built; the index finds the
        step by the blocks its loads filled (``ConnectorIndex.failed_plan``)."""
        invalid = set(getattr(connector_output, "invalid_block_ids", None) or ())
        if not invalid or self.index is None:
            return
        failed: dict[str, int] = {}
        recompute: dict[str, int] = {}  # where vLLM computes each again (it rolled them back)
        for req_id, blocks in self._blocks.items():  # its own load, or blocks it shares
            bad = [index for index, block in enumerate(blocks) if block in invalid]
            request = self.index.requests.get(req_id)
            if not bad or request is None or request.state is not RequestState.RUNNING:
                continue
            pages = len(request.pages)
            if bad[0] >= pages:
                continue
            failed[req_id] = bad[0]
            engine = self._requests.get(req_id)
            if engine is not None:  # vLLM has rolled it back: it computes again from here
                kept = int(engine.num_computed_tokens)
                # unless it keeps tokens it computed itself over the bad blocks (async scheduling,
                # a request sharing them): then none of its later pages is saved
                own = kept > self._prefix.get(req_id, 0) * self.block_size
                recompute[req_id] = pages if own else kept // self.block_size
        self.index.load_failures(failed, self.index.failed_plan(invalid), recompute)

    def request_finished(
        self, request: Any, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        if self.index is not None and request.request_id in self.index.requests:
            self.index.finish(request.request_id)
        self._computed.pop(request.request_id, None)
        self._blocks.pop(request.request_id, None)
        self._requests.pop(request.request_id, None)
        self._prefix.pop(request.request_id, None)
        return False, None

    def set_xfer_handshake_metadata(self, metadata: dict[int, Any]) -> None:
        self._take_handshake(list(metadata.values()))

    def set_xfer_handshake_metadata_pp_aware(self, metadata: dict[tuple[int, int], Any]) -> None:
        """Every stage's and rank's report (vLLM's handshake, once the workers registered their
        KV caches): a KV kept as bytes is keyed by its writing backend from here on."""
        self._take_handshake(list(metadata.values()))

    def _take_handshake(self, reports: list[Any]) -> None:
        ours = [report.kv_backend for report in reports if isinstance(report, KvstrataHandshake)]
        backend = agreed_backend(ours, _WHERE)
        if backend is None or (not self._backend_unknown and backend == self._template.kv_backend):
            return
        self._template = attrs.evolve(self._template, kv_backend=backend)
        fresh = self._open_probes()

        def swap() -> None:  # on the lookup thread: never under a lookup in flight
            stale, self._probes = self._probes, fresh
            self._backend_unknown = False
            for _shard, probe in stale:
                if probe is not None:
                    probe.close()

        self._lookups.submit(swap).result()

    # ------------------------------------------------------------------------------ worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        tp_rank = group_rank("tp") if self.tp_size > 1 else 0
        pp_rank = group_rank("pp") if self.pp_size > 1 else 0
        backends = attention_backends(self._vllm_config, self.layer_names)
        split = kv_split(backends, self._template.mla, _WHERE)
        writer = writing_backend(backends, self._template.dtype, self._configured, _WHERE)
        self._template = attrs.evolve(self._template, kv_backend=writer)
        shard = self._shard(tp_rank, pp_rank)
        if writer and self._configured is None:  # the scheduler side learns it from this report
            self._handshake = KvstrataHandshake(writer)
        host = HostKVPool(self.shape, self.l2_pages + self.staging_pages, "page_first_direct")
        backend = open_backend(self.options, shard.keyspace(), writer=shard.writer)
        caches = {name: kv_caches[name] for name in self.layer_names if name in kv_caches}
        blocks = BlockViews(  # a layer that reuses another's KV (an alias) is not a layer here
            caches, self.num_blocks, self.shape, self.heads, self.head_size, split=split
        )
        lane = lane_executor(self.async_backup and backend is not None)
        self.worker = ConnectorWorker(host, backend, shard.namespace(), blocks, lane)
        if self.pp_size > 1:
            group = process_group("pp")
            self._pipe = TorchStagePipe(group.cpu_group, group.ranks, int(group.rank_in_group))

    def get_handshake_metadata(self) -> KvstrataHandshake | None:
        """The worker's report to the scheduler side (``None`` before its KV caches are
        registered)."""
        return self._handshake

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if self.worker is not None and isinstance(meta, KvstrataConnectorMetadata):
            agree = agree_least if self.tp_size > 1 else None
            self._failed |= self.worker.load(meta.plan, agree, self._pipe)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None  # loads complete in start_load_kv

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return None  # whole blocks are saved once per step, in wait_for_save

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        if self.worker is not None and isinstance(meta, KvstrataConnectorMetadata):
            self.worker.save(meta.plan, self._pipe)

    def get_block_ids_with_load_errors(self) -> set[int]:
        failed, self._failed = self._failed, set()
        return failed

    def get_kv_connector_stats(self) -> KvstrataConnectorStats | None:
        """The worker's stats since the last call (the scheduler side keeps none)."""
        if self.worker is None:
            return None
        stats = KvstrataConnectorStats(data=self.worker.take_stats().as_dict())
        return None if stats.is_empty() else stats

    @classmethod
    def build_kv_connector_stats(
        cls, data: dict[str, Any] | None = None
    ) -> KvstrataConnectorStats | None:
        return KvstrataConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config: Any, *registration: Any) -> KvstrataPromMetrics:
        """kvstrata's Prometheus counters (``registration``: vLLM's metric types, label names and
        per-engine label values, as vLLM passes them)."""
        return KvstrataPromMetrics(vllm_config, *registration)

    @property
    def kv_backend(self) -> str:
        """The backend (and platform fp8 type) this side keys a KV kept as bytes by (``""`` for
        any other KV, on a worker until it registered its KV caches, and on the scheduler side
        until the workers reported theirs, unless ``kv_backend`` was configured)."""
        return self._template.kv_backend

    @property
    def loaded_pages(self) -> int:
        """Pages this worker has loaded into vLLM's blocks (tests and metrics)."""
        return 0 if self.worker is None else self.worker.loaded_pages

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.close()
        for _shard, backend in getattr(self, "_probes", []):
            if backend is not None:
                backend.close()
