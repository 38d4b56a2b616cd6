"""The service's Prometheus metrics: one registry per app, counters without labels, summed over
the processes of `kvc serve --workers N` (prometheus_client's multiprocess mode)."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    generate_latest,
    multiprocess,
    values,
)

__all__ = ["CONTENT_TYPE_LATEST", "Metrics"]


class Metrics:
    """Process-wide counters of one app, without labels: per-namespace labels would tell
    any scraper the tenants. Each app has its own registry, so two apps in one process
    (tests, an embedding) never share or collide on a metric.

    With `multiprocess_dir` the values live in files there, one per process, and
    `exposition` sums every process's files, so any worker answers for all of them.
    prometheus_client must have been imported with PROMETHEUS_MULTIPROC_DIR set to
    that directory (`kvc serve --workers N` sets it before starting the workers).
    """

    def __init__(self, multiprocess_dir: str | None = None) -> None:
        if multiprocess_dir is not None and values.ValueClass is values.MutexValue:
            raise ValueError(
                "multiprocess metrics need PROMETHEUS_MULTIPROC_DIR set before prometheus_client "
                "is imported"
            )
        self.multiprocess_dir = multiprocess_dir
        self._journal: tuple[Gauge, Callable[[], float]] | None = None
        self._journal_seen = 0.0
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
        """Expose the catalog's journal failures (`Catalog.journal_failures`): read at scrape
        time in one process; with several, each process writes its own after every request
        (`after_request`) and a scrape sums them."""
        gauge = Gauge(
            "kvc_journal_failures",
            "Journal records (refs, pins, quarantine, GC purges) that did not reach every store "
            "since the service started.",
            registry=self.registry,
            multiprocess_mode="sum",
        )
        if self.multiprocess_dir is None:
            gauge.set_function(failures)
        else:
            self._journal = (gauge, failures)

    def after_request(self) -> None:
        """Bring this process's share of the journal failures up to date (multiprocess only)."""
        if self._journal is not None:
            gauge, failures = self._journal
            now = failures()
            if now != self._journal_seen:
                self._journal_seen = now
                gauge.set(now)

    def exposition(self) -> bytes:
        """The Prometheus text exposition (`CONTENT_TYPE_LATEST`)."""
        if self.multiprocess_dir is None:
            return generate_latest(self.registry)
        merged = CollectorRegistry()
        multiprocess.MultiProcessCollector(merged, path=self.multiprocess_dir)  # type: ignore[no-untyped-call]
        return generate_latest(merged)
