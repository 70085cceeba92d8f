"""What ``pfl-edge emulate`` holds each device to, worked out before anything touches the kernel: the CPU quota
from the class's speed (a fraction of one core of this host) under one time dilation for the whole fleet, the
memory limit, each link's ``tc tbf`` settings, the one-way delay the relay adds, and each device's seeded
availability trace (on/off periods with a diurnal shape). Pure functions: tested without root
(tests/edge_runtime/test_emulation_plan.py); edge_runtime/emulator.py applies the plan (docs/emulation.md)."""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass
from typing import Any

from device_profiles import Emulation, Profile
from pfl_edge.errors import ConfigError
from pfl_edge.seeding import numpy_rng

__all__ = ["AVAILABILITY_STREAM", "DIURNAL", "DevicePlan", "EmulationConfig", "FleetPlan", "availability_trace",
           "diurnal_probability", "online_at", "plan_fleet", "tbf_args"]

AVAILABILITY_STREAM = "emulation-availability"  # the run seed's stream of device i's trace (pfl_edge.seeding)
MIN_QUOTA_US = 1000  # the kernel refuses a smaller cpu.cfs_quota_us
# the share of devices online over a day: lowest in the afternoon, highest at night, when phones are idle, charging
# and on Wi-Fi (Bonawitz et al., "Towards Federated Learning at Scale", MLSys 2019: devices train only then)
DIURNAL = {"floor": 0.2, "peak": 0.9, "peak_hour": 2.0}


@dataclass(frozen=True)
class EmulationConfig:
    """The emulator's own settings (pfl-edge emulate's flags); what each class gets is in its profile."""

    dilation: float | None = None  # wall seconds per device second; None: the least that fits cpu_budget
    cpu_budget: float | None = None  # host cores the devices' quotas may add up to; None: 60 % of this host's
    period_us: int = 100_000  # cpu.cfs_period_us, the kernel's default (longer where a quota would be under 1 ms)
    runtime_overhead_mb: int = 512  # what CPython and torch take that the device's own runtime does not
    availability: str = "profile"  # profile: each class's [emulation] availability; always: every device online
    day_s: float = 1200.0  # seconds one emulated day lasts undilated (x dilation on the wall clock)
    start_hour: float = 20.0  # the local hour the run starts at
    mean_session_h: float = 2.0  # mean online period, in emulated hours
    min_period_s: float = 5.0  # no on or off period shorter than this many wall seconds
    horizon_s: float = 3600.0  # how far the trace is drawn (the run's timeout)

    def __post_init__(self) -> None:
        if self.dilation is not None and not self.dilation >= 1:
            raise ConfigError(f"--dilation must be >= 1 (wall seconds per device second), got {self.dilation}")
        if self.cpu_budget is not None and not self.cpu_budget > 0:
            raise ConfigError(f"--cpu-budget must be > 0 cores, got {self.cpu_budget}")
        if not 1000 <= self.period_us <= 1_000_000:
            raise ConfigError(f"--cpu-period-us must be in [1000, 1000000], got {self.period_us}")
        if self.availability not in ("profile", "always"):
            raise ConfigError(f"--availability must be profile or always, got {self.availability!r}")
        if self.day_s <= 0 or self.mean_session_h <= 0 or self.horizon_s <= 0 or self.min_period_s < 0:
            raise ConfigError("--day-s, the mean session and the horizon must be > 0")
        if not 0 <= self.start_hour < 24:
            raise ConfigError(f"--start-hour must be in [0, 24), got {self.start_hour}")
        if self.runtime_overhead_mb < 0:
            raise ConfigError(f"--runtime-overhead-mb must be >= 0, got {self.runtime_overhead_mb}")


@dataclass(frozen=True)
class DevicePlan:
    """One device's limits, in the host's terms (after dilation)."""

    index: int
    profile: str
    cpu_fraction: float  # of one host core: the class's speed / dilation
    period_us: int
    quota_us: int
    memory_bytes: int
    uplink_kbit: int  # tc tbf rate of the device's side of its link (what it sends)
    downlink_kbit: int  # tc tbf rate of the host's side (what it receives)
    delay_s: float  # one way, each direction (the relay's; half the round trip, dilated)
    availability: str  # always | diurnal


@dataclass(frozen=True)
class FleetPlan:
    dilation: float
    host_cores: int
    devices: tuple[DevicePlan, ...]

    def as_json(self, cfg: EmulationConfig) -> dict[str, Any]:
        return {"dilation": self.dilation, "host_cores": self.host_cores, "settings": asdict(cfg),
                "cpu_quota_sum": sum(d.cpu_fraction for d in self.devices),
                "devices": [asdict(d) for d in self.devices]}


def _emulation(p: Profile) -> Emulation:
    if p.emulation is None:
        raise ConfigError(f"profile {p.name!r} has no [emulation] table: pfl-edge emulate needs its speed, memory, "
                          "links and round trip (docs/emulation.md)")
    return p.emulation


def plan_fleet(profiles: list[Profile], cfg: EmulationConfig, host_cores: int | None = None) -> FleetPlan:
    """Each device's limits. One dilation D for the whole fleet keeps every ratio the profiles give: quotas are
    speed / D, link rates / D, round trips x D, so that the quotas add up to at most ``cpu_budget`` cores (a
    quota is a ceiling, not a reservation: beyond the host's cores the classes would no longer differ)."""
    cores = host_cores or os.cpu_count() or 1
    ems = [_emulation(p) for p in profiles]
    budget = cfg.cpu_budget if cfg.cpu_budget is not None else 0.6 * cores
    dilation = cfg.dilation if cfg.dilation is not None else max(1.0, sum(e.speed for e in ems) / budget)
    out = []
    for i, (p, e) in enumerate(zip(profiles, ems, strict=True)):
        frac = e.speed / dilation
        period = max(cfg.period_us, math.ceil(MIN_QUOTA_US / frac))
        if period > 1_000_000:
            raise ConfigError(f"device {i} ({p.name}) would get {frac:.5f} of a core, under the kernel's 1 ms a "
                              "second: use a smaller --dilation or fewer devices")
        avail = "always" if cfg.availability == "always" else e.availability
        out.append(DevicePlan(
            index=i, profile=p.name, cpu_fraction=frac, period_us=period,
            quota_us=max(MIN_QUOTA_US, round(frac * period)),
            memory_bytes=(e.memory_mb + cfg.runtime_overhead_mb) * 1024 * 1024,
            uplink_kbit=max(8, round(e.uplink_kbps / dilation)),
            downlink_kbit=max(8, round(e.downlink_kbps / dilation)),
            delay_s=e.rtt_ms / 2 / 1000 * dilation, availability=avail))
    return FleetPlan(dilation, cores, tuple(out))


def tbf_args(rate_kbit: int) -> list[str]:
    """``tc qdisc add ... root tbf`` arguments for a link of ``rate_kbit``: a bucket of 10 ms of the rate (at least
    32 KiB, so one timer tick at any HZ >= 100 refills it and a 64 KiB TSO segment is split, not dropped) and at
    most 200 ms of queue before drops (a mobile link's buffers hold that much, and more)."""
    burst = max(32 * 1024, rate_kbit * 1000 // 8 // 100)
    return ["rate", f"{rate_kbit}kbit", "burst", str(burst), "latency", "200ms"]


def diurnal_probability(hour: float) -> float:
    """The share of a diurnal class online at local ``hour``: a cosine from DIURNAL's floor (14 h after the peak)
    to its peak."""
    floor, peak, at = DIURNAL["floor"], DIURNAL["peak"], DIURNAL["peak_hour"]
    return floor + (peak - floor) * (1 + math.cos(2 * math.pi * (hour - at) / 24)) / 2


def availability_trace(seed: int, index: int, kind: str, cfg: EmulationConfig,
                       dilation: float = 1.0) -> list[tuple[float, float]]:
    """Device ``index``'s online periods in wall seconds from the run's start, ``[start, end)``, sorted. Every
    device is online at 0 (the fleet enrols as it is deployed); after that a diurnal device is a two-state process
    whose rates follow the hour: it leaves at rate ``1 / mean_session_h`` and returns at rate ``p / (1 - p)`` times
    that, ``p = diurnal_probability(hour)``, so that the share online tracks ``p`` (within about one session's
    lag), stepped every 5 emulated minutes; no period is shorter than ``min_period_s``. A day lasts ``day_s x
    dilation`` wall seconds: the fleet's days slow down with its computing and its links. Drawn from the run seed's
    own stream for the device (``numpy_rng(seed, AVAILABILITY_STREAM, index)``): the same seed, the same trace."""
    if kind == "always":
        return [(0.0, cfg.horizon_s)]
    if kind != "diurnal":
        raise ConfigError(f"unknown availability {kind!r}: always or diurnal")
    hour_s = cfg.day_s * dilation / 24
    dt_h = 1 / 12
    steps = math.ceil(cfg.horizon_s / (hour_s * dt_h))
    draws = numpy_rng(seed, AVAILABILITY_STREAM, index).random(steps)
    online, since, out = True, 0.0, []
    for k in range(1, steps):
        t = k * dt_h * hour_s
        if t - since < cfg.min_period_s:
            continue
        p = diurnal_probability((cfg.start_hour + t / hour_s) % 24)
        rate = 1 / cfg.mean_session_h if online else p / (1 - p) / cfg.mean_session_h
        if draws[k] < 1 - math.exp(-rate * dt_h):
            if online:
                out.append((since, t))
            online, since = not online, t
    if online:
        out.append((since, cfg.horizon_s))
    return out


def online_at(periods: list[tuple[float, float]], t: float) -> bool:
    return any(a <= t < b for a, b in periods)
