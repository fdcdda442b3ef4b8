"""Requests that go on after their insert, for the model machines (the differential machines have
``DifferentialMachine.request_tokens(..., running=True)``)."""

from __future__ import annotations

from hypothesis import event
from hypothesis import strategies as st

from kvstrata.model.cache import CacheModel
from kvstrata.model.keys import Namespace

__all__ = ["keep_running"]


def keep_running(
    data: st.DataObject,
    cache: CacheModel,
    locked: list[int],
    tokens: tuple[int, ...],
    ns: Namespace,
) -> None:
    """A quarter of the requests go on after their insert (a scheduler keeps a decoding request's
    prefix locked): the node their tokens end at stays locked, its id appended to ``locked`` for the
    machine's ``unlock`` rule. Random tokens in a random namespace rarely match a cached node, so
    without this a lock hardly ever met an eviction, a backup or a prefetch."""
    if not data.draw(st.sampled_from([False, False, False, True]), label="keeps running"):
        return
    node = cache.match_prefix(tokens, ns).device_node
    if not cache.tree.nodes[node].is_root:
        cache.lock(node)
        locked.append(node)
        event("a running request keeps its node locked")
