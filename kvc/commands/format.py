"""What the reading and maintenance commands share: error mapping, hash and size formatting, documents."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime
from typing import Any

from chunkstore.units import human_bytes as human_bytes  # the one size format of every output
from kvc.commands.common import EXIT_PROBLEMS, EXIT_USAGE, fail

SHORT = 12  # hex characters of a hash shown in text output
MIN_HEX = 8  # shortest unique hex prefix accepted for a prefix hash or blob key
HEX = re.compile(r"[0-9a-f]+")


@contextmanager
def reporting() -> Iterator[None]:
    """Turn library errors into one line and an exit code: 2 for bad input, 1 otherwise."""
    from catalog.admin import DATABASE_ERRORS, database_error_detail
    from catalog.errors import CatalogError, CatalogInputError, NotFoundError
    from chunkstore.errors import ChunkStoreError, InvalidKeyError
    from restore.errors import InputError, RestoreError

    try:
        yield
    except NotFoundError as exc:
        fail(str(exc), EXIT_PROBLEMS)
    except (CatalogInputError, InvalidKeyError, InputError) as exc:
        fail(str(exc), EXIT_USAGE)
    except (CatalogError, ChunkStoreError, RestoreError) as exc:
        fail(str(exc), EXIT_PROBLEMS)
    except DATABASE_ERRORS as exc:
        fail(f"catalog error: {database_error_detail(exc)}", EXIT_PROBLEMS)


def short(h: bytes | str) -> str:
    return (h.hex() if isinstance(h, bytes) else h)[:SHORT]


def when(t: datetime | None) -> str:
    return "never" if t is None else t.strftime("%Y-%m-%d %H:%M:%S UTC")


def hex_arg(text: str, what: str) -> str:
    """A lowercase hex string of 8 to 64 characters (a hash or a unique prefix of one), else exit 2."""
    value = text.strip().lower()
    if not (MIN_HEX <= len(value) <= 64) or HEX.fullmatch(value) is None:
        fail(
            f"malformed {what} {text!r:.80}: expected {MIN_HEX} to 64 hex characters",
            EXIT_USAGE,
        )
    return value


def resolve_prefix(cat: Any, namespace: str, text: str) -> bytes:
    """A full prefix hash or a unique hex prefix of one (>= 8 characters) in `namespace`."""
    from catalog.admin import prefix_candidates

    hexp = hex_arg(text, "prefix hash")
    found = prefix_candidates(cat, namespace, hexp)
    if not found:
        fail(f"no prefix {hexp} in namespace {namespace!r}", EXIT_PROBLEMS)
    if len(found) > 1:
        fail(
            f"prefix {hexp} is ambiguous in namespace {namespace!r}: give more characters",
            EXIT_USAGE,
        )
    return found[0]


def ref_doc(ref: Any) -> dict[str, Any]:
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


def prefix_doc(p: Any) -> dict[str, Any]:
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


def replica_doc(r: Any) -> dict[str, Any]:
    """A `catalog.admin.ReplicaRow` as `kvc show` prints it (without its blob key)."""
    return {
        "location": r.location,
        "tier": r.tier,
        "state": r.state,
        "size": r.size,
        "worker": r.worker,
        "checksum": r.checksum,
        "stored_at": r.stored_at,
        "last_verified_at": r.last_verified_at,
    }


def event_doc(e: Any) -> dict[str, Any]:
    return {
        "seq": e.seq,
        "at": e.at,
        "kind": e.kind,
        "namespace": e.namespace,
        "subject": e.subject,
        "actor": e.actor,
        "details": e.details,
    }


def replica_line(r: dict[str, Any]) -> str:
    return (
        f"    {r['state']:<8} {r['tier']:<8} {human_bytes(r['size']):>10}  {r['location']}"
        f"  (verified {when(r['last_verified_at'])})"
    )


def event_lines(events: list[dict[str, Any]]) -> list[str]:
    if not events:
        return ["events: none"]
    lines = [f"events (newest first, {len(events)}):"]
    for e in events:
        details = json.dumps(e["details"], sort_keys=True, default=str)
        lines.append(f"  #{e['seq']} {when(e['at'])} {e['kind']} {e['actor'] or '-'} {details}")
    return lines
