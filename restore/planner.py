"""The planner: fork resident pages, restore from a tier, or recompute, whichever reaches the first token soonest."""

from __future__ import annotations

import math
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from chunkstore.units import human_bytes, human_rate

Action = Literal["fork", "restore", "recompute"]

# Conservative starting rates, replaced by measurements as soon as there are any.
DEFAULT_TIER_BYTES_PER_S = {"resident": 20e9, "local": 1e9, "object": 100e6}


@dataclass(frozen=True)
class Option:
    action: Action
    reuse_tokens: int
    est_seconds: float
    detail: str


@dataclass(frozen=True)
class Decision:
    """The chosen option, why (with the numbers), and the options it beat."""

    action: Action
    reuse_tokens: int
    est_seconds: float
    reason: str
    options: tuple[Option, ...] = field(default=())


class Planner:
    """Estimates time to first token per option from rates measured on this deployment.

    Restore rates are what `Restorer.tier_rates` measured (`use_measured`); the
    prefill rate is a moving average of the prefills the engine reported
    (`observe_prefill`), starting from the rate the engine was configured with.
    """

    def __init__(
        self,
        prefill_tokens_per_s: float,
        tier_bytes_per_s: dict[str, float] | None = None,
        *,
        restore_overhead_s: float = 0.002,
        fork_overhead_s: float = 0.0001,
        smoothing: float = 0.2,
    ) -> None:
        if prefill_tokens_per_s <= 0:
            raise ValueError("prefill_tokens_per_s must be positive")
        self.prefill_tokens_per_s = prefill_tokens_per_s
        self.tier_bytes_per_s = {**DEFAULT_TIER_BYTES_PER_S, **(tier_bytes_per_s or {})}
        self.restore_overhead_s = restore_overhead_s
        self.fork_overhead_s = fork_overhead_s
        self._alpha = smoothing
        self._lock = threading.Lock()

    def use_measured(self, tier_bytes_per_s: Mapping[str, float]) -> None:
        """Take rates measured elsewhere (`Restorer.tier_rates`) as they are, per tier."""
        with self._lock:
            self.tier_bytes_per_s.update(
                {t: r for t, r in tier_bytes_per_s.items() if r > 0 and math.isfinite(r)}
            )

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        """Fold a prefill the engine just did into the prefill rate (a moving average)."""
        if tokens > 0 and seconds > 0:
            with self._lock:
                rate = tokens / seconds
                self.prefill_tokens_per_s = (
                    1 - self._alpha
                ) * self.prefill_tokens_per_s + self._alpha * rate

    def plan(
        self,
        prompt_tokens: int,
        *,
        resident_tokens: int = 0,
        restorable_tokens: int = 0,
        restore_bytes: int = 0,
        tier: str = "local",
    ) -> Decision:
        """Choose for a prompt of `prompt_tokens` given what is resident and what a lookup found."""
        if prompt_tokens < 1:
            raise ValueError("a prompt has at least one token")
        with self._lock:
            tps = self.prefill_tokens_per_s
            rate = self.tier_bytes_per_s.get(tier)
        if rate is None:
            raise ValueError(f"no rate known for tier {tier!r}")
        options = [
            Option(
                "recompute",
                0,
                prompt_tokens / tps,
                f"prefill {prompt_tokens} tokens at {tps:,.0f} tok/s",
            ),
        ]
        if resident_tokens > 0:
            rest = prompt_tokens - resident_tokens
            options.append(
                Option(
                    "fork",
                    resident_tokens,
                    self.fork_overhead_s + rest / tps,
                    f"fork {resident_tokens} resident tokens, prefill {rest}",
                )
            )
        if restorable_tokens > 0:
            rest = prompt_tokens - restorable_tokens
            fetch = restore_bytes / rate
            options.append(
                Option(
                    "restore",
                    restorable_tokens,
                    self.restore_overhead_s + fetch + rest / tps,
                    f"restore {restorable_tokens} tokens ({human_bytes(restore_bytes)} from {tier} "
                    f"at {human_rate(rate)} = {fetch * 1e3:.1f} ms), prefill {rest}",
                )
            )
        best = min(options, key=lambda o: (o.est_seconds, o.action != "fork"))
        others = "; ".join(
            f"{o.action} {o.est_seconds * 1e3:.1f} ms ({o.detail})"
            for o in options
            if o is not best
        )
        reason = f"{best.action}: est. {best.est_seconds * 1e3:.1f} ms ({best.detail})" + (
            f"; beats {others}" if others else ""
        )
        return Decision(best.action, best.reuse_tokens, best.est_seconds, reason, tuple(options))
