"""Engine deployments on one store: who reads whose pages (model/engines.py's sharing rule; issue 16,
issue 20 part 19).

Deployments of an engine plug-in (:class:`~kvstrata.integrations.hicache.HiCachePages`, the
engine-free half of the sglang backend, on its own host pool) share one in-memory store. Each is an
:class:`~kvstrata.model.engines.EngineShard`: a model name, what fixes its weights (``weights``), a KV
dtype and, for a byte-typed pool, its KV format (sglang and vLLM keep every fp8 variant as
``uint8``), the backend that wrote such a KV (vLLM's attention backend), a page layout (vLLM's
``hnd``), a tensor-parallel rank and size, a tag, a tenant and a
key schema. Every pool holds the same bytes per page, so no size check can tell two deployments
apart: only the keys can.

Rules: a first deployment; a *neighbour* of a deployment that differs from it in one field (or in
none: a twin; or only in how a dtype, backend or layout is spelled), so deployments that nearly
agree are the common case, not a lucky draw; a deployment writes a page whose bytes are derived from
its sharing class (the test's own spelling of the rule, :func:`sharing_class`) and the page; a
deployment asks ``exists`` for a page and gets it. The model: the set of (sharing class, page)
written. After every step (a new deployment asks for every page, a write is asked for by every
deployment): ``exists`` and ``get`` hit exactly when the reader's class wrote the page, and every
byte got is the bytes its class wrote; a hit on another class's page (a field dropped from the key)
and a miss on its own (a field spelled two ways) both fail.
"""

from __future__ import annotations

import hashlib

import attrs
import torch
from hypothesis import note, settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, initialize, rule

from kvstrata.impl.pools import HostKVPool, KVShape
from kvstrata.impl.storage.memory import MemoryStore
from kvstrata.integrations.hicache import HiCachePages
from kvstrata.integrations.store import StoreOptions
from kvstrata.model.engines import EngineShard, HashScheme
from kvstrata.model.keys import KVKind

PAGE = 2
PAGES = 6
#: two pool dtypes with the same bytes per page: float16 of head dim 4, uint8 of head dim 8
SHAPES = {
    "float16": KVShape(KVKind.MHA, layers=1, heads=1, head_dim=4, dtype=torch.float16, page_size=PAGE),
    "uint8": KVShape(KVKind.MHA, layers=1, heads=1, head_dim=8, dtype=torch.uint8, page_size=PAGE),
}  # fmt: skip
#: each field's alternatives; a neighbour takes another one of them (spellings: same meaning)
FIELDS: dict[str, list[object]] = {
    "model_name": ["org/a", "org/A", "org/b"],
    "weights": ["", "revision=r1", "revision=r1;quantization=fp8"],
    "kv": [
        ("float16", ""),
        ("uint8", "float8_e4m3fn"),
        ("uint8", "float8_e5m2"),
        ("uint8", "float8_e4m3fnuz"),
        ("float16", "float8_e4m3fn"),
    ],
    "kv_layout": ["", "hnd", "nhd"],
    "kv_backend": ["", "TRITON_ATTN", "FLASHINFER"],
    "tp": [(0, 1), (0, 2), (1, 2)],
    "tag": [None, "blue"],
    "tenant": ["", "t1"],
    "key_schema": [1, 2],
}
SPELLINGS = {
    "float16": "torch.float16",
    "uint8": "torch.uint8",
    "float8_e4m3fn": "torch.float8_e4m3fn",
}


@attrs.frozen
class Config:
    """One deployment's choice per field of :data:`FIELDS`; ``spelled``: dtypes written with
    ``torch.`` (the same dtype to the rule)."""

    model_name: str = "org/a"
    weights: str = ""
    kv: tuple[str, str] = ("float16", "")
    kv_layout: str = ""
    kv_backend: str = ""
    tp: tuple[int, int] = (0, 1)
    tag: str | None = None
    tenant: str = ""
    key_schema: int = 1
    spelled: bool = False

    def shard(self) -> EngineShard:
        dtype, kv_format = self.kv
        if self.spelled:
            dtype, kv_format = SPELLINGS.get(dtype, dtype), SPELLINGS.get(kv_format, kv_format)
        return EngineShard(
            HashScheme.SGLANG,
            self.model_name,
            dtype,
            mla=False,
            page_size=PAGE,
            tp_rank=self.tp[0],
            tp_size=self.tp[1],
            tag=self.tag,
            tenant=self.tenant,
            key_schema=self.key_schema,
            kv_format=kv_format,
            weights=self.weights,
            kv_layout=self.kv_layout.upper() if self.spelled else self.kv_layout,
            kv_backend=self.kv_backend.lower() if self.spelled else self.kv_backend,
        )


def sharing_class(config: Config) -> tuple[object, ...]:
    """The rule of model/engines.py, spelled independently: sharded (MHA) deployments share pages
    exactly when every field but the spelling agrees."""
    return (config.model_name, config.weights, config.kv, config.kv_layout, config.kv_backend,
            config.tp, config.tag, config.tenant, config.key_schema)  # fmt: skip


@attrs.define
class Deployment:
    config: Config
    pages: HiCachePages
    host: HostKVPool


def page_key(page: int) -> str:
    return hashlib.sha256(f"page {page}".encode()).hexdigest()


def page_bytes(config: Config, page: int) -> torch.Tensor:
    """The bytes of ``page`` as a deployment of ``config``'s class computes them (64 per page)."""
    seed = hashlib.sha256(repr((sharing_class(config), page)).encode()).digest()
    generator = torch.Generator().manual_seed(int.from_bytes(seed[:8], "little"))
    return torch.randint(0, 256, (SHAPES["uint8"].bytes_per_page,), generator=generator,
                         dtype=torch.uint8)  # fmt: skip


def planes(host: HostKVPool, page: int) -> list[torch.Tensor]:
    """The bytes of one host page, K then V (writable views)."""
    return [host.page_slab(plane, page).view(torch.uint8) for plane in range(host.shape.planes)]


def slots(host_page: int) -> torch.Tensor:
    return torch.arange(host_page * PAGE, (host_page + 1) * PAGE)


class EngineSharing(RuleBasedStateMachine):
    deployments = Bundle("deployments")

    def __init__(self) -> None:
        super().__init__()
        self.store = MemoryStore()
        self.options = StoreOptions.parse(
            {"store": "memory", "memory_store": self.store}, where="t"
        )
        self.written: set[tuple[tuple[object, ...], int]] = set()
        self.open: list[Deployment] = []

    def deploy(self, config: Config) -> Deployment:
        host = HostKVPool(SHAPES[config.kv[0]], 2, "page_first_direct")
        deployment = Deployment(config, HiCachePages(config.shard(), self.options, host), host)
        note(f"deploy {config}")
        self.open.append(deployment)
        for page in range(PAGES):  # it sees exactly its class's pages from the start
            self.check_exists(deployment, page)
        return deployment

    def check_exists(self, deployment: Deployment, page: int) -> None:
        mine = (sharing_class(deployment.config), page) in self.written
        assert deployment.pages.exists([page_key(page)]) == int(mine), deployment.config

    @initialize(target=deployments)
    def first(self) -> Deployment:
        return self.deploy(Config())

    @rule(
        target=deployments,
        of=deployments,
        field=st.sampled_from([*FIELDS, "twin", "spelling"]),
        pick=st.integers(0, 4),
    )
    def neighbour(self, of: Deployment, field: str, pick: int) -> Deployment:
        """A deployment that differs from ``of`` in ``field`` only (a twin: in nothing; a
        spelling: in how its dtypes are written)."""
        if field == "twin":
            return self.deploy(of.config)
        if field == "spelling":
            return self.deploy(attrs.evolve(of.config, spelled=not of.config.spelled))
        others = [value for value in FIELDS[field] if value != getattr(of.config, field)]
        return self.deploy(attrs.evolve(of.config, **{field: others[pick % len(others)]}))

    @rule(deployment=deployments, page=st.integers(0, PAGES - 1))
    def write(self, deployment: Deployment, page: int) -> None:
        written = page_bytes(deployment.config, page).chunk(2)
        for plane, data in zip(planes(deployment.host, 0), written, strict=True):
            plane.copy_(data)
        assert deployment.pages.set([page_key(page)], slots(0)) == [True]
        self.written.add((sharing_class(deployment.config), page))
        for other in self.open:  # every deployment of its class sees it, and no other
            self.check_exists(other, page)

    @rule(deployment=deployments, page=st.integers(0, PAGES - 1))
    def read(self, deployment: Deployment, page: int) -> None:
        mine = (sharing_class(deployment.config), page) in self.written
        self.check_exists(deployment, page)
        for plane in planes(deployment.host, 1):
            plane.fill_(0)
        assert deployment.pages.get([page_key(page)], slots(1)) == [mine]
        target = torch.cat(planes(deployment.host, 1))
        if mine:
            assert torch.equal(target, page_bytes(deployment.config, page))
        else:
            assert not target.any()  # a miss writes nothing

    def teardown(self) -> None:
        for deployment in self.open:
            deployment.pages.close()


TestEngineSharing = EngineSharing.TestCase
TestEngineSharing.settings = settings(stateful_step_count=30)
