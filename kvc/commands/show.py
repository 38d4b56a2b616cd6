"""`kvc show OBJECT`: everything the catalog knows about a ref, a prefix node or a blob."""

from __future__ import annotations

from typing import Any

import click

from kvc.commands.common import (
    EXIT_PROBLEMS,
    EXIT_USAGE,
    emit,
    fail,
    open_catalog,
    settings_options,
)
from kvc.commands.format import (
    HEX,
    MIN_HEX,
    event_doc,
    event_lines,
    human_bytes,
    prefix_doc,
    ref_doc,
    replica_doc,
    replica_line,
    reporting,
    short,
)
from kvc.settings import Settings


def _chunk_doc(c: Any) -> dict[str, Any]:
    return {
        "fingerprint": c.fingerprint,
        "shard": {"layers": [c.layer_lo, c.layer_hi], "kv_heads": [c.head_lo, c.head_hi]},
        "blob_key": c.blob_key,
        "codec": c.codec,
        "stored_bytes": c.stored_bytes,
        "kv_bytes": c.kv_bytes,
        "created_at": c.created_at,
        "last_access_at": c.last_access_at,
        "access_count": c.access_count,
    }


def _events(cat: Any, subjects: list[str], limit: int) -> list[dict[str, Any]]:
    from catalog.admin import recent_events

    return [event_doc(e) for e in recent_events(cat, subjects, limit)]


def _show_prefix(cat: Any, namespace: str, h: bytes, events: int) -> tuple[dict[str, Any], str]:
    from catalog.admin import chunks_at, prefix_links, replicas_of

    p = cat.get_prefix(namespace, h)
    chunks = [_chunk_doc(c) for c in chunks_at(cat, h)]
    reps = {
        k: [replica_doc(r) for r in rows]
        for k, rows in replicas_of(cat, [c["blob_key"] for c in chunks]).items()
    }
    for c in chunks:
        c["replicas"] = reps[c["blob_key"]]
    links = prefix_links(cat, h)
    children, heads = links.children, list(links.refs)
    evs = _events(cat, [h.hex(), *reps], events)
    doc = {
        "kind": "prefix",
        "namespace": namespace,
        **prefix_doc(p),
        "children": children,
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
        lines.extend(replica_line(r) for r in c["replicas"])
    lines += event_lines(evs)
    return doc, "\n".join(lines)


def _show_blob(cat: Any, namespace: str, key: str, events: int) -> tuple[dict[str, Any], str]:
    from catalog.admin import chunks_of_blob, replicas_of

    found = chunks_of_blob(cat, key)
    reps = [replica_doc(r) for r in replicas_of(cat, [key])[key]]
    evs = _events(cat, [key], events)
    chunks: list[dict[str, Any]] = [
        {"prefix": c.prefix_hash.hex(), "token_start": c.token_start, "token_end": c.token_end}
        for c in found
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
    lines += [replica_line(r) for r in reps]
    lines += event_lines(evs)
    return doc, "\n".join(lines)


def _show_ref(cat: Any, ref: Any, events: int) -> tuple[dict[str, Any], str]:
    from catalog.admin import replica_states

    chain = cat.lineage(ref.namespace, ref.head_hash)
    states = replica_states(cat, [p.prefix_hash for p in chain], ref.fingerprint)
    quarantined = [p.prefix_hash.hex() for p in chain if p.quarantined]
    evs = _events(cat, [ref.name], events)
    doc = {
        "kind": "ref",
        **ref_doc(ref),
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
    lines += event_lines(evs)
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
    from catalog.admin import blob_candidates, prefix_candidates
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
            if len(hexp) < MIN_HEX or len(hexp) > 64 or HEX.fullmatch(hexp) is None:
                fail(
                    f"no ref {object_!r:.80} in namespace {ns!r} (and not a hex hash)",
                    EXIT_PROBLEMS,
                )
            prefixes = prefix_candidates(cat, ns, hexp)
            blobs = blob_candidates(cat, ns, hexp)
            if len(prefixes) + len(blobs) > 1:
                fail(f"{hexp} is ambiguous in namespace {ns!r}: give more characters", EXIT_USAGE)
            if prefixes:
                doc, text = _show_prefix(cat, ns, prefixes[0], n_events)
            elif blobs:
                doc, text = _show_blob(cat, ns, blobs[0], n_events)
            else:
                fail(f"no ref, prefix or blob {hexp} in namespace {ns!r}", EXIT_PROBLEMS)
    emit(as_json, doc, text)
