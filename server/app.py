"""The HTTP API of ``pfl_edge.protocol`` as a FastAPI app: ``create_app(settings)``.

The routers (``server.routers``) get their services and callers by dependency injection (``server.deps``).
Refusals are JSON ``{"detail": "..."}`` with the status of their ``server.errors`` type, saying what was wrong
and what is valid. Nothing unauthenticated changes state.
"""

from __future__ import annotations

import gc
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import IO, Any

from fastapi import FastAPI, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse
from sqlalchemy import Engine

from pfl_edge.protocol import PROTOCOL_VERSION

from .blobs import DirBlobStore
from .broker import EmbeddedBroker
from .broker_setup import start_mqtt
from .coordinator import Coordinator
from .db import make_engine
from .enrol_gate import enrol_gate
from .errors import ApiError
from .limits import install as install_limits
from .migrations import make_sessionmaker
from .mqtt import MqttLink
from .peers import CloseStrangers
from .routers import api, dashboard, health, prom
from .services.leadership import leadership_for, sqlite_guard
from .services.spool import DecodePool
from .services.telemetry import install as install_telemetry
from .settings import Settings, ensure_admin_token, secure_data_dir

__all__ = ["AppState", "create_app"]

log = logging.getLogger(__name__)


@dataclass
class AppState:
    settings: Settings
    engine: Engine
    coordinator: Coordinator
    broker: EmbeddedBroker | None
    broker_url: str
    link: MqttLink
    guard: IO[bytes] | None = None  # SQLite's one-server lock (server.services.leadership.sqlite_guard)


def create_app(settings: Settings | None = None) -> FastAPI:
    """The server as an ASGI app. Its lifespan opens the database (creating or upgrading its schema) and blob
    store, starts the embedded broker (if ``broker_url`` is ``embedded``), connects to the broker, resumes
    unfinished federations and runs the round worker; ``app.state.pfl`` is the :class:`AppState` once started."""
    settings = ensure_admin_token(settings if settings is not None else Settings())

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        st = await run_in_threadpool(_start, settings)
        app.state.pfl = st
        # everything made so far (torch, the models, the routes) lives as long as the server: out of the cyclic
        # GC's sight, so that a collection a request triggers walks what requests made, not the whole heap (issue
        # 33 measured a JSON parse at 34 ms with the heap walked, 1.2 ms after freezing it)
        gc.freeze()
        try:
            yield
        finally:
            arts = getattr(app.state, "artefacts", None)  # made on first use (server.routers.models)
            if arts is not None:
                await run_in_threadpool(arts.close)
            await run_in_threadpool(_stop, st)

    docs: dict[str, Any] = {} if settings.api_docs else dict(docs_url=None, redoc_url=None, openapi_url=None)
    app = FastAPI(title="pfl-edge server", version=str(PROTOCOL_VERSION), lifespan=lifespan,
                  description="Coordination of personalized federated learning (FedPer, DisPFL) on edge devices: "
                              "the HTTP half of pfl_edge.protocol. Control messages travel over MQTT.", **docs)
    app.state.api_docs = settings.api_docs
    app.state.admin_token = settings.admin_token.get_secret_value() if settings.admin_token else ""
    app.add_exception_handler(ApiError, _api_error)  # type: ignore[arg-type]  # narrower than Exception
    app.add_middleware(CloseStrangers)  # no idle kept-alive connection for a request without a token
    install_limits(app)  # body, header and JSON bounds before parsing; 422s that never echo the input
    install_telemetry(app)  # request latency and bytes by route template, for /metrics (outermost: sees refusals)
    app.include_router(health.router)
    app.include_router(api)
    app.include_router(prom.router)
    app.include_router(dashboard.router)
    return app


async def _api_error(_request: Request, exc: ApiError) -> JSONResponse:
    return JSONResponse({"detail": exc.detail}, status_code=int(exc.status), headers=exc.headers)


def _start(settings: Settings) -> AppState:
    secure_data_dir(settings)  # 0700, and state.db 0600
    guard = sqlite_guard(settings.resolved_database_url)  # SQLite: this process alone (replicas: PostgreSQL)
    try:
        return _start_guarded(settings, guard)
    except BaseException:
        if guard is not None:  # a start that failed must not keep the next one out
            guard.close()
        raise


def _start_guarded(settings: Settings, guard: IO[bytes] | None) -> AppState:
    engine = make_engine(settings.resolved_database_url)
    try:
        sessions = make_sessionmaker(engine)  # refuses a database of a newer schema before anything starts
    except BaseException:
        engine.dispose()
        raise
    blobs = DirBlobStore(settings.resolved_blob_dir, settings.max_blob_bytes)
    holder: list[Coordinator] = []  # the broker's and link's callbacks need the coordinator, which needs the link
    mq = start_mqtt(settings, lambda cid, user, pw: holder[0].broker_access.authenticate(cid, user, pw)
                    if holder else None)
    link = mq.link(lambda topic, payload: holder[0].on_status(topic, payload) if holder else None,
                   on_reconnect=lambda: holder[0].request_republish() if holder else None)
    coordinator = Coordinator(
        sessions, blobs, link, device_broker_url=mq.device_url, broker_mode=mq.mode, embedded_broker=mq.broker,
        server_mqtt=mq.server_credentials,
        device_mqtt_password=settings.device_mqtt_password.get_secret_value() if settings.device_mqtt_password
        else "", max_blob_bytes=settings.max_blob_bytes, tick_s=settings.tick_s, token_ttl_s=settings.token_ttl_s,
        gate=enrol_gate(settings, sessions), upload_quota=settings.upload_quota_pending,
        gc_keep_rounds=settings.gc_keep_rounds, leadership=leadership_for(engine),
        partial_sums=settings.partial_sums, partial_flush_s=settings.partial_flush_s, broker_tokens=mq.tokens)
    holder.append(coordinator)
    coordinator.enrolment.token_max_lifetime_s = settings.device_token_max_lifetime_s
    _uploads(coordinator, settings)
    link.start()
    coordinator.start()
    return AppState(settings, engine, coordinator, mq.broker, mq.url, link, guard)


def _uploads(coordinator: Coordinator, settings: Settings) -> None:
    """Uploads' bodies spool to ``<data_dir>/incoming`` and are decode-checked in ``decode_processes`` processes
    (default: one per core), off the event loop and off the request threads (``server.services.spool``)."""
    access = coordinator.blob_access
    access.spool_dir = settings.data_dir / "incoming"
    access.decoder = DecodePool(settings.decode_processes)
    access.decoder.start()


def _stop(st: AppState) -> None:
    st.coordinator.stop()
    st.coordinator.blob_access.decoder.stop()
    st.link.stop()
    if st.broker is not None:
        st.broker.stop()
    st.engine.dispose()
    if st.guard is not None:
        st.guard.close()
