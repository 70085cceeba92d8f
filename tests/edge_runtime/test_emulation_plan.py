"""The emulator's plan without root (edge_runtime.emulation_plan): quotas, rates and delays follow the profiles'
[emulation] figures under one dilation, and the availability traces are seeded and diurnal; the relay adds its
delay both ways; the kernel check names what is missing; the command line parses."""

from __future__ import annotations

import dataclasses
import itertools
import socket
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from device_profiles import Emulation, Fleet, FleetMember, Profile, get_fleet, get_profile
from edge_runtime import emulator_kernel
from edge_runtime.delay_relay import DelayRelay, Route
from edge_runtime.emulation_plan import (
    DIURNAL,
    EmulationConfig,
    availability_trace,
    diurnal_probability,
    online_at,
    plan_fleet,
    tbf_args,
)
from pfl_edge.cli.parser import build_parser
from pfl_edge.errors import ConfigError, PflEdgeError


def test_quotas_follow_the_profiles_speeds_under_one_dilation() -> None:
    profiles = get_fleet("mixed").assign(24)
    plan = plan_fleet(profiles, EmulationConfig(cpu_budget=1.2), host_cores=2)
    speeds = [p.emulation.speed for p in profiles if p.emulation is not None]
    assert plan.dilation == pytest.approx(sum(speeds) / 1.2)
    assert sum(d.cpu_fraction for d in plan.devices) == pytest.approx(1.2)
    for d, p in zip(plan.devices, profiles, strict=True):
        e = p.emulation
        assert e is not None
        assert d.cpu_fraction == pytest.approx(e.speed / plan.dilation)
        assert d.quota_us / d.period_us == pytest.approx(d.cpu_fraction, rel=1e-3)
        assert d.quota_us >= 1000  # the kernel's smallest quota
        assert d.uplink_kbit == max(8, round(e.uplink_kbps / plan.dilation))
        assert d.downlink_kbit == max(8, round(e.downlink_kbps / plan.dilation))
        assert d.delay_s == pytest.approx(e.rtt_ms / 2000 * plan.dilation)
        assert d.memory_bytes == (e.memory_mb + 512) * 2**20
    # two classes keep their ratio whatever the dilation
    pi4, mid = get_profile("raspberry-pi-4"), get_profile("phone-mid")
    for dilation in (1.0, 3.0, 7.5):
        a, b = plan_fleet([pi4, mid], EmulationConfig(dilation=dilation)).devices
        assert b.cpu_fraction / a.cpu_fraction == pytest.approx(0.92 / 0.43)


def test_a_small_fleet_runs_undilated_and_a_tiny_quota_lengthens_its_period() -> None:
    plan = plan_fleet([get_profile("phone-low")], EmulationConfig(), host_cores=2)
    assert plan.dilation == 1.0 and plan.devices[0].cpu_fraction == pytest.approx(0.42)
    tiny = plan_fleet([get_profile("phone-low")], EmulationConfig(dilation=300.0)).devices[0]
    assert tiny.quota_us == 1000 and tiny.period_us == pytest.approx(1000 / (0.42 / 300), abs=1)
    with pytest.raises(ConfigError, match="1 ms a second"):
        plan_fleet([get_profile("phone-low")], EmulationConfig(dilation=1000.0))


def test_a_profile_without_an_emulation_table_is_refused_by_name() -> None:
    bare = Profile(name="bare-board", description="", device_class="board", architecture="aarch64", soc="s",
                   ram_mb=1024, ram_budget_mb=512, cores=4, threads=2, inference_runtime="onnxruntime",
                   training_backend="torch", density=0.5, kp=2, batch_size=8, train_memory_mb=256)
    with pytest.raises(ConfigError, match="'bare-board' has no \\[emulation\\]"):
        plan_fleet([bare], EmulationConfig())


def test_tbf_settings_hold_a_tick_and_a_segment() -> None:
    args = tbf_args(5000)
    assert args[:2] == ["rate", "5000kbit"] and int(args[3]) >= 32 * 1024 and args[4:] == ["latency", "200ms"]
    assert int(tbf_args(1_000_000)[3]) == 1_000_000 * 1000 // 8 // 100  # 10 ms of a fast link


def test_the_same_seed_gives_the_same_trace() -> None:
    cfg = EmulationConfig(day_s=240, horizon_s=2000)
    a = availability_trace(7, 3, "diurnal", cfg)
    assert a == availability_trace(7, 3, "diurnal", cfg)
    assert a != availability_trace(8, 3, "diurnal", cfg)
    assert a != availability_trace(7, 4, "diurnal", cfg)
    assert a[0][0] == 0.0  # every device enrols at the start
    assert all(s < e for s, e in a) and all(e1 < s2 for (_, e1), (s2, _) in itertools.pairwise(a))
    assert all(e - s >= cfg.min_period_s or e == cfg.horizon_s for s, e in a)
    assert availability_trace(7, 3, "always", cfg) == [(0.0, 2000.0)]
    # the fleet's days slow down with it: at dilation 2 a day lasts twice its wall seconds
    assert availability_trace(7, 3, "diurnal", cfg, 2.0) == availability_trace(
        7, 3, "diurnal", dataclasses.replace(cfg, day_s=480))
    assert online_at(a, 0.0) and not online_at([(0.0, 5.0)], 5.0)


def test_the_diurnal_shape_is_measurable() -> None:
    """Over 300 devices and four emulated days, the share online by hour follows diurnal_probability: highest
    around the peak hour, lowest half a day later."""
    cfg = EmulationConfig(day_s=240, horizon_s=4 * 240, start_hour=0.0)
    hour_s = cfg.day_s / 24
    times = np.arange(hour_s * 6, cfg.horizon_s, hour_s / 4)  # past the first hours (everyone starts online)
    share = np.zeros(len(times))
    for i in range(300):
        trace = availability_trace(11, i, "diurnal", cfg)
        share += [online_at(trace, float(t)) for t in times]
    share /= 300
    hours = (cfg.start_hour + times / hour_s) % 24
    by_hour = np.array([share[(hours >= h) & (hours < h + 1)].mean() for h in range(24)])
    peak = DIURNAL["peak_hour"]
    night = by_hour[[int(peak + k) % 24 for k in (-1, 0, 1, 2)]].mean()
    afternoon = by_hour[[int(peak + 12 + k) % 24 for k in (-1, 0, 1, 2)]].mean()
    assert night > afternoon + 0.35, (night, afternoon)
    expected = np.array([diurnal_probability(h + 0.5) for h in range(24)])
    assert np.corrcoef(by_hour, expected)[0, 1] > 0.8


@pytest.mark.parametrize("table,match", [
    ({"speed": 1.5}, "emulation.speed must be in \\(0, 1\\]"),
    ({"speed": 0}, "emulation.speed"),
    ({"memory_mb": 0}, "emulation.memory_mb"),
    ({"uplink_kbps": 2.5}, "emulation.uplink_kbps"),
    ({"rtt_ms": -1}, "emulation.rtt_ms"),
    ({"availability": "weekends"}, "always, diurnal"),
    ({"memory_mb": 9000}, "exceeds ram_mb"),
    ({"bandwidth": 3}, "unknown \\['bandwidth'\\]"),
])
def test_emulation_fields_are_checked_on_load(table: dict, match: str) -> None:
    d = {k: getattr(get_profile("phone-mid"), k) for k in Profile.__dataclass_fields__ if k != "emulation"}
    base = {"speed": 0.5, "memory_mb": 512, "uplink_kbps": 1000, "downlink_kbps": 4000, "rtt_ms": 40}
    with pytest.raises(ConfigError, match=match):
        Profile.from_dict({**d, "name": "x", "emulation": {**base, **table}}, "x.toml")
    with pytest.raises(ConfigError, match="missing \\['rtt_ms'\\]"):
        Emulation.from_dict({k: v for k, v in base.items() if k != "rtt_ms"}, "x.toml")


def test_every_shipped_profile_can_be_emulated() -> None:
    for name in ("phone-low", "phone-mid", "phone-high", "raspberry-pi-4", "raspberry-pi-5", "jetson-nano",
                 "jetson-orin-nano"):
        e = get_profile(name).emulation
        assert e is not None and 0 < e.speed <= 1, name
    assert get_profile("phone-low").emulation.availability == "diurnal"  # type: ignore[union-attr]


def test_unknown_profile_names_list_the_valid_ones() -> None:
    from device_profiles import register_fleet

    with pytest.raises(ConfigError, match=r"valid profiles: .*phone-mid.*raspberry-pi-4"):
        register_fleet(Fleet("emu-bad", "", (FleetMember("raspberry-pi-9", 1),)))


def test_the_command_line_parses() -> None:
    args = build_parser().parse_args(["emulate", "--fleet", "mixed", "--devices", "24", "--rounds", "3", "--seed",
                                      "4", "--out", "runs/x", "--dilation", "6", "--availability", "always"])
    assert (args.devices, args.rounds, args.seed, args.dilation, args.availability) == (24, 3, 4, 6.0, "always")
    assert args.func.__name__ == "_cmd_emulate"


def test_without_root_or_cgroup_v1_the_error_names_what_is_missing(monkeypatch: pytest.MonkeyPatch,
                                                                   tmp_path: Path) -> None:
    monkeypatch.setattr(emulator_kernel.os, "geteuid", lambda: 1000)
    monkeypatch.setattr(emulator_kernel, "CGROUPS", tmp_path)  # an empty hierarchy: a cgroup v2-only machine
    with pytest.raises(emulator_kernel.EmulationUnavailable) as e:
        emulator_kernel.require_kernel()
    text = str(e.value)
    assert "root" in text and "cgroup v1 cpu controller" in text and "cgroup v1 memory controller" in text


def _echo_server() -> tuple[socket.socket, int]:
    srv = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        conn, _ = srv.accept()
        with conn:
            while data := conn.recv(65536):
                conn.sendall(data)

    threading.Thread(target=serve, daemon=True).start()
    return srv, srv.getsockname()[1]


def _round_trip(port: int, n: int = 5) -> float:
    with socket.create_connection(("127.0.0.1", port), timeout=30) as c:
        c.sendall(b"x")  # the first exchange opens the relay's upstream connection
        c.recv(1)
        t = time.perf_counter()
        for _ in range(n):
            c.sendall(b"ping")
            got = b""
            while len(got) < 4:
                got += c.recv(4 - len(got))
        return (time.perf_counter() - t) / n


@pytest.mark.parametrize("delay", [0.0, 0.05])
def test_the_relay_adds_the_peers_delay_each_way(delay: float) -> None:
    srv, target = _echo_server()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    relay = DelayRelay([Route("127.0.0.1", port, "127.0.0.1", target)], lambda peer: delay)
    relay.start()
    try:
        rtt = _round_trip(port)
    finally:
        relay.close()
        srv.close()
    assert rtt >= 2 * delay
    assert rtt < 2 * delay + 0.05, rtt  # generous for a busy machine
    assert relay.stats.connections == 1 and relay.stats.bytes["up"] == relay.stats.bytes["down"] == 21


def test_the_relay_refuses_to_start_on_a_taken_port() -> None:
    with socket.create_server(("127.0.0.1", 0)) as taken:
        relay = DelayRelay([Route("127.0.0.1", taken.getsockname()[1], "127.0.0.1", 9)], lambda peer: 0.0)
        with pytest.raises(PflEdgeError, match="cannot listen"):
            relay.start()
    assert not relay._thread.is_alive()  # its loop stopped with it
