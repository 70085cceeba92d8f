"""The server's settings: environment variables ``PFL_*``, an optional TOML or ``.env`` file, or keyword arguments.

Precedence, highest first: keyword arguments, environment, the file, the defaults below.
"""

from __future__ import annotations

import secrets
import sys
from contextvars import ContextVar
from pathlib import Path
from typing import Any

from pydantic import Field, SecretStr, field_validator
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

__all__ = ["Settings", "ensure_admin_token", "load_settings"]

_TOML: ContextVar[Path | None] = ContextVar("pfl_settings_toml", default=None)


class Settings(BaseSettings):
    """Everything the server needs. Paths default to files under ``data_dir``."""

    model_config = SettingsConfigDict(env_prefix="PFL_", extra="forbid", validate_default=True)

    data_dir: Path = Path("pfl-server-data")
    database_url: str | None = None  # default sqlite:///<data_dir>/state.db; postgresql://... for PostgreSQL
    blob_dir: Path | None = None  # default <data_dir>/blobs
    broker_url: str = "embedded"  # or mqtt://host:port (Mosquitto, EMQX, ...)
    public_url: str = "http://127.0.0.1:8000"  # this server, as devices reach it
    public_broker_url: str | None = None  # the broker as devices reach it; default: broker_url as the server sees it
    admin_token: SecretStr | None = None  # creates federations; generated (and printed once) when unset
    max_blob_bytes: int = Field(default=64 * 1024 * 1024, ge=1024)
    mqtt_username: str | None = None  # the server's own credentials on an external broker
    mqtt_password: SecretStr | None = None
    device_mqtt_password: SecretStr | None = None  # told to devices, whose MQTT username is their device id
    tick_s: float = Field(default=1.0, gt=0)  # how often deadlines and round transitions are checked

    @field_validator("broker_url")
    @classmethod
    def _broker(cls, v: str) -> str:
        if v != "embedded" and not v.startswith(("mqtt://", "tcp://")):
            raise ValueError("broker_url must be 'embedded' or mqtt://host:port")
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
        toml = _TOML.get()
        extra = (TomlConfigSettingsSource(settings_cls, toml_file=toml),) if toml is not None else ()
        return (init_settings, env_settings, dotenv_settings, *extra, file_secret_settings)

    @property
    def resolved_database_url(self) -> str:
        url = self.database_url or f"sqlite:///{(self.data_dir / 'state.db').resolve()}"
        # SQLAlchemy's default PostgreSQL driver is psycopg2; psycopg 3 is what we ship
        for plain in ("postgresql://", "postgres://"):
            if url.startswith(plain):
                return "postgresql+psycopg://" + url[len(plain):]
        return url

    @property
    def resolved_blob_dir(self) -> Path:
        return self.blob_dir if self.blob_dir is not None else self.data_dir / "blobs"


def load_settings(path: str | Path | None = None, **overrides: Any) -> Settings:
    """Settings from the environment, an optional ``.toml`` (keys as the field names) or ``.env`` file
    (``PFL_*`` lines), and ``overrides``."""
    if path is None:
        return Settings(**overrides)
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"settings file {p} does not exist")
    if p.suffix == ".toml":
        token = _TOML.set(p)
        try:
            return Settings(**overrides)
        finally:
            _TOML.reset(token)
    return Settings(_env_file=p, **overrides)  # type: ignore[call-arg]


def ensure_admin_token(settings: Settings, *, announce: bool = True) -> Settings:
    """The settings with an admin token: the configured one, or a fresh one printed once to stderr so the
    operator can create federations (the only time a token is ever shown)."""
    if settings.admin_token is not None and settings.admin_token.get_secret_value():
        return settings
    token = secrets.token_urlsafe(32)
    if announce:
        print(f"pfl-edge server: no PFL_ADMIN_TOKEN set; generated admin token: {token}", file=sys.stderr)
    return settings.model_copy(update={"admin_token": SecretStr(token)})
