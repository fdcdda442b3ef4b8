"""What the L3 tier may do to the tree: the whole of it (SPEC §3, §5; issue 15).

L3 never imports the cache. It holds a :class:`TreePort`, which the cache implements
(:class:`kvstrata.impl.cache.port.CachePort`), and reads only the value fields of the nodes the cache
hands it (``hashes``, ``host``, ``num_pages``, ``is_root``, ``last_hash``) plus the two pin counts it
owns: ``Node.backup_pins`` (host pages a backup reads: never evicted or reused, I5) and
``StateInfo.host_pins`` (the same for an L2 state slot). Tree shape and residency change only behind
the port, which advances them through the model's tables.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import numpy as np
import numpy.typing as npt

from kvstrata.model.keys import Namespace

if TYPE_CHECKING:
    from kvstrata.impl.cache.node import Node, StateInfo

__all__ = ["Pages", "TreePort"]

Pages = npt.NDArray[np.int64]


class TreePort(Protocol):
    @property
    def page_size(self) -> int: ...

    @property
    def has_states(self) -> bool:
        """Whether the tree keeps trailing states (a ``TRAILING_PAGES`` side pool)."""

    @property
    def host_capacity(self) -> int:
        """L2 pages in all (the prefetch reservation limit is a fraction of it)."""

    def new_op(self) -> int:
        """A fresh op id from the cache's counter (ops of every kind share it)."""

    def lock(self, node: Node, delta: int) -> None:
        """Add ``delta`` to ``node``'s path lock (a prefetch's anchor)."""

    def continuation(
        self, query: npt.NDArray[np.uint32], namespace: Namespace
    ) -> tuple[Node, int] | None:
        """The node a prefetch of ``query`` attaches at (a root or host-claimed; the node the
        match ends inside is split) and the pages matched; ``None`` if L3 pages cannot join there."""

    def chain_after(
        self, anchor: Node, query: npt.NDArray[np.uint32], matched: int, namespace: Namespace
    ) -> Callable[[], bytes]:
        """The hash chain of ``query``'s whole pages after ``matched``, as a function the store
        worker runs (nothing is copied or hashed for a prefetch that is not started)."""

    def reserve_host(self, pages: int, *, state: bool) -> tuple[Pages, int | None] | None:
        """``pages`` L2 pages and (``state``) one L2 state slot, all or nothing."""

    def free_host(self, pages: Pages) -> None:
        """Give back reserved L2 pages the tree did not take."""

    def free_host_state(self, slot: int) -> None:
        """Give back a reserved L2 state slot the tree did not take."""

    def host_state(self, node: Node) -> StateInfo:
        """The state at ``node``'s end (it has an L2 copy: a backup reads it)."""

    def commit_pages(
        self,
        tokens: npt.NDArray[np.uint32],
        namespace: Namespace,
        prefix_pages: int,
        host: Pages,
        digests: bytes,
    ) -> tuple[int, Node | None]:
        """Prefetched pages ``prefix_pages ..`` of ``tokens`` (in L2 ``host``, hashes ``digests``)
        join the tree as host-only nodes where they are missing and may hang (I3); the rest of
        ``host`` is freed. The pages added and the node the range ends at (``None``: not in the
        tree, or nothing arrived)."""

    def host_nodes(self) -> list[Node]:
        """Every node with a valid L2 copy of all its pages and their hashes (to re-publish)."""

    def commit_state(self, end: Node | None, slot: int) -> None:
        """A prefetched state in L2 ``slot`` becomes the L2 state at ``end``'s end, or is freed."""
