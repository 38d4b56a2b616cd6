"""The checkpoint/restore daemon: two workers on one catalog, resident replicas, reconcile, HTTP errors, timers."""

from __future__ import annotations

import logging
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Protocol, cast

import click
import numpy as np
import pytest
import uvicorn
from click.testing import CliRunner

from catalog import Fingerprint
from catalog.catalog import Catalog
from catalog.remote import RemoteCatalog
from chunkstore import ChunkStore, open_store
from kvc.commands.daemon import register
from kvc.daemon import Daemon, create_daemon_app
from restore.engines.reference import ReferenceModel
from restore.pool import PagePool

with warnings.catch_warnings():
    # Starlette nudges towards `httpx2`; the project uses httpx, which TestClient still supports.
    warnings.filterwarnings("ignore", message=".*httpx2.*")
    from fastapi.testclient import TestClient

MODEL = ReferenceModel.small(seed=0)
CHUNK = 32
PROMPT = np.random.default_rng(7).integers(0, MODEL.vocab_size, 3 * CHUNK + 9).tolist()

Worker = tuple[Daemon, TestClient]


class Start(Protocol):
    def __call__(
        self, worker_id: str, *, invalidation_interval: float = 0.0, catalog: Any = None
    ) -> Worker: ...


@pytest.fixture
def cat(tmp_path: Path) -> Iterator[Catalog]:
    c = Catalog.open(f"sqlite:///{tmp_path / 'catalog.db'}", upgrade=True)
    yield c
    c.close()


@pytest.fixture
def store(tmp_path: Path) -> Iterator[ChunkStore]:
    s = open_store(f"file://{tmp_path / 'blobs'}")
    yield s
    s.close()


@pytest.fixture
def worker(cat: Catalog, store: ChunkStore) -> Iterator[Start]:
    """Start daemons on the shared catalog and store; each is closed at the end of the test.

    The invalidation timer is off unless a test asks for it, so the tests that
    call refresh see the invalidations themselves.
    """
    started: list[Daemon] = []

    def start(worker_id: str, *, invalidation_interval: float = 0.0, catalog: Any = None) -> Worker:
        d = Daemon(
            cat if catalog is None else catalog,
            [store],
            worker_id=worker_id,
            namespace="ns",
            chunk_size=CHUNK,
            page_size=16,
            engines=[MODEL],
            invalidation_interval=invalidation_interval,
        )
        started.append(d)
        d.reconcile()
        return d, TestClient(create_daemon_app(d), base_url="http://127.0.0.1")

    yield start
    for d in started:
        d.close()


def configured(start: Callable[..., Worker], worker_id: str, **options: Any) -> Worker:
    d, client = start(worker_id, **options)
    r = client.post("/v1/configure", json={"fingerprint": "reference", "num_pages": 64})
    assert r.status_code == 200, r.text
    assert r.json()["fingerprint"] == MODEL.fingerprint.hex
    return d, client


def pool_of(d: Daemon) -> PagePool:
    pool = d.pool
    assert pool is not None
    return pool


def prefill_and_checkpoint(client: TestClient, tokens: list[int]) -> dict[str, Any]:
    r = client.post("/v1/prefill", json={"tokens": tokens})
    assert r.status_code == 200, r.text
    route = r.json()["route"]
    assert r.json()["length"] == len(tokens)
    r = client.post("/v1/checkpoint", json={"route": route, "tokens": tokens})
    assert r.status_code == 200, r.text
    doc: dict[str, Any] = r.json()
    return doc


def test_checkpoint_on_one_daemon_restores_bit_exact_on_another(
    worker: Callable[[str], Worker],
) -> None:
    a, client_a = configured(worker, "A")
    b, client_b = worker("B")
    # B names the fingerprint by hex: A's configure registered it in the catalog.
    r = client_b.post("/v1/configure", json={"fingerprint": MODEL.fingerprint.hex, "num_pages": 64})
    assert r.status_code == 200, r.text

    cp = prefill_and_checkpoint(client_a, PROMPT)
    assert (cp["new_chunks"], cp["skipped_chunks"], cp["chunks"]) == (4, 0, 4)
    assert cp["head"] is not None and len(cp["head"]) == 64
    route_a = cp["route"]

    r = client_b.post("/v1/restore", json={"tokens": PROMPT})
    assert r.status_code == 200, r.text
    hit = r.json()
    assert hit["restored_tokens"] == len(PROMPT) - 1
    assert hit["recompute_from"] == len(PROMPT) - 1
    k_b, v_b = pool_of(b).read(hit["route"])
    k_a, v_a = pool_of(a).read(route_a, 0, len(PROMPT) - 1)
    assert k_b.tobytes() == k_a.tobytes() and v_b.tobytes() == v_a.tobytes()

    # Feeding the pending token on B's restored route continues exactly like A.
    r = client_b.post("/v1/prefill", json={"tokens": PROMPT[-1:], "route": hit["route"]})
    assert r.status_code == 200, r.text
    assert pool_of(b).read(hit["route"])[0].tobytes() == pool_of(a).read(route_a)[0].tobytes()

    stats = client_b.get("/v1/stats").json()
    assert stats["restores"] == 1 and stats["restored_tokens"] == len(PROMPT) - 1
    assert stats["restored_bytes"] > 0
    assert stats["pages_total"] == 64 and stats["pages_free"] < 64


def test_a_second_checkpoint_of_the_same_prefix_stores_nothing_new(
    worker: Callable[[str], Worker],
) -> None:
    _, client = configured(worker, "A")
    prefill_and_checkpoint(client, PROMPT)
    again = prefill_and_checkpoint(client, PROMPT)
    assert (again["new_chunks"], again["skipped_chunks"], again["stored_bytes"]) == (0, 4, 0)


def test_a_miss_answers_204(worker: Callable[[str], Worker]) -> None:
    _, client_a = configured(worker, "A")
    prefill_and_checkpoint(client_a, PROMPT)
    _, client_b = configured(worker, "B")
    other = [(t + 1) % MODEL.vocab_size for t in PROMPT]
    r = client_b.post("/v1/restore", json={"tokens": other})
    assert r.status_code == 204
    assert r.content == b""
    stats = client_b.get("/v1/stats").json()
    assert stats["restore_misses"] == 1 and stats["routes"] == {}


def test_resident_replicas_are_advertised_and_reconciled_away_on_restart(
    worker: Callable[[str], Worker], cat: Catalog, store: ChunkStore
) -> None:
    _, client_a = configured(worker, "A")
    prefill_and_checkpoint(client_a, PROMPT)
    match = cat.lookup("ns", MODEL.fingerprint, [*PROMPT, 0])
    keys = sorted(c.blob_key for c in match.chunks)
    assert len(keys) == 4
    assert cat.replicas_at("worker:A") == keys
    for c in match.chunks:
        resident = [r for r in c.replicas if r.location == "worker:A"]
        assert [(r.tier, r.worker) for r in resident] == [("resident", "A")]

    # B restores the prefix: it now holds the chunks it loaded whole, too (not the
    # tail, whose last position stays pending).
    _, client_b = configured(worker, "B")
    assert client_b.post("/v1/restore", json={"tokens": PROMPT}).status_code == 200
    whole = sorted(c.blob_key for c in match.chunks if c.token_start + c.token_count < len(PROMPT))
    assert len(whole) == 3
    assert cat.replicas_at("worker:B") == whole

    # A new process under worker id A holds nothing: its start withdraws A's replicas only.
    restarted, _ = worker("A")
    assert cat.replicas_at("worker:A") == []
    assert cat.replicas_at("worker:B") == whole
    assert cat.replicas_at(store.name) == keys
    assert restarted.reconcile() == 0


def test_clear_and_release_withdraw_what_the_pool_no_longer_holds(
    worker: Callable[[str], Worker], cat: Catalog
) -> None:
    d, client = configured(worker, "A")
    first = prefill_and_checkpoint(client, PROMPT[: 2 * CHUNK])
    second = prefill_and_checkpoint(client, PROMPT)
    assert len(cat.replicas_at("worker:A")) == 4

    # The first two chunks are still held by the second route.
    r = client.post("/v1/release", json={"route": first["route"]})
    assert r.status_code == 200
    assert len(cat.replicas_at("worker:A")) == 4
    assert client.post("/v1/release", json={"route": first["route"]}).status_code == 404

    r = client.post("/v1/clear")
    assert r.status_code == 200 and r.json()["released"] == [second["route"]]
    assert cat.replicas_at("worker:A") == []
    stats = client.get("/v1/stats").json()
    assert stats["routes"] == {} and stats["pages_free"] == stats["pages_total"] == 64
    assert pool_of(d).routes() == []


def test_reconfiguring_with_another_fingerprint_drops_the_pool(
    worker: Callable[[str], Worker], cat: Catalog
) -> None:
    d, client = configured(worker, "A")
    prefill_and_checkpoint(client, PROMPT)
    old = pool_of(d)
    # The same request again keeps the pool and its routes.
    r = client.post("/v1/configure", json={"fingerprint": "reference", "num_pages": 64})
    assert r.json()["reconfigured"] is False and d.pool is old

    other = ReferenceModel.small(seed=0, kv_dtype="float32").fingerprint
    r = client.post("/v1/configure", json={"fingerprint": dict(other.descriptor), "num_pages": 8})
    assert r.status_code == 200, r.text
    assert r.json()["reconfigured"] is True and r.json()["layout"]["dtype"] == "float32"
    assert d.pool is not old and pool_of(d).routes() == []
    assert cat.replicas_at("worker:A") == []
    # Not a model the daemon can run: prefill is the reference hook only.
    r = client.post("/v1/prefill", json={"tokens": [1, 2, 3]})
    assert r.status_code == 409 and "reference" in r.json()["error"]


def test_requests_before_configure_and_on_unknown_routes_are_refused(
    worker: Callable[[str], Worker],
) -> None:
    _, client = worker("A")
    assert client.get("/healthz").json() == {"ok": True, "worker": "A", "configured": False}
    r = client.post("/v1/restore", json={"tokens": [1, 2, 3]})
    assert r.status_code == 409 and "configure" in r.json()["error"]
    assert client.post("/v1/configure", json={"fingerprint": "ab" * 32, "num_pages": 4}).json()[
        "field"
    ] == ("fingerprint")

    _, client = configured(worker, "B")
    r = client.post("/v1/checkpoint", json={"route": 99, "tokens": [1, 2]})
    assert (r.status_code, r.json()["field"]) == (404, "route")
    route = client.post("/v1/prefill", json={"tokens": [1, 2]}).json()["route"]
    r = client.post("/v1/checkpoint", json={"route": route, "tokens": [1, 2, 3]})
    assert r.status_code == 409 and "holds 2 positions" in r.json()["error"]
    r = client.post("/v1/prefill", json={"tokens": [MODEL.vocab_size]})
    assert (r.status_code, r.json()["field"]) == (422, "tokens")
    r = client.post("/v1/prefill", json={"tokens": list(range(200)) * 6})
    assert r.status_code == 507 and "free" in r.json()["error"]
    errors = client.get("/v1/stats").json()["last_errors"]
    assert [e["status"] for e in errors] == [404, 409, 422, 507]


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        ("/v1/restore", {}, "tokens"),
        ("/v1/restore", {"tokens": []}, "tokens"),
        ("/v1/restore", {"tokens": ["1", 2]}, "tokens.0"),
        ("/v1/restore", {"tokens": [-1]}, "tokens.0"),
        ("/v1/restore", {"tokens": [1], "extra": 1}, "extra"),
        ("/v1/checkpoint", {"tokens": [1, 2]}, "route"),
        ("/v1/checkpoint", {"route": 1, "tokens": [1], "pending": 1.5}, "pending"),
        ("/v1/configure", {"fingerprint": "reference", "num_pages": 0}, "num_pages"),
        ("/v1/configure", {"fingerprint": {"format": 1}, "num_pages": 4}, "fingerprint"),
        ("/v1/configure", {"fingerprint": 123, "num_pages": 4}, "fingerprint"),
        ("/v1/configure", {"fingerprint": "reference", "num_pages": 1 << 40}, "num_pages"),
        ("/v1/prefill", "not json", "body"),
    ],
)
def test_bad_bodies_answer_422_naming_the_field(
    worker: Callable[[str], Worker], path: str, body: Any, field: str
) -> None:
    _, client = configured(worker, "A")
    if isinstance(body, str):
        r = client.post(path, content=body, headers={"content-type": "application/json"})
    else:
        r = client.post(path, json=body)
    assert r.status_code == 422, r.text
    doc = r.json()
    named = doc.get("fields", [doc.get("field")])
    assert field in named, doc
    assert "Traceback" not in r.text


def test_unexpected_errors_answer_500_without_a_traceback(
    worker: Callable[[str], Worker], monkeypatch: pytest.MonkeyPatch
) -> None:
    d, client = configured(worker, "A")

    def boom(*args: object, **kwargs: object) -> None:
        raise KeyError("secret internals")

    monkeypatch.setattr(d.catalog, "lookup", boom)
    r = client.post("/v1/restore", json={"tokens": PROMPT})
    assert r.status_code == 500
    assert "KeyError" in r.json()["error"] and "secret" not in r.text
    assert "Traceback" not in r.text


def test_a_fingerprint_descriptor_configures_the_pool_geometry(
    worker: Callable[[str], Worker],
) -> None:
    d, client = worker("A")
    fp = Fingerprint.from_descriptor(MODEL.fingerprint.descriptor)
    r = client.post(
        "/v1/configure",
        json={"fingerprint": dict(fp.descriptor), "num_pages": 10, "page_size": 8},
    )
    assert r.status_code == 200, r.text
    pool = pool_of(d)
    assert (pool.num_pages, pool.page_size, pool.layout) == (10, 8, MODEL.layout)


def test_cli_help_shows_an_example() -> None:
    group = click.Group("kvc")
    register(group)
    result = CliRunner().invoke(group, ["daemon", "--help"])
    assert result.exit_code == 0, result.output
    assert "Example: kvc daemon" in result.output
    for option in (
        "--host",
        "--port",
        "--worker-id",
        "--invalidation-interval",
        "--catalog",
        "--store",
    ):
        assert option in result.output


def test_quarantine_invalidations_drop_the_routes_holding_those_blobs(
    worker: Callable[[str], Worker], cat: Catalog
) -> None:
    a, client_a = configured(worker, "A")
    cp = prefill_and_checkpoint(client_a, PROMPT)
    other = client_a.post("/v1/prefill", json={"tokens": [1, 2, 3]}).json()["route"]
    match = cat.lookup("ns", MODEL.fingerprint, [*PROMPT, 0])
    directives = cat.quarantine("ns", match.chunks[1].prefix_hash, "bad kernel")
    assert any(d.location == "worker:A" for d in directives)
    r = client_a.post("/v1/refresh")
    assert r.status_code == 200, r.text
    assert r.json()["invalidated_routes"] == 1
    assert pool_of(a).routes() == [other]  # the route with quarantined pages is gone
    assert cp["route"] not in pool_of(a).routes()
    assert cat.replicas_at("worker:A") == []  # and its resident placements withdrawn
    assert a.apply_invalidations() == 0  # applied once


# -- the invalidation timer ------------------------------------------------------------------


def wait_for(condition: Callable[[], bool], what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"still waiting after {timeout}s for {what}")
        time.sleep(0.01)


def timer_threads(worker_id: str) -> list[threading.Thread]:
    name = f"kvc-daemon-invalidations[worker:{worker_id}]"
    return [t for t in threading.enumerate() if t.name == name]


def quarantine_second_chunk(cat: Catalog) -> None:
    match = cat.lookup("ns", MODEL.fingerprint, [*PROMPT, 0])
    directives = cat.quarantine("ns", match.chunks[1].prefix_hash, "bad kernel")
    assert any(d.location == "worker:A" for d in directives)


def test_the_timer_drops_quarantined_routes_without_a_refresh(worker: Start, cat: Catalog) -> None:
    a, client = configured(worker, "A", invalidation_interval=0.05)
    cp = prefill_and_checkpoint(client, PROMPT)
    other = client.post("/v1/prefill", json={"tokens": [1, 2, 3]}).json()["route"]
    # The timer runs and, with nothing quarantined, leaves the routes alone. Counted from
    # now: checks made before the routes existed would leave nothing to observe. Of two
    # more, the second started after this point.
    checks = client.get("/v1/stats").json()["invalidation_checks"]
    wait_for(
        lambda: client.get("/v1/stats").json()["invalidation_checks"] >= checks + 2,
        "two checks with the routes in the pool",
    )
    assert sorted(pool_of(a).routes()) == sorted([cp["route"], other])
    assert len(cat.replicas_at("worker:A")) == 4

    quarantine_second_chunk(cat)
    wait_for(lambda: pool_of(a).routes() == [other], "the quarantined route to be dropped")
    wait_for(lambda: cat.replicas_at("worker:A") == [], "its resident replicas to be withdrawn")
    pool_of(a).check_invariants()
    stats = client.get("/v1/stats").json()
    assert stats["invalidated_routes"] == 1 and stats["invalidation_failures"] == 0
    assert stats["invalidation_timer"] is True and stats["invalidation_interval"] == 0.05
    assert stats["last_invalidation_check"] is not None
    # The timer applied them: a refresh now has nothing left to drop.
    assert client.post("/v1/refresh").json()["invalidated_routes"] == 0


def test_interval_zero_starts_no_timer(worker: Start, cat: Catalog) -> None:
    d, client = worker("Z", invalidation_interval=0)
    assert timer_threads("Z") == []
    stats = client.get("/v1/stats").json()
    assert stats["invalidation_timer"] is False and stats["invalidation_interval"] == 0
    assert stats["invalidation_checks"] == 0 and stats["last_invalidation_check"] is None
    # Refresh still applies them, and that counts as a check.
    assert d.refresh()["invalidated_routes"] == 0
    stats = client.get("/v1/stats").json()
    assert stats["invalidation_checks"] == 1 and stats["last_invalidation_check"] is not None


@pytest.mark.parametrize("interval", [-1, float("nan"), float("inf"), True, "2"])
def test_a_bad_interval_is_refused(cat: Catalog, store: ChunkStore, interval: Any) -> None:
    with pytest.raises(ValueError, match="invalidation_interval"):
        Daemon(cat, [store], worker_id="X", invalidation_interval=interval)
    assert timer_threads("X") == []


@pytest.mark.parametrize("interval", [0.01, 3600.0])
def test_close_stops_the_timer(cat: Catalog, store: ChunkStore, interval: float) -> None:
    # 3600 s: close must wake the timer, not wait out its interval.
    d = Daemon(cat, [store], worker_id="C", invalidation_interval=interval)
    try:
        [timer] = timer_threads("C")
        assert timer.daemon and timer.is_alive()
    finally:
        d.close()
    assert not timer.is_alive()
    assert timer_threads("C") == []
    assert d.stats()["invalidation_timer"] is False
    d.close()  # a second close is harmless


class FlakyEvents:
    """A catalog whose `events` fails while `failures` lasts, like a database gone for a moment."""

    def __init__(self, inner: Catalog, failures: int) -> None:
        self.inner = inner
        self.failures = failures
        self.lock = threading.Lock()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def events(self, **kwargs: Any) -> Any:
        with self.lock:
            if self.failures > 0:
                self.failures -= 1
                raise ConnectionError("could not connect as kvc:hunter2@db.internal")
        return self.inner.events(**kwargs)


def test_a_failing_catalog_call_does_not_stop_the_timer(
    worker: Start, cat: Catalog, caplog: pytest.LogCaptureFixture
) -> None:
    flaky = FlakyEvents(cat, failures=3)
    caplog.set_level(logging.WARNING, logger="kvc.daemon")
    a, client = configured(worker, "A", invalidation_interval=0.02, catalog=cast(Catalog, flaky))
    # The counter moves before the tick logs its warning: wait for both.
    wait_for(
        lambda: (
            client.get("/v1/stats").json()["invalidation_failures"] == 3
            and len([r for r in caplog.records if "invalidation check" in r.getMessage()]) == 3
        ),
        "three failed ticks",
    )
    cp = prefill_and_checkpoint(client, PROMPT)
    quarantine_second_chunk(cat)
    wait_for(lambda: cp["route"] not in pool_of(a).routes(), "the quarantined route to be dropped")

    [timer] = timer_threads("A")
    assert timer.is_alive()
    stats = client.get("/v1/stats").json()
    assert stats["invalidation_failures"] == 3 and stats["invalidated_routes"] == 1
    failures = [r for r in caplog.records if "invalidation check" in r.getMessage()]
    assert len(failures) == 3 and all(r.levelno == logging.WARNING for r in failures)
    assert "ConnectionError" in failures[0].getMessage()
    assert "hunter2" not in caplog.text


def test_cli_sets_the_interval_from_flag_environment_and_default(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[Any] = []

    def serve(app: Any, **kwargs: Any) -> None:
        # Instead of serving: ask the app what its daemon runs with.
        stats = TestClient(app, base_url="http://127.0.0.1:8708").get("/v1/stats").json()
        seen.append((stats["invalidation_interval"], stats["invalidation_timer"]))

    monkeypatch.setattr(uvicorn, "run", serve)
    group = click.Group("kvc")
    register(group)
    env = {"KVC_HOME": str(tmp_path / "home"), "KVC_CONFIG": str(tmp_path / "absent.toml")}
    runner = CliRunner()
    base = ["daemon", "--worker-id", "cli", "--json"]

    result = runner.invoke(group, [*base, "--invalidation-interval", "0.5"], env=env)
    assert result.exit_code == 0, result.output
    env["KVC_DAEMON_INVALIDATION_INTERVAL"] = "0"
    result = runner.invoke(group, base, env=env)
    assert result.exit_code == 0, result.output
    del env["KVC_DAEMON_INVALIDATION_INTERVAL"]
    result = runner.invoke(group, base, env=env)
    assert result.exit_code == 0, result.output
    assert seen == [(0.5, True), (0.0, False), (2.0, True)]
    assert timer_threads("cli") == []  # every run's timer stopped with it

    result = runner.invoke(group, [*base, "--invalidation-interval", "-1"], env=env)
    assert result.exit_code == 2
    result = runner.invoke(group, base, env={**env, "KVC_DAEMON_INVALIDATION_INTERVAL": "nan"})
    assert result.exit_code == 2 and "daemon_invalidation_interval" in result.output


# -- the planner decides each restore ------------------------------------------------------


def planned(cat: Catalog, store: ChunkStore, worker_id: str, rate: float) -> Worker:
    d = Daemon(
        cat,
        [store],
        worker_id=worker_id,
        namespace="ns",
        chunk_size=CHUNK,
        engines=[MODEL],
        invalidation_interval=0,
        prefill_tokens_per_s=rate,
    )
    client = TestClient(create_daemon_app(d), base_url="http://127.0.0.1")
    r = client.post("/v1/configure", json={"fingerprint": "reference", "num_pages": 64})
    assert r.status_code == 200, r.text
    return d, client


def test_the_planner_leaves_a_prompt_to_recompute_when_prefill_is_faster(
    worker: Start, cat: Catalog, store: ChunkStore
) -> None:
    _, client_a = configured(worker, "A")
    prefill_and_checkpoint(client_a, PROMPT)
    b, client_b = planned(cat, store, "B", rate=1e15)
    try:
        r = client_b.post("/v1/restore", json={"tokens": PROMPT})
        assert r.status_code == 200, r.text
        doc = r.json()
        assert doc["decision"]["action"] == "recompute"
        assert (
            doc["decision"]["reason"].startswith("recompute:")
            and "beats restore" in doc["decision"]["reason"]
        )
        assert (doc["route"], doc["restored_tokens"], doc["recompute_from"]) == (None, 0, 0)
        # Nothing was restored: no route, no page taken, no resident replica.
        assert pool_of(b).routes() == [] and pool_of(b).free_pages == 64
        assert cat.replicas_at("worker:B") == []
        stats = client_b.get("/v1/stats").json()
        assert (stats["restores"], stats["restored_bytes"], stats["planned_recomputes"]) == (
            0,
            0,
            1,
        )
    finally:
        b.close()


def test_prefills_teach_the_planner_this_engines_rate(cat: Catalog, store: ChunkStore) -> None:
    # Configured absurdly fast; the prefills the daemon runs pull the rate toward what
    # the engine really does, so a later restore is weighed against real numbers.
    d, client = planned(cat, store, "P", rate=1e15)
    try:
        for _ in range(3):
            r = client.post("/v1/prefill", json={"tokens": PROMPT})
            assert r.status_code == 200, r.text
        assert client.get("/v1/stats").json()["prefill_tokens_per_s"] < 0.6 * 1e15
    finally:
        d.close()


def test_the_planner_restores_when_prefill_is_slower(
    worker: Start, cat: Catalog, store: ChunkStore
) -> None:
    _, client_a = configured(worker, "A")
    prefill_and_checkpoint(client_a, PROMPT)
    b, client_b = planned(cat, store, "B", rate=1e-3)
    try:
        doc = client_b.post("/v1/restore", json={"tokens": PROMPT}).json()
        assert doc["decision"]["action"] == "restore"
        assert (
            doc["decision"]["reason"].startswith("restore:")
            and "from local" in doc["decision"]["reason"]
        )
        assert {o["action"] for o in doc["decision"]["options"]} == {"restore", "recompute"}
        assert doc["restored_tokens"] == len(PROMPT) - 1 and doc["bytes"] > 0
        assert pool_of(b).routes() == [doc["route"]]
        assert client_b.get("/v1/stats").json()["restores"] == 1
    finally:
        b.close()


def test_a_prefix_resident_in_the_pool_is_forked_not_fetched(worker: Start, cat: Catalog) -> None:
    a, client = configured(worker, "A")
    cp = prefill_and_checkpoint(client, PROMPT)
    doc = client.post("/v1/restore", json={"tokens": [*PROMPT, 5]}).json()
    assert doc["decision"]["action"] == "fork", doc["decision"]
    assert (doc["restored_tokens"], doc["bytes"], doc["chunks"]) == (len(PROMPT), 0, 0)
    pool = pool_of(a)
    # The fork shares the checkpointed route's pages, bit for bit.
    assert pool.page_table(doc["route"])[:2] == pool.page_table(cp["route"])[:2]
    assert pool.read(doc["route"])[0].tobytes() == pool.read(cp["route"])[0].tobytes()
    stats = client.get("/v1/stats").json()
    assert (stats["planned_forks"], stats["restores"]) == (1, 0)
    pool.check_invariants()


# -- demand ----------------------------------------------------------------------------------


def test_the_daemon_declares_demand_for_what_it_holds(worker: Start, cat: Catalog) -> None:
    _, client_a = configured(worker, "A")
    cp = prefill_and_checkpoint(client_a, PROMPT)
    head = bytes.fromhex(cp["head"])
    assert cat.demand("ns", [head]) == {head: 1.0}
    _, client_b = configured(worker, "B")
    assert client_b.post("/v1/restore", json={"tokens": PROMPT}).status_code == 200
    # B restored the three whole chunks: it demands the third, A the tail after it.
    third = cat.lookup("ns", MODEL.fingerprint, PROMPT).chunks[2].prefix_hash
    assert cat.demand("ns", [head, third]) == {head: 1.0, third: 1.0}


def test_a_demanded_route_outlives_an_undemanded_one_of_the_same_age(
    worker: Start, cat: Catalog
) -> None:
    d, client = configured(worker, "A")
    first = prefill_and_checkpoint(client, PROMPT[: 2 * CHUNK])
    other = [(t + 1) % MODEL.vocab_size for t in PROMPT[: 2 * CHUNK]]
    demanded = prefill_and_checkpoint(client, other)
    pool = pool_of(d)
    # Both are durable and equally demanded (by this worker): eviction is LRU, the older goes.
    assert pool.evict(1) == [first["route"]]

    undemanded = prefill_and_checkpoint(client, PROMPT[: 2 * CHUNK])
    assert pool.routes() == [demanded["route"], undemanded["route"]]
    # Another worker needs the now older prefix: the next sync reads its demand into the pool.
    cat.declare_demand("B", "ns", bytes.fromhex(demanded["head"]), priority=3.0)
    assert client.post("/v1/refresh").status_code == 200
    assert pool.evict(1) == [undemanded["route"]]
    assert pool.routes() == [demanded["route"]]


# -- KVC_SERVICE_URL: the daemon on a `kvc serve` service instead of a database ---------------

SERVICE_TOKEN = "daemon-service-token-5d1f"


@pytest.fixture
def service_url(cat: Catalog) -> Iterator[str]:
    from kvc.service import create_app, hash_token
    from tests.services import serve_in_thread

    with serve_in_thread(
        create_app(cat, {"ns": hash_token(SERVICE_TOKEN)}, max_prompt_tokens=4096)
    ) as url:
        yield url


def service_env(tmp_path: Path, url: str) -> dict[str, str]:
    return {
        "KVC_HOME": str(tmp_path / "home"),
        "KVC_CONFIG": str(tmp_path / "absent.toml"),
        "KVC_STORES": f"file://{tmp_path / 'blobs'}",
        "KVC_NAMESPACE": "ns",
        "KVC_SERVICE_URL": url,
        "KVC_SERVICE_TOKEN": SERVICE_TOKEN,
    }


def test_cli_opens_the_service_named_by_kvc_service_url_instead_of_a_database(
    tmp_path: Path, service_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import kvc.daemon

    seen: list[Any] = []

    class Recorder:
        def __init__(self, catalog: Any, stores: Any, **kwargs: Any) -> None:
            # A real round trip: the service answers for the namespace the token opens.
            seen.append((catalog, catalog.namespace_chunk_size("ns"), kwargs["namespace"]))
            raise ValueError("recorded")

    monkeypatch.setattr(kvc.daemon, "Daemon", Recorder)
    group = click.Group("kvc")
    register(group)
    env = service_env(tmp_path, service_url)
    result = CliRunner().invoke(group, ["daemon", "--worker-id", "svc", "--json"], env=env)
    assert result.exit_code == 2 and "recorded" in result.output
    [(catalog, _, namespace)] = seen
    assert isinstance(catalog, RemoteCatalog) and catalog.base_url == service_url
    assert namespace == "ns"
    assert not (tmp_path / "home" / "catalog.db").exists()  # no database was opened

    del env["KVC_SERVICE_TOKEN"]
    result = CliRunner().invoke(group, ["daemon", "--worker-id", "svc"], env=env)
    assert result.exit_code == 2 and "KVC_SERVICE_TOKEN" in result.output


def test_a_daemon_on_the_service_checkpoints_and_restores(
    tmp_path: Path, service_url: str, cat: Catalog, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[Any] = []

    def serve(app: Any, **kwargs: Any) -> None:
        client = TestClient(app, base_url="http://127.0.0.1:8708")
        r = client.post("/v1/configure", json={"fingerprint": "reference", "num_pages": 64})
        assert r.status_code == 200, r.text
        cp = prefill_and_checkpoint(client, PROMPT)
        seen.append((cp, client.post("/v1/restore", json={"tokens": PROMPT}).json()))

    monkeypatch.setattr(uvicorn, "run", serve)
    group = click.Group("kvc")
    register(group)
    env = {**service_env(tmp_path, service_url), "KVC_CHUNK_SIZE": str(CHUNK)}
    result = CliRunner().invoke(group, ["daemon", "--worker-id", "svc", "--json"], env=env)
    assert result.exit_code == 0, result.output
    [(cp, restored)] = seen
    assert cp["new_chunks"] == 4 and restored["decision"]["action"] == "fork"
    # The service's database holds what the daemon published.
    assert len(cat.lookup("ns", MODEL.fingerprint, PROMPT).chunks) == 4


# -- only its own clients: no cross-site posts, no DNS rebinding ----------------------------

MUTATING = {
    "/v1/configure": {"fingerprint": "reference", "num_pages": 64},
    "/v1/prefill": {"tokens": PROMPT[:CHUNK]},
    "/v1/checkpoint": {"route": 1, "tokens": PROMPT[:CHUNK], "name": "evil"},
    "/v1/restore": {"tokens": PROMPT},
    "/v1/release": {"route": 1},
    "/v1/clear": None,
    "/v1/refresh": None,
}


def test_a_web_page_cannot_drive_the_daemon(worker: Start) -> None:
    """Over real HTTP: a cross-site post (any Origin but the daemon's own, `null` included)
    on every mutating route, a form-style body (text/plain or urlencoded, which a browser
    sends cross-site without a preflight), and a DNS-rebinding Host are refused (403 / 415,
    a JSON error naming the cause) and change nothing; the daemon's own clients (no
    Origin, or its own) still work."""
    import httpx

    from tests.services import serve_in_thread

    d, _ = worker("guarded")
    with serve_in_thread(create_daemon_app(d)) as url, httpx.Client(base_url=url) as http:
        r = http.post("/v1/configure", json=MUTATING["/v1/configure"])
        assert r.status_code == 200, r.text
        r = http.post("/v1/prefill", json={"tokens": PROMPT[:CHUNK]})
        assert r.status_code == 200, r.text
        before = http.get("/v1/stats").json()
        assert before["routes"] == {"1": CHUNK}

        for origin in (
            "http://evil.example",
            "null",
            f"https://{url[7:]}",
            "http://127.0.0.1.evil.example",
        ):
            for path, body in MUTATING.items():
                r = http.post(path, json=body, headers={"Origin": origin})
                assert r.status_code == 403, (origin, path, r.text)
                assert "Origin" in r.json()["error"]
        for ctype, content in (
            ("text/plain", '{"tokens": [1, 2, 3]}'),
            ("application/x-www-form-urlencoded", "a=1"),
        ):
            for path in ("/v1/prefill", "/v1/clear"):
                r = http.post(path, content=content, headers={"Content-Type": ctype})
                assert r.status_code == 415, (ctype, path, r.text)
                assert "application/json" in r.json()["error"]
        port = url.rsplit(":", 1)[1]
        for host in (f"evil.example:{port}", "evil.example", f"127.0.0.1.nip.io:{port}"):
            for method, path in (("GET", "/v1/stats"), ("POST", "/v1/clear")):
                r = http.request(method, path, headers={"Host": host})
                assert r.status_code == 403, (host, path, r.text)
                assert "Host" in r.json()["error"]
        assert http.get("/v1/stats").json() == before  # configured, route 1 kept: nothing changed

        # Its own clients: curl-style (no Origin), its own origin, a bodyless POST.
        r = http.post("/v1/prefill", json={"tokens": PROMPT[:CHUNK]}, headers={"Origin": url})
        assert r.status_code == 200, r.text
        for host in (f"localhost:{port}", f"127.0.0.1:{port}"):
            assert http.get("/v1/stats", headers={"Host": host}).status_code == 200
        assert http.post("/v1/clear").status_code == 200
        assert http.get("/v1/stats").json()["routes"] == {}


def test_the_daemon_answers_only_its_port_and_the_names_it_is_given(worker: Start) -> None:
    d, _ = worker("named")
    app = create_daemon_app(d, host="127.0.0.1", port=8708, allowed_hosts=["kvc-gpu0.internal"])
    ok = TestClient(app, base_url="http://127.0.0.1:8708")
    assert ok.get("/v1/stats").status_code == 200
    assert (
        TestClient(app, base_url="http://kvc-gpu0.internal:8708").get("/v1/stats").status_code
        == 200
    )
    assert TestClient(app, base_url="http://127.0.0.1:9999").get("/v1/stats").status_code == 403
    assert (
        TestClient(app, base_url="http://other.internal:8708").get("/v1/stats").status_code == 403
    )
    r = ok.get("/v1/stats", headers={"Origin": "http://kvc-gpu0.internal:8708"})
    assert r.status_code == 200
    r = ok.post("/v1/clear", headers={"Origin": "http://127.0.0.1:9999"})  # another local app
    assert r.status_code == 403 and "Origin" in r.json()["error"]
