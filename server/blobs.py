"""Content-addressed blob store: a blob's name is the sha256 of its bytes.

The interface (:class:`BlobStore`) is small enough for an S3-compatible store to implement; :class:`DirBlobStore`
keeps blobs as files under a directory, written atomically (temp file, fsync, ``os.replace``).
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path
from typing import Protocol

from pfl_edge.protocol import DIGEST_RE

__all__ = ["BlobError", "BlobStore", "BlobTooLarge", "DirBlobStore", "sha256_hex"]


class BlobError(ValueError):
    """A blob was refused (bad digest, content that does not match it)."""


class BlobTooLarge(BlobError):
    pass


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class BlobStore(Protocol):
    def put(self, digest: str, data: bytes) -> bool:
        """Store ``data`` under ``digest`` (checked); True if it was new, False if already there (not rewritten)."""
        ...

    def get(self, digest: str) -> bytes:
        """The blob's bytes; KeyError if unknown."""
        ...

    def exists(self, digest: str) -> bool: ...

    def size(self, digest: str) -> int:
        """Its size in bytes; KeyError if unknown."""
        ...

    def delete(self, digest: str) -> bool:
        """Remove the blob (garbage collection: ``server.services.gc``); True if it was there."""
        ...


def _check_digest(digest: str) -> None:
    if not DIGEST_RE.match(digest):
        raise BlobError(f"{digest!r:.80} is not a sha256 digest (64 lowercase hex characters)")


class DirBlobStore:
    """Blobs as ``<root>/<first two hex>/<digest>``; a crash mid-write leaves only a temp file, never a torn blob."""

    def __init__(self, root: str | Path, max_bytes: int = 64 * 1024 * 1024) -> None:
        self.root = Path(root)
        self.max_bytes = max_bytes
        self.root.mkdir(parents=True, exist_ok=True)

    def _path(self, digest: str) -> Path:
        _check_digest(digest)
        return self.root / digest[:2] / digest

    def put(self, digest: str, data: bytes) -> bool:
        path = self._path(digest)
        if len(data) > self.max_bytes:
            raise BlobTooLarge(f"blob of {len(data)} bytes is over the limit of {self.max_bytes} bytes")
        actual = sha256_hex(data)
        if actual != digest:
            raise BlobError(f"content has sha256 {actual}, not {digest}")
        if path.exists():
            return False
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)  # atomic: readers see the whole blob or none
            _fsync_dir(path.parent)  # the rename itself survives a power cut before the update is accepted
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return True

    def get(self, digest: str) -> bytes:
        try:
            return self._path(digest).read_bytes()
        except FileNotFoundError:
            raise KeyError(digest) from None

    def exists(self, digest: str) -> bool:
        return self._path(digest).is_file()

    def size(self, digest: str) -> int:
        try:
            return self._path(digest).stat().st_size
        except FileNotFoundError:
            raise KeyError(digest) from None


    def delete(self, digest: str) -> bool:
        try:
            self._path(digest).unlink()
        except FileNotFoundError:
            return False
        return True


def _fsync_dir(d: Path) -> None:
    try:
        fd = os.open(d, os.O_RDONLY)
    except OSError:
        return  # a platform without directory fds
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
