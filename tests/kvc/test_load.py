"""The service under concurrent clients: no errors, no wrong answers, nothing lost.

Throughput and latency are measured by bench/load_service.py (run by hand); this
test asserts only what a user would notice whatever the machine's speed.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from load_service import run_load


def test_service_under_concurrent_clients(tmp_path: Path) -> None:
    # The clients go on past 5 s (at most a minute) until they have made what is asserted.
    res = run_load(
        f"sqlite:///{tmp_path / 'catalog.db'}",
        clients=20,
        seconds=5,
        workdir=tmp_path,
        min_ops={"lookup": 51, "publish": 1},
    )
    summary = res.summary()
    assert res.errors == []
    assert res.wrong == []  # every lookup found the whole prefix it asked for
    assert res.lost == []  # every acknowledged publish is in the catalog afterwards
    assert summary["lookup"]["count"] > 50 and summary["publish"]["count"] > 0
    assert len(res.published) == summary["publish"]["count"]
    # Memory stays flat: no more than 64 MiB growth over the run.
    assert res.rss_end_kb - res.rss_start_kb < 64 * 1024, summary
