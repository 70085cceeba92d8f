"""The server's settings: environment variables ``PFL_*``, an optional TOML or ``.env`` file, or keyword arguments.

Precedence, highest first: keyword arguments, environment, the file, the defaults below.
"""

from __future__ import annotations

import os
import secrets
import sys
from contextvars import ContextVar
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

from pfl_edge.secret_file import read_secret_file

__all__ = ["Settings", "ensure_admin_token", "load_settings", "secure_data_dir"]

_TOML: ContextVar[Path | None] = ContextVar("pfl_settings_toml", default=None)


class Settings(BaseSettings):
    """Everything the server needs. Paths default to files under ``data_dir``."""

    model_config = SettingsConfigDict(env_prefix="PFL_", extra="forbid", validate_default=True)

    data_dir: Path = Path("pfl-server-data")
    database_url: str | None = None  # default sqlite:///<data_dir>/state.db; postgresql://... for PostgreSQL
    blob_dir: Path | None = None  # default <data_dir>/blobs
    # exported programs (server.services.artefacts), by what decides their bytes: one directory may serve several
    # servers of the same version (replicas, or a test session's servers); default <data_dir>/programs
    programs_dir: Path | None = None
    broker_url: str = "embedded"  # or mqtt://host:port (Mosquitto, EMQX, ...)
    public_url: str = "http://127.0.0.1:8000"  # this server, as devices reach it
    public_broker_url: str | None = None  # the broker as devices reach it; default: broker_url as the server sees it
    admin_token: SecretStr | None = None  # creates federations; generated (and printed once) when unset
    max_blob_bytes: int = Field(default=64 * 1024 * 1024, ge=1024)
    mqtt_username: str | None = None  # the server's own credentials on an external broker
    mqtt_password: SecretStr | None = None
    device_mqtt_password: SecretStr | None = None  # shared mode only: told to every device (see broker_dynsec)
    # MQTT (server.services.broker_access): the embedded broker gives every device its own password and topics.
    # On an external broker, broker_dynsec provisions each device the same way through Mosquitto's
    # dynamic-security plugin (mqtt_username/mqtt_password: a dynsec admin whose role may also publish pfl/#);
    # without it every device gets device_mqtt_password and the broker's own configuration rules.
    broker_dynsec: bool = False
    # or the external broker asks this server about every device (RabbitMQ's rabbitmq_auth_backend_http, and
    # brokers with an HTTP auth hook): POST /v1/broker/hook/<token>/{user,vhost,resource,topic} answer allow or
    # deny by the same rules as the embedded broker, nothing provisioned per device (docs/operations.md,
    # "Clustered brokers"). The token, in the hook's URL, keeps everyone but the broker out of it
    broker_hook_token: SecretStr | None = None
    broker_hook_vhost: str = "/"  # the only virtual host a device may use
    # or the external broker checks signed tokens alone (RabbitMQ's rabbitmq_auth_backend_oauth2; "Clustered
    # brokers" in docs/operations.md): a device's MQTT password is a JWT of broker_token_ttl_s whose scopes are its
    # topics, refreshed at GET /v1/devices/me/broker; the keys in broker_token_keys (default <data_dir>/broker-keys,
    # one folder shared by replicas), made at the first start; broker_token_audience: the broker's resource server id
    broker_tokens: bool = False
    # 10 minutes: how long a revoked device may still connect to the broker (issue 49: an hour was); the devices
    # refresh before expiry (edge_runtime.control), 10,000 of them about 20 requests a second
    broker_token_ttl_s: float = Field(default=600.0, ge=10.0, le=7 * 86400.0)
    broker_token_keys: Path | None = None
    broker_token_audience: str = Field(default="pfl", pattern=r"^[A-Za-z0-9_-]{1,64}$")
    embedded_broker_host: str = "127.0.0.1"  # where the embedded broker listens; 0.0.0.0 for devices elsewhere
    embedded_broker_port: int | None = Field(default=None, ge=1, le=65535)  # None: last run's port, else free one
    # connections one client address (an IPv6 one: its http_ipv6_prefix network) may hold open on the embedded
    # broker before they log in, loopback too, and all addresses together (0: no bound); at a bound the oldest
    # without a whole CONNECT is reset for the newcomer (server.broker_door). Logged-in sessions count in neither:
    # a fleet behind one NAT logs in whole (issue 49: 64 of 100 could)
    embedded_broker_max_per_address: int = Field(default=256, ge=0, le=1_000_000)
    embedded_broker_max_unauthenticated: int = Field(default=1024, ge=0, le=1_000_000)
    # who may tell the server a client's address (X-Forwarded-For): the load balancer's addresses or networks,
    # comma-separated (uvicorn's forwarded_allow_ips); "" trusts nobody: the connection's own address counts
    forwarded_allow_ips: str = ""
    # the embedded broker listens with TLS (mqtts://) with this certificate chain and key (both or neither)
    broker_tls_cert: Path | None = None
    broker_tls_key: Path | None = None
    mqtt_ca_file: Path | None = None  # the CA the server trusts for an mqtts:// broker (None: the system's CAs)
    # programs a new federation's devices will ask for, exported when it is created (server.services.artefacts):
    # all: ONNX, then the training programs of every profile that trains with ExecuTorch; inference: ONNX only;
    # none: each on first request
    export_on_create: Literal["all", "inference", "none"] = "all"
    tick_s: float = Field(default=1.0, gt=0)  # how often deadlines and round transitions are checked
    decode_processes: int | None = Field(default=None, ge=0, le=1024)  # uploads' decode checks; None: one per core
    admin_token_file: Path | None = None  # the admin token read from this file (first line) when admin_token is unset
    metrics_token: SecretStr | None = None  # read-only bearer token for GET /metrics (Prometheus); None: admin only
    # device tokens: a device rotates its own (POST /v1/devices/me/token) before they expire
    token_ttl_s: float = Field(default=30 * 86400.0, ge=60, le=10 * 365 * 86400.0)
    # enrolment attempts: a token bucket per client address and per federation, in memory; a refused attempt
    # (wrong secret, unknown federation) spends a token, an accepted one gives it back; an empty bucket: 429
    enrol_rate_per_address: float = Field(default=1.0, gt=0, le=1e6)  # refills per second
    enrol_burst_per_address: int = Field(default=20, ge=1, le=1_000_000)
    enrol_rate_per_federation: float = Field(default=5.0, gt=0, le=1e6)
    enrol_burst_per_federation: int = Field(default=100, ge=1, le=1_000_000)
    enrol_kdf_slots: int = Field(default=2, ge=1, le=64)  # threads for enrolment's scrypt (never a request thread)
    # a device's token chain (its own rotations since it last showed the enrol secret) ends this long after it began
    device_token_max_lifetime_s: float = Field(default=30 * 86400.0, ge=60, le=10 * 365 * 86400.0)
    # disk: uploads a device holds that no update of it names yet (a round's upload waits for its update)
    upload_quota_pending: int = Field(default=4, ge=1, le=1000)
    gc_keep_rounds: int = Field(default=2, ge=1, le=1_000_000)  # blobs of the current and last K rounds are kept
    # replicas fold the updates they accept into partial sums that the leader merges at close (the mean rule;
    # server.services.partials): the close reads a sum per replica instead of every update, and the base equals
    # the one-by-one mean up to float64 rounding in the order of the sums (off: in slot order, to the bit)
    partial_sums: bool = False
    partial_flush_s: float = Field(default=1.0, gt=0, le=3600)  # how often a replica writes its sums
    # HTTPS (both or neither) and the HTTP server's limits (uvicorn)
    tls_cert: Path | None = None
    tls_key: Path | None = None
    http_limit_concurrency: int = Field(default=4096, ge=16, le=1_000_000)  # more connections or tasks: 503
    http_backlog: int = Field(default=2048, ge=16, le=65535)
    http_keep_alive_s: float = Field(default=15.0, gt=0, le=3600)  # an idle kept-alive connection is closed
    http_header_timeout_s: float = Field(default=10.0, gt=0, le=3600)  # a connection without a whole request header
    http_first_byte_timeout_s: float = Field(default=5.0, gt=0, le=3600)  # a new connection that sent no byte yet
    # open connections one TCP peer address may hold; more are reset at once, unread (0: no limit). Behind a proxy
    # or NAT every client has its address: forwarded_allow_ips are never capped; else raise it, or 0
    http_max_connections_per_address: int = Field(default=256, ge=0, le=1_000_000)
    http_ipv6_prefix: int = Field(default=64, ge=8, le=128)  # an IPv6 peer counts under its /64: one client holds one
    # connections without a whole request header yet, all peers together; one more resets the oldest (0: no bound):
    # a quarter of http_limit_concurrency keeps silent sockets from many addresses off every device's 503
    http_max_unproven_connections: int = Field(default=1024, ge=0, le=1_000_000)
    http_body_idle_timeout_s: float = Field(default=30.0, gt=0, le=3600)  # a blob PUT's body that stops arriving
    # a blob PUT's body slower on average than this (bytes a second), once past the idle timeout, is refused: a
    # drip of a byte a second held its connection for ever (issue 49); 2G links carry several kB/s
    http_body_min_rate: float = Field(default=1000.0, ge=0, le=1e9)
    # /docs, /redoc, /openapi.json and /v1/schemas: on where people develop, off in the shipped compose files (they
    # told strangers every route and message, issue 49)
    api_docs: bool = True
    http_max_header_bytes: int = Field(default=16 * 1024, ge=1024, le=1 << 20)

    @field_validator("broker_url")
    @classmethod
    def _broker(cls, v: str) -> str:
        if v != "embedded" and not v.startswith(("mqtt://", "tcp://", "mqtts://", "ssl://")):
            raise ValueError("broker_url must be 'embedded', mqtt://host:port or mqtts://host:port")
        return v

    @model_validator(mode="after")
    def _hook(self) -> Settings:
        token = self.broker_hook_token.get_secret_value() if self.broker_hook_token else None
        if token is not None:
            if self.broker_url == "embedded" or self.broker_dynsec:
                raise ValueError("broker_hook_token is for an external broker that asks the server (not the embedded "
                                 "broker, not broker_dynsec): set broker_url to that broker, or unset the token")
            if len(token) < 16:
                raise ValueError("broker_hook_token must be at least 16 characters (it is the hook's only secret)")
            # the hook lets the server's user name in on this password alone, never throttled (a throttle locked
            # the servers out, issue 49): its length is what keeps guessing hopeless (BrokerAccess._server_login)
            password = self.mqtt_password.get_secret_value() if self.mqtt_password else ""
            if self.mqtt_username and password and len(password) < 16:
                raise ValueError("mqtt_password must be at least 16 characters where the broker hook checks it (the "
                                 "hook answers guesses at HTTP speed): draw it at random, e.g. openssl rand -hex 32")
        if self.broker_tokens and (self.broker_url == "embedded" or self.broker_dynsec):
            raise ValueError("broker_tokens is for an external broker that checks tokens (RabbitMQ's oauth2 "
                             "backend), not the embedded broker nor broker_dynsec")
        return self

    @model_validator(mode="after")
    def _tls_pair(self) -> Settings:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("tls_cert and tls_key go together: set both (HTTPS) or neither (HTTP)")
        if (self.broker_tls_cert is None) != (self.broker_tls_key is None):
            raise ValueError("broker_tls_cert and broker_tls_key go together: set both (mqtts://) or neither")
        return self

    @property
    def scheme(self) -> str:
        return "https" if self.tls_cert is not None else "http"

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
    if settings.admin_token_file is not None:
        return settings.model_copy(update={"admin_token": SecretStr(read_secret_file(settings.admin_token_file))})
    token = secrets.token_urlsafe(32)
    if announce:
        print(f"pfl-edge server: no PFL_ADMIN_TOKEN set; generated admin token: {token}", file=sys.stderr)
    return settings.model_copy(update={"admin_token": SecretStr(token)})


def secure_data_dir(settings: Settings) -> None:
    """The data dir and blob dir private to the server's user (0700), and SQLite's ``state.db`` created 0600
    (SQLite gives its -wal and -shm files the database file's mode)."""
    for d in (settings.data_dir, settings.resolved_blob_dir):
        d.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.chmod(d, 0o700)
    url = settings.resolved_database_url
    if url.startswith("sqlite:///"):
        db = Path(url[len("sqlite:///"):])
        if db.parent.is_dir():
            os.close(os.open(db, os.O_WRONLY | os.O_CREAT, 0o600))
            os.chmod(db, 0o600)
