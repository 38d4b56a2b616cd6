"""The inspection and maintenance commands (lookup, refs, log, show, stats, stores, quarantine, fsck, gc)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import blake3
import numpy as np
import pytest

from catalog.catalog import Catalog
from chunkstore import open_store
from restore.checkpoint import Checkpointer
from restore.engines.reference import ReferenceModel
from restore.pool import PagePool

MODEL = ReferenceModel.small(seed=0)
CHUNK = 32
FP = MODEL.fingerprint.hex

# Runs the CLI with these command modules registered whether or not kvc/cli.py lists them.
_WRAPPER = (
    "from kvc.cli import cli; from kvc.commands import inspect, maintenance; "
    "inspect.register(cli); maintenance.register(cli); cli(prog_name='kvc')"
)


@dataclass
class Home:
    path: Path
    tokens: list[int]

    @property
    def env(self) -> dict[str, str]:
        return {"KVC_HOME": str(self.path)}

    @property
    def catalog_url(self) -> str:
        return f"sqlite:///{self.path / 'catalog.db'}"

    @property
    def store_name(self) -> str:
        return f"file://{self.path / 'blobs'}"

    def blob_path(self, key: str) -> Path:
        return self.path / "blobs" / key[:2] / key[2:4] / key

    def chain(self) -> list[tuple[str, str]]:
        """(prefix hex, blob key) of the ref's chunks, root first."""
        with Catalog.open(self.catalog_url) as cat, cat.engine.connect() as conn:
            rows = conn.exec_driver_sql(
                "SELECT p.prefix_hash, c.blob_key FROM chunks c"
                " JOIN prefixes p ON p.prefix_hash = c.prefix_hash ORDER BY p.token_start"
            ).all()
        return [(bytes(h).hex(), k) for h, k in rows]

    def replica_state(self, key: str) -> str:
        with Catalog.open(self.catalog_url) as cat, cat.engine.connect() as conn:
            state: str = conn.exec_driver_sql(
                "SELECT state FROM replicas WHERE blob_key = ?", (key,)
            ).scalar_one()
        return state


def _populate(path: Path) -> Home:
    """100 tokens checkpointed as ref `chat` (3 full chunks of 32 and a 4-token tail)."""
    path.mkdir(parents=True, exist_ok=True)
    tokens = np.random.default_rng(1).integers(0, MODEL.vocab_size, 100).tolist()
    pool = PagePool(MODEL.layout, page_size=16, num_pages=64)
    route = pool.new_route()
    MODEL.prefill(pool, route, tokens)
    with Catalog.open(f"sqlite:///{path / 'catalog.db'}", upgrade=True) as cat:
        store = open_store(f"file://{path / 'blobs'}")
        with Checkpointer(cat, store, chunk_size=CHUNK) as cp:
            cp.checkpoint(pool, route, tokens, MODEL.fingerprint, name="chat", pending=3)
    return Home(path, tokens)


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> Home:
    """A populated home for tests that only read."""
    return _populate(tmp_path_factory.mktemp("shared") / "home")


@pytest.fixture
def home(tmp_path: Path) -> Iterator[Home]:
    """A populated home a test may change."""
    yield _populate(tmp_path / "home")


def kvc(
    *args: str, env: dict[str, str] | None = None, stdin: str | None = None
) -> subprocess.CompletedProcess[str]:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("KVC_")}
    full_env.update(env or {})
    return subprocess.run(
        [sys.executable, "-c", _WRAPPER, *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=full_env,
        input=stdin,
        stdin=None if stdin is not None else subprocess.DEVNULL,
    )


def ok_json(*args: str, env: dict[str, str]) -> Any:
    out = kvc(*args, "--json", env=env)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)  # stdout is one JSON document, nothing else


def one_line_error(out: subprocess.CompletedProcess[str], code: int) -> None:
    assert out.returncode == code, (out.returncode, out.stdout, out.stderr)
    assert out.stderr.startswith("kvc: error:") and "Traceback" not in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1
    assert out.stdout == ""


COMMANDS = [
    ["lookup"],
    ["refs", "list"],
    ["refs", "show"],
    ["refs", "delete"],
    ["log"],
    ["show"],
    ["stats"],
    ["stores"],
    ["quarantine"],
    ["fsck"],
    ["gc"],
    ["pins", "set"],
    ["pins", "list"],
    ["pins", "rm"],
]


def test_every_command_explains_itself() -> None:
    from click.testing import CliRunner

    from kvc.cli import cli
    from kvc.commands import inspect, maintenance, pins

    inspect.register(cli)
    maintenance.register(cli)
    pins.register(cli)
    for command in COMMANDS:
        out = CliRunner().invoke(cli, [*command, "--help"])
        assert out.exit_code == 0, (command, out.output)
        assert "Example:" in out.output and "--json" in out.output, command
    # Through the real process too: the wrapper the other tests use works.
    assert "Example:" in kvc("gc", "--help").stdout


def test_refs_list_and_show(shared: Home) -> None:
    out = kvc("refs", "list", env=shared.env)
    assert out.returncode == 0 and out.stdout.startswith("chat ")
    assert "processed 100" in out.stdout and "pending 3" in out.stdout
    doc = ok_json("refs", "show", "chat", env=shared.env)
    assert doc["processed"] == 100 and doc["pending_token"] == 3 and doc["fingerprint"] == FP
    listed = ok_json("refs", "list", env=shared.env)
    assert [r["name"] for r in listed["refs"]] == ["chat"]
    other = ok_json("refs", "list", "--namespace", "nobody", env=shared.env)
    assert other["refs"] == []


def test_log_is_newest_first(shared: Home) -> None:
    chain = shared.chain()
    out = kvc("log", "chat", env=shared.env)
    assert out.returncode == 0, out.stderr
    assert f"fingerprint {FP}" in out.stdout and "processed 100" in out.stdout
    assert "pending token 3" in out.stdout
    node_lines = [line for line in out.stdout.splitlines() if "tokens [" in line]
    assert node_lines[0].startswith(chain[-1][0][:12]) and "tokens [96, 100)" in node_lines[0]
    assert node_lines[-1].startswith(chain[0][0][:12]) and "tokens [0, 32)" in node_lines[-1]
    doc = ok_json("log", "chat", env=shared.env)
    assert [n["prefix"] for n in doc["chain"]] == [h for h, _ in reversed(chain)]
    assert doc["ref"]["pending_token"] == 3
    # A prefix hash works too; -n limits the output.
    short = ok_json("log", chain[1][0][:10], "-n", "1", env=shared.env)
    assert short["nodes"] == 2 and len(short["chain"]) == 1


def test_lookup_hit_and_miss(shared: Home, tmp_path: Path) -> None:
    f = tmp_path / "tokens.json"
    f.write_text(json.dumps(shared.tokens))
    doc = ok_json("lookup", "--fingerprint", FP, "--tokens-file", str(f), env=shared.env)
    assert doc["hit"] is True and doc["matched_tokens"] == 99 and doc["prompt_tokens"] == 100
    chunks = doc["chunks"]
    assert [c["token_start"] for c in chunks] == [0, 32, 64, 96]
    assert chunks[-1]["tokens_used"] == 3
    assert [c["blob_key"] for c in chunks] == [k for _, k in shared.chain()]
    assert chunks[0]["replicas"][0]["location"] == shared.store_name
    # Whitespace-separated ids on stdin; the text output says which.
    text = kvc(
        "lookup", "--fingerprint", FP, env=shared.env, stdin=" ".join(map(str, shared.tokens[:40]))
    )
    assert text.returncode == 0 and text.stdout.startswith("hit: 39 of 40 tokens")
    miss = kvc("lookup", "--fingerprint", FP, env=shared.env, stdin="[5, 6, 7]")
    assert miss.returncode == 0 and miss.stdout.startswith("miss:")
    unknown = kvc("lookup", "--fingerprint", "ab" * 32, env=shared.env, stdin="1 2 3")
    assert unknown.returncode == 0 and "fingerprint not catalogued" in unknown.stdout


def test_show_ref_prefix_and_blob(shared: Home) -> None:
    (h0, _), (h1, k1) = shared.chain()[:2]
    ref = ok_json("show", "chat", env=shared.env)
    assert ref["kind"] == "ref" and ref["chain_nodes"] == 4 and ref["replicas"] == {"durable": 4}
    assert [e["kind"] for e in ref["events"]] == ["ref.create"]
    prefix = ok_json("show", h1[:8], env=shared.env)
    assert prefix["kind"] == "prefix" and prefix["prefix"] == h1 and prefix["parent"] == h0
    assert (prefix["token_start"], prefix["token_end"], prefix["children"]) == (32, 64, 1)
    replica = prefix["chunks"][0]["replicas"][0]
    assert replica["location"] == shared.store_name and replica["state"] == "durable"
    assert replica["last_verified_at"] is not None
    blob = ok_json("show", k1, env=shared.env)
    assert blob["kind"] == "blob" and blob["chunks"][0]["prefix"] == h1
    text = kvc("show", h1, env=shared.env)
    assert text.returncode == 0 and f"prefix {h1}" in text.stdout and k1 in text.stdout
    assert "durable" in text.stdout and "verified" in text.stdout


def test_stats_and_stores(shared: Home) -> None:
    doc = ok_json("stats", "--count-blobs", env=shared.env)
    assert (doc["chunks"], doc["prefixes"], doc["refs"]) == (4, 4, 1)
    assert doc["replicas"] == {"durable": 4} and doc["store_blobs"] == {shared.store_name: 4}
    text = kvc("stats", env=shared.env)
    assert text.returncode == 0 and "chunks: 4" in text.stdout
    stores = ok_json("stores", env=shared.env)
    assert stores["configured"] == [shared.store_name]
    (entry,) = stores["stores"]
    assert entry["tier"] == "local" and entry["configured"] and entry["catalogued"]
    assert entry["replicas"] == {"durable": 4}


@pytest.mark.parametrize(
    ("args", "stdin", "code", "words"),
    [
        (["refs", "show", "nope"], None, 1, "no ref 'nope'"),
        (["refs", "delete", "nope"], None, 1, "no ref 'nope'"),
        (["log", "nope"], None, 1, "no ref 'nope'"),
        (["show", "nope"], None, 1, "no ref 'nope'"),
        (["show", "0000000000"], None, 1, "no ref, prefix or blob"),
        (["quarantine", "xyz", "--reason", "r"], None, 2, "malformed prefix hash"),
        (["quarantine", "abc", "--reason", "r"], None, 2, "malformed prefix hash"),
        (["quarantine", "00000000", "--reason", "r"], None, 1, "no prefix 00000000"),
        (["quarantine", "0" * 64, "--reason", " "], None, 2, "--reason"),
        (["lookup", "--fingerprint", "beef"], "1 2", 2, "malformed fingerprint"),
        (["lookup", "--fingerprint", "ab" * 32], "1 two", 2, "whitespace-separated integers"),
        (["lookup", "--fingerprint", "ab" * 32], "[1, true]", 2, "JSON list of integers"),
        (["lookup", "--fingerprint", "ab" * 32], "[1, 2", 2, "not valid JSON"),
        (["lookup", "--fingerprint", "ab" * 32], "", 2, "no tokens"),
        (["lookup", "--fingerprint", "ab" * 32], "1 -5", 2, "token"),
        (["fsck", "--subset", "3/2"], None, 2, "--subset"),
        (["fsck", "--subset", "x"], None, 2, "--subset"),
    ],
)
def test_bad_input_is_one_line(
    shared: Home, args: list[str], stdin: str | None, code: int, words: str
) -> None:
    out = kvc(*args, env=shared.env, stdin=stdin)
    one_line_error(out, code)
    assert words in out.stderr


def test_quarantine_stops_lookup(home: Home) -> None:
    chain = home.chain()
    prompt = " ".join(map(str, home.tokens))
    before = kvc("lookup", "--fingerprint", FP, "--json", env=home.env, stdin=prompt)
    assert json.loads(before.stdout)["matched_tokens"] == 99
    doc = ok_json("quarantine", chain[1][0][:12], "--reason", "bad kernel", env=home.env)
    assert doc["prefix"] == chain[1][0] and doc["prefixes_quarantined"] == 3
    directives = doc["directives"]
    assert {d["blob_key"] for d in directives} == {k for _, k in chain[1:]}
    assert {d["location"] for d in directives} == {home.store_name}
    after = kvc("lookup", "--fingerprint", FP, "--json", env=home.env, stdin=prompt)
    assert after.returncode == 0 and json.loads(after.stdout)["matched_tokens"] == 32
    log = kvc("log", "chat", env=home.env)
    assert log.stdout.count("QUARANTINED: bad kernel") == 3
    kinds = [e["kind"] for e in ok_json("show", chain[1][0], env=home.env)["events"]]
    assert "quarantine" in kinds and "invalidate" in kinds


def test_refs_delete(home: Home) -> None:
    out = kvc("refs", "delete", "chat", env=home.env)
    assert out.returncode == 0 and "deleted ref 'chat'" in out.stdout
    assert ok_json("refs", "list", env=home.env)["refs"] == []
    one_line_error(kvc("refs", "delete", "chat", env=home.env), 1)


def test_fsck_finds_a_missing_blob_and_gc_waits_for_it(home: Home) -> None:
    assert kvc("fsck", env=home.env).returncode == 0
    _, key = home.chain()[2]
    path = home.blob_path(key)
    data = path.read_bytes()
    path.unlink()
    out = kvc("fsck", "--json", env=home.env)
    assert out.returncode == 1, out.stderr
    doc = json.loads(out.stdout)
    assert [m["blob_key"] for m in doc["missing"]] == [key] and doc["ok"] == 3
    assert home.replica_state(key) == "missing"
    text = kvc("fsck", env=home.env)
    assert text.returncode == 1 and f"missing  {key}" in text.stdout
    # GC refuses while the catalog points at missing bytes, unless forced.
    one_line_error(kvc("gc", env=home.env), 1)
    assert kvc("gc", "--force", env=home.env).returncode == 0
    # The bytes come back: fsck marks the replica usable again and is clean.
    open_store(home.store_name).put(key, data)
    back = json.loads(kvc("fsck", "--json", env=home.env).stdout)
    assert back["clean"] and [r["blob_key"] for r in back["revived"]] == [key]
    assert home.replica_state(key) == "durable"


def test_fsck_read_data_finds_a_corrupt_blob(home: Home) -> None:
    _, key = home.chain()[1]
    path = home.blob_path(key)
    path.chmod(0o644)
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF  # same size: only reading the data can tell
    path.write_bytes(bytes(data))
    # Without --read-data the blob is present with its size: "ok", and the summary says
    # that the contents were not read.
    quick = kvc("fsck", env=home.env)
    assert quick.returncode == 0
    quick_doc = json.loads(kvc("fsck", "--json", env=home.env).stdout)
    assert quick_doc["contents_verified"] is False and quick_doc["corrupt"] == []
    n = quick_doc["checked"]
    assert n == quick_doc["ok"] > 0
    assert quick.stdout.splitlines()[-1] == (
        f"checked {n} replica(s) in 1 store(s): {n} present (contents not read: "
        "use --read-data to verify), 0 missing, 0 corrupt"
    )
    out = kvc("fsck", "--read-data", "--json", env=home.env)
    assert out.returncode == 1, out.stderr
    doc = json.loads(out.stdout)
    assert [c["blob_key"] for c in doc["corrupt"]] == [key] and doc["read_data"] is True
    assert doc["contents_verified"] is True
    human = kvc("fsck", "--read-data", env=home.env)
    assert human.returncode == 1 and "contents not read" not in human.stdout
    assert f"corrupt  {key} at " in human.stdout
    assert f"reading data: {n - 1} ok, 0 missing, 1 corrupt" in human.stdout
    assert home.replica_state(key) == "corrupt"
    # Subsets partition the replicas.
    parts = [
        json.loads(kvc("fsck", "--subset", f"{n}/2", "--json", env=home.env).stdout)["checked"]
        for n in (1, 2)
    ]
    assert sum(parts) == 4


def test_fsck_reports_other_locations_as_not_checked(home: Home, tmp_path: Path) -> None:
    other = {**home.env, "KVC_STORES": f"file://{tmp_path / 'elsewhere'}"}
    out = kvc("fsck", env=other)
    assert out.returncode == 0, out.stderr
    assert f"not checked: 4 replica(s) at {home.store_name}" in out.stdout


def _orphan(home: Home, payload: bytes, age_s: float) -> str:
    key = blake3.blake3(payload).hexdigest()
    open_store(home.store_name).put(key, payload)
    t = time.time() - age_s
    os.utime(home.blob_path(key), (t, t))
    return key


def test_gc_deletes_only_old_orphans(home: Home) -> None:
    old = _orphan(home, b"left by a crashed publish", 7200)
    young = _orphan(home, b"a publish in flight", 10)
    catalogued = [k for _, k in home.chain()]
    for k in catalogued:  # old catalogued blobs are never orphans
        os.utime(home.blob_path(k), (time.time() - 7200,) * 2)
    dry = ok_json("gc", "--dry-run", env=home.env)
    assert [d["blob_key"] for d in dry["deleted"]] == [old]
    assert home.blob_path(old).exists()
    out = kvc("gc", env=home.env)
    assert out.returncode == 0, out.stderr
    assert f"deleted orphan blob {old}" in out.stdout and "deleted 1 orphan blob(s)" in out.stdout
    assert not home.blob_path(old).exists() and home.blob_path(young).exists()
    assert all(home.blob_path(k).exists() for k in catalogued)
    again = ok_json("gc", "--grace", "0", env=home.env)
    assert [d["blob_key"] for d in again["deleted"]] == [young]
    assert again["kept_catalogued"] == 4
    assert kvc("fsck", env=home.env).returncode == 0


def test_fsck_read_data_records_the_verification_time(home: Home) -> None:
    import sqlalchemy as sa

    engine = sa.create_engine(home.catalog_url)
    query = sa.text("SELECT min(last_verified_at) FROM replicas")
    with engine.connect() as conn:
        before = conn.execute(query).scalar_one()
    out = kvc("fsck", "--read-data", env=home.env)
    assert out.returncode == 0, out.stderr
    with engine.connect() as conn:
        after = conn.execute(query).scalar_one()
    engine.dispose()
    assert str(after) > str(before)


def test_fsck_repairs_a_corrupt_replica_from_a_good_one(home: Home, tmp_path: Path) -> None:
    from chunkstore.record import decode_chunk
    from restore.write_behind import to_replica_receipt

    second = open_store(f"file://{tmp_path / 'second'}")
    with Catalog.open(home.catalog_url) as cat:
        for _, key in home.chain():
            data = bytes(open_store(home.store_name).get(key))
            cat.record_replica(key, to_replica_receipt(second.put(key, data), "local"))
    _, key = home.chain()[2]
    path = home.blob_path(key)
    path.chmod(0o644)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    env = {**home.env, "KVC_STORES": f"{home.store_name},{second.name}"}
    out = kvc("fsck", "--read-data", "--json", env=env)
    assert out.returncode == 1, out.stderr  # a problem was found (and repaired)
    doc = json.loads(out.stdout)
    assert doc["repaired"] == [{"blob_key": key, "location": home.store_name, "source": second.name}]
    with Catalog.open(home.catalog_url) as cat, cat.engine.connect() as conn:
        st = dict(conn.exec_driver_sql("SELECT location, state FROM replicas WHERE blob_key = ?", (key,)).all())
    assert st == {home.store_name: "durable", second.name: "durable"}
    decode_chunk(open_store(home.store_name).get(key), expected_key=key)  # the bytes verify again
    again = kvc("fsck", "--read-data", "--json", env=env)
    assert again.returncode == 0 and json.loads(again.stdout)["clean"] is True
    no_repair = kvc("fsck", "--help", env=env)
    assert "--no-repair" in no_repair.stdout
