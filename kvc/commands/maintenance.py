"""`kvc fsck` and `kvc gc`: checking that catalogued bytes exist, purging chunks and orphan blobs."""

from __future__ import annotations

import contextlib
import sys
from datetime import UTC, datetime
from typing import Any

import click
from tqdm import tqdm

from kvc.commands.common import (
    EXIT_PROBLEMS,
    EXIT_USAGE,
    emit,
    fail,
    open_catalog,
    open_stores,
    settings_options,
)
from kvc.commands.inspect import human_bytes, reporting
from kvc.settings import Settings

_BATCH = 500  # keys per IN (...) query


def _progress(as_json: bool, total: int | None, desc: str) -> tqdm[Any]:
    # stdout stays clean for --json; a bar is noise when stderr is a file or pipe.
    return tqdm(
        total=total,
        desc=desc,
        unit="blob",
        file=sys.stderr,
        disable=as_json or not sys.stderr.isatty(),
        leave=False,
    )


def _subset(text: str | None) -> tuple[int, int] | None:
    if text is None:
        return None
    try:
        n_s, t_s = text.split("/")
        n, t = int(n_s), int(t_s)
    except ValueError:
        fail(f"malformed --subset {text!r}: expected n/t, e.g. 1/4", EXIT_USAGE)
    if not 1 <= n <= t:
        fail(f"malformed --subset {text!r}: need 1 <= n <= t", EXIT_USAGE)
    return n, t


def _in_subset(key: str, subset: tuple[int, int] | None) -> bool:
    # Blob keys are uniform digests, so their leading bits split the work evenly and stably.
    return subset is None or int(key[:8], 16) % subset[1] == subset[0] - 1


# -- fsck -------------------------------------------------------------------------------


@click.command(
    "fsck",
    epilog="Example: kvc fsck --read-data --subset 1/7   (a seventh of the blobs each night)",
)
@settings_options
@click.option(
    "--read-data",
    is_flag=True,
    help="Download every blob and verify its digest and record (slow; default: existence and size).",
)
@click.option(
    "--subset",
    "subset_text",
    metavar="n/t",
    default=None,
    help="Check only part n of t (by blob key), to spread the work over runs.",
)
@click.option(
    "--repair/--no-repair",
    default=True,
    show_default=True,
    help="Copy a verified good replica over each missing or corrupt one.",
)
def fsck(
    settings: Settings, as_json: bool, read_data: bool, subset_text: str | None, repair: bool
) -> None:
    """Check every catalogued replica in the configured stores.

    Each replica must exist with its receipt's size; with --read-data its bytes
    must hash to its key and decode as a valid record. Broken replicas are
    marked `missing` or `corrupt` in the catalog (restores then skip them); a
    replica marked broken that checks out again is marked `durable`. Replicas
    at locations that are not configured stores (other stores, workers) are
    reported as not checked. A missing or corrupt replica is repaired from
    another replica of the same blob in a configured store, once that copy
    verifies (disable with --no-repair). Exit 1 when problems were found
    (repaired or not), 0 when clean."""
    import sqlalchemy as sa

    from catalog.schema import Replica
    from chunkstore.errors import (
        BlobNotFoundError,
        ChunkFormatError,
        ChunkIntegrityError,
        ChunkStoreError,
    )
    from chunkstore.record import decode_chunk

    subset = _subset(subset_text)
    stores = {s.name: s for s in open_stores(settings)}
    actor = "kvc fsck"
    missing: list[dict[str, Any]] = []
    corrupt: list[dict[str, Any]] = []
    unreachable: list[dict[str, Any]] = []
    revived: list[dict[str, Any]] = []
    repaired: list[dict[str, Any]] = []
    verified: dict[str, list[str]] = {}
    checked = ok = 0
    down: dict[str, str] = {}  # store -> first error; its remaining replicas are not checked
    with open_catalog(settings) as cat, reporting():
        with cat.engine.connect() as conn:
            rows = [
                r
                for r in conn.execute(
                    sa.select(Replica.blob_key, Replica.location, Replica.state, Replica.size)
                    .where(Replica.location.in_(sorted(stores)))
                    .order_by(Replica.location, Replica.blob_key)
                ).all()
                if _in_subset(r.blob_key, subset)
            ]
            elsewhere = {
                loc: int(n)
                for loc, n in conn.execute(
                    sa.select(Replica.location, sa.func.count())
                    .where(Replica.location.not_in(sorted(stores)))
                    .group_by(Replica.location)
                    .order_by(Replica.location)
                ).all()
            }

        def mark(key: str, loc: str, state: str, reason: str, was: str) -> None:
            if was != state:  # already marked: no new event
                cat.mark_replica(key, loc, state, reason=reason, actor=actor)

        with _progress(as_json, len(rows), "fsck") as bar:
            for key, loc, state, size in rows:
                bar.update(1)
                if loc in down:
                    continue
                store = stores[loc]
                item = {"blob_key": key, "location": loc, "was": state}
                checked += 1
                try:
                    st = store.stat(key)
                    if st.size != size:
                        reason = f"size {st.size}, receipt says {size}"
                        corrupt.append({**item, "reason": reason})
                        mark(key, loc, "corrupt", reason, state)
                        continue
                    if read_data:
                        data = store.get(key)
                        try:
                            decode_chunk(data, expected_key=key)
                        finally:
                            if isinstance(data, memoryview):
                                data.release()
                except BlobNotFoundError:
                    missing.append({**item, "reason": "not in the store"})
                    mark(key, loc, "missing", "fsck: not in the store", state)
                    continue
                except (ChunkIntegrityError, ChunkFormatError) as exc:
                    corrupt.append({**item, "reason": str(exc)})
                    mark(key, loc, "corrupt", f"fsck: {exc}", state)
                    continue
                except (ChunkStoreError, OSError) as exc:
                    # Outcome unknown: leave the replica's state alone.
                    unreachable.append({**item, "reason": str(exc)})
                    down[loc] = str(exc)
                    checked -= 1
                    continue
                ok += 1
                if read_data:
                    verified.setdefault(loc, []).append(key)
                # Bytes that are back (or verified in full) make a broken replica usable again;
                # stat alone cannot clear a `corrupt` mark.
                if state == "missing" or (state == "corrupt" and read_data):
                    cat.mark_replica(key, loc, "durable", reason="fsck: verified", actor=actor)
                    revived.append({**item, "state": "durable"})
        for loc, keys in verified.items():
            cat.touch_verified(loc, keys)
        if repair:
            repaired = _repair(cat, stores, missing + corrupt, down, actor)
    for s in stores.values():
        s.close()
    skipped = sum(1 for _, loc, _, _ in rows if loc in down) - len(unreachable)
    problems = bool(missing or corrupt or unreachable)
    doc = {
        "read_data": read_data,
        "subset": subset_text,
        "stores": sorted(stores),
        "checked": checked,
        "ok": ok,
        "missing": missing,
        "corrupt": corrupt,
        "unreachable": unreachable,
        "skipped_after_error": skipped,
        "revived": revived,
        "repaired": repaired,
        "not_checked": elsewhere,
        "clean": not problems,
    }
    lines = [f"missing  {m['blob_key']} at {m['location']}" for m in missing]
    lines += [f"corrupt  {c['blob_key']} at {c['location']}: {c['reason']}" for c in corrupt]
    lines += [f"unreachable {u['location']}: {u['reason']}" for u in unreachable]
    lines += [f"revived  {r['blob_key']} at {r['location']} (was {r['was']})" for r in revived]
    lines += [f"repaired {r['blob_key']} at {r['location']} from {r['source']}" for r in repaired]
    lines.append(
        f"checked {checked} replica(s) in {len(stores)} store(s)"
        f"{' reading data' if read_data else ''}: {ok} ok, {len(missing)} missing, "
        f"{len(corrupt)} corrupt" + (f", {skipped} skipped after errors" if skipped else "")
    )
    for loc, n in elsewhere.items():
        lines.append(f"not checked: {n} replica(s) at {loc} (not a configured store)")
    emit(as_json, doc, "\n".join(lines))
    if problems:
        sys.exit(EXIT_PROBLEMS)


def _repair(
    cat: Any, stores: dict[str, Any], broken: list[dict[str, Any]], down: dict[str, str], actor: str
) -> list[dict[str, Any]]:
    """Copy verified bytes from a good replica over each broken one; return what was repaired."""
    from chunkstore.errors import ChunkStoreError
    from chunkstore.record import decode_chunk
    from restore.checkpoint import store_tier, to_replica_receipt

    bad = {(b["blob_key"], b["location"]) for b in broken}
    out: list[dict[str, Any]] = []
    for item in broken:
        key, loc = item["blob_key"], item["location"]
        if loc in down:
            continue
        for src_name, src in stores.items():
            if src_name == loc or (key, src_name) in bad or src_name in down:
                continue
            try:
                data = bytes(src.get(key))
                decode_chunk(data, expected_key=key)  # never copy bytes that do not verify
                target = stores[loc]
                target.delete(key)  # a same-size corrupt copy would otherwise be kept
                receipt = target.put(key, data)
            except (ChunkStoreError, OSError, ValueError):
                continue
            cat.record_replica(key, to_replica_receipt(receipt, store_tier(target)), actor=actor)
            out.append({"blob_key": key, "location": loc, "source": src_name})
            break
    return out


# -- gc ----------------------------------------------------------------------------------


def _still_catalogued(cat: Any, location: str, keys: list[str]) -> set[str]:
    import sqlalchemy as sa

    from catalog.schema import Replica

    out: set[str] = set()
    with cat.engine.connect() as conn:
        for i in range(0, len(keys), _BATCH):
            out.update(
                conn.execute(
                    sa.select(Replica.blob_key).where(
                        Replica.location == location, Replica.blob_key.in_(keys[i : i + _BATCH])
                    )
                ).scalars()
            )
    return out


_LOCK_TTL_S = 6 * 3600.0  # longer than any GC run; a crashed run's lock expires after it


def _retention(
    cat: Any,
    settings: Settings,
    stores: list[Any],
    *,
    as_json: bool,
    max_age: float | None,
    max_bytes: int | None,
    dry_run: bool,
    now: datetime,
) -> tuple[dict[str, Any], list[str]]:
    """Plan (and unless --dry-run apply) the catalog-side purge of the settings' namespace."""
    from catalog.gc import plan_gc
    from catalog.purge import apply_gc, resume_gc
    from chunkstore.errors import BlobNotFoundError

    by_name = {s.name: s for s in stores}

    def delete_blob(location: str, key: str) -> bool:
        store = by_name.get(location)
        if store is None:
            return False  # another store or a worker's pool: not ours to reach
        with contextlib.suppress(BlobNotFoundError):  # already gone is what we wanted
            store.delete(key)
        return True

    lines: list[str] = []
    resumed: dict[str, Any] | None = None
    if not dry_run:
        # First finish what an interrupted run left `purging`/`deleting` (publishes of
        # those chunks are refused until it is done).
        with _progress(as_json, None, "gc resume") as bar:
            res = resume_gc(cat, delete_blob, actor="kvc gc", progress=bar.update)
        resumed = res.to_json()
        if res.resumed:
            lines.append(
                f"finished an earlier run: {res.chunks_removed} chunk(s) purged, "
                f"{len(res.blobs_deleted)} blob(s) deleted"
            )
        lines += [f"kept bytes {k} at {loc}: {why}" for loc, k, why in res.blobs_kept]
    if cat.namespace_chunk_size(settings.namespace) is None:
        return {"namespace": settings.namespace, "items": [], "resumed": resumed}, lines
    plan = plan_gc(cat, settings.namespace, max_age_s=max_age, max_bytes=max_bytes, now=now)
    doc = plan.to_json()
    doc["resumed"] = resumed
    verb = "would purge" if dry_run else "purged"
    lines += [
        f"{verb} chunk {i.prefix_hash.hex()[:16]} {i.blob_key[:16]} ({i.reason})"
        for i in plan.items
    ]
    lines += [
        f"kept quarantined {h.hex()[:16]}: a ref or demand needs it" for h in plan.kept_quarantined
    ]
    if not dry_run and plan.items:
        with _progress(as_json, None, "gc purge") as bar:
            result = apply_gc(cat, plan, delete_blob, actor="kvc gc", progress=bar.update)
        doc["result"] = result.to_json()
        lines += [f"kept bytes {k} at {loc}: {why}" for loc, k, why in result.blobs_kept]
    lines.append(
        f"{verb} {len(plan.items)} chunk(s) of namespace {settings.namespace}, "
        f"{human_bytes(plan.purged_bytes)}; {human_bytes(plan.bytes_after)} remain"
    )
    return doc, lines


@click.command(
    "gc",
    epilog="Example: kvc gc --dry-run --max-age 604800   (then without --dry-run)",
)
@settings_options
@click.option(
    "--grace",
    type=click.FloatRange(min=0),
    default=3600.0,
    show_default=True,
    metavar="SECONDS",
    help="Only blobs not modified for this long are orphans (a publish in flight is younger); "
    "keep it above the stores' refresh_after_s (900 s by default).",
)
@click.option(
    "--max-age",
    type=click.FloatRange(min=0),
    default=None,
    metavar="SECONDS",
    help="Purge leaf chunks of the namespace not used for this long (roots are kept).",
)
@click.option(
    "--max-bytes",
    type=click.IntRange(min=0),
    default=None,
    metavar="N",
    help="Purge the least used leaf chunks while the namespace stores more than N bytes.",
)
@click.option("--dry-run", is_flag=True, help="List what would be deleted; delete nothing.")
@click.option(
    "--force",
    is_flag=True,
    help="Run even though the catalog records missing replicas in a configured store.",
)
def gc(
    settings: Settings,
    as_json: bool,
    grace: float,
    max_age: float | None,
    max_bytes: int | None,
    dry_run: bool,
    force: bool,
) -> None:
    """Purge unneeded chunks of the namespace, then delete orphan blobs.

    Catalog side: chunks under a quarantined prefix, and with --max-age/--max-bytes
    the least valuable leaf chunks, are purged (bytes, replicas and rows). Refs,
    live pins (`kvc pins`) and live demand are roots: they and their ancestors are
    never purged, and a chunk with kept descendants goes only with its whole subtree.
    A chunk extended, re-published or rooted after planning is spared. A run that was
    interrupted is finished first (chunks it left `purging`, replicas `deleting`).

    Store side: a blob is an orphan when no replica row names it at that store and
    it has not been modified for --grace seconds (a crashed publish leaves such bytes;
    a publish that reuses a blob refreshes its time, so GC never deletes what a
    concurrent publish relies on).

    One GC runs at a time (a lock in the catalog; a crashed run's lock expires).
    Refuses to run while the catalog records `missing` replicas in a configured
    store (see `kvc fsck`) unless --force."""
    import os
    import socket

    import sqlalchemy as sa

    from catalog.gc import GC_LOCK, acquire_lock, lock_holder, release_lock
    from catalog.schema import Replica
    from chunkstore.errors import BlobNotFoundError, ChunkStoreError

    stores = open_stores(settings)
    now = datetime.now(UTC)
    deleted: list[dict[str, Any]] = []
    young = kept = 0
    errors: list[str] = []
    holder = f"kvc gc {socket.gethostname()}:{os.getpid()}"
    with open_catalog(settings) as cat, reporting():
        # A dry run changes nothing, so it needs no lock (and is not refused by one).
        if not dry_run and not acquire_lock(cat, GC_LOCK, holder, _LOCK_TTL_S):
            other = lock_holder(cat, GC_LOCK)
            who = f"{other[0]} until {other[1]:%Y-%m-%d %H:%M:%S} UTC" if other else "another run"
            fail(f"another GC is running ({who}); try again later", EXIT_PROBLEMS)
        try:
            with cat.engine.connect() as conn:
                broken = conn.execute(
                    sa.select(sa.func.count()).where(
                        Replica.location.in_([s.name for s in stores]),
                        Replica.state == "missing",
                    )
                ).scalar_one()
            if broken and not force and not dry_run:
                fail(
                    f"the catalog records {broken} missing replica(s) in the configured stores; "
                    "check with `kvc fsck` (or run with --force)",
                    EXIT_PROBLEMS,
                )
            retention, lines = _retention(
                cat,
                settings,
                stores,
                as_json=as_json,
                max_age=max_age,
                max_bytes=max_bytes,
                dry_run=dry_run,
                now=now,
            )
            for store in stores:
                # Catalogue first, then list: a blob published meanwhile is young, so it is kept.
                catalogued = set(cat.replicas_at(store.name))
                candidates: dict[str, tuple[int, float]] = {}
                try:
                    with _progress(as_json, None, f"gc {store.name}") as bar:
                        for key in store.keys():
                            bar.update(1)
                            if key in catalogued:
                                kept += 1
                                continue
                            try:
                                st = store.stat(key)
                            except BlobNotFoundError:
                                continue
                            age = (now - st.mtime).total_seconds()
                            if age < grace:
                                young += 1
                            else:
                                candidates[key] = (st.size, age)
                    # Catalogued since the snapshot: not an orphan any more.
                    for key in _still_catalogued(cat, store.name, sorted(candidates)):
                        del candidates[key]
                        kept += 1
                    for key, (size, age) in sorted(candidates.items()):
                        if not dry_run:
                            try:
                                # Refreshed by a publish since we looked: keep it.
                                mtime = store.stat(key).mtime
                                if (datetime.now(UTC) - mtime).total_seconds() < grace:
                                    young += 1
                                    continue
                            except BlobNotFoundError:
                                continue
                            store.delete(key)
                        deleted.append(
                            {
                                "store": store.name,
                                "blob_key": key,
                                "size": size,
                                "age_s": round(age),
                            }
                        )
                except ChunkStoreError as exc:
                    errors.append(f"{store.name}: {exc}")
                    click.echo(f"kvc: warning: {store.name}: {exc}", err=True)
                finally:
                    store.close()
        finally:
            if not dry_run:
                release_lock(cat, GC_LOCK, holder)
    total = sum(d["size"] for d in deleted)
    verb = "would delete" if dry_run else "deleted"
    doc = {
        "dry_run": dry_run,
        "grace_s": grace,
        "max_age_s": max_age,
        "max_bytes": max_bytes,
        "stores": [s.name for s in stores],
        "retention": retention,
        "deleted": deleted,
        "deleted_bytes": total,
        "kept_catalogued": kept,
        "kept_young": young,
        "errors": errors,
    }
    lines += [f"{verb} {d['blob_key']} at {d['store']} ({d['age_s']} s old)" for d in deleted]
    lines.append(
        f"{verb} {len(deleted)} orphan blob(s), {human_bytes(total)}; kept {kept} catalogued, "
        f"{young} younger than {grace:g} s"
    )
    emit(as_json, doc, "\n".join(lines))
    if errors:
        sys.exit(EXIT_PROBLEMS)


def register(cli: click.Group) -> None:
    cli.add_command(fsck)
    cli.add_command(gc)
