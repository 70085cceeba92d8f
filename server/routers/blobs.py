"""The content-addressed blob store over HTTP: devices put payloads named by their sha256, and read what they
may (``server.services.blob_access``)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path, Request, Response
from fastapi.concurrency import run_in_threadpool
from pydantic import BaseModel

from pfl_edge.protocol import DIGEST_RE

from ..db import Device
from ..deps import BlobReader, Blobs, DeviceAuth
from ..errors import TooLarge, Unprocessable

__all__ = ["BlobStored", "router"]

router = APIRouter(prefix="/blobs", tags=["blobs"])

Digest = Annotated[str, Path(description="sha256 of the blob's bytes, 64 lowercase hex characters")]


class BlobStored(BaseModel):
    digest: str
    size: int
    created: bool  # False: this device had already sent these bytes


def _check_digest(sha256: str) -> None:
    if not DIGEST_RE.match(sha256):
        raise Unprocessable(f"{sha256!r:.80} is not a sha256 digest (64 lowercase hex characters)")


async def _read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise TooLarge(f"blob of {declared} bytes is over the limit of {limit} bytes")
    buf = bytearray()
    async for chunk in request.stream():
        buf += chunk
        if len(buf) > limit:  # a body without (or with a lying) Content-Length
            raise TooLarge(f"blob is over the limit of {limit} bytes")
    return bytes(buf)


@router.put("/{sha256}", response_model=BlobStored,
            responses={201: {"model": BlobStored}, 413: {"description": "over max_blob_bytes"}},
            openapi_extra={"requestBody": {"required": True, "content": {
                "application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}}})
async def put_blob(request: Request, sha256: Digest, dev: DeviceAuth, blobs: Blobs, response: Response) -> BlobStored:
    """A payload of pfl_edge.codec, named by its sha256; checked to decode against the federation's model."""
    _check_digest(sha256)
    data = await _read_body(request, blobs.store.max_blob_bytes)
    created = await run_in_threadpool(blobs.put, dev, sha256, data)
    response.status_code = 201 if created else 200
    return BlobStored(digest=sha256, size=len(data), created=created)


@router.get("/{sha256}", response_class=Response, responses={200: {"content": {"application/octet-stream": {}}}})
def get_blob(sha256: Digest, reader: BlobReader, blobs: Blobs) -> Response:
    _check_digest(sha256)
    dev = reader if isinstance(reader, Device) else None
    data = blobs.get(None if dev is None else dev.federation, sha256, dev)
    return Response(data, media_type="application/octet-stream", headers={"ETag": f'"{sha256}"'})
