"""The content-addressed blob store over HTTP: devices put payloads named by their sha256, and read what they
may (``server.services.blob_access``)."""

from __future__ import annotations

import asyncio
import logging
from typing import Annotated

from fastapi import APIRouter, Path, Request, Response
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse
from starlette.requests import ClientDisconnect

from pfl_edge.protocol import DIGEST_RE, BlobStored

from ..db import Device
from ..deps import BlobReader, Blobs, DeviceAuth
from ..errors import Unprocessable
from ..services.blob_access import BlobAccess
from ..services.spool import BodyStalled, Spooled, spool_body
from ..settings import Settings

__all__ = ["BlobStored", "router"]

router = APIRouter(prefix="/blobs", tags=["blobs"])

log = logging.getLogger(__name__)

Digest = Annotated[str, Path(description="sha256 of the blob's bytes, 64 lowercase hex characters")]


def _check_digest(sha256: str) -> None:
    if not DIGEST_RE.match(sha256):
        raise Unprocessable(f"{sha256!r:.80} is not a sha256 digest (64 lowercase hex characters)")



def _put(blobs: BlobAccess, dev: Device, sha256: str, body: Spooled) -> bool:
    try:
        return blobs.put(dev, sha256, body)
    finally:
        body.discard()


def _body_setting(request: Request, name: str) -> float:
    """The server's ``http_body_*`` setting ``name`` (its default for an app without the server's state)."""
    st = getattr(request.app.state, "pfl", None)
    if st is None:
        return float(Settings.model_fields[name].default)
    return float(getattr(st.settings, name))


@router.put("/{sha256}", response_model=BlobStored,
            responses={201: {"model": BlobStored}, 413: {"description": "over max_blob_bytes"}},
            openapi_extra={"requestBody": {"required": True, "content": {
                "application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}}})
async def put_blob(request: Request, sha256: Digest, dev: DeviceAuth, blobs: Blobs,
                   response: Response) -> BlobStored | Response:
    """A payload of pfl_edge.codec, named by its sha256; checked to decode against the federation's model."""
    _check_digest(sha256)
    # the quota and the device's uploads in flight before a byte of the body is read (both again when it is stored)
    await run_in_threadpool(blobs.check_quota, dev, sha256)
    # to a temp file as it arrives (an upload in flight holds a chunk, not its body), then checked and stored by
    # the upload threads (decoded in the decode processes), apart from the thread pool of cheap requests
    try:
        with blobs.receiving(dev):
            body = await spool_body(request.stream(), blobs.store.max_blob_bytes, blobs.spool_dir,
                                    request.headers.get("content-length"),
                                    _body_setting(request, "http_body_idle_timeout_s"),
                                    _body_setting(request, "http_body_min_rate"))
    except ClientDisconnect:  # cut or killed mid-upload: nothing was kept, and a device sends the blob again
        log.info("device %s went away during PUT of blob %s", dev.id, sha256)
        return Response(status_code=400)  # read by no one; not a server error to log with a traceback
    except BodyStalled as e:  # its slot and spool file are free already; the connection ends with the answer
        log.info("device %s stalled during PUT of blob %s: %s", dev.id, sha256, e)
        return JSONResponse({"detail": f"request body stalled: {e}"}, status_code=408,
                            headers={"Connection": "close"})  # the rest of the body is never read
    job = blobs.upload_threads.submit(_put, blobs, dev, sha256, body)
    try:
        created = await asyncio.wrap_future(job)
    except asyncio.CancelledError:  # the client went away: a job not yet started never will
        if job.cancel():
            body.discard()
        raise
    response.status_code = 201 if created else 200
    return BlobStored(digest=sha256, size=body.size, created=created)


@router.get("/{sha256}", response_class=Response, responses={200: {"content": {"application/octet-stream": {}}}})
def get_blob(sha256: Digest, reader: BlobReader, blobs: Blobs) -> Response:
    _check_digest(sha256)
    dev = reader if isinstance(reader, Device) else None
    data = blobs.get(None if dev is None else dev.federation, sha256, dev)
    return Response(data, media_type="application/octet-stream", headers={"ETag": f'"{sha256}"'})
