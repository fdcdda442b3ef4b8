"""The vLLM connector's stats, in vLLM's terms: :class:`KvstrataConnectorStats` (what vLLM's stats
logger prints every interval) and :class:`KvstrataPromMetrics` (Prometheus counters).

Each worker reports its :class:`~kvstrata.integrations.connector_worker.WorkerStats` of the last
step (``KvstrataConnector.get_kv_connector_stats``); vLLM sums them over the workers
(:meth:`KvstrataConnectorStats.aggregate`), ships the sum to its front end as a plain dict, and
there logs :meth:`KvstrataConnectorStats.reduce` and feeds the counters
(:meth:`KvstrataPromMetrics.observe`). Every value is a count or a total, so any order of sums
gives the same result; rates are derived only when printed.

Every count is of page copies: each tensor-parallel rank and pipeline stage loads, saves and
backs up its own copy of a page (its heads, its layers), and vLLM sums the workers; with ``TP=4`` a
page loaded once counts 4. Prometheus (vLLM's ``/metrics``), each with vLLM's engine labels
(``LLM.get_metrics()`` offline gives the same counters by family name, without ``_total``, and as
whole numbers):

``vllm:kvstrata_loaded_pages_total{source="l2"|"l3"}``
    page copies loaded into vLLM's blocks, from kvstrata's host pool or from the store;
``vllm:kvstrata_failed_load_pages_total``
    page copies reported to vLLM as failed loads (recomputed under
    ``kv_load_failure_policy: recompute``);
``vllm:kvstrata_saved_pages_total``, ``vllm:kvstrata_backed_up_pages_total``,
``vllm:kvstrata_failed_backup_pages_total``
    page copies copied into the host pool, page copies the store holds after a backup, backup
    puts that failed (the page is put again by a later step, and counts again if that fails);
``vllm:kvstrata_l3_bytes_total{direction="read"|"write"}``,
``vllm:kvstrata_l3_seconds_total{direction="read"|"write"}``
    bytes moved by the store's calls and the seconds the workers spent in them;
``vllm:kvstrata_backup_wait_seconds_total``
    seconds the workers' saves waited for the store's puts: with ``async_backup`` (the default)
    only where the store fell behind the steps (a save reusing a slot a put still reads), without
    it every put. It grows with the store's backlog.
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

        copies = " (page copies: one per TP rank and PP stage)."
        loaded = counter("loaded_pages", "Pages loaded into vLLM's blocks" + copies, "source")
        l3_bytes = counter("l3_bytes", "Bytes moved by the store's calls.", "direction")
        seconds = counter("l3_seconds", "Seconds in the store's calls.", "direction")
        #: (counter, its labels beyond vLLM's, the payload field it adds up)
        self._series: list[tuple[Any, tuple[str, ...], str]] = [
            (loaded, ("l2",), "loaded_l2_pages"),
            (loaded, ("l3",), "loaded_l3_pages"),
            (counter("failed_load_pages", "Pages failed to load" + copies), (), "failed_load_pages"),
            (counter("saved_pages", "Pages copied into the host pool" + copies), (), "saved_pages"),
            (counter("backed_up_pages", "Pages in the store after a backup" + copies), (),
             "backed_up_pages"),
            (counter("failed_backup_pages", "Backup puts that failed" + copies), (),
             "failed_backup_pages"),
            (l3_bytes, ("read",), "l3_read_bytes"),
            (l3_bytes, ("write",), "l3_written_bytes"),
            (seconds, ("read",), "l3_read_seconds"),
            (seconds, ("write",), "l3_write_seconds"),
            (counter("backup_wait_seconds", "Seconds saves waited for the store's puts."), (),
             "backup_wait_seconds"),
        ]  # fmt: skip
        for labels in per_engine_labelvalues.values():  # every series exists from the start, at 0
            for metric, extra, _field in self._series:
                metric.labels(*labels, *extra)

    def observe(self, transfer_stats_data: dict[str, Any] | None, engine_idx: int = 0) -> None:
        if not transfer_stats_data:
            return
        labels = self.per_engine_labelvalues[engine_idx]
        for metric, extra, field in self._series:
            metric.labels(*labels, *extra).inc(transfer_stats_data.get(field, 0))
