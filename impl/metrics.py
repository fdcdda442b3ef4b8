"""Prometheus metrics of one cache (SPEC §9), with prometheus-client.

The hot path only bumps plain integers (:class:`CacheStats` on the cache, ``L3Counters`` on its L3
tier, ``BackendCounters`` on the backend); :class:`CacheCollector` turns them into metric families
when the registry is scraped. Nothing is global: each cache gets its own
:class:`prometheus_client.CollectorRegistry` (``registry_for``) unless the caller registers the
collector in a registry of its own (e.g. the process default, with a distinct ``instance`` label).

Metric names (all prefixed ``kvstrata_``):

- ``match_tokens_total`` — tokens asked for by ``match_prefix``;
- ``hit_tokens_total{tier="l1"|"l2"|"l3"}`` — tokens found per tier (L3: committed by prefetch);
- ``copy_pages_total{direction="write"|"load"}`` / ``copy_bytes_total`` — L1<->L2 pages acked;
- ``backup_pages_total{status=...}`` / ``backup_bytes_total`` — L2->L3 pages by outcome;
- ``backup_abandoned_pages_total``, ``backup_retries_total``;
- ``prefetch_pages_total{status=...}`` / ``prefetch_bytes_total`` — L3->L2 pages by outcome;
- ``store_errors_total{kind=...}`` — backend failures by kind (full, failed, missing, …);
- ``queue_depth{queue="write"|"load"|"backup"|"prefetch"}`` — pending ops (gauge);
- ``cached_pages{tier="l1"|"l2"}`` — pages the tree holds (gauge);
- ``store_health{state=...}`` (gauge, 1 for the current state), ``store_faults_total``,
  ``store_recoveries_total``, ``prefetch_unserved_total``, ``backup_dropped_pages_total``,
  ``republished_pages_total``, ``backup_deferred_pages`` (gauge) — the store link (issue 17).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvstrata.model.lifecycles import Health

if TYPE_CHECKING:
    from kvstrata.impl.cache import HierarchicalRadixCache
    from kvstrata.impl.l3 import L3Tier

__all__ = ["CacheCollector", "registry_for"]


class CacheCollector(Collector):
    """Reads one cache's counters at scrape time."""

    def __init__(self, cache: HierarchicalRadixCache, prefix: str = "kvstrata") -> None:
        self._cache = cache
        self._prefix = prefix

    def _name(self, name: str) -> str:
        return f"{self._prefix}_{name}"

    def collect(self) -> Iterator[Metric]:
        cache = self._cache
        stats = cache.stats
        yield CounterMetricFamily(
            self._name("match_tokens"), "Tokens asked for by match_prefix", value=stats.match_tokens
        )
        hits = CounterMetricFamily(
            self._name("hit_tokens"), "Tokens found cached, per tier", labels=["tier"]
        )
        hits.add_metric(["l1"], stats.l1_hit_tokens)
        hits.add_metric(["l2"], stats.l2_hit_tokens)
        l3 = cache.l3
        committed = 0 if l3 is None else l3.counters.prefetch_committed_pages
        hits.add_metric(["l3"], committed * cache.page_size)
        yield hits
        pages = CounterMetricFamily(
            self._name("copy_pages"), "L1<->L2 pages copied", labels=["direction"]
        )
        pages.add_metric(["write"], stats.write_pages)
        pages.add_metric(["load"], stats.load_pages)
        yield pages
        moved = CounterMetricFamily(
            self._name("copy_bytes"), "L1<->L2 bytes copied", labels=["direction"]
        )
        moved.add_metric(["write"], stats.write_bytes)
        moved.add_metric(["load"], stats.load_bytes)
        yield moved
        depth = GaugeMetricFamily(self._name("queue_depth"), "Pending ops", labels=["queue"])
        for queue, count in cache.pending().as_dict().items():
            depth.add_metric([queue], count)
        yield depth
        if l3 is not None:
            yield from self._l3_metrics(cache)

    def _l3_metrics(self, cache: HierarchicalRadixCache) -> Iterator[Metric]:
        l3 = cache.l3
        assert l3 is not None
        counters = l3.counters
        backup = CounterMetricFamily(
            self._name("backup_pages"), "L2->L3 pages by outcome", labels=["status"]
        )
        for status, count in counters.backup_pages.items():
            backup.add_metric([status], count)
        yield backup
        yield CounterMetricFamily(
            self._name("backup_bytes"), "L2->L3 bytes written", value=counters.backup_bytes
        )
        yield CounterMetricFamily(
            self._name("backup_retries"), "Backup batches retried", value=counters.backup_retries
        )
        yield CounterMetricFamily(
            self._name("backup_abandoned_pages"),
            "Pages given up after every retry failed",
            value=counters.backup_abandoned_pages,
        )
        fetched = CounterMetricFamily(
            self._name("prefetch_pages"), "L3->L2 pages by outcome", labels=["status"]
        )
        for status, count in counters.prefetch_pages.items():
            fetched.add_metric([status], count)
        yield fetched
        yield CounterMetricFamily(
            self._name("prefetch_bytes"), "L3->L2 bytes read", value=counters.prefetch_bytes
        )
        errors = CounterMetricFamily(
            self._name("store_errors"), "Store failures by kind", labels=["kind"]
        )
        errors.add_metric(["full"], counters.backup_pages["full"])
        errors.add_metric(["put_failed"], counters.backup_pages["failed"])
        errors.add_metric(["get_failed"], counters.prefetch_pages["failed"])
        errors.add_metric(["get_missing"], counters.prefetch_pages["missing"])
        yield errors
        yield from self._store_metrics(l3)

    def _store_metrics(self, l3: L3Tier) -> Iterator[Metric]:
        """The store link's health (issue 17): one gauge per state (1 for the current one)."""
        link, counters = l3.link, l3.counters
        health = GaugeMetricFamily(
            self._name("store_health"), "L3 store health (1: current state)", labels=["state"]
        )
        for state in Health:
            health.add_metric([state.value], float(link.state is state))
        yield health
        for name, text, value in (
            ("store_faults", "Store calls that failed or overran their deadline", link.faults),
            ("store_recoveries", "Times the store came back (a probe succeeded)", link.recoveries),
            ("prefetch_unserved", "Prefetches answered nothing: store down", link.answered_nothing),
            (
                "backup_dropped_pages",
                "Deferred backup pages dropped to stay bounded",
                counters.backup_dropped_pages,
            ),
            (
                "republished_pages",
                "L2 pages checked again after an outage",
                counters.republished_pages,
            ),
        ):
            yield CounterMetricFamily(self._name(name), text, value=value)
        yield GaugeMetricFamily(
            self._name("backup_deferred_pages"),
            "Backup pages waiting with no job: for the store to come back "
            "(under TP, or for the ranks to agree they may resume)",
            value=l3.backup.deferred_pages(),
        )


def registry_for(cache: HierarchicalRadixCache) -> CollectorRegistry:
    """A fresh registry holding only ``cache``'s metrics (``generate_latest(registry)`` scrapes it)."""
    registry = CollectorRegistry(auto_describe=True)
    registry.register(CacheCollector(cache))
    return registry
