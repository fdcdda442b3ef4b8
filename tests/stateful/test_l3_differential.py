"""L3 differential: the real cache with an L3 backend (backup, exists, prefetch, commit, abort) against
the reference model with its store, side by side (SPEC §3, §4, §7; issue 4).

The L1/L2 machine of ``tests/support/differential.py`` is extended with an in-memory L3 backend shared
with a *peer* (another instance writing the same key space) and rules for the store's own eviction,
the peer's backups, prefetch start / arrival / readiness / commit / abort, and injected failures of
backup batches. Store I/O runs on a second ManualExecutor: a rule decides when the oldest job runs.
Each storage result the implementation applies is mirrored into the model at that moment, so both
see the same store contents. Compared after every step, on top of the L1/L2 view: the store's
visible keys (exactly the same rendered keys: one schema, no double tag), pending backups,
prefetch reservations, and ``exists`` for every sequence seen. Bytes: every page a prefetch
delivers is read back from the host pool and compared with the KV derived from its page hash.

The prefetch query (hashing + ``exists``) is asynchronous in the implementation and synchronous in
the model; the prefetch rule therefore runs storage jobs until its query result is applied and only
then calls the model's ``prefetch`` (both split the tree at the same point first).

``HybridL3TierDifferential`` (below) is the same machine with side pools:

The machine combines the hybrid L1/L2 machine (``HybridDifferentialMachine``: states on L1/L2, state
eviction, state misuse) with the L3 machine (``L3Differential``: backups mirrored job by job, the
store's own eviction, a peer's backups, prefetch start / arrival / commit / abort, failed backup
batches). On top of both:

- backups carry indexer objects and node-end states (a failing batch fails every part; the model's
  ``fail_backup``), the host state slot stays pinned until the store confirms (``evict_state`` on
  L2 of a pinned state is misuse on both, and eviction skips it);
- the peer backs up KV, indexer objects and states at chosen positions;
- the store evicts a chosen indexer object or state component (any visible side key);
- ``exists`` is the usable prefix (``HybridStorage.exists(...).usable`` against ``l3_exists``);
- every prefetched page's KV and indexer entry, and the prefetched state, are compared bit for bit
  with the bytes their page hash names; a committed state is compared again whenever a match
  loads it back to L1 (the hybrid machine's L1 checks).

Compared after every step: the L1/L2 view, state residency of every page seen, free state slots
per tier, the store's visible keys (KV and side), pending backups, prefetch reservations and
``exists`` of every sequence seen.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import attrs
import hypothesis.strategies as st
import pytest
import torch
from hypothesis import event, settings
from hypothesis.stateful import invariant, precondition, rule
from support.differential import (
    INDEXER,
    MAMBA,
    NAMESPACES,
    DifferentialMachine,
    HybridDifferentialMachine,
    kv_for,
    same_bits,
    side_bytes,
)
from support.lagging import LaggingClient

from kvstrata.impl.config import StorageConfig
from kvstrata.impl.errors import MisuseError
from kvstrata.impl.l3 import PrefetchOp
from kvstrata.impl.pools import HostKVPool, HostLayout
from kvstrata.impl.pools.side import SideBuffer
from kvstrata.impl.storage.base import GetStatus, PutStatus, StorageBackend
from kvstrata.impl.storage.hybrid import HybridPut, HybridStorage
from kvstrata.impl.storage.memory import MemoryBackend, MemoryStore
from kvstrata.impl.storage.mooncake import LocalCluster, MooncakeBackend, MooncakeClient
from kvstrata.impl.storage.worker import BackupResult, FetchResult, QueryResult
from kvstrata.impl.transfer import ManualExecutor
from kvstrata.model.cache import WritePolicy
from kvstrata.model.errors import KeyParseError
from kvstrata.model.hybrid import side_page_keys
from kvstrata.model.keys import (
    SCHEMA_VERSIONS,
    KeySpace,
    KVKind,
    ModelIdentity,
    Namespace,
    PageHash,
    RenderedKeys,
    Shard,
    StoreKey,
    chain_page_hashes,
    parse_store_key,
    render_store_key,
)
from kvstrata.model.l3.health import CallKind
from kvstrata.model.l3.policy import PrefetchPolicy
from kvstrata.model.lifecycles import HOST_VALID, PrefetchState, Residency
from kvstrata.model.store import StoreModel

TAG = "ci-l3"
#: Identities drawn per machine (issue 19): the shard and the deployment tag are part of every key.
SHARDS = {
    KVKind.MHA: (
        Shard(),
        Shard(tp_rank=1, tp_size=2),
        Shard(tp_rank=3, tp_size=4, pp_rank=1, pp_size=2),
    ),
    KVKind.MLA: (Shard.replicated(), Shard(tp_rank=1, tp_size=2)),
}
TAGS = (TAG, "prod.eu-1", None)
#: The host layouts a peer instance may have: each moves a page's objects its own way (issue 20).
PEER_LAYOUTS = (HostLayout.PAGE_FIRST, HostLayout.PAGE_FIRST_DIRECT, HostLayout.PAGE_MAJOR)
#: A foreign namespace: another tenant's pages in the same store.
FOREIGN = Namespace(extra_key="tenant-b", salt="b")


class L3Differential(DifferentialMachine):
    policy = WritePolicy.WRITE_THROUGH
    page_first_only = True
    page_hashes = st.just(True)
    host_sizes = st.integers(4, 10)

    def __init__(self) -> None:
        super().__init__()
        self.evicted: set[str] = set()
        self.finished: set[int] = set()  # committed/aborted, read still in flight
        self.failing = False

    # ------------------------------------------------------------ setup hooks
    def model_extras(
        self, data: st.DataObject, kind: KVKind, page_size: int, host_pages: int
    ) -> dict[str, Any]:
        self.keyspace = KeySpace(
            ModelIdentity(name="tiny-llm", dtype="float16", kind=kind, page_size=page_size),
            shard=data.draw(st.sampled_from(SHARDS[kind]), label="shard"),
            tag=data.draw(st.sampled_from(TAGS), label="tag"),
            schema=data.draw(st.sampled_from(SCHEMA_VERSIONS), label="key_schema"),
        )
        self.strangers: dict[str, KeySpace] = {}  # rendered key -> the key space that wrote it
        #: each stranger's backend, namespace and pages: checked after every step
        self.stranger_views: list[tuple[StorageBackend, Namespace, list[PageHash]]] = []
        self.garbage: set[str] = set()  # malformed keys a broken foreign writer left
        self.prefetch_policy = data.draw(
            st.sampled_from([PrefetchPolicy.BEST_EFFORT, PrefetchPolicy.WAIT_COMPLETE]),
            label="prefetch_policy",
        )
        self.threshold = page_size * data.draw(st.integers(1, 2), label="prefetch_pages")
        #: the store starts out lagging (puts accepted, shown later or never) in half the examples
        self.initial_lag = self.lags and data.draw(st.booleans(), label="store_lags")
        #: a node's backup cut into ops of this many pages: a storage job is one chunk of a node
        self.backup_batch = data.draw(st.sampled_from([None, 1, 2]), label="backup_batch_pages")
        return {
            "backup_batch_pages": self.backup_batch,
            "keys": self.keyspace,
            "prefetch_threshold": self.threshold,
            "prefetch_policy": self.prefetch_policy,
        }

    def model_store(self) -> dict[str, Any]:
        self.store_model = StoreModel(hold_writes=self.initial_lag)
        return {"store": self.store_model}

    def storage(self) -> dict[str, Any]:
        self.shared = MemoryStore()
        self.backend = MemoryBackend(self.keyspace, store=self.shared)
        self.backend.hold_puts = self.initial_lag
        self.storage_executor = ManualExecutor()
        self.prefetch_ops: dict[int, int | None] = {}  # impl op id -> model op id (None: no hit)
        return {
            "storage": self.backend,
            "storage_executor": self.storage_executor,
            "storage_config": StorageConfig(
                prefetch_threshold=self.threshold,
                prefetch_policy=self.prefetch_policy,
                backup_retries=10**6,  # the model retries forever
                backup_backoff_s=0.0,
                backup_batch_pages=self.backup_batch or 256,
            ),
        }

    # ------------------------------------------------------------ store access (overridden for Mooncake)
    def inject_put_failure(self) -> None:
        """The next backup batch fails as a whole (as against an unreachable store)."""
        self.failing = True

    def install_failures(self) -> None:
        real_put = self.backend.put

        def put(namespace: Namespace, pages: Any, host_indices: Any) -> list[PutStatus]:
            if self.failing:
                self.failing = False
                return [PutStatus.FAILED] * len(pages)
            return real_put(namespace, pages, host_indices)

        self.backend.put = put  # type: ignore[method-assign]

    lists_keys = True  # the store can list its keys (memory); Mooncake cannot

    def mine(self, text: str) -> bool:
        """Whether a stored key belongs to this instance's key space (any of its namespaces)."""
        if text in self.garbage or text in self.strangers:
            return False
        try:
            parts = parse_store_key(text)
        except KeyParseError:
            return False
        space = self.keyspace
        return (parts.model, parts.shard, parts.tag) == (space.model, space.shard, space.tag) and (
            parts.namespace_id in {ns.key_id() for ns in NAMESPACES}
        )

    def visible_keys(self) -> list[str]:
        return sorted(key.text for key in self.shared.visible_keys() if self.mine(key.text))

    def model_keys(self) -> list[str]:
        return sorted(key.text for key, _ in self.store_model.visible_items())

    def drop_key(self, key: StoreKey) -> int:
        return self.shared.drop([key])

    def peer(self) -> StorageBackend:
        return MemoryBackend(self.keyspace, store=self.shared)

    # ------------------------------------------------------------ storage jobs, mirrored
    def run_storage_job(self, fail: bool = False, *, merged: bool = False) -> list[object]:
        """Run the oldest storage job (a backup fails as a whole when ``fail``), apply its result
        to the implementation and mirror it into the model. Returns the applied results.
        ``merged``: the backups (or fetches) queued right behind it run with it as one store call
        (a lane with a backlog, issue 20); the model still sees one op after the other."""
        if not getattr(self, "_failures_installed", False):
            self.install_failures()
            self._failures_installed = True
        if fail:
            self.inject_put_failure()
        if merged:
            jobs = self.storage_executor.jobs
            kind = getattr(getattr(jobs[0], "call", None), "kind", None) if jobs else None
            ran = self.storage_executor.run_merged()
            if ran > 1:
                what = "fetches" if kind is CallKind.FETCH else "backups"
                event(f"queued {what} ran as one store call")
        else:
            self.storage_executor.run_next()
        self.failing = False
        self.impl.check_events()
        l3 = self.impl.l3
        assert l3 is not None
        applied = list(l3.last_applied)
        for result in applied:
            if isinstance(result, BackupResult):
                self.model.start_backup()
                statuses = (*result.statuses, *result.states)
                if fail:
                    assert all(s is PutStatus.FAILED for s in statuses)
                    event("backup batch failed and was retried")
                    self.model.fail_backup()
                else:  # the model decides which pages count as stored (visible after the puts)
                    if not all(status.ok for status in statuses):
                        event("a backup's puts were accepted but not visible: retried")
                    self.model.ack_backup()
            elif isinstance(result, FetchResult):
                self.mirror_fetch(result)
        return applied

    # ------------------------------------------------------------ a store that lags (issue 19)
    lags = True  # the machine's store can accept a put and show it later, or never

    def set_lagging(self, on: bool) -> None:
        """While on, the store accepts puts but keeps their objects invisible (both sides)."""
        if not self.lags:
            return
        self.backend.hold_puts = on
        self.store_model.hold_writes = on

    def lagging_keys(self) -> list[StoreKey]:
        return sorted(self.store_model.lagging_keys(), key=lambda key: key.text)

    def settle_lagging(self, keys: list[StoreKey], lose: bool) -> int:
        """The store publishes the lagging ``keys`` at last, or loses them; how many it held."""
        return self.backend.abort_puts(keys) if lose else self.backend.release_puts(keys)

    @precondition(lambda self: self.ready and self.lags)
    @rule(on=st.booleans())
    def store_lags(self, on: bool) -> None:
        """From now on the store accepts puts but shows their objects only later (``on``), or
        again at once."""
        self.set_lagging(on)

    @precondition(lambda self: self.ready and self.lags)
    @rule(data=st.data())
    def backups_merge_behind_a_lag(self, data: st.DataObject) -> None:
        """Two requests land on L2, so their backups queue; the store lags while the oldest
        storage job runs (a backup's puts accepted, not yet shown), then shows new puts at once
        again; the jobs queued behind it (a retry among them) run merged: one store call in
        which one op's pages are still held and another's are shown, so each op must get its
        own slice of the statuses (issue 20)."""
        self.drain()
        for _ in range(2):
            self.do_request(data, with_state=False)
        while self.executor.jobs:
            self.complete_copy_batch(fail=False)
        if not self.storage_executor.jobs:
            return
        self.set_lagging(True)
        self.run_storage_job()
        self.set_lagging(False)
        for _ in range(len(self.storage_executor.jobs)):
            for result in self.run_storage_job(merged=True):
                if isinstance(result, BackupResult) and not all(s.ok for s in result.statuses):
                    event("a merged backup's op met pages the lagging store still held")

    @precondition(lambda self: self.ready and self.lags and self.store_model.lagging_keys())
    @rule(data=st.data(), lose=st.booleans())
    def store_settles(self, data: st.DataObject, lose: bool) -> None:
        """Objects the store accepted but did not show become visible at last, or are lost for
        good (success was returned; no reader will ever see them)."""
        lagging = self.lagging_keys()
        chosen = data.draw(
            st.lists(st.sampled_from(lagging), min_size=1, unique=True), label="keys"
        )
        settled = self.store_model.lose(chosen) if lose else self.store_model.publish(chosen)
        assert self.settle_lagging(chosen, lose) == settled == len(chosen)
        event("the store lost accepted puts" if lose else "the store showed lagging puts")

    def impl_lagging(self) -> list[str]:
        if not self.lags:
            return []
        return sorted(key.text for key in self.shared.pending_keys() if self.mine(key.text))

    def mirror_fetch(self, result: FetchResult) -> None:
        model_op = self.prefetch_ops.get(result.op_id)
        if model_op is None:
            return
        state = self.model.prefetch_ops[model_op].state
        if state is PrefetchState.CANCELLING:
            self.model.prefetch_drain(model_op)
            del self.prefetch_ops[result.op_id]
            self.finished.discard(result.op_id)
            event("prefetch drained after commit/abort")
            return
        arrived = self.model.prefetch_arrive(model_op, pages=len(result.statuses))
        l3 = self.impl.l3
        assert l3 is not None
        op = l3.prefetches[result.op_id]
        assert op.arrived == arrived, (op.arrived, arrived)
        if arrived:
            self.check_prefetched(op, model_op)
            event("prefetched bytes compared")
        if arrived < len(result.statuses):
            event("prefetch cut short by a page missing in the store")

    def check_prefetched(self, op: PrefetchOp, model_op: int) -> None:
        """The host pages prefetch ``op`` delivered hold the KV of the model op's pages."""
        pages = self.model.prefetch_ops[model_op].pages[: op.arrived]
        assert self.host_pool is not None
        got = self.host_pool.read_pages(op.host[: op.arrived])
        want = torch.cat([kv_for(self.shape, page) for page in pages], dim=2)
        assert torch.equal(got.view(torch.int16), want.view(torch.int16)), "L3 bytes differ"

    def l3_exists(self, namespace: Namespace, pages: list[PageHash]) -> int:
        """What the implementation's store reports for ``pages`` (the model's ``l3_exists``)."""
        return self.backend.exists(namespace, pages)

    @precondition(lambda self: self.ready and self.storage_executor.jobs)
    @rule(fail=st.sampled_from([False, False, True]))
    def storage_job(self, fail: bool) -> None:
        """The oldest storage job runs; a backup may fail as a whole (``fail``)."""
        for result in self.run_storage_job(fail):
            assert not isinstance(result, QueryResult), "a query outlived its prefetch rule"

    @precondition(lambda self: self.ready and len(self.storage_executor.jobs) > 1)
    @rule(fail=st.sampled_from([False, False, True]))
    def storage_jobs_merged(self, fail: bool) -> None:
        """The oldest storage job runs together with the backups (or fetches) queued right behind
        it that merge with it (one store call, as a lane with a backlog makes it); a shared put may
        fail as a whole (``fail``)."""
        for result in self.run_storage_job(fail, merged=True):
            assert not isinstance(result, QueryResult), "a query outlived its prefetch rule"

    # ------------------------------------------------------------ the store's own life
    @precondition(lambda self: self.ready and self.store_model.visible_items())
    @rule(data=st.data())
    def store_evicts(self, data: st.DataObject) -> None:
        keys = sorted(key.text for key, _ in self.store_model.visible_items())
        text = data.draw(st.sampled_from(keys), label="evicted key")
        key = next(k for k, _ in self.store_model.visible_items() if k.text == text)
        assert self.model.store_evict(key)
        assert self.drop_key(key) == 1
        self.evicted.add(text)  # may leave an L2 page out of L3 after a drain
        event("the store evicted an object")

    @rule(data=st.data())
    def peer_backs_up(self, data: st.DataObject) -> None:
        """Another instance with the same key space backs up a sequence (SPEC §10)."""
        tokens, ns = self.draw_tokens(data)
        pages = chain_page_hashes(tokens, self.page_size, ns)
        if not pages:
            return
        for page in pages:
            for component, key in zip(
                self.keyspace.components, self.keyspace.page_keys(ns, page), strict=True
            ):
                if self.store_model.begin_put(key):  # the peer's own puts do not lag
                    lagging, self.store_model.hold_writes = self.store_model.hold_writes, False
                    self.store_model.end_put(key, (page, component))
                    self.store_model.hold_writes = lagging
        # the writer's host layout, and another for a reader right after, cycle without a draw:
        # every pair of page-first layouts writes and reads each other's objects (issue 20)
        turn = self._peer_writes = getattr(self, "_peer_writes", -1) + 1
        writer_layout = PEER_LAYOUTS[turn % len(PEER_LAYOUTS)]
        scratch = HostKVPool(self.shape, len(pages), writer_layout)
        peer = self.peer()
        peer.attach(scratch)
        slots = list(range(len(pages)))
        scratch.write_pages(slots, torch.cat([kv_for(self.shape, p) for p in pages], dim=2))
        try:
            statuses = peer.put(ns, list(pages), slots)
        finally:
            peer.close()
        held = self.store_model.lagging_keys()  # the peer's puts did not change them
        for page, status in zip(pages, statuses, strict=True):
            blocked = any(key in held for key in self.keyspace.page_keys(ns, page))
            # a page whose object the store holds back for this instance is another writer's
            # unfinished put to the peer: refused (retryable), its other objects written
            assert status.ok != blocked, (page, status, blocked)
            if blocked:
                event("a peer's put met an object the store holds back")
        event("a peer backed up a sequence")
        stored = [page for page, status in zip(pages, statuses, strict=True) if status.ok]
        reader_layout = PEER_LAYOUTS[(turn + 1) % len(PEER_LAYOUTS)]
        if self._read_as_peer(ns, stored, reader_layout):
            event("a peer read another layout's fresh pages back whole")
        self._shuttle(ns, list(pages), turn)

    def _shuttle(self, ns: Namespace, pages: list[PageHash], turn: int) -> None:
        """A deployment of the same model under key schema 2 and a tag of its own shares the store
        (whatever schema this instance drew): one of its instances writes ``pages`` from one
        page-first layout, another reads them into the next. Every page read ``LOADED`` is bit for
        bit the page's KV: one object per page crosses host layouts whole (issue 20). This
        instance never sees those keys (another tag)."""
        space = attrs.evolve(self.keyspace, schema=2, tag="shuttle")
        writer_layout = PEER_LAYOUTS[turn % len(PEER_LAYOUTS)]
        reader_layout = PEER_LAYOUTS[(turn + 1) % len(PEER_LAYOUTS)]
        slots = list(range(len(pages)))
        source = HostKVPool(self.shape, len(pages), writer_layout)
        source.write_pages(slots, torch.cat([kv_for(self.shape, p) for p in pages], dim=2))
        writer = self.stranger_backend(space)
        writer.attach(source)
        try:
            put = writer.put(ns, pages, slots)
        finally:
            writer.close()
        for page in pages:
            for key in space.page_keys(ns, page):
                self.strangers[key.text] = space
        self._read_as_peer(ns, pages, reader_layout, self.stranger_backend(space))
        if any(status.ok for status in put):
            event(f"schema-2 pages crossed from {writer_layout.value} to {reader_layout.value}")

    def stranger_backend(self, space: KeySpace) -> StorageBackend:
        return MemoryBackend(space, store=self.shared)

    @precondition(lambda self: self.ready and self.known)
    @rule(data=st.data())
    def stranger_backs_up(self, data: st.DataObject) -> None:
        """Another deployment shares the store (issue 19): the same pages under another tag,
        shard, model, tenant namespace or key schema, with other bytes. This instance must never see them."""
        tokens = data.draw(st.sampled_from(self.known), label="stranger's tokens")
        space, ns = self.keyspace, data.draw(st.sampled_from(NAMESPACES), label="namespace")
        how = data.draw(
            st.sampled_from(["tag", "shard", "model", "tenant", "schema"]), label="differs by"
        )
        if how == "schema":  # issue 20: the other key schema's objects of the same pages
            space = attrs.evolve(space, schema=3 - space.schema)
        elif how == "tag":
            space = attrs.evolve(space, tag="other" if space.tag != "other" else None)
        elif how == "shard":
            others = [
                s
                for s in (*SHARDS[space.model.kind], Shard(tp_rank=0, tp_size=2))
                if s != space.shard
            ]
            space = attrs.evolve(space, shard=others[0])
        elif how == "model":
            space = attrs.evolve(space, model=attrs.evolve(space.model, name="other-llm"))
        else:
            ns = FOREIGN
        pages = chain_page_hashes(tokens, self.page_size, ns)
        if not pages:
            return
        scratch = HostKVPool(self.shape, len(pages), HostLayout.PAGE_FIRST)
        slots = list(range(len(pages)))
        scratch.write_pages(
            slots, torch.zeros(self.shape.canonical(len(pages)), dtype=self.shape.dtype)
        )
        stranger = self.stranger_backend(space)
        stranger.attach(scratch)
        assert all(status.ok for status in stranger.put(ns, list(pages), slots))
        for page in pages:
            for key in space.page_keys(ns, page):
                self.strangers[key.text] = space
        self.stranger_views.append((stranger, ns, list(pages)))
        event(f"a stranger ({how}) backed up the same tokens")

    @invariant()
    def strangers_see_their_own(self) -> None:
        """Every other identity sharing the store still finds every page it wrote, whatever this
        instance did since (its own view is compared with the model's): two identities, one store,
        each sees exactly its own pages (issue 19)."""
        for stranger, ns, pages in getattr(self, "stranger_views", ()):
            assert stranger.exists(ns, pages) == len(pages), "a stranger lost its pages"

    @precondition(lambda self: self.ready and self.seen)
    @rule(data=st.data())
    def peer_reads_back(self, data: st.DataObject) -> None:
        """Other instances, one per page-first host layout, read pages the store holds whole: a
        page one gets is bit for bit the page's KV (an object's bytes are fixed by its key, whatever
        layout wrote it; issue 20's one object per page moves K and V in one object)."""
        ns, tokens = data.draw(st.sampled_from(sorted(self.seen, key=repr)), label="sequence")
        whole = [
            page
            for page in chain_page_hashes(tokens, self.page_size, ns)
            if all(self.store_model.contains(k) for k in self.keyspace.page_keys(ns, page))
        ]
        if not whole:
            return
        for layout in PEER_LAYOUTS:
            self._read_as_peer(ns, whole, layout)
        event(
            f"peers in every page-first layout read back whole pages (schema {self.keyspace.schema})"
        )

    def _read_as_peer(
        self,
        ns: Namespace,
        pages: list[PageHash],
        layout: HostLayout,
        peer: StorageBackend | None = None,
    ) -> int:
        """Another instance (``peer``, by default one in this key space) with a ``layout`` host
        pool gets ``pages``: every page it reports ``LOADED`` must be bit for bit the page's KV.
        Returns how many were loaded. The peer is closed afterwards."""
        peer = self.peer() if peer is None else peer
        if not pages:
            peer.close()
            return 0
        scratch = HostKVPool(self.shape, len(pages), layout)
        peer.attach(scratch)
        try:
            statuses = peer.get(ns, pages, list(range(len(pages))))
        finally:
            peer.close()
        loaded = 0
        for slot, (page, status) in enumerate(zip(pages, statuses, strict=True)):
            if status is GetStatus.LOADED:
                loaded += 1
                got = scratch.read_pages([slot]).view(torch.uint8)
                assert torch.equal(got, kv_for(self.shape, page).view(torch.uint8)), (
                    f"a peer ({layout.value}) read other bytes for {page!r}"
                )
        return loaded

    @precondition(lambda self: self.ready and self.lists_keys and self.seen)
    @rule(data=st.data())
    def garbage_in_store(self, data: st.DataObject) -> None:
        """A broken foreign writer leaves malformed keys (a doubled tag, a doubled version, an
        uppercase hash, a trailing segment) next to this instance's: the parser must refuse them
        and nothing may read them."""
        ns, tokens = data.draw(st.sampled_from(sorted(self.seen, key=repr)), label="sequence")
        pages = chain_page_hashes(tokens, self.page_size, ns)
        if not pages:
            return
        good = self.keyspace.page_keys(ns, pages[0])[0].text
        head, _, digest = good.rpartition("/")
        tag = self.keyspace.tag or "_"
        version = f"kvs{self.keyspace.schema}/"
        variants = {
            "doubled version": good.replace(version, version * 2, 1),
            "uppercase hash": f"{head}/{digest.upper()}",
            "trailing segment": good + "/x",
            "doubled tag": good.replace(f"{version}{tag}/", f"{version}{tag}/{tag}/", 1),
            "quoted name": good.replace("/tiny-llm/", "/tiny%2Dllm/", 1),
            "zero-padded page": good.replace(f"/p{self.page_size}/", f"/p0{self.page_size}/", 1),
        }
        how = data.draw(st.sampled_from(sorted(variants)), label="malformed")
        text = variants[how]
        assert text != good, how  # a variant that did not apply would be a valid key
        size = self.shape.nbytes(1) // len(self.keyspace.components)
        self.shared.write([(StoreKey(text), bytes(size))], [], owner=0, hold=False)
        self.garbage.add(text)
        event(f"a malformed key in the store ({how})")

    # ------------------------------------------------------------ prefetch
    @rule(data=st.data())
    def prefetch(self, data: st.DataObject) -> None:
        self.do_prefetch(*self.draw_tokens(data))

    @precondition(lambda self: self.ready and self.known)
    @rule(data=st.data(), commit=st.booleans())
    def l3_round_trip(self, data: st.DataObject, commit: bool) -> None:
        """Back up everything, drop a known sequence from L1 and L2 on both (LRU eviction of the
        whole tiers), prefetch it again, read it and commit (or abort) it."""
        tokens = data.draw(st.sampled_from(self.known), label="round-trip tokens")
        ns = data.draw(st.sampled_from([n for n, t in sorted(self.seen, key=repr) if t == tokens]))
        self.drain()
        total = 64  # more than any pool here
        assert self.impl.evict(total) == self.model.evict(total)
        assert self.impl.evict_host(total) == self.model.evict_host(total)
        op_id = self.do_prefetch(tokens, ns)
        if op_id is None:
            return
        model_op = self.prefetch_ops[op_id]
        if model_op is not None and data.draw(st.booleans(), label="store loses an object"):
            self.lose_object(data, ns, self.model.prefetch_ops[model_op].pages)
        while op_id not in self.finished and self.storage_executor.jobs:
            self.run_storage_job()
            l3 = self.impl.l3
            assert l3 is not None
            if l3.prefetches[op_id].state is not PrefetchState.LOADING:
                break
        self.finish(op_id, commit)
        event("L3 round trip " + ("committed" if commit else "aborted"))

    @precondition(lambda self: self.ready and self.seen)
    @rule(data=st.data())
    def prefetch_burst(self, data: st.DataObject) -> None:
        """A burst of requests (issue 20): everything is backed up and dropped from L1 and L2,
        then two or three prefetches start before any returns (of one namespace, or of any);
        their queries land first, so their fetches wait on the read lane back to back and the
        lane runs those of one namespace as one get (``prefetch_merge_pages``); the store may
        lose an object of one op's pages first, so each op's share of the get's statuses
        differs. Each then commits or aborts. The running requests end first (their locks
        would keep their pages in L1, and a prefetch of them would find nothing to fetch)."""
        self.drain()
        self.unlock_all()
        total = 64  # more than any pool here
        assert self.impl.evict(total) == self.model.evict(total)
        assert self.impl.evict_host(total) == self.model.evict_host(total)
        seen = sorted(self.seen, key=repr)
        held = [  # sequences the store holds enough of to prefetch
            (ns, tokens)
            for ns, tokens in seen
            if self.l3_exists(ns, chain_page_hashes(tokens, self.page_size, ns)) * self.page_size
            >= self.threshold
        ]
        seen = held or seen
        if data.draw(st.booleans(), label="one namespace"):  # their fetches may merge
            ns = data.draw(st.sampled_from(sorted({n for n, _ in seen}, key=repr)), label="ns")
            seen = [(n, t) for n, t in seen if n == ns]
        # repeats allowed: requests that share a prefix fetch the same keys
        burst = data.draw(st.lists(st.sampled_from(seen), min_size=2, max_size=3), label="burst")
        started = [(self.impl.prefetch(tokens, ns), tokens, ns) for ns, tokens in burst]
        ops = [self.land_prefetch(*op) for op in started]
        namespaces = {ns for op_id, _, ns in started if op_id is not None}
        fetching = [op_id for op_id in ops if op_id is not None and self.loading(op_id)]
        if len(fetching) > 1:
            event(f"a burst of prefetches queued its fetches ({len(namespaces)} namespaces)")
            keys = [
                (op.namespace, page)
                for op_id in fetching
                if (model_op := self.prefetch_ops[op_id]) is not None
                for op in [self.model.prefetch_ops[model_op]]
                for page in op.pages
            ]
            if len(set(keys)) < len(keys):
                event("the fetches of a burst name a page twice")
        if fetching and data.draw(st.booleans(), label="store loses an object"):
            model_op = self.prefetch_ops[data.draw(st.sampled_from(fetching), label="losing op")]
            if model_op is not None:  # one op's pages arrive short, the others' whole
                op = self.model.prefetch_ops[model_op]
                self.lose_object(data, op.namespace, op.pages)
        while self.storage_executor.jobs and any(
            op_id is not None and self.loading(op_id) for op_id in ops
        ):
            self.run_storage_job(merged=True)
        for op_id in ops:
            if op_id is not None and op_id in self.prefetch_ops and op_id not in self.finished:
                self.finish(op_id, data.draw(st.booleans(), label="commit"))

    def loading(self, op_id: int) -> bool:
        l3 = self.impl.l3
        assert l3 is not None
        return l3.prefetches[op_id].state is PrefetchState.LOADING

    def lose_object(self, data: st.DataObject, ns: Namespace, pages: tuple[PageHash, ...]) -> None:
        """Between a prefetch's query and its read the store drops one object of its pages (a KV
        component, an indexer object or a state component)."""
        visible = {key.text: key for key, _ in self.store_model.visible_items()}
        candidates = sorted(
            {
                key.text
                for page in pages
                for objects in (
                    self.model._page_objects(ns, page),
                    self.model._state_objects(ns, page),
                )
                for _component, key in objects
                if key.text in visible
            }
        )
        if not candidates:
            return
        text = data.draw(st.sampled_from(candidates), label="object lost before the read")
        assert self.model.store_evict(visible[text])
        assert self.drop_key(visible[text]) == 1
        self.evicted.add(text)
        event("an object of a reserved page was lost before the read")

    def do_prefetch(self, tokens: tuple[int, ...], ns: Namespace) -> int | None:
        """Start a prefetch on both (the implementation's query runs first); returns its id."""
        return self.land_prefetch(self.impl.prefetch(tokens, ns), tokens, ns)

    def land_prefetch(
        self, op_id: int | None, tokens: tuple[int, ...], ns: Namespace
    ) -> int | None:
        """Run storage jobs until the query of the implementation's prefetch ``op_id`` (of
        ``tokens`` in ``ns``) returned, then start the model's; returns ``op_id``."""
        if op_id is None:
            assert self.model.prefetch(tokens, ns) is None
            return None
        l3 = self.impl.l3
        assert l3 is not None
        while l3.prefetches[op_id].state is None:  # querying: run jobs up to its result
            assert self.storage_executor.jobs, "the query job is missing"
            self.run_storage_job()
        model_op = self.model.prefetch(tokens, ns)
        reserved = len(l3.prefetches[op_id].host)
        assert (model_op is None) == (reserved == 0), (model_op, reserved)
        if model_op is not None:
            assert len(self.model.prefetch_ops[model_op].pages) == reserved
            event("prefetch reserved host pages for an L3 hit")
        self.prefetch_ops[op_id] = model_op
        return op_id

    def active(self) -> list[int]:
        return sorted(set(self.prefetch_ops) - self.finished) if self.ready else []

    @precondition(lambda self: self.active())
    @rule(data=st.data(), commit=st.booleans())
    def finish_prefetch(self, data: st.DataObject, commit: bool) -> None:
        self.finish(data.draw(st.sampled_from(self.active()), label="prefetch op"), commit)

    def finish(self, op_id: int, commit: bool) -> None:
        """Commit or abort prefetch ``op_id`` on both."""
        model_op = self.prefetch_ops[op_id]
        if model_op is not None:
            assert self.impl.prefetch_ready(op_id) == self.model.prefetch_ready(model_op)
        in_flight = self.impl.l3 is not None and self.impl.l3.prefetches[op_id].in_flight
        if commit:
            added = self.impl.prefetch_commit(op_id)
            want = 0 if model_op is None else self.model.prefetch_commit(model_op)
            assert added == want, (added, want)
            if added:
                event("prefetched pages committed as host-only nodes")
        else:
            self.impl.prefetch_abort(op_id)
            if model_op is not None:
                self.model.prefetch_abort(model_op)
        if model_op is None or not in_flight:
            del self.prefetch_ops[op_id]
        else:  # kept until its read is drained (mirror_fetch)
            self.finished.add(op_id)
            event("prefetch finished while its read was in flight")

    # ------------------------------------------------------------ I4 end to end
    @rule()
    def drain(self) -> None:
        """Finish every copy and every storage job; then L3 holds every page the tree holds on L2
        (I4, seen from outside the tree through the backend)."""
        while self.executor.jobs:
            self.complete_copy_batch(fail=False)
        for _ in range(len(self.storage_executor.jobs)):  # what is queued runs as the store is,
            self.run_storage_job(merged=True)  # queued backups as one store call each
        self.set_lagging(False)
        lagging = self.lagging_keys()
        if lagging:  # the store settles first, or a backup of a lagging page never ends
            half = len(lagging) // 2
            self.store_model.publish(lagging[:half])
            self.store_model.lose(lagging[half:])
            assert self.settle_lagging(lagging[:half], lose=False) == half
            assert self.settle_lagging(lagging[half:], lose=True) == len(lagging) - half
        while self.executor.jobs or self.storage_executor.jobs:
            if self.executor.jobs:
                self.complete_copy_batch(fail=False)
            else:
                self.run_storage_job()
        for node in self.impl.nodes():
            if node.state in HOST_VALID:
                pages = [node.page_hash(i) for i in range(node.num_pages)]
                namespace: Namespace = node.namespace
                assert self.backend.exists(namespace, pages) == len(pages) or any(
                    key in self.evicted for key in self.node_keys(node)
                ), f"{node!r} is on L2 but not in L3 after every backup finished"
        event("drained: L2 is backed up")

    def node_keys(self, node: Any) -> list[str]:
        return [
            key.text
            for i in range(node.num_pages)
            for key in self.keyspace.page_keys(node.namespace, node.page_hash(i))
        ]

    # ------------------------------------------------------------ comparison
    def observe(self) -> tuple[object, object]:
        model_view, impl_view = super().observe()
        l3 = self.impl.l3
        assert l3 is not None
        model_keys = self.model_keys()
        impl_keys = self.visible_keys()
        seen = sorted(self.seen, key=repr)
        model_l3 = (
            model_keys,
            sorted(key.text for key in self.lagging_keys()),
            len(self.model.backup_ops),
            self.model.prefetch_reserved(),
            tuple(self.model.l3_exists(t, ns) for ns, t in seen),
        )
        impl_l3 = (
            impl_keys,
            self.impl_lagging(),
            len(l3.backups),
            self.impl.prefetch_reserved(),
            tuple(
                self.l3_exists(ns, list(chain_page_hashes(t, self.page_size, ns))) for ns, t in seen
            ),
        )
        return (model_view, model_l3), (impl_view, impl_l3)

    @invariant()
    def store_keys_parse(self) -> None:
        """Every key in the store parses back to the parts that rendered it (round trip), and those
        parts name the key space that wrote it: this instance's, or a stranger's; a malformed
        key is refused by the parser (issue 19)."""
        if not self.ready:
            return
        keys = (
            [k.text for k in self.shared.visible_keys()] if self.lists_keys else self.visible_keys()
        )
        for text in keys:
            if text in self.garbage:
                try:
                    parse_store_key(text)
                except KeyParseError:
                    continue
                raise AssertionError(f"the parser accepted a malformed key: {text}")
            parts = parse_store_key(text)
            assert render_store_key(parts).text == text, f"round trip changed {text}"
            owner = self.strangers.get(text)
            if owner is None:
                assert self.mine(text), f"a key nobody rendered: {text}"
                continue
            assert (parts.model, parts.shard, parts.tag) == (owner.model, owner.shard, owner.tag), (
                f"{text} does not name the key space that wrote it"
            )

    def teardown(self) -> None:
        if self.ready:
            self.storage_executor.jobs.clear()
        for stranger, _, _ in getattr(self, "stranger_views", ()):
            stranger.close()
        super().teardown()


class L3WriteThrough(L3Differential):
    policy = WritePolicy.WRITE_THROUGH


class L3PrefetchOntoWriting(L3Differential):
    """The L3 machine under write_through with one more rule, in a machine of its own so the other
    machines' examples (and the mutants they catch) stay as they were."""

    policy = WritePolicy.WRITE_THROUGH

    @precondition(lambda self: self.ready and self.known)
    @rule(data=st.data(), lands=st.booleans())
    def prefetch_onto_writing(self, data: st.DataObject, lands: bool) -> None:
        """A sequence is backed up and dropped from L1 and L2; a request computes its first pages
        again (under write_through their write-through is then in flight), prefetches the rest
        onto them and commits before that write lands; then the write lands or fails. Both sides
        give the pages back while the anchor's L2 copy is not readable yet, so a failed write
        cannot leave a host-only leaf under an L1-only node (I3; the model's fuzz run found it)."""
        tokens = data.draw(st.sampled_from(self.known), label="tokens")
        pages = len(tokens) // self.page_size
        if pages < 2:
            return
        ns = data.draw(st.sampled_from(NAMESPACES), label="namespace")
        self.seen.add((ns, tokens))
        self.request_tokens(tokens, ns, with_state=False)
        self.drain()
        total = 64  # more than any pool here
        assert self.impl.evict(total) == self.model.evict(total)
        assert self.impl.evict_host(total) == self.model.evict_host(total)
        cut = data.draw(st.integers(1, pages - 1), label="pages computed again")
        part = tokens[: cut * self.page_size]
        self.seen.add((ns, part))  # it joins `known`: l3_round_trip draws its namespace from here
        self.request_tokens(part, ns, with_state=False)
        op_id = self.do_prefetch(tokens, ns)
        if op_id is None:
            return
        while self.storage_executor.jobs and self.loading(op_id):
            self.run_storage_job()
        if self.model.write_ops:
            event("prefetch committed while a write-through was in flight")
        self.finish(op_id, commit=True)
        fail = not lands
        while self.executor.jobs:
            self.complete_copy_batch(fail=fail)
            fail = False


class L3Selective(L3Differential):
    policy = WritePolicy.WRITE_THROUGH_SELECTIVE


STEPS = settings(stateful_step_count=50)
L3_STEPS = settings(STEPS, max_examples=max(10, settings().max_examples // 2))
TestL3WriteThrough = L3WriteThrough.TestCase
TestL3WriteThrough.settings = L3_STEPS
TestL3Selective = L3Selective.TestCase
TestL3Selective.settings = L3_STEPS
TestL3PrefetchOntoWriting = L3PrefetchOntoWriting.TestCase
TestL3PrefetchOntoWriting.settings = L3_STEPS


# ---------------------------------------------------------------------------- on a real Mooncake
class PythonKeysBackend(MooncakeBackend):
    """A :class:`MooncakeBackend` whose key texts the key space renders in Python, never through
    :data:`kvstrata.impl.kernels.join_keys` (issue 20's C kernel)."""

    def _keys(self, namespace: Namespace, pages: Sequence[PageHash]) -> RenderedKeys:
        return self.keyspace.rendered(namespace, pages, self.pool)


class MooncakeL3(L3Differential):
    """The same machine with a real Mooncake master and storage node as L3 (a smaller run). The
    store cannot list its keys, so the compared key set is restricted to the keys of every page of
    every sequence seen (which covers everything either side can have written)."""

    client: MooncakeClient | None = None
    lists_keys = False

    def through_store(self, backend: MooncakeBackend, *, holding: bool = False) -> MooncakeBackend:
        """``backend`` sees the store as it lags (hidden objects are not there); only the cache's
        own backend writes lagging objects."""
        backend.client = self.lagging if holding else self.lagging.view()  # type: ignore[assignment]
        return backend

    def stranger_backend(self, space: KeySpace) -> StorageBackend:
        client = MooncakeL3.client
        assert client is not None
        return self.through_store(MooncakeBackend(client, space))

    def set_lagging(self, on: bool) -> None:
        self.lagging.hold = on
        self.store_model.hold_writes = on

    def settle_lagging(self, keys: list[StoreKey], lose: bool) -> int:
        return self.lagging.lose(keys) if lose else self.lagging.publish(keys)

    def impl_lagging(self) -> list[str]:
        return sorted(text for text in self.lagging.hidden if self.mine(text))

    def storage(self) -> dict[str, Any]:
        client = MooncakeL3.client
        assert client is not None, "the module fixture starts the cluster"
        assert client.remove_all(force=True) >= 0
        self.lagging = LaggingClient(client)
        self.lagging.hold = self.initial_lag
        self.backend = self.through_store(MooncakeBackend(client, self.keyspace), holding=True)
        self.storage_executor = ManualExecutor()
        self.prefetch_ops = {}
        return {
            "storage": self.backend,
            "storage_executor": self.storage_executor,
            "storage_config": StorageConfig(
                prefetch_threshold=self.threshold,
                prefetch_policy=self.prefetch_policy,
                backup_retries=10**6,
                backup_backoff_s=0.0,
                backup_batch_pages=self.backup_batch or 256,
            ),
        }

    def visible_keys(self) -> list[str]:
        client = MooncakeL3.client
        assert client is not None
        candidates = sorted(
            {
                key.text: key
                for ns, tokens in self.seen
                for page in chain_page_hashes(tokens, self.page_size, ns)
                for key in self.keyspace.page_keys(ns, page)
            }.items()
        )
        if not candidates:
            return []
        found = self.lagging.batch_is_exist([key for _, key in candidates])
        return [text for (text, _), hit in zip(candidates, found, strict=True) if hit == 1]

    def drop_key(self, key: StoreKey) -> int:
        client = MooncakeL3.client
        assert client is not None
        return sum(1 for code in client.batch_remove([key], force=True) if code == 0)

    def peer(self) -> StorageBackend:
        """Another instance in this key space, which renders its keys in Python (as one without
        the C kernels would): a page's objects must lie under the same keys whichever renders them."""
        client = MooncakeL3.client
        assert client is not None
        return self.through_store(PythonKeysBackend(client, self.keyspace))

    def model_keys(self) -> list[str]:
        seen = {
            key.text
            for ns, tokens in self.seen
            for page in chain_page_hashes(tokens, self.page_size, ns)
            for key in self.keyspace.page_keys(ns, page)
        }
        return sorted(key.text for key, _ in self.store_model.visible_items() if key.text in seen)


@pytest.fixture(scope="module")
def mooncake_for_machine() -> Iterator[None]:
    with LocalCluster(segment_size="64mib") as cluster, MooncakeClient(cluster.config) as client:
        MooncakeL3.client = client
        try:
            yield
        finally:
            MooncakeL3.client = None


class TestMooncakeL3(MooncakeL3.TestCase):  # type: ignore[name-defined,misc]
    settings = settings(STEPS, max_examples=max(5, settings().max_examples // 2), deadline=None)

    @pytest.fixture(autouse=True)
    def _cluster(self, mooncake_for_machine: None) -> None:
        """Start the real store for this test class."""


# ---------------------------------------------------------------------------- side pools (issue 6)
class HybridL3TierDifferential(HybridDifferentialMachine, L3Differential):
    """See the module docstring."""

    lags = False  # the side pools' stores do not lag (the KV machines cover visibility)

    policy = WritePolicy.WRITE_THROUGH

    # ------------------------------------------------------------ setup hooks (both machines')
    def model_extras(
        self, data: st.DataObject, kind: KVKind, page_size: int, host_pages: int
    ) -> dict[str, Any]:
        l3 = L3Differential.model_extras(self, data, kind, page_size, host_pages)
        return {
            **l3,
            **HybridDifferentialMachine.model_extras(self, data, kind, page_size, host_pages),
        }

    def storage(self) -> dict[str, Any]:
        return {**L3Differential.storage(self), "side_specs": self.specs}

    @property
    def hybrid(self) -> HybridStorage:
        l3 = self.impl.l3
        assert l3 is not None and l3.hybrid is not None, "side pools with L3 use HybridStorage"
        return l3.hybrid

    def host_side(self, name: str) -> SideBuffer:
        assert self.impl.host_group is not None
        return self.impl.host_group.side[name]

    # ------------------------------------------------------------ store access
    def install_failures(self) -> None:
        """A failing batch fails as a whole: KV, indexer objects and states (the model's
        ``fail_backup`` aborts every put the op began)."""
        hybrid = self.hybrid
        real_put, real_states = hybrid.put, hybrid.put_states

        def put(namespace: Namespace, pages: Any, host_indices: Any, states: Any = None) -> Any:
            if self.failing:
                return HybridPut([PutStatus.FAILED] * len(pages), {})
            return real_put(namespace, pages, host_indices, states)

        def put_states(namespace: Namespace, pages: Any, slots: Any) -> list[PutStatus]:
            if self.failing:
                return [PutStatus.FAILED] * len(pages)
            return real_states(namespace, pages, slots)

        hybrid.put = put  # type: ignore[method-assign]
        hybrid.put_states = put_states  # type: ignore[method-assign]

    def l3_exists(self, namespace: Namespace, pages: list[PageHash]) -> int:
        return self.hybrid.exists(namespace, pages).usable

    def same_op(self, want: int | None, got: int | None) -> bool:
        """A prefetch query takes an op id in the implementation even when the model starts no
        op (no hit), so load-back op ids are compared by whether one started."""
        return (want is None) == (got is None)

    def side_keys(self) -> list[str]:
        pools = {f"/{INDEXER}/", f"/{MAMBA}/"}
        return sorted(
            key.text
            for key, _ in self.store_model.visible_items()
            if any(pool in key.text for pool in pools)
        )

    # ------------------------------------------------------------ prefetched bytes
    def check_prefetched(self, op: PrefetchOp, model_op: int) -> None:
        super().check_prefetched(op, model_op)
        model = self.model.prefetch_ops[model_op]
        pages = model.pages[: op.arrived]
        indexer = self.host_side(INDEXER)
        wanted = [side_bytes(indexer.spec, page) for page in pages]
        for have, column in zip(
            indexer.read(op.host[: op.arrived]), zip(*wanted, strict=True), strict=True
        ):
            assert same_bits(have, torch.cat(column)), "prefetched indexer bytes differ"
        assert op.state_read == (model.state_page is not None), (op.state_read, model.state_page)
        if model.state_page is not None:
            assert model.state_page == pages[-1], "the state is not at the last usable page"
            assert op.state_slot == model.state_slot, (op.state_slot, model.state_slot)
            mamba = self.host_side(MAMBA)
            assert op.state_slot is not None
            for have, want in zip(
                mamba.read([op.state_slot]), side_bytes(mamba.spec, model.state_page), strict=True
            ):
                assert same_bits(have, want), "prefetched state bytes differ"
            event("prefetched state bytes compared")

    # ------------------------------------------------------------ rules
    @rule(data=st.data())
    def peer_backs_up(self, data: st.DataObject) -> None:
        """Another instance backs up a sequence: KV and indexer objects of every page, and the
        states at the ends of chosen pages (at least the last one most of the time)."""
        tokens, ns = self.draw_tokens(data)
        pages = chain_page_hashes(tokens, self.page_size, ns)
        if not pages:
            return
        positions = sorted(
            set(data.draw(st.lists(st.integers(0, len(pages) - 1), max_size=2), label="states"))
            | ({len(pages) - 1} if data.draw(st.booleans(), label="last state") else set())
        )
        self.peer_back_up(ns, pages, positions)

    def peer_back_up(
        self, ns: Namespace, pages: tuple[PageHash, ...], positions: list[int]
    ) -> None:
        """Another instance backs up ``pages`` with the states at ``positions`` (both sides)."""
        model = self.model
        for page in pages:
            for component, key in model._page_objects(ns, page):
                if self.store_model.begin_put(key):
                    self.store_model.end_put(key, (page, component))
        for position in positions:
            for component, key in model._state_objects(ns, pages[position]):
                if self.store_model.begin_put(key):
                    self.store_model.end_put(key, (pages[position], component))
        turn = self._peer_writes = getattr(self, "_peer_writes", -1) + 1  # as the KV-only peer's
        scratch = HostKVPool(self.shape, len(pages), PEER_LAYOUTS[turn % len(PEER_LAYOUTS)])
        indexer = SideBuffer(self.specs[0], len(pages), host=True)
        mamba = SideBuffer(self.specs[1], max(1, len(positions)), host=True)
        peer = HybridStorage(self.peer(), [indexer, mamba])
        peer.attach(scratch)
        slots = list(range(len(pages)))
        scratch.write_pages(slots, torch.cat([kv_for(self.shape, p) for p in pages], dim=2))
        parts = [side_bytes(indexer.spec, page) for page in pages]
        indexer.write(slots, [torch.cat(column) for column in zip(*parts, strict=True)])
        for slot, position in enumerate(positions):
            mamba.write([slot], side_bytes(mamba.spec, pages[position]))
        put = peer.put(ns, list(pages), slots)
        assert all(status.ok for status in put.pages)
        states = peer.put_states(ns, [pages[p] for p in positions], list(range(len(positions))))
        assert all(status.ok for status in states)
        event(f"a peer backed up a sequence with {len(positions)} state(s)")
        if self._read_as_peer(ns, list(pages), PEER_LAYOUTS[(turn + 1) % len(PEER_LAYOUTS)]):
            event("a peer read another layout's fresh pages back whole")

    @precondition(lambda self: self.ready and self.side_keys())
    @rule(data=st.data())
    def store_evicts_side(self, data: st.DataObject) -> None:
        """The store drops one indexer object or one state component."""
        text = data.draw(st.sampled_from(self.side_keys()), label="evicted side key")
        key = next(k for k, _ in self.store_model.visible_items() if k.text == text)
        assert self.model.store_evict(key)
        assert self.drop_key(key) == 1
        self.evicted.add(text)
        event(
            "the store evicted an indexer object"
            if f"/{INDEXER}/" in text
            else "the store evicted a state component"
        )

    def states_under_backup(self) -> list[int]:
        """Model nodes whose end state a pending backup still reads from L2."""
        pinned = {page for op in self.model.backup_ops for page in op.states}
        return sorted(
            node.node_id
            for node in self.model.tree.non_root_nodes()
            if node.pages[-1] in pinned and node.pages[-1] in self.model.state_info
        )

    @precondition(lambda self: self.ready)
    @rule(data=st.data())
    def evict_state_under_backup(self, data: st.DataObject) -> None:
        """Dropping the L2 copy of a state that a backup is still writing is refused by both,
        nothing changed: its slot must not be freed or reused while the store may read it (a stale
        offset on the state path). When no backup holds a state now, a request with a state is
        served and written through first, so its backup is queued, not run (the other rules
        run storage jobs soon after they are queued: waiting for one to hold a state here
        almost never happened)."""
        if not self.states_under_backup():
            self.drain()
            self.do_request(data, with_state=True)
            while self.executor.jobs:
                self.complete_copy_batch(fail=False)
        pinned = self.states_under_backup()
        if not pinned:  # refused, or not written through (a selective policy's threshold)
            return
        node_id = data.draw(st.sampled_from(pinned), label="pinned state")
        before = self.observe()
        refused = []
        for call in (
            lambda: self.model.evict_state(node_id, host=True),
            lambda: self.impl.evict_state(self.impl_node(node_id), host=True),
        ):
            try:
                call()
            except MisuseError:
                refused.append(True)
            else:
                refused.append(False)
        assert refused[0] == refused[1], f"evict_state(host): model {refused}, impl"
        if refused[0]:
            assert self.observe() == before, "a refused evict_state changed something"
            event("L2 state under backup: evict_state refused by both")

    @precondition(lambda self: self.ready and self.known)
    @rule(data=st.data())
    def prefetch_onto_loading(self, data: st.DataObject) -> None:
        """A prefetch read lands while the same sequence, computed locally without a state, is
        written through, demoted and being loaded back: the commit ends at a node in LOADING
        (valid on L2) whose end has no state. Both sides must attach the prefetched state alike:
        the guard is ``HOST_VALID`` from the table (issue 15: the implementation's hand-written
        ``(BOTH, HOST)`` freed the state instead)."""
        assert self.host_pool is not None
        room = min(self.host_pool.num_pages // 2, self.device_pool.num_pages // 2)
        fits = [t for t in self.known if 0 < len(t) // self.page_size <= room]
        if not fits:
            return
        tokens = data.draw(st.sampled_from(fits), label="tokens")
        ns = data.draw(st.sampled_from(NAMESPACES), label="namespace")
        self.seen.add((ns, tokens))
        pages = chain_page_hashes(tokens, self.page_size, ns)
        self.drain()
        self.peer_back_up(ns, pages, [len(pages) - 1])
        total = 64  # more than any pool here
        assert self.impl.evict(total) == self.model.evict(total)
        assert self.impl.evict_host(total) == self.model.evict_host(total)
        op_id = self.do_prefetch(tokens, ns)
        if op_id is None or self.prefetch_ops[op_id] is None:
            return
        l3 = self.impl.l3
        assert l3 is not None
        while self.storage_executor.jobs and l3.prefetches[op_id].state is PrefetchState.LOADING:
            self.run_storage_job()
        self.request_tokens(tokens, ns, with_state=False)
        while self.executor.jobs:
            self.complete_copy_batch(fail=False)
        assert self.impl.evict(total) == self.model.evict(total)
        ends = [  # the node holding the last page (matches report no stateless node end)
            node.node_id
            for node in self.model.tree.non_root_nodes()
            if node.pages[-1] == pages[-1] and self.model.residency_of(node) is Residency.HOST
        ]
        if ends:
            want = self.model.load_back(ends[0])
            got = self.impl.load_back(self.impl_node(ends[0]))
            assert self.same_op(want, got), (want, got)
            if got is not None:
                event("prefetch committed onto a node that is loading back")
        self.finish(op_id, commit=True)


class HybridL3Selective(HybridL3TierDifferential):
    policy = WritePolicy.WRITE_THROUGH_SELECTIVE


TestHybridL3TierDifferential = HybridL3TierDifferential.TestCase
TestHybridL3TierDifferential.settings = settings(STEPS)
TestHybridL3Selective = HybridL3Selective.TestCase
TestHybridL3Selective.settings = settings(STEPS, max_examples=max(10, settings().max_examples // 4))


# ---------------------------------------------------------------- side pools on a real Mooncake
class MooncakeHybridL3Tier(HybridL3TierDifferential):
    """The hybrid L3 machine with a real Mooncake master and storage node (a smaller run). As in
    :class:`MooncakeL3`, the compared keys are those of every page of every sequence seen, here with
    every side pool's keys of those pages (indexer objects and state components)."""

    def storage(self) -> dict[str, Any]:
        return {**MooncakeL3.storage(self), "side_specs": self.specs}  # type: ignore[arg-type]

    lists_keys = False
    through_store = MooncakeL3.through_store

    def stranger_backend(self, space: KeySpace) -> StorageBackend:
        return MooncakeL3.stranger_backend(self, space)  # type: ignore[arg-type]

    def _candidates(self) -> dict[str, StoreKey]:
        keys: dict[str, StoreKey] = {}
        for ns, tokens in self.seen:
            for page in chain_page_hashes(tokens, self.page_size, ns):
                for key in self.keyspace.page_keys(ns, page):
                    keys[key.text] = key
                for spec in self.specs:
                    for key in side_page_keys(self.keyspace, ns, spec.pool, page):
                        keys[key.text] = key
        return keys

    def visible_keys(self) -> list[str]:
        client = MooncakeL3.client
        assert client is not None
        candidates = sorted(self._candidates().items())
        if not candidates:
            return []
        found = client.batch_is_exist([key for _, key in candidates])
        return [text for (text, _), hit in zip(candidates, found, strict=True) if hit == 1]

    def model_keys(self) -> list[str]:
        seen = self._candidates()
        return sorted(key.text for key, _ in self.store_model.visible_items() if key.text in seen)

    def drop_key(self, key: StoreKey) -> int:
        return MooncakeL3.drop_key(self, key)  # type: ignore[arg-type]

    def peer(self) -> StorageBackend:
        return MooncakeL3.peer(self)  # type: ignore[arg-type]


class TestMooncakeHybridL3Tier(MooncakeHybridL3Tier.TestCase):  # type: ignore[name-defined,misc]
    settings = settings(STEPS, max_examples=max(5, settings().max_examples // 15), deadline=None)

    @pytest.fixture(autouse=True)
    def _cluster(self, mooncake_for_machine: None) -> None:
        """Start the real store for this test class."""
