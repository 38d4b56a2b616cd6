"""`kvc demo`: the main job, on the embedded default unless configured otherwise."""

from __future__ import annotations

import sys

import click

from kvc.commands.common import EXIT_PROBLEMS, emit, open_catalog, open_stores, settings_options
from kvc.settings import Settings


@click.command(
    "demo",
    epilog="Example: kvc demo      (then: kvc log demo/chat-1 --namespace demo)",
)
@settings_options
@click.option(
    "--sessions",
    default=4,
    show_default=True,
    type=click.IntRange(1, 32),
    help="Sessions sharing the system prompt.",
)
@click.option(
    "--system-tokens",
    default=1536,
    show_default=True,
    type=click.IntRange(16, 16384),
    help="Length of the shared system prompt.",
)
@click.option(
    "--new-tokens",
    default=8,
    show_default=True,
    type=click.IntRange(1, 256),
    help="Tokens each session generates.",
)
def demo(
    settings: Settings, as_json: bool, sessions: int, system_tokens: int, new_tokens: int
) -> None:
    """Show what kvc is for, with a small reference decoder.

    Several sessions share a long system prompt (and one forks a conversation):
    the first computes and checkpoints, the later ones restore the shared prefix
    and compute only their own suffix. Every session is checked token- and
    bit-exact against a straight run without kvc; the command exits 1 if any
    is not exact."""
    from tqdm import tqdm

    from kvc.demo import report_dict, run_demo

    namespace = settings.namespace if settings.namespace != "default" else "demo"
    stores = open_stores(settings)
    with open_catalog(settings, upgrade=settings.uses_embedded_default) as cat:
        cat.ensure_namespace(namespace, settings.chunk_size)
        bar = tqdm(
            total=sessions + 1,
            desc="kvc demo",
            unit="session",
            file=sys.stderr,
            disable=as_json or not sys.stderr.isatty(),
        )

        def progress(name: str) -> None:  # called as each session starts
            bar.set_postfix_str(name)
            bar.update(1)

        rep = run_demo(
            cat,
            stores,
            namespace=namespace,
            chunk_size=settings.chunk_size,
            page_size=settings.page_size,
            system_tokens=system_tokens,
            sessions=sessions,
            new_tokens=new_tokens,
            progress=progress,
        )
        bar.close()
    for s in stores:
        s.close()
    lines = [
        f"kvc demo: namespace {rep.namespace!r}, catalog {rep.catalog}, stores {', '.join(rep.stores)}",
        "",
        f"{'session':<14}{'prompt':>8}{'restored':>10}{'recomputed':>12}{'TTFT ms':>10}{'no-kvc ms':>11}  verified",
    ]
    for r in rep.sessions:
        lines.append(
            f"{r.session:<14}{r.prompt_tokens:>8}{r.restored:>10}{r.recomputed:>12}{r.ttft_ms:>10.1f}"
            f"{r.straight_ttft_ms:>11.1f}  {'exact' if r.exact else 'NOT EXACT'}"
        )
    lines += [
        "",
        f"stored by kvc: {rep.stored_bytes / 1e6:.1f} MB; one file per session would take "
        f"{rep.per_session_file_bytes / 1e6:.1f} MB",
        f"time to first token with restore: {rep.restore_speedup:.1f}x faster than recomputing "
        "(sessions that restored)",
        "every session token- and bit-exact against a straight run"
        if rep.exact
        else "SOME SESSIONS ARE NOT EXACT",
    ]
    emit(as_json, report_dict(rep), "\n".join(lines))
    if not rep.exact:
        sys.exit(EXIT_PROBLEMS)


def register(cli: click.Group) -> None:
    cli.add_command(demo)
