"""The programs a device runs, from its server: the model card (``GET /v1/federations/{fed}/model``) says which
programs there are, their sizes and sha256; each is downloaded once into the state dir and checked against the
card before use (docs/model.md). A device exports nothing itself."""

from __future__ import annotations

import hashlib
import logging
import re
from pathlib import Path
from typing import Any
from urllib.parse import quote

from pfl_edge.errors import ConfigError
from pfl_edge.modelcard import ModelCard, ProgramInfo
from pfl_edge.protocol import API_PREFIX

from .http import Http
from .state import atomic_write

__all__ = ["MAX_CARD_BYTES", "ProgramSource", "fetch_card"]

log = logging.getLogger("pfl_edge.client")

MAX_CARD_BYTES = 16 * 1024 * 1024  # a card lists every layer and tensor: far under this for the built-in models
_FILE = re.compile(r"^[a-z0-9][a-z0-9._-]{0,199}\.(onnx|pte)$")
_SHA = re.compile(r"^[0-9a-f]{64}$")


def fetch_card(http: Http, federation: str, *, training_backend: str | None = None) -> ModelCard:
    """This device's model card (its own profile and K_P; ``training_backend`` where it overrides the profile's).
    The server answers 503 while it exports the programs; ``Http`` retries 5xx answers within its patience."""
    params = f"?training_backend={training_backend}" if training_backend else ""
    r = http.call("GET", f"{API_PREFIX}/federations/{quote(federation, safe='')}/model{params}",
                  max_bytes=MAX_CARD_BYTES)
    try:
        return ModelCard.model_validate_json(r.content)
    except ValueError as e:
        raise ConfigError(f"the server's model card is not a valid card: {e}") from None


class ProgramSource:
    """The training programs of this device's card, downloaded into ``folder`` and checked."""

    def __init__(self, http: Http, federation: str, folder: Path, *, model_id: str, max_bytes: int,
                 training_backend: str | None = None) -> None:
        self.http, self.federation, self.folder = http, federation, folder
        self.model_id, self.max_bytes, self.training_backend = model_id, max_bytes, training_backend
        self._card: ModelCard | None = None

    @property
    def card(self) -> ModelCard:
        if self._card is None:
            card = fetch_card(self.http, self.federation, training_backend=self.training_backend)
            if card.model_id != self.model_id:
                # not a transient fault: retrying (or restarting) cannot make another model this device's
                raise ConfigError(f"the server's model card is for model {card.model_id!r}, but this device trains "
                                  f"{self.model_id!r} (its federation's config); refusing its programs")
            self._card = card
        return self._card

    def training(self, mode: str, runtime: str = "executorch") -> tuple[bytes, dict[str, Any]]:
        """The training program of ``mode`` for ``runtime`` (``executorch`` or ``onnxruntime``) and its details
        (the backend's manifest entry)."""
        info = next((p for p in self.card.programs if p.kind == "training" and p.runtime == runtime
                     and p.mode == mode), None)
        if info is None:
            have = [f"{p.kind}/{p.runtime}/{p.mode}" for p in self.card.programs]
            raise ConfigError(f"the server's model card lists no {runtime} training program of mode {mode!r} "
                              f"(it lists {have}); is the federation's algorithm {self.card.algorithm!r} this "
                              "device's?")
        return self.fetch(info), dict(info.details)

    def inference(self) -> tuple[bytes, dict[str, Any]]:
        """The ONNX inference program (weights as inputs) and its details: how a device without torch evaluates."""
        info = next((p for p in self.card.programs if p.kind == "inference" and p.runtime == "onnxruntime"), None)
        if info is None:
            raise ConfigError("the server's model card lists no ONNX inference program")
        return self.fetch(info), dict(info.details)

    def fetch(self, info: ProgramInfo) -> bytes:
        """The program's bytes: the copy in ``folder`` if it matches the card, else downloaded, checked, kept."""
        if not _FILE.match(info.file) or not _SHA.match(info.sha256) or not 0 < info.bytes <= self.max_bytes:
            raise ConfigError(f"the card's program {info.file!r:.100} ({info.bytes} bytes, sha256 "
                              f"{info.sha256!r:.70}) is out of bounds (a plain file name, at most {self.max_bytes} "
                              "bytes)")
        path = self.folder / info.file
        if path.is_file() and path.stat().st_size == info.bytes:
            data = path.read_bytes()
            if hashlib.sha256(data).hexdigest() == info.sha256:
                return data
        # the URL is built here, never taken from the card: the bearer token goes to this server's path only
        r = self.http.call("GET", f"{API_PREFIX}/federations/{quote(self.federation, safe='')}/programs/{info.file}",
                           max_bytes=info.bytes)
        data = r.content
        got = hashlib.sha256(data).hexdigest()
        if len(data) != info.bytes or got != info.sha256:
            raise ConfigError(f"program {info.file}: downloaded {len(data)} bytes with sha256 {got}; the card says "
                              f"{info.bytes} bytes, {info.sha256}")
        self.folder.mkdir(parents=True, exist_ok=True)
        atomic_write(path, data)
        log.info("downloaded program %s (%d bytes)", info.file, len(data))
        return data
