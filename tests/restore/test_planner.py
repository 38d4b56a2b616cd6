"""The planner picks the option with the lowest estimated time to first token, and says why."""

from __future__ import annotations

import pytest

from restore.planner import Planner


def test_slow_tier_loses_to_recompute_for_a_short_prefix() -> None:
    p = Planner(prefill_tokens_per_s=10_000, tier_bytes_per_s={"object": 20e6})
    # 64 tokens of a big model: 64 x 112 KiB = 7.0 MiB at 19.1 MiB/s = 367 ms vs 6.4 ms of prefill
    d = p.plan(100, restorable_tokens=64, restore_bytes=64 * 114_688, tier="object")
    assert d.action == "recompute"
    assert "recompute" in d.reason and "restore" in d.reason
    # In the binary units of every kvc output: 7340032 bytes, 20e6 bytes/s.
    assert "(7.0 MiB from object at 19.1 MiB/s = 367.0 ms)" in d.reason, d.reason


def test_slow_tier_wins_for_a_long_prefix() -> None:
    p = Planner(prefill_tokens_per_s=2_000, tier_bytes_per_s={"object": 200e6})
    d = p.plan(32_768, restorable_tokens=32_000, restore_bytes=32_000 * 20_000, tier="object")
    assert d.action == "restore" and d.reuse_tokens == 32_000
    assert d.est_seconds < 32_768 / 2_000
    assert "beats recompute" in d.reason


def test_resident_fork_beats_restore_of_the_same_tokens() -> None:
    p = Planner(prefill_tokens_per_s=5_000)
    d = p.plan(4096, resident_tokens=4000, restorable_tokens=4000, restore_bytes=4000 * 100_000)
    assert d.action == "fork" and d.reuse_tokens == 4000


def test_measured_rates_change_the_decision() -> None:
    p = Planner(prefill_tokens_per_s=10_000, tier_bytes_per_s={"local": 5e9})
    args = {"restorable_tokens": 1000, "restore_bytes": 100_000_000, "tier": "local"}
    assert p.plan(1024, **args).action == "restore"  # type: ignore[arg-type]
    p.use_measured({"local": 100_000_000 / 2.0})  # the disk turns out to be slow
    assert p.plan(1024, **args).action == "recompute"  # type: ignore[arg-type]
    for _ in range(40):  # and the engine turns out to be slow too
        p.observe_prefill(1000, 10.0)
    assert p.plan(1024, **args).action == "restore"  # type: ignore[arg-type]


def test_bad_input() -> None:
    with pytest.raises(ValueError):
        Planner(prefill_tokens_per_s=0)
    p = Planner(prefill_tokens_per_s=1)
    with pytest.raises(ValueError, match="at least one token"):
        p.plan(0)
    with pytest.raises(ValueError, match="tier"):
        p.plan(10, restorable_tokens=5, restore_bytes=5, tier="floppy")
