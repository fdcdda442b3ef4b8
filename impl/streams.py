"""Copy streams: where a copy batch's page copies run, and when their data counts as landed.

Invariant (held by every stream): ``synchronize()`` returns only once every copy issued before it has
landed, and reports the bytes they moved; a copy's failure surfaces no later than that. The transfer
controller reports a batch only after synchronising its stream (:mod:`kvstrata.impl.transfer`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Protocol

import torch

__all__ = ["CopyStream", "CudaStream", "DeferredStream", "ImmediateStream"]


class CopyStream(Protocol):
    """Where a batch's copies run. ``issue(copy)`` starts one copy (``copy()`` returns the bytes it
    moves), which may land later; ``synchronize()`` returns once every issued copy landed, with the
    bytes they moved since the last synchronisation."""

    def issue(self, copy: Callable[[], int]) -> None: ...

    def synchronize(self) -> int: ...


class ImmediateStream:
    """CPU: a copy lands when it is issued."""

    def __init__(self) -> None:
        self._moved = 0

    def issue(self, copy: Callable[[], int]) -> None:
        self._moved += copy()

    def synchronize(self) -> int:
        moved, self._moved = self._moved, 0
        return moved


class CudaStream(ImmediateStream):
    """The controller's own CUDA stream: copies are queued on it, and land when it is synchronised."""

    def __init__(self) -> None:
        super().__init__()
        self._stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]

    def issue(self, copy: Callable[[], int]) -> None:
        with torch.cuda.stream(self._stream):
            super().issue(copy)

    def synchronize(self) -> int:
        self._stream.synchronize()
        return super().synchronize()


class DeferredStream:
    """The CPU stand-in for a CUDA stream (tests): an issued copy runs, and so reads its source and
    writes its destination, only when :meth:`land` picks it (oldest first) or at :meth:`synchronize`.
    A copy that raises when it lands makes ``synchronize`` raise once every other copy landed."""

    def __init__(self) -> None:
        self.issued: deque[Callable[[], int]] = deque()
        #: When set, the next ``issue`` raises and queues nothing (a copy that fails to launch).
        self.refuse_next = False
        self._moved = 0
        self._error: Exception | None = None

    def land(self) -> bool:
        """The oldest issued copy lands; whether there was one."""
        if not self.issued:
            return False
        try:
            self._moved += self.issued.popleft()()
        except Exception as error:  # surfaces at the next synchronisation, like a CUDA error
            self._error = self._error or error
        return True

    def synchronize(self) -> int:
        while self.land():
            pass
        error, self._error = self._error, None
        if error is not None:
            self._moved = 0
            raise error
        moved, self._moved = self._moved, 0
        return moved

    def issue(self, copy: Callable[[], int]) -> None:
        if self.refuse_next:
            self.refuse_next = False
            raise RuntimeError("injected launch failure of a copy")
        self.issued.append(copy)
