"""Keep the native Mooncake client's log lines off stderr: :class:`NativeLogFilter` (issue 17).

The native client logs through glog, which it never initialises, so every line goes to the process's
stderr (file descriptor 2) whatever ``MC_LOG_LEVEL`` says about ``ERROR`` lines, and the ``GLOG_*``
variables are not read (measured with 0.3.13.post1). Against a dead master that is one line per call:
700-1,600 lines per outage. kvstrata reports an outage itself, in two lines (the store link's).

The filter moves fd 2 onto a pipe and keeps a thread that copies everything from the pipe to the
original stderr, except lines in glog's format (``E1126 00:18:51.575129  2168 file.cc:406] ...``)
and glog's "Logging before InitGoogleLogging()" banner, which it counts (:attr:`NativeLogFilter.lines`)
and hands to the ``kvstrata.native`` logger at DEBUG level. Python's own stderr output (tracebacks,
logging, progress bars) passes through unchanged.

Installed by the first Mooncake client of a process (:func:`quiet_native_logs`) unless
``KVSTRATA_DEBUG=1``; :meth:`NativeLogFilter.uninstall` (also run at exit) puts fd 2 back. One per
process: fd 2 is process-wide.
"""

from __future__ import annotations

import atexit
import logging
import os
import re
import threading

__all__ = ["NativeLogFilter", "quiet_native_logs"]

log = logging.getLogger("kvstrata.native")

#: glog's line prefix: severity, MMDD, time, thread id, file:line]
GLOG_LINE = re.compile(
    rb"^(?:[IWEF]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ [^ \]]+:\d+\] "
    rb"|WARNING: Logging before InitGoogleLogging)"
)


class NativeLogFilter:
    """fd 2 through a pipe, glog lines taken out (see the module docstring)."""

    def __init__(self) -> None:
        self.lines = 0
        self._saved: int | None = None
        self._write_end: int | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    @property
    def installed(self) -> bool:
        return self._saved is not None

    def install(self) -> None:
        with self._lock:
            if self._saved is not None:
                return
            read_end, write_end = os.pipe()
            self._saved = os.dup(2)
            os.dup2(write_end, 2)
            self._write_end = write_end
            self._thread = threading.Thread(
                target=self._pump, args=(read_end, self._saved), name="kvstrata-stderr", daemon=True
            )
            self._thread.start()
        atexit.register(self.uninstall)

    def uninstall(self) -> None:
        """Put the original stderr back on fd 2 (only if fd 2 is still the pipe: someone else may
        have redirected it since) and stop the copying thread."""
        with self._lock:
            saved, write_end, thread = self._saved, self._write_end, self._thread
            if saved is None or write_end is None:
                return
            self._saved = self._write_end = self._thread = None
            if _same_file(2, write_end):
                os.dup2(saved, 2)
            os.close(write_end)  # end of file for the pump once no process writes to the pipe
        if thread is not None:
            thread.join(timeout=1.0)
            if thread.is_alive():
                return  # a child still holds the pipe: keep its target open (never reuse the fd)
        os.close(saved)

    def _pump(self, read_end: int, target: int) -> None:
        pending = b""
        try:
            while True:
                chunk = os.read(read_end, 65536)
                if not chunk:
                    break
                pending += chunk
                *lines, pending = pending.split(b"\n")
                out = [line + b"\n" for line in lines if not self._native(line)]
                if pending and not GLOG_LINE.match(pending):
                    out.append(pending)  # a partial line that is not glog's (a prompt, a bar)
                    pending = b""
                if out:
                    _write_all(target, b"".join(out))
            if pending and not self._native(pending):
                _write_all(target, pending)
        except OSError:  # pragma: no cover - the original stderr went away
            pass
        finally:
            os.close(read_end)

    def _native(self, line: bytes) -> bool:
        if not GLOG_LINE.match(line):
            return False
        self.lines += 1
        if log.isEnabledFor(logging.DEBUG):
            log.debug("%s", line.decode(errors="replace"))
        return True


def _same_file(a: int, b: int) -> bool:
    try:
        first, second = os.fstat(a), os.fstat(b)
    except OSError:
        return False
    return (first.st_dev, first.st_ino) == (second.st_dev, second.st_ino)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        view = view[written:]


#: One per process: file descriptor 2 is the process's, not an object's.
_FILTER = NativeLogFilter()


def quiet_native_logs() -> NativeLogFilter:
    """The process's filter, installed unless ``KVSTRATA_DEBUG=1`` (then native lines stay)."""
    if os.environ.get("KVSTRATA_DEBUG", "") != "1":
        _FILTER.install()
    return _FILTER
