"""`kvc lookup|refs|log|show|stats|stores|quarantine`: reading the catalog, and quarantining a prefix."""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager, suppress
from datetime import datetime
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
from kvc.settings import Settings

SHORT = 12  # hex characters of a hash shown in text output
MIN_HEX = 8  # shortest unique hex prefix accepted for a prefix hash or blob key
_HEX = re.compile(r"[0-9a-f]+")


# -- shared helpers (maintenance.py uses them too) ------------------------------


@contextmanager
def reporting() -> Iterator[None]:
    """Turn library errors into one line and an exit code: 2 for bad input, 1 otherwise."""
    from sqlalchemy.exc import SQLAlchemyError

    from catalog.errors import CatalogError, IdentityError, NotFoundError
    from chunkstore.errors import ChunkStoreError, InvalidKeyError

    try:
        yield
    except NotFoundError as exc:
        fail(str(exc), EXIT_PROBLEMS)
    except (IdentityError, InvalidKeyError) as exc:
        fail(str(exc), EXIT_USAGE)
    except (CatalogError, ChunkStoreError) as exc:
        fail(str(exc), EXIT_PROBLEMS)
    except SQLAlchemyError as exc:
        detail = str(getattr(exc, "orig", None) or exc).splitlines()[0]
        fail(f"catalog error: {exc.__class__.__name__}: {detail}", EXIT_PROBLEMS)


def short(h: bytes | str) -> str:
    return (h.hex() if isinstance(h, bytes) else h)[:SHORT]


def human_bytes(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{int(size)} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def when(t: datetime | None) -> str:
    return "never" if t is None else t.strftime("%Y-%m-%d %H:%M:%S UTC")


def hex_arg(text: str, what: str) -> str:
    """A lowercase hex string of 8 to 64 characters (a hash or a unique prefix of one), else exit 2."""
    value = text.strip().lower()
    if not (MIN_HEX <= len(value) <= 64) or _HEX.fullmatch(value) is None:
        fail(
            f"malformed {what} {text!r:.80}: expected {MIN_HEX} to 64 hex characters",
            EXIT_USAGE,
        )
    return value


def _prefix_candidates(cat: Any, namespace: str, hexp: str, limit: int = 2) -> list[bytes]:
    """Prefix hashes in `namespace` starting with the hex string `hexp` (a range scan on the key)."""
    import sqlalchemy as sa

    from catalog.schema import Namespace, PrefixNode

    lo = bytes.fromhex(hexp.ljust(64, "0"))
    hi = bytes.fromhex(hexp.ljust(64, "f"))
    with cat.engine.connect() as conn:
        rows = conn.execute(
            sa.select(PrefixNode.prefix_hash)
            .join(Namespace, Namespace.id == PrefixNode.namespace_id)
            .where(Namespace.name == namespace, PrefixNode.prefix_hash.between(lo, hi))
            .order_by(PrefixNode.prefix_hash)
            .limit(limit)
        ).scalars()
        return [bytes(h) for h in rows]


def _blob_candidates(cat: Any, namespace: str, hexp: str, limit: int = 2) -> list[str]:
    """Blob keys of chunks in `namespace` starting with `hexp`."""
    import sqlalchemy as sa

    from catalog.schema import Chunk, Namespace, PrefixNode

    with cat.engine.connect() as conn:
        rows = conn.execute(
            sa.select(Chunk.blob_key)
            .distinct()
            .join(PrefixNode, PrefixNode.prefix_hash == Chunk.prefix_hash)
            .join(Namespace, Namespace.id == PrefixNode.namespace_id)
            .where(
                Namespace.name == namespace,
                Chunk.blob_key >= hexp,
                Chunk.blob_key <= hexp + "g",  # every hex continuation sorts below "g"
            )
            .order_by(Chunk.blob_key)
            .limit(limit)
        ).scalars()
        return list(rows)


def resolve_prefix(cat: Any, namespace: str, text: str) -> bytes:
    """A full prefix hash or a unique hex prefix of one (>= 8 characters) in `namespace`."""
    hexp = hex_arg(text, "prefix hash")
    found = _prefix_candidates(cat, namespace, hexp)
    if not found:
        fail(f"no prefix {hexp} in namespace {namespace!r}", EXIT_PROBLEMS)
    if len(found) > 1:
        fail(
            f"prefix {hexp} is ambiguous in namespace {namespace!r}: give more characters",
            EXIT_USAGE,
        )
    return found[0]


def replica_rows(cat: Any, blob_keys: Sequence[str]) -> dict[str, list[dict[str, Any]]]:
    """Every replica (any state) of these blobs, best tier first, as plain dicts."""
    import sqlalchemy as sa

    from catalog.models import TIERS
    from catalog.schema import Replica

    out: dict[str, list[dict[str, Any]]] = {k: [] for k in blob_keys}
    if not blob_keys:
        return out
    rank = {t: i for i, t in enumerate(TIERS)}
    with cat.engine.connect() as conn:
        rows = conn.execute(
            sa.select(Replica).where(Replica.blob_key.in_(sorted(set(blob_keys))))
        ).all()
    for r in sorted(rows, key=lambda r: (rank.get(r.tier, 99), r.location)):
        out[r.blob_key].append(
            {
                "location": r.location,
                "tier": r.tier,
                "state": r.state,
                "size": r.size,
                "worker": r.worker,
                "checksum": r.checksum,
                "stored_at": r.stored_at,
                "last_verified_at": r.last_verified_at,
            }
        )
    return out


def recent_events(cat: Any, subjects: Iterable[str], limit: int) -> list[dict[str, Any]]:
    """The newest events whose subject is one of `subjects`, newest first."""
    import sqlalchemy as sa

    from catalog.schema import Event

    wanted = sorted(set(subjects))
    if not wanted or limit <= 0:
        return []
    with cat.engine.connect() as conn:
        rows = conn.execute(
            sa.select(Event)
            .where(Event.subject.in_(wanted))
            .order_by(Event.seq.desc())
            .limit(limit)
        ).all()
    return [
        {
            "seq": r.seq,
            "at": r.at,
            "kind": r.kind,
            "namespace": r.namespace,
            "subject": r.subject,
            "actor": r.actor,
            "details": r.details,
        }
        for r in rows
    ]


def _ref_doc(ref: Any) -> dict[str, Any]:
    return {
        "namespace": ref.namespace,
        "name": ref.name,
        "fingerprint": ref.fingerprint,
        "head": ref.head_hash.hex(),
        "processed": ref.processed,
        "pending_token": ref.pending_token,
        "forked_from": ref.forked_from,
        "created_at": ref.created_at,
        "updated_at": ref.updated_at,
    }


def _prefix_doc(p: Any) -> dict[str, Any]:
    return {
        "prefix": p.prefix_hash.hex(),
        "parent": p.parent_hash.hex(),
        "token_start": p.token_start,
        "token_end": p.token_end,
        "tokens": len(p.tokens),
        "depth": p.depth,
        "quarantined": p.quarantined,
        "quarantine_reason": p.quarantine_reason,
    }


def _replica_line(r: dict[str, Any]) -> str:
    return (
        f"    {r['state']:<8} {r['tier']:<8} {human_bytes(r['size']):>10}  {r['location']}"
        f"  (verified {when(r['last_verified_at'])})"
    )


def _event_lines(events: list[dict[str, Any]]) -> list[str]:
    if not events:
        return ["events: none"]
    lines = [f"events (newest first, {len(events)}):"]
    for e in events:
        details = json.dumps(e["details"], sort_keys=True, default=str)
        lines.append(f"  #{e['seq']} {when(e['at'])} {e['kind']} {e['actor'] or '-'} {details}")
    return lines


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
    docs = [_ref_doc(r) for r in found]
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
        doc = _ref_doc(cat.get_ref(settings.namespace, name))
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
            if _HEX.fullmatch(ref.lower()) is None or len(ref) < MIN_HEX:
                fail(f"no ref {ref!r} in namespace {settings.namespace!r}", EXIT_PROBLEMS)
            head = resolve_prefix(cat, settings.namespace, ref)
        chain = list(reversed(cat.lineage(settings.namespace, head)))
    shown = chain[:max_count] if max_count else chain
    doc = {
        "namespace": settings.namespace,
        "ref": _ref_doc(info) if info is not None else None,
        "head": head.hex(),
        "nodes": len(chain),
        "chain": [_prefix_doc(p) for p in shown],
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


# -- show -------------------------------------------------------------------------


def _chunks_at(cat: Any, prefix_hash: bytes) -> list[dict[str, Any]]:
    import sqlalchemy as sa

    from catalog.schema import Chunk

    with cat.engine.connect() as conn:
        rows = conn.execute(
            sa.select(Chunk).where(Chunk.prefix_hash == prefix_hash).order_by(Chunk.id)
        ).all()
    return [
        {
            "fingerprint": r.fingerprint,
            "shard": {
                "layers": [r.layer_lo, r.layer_hi],
                "kv_heads": [r.head_lo, r.head_hi],
            },
            "blob_key": r.blob_key,
            "codec": r.codec,
            "stored_bytes": r.stored_bytes,
            "kv_bytes": r.kv_bytes,
            "created_at": r.created_at,
            "last_access_at": r.last_access_at,
            "access_count": r.access_count,
        }
        for r in rows
    ]


def _show_prefix(cat: Any, namespace: str, h: bytes, events: int) -> tuple[dict[str, Any], str]:
    import sqlalchemy as sa

    from catalog.schema import PrefixNode, Ref

    p = cat.get_prefix(namespace, h)
    chunks = _chunks_at(cat, h)
    reps = replica_rows(cat, [c["blob_key"] for c in chunks])
    for c in chunks:
        c["replicas"] = reps[c["blob_key"]]
    with cat.engine.connect() as conn:
        children = conn.execute(
            sa.select(sa.func.count()).select_from(PrefixNode).where(PrefixNode.parent_hash == h)
        ).scalar_one()
        heads = list(
            conn.execute(sa.select(Ref.name).where(Ref.head_hash == h).order_by(Ref.name)).scalars()
        )
    evs = recent_events(cat, [h.hex(), *reps], events)
    doc = {
        "kind": "prefix",
        "namespace": namespace,
        **_prefix_doc(p),
        "children": int(children),
        "refs": heads,
        "chunks": chunks,
        "events": evs,
    }
    lines = [
        f"prefix {h.hex()}  (namespace {namespace})",
        f"parent {p.parent_hash.hex()}",
        f"tokens [{p.token_start}, {p.token_end})  depth {p.depth}  children {children}",
    ]
    if p.quarantined:
        lines.append(f"QUARANTINED: {p.quarantine_reason}")
    if heads:
        lines.append(f"head of: {', '.join(heads)}")
    for c in chunks:
        sh = c["shard"]
        lines.append(
            f"chunk {c['blob_key']}  layers {sh['layers'][0]}-{sh['layers'][1]} "
            f"heads {sh['kv_heads'][0]}-{sh['kv_heads'][1]}  {c['codec']}  "
            f"{human_bytes(c['stored_bytes'])}  fingerprint {short(c['fingerprint'])}"
        )
        lines.extend(_replica_line(r) for r in c["replicas"])
    lines += _event_lines(evs)
    return doc, "\n".join(lines)


def _show_blob(cat: Any, namespace: str, key: str, events: int) -> tuple[dict[str, Any], str]:
    import sqlalchemy as sa

    from catalog.schema import Chunk, PrefixNode

    with cat.engine.connect() as conn:
        rows = conn.execute(
            sa.select(Chunk.prefix_hash, PrefixNode.token_start, PrefixNode.token_count)
            .join(PrefixNode, PrefixNode.prefix_hash == Chunk.prefix_hash)
            .where(Chunk.blob_key == key)
        ).all()
    reps = replica_rows(cat, [key])[key]
    evs = recent_events(cat, [key], events)
    chunks = [
        {
            "prefix": bytes(r.prefix_hash).hex(),
            "token_start": r.token_start,
            "token_end": r.token_start + r.token_count,
        }
        for r in rows
    ]
    doc = {
        "kind": "blob",
        "namespace": namespace,
        "blob_key": key,
        "chunks": chunks,
        "replicas": reps,
        "events": evs,
    }
    lines = [f"blob {key}  (namespace {namespace})"]
    lines += [
        f"chunk at prefix {short(c['prefix'])}  tokens [{c['token_start']}, {c['token_end']})"
        for c in chunks
    ]
    lines.append(f"replicas ({len(reps)}):")
    lines += [_replica_line(r) for r in reps]
    lines += _event_lines(evs)
    return doc, "\n".join(lines)


def _show_ref(cat: Any, ref: Any, events: int) -> tuple[dict[str, Any], str]:
    import sqlalchemy as sa

    from catalog.schema import Chunk, Replica

    chain = cat.lineage(ref.namespace, ref.head_hash)
    hashes = [p.prefix_hash for p in chain]
    with cat.engine.connect() as conn:
        by_state = conn.execute(
            sa.select(Replica.state, sa.func.count())
            .join(Chunk, Chunk.blob_key == Replica.blob_key)
            .where(Chunk.prefix_hash.in_(hashes), Chunk.fingerprint == ref.fingerprint)
            .group_by(Replica.state)
            .order_by(Replica.state)
        ).all()
    states = {s: int(n) for s, n in by_state}
    quarantined = [p.prefix_hash.hex() for p in chain if p.quarantined]
    evs = recent_events(cat, [ref.name], events)
    doc = {
        "kind": "ref",
        **_ref_doc(ref),
        "chain_nodes": len(chain),
        "quarantined_nodes": quarantined,
        "replicas": states,
        "events": evs,
    }
    lines = [
        f"ref {ref.name}  (namespace {ref.namespace})",
        f"fingerprint {ref.fingerprint}",
        f"head {ref.head_hash.hex()}",
        f"processed {ref.processed}  pending token {ref.pending_token}  nodes {len(chain)}",
    ]
    if ref.forked_from:
        lines.append(f"forked from {ref.forked_from}")
    if quarantined:
        lines.append(f"QUARANTINED nodes: {', '.join(short(q) for q in quarantined)}")
    lines.append(
        "replicas: " + (", ".join(f"{n} {s}" for s, n in states.items()) if states else "none")
    )
    lines += _event_lines(evs)
    return doc, "\n".join(lines)


@click.command("show", epilog="Example: kvc show 3f2a9c1b  (or a ref name, or a blob key)")
@settings_options
@click.argument("object_", metavar="OBJECT")
@click.option(
    "--events",
    "n_events",
    type=click.IntRange(min=0),
    default=10,
    show_default=True,
    help="How many recent events to show.",
)
def show(settings: Settings, as_json: bool, object_: str, n_events: int) -> None:
    """Everything the catalog knows about OBJECT: facts, replicas, recent events.

    OBJECT is a ref name, a prefix hash, or a blob key (hashes may be shortened
    to a unique prefix of at least 8 hex characters). Exit 1 if nothing matches."""
    from catalog.errors import NotFoundError

    ns = settings.namespace
    with open_catalog(settings) as cat, reporting():
        try:
            ref = cat.get_ref(ns, object_)
        except NotFoundError:
            ref = None
        if ref is not None:
            doc, text = _show_ref(cat, ref, n_events)
        else:
            hexp = object_.strip().lower()
            if len(hexp) < MIN_HEX or len(hexp) > 64 or _HEX.fullmatch(hexp) is None:
                fail(
                    f"no ref {object_!r:.80} in namespace {ns!r} (and not a hex hash)",
                    EXIT_PROBLEMS,
                )
            prefixes = _prefix_candidates(cat, ns, hexp)
            blobs = _blob_candidates(cat, ns, hexp)
            if len(prefixes) + len(blobs) > 1:
                fail(f"{hexp} is ambiguous in namespace {ns!r}: give more characters", EXIT_USAGE)
            if prefixes:
                doc, text = _show_prefix(cat, ns, prefixes[0], n_events)
            elif blobs:
                doc, text = _show_blob(cat, ns, blobs[0], n_events)
            else:
                fail(f"no ref, prefix or blob {hexp} in namespace {ns!r}", EXIT_PROBLEMS)
    emit(as_json, doc, text)


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
    import sqlalchemy as sa

    from catalog.schema import Replica, Store

    configured = []
    for store in open_stores(settings):
        configured.append(store.name)
        store.close()
    with open_catalog(settings) as cat, reporting(), cat.engine.connect() as conn:
        known = {r.name: r for r in conn.execute(sa.select(Store)).all()}
        counts = conn.execute(
            sa.select(Replica.location, Replica.tier, Replica.state, sa.func.count()).group_by(
                Replica.location, Replica.tier, Replica.state
            )
        ).all()
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
    for loc, tier, state, n in counts:
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
