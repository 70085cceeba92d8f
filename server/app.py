"""The HTTP API of ``pfl_edge.protocol`` as a FastAPI app: ``create_app(settings)``.

Every call but enrolment and ``/healthz`` carries ``Authorization: Bearer <token>``: a device token, or the admin
token (federation creation; it may also read everything). Refusals are JSON ``{"detail": "..."}`` saying what
was wrong and what is valid. Nothing unauthenticated changes state.
"""

from __future__ import annotations

import hmac
import logging
import pathlib
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Annotated, Any

from fastapi import Depends, FastAPI, Path, Request, Response
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import BaseModel
from sqlalchemy import Engine, text

from pfl_edge.protocol import (
    API_PREFIX,
    DIGEST_RE,
    MAX_ROUND,
    PROTOCOL_VERSION,
    Enrolment,
    EnrolRequest,
    FederationCreate,
    FederationInfo,
    MetricsReport,
    UpdateAccepted,
    UpdateRequest,
)

from .blobs import DirBlobStore
from .broker import EmbeddedBroker
from .db import Device, make_engine, make_sessionmaker
from .mqtt import MqttLink
from .rounds import ApiError, Coordinator
from .settings import Settings, ensure_admin_token

__all__ = ["AppState", "create_app"]

log = logging.getLogger(__name__)

_bearer = HTTPBearer(auto_error=False, description="a device token (from enrolment) or the admin token")
Token = Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]
RoundNo = Annotated[int, Path(ge=0, le=MAX_ROUND, description="the round")]
Digest = Annotated[str, Path(description="sha256 of the blob's bytes, 64 lowercase hex characters")]


class BlobStored(BaseModel):
    digest: str
    size: int
    created: bool  # False: this device had already sent these bytes


class MetricsStored(BaseModel):
    round: int
    device_id: str


class Health(BaseModel):
    status: str
    protocol: int
    database: bool
    mqtt: bool


@dataclass
class AppState:
    settings: Settings
    engine: Engine
    coordinator: Coordinator
    broker: EmbeddedBroker | None
    broker_url: str
    link: MqttLink


def create_app(settings: Settings | None = None) -> FastAPI:
    """The server as an ASGI app. Its lifespan opens the database and blob store, starts the embedded broker
    (if ``broker_url`` is ``embedded``), connects to the broker, resumes unfinished federations and runs the
    round worker; ``app.state.pfl`` is the :class:`AppState` once started."""
    settings = ensure_admin_token(settings if settings is not None else Settings())
    admin = settings.admin_token.get_secret_value() if settings.admin_token else ""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        st = await run_in_threadpool(_start, settings)
        app.state.pfl = st
        try:
            yield
        finally:
            await run_in_threadpool(_stop, st)

    app = FastAPI(title="pfl-edge server", version=str(PROTOCOL_VERSION), lifespan=lifespan,
                  description="Coordination of personalized federated learning (FedPer, DisPFL) on edge devices: "
                              "the HTTP half of pfl_edge.protocol. Control messages travel over MQTT.")

    def coord(request: Request) -> Coordinator:
        return request.app.state.pfl.coordinator

    def is_admin(tok: Token) -> bool:
        return tok is not None and bool(admin) and hmac.compare_digest(tok.credentials.encode(), admin.encode())

    def device(request: Request, tok: Token) -> Device:
        return coord(request).device_for_token(tok.credentials if tok else None)

    def reader(request: Request, tok: Token, fed: str) -> None:
        """The admin, or a device of federation ``fed``."""
        if is_admin(tok):
            return
        dev = device(request, tok)
        if dev.federation != fed:
            raise ApiError(403, f"this device belongs to federation {dev.federation!r}, not {fed!r}")

    @app.exception_handler(ApiError)
    async def _api_error(_request: Request, exc: ApiError) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else None
        return JSONResponse({"detail": exc.detail}, status_code=exc.status, headers=headers)

    @app.get("/healthz", response_model=Health, tags=["ops"])
    def healthz(request: Request) -> Health:
        st: AppState = request.app.state.pfl
        try:
            with st.engine.connect() as c:
                c.execute(text("SELECT 1"))
            db_ok = True
        except Exception:
            db_ok = False
        return Health(status="ok" if db_ok else "degraded", protocol=PROTOCOL_VERSION, database=db_ok,
                      mqtt=st.link.connected)

    @app.post(f"{API_PREFIX}/federations", response_model=FederationInfo, status_code=201, tags=["federations"])
    def create_federation(request: Request, body: FederationCreate, tok: Token) -> FederationInfo:
        if tok is None:
            raise ApiError(401, "missing bearer token: creating a federation needs the admin token")
        if not is_admin(tok):
            raise ApiError(401, "creating a federation needs the admin token (PFL_ADMIN_TOKEN)")
        return coord(request).create_federation(body)

    @app.get(f"{API_PREFIX}/federations/{{fed}}", response_model=FederationInfo, tags=["federations"])
    def get_federation(request: Request, fed: str, tok: Token) -> FederationInfo:
        reader(request, tok, fed)
        return coord(request).federation_info(fed)

    @app.get(f"{API_PREFIX}/federations/{{fed}}/metrics", tags=["federations"])
    def get_metrics(request: Request, fed: str, tok: Token) -> dict[str, Any]:
        """Every round: per-device metrics and a summary (mean accuracy, updates, wall time of the round)."""
        reader(request, tok, fed)
        return coord(request).metrics(fed)

    @app.get(f"{API_PREFIX}/federations/{{fed}}/devices", tags=["federations"])
    def get_devices(request: Request, fed: str, tok: Token) -> list[dict[str, Any]]:
        """Enrolled devices: profile, index, density, K_P, online, last round, bytes."""
        reader(request, tok, fed)
        return coord(request).devices(fed)

    @app.post(f"{API_PREFIX}/devices", response_model=Enrolment, status_code=201, tags=["devices"])
    def enrol(request: Request, body: EnrolRequest) -> Enrolment:
        return coord(request).enrol(body)

    @app.put(f"{API_PREFIX}/blobs/{{sha256}}", response_model=BlobStored, tags=["blobs"],
             responses={201: {"model": BlobStored}, 413: {"description": "over max_blob_bytes"}},
             openapi_extra={"requestBody": {"required": True, "content": {
                 "application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}}})
    async def put_blob(request: Request, sha256: Digest, tok: Token, response: Response) -> BlobStored:
        """A payload of pfl_edge.codec, named by its sha256; checked to decode against the federation's model."""
        dev = await run_in_threadpool(device, request, tok)
        if not DIGEST_RE.match(sha256):
            raise ApiError(422, f"{sha256!r:.80} is not a sha256 digest (64 lowercase hex characters)")
        limit = settings.max_blob_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise ApiError(413, f"blob of {declared} bytes is over the limit of {limit} bytes")
        buf = bytearray()
        async for chunk in request.stream():
            buf += chunk
            if len(buf) > limit:  # a body without (or with a lying) Content-Length
                raise ApiError(413, f"blob is over the limit of {limit} bytes")
        data = bytes(buf)
        created = await run_in_threadpool(coord(request).put_blob, dev, sha256, data)
        response.status_code = 201 if created else 200
        return BlobStored(digest=sha256, size=len(data), created=created)

    @app.get(f"{API_PREFIX}/blobs/{{sha256}}", tags=["blobs"], response_class=Response,
             responses={200: {"content": {"application/octet-stream": {}}}})
    def get_blob(request: Request, sha256: Digest, tok: Token) -> Response:
        reader = None if is_admin(tok) else device(request, tok)
        if not DIGEST_RE.match(sha256):
            raise ApiError(422, f"{sha256!r:.80} is not a sha256 digest (64 lowercase hex characters)")
        data = coord(request).get_blob(None if reader is None else reader.federation, sha256, reader)
        return Response(data, media_type="application/octet-stream", headers={"ETag": f'"{sha256}"'})

    @app.post(f"{API_PREFIX}/rounds/{{t}}/updates", response_model=UpdateAccepted, tags=["rounds"])
    def post_update(request: Request, t: RoundNo, body: UpdateRequest, tok: Token) -> UpdateAccepted:
        dev = device(request, tok)
        if t < 0:
            raise ApiError(422, f"round must be >= 0, got {t}")
        return coord(request).submit_update(dev, t, body)

    @app.post(f"{API_PREFIX}/rounds/{{t}}/metrics", response_model=MetricsStored, tags=["rounds"])
    def post_metrics(request: Request, t: RoundNo, body: MetricsReport, tok: Token) -> MetricsStored:
        dev = device(request, tok)
        coord(request).report_metrics(dev, t, body)
        return MetricsStored(round=t, device_id=dev.id)

    return app


def _embedded_port(data_dir: pathlib.Path) -> int | None:
    """The embedded broker's port of this data dir's last run, when it is free again: enrolled devices know
    the broker by that URL and reconnect to it after a server restart. None: any free port."""
    import socket

    try:
        port = int((data_dir / "broker-port").read_text())
    except (OSError, ValueError):
        return None
    with socket.socket() as sock:
        # as the broker binds it: connections of the killed run linger in TIME_WAIT on this port
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return None
    return port


def _start(settings: Settings) -> AppState:
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    engine = make_engine(settings.resolved_database_url)
    sessions = make_sessionmaker(engine)
    blobs = DirBlobStore(settings.resolved_blob_dir, settings.max_blob_bytes)
    broker: EmbeddedBroker | None = None
    if settings.broker_url == "embedded":
        broker = EmbeddedBroker(port=_embedded_port(settings.data_dir))
        broker_url = broker.start()
        (settings.data_dir / "broker-port").write_text(str(broker.port))
    else:
        broker_url = settings.broker_url
    holder: list[Coordinator] = []
    link = MqttLink(broker_url, lambda topic, payload: holder[0].on_status(topic, payload) if holder else None,
                    on_reconnect=lambda: holder[0].request_republish() if holder else None,
                    username=settings.mqtt_username,
                    password=settings.mqtt_password.get_secret_value() if settings.mqtt_password else None)
    coordinator = Coordinator(
        sessions, blobs, link, device_broker_url=settings.public_broker_url or broker_url,
        device_mqtt_password=settings.device_mqtt_password.get_secret_value() if settings.device_mqtt_password
        else "", max_blob_bytes=settings.max_blob_bytes, tick_s=settings.tick_s)
    holder.append(coordinator)
    link.start()
    coordinator.start()
    return AppState(settings, engine, coordinator, broker, broker_url, link)


def _stop(st: AppState) -> None:
    st.coordinator.stop()
    st.link.stop()
    if st.broker is not None:
        st.broker.stop()
    st.engine.dispose()
