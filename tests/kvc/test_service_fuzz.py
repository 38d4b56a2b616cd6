"""Fuzzing the HTTP service against its own OpenAPI document: no 500, refusals name the field, refused calls change nothing.

schemathesis generates the cases from the document the app serves: the
deterministic boundary cases of its coverage phase and Hypothesis-generated
ones, valid and invalid, for every operation. Each is sent in-process, with
namespace "a"'s token, to an app over one SQLite catalog per module (a quarter
of them to namespace "b" or to none instead), and every table is read before
and after each call: a refused call must change nothing, no call of "a" may
change "b", and the catalog stays consistent. Without a namespace's token,
every namespace operation answers 401, whatever else the call holds.
"""

from __future__ import annotations

import itertools
import logging
import sqlite3
import tempfile
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import pytest
import schemathesis
from fastapi import FastAPI
from schemathesis import BaseSchema, Case, GenerationMode, Response
from schemathesis.checks import not_a_server_error
from schemathesis.core import NotSet
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from catalog import Fingerprint, chain_root
from catalog.catalog import Catalog
from catalog.models import ChunkRecord, ReplicaReceipt, Shard
from catalog.wire import NOT_FOUND, ChunkRecordModel, ShardModel
from kvc.service import create_app, hash_token
from tests.catalog_helpers import CS, FP, FP2, LAYOUT, chain_records

TOKEN_A = "fuzz-token-a-3c9e"
TOKEN_B = "fuzz-token-b-71d4"
AUTH_A = {"Authorization": f"Bearer {TOKEN_A}"}
MAX_PROMPT = 64
A_TOKENS = list(range(100, 110))
B_TOKENS = list(range(200, 213))
# A fixed receipt time: the cases (and which namespace each goes to) depend on nothing else.
RECEIPTS = [
    ReplicaReceipt("file:///store", "local", 100, "blake3:x", datetime(2026, 1, 1, tzinfo=UTC))
]


def _chain(namespace: str, tokens: Sequence[int], **kw: Any) -> list[ChunkRecord]:
    return chain_records(namespace, tokens, receipts=RECEIPTS, **kw)


A_RECS = _chain("a", A_TOKENS)
B_RECS = _chain("b", B_TOKENS)
_HASHES = [r.prefix_hash.hex() for r in A_RECS + B_RECS] + [chain_root("a").hex()]


def _wire(records: list[ChunkRecord]) -> list[dict[str, Any]]:
    return [ChunkRecordModel.of(r).model_dump(mode="json") for r in records]


# Values the schema cannot describe (a descriptor that hashes to its key, what is
# catalogued in "a" and in "b"): half of the fields of these names are set to one,
# so generated calls get past "no such thing" to the catalog's own checks.
KNOWN: dict[str, list[Any]] = {
    "fingerprint": [FP.hex, FP2.hex],
    "prefix_hash": _HASHES,
    "parent_hash": _HASHES,
    "head_hash": _HASHES,
    "expected_head": _HASHES,
    "new_head": _HASHES,
    "prefix_hashes": [_HASHES, _HASHES * 9],  # the second is over the limit (413)
    "blob_key": [r.blob_key for r in A_RECS + B_RECS],
    "descriptor": [dict(FP2.descriptor)],
    "shard": [ShardModel.of(Shard.full(LAYOUT)).model_dump()],
    # A new chain of "a"; one whose parent is not catalogued; "b"'s chain, which is not
    # "a"'s; one longer than the limit.
    "records": [
        _wire(_chain("a", [*A_TOKENS, 1, 2, 3])),
        _wire(_chain("a", [5, 6, 7, 8, 9], start_chunk=1)),
        _wire(B_RECS),
        _wire(_chain("a", range(300, 300 + MAX_PROMPT + 4))),
    ],
    "tokens": [A_TOKENS, [*A_TOKENS, 7], B_TOKENS, list(range(MAX_PROMPT + 1))],
    "name": ["r", "rb", "r/side"],
}


def _new_fingerprint(n: int) -> dict[str, Any]:
    fp = Fingerprint.create(
        weights=f"sha256:fuzz-{n}", architecture="llama", config={"v": 2}, attention_layout=LAYOUT
    )
    return {fp.hex: dict(fp.descriptor)}


# A publish's `fingerprints` is sometimes one catalogued nowhere, a new one per case:
# registered only if the publish lands.
FRESH = {"fingerprints": _new_fingerprint}
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    negative_data_rejection,
]
BAD_CREDENTIALS = {
    "no header": {},
    "unknown token": {"Authorization": "Bearer not-a-namespace-token"},
    "another scheme": {"Authorization": f"Basic {TOKEN_A}"},
    "empty token": {"Authorization": "Bearer "},
}


def _document() -> dict[str, Any]:
    """The service's OpenAPI document. It depends on the routes alone, and schemathesis needs it
    at collection, before any fixture: build it over a throwaway catalog, closed at once.
    (`schemathesis.pytest.from_fixture` would fit, but it sets `Node._nodeid`, gone in pytest
    9.2.)"""
    with (
        tempfile.TemporaryDirectory() as tmp,
        Catalog.open(f"sqlite:///{tmp}/catalog.db", upgrade=True) as catalog,
    ):
        return create_app(catalog, {}, max_prompt_tokens=1).openapi()


_DOC = _document()


def _schema(phases: list[str], max_examples: int) -> BaseSchema:
    schema = schemathesis.openapi.from_dict(_DOC)
    schema.config.generation.update(
        modes=list(GenerationMode),
        max_examples=max_examples,
        deterministic=True,  # the same cases on every run, in CI too
        database="none",  # and no example database written anywhere
        with_security_parameters=False,  # the credentials are the test's to choose
    )
    schema.config.phases.update(phases=phases)
    return schema


FUZZ = _schema(["coverage", "fuzzing"], max_examples=15)
AUTH = _schema(["fuzzing"], max_examples=3).include(path_regex="^/v1/")


# -- the catalog and what is stored in it -------------------------------------------

Snapshot = dict[str, list[dict[str, Any]]]


@dataclass
class Env:
    cat: Catalog
    app: FastAPI
    db: sqlite3.Connection  # read-only use; plain sqlite3 reads every table in about a millisecond

    def snapshot(self) -> Snapshot:
        """Every row of every table (the migrations' own too), sorted."""
        self.cat.flush_access()  # access statistics are written in batches: none may land mid-call
        tables = [
            n for (n,) in self.db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")
        ]
        out = {}
        for table in tables:
            cursor = self.db.execute(f'SELECT * FROM "{table}"')
            columns = [d[0] for d in cursor.description]
            rows = sorted(cursor.fetchall(), key=repr)
            out[table] = [dict(zip(columns, row, strict=True)) for row in rows]
        return out


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    path = tmp_path_factory.mktemp("fuzz") / "catalog.db"
    cat = Catalog.open(f"sqlite:///{path}", upgrade=True)
    cat.ensure_namespace("a", CS)
    cat.ensure_namespace("b", CS)
    cat.record_chunks(A_RECS)
    cat.record_chunks(B_RECS)
    cat.create_ref("a", "r", FP, A_RECS[0].prefix_hash)
    cat.create_ref("b", "rb", FP, B_RECS[1].prefix_hash)
    cat.quarantine("b", B_RECS[2].prefix_hash, "seeded")
    app = create_app(
        cat, {"a": hash_token(TOKEN_A), "b": hash_token(TOKEN_B)}, max_prompt_tokens=MAX_PROMPT
    )
    # A 500 is logged with its traceback at DEBUG: shown with the failing case.
    service_log = logging.getLogger("kvc.service")
    level = service_log.level
    service_log.setLevel(logging.DEBUG)
    db = sqlite3.connect(path)
    yield Env(cat, app, db)
    db.close()
    service_log.setLevel(level)
    cat.close()


def rows_of(snap: Snapshot, namespace: str) -> Snapshot:
    """The rows that belong to `namespace`: itself, its prefixes, their chunks and replicas, refs, events..."""
    ns_ids = {r["id"] for r in snap["namespaces"] if r["name"] == namespace}
    prefixes = {r["prefix_hash"] for r in snap["prefixes"] if r["namespace_id"] in ns_ids}
    keys = {r["blob_key"] for r in snap["chunks"] if r["prefix_hash"] in prefixes}

    def mine(table: str, r: dict[str, Any]) -> bool:
        return (
            r.get("namespace_id") in ns_ids
            or r.get("namespace") == namespace
            or (table == "namespaces" and r["name"] == namespace)
            or (table == "chunks" and r["prefix_hash"] in prefixes)
            or (table == "replicas" and r["blob_key"] in keys)
        )

    return {t: [r for r in rows if mine(t, r)] for t, rows in snap.items()}


def broken_invariants(snap: Snapshot) -> list[str]:
    """What a consistent catalog never holds: dangling prefixes, chunks, replicas or refs."""
    names = {r["id"]: r["name"] for r in snap["namespaces"]}
    prefixes = {r["prefix_hash"]: r for r in snap["prefixes"]}
    fingerprints = {r["hex"] for r in snap["fingerprints"]}
    keys = {r["blob_key"] for r in snap["chunks"]}
    out = []
    for p in prefixes.values():
        parent = prefixes.get(p["parent_hash"])
        if p["token_start"] == 0:
            ok = p["parent_hash"] == chain_root(names[p["namespace_id"]])
        else:
            ok = parent is not None and parent["namespace_id"] == p["namespace_id"]
        if not ok:
            out.append(f"prefix {p['prefix_hash'].hex()} extends nothing of its namespace")
    for c in snap["chunks"]:
        if c["prefix_hash"] not in prefixes or c["fingerprint"] not in fingerprints:
            out.append(f"chunk {c['blob_key']} has no prefix or no fingerprint")
    for rep in snap["replicas"]:
        if rep["blob_key"] not in keys:
            out.append(f"replica {rep['blob_key']} at {rep['location']!r} of no chunk")
    for ref in snap["refs"]:
        head = prefixes.get(ref["head_hash"])
        if head is None or head["namespace_id"] != ref["namespace_id"]:
            out.append(f"ref {ref['name']!r} names no prefix of its namespace")
    return out


def changes(before: Snapshot, after: Snapshot) -> dict[str, Any]:
    out = {}
    for t in before:
        gone = [r for r in before[t] if r not in after[t]]
        new = [r for r in after[t] if r not in before[t]]
        if gone or new:
            out[t] = {"before": gone, "after": new}
    return out


def send(env: Env, case: Case, headers: dict[str, str]) -> Response:
    """Call the app with `case`; a refused call must leave every table as it was, any call "b"'s rows."""
    before = env.snapshot()
    response = case.call(app=env.app, headers=headers)
    after = env.snapshot()
    status = response.status_code
    if status >= 400:
        diff = changes(before, after)
        assert not diff, f"a call refused with {status} changed {diff}"
    else:
        diff = changes(rows_of(before, "b"), rows_of(after, "b"))
        assert not diff, f"a call of token a changed namespace b: {diff}"
        assert broken_invariants(after) == []
    return response


# -- shaping the generated cases ---------------------------------------------------


def pick(case: Case, salt: str, n: int) -> int:
    """A choice in range(n), fixed by the case's content (so a failing case replays the same)."""
    body = "" if isinstance(case.body, NotSet) else repr(case.body)
    params = sorted((case.path_parameters or {}).items())
    key = f"{salt}|{case.operation.label}|{params}|{case.query}|{body}"
    return zlib.crc32(key.encode()) % n


def seeded(case: Case, key: str, value: Any, where: str) -> Any:
    if key in FRESH and isinstance(value, dict) and pick(case, where, 2) == 0:
        return FRESH[key](pick(case, where + "#", 2**32))
    options = KNOWN.get(key)
    if options and type(value) is type(options[0]) and pick(case, where, 2) == 0:
        return options[pick(case, where + "#", len(options))]
    if isinstance(value, dict):
        return {k: seeded(case, k, v, f"{where}.{k}") for k, v in value.items()}
    if isinstance(value, list):
        return [seeded(case, "", v, f"{where}[{i}]") for i, v in enumerate(value)]
    return value


def seed(case: Case) -> bool:
    """Set some fields to known values (see KNOWN), the namespace to "a"; True if a field changed."""
    params = case.path_parameters or {}
    new_params = {k: seeded(case, k, v, f"path.{k}") for k, v in params.items()}
    new_body = seeded(case, "", case.body, "body")
    changed = new_params != params or new_body != case.body
    case.body = new_body
    if params:
        params.update(new_params)
        params["namespace"] = "a"
    return changed


def negated_field(case: Case) -> tuple[str, list[str]] | None:
    """Where a coverage case made its input invalid: ("body", ["records", "tokens"]), ("path", ["name"])."""
    meta = case.meta
    if meta is None or meta.phase.name.value != "coverage" or not meta.generation.mode.is_negative:
        return None
    data = meta.phase.data
    where = getattr(data, "parameter_location", None)
    if where is None or where.value not in ("body", "path", "query"):
        return None
    if where.value == "body":
        pointer = (getattr(data, "location", None) or "").split("/")
        return "body", [name for kind, name in itertools.pairwise(pointer) if kind == "properties"]
    return where.value, [data.parameter]


def check_refusal(response: Response, negated: tuple[str, list[str]] | None = None) -> None:
    """No 500; a 4xx says what is wrong in `detail`; a 422 from validation names each field in `loc`.

    With `negated` (the one field a coverage case made invalid), a 422 names that field.
    """
    status = response.status_code
    assert status < 500, response.text
    if status < 400:
        return
    body = response.json()
    assert isinstance(body, dict) and "detail" in body, response.text
    detail = body["detail"]
    if isinstance(detail, list):
        assert status == 422 and detail, response.text
        for err in detail:
            loc = err.get("loc")
            assert isinstance(loc, list) and len(loc) >= 1, response.text
            assert loc[0] in {"body", "path", "query", "header"}, response.text
            assert isinstance(err.get("msg"), str), response.text
        if negated is not None:
            where, names = negated
            named = [
                [x for x in err["loc"][1:] if isinstance(x, str)][: len(names)] for err in detail
            ]
            assert any(
                err["loc"][0] == where and n == names for err, n in zip(detail, named, strict=True)
            ), f"{where} {names} not named: {response.text}"
    else:
        assert negated is None, f"invalid {negated} refused by no validation: {response.text}"
        assert isinstance(detail, str) and detail, response.text


# -- the tests ---------------------------------------------------------------------


@FUZZ.parametrize()
def test_any_call_as_namespace_a_gets_an_answer_never_a_500(case: Case, env: Env) -> None:
    """Every operation, valid and invalid input: no 500; 4xx name the problem; the document holds."""
    negated = None if seed(case) else negated_field(case)
    params = case.path_parameters or {}
    if "namespace" in params and pick(case, "namespace", 4) == 0:
        # Another tenant's namespace, or none: the same answer for both, a bare 404 unless
        # the body is unreadable (which the app finds before looking at the namespace).
        answers = []
        for ns in ("b", "nobody"):
            params["namespace"] = ns
            response = send(env, case, AUTH_A)
            check_refusal(response)
            # Another method on the path: 405, or 404 where it matches another route (`refs/{name:path}`).
            allowed = (
                (400, 404, 422) if case.method == case.operation.method.upper() else (404, 405)
            )
            assert response.status_code in allowed, response.text
            if response.status_code == 404:
                assert response.json() == NOT_FOUND
            if response.status_code == 422:
                assert isinstance(response.json()["detail"], list), response.text
            answers.append((response.status_code, response.content))
        assert answers[0] == answers[1]
        return
    response = send(env, case, AUTH_A)
    check_refusal(response, negated)
    case.validate_response(response, checks=CHECKS, headers=AUTH_A)


@AUTH.parametrize()
def test_without_a_namespace_token_every_call_is_401(case: Case, env: Env) -> None:
    """No token, a token of no namespace, another scheme: 401, whatever else the call holds."""
    seed(case)
    params = case.path_parameters or {}
    params["namespace"] = ("a", "b", "nobody")[pick(case, "namespace", 3)]
    for label, headers in BAD_CREDENTIALS.items():
        response = send(env, case, headers)
        assert response.status_code == 401, f"{label}: {response.status_code} {response.text}"
        assert response.headers.get("www-authenticate") == ["Bearer"], label
        assert response.json()["detail"], label
        case.validate_response(response, checks=CHECKS, headers=headers)


def test_the_document_says_every_namespace_operation_needs_the_token() -> None:
    for path, item in _DOC["paths"].items():
        for method, op in item.items():
            if path.startswith("/v1/namespaces/{namespace}/"):
                assert op.get("security") == [{"HTTPBearer": []}], (method, path)
            else:
                assert path in ("/healthz", "/metrics"), (method, path)


def test_the_snapshot_holds_the_seeded_rows(env: Env) -> None:
    """An empty snapshot would compare equal whatever a call did: it holds what "b" was given."""
    snap = env.snapshot()
    assert {"namespaces", "prefixes", "chunks", "replicas", "refs", "events"} <= set(snap)
    b = rows_of(snap, "b")
    assert len(b["prefixes"]) == len(B_RECS) and len(b["refs"]) == 1
    assert len(b["replicas"]) == len(B_RECS)
    assert broken_invariants(snap) == []
