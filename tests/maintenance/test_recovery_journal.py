"""Disaster recovery, names and removals: refs, pins and quarantines come back from the stores'
journal, and what GC purged stays purged, with nothing but the store URLs."""

from __future__ import annotations

import shutil
from datetime import UTC, datetime
from pathlib import Path

from catalog.catalog import Catalog
from catalog.gc import plan_gc
from catalog.purge import apply_gc
from chunkstore import ChunkStore, open_store
from maintenance.rebuild import rebuild
from restore.journal import attach_journal
from tests.maintenance.test_recovery import (
    CHUNK,
    FP,
    P,
    Q,
    R,
    checkpoint,
    drop_database,
    restore_in_new_process,
    straight,
)

NS = "default"


def test_names_and_removals_come_back_from_the_journal(catalog_url: str, tmp_path: Path) -> None:
    a_url, old_url = f"file://{tmp_path / 'a'}", f"file://{tmp_path / 'old-copy'}"
    a = open_store(a_url)
    with Catalog.open(catalog_url, upgrade=True) as cat:
        attach_journal(cat, [a])
        checkpoint(cat, a, [P, Q, R])  # refs by length: c100 (moved from P to Q), c64 (R)
        p_line = cat.lookup(NS, FP, [*P, 0]).chunks
        q_line = cat.lookup(NS, FP, [*Q, 0]).chunks
        r_keys = [c.blob_key for c in cat.lookup(NS, FP, [*R, 0]).chunks]
        cat.create_ref(NS, "chat-p", FP, p_line[-1].prefix_hash, pending_token=P[-1])
        cat.fork_ref(NS, "chat-p", "chat-p2")
        cat.create_ref(NS, "chat-q", FP, q_line[-1].prefix_hash)
        cat.update_ref(
            NS, "chat-q", expected_head=q_line[-1].prefix_hash, new_head=q_line[1].prefix_hash
        )
        cat.pin(NS, "keep", p_line[1].prefix_hash, reason="system prompt")
        cat.pin(NS, "gone", p_line[0].prefix_hash)
        cat.unpin(NS, "gone")
        cat.quarantine(NS, q_line[2].prefix_hash, "bad kernel")
        # An operator's old copy of the store, taken before GC ran: its copies of R's
        # blobs must not come back once GC has purged them.
        shutil.copytree(tmp_path / "a", tmp_path / "old-copy")
        cat.delete_ref(NS, f"c{len(R)}")  # R's only root
        plan = plan_gc(cat, NS, max_age_s=0, max_bytes=None, now=datetime.now(UTC))
        assert {i.blob_key for i in plan.items} >= set(r_keys)
        apply_gc(cat, plan, lambda loc, key: a.delete(key) or True)
        refs_before = {r.name: r.head_hash for r in cat.list_refs(NS)}
        assert cat.journal_failures == 0
    drop_database(catalog_url)

    old = open_store(old_url)
    with Catalog.open(catalog_url, upgrade=True) as cat:
        report = rebuild(cat, [a, old])  # nothing but the stores
        assert report.complete, report.to_dict()
        assert set(report.journal.purged) >= set(r_keys)  # GC's decision stands
        assert {r.name: r.head_hash for r in cat.list_refs(NS)} == refs_before
        assert "chat-q" in refs_before and f"c{len(R)}" not in refs_before
        assert cat.get_ref(NS, "chat-q").head_hash == q_line[1].prefix_hash  # the latest move
        assert cat.get_ref(NS, "chat-p2").forked_from == "chat-p"
        assert [p.name for p in cat.list_pins(NS)] == ["keep"]
        assert cat.get_prefix(NS, q_line[2].prefix_hash).quarantined
        # Q's own third chunk is quarantined: only P's sibling serves (the 6 tokens they share).
        third = cat.lookup(NS, FP, [*Q, 0]).chunks[2]
        assert third.prefix_hash != q_line[2].prefix_hash and third.tokens_used == 70 - 2 * CHUNK
        assert not cat.lookup(NS, FP, [*R, 0]).hit
        again = rebuild(cat, [a, old])  # idempotent: nothing new, nothing disagrees
        assert again.complete and again.recorded == 0, again.to_dict()
        assert not (again.journal.refs_added or again.journal.pins_added)
    got = restore_in_new_process(catalog_url, [a_url], P)
    assert got["restored"] == len(P) - 1
    assert (got["tokens"], got["logits"]) == straight(P, 6)
    for s in (a, old):
        s.close()


def test_a_ref_the_catalog_has_otherwise_is_kept_and_reported(tmp_path: Path) -> None:
    a = open_store(f"file://{tmp_path / 'a'}")
    with Catalog.open(f"sqlite:///{tmp_path / 'one.db'}", upgrade=True) as cat:
        attach_journal(cat, [a])
        checkpoint(cat, a, [P])
        line = cat.lookup(NS, FP, [*P, 0]).chunks
        cat.create_ref(NS, "chat", FP, line[-1].prefix_hash)
    with Catalog.open(f"sqlite:///{tmp_path / 'two.db'}", upgrade=True) as cat:
        rebuild(cat, a, dry_run=False)
        cat.update_ref(NS, "chat", expected_head=line[-1].prefix_hash, new_head=line[0].prefix_hash)
        report = rebuild(cat, a)
        assert report.journal.disagreements == ["ref default/chat"] and not report.complete
        assert cat.get_ref(NS, "chat").head_hash == line[0].prefix_hash  # not overwritten


def test_dry_run_counts_the_names_it_would_bring_back(tmp_path: Path) -> None:
    a: ChunkStore = open_store(f"file://{tmp_path / 'a'}")
    with Catalog.open(f"sqlite:///{tmp_path / 'lost.db'}", upgrade=True) as cat:
        attach_journal(cat, [a])
        checkpoint(cat, a, [P, R])  # refs c100 and c64
    report = rebuild(None, a, dry_run=True)
    assert sorted(report.journal.refs_added) == ["default/c100", "default/c64"]
    assert not (tmp_path / "new.db").exists()
