"""The demo: sessions sharing a long system prompt, checkpointed once, restored by the others, checked exact."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import blake3
import numpy as np

from catalog import Catalog
from chunkstore import ChunkStore
from restore.checkpoint import Checkpointer
from restore.engines.reference import ReferenceModel
from restore.pool import PagePool
from restore.restore import Restorer


@dataclass
class SessionRow:
    session: str
    prompt_tokens: int
    restored: int
    recomputed: int
    ttft_ms: float
    straight_ttft_ms: float
    exact: bool


@dataclass
class DemoReport:
    sessions: list[SessionRow]
    stored_bytes: int
    per_session_file_bytes: int
    restore_speedup: float
    exact: bool
    namespace: str
    catalog: str
    stores: list[str]


def _digest(x: np.ndarray[Any, Any]) -> str:
    return blake3.blake3(x.tobytes()).hexdigest()


def _decode(
    model: ReferenceModel, pool: PagePool, route: int, first: np.ndarray[Any, Any], n: int
) -> tuple[list[int], list[str]]:
    logits, out = [first], []
    for _ in range(n):
        t = int(np.argmax(logits[-1]))
        out.append(t)
        logits.append(model.decode(pool, route, t))
    return out, [_digest(x) for x in logits]


def run_demo(
    catalog: Catalog,
    stores: list[ChunkStore],
    *,
    namespace: str = "demo",
    chunk_size: int = 256,
    page_size: int = 16,
    system_tokens: int = 1536,
    sessions: int = 4,
    new_tokens: int = 8,
    progress: Callable[[str], None] | None = None,
) -> DemoReport:
    """Run the demo sessions; every session is checked against a straight run without kvc."""
    model = ReferenceModel.small(seed=0)
    rng = np.random.default_rng(2026)
    system = rng.integers(0, model.vocab_size, system_tokens).tolist()
    questions = [
        rng.integers(0, model.vocab_size, int(rng.integers(40, 120))).tolist()
        for _ in range(sessions)
    ]
    follow_up = rng.integers(0, model.vocab_size, 48).tolist()
    pool = PagePool(
        model.layout, page_size=page_size, num_pages=(system_tokens + 1024) * 3 // page_size
    )
    primary, *others = stores
    write_behind = next((s for s in others if s.name.startswith("s3:")), None)
    rows: list[SessionRow] = []
    history: dict[str, list[int]] = {}
    step = progress or (lambda _msg: None)

    with (
        Checkpointer(
            catalog, primary, namespace, chunk_size=chunk_size, write_behind=write_behind
        ) as cp,
        Restorer(catalog, stores, namespace) as restorer,
    ):

        def session(name: str, prompt: list[int]) -> None:
            step(name)
            # Straight run: what the engine would do without kvc.
            t0 = time.perf_counter()
            route = pool.new_route()
            first = model.prefill(pool, route, prompt)
            straight_ttft = time.perf_counter() - t0
            want = _decode(model, pool, route, first, new_tokens)
            pool.release(route)
            # With kvc: restore the longest stored prefix, compute only the rest.
            t0 = time.perf_counter()
            res = restorer.restore(pool, prompt, model.fingerprint)
            route = res.route if res.route is not None else pool.new_route()
            first = model.prefill(pool, route, prompt[res.restored_tokens :])
            ttft = time.perf_counter() - t0
            got = _decode(model, pool, route, first, new_tokens)
            # Checkpoint the whole conversation so far (prompt + generated, but the
            # last generated token is still pending: it has no KV yet).
            conversation = prompt + got[0][:-1]
            cp.checkpoint(
                pool,
                route,
                conversation,
                model.fingerprint,
                name=f"{namespace}/{name}",
                pending=got[0][-1],
            )
            pool.release(route)
            history[name] = prompt + got[0]
            rows.append(
                SessionRow(
                    name,
                    len(prompt),
                    res.restored_tokens,
                    len(prompt) - res.restored_tokens,
                    ttft * 1e3,
                    straight_ttft * 1e3,
                    got == want,
                )
            )

        for i, q in enumerate(questions):
            session(f"chat-{i}", system + q)
        # A forked conversation: chat-0 went on with a follow-up question.
        session("chat-0-fork", history["chat-0"] + follow_up)

    stored = int(catalog.stats(namespace)["stored_bytes"])
    per_session = sum(r.prompt_tokens + new_tokens - 1 for r in rows) * model.layout.bytes_per_token
    later = [r for r in rows if r.restored > 0]
    speedup = (
        sum(r.straight_ttft_ms for r in later) / sum(r.ttft_ms for r in later) if later else 0.0
    )
    return DemoReport(
        sessions=rows,
        stored_bytes=stored,
        per_session_file_bytes=per_session,
        restore_speedup=speedup,
        exact=all(r.exact for r in rows),
        namespace=namespace,
        catalog=catalog.url,
        stores=[s.name for s in stores],
    )


def report_dict(rep: DemoReport) -> dict[str, Any]:
    return asdict(rep)
