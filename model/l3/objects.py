"""What L3 holds for the cache model: the store objects of a page and of a trailing state, and the
leading pages L3 can serve (SPEC §4, §5).

Invariants upheld here alone: every store key of the cache is rendered by the key space, once per
object (never re-prefixed: I1, the double tag), and an L3 hit counts a page only when the objects of
every pool are present, cut back to a usable prefix (I6, :func:`~kvstrata.model.hybrid.hybrid_exists`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvstrata.model.hybrid import hybrid_exists, side_components, side_page_keys
from kvstrata.model.keys import Namespace, PageHash, StoreKey
from kvstrata.model.store import StoreModel

if TYPE_CHECKING:
    from kvstrata.model.cache.config import CacheConfig

__all__ = ["Objects", "l3_hit", "page_objects", "state_objects"]

Objects = tuple[tuple[str, StoreKey], ...]  # (component, key) of each store object


def page_objects(config: CacheConfig, namespace: Namespace, page: PageHash) -> Objects:
    """(component, key) of every store object of one page: the KV components, then every
    ``ALL_PAGES`` side pool's (:func:`~kvstrata.model.hybrid.side_components`: one per component
    under schema 1, the one ``page`` object under schema 2), each key rendered once by the key
    space."""
    keys = config.keys
    assert keys is not None
    out = tuple(zip(keys.components, keys.page_keys(namespace, page), strict=True))
    for pool in config.all_pages_pools:
        components = side_components(keys, pool)
        out += tuple(zip(components, side_page_keys(keys, namespace, pool, page), strict=True))
    return out


def state_objects(config: CacheConfig, namespace: Namespace, page: PageHash) -> Objects:
    """(component, key) of every store object of the state at the end of ``page``'s prefix:
    every object of every ``TRAILING_PAGES`` pool (as in :func:`page_objects`), keyed by that
    (last) page's hash."""
    keys = config.keys
    assert keys is not None
    out: Objects = ()
    for pool in config.trailing_pools:
        components = side_components(keys, pool)
        out += tuple(zip(components, side_page_keys(keys, namespace, pool, page), strict=True))
    return out


def l3_hit(
    config: CacheConfig, store: StoreModel, namespace: Namespace, pages: Sequence[PageHash]
) -> int:
    """Leading pages of ``pages`` L3 can serve in every pool (SPEC §5; the KV hit without side
    pools)."""
    keys = config.keys
    assert keys is not None
    if not config.side_pools:
        return store.exists_pages(keys.page_keys(namespace, page) for page in pages)
    return hybrid_exists(store, keys, namespace, pages, config.side_pools)
