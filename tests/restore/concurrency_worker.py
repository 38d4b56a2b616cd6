"""One process of the concurrency run (tests/restore/test_concurrency.py): publishes, restores,
ref moves or GC, against one shared catalog and store, until its deadline.

Prints one JSON line: operation counts and every error by kind. Errors a caller of
kvc must expect under concurrency (a lost ref compare-and-swap, a ref deleted by
another worker, a ref onto a prefix GC is purging) are counted as `expected`; any
other exception, and any restored position that differs from a fresh prefill, is
`unexpected`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import traceback
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

from catalog import Catalog
from catalog.errors import NotFoundError, PurgeInProgressError, RefConflictError
from chunkstore import open_store
from restore.checkpoint import Checkpointer
from restore.engines.reference import ReferenceModel
from restore.pool import PagePool
from restore.restore import Restorer

NS = "default"
CHUNK = 16
MODEL = ReferenceModel.small(seed=0)
EXPECTED = (RefConflictError, NotFoundError, PurgeInProgressError)
REF_OPS = ("pin", "fork", "create_ref", "move_ref", "unpin", "delete_ref")


def family(rng: np.random.Generator) -> list[int]:
    """A prompt from a small family, so workers publish and restore overlapping prefixes:
    a shared system prompt, one of four branches, one of three follow-ups, a cut."""
    base = np.random.default_rng(7)
    system = base.integers(0, MODEL.vocab_size, 40).tolist()
    branches = [base.integers(0, MODEL.vocab_size, 24).tolist() for _ in range(4)]
    follow = [base.integers(0, MODEL.vocab_size, 20).tolist() for _ in range(3)]
    full = system + branches[int(rng.integers(4))] + follow[int(rng.integers(3))]
    return full[: int(rng.integers(20, len(full) + 1))]


def prefill(tokens: list[int]) -> tuple[PagePool, int]:
    pool = PagePool(MODEL.layout, page_size=CHUNK, num_pages=16)
    route = pool.new_route()
    MODEL.prefill(pool, route, tokens)
    return pool, route


def gc_cli(args: dict[str, Any]) -> tuple[int, str]:
    kvc = str(Path(sys.executable).parent / "kvc")
    proc = subprocess.run(
        [
            kvc,
            "gc",
            "--catalog",
            args["catalog"],
            "--store",
            args["store"],
            "--max-age",
            str(args["max_age_s"]),
            "--grace",
            str(args["grace_s"]),
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env={k: v for k, v in os.environ.items() if not k.startswith("KVC_")},
    )
    return proc.returncode, proc.stderr.strip()[-500:]


def main() -> None:
    args = json.loads(sys.argv[1])
    role, wid = args["role"], args["id"]
    deadline = time.monotonic() + args["seconds"]
    rng = np.random.default_rng(1000 + wid)
    counts: Counter[str] = Counter()
    unexpected: list[str] = []
    cat = Catalog.open(args["catalog"])
    store = open_store(args["store"])

    def guard(op: str, fn: Any, *a: Any, **kw: Any) -> Any:
        try:
            out = fn(*a, **kw)
            counts[op] += 1
            return out
        except EXPECTED as exc:
            counts[f"expected.{op}.{type(exc).__name__}"] += 1
        except Exception:
            unexpected.append(f"{op}: {traceback.format_exc()[-1500:]}")
        return None

    ck = Checkpointer(cat, store, NS, CHUNK, actor=f"w{wid}", purge_wait_s=60)
    restorer = Restorer(cat, [store], NS)

    def head_of_family() -> bytes | None:
        match = guard("lookup", cat.lookup, NS, MODEL.fingerprint, family(rng))
        return match.chunks[-1].prefix_hash if match is not None and match.chunks else None

    def refs_step(step: int) -> None:
        """Ref and pin churn in a fixed rotation (so every kind of change happens), on
        random targets. Each worker first keeps one pin and one ref it never removes,
        so some roots are certain to survive the run."""
        if counts["keep"] == 0:
            head = head_of_family()
            if (
                head is not None
                and guard("pin", cat.pin, NS, f"keep-{wid}", head) is not None
                and guard("create_ref", cat.create_ref, NS, f"keep-{wid}", MODEL.fingerprint, head)
            ):
                counts["keep"] = 1
            return
        refs = guard("list_refs", cat.list_refs, NS) or []
        op = REF_OPS[step % len(REF_OPS)]
        if op == "fork" and refs:
            src = refs[int(rng.integers(len(refs)))]
            guard("fork", cat.fork_ref, NS, src.name, f"fork-{wid}-{counts['fork']}")
        elif op == "delete_ref":
            mortal = [r for r in refs if not r.name.startswith("keep-")]
            if mortal:
                guard("delete_ref", cat.delete_ref, NS, mortal[int(rng.integers(len(mortal)))].name)
        elif op == "move_ref" and len(refs) >= 2:
            a, b = (refs[int(i)] for i in rng.choice(len(refs), 2, replace=False))
            guard("move_ref", cat.update_ref, NS, a.name, expected_head=a.head_hash, new_head=b.head_hash)
        elif op == "unpin":
            pins = [p for p in guard("list_pins", cat.list_pins, NS) or [] if not p.name.startswith("keep-")]
            if pins:
                guard("unpin", cat.unpin, NS, pins[int(rng.integers(len(pins)))].name)
        elif op in ("pin", "create_ref"):
            head = head_of_family()
            if head is None:
                return
            if op == "pin":  # half of them expiring soon
                ttl = None if rng.random() < 0.5 else 2.0
                guard("pin", cat.pin, NS, f"hold-{wid}-{int(rng.integers(8))}", head, ttl_s=ttl)
            else:
                guard("create_ref", cat.create_ref, NS, f"pin-{wid}-{counts['create_ref']}", MODEL.fingerprint, head)

    def done() -> bool:
        """The situation the test asserts is guaranteed, not left to the random schedule."""
        if role == "gc":
            return counts["gc"] >= 3
        if role == "refs":
            changes = sum(counts[op] for op in ("fork", "move_ref", "delete_ref", "create_ref"))
            return counts["keep"] == 1 and counts["pin"] >= 3 and counts["unpin"] >= 1 and changes >= 5
        return counts["publish"] >= 4 and counts["verified"] >= 4

    step = 0
    try:
        # On a loaded machine one `kvc gc` can take seconds: a worker goes on past its
        # deadline (for at most a minute) until it has done what the test asserts.
        while len(unexpected) < 5 and (
            time.monotonic() < deadline or (not done() and time.monotonic() < deadline + 60)
        ):
            step += 1
            if role == "gc":
                t0 = time.monotonic()
                code, err = gc_cli(args)
                ms = int((time.monotonic() - t0) * 1000)
                counts["gc_ms_max"] = max(counts["gc_ms_max"], ms)
                if code == 0:
                    counts["gc"] += 1
                else:
                    unexpected.append(f"kvc gc exited {code}: {err}")
                time.sleep(max(0.2, args["gc_every_s"] - ms / 1000))
                continue
            if role == "refs":
                refs_step(step)
                time.sleep(0.02)
                continue
            toks = family(rng)
            if rng.random() < 0.5:
                pool, route = prefill(toks)
                name = f"chat-{int(rng.integers(3))}" if rng.random() < 0.5 else None
                res = guard("publish", ck.checkpoint, pool, route, toks, MODEL.fingerprint, name)
                if res is not None:
                    counts["purge_retries"] += res.purge_retries
            else:
                dst = PagePool(MODEL.layout, page_size=CHUNK, num_pages=16)
                res = guard("restore", restorer.restore, dst, toks, MODEL.fingerprint)
                if res is not None and res.route is not None:
                    counts["restored_tokens"] += res.restored_tokens
                    n = res.restored_tokens
                    want_pool, want_route = prefill(toks)
                    k, v = dst.read(res.route)
                    k0, v0 = want_pool.read(want_route)
                    if not (np.array_equal(k, k0[:, :n]) and np.array_equal(v, v0[:, :n])):
                        unexpected.append(f"restore of {n} tokens differs from a fresh prefill")
                    counts["verified"] += 1
    finally:
        ck.close()
        restorer.close()
        cat.close()
    print(json.dumps({"id": wid, "role": role, "counts": counts, "unexpected": unexpected}))


if __name__ == "__main__":
    main()
