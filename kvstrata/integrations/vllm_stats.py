"""The vLLM connector's stats, in vLLM's terms: :class:`KvstrataConnectorStats` (what vLLM's stats
logger prints every interval) and :class:`KvstrataPromMetrics` (Prometheus counters).

Each worker reports its :class:`~kvstrata.integrations.connector_worker.WorkerStats` of the last
step (``KvstrataConnector.get_kv_connector_stats``); vLLM sums them over the workers
(:meth:`KvstrataConnectorStats.aggregate`), ships the sum to its front end as a plain dict, and
there logs :meth:`KvstrataConnectorStats.reduce` and feeds the counters
(:meth:`KvstrataPromMetrics.observe`). Every value is a count or a total, so any order of sums
gives the same result; rates are derived only when printed.

Prometheus (vLLM's ``/metrics``, or ``LLM.get_metrics()``), each with vLLM's engine labels:

``vllm:kvstrata_loaded_pages_total{source="l2"|"l3"}``
    pages loaded into vLLM's blocks, from kvstrata's host pool or from the store;
``vllm:kvstrata_failed_load_pages_total``
    pages reported to vLLM as failed loads (recomputed under ``kv_load_failure_policy: recompute``);
``vllm:kvstrata_saved_pages_total``, ``vllm:kvstrata_backed_up_pages_total``,
``vllm:kvstrata_failed_backup_pages_total``
    pages copied into the host pool, pages the store holds after a backup, puts that failed (the
    page is put again by a later step);
``vllm:kvstrata_l3_bytes_total{direction="read"|"write"}``,
``vllm:kvstrata_l3_seconds_total{direction="read"|"write"}``
    bytes moved by the store's calls and the seconds the workers spent in them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

from kvstrata.integrations.connector_worker import WorkerStats

__all__ = ["KvstrataConnectorStats", "KvstrataPromMetrics"]

FIELDS = tuple(WorkerStats().as_dict())
"""The keys of a stats payload: every :class:`WorkerStats` field."""


@dataclass
class KvstrataConnectorStats(KVConnectorStats):  # type: ignore[misc]
    """A sum of :class:`WorkerStats` payloads (``data``: field name -> total)."""

    def reset(self) -> None:
        self.data = dict[str, Any]()

    def aggregate(self, other: KVConnectorStats) -> KvstrataConnectorStats:
        for name, value in other.data.items():
            self.data[name] = self.data.get(name, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        """The interval's totals, plus the store's read and write rates per worker (GB/s over the
        seconds the workers spent in its calls)."""
        totals: dict[str, int | float] = {name: self.data.get(name, 0) for name in FIELDS}
        for direction, moved in (("read", "l3_read_bytes"), ("write", "l3_written_bytes")):
            seconds = float(self.data.get(f"l3_{direction}_seconds", 0.0))
            totals[f"l3_{direction}_seconds"] = round(seconds, 6)
            totals[f"l3_{direction}_gbps"] = (
                round(self.data.get(moved, 0) / seconds / 1e9, 3) if seconds > 0 else 0.0
            )
        return totals

    def is_empty(self) -> bool:
        return not any(self.data.values())


class KvstrataPromMetrics(KVConnectorPromMetrics):  # type: ignore[misc]
    """kvstrata's counters, registered once per front end with vLLM's engine labels."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)

        def counter(name: str, documentation: str, *extra: str) -> Any:
            return self._counter_cls(
                name=f"vllm:kvstrata_{name}_total",
                documentation=documentation,
                labelnames=[*labelnames, *extra],
            )

        self._loaded = counter(
            "loaded_pages", "Pages kvstrata loaded into vLLM's blocks.", "source"
        )
        self._failed_loads = counter("failed_load_pages", "Pages reported as failed loads.")
        self._saved = counter("saved_pages", "Pages copied into kvstrata's host pool.")
        self._backed_up = counter("backed_up_pages", "Pages the store holds after a backup.")
        self._failed_backups = counter("failed_backup_pages", "Backup puts that failed.")
        self._bytes = counter("l3_bytes", "Bytes moved by the store's calls.", "direction")
        self._seconds = counter("l3_seconds", "Seconds in the store's calls.", "direction")

    def observe(self, transfer_stats_data: dict[str, Any] | None, engine_idx: int = 0) -> None:
        if not transfer_stats_data:
            return
        data, labels = transfer_stats_data, self.per_engine_labelvalues[engine_idx]
        self._loaded.labels(*labels, "l2").inc(data.get("loaded_l2_pages", 0))
        self._loaded.labels(*labels, "l3").inc(data.get("loaded_l3_pages", 0))
        self._failed_loads.labels(*labels).inc(data.get("failed_load_pages", 0))
        self._saved.labels(*labels).inc(data.get("saved_pages", 0))
        self._backed_up.labels(*labels).inc(data.get("backed_up_pages", 0))
        self._failed_backups.labels(*labels).inc(data.get("failed_backup_pages", 0))
        self._bytes.labels(*labels, "read").inc(data.get("l3_read_bytes", 0))
        self._bytes.labels(*labels, "write").inc(data.get("l3_written_bytes", 0))
        self._seconds.labels(*labels, "read").inc(data.get("l3_read_seconds", 0.0))
        self._seconds.labels(*labels, "write").inc(data.get("l3_write_seconds", 0.0))
