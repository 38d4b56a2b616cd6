"""The demo: sessions sharing a long system prompt, checkpointed once, restored by the others, checked exact."""

from __future__ import annotations

import contextlib
import copy
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any, Protocol

import blake3
import numpy as np

from catalog import Catalog, RefConflictError
from catalog.base import CatalogAPI
from chunkstore import ChunkStore
from restore.engines.reference import ReferenceModel
from restore.pool import PagePool
from restore.session import Session


@dataclass
class SessionRow:
    session: str
    prompt_tokens: int
    restored: int
    recomputed: int
    ttft_ms: float
    straight_ttft_ms: float
    # None: restored from an earlier process whose KV is not here to compare with
    # (every blob was still verified against its digest and the catalog).
    exact: bool | None
    ref: str = ""  # the ref the session's conversation is checkpointed under
    forked_from: str | None = None  # the ref it was forked from, as the catalog records it


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
    engine: str
    exact_against: str


def _digest(x: np.ndarray[Any, Any]) -> str:
    return blake3.blake3(x.tobytes()).hexdigest()


@dataclass
class _Run:
    """One session's decode: tokens, a digest per logits vector, time to first token."""

    tokens: list[int]
    logits: list[str]
    ttft_s: float
    restored: int = 0


class _Engine(Protocol):
    """What the demo asks of an engine: decode without kvc, and with kvc (restore, compute
    the rest, decode, checkpoint the conversation), plus the proof that the kvc run is exact."""

    name: str
    exact_against: str  # what "exact" compares a kvc run with
    vocab_size: int
    bytes_per_token: int

    def straight(self, prompt: list[int], new_tokens: int) -> _Run: ...

    def with_kvc(self, prompt: list[int], new_tokens: int, name: str) -> _Run: ...

    def same_as_recomputed(self, prompt: list[int], run: _Run, new_tokens: int) -> bool | None: ...

    def close(self) -> None: ...


class _ReferenceEngine:
    """The numpy reference decoder on a page pool: every split of a prompt computes the same
    bits, so the kvc run must equal the straight run exactly."""

    def __init__(
        self,
        catalog: CatalogAPI,
        stores: list[ChunkStore],
        namespace: str,
        chunk_size: int,
        page_size: int,
        max_tokens: int,
    ) -> None:
        self.model = ReferenceModel.small(seed=0)
        self.name = "reference"
        self.exact_against = "a straight run without kvc"
        self.vocab_size = self.model.vocab_size
        self.bytes_per_token = self.model.layout.bytes_per_token
        self.namespace = namespace
        self.pool = PagePool(
            self.model.layout, page_size=page_size, num_pages=3 * max_tokens // page_size
        )
        self.session = Session(catalog, stores, namespace, chunk_size)
        self.checkpointer = self.session.checkpointer
        self.restorer = self.session.restorer
        self._straight: dict[tuple[int, ...], _Run] = {}

    def _decode(
        self, route: int, first: np.ndarray[Any, Any], n: int
    ) -> tuple[list[int], list[str]]:
        logits, out = [first], []
        for _ in range(n):
            t = int(np.argmax(logits[-1]))
            out.append(t)
            logits.append(self.model.decode(self.pool, route, t))
        return out, [_digest(x) for x in logits]

    def straight(self, prompt: list[int], new_tokens: int) -> _Run:
        t0 = time.perf_counter()
        route = self.pool.new_route()
        first = self.model.prefill(self.pool, route, prompt)
        ttft = time.perf_counter() - t0
        tokens, logits = self._decode(route, first, new_tokens)
        self.pool.release(route)
        run = _Run(tokens, logits, ttft)
        self._straight[tuple(prompt)] = run
        return run

    def with_kvc(self, prompt: list[int], new_tokens: int, name: str) -> _Run:
        t0 = time.perf_counter()
        res = self.restorer.restore(self.pool, prompt, self.model.fingerprint)
        route = res.route if res.route is not None else self.pool.new_route()
        first = self.model.prefill(self.pool, route, prompt[res.restored_tokens :])
        ttft = time.perf_counter() - t0
        tokens, logits = self._decode(route, first, new_tokens)
        # Checkpoint the whole conversation so far (prompt + generated, but the
        # last generated token is still pending: it has no KV yet).
        self.checkpointer.checkpoint(
            self.pool,
            route,
            prompt + tokens[:-1],
            self.model.fingerprint,
            name=name,
            pending=tokens[-1],
        )
        self.pool.release(route)
        return _Run(tokens, logits, ttft, res.restored_tokens)

    def same_as_recomputed(self, prompt: list[int], run: _Run, new_tokens: int) -> bool:
        want = self._straight[tuple(prompt)]
        return (run.tokens, run.logits) == (want.tokens, want.logits)

    def close(self) -> None:
        self.session.close()


class _HFEngine:
    """A transformers model through `HFAdapter`. torch may round a prefix computed in one
    piece differently from the same prefix computed in pieces, so a kvc run is checked
    against the KV it promises to give back: the cache of the earlier session that
    computed the restored prefix, cut at the same position, continued with the same rest.
    A run that restored nothing must equal the straight run."""

    def __init__(
        self,
        model: Any,
        catalog: CatalogAPI,
        stores: list[ChunkStore],
        namespace: str,
        chunk_size: int,
    ) -> None:
        from restore.engines import hf

        self.hf = hf
        self.model = model
        self.name = f"transformers {type(model).__name__}"
        self.exact_against = (
            "the KV of the session that computed the restored prefix, continued alike"
        )
        self.kv = hf.HFAdapter(model, catalog, stores, namespace, chunk_size)
        self.vocab_size = int(model.config.get_text_config(decoder=True).vocab_size)
        self.bytes_per_token = self.kv.layout.bytes_per_token
        self._straight: dict[tuple[int, ...], _Run] = {}
        self._sessions: list[tuple[list[int], Any]] = []  # (tokens the cache holds, the cache)

    def _run(self, prompt: list[int], cache: Any, start: int, new_tokens: int) -> _Run:
        g = self.hf.greedy(self.model, prompt, cache, start, new_tokens)
        return _Run(g.tokens, [_digest(x) for x in g.logits], g.first_token_s, start)

    def straight(self, prompt: list[int], new_tokens: int) -> _Run:
        run = self._run(prompt, self.kv.new_cache(), 0, new_tokens)
        self._straight[tuple(prompt)] = run
        return run

    def with_kvc(self, prompt: list[int], new_tokens: int, name: str) -> _Run:
        t0 = time.perf_counter()
        cache, n = self.kv.restore(prompt)
        restore_s = time.perf_counter() - t0
        run = self._run(prompt, cache, n, new_tokens)
        run.ttft_s += restore_s
        conversation = prompt + run.tokens
        self.kv.checkpoint(conversation, cache, name=name)
        self._sessions.append((conversation[:-1], cache))
        return run

    def same_as_recomputed(self, prompt: list[int], run: _Run, new_tokens: int) -> bool | None:
        n = run.restored
        if n == 0:
            want = self._straight[tuple(prompt)]
            return (run.tokens, run.logits) == (want.tokens, want.logits)
        earlier = self._sessions[:-1]  # the last one is this run's own session
        source = next((c for toks, c in earlier if toks[:n] == prompt[:n]), None)
        if source is None:
            return None  # computed by an earlier process
        cut = copy.deepcopy(source)
        cut.crop(n - cut.get_seq_length())  # transformers crops by a negative count
        again = self._run(prompt, cut, n, new_tokens)
        return (again.tokens, again.logits) == (run.tokens, run.logits)

    def close(self) -> None:
        self.kv.close()


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
    hf_model: Any = None,
    progress: Callable[[str], None] | None = None,
    on_row: Callable[[SessionRow], None] | None = None,
) -> DemoReport:
    """Run the demo sessions on the reference decoder, or on `hf_model` (a loaded
    transformers model); every session is checked exact (see the engines' docstrings).
    `progress(name)` is called as each session starts, `on_row(row)` as it finishes."""
    engine: _Engine = (
        _HFEngine(hf_model, catalog, stores, namespace, chunk_size)
        if hf_model is not None
        else _ReferenceEngine(
            catalog, stores, namespace, chunk_size, page_size, system_tokens + 1024
        )
    )
    rng = np.random.default_rng(2026)
    vocab = engine.vocab_size
    system = rng.integers(0, vocab, system_tokens).tolist()
    questions = [
        rng.integers(0, vocab, int(rng.integers(40, 120))).tolist() for _ in range(sessions)
    ]
    follow_up = rng.integers(0, vocab, 48).tolist()
    rows: list[SessionRow] = []
    history: dict[str, list[int]] = {}
    step = progress or (lambda _msg: None)

    def session(name: str, prompt: list[int]) -> None:
        step(name)
        straight = engine.straight(prompt, new_tokens)  # what the engine does without kvc
        ref = f"{namespace}/{name}"
        run = engine.with_kvc(prompt, new_tokens, ref)
        history[name] = prompt + run.tokens
        rows.append(
            SessionRow(
                name,
                len(prompt),
                run.restored,
                len(prompt) - run.restored,
                run.ttft_s * 1e3,
                straight.ttft_s * 1e3,
                engine.same_as_recomputed(prompt, run, new_tokens),
                ref,
                catalog.get_ref(namespace, ref).forked_from,
            )
        )
        if on_row is not None:
            on_row(rows[-1])

    try:
        for i, q in enumerate(questions):
            session(f"chat-{i}", system + q)
        # A forked conversation: chat-0 went on with a follow-up question. The fork's ref
        # starts at chat-0's head and remembers it (an earlier run's fork is kept as it is).
        fork = f"{namespace}/chat-0-fork"
        with contextlib.suppress(RefConflictError):
            catalog.fork_ref(namespace, f"{namespace}/chat-0", fork, actor="kvc demo")
        session("chat-0-fork", history["chat-0"] + follow_up)
    finally:
        engine.close()

    stored = int(catalog.stats(namespace)["stored_bytes"])
    per_session = sum(r.prompt_tokens + new_tokens - 1 for r in rows) * engine.bytes_per_token
    later = [r for r in rows if r.restored > 0]
    speedup = (
        sum(r.straight_ttft_ms for r in later) / sum(r.ttft_ms for r in later) if later else 0.0
    )
    return DemoReport(
        sessions=rows,
        stored_bytes=stored,
        per_session_file_bytes=per_session,
        restore_speedup=speedup,
        exact=all(r.exact is not False for r in rows),
        namespace=namespace,
        catalog=catalog.url,
        stores=[s.name for s in stores],
        engine=engine.name,
        exact_against=engine.exact_against,
    )


def report_dict(rep: DemoReport) -> dict[str, Any]:
    return asdict(rep)
