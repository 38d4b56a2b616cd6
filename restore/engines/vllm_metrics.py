"""The kvc vLLM connector's metrics, through vLLM's own hooks: `KvcConnectorStats` (what a
worker or the scheduler counted since vLLM last asked, summed across ranks and steps the way
vLLM aggregates connector stats) and `KvcPromMetrics` (the Prometheus metrics vLLM's
`PrometheusStatLogger` registers for the connector and observes each payload into).

Request counts (hits, hit tokens, skipped requests by reason) are counted once, by the
scheduler. Load and save counts are counted by each tensor-parallel rank for its own kv
heads and summed by vLLM: at tensor-parallel size n one request's load is n loads, and
bytes are the sum of the ranks' shards (docs/engines.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)
from vllm.v1.metrics.utils import create_metric_per_engine

if TYPE_CHECKING:
    from vllm.config import VllmConfig

# Counters of the payload: name -> (Prometheus name, help). Prometheus adds `_total`.
COUNTERS: dict[str, tuple[str, str]] = {
    "hit_requests": (
        "vllm:kvc_hit_requests",
        "Requests vLLM allocated blocks for a kvc load (counted by the scheduler).",
    ),
    "hit_tokens": (
        "vllm:kvc_hit_tokens",
        "Prompt tokens vLLM allocated for kvc loads (counted by the scheduler).",
    ),
    "loads": ("vllm:kvc_loads", "kvc loads run, one per request and tensor-parallel rank."),
    "load_errors": (
        "vllm:kvc_load_errors",
        "kvc loads that restored fewer positions than offered (vLLM recomputes the rest), "
        "per rank.",
    ),
    "loaded_tokens": (
        "vllm:kvc_loaded_tokens",
        "Positions written into vLLM's blocks by kvc loads, summed over ranks.",
    ),
    "loaded_bytes": (
        "vllm:kvc_loaded_bytes",
        "Bytes of verified kvc chunks read by loads, summed over ranks.",
    ),
    "saves": ("vllm:kvc_saves", "kvc saves published, one per request and rank."),
    "save_errors": (
        "vllm:kvc_save_errors",
        "kvc saves not made (refused, dropped by a full checkpoint queue, or failed), per rank.",
    ),
    "saved_bytes": (
        "vllm:kvc_saved_bytes",
        "Bytes of new chunks kvc saves stored (chunks already catalogued cost none).",
    ),
}
LOAD_SECONDS = ("vllm:kvc_load_seconds", "Time of one kvc load on one rank (lookup, fetch, verify, copy).")
SKIPPED = (
    "vllm:kvc_skipped_requests",
    "Requests kvc neither loads nor saves because vLLM keys their KV on more than token ids, "
    "by reason (lora, multimodal, cache_salt, prompt_embeds).",
)
LOAD_SECONDS_BUCKETS = [0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0]


@dataclass
class KvcConnectorStats(KVConnectorStats):
    """What the connector counted since vLLM last collected it: counters (`COUNTERS`), the
    seconds of each load, and skipped requests by reason. Plain JSON-like data, so it crosses
    vLLM's worker and front-end process boundaries as it is."""

    def __post_init__(self) -> None:
        data = self.data  # a payload vLLM passes back (build_kv_connector_stats), or empty
        self.reset()
        self._add(data)

    def reset(self) -> None:
        self.data = {**dict.fromkeys(COUNTERS, 0), "load_seconds": [], "skipped": {}}

    def _add(self, data: dict[str, Any]) -> None:
        for key in COUNTERS:
            self.data[key] += data.get(key, 0)
        self.data["load_seconds"].extend(data.get("load_seconds", ()))
        skipped = self.data["skipped"]
        for reason, n in data.get("skipped", {}).items():
            skipped[reason] = skipped.get(reason, 0) + n

    def is_empty(self) -> bool:
        return not (
            any(self.data[key] for key in COUNTERS) or self.data["load_seconds"] or self.data["skipped"]
        )

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        self._add(other.data)
        return self

    def reduce(self) -> dict[str, int | float]:
        """One summary of an interval, for vLLM's periodic log line."""
        seconds = self.data["load_seconds"]
        out: dict[str, int | float] = {
            "Hit requests": self.data["hit_requests"],
            "Hit tokens": self.data["hit_tokens"],
            "Loads": self.data["loads"],
            "Load errors": self.data["load_errors"],
            "Loaded MB": round(self.data["loaded_bytes"] / 2**20, 3),
            "Avg load ms": round(1e3 * math.fsum(seconds) / len(seconds), 3) if seconds else 0,
            "Saves": self.data["saves"],
            "Save errors": self.data["save_errors"],
            "Saved MB": round(self.data["saved_bytes"] / 2**20, 3),
        }
        for reason, n in sorted(self.data["skipped"].items()):
            out[f"Skipped ({reason})"] = n
        return out

    # -- recording (the connector holds its own lock around these) --------------------

    def record_hit(self, tokens: int) -> None:
        self.data["hit_requests"] += 1
        self.data["hit_tokens"] += tokens

    def record_skip(self, reason: str) -> None:
        skipped = self.data["skipped"]
        skipped[reason] = skipped.get(reason, 0) + 1

    def record_load(self, *, tokens: int, nbytes: int, seconds: float, complete: bool) -> None:
        self.data["loads"] += 1
        self.data["loaded_tokens"] += tokens
        self.data["loaded_bytes"] += nbytes
        self.data["load_seconds"].append(seconds)
        if not complete:
            self.data["load_errors"] += 1

    def record_save(self, nbytes: int | None) -> None:
        """A save published (`nbytes` of new chunks stored), or not made (None)."""
        if nbytes is None:
            self.data["save_errors"] += 1
        else:
            self.data["saves"] += 1
            self.data["saved_bytes"] += nbytes


class KvcPromMetrics(KVConnectorPromMetrics):
    """The connector's Prometheus metrics, registered through the metric classes vLLM passes
    (so they go wherever vLLM's other metrics go), one child per engine."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        # vLLM types the three classes as one union; each is used as what it is.
        counter: Any = self._counter_cls
        histogram: Any = self._histogram_cls
        self._counters: dict[str, dict[int, Any]] = {
            key: create_metric_per_engine(
                counter(name=name, documentation=doc, labelnames=labelnames),
                per_engine_labelvalues,
            )
            for key, (name, doc) in COUNTERS.items()
        }
        self._load_seconds: dict[int, Any] = create_metric_per_engine(
            histogram(
                name=LOAD_SECONDS[0],
                documentation=LOAD_SECONDS[1],
                buckets=LOAD_SECONDS_BUCKETS,
                labelnames=labelnames,
            ),
            per_engine_labelvalues,
        )
        self._skipped = counter(
            name=SKIPPED[0], documentation=SKIPPED[1], labelnames=[*labelnames, "reason"]
        )

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        stats = KvcConnectorStats(data=transfer_stats_data)
        for key, children in self._counters.items():
            if stats.data[key]:
                children[engine_idx].inc(stats.data[key])
        for seconds in stats.data["load_seconds"]:
            self._load_seconds[engine_idx].observe(seconds)
        labels = self.per_engine_labelvalues[engine_idx]
        for reason, n in stats.data["skipped"].items():
            self._skipped.labels(*labels, reason).inc(n)
