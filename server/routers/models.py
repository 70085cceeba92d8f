"""The model as an artefact (docs/model.md): a federation's model card for a device profile, and the programs it
lists, for the admin or the federation's devices. A program not exported yet is answered 503 with Retry-After
while it is exported (``server.services.artefacts``)."""

from __future__ import annotations

import re
import threading
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import FileResponse, JSONResponse

from device_profiles import get_profile, list_profiles
from pfl_edge.errors import UnknownNameError
from pfl_edge.federation import device_capacity
from pfl_edge.modelcard import (
    TRAINING_RUNTIMES,
    Layer,
    ModelCard,
    ProgramInfo,
    build_card,
    card_wire,
    describe_layers,
)
from pfl_edge.protocol import API_PREFIX, PROTOCOL_VERSION

from ..db import Device
from ..deps import Coord, FederationReader
from ..errors import NotFound, Unprocessable
from ..fedmodel import FedModel
from ..services import identity
from ..services.artefacts import Artefacts, ProgramKey, ProgramRecord

__all__ = ["artefacts", "creation_keys", "program_keys", "router"]

router = APIRouter(prefix="/federations", tags=["models"])

_FILE = re.compile(r"^[a-z0-9][a-z0-9._-]{0,199}\.(onnx|pte)$")
_CREATE = threading.Lock()
_NOT_READY: dict[int | str, dict[str, Any]] = {
    503: {"description": "a program is being exported: ask again after Retry-After seconds"}}


def artefacts(request: Request) -> Artefacts:
    """The app's program store (``programs_dir``, default ``<data_dir>/programs``), made on first use."""
    state = request.app.state
    with _CREATE:
        got: Artefacts | None = getattr(state, "artefacts", None)
        if got is None:
            st = state.pfl.settings
            got = state.artefacts = Artefacts(st.programs_dir or st.data_dir / "programs")
    return got


ArtefactsDep = Annotated[Artefacts, Depends(artefacts)]

_LAYERS: dict[str, list[Layer]] = {}  # by model id: tracing a large model takes about a second


def _layers(fm: FedModel) -> list[Layer]:
    got = _LAYERS.get(fm.model_id)
    if got is None:
        s = fm.spec
        got = _LAYERS[fm.model_id] = describe_layers(fm.model, (s.in_channels, s.image_size, s.image_size))
    return got


def program_keys(fm: FedModel, *, kp: int, training_backend: str) -> list[ProgramKey]:
    """The programs a device keeping ``kp`` blocks needs: ONNX inference always; the training programs of its
    algorithm when it trains with a program (ExecuTorch or ONNX Runtime: ``training_backend``)."""
    keys = [ProgramKey(fm.spec, "inference")]
    if training_backend in TRAINING_RUNTIMES:
        for mode in fm.algorithm(kp).device_programs():
            keys.append(ProgramKey(fm.spec, "training", mode, kp if mode == "personal" else None,
                                   fm.cfg.batch_size, training_backend))
    return keys


def creation_keys(fm: FedModel, *, profile_capacity: bool, scope: str) -> list[ProgramKey]:
    """What a new federation's devices will ask for, ONNX first (``scope``: the ``export_on_create`` setting):
    the ONNX program, then the training programs of each profile that trains with a program, at the K_P such a
    device is given (its profile's where capacities come from profiles, else the config's). A device that trains
    otherwise than its profile (one without torch: the ONNX program) has its programs exported on its first ask;
    an ONNX training program takes seconds."""
    if scope == "none":
        return []
    keys = [ProgramKey(fm.spec, "inference")]
    if scope == "all":
        for name in list_profiles():
            prof = get_profile(name)
            if prof.training_backend not in TRAINING_RUNTIMES:
                continue
            _, kp = device_capacity(fm.cfg, 0, profile_density=prof.density if profile_capacity else None,
                                    profile_kp=prof.kp if profile_capacity else None)
            if kp > fm.num_blocks:
                continue
            keys += [k for k in program_keys(fm, kp=kp, training_backend=prof.training_backend)[1:] if k not in keys]
    return keys


def _federation_programs(fm: FedModel) -> dict[str, ProgramKey]:
    """Every program a card of this federation can list (any profile, any K_P), by file name."""
    return {k.file: k for kp in range(fm.num_blocks + 1) for runtime in TRAINING_RUNTIMES
            for k in program_keys(fm, kp=kp, training_backend=runtime)}


def _info(fed: str, key: ProgramKey, rec: ProgramRecord) -> ProgramInfo:
    return ProgramInfo(file=rec.file, kind=key.kind, runtime=key.runtime, mode=key.mode,  # type: ignore[arg-type]
                       sha256=rec.sha256, bytes=rec.bytes, url=f"{API_PREFIX}/federations/{fed}/programs/{rec.file}",
                       details=rec.details)


@router.get("/{fed}/model", response_model=ModelCard, responses=_NOT_READY)
def get_model_card(fed: str, reader: FederationReader, coord: Coord, arts: ArtefactsDep,
                   profile: Annotated[str | None, Query(max_length=64)] = None,
                   training_backend: Literal["torch", "executorch", "onnxruntime"] | None = None) -> JSONResponse:
    """The model card for a device of ``profile`` (a device without ``profile``: its own); ``training_backend``
    where the device trains otherwise than its profile says (``executorch``, ``onnxruntime``: the card lists that
    runtime's training programs). A device is answered in its protocol version (``card_wire``); the admin in
    the newest."""
    dev = reader if isinstance(reader, Device) else None
    name = profile or (dev.profile if dev is not None else None)
    if name is None:
        raise Unprocessable("give ?profile=NAME: the card depends on the device profile; valid profiles: "
                            f"{', '.join(list_profiles())}")
    try:
        prof = get_profile(name)
    except UnknownNameError:
        raise Unprocessable(f"unknown device profile {name!r}; valid profiles: {', '.join(list_profiles())}") from None
    with coord.store.read() as s:
        row = coord.store.federation(s, fed)
        fm, by_profile = coord.store.model(row), row.profile_capacity
    if dev is not None and dev.profile == prof.name:
        density, kp = dev.density, dev.kp  # its own: exactly what it was given at enrolment
    else:
        density, kp = device_capacity(fm.cfg, 0, profile_density=prof.density if by_profile else None,
                                      profile_kp=prof.kp if by_profile else None)
    if kp > fm.num_blocks:
        raise Unprocessable(f"profile {prof.name!r} keeps {kp} personal blocks but model {fm.cfg.model!r} has "
                            f"only {fm.num_blocks}")
    keys = program_keys(fm, kp=kp, training_backend=training_backend or prof.training_backend)
    records = arts.ensure(keys)
    card = build_card(federation=fed, cfg=fm.cfg, spec=fm.spec, model=fm.model, profile=prof.name, kp=kp,
                      density=density, base_keys=fm.base_keys(kp),
                      programs=[_info(fed, k, r) for k, r in zip(keys, records, strict=True)],
                      layers=_layers(fm))
    return JSONResponse(card_wire(card, PROTOCOL_VERSION if dev is None else identity.answered_in(dev)))


@router.get("/{fed}/programs/{file}", response_class=FileResponse, responses={
    200: {"content": {"application/octet-stream": {}}}, **_NOT_READY})
def get_program(fed: str, file: str, _reader: FederationReader, coord: Coord, arts: ArtefactsDep) -> FileResponse:
    """A program of the federation's model cards, as raw bytes (its sha256 in the card and the ETag)."""
    with coord.store.read() as s:
        fm = coord.store.model(coord.store.federation(s, fed))
    keys = _federation_programs(fm) if _FILE.match(file) else {}
    if file not in keys:
        raise NotFound(f"federation {fed!r} has no program {file!r:.100}")  # the same for foreign and unknown
    rec = arts.ensure([keys[file]])[0]
    return FileResponse(arts.path(file), media_type="application/octet-stream", headers={"ETag": f'"{rec.sha256}"'})
