"""A Mooncake cluster on this machine: :class:`LocalCluster` (SPEC §8, the embedded default).

It starts two child processes and nothing else:

1. ``mooncake_master`` (found next to ``sys.executable``, else on ``PATH``) bound to ``host`` (loopback
   by default) on a free RPC port, with its metrics server on the same host and an OS-chosen port,
   quiet logging, two RPC threads, and the lease and client TTLs of :class:`LocalClusterConfig`.
   A port taken between choosing it and the master's bind makes the master exit at once (silently,
   rc 1) while the port still accepts (someone else's listener), so the launcher waits until the port
   accepts *and* the listening socket belongs to its child (``/proc``), polls the child meanwhile, and
   retries on new ports when it exits;
2. a storage node (``python -m kvstrata.impl.storage.mooncake.node``) that owns the segment memory,
   so objects outlive the clients that put them; the launcher waits for its ``READY`` line.

Every wait is bounded (``startup_timeout``, ``stop_timeout``); a child's stderr goes to a temporary
file whose tail is quoted in the :class:`~kvstrata.impl.errors.StoreUnavailable` raised when it does not
start. :meth:`LocalCluster.stop` sends SIGTERM, then SIGKILL after ``stop_timeout``, only to the
processes this object started (it holds their ``Popen`` handles; it never looks processes up by name
or port). Should the launcher itself die: the node stops when its stdin closes, and the master, when
the cluster was started from the main thread on Linux, receives SIGTERM through ``PR_SET_PDEATHSIG``.
"""

from __future__ import annotations

import contextlib
import ctypes
import enum
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import IO, Any

import attrs

from kvstrata.impl.errors import ConfigError, MisuseError, StoreUnavailable
from kvstrata.impl.storage.mooncake.config import MIN_SEGMENT_SIZE, MooncakeConfig, to_bytes

__all__ = ["READY", "LocalCluster", "LocalClusterConfig", "free_port", "find_master_binary"]

READY = "READY"
"""The first word of the line the storage node prints once its segment is mounted."""

MASTER_ATTEMPTS = 5
_POLL = 0.005
_PR_SET_PDEATHSIG = 1
_TAIL = 4000


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on ``host`` a moment ago (the caller must cope with a race)."""
    with socket.socket() as probe:
        probe.bind((host, 0))
        port: int = probe.getsockname()[1]
        return port


def find_master_binary() -> str:
    """``mooncake_master`` next to the running interpreter (a virtual environment's ``bin``), else
    on ``PATH``; :class:`StoreUnavailable` if neither has one."""
    beside = Path(sys.executable).parent / "mooncake_master"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    found = shutil.which("mooncake_master")
    if found is None:
        raise StoreUnavailable(
            "mooncake_master not found next to the Python interpreter nor on PATH; "
            "pip install mooncake-transfer-engine-non-cuda"
        )
    return found


def _positive(_instance: object, attribute: attrs.Attribute[Any], value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise ConfigError(f"{attribute.name}: expected a number > 0, got {value!r}")


def _host(_instance: object, attribute: attrs.Attribute[str], value: str) -> None:
    if not isinstance(value, str) or not value or any(c.isspace() or c == ":" for c in value):
        raise ConfigError(f"{attribute.name}: expected an IPv4 address or host name, got {value!r}")


def _segment_size(value: object) -> int:
    return to_bytes(value, "segment_size")


@attrs.frozen
class LocalClusterConfig:
    """What :class:`LocalCluster` starts. Sizes accept ``"256mib"``-style strings.

    ``lease_ttl_ms`` is the master's ``--default_kv_lease_ttl``: every hit of ``exists``/``get``
    blocks eviction and removal of the object for that long, and a read that takes longer fails
    (-707); 2 s suits loopback. ``client_ttl_s`` is how long a crashed client's segment stays
    mounted.
    """

    segment_size: int = attrs.field(default=256 << 20, converter=_segment_size)
    host: str = attrs.field(default="127.0.0.1", validator=_host)
    lease_ttl_ms: int = attrs.field(default=2000, validator=_positive)
    client_ttl_s: int = attrs.field(default=2, validator=_positive)
    startup_timeout: float = attrs.field(default=60.0, validator=_positive)
    stop_timeout: float = attrs.field(default=10.0, validator=_positive)
    setup_retries: int = attrs.field(default=2, validator=_positive)

    def __attrs_post_init__(self) -> None:
        if self.segment_size < MIN_SEGMENT_SIZE:
            raise ConfigError(
                f"segment_size: the storage node needs at least {MIN_SEGMENT_SIZE} bytes (16 MiB, "
                f"Mooncake's minimum segment), got {self.segment_size}"
            )
        for name in ("lease_ttl_ms", "client_ttl_s", "setup_retries"):
            if not isinstance(getattr(self, name), int):
                raise ConfigError(f"{name}: expected an int, got {getattr(self, name)!r}")


class ClusterState(enum.Enum):
    NEW = "new"
    RUNNING = "running"
    STOPPED = "stopped"


def _parent_death_signal() -> Callable[[], None] | None:
    """A ``preexec_fn`` that asks Linux to SIGTERM the child when this thread dies, or None where
    that is not possible or not wanted (not Linux; not the main thread, whose exit is the process's).
    ``prctl`` is looked up here, in the parent: the forked child only calls it."""
    if sys.platform != "linux" or threading.current_thread() is not threading.main_thread():
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None

    def preexec() -> None:  # pragma: no cover - runs in the forked child
        prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM))

    return preexec


def _listener_inodes(port: int) -> set[str] | None:
    """Inodes of the TCP sockets listening on ``port`` (any address), from ``/proc/net``; None
    where there is no ``/proc``."""
    inodes: set[str] = set()
    found = False
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table, encoding="ascii") as lines:
                next(lines, None)
                found = True
                for line in lines:
                    fields = line.split()
                    # local_address is HEXIP:HEXPORT; state 0A is LISTEN; field 9 is the inode
                    listening = len(fields) > 9 and fields[3] == "0A"
                    if listening and int(fields[1].rsplit(":", 1)[1], 16) == port:
                        inodes.add(fields[9])
        except OSError:
            continue
    return inodes if found else None


def _owns_listener(pid: int, port: int) -> bool:
    """Whether process ``pid`` holds a socket listening on ``port`` (True where ``/proc`` cannot
    tell: the caller then trusts the connection it made)."""
    inodes = _listener_inodes(port)
    if inodes is None:
        return True
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return False
    for fd in fds:
        with contextlib.suppress(OSError):
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
            if link.startswith("socket:[") and link[8:-1] in inodes:
                return True
    return False


def _tail(log: IO[bytes] | None) -> str:
    if log is None:
        return ""
    try:
        log.flush()
        log.seek(0)
        text = log.read().decode("utf-8", "replace")
    except (OSError, ValueError):
        return ""
    text = text[-_TAIL:].strip()
    return f"\n--- its stderr (last {_TAIL} characters) ---\n{text}" if text else ""


def _terminate(proc: subprocess.Popen[bytes] | None, timeout: float) -> None:
    """SIGTERM, then SIGKILL after ``timeout``; only ever our own child (``Popen`` knows whether it
    was reaped and then sends nothing)."""
    if proc is None:
        return
    if proc.stdin is not None:
        with contextlib.suppress(OSError):
            proc.stdin.close()
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    if proc.stdout is not None:
        proc.stdout.close()


class _Children:
    """The processes and log files of one cluster; shared with the finalizer, so that a cluster that
    is garbage collected or alive at interpreter exit still stops its children."""

    def __init__(self) -> None:
        self.master: subprocess.Popen[bytes] | None = None
        self.node: subprocess.Popen[bytes] | None = None
        self.master_log: IO[bytes] | None = None
        self.node_log: IO[bytes] | None = None

    def stop(self, timeout: float) -> None:
        _terminate(self.node, timeout)
        _terminate(self.master, timeout)
        for log in (self.master_log, self.node_log):
            if log is not None:
                log.close()


class LocalCluster:
    """A ``mooncake_master`` and one storage node on this machine (see the module docstring).

    ``LocalCluster(segment_size="1gib")`` takes :class:`LocalClusterConfig` fields as keywords (or
    ``config=``); :meth:`start` (or ``with``) starts it. ``ports`` supplies candidate RPC ports
    (default :func:`free_port`; tests inject clashes through it).
    """

    def __init__(
        self,
        config: LocalClusterConfig | None = None,
        *,
        master_binary: str | None = None,
        ports: Callable[[], int] | None = None,
        **fields: Any,
    ) -> None:
        if config is not None and fields:
            raise MisuseError("LocalCluster: pass either config= or its fields, not both")
        self.settings = config if config is not None else LocalClusterConfig(**fields)
        self._binary = master_binary
        self._ports = ports if ports is not None else (lambda: free_port(self.settings.host))
        self._state = ClusterState.NEW
        self._port: int | None = None
        self._segment_name: str | None = None
        self._children = _Children()
        self._finalizer = weakref.finalize(self, self._children.stop, self.settings.stop_timeout)
        self._env = dict(os.environ, MC_LOG_LEVEL="ERROR")

    # ----------------------------------------------------------------------------- properties
    @property
    def state(self) -> ClusterState:
        return self._state

    @property
    def master_address(self) -> str:
        """``host:port`` of the master's RPC server."""
        if self._port is None:
            raise MisuseError("LocalCluster: not started")
        return f"{self.settings.host}:{self._port}"

    @property
    def config(self) -> MooncakeConfig:
        """A client configuration for this cluster that contributes no memory (the storage node
        holds the segment), as a scheduler-side client wants it."""
        return MooncakeConfig(
            master=self.master_address,
            local_hostname=self.settings.host,
            global_segment_size=0,
            setup_retries=self.settings.setup_retries,
        )

    @property
    def segment_name(self) -> str | None:
        """The storage node's segment name as it reported it."""
        return self._segment_name

    @property
    def master_pid(self) -> int | None:
        master = self._children.master
        return master.pid if master is not None and master.poll() is None else None

    @property
    def node_pid(self) -> int | None:
        node = self._children.node
        return node.pid if node is not None and node.poll() is None else None

    # ------------------------------------------------------------------------------ lifecycle
    def start(self) -> LocalCluster:
        """Start the master and the storage node; :class:`StoreUnavailable` (with the child's stderr)
        if either does not come up within ``startup_timeout``. Returns ``self``."""
        if self._state is not ClusterState.NEW:
            raise MisuseError(f"LocalCluster: start() when {self._state.value}")
        self._state = ClusterState.RUNNING
        try:
            # closed by _Children.stop, which the finalizer always runs
            self._children.master_log = tempfile.TemporaryFile(prefix="mooncake-master-")  # noqa: SIM115
            self._children.node_log = tempfile.TemporaryFile(prefix="kvstrata-node-")  # noqa: SIM115
            deadline = time.monotonic() + self.settings.startup_timeout
            self._start_master_on_free_port(deadline)
            self._start_node(deadline)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """Stop the storage node, then the master (SIGTERM, SIGKILL after ``stop_timeout``).
        Idempotent."""
        self._state = ClusterState.STOPPED
        self._finalizer()

    def kill_master(self) -> None:
        """SIGKILL the master (fault tests): every client then sees RPC failures."""
        self._require_running("kill_master")
        master = self._children.master
        if master is not None and master.poll() is None:
            master.kill()
            master.wait()

    def restart_master(self) -> None:
        """Stop the master if it runs and start a new one on the same port (all metadata is lost;
        clients and the storage node reconnect and remount by themselves within about a second)."""
        self._require_running("restart_master")
        _terminate(self._children.master, self.settings.stop_timeout)
        assert self._port is not None
        deadline = time.monotonic() + self.settings.startup_timeout
        while True:
            if self._launch_master(self._port, deadline):
                return
            if time.monotonic() > deadline:
                raise StoreUnavailable(
                    f"mooncake_master did not restart on port {self._port}"
                    + _tail(self._children.master_log)
                )
            time.sleep(0.05)  # the old listener may linger for a moment

    def __enter__(self) -> LocalCluster:
        if self._state is ClusterState.NEW:
            self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        where = f"{self.settings.host}:{self._port}" if self._port else "-"
        return f"LocalCluster({where}, {self._state.value})"

    def _require_running(self, what: str) -> None:
        if self._state is not ClusterState.RUNNING:
            raise MisuseError(f"LocalCluster: {what}() when {self._state.value}")

    # ---------------------------------------------------------------------------------- master
    def _master_args(self, port: int) -> list[str]:
        s = self.settings
        binary = self._binary if self._binary is not None else find_master_binary()
        return [
            binary,
            f"--rpc_address={s.host}",
            f"--rpc_port={port}",
            f"--metrics_host={s.host}",
            "--metrics_port=0",
            "--enable_metric_reporting=false",
            "--rpc_thread_num=2",
            f"--default_kv_lease_ttl={s.lease_ttl_ms}",
            f"--client_ttl={s.client_ttl_s}",
            "--minloglevel=2",
        ]

    def _start_master_on_free_port(self, deadline: float) -> None:
        for _ in range(MASTER_ATTEMPTS):
            port = self._ports()
            if self._launch_master(port, deadline):
                self._port = port
                return
        raise StoreUnavailable(
            f"mooncake_master did not start in {MASTER_ATTEMPTS} attempts (ports taken, or it "
            f"fails at start-up)" + _tail(self._children.master_log)
        )

    def _launch_master(self, port: int, deadline: float) -> bool:
        """Start a master on ``port`` and wait for the port to accept; False if the process exited
        first (a port clash, usually); :class:`StoreUnavailable` at ``deadline``."""
        master = subprocess.Popen(
            self._master_args(port),
            stdin=subprocess.DEVNULL,
            stdout=self._children.master_log,
            stderr=self._children.master_log,
            env=self._env,
            preexec_fn=_parent_death_signal(),  # noqa: PLW1509 - one prctl call, resolved before fork
        )
        self._children.master = master
        while master.poll() is None:
            try:
                with socket.create_connection((self.settings.host, port), timeout=0.2):
                    pass
            except OSError:
                pass
            else:
                # someone else's listener on a clashing port also accepts: it must be ours
                if _owns_listener(master.pid, port):
                    return True
            if time.monotonic() > deadline:
                _terminate(master, self.settings.stop_timeout)
                raise StoreUnavailable(
                    f"mooncake_master did not open {self.settings.host}:{port} in time"
                    + _tail(self._children.master_log)
                )
            time.sleep(_POLL)
        return False

    # ------------------------------------------------------------------------------------ node
    def _start_node(self, deadline: float) -> None:
        s = self.settings
        args = [
            sys.executable,
            "-m",
            "kvstrata.impl.storage.mooncake.node",
            "--master",
            self.master_address,
            "--segment",
            str(s.segment_size),
            "--hostname",
            s.host,
            "--setup-retries",
            str(s.setup_retries),
            "--watch-stdin",
        ]
        node = subprocess.Popen(
            args,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._children.node_log,
            env=self._env,
        )
        self._children.node = node
        line = self._read_line(node, deadline)
        word, _, name = line.partition(" ")
        if word != READY:
            raise StoreUnavailable(
                f"the kvstrata storage node did not start (said {line!r}, exit status "
                f"{node.poll()})" + _tail(self._children.node_log)
            )
        self._segment_name = name.strip() or None

    @staticmethod
    def _read_line(proc: subprocess.Popen[bytes], deadline: float) -> str:
        """The first line ``proc`` writes to stdout, or ``""`` if it exits or ``deadline`` passes
        first."""
        assert proc.stdout is not None
        fd = proc.stdout.fileno()
        data = b""
        while b"\n" not in data:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            ready, _, _ = select.select([fd], [], [], min(left, 0.1))
            if ready:
                chunk = os.read(fd, 4096)
                if not chunk:
                    break
                data += chunk
        return data.split(b"\n", 1)[0].decode("utf-8", "replace").strip()
