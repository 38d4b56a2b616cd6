"""`kvc lookup|refs|log|stats|stores|quarantine` (and `show`, from show.py): reading the catalog, quarantining."""

from __future__ import annotations

import json
import sys
from contextlib import suppress
from typing import Any

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
from kvc.commands.format import (
    HEX,
    MIN_HEX,
    human_bytes,
    prefix_doc,
    ref_doc,
    reporting,
    resolve_prefix,
    short,
)
from kvc.commands.show import show
from kvc.settings import Settings


def _read_tokens(tokens_file: str | None) -> list[int]:
    """Token ids from a file or stdin: a JSON list or whitespace-separated integers."""
    if tokens_file is None:
        if sys.stdin.isatty():
            fail("give the prompt's tokens with --tokens-file F or on stdin", EXIT_USAGE)
        text = sys.stdin.read()
        source = "stdin"
    else:
        try:
            with open(tokens_file, encoding="utf-8") as f:
                text = f.read()
        except OSError as exc:
            fail(f"cannot read {tokens_file}: {exc.strerror or exc}", EXIT_USAGE)
        source = tokens_file
    text = text.strip()
    if not text:
        fail(f"no tokens in {source}", EXIT_USAGE)
    if text.startswith("["):
        try:
            value = json.loads(text)
        except json.JSONDecodeError as exc:
            fail(f"tokens in {source} are not valid JSON: {exc}", EXIT_USAGE)
        if not isinstance(value, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in value
        ):
            fail(f"tokens in {source} must be a JSON list of integers", EXIT_USAGE)
        return value
    try:
        return [int(t) for t in text.split()]
    except ValueError:
        fail(
            f"tokens in {source} must be a JSON list or whitespace-separated integers",
            EXIT_USAGE,
        )


# -- lookup ---------------------------------------------------------------------


@click.command(
    "lookup",
    epilog="Example: echo '[1, 2, 3, 4]' | kvc lookup --fingerprint 9f1c...e2 --json",
)
@settings_options
@click.option(
    "--fingerprint", required=True, metavar="HEX", help="Model/execution fingerprint (64 hex)."
)
@click.option(
    "--tokens-file",
    type=click.Path(dir_okay=False),
    default=None,
    help="Prompt token ids: a JSON list or whitespace-separated integers (default: stdin).",
)
def lookup(settings: Settings, as_json: bool, fingerprint: str, tokens_file: str | None) -> None:
    """Find the longest stored, restorable prefix of a prompt (whole-model shard).

    Prints the matched token count and the chunks that cover it (start, tokens
    used, blob key, replicas). A miss is not an error: exit 0 either way."""
    from catalog.identity import fingerprint_hex

    with reporting():
        fp = fingerprint_hex(fingerprint.strip().lower())
    tokens = _read_tokens(tokens_file)
    with open_catalog(settings) as cat, reporting():
        known = cat.get_fingerprint(fp) is not None
        match = cat.lookup(settings.namespace, fp, tokens)
    chunks = [
        {
            "prefix": c.prefix_hash.hex(),
            "token_start": c.token_start,
            "token_count": c.token_count,
            "tokens_used": c.tokens_used,
            "blob_key": c.blob_key,
            "codec": c.codec,
            "stored_bytes": c.stored_bytes,
            "replicas": [
                {"location": r.location, "tier": r.tier, "state": r.state, "size": r.size}
                for r in c.replicas
            ],
        }
        for c in match.chunks
    ]
    doc = {
        "namespace": settings.namespace,
        "fingerprint": fp,
        "fingerprint_known": known,
        "hit": match.hit,
        "prompt_tokens": match.prompt_tokens,
        "matched_tokens": match.matched_tokens,
        "chunks": chunks,
    }
    if match.hit:
        lines = [
            f"hit: {match.matched_tokens} of {match.prompt_tokens} tokens restorable "
            f"from {len(chunks)} chunk(s)"
        ]
        for c in chunks:
            end = c["token_start"] + c["tokens_used"]
            part = "" if c["tokens_used"] == c["token_count"] else f" of {c['token_count']}"
            lines.append(
                f"  {short(c['prefix'])}  tokens [{c['token_start']}, {end}){part}  blob {c['blob_key']}"
            )
            lines.extend(
                f"    {r['state']:<8} {r['tier']:<8} {r['location']}" for r in c["replicas"]
            )
    else:
        why = "" if known else " (fingerprint not catalogued)"
        lines = [f"miss: no stored prefix of these {match.prompt_tokens} tokens{why}"]
    emit(as_json, doc, "\n".join(lines))


# -- refs -------------------------------------------------------------------------


@click.group("refs")
def refs() -> None:
    """Named continuations (like git branches) in the namespace."""


@refs.command("list", epilog="Example: kvc refs list --namespace team-a")
@settings_options
def refs_list(settings: Settings, as_json: bool) -> None:
    """List the namespace's refs: name, head, processed tokens, pending token."""
    with open_catalog(settings) as cat, reporting():
        found = cat.list_refs(settings.namespace)
    docs = [ref_doc(r) for r in found]
    lines = [
        f"{r['name']}  {short(r['head'])}  processed {r['processed']}  pending {r['pending_token']}"
        + (f"  (forked from {r['forked_from']})" if r["forked_from"] else "")
        for r in docs
    ]
    emit(
        as_json,
        {"namespace": settings.namespace, "refs": docs},
        "\n".join(lines) if lines else f"no refs in namespace {settings.namespace!r}",
    )


@refs.command("show", epilog="Example: kvc refs show demo/chat-0 --json")
@settings_options
@click.argument("name")
def refs_show(settings: Settings, as_json: bool, name: str) -> None:
    """Show one ref: fingerprint, head prefix, processed count, pending token. Exit 1 if unknown."""
    with open_catalog(settings) as cat, reporting():
        doc = ref_doc(cat.get_ref(settings.namespace, name))
    emit(as_json, doc, "\n".join(f"{k}: {v}" for k, v in doc.items()))


@refs.command("delete", epilog="Example: kvc refs delete demo/chat-0")
@settings_options
@click.argument("name")
def refs_delete(settings: Settings, as_json: bool, name: str) -> None:
    """Delete a ref (its chunks stay until retention GC). Exit 1 if unknown."""
    with open_catalog(settings) as cat, reporting():
        cat.delete_ref(settings.namespace, name, actor="kvc refs delete")
    emit(
        as_json,
        {"namespace": settings.namespace, "deleted": name},
        f"deleted ref {name!r} in namespace {settings.namespace!r}",
    )


# -- log --------------------------------------------------------------------------


@click.command("log", epilog="Example: kvc log demo/chat-0 -n 5")
@settings_options
@click.argument("ref")
@click.option(
    "-n", "--max-count", type=click.IntRange(min=1), default=None, help="Show at most N nodes."
)
def log(settings: Settings, as_json: bool, ref: str, max_count: int | None) -> None:
    """The lineage of REF, newest chunk first, like `git log`: one line per prefix node.

    REF is a ref name, or a prefix hash (or a unique hex prefix of at least 8 characters)."""
    from catalog.errors import NotFoundError

    with open_catalog(settings) as cat, reporting():
        info: Any = None
        with suppress(NotFoundError):
            info = cat.get_ref(settings.namespace, ref)
        if info is not None:
            head = info.head_hash
        else:
            if HEX.fullmatch(ref.lower()) is None or len(ref) < MIN_HEX:
                fail(f"no ref {ref!r} in namespace {settings.namespace!r}", EXIT_PROBLEMS)
            head = resolve_prefix(cat, settings.namespace, ref)
        chain = list(reversed(cat.lineage(settings.namespace, head)))
    shown = chain[:max_count] if max_count else chain
    doc = {
        "namespace": settings.namespace,
        "ref": ref_doc(info) if info is not None else None,
        "head": head.hex(),
        "nodes": len(chain),
        "chain": [prefix_doc(p) for p in shown],
    }
    lines: list[str] = []
    if info is not None:
        lines += [
            f"ref {info.name}  (namespace {info.namespace})",
            f"fingerprint {info.fingerprint}",
            f"head {short(head)}  processed {info.processed}  pending token {info.pending_token}",
        ]
        if info.forked_from:
            lines.append(f"forked from {info.forked_from}")
    else:
        lines.append(f"prefix {head.hex()}  (namespace {settings.namespace})")
    lines.append("")
    for p in shown:
        mark = f"  QUARANTINED: {p.quarantine_reason}" if p.quarantined else ""
        lines.append(f"{short(p.prefix_hash)}  tokens [{p.token_start}, {p.token_end}){mark}")
    if len(shown) < len(chain):
        lines.append(f"... {len(chain) - len(shown)} older node(s)")
    emit(as_json, doc, "\n".join(lines))


# -- stats and stores ----------------------------------------------------------------


@click.command("stats", epilog="Example: kvc stats --count-blobs --json")
@settings_options
@click.option("--all-namespaces", is_flag=True, help="Totals over every namespace.")
@click.option(
    "--count-blobs",
    is_flag=True,
    help="Also count the blobs in each configured store (lists them).",
)
def stats(settings: Settings, as_json: bool, all_namespaces: bool, count_blobs: bool) -> None:
    """Chunks, prefixes, refs, bytes and replicas by state, for the namespace (or all)."""
    from chunkstore.errors import ChunkStoreError

    with open_catalog(settings) as cat, reporting():
        doc = cat.stats(None if all_namespaces else settings.namespace)
    problems = False
    if count_blobs:
        doc["store_blobs"] = {}
        for store in open_stores(settings):
            try:
                doc["store_blobs"][store.name] = sum(1 for _ in store.keys())
            except ChunkStoreError as exc:
                doc["store_blobs"][store.name] = None
                click.echo(f"kvc: warning: cannot list {store.name}: {exc}", err=True)
                problems = True
            finally:
                store.close()
    reps = doc["replicas"]
    lines = [
        f"namespace: {doc['namespace'] or '(all)'}",
        f"chunks: {doc['chunks']}  prefixes: {doc['prefixes']}  refs: {doc['refs']}",
        f"stored: {human_bytes(doc['stored_bytes'])}  kv: {human_bytes(doc['kv_bytes'])}",
        "replicas: " + (", ".join(f"{n} {s}" for s, n in sorted(reps.items())) or "none"),
    ]
    for name, n in doc.get("store_blobs", {}).items():
        lines.append(f"blobs in {name}: {'unreadable' if n is None else n}")
    emit(as_json, doc, "\n".join(lines))
    if problems:
        sys.exit(EXIT_PROBLEMS)


@click.command("stores", epilog="Example: kvc stores --json")
@settings_options
def stores(settings: Settings, as_json: bool) -> None:
    """Configured stores, the catalog's known stores, and replica counts per state at each."""
    from catalog.admin import known_stores, replica_counts

    configured = []
    for store in open_stores(settings):
        configured.append(store.name)
        store.close()
    with open_catalog(settings) as cat, reporting():
        known = {r.name: r for r in known_stores(cat)}
        counts = replica_counts(cat)
    by_loc: dict[str, dict[str, Any]] = {}
    for name in [*configured, *known]:
        row = known.get(name)
        by_loc.setdefault(
            name,
            {
                "name": name,
                "kind": row.kind if row else name.split(":", 1)[0],
                "tier": row.tier if row else None,
                "configured": name in configured,
                "catalogued": row is not None,
                "replicas": {},
            },
        )
    for c in counts:
        loc, tier, state, n = c.location, c.tier, c.state, c.count
        entry = by_loc.setdefault(
            loc,
            {
                "name": loc,
                "kind": loc.split(":", 1)[0],
                "tier": tier,
                "configured": loc in configured,
                "catalogued": loc in known,
                "replicas": {},
            },
        )
        entry["replicas"][state] = entry["replicas"].get(state, 0) + int(n)
    docs = list(by_loc.values())
    lines = []
    for d in docs:
        flags = ", ".join(
            f for f, on in (("configured", d["configured"]), ("catalogued", d["catalogued"])) if on
        )
        reps = ", ".join(f"{n} {s}" for s, n in sorted(d["replicas"].items())) or "no replicas"
        lines.append(
            f"{d['name']}  [{d['tier'] or '?'}; {flags or 'replica location only'}]  {reps}"
        )
    emit(as_json, {"configured": configured, "stores": docs}, "\n".join(lines) or "no stores")


# -- quarantine -----------------------------------------------------------------------


@click.command(
    "quarantine",
    epilog='Example: kvc quarantine 3f2a9c1b --reason "built with a broken kernel"',
)
@settings_options
@click.argument("prefix")
@click.option("--reason", required=True, help="Why (recorded in the history).")
def quarantine(settings: Settings, as_json: bool, prefix: str, reason: str) -> None:
    """Make PREFIX and all its descendants unrestorable at once.

    PREFIX is a prefix hash or a unique hex prefix of at least 8 characters.
    Prints one invalidation directive (location, blob key) per replica: the
    stores and workers that should drop those bytes (GC may purge them)."""
    if not reason.strip():
        fail("--reason must not be empty", EXIT_USAGE)
    with open_catalog(settings) as cat, reporting():
        h = resolve_prefix(cat, settings.namespace, prefix)
        directives = cat.quarantine(settings.namespace, h, reason, actor="kvc quarantine")
        affected = 1 + len(cat.descendants(settings.namespace, h))
    docs = [
        {
            "location": d.location,
            "blob_key": d.blob_key,
            "tier": d.tier,
            "worker": d.worker,
            "prefix": d.prefix_hash.hex(),
        }
        for d in directives
    ]
    lines = [
        f"quarantined {h.hex()} and {affected - 1} descendant(s) in namespace "
        f"{settings.namespace!r}: {reason}",
        f"invalidation directives ({len(docs)}):",
    ]
    lines += [f"  drop {d['blob_key']} at {d['location']} ({d['tier']})" for d in docs]
    emit(
        as_json,
        {
            "namespace": settings.namespace,
            "prefix": h.hex(),
            "reason": reason,
            "prefixes_quarantined": affected,
            "directives": docs,
        },
        "\n".join(lines),
    )


def register(cli: click.Group) -> None:
    for command in (lookup, refs, log, show, stats, stores, quarantine):
        cli.add_command(command)
