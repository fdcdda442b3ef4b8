"""The result of a replay as attrs values, and its JSON form (a stable, documented schema).

JSON schema ``kvstrata-replay/1`` (README "What the output means" and docs/scheduler.md describe the
fields; new fields may be added, existing ones keep their name and meaning):

- ``requests``, ``refused_requests``, ``input_tokens``;
- ``hit_tokens`` and ``hit_ratio``: objects with ``l1``, ``l2``, ``l3`` and ``total`` (ratios are
  hit tokens / ``input_tokens``; ``total`` is the sum of the three tiers);
- ``max_hit_tokens``, ``max_hit_ratio``: the trace's reuse with unbounded capacity, from the hash ids;
- ``bytes`` and ``pages``: moved per direction, ``l1_to_l2`` (write-through), ``l2_to_l1``
  (load-back), ``l2_to_l3`` (backup, pages newly stored), ``l3_to_l2`` (prefetch, pages arrived);
- ``tiers``: per tier ``pages``, ``tokens`` and ``bytes`` of capacity; L3 adds ``backend``, ``where``
  and ``store_bytes`` (what the store was sized to; ``null`` for a configured cluster);
- ``l3``: the L3 counters (backup and prefetch outcomes) and ``store``, the store link's health
  (``state``, ``faults``, ``answered_nothing``, ``recoveries``, ``losses``), ``null`` without L3;
- ``timings``: ``wall_s`` (everything), ``startup_s`` (pools, store, cluster), ``replay_s`` (the
  request loop), ``drain_s`` (waiting for background work at the end), ``shutdown_s``, and per request
  ``scheduler_us_per_request`` (time inside kvstrata's calls), ``wait_us_per_request`` (blocked on
  prefetch / load-back, draining events meanwhile), ``kv_us_per_request`` (synthetic KV: hashing,
  writing, verifying), and the distribution of the per-request waits, ``wait_ms_per_request`` and
  its L3 part ``l3_wait_ms_per_request`` (each ``p50``, ``p99``, ``max`` in milliseconds);
- ``verify``: ``enabled`` and ``pages_checked``;
- ``config``: the replay's configuration; ``trace``: its path and ``limit``;
- ``timeline``: cumulative counts after sampled requests (``requests``, ``input_tokens``,
  ``hit_tokens.{l1,l2,l3}``, ``max_hit_tokens``), for plots;
- ``sweep``: with ``--sweep-l1``, one summary per L1 capacity (``l1``, ``l1_pages``, ``hit_ratio``,
  ``max_hit_ratio``, ``refused_requests``, ``wall_s``); absent otherwise.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import attrs
import numpy as np

__all__ = ["SCHEMA", "Moved", "ReplayResult", "TierTokens", "Timeline", "Timings"]

SCHEMA = "kvstrata-replay/1"
DIRECTIONS = ("l1_to_l2", "l2_to_l1", "l2_to_l3", "l3_to_l2")


@attrs.define
class TierTokens:
    """Tokens per tier. ``total`` is their sum by construction."""

    l1: int = 0
    l2: int = 0
    l3: int = 0

    @property
    def total(self) -> int:
        return self.l1 + self.l2 + self.l3

    def as_dict(self) -> dict[str, int]:
        return {"l1": self.l1, "l2": self.l2, "l3": self.l3, "total": self.total}

    def ratios(self, of: int) -> dict[str, float]:
        """Each count divided by ``of`` (0.0 when ``of`` is 0)."""
        return {tier: (count / of if of else 0.0) for tier, count in self.as_dict().items()}


@attrs.frozen
class Moved:
    """Pages and bytes moved per direction (keys: :data:`DIRECTIONS`)."""

    pages: dict[str, int]
    bytes: dict[str, int]


@attrs.define
class Timings:
    wall_s: float = 0.0
    startup_s: float = 0.0
    replay_s: float = 0.0
    drain_s: float = 0.0
    shutdown_s: float = 0.0
    scheduler_ns: int = 0
    wait_ns: int = 0
    kv_ns: int = 0
    waits_ns: list[int] = attrs.field(factory=list)  # per request: blocked on background work
    l3_waits_ns: list[int] = attrs.field(factory=list)  # per request: the part spent on L3

    def as_dict(self, requests: int) -> dict[str, Any]:
        per = max(requests, 1) * 1000
        return {
            "wall_s": round(self.wall_s, 3),
            "startup_s": round(self.startup_s, 3),
            "replay_s": round(self.replay_s, 3),
            "drain_s": round(self.drain_s, 3),
            "shutdown_s": round(self.shutdown_s, 3),
            "scheduler_us_per_request": round(self.scheduler_ns / per, 1),
            "wait_us_per_request": round(self.wait_ns / per, 1),
            "kv_us_per_request": round(self.kv_ns / per, 1),
            "wait_ms_per_request": _distribution(self.waits_ns),
            "l3_wait_ms_per_request": _distribution(self.l3_waits_ns),
        }


def _distribution(values_ns: list[int]) -> dict[str, float]:
    """p50, p99 and max of per-request times, in milliseconds (0 without requests)."""
    if not values_ns:
        return {"p50": 0.0, "p99": 0.0, "max": 0.0}
    ms = np.asarray(values_ns, dtype=np.float64) / 1e6
    p50, p99 = np.percentile(ms, [50, 99])
    return {
        "p50": round(float(p50), 3),
        "p99": round(float(p99), 3),
        "max": round(float(ms.max()), 3),
    }


@attrs.define
class Timeline:
    """Cumulative counts after sampled requests (every ``step``-th and the last)."""

    requests: list[int] = attrs.field(factory=list)
    input_tokens: list[int] = attrs.field(factory=list)
    l1: list[int] = attrs.field(factory=list)
    l2: list[int] = attrs.field(factory=list)
    l3: list[int] = attrs.field(factory=list)
    max_hit_tokens: list[int] = attrs.field(factory=list)

    def add(self, requests: int, input_tokens: int, hits: TierTokens, max_hits: int) -> None:
        self.requests.append(requests)
        self.input_tokens.append(input_tokens)
        self.l1.append(hits.l1)
        self.l2.append(hits.l2)
        self.l3.append(hits.l3)
        self.max_hit_tokens.append(max_hits)

    def as_dict(self) -> dict[str, Any]:
        return {
            "requests": self.requests,
            "input_tokens": self.input_tokens,
            "hit_tokens": {"l1": self.l1, "l2": self.l2, "l3": self.l3},
            "max_hit_tokens": self.max_hit_tokens,
        }


@attrs.define
class ReplayResult:
    """One replay run. Invariants: ``hits.total <= max_hit_tokens <= input_tokens`` whenever nothing
    was in L3 before the run (a shared cluster may already hold pages: then L3 can exceed the
    trace's own reuse), and every hit is a whole page."""

    trace: str
    limit: int | None
    config: dict[str, Any]
    requests: int = 0
    refused: int = 0
    input_tokens: int = 0
    hits: TierTokens = attrs.field(factory=TierTokens)
    max_hit_tokens: int = 0
    moved: Moved = attrs.field(
        factory=lambda: Moved(dict.fromkeys(DIRECTIONS, 0), dict.fromkeys(DIRECTIONS, 0))
    )
    tiers: dict[str, Any] = attrs.field(factory=dict)
    l3: dict[str, Any] | None = None
    timings: Timings = attrs.field(factory=Timings)
    pages_verified: int = 0
    timeline: Timeline = attrs.field(factory=Timeline)
    sweep: list[dict[str, Any]] | None = None

    @property
    def hit_ratio(self) -> dict[str, float]:
        return self.hits.ratios(self.input_tokens)

    @property
    def max_hit_ratio(self) -> float:
        return self.max_hit_tokens / self.input_tokens if self.input_tokens else 0.0

    def summary(self) -> dict[str, Any]:
        """The short form kept per point of a sweep."""
        return {
            "l1": self.config["capacity"]["l1"],
            "l1_pages": self.tiers.get("l1", {}).get("pages"),
            "hit_ratio": self.hit_ratio,
            "max_hit_ratio": self.max_hit_ratio,
            "refused_requests": self.refused,
            "wall_s": round(self.timings.wall_s, 3),
        }

    def as_json(self) -> dict[str, Any]:
        """The JSON object of schema :data:`SCHEMA` (see the module docstring)."""
        out: dict[str, Any] = {
            "schema": SCHEMA,
            "trace": {"path": self.trace, "limit": self.limit},
            "requests": self.requests,
            "refused_requests": self.refused,
            "input_tokens": self.input_tokens,
            "hit_tokens": self.hits.as_dict(),
            "hit_ratio": self.hit_ratio,
            "max_hit_tokens": self.max_hit_tokens,
            "max_hit_ratio": self.max_hit_ratio,
            "bytes": dict(self.moved.bytes),
            "pages": dict(self.moved.pages),
            "tiers": self.tiers,
            "l3": self.l3,
            "timings": self.timings.as_dict(self.requests),
            "verify": {
                "enabled": bool(self.config.get("verify")),
                "pages_checked": self.pages_verified,
            },
            "config": self.config,
            "timeline": self.timeline.as_dict(),
        }
        if self.sweep is not None:
            out["sweep"] = self.sweep
        return out

    def write_json(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.as_json(), indent=2) + "\n", encoding="utf-8")
