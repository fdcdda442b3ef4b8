"""Hybrid-model side pools and their hit policies (SPEC §5). Pure functions over injected probes.

Theory of operation
-------------------
The KV pool is the *anchor*: it owns page indices and token accounting, and its L3 hit
``kv_hit`` is the number of consecutive pages, from the first, whose KV objects all exist. A
hybrid model adds *side pools*, each with a hit policy that says which prefixes of ``n`` pages it
can serve:

``ALL_PAGES`` (sparse-attention indexer keys)
    one object per KV page; ``n`` is usable iff the pool's objects for pages ``0 .. n-1`` all
    exist.
``TRAILING_PAGES`` (Mamba / linear-attention state)
    one state per node end, keyed by the last page hash of that prefix; ``n`` is usable iff
    ``n == 0`` or the state for the prefix ending at page ``n - 1`` exists (earlier pages need
    nothing).

The usable prefix is the largest ``n <= kv_hit`` usable in *every* pool (I6). A pool is queried
through a *probe* ``probe(i) -> bool`` ("do this pool's objects for page ``i`` exist?"),
injected so that the same policy code serves the model, the implementation and the tests; a
probe is never called with ``i >= kv_hit`` (SPEC §5: side pools are never queried beyond the KV
hit).

Design rationale: why not the minimum of independently computed boundaries
    Computing each pool's boundary against ``kv_hit`` on its own and taking the minimum is wrong
    as soon as a ``TRAILING_PAGES`` pool meets a pool that cuts deeper: with ``kv_hit == 5``, an
    indexer present on pages 0-1 only (boundary 2) and a Mamba state only at page 4 (boundary 5),
    the minimum is 2, but no state ends at page 1, so 2 is not usable in the Mamba pool (an I6
    violation). The usable set of a ``TRAILING_PAGES`` pool is not downward closed, so its
    boundary must be taken *under the cap the other pools impose*. :func:`usable_prefix` applies
    the ``ALL_PAGES`` pools first (their usable sets are downward closed, so their boundaries
    commute with any cap), then lowers the cap through the ``TRAILING_PAGES`` pools until none
    lowers it further. The result is still the minimum over pools of each pool's policy boundary,
    each boundary taken with ``kv_hit`` replaced by that cap; every (pool, page) pair is probed at
    most once.

:func:`hybrid_exists` runs this against a :class:`~kvstrata.model.store.StoreModel`, rendering
every key through the :class:`~kvstrata.model.keys.KeySpace` (never by string concatenation,
I1); an object still being written is invisible to the store and so never counts (I2).
:func:`check_usable` raises ``InvariantViolation("I6", ...)`` for a prefix some pool cannot
serve.

:class:`~kvstrata.model.cache.CacheModel` carries side pools on every tier (``CacheConfig.side_pools``):
its L3 ``exists`` and prefetch go through :func:`hybrid_exists`, its backups render side keys through
:func:`side_page_keys`, and :func:`check_side_pools` validates its configuration.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Callable, Hashable, Iterable, Sequence

import attrs

from kvstrata.model.errors import InvariantViolation, MisuseError
from kvstrata.model.keys import (
    PAGE_COMPONENT,
    KeySpace,
    Namespace,
    PageHash,
    RenderedKeys,
    StoreKey,
)
from kvstrata.model.store import StoreModel

__all__ = [
    "KV_POOL",
    "HitPolicy",
    "Probe",
    "SidePool",
    "check_side_pools",
    "check_usable",
    "hybrid_exists",
    "is_usable",
    "pool_boundary",
    "pool_segment",
    "side_components",
    "side_page_keys",
    "side_rendered",
    "state_content",
    "state_page",
    "usable_prefix",
]

#: The name of the anchor pool (the KV pages) in store keys.
KV_POOL = "kv"

#: ``probe(i)``: whether a pool's object(s) for page ``i`` (0-based) exist.
Probe = Callable[[int], bool]

_NAME_RE = re.compile(r"[a-z][a-z0-9_]*\Z")
_LAYOUT_RE = re.compile(r"[0-9a-z]{1,32}\Z")


class HitPolicy(enum.Enum):
    """Which prefixes a side pool can serve (SPEC §5)."""

    ALL_PAGES = "all_pages"  # every page of the prefix needs the pool's object
    TRAILING_PAGES = "trailing_pages"  # only the prefix's last page needs the pool's state


def _check_pool_name(_instance: object, _attribute: object, value: str) -> None:
    if not isinstance(value, str) or not _NAME_RE.match(value):
        raise MisuseError(f"a side pool name must match [a-z][a-z0-9_]*, got {value!r}")
    if value == KV_POOL:
        raise MisuseError(f"{KV_POOL!r} is the anchor pool, not a side pool")


def _check_components(_instance: object, _attribute: object, value: tuple[str, ...]) -> None:
    if not value:
        raise MisuseError("a side pool needs at least one component")
    for component in value:
        if not isinstance(component, str) or not _NAME_RE.match(component):
            raise MisuseError(f"a component name must match [a-z][a-z0-9_]*, got {component!r}")
    if len(set(value)) != len(value):
        raise MisuseError(f"component names must be distinct, got {value!r}")


def pool_segment(name: str, layout: str = "") -> str:
    """A pool's segment in store keys: ``name``, or ``name.layout`` when its entries carry a layout
    token (:attr:`SidePool.layout`), so two layouts of one pool name never share a key. ``name``
    matches ``[a-z][a-z0-9_]*``, ``layout`` is empty or 1-32 of ``[0-9a-z]`` (:class:`MisuseError`
    otherwise)."""
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise MisuseError(f"a pool name must match [a-z][a-z0-9_]*, got {name!r}")
    _check_layout(None, None, layout)
    return f"{name}.{layout}" if layout else name


def _check_layout(_instance: object, _attribute: object, value: str) -> None:
    if not isinstance(value, str) or (value and not _LAYOUT_RE.match(value)):
        raise MisuseError(f"a pool layout is empty or 1-32 of [0-9a-z], got {value!r}")


def _to_components(value: Iterable[str]) -> tuple[str, ...]:
    if isinstance(value, str):
        raise MisuseError(f"components is a sequence of names, got the string {value!r}")
    return tuple(value)


@attrs.frozen
class SidePool:
    """One side pool of a hybrid model: its name in store keys, hit policy and components.

    Invariants: ``name`` and every component match ``[a-z][a-z0-9_]*``; ``name`` is not the
    anchor pool ``"kv"``; ``components`` is non-empty and has no repeats; ``layout`` is empty or
    1-32 of ``[0-9a-z]``. A page of the pool exists only if *all* the store objects of its entry
    exist (:func:`side_components`: one per component under key schema 1, the one ``page`` object
    under schema 2).

    ``layout`` names how an entry's bytes are laid out (each component's dtype and shape, in
    order): the model identity fixes the KV pool's layout, but not a side pool's (an engine may
    keep a Mamba state's SSM buffer in float32, bfloat16 or float16 for the same model). It is
    part of the pool's key segment (:attr:`segment`), so two pools of one name whose entries are
    laid out differently never read each other's objects, even when the entries have the same
    size. The model treats it as an opaque token; the implementation derives it from the pool's
    shapes and dtypes (``kvstrata.impl.pools.side.side_layout``).
    """

    name: str = attrs.field(validator=_check_pool_name)
    policy: HitPolicy = attrs.field(validator=attrs.validators.instance_of(HitPolicy))
    components: tuple[str, ...] = attrs.field(converter=_to_components, validator=_check_components)
    layout: str = attrs.field(default="", kw_only=True, validator=_check_layout)

    @property
    def segment(self) -> str:
        """The pool's segment in store keys: ``name``, or ``name.layout`` (:func:`pool_segment`;
        both fields were checked when the pool was made, so nothing is checked again here: this
        runs once per page on the store paths)."""
        return f"{self.name}.{self.layout}" if self.layout else self.name


def _check_count(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise MisuseError(f"{name} must be an int >= 0, got {value!r}")


def pool_boundary(policy: HitPolicy, probe: Probe, kv_hit: int) -> int:
    """The longest prefix ``n <= kv_hit`` that one pool of ``policy`` can serve.

    ``ALL_PAGES``: the number of consecutive pages from 0 (capped at ``kv_hit``) whose objects
    exist; probes ``0, 1, ...`` and stops at the first miss. ``TRAILING_PAGES``: the largest
    ``n <= kv_hit`` with ``n == 0`` or a state for the prefix ending at page ``n - 1``; probes
    ``kv_hit - 1`` downwards and stops at the first hit. ``probe`` is only ever called with
    ``0 <= i < kv_hit``, each ``i`` at most once.
    """
    _check_count("kv_hit", kv_hit)
    if policy is HitPolicy.ALL_PAGES:
        count = 0
        while count < kv_hit and probe(count):
            count += 1
        return count
    if policy is HitPolicy.TRAILING_PAGES:
        for last in range(kv_hit - 1, -1, -1):
            if probe(last):
                return last + 1
        return 0
    raise MisuseError(f"policy must be a HitPolicy, got {policy!r}")


def is_usable(policy: HitPolicy, probe: Probe, prefix: int) -> bool:
    """Whether a pool of ``policy`` can serve the first ``prefix`` pages (what I6 checks).

    Probes only pages ``< prefix``.
    """
    _check_count("prefix", prefix)
    if policy is HitPolicy.ALL_PAGES:
        return all(probe(index) for index in range(prefix))
    if policy is HitPolicy.TRAILING_PAGES:
        return prefix == 0 or probe(prefix - 1)
    raise MisuseError(f"policy must be a HitPolicy, got {policy!r}")


def usable_prefix(kv_hit: int, pools_and_probes: Iterable[tuple[HitPolicy, Probe]]) -> int:
    """The largest prefix ``n <= kv_hit`` usable in every pool (I6); ``kv_hit`` when there are none.

    Equals the minimum over pools of :func:`pool_boundary`, each taken under the cap set by the
    others (see the module's design rationale). Returns 0 at once, probing nothing, when
    ``kv_hit == 0``, and stops as soon as the cap reaches 0. Never probes a page ``>= kv_hit``;
    probes each (pool, page) at most once.
    """
    _check_count("kv_hit", kv_hit)
    pools = list(pools_and_probes)
    for policy, _probe in pools:
        if not isinstance(policy, HitPolicy):
            raise MisuseError(f"policy must be a HitPolicy, got {policy!r}")
    cap = kv_hit
    # ALL_PAGES first: their usable sets are downward closed, so one pass under a shrinking cap
    # is exact.
    for policy, probe in pools:
        if cap == 0:
            return 0
        if policy is HitPolicy.ALL_PAGES:
            cap = pool_boundary(policy, probe, cap)
    trailing = [probe for policy, probe in pools if policy is HitPolicy.TRAILING_PAGES]
    # Then lower the cap through the TRAILING_PAGES pools to a common fixpoint. ``served[j]`` is
    # the last boundary pool j returned (a prefix it can serve); it is asked again only under a
    # lower cap, so it only ever probes pages below the ones it probed before.
    served: list[int | None] = [None] * len(trailing)
    changed = True
    while changed and cap > 0:
        changed = False
        for index, probe in enumerate(trailing):
            if served[index] == cap:
                continue
            boundary = pool_boundary(HitPolicy.TRAILING_PAGES, probe, cap)
            served[index] = boundary
            if boundary < cap:
                cap = boundary
                changed = True
                if cap == 0:
                    return 0
    return cap


def side_components(keys: KeySpace, pool: SidePool) -> tuple[str, ...]:
    """The store objects one entry of ``pool`` is under ``keys``' schema version.

    Schema 1: one object per component of the pool (``pool.components``, in order). Schema 2 (one
    object per page, issue 20): the single object ``page`` (:data:`~kvstrata.model.keys.PAGE_COMPONENT`)
    holding every component's bytes of the entry, concatenated in ``pool.components`` order. A
    one-component pool holds the same bytes under either version; only its key differs.
    """
    if keys.schema == 1:
        return pool.components
    return (PAGE_COMPONENT,)


def side_page_keys(
    keys: KeySpace, namespace: Namespace, pool: SidePool, page_hash: PageHash
) -> tuple[StoreKey, ...]:
    """The store keys of every object of ``pool``'s entry for one page (:func:`side_components`
    of the key space's schema, in that order), rendered by ``keys`` under the pool's key segment
    (:attr:`SidePool.segment`: its name, and its layout when it has one).

    For a ``TRAILING_PAGES`` pool, ``page_hash`` is the hash of the last page of the prefix the
    state belongs to.
    """
    return keys.component_keys(namespace, pool.segment, side_components(keys, pool), page_hash)


def side_rendered(
    keys: KeySpace, namespace: Namespace, pool: SidePool, pages: Sequence[PageHash]
) -> RenderedKeys:
    """:func:`side_page_keys` of every page of ``pages``, page-major, as one batch of text (what a
    store call on many entries sends; issue 20: no object per key)."""
    return keys.rendered(namespace, pages, pool.segment, side_components(keys, pool))


def check_side_pools(side_pools: Sequence[SidePool]) -> None:
    """Raise :class:`MisuseError` unless ``side_pools`` are :class:`SidePool` values with distinct
    names (what every function taking a set of side pools, and ``CacheConfig``, accepts)."""
    for pool in side_pools:
        if not isinstance(pool, SidePool):
            raise MisuseError(f"side pools are SidePool values, got {type(pool).__name__}")
    names = [pool.name for pool in side_pools]
    if len(set(names)) != len(names):
        raise MisuseError(f"side pool names must be distinct, got {names!r}")


def _store_probe(
    store: StoreModel,
    keys: KeySpace,
    namespace: Namespace,
    page_hashes: Sequence[PageHash],
    pool: SidePool,
) -> Probe:
    def probe(index: int) -> bool:
        page_keys = side_page_keys(keys, namespace, pool, page_hashes[index])
        return all(store.contains(key) for key in page_keys)

    return probe


def hybrid_exists(
    store: StoreModel,
    keys: KeySpace,
    namespace: Namespace,
    page_hashes: Sequence[PageHash],
    side_pools: Sequence[SidePool],
) -> int:
    """How many pages of ``page_hashes``, from the first, L3 can serve in every pool (SPEC §5, I6).

    The KV hit is :meth:`StoreModel.exists_pages` over the anchor pool's component keys
    (:meth:`KeySpace.page_keys`), rendered page by page only as far as the first miss. Side pools
    are then probed through :func:`side_page_keys` (each probed entry's keys rendered once per
    probe by :meth:`KeySpace.component_keys`, never concatenated) and never beyond the KV hit.
    Objects still being written are invisible (I2).
    """
    check_side_pools(side_pools)
    kv_hit = store.exists_pages(
        keys.page_keys(namespace, page_hash, KV_POOL) for page_hash in page_hashes
    )
    if kv_hit == 0 or not side_pools:
        return kv_hit
    return usable_prefix(
        kv_hit,
        [
            (pool.policy, _store_probe(store, keys, namespace, page_hashes, pool))
            for pool in side_pools
        ],
    )


def check_usable(
    store: StoreModel,
    keys: KeySpace,
    namespace: Namespace,
    page_hashes: Sequence[PageHash],
    side_pools: Sequence[SidePool],
    *,
    prefix: int,
) -> None:
    """Raise ``InvariantViolation("I6", ...)`` unless the first ``prefix`` pages are usable in
    every pool: every KV component visible for pages ``< prefix``, and each side pool usable under
    its policy.
    """
    check_side_pools(side_pools)
    _check_count("prefix", prefix)
    if prefix > len(page_hashes):
        raise InvariantViolation(
            "I6", f"reported prefix {prefix} is longer than the {len(page_hashes)} pages asked"
        )
    kv_pages = store.exists_pages(
        keys.page_keys(namespace, page_hash, KV_POOL) for page_hash in page_hashes[:prefix]
    )
    if kv_pages < prefix:
        raise InvariantViolation(
            "I6", f"reported prefix {prefix} but KV page {kv_pages} is not in the store"
        )
    for pool in side_pools:
        probe = _store_probe(store, keys, namespace, page_hashes, pool)
        if not is_usable(pool.policy, probe, prefix):
            raise InvariantViolation(
                "I6",
                f"reported prefix {prefix} is not usable in side pool {pool.name!r} "
                f"({pool.policy.name})",
            )


def state_content(page: PageHash) -> Hashable:
    """The bytes of the trailing state at the end of ``page``'s prefix, as an identity."""
    return ("state", page)


def state_page(content: Hashable) -> PageHash:
    """The page a state identity names (what a copy of the state would be keyed by)."""
    assert isinstance(content, tuple) and content[0] == "state"
    page = content[1]
    assert isinstance(page, PageHash)
    return page
