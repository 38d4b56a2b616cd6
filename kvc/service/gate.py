"""Writes take a slot in the event loop before they take a thread, so reads never queue behind them.

The routes are plain `def`s run in the process's threadpool. A write waits for the
database's write lock (SQLite has one writer; PostgreSQL serializes conflicting rows), and
while it waits it holds a thread. Under load the threadpool filled with writes waiting for
each other and a lookup, on the path to a user's first token, waited for a thread behind
them (lookup p99 about 10x its median at 50 clients). `WriteGate` lets at most `slots`
writes of a process hold threads; the others wait, holding no thread, in a FIFO queue.
"""

from __future__ import annotations

import anyio
from starlette.types import ASGIApp, Receive, Scope, Send

from catalog.wire import API_ROOT

# POSTs that only read: their bodies are a query (a prompt, prefix hashes, a demand query).
READ_POSTS = frozenset({"lookup", "known", "with-tokens", "query"})


def is_write(scope: Scope) -> bool:
    """Whether this request changes the catalog: every method but GET and HEAD, except the
    POSTs of `READ_POSTS` under the API root."""
    method = scope.get("method", "GET")
    if method in ("GET", "HEAD"):
        return False
    path: str = scope.get("path", "")
    if method == "POST" and path.startswith(API_ROOT):
        return path.rsplit("/", 1)[-1] not in READ_POSTS
    return True


def write_slots(dialect: str, threads: int) -> int:
    """Writes of one process that may hold a thread at once: one on SQLite (one writer at a
    time anyway), half the threads on PostgreSQL (writes of different rows run together)."""
    return 1 if dialect == "sqlite" else max(1, threads // 2)


class WriteGate:
    """ASGI middleware: a write waits for one of `slots` before it goes on (see the module)."""

    def __init__(self, app: ASGIApp, slots: int) -> None:
        if slots < 1:
            raise ValueError(f"slots must be >= 1, got {slots!r}")
        self.app = app
        self.slots = slots
        self._semaphore: anyio.Semaphore | None = None  # made in the server's event loop

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not is_write(scope):
            await self.app(scope, receive, send)
            return
        if self._semaphore is None:
            self._semaphore = anyio.Semaphore(self.slots)
        async with self._semaphore:
            await self.app(scope, receive, send)
