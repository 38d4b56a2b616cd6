"""The service's Prometheus metrics: one registry per app, counters without labels."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    generate_latest,
)

__all__ = ["CONTENT_TYPE_LATEST", "Metrics"]


class Metrics:
    """Process-wide counters of one app, without labels: per-namespace labels would tell
    any scraper the tenants. Each app has its own registry, so two apps in one process
    (tests, an embedding) never share or collide on a metric."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, registry=self.registry)

        # prometheus_client appends `_total` to a counter's name on exposition.
        self.lookups = counter("kvc_lookups", "Lookups answered.")
        self.lookup_hits = counter("kvc_lookup_hits", "Lookups that matched at least one token.")
        self.restorable_tokens = counter(
            "kvc_restorable_tokens", "Tokens the lookups found restorable."
        )
        self.publish_chunks = counter("kvc_publish_chunks", "Chunks newly recorded by publishes.")
        self.errors = counter("kvc_errors", "Requests that failed with an unexpected error (500).")
        self.unavailable = counter(
            "kvc_catalog_unavailable",
            "Requests answered 503 or 504 because the catalog's database failed or timed out.",
        )

    def watch_journal(self, failures: Callable[[], float]) -> None:
        """Expose the catalog's journal failures (`Catalog.journal_failures`), read at scrape time."""
        Gauge(
            "kvc_journal_failures",
            "Journal records (refs, pins, quarantine, GC purges) that did not reach every store "
            "since the service started.",
            registry=self.registry,
        ).set_function(failures)

    def exposition(self) -> bytes:
        """The Prometheus text exposition (`CONTENT_TYPE_LATEST`)."""
        return generate_latest(self.registry)
