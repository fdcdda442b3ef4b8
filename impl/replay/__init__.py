"""Trace replay through the full three-tier stack: the main job (SPEC §11, issue 5).

What it is: a Mooncake-format trace (:mod:`.trace`) replayed request by request through real L1/L2
pools holding synthetic KV (:mod:`.kv`) and a real L3 (:mod:`.store`), driven by the reference
scheduler integration (:mod:`.scheduler`), with the trace's theoretical maximum computed apart
(:mod:`.maximum`). :func:`replay` / :func:`sweep` (:mod:`.runner`) return a :class:`ReplayResult`
(:mod:`.result`: the JSON schema), which :mod:`.report` (rich) and :mod:`.plot` (matplotlib) present.

What it is not: a model of an engine's batching. Requests run one at a time; each is locked, served and
unlocked before the next starts.

Module map, one job each: ``capacity`` (``3M`` / ``4gb`` / ``inf``), ``config``, ``trace``,
``maximum``, ``kv``, ``background`` (waiting without spinning), ``store``, ``scheduler``, ``runner``,
``result``, ``report``, ``plot``, ``errors``. Importing this package is cheap: the heavy modules
(torch, the cache, matplotlib) load on first use of a name that needs them.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvstrata.impl.replay.capacity import Capacity
    from kvstrata.impl.replay.config import ModelShape, ReplayConfig
    from kvstrata.impl.replay.errors import ReplayError, TraceError, VerifyError
    from kvstrata.impl.replay.result import ReplayResult
    from kvstrata.impl.replay.runner import replay, sweep
    from kvstrata.impl.replay.scheduler import ReferenceScheduler
    from kvstrata.impl.replay.trace import Request, read_trace

__all__ = [
    "Capacity",
    "ModelShape",
    "ReferenceScheduler",
    "ReplayConfig",
    "ReplayError",
    "ReplayResult",
    "Request",
    "TraceError",
    "VerifyError",
    "read_trace",
    "replay",
    "sample_trace",
    "sweep",
]

_WHERE = {
    "Capacity": "capacity",
    "ModelShape": "config",
    "ReplayConfig": "config",
    "ReplayError": "errors",
    "TraceError": "errors",
    "VerifyError": "errors",
    "ReplayResult": "result",
    "replay": "runner",
    "sweep": "runner",
    "ReferenceScheduler": "scheduler",
    "Request": "trace",
    "read_trace": "trace",
}


def sample_trace() -> str:
    """The path of the sample trace shipped with the package (``data/sample_trace.jsonl``)."""
    from importlib.resources import files  # noqa: PLC0415

    return str(files("kvstrata.impl.replay").joinpath("data", "sample_trace.jsonl"))


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
