"""`kvc daemon`: serve a page pool's checkpoints and restores over loopback HTTP beside an engine."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import click

from kvc.commands.common import EXIT_USAGE, emit, fail, open_catalog, open_stores, settings_options
from kvc.settings import Settings


@click.command(
    "daemon",
    epilog="Example: kvc daemon --worker-id gpu0 --port 8708\n\n"
    "then: curl -s localhost:8708/v1/configure -d "
    '\'{"fingerprint": "reference", "num_pages": 256}\' -H content-type:application/json',
)
@settings_options
@click.option(
    "--host",
    default="127.0.0.1",
    show_default=True,
    help="Address to bind; anything but loopback exposes the pool to the network.",
)
@click.option(
    "--port",
    type=click.IntRange(1, 65535),
    default=None,
    help="Port to bind (env KVC_DAEMON_PORT, default 8708).",
)
@click.option(
    "--allowed-host",
    "allowed_hosts",
    multiple=True,
    metavar="NAME",
    help="A host name the daemon answers to besides loopback and --host (repeatable; env "
    "KVC_DAEMON_ALLOWED_HOSTS, comma-separated). Requests naming any other Host, or sent "
    "by a web page of another origin, are refused with 403.",
)
@click.option(
    "--worker-id",
    default=None,
    help="Name of this worker in the catalog's resident replicas (env KVC_WORKER_ID, "
    "default HOSTNAME-PID). Keep it stable across restarts so a restart withdraws "
    "what the previous process advertised.",
)
@click.option(
    "--invalidation-interval",
    type=click.FloatRange(0, 86400),
    default=None,
    metavar="SECONDS",
    help="How often to apply quarantine invalidations addressed to this worker, dropping "
    "the routes that hold quarantined chunks (env KVC_DAEMON_INVALIDATION_INTERVAL, "
    "default 2; 0 disables: then only POST /v1/refresh applies them).",
)
def daemon(
    settings: Settings,
    as_json: bool,
    host: str,
    port: int | None,
    allowed_hosts: tuple[str, ...],
    worker_id: str | None,
    invalidation_interval: float | None,
) -> None:
    """Run the checkpoint/restore daemon beside an inference engine.

    The daemon owns one page pool, configured over HTTP for the engine's model
    fingerprint. It checkpoints routes into the first store, restores prompts
    from every store, and advertises the chunks its pool holds as resident
    replicas of worker:WORKER_ID. On start it withdraws the resident replicas
    a previous process under the same worker id left behind. Every
    --invalidation-interval seconds it drops the routes holding chunks a
    quarantine invalidated on this worker. With KVC_SERVICE_URL (and
    KVC_SERVICE_TOKEN) set it uses that `kvc serve` service as its catalog
    instead of opening a database. Endpoints: see docs/daemon.md."""
    import uvicorn

    from kvc.daemon import Daemon, create_daemon_app
    from restore.errors import RestoreError

    worker = worker_id or settings.worker_id or f"{socket.gethostname()}-{os.getpid()}"
    bind_port = port if port is not None else settings.daemon_port
    interval = (
        invalidation_interval
        if invalidation_interval is not None
        else settings.daemon_invalidation_interval
    )
    stores = open_stores(settings)
    try:
        with daemon_catalog(settings) as cat:
            try:
                d = Daemon(
                    cat,
                    stores,
                    worker_id=worker,
                    namespace=settings.namespace,
                    chunk_size=settings.chunk_size,
                    page_size=settings.page_size,
                    invalidation_interval=interval,
                    write_behind_bytes=settings.write_behind_bytes,
                )
            except (RestoreError, ValueError) as exc:
                fail(str(exc), EXIT_USAGE)
            with d:
                withdrawn = d.reconcile()
                emit(
                    as_json,
                    {
                        "worker": worker,
                        "url": f"http://{host}:{bind_port}",
                        "namespace": settings.namespace,
                        "withdrawn": withdrawn,
                        "invalidation_interval": interval,
                    },
                    f"kvc daemon: worker {worker} on http://{host}:{bind_port} "
                    f"(namespace {settings.namespace}; withdrew {withdrawn} stale resident replicas; "
                    + (
                        f"invalidations every {interval:g}s)"
                        if interval > 0
                        else "invalidations on /v1/refresh only)"
                    ),
                )
                app = create_daemon_app(
                    d,
                    host=host,
                    port=bind_port,
                    allowed_hosts=list(allowed_hosts) or settings.daemon_allowed_hosts,
                )
                uvicorn.run(app, host=host, port=bind_port, log_level="info")
    finally:
        for s in stores:
            s.close()


@contextmanager
def daemon_catalog(settings: Settings) -> Iterator[Any]:
    """The catalog `settings` name: the `kvc serve` service at `service_url` (a
    `RemoteCatalog` with `service_token`), else the database (`open_catalog`)."""
    if settings.service_url is None:
        with open_catalog(settings, upgrade=settings.uses_embedded_default) as cat:
            yield cat
        return
    if not settings.service_token:
        fail(
            "KVC_SERVICE_URL is set but KVC_SERVICE_TOKEN is not: the service needs the "
            f"bearer token of namespace {settings.namespace!r}",
            EXIT_USAGE,
        )
    from catalog.remote import RemoteCatalog

    remote = RemoteCatalog(
        settings.service_url, settings.service_token, namespace=settings.namespace
    )
    try:
        yield remote
    finally:
        remote.close()


def register(cli: click.Group) -> None:
    cli.add_command(daemon)
