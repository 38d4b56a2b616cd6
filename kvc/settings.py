"""Settings: flags > KVC_* environment > kvc.toml > defaults, and the embedded default home."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Any

from pydantic import Field, field_validator
from pydantic_settings import (
    BaseSettings,
    NoDecode,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

from catalog.base import MAX_CHUNK_SIZE, MIN_CHUNK_SIZE
from restore.cores import usable_cores


def _config_file() -> Path:
    return Path(os.environ.get("KVC_CONFIG", "kvc.toml"))


class Settings(BaseSettings):
    """Everything kvc needs to run; see `docs/cli.md` for each setting.

    `home` (KVC_HOME, default ./.kvc) holds the embedded default: a SQLite
    catalog (`catalog.db`) and a local store (`blobs/`), used when
    `catalog_url` and `stores` are not set.
    """

    model_config = SettingsConfigDict(env_prefix="KVC_", extra="forbid", validate_default=True)

    home: Path = Path(".kvc")
    catalog_url: str | None = Field(
        default=None, description="sqlite:///PATH or postgresql+psycopg://..."
    )
    stores: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="store URLs, comma-separated in KVC_STORES: the first is written synchronously, "
        "object stores after it get write-behind uploads",
    )
    namespace: str = "default"
    chunk_size: int = Field(default=256, ge=MIN_CHUNK_SIZE, le=MAX_CHUNK_SIZE)
    page_size: int = Field(default=16, ge=1, le=4096)
    host: str = "127.0.0.1"
    port: int = Field(default=8707, ge=1, le=65535)
    daemon_port: int = Field(default=8708, ge=1, le=65535)
    daemon_invalidation_interval: float = Field(
        default=2.0,
        ge=0,
        le=86400,
        allow_inf_nan=False,
        description="seconds between the daemon's quarantine-invalidation checks; 0 disables",
    )
    daemon_allowed_hosts: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="host names the daemon answers to besides loopback and its bind address "
        "(comma-separated in KVC_DAEMON_ALLOWED_HOSTS); requests naming another Host, or "
        "coming from a page of another origin, are refused",
    )
    worker_id: str | None = None
    service_url: str | None = Field(
        default=None, description="use a kvc service instead of a database"
    )
    service_token: str | None = Field(default=None, repr=False)
    tokens_file: Path | None = Field(
        default=None, description="namespace -> sha256(token) for `kvc serve`"
    )
    max_prompt_tokens: int = Field(default=1 << 20, ge=1)
    serve_workers: int | None = Field(
        default=None,
        ge=1,
        le=256,
        description="`kvc serve`: processes answering requests; default one per core, at most 8",
    )
    serve_threads: int = Field(
        default=8,
        ge=1,
        le=1024,
        description="`kvc serve`: requests each process handles at once (its threadpool)",
    )
    max_body_bytes: int = Field(
        default=64 << 20, ge=1, description="`kvc serve`: larger request bodies are a 413"
    )
    write_behind_bytes: int = Field(
        default=256 << 20,
        ge=1,
        description="encoded bytes of write-behind uploads pending at once; past it speculative "
        "checkpoints skip the object copy and explicit ones wait, then are refused",
    )

    @field_validator("stores", "daemon_allowed_hosts", mode="before")
    @classmethod
    def _split(cls, v: Any) -> Any:
        if isinstance(v, str):
            return [s.strip() for s in v.split(",") if s.strip()]
        return v

    @field_validator("stores")
    @classmethod
    def _valid_store_urls(cls, v: list[str]) -> list[str]:
        from chunkstore import check_store_url
        from chunkstore.errors import StoreURLError

        for url in v:
            try:
                check_store_url(url)
            except StoreURLError as exc:
                raise ValueError(str(exc)) from None
        return v

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # Flags (init) beat the environment, which beats kvc.toml.
        return (init_settings, env_settings, TomlConfigSettingsSource(settings_cls, _config_file()))

    @property
    def resolved_catalog_url(self) -> str:
        return self.catalog_url or f"sqlite:///{self.home.resolve() / 'catalog.db'}"

    @property
    def resolved_stores(self) -> list[str]:
        return self.stores or [f"file://{self.home.resolve() / 'blobs'}"]

    @property
    def uses_embedded_default(self) -> bool:
        return self.catalog_url is None or not self.stores


def default_serve_workers() -> int:
    """`kvc serve`'s processes when not told: one per core this process may run on, at most 8
    (each holds its own database connections)."""
    return max(1, min(usable_cores(), 8))


def load(**flags: Any) -> Settings:
    """Settings from flags (None means not given), the environment and kvc.toml."""
    return Settings(**{k: v for k, v in flags.items() if v is not None})
