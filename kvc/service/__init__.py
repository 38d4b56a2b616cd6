"""The catalog over HTTP (`kvc serve`): a FastAPI app with per-namespace bearer tokens and metrics.

`auth` holds the tokens, `routes_*` the routes (plain `def`s: the catalog is
synchronous, so FastAPI runs them in its threadpool), `metrics` the Prometheus
counters and `app` the factory. The bodies are `catalog.wire`'s. See docs/http-api.md.
"""

from __future__ import annotations

from kvc.service.app import create_app
from kvc.service.auth import hash_token

__all__ = ["create_app", "hash_token"]
