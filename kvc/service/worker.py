"""One process of `kvc serve --workers N`: its app, made from what `kvc serve` put in the environment."""

from __future__ import annotations

import os

from fastapi import FastAPI
from pydantic import BaseModel

from catalog import Catalog
from kvc.service.app import create_app

CONFIG_ENV = "KVC_SERVE_WORKER_CONFIG"
"""The variable `kvc serve` passes the path of a `WorkerConfig` file (JSON) in to the
processes it starts. Only the path: the config holds the catalog URL, whose password must
not sit in any process's environment (/proc/PID/environ, crash reports, child processes)."""


class WorkerConfig(BaseModel):
    """What every worker process needs to serve: `kvc serve` resolved it once, from flags,
    environment and kvc.toml, and checked it (the catalog opens, the tokens file parses)."""

    catalog_url: str
    journal_stores: list[str]  # empty: no journal
    tokens: dict[str, str]  # namespace -> sha256 hex of its token, never a token
    max_prompt_tokens: int
    max_body_bytes: int
    threads: int
    metrics_dir: str


def write_config(config: WorkerConfig, directory: str) -> str:
    """Write `config` to a new file readable by this user only in `directory` (a private
    directory that lives as long as the service); return its path."""
    path = os.path.join(directory, "worker-config.json")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(config.model_dump_json())
    return path


def pool_size(threads: int) -> int:
    """Database connections for a process of `threads` request threads: one each, and one
    for the access-statistics flusher and one for a health check."""
    return threads + 2


def app_from_environment() -> FastAPI:
    """The app of one worker (uvicorn's app factory): its own catalog connections and journal,
    closed when uvicorn shuts the worker down; metrics shared through `metrics_dir`."""
    with open(os.environ[CONFIG_ENV], encoding="utf-8") as f:
        config = WorkerConfig.model_validate_json(f.read())
    catalog = Catalog.open(config.catalog_url, pool_size=pool_size(config.threads))
    journal = None
    if config.journal_stores:
        from restore.journal import StoreJournal

        journal = StoreJournal.from_urls(config.journal_stores)
        catalog.add_change_listener(journal)

    def close() -> None:
        catalog.close()
        if journal is not None:
            journal.close()

    return create_app(
        catalog,
        config.tokens,
        max_prompt_tokens=config.max_prompt_tokens,
        max_body_bytes=config.max_body_bytes,
        threads=config.threads,
        metrics_dir=config.metrics_dir,
        on_close=close,
    )
