"""Where an engine's pages live in kvstrata's key namespace (SPEC §4; issue 16). Pure: no engine,
no torch, no I/O.

An engine plug-in (sglang's L3 storage backend, vLLM's KV connector) names its pages with the
engine's own hashes and describes its place in the deployment with the engine's own config. This
module turns both into kvstrata's terms, once, so that the adapters stay thin and every rule about
sharing is stated (and property-tested) here.

Sharing rule (the invariant :class:`EngineShard` keeps): two plug-in instances read each other's
pages **exactly when** they agree on the hash scheme, the model (its name as the engine reports it,
verbatim, and what else fixes its weights where the engine says: ``weights``), the KV dtype and the
KV format (the logical element type of a byte-typed pool), the page layout (the order of a page's
bytes, where the engine names one), the KV kind, the page size, the pipeline
stage (rank and size), the tag, the key schema and the tenant namespace, and, for sharded (MHA) KV,
on the tensor-parallel rank **and** size. MLA KV is replicated across TP ranks: every rank of every
TP size reads it, and only the writer rank (rank 0, or the rank an engine names) writes it.
Data-parallel replicas hold the same KV and share; a rank's DP index is therefore not part of the
key.

Hash schemes: each engine hashes pages its own way (sglang: a chain of SHA-256 hex strings; vLLM:
32-byte block hashes), so equal token prefixes never have equal hashes across engines. The scheme is
still put in the key (as the namespace's ``extra_key``) so that a page written by one engine can
never be misread by another, whatever their hashes happen to be.

Model names: the engine's name (``"meta-llama/Llama-3.1-8B"``) becomes a key-safe slug followed by
12 hex digits of the SHA-256 of the exact name (and of ``weights`` when given), so names that slug
alike stay apart.

KV dtypes (issue 20, part 19): engines keep every fp8 variant (e4m3, e5m2, e4m3fnuz) and other
packed formats in ``uint8`` or ``int8`` tensors, so a byte dtype does not say what the bytes are.
Two deployments of one model with ``--kv-cache-dtype fp8_e4m3`` and ``fp8_e5m2`` would otherwise
share keys and read each other's pages as their own (same sizes: no size check can tell). A shard
whose dtype is one of :data:`BYTE_DTYPES` must therefore name its ``kv_format``, and the format is
part of the key's dtype segment (``uint8.float8_e4m3fn``); a shard of any other dtype keeps the
key it always had unless it names a format too.

Page layouts: a plug-in that cuts its pages out of the engine's blocks in a stated order names that
order (``kv_layout``; vLLM's connector: ``"hnd"``, K and V each heads x tokens x head dim). A page
written in one order must never be read in another (same sizes, other bytes), so the layout is part
of the key's dtype segment after a ``~`` (``bfloat16~hnd``); an empty layout renders the key the
plug-in always had.

Writing backends (issue 20, part 21): where the meaning of a byte-typed KV depends on the kernels that
wrote it, a plug-in names them (``kv_backend``; vLLM's connector: the attention backend, for a KV it
keeps as bytes). vLLM's Triton backend writes an ``fp8_e5m2`` cache in the platform's e4m3 type, its
FlashInfer backend real e5m2, under one cache dtype name: the format alone would let each read the
other's pages as its own. The backend follows the format after an ``@`` (``uint8.float8_e5m2@
triton_attn~hnd``); empty, the key is the one the plug-in always had.
"""

from __future__ import annotations

import enum
import hashlib
import json
import re

import attrs

from kvstrata.model.errors import MisuseError
from kvstrata.model.keys import KeySpace, KVKind, ModelIdentity, Namespace, PageHash, Shard

__all__ = [
    "BYTE_DTYPES",
    "EngineShard",
    "HashScheme",
    "engine_kv_format",
    "engine_page_hash",
    "engine_weights",
    "holds_bytes",
    "model_slug",
]

BYTE_DTYPES = frozenset({"uint8", "int8"})
"""Dtypes (as :meth:`EngineShard.model` spells them) that hold some other format's bytes: a shard
of one of them must name its ``kv_format``."""

_SLUG_CHARS = re.compile(r"[^a-z0-9]+")
_SLUG_LENGTH = 40
_HEX64 = re.compile(r"[0-9a-fA-F]{64}\Z")


class HashScheme(enum.Enum):
    """How an engine names a page."""

    SGLANG = "sglang-sha256"
    """sglang HiCache: 64 hex digits of a SHA-256 chain value per page."""
    VLLM = "vllm-block"
    """vLLM: the 32-byte ``BlockHash`` of a full block."""


def model_slug(name: str, weights: str = "") -> str:
    """A :class:`ModelIdentity` name for an engine's model name: lower-case letters, digits and
    ``_``, starting with a letter, ending with 12 hex digits of SHA-256 of ``name`` (so two names
    that slug alike still differ). Deterministic across processes and machines.

    ``weights`` (what else fixes the weights: a revision, a quantization) goes into the digest
    alone, domain-separated from a bare name, so ``("a", "b")`` and ``("a", "")`` never meet;
    empty, the slug is the one a bare name always had."""
    if not isinstance(name, str) or not name.strip():
        raise MisuseError(f"a model name must be a non-empty string, got {name!r}")
    if not isinstance(weights, str):
        raise MisuseError(f"a model's weights must be a string, got {weights!r}")
    slug = _SLUG_CHARS.sub("_", name.strip().lower()).strip("_")[:_SLUG_LENGTH].rstrip("_")
    hashed = json.dumps(["kvstrata.weights.v1", name, weights]) if weights else name
    digest = hashlib.sha256(hashed.encode()).hexdigest()[:12]
    return f"m_{slug}_{digest}" if slug else f"m_{digest}"


#: engine KV cache dtype names (vLLM's and sglang's ``--kv-cache-dtype``) that name one element type
_E4M3_NAMES = frozenset({"fp8", "fp8_e4m3"})
_E5M2_NAMES = frozenset({"fp8_e5m2"})


def engine_kv_format(
    configured: str, fp8_e4m3: str = "float8_e4m3fn", fp8_e5m2: str = "float8_e5m2"
) -> str:
    """The :attr:`EngineShard.kv_format` for an engine's configured KV cache dtype: the type the
    platform stores for it. ``fp8`` and ``fp8_e4m3`` become ``fp8_e4m3`` (``float8_e4m3fn``, or
    ``float8_e4m3fnuz`` on ROCm's MI300, whose bytes mean other numbers); ``fp8_e5m2`` becomes
    ``fp8_e5m2`` (``float8_e5m2``; sglang on ROCm stores its e4m3 type instead); any other name (a
    torch dtype, a packed format such as vLLM's ``int8_per_token_head``) is kept as it is. Engines
    that spell one type two ways therefore share keys, and types that differ never do."""
    if not isinstance(configured, str) or not configured.strip():
        raise MisuseError(f"a KV cache dtype must be a non-empty string, got {configured!r}")
    name = configured.strip().removeprefix("torch.").lower()
    if name in _E4M3_NAMES:
        return fp8_e4m3.strip().removeprefix("torch.")
    if name in _E5M2_NAMES:
        return fp8_e5m2.strip().removeprefix("torch.")
    return name


def engine_weights(revision: object = None, quantization: object = None) -> str:
    """The :attr:`EngineShard.weights` for what an engine says fixes a model's weights beyond its
    name: ``revision=...;quantization=...``, each part only when given (``""`` when neither)."""
    parts = {"revision": revision, "quantization": quantization}
    return ";".join(f"{name}={value}" for name, value in parts.items() if value)


def _dtype_slug(value: str) -> str:
    return _SLUG_CHARS.sub("_", value.strip().removeprefix("torch.").lower()).strip("_")


def holds_bytes(dtype: object) -> bool:
    """Whether an engine tensor of ``dtype`` (a torch dtype or its name) holds some other format's
    bytes (:data:`BYTE_DTYPES`): its shard must then name a ``kv_format``."""
    return _dtype_slug(str(dtype)) in BYTE_DTYPES


def engine_page_hash(key: object, scheme: HashScheme) -> PageHash:
    """The :class:`PageHash` of one engine page name: 64 hex digits (sglang) or 32 bytes (vLLM).
    :class:`MisuseError` for anything else (no truncation, no re-hashing: the engine's hash already
    names the whole prefix)."""
    if scheme is HashScheme.SGLANG:
        if not isinstance(key, str) or not _HEX64.match(key):
            raise MisuseError(f"an sglang page key is 64 hex digits, got {key!r}")
        return PageHash(bytes.fromhex(key))
    if scheme is HashScheme.VLLM:
        if not isinstance(key, bytes) or len(key) != 32:
            raise MisuseError(f"a vLLM block hash is 32 bytes, got {key!r}")
        return PageHash(key)
    raise MisuseError(f"scheme must be a HashScheme, got {scheme!r}")


def _positive(_instance: object, attribute: attrs.Attribute[int], value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise MisuseError(f"EngineShard.{attribute.name}: expected an int >= 1, got {value!r}")


def _rank(_instance: object, attribute: attrs.Attribute[int], value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise MisuseError(f"EngineShard.{attribute.name}: expected an int >= 0, got {value!r}")


def _scheme(value: object) -> None:
    if not isinstance(value, HashScheme):
        raise MisuseError(f"EngineShard.scheme: expected a HashScheme, got {value!r}")


def _flag(value: object) -> None:
    if not isinstance(value, bool):
        raise MisuseError(f"EngineShard.mla: expected a bool, got {value!r}")


def _text(_instance: object, attribute: attrs.Attribute[str], value: str) -> None:
    if not isinstance(value, str) or not value.strip():
        raise MisuseError(
            f"EngineShard.{attribute.name}: expected a non-empty string, got {value!r}"
        )


@attrs.frozen
class EngineShard:
    """One plug-in instance's place in the deployment, in the engine's terms.

    Invariants (:class:`MisuseError` otherwise): ranks lie in ``[0, size)``; ``page_size`` and
    sizes are >= 1; ``writer_rank`` is a TP rank. :meth:`keyspace` and :meth:`namespace` are pure
    functions of the fields that decide sharing (the module's sharing rule) and of nothing else.
    """

    scheme: HashScheme = attrs.field(validator=lambda _i, _a, value: _scheme(value))
    model_name: str = attrs.field(validator=_text)
    dtype: str = attrs.field(validator=_text)
    """The KV dtype's name, e.g. ``"bfloat16"`` (``torch.`` is dropped)."""
    mla: bool = attrs.field(validator=lambda _i, _a, value: _flag(value))
    page_size: int = attrs.field(validator=_positive)
    tp_rank: int = attrs.field(default=0, validator=_rank)
    tp_size: int = attrs.field(default=1, validator=_positive)
    pp_rank: int = attrs.field(default=0, validator=_rank)
    pp_size: int = attrs.field(default=1, validator=_positive)
    writer_rank: int = attrs.field(default=0, validator=_rank)
    """MLA only: the TP rank that writes the replicated pages."""
    tag: str | None = None
    """A deployment tag (a key segment; see :class:`~kvstrata.model.keys.KeySpace`)."""
    tenant: str = ""
    """A tenant namespace: tenants never share pages (the namespace's ``salt``)."""
    key_schema: int = 1
    """The store key schema (:data:`~kvstrata.model.keys.SCHEMA_VERSIONS`): 1, one object per K
    and V plane (what deployments already hold); 2, one object per page (issue 20). Part of the
    key space: instances share pages only under the same schema."""
    kv_format: str = ""
    """The KV's logical element type when ``dtype`` is the byte container the engine keeps it in
    (``"float8_e5m2"`` in a ``uint8`` pool); required for :data:`BYTE_DTYPES`. Part of the key's
    dtype segment, compared as the dtype is (case, punctuation and ``torch.`` aside)."""
    weights: str = ""
    """What fixes the model's weights beyond its name where the engine reports it (vLLM: the
    revision and the weight quantization), folded into the model name's digest."""
    kv_layout: str = ""
    """The order of a page's bytes where the plug-in states one (vLLM: ``"hnd"``); part of the
    key's dtype segment after a ``~``, compared as the dtype is. Empty: the key the plug-in always
    had."""
    kv_backend: str = ""
    """The kernels that wrote the bytes, where their meaning depends on them (vLLM: the attention
    backend of a KV kept as bytes, ``"TRITON_ATTN"``); part of the key's dtype segment after an
    ``@``, compared as the dtype is. Empty: the key the plug-in always had."""

    def __attrs_post_init__(self) -> None:
        if self.tp_rank >= self.tp_size:
            raise MisuseError(f"EngineShard: tp_rank {self.tp_rank} >= tp_size {self.tp_size}")
        if self.pp_rank >= self.pp_size:
            raise MisuseError(f"EngineShard: pp_rank {self.pp_rank} >= pp_size {self.pp_size}")
        if self.writer_rank >= self.tp_size:
            raise MisuseError(
                f"EngineShard: writer_rank {self.writer_rank} >= tp_size {self.tp_size}"
            )
        for name in ("tenant", "kv_format", "weights", "kv_layout", "kv_backend"):
            value = getattr(self, name)
            if not isinstance(value, str):
                raise MisuseError(f"EngineShard.{name}: expected a string, got {value!r}")
        for name in ("kv_format", "kv_layout", "kv_backend"):  # named, it must say something
            value = getattr(self, name)
            if value.strip() and not _dtype_slug(value):
                raise MisuseError(f"EngineShard.{name}: {value!r} has no letter or digit")
        if holds_bytes(self.dtype) and not _dtype_slug(self.kv_format):
            raise MisuseError(
                f"EngineShard: a {self.dtype} KV pool holds some other format's bytes; name it "
                "(kv_format, e.g. 'float8_e4m3fn'), or pages of every such format share keys"
            )

    @property
    def writer(self) -> bool:
        """Whether this instance writes pages: every rank for sharded KV, one rank for MLA."""
        return not self.mla or self.tp_rank == self.writer_rank

    def model(self) -> ModelIdentity:
        dtype = _dtype_slug(self.dtype) or "unknown"
        kv_format = _dtype_slug(self.kv_format)
        kv_layout = _dtype_slug(self.kv_layout)
        kv_backend = _dtype_slug(self.kv_backend)
        dtype = f"{dtype}.{kv_format}" if kv_format else dtype
        dtype = f"{dtype}@{kv_backend}" if kv_backend else dtype
        return ModelIdentity(
            name=model_slug(self.model_name, self.weights),
            dtype=f"{dtype}~{kv_layout}" if kv_layout else dtype,
            kind=KVKind.MLA if self.mla else KVKind.MHA,
            page_size=self.page_size,
        )

    def shard(self) -> Shard:
        if self.mla:
            return Shard.replicated(pp_rank=self.pp_rank, pp_size=self.pp_size)
        return Shard(self.tp_rank, self.tp_size, self.pp_rank, self.pp_size)

    def keyspace(self) -> KeySpace:
        """The key space of this instance's KV pages (and of its side pools)."""
        return KeySpace(self.model(), self.shard(), self.tag, schema=self.key_schema)

    def namespace(self) -> Namespace:
        """The namespace every key of this instance is rendered in: the hash scheme and the
        tenant."""
        return Namespace(extra_key=self.scheme.value, salt=self.tenant)
