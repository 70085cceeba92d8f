"""Report inputs, read and checked: a demo run folder (``pfl-edge demo``), a simulator result
(``pfl-edge simulate --out``), or what a live server answered (``/v1/federations/{fed}``, ``/metrics``,
``/devices``). Every input becomes one :class:`Run`; nothing here trusts a field's type or size."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..algorithms import algorithm_class, list_algorithms
from ..errors import ConfigError, DataError

__all__ = [
    "MAX_INPUT_BYTES",
    "DeviceInfo",
    "DeviceRound",
    "RoundRecord",
    "Run",
    "from_server",
    "from_simulation",
    "load_runs",
    "parse_json",
    "read_json",
]

#: the largest JSON file (or HTTP body) a report reads: a month of rounds of a 10 000-device fleet fits
MAX_INPUT_BYTES = 256 * 2**20
_SERVER_QUORUM = 1.0  # FederationCreate's default: what a demo federation (which sets none) closes its rounds at


@dataclass(frozen=True)
class DeviceInfo:
    """One device (or simulated client) as the server lists it."""

    device_id: str
    name: str
    profile: str  # the device class; "unknown" when the listing lacks the device
    density: float | None = None
    kp: int | None = None
    server_bytes_up: int | None = None  # the server's own count of the device's uploads (demo and live only)
    server_bytes_down: int | None = None


@dataclass(frozen=True)
class DeviceRound:
    """What one device reported of one round: its deployed model's test accuracy and its traffic."""

    accuracy: float | None
    loss: float | None
    bytes_up: int
    bytes_down: int
    step_ms: float | None = None
    train_s: float | None = None


@dataclass(frozen=True)
class RoundRecord:
    round: int
    state: str | None  # None: a round the server holds metrics of but no round row (or a simulator round)
    updates: int | None  # updates the server accepted
    active: int | None  # devices given a task
    wall_s: float | None  # opened to closed; None while open
    devices: Mapping[str, DeviceRound] = field(default_factory=dict)


@dataclass(frozen=True)
class Run:
    source: str  # "demo" | "simulation" | "live"
    name: str
    algorithm: str | None
    quorum: float | None  # fraction of a round's devices that closes it early; None: unknown
    rounds_planned: int | None
    state: str | None  # the federation's current state (demo: finished or not)
    devices: tuple[DeviceInfo, ...]
    rounds: tuple[RoundRecord, ...]
    config: Mapping[str, Any] = field(default_factory=dict)


def parse_json(data: bytes, what: str, *, limit: int = MAX_INPUT_BYTES) -> Any:
    """``data`` as JSON, refused (DataError) past ``limit`` bytes or when malformed or nested absurdly deep."""
    if len(data) > limit:
        raise DataError(f"{what} is over {limit} bytes ({limit // 2**20} MB), the limit of a report input")
    try:
        return json.loads(data)
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
        raise DataError(f"{what} is not valid JSON: {e}") from None


def read_json(path: Path, *, limit: int = MAX_INPUT_BYTES) -> Any:
    """A JSON file of at most ``limit`` bytes; the size is checked before reading a byte of it."""
    try:
        size = path.stat().st_size
        if size > limit:
            raise DataError(f"{path} is {size} bytes, over the {limit} byte ({limit // 2**20} MB) limit of a "
                            "report input")
        with path.open("rb") as f:
            data = f.read(limit + 1)  # a file that grows while read is still bounded
    except FileNotFoundError:
        raise DataError(f"{path}: no such file") from None
    except OSError as e:
        raise DataError(f"cannot read {path}: {e.strerror or e}") from None
    return parse_json(data, str(path), limit=limit)


def load_runs(path: Path) -> list[Run]:
    """Every run ``path`` holds: a demo (or saved live) folder is one; a simulator result file is one; a folder of
    simulator results (``pfl-edge demo --simulate``) is one per ``*.json`` result in it, in name order."""
    if not path.exists():
        raise ConfigError(f"{path}: no such file or folder")
    if path.is_file():
        return [from_simulation(_obj(read_json(path), str(path)), name=path.stem)]
    if (path / "metrics.json").is_file():
        return [_load_server_folder(path)]
    results = []
    for p in sorted(path.glob("*.json")):
        doc = read_json(p)
        if _is_simulation(doc):
            results.append(from_simulation(doc, name=p.stem))
    if not results:
        raise ConfigError(f"{path} holds no run: neither metrics.json (pfl-edge demo, or a saved live report) nor "
                          "a simulator result (*.json with config and rounds)")
    return results


def _load_server_folder(path: Path) -> Run:
    metrics = read_json(path / "metrics.json")
    devices = read_json(path / "devices.json") if (path / "devices.json").is_file() else []
    if (path / "federation.json").is_file():  # written by a live report
        return from_server(read_json(path / "federation.json"), metrics, devices, source="live")
    summary = read_json(path / "summary.json") if (path / "summary.json").is_file() else {}
    cfg = _obj(summary, f"{path / 'summary.json'}").get("config", {})
    cfg = cfg if isinstance(cfg, dict) else {}
    info = {"id": path.name, "config": cfg, "quorum": _SERVER_QUORUM,
            "state": "finished" if summary.get("finished") else None}
    return from_server(info, metrics, devices, source="demo")


def _is_simulation(doc: Any) -> bool:
    return (isinstance(doc, dict) and isinstance(doc.get("config"), dict) and isinstance(doc.get("rounds"), list)
            and all(isinstance(r, dict) and "client_acc" in r for r in doc["rounds"]))


def _obj(x: Any, where: str) -> dict[str, Any]:
    if not isinstance(x, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(x).__name__}")
    return x


def _list(x: Any, where: str) -> list[Any]:
    if not isinstance(x, list):
        raise DataError(f"{where}: expected a JSON list, got {type(x).__name__}")
    return x


def _num(x: Any, where: str, *, optional: bool = True) -> float | None:
    if x is None and optional:
        return None
    if isinstance(x, bool) or not isinstance(x, int | float) or not math.isfinite(x):
        raise DataError(f"{where}: expected a finite number, got {x!r:.40}")
    return float(x)


def _keeps_blocks(name: Any) -> bool:
    """Does the run's algorithm keep the config's K_P blocks personal (FedPer and its -FT)? False for a name
    this version does not know (a result written by another)."""
    return isinstance(name, str) and name in list_algorithms() and algorithm_class(name).keeps_config_kp()


def _int(x: Any, where: str, *, optional: bool = True) -> int | None:
    if x is None and optional:
        return None
    if isinstance(x, bool) or not isinstance(x, int) or x < 0:
        raise DataError(f"{where}: expected a non-negative integer, got {x!r:.40}")
    return x


def _str(x: Any, where: str, default: str = "") -> str:
    if x is None:
        return default
    if not isinstance(x, str):
        raise DataError(f"{where}: expected a string, got {type(x).__name__}")
    return x[:200]  # a label for tables; no longer than any the server accepts


def _device_round(m: Any, where: str) -> DeviceRound:
    m = _obj(m, where)
    return DeviceRound(accuracy=_num(m.get("accuracy"), f"{where}.accuracy"),
                       loss=_num(m.get("loss"), f"{where}.loss"),
                       bytes_up=_int(m.get("bytes_up", 0), f"{where}.bytes_up", optional=False) or 0,
                       bytes_down=_int(m.get("bytes_down", 0), f"{where}.bytes_down", optional=False) or 0,
                       step_ms=_num(m.get("step_ms"), f"{where}.step_ms"),
                       train_s=_num(m.get("train_s"), f"{where}.train_s"))


def _server_round(r: Any, where: str) -> RoundRecord:
    r = _obj(r, where)
    devs = _obj(r.get("devices", {}), f"{where}.devices")
    return RoundRecord(round=_int(r.get("round"), f"{where}.round", optional=False) or 0,
                       state=_str(r.get("state"), f"{where}.state") or None,
                       updates=_int(r.get("updates"), f"{where}.updates"),
                       active=_int(r.get("active"), f"{where}.active"),
                       wall_s=_num(r.get("wall_s"), f"{where}.wall_s"),
                       devices={_str(k, where): _device_round(v, f"{where}.devices[{k[:40]!r}]")
                                for k, v in devs.items()})


def _server_device(d: Any, where: str) -> DeviceInfo:
    d = _obj(d, where)
    dev_id = _str(d.get("device_id"), f"{where}.device_id")
    if not dev_id:
        raise DataError(f"{where}: a device without a device_id")
    return DeviceInfo(device_id=dev_id, name=_str(d.get("name"), f"{where}.name") or dev_id,
                      profile=_str(d.get("profile"), f"{where}.profile", "unknown"),
                      density=_num(d.get("density"), f"{where}.density"), kp=_int(d.get("kp"), f"{where}.kp"),
                      server_bytes_up=_int(d.get("bytes_up"), f"{where}.bytes_up"),
                      server_bytes_down=_int(d.get("bytes_down"), f"{where}.bytes_down"))


def from_server(info: Any, metrics: Any, devices: Any, *, source: str) -> Run:
    """A run from the server's three answers: the federation (``id``, ``config``, ``quorum``, ``state``), its
    metrics (``{"rounds": [...]}``) and its device listing. Devices that reported metrics but are not listed
    (revoked since, or a listing cut short) are kept, with profile "unknown"."""
    info = _obj(info, "federation")
    metrics = _obj(metrics, "metrics")
    rounds = tuple(sorted((_server_round(r, f"metrics.rounds[{i}]")
                           for i, r in enumerate(_list(metrics.get("rounds", []), "metrics.rounds"))),
                          key=lambda r: r.round))
    listed = [_server_device(d, f"devices[{i}]") for i, d in enumerate(_list(devices, "devices"))]
    known = {d.device_id for d in listed}
    extra = sorted({dev for r in rounds for dev in r.devices} - known)
    cfg = _obj(info.get("config", {}), "federation.config")
    return Run(source=source, name=_str(info.get("id") or metrics.get("federation"), "federation.id", "federation"),
               algorithm=_str(cfg.get("algorithm"), "config.algorithm") or None,
               quorum=_num(info.get("quorum"), "federation.quorum"),
               rounds_planned=_int(cfg.get("rounds"), "config.rounds"),
               state=_str(info.get("state"), "federation.state") or None,
               devices=(*listed, *(DeviceInfo(d, d, "unknown") for d in extra)), rounds=rounds, config=cfg)


def from_simulation(result: Any, *, name: str = "simulation") -> Run:
    """A run from a simulator result: client ``i`` is a device; its class is its density (DisPFL's capacity) when
    the clients' densities differ, else one class "client". Every sampled client reports, so no round is short."""
    res = _obj(result, name)
    cfg = _obj(res.get("config"), f"{name}.config")
    rounds_in = _list(res.get("rounds"), f"{name}.rounds")
    kp = _int(cfg.get("kp"), "config.kp") if _keeps_blocks(cfg.get("algorithm")) else None
    rounds, densities = [], {}
    for i, r in enumerate(rounds_in):
        where = f"{name}.rounds[{i}]"
        r = _obj(r, where)
        cols = {k: _list(r.get(k, []), f"{where}.{k}") for k in
                ("client_acc", "client_loss", "client_bytes_up", "client_bytes_down", "client_density")}
        parts = _list(r.get("participants", list(range(len(cols["client_acc"])))), f"{where}.participants")
        devs = {}
        for c, acc in enumerate(cols["client_acc"]):
            dev = f"client-{c:03d}"
            devs[dev] = DeviceRound(accuracy=_num(acc, f"{where}.client_acc[{c}]"),
                                    loss=_num(_at(cols["client_loss"], c), f"{where}.client_loss[{c}]"),
                                    bytes_up=_int(_at(cols["client_bytes_up"], c, 0), f"{where}.client_bytes_up")
                                    or 0,
                                    bytes_down=_int(_at(cols["client_bytes_down"], c, 0),
                                                    f"{where}.client_bytes_down") or 0)
            dens = _num(_at(cols["client_density"], c), f"{where}.client_density[{c}]")
            if dens is not None:
                densities[dev] = round(dens, 3)  # the mask's density, a hair off the asked one
        rounds.append(RoundRecord(round=_int(r.get("round"), f"{where}.round", optional=False) or 0,
                                  state="published", updates=len(parts), active=len(parts),
                                  wall_s=_num(r.get("wall_s"), f"{where}.wall_s"), devices=devs))
    ids = sorted({d for r in rounds for d in r.devices})
    classes = len(set(densities.values())) > 1
    devices = tuple(DeviceInfo(d, d, f"density {densities[d]:.2f}" if classes and d in densities else "client",
                               densities.get(d), kp) for d in ids)
    return Run(source="simulation", name=name, algorithm=_str(cfg.get("algorithm"), "config.algorithm") or None,
               quorum=1.0, rounds_planned=_int(cfg.get("rounds"), "config.rounds"), state="finished",
               devices=devices, rounds=tuple(rounds), config=cfg)


def _at(xs: list[Any], i: int, default: Any = None) -> Any:
    return xs[i] if i < len(xs) else default
