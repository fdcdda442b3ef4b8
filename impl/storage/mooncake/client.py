"""A Mooncake store client that cannot crash the process: :class:`MooncakeClient`.

The native ``MooncakeDistributedStore`` segfaults when most methods are called before a successful
``setup()`` or after ``close()``, blocks about 90 s in ``setup()`` against a dead master, and writes
wherever a pointer points. This wrapper makes those impossible:

- **State** (:class:`ClientState`, advanced only through :data:`TRANSITIONS`, :mod:`.states`): ``NEW``
  → ``READY`` on a successful setup, → ``FAILED`` on a failed one (a later :meth:`setup` may retry
  with a fresh native object), → ``CLOSED`` on :meth:`close` (idempotent, final).
  The native object exists only while ``READY``; every other method raises
  :class:`~kvstrata.impl.errors.StoreUnavailable` in any other state, so no native call is ever
  made before setup or after close.
- **Bounded setup**: the master's TCP port is probed first (``probe_timeout``) and a refused probe
  raises at once, naming the address; ``MC_STORE_CLIENT_SETUP_RETRIES`` (``setup_retries``, never 0)
  bounds the native setup to about 4.4 s per retry when something answers the port but no master does.
  ``MC_LOG_LEVEL`` defaults to ``ERROR`` (it is read when the native module is first imported, so
  this module imports ``mooncake.store`` lazily, after setting it), and the native client's glog
  lines are kept off stderr (:mod:`.native_log`; ``KVSTRATA_DEBUG=1`` keeps them).
- **Memory safety**: every pointer range handed to a batch call must lie inside a buffer registered
  through this client; keys must be :class:`~kvstrata.model.keys.StoreKey` values (made only by the
  key schema).
- **A gate** around every native call: data calls (``batch_*``, ``health``) run side by side (the
  cache's query, read, write and probe lanes share one client, as sglang's prefetch and backup threads
  share one native store; the GIL is released inside the calls), while setup, close and buffer
  (un)registration run alone, after every running data call returned: a slow call against a dead
  master never turns into a call on a closed native object.

Batch calls return the native per-key ints unchanged (``>= 0`` success, negative ``ErrorCode``,
:mod:`.codes`), one per key: a native exception or a malformed answer becomes ``-1`` for every key
and is logged. Only setup and buffer registration raise typed errors. A batch get that names a key
twice is made in rounds of distinct keys (:mod:`.rounds`: the native call fills only the last
buffer of a repeated key).
"""

from __future__ import annotations

import bisect
import logging
import operator
from collections.abc import Callable, Sequence
from itertools import chain
from types import TracebackType
from typing import Any, Final, TypeVar

from kvstrata.impl.errors import MisuseError, StoreUnavailable
from kvstrata.impl.storage.mooncake.codes import INTERNAL_ERROR, describe, error_for, native_codes
from kvstrata.impl.storage.mooncake.config import MooncakeConfig
from kvstrata.impl.storage.mooncake.connect import (
    Gate,
    native_store_class,
    prepare_environment,
    probe_master,
)
from kvstrata.impl.storage.mooncake.rounds import in_rounds
from kvstrata.impl.storage.mooncake.states import (
    TRANSITIONS,
    ClientEvent,
    ClientHealth,
    ClientState,
)
from kvstrata.model.keys import RenderedKeys, StoreKey

__all__ = [
    "ClientEvent",
    "ClientHealth",
    "ClientState",
    "MooncakeClient",
    "TRANSITIONS",
    "probe_master",
]

log = logging.getLogger("kvstrata.storage.mooncake")

Keys = Sequence[StoreKey] | RenderedKeys
"""A batch's keys: :class:`StoreKey` values or one rendered batch (:meth:`KeySpace.rendered`)."""
Parts = Sequence[Sequence[int]]
"""Per object, its registered ranges' pointers (or sizes), in order."""
T = TypeVar("T")


def _check_int(value: object, what: str, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise MisuseError(f"{what}: expected an int >= {low}, got {value!r}")
    return value


class MooncakeClient:
    """One connection to a Mooncake cluster (see the module docstring for the guarantees).

    ``MooncakeClient(config)`` only records the configuration; :meth:`setup` (or ``with``) connects.
    """

    def __init__(self, config: MooncakeConfig) -> None:
        if not isinstance(config, MooncakeConfig):
            raise MisuseError(f"MooncakeClient takes a MooncakeConfig, got {config!r}")
        self.config: Final = config
        self._state = ClientState.NEW
        self._native: Any = None
        self._hostname: str | None = None
        self._gate = Gate()
        self._starts: list[int] = []  # sorted starts of registered buffers
        self._sizes: dict[int, int] = {}  # start -> size
        self._refs: dict[int, int] = {}  # start -> registrations of exactly that range
        self._released: list[int] = []  # unregistrations deferred to the next call (GC-safe)

    # ----------------------------------------------------------------------------- lifecycle
    @property
    def state(self) -> ClientState:
        return self._state

    @property
    def hostname(self) -> str | None:
        """This client's segment name (``host:port``) once set up."""
        return self._hostname

    @property
    def native_store(self) -> Any:
        """The native ``MooncakeDistributedStore`` this client calls once set up (``None`` before
        and after close): for calls kvstrata does not wrap, and for benchmarks that time the raw
        API on the same connection. A call made on it bypasses this client: no gate against a
        concurrent close, no argument checks, no error classification."""
        return self._native

    def _advance(self, event: ClientEvent) -> None:
        target = TRANSITIONS.get((self._state, event))
        if target is None:  # pragma: no cover - every caller checks first
            raise MisuseError(f"mooncake client: {event.value} is not allowed in {self._state}")
        self._state = target

    def setup(self) -> MooncakeClient:
        """Connect; :class:`StoreUnavailable` (state ``FAILED``) when the master is unreachable or
        the native setup fails. Returns ``self``."""
        with self._gate.exclusive():
            if self._state is ClientState.CLOSED:
                raise StoreUnavailable("mooncake client: setup() after close()")
            if self._state is ClientState.READY:
                raise MisuseError("mooncake client: setup() called twice")
            try:
                self._native, self._hostname = self._connect()
            except StoreUnavailable:
                self._advance(ClientEvent.SETUP_FAILED)
                raise
            self._advance(ClientEvent.SETUP_OK)
            log.debug("mooncake client %s connected to %s", self._hostname, self.config.master)
            return self

    def _connect(self) -> tuple[Any, str]:
        config = self.config
        probe_master(config)
        prepare_environment(config)
        native = native_store_class()()
        try:
            rc = native.setup(
                config.local_hostname,
                config.metadata_server,
                config.global_segment_size,
                config.local_buffer_size,
                config.protocol,
                config.device_name,
                config.master,
            )
        except Exception as error:  # a native exception is a failed setup, never a crash
            log.warning("mooncake setup raised %r", error)
            rc = INTERNAL_ERROR
        if rc != 0:
            raise StoreUnavailable(
                f"mooncake setup against master {config.master} failed with {describe(rc)} "
                f"after {config.setup_retries} attempt(s) (protocol {config.protocol}, metadata "
                f"{config.metadata_server})"
            )
        try:
            hostname = str(native.get_hostname())
        except Exception:  # pragma: no cover - informational only
            hostname = f"{config.local_hostname}:?"
        return native, hostname

    def close(self) -> None:
        """Close the connection (0.2-2 s: it unmounts this client's segment, whose objects vanish
        from the store). Idempotent; the client is ``CLOSED`` afterwards whatever happened."""
        with self._gate.exclusive():
            native, self._native = self._native, None
            self._advance(ClientEvent.CLOSE)
            self._starts.clear()
            self._sizes.clear()
            self._refs.clear()
            self._released.clear()
            if native is not None:
                try:
                    native.close()
                except Exception as error:  # pragma: no cover - defensive
                    log.warning("mooncake close raised %r", error)

    def __enter__(self) -> MooncakeClient:
        if self._state is not ClientState.READY:
            self.setup()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"MooncakeClient({self.config.master}, {self._state.value}, {self._hostname})"

    # ------------------------------------------------------------------------------ plumbing
    def _call(
        self,
        what: str,
        call: Callable[[Any], T],
        check: Callable[[], None] | None = None,
        *,
        exclusive: bool = False,
    ) -> T:
        """Run ``check()`` then ``call(native)`` through the gate (alone when ``exclusive``), only
        when ``READY``."""
        if self._released:
            with self._gate.exclusive():
                if self._state is ClientState.READY and self._native is not None:
                    while self._released:
                        self._drop_reference(self._native, self._released.pop())
        with self._gate.exclusive() if exclusive else self._gate.shared():
            if self._state is not ClientState.READY or self._native is None:
                raise StoreUnavailable(f"mooncake client: {what} while {self._state.value}")
            if check is not None:
                check()
            return call(self._native)

    def _batch(self, what: str, count: int, call: Callable[[Any], object]) -> list[int]:
        return self._call(what, lambda native: native_codes(what, count, call, native))

    @staticmethod
    def _texts(keys: Sequence[StoreKey] | RenderedKeys, what: str) -> list[str]:
        if isinstance(keys, RenderedKeys):  # a batch KeySpace rendered: no per-key objects
            return keys.texts
        texts = []
        for key in keys:
            if not isinstance(key, StoreKey):
                raise MisuseError(f"{what}: keys must be StoreKey values, got {key!r}")
            texts.append(key.text)
        return texts

    def _check_ranges(self, ptrs: Sequence[int], sizes: Sequence[int], what: str) -> None:
        """:class:`MisuseError` unless every ``[ptr, ptr + size)`` lies in one registered buffer
        (called through the gate: registrations change only while no data call runs). Fast path:
        plain positive ints spanning ``[lowest, highest end)`` inside one buffer (buffers never
        overlap, so every range lies in it); anything else is checked range by range."""
        if ptrs and len(ptrs) == len(sizes) and {*map(type, ptrs), *map(type, sizes)} == {int}:
            low, high = min(ptrs), max(map(operator.add, ptrs, sizes))
            slot = bisect.bisect_right(self._starts, low) - 1
            end = self._starts[slot] + self._sizes[self._starts[slot]] if slot >= 0 else 0
            if min(low, *sizes) >= 1 and high <= end:
                return
        for ptr, size in zip(ptrs, sizes, strict=True):
            _check_int(ptr, f"{what}: pointer", 1)
            _check_int(size, f"{what}: size", 1)
            slot = bisect.bisect_right(self._starts, ptr) - 1
            if slot < 0 or ptr + size > self._starts[slot] + self._sizes[self._starts[slot]]:
                raise MisuseError(
                    f"{what}: [{ptr:#x}, +{size}) is not inside a buffer registered with this client"
                )

    # ------------------------------------------------------------------------------- buffers
    def register_buffer(self, ptr: int, size: int) -> None:
        """Register ``size`` bytes at ``ptr`` for zero-copy transfers. Registering exactly the same
        range again only counts a reference (several backends may share one host pool and one
        client); :class:`MisuseError` for any other overlap; a typed :class:`StoreError` if the store
        refuses."""
        _check_int(ptr, "register_buffer: pointer", 1)
        _check_int(size, "register_buffer: size", 1)

        def register(native: Any) -> None:
            if self._sizes.get(ptr) == size:
                self._refs[ptr] += 1
                return
            slot = bisect.bisect_right(self._starts, ptr)
            before = self._starts[slot - 1] if slot else None
            after = self._starts[slot] if slot < len(self._starts) else None
            if (before is not None and before + self._sizes[before] > ptr) or (
                after is not None and ptr + size > after
            ):
                raise MisuseError(f"register_buffer: [{ptr:#x}, +{size}) overlaps a registration")
            rc = int(native.register_buffer(ptr, size))
            if rc != 0:
                raise error_for(rc, "register_buffer")
            self._starts.insert(slot, ptr)
            self._sizes[ptr] = size
            self._refs[ptr] = 1

        self._call("register_buffer", register, exclusive=True)

    def unregister_buffer(self, ptr: int) -> None:
        """Drop one reference taken by :meth:`register_buffer`; the last one unregisters the range
        (:class:`MisuseError` for a pointer never registered)."""

        def unregister(native: Any) -> None:
            if ptr not in self._sizes:
                raise MisuseError(f"unregister_buffer: {ptr!r} was not registered")
            rc = self._drop_reference(native, ptr)
            if rc != 0:
                raise error_for(rc, "unregister_buffer")

        self._call("unregister_buffer", unregister, exclusive=True)

    def release_buffer_later(self, ptr: int) -> None:
        """:meth:`unregister_buffer` at the start of this client's next call. Safe from a garbage
        collector's finalizer, on any thread and inside another call of this client (it takes no
        lock): the finalizer of a backend that was never closed uses it, so a freed host buffer
        does not stay registered and block a new buffer at the same address."""
        self._released.append(ptr)

    def _drop_reference(self, native: Any, ptr: int) -> int:
        """One reference less on the registration at ``ptr`` (gate held alone); the native
        unregister's code when it was the last one, else 0."""
        if ptr not in self._refs:
            return 0
        self._refs[ptr] -= 1
        if self._refs[ptr]:
            return 0
        self._starts.remove(ptr)
        del self._sizes[ptr], self._refs[ptr]
        try:
            return int(native.unregister_buffer(ptr))
        except Exception as error:  # pragma: no cover - defensive
            log.warning("mooncake unregister_buffer raised %r", error)
            return INTERNAL_ERROR

    # ------------------------------------------------------------------------------- batches
    def batch_is_exist(self, keys: Sequence[StoreKey] | RenderedKeys) -> list[int]:
        """Per key: 1 exists (complete), 0 not, negative error. Each hit grants a read lease."""
        texts = self._texts(keys, "batch_is_exist")
        if not texts:
            return []
        return self._batch("batch_is_exist", len(texts), lambda n: n.batch_is_exist(texts))

    def is_exist(self, key: StoreKey) -> int:
        """One key: 1 exists, 0 not, negative error. Against a dead master it answers -900 in
        well under a millisecond, where ``batch_is_exist`` takes about 4.3 s (MOONCAKE.md §5.3):
        the store link's probes use it."""
        (text,) = self._texts([key], "is_exist")

        def call(native: Any) -> int:
            try:
                return int(native.is_exist(text))
            except Exception as error:
                log.error("mooncake is_exist raised %r", error)
                return INTERNAL_ERROR

        return self._call("is_exist", call)

    def batch_put_from(
        self, keys: Sequence[StoreKey] | RenderedKeys, ptrs: Sequence[int], sizes: Sequence[int]
    ) -> list[int]:
        """Per key: 0 stored (or already existing: the first bytes stay), negative error."""
        texts = self._texts(keys, "batch_put_from")
        if len(ptrs) != len(texts) or len(sizes) != len(texts):
            raise MisuseError("batch_put_from: keys, pointers and sizes differ in length")
        return self._moves("batch_put_from", texts, list(ptrs), list(sizes), flat=True)

    def batch_get_into(
        self, keys: Sequence[StoreKey] | RenderedKeys, ptrs: Sequence[int], sizes: Sequence[int]
    ) -> list[int]:
        """Per key: bytes read (``> 0``), or negative (-704 missing, -600 slot too small, ...)."""
        texts = self._texts(keys, "batch_get_into")
        if len(ptrs) != len(texts) or len(sizes) != len(texts):
            raise MisuseError("batch_get_into: keys, pointers and sizes differ in length")
        return self._moves("batch_get_into", texts, list(ptrs), list(sizes), flat=True)

    def batch_put_parts(self, keys: Keys, ptrs: Parts, sizes: Parts) -> list[int]:
        """:meth:`batch_put_from` of objects each made of several registered ranges, in order
        (object ``i`` is ``sizes[i][j]`` bytes at ``ptrs[i][j]`` for every ``j``): the native
        ``batch_put_from_multi_buffers``. Per key as :meth:`batch_put_from`."""
        return self._parts("batch_put_from_multi_buffers", keys, ptrs, sizes)

    def batch_get_parts(self, keys: Keys, ptrs: Parts, sizes: Parts) -> list[int]:
        """:meth:`batch_get_into` scattering each object over several registered ranges, in order
        (the native ``batch_get_into_multi_buffers``). Per key: the bytes read in all, or negative."""
        return self._parts("batch_get_into_multi_buffers", keys, ptrs, sizes)

    def _parts(self, what: str, keys: Keys, ptrs: Parts, sizes: Parts) -> list[int]:
        texts = self._texts(keys, what)
        ptr_lists, size_lists = [list(p) for p in ptrs], [list(s) for s in sizes]
        shapes = [len(p) for p in ptr_lists]
        if len(ptr_lists) != len(texts) or [len(s) for s in size_lists] != shapes or 0 in shapes:
            raise MisuseError(f"{what}: keys, pointer lists and size lists differ in shape")
        return self._moves(what, texts, ptr_lists, size_lists, flat=False)

    def _moves(
        self, what: str, texts: list[str], ptrs: list[Any], sizes: list[Any], *, flat: bool
    ) -> list[int]:
        """The native batch put or get ``what`` of ``texts`` from or into ``ptrs`` / ``sizes`` (a
        range per key if ``flat``, else a list of ranges per key) in one pass through the gate,
        every range checked before any byte moves; a get naming a key twice in rounds of distinct
        keys (:mod:`.rounds`; a key put twice stores its last buffer's bytes, no wrong code)."""
        if not texts:
            return []
        ranges = (ptrs, sizes) if flat else (list(chain(*ptrs)), list(chain(*sizes)))

        def run(native: Any) -> list[int]:
            def move(names: list[str], at: list[Any], size: list[Any]) -> list[int]:
                call = lambda n: getattr(n, what)(names, at, size)  # noqa: E731
                return native_codes(what, len(names), call, native)

            return (
                move(texts, ptrs, sizes) if "_put_" in what else in_rounds(move, texts, ptrs, sizes)
            )

        return self._call(what, run, lambda: self._check_ranges(*ranges, what))

    def batch_remove(self, keys: Sequence[StoreKey], *, force: bool = False) -> list[int]:
        """Per key: 0 removed, -704 missing, -706 leased (unless ``force``)."""
        texts = self._texts(keys, "batch_remove")
        if not texts:
            return []
        return self._batch("batch_remove", len(texts), lambda n: n.batch_remove(texts, force))

    def remove_all(self, *, force: bool = False) -> int:
        """Remove every object of the cluster (tests, operators); the count removed or a negative
        code. Without ``force`` leased objects are silently kept."""

        def remove(native: Any) -> int:
            try:
                return int(native.remove_all(force))
            except Exception as error:
                log.error("mooncake remove_all raised %r", error)
                return INTERNAL_ERROR

        return self._call("remove_all", remove)

    def health(self) -> ClientHealth:
        """A hint about the connection; never raises."""
        with self._gate.shared():
            if self._state is not ClientState.READY or self._native is None:
                return ClientHealth.NOT_READY
            try:
                rc = int(self._native.health_check())
            except Exception:
                return ClientHealth.UNREACHABLE
        return {0: ClientHealth.HEALTHY, 1: ClientHealth.NOT_READY}.get(
            rc, ClientHealth.UNREACHABLE
        )
