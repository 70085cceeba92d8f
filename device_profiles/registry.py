"""Device profiles and fleets: typed, validated, loaded from the TOML files beside this module (or a user's)."""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Literal

from pfl_edge.compat import tomllib
from pfl_edge.errors import ConfigError, UnknownNameError

__all__ = [
    "AVAILABILITY",
    "Emulation",
    "Fleet",
    "FleetMember",
    "Profile",
    "get_fleet",
    "get_profile",
    "list_fleets",
    "list_profiles",
    "load_dir",
    "register_fleet",
    "register_profile",
]

HERE = Path(__file__).parent
AVAILABILITY = ("always", "diurnal")  # how a class comes and goes (edge_runtime.emulation_plan)


@dataclass(frozen=True)
class Emulation:
    """How ``pfl-edge emulate`` holds a device of this class to its resources on a host (docs/emulation.md):
    ``speed`` is one device core's speed as a fraction of ONE core of the host the emulator runs on (the device
    trains with one thread, so at most 1), the CPU quota at no time dilation; the links in kbit/s each way and
    the round trip in ms; ``availability``: always online, or on and off with a diurnal shape."""

    speed: float  # fraction of one host core (cgroup cpu.cfs_quota_us / cpu.cfs_period_us)
    memory_mb: int  # the class's memory for pfl-edge (the emulator adds its runtime's own overhead)
    uplink_kbps: int
    downlink_kbps: int
    rtt_ms: float
    availability: Literal["always", "diurnal"] = "always"

    def check(self, where: str) -> None:
        if isinstance(self.speed, bool) or not isinstance(self.speed, int | float) or not 0 < self.speed <= 1:
            raise ConfigError(f"{where}: emulation.speed must be in (0, 1] (a fraction of one host core: the "
                              f"device trains with one thread), got {self.speed!r}")
        for f in ("memory_mb", "uplink_kbps", "downlink_kbps"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ConfigError(f"{where}: emulation.{f} must be a positive integer, got {v!r}")
        if isinstance(self.rtt_ms, bool) or not isinstance(self.rtt_ms, int | float) or not 0 <= self.rtt_ms <= 10_000:
            raise ConfigError(f"{where}: emulation.rtt_ms must be a number of ms in [0, 10000], got {self.rtt_ms!r}")
        if self.availability not in AVAILABILITY:
            raise ConfigError(f"{where}: emulation.availability must be one of {', '.join(AVAILABILITY)}, got "
                              f"{self.availability!r}")

    @staticmethod
    def from_dict(d: Any, where: str) -> Emulation:
        if not isinstance(d, dict):
            raise ConfigError(f"{where}: [emulation] must be a table, got {d!r}")
        known = {f.name for f in fields(Emulation)}
        missing, unknown = known - set(d) - {"availability"}, set(d) - known
        if missing or unknown:
            raise ConfigError(f"{where}: [emulation] is missing {sorted(missing)}, has unknown {sorted(unknown)} "
                              f"(its fields: {', '.join(sorted(known))})")
        return Emulation(**d)


@dataclass(frozen=True)
class Profile:
    """What a device class can afford. The model is the federation's, not the profile's: ``check`` says
    whether a given model fits."""

    name: str
    description: str
    device_class: str
    architecture: str
    soc: str
    ram_mb: int  # the device's memory
    ram_budget_mb: int  # what pfl-edge may use on it
    cores: int
    threads: int  # torch / runtime threads
    inference_runtime: Literal["onnxruntime", "executorch"]
    training_backend: Literal["torch", "executorch", "onnxruntime"]  # the last two: a program from the model card
    density: float  # 1 - sparsity (DisPFL capacity)
    kp: int  # FedPer personal blocks
    batch_size: int
    train_memory_mb: int  # ceiling for one training step: weights, gradients, optimizer state, activations
    emulation: Emulation | None = None  # what pfl-edge emulate holds it to; None: a class it cannot emulate

    def __post_init__(self) -> None:
        where = f"profile {self.name!r}"
        for f in ("ram_mb", "ram_budget_mb", "cores", "threads", "batch_size", "train_memory_mb"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ConfigError(f"{where}: {f} must be a positive integer, got {v!r}")
        if self.emulation is not None:  # after ram_mb is known to be a number: it bounds the emulated memory
            if not isinstance(self.emulation, Emulation):
                raise ConfigError(f"{where}: emulation must be an Emulation, got {self.emulation!r}")
            self.emulation.check(where)
            if self.emulation.memory_mb > self.ram_mb:
                raise ConfigError(f"{where}: emulation.memory_mb ({self.emulation.memory_mb}) exceeds ram_mb "
                                  f"({self.ram_mb})")
        if not isinstance(self.kp, int) or self.kp < 0:
            raise ConfigError(f"{where}: kp must be an integer >= 0, got {self.kp!r}")
        if not isinstance(self.density, int | float) or not 0 < self.density <= 1:
            raise ConfigError(f"{where}: density must be in (0, 1], got {self.density!r}")
        if self.inference_runtime not in ("onnxruntime", "executorch"):
            raise ConfigError(f"{where}: inference_runtime must be onnxruntime or executorch, "
                              f"got {self.inference_runtime!r}")
        if self.training_backend not in ("torch", "executorch", "onnxruntime"):
            raise ConfigError(f"{where}: training_backend must be torch, executorch or onnxruntime, got "
                              f"{self.training_backend!r}")
        if self.threads > self.cores:
            raise ConfigError(f"{where}: threads ({self.threads}) exceed cores ({self.cores})")
        if self.ram_budget_mb > self.ram_mb or self.train_memory_mb > self.ram_budget_mb:
            raise ConfigError(f"{where}: needs train_memory_mb <= ram_budget_mb <= ram_mb")

    @staticmethod
    def from_dict(d: dict[str, Any], source: str = "") -> Profile:
        known = {f.name for f in fields(Profile)}
        missing, unknown = known - set(d) - {"emulation"}, set(d) - known
        if missing or unknown:
            raise ConfigError(f"{source or 'profile'}: missing fields {sorted(missing)}, unknown {sorted(unknown)}")
        if "emulation" in d:
            d = {**d, "emulation": Emulation.from_dict(d["emulation"], source or f"profile {d.get('name')!r}")}
        return Profile(**d)


@dataclass(frozen=True)
class FleetMember:
    profile: str
    weight: int


@dataclass(frozen=True)
class Fleet:
    """A named mix of profiles. Devices are dealt cyclically: the member list expanded by weight, repeated."""

    name: str
    description: str
    members: tuple[FleetMember, ...]

    def __post_init__(self) -> None:
        if not self.members:
            raise ConfigError(f"fleet {self.name!r} has no members")
        for m in self.members:
            if not isinstance(m.weight, int) or m.weight < 1:
                raise ConfigError(f"fleet {self.name!r}: weight of {m.profile!r} must be a positive integer")

    @property
    def cycle(self) -> tuple[str, ...]:
        return tuple(m.profile for m in self.members for _ in range(m.weight))

    def assign(self, num_devices: int) -> list[Profile]:
        """The profile of devices 0..num_devices-1."""
        cycle = [get_profile(p) for p in self.cycle]
        return [cycle[i % len(cycle)] for i in range(num_devices)]

    def densities(self) -> tuple[float, ...]:
        """Densities in dealing order, to be cycled over clients (the simulator's ``densities``)."""
        return tuple(float(get_profile(p).density) for p in self.cycle)


_PROFILES: dict[str, Profile] = {}
_FLEETS: dict[str, Fleet] = {}


def register_profile(profile: Profile) -> Profile:
    if profile.name in _PROFILES and _PROFILES[profile.name] != profile:
        raise ConfigError(f"profile {profile.name!r} is already registered with other values")
    _PROFILES[profile.name] = profile
    return profile


def register_fleet(fleet: Fleet) -> Fleet:
    for m in fleet.members:
        get_profile(m.profile)  # every member must name a known profile
    if fleet.name in _FLEETS and _FLEETS[fleet.name] != fleet:
        raise ConfigError(f"fleet {fleet.name!r} is already registered with other values")
    _FLEETS[fleet.name] = fleet
    return fleet


def _read(path: Path) -> dict[str, Any]:
    try:
        return tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise ConfigError(f"cannot read {path}: {e}") from e


def load_dir(folder: str | Path) -> None:
    """Register every ``profiles/*.toml`` and ``fleets/*.toml`` under ``folder`` (a user's own classes)."""
    root = Path(folder)
    for p in sorted((root / "profiles").glob("*.toml")):
        register_profile(Profile.from_dict(_read(p), str(p)))
    for p in sorted((root / "fleets").glob("*.toml")):
        d = _read(p)
        raw = d.get("members")
        if not isinstance(d.get("name"), str) or not isinstance(raw, list) or not all(
                isinstance(m, dict) and isinstance(m.get("profile"), str) for m in raw):
            raise ConfigError(f"{p}: a fleet needs a name and [[members]], each with a profile (and a weight)")
        members = tuple(FleetMember(m["profile"], m.get("weight", 1)) for m in raw)
        register_fleet(Fleet(d["name"], str(d.get("description", "")), members))


def list_profiles() -> list[str]:
    return sorted(_PROFILES)


def list_fleets() -> list[str]:
    return sorted(_FLEETS)


def get_profile(name: str) -> Profile:
    try:
        return _PROFILES[name]
    except KeyError:
        raise UnknownNameError("profile", name, list_profiles()) from None


def get_fleet(name: str) -> Fleet:
    try:
        return _FLEETS[name]
    except KeyError:
        raise UnknownNameError("fleet", name, list_fleets()) from None


load_dir(HERE)
