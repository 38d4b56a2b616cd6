"""`kvc demo`: the main job, on the embedded default unless configured otherwise."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

import click

from kvc.commands.common import (
    EXIT_PROBLEMS,
    EXIT_USAGE,
    emit,
    fail,
    open_catalog,
    open_stores,
    settings_options,
)
from kvc.commands.format import human_bytes
from kvc.settings import Settings

if TYPE_CHECKING:
    from kvc.demo import SessionRow


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
@click.option(
    "--engine",
    type=click.Choice(["reference", "hf"]),
    default="reference",
    show_default=True,
    help="reference: kvc's numpy decoder. hf: a Hugging Face transformers model (needs .[hf]).",
)
@click.option(
    "--model",
    "model_path",
    metavar="PATH_OR_ID",
    help="With --engine hf: a local checkpoint directory, or a hub id where there is network. "
    "Default: a small random-init Llama built under the home directory.",
)
def demo(
    settings: Settings,
    as_json: bool,
    sessions: int,
    system_tokens: int,
    new_tokens: int,
    engine: str,
    model_path: str | None,
) -> None:
    """Show what kvc is for, with a small reference decoder or a transformers model.

    Several sessions share a long system prompt (and one forks a conversation):
    the first computes and checkpoints, the later ones restore the shared prefix
    and compute only their own suffix. Every session is checked exact; the
    command exits 1 if any is not. With the reference decoder the check is
    against a straight run without kvc (it computes every split alike); with
    transformers it is against recomputing the restored prefix and then the
    same rest (torch may round one long prefill differently from two)."""
    from tqdm import tqdm

    from kvc.demo import report_dict, run_demo

    if model_path is not None and engine != "hf":
        fail("--model needs --engine hf", EXIT_USAGE)
    hf_model = _load_hf_model(settings, model_path, as_json) if engine == "hf" else None
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
            bar.set_postfix_str(f"{name} running")

        def on_row(row: SessionRow) -> None:  # each session's row as soon as it is done
            if not as_json:
                bar.write(_row(row), file=sys.stdout)  # clears the bar, prints, redraws it
                sys.stdout.flush()
            bar.set_postfix_str(f"{row.session} done", refresh=False)
            bar.update(1)

        if not as_json:
            label = "reference" if hf_model is None else f"transformers {type(hf_model).__name__}"
            for line in (
                f"kvc demo ({label}): namespace {namespace!r}, catalog {cat.url}, "
                f"stores {', '.join(s.name for s in stores)}",
                "",
                HEADER,
            ):
                click.echo(line)
        rep = run_demo(
            cat,
            stores,
            namespace=namespace,
            chunk_size=settings.chunk_size,
            page_size=settings.page_size,
            system_tokens=system_tokens,
            sessions=sessions,
            new_tokens=new_tokens,
            hf_model=hf_model,
            progress=progress,
            on_row=on_row,
        )
        bar.close()
    for s in stores:
        s.close()
    lines = [""]
    lines += [
        f"{r.ref} was forked from {r.forked_from} (kvc show {r.ref} --namespace {rep.namespace})"
        for r in rep.sessions
        if r.forked_from is not None
    ]
    lines += [
        f"stored by kvc: {human_bytes(rep.stored_bytes)}; one file per session would take "
        f"{human_bytes(rep.per_session_file_bytes)}",
        f"time to first token with restore: {rep.restore_speedup:.1f}x faster than recomputing "
        "(sessions that restored)",
        _summary(rep),
    ]
    emit(as_json, report_dict(rep), "\n".join(lines))
    if not rep.exact:
        sys.exit(EXIT_PROBLEMS)


def _summary(rep: Any) -> str:
    if not rep.exact:
        return "SOME SESSIONS ARE NOT EXACT"
    exact = sum(1 for r in rep.sessions if r.exact)
    if exact == len(rep.sessions):
        return f"every session token- and bit-exact against {rep.exact_against}"
    return (
        f"{exact} session(s) token- and bit-exact against {rep.exact_against}; "
        f"{len(rep.sessions) - exact} restored KV an earlier run computed (verified against "
        "its digests; that run's KV is not here to compare with)"
    )


def _verdict(exact: bool | None) -> str:
    return "verified" if exact is None else "exact" if exact else "NOT EXACT"


HEADER = f"{'session':<14}{'prompt':>8}{'restored':>10}{'recomputed':>12}{'TTFT ms':>10}{'no-kvc ms':>11}  verified"


def _row(r: SessionRow) -> str:
    return (
        f"{r.session:<14}{r.prompt_tokens:>8}{r.restored:>10}{r.recomputed:>12}{r.ttft_ms:>10.1f}"
        f"{r.straight_ttft_ms:>11.1f}  {_verdict(r.exact)}"
    )


def _load_hf_model(settings: Settings, model_path: str | None, as_json: bool) -> Any:
    try:
        from restore.engines import hf
    except ImportError as exc:
        fail(f"--engine hf needs torch and transformers: pip install 'kvc[hf]' ({exc})", EXIT_USAGE)
    try:
        if model_path is not None:
            return hf.load_model(model_path)
        path = settings.home / "models" / "random-llama"
        if not (path / "config.json").exists():
            hf.save_random_model(path, "llama", seed=0, **hf.DEMO_MODEL)
        if not as_json:
            click.echo(
                f"no --model given: a small random-init Llama ({hf.DEMO_MODEL['num_hidden_layers']} "
                f"layers, hidden {hf.DEMO_MODEL['hidden_size']}, bfloat16) built at {path}",
                err=True,
            )
        return hf.load_model(path, "bfloat16")
    except OSError as exc:
        fail(f"cannot load model {model_path or path}: {exc}")


def register(cli: click.Group) -> None:
    cli.add_command(demo)
