"""``pfl-edge emulate``: the demo's federation (edge_runtime.fleet) on an emulated fleet. Each device process is
held by the kernel to its class's profile (edge_runtime.emulator_kernel: CPU quota, memory limit, shaped links in
its own network namespace), its round trip added by a relay on the bridge (edge_runtime.delay_relay), and it
comes and goes on its seeded availability trace (edge_runtime.emulation_plan): a device that leaves is killed
(SIGKILL, mid-round if it was training) and, when it returns, started again on its same state dir, from which it
resumes as after any crash. The run folder is the demo's, plus emulation.json (the plan) and availability.json
(every trace and what happened). docs/emulation.md says what each limit does and what is not emulated."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from device_profiles import get_fleet
from pfl_edge.errors import ConfigError

from .delay_relay import DelayRelay, Route
from .emulation_plan import (
    AVAILABILITY_STREAM,
    EmulationConfig,
    FleetPlan,
    availability_trace,
    online_at,
    plan_fleet,
)
from .emulator_kernel import Kernel, reap_stale, require_kernel
from .fleet import DemoConfig, Federation, Placement, free_port, run_demo, start_server

if TYPE_CHECKING:
    from device_profiles import Profile

__all__ = ["Emulation", "run_emulation"]


class Emulation(Placement):
    """The demo's placement, emulated: the server reached through the relay, every device in its limits, each
    device on its trace. ``events``: who left and came back when (seconds from the start)."""

    def __init__(self, plan: FleetPlan, kernel: Kernel, traces: list[list[tuple[float, float]]]) -> None:
        self.plan, self.kernel, self.traces = plan, kernel, traces
        self.relay: DelayRelay | None = None
        self.events: list[dict[str, Any]] = []
        self.away: set[int] = set()
        self.done: set[int] = set()
        self._names: list[str] = []
        self._extra: list[str] = []

    def start_server(self, out: Path, cfg: DemoConfig) -> Federation:
        """The server on loopback, as in the demo; devices reach it (HTTP and the embedded broker) at the same
        ports on the bridge's address, through the relay that adds each one's delay."""
        if cfg.broker_url != "embedded":
            raise ConfigError("pfl-edge emulate runs the embedded broker (the relay forwards its port)")
        port, bport = free_port(), free_port()
        ip = self.kernel.bridge_ip
        delays = {self.kernel.device_ip(d.index): d.delay_s for d in self.plan.devices}
        self.relay = DelayRelay([Route(ip, port, "127.0.0.1", port), Route(ip, bport, "127.0.0.1", bport)],
                                lambda peer: delays.get(peer, 0.0))
        self.relay.start()
        env = {"PFL_PUBLIC_BROKER_URL": f"mqtt://{ip}:{bport}", "PFL_EMBEDDED_BROKER_PORT": str(bport)}
        fed = start_server(out, database_url=cfg.database_url, port=port, env=env, device_url=f"http://{ip}:{port}")
        self.kernel.note_process(fed.server.pid)
        return fed

    def start_devices(self, fed: Federation, profiles: list[Profile], extra: list[str]) -> None:
        self._names, self._extra = [p.name for p in profiles], extra
        for i, name in enumerate(self._names):  # every trace starts online: the fleet enrols as it is deployed
            fed.start_device(i, name, extra=extra, launcher=self.kernel.wrap)

    def tick(self, fed: Federation, elapsed_s: float, finished: bool) -> set[int]:
        """Apply the traces at ``elapsed_s``: kill who should be away, restart who is back (on its state dir)."""
        if finished:
            return set(self.away)
        for i, p in enumerate(fed.devices):
            if i in self.done:
                continue
            running = p.poll() is None
            if not running and i not in self.away:
                if p.returncode == 0:
                    self.done.add(i)  # it finished its federation
                continue  # a failure: the demo's follow loop reports it
            on = online_at(self.traces[i], elapsed_s)
            if running and not on:
                p.kill()
                p.wait()
                self.away.add(i)
                self.events.append({"t": round(elapsed_s, 2), "device": i, "event": "left"})
            elif not running and on:
                fed.start_device(i, self._names[i], extra=self._extra, launcher=self.kernel.wrap)
                self.away.discard(i)
                self.events.append({"t": round(elapsed_s, 2), "device": i, "event": "returned"})
        return set(self.away)

    def close(self) -> None:
        if self.relay is not None:
            self.relay.close()


def _write(out: Path, plan: FleetPlan, ecfg: EmulationConfig, kernel: Kernel, seed: int,
           traces: list[list[tuple[float, float]]], events: list[dict[str, Any]]) -> None:
    settings = {**plan.as_json(ecfg), "bridge_ip": kernel.bridge_ip, "run_id": kernel.id,
                "device_ips": [kernel.device_ip(d.index) for d in plan.devices]}
    (out / "emulation.json").write_text(json.dumps(settings, indent=1))
    (out / "availability.json").write_text(json.dumps({
        "seed": seed, "stream": AVAILABILITY_STREAM, "day_s": ecfg.day_s,
        "wall_day_s": ecfg.day_s * plan.dilation, "start_hour": ecfg.start_hour,
        "horizon_s": ecfg.horizon_s, "events": events,
        "devices": [{"index": d.index, "profile": d.profile, "availability": d.availability,
                     "online": [[round(a, 3), round(b, 3)] for a, b in traces[d.index]]} for d in plan.devices],
    }, indent=1))


def run_emulation(cfg: DemoConfig, ecfg: EmulationConfig, *, host_cores: int | None = None) -> dict[str, Any]:
    """Run ``cfg``'s federation on its fleet, emulated; everything made is undone on exit, error or Ctrl-C.
    Returns the demo's summary with the emulation's settings."""
    profiles = get_fleet(cfg.fleet).assign(cfg.devices)
    plan = plan_fleet(profiles, ecfg, host_cores)  # a profile without [emulation] fails here, before root checks
    require_kernel()
    for stale in reap_stale():
        print(f"undid emulation run {stale}'s leftovers (its process is gone)", flush=True)
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    traces = [availability_trace(cfg.seed, d.index, d.availability, ecfg, plan.dilation) for d in plan.devices]
    kernel = Kernel(plan)
    emu = Emulation(plan, kernel, traces)
    _write(out, plan, ecfg, kernel, cfg.seed, traces, [])
    print(f"emulating {cfg.devices} devices of fleet {cfg.fleet!r} at dilation {plan.dilation:.2f} (quotas add "
          f"up to {sum(d.cpu_fraction for d in plan.devices):.2f} of {plan.host_cores} cores); run {kernel.id}, "
          f"bridge {kernel.bridge_ip}", flush=True)
    t0 = time.monotonic()
    try:
        kernel.setup()
        summary = run_demo(cfg, emu)
    finally:
        emu.close()
        kernel.teardown()
        _write(out, plan, ecfg, kernel, cfg.seed, traces, emu.events)
    summary["emulation"] = {"dilation": plan.dilation, "events": len(emu.events),
                            "wall_s": time.monotonic() - t0}
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary
