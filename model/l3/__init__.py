"""The L3 side of the cache model (SPEC §3, §4): the store objects of a page and of a state
(:mod:`.objects`), the L2 -> L3 backup queue (:mod:`.backup`) and the L3 -> L2 prefetch ops and
their wait policies (:mod:`.prefetch`, :mod:`.policy`). The pieces are built and wired by
:class:`kvstrata.model.cache.CacheModel`.
"""

from __future__ import annotations
