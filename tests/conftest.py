"""Shared fixtures: real PostgreSQL and S3 services for the session, per-test URLs, Hypothesis profiles."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

from tests.services import Postgres, S3Server, ServiceUnavailable, start_postgres, start_seaweedfs

settings.register_profile(
    "ci",
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile("dev", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(
    "ci" if os.environ.get("CI") else os.environ.get("KVC_HYPOTHESIS_PROFILE", "dev")
)


def _services_required() -> bool:
    return os.environ.get("KVC_TEST_REQUIRE_SERVICES") == "1"


def _unavailable(what: str, exc: BaseException) -> None:
    if _services_required():
        pytest.fail(f"{what} is required (KVC_TEST_REQUIRE_SERVICES=1) but could not start: {exc}")
    pytest.skip(f"{what} unavailable: {exc}")


@pytest.fixture(scope="session", autouse=True)
def kvc_cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Per-machine caches (the weights digest, restore/engines/weights.py) in the session's
    temporary directory, never the user's ~/.cache; child processes inherit it."""
    path = tmp_path_factory.mktemp("kvc-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KVC_CACHE_DIR", str(path))
        yield path


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[str]:
    """SQLAlchemy URL of a PostgreSQL server: KVC_TEST_DATABASE_URL, or one started for the session."""
    external = os.environ.get("KVC_TEST_DATABASE_URL")
    if external:
        yield external
        return
    try:
        cm = start_postgres()
        server: Postgres = cm.__enter__()
    except (ServiceUnavailable, OSError, Exception) as exc:
        _unavailable("PostgreSQL", exc)
        raise
    try:
        yield server.url
    finally:
        cm.__exit__(None, None, None)


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    """An S3-compatible server: KVC_TEST_S3_ENDPOINT (+ _BUCKET, _ACCESS_KEY, _SECRET_KEY,
    _REGION), or SeaweedFS started for the session."""
    endpoint = os.environ.get("KVC_TEST_S3_ENDPOINT")
    if endpoint:
        yield S3Server(
            endpoint_url=endpoint,
            access_key=os.environ.get("KVC_TEST_S3_ACCESS_KEY", "minioadmin"),
            secret_key=os.environ.get("KVC_TEST_S3_SECRET_KEY", "minioadmin"),
            region=os.environ.get("KVC_TEST_S3_REGION", "us-east-1"),
            bucket=os.environ.get("KVC_TEST_S3_BUCKET", "kvc-test"),
        )
        return
    try:
        cm = start_seaweedfs()
        server = cm.__enter__()
    except (ServiceUnavailable, OSError, Exception) as exc:
        _unavailable("SeaweedFS S3", exc)
        raise
    try:
        yield server
    finally:
        cm.__exit__(None, None, None)


@pytest.fixture
def s3_credentials(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> S3Server:
    """Put the server's keys where the standard AWS credential chain finds them."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3_server.access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3_server.secret_key)
    monkeypatch.delenv("AWS_SESSION_TOKEN", raising=False)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", os.devnull)
    return s3_server


@pytest.fixture
def s3_url(s3_credentials: S3Server) -> str:
    """A store URL on the real S3 server under a fresh prefix, credentials in the environment."""
    srv = s3_credentials
    return (
        f"s3://{srv.bucket}/t-{uuid.uuid4().hex[:12]}"
        f"?endpoint_url={srv.endpoint_url}&region={srv.region}"
    )


@pytest.fixture
def postgres_url(postgres_server: str) -> Iterator[str]:
    """A fresh, empty database on the session's PostgreSQL server, dropped afterwards."""
    import sqlalchemy as sa

    name = f"kvc_{uuid.uuid4().hex[:12]}"
    admin = sa.create_engine(postgres_server, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(sa.text(f'CREATE DATABASE "{name}"'))
    url = sa.make_url(postgres_server).set(database=name)
    try:
        yield url.render_as_string(hide_password=False)
    finally:
        with admin.connect() as conn:
            conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


@pytest.fixture(params=["sqlite", "postgres"])
def catalog_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """An empty catalog database, once on SQLite (a file per test) and once on PostgreSQL."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'catalog.db'}"
    return str(request.getfixturevalue("postgres_url"))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # Mark tests by the services they use, so `-m "not s3"` works without remembering to tag.
    for item in items:
        names = set(getattr(item, "fixturenames", ()))
        if names & {"s3_server", "s3_credentials", "s3_url"}:
            item.add_marker(pytest.mark.s3)
        if names & {"postgres_server", "postgres_url"}:
            item.add_marker(pytest.mark.postgres)
