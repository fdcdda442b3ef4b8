"""The store key schema (SPEC §4). Pure functions, no state, no I/O.

This module is intentionally a library of its own: an external router that wants to predict which store
keys kvstrata reads and writes can import it alone (it re-exports the page hashes and namespaces of
:mod:`kvstrata.model.hashes`).

Store keys
    A :class:`StoreKey` is rendered by exactly one function, :func:`render_store_key`, from typed parts
    (:class:`KeyParts`): schema version, optional deployment tag, model identity (name, dtype, KV kind, page
    size or embedding dim), namespace, shard (tp rank *and* tp size, pp rank and size), pool, component and
    page hash. :func:`parse_store_key` inverts it. A :class:`PageHash` and a :class:`StoreKey` are different
    types, so rendering a rendered key is a type error for mypy and a :class:`DoubleRenderError` at run time
    (the historic "tagged twice" bug).

Schema versions (:data:`SCHEMA_VERSIONS`; the version is the key's first segment, so objects of two
versions never answer each other's lookups)
    1. one store object per plane of a KV page: components ``k`` and ``v`` (MHA) or ``latent`` (MLA);
    2. one store object per KV page (issue 20): component ``page``, every plane of the page in
       canonical order ``[planes, layers, page_size, heads, head_dim]`` (K then V). A side pool's
       entry is likewise one ``page`` object (its components concatenated in order:
       :func:`kvstrata.model.hybrid.side_components`); an embedding is one ``emb`` object under
       either version, where only the version segment differs.

    A :class:`KeySpace` picks one (``schema``, default :data:`SCHEMA_VERSION`) for all who share it.

Rendered form, one path segment per field, each percent-escaped::

    kvs<version>/<tag|_>/<model>/<dtype>/<kind>/<p<page_size>|d<dim>>/<namespace>/
        <tp<r>of<s>|tp-rep>/pp<r>of<s>/<pool[.layout]>/<component>/<hex digest>

(one line, no spaces; split here for reading; ``.layout``: :func:`kvstrata.model.hybrid.pool_segment`).
"""

from __future__ import annotations

import enum
import re
from collections.abc import Callable, Iterable, Sequence
from urllib.parse import quote, unquote

import attrs

from kvstrata.model.errors import DoubleRenderError, KeyParseError, MisuseError
from kvstrata.model.hashes import (
    DEFAULT_NAMESPACE,
    Namespace,
    PageHash,
    chain_page_hashes,
    content_hash,
)

KeyJoin = Callable[[tuple[str, ...], Sequence[PageHash]], list[str] | None]
"""``join(prefixes, pages)``: every prefix + page hex, page-major (see :meth:`KeySpace.rendered`)."""

__all__ = [
    "DEFAULT_NAMESPACE",
    "PAGE_COMPONENT",
    "SCHEMA_VERSION",
    "SCHEMA_VERSIONS",
    "KVKind",
    "KeyJoin",
    "KeyParts",
    "KeySpace",
    "ModelIdentity",
    "Namespace",
    "PageHash",
    "RenderedKeys",
    "Shard",
    "StoreKey",
    "chain_page_hashes",
    "content_hash",
    "parse_store_key",
    "render_store_key",
]

SCHEMA_VERSION = 1
"""The default schema version: one object per plane of a KV page."""
SCHEMA_VERSIONS = (1, 2)
"""Every schema version this library renders and parses."""
PAGE_COMPONENT = "page"
"""The one component of a KV page under schema version 2."""
_PREFIX = "kvs"
_NAME_RE = re.compile(r"[a-z][a-z0-9_]*\Z")
_POOL_RE = re.compile(r"[a-z][a-z0-9_]*(?:\.[0-9a-z]{1,32})?\Z")
_TAG_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9.\-]*\Z")


class KVKind(enum.Enum):
    """What one object of the model's pool holds: MHA K/V planes, an MLA latent, or an embedding."""

    MHA = "mha"
    MLA = "mla"
    EMBEDDING = "emb"


def _check_name(_instance: object, attribute: attrs.Attribute[str], value: str) -> None:
    if not isinstance(value, str) or not value:
        raise MisuseError(f"{attribute.name} must be a non-empty string, got {value!r}")


@attrs.frozen
class ModelIdentity:
    """Everything about a model that changes the bytes of its cached objects.

    KV kinds carry ``page_size`` (tokens per page) and ``dim == 0``; embeddings carry ``dim`` and
    ``page_size == 0``.
    """

    name: str = attrs.field(validator=_check_name)
    dtype: str = attrs.field(validator=_check_name)
    kind: KVKind = attrs.field(validator=attrs.validators.instance_of(KVKind))
    page_size: int = 0
    dim: int = 0

    def __attrs_post_init__(self) -> None:
        for name in ("page_size", "dim"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise MisuseError(f"{name} must be an int, got {value!r}")
        if self.kind is KVKind.EMBEDDING:
            if self.dim <= 0 or self.page_size != 0:
                raise MisuseError(f"an embedding identity needs dim > 0 and no page size: {self!r}")
        elif self.page_size <= 0 or self.dim != 0:
            raise MisuseError(f"a KV identity needs page_size > 0 and no dim: {self!r}")

    @property
    def components(self) -> tuple[str, ...]:
        """The objects one page of the KV pool is stored as."""
        components = {KVKind.MHA: ("k", "v"), KVKind.MLA: ("latent",), KVKind.EMBEDDING: ("emb",)}
        return components[self.kind]


@attrs.frozen
class Shard:
    """Which slice of the model's state an object holds. ``tp_rank is None`` means replicated across
    tensor-parallel ranks (MLA): one rank writes it and every rank reads it."""

    tp_rank: int | None = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1

    def __attrs_post_init__(self) -> None:
        for name in ("tp_size", "pp_size", "pp_rank", "tp_rank"):
            value = getattr(self, name)
            if isinstance(value, bool) or not (
                isinstance(value, int) or (value is None and name == "tp_rank")
            ):
                raise MisuseError(f"{name} must be an int, got {value!r}")
        if self.tp_rank is None and self.tp_size != 1:
            raise MisuseError(
                f"a replicated shard has no tp size (use Shard.replicated()): {self!r}"
            )
        if self.tp_size <= 0 or self.pp_size <= 0:
            raise MisuseError(f"tp_size and pp_size must be > 0: {self!r}")
        if self.tp_rank is not None and not 0 <= self.tp_rank < self.tp_size:
            raise MisuseError(f"tp_rank must be in [0, tp_size): {self!r}")
        if not 0 <= self.pp_rank < self.pp_size:
            raise MisuseError(f"pp_rank must be in [0, pp_size): {self!r}")

    @classmethod
    def replicated(cls, pp_rank: int = 0, pp_size: int = 1) -> Shard:
        return cls(tp_rank=None, tp_size=1, pp_rank=pp_rank, pp_size=pp_size)


@attrs.frozen(repr=False)
class StoreKey:
    """A rendered store key, made only by :func:`render_store_key` or from a text it rendered."""

    text: str

    def __str__(self) -> str:
        return self.text

    def __repr__(self) -> str:
        return f"StoreKey({self.text!r})"


#: a pool's segment may end in a side pool's layout token (kvstrata.model.hybrid.pool_segment)
_NAME_RULES = {"pool": (_POOL_RE, "[a-z][a-z0-9_]* with an optional .<layout> of 1-32 [0-9a-z]")}


def _check_component_name(_instance: object, attribute: attrs.Attribute[str], value: str) -> None:
    pattern, rule = _NAME_RULES.get(attribute.name, (_NAME_RE, "[a-z][a-z0-9_]*"))
    if not isinstance(value, str) or not pattern.match(value):
        raise MisuseError(f"{attribute.name} must match {rule}, got {value!r}")


def _check_schema(_instance: object, _attribute: object, value: int) -> None:
    if isinstance(value, bool) or value not in SCHEMA_VERSIONS:
        raise MisuseError(f"a key schema version is one of {SCHEMA_VERSIONS}, got {value!r}")


def _check_tag(_instance: object, _attribute: object, value: str | None) -> None:
    if value is not None and (not isinstance(value, str) or not _TAG_RE.match(value)):
        raise MisuseError(f"a deployment tag must match [A-Za-z0-9][A-Za-z0-9.-]*, got {value!r}")


@attrs.frozen
class KeyParts:
    """The typed, not yet rendered, form of a store key."""

    model: ModelIdentity
    namespace_id: str = attrs.field(validator=_check_name)
    shard: Shard
    pool: str = attrs.field(validator=_check_component_name)
    component: str = attrs.field(validator=_check_component_name)
    page_hash: PageHash
    tag: str | None = attrs.field(default=None, validator=_check_tag)
    version: int = SCHEMA_VERSION


def _segment(value: str) -> str:
    return quote(value, safe="")


def render_store_key(parts: KeyParts) -> StoreKey:
    """The one function that turns key parts into the string the store sees."""
    if isinstance(parts, StoreKey | str):
        raise DoubleRenderError(f"refusing to render an already rendered key: {parts!r}")
    if not isinstance(parts, KeyParts):
        raise TypeError(f"render_store_key takes KeyParts, got {type(parts).__name__}")
    if not isinstance(parts.page_hash, PageHash):
        raise DoubleRenderError(f"page_hash is not a PageHash: {parts.page_hash!r}")
    if parts.version not in SCHEMA_VERSIONS:
        raise MisuseError(f"cannot render schema version {parts.version}")
    model = parts.model
    unit = f"d{model.dim}" if model.kind is KVKind.EMBEDDING else f"p{model.page_size}"
    shard = parts.shard
    tp = "tp-rep" if shard.tp_rank is None else f"tp{shard.tp_rank}of{shard.tp_size}"
    segments = (
        f"{_PREFIX}{parts.version}",
        "_" if parts.tag is None else parts.tag,
        _segment(model.name),
        _segment(model.dtype),
        model.kind.value,
        unit,
        _segment(parts.namespace_id),
        tp,
        f"pp{shard.pp_rank}of{shard.pp_size}",
        parts.pool,
        parts.component,
        parts.page_hash.hex(),
    )
    return StoreKey("/".join(segments))


_KEY_RE = re.compile(
    r"kvs(?P<version>[0-9]+)/(?P<tag>[^/]+)/(?P<name>[^/]+)/(?P<dtype>[^/]+)/(?P<kind>[a-z]+)/"
    r"(?:p(?P<page>[0-9]+)|d(?P<dim>[0-9]+))/(?P<ns>[^/]+)/"
    r"(?:tp-rep|tp(?P<tp_rank>[0-9]+)of(?P<tp_size>[0-9]+))/pp(?P<pp_rank>[0-9]+)of(?P<pp_size>[0-9]+)/"
    r"(?P<pool>[^/]+)/(?P<component>[^/]+)/(?P<hash>[0-9a-f]{64})\Z"
)


def parse_store_key(key: StoreKey | str) -> KeyParts:
    """The inverse of :func:`render_store_key`; raises :class:`KeyParseError` for anything else.

    The result renders back to exactly the same text (a key with, say, a doubled prefix does not
    parse)."""
    text = key.text if isinstance(key, StoreKey) else key
    if not isinstance(text, str):
        raise KeyParseError(f"a store key is a string, got {type(text).__name__}")
    match = _KEY_RE.match(text)
    if match is None or int(match["version"]) not in SCHEMA_VERSIONS:
        raise KeyParseError(f"not a kvstrata v1 or v2 store key: {text!r}")
    try:
        kind = KVKind(match["kind"])
        model = ModelIdentity(
            name=unquote(match["name"]),
            dtype=unquote(match["dtype"]),
            kind=kind,
            page_size=int(match["page"] or 0),
            dim=int(match["dim"] or 0),
        )
        tp_rank = None if match["tp_rank"] is None else int(match["tp_rank"])
        shard = Shard(
            tp_rank=tp_rank,
            tp_size=1 if match["tp_size"] is None else int(match["tp_size"]),
            pp_rank=int(match["pp_rank"]),
            pp_size=int(match["pp_size"]),
        )
        parts = KeyParts(
            model=model,
            namespace_id=unquote(match["ns"]),
            shard=shard,
            pool=match["pool"],
            component=match["component"],
            page_hash=PageHash.from_hex(match["hash"]),
            tag=None if match["tag"] == "_" else match["tag"],
            version=int(match["version"]),
        )
    except (ValueError, MisuseError) as exc:
        raise KeyParseError(f"malformed store key {text!r}: {exc}") from exc
    if render_store_key(parts).text != text:
        raise KeyParseError(f"store key is not in canonical form: {text!r}")
    return parts


_ZERO_HASH = PageHash(bytes(32))
_ZERO_HEX = _ZERO_HASH.digest.hex()


@attrs.frozen
class KeySpace:
    """The fixed part of every key one cache instance reads and writes.

    Two instances share L3 objects exactly when their key spaces are equal (same model identity,
    shard, tag and schema version) and so are their namespaces. ``schema`` decides what one KV page is
    in the store (:meth:`components`): one object per plane (1) or one object per page (2).

    Speed without a second renderer: everything in a key but the page hash is fixed per
    (namespace, pool, component), and the page hash is the key's last segment. :meth:`key` therefore
    renders that fixed part once through :func:`render_store_key` (with an all-zero page hash) and
    appends each page hash's hex digits to it; a unit test checks the result equals
    :func:`render_store_key` for arbitrary parts. The memo is part of no comparison or hash."""

    model: ModelIdentity
    shard: Shard = Shard()
    tag: str | None = attrs.field(default=None, validator=_check_tag)
    schema: int = attrs.field(default=SCHEMA_VERSION, kw_only=True, validator=_check_schema)
    _prefixes: dict[tuple[Namespace, str, str], str] = attrs.field(
        factory=dict, init=False, eq=False, hash=False, repr=False
    )
    _component_prefixes: dict[tuple[Namespace, str, tuple[str, ...] | None], tuple[str, ...]] = (
        attrs.field(factory=dict, init=False, eq=False, hash=False, repr=False)
    )

    def key(self, namespace: Namespace, pool: str, component: str, page_hash: PageHash) -> StoreKey:
        if not isinstance(page_hash, PageHash):
            raise DoubleRenderError(f"page_hash is not a PageHash: {page_hash!r}")
        prefix = self._prefixes.get((namespace, pool, component))  # inline: the hot path
        if prefix is None:
            prefix = self._prefix(namespace, pool, component)
        return StoreKey(prefix + page_hash.digest.hex())

    def _prefix(self, namespace: Namespace, pool: str, component: str) -> str:
        """Every key of (namespace, pool, component) but its page hash's hex digits: rendered once
        through :func:`render_store_key` with an all-zero page hash, then memoised."""
        slot = (namespace, pool, component)
        prefix = self._prefixes.get(slot)
        if prefix is None:
            template = render_store_key(
                KeyParts(
                    model=self.model,
                    namespace_id=namespace.key_id(),
                    shard=self.shard,
                    pool=pool,
                    component=component,
                    page_hash=_ZERO_HASH,
                    tag=self.tag,
                    version=self.schema,
                )
            ).text
            prefix = template[: -len(_ZERO_HEX)]
            self._prefixes[slot] = prefix
        return prefix

    def component_keys(
        self, namespace: Namespace, pool: str, components: tuple[str, ...], page_hash: PageHash
    ) -> tuple[StoreKey, ...]:
        """:meth:`key` of each of ``components`` of ``page_hash``, in order, with one memo lookup
        for them all (the unit objects of one embedding; the same strings as :meth:`key`)."""
        if not isinstance(page_hash, PageHash):
            raise DoubleRenderError(f"page_hash is not a PageHash: {page_hash!r}")
        slot = (namespace, pool, components)
        prefixes = self._component_prefixes.get(slot)
        if prefixes is None:
            prefixes = tuple(self._prefix(namespace, pool, name) for name in components)
            self._component_prefixes[slot] = prefixes
        hex_ = page_hash.digest.hex()
        return tuple(StoreKey(prefix + hex_) for prefix in prefixes)

    def page_keys(
        self, namespace: Namespace, page_hash: PageHash, pool: str = "kv"
    ) -> tuple[StoreKey, ...]:
        """The keys of every component object of one page of ``pool``."""
        return self.component_keys(namespace, pool, self.components, page_hash)

    @property
    def components(self) -> tuple[str, ...]:
        """The objects one page of this model's pool is stored as: the model's components under
        schema 1 (``k``, ``v`` / ``latent`` / ``emb``), the one ``page`` object of a KV page under
        schema 2 (an embedding is one object under either)."""
        if self.schema == 1 or self.model.kind is KVKind.EMBEDDING:
            return self.model.components
        return (PAGE_COMPONENT,)

    def rendered(
        self,
        namespace: Namespace,
        pages: Sequence[PageHash],
        pool: str = "kv",
        components: tuple[str, ...] | None = None,
        join: KeyJoin | None = None,
    ) -> RenderedKeys:
        """Every component key of every page of ``pool``, page-major, as one batch of text (issue
        20: a store call on many pages makes one object, not one per key). ``components``: the
        key space's own (:attr:`components`, the KV pool's) unless given (a side pool's, as
        :func:`kvstrata.model.hybrid.side_rendered` passes them). The same strings as
        :meth:`page_keys` / :meth:`component_keys`; a page that is not a :class:`PageHash` is a
        :class:`DoubleRenderError`. ``join`` (the implementation's native kernel) may make the
        texts from the prefixes; it must make these same strings, or answer None to leave it here
        (an answer of another length is left here too)."""
        slot = (namespace, pool, components)  # None: the key space's own, without a lookup
        prefixes = self._component_prefixes.get(slot)
        if prefixes is None:
            names = self.components if components is None else components
            prefixes = tuple(self._prefix(namespace, pool, name) for name in names)
            self._component_prefixes[slot] = prefixes
        texts = None if join is None else join(prefixes, pages)
        if texts is None or len(texts) != len(pages) * len(prefixes):  # declined (or malformed)
            for page in pages:
                if not isinstance(page, PageHash):
                    raise DoubleRenderError(f"page_hash is not a PageHash: {page!r}")
            hexes = [page.digest.hex() for page in pages]
            texts = [prefix + hex_ for hex_ in hexes for prefix in prefixes]
        return RenderedKeys(texts)


@attrs.frozen
class RenderedKeys:
    """A batch of store keys as text, made only by :meth:`KeySpace.rendered` or from StoreKeys'
    texts (so, like a :class:`StoreKey`, never a string from elsewhere). ``texts`` is page-major."""

    texts: list[str]

    def __len__(self) -> int:
        return len(self.texts)

    def __getitem__(self, part: slice) -> RenderedKeys:
        """A run of the batch (slices only: a single key is a :class:`StoreKey`'s job)."""
        if not isinstance(part, slice):
            raise MisuseError(f"RenderedKeys takes a slice, got {part!r}")
        return RenderedKeys(self.texts[part])

    def select(self, positions: Iterable[int]) -> RenderedKeys:
        """The keys at ``positions``, in that order."""
        texts = self.texts
        return RenderedKeys([texts[i] for i in positions])

    @staticmethod
    def join(batches: Iterable[RenderedKeys]) -> RenderedKeys:
        """One batch of every key of ``batches``, in order (several pools asked in one call)."""
        texts: list[str] = []
        for batch in batches:
            if not isinstance(batch, RenderedKeys):
                raise MisuseError(f"RenderedKeys.join takes RenderedKeys, got {batch!r}")
            texts += batch.texts
        return RenderedKeys(texts)
