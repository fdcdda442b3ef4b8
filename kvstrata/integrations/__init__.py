"""Engine plug-ins (issue 16): kvstrata behind an engine's own extension points.

- :mod:`kvstrata.integrations.sglang`: ``KvstrataHiCacheStorage``, sglang's L3 storage backend
  (needs sglang; imported only by sglang's loader);
- :mod:`kvstrata.integrations.hicache`, :mod:`.legacy`: what that backend does, without sglang;
- :mod:`kvstrata.integrations.store`: the store options both engines' extra configs share.

Which keys an engine's pages get is decided in :mod:`kvstrata.model.engines`. docs/engines.md has the
flags, the options and the limits.
"""
