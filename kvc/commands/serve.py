"""`kvc serve` (the catalog over HTTP) and `kvc serve-hash-token` (a line for the tokens file)."""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

import click

from catalog.identity import is_hex64
from kvc.commands.common import EXIT_USAGE, fail, open_catalog, settings_options, setup_logging
from kvc.settings import Settings, default_serve_workers

# Settings read from the environment that may hold a secret: `kvc serve` has read them
# (into the worker config file), so its worker processes do not inherit them.
SECRET_ENV = ("KVC_CATALOG_URL", "KVC_SERVICE_TOKEN")


def load_tokens(path: Path) -> dict[str, str]:
    """The tokens file: a JSON object mapping namespace -> sha256 hex of its bearer token."""
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        fail(f"tokens file {path} does not exist", EXIT_USAGE)
    except (OSError, UnicodeDecodeError) as exc:
        fail(f"cannot read tokens file {path}: {exc.__class__.__name__}", EXIT_USAGE)
    except json.JSONDecodeError as exc:
        fail(f"tokens file {path} is not JSON (line {exc.lineno})", EXIT_USAGE)
    if not isinstance(doc, dict) or not doc:
        fail(f"tokens file {path} must be a non-empty JSON object namespace -> sha256", EXIT_USAGE)
    for ns, h in doc.items():
        # Never echo the value: someone may have pasted a token instead of its hash.
        if not ns or not isinstance(h, str) or not is_hex64(h.lower()):
            fail(
                f"tokens file {path}: the entry for namespace {ns!r} is not a sha256 hex digest "
                "(make one with `kvc serve-hash-token`)",
                EXIT_USAGE,
            )
    return {str(ns): str(h).lower() for ns, h in doc.items()}


@click.command(
    "serve",
    epilog="""Example:

\b
  kvc serve-hash-token < token.txt   # -> put {"default": "<hash>"} in tokens.json
  kvc serve --catalog postgresql+psycopg://kvc@db/kvc --tokens-file tokens.json --port 8707
  curl -H "Authorization: Bearer $(cat token.txt)" http://127.0.0.1:8707/v1/namespaces/default/stats

See docs/http-api.md for the endpoints.""",
)
@settings_options
@click.option("--host", default=None, help="Address to bind (env KVC_HOST, default 127.0.0.1).")
@click.option("--port", type=int, default=None, help="Port (env KVC_PORT, default 8707).")
@click.option(
    "--tokens-file",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="JSON object namespace -> sha256 hex of its bearer token (env KVC_TOKENS_FILE). Required.",
)
@click.option(
    "--workers",
    type=click.IntRange(1, 256),
    default=None,
    help="Processes answering requests (env KVC_SERVE_WORKERS, default one per core, at most 8).",
)
@click.option(
    "--threads",
    type=click.IntRange(1, 1024),
    default=None,
    help="Requests each process handles at once (env KVC_SERVE_THREADS, default 8).",
)
@click.option("-v", "--verbose", is_flag=True, help="Log debug details to stderr.")
def serve(
    settings: Settings,
    as_json: bool,
    host: str | None,
    port: int | None,
    tokens_file: Path | None,
    workers: int | None,
    threads: int | None,
    verbose: bool,
) -> None:
    """Serve the catalog over HTTP to workers holding a namespace's bearer token.

    Each namespace in the tokens file is reachable only with its token; another
    namespace answers 404. GET /healthz and /metrics need no token."""
    import uvicorn

    from kvc.service import create_app
    from kvc.service.worker import pool_size

    setup_logging(verbose)
    path = tokens_file or settings.tokens_file
    if path is None:
        fail("no tokens file: pass --tokens-file or set KVC_TOKENS_FILE", EXIT_USAGE)
    tokens = load_tokens(path)
    bind_host = host or settings.host
    bind_port = port if port is not None else settings.port
    if not 1 <= bind_port <= 65535:
        fail(f"--port must be in 1..65535, got {bind_port}", EXIT_USAGE)
    processes = workers or settings.serve_workers or default_serve_workers()
    per_process = threads or settings.serve_threads
    log_level = "debug" if verbose else "info"
    if processes > 1:
        _serve_processes(settings, tokens, bind_host, bind_port, processes, per_process, log_level)
        return
    # Journal refs and pins to the stores the workers write to, when they are configured
    # (without KVC_STORES the service does not know where the blobs are).
    with open_catalog(
        settings, journal=bool(settings.stores), pool_size=pool_size(per_process)
    ) as cat:
        app = create_app(
            cat,
            tokens,
            max_prompt_tokens=settings.max_prompt_tokens,
            max_body_bytes=settings.max_body_bytes,
            threads=per_process,
        )
        click.echo(
            f"kvc: serving {cat.url} for {len(tokens)} namespace(s) on http://{bind_host}:{bind_port}",
            err=True,
        )
        uvicorn.run(app, host=bind_host, port=bind_port, log_level=log_level)


def _serve_processes(
    settings: Settings,
    tokens: dict[str, str],
    host: str,
    port: int,
    processes: int,
    threads: int,
    log_level: str,
) -> None:
    """uvicorn's supervisor and `processes` workers on one socket, each with its own catalog.

    The catalog is opened here first only so that a bad URL or schema is one line and exit 2,
    as with one process. Metrics are summed over the workers through files in a directory
    that lives as long as the service."""
    import uvicorn

    from kvc.service.worker import CONFIG_ENV, WorkerConfig, write_config

    with open_catalog(settings, journal=False) as cat:
        url = cat.url
    with (
        tempfile.TemporaryDirectory(prefix="kvc-serve-metrics-") as metrics_dir,
        tempfile.TemporaryDirectory(prefix="kvc-serve-config-") as private,  # mode 0700
    ):
        config = WorkerConfig(
            catalog_url=settings.resolved_catalog_url,
            journal_stores=settings.resolved_stores if settings.stores else [],
            tokens=tokens,
            max_prompt_tokens=settings.max_prompt_tokens,
            max_body_bytes=settings.max_body_bytes,
            threads=threads,
            metrics_dir=metrics_dir,
        )
        # The workers are new interpreters (spawned) and inherit this environment: they get
        # only the path of their config (it holds the catalog URL with its password), and
        # the variables that carried secrets to this process are not passed on.
        # prometheus_client reads its variable when it is first imported there.
        os.environ[CONFIG_ENV] = write_config(config, private)
        for name in SECRET_ENV:
            os.environ.pop(name, None)
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir
        click.echo(
            f"kvc: serving {url} for {len(tokens)} namespace(s) on http://{host}:{port}"
            f" with {processes} worker processes",
            err=True,
        )
        uvicorn.run(
            "kvc.service.worker:app_from_environment",
            factory=True,
            workers=processes,
            host=host,
            port=port,
            log_level=log_level,
        )


# The tokens file holds a plain sha256 of each token (no salt, no stretching, so that a
# request is checked in microseconds): the token itself must be unguessable. 32 characters
# is 128 bits as hex (`openssl rand -hex 16`), out of reach of an offline search of the hash.
MIN_TOKEN_CHARS = 32


@click.command(
    "serve-hash-token",
    epilog="""Example:

\b
  openssl rand -hex 32 > token.txt   # 64 random hex characters
  kvc serve-hash-token < token.txt""",
)
def serve_hash_token() -> None:
    """Print the sha256 hex of the token read from stdin (one line), for a tokens file.

    The token must be at least 32 characters (e.g. `openssl rand -hex 32`): the tokens
    file keeps an unsalted sha256 of it, so a short token could be found from the file
    by trying candidates. A shorter one exits 2 and prints nothing."""
    from kvc.service import hash_token

    token = sys.stdin.readline().strip()
    if not token:
        fail("no token on stdin", EXIT_USAGE)
    if len(token) < MIN_TOKEN_CHARS:
        # Never echo the token, not even in part.
        fail(
            f"the token is {len(token)} characters; at least {MIN_TOKEN_CHARS} characters are required "
            "(make one with `openssl rand -hex 32`)",
            EXIT_USAGE,
        )
    click.echo(hash_token(token))


def register(cli: click.Group) -> None:
    cli.add_command(serve)
    cli.add_command(serve_hash_token)
