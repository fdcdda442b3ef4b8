"""L3 storage: the backend interface (:mod:`.base`) and its backends (in-memory, file, Mooncake)."""
