"""A device acts only on the server's word: a forged task (naming a base that does not exist) or a forged
"finished" on its broker moves or ends nothing, and its real tasks still run; a model it receives with NaN in it
makes it report and sit that round out, then go on with the next one. Agents run in threads against a real
server (in-process, embedded broker), two devices of a tiny FedPer federation."""

from __future__ import annotations

import hashlib
import json
import queue
import struct
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, cast

import httpx
import pytest

from edge_runtime.agent import Agent, AgentConfig
from edge_runtime.http import Http
from edge_runtime.tasks import Downloads, UnusableModel, mismatch
from pfl_edge.checkpoint import ModelSpec, build_model
from pfl_edge.codec import decode, encode
from pfl_edge.federation import model_id
from pfl_edge.protocol import Task, round_topic, task_topic
from server.launch import BackgroundServer, start_background
from server.settings import Settings

SECRET = "enrol-secret-tasks"
CONFIG: dict[str, Any] = dict(algorithm="fedper", kp=2, clients=2, rounds=2, dataset="synthetic",
                              partition="pathological:2", samples_per_client=48, test_per_client=32,
                              local_epochs=1, batch_size=16, lr=0.05, workers=1, seed=3)
FORGED = "f" * 64


@pytest.fixture
def srv(tmp_path: Path) -> Iterator[BackgroundServer]:
    s = start_background(Settings(data_dir=tmp_path / "data", database_url=f"sqlite:///{tmp_path / 'state.db'}",
                                  admin_token="admin-token-task-checks", tick_s=0.05))  # type: ignore[arg-type]
    yield s
    s.stop()


def _create(srv: BackgroundServer, **options: Any) -> None:
    r = httpx.post(f"{srv.url}/v1/federations", headers={"Authorization": f"Bearer {srv.admin_token}"},
                   json={"id": "tc", "enrol_secret": SECRET, "config": CONFIG, **options}, timeout=30)
    assert r.status_code == 201, r.text


class _Run:
    """An agent in a thread, its events and its exit."""

    def __init__(self, srv: BackgroundServer, root: Path, slot: int,
                 inbox: queue.Queue[tuple[str, bytes]] | None = None, **cfg: Any) -> None:
        self.events: list[tuple[str, dict[str, Any]]] = []
        self.agent = Agent(AgentConfig(server=srv.url, federation="tc", enrol_secret=SECRET, profile="phone-mid",
                                       state_dir=str(root / f"dev{slot}"), partition_id=slot, threads=1,
                                       training_backend="torch", patience_s=30, **cfg),
                           on_event=lambda kind, data: self.events.append((kind, dict(data))))
        if inbox is not None:
            self.agent.inbox = inbox
        self.rc: int | BaseException | None = None
        self.thread = threading.Thread(target=self._main, daemon=True)
        self.thread.start()

    def _main(self) -> None:
        try:
            self.rc = self.agent.run()
        except BaseException as e:  # the test reports it
            self.rc = e

    def kinds(self) -> list[str]:
        return [k for k, _ in self.events]

    def wait(self, cond: Callable[[], bool], timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while not cond():
            assert self.rc is None or self.rc == 0, f"agent stopped: {self.rc!r}"
            assert time.monotonic() < deadline, f"timed out; events {self.kinds()}"
            time.sleep(0.05)


def _forged_task(t: int) -> bytes:
    return json.dumps({"federation": "tc", "round": t, "algorithm": "fedper", "base": FORGED,
                       "deadline": time.time() + 60}).encode()


def test_forged_task_and_finished_move_nothing_and_real_tasks_run(srv: BackgroundServer, tmp_path: Path) -> None:
    _create(srv)
    a = _Run(srv, tmp_path, 0)  # alone: round 1 waits for the second device
    a.wait(lambda: hasattr(a.agent, "downloads"))
    dev = a.agent.enr.device_id
    a.agent.inbox.put((task_topic("tc", dev), _forged_task(1)))
    a.agent.inbox.put((round_topic("tc"), json.dumps({"federation": "tc", "round": 2, "state": "finished"}).encode()))
    # a third forged task, after the "finished": the inbox is handled in order, so once its mismatch is logged the
    # "finished" has been acted on too
    a.agent.inbox.put((task_topic("tc", dev), _forged_task(3)))
    a.wait(lambda: any(k == "task_mismatch" and d.get("round") == 3 for k, d in a.events))
    assert a.thread.is_alive() and not a.agent.done and a.rc is None  # the forged "finished" ended nothing
    assert "task" not in a.kinds() and a.agent.store.progress.round == 0  # the forged task ran nothing
    b = _Run(srv, tmp_path, 1)
    for r in (a, b):
        r.thread.join(120)
        assert r.rc == 0, r.rc
        assert [d["round"] for k, d in r.events if k == "update"] == [1, 2]
        assert "final" in r.kinds()
    assert a.agent.store.progress.final


class _Deaf(queue.Queue[tuple[str, bytes]]):
    """An inbox that loses every message the broker's thread brings (its bells, its tasks): only what the
    agent's own thread puts in arrives."""

    def __init__(self) -> None:
        super().__init__()
        self.lost = 0

    def put(self, item: tuple[str, bytes], block: bool = True, timeout: float | None = None) -> None:
        if threading.current_thread().name.startswith("paho"):
            self.lost += 1
            return
        super().put(item, block, timeout)


def test_a_device_that_hears_nothing_from_its_broker_asks_the_server(srv: BackgroundServer, tmp_path: Path) -> None:
    """Every bell and task the broker brings is lost (a link renewed mid-publish, a broker that dropped its
    queue): after ``ask_every_s`` of quiet each device asks the server, and the federation runs to its end."""
    _create(srv)
    runs = [_Run(srv, tmp_path, slot, _Deaf(), ask_every_s=0.2) for slot in (0, 1)]
    for r in runs:
        r.thread.join(180)
        assert r.rc == 0, (r.rc, r.kinds())
        assert [d["round"] for k, d in r.events if k == "update"] == [1, 2]
        assert "final" in r.kinds()
    assert sum(cast(_Deaf, r.agent.inbox).lost for r in runs) > 0  # the broker did ring, and was not heard


def _nan_payload(payload: bytes) -> bytes:
    """``payload`` with its first float set to NaN (a valid sha256 trailer: only the NaN check can refuse it)."""
    body = bytearray(payload[:-32])
    head_len = struct.unpack_from("<I", body, 5)[0]
    struct.pack_into("<f", body, 9 + head_len, float("nan"))
    return bytes(body) + hashlib.sha256(body).digest()


def _huge_payload(payload: bytes) -> bytes:
    """``payload`` with every float scaled to ~1e30: finite (it decodes), but training on it diverges."""
    d = decode(payload)
    return encode({k: v * 1e30 if v.is_floating_point() else v for k, v in d.tensors.items()}, model_id=d.model_id,
                  round=d.round)


@pytest.mark.parametrize(("poison", "kind"), [(_nan_payload, "bad_model"), (_huge_payload, "diverged")])
def test_a_bad_model_received_skips_the_round_and_the_next_one_runs(srv: BackgroundServer, tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch,
                                                                    poison: Callable[[bytes], bytes],
                                                                    kind: str) -> None:
    """NaN in the base: refused on receipt; a finite base of 1e30: training diverges. Either way the device logs,
    reports and sits round 1 out (keeping its last good model), and takes part in round 2."""
    _create(srv, deadline_s=5.0)  # round 1 closes at its deadline with the other device's update
    real_fetch = Downloads.fetch
    poisoned: list[str] = []

    def fetch(self: Downloads, digest: str) -> bytes:
        data = real_fetch(self, digest)
        if self.device_id == first[0] and not poisoned and getattr(self, "_in_round", False):
            poisoned.append(digest)
            return poison(data)
        return data

    real_received = Downloads.received

    def received(self: Downloads, task: Task) -> Any:
        self._in_round = not task.final  # type: ignore[attr-defined]
        return real_received(self, task)

    first: list[str] = [""]
    monkeypatch.setattr(Downloads, "fetch", fetch)
    monkeypatch.setattr(Downloads, "received", received)
    a = _Run(srv, tmp_path, 0)
    a.wait(lambda: getattr(a.agent, "enr", None) is not None)
    first[0] = a.agent.enr.device_id
    b = _Run(srv, tmp_path, 1)
    for r in (a, b):
        r.thread.join(120)
        assert r.rc == 0, r.rc
    assert poisoned, "the poisoned fetch never happened"
    bad = [d for k, d in a.events if k == kind]
    assert [d["round"] for d in bad] == [1] and "NaN" in bad[0]["error"]
    assert [d["round"] for k, d in a.events if k == "update"] == [2]  # sat round 1 out, took part in round 2
    assert [d["round"] for k, d in b.events if k == "update"] == [1, 2]
    assert "final" in a.kinds()


def test_downloads_refuse_nan_and_mismatch_logs_only_forgeries() -> None:
    spec = ModelSpec("cnn", 10, 1, 28)
    model = build_model(spec)
    good = {k: v.clone() for k, v in model.state_dict().items()}
    dl = Downloads(Http("http://127.0.0.1:9", 1.0), "dev-x", {k: tuple(v.shape) for k, v in model.state_dict().items()},
                   model_id(spec), 1 << 26)
    payload = encode(good, model_id=model_id(spec), round=1)
    assert set(dl.decode(payload).tensors) == set(good)
    with pytest.raises(UnusableModel, match="NaN"):
        dl.decode(_nan_payload(payload))
    real = Task(federation="tc", round=3, algorithm="fedper", base="a" * 64, deadline=0.0)
    assert mismatch(real, real) is None
    assert mismatch(real.model_copy(update={"round": 2}), real) is None  # stale, not forged
    assert "base" in str(mismatch(real.model_copy(update={"base": FORGED}), real))
    assert "no task" in str(mismatch(real, None))


def test_only_drawn_devices_ask_on_a_sampled_rounds_bell() -> None:
    """A sampled round's announcement makes exactly the devices the simulator's draw picks ask the server for a
    task (``sample_participants``); a (re)connect's empty bell, an unreadable one, a finished federation, an
    unsampled federation and a device's own task topic always make it ask."""
    from types import SimpleNamespace

    from pfl_edge.algorithms import get_algorithm
    from pfl_edge.algorithms.participants import sampled_slots
    from pfl_edge.federation import FederationConfig
    from pfl_edge.protocol import RoundAnnouncement
    from pfl_edge.sim import build_context, sample_participants

    def asks(cfg: FederationConfig, slot: int, batch: list[tuple[str, bytes]]) -> bool:
        woke: list[Task | None] = []
        algo = get_algorithm(cfg, build_model(build_context(cfg)[1]), cfg.kp)
        dev = SimpleNamespace(algo=algo, enr=SimpleNamespace(federation="tc", device_id=f"d{slot}", index=slot),
                              _wake=woke.append)
        dev._not_drawn = lambda p: Agent._not_drawn(dev, p)  # type: ignore[arg-type]
        Agent._handle(dev, batch)  # type: ignore[arg-type]
        return bool(woke)

    def bell(t: int, state: str = "collecting") -> tuple[str, bytes]:
        return round_topic("tc"), RoundAnnouncement(federation="tc", round=t, state=state).model_dump_json().encode()  # type: ignore[arg-type]

    cfg = FederationConfig.from_dict({**CONFIG, "clients": 10, "participation": 0.3})
    for t in (1, 2, 3):
        drawn = set(sample_participants(cfg.seed, t, 10, 0.3).tolist())
        assert {i for i in range(10) if asks(cfg, i, [bell(t)])} == drawn and len(drawn) == 3
        idle = next(i for i in range(10) if i not in drawn)
        assert asks(cfg, idle, [bell(t, "finished")]) and asks(cfg, idle, [(round_topic("tc"), b"")])
        assert asks(cfg, idle, [(round_topic("tc"), b"{not json")])
        assert asks(cfg, idle, [bell(t), (task_topic("tc", f"d{idle}"), b"{}")])  # its own task topic rang
    everyone = FederationConfig.from_dict(CONFIG)
    assert asks(everyone, 1, [bell(1)]) and asks(everyone, 0, [bell(2)])
    # a private federation's draw is the server's secret (docs/privacy.md): every device asks on every bell, none
    # computes a draw from the config (the seed's would not be the server's)
    private = cfg.replace(privacy={"clip": 1.0, "noise_multiplier": 1.0, "delta": 1e-3})
    assert all(asks(private, i, [bell(t)]) for t in (1, 2) for i in range(10))
    public = cfg.replace(privacy={"clip": 1.0, "noise_multiplier": 1.0, "delta": 1e-3, "secret_noise": False})
    assert {i for i in range(10) if asks(public, i, [bell(1)])} == sampled_slots(cfg.seed, 1, 10, 0.3, True)
