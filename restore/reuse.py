"""Reuse of a stored prefix on a page pool: plan it (fork resident pages, restore from a tier, or
recompute) and carry the plan out."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from catalog import Fingerprint
from catalog.models import Match
from restore.planner import Decision, Planner
from restore.pool import PagePool
from restore.residency import Residency
from restore.restore import Restorer

__all__ = ["Reuse", "plan_reuse", "reuse_prefix"]


@dataclass
class Reuse:
    """What `reuse_prefix` did: `decision` (with its reason) and, unless it chose to
    recompute, the `route` holding the first `restored_tokens` positions of the prompt."""

    decision: Decision
    prompt_tokens: int
    route: int | None = None
    restored_tokens: int = 0
    chunks: int = 0
    bytes: int = 0
    failures: list[str] = field(default_factory=list)

    @property
    def recompute_from(self) -> int:
        return self.restored_tokens

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready, the decision with its reason and every option's estimate included."""
        d = self.decision
        options = [
            {"action": o.action, "reuse_tokens": o.reuse_tokens, "est_seconds": o.est_seconds}
            for o in d.options
        ]
        return {
            "route": self.route,
            "restored_tokens": self.restored_tokens,
            "recompute_from": self.recompute_from,
            "prompt_tokens": self.prompt_tokens,
            "chunks": self.chunks,
            "bytes": self.bytes,
            "failures": list(self.failures),
            "decision": {"action": d.action, "reason": d.reason, "options": options},
        }


def plan_reuse(
    planner: Planner, restorer: Restorer, residency: Residency, match: Match
) -> Decision | None:
    """The planner's choice for a lookup hit, from the rates the restorer measured on this
    deployment; None when nothing of it can be reused here (no route holds it, no store
    this restorer reads has it)."""
    if not match.hit:
        return None
    resident = residency.resident_prefix(match)
    tokens, nbytes, tier = restorer.readable_prefix(match)
    if resident is None and tier is None:
        return None
    planner.use_measured(restorer.tier_rates)
    return planner.plan(
        match.prompt_tokens,
        resident_tokens=0 if resident is None else resident.tokens,
        restorable_tokens=tokens,
        restore_bytes=nbytes,
        tier=tier or "local",
    )


def reuse_prefix(
    planner: Planner,
    restorer: Restorer,
    residency: Residency,
    pool: PagePool,
    fingerprint: Fingerprint,
    tokens: Sequence[int],
) -> Reuse | None:
    """Look `tokens` up, plan, and carry the plan out on `residency`'s current `pool`.

    - fork: a new route shares the resident route's pages (nothing is fetched);
    - restore: the longest verified stored prefix is loaded into a new route;
    - recompute: nothing is loaded; the engine prefills the whole prompt.

    The new route's whole chunks are held (and advertised by `residency.sync`,
    which the caller runs). None on a miss, or when no chunk could be restored.
    """
    toks = list(tokens)
    match = restorer.catalog.lookup(restorer.namespace, fingerprint, toks)
    decision = plan_reuse(planner, restorer, residency, match)
    if decision is None:
        return None
    out = Reuse(decision, len(toks))
    if decision.action == "fork":
        resident = residency.resident_prefix(match)
        if resident is None or resident.tokens < decision.reuse_tokens:
            return None  # released since planning: a miss, as if it never was
        out.route = residency.fork(pool, resident.route, decision.reuse_tokens)
        out.restored_tokens = decision.reuse_tokens
    elif decision.action == "restore":
        result = restorer.restore(pool, toks, fingerprint, match=match)
        if result.route is None:
            return None
        residency.hold(pool, result.route, residency.restored_chunks(match, result.restored_tokens))
        out.route = result.route
        out.restored_tokens = result.restored_tokens
        out.chunks = result.report.chunks
        out.bytes = result.report.bytes
        out.failures = list(result.report.failures)
    return out
