"""compose/ cannot run here (no Docker engine): parse it and keep it in step with the settings."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from urllib.parse import parse_qs, urlparse

import yaml

from kvc.settings import Settings

COMPOSE = Path(__file__).resolve().parents[2] / "compose"


def load() -> dict:  # type: ignore[type-arg]
    return yaml.safe_load((COMPOSE / "docker-compose.yml").read_text())


def test_services_ports_and_health() -> None:
    doc = load()
    services = doc["services"]
    assert set(services) == {"postgres", "minio", "create-bucket", "kvc"}
    assert "127.0.0.1:5432:5432" in services["postgres"]["ports"]
    assert "127.0.0.1:9000:9000" in services["minio"]["ports"]
    assert "127.0.0.1:8707:8707" in services["kvc"]["ports"]  # loopback only on the host
    for name in ("postgres", "minio"):
        assert "healthcheck" in services[name]
    deps = services["kvc"]["depends_on"]
    assert deps["postgres"]["condition"] == "service_healthy"
    assert deps["create-bucket"]["condition"] == "service_completed_successfully"


def test_kvc_env_is_valid_settings_and_matches_the_other_services() -> None:
    svc = load()["services"]
    env = svc["kvc"]["environment"]
    kvc_env = {k.removeprefix("KVC_").lower(): v for k, v in env.items() if k.startswith("KVC_")}
    settings = Settings(**kvc_env)  # extra="forbid": an unknown KVC_ name fails here
    pg = svc["postgres"]["environment"]
    url = urlparse(settings.resolved_catalog_url)
    assert url.scheme == "postgresql+psycopg" and url.hostname == "postgres"
    assert (url.username, url.password, url.path.lstrip("/")) == (pg["POSTGRES_USER"], pg["POSTGRES_PASSWORD"], pg["POSTGRES_DB"])
    store = urlparse(settings.resolved_stores[0])
    assert store.scheme == "s3" and store.netloc == "kvc"
    assert parse_qs(store.query)["endpoint_url"] == ["http://minio:9000"]
    minio = svc["minio"]["environment"]
    assert env["AWS_ACCESS_KEY_ID"] == minio["MINIO_ROOT_USER"]
    assert env["AWS_SECRET_ACCESS_KEY"] == minio["MINIO_ROOT_PASSWORD"]
    assert "local/kvc" in svc["create-bucket"]["entrypoint"]
    assert "kvc serve" in " ".join(svc["kvc"]["command"]) and "--port 8707" in " ".join(svc["kvc"]["command"])


def test_tokens_file_holds_hashes_not_tokens() -> None:
    tokens = json.loads((COMPOSE / "tokens.json").read_text())
    assert tokens == {"default": hashlib.sha256(b"kvc-dev-token").hexdigest()}
    assert "kvc-dev-token" in (COMPOSE / "README.md").read_text()
