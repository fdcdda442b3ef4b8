"""Reaching a Mooncake master before the native client does (issue 17): the RPC handshake that tells a
master from anything else in seconds (:func:`probe_master`), the environment the native library reads,
its first import shielded from Ctrl-C, and :class:`Gate`, the shared/exclusive gate around native calls.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import struct
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Final

from kvstrata.impl.errors import StoreUnavailable
from kvstrata.impl.storage.mooncake.config import MooncakeConfig
from kvstrata.impl.storage.mooncake.native_log import quiet_native_logs

__all__ = ["Gate", "native_store_class", "prepare_environment", "probe_master"]

log = logging.getLogger("kvstrata.storage.mooncake")


#: A coro_rpc request header (Mooncake's RPC framing): magic 0x15, version 0, serialization 0,
#: message type 0, sequence number, function id, body length 0, attachment length 0. A Mooncake
#: master answers an unknown function id at once with a response header that starts with the same
#: magic and echoes the sequence number ("the rpc function not registered"), measured on 0.3.13.post1.
_RPC_MAGIC: Final = 0x15
_HANDSHAKE_SEQ: Final = 0x6B767374  # "kvst"
_HANDSHAKE: Final = struct.pack("<BBBBIIII", _RPC_MAGIC, 0, 0, 0, _HANDSHAKE_SEQ, 0, 0, 0)


def probe_master(config: MooncakeConfig) -> None:
    """:class:`StoreUnavailable` naming the address unless the master's RPC port accepts a TCP
    connection and answers a Mooncake RPC header like a Mooncake master, each within
    ``config.probe_timeout`` seconds: a port nobody listens on, a service that is not a Mooncake
    master and a master that does not answer are told apart in seconds, before the native setup
    (which would retry for a minute and say only ``INTERNAL_ERROR``)."""
    address = config.master
    try:
        connection = socket.create_connection(
            (config.master_host, config.master_port), timeout=config.probe_timeout
        )
    except OSError as error:
        raise StoreUnavailable(
            f"mooncake master {address} is not reachable ({error}); is mooncake_master "
            f"running and is the address right?"
        ) from None
    with connection:
        try:
            connection.sendall(_HANDSHAKE)
            answer = connection.recv(8)
        except TimeoutError:
            raise StoreUnavailable(
                f"{address} accepted a connection but did not answer a Mooncake RPC request "
                f"within {config.probe_timeout:g} s: not a Mooncake master, or one that hangs"
            ) from None
        except OSError as error:
            answer = f"{error}".encode()
    if len(answer) >= 8 and answer[0] == _RPC_MAGIC:
        (sequence,) = struct.unpack_from("<I", answer, 4)
        if sequence == _HANDSHAKE_SEQ:
            return
    shown = answer[:32].decode("ascii", errors="replace") if answer else "nothing (closed)"
    raise StoreUnavailable(
        f"{address} is not a Mooncake master: it answered a Mooncake RPC request with {shown!r}; "
        f"check --master (the master's RPC port, default 50051)"
    )


def prepare_environment(config: MooncakeConfig) -> None:
    # Read by the native library: MC_LOG_LEVEL when mooncake.store is first imported,
    # the retry count at every setup.
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    quiet_native_logs()  # glog lines off stderr (KVSTRATA_DEBUG=1 keeps them)
    retries = str(config.setup_retries)
    if os.environ.get("MC_STORE_CLIENT_SETUP_RETRIES") != retries:
        os.environ["MC_STORE_CLIENT_SETUP_RETRIES"] = retries


@contextmanager
def _interrupt_deferred() -> Iterator[None]:
    """Hold a Ctrl-C (SIGINT) that arrives inside the block until the block is done, then raise it
    (main thread only: elsewhere no KeyboardInterrupt is raised anyway). The native module's first
    import is never cut in the middle, so a later import cannot find it half registered."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[tuple[int, Any]] = []
    previous = signal.signal(signal.SIGINT, lambda number, frame: caught.append((number, frame)))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if caught:
        if callable(previous):
            previous(*caught[0])
        raise KeyboardInterrupt


def native_store_class() -> Any:
    with _interrupt_deferred():
        try:
            from mooncake.store import (  # type: ignore[import-untyped]  # noqa: PLC0415 (lazy)
                MooncakeDistributedStore,
            )
        except ModuleNotFoundError as error:
            raise StoreUnavailable(
                f"the mooncake client is not installed ({error}); "
                f"pip install mooncake-transfer-engine-non-cuda (or the CUDA variant)"
            ) from None
        except ImportError as error:
            raise StoreUnavailable(
                f"the mooncake client is installed but could not be loaded: {error}"
            ) from None
    return MooncakeDistributedStore


class Gate:
    """Many shared holders at once, or one exclusive holder alone (writer-preferring: a waiting
    exclusive holder lets no new shared holder in)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._shared = 0
        self._exclusive = False
        self._waiting = 0

    def shared(self) -> _Shared:
        """``with gate.shared():`` (a plain context object: every store call enters it)."""
        return _Shared(self)

    def enter_shared(self) -> None:
        with self._cond:
            while self._exclusive or self._waiting:
                self._cond.wait()
            self._shared += 1

    def leave_shared(self) -> None:
        """The last shared holder out wakes the waiting exclusive ones (nobody else waits on it)."""
        with self._cond:
            self._shared -= 1
            if not self._shared and self._waiting:
                self._cond.notify_all()

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        with self._cond:
            self._waiting += 1
            while self._exclusive or self._shared:
                self._cond.wait()
            self._waiting -= 1
            self._exclusive = True
        try:
            yield
        finally:
            with self._cond:
                self._exclusive = False
                self._cond.notify_all()


class _Shared:
    """:meth:`Gate.shared` as an object (no generator frame per store call)."""

    __slots__ = ("_gate",)

    def __init__(self, gate: Gate) -> None:
        self._gate = gate

    def __enter__(self) -> None:
        self._gate.enter_shared()

    def __exit__(self, *exc: object) -> None:
        self._gate.leave_shared()
